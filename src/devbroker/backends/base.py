"""What the broker core asks of a driver backend (emulated or real).

The broker has already decided that a call may run, translated its handles and fd
arguments, and read its nested buffer from the tenant. A backend executes exactly that call
and returns the bytes the driver would have written back. It knows nothing of tenants.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from devbroker.abi.nodes import NodeKind


class PciLocation:
    """Domain/bus/slot/function of a GPU, from its `pci_bus_id` ("0000:00:06.0")."""

    pci_bus_id: str

    @property
    def domain(self) -> int:
        return int(self.pci_bus_id.split(":")[0], 16)

    @property
    def bus(self) -> int:
        return int(self.pci_bus_id.split(":")[1], 16)

    @property
    def slot(self) -> int:
        return int(self.pci_bus_id.split(":")[2].split(".")[0], 16)

    @property
    def function(self) -> int:
        return int(self.pci_bus_id.split(".")[1], 16)


class DriverFile(Protocol):
    """An open file of the backend's driver (opaque to the broker)."""

    node: NodeKind
    minor: int


@dataclass
class DriverCall:
    call: Any  # devbroker.abi IoctlCall, already translated by the broker
    nested: bytes | None = None  # the nested buffer (RM_CONTROL params, RM_ALLOC params, XFER)
    # fd arguments, translated: field name (e.g. "fd", "ctl_fd") -> the backend's DriverFile
    fd_files: dict[str, Any] = field(default_factory=dict)
    abi: Any = None  # the DriverABI the call was decoded with (the client's version)
    tgid: int = 0  # the calling process (the emulator reports it in GET_PIDS)
    # Buffers that nested parameters point to ("embedded pointers", e.g. the strings of
    # SYSTEM_GET_BUILD_VERSION): field name -> the bytes read from the tenant. A backend
    # updates them in place (bytearray); the broker writes them back after the call.
    embedded: dict[str, bytearray] = field(default_factory=dict)
    # Files that live in the tenant (backends/tenantfile.py): the broker's duplicate of the
    # tenant's file the call is made on, and of each file an fd field names (field -> fd).
    # Numbers in the broker's own fd table, valid for this call only.
    file_fd: int | None = None
    fds: dict[str, int] = field(default_factory=dict)
    # fds inside the nested parameters (EXPORT/IMPORT_OBJECTS_TO/FROM_FD): byte offset ->
    # (the tenant's fd number, the session file it was checked to be). For files that live
    # in the tenant the broker writes its duplicate's number there; other backends find the
    # file in fd_files ("params.<field>").
    nested_fds: dict[int, tuple[int, Any]] = field(default_factory=dict)


@dataclass
class DriverResult:
    arg: bytes  # the top-level argument after the call
    nested: bytes | None = None  # the nested buffer after the call
    result: int = 0  # ioctl(2) return value
    errno: int = 0  # non-zero: the ioctl failed with this errno


class NotHere(Exception):
    """This work cannot be done on the calling thread (broker/effects.py): a backend's
    ioctl_blocking raises it for a file it serves only the trio way."""


class Backend(Protocol):
    name: str
    version: str  # the driver version this backend speaks by default

    def gpus(self) -> list[Any]: ...

    def open(self, node: NodeKind, minor: int) -> DriverFile: ...

    def close(self, file: DriverFile) -> None: ...

    async def ioctl(self, file: DriverFile, call: DriverCall) -> DriverResult: ...

    # Optional: `ioctl_blocking(file, call) -> DriverResult` runs the call on the calling
    # thread (a seccomp listener's: broker/effects.py), or raises effects.NotHere for a file
    # it can only serve the trio way (a relayed file). Backends without it are always
    # awaited on the trio thread.

    def map_read(self, file: DriverFile, offset: int, length: int) -> bytes: ...
