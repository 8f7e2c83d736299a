"""What a test's (or benchmark's) tenant program needs from the host under /tmp.

`devbroker exec` gives every tenant a /tmp of its own, so a checkout (its .venv, its src on
PYTHONPATH) that lies under the host's /tmp is not in a tenant's view. Harnesses that run
the project's own Python inside tenants bind those paths back in, read-only, at the same
place; anywhere else they are visible (read-only) already, and nothing is added.

    argv = ["devbroker", "exec", "--tenant", t, *bind_args(), "--", sys.executable, ...]
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]  # src/devbroker/testing -> the checkout


def _under_tmp(p: str) -> bool:
    return p == "/tmp" or p.startswith("/tmp/")


def paths() -> list[str]:
    """The outermost of: the checkout, the interpreter's environment (a venv), the
    interpreter itself — those under /tmp."""
    cands = {os.path.realpath(p) for p in (REPO, sys.prefix, os.path.dirname(sys.executable))}
    cands |= {os.path.abspath(p) for p in (REPO, sys.prefix, os.path.dirname(sys.executable))}
    under = sorted(p for p in cands if _under_tmp(p) and os.path.exists(p))
    out: list[str] = []
    for p in under:  # sorted: a parent comes before what is inside it
        if not any(p == o or p.startswith(o + "/") for o in out):
            out.append(p)
    return out


def bind_args() -> list[str]:
    return [a for p in paths() for a in ("--bind", p)]
