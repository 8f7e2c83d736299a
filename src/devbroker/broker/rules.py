"""Every call a tenant may make, as one rule table per kind of call. Anything not here is
refused and logged.

Four tables, one per kind of call, each row a frozen record that holds everything the
broker does with that call:

- ``ESCAPES`` (NVIDIA escapes, by name) and ``UVM_COMMANDS`` (nvidia-uvm commands, by name):
  `EscapeRule` -- capability, reason, the handler (a function of one `handlers.CallContext`),
  the nodes it is valid on, whether it carries the tenant's fds (the fields themselves are the
  ABI's ``fd`` roles, never listed here), an answer rewrite, and why it runs in the caller.
- ``CLASSES`` (RM classes, by number): `ClassRule` -- capability, reason, whether it is
  charged against the memory quota, and why it runs in the caller.
- ``CONTROLS`` (RM controls, by number): `ControlRule` -- capability, reason, the pre/post
  rewrite hooks (functions in rewrite.py), a broker answer and the driver's own refusal.
  (What the emulated driver answers is the emulator's own table,
  backends/emulated_controls.py: it models the driver without a broker too.)

The core (core.py) looks a call up here and runs the row's handler; the security
documentation's tables are generated from the same rows (allowdoc.py, `devbroker policy
allowlist`). `simple_control(abi, cmd)` says which control rows need no decode of their
parameters (the seccomp fast lane). Adding an allowed control with a rewrite hook and an
emulator handler is one row here plus its two functions: docs/design.md shows it.

Each entry names the capability that grants it and *why* it is safe to let through.
Capabilities are named sets a policy grants per tenant:

- ``nvml``: queries that NVML and nvidia-smi need to show a GPU (read-only, per-client).
- ``compute``: objects a CUDA context needs (memory under quota, VA spaces, channels, engines).
- ``uvm``: the UVM driver's calls CUDA makes for its address space.

``profiling``, ``debug`` and ``admin`` are deliberately absent: no tenant gets them.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from devbroker.abi import registry
from devbroker.abi import status as nvstatus
from devbroker.abi.nodes import NodeKind
from devbroker.broker import compute, handlers, preemption, rewrite, shares

NV01_DEVICE_0 = 0x80  # the device class: a parent the driver wraps channels under

CAPABILITIES = {
    "nvml": "GPU queries NVML and nvidia-smi need (names, UUIDs, memory, utilization)",
    "compute": "CUDA contexts: device memory (under quota), VA spaces, channels, engines",
    "uvm": "the UVM calls CUDA makes for its own address space",
}
DEFAULT_CAPABILITIES = ("nvml", "compute", "uvm")

RM_NODES = frozenset({NodeKind.CTL, NodeKind.GPU})
UVM_NODES = frozenset({NodeKind.UVM})


# Names of fields that hold a *client* handle, wherever they appear (top-level arguments,
# nested parameters, UVM arguments). A tenant may only name its own clients there.
CLIENT_HANDLE_FIELDS = ("hClient", "hRoot", "hClientSrc", "hClientShare", "hClientTarget",
                        "hParentClient", "hTargetClient", "hAppClient")
# Of those, the ones where 0 means "none" (a device with no target client, ...).
CLIENT_FIELDS_ZERO_OK = frozenset({"hClientShare", "hTargetClient", "hAppClient"})


@dataclass(frozen=True)
class EscapeRule:
    """An escape or UVM command a tenant may send."""
    capability: str
    reason: str
    # Runs the call: a function of one handlers.CallContext, returning an IoctlReply or a
    # generator of effects that returns one (effects.py).
    handler: Callable = handlers.relay
    nodes: frozenset = RM_NODES
    # The call names files of the tenant's by number: its ``fd`` fields (the ABI's roles, see
    # fd_fields) are checked to be the tenant's own NVIDIA files and handed to the backend as
    # those files. False: the numbers go to the driver as sent (UVM's rmCtrlFd: the UVM rows
    # run in the caller or in the emulator, neither of which reads another process's fds).
    carries_fds: bool = False
    # Rewrites the driver's answer before the tenant sees it: f(CallContext, decoded value)
    # -> value (rewrite.py).
    rewrite: Callable | None = None
    # With a driver file that lives in the tenant (seccomp front end + real backend): why
    # the driver binds this call to the calling process, so that it must run there (the
    # kernel continues it after the broker's checks). Empty: the broker executes it on its
    # own duplicate of the tenant's file with private copies of every buffer.
    in_caller: str = ""
    # For in-caller rows: why a racing tenant thread, which can rewrite the argument after
    # the broker decided (the kernel re-reads it), cannot turn the call into one the policy
    # refuses, or how the broker detects it.
    race: str = ""
    # With real driver files (seccomp front end + real backend): why the broker need not see
    # this call at all, so that the tenant's seccomp filter lets the kernel run it without a
    # notification (kernel_commands). Only for in-caller rows whose every check the kernel
    # would redo anyway: a continued call's argument is re-read after the broker decided, so
    # the broker's look at it was never the boundary (`race` says what is).
    in_kernel: str = ""
    # Why the broker's whole answer to this call may be given again without asking it
    # (the seccomp native loop's answer facts, native/lane.c struct dvb_answer): the answer
    # depends on nothing but the tenant's policy and what the driver fixed when it loaded,
    # and not on the argument. Empty: every call is decided.
    answer_kept: str = ""

    def granted(self, caps: frozenset[str]) -> bool:
        return self.capability in caps

    def fd_fields(self, spec) -> tuple[str, ...]:
        """The fields of argument layout `spec` that the broker translates as the tenant's
        fds: the ABI's ``fd`` roles (abi/tables/base.py ANNOTATIONS), when the row carries
        fds."""
        if not self.carries_fds or spec is None:
            return ()
        return fd_fields_of(spec)


Rule = EscapeRule  # the earlier name


_FD_FIELDS: dict = {}  # StructSpec (by identity) -> its fd-role field paths


def fd_fields_of(spec) -> tuple[str, ...]:
    """The dotted paths of every ``fd``-role field of a layout (cached per layout)."""
    known = _FD_FIELDS.get(spec)
    if known is None:
        known = _FD_FIELDS[spec] = tuple(spec.fields_of_kind("fd"))
    return known


# Why the in-caller rows below are safe against a racing thread, in one place: the fd and
# the command are syscall registers, which no other thread can change; every handle the
# driver resolves is validated against the file the call is made on
# (PDB_PROP_SYS_VALIDATE_CLIENT_HANDLE_STRICT, measured on the H200: another file's client
# is NV_ERR_INVALID_CLIENT) and that file is the tenant's own.
_OWN_OBJECTS = ("names only objects the driver validates against the tenant's own file; a "
                "rewritten argument can only name other objects of the same tenant")
_OWN_MM = ("acts on the calling process's own UVM va space and mm; RM objects it names are "
           "validated by the driver against the tenant's own files and pid")

# --------------------------------------------------------------------------- escapes
ESCAPES: dict[str, EscapeRule] = {
    # frontend escapes ('F', 200+n)
    "NV_ESC_CHECK_VERSION_STR": Rule("nvml", "client/driver version handshake; no state",
                                     handler=handlers.version),
    "NV_ESC_CARD_INFO": Rule("nvml", "lists GPUs; rewritten to the tenant's GPUs only",
                             rewrite=rewrite.card_info,
                             answer_kept="the driver's table of the host's GPUs, built when "
                             "it loaded (nv.c nvidia_read_card_info; the argument is only "
                             "written), cut down to the tenant's GPUs (the policy epoch)"),
    "NV_ESC_SYS_PARAMS": Rule("nvml", "host-global and set-once: answered by the broker, "
                              "never relayed; a value other than the host's is refused",
                              handler=handlers.sys_params),
    "NV_ESC_REGISTER_FD": Rule("nvml", "binds a GPU file to the tenant's own ctl file "
                               "(fd checked to be the tenant's)", handler=handlers.fd,
                               carries_fds=True),
    "NV_ESC_NUMA_INFO": Rule("nvml", "read-only NUMA facts of the tenant's GPU file"),
    "NV_ESC_WAIT_OPEN_COMPLETE": Rule("nvml", "waits for the GPU file's own open to finish"),
    "NV_ESC_ALLOC_OS_EVENT": Rule("compute", "event on the tenant's own client and file",
                                  handler=handlers.fd, carries_fds=True,
                                  in_caller="the event is keyed by the fd number in the "
                                  "caller's own fd table",
                                  race=_OWN_OBJECTS),
    "NV_ESC_FREE_OS_EVENT": Rule("compute", "frees the tenant's own event",
                                 handler=handlers.fd, carries_fds=True,
                                 in_caller="the event is keyed by the fd number in the "
                                 "caller's own fd table", race=_OWN_OBJECTS),
    # RM escapes ('F', 0x27-0x5f)
    "NV_ESC_RM_CONTROL": Rule("nvml", "per-control allowlist below; client ownership checked",
                              handler=handlers.rm_control),
    "NV_ESC_RM_ALLOC": Rule("nvml", "per-class allowlist below; quota enforced",
                            handler=handlers.rm_alloc),
    "NV_ESC_RM_FREE": Rule("nvml", "frees only the tenant's own objects", handler=handlers.rm_free),
    "NV_ESC_RM_MAP_MEMORY": Rule("nvml", "maps the tenant's own object into the tenant's own "
                                 "file (fd checked)", handler=handlers.rm_map, carries_fds=True,
                                 in_caller="rm_create_mmap_context refuses a pid other than "
                                 "the client's (osapi.c)",
                                 race=_OWN_OBJECTS + "; a mapping context on a file the "
                                 "broker did not give out is useless: mmap of such a file is "
                                 "refused"),
    "NV_ESC_RM_UNMAP_MEMORY": Rule("nvml", "unmaps the tenant's own mapping",
                                   handler=handlers.rm_objects,
                                   in_caller="CPU mappings are found again only by the pid "
                                   "that made them", race=_OWN_OBJECTS),
    "NV_ESC_RM_UPDATE_DEVICE_MAPPING_INFO": Rule("compute", "updates the tenant's own mapping",
                                                 handler=handlers.rm_objects,
                                                 in_caller="CPU mappings are found again only "
                                                 "by the pid that made them",
                                                 race=_OWN_OBJECTS),
    "NV_ESC_RM_DUP_OBJECT": Rule("compute", "duplicates an object of one of the tenant's "
                                 "clients into another of its clients (CUDA IPC and peer "
                                 "mappings between the tenant's own processes): both "
                                 "clients, the source object and the new parent must be the "
                                 "tenant's; device memory keeps its charge until its last handle "
                                 "is freed", handler=handlers.rm_dup),
    # Once refused: on the two-H200 host one-GPU tenants' NVML failed in the run that first
    # allowed it; that run's failure was the device instance being taken for the minor
    # (docs/hardware.md), which also broke the runs where this was refused again.
    "NV_ESC_ATTACH_GPUS_TO_FD": Rule("compute", "keeps the GPUs it names open on the tenant's "
                                     "own ctl file (CUDA sends it for the GPUs a process "
                                     "uses); every id must be one of the tenant's GPUs, "
                                     "others are refused with EINVAL like an unknown id",
                                     handler=handlers.attach_gpus,
                                     nodes=frozenset({NodeKind.CTL})),
    # CUDA's legacy IPC (cudaIpcGetMemHandle, torch.multiprocessing) shares the memory
    # before another process duplicates it (seen on the two-H200 host).
    "NV_ESC_RM_SHARE": Rule("compute", "sets the share policy of one of the tenant's own "
                            "objects (client and object checked to be its own), kept inside "
                            "the tenant (broker/shares.py): a grant to every client or every "
                            "client of the user is kept in the broker's books and given, at a "
                            "duplicate through the broker, to that one client of the tenant's "
                            "(UVM's mapping calls duplicate under the driver's policy too, in "
                            "the tenant's process); one naming another tenant's client is "
                            "refused",
                            handler=handlers.rm_share),
    "NV_ESC_RM_ALLOC_MEMORY": Rule("compute", "memory for the tenant's own client: same class "
                                   "allowlist and quota as RM_ALLOC",
                                   handler=handlers.rm_alloc_memory, carries_fds=True),
}

# --------------------------------------------------------------------------- UVM commands
# nvidia-uvm's commands (raw numbers, /dev/nvidia-uvm), by name.
UVM_COMMANDS: dict[str, EscapeRule] = {
    "UVM_INITIALIZE": Rule("nvml", "binds a UVM va space to the calling process",
                           handler=handlers.uvm, nodes=UVM_NODES,
                           in_caller="binds the va space to current->mm", race=_OWN_MM),
    "UVM_DEINITIALIZE": Rule("nvml", "tears down the caller's own va space",
                             handler=handlers.uvm, nodes=UVM_NODES,
                             in_caller="acts on current->mm", race=_OWN_MM),
    "UVM_MM_INITIALIZE": Rule("nvml", "binds the caller's mm to its va space (uvmFd checked "
                              "to be the tenant's own UVM file)", handler=handlers.uvm, nodes=UVM_NODES,
                              carries_fds=True, in_caller="binds current->mm",
                              race=_OWN_MM),
}

# UVM calls CUDA makes; each acts on the caller's own va space, and those naming an RM
# client are checked to name the tenant's own.
#
# Most of them the broker only ever CONTINUEs after looking at client handles that the
# kernel then reads again (a racing thread can change them in between: the driver's own
# checks are what holds, `_OWN_MM`). With real driver files those rows run in the kernel
# without a notification (`in_kernel`): a CUDA init makes ~150 of them, each a round trip
# through the broker of 35-130 us on the H200 for nothing the broker could enforce
# (docs/benchmarks.md). Two steps stay with the broker: giving a va space a GPU
# (REGISTER_GPU) and an RM VA space (REGISTER_GPU_VASPACE), once per process each. Every
# in-kernel command acts only within what those steps, and the RM objects the broker
# admitted, put in the va space; the nvidia-uvm file itself comes only from the broker's
# open (`check_open`), and a tenant without the "uvm" capability gets no in-kernel rows.
_UVM_GPU_STEPS = frozenset({"UVM_REGISTER_GPU", "UVM_REGISTER_GPU_VASPACE"})
_UVM_IN_KERNEL = ("the broker's look at its argument was never the boundary (the kernel "
                  "re-reads it after a CONTINUE); UVM acts on the caller's own va space, "
                  "on GPUs and RM VA spaces registered through the broker, and the driver "
                  "validates every RM handle against the tenant's own files and pid")
for _name, _why in {
    "UVM_REGISTER_GPU": "registers a GPU the tenant's client already opened",
    "UVM_UNREGISTER_GPU": "unregisters the tenant's GPU from its own va space",
    "UVM_REGISTER_GPU_VASPACE": "shares the tenant's own RM VA space with UVM",
    "UVM_UNREGISTER_GPU_VASPACE": "undoes the above",
    "UVM_REGISTER_CHANNEL": "registers the tenant's own channel",
    "UVM_UNREGISTER_CHANNEL": "undoes the above",
    "UVM_CREATE_RANGE_GROUP": "bookkeeping in the caller's own va space",
    "UVM_DESTROY_RANGE_GROUP": "bookkeeping in the caller's own va space",
    "UVM_MAP_EXTERNAL_ALLOCATION": "maps the tenant's own RM memory",
    "UVM_FREE": "frees a range of the caller's own va space",
    "UVM_ALLOC_SEMAPHORE_POOL": "semaphore memory in the caller's own va space",
    "UVM_PAGEABLE_MEM_ACCESS": "read-only capability query",
    "UVM_VALIDATE_VA_RANGE": "read-only check of the caller's own range",
    "UVM_CREATE_EXTERNAL_RANGE": "reserves a range in the caller's own va space",
    "UVM_SET_PREFERRED_LOCATION": "hint on the caller's own range",
    "UVM_MIGRATE": "moves the caller's own managed memory",
    "UVM_TOOLS_GET_PROCESSOR_UUID_TABLE": "lists the processors of the caller's own va space",
    "UVM_ENABLE_READ_DUPLICATION": "hint on the caller's own range",
    "UVM_SET_ACCESSED_BY": "hint on the caller's own range",
    # what managed memory (cudaMallocManaged, cudaMemAdvise, cudaStreamAttachMemAsync)
    # sends on the caller's own managed ranges, which are charged when mapped
    "UVM_DISABLE_READ_DUPLICATION": "hint on the caller's own range",
    "UVM_UNSET_PREFERRED_LOCATION": "hint on the caller's own range",
    "UVM_UNSET_ACCESSED_BY": "hint on the caller's own range",
    "UVM_SET_RANGE_GROUP": "puts the caller's own ranges in one of its range groups",
    "UVM_MIGRATE_RANGE_GROUP": "moves the caller's own managed memory (a range group)",
    "UVM_PREVENT_MIGRATION_RANGE_GROUPS": "pins the caller's own range groups in place",
    "UVM_ALLOW_MIGRATION_RANGE_GROUPS": "undoes the above",
    "UVM_MAP_DYNAMIC_PARALLELISM_REGION": "maps in the caller's own va space",
    "UVM_UNMAP_EXTERNAL": "unmaps in the caller's own va space",
}.items():
    UVM_COMMANDS[_name] = Rule("uvm", _why, handler=handlers.uvm, nodes=UVM_NODES,
                          in_caller="UVM acts on the caller's mm and checks that RM objects "
                          "belong to the calling process (pid share policy)", race=_OWN_MM,
                          in_kernel="" if _name in _UVM_GPU_STEPS else _UVM_IN_KERNEL)

# Refused on purpose (listed so that the audit line and the docs give the reason).
REFUSED_ESCAPES: dict[str, str] = {
    "NV_ESC_RM_ACCESS_REGISTRY": "reads/writes the driver's registry (host-global settings)",
    "NV_ESC_RM_I2C_ACCESS": "raw I2C bus access to the board",
    "NV_ESC_SET_NUMA_STATUS": "changes the GPU's NUMA onlining state (host-global)",
    "NV_ESC_IOCTL_XFER_CMD": "indirect wrapper; no supported client sends it",
    "NV_ESC_RM_EXPORT_OBJECT_TO_FD": "exports an object to an fd other processes can import",
    "NV_ESC_RM_IMPORT_OBJECT_FROM_FD": "imports an object exported by another process",
    "NV_ESC_EXPORT_TO_DMABUF_FD": "exports device memory as a dma-buf",
    "NV_ESC_RM_CONFIG_SET": "legacy configuration writes",
    "NV_ESC_RM_CONFIG_SET_EX": "legacy configuration writes",
    "NV_ESC_RM_LOCKLESS_DIAGNOSTIC": "diagnostic interface",
    "NV_ESC_RM_VID_HEAP_CONTROL": "legacy heap allocator (ALLOC_SIZE bypasses class-based "
                                  "accounting)",
}


def kernel_commands(abi, caps: frozenset[str]) -> tuple[int, ...]:
    """The ioctl command numbers of driver ABI `abi` that a real-file seccomp tenant with
    capabilities `caps` makes without a notification: the UVM rows with `in_kernel` whose
    capability it holds (sorted). The filter is fixed when the tenant starts; what a policy
    change does to them is in docs/security.md ("Calls the kernel runs alone")."""
    return tuple(sorted(cmd for cmd, op in abi.uvm_cmds.items()
                        if (row := UVM_COMMANDS.get(op.name)) is not None
                        and row.in_kernel and row.granted(caps)))


def escape_rule(call) -> EscapeRule | None:
    """The row of a decoded escape or UVM command; None: not allowed."""
    return (UVM_COMMANDS if call.kind == "uvm" else ESCAPES).get(call.name)


# --------------------------------------------------------------------------- open
def check_open(node: NodeKind, minor: int, gpus: tuple[int, ...], caps: frozenset[str]) -> str:
    """'' when the tenant may open this node, else the reason it may not."""
    if node is NodeKind.CTL:
        return ""
    if node is NodeKind.GPU:
        return "" if minor in gpus else f"GPU {minor} is not one of the tenant's GPUs {list(gpus)}"
    if node is NodeKind.UVM:
        return "" if ("uvm" in caps or "nvml" in caps) else "needs capability 'uvm'"
    if node is NodeKind.UVM_TOOLS:
        return "nvidia-uvm-tools is the profiling interface (other processes' events)"
    if node is NodeKind.CAP:
        return "capability nodes grant MIG administration"
    return "not an NVIDIA node the broker serves"


# --------------------------------------------------------------------------- classes
@dataclass(frozen=True)
class ClassRule:
    """An RM class a tenant may allocate (NV_ESC_RM_ALLOC, NV_ESC_RM_ALLOC_MEMORY)."""
    capability: str
    reason: str
    # Device memory: the allocation's size counts against the tenant's quota on the GPU of
    # the parent device (handlers.rm_alloc, rm_alloc_memory).
    charge: bool = False
    # Pinned host memory: the allocation's size counts against the tenant's
    # pinned_host_memory (handlers.pinned_charge), refused beyond it with NV_ERR_NO_MEMORY.
    # Only the general path decides such a class (the size is in its parameters, which the
    # lanes' header decisions do not read): the control and continue lanes decline it.
    pinned: bool = False
    # What its parameters may name, checked after the client handles in them: a function
    # (CallContext, handlers.AllocCall) that raises Refusal (NV_ESC_RM_ALLOC only).
    check: Callable | None = None
    # Runs after the driver allocated it (NV_OK) and the object is in the books, before the
    # tenant has its answer: a function (CallContext, handlers.AllocCall, handle, gpu) ->
    # steps (NV_ESC_RM_ALLOC only). The channel group's compute share (compute.after_alloc).
    after: Callable | None = None
    # Runs when the driver answered NV_ERR_NO_MEMORY to an allocation the quota allowed: a
    # function (CallContext, gpu, charge, where, result, again) -> steps giving the result
    # the tenant gets (`again()`: the driver call's steps, once more). Priority preemption
    # (preemption.after_no_memory: lower-priority tenants checkpointed, then retried).
    no_memory: Callable | None = None
    # The allocation escapes (NV_ESC_RM_ALLOC, NV_ESC_RM_ALLOC_MEMORY) through which the
    # driver binds this class to the calling process (see Rule.in_caller), and why.
    in_caller_via: frozenset = frozenset()
    in_caller: str = ""
    race: str = ""
    # Pointer-typed fields of its parameters that the driver uses as a key and never
    # dereferences (with the reason): the control lane may then take the allocation with
    # them set, where any other pointer must be NULL (rules.lane_pointers).
    keys: tuple = ()
    keys_why: str = ""
    # The classes its parent object must be of (empty: any object of the tenant's that the
    # driver takes): checked on the header by the general path and the lane; such an
    # allocation is never settled (the loop's facts are keyed by the parent's handle, not
    # its class).
    parents: frozenset = frozenset()

    def granted(self, caps: frozenset[str]) -> bool:
        return self.capability in caps


# A racing thread can rewrite the class of a continued allocation (NVOS02 allocates
# NV01_MEMORY_LOCAL_USER too: rmapi_deprecated_allocmemory.c), i.e. allocate device memory
# the broker never saw, under the tenant's own client. Not preventable from outside the
# process; detected: the broker reads the driver's own per-process video-memory accounting
# after such calls and ends a tenant that holds more than its quota (Broker.quota_watch).
_RACE_ALLOC_MEMORY = ("a rewritten class could allocate device memory the broker did not "
                      "see: detected from the driver's per-process accounting afterwards, and "
                      "the tenant is ended with an audit record")

CLASSES: dict[int, ClassRule] = {
    0x80: ClassRule("nvml", "device object; deviceId checked against the tenant's GPUs"),
    0x2080: ClassRule("nvml", "subdevice of the tenant's own device"),
    0xDE: ClassRule("nvml", "subdevice diagnostics object NVML reads counters through"),
    0x3E: ClassRule("compute", "system memory of the tenant's own process, counted "
                    "against its pinned_host_memory", pinned=True,
                    in_caller_via=frozenset({"NV_ESC_RM_ALLOC_MEMORY"}),
                    in_caller="NVOS02 creates the mmap context for the caller's pid (escape.c)",
                    race=_RACE_ALLOC_MEMORY),
    0x40: ClassRule("compute", "device memory, counted against the tenant's quota",
                    charge=True, no_memory=preemption.after_no_memory),
    0x71: ClassRule("compute", "OS descriptor memory (the tenant's own pages, pinned: "
                    "counted against its pinned_host_memory)", pinned=True,
                    in_caller_via=frozenset({"NV_ESC_RM_ALLOC", "NV_ESC_RM_ALLOC_MEMORY"}),
                    in_caller="pins pages of the caller's own address space",
                    race=_RACE_ALLOC_MEMORY),
    0x79: ClassRule("compute", "OS event on the tenant's own file",
                    check=handlers.os_event_notifier, keys=("data",),
                    keys_why="`data` is an fd number that, with the allocating client, "
                    "looks up an event the tenant registered itself (NV_ESC_ALLOC_OS_EVENT): "
                    "os.c osUserHandleToKernelPtr walks the driver's event list for (fd, "
                    "hClient) and writes the event's kernel address back into the field; no "
                    "memory is read through it"),
    0x90F1: ClassRule("compute", "GPU virtual address space of the tenant's context"),
    0x9067: ClassRule("compute", "context share of the tenant's own channel group"),
    0x90E6: ClassRule("compute", "subdevice master object (error counters of own GPU)"),
    0xA06C: ClassRule("compute", "channel group (time-sliced with other tenants); its "
                      "timeslice and interleave level are set to the tenant's compute share "
                      "before the tenant has the handle", after=compute.after_alloc),
    # Under one of the tenant's channel groups, or under its device: the driver's checkpoint,
    # which runs inside the tenant's process, allocates a channel right under the device
    # (seen on the H200, 580.159.04: refusing it failed the checkpoint with
    # CUDA_ERROR_UNKNOWN, docs/compute-shares.md). The driver wraps such a channel in a channel
    # group of its own making (kernel_channel.c, kchannelConstruct_IMPL, tag 580.142: a
    # parent that is no KernelChannelGroupApi gets an internal KEPLER_CHANNEL_GROUP_A under
    # that parent, with a handle the driver picks and does not return), which the after-hook
    # finds and gives the tenant's compute share before the tenant has the channel
    # (compute.after_channel_alloc; docs/compute-shares.md, "Channels under the device").
    0xC86F: ClassRule("compute", "GPFIFO channel in the tenant's channel group or under its "
                      "device (the group the driver makes for it there gets the tenant's "
                      "compute share before the tenant has the handle); stopped before the "
                      "tenant has the handle while the tenant is preempted (priority low next "
                      "to a high tenant)", after=compute.after_channel_alloc,
                      parents=frozenset({compute.KEPLER_CHANNEL_GROUP_A, NV01_DEVICE_0})),
    0xC8B5: ClassRule("compute", "copy engine object on the tenant's channel"),
    0xCBC0: ClassRule("compute", "compute engine object on the tenant's channel"),
    0xC661: ClassRule("compute", "usermode doorbell page (write-only)"),
    0x2081: ClassRule("compute", "NV2081 BINAPI object CUDA uses for its own context"),
    0x503C: ClassRule("compute", "third-party P2P object on the tenant's own subdevice"),
    # NCCL's peer mappings between the two GPUs of one tenant (seen on the two-H200 host).
    0x503B: ClassRule("compute", "NV50_P2P: a peer link between two subdevices; the driver "
                      "looks hSubDevice and hPeerSubDevice up in the allocating client, "
                      "which holds subdevices of the tenant's own GPUs only (device objects "
                      "are checked against its GPUs), so both ends are the tenant's"),
    # Seen on the two-H200 host (NVLink): CUDA maps each large allocation into the fabric
    # address space; refused, every cudaMalloc above ~2 GiB failed there.
    0xF8: ClassRule("compute", "NV_MEMORY_FABRIC: a fabric (FLA) address range over the "
                    "tenant's own physical memory: the driver takes map.hVidMem from the same "
                    "client and device (or none, for a flexible range); it holds no video "
                    "memory of its own, so nothing is charged (the physical allocation is). "
                    "Exporting it to other processes (EXPORT_OBJECT_TO_FD) stays refused"),
    0x50A0: ClassRule("compute", "NV50 memory virtual object of the tenant's VA space"),
    0xCB33: ClassRule("compute", "confidential-computing query object (read-only)"),
    # CUDA allocates one per context to choose which SM exceptions it is told about, and
    # fails to create the context without it (seen on the H200). Only on the tenant's own
    # context: hAppClient must be the allocating client and hClass3dObject one of its
    # objects (handlers.rm_alloc); of its controls only SET_EXCEPTION_MASK is allowed.
    0x83DE: ClassRule("compute", "debugger object on the tenant's own context only (its "
                      "memory/register controls stay refused)",
                      check=handlers.debugger_on_own_context),
}

# Device-memory classes: their `size` counts against the tenant's quota on the GPU of the
# parent device.
DEVICE_MEMORY_CLASSES = frozenset(c for c, r in CLASSES.items() if r.charge)

REFUSED_CLASSES: dict[int, str] = {
    0x90CC: "profiler: counters of other tenants' work",
    0xB0CC: "profiler", 0xB1CC: "profiler", 0xB2CC: "profiler",
    0xC639: "MIG capability session (needs the cap node)",
    0xC640: "MIG capability session (needs the cap node)",
    0x0F: "capability object", 0xF1: "capability object",
    0xC2: "LOCAL_PHYSICAL: raw physical video memory",
    0x3F: "physical system memory",
    0x42: "privileged local memory",
    0xFD: "fabric memory (cross-node; not accounted)",
    # Objects nvidia-smi allocates that a tenant must not get.
    0x208F: "NV20_SUBDEVICE_DIAG: diagnostics object whose controls access registers",
    0x73: "NV04_DISPLAY_COMMON: display object; no display is shared with tenants",
    0x90E7: "GF100_SUBDEVICE_INFOROM: inforom object (its controls include inforom writes)",
    0xA083: "GRID displayless virtual display (vGPU); not a tenant's object",
}


def class_rule(rm_class: int) -> ClassRule | None:
    return CLASSES.get(rm_class)


def in_caller_reason(call, rm_class: int | None = None) -> str:
    """Why the driver binds this decided call to the calling process ('' when the broker may
    execute it itself on a duplicate of the tenant's file)."""
    if rm_class is not None and call.name in ("NV_ESC_RM_ALLOC", "NV_ESC_RM_ALLOC_MEMORY"):
        rule = CLASSES.get(rm_class)
        if rule is not None and call.name in rule.in_caller_via:
            return rule.in_caller
        return ""
    rule = escape_rule(call)
    return rule.in_caller if rule is not None else ""


# --------------------------------------------------------------------------- controls
@dataclass(frozen=True)
class ControlRule:
    """An RM control a tenant may send (NV_ESC_RM_CONTROL)."""
    capability: str
    reason: str
    # Rewrite hooks (rewrite.py): pre(ControlContext, params) -> params runs on the decoded
    # parameters before the driver sees them (and may refuse by raising Refusal);
    # post(ControlContext, params) -> params on the driver's answer before the tenant does.
    pre: Callable | None = None
    post: Callable | None = None
    # Answered by the broker instead of the driver: a predicate on the decoded parameters,
    # True when the call is relayed after all (ANSWERED_CONTROLS below).
    relay_if: Callable | None = None
    # Memory accounting: the control moves memory the quota counts (a row that sets it is
    # never `simple`). The object-export controls keep charges through their own `run`.
    charge: bool = False
    # Runs the control instead of the plain copy-in/copy-out path, after the client, object,
    # allowlist and pre-hook checks: a function (CallContext, ControlCall) -> steps
    # returning an IoctlReply (handlers.py). For controls whose parameters hold the tenant's
    # fds (the object export through an nvidiactl fd).
    run: Callable | None = None
    # Set when the driver's own flags refuse this control to a caller that is neither root
    # nor the kernel (abi OpSpec.driver_refusal): the flag, why, and the status the driver
    # answers. Such a control is refused whatever the policy grants: the broker must not
    # become the privileged caller the driver would otherwise refuse (its relay runs without
    # capabilities, but the emulator and a relay started with them would not refuse).
    driver_flag: str = ""
    driver_why: str = ""
    driver_status: int = nvstatus.NV_ERR_INSUFFICIENT_PERMISSIONS
    # Why the control may run where the caller's driver ABI has no layout for it (nothing in
    # its parameters can then be checked: no GPU id, client or pointer). Empty: such a call
    # is refused (`control_rule`), as the driver version that lacks it would answer.
    no_layout: str = ""

    def granted(self, caps: frozenset[str]) -> bool:
        return not self.driver_flag and self.capability in caps

    @property
    def rewrites(self) -> bool:
        """Whether the broker changes what goes to the driver or comes back."""
        return (self.pre is not None or self.post is not None or self.relay_if is not None
                or self.run is not None)

    @property
    def simple(self) -> bool:
        """The row's half of `simple_control`: no hook, no broker answer, no run of its own,
        no charge. The other half is the parameter layout, which is the ABI's (per driver
        version): `simple_control(abi, cmd)` combines both."""
        return not self.rewrites and not self.charge


def _nvml(reason: str, **kw) -> ControlRule:
    return ControlRule("nvml", reason, **kw)


def _compute(reason: str, **kw) -> ControlRule:
    return ControlRule("compute", reason, **kw)


_GSP_QUERY = "unpublished GSP query nvidia-smi sends (read-only; emulator: NOT_SUPPORTED)"

CONTROLS: dict[int, ControlRule] = {
    0x101: _nvml("driver build version (no GPU state)"),
    0x201: _nvml("attached GPU ids; rewritten to the tenant's GPUs", post=rewrite.attached_ids),
    0x202: _nvml("id info; refused for GPUs not the tenant's", post=rewrite.id_info_in_use),
    0x205: _nvml("id info v2; refused for GPUs not the tenant's", post=rewrite.id_info_in_use),
    0x214: _nvml("probed GPU ids; rewritten to the tenant's GPUs", post=rewrite.probed_ids),
    0x215: _nvml("attach: only the tenant's GPU ids (others refused)",
                 pre=rewrite.restrict_attach_ids),
    0x216: _nvml("detach: only the tenant's GPU ids (others refused)",
                 pre=rewrite.restrict_attach_ids),
    0x21B: _nvml("PCI location (domain/bus/slot) of a GPU id; NVML matches probed ids to cards"),
    0x279: _nvml("drain state of a GPU id (read-only; MODIFY_DRAIN_STATE stays refused)"),
    0x289: _nvml("system-level query without GPU state"),
    0xD01: _nvml("system-level query without GPU state"),
    0x800289: _nvml("device-level read-only query"),
    0x800292: _nvml("device-level read-only query"),
    0x20800102: _nvml("subdevice read-only info"),
    0x20800110: _nvml("subdevice name string"),
    0x2080014A: _nvml("subdevice UUID / identity query"),
    0x2080018D: _nvml("GPU process ids; rewritten to the tenant's own processes",
                 post=rewrite.gpu_pids),
    0x2080018E: _nvml("per-process info; only the tenant's own processes",
                 pre=rewrite.pid_info_to_host, post=rewrite.pid_info_to_tenant),
    0x20800406: _nvml("subdevice read-only info"),
    0x20801303: _nvml("framebuffer info; rewritten to the tenant's quota and use",
                 post=rewrite.fb_info),
    0x20801701: _nvml("subdevice read-only info"),
    0x20801801: _nvml("subdevice read-only info"),
    0x20801802: _nvml("subdevice read-only info"),
    0x20809009: _nvml("subdevice read-only info"),
    0x20809064: _nvml("subdevice read-only info"),
    0xDE0001: _nvml("diagnostics object read-only query"),
    # Read-only queries nvidia-smi 535 sends (nvidia-smi, -q, --query-gpu); the emulator
    # answers what it models and NV_ERR_NOT_SUPPORTED (shown as N/A) for the rest. Refusing
    # them instead would make nvidia-smi print ERR! (docs/emulator.md).
    0x800288: _nvml("software state persistence query (read-only)"),
    0x2080013F: _nvml("OEM board info: part/serial numbers of the tenant's own GPU "
                      "(read-only)"),
    0x20800802: _nvml("VBIOS info of the tenant's own GPU (read-only; its list pointer is carried "
                      "by the ABI as an embedded buffer)"),
    0x208001A4: _nvml("chip details of the tenant's own GPU (read-only)"),
    0x208001AB: _nvml("reset-required status of the tenant's own GPU (read-only)"),
    0x208001AE: _nvml("drain-and-reset recommendation of the tenant's own GPU (read-only)"),
    0x20801344: _nvml("remapped-rows summary of the tenant's own GPU (read-only)"),
    0x20801813: _nvml("PCIe counters of the tenant's own GPU (read-only)"),
    0x20801819: _nvml("PCIe utilization counters of the tenant's own GPU (read-only)"),
    0x20801829: _nvml("PCIe atomics capabilities of the tenant's own GPU (read-only)"),
    0x20802609: _nvml("power-management module info of the tenant's own GPU (read-only)"),
    0x20803401: _nvml("volatile ECC counts of the tenant's own GPU (read-only; ECC config stays "
                      "refused)"),
    # The rest of nvidia-smi's read-only queries (535 here, 580 on the H200); each
    # reads a fact of the tenant's own GPU object and carries no handle, pointer or GPU id.
    0x2080014B: _nvml("inforom object version of the tenant's own GPU (read-only)"),
    0x20800156: _nvml("inforom image version of the tenant's own GPU (read-only)"),
    0x20800157: _nvml("whether the tenant's own GPU's inforom holds ECC data (read-only, no "
                      "params)"),
    0x20801322: _nvml("retired (offlined) pages of the tenant's own GPU (read-only)"),
    0x20801357: _nvml("DRAM-encryption inforom support of the tenant's own GPU (read-only)"),
    0x20802068: _nvml("current performance state of the tenant's own GPU (read-only; setting it "
                      "stays refused)"),
    0x208001B2: _nvml("recovery action the driver recommends for the tenant's own GPU (read-only; "
                      "the number is GET_RECOVERY_ACTION in the 580 driver the broker "
                      "relays to)"),
    # Unpublished (GSP) queries nvidia-smi sends for clocks/thermal/power/perf; their layout is
    # in no open header, so they carry no handle the broker could check: with the real
    # backend each needs its layout checked before it is relayed.
    0x20808161: _nvml(_GSP_QUERY),
    0x2080852A: _nvml(_GSP_QUERY),
    0x2080852E: _nvml(_GSP_QUERY),
    0x20808513: _nvml(_GSP_QUERY),
    0x20808536: _nvml(_GSP_QUERY),
    0x2080853A: _nvml(_GSP_QUERY),
    0x2080A068: _nvml(_GSP_QUERY),
    0x2080A06E: _nvml(_GSP_QUERY),
    0x2080A0A7: _nvml(_GSP_QUERY),
    # NVML's nvmlDeviceGetUtilizationRates sent it on the H200 when the polled user-shared
    # page (0xde, REQUEST_DATA_POLL) did not answer in time, i.e. under load (when
    # refused, the tenant's NVML died with NoPermission). No header names it; the kernel
    # forwards every number of a LEGACY_NON_PRIVILEGED category to GSP as one flat block
    # (rmapi_gss_legacy_control.c RmGssLegacyRpcCmd, tag 580.142, lines 38-127: paramsSize
    # bytes copied in, the object looked up in the caller's own client, the block handed to
    # GSP's RM, which cannot follow a pointer into the caller's memory), so it can name
    # nothing but the caller's own objects: the same grounds as the GSP queries above.
    0x2080A097: _nvml("unpublished GSP utilization query NVML falls back to when the polled "
                      "user-shared page is late (read-only; forwarded to GSP as a flat block "
                      "in the caller's client: rmapi_gss_legacy_control.c; emulator: "
                      "NOT_SUPPORTED)"),
    0x2080A612: _nvml(_GSP_QUERY),
    0x2080A637: _nvml(_GSP_QUERY),
    0x2080B201: _nvml(_GSP_QUERY),
}
_COMPUTE_CONTROLS = [
    0x13A, 0x1F0, 0x27B, 0x288, 0xA04, 0xD04,
    0x20800111, 0x20800119, 0x2080012F, 0x20800131, 0x20800145, 0x20800146, 0x20800170,
    0x20800195,
    0x208001A3, 0x20801201, 0x20801210, 0x20801218, 0x2080121B, 0x20801227, 0x2080122A,
    0x2080122B, 0x20801230, 0x20801803, 0x20801823, 0x2080182A, 0x2080182B,
    0x2080220C, 0x20802210, 0x20802A0A, 0x20803002, 0x20803601, 0x20803801, 0x20808159,
    0x20808162, 0x20809001, 0x20809038, 0x2080A026, 0x2080A084, 0x20810108,
    0x503C0102, 0x503C0104, 0x503C0105, 0x800280, 0x801307, 0x801402, 0x80170D, 0x801909,
    0x906F0101, 0x90E60102, 0xA06C0101, 0xA06C0103, 0xC36F0108, 0xCB330101,
]

# No driver version's headers give these layouts: what the broker checks is the NVOS54
# header (the tenant's own client and subdevice), the driver the rest.
for _cmd, _row in list(CONTROLS.items()):
    if _row.reason == _GSP_QUERY or _cmd == 0x2080A097:
        CONTROLS[_cmd] = dataclasses.replace(
            _row, no_layout="unpublished in every driver version; a read-only query sent "
                            "to the tenant's own subdevice (checked in the header)")

_CUDA_TRACE = "used by CUDA on the tenant's own objects (seen in the PyTorch trace)"
CONTROLS.update({c: _compute(_CUDA_TRACE) for c in _COMPUTE_CONTROLS})
# The policy a client's later objects start with: nothing that reaches beyond the tenant
# (broker/shares.py; CUDA sets PID policies here).
CONTROLS[0xD04] = _compute("NV0000_CTRL_CMD_CLIENT_SET_INHERITED_SHARE_POLICY: the share "
                           "policy the tenant's client gives its later objects; only policies "
                           "that grant nothing beyond the calling process (PID, REQUIRE, "
                           "REVOKE, the tenant's own clients)", pre=shares.inherited_policy)
# GET_ACTIVE_DEVICE_IDS: only the tenant's GPUs are listed.
CONTROLS[0x288] = _compute(_CUDA_TRACE, post=rewrite.active_device_ids)
CONTROLS[0x83DE0309] = ControlRule("compute", "which SM exceptions the tenant's own context "
                                   "reports (its own debugger object)")
# Seen from NCCL/torch.distributed across two GPUs on the two-H200 host.
CONTROLS[0x12B] = ControlRule("compute", "NV0000_CTRL_CMD_SYSTEM_GET_P2P_CAPS_V2: peer "
                              "capabilities between GPU ids the caller names; every id in "
                              "gpuIds[gpuCount] must be one of the tenant's GPUs (checked by "
                              "the ABI's GPU-id fields) and the peer ids come back inline")
CONTROLS[0x20803001] = ControlRule("compute", "NV2080_CTRL_CMD_NVLINK_GET_NVLINK_CAPS: the "
                                   "NVLink capabilities of the tenant's own subdevice "
                                   "(read-only; CUDA asks before peer access)",
                                   post=rewrite.nvlink_caps)
# The driver's checkpoint (cuCheckpointProcess*, docs/preemption.md) stops and restarts the
# process's own channels with it; the only refusal a checkpoint met on the H200.
CONTROLS[0xA06F0103] = ControlRule("compute", "NVA06F_CTRL_CMD_GPFIFO_SCHEDULE: enables or "
                                   "disables one of the tenant's own channels (the driver's "
                                   "checkpoint does, in the process); not enabling one while "
                                   "the broker holds the tenant's channels stopped",
                                   pre=preemption.own_channel_schedule)
CONTROLS[0xA06C0105] = ControlRule("compute", "NVA06C_CTRL_CMD_PREEMPT: preempts the tenant's "
                                   "own channel group (the object is checked to be the "
                                   "tenant's)")
# Compute shares (broker/compute.py): a channel group's scheduling values are the
# policy's; the broker sets them on every new group (CLASSES[0xA06C].after) and rewrites the
# tenant's own attempts, on its private copy of the parameters.
CONTROLS[0xA06C0103] = _compute("NVA06C_CTRL_CMD_SET_TIMESLICE on the tenant's own channel "
                                "group: executed with the policy's timeslice (compute_weight) "
                                "whatever the tenant asked (audited)",
                                pre=compute.schedule_control)
CONTROLS[0xA06C0104] = _compute("NVA06C_CTRL_CMD_GET_TIMESLICE of the tenant's own channel "
                                "group (read-only: the policy's value)")
CONTROLS[0xA06C0107] = _compute("NVA06C_CTRL_CMD_SET_INTERLEAVE_LEVEL on the tenant's own "
                                "channel group: executed with the policy's level (priority) "
                                "whatever the tenant asked (audited)",
                                pre=compute.schedule_control)

CONTROLS[0x20801702] = ControlRule("compute", "NV2080_CTRL_CMD_MC_SERVICE_INTERRUPTS: "
                                   "asks the driver to service interrupts pending on the "
                                   "tenant's own GPU now (CUDA's fault handling); nothing is "
                                   "read back and the driver services them anyway")
CONTROLS[0x410110] = ControlRule("compute", "NV0041_CTRL_CMD_GET_SURFACE_INFO: attributes, "
                                 "physical size and address space of the tenant's own memory "
                                 "object (CUDA asks it of memory NCCL imported); the list is "
                                 "copied in and out by the broker like the driver does")
# Object export through an fd (cuMemExportToShareableHandle with POSIX fds: NCCL and CUDA
# IPC between the tenant's processes): handlers.object_fd_control.
_FD_EXPORT = ("; the fd must be one of the tenant's own nvidiactl files (the broker passes "
              "the driver its duplicate), so exported slots hold only the tenant's objects and "
              "only its processes import them; a filled slot keeps the object's charge until "
              "the file is closed")
CONTROLS[0x3D0B] = ControlRule("compute", "NV0000_CTRL_CMD_OS_UNIX_EXPORT_OBJECTS_TO_FD: "
                               "exports objects of the caller's client into an fd's slots"
                               + _FD_EXPORT,
                               run=handlers.object_fd_control, charge=True)
CONTROLS[0x3D0C] = ControlRule("compute", "NV0000_CTRL_CMD_OS_UNIX_IMPORT_OBJECTS_FROM_FD: "
                               "new handles in the caller's client for exported objects"
                               + _FD_EXPORT,
                               run=handlers.object_fd_control, charge=True)
CONTROLS[0x3D08] = ControlRule("compute", "NV0000_CTRL_CMD_OS_UNIX_GET_EXPORT_OBJECT_INFO: "
                               "slot count and metadata of an export fd" + _FD_EXPORT,
                               run=handlers.object_fd_control)

REFUSED_CONTROLS: dict[int, str] = {
    0x20800134: "ECC configuration", 0x20800136: "ECC configuration",
    0x20803403: "ECC configuration",
    0x208001A9: "GPU reset / drain", 0x208001AC: "GPU reset / drain", 0x278: "GPU drain",
    0x20800112: "power / clocks", 0x2080205B: "power / clocks",
    0x2080206F: "power / clocks",
    0x20800122: "register access", 0x20800602: "I2C access", 0x20800603: "I2C access",
    0x20800604: "I2C access", 0x208F0703: "register access",
    0x20800174: "MIG partitioning", 0xC6370101: "MIG partitioning",
    0xC6370102: "MIG partitioning",
    # Queries nvidia-smi/NVML send that a tenant must not get (nvidia-smi then shows
    # "Insufficient Permissions" for that field: correct, see docs/emulator.md).
    0x127: "P2P caps between GPU ids the caller names (not restricted to the tenant's) with "
           "an embedded busPeerIds pointer whose size (gpuCount squared) the ABI cannot express",
    0xB02: "accounting state of a GPU id the caller names (no rewrite hook restricts it to the "
           "tenant's GPUs) and of a vGPU guest pid",
    0x2080016D: "encoder session stats aggregate every process's sessions on the GPU, other "
                "tenants' included",
    0x2080017B: "frame-buffer-capture session stats aggregate every process's sessions on the "
                "GPU, other tenants' included",
    0x20803083: "the host's rack/InfiniBand GUIDs and chassis slot: facts of the machine, not of "
                "the tenant's GPU",
    0x20800152: "unpublished (no header names it): layout unknown, may hide handles/pointers",
    0x20808546: "unpublished (no header names it): layout unknown, may hide handles/pointers",
    0x2080A080: "unpublished (no header names it): layout unknown, may hide handles/pointers",
    0x2080A087: "unpublished (no header names it): layout unknown, may hide handles/pointers",
    0x2080A618: "unpublished (no header names it): layout unknown, may hide handles/pointers",
    0x2080852F: "unpublished (no header names it): layout unknown, may hide handles/pointers",
    # Scheduling controls a tenant could use to take more than its compute share
    # (docs/compute-shares.md).
    0xA06C0110: "MAKE_REALTIME puts a channel group ahead of every other tenant's (realtime "
                "TSGs precede all others and make them preemptible)",
    0xA06F0109: "a channel's own interleave level: the broker sets levels per channel group "
                "from the policy's priority",
    0x20801115: "RUNLIST_SET_SCHED_POLICY changes (and locks) the scheduling policy of every "
                "runlist of the GPU, for every tenant",
    0x20801121: "OBJSCHED_SET_STATE changes the GPU's runlist scheduler for every tenant",
    0x2080110B: "FIFO_DISABLE_CHANNELS stops the channels it lists by client and handle, any "
                "client's: another tenant's work (the broker sends it itself, for a tenant's own "
                "channels only: docs/compute-shares.md)",
    0x2080111A: "FIFO_DISABLE_CHANNELS_FOR_KEY_ROTATION lists channels by client and handle, "
                "any client's",
    0x20810110: "unpublished BINAPI control (no header names it): layout unknown",
    0x20810111: "unpublished BINAPI control (no header names it): layout unknown",
    0xD02: "CLIENT_GET_HANDLE_INFO: no client of a tenant's was seen sending it, and the broker "
           "sends it itself (the channel group the driver made for a channel under the device)",
}


# Controls the broker sends itself and tenants never may (each is in REFUSED_CONTROLS too),
# with what for: the emulator models them for the broker's own calls.
BROKER_CONTROLS: dict[int, str] = {
    0x2080110B: "FIFO_DISABLE_CHANNELS: a low-priority tenant's own channels stopped while a "
                "high-priority tenant holds a context on the GPU (compute.preempt_all), and a "
                "tenant's own channels stopped while another tenant has its turn "
                "([broker] compute_turns_ms, turns.step)",
    0xD02: "CLIENT_GET_HANDLE_INFO: which of a client's driver-picked handles is the channel "
           "group the driver made for a channel allocated under the device, and under which "
           "parent (compute.driver_group_of)",
}


# Controls a tenant's client sends that act on the whole GPU, for every tenant: the broker
# answers NV_OK itself and the driver never sees them. (CUDA sends PERF_BOOST at context
# creation and refuses to start when it fails: seen on the H200 through the seccomp front
# end, `CUDA driver initialization failed`.)
def _cuda_boost(params) -> bool:
    # What CUDA sends at context creation (flags BOOST_TO_MAX | CUDA, duration infinite;
    # ctrl2080perf.h): the boost every CUDA process gets natively, held by the driver for
    # the client's lifetime. Without it the H200 ran bf16 matmuls at ~470 instead of
    # ~700 TFLOP/s through the broker.
    return params is not None and params.flags == 0x12 and params.duration == 0xFFFFFFFF


CONTROLS[0x2080200A] = ControlRule(
    "compute", "PERF_BOOST changes the GPU's clocks for every tenant: CUDA's own context boost "
    "(flags 0x12, infinite) reaches the driver, any other boost or clear is answered NV_OK by "
    "the broker and not relayed", relay_if=_cuda_boost)

# (capability, reason, relay_if) of the rows the broker answers (the documentation's table).
ANSWERED_CONTROLS: dict[int, tuple[str, str, Callable]] = {
    c: (r.capability, r.reason, r.relay_if) for c, r in CONTROLS.items() if r.relay_if}


def _driver_refusal(cmd: int, abi) -> tuple[str, str, str] | None:
    """(flag, why, version) when the driver refuses `cmd` to an unprivileged caller: by the
    tables of `abi`, or (abi None: documentation, tests) of any supported version."""
    abis = [abi] if abi is not None else [registry.get(v) for v in registry.versions()]
    for a in abis:
        ref = a.control_op(cmd).driver_refusal()
        if ref is not None:
            return ref[0], ref[1], a.version
    return None


NO_LAYOUT = "NO_LAYOUT"  # ControlRule.driver_flag of a control the caller's ABI lacks


def control_rule(cmd: int, abi=None) -> ControlRule | None:
    """The rule for a control: None when it is not on the allowlist; for one that is, a rule
    whose `driver_flag` is set (and `granted()` False) when the driver's own flags reserve it
    for root, the kernel or RM itself, in the ABI of `abi` (the caller's driver version; None:
    in any supported version)."""
    rule = CONTROLS.get(cmd)
    if rule is None:
        return None
    # The driver's own reservation first: it is what the driver answers an unprivileged
    # caller, layout or not.
    ref = _driver_refusal(cmd, abi)
    if ref is None:
        if abi is not None and not rule.no_layout and abi.control(cmd) is None:
            # A control this driver version does not define (no layout in its tables):
            # nothing in its parameters could be checked, and the driver would not know it.
            return dataclasses.replace(
                rule, driver_flag=NO_LAYOUT, driver_status=nvstatus.NV_ERR_NOT_SUPPORTED,
                driver_why=f"driver {abi.version} defines no layout for it, so nothing in "
                           "its parameters can be checked")
        return rule
    flag, why, version = ref
    status = (nvstatus.NV_ERR_NOT_SUPPORTED if flag == "RMCTRL_FLAGS_INTERNAL"
              else nvstatus.NV_ERR_INSUFFICIENT_PERMISSIONS)
    if abi is None:
        why = f"{why} (driver {version})"
    return dataclasses.replace(rule, driver_flag=flag, driver_why=why, driver_status=status)


def control_refusal(rule: ControlRule | None) -> tuple[str, int]:
    """(reason, NV_STATUS) for a control `control_rule` did not grant: not on the allowlist,
    reserved by the driver's flags (named), or a capability the tenant lacks."""
    if rule is None:
        return "not on the control allowlist", nvstatus.NV_ERR_INSUFFICIENT_PERMISSIONS
    if rule.driver_flag == NO_LAYOUT:
        return f"refused whatever the policy grants: {rule.driver_why}", rule.driver_status
    if rule.driver_flag:
        return (f"refused whatever the policy grants: the driver marks it {rule.driver_flag} "
                f"({rule.driver_why})", rule.driver_status)
    return f"needs capability '{rule.capability}'", nvstatus.NV_ERR_INSUFFICIENT_PERMISSIONS


# --------------------------------------------------------------------------- simple controls
_SIMPLE: dict = {}  # (DriverABI, cmd) -> bool


def simple_control(abi, cmd: int) -> bool:
    """Whether a control of `abi` can be executed without decoding its parameters: it is on
    the allowlist and not reserved by the driver; its row has no rewrite hook, no broker
    answer and no charge; and its parameter layout is known (published, fixed size) with no
    field the broker must look at: no pointer (nested or embedded buffer), no fd, no client
    handle (CLIENT_HANDLE_FIELDS) and no GPU id (rewrite.GPU_ID_FIELD_NAMES), at any depth.

    For such a control the full path (handlers.rm_control) only copies the parameter block
    to the driver and back, so a fast lane may do just that. What it must still do itself,
    from the NVOS54 header: the capability (`control_rule(cmd, abi).granted`), the client
    and object ownership and the revoked-GPU check, and paramsSize == the layout's size.
    Computed once per (ABI, command)."""
    key = (abi, cmd)
    known = _SIMPLE.get(key)
    if known is None:
        known = _SIMPLE[key] = _simple(abi, cmd)
    return known


def _simple(abi, cmd: int) -> bool:
    rule = control_rule(cmd, abi)
    if rule is None or rule.driver_flag or not rule.simple:
        return False
    op = abi.control(cmd)
    return op is not None and op.params is not None and plain_layout(op.params)


_PLAIN: dict = {}  # StructSpec (by identity) -> bool
_CHECKED: dict = {}  # StructSpec (by identity) -> pointer offsets or None


def plain_layout(spec) -> bool:
    """A parameter layout with nothing the broker looks at: no pointer (nested or embedded
    buffer), no fd, no client handle (CLIENT_HANDLE_FIELDS) and no GPU id
    (rewrite.GPU_ID_FIELD_NAMES), at any depth. Cached per layout."""
    known = _PLAIN.get(spec)
    if known is None:
        known = _PLAIN[spec] = not any(
            f.kind in ("ptr", "fd") or f.name in CLIENT_HANDLE_FIELDS
            or f.name in rewrite.GPU_ID_FIELD_NAMES for _path, f, _off in spec.walk())
    return known


def lane_pointers(spec) -> tuple[int, ...] | None:
    """For the control lane's checked controls: the offsets of a layout's pointer fields,
    which the lane admits only when every one is NULL in its private copy (then the driver
    reads and writes no memory but that copy); None for a layout the lane cannot check on
    its private copy alone: an fd, or a pointer inside an array. Client handles and GPU ids
    are allowed (ControlLane.check tests them). Cached per layout."""
    known = _CHECKED.get(spec, False)
    if known is False:
        offs: list[int] | None = []
        for path, f, off in spec.walk():
            if f.kind == "fd" or (f.kind == "ptr" and "[]" in path):
                offs = None
                break
            if f.kind == "ptr":
                offs.append(off)
        known = _CHECKED[spec] = tuple(offs) if offs is not None else None
    return known


def lane_embedded(spec) -> tuple[tuple[int, str], ...]:
    """(offset, name) of a layout's top-level pointer fields that name *embedded buffers*
    (`ptr->bytes@sizeField`, `ptr->STRUCT@countField`: handlers.embedded_buffers, which the
    general path copies in and back): a front end that can carry them lets the lane take
    such a control with the pointer set (ControlLane.check, embedded_ok). Cached per
    layout."""
    known = _EMBEDDED.get(spec)
    if known is None:
        known = _EMBEDDED[spec] = tuple(
            (off, f.name) for path, f, off in spec.walk()
            if path == f.name and f.kind == "ptr" and f.size_field
            and isinstance(f.points_to, str) and f.points_to not in ("control", "class", "xfer"))
    return known


_EMBEDDED: dict = {}


def reads_params(rule: ControlRule, spec) -> bool:
    """Whether the full path (handlers.rm_control) must decode a control's parameters: its
    row changes something (hooks, answer, run, charge) or its layout holds something the
    broker checks. The others pass through as the bytes read: decoding them would only cost time."""
    return not rule.simple or not plain_layout(spec)
