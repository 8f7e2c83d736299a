"""The earlier home of devbroker.broker.procmem (process memory and fds of a caller, by pid):
the same functions, for the front ends that import them from here."""
from __future__ import annotations

from devbroker.broker.procmem import (  # noqa: F401  (re-exported)
    MAX_TRANSFER, pidfd_getfd, vm_read, vm_write, vm_write_many,
)
