"""What an attack reports (escape/attacks.py, escape/races.py): refused, escaped, or error.

- ``refused``: every attempt was refused; ``got`` is the errno / NV_STATUS name seen;
- ``escaped``: at least one attempt succeeded where it must not have (``detail`` says which);
- ``error``: the attack could not be carried out (a harness bug, never counted as refused).
"""
from __future__ import annotations

import errno
from dataclasses import dataclass


@dataclass
class Outcome:
    result: str  # "refused" | "escaped" | "error"
    got: str = ""  # errno / NV_STATUS name(s) seen
    detail: str = ""
    # Refused by the kernel before anything reached the broker (so no audit record is due):
    # e.g. userfaultfd for a tenant without CAP_SYS_PTRACE.
    by_kernel: bool = False

    def to_dict(self) -> dict[str, str | bool]:
        out: dict[str, str | bool] = {"result": self.result, "got": self.got, "detail": self.detail}
        if self.by_kernel:
            out["by_kernel"] = True
        return out


def refused(got: str, detail: str = "") -> Outcome:
    return Outcome("refused", got, detail)


def escaped(detail: str, got: str = "success") -> Outcome:
    return Outcome("escaped", got, detail)


def ename(e: int) -> str:
    """An errno's name (EACCES), or its number when it has none."""
    return errno.errorcode.get(e, str(e))
