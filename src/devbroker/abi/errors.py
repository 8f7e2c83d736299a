"""Errors raised by the ABI decoders.

Every decoder failure is a DecodeError that names *where* (byte offset into the buffer that
was being decoded) and *what* (the field, dotted for nested structs), so that a broker can log
a precise reason and deny the call instead of crashing on an IndexError from deep inside.
"""
from __future__ import annotations


class DecodeError(ValueError):
    def __init__(self, offset: int, field: str, reason: str):
        self.offset = offset
        self.field = field
        self.reason = reason
        super().__init__(f"at offset {offset} ({field}): {reason}")

    # keep pickling (multiprocessing, hypothesis) working
    def __reduce__(self) -> tuple[type[DecodeError], tuple[int, str, str]]:
        return (type(self), (self.offset, self.field, self.reason))


class UnknownVersion(LookupError):
    """registry.get() was asked for a driver version it has no table for."""
