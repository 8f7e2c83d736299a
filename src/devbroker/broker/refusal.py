"""Refusal: a decision to refuse a call, raised by the core, its handlers and the rewrite hooks."""
from __future__ import annotations

import errno


class Refusal(Exception):
    """A decision to refuse a call; carries both the errno and the driver status forms."""

    def __init__(self, reason: str, *, errno_: int = errno.EPERM, status: int | None = None,
                 what: str = ""):
        super().__init__(reason)
        self.reason = reason
        self.errno = errno_
        self.status = status
        self.what = what
