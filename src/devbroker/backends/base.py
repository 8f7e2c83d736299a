"""What the broker core asks of a driver backend (emulated or real).

The broker has already decided that a call may run, translated its handles and fd
arguments, and read its nested buffer from the tenant. A backend executes exactly that call
and returns the bytes the driver would have written back. It knows nothing of tenants.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from devbroker.abi.nodes import NodeKind
from devbroker.backends.checkpoint import NOT_SUPPORTED, Checkpointer


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


class GpuInfo(Protocol):
    """One GPU as a backend describes it (backends/emulated.EmulatedGpu, real.RealGpu)."""

    index: int  # the device minor (/dev/nvidia<index>), the policy's GPU number
    name: str
    uuid: str
    pci_bus_id: str
    memory_bytes: int

    @property
    def gpu_id(self) -> int:
        """The driver's GPU id (GET_ATTACHED_IDS, ATTACH_IDS, ...)."""
        ...


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
    """What the broker asks of a backend. The capability attributes below say what this
    backend offers; code above asks them instead of the backend's name, so a new backend
    says what it is in one place (tests/test_backend_caps.py holds each class to them)."""

    name: str  # for people (logs, audit, snapshots) and to rebuild it after an upgrade
    version: str  # the driver version this backend speaks by default

    # -- capabilities (class attributes: fixed for the backend's kind)
    # The tenant's /proc/driver/nvidia is built from the host's (procview.HOST_PROC): there
    # is a real driver whose files to show, filtered; else it is made up from gpus().
    host_proc: bool
    # open(node, minor, tenant_file=True, flags=...) gives real driver files that live in
    # the tenant (backends/tenantfile.py, the seccomp front end); without it every file is
    # the backend's and each call is relayed.
    tenant_files: bool
    # The driver's own process list (GET_PIDS) names the tenants' processes. Not so through
    # a relay: the real driver credits every relayed object to the relay process, so the
    # broker answers from its own books.
    reports_tenant_pids: bool
    # The driver keeps its own per-process account of device memory (process_vidmem), which
    # the broker's quota watch compares with quotas to catch a racing thread's allocation
    # (broker/quotawatch.py).
    counts_process_memory: bool
    # How a live upgrade carries this backend's state: "emulated" (its books as JSON,
    # broker/handover.py), "real" (backends/realhandover.py: the relay's channels as fds),
    # None where it cannot be handed over.
    handover_format: str | None

    # The host's memory block size (what SYS_PARAMS sets once per boot), None where unknown:
    # a tenant asking for another value is refused (broker/handlers.sys_params).
    memblock_size: int | None
    # A counter, not a capability: the control lane's calls run on the broker's own
    # duplicates of relayed files (the real backend, from FUSE readers); 0 without any.
    relayed_here: int
    # Moves a process's GPU state to host memory and back (backends/checkpoint.py; the
    # broker's preemption, docs/preemption.md). A backend without a checkpoint API keeps
    # the default, which refuses every operation with the reason.
    checkpointer: Checkpointer = NOT_SUPPORTED

    def gpus(self) -> "list[GpuInfo]": ...

    def gpu_index_of_instance(self, instance: int) -> int | None:
        """The GPU (minor) an RM device instance (NV0080 deviceId) names, None for none:
        the driver numbers instances at attach time, not as minors."""
        ...

    def memory_in_use(self) -> dict[int, int] | None:
        """Device memory the backend itself counts as taken (GPU index -> bytes), for the
        metrics; None where it does not count (a real driver: see process_vidmem)."""
        ...

    def prepare_tenant_files(self) -> None:
        """Called once at start on the broker's main thread, which may still mount: make
        what tenant files need (nothing where tenant_files is False)."""
        ...

    def stop(self) -> None:
        """Release what the backend holds outside this process's memory (relay process,
        threads, mounts); not called when a successor took it over."""
        ...

    def open(self, node: NodeKind, minor: int) -> DriverFile: ...

    def after_open_answered(self, later: bool = False) -> bool:
        """Work an open of a tenant file leaves for after the tenant has its answer (the
        real backend's spare device nodes, tenantfile.PrivateNodes.tidy); nothing by
        default. later=True: the front end will call `quiet_work` when it is quiet, and the
        work may wait for then (True: some did)."""
        return False

    def quiet_work(self) -> None:
        """The work `after_open_answered` kept for a quiet moment."""

    def close(self, file: DriverFile) -> None: ...

    async def ioctl(self, file: DriverFile, call: DriverCall) -> DriverResult: ...

    def ioctl_blocking(self, file: DriverFile, call: DriverCall) -> DriverResult:
        """Run the call on the calling thread (a seccomp listener's: broker/effects.py), or
        raise NotHere for a file it can only serve the trio way (a relayed file)."""
        ...

    def can_run_control(self, file: DriverFile) -> bool:
        """Whether run_control can run a control on this file here (the control lane asks
        before it takes anything of the tenant's, such as a rate-limit token)."""
        ...

    def control_is_plain_ioctl(self, file: DriverFile) -> bool:
        """Whether run_control on this file is exactly one ioctl(fd, header.ioctl_cmd, the
        private header with its params pointer naming the private block) on the broker's
        duplicate of the tenant's file, on a thread without the driver-checked
        capabilities: then a native loop (frontends/nativelane.py) may make that call
        itself. False where the backend answers some other way (the emulator, a relay)."""
        return False

    def run_control(self, file: DriverFile, fd: int, hdr: bytes, params: bytearray,
                    header: Any, abi: Any) -> tuple[int, int, bytes]:
        """One RM_CONTROL (or RM_ALLOC: the allocation lane) the broker admitted unchanged
        (broker/fastlane.py), from private copies: `hdr` the NVOS54 (NVOS64/NVOS21) header as
        the tenant sent it, `params` its parameter block (answered in place). `fd` is the broker's duplicate of the tenant's file where the
        file lives in the tenant (-1 else); `header` the layout (fastlane.Header), `abi` the caller's. Returns
        (ioctl return value, errno, the header as the driver left it, with the tenant's
        params pointer); on the calling thread, like ioctl_blocking (NotHere where it
        cannot)."""
        ...

    # Only where counts_process_memory:
    # `process_vidmem(tgid) -> dict[int, int]`: the driver's account of tgid's device memory
    # (GPU index -> bytes); `process_vidmem_many(tgids) -> {tgid: {GPU index: bytes}}`: the
    # same for several processes in one read (thread-safe: the quota watch's worker thread).

    def map_read(self, file: DriverFile, offset: int, length: int) -> bytes: ...
