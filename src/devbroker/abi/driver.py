"""DriverABI: one driver version's escapes, RM classes, RM controls and UVM commands.

Sans-IO: decode_ioctl() takes the argument bytes the front end already read; nested()
says which further buffer (pointer, size, layout) the caller must read from tenant memory,
and decode_nested() decodes it.  Nothing here dereferences a pointer.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import Any, Callable, ClassVar

from . import status as _status
from .errors import DecodeError
from .nodes import NodeKind
from .ioc import IOC_READ, IOC_WRITE, ioc
from .spec import StructSpec, StructValue, format_value

NV_IOCTL_MAGIC = 0x46  # 'F'
NV_IOCTL_BASE = 200  # frontend escapes are 'F', 200+n; RM escapes are 'F', 0x27..0x5f
# Largest nested buffer we will ask a caller to read.  The biggest param structs in the
# tables are a few tens of KiB; anything beyond this is a malformed or hostile request.
MAX_NESTED = 1 << 20


def iowr(nr: int, size: int, typ: int = NV_IOCTL_MAGIC) -> int:
    """_IOWR(typ, nr, size): the NVIDIA escapes are read|write 'F' requests."""
    return ioc(IOC_READ | IOC_WRITE, typ, nr, size)


@dataclass(frozen=True)
class OpSpec:
    """An escape, RM class, RM control or UVM command.

    `params` is the StructSpec of its argument (None when it takes none).  For escapes
    whose argument size varies (RM_ALLOC: NVOS21 or NVOS64; CARD_INFO: an array) the
    accepted layouts are in `variants` (size -> StructSpec).  `flags` holds devbroker's own
    markers ("unpublished": in no open header).  `driver_flags` are the driver's flags for
    it, from the driver source (controls: RMCTRL_FLAGS_* of the exported-method tables, e.g.
    "NON_PRIVILEGED", "PRIVILEGED", "INTERNAL", "ROUTE_TO_PHYSICAL"; classes: RS_FLAGS_* of
    resource_list.h, e.g. "ALLOC_NON_PRIVILEGED"), None where the source has no entry."""

    kind: str  # "frontend" | "rm" | "control" | "class" | "uvm"
    number: int
    name: str
    params: StructSpec | None = None
    flags: frozenset[str] = frozenset()
    variants: dict[int, StructSpec] = field(default_factory=dict, compare=False, hash=False)
    array_of: StructSpec | None = None  # argument is N of these (CARD_INFO)
    source: str = ""
    driver_flags: frozenset[str] | None = None

    @property
    def size(self) -> int:
        return self.params.size if self.params is not None else 0

    @property
    def privileged(self) -> bool:
        return self.driver_flags is not None and "PRIVILEGED" in self.driver_flags

    @property
    def unpublished(self) -> bool:
        return "unpublished" in self.flags

    def driver_refusal(self) -> tuple[str, str] | None:
        """(flag, what the driver does) when the driver itself refuses this control or class
        to a caller that is neither root (CAP_SYS_ADMIN) nor the kernel, by its flags; None
        when it lets such a caller through, or when the driver source has no flags for it.

        Controls (control.c: serverControl_ValidateCookie, rmControlValidateClientPrivilegeAccess;
        rmapi_gss_legacy_control.c): INTERNAL -> NV_ERR_NOT_SUPPORTED unless RM calls itself;
        PRIVILEGED -> root only; an exported control with none of NON_PRIVILEGED, PRIVILEGED,
        INTERNAL is KERNEL_PRIVILEGED (the default: kernel clients only); a GSS legacy number
        in a LEGACY_PRIVILEGED category -> root only. Classes (alloc_free.c:
        _serverAllocValidatePrivilege): ALLOC_KERNEL_PRIVILEGED, ALLOC_PRIVILEGED, no privilege
        flag at all (refused), INTERNAL_ONLY; clients (ROOT_OBJECT) are not checked there."""
        f = self.driver_flags
        if f is None:
            return None
        if self.kind == "control":
            if "INTERNAL" in f:
                return ("RMCTRL_FLAGS_INTERNAL", "only RM itself may call it (the driver "
                        "answers NV_ERR_NOT_SUPPORTED)")
            if "GSS_LEGACY_PRIVILEGED" in f:
                return ("RM_GSS_LEGACY_MASK_PRIVILEGED", "a LEGACY_PRIVILEGED category: the "
                        "driver forwards it to GSP for root (CAP_SYS_ADMIN) and kernel clients only")
            if "PRIVILEGED" in f:
                return ("RMCTRL_FLAGS_PRIVILEGED", "the driver allows it to root "
                        "(CAP_SYS_ADMIN) and kernel clients only")
            if "NO_EXPORT_ENTRY" not in f and "NON_PRIVILEGED" not in f:
                return ("RMCTRL_FLAGS_KERNEL_PRIVILEGED", "none of NON_PRIVILEGED, PRIVILEGED, "
                        "INTERNAL: the driver allows it to kernel clients only")
            return None
        if self.kind == "class":
            if "ROOT_OBJECT" in f:
                return None
            if "ALLOC_KERNEL_PRIVILEGED" in f:
                return ("RS_FLAGS_ALLOC_KERNEL_PRIVILEGED", "the driver allocates it for "
                        "kernel clients only")
            if "ALLOC_PRIVILEGED" in f:
                return ("RS_FLAGS_ALLOC_PRIVILEGED", "the driver allocates it for root "
                        "(CAP_SYS_ADMIN) and kernel clients only")
            if "ALLOC_NON_PRIVILEGED" not in f:
                return ("RS_FLAGS (no privilege flag)", "the driver refuses to allocate a "
                        "class without a privilege flag")
            if "INTERNAL_ONLY" in f:
                return ("RS_FLAGS_INTERNAL_ONLY", "only RM itself may allocate it")
        return None


@dataclass(frozen=True)
class NestedRef:
    """A buffer one level below the ioctl argument: read `size` bytes at `ptr` from the
    caller, decode with `spec` (None: layout unknown, e.g. an unknown control).
    `field` names the pointer field in the argument; `size_field` the field that gave size
    ("" when the size came from the class table because paramsSize was 0)."""

    ptr: int
    size: int
    spec: StructSpec | None
    field: str
    size_field: str = ""
    op: OpSpec | None = None  # the control / class / inner escape it belongs to


class IoctlCall:
    """A decoded ioctl.  `value` is None for unknown commands and argument-less ones."""

    __slots__ = ("node", "cmd", "kind", "name", "spec", "value", "raw", "nr")

    def __init__(self, node: NodeKind | int, cmd: int, kind: str, name: str,
                 spec: OpSpec | None, value: StructValue | None, raw: bytes, nr: int):
        self.node = node
        self.cmd = cmd
        self.kind = kind  # "frontend" | "rm" | "uvm"
        self.name = name
        self.spec = spec
        self.value = value
        self.raw = raw
        self.nr = nr

    @property
    def known(self) -> bool:
        return self.spec is not None

    def encode(self) -> bytes:
        return self.value.encode() if self.value is not None else self.raw

    def replace(self, **kw: Any) -> "IoctlCall":
        if self.value is None:
            raise ValueError(f"{self.name}: no decoded argument to replace fields of")
        return IoctlCall(self.node, self.cmd, self.kind, self.name, self.spec,
                         self.value.replace(**kw), self.raw, self.nr)

    def with_status(self, status: int) -> bytes | None:
        """The argument with the driver's status set to `status` where the driver keeps it:
        the field whose role is `status` (NV_STATUS: `status`, UVM's `rmStatus`, the OS
        events' `Status`), at the top level or in the `params` it wraps
        (nv_ioctl_nvos33_parameters_with_fd and the like). None where the argument has no
        such field (REGISTER_FD, NUMA_INFO, whose `status` is a NUMA state, argument-less and
        unknown calls): the driver answers those with an errno. The emulator's answers for
        calls it does not model go by the same role."""
        value = self.value
        if value is None:
            return None
        name = _status_field(value)
        if name is not None:
            return value.replace(**{name: status}).encode()
        inner = getattr(value, "params", None)
        name = _status_field(inner) if isinstance(inner, StructValue) else None
        if name is not None and inner is not None:
            return value.replace(params=inner.replace(**{name: status})).encode()
        return None

    def __repr__(self) -> str:
        v = f" {format_value(self.value, status_name=_status.name)}" if self.value is not None else ""
        return f"<IoctlCall {self.name}{v}>"


def _status_field(value: StructValue) -> str | None:
    """The name of the field of a decoded struct whose role is the driver's NV status."""
    for f in value.spec.fields:
        if f.kind == "status":
            return f.name
    return None


class DriverABI:
    """The tables of one driver version (built by registry; treat as read-only)."""

    def __init__(self, version: str, *, tag: str, escapes: dict[int, OpSpec],
                 controls: Mapping[int, OpSpec], classes: Mapping[int, OpSpec],
                 uvm: dict[int, OpSpec], structs: Mapping[str, StructSpec],
                 unpublished: Callable[[int], OpSpec] | None = None):
        self.version = version
        self.tag = tag  # the open-gpu-kernel-modules tag the layouts were read from
        self.escapes = escapes
        self.controls = controls  # published controls (and unpublished ones of known size)
        self.classes = classes
        self.uvm_cmds = uvm
        self.structs = structs
        self._unpublished = unpublished
        self._unpub_cache: dict[int, OpSpec] = {}
        self._escape_by_name = {s.name: s for s in escapes.values()}

    def __repr__(self) -> str:
        return f"<DriverABI {self.version} (headers {self.tag})>"

    # ------------------------------------------------------------------ lookups
    def escape(self, nr_or_name: int | str) -> OpSpec | None:
        if isinstance(nr_or_name, str):
            return self._escape_by_name.get(nr_or_name)
        return self.escapes.get(nr_or_name)

    def escape_cmd(self, name: str, size: int | None = None) -> int:
        """The ioctl request number of escape `name` with a `size`-byte argument (its own
        parameters' size by default): _IOWR('F', nr, size)."""
        spec = self._escape_by_name[name]
        return iowr(spec.number, spec.size if size is None else size)

    def own_control(self, node: NodeKind | int, h_client: int, h_object: int, cmd: int,
                    params_size: int) -> IoctlCall:
        """An NV_ESC_RM_CONTROL the broker sends itself (a probe, a scheduling value),
        decoded as a tenant's would be: its parameters are the broker's own buffer (params=1
        marks it: no pointer of a tenant's), passed to the backend as the nested bytes."""
        ctl = self.struct("NVOS54_PARAMETERS")
        value = ctl.decode(bytes(ctl.size)).replace(hClient=h_client, hObject=h_object,
                                                    cmd=cmd, paramsSize=params_size, params=1)
        return self.decode_ioctl(node, self.escape_cmd("NV_ESC_RM_CONTROL", ctl.size),
                                 value.encode())

    def with_status(self, node: NodeKind | int, cmd: int, arg: bytes,
                    status: int) -> bytes | None:
        """`arg` (the argument of ioctl `cmd` on `node`) with the driver's status set to
        `status` where the driver keeps it; None where it has none (IoctlCall.with_status)."""
        return self.decode_ioctl(node, cmd, arg).with_status(status)

    def control(self, cmd: int) -> OpSpec | None:
        """A control of the tables (published, or unpublished of a known size), else None."""
        return self.controls.get(cmd)

    def control_op(self, cmd: int) -> OpSpec:
        """Any control number: the table's entry, else an unpublished one named by its range
        (flags {"unpublished"}, no layout)."""
        op = self.controls.get(cmd)
        if op is not None:
            return op
        op = self._unpub_cache.get(cmd)
        if op is None:
            if self._unpublished is None:
                op = OpSpec("control", cmd, f"UNKNOWN_CONTROL(0x{cmd:x})",
                            flags=frozenset({"unpublished"}))
            else:
                op = self._unpublished(cmd & 0xFFFFFFFF)
            if len(self._unpub_cache) < 4096:  # a hostile client may send any number
                self._unpub_cache[cmd] = op
        return op

    def rm_class(self, class_id: int) -> OpSpec | None:
        return self.classes.get(class_id)

    def uvm(self, cmd: int) -> OpSpec | None:
        return self.uvm_cmds.get(cmd)

    def struct(self, name: str) -> StructSpec:
        return self.structs[name]

    def control_name(self, cmd: int) -> str:
        return self.control_op(cmd).name

    def class_name(self, class_id: int) -> str:
        s = self.classes.get(class_id)
        return s.name if s else f"UNKNOWN_CLASS(0x{class_id:x})"

    # ------------------------------------------------------------------ decoding
    def decode_ioctl(self, node: NodeKind | int, cmd: int, arg: bytes, *,
                     window: bool = False) -> IoctlCall:
        """Decode a top-level ioctl argument.

        UVM nodes: `arg` must hold at least sizeof(params); extra bytes (a recorder's window)
        are kept and re-encoded.  'F' nodes: `arg` must be exactly _IOC_SIZE(cmd) bytes and
        that size must be one the escape accepts.  Unknown commands give spec None.
        window=True (trace reading only): a UVM argument shorter than its struct is a capture
        window cut short by the recorder; decode what is there (see StructSpec.decode)."""
        if node == NodeKind.UVM or node == NodeKind.UVM_TOOLS:
            spec = self.uvm_cmds.get(cmd)
            if spec is None:
                return IoctlCall(node, cmd, "uvm", f"UNKNOWN(0x{cmd:x})", None, None, arg, cmd)
            if spec.params is None:
                return IoctlCall(node, cmd, "uvm", spec.name, spec, None, arg, cmd)
            return IoctlCall(node, cmd, "uvm", spec.name, spec,
                             spec.params.decode(arg, partial=window), arg, cmd)
        nr = cmd & 0xFF
        kind = "frontend" if nr >= NV_IOCTL_BASE else "rm"
        if (cmd >> 8) & 0xFF != NV_IOCTL_MAGIC:
            return IoctlCall(node, cmd, kind, f"UNKNOWN(0x{cmd:x})", None, None, arg, nr)
        spec = self.escapes.get(nr)
        if spec is None:
            return IoctlCall(node, cmd, kind, f"UNKNOWN(0x{cmd:x})", None, None, arg, nr)
        size = (cmd >> 16) & 0x3FFF
        n = len(arg)
        if n != size:
            raise DecodeError(min(n, size), "<arg>",
                              f"{spec.name}: argument is {n} bytes but _IOC_SIZE is {size}")
        ps = spec.params
        if ps is None or ps.size != size:
            ps = spec.variants.get(size)
            if ps is None and spec.array_of is not None and size and size % spec.array_of.size == 0:
                ps = self._array_spec(spec.array_of, size // spec.array_of.size)
            if ps is None:
                if spec.params is None and not spec.variants and spec.array_of is None:
                    return IoctlCall(node, cmd, kind, spec.name, spec, None, arg, nr)
                want = sorted({spec.size, *spec.variants} - {0})
                raise DecodeError(0, "<arg>", f"{spec.name}: size {size} is not one of {want}")
        return IoctlCall(node, cmd, kind, spec.name, spec, ps.decode(arg), arg, nr)

    _arrays: ClassVar[dict[tuple[str, int, int], StructSpec]] = {}

    def _array_spec(self, elem: StructSpec, n: int) -> StructSpec:
        key = (elem.name, elem.size, n)
        s = DriverABI._arrays.get(key)
        if s is None:
            from .spec import Field
            s = DriverABI._arrays[key] = StructSpec(f"{elem.name}[{n}]",
                                                     [Field("entries", "array", elem=elem, count=n)])
        return s

    def nested(self, call: IoctlCall) -> NestedRef | None:
        """The nested buffer of RM_CONTROL (params), RM_ALLOC (pAllocParms) and XFER_CMD
        (ptr), or None (no nested buffer, or a NULL pointer).

        Raises DecodeError when the size is absurd (> MAX_NESTED)."""
        v = call.value
        if v is None or call.spec is None:
            return None
        name = call.name
        op: OpSpec | None
        if name == "NV_ESC_RM_CONTROL":
            op = self.control_op(v.cmd)
            ref = NestedRef(v.params, v.paramsSize, op.params, "params", "paramsSize", op)
        elif name == "NV_ESC_RM_ALLOC":
            op = self.classes.get(v.hClass)
            size, sf = v.paramsSize, "paramsSize"
            if size == 0 and op is not None:
                size, sf = op.size, ""
            ref = NestedRef(v.pAllocParms, size, op.params if op else None, "pAllocParms", sf, op)
        elif name == "NV_ESC_IOCTL_XFER_CMD":
            op = self.escapes.get(v.cmd)
            ref = NestedRef(v.ptr, v.size, op.params if op else None, "ptr", "size", op)
        else:
            return None
        if ref.ptr == 0:
            return None
        if ref.size > MAX_NESTED:
            f = ref.size_field or ref.field
            off = v.spec.by_name[f].offset
            raise DecodeError(off, f, f"{name}: nested size {ref.size} exceeds {MAX_NESTED}")
        return ref

    def decode_nested(self, call: IoctlCall, data: bytes,
                      ref: NestedRef | None = None) -> StructValue | None:
        """Decode the nested buffer `data` (read at ref.ptr).  Checks what the driver checks:
        a control's paramsSize must equal its params size; the buffer must hold the struct.
        Returns None when the layout is unknown (the caller should deny)."""
        if ref is None:
            ref = self.nested(call)
        if ref is None or ref.spec is None:
            return None
        if call.name == "NV_ESC_RM_CONTROL" and ref.size != ref.spec.size:
            off = call.value.spec.by_name["paramsSize"].offset if call.value else 0
            what = ref.op.name if ref.op else call.name
            raise DecodeError(off, "paramsSize", f"{what}: paramsSize {ref.size} != "
                              f"sizeof({ref.spec.name}) {ref.spec.size}")
        if len(data) < ref.size:
            raise DecodeError(len(data), ref.field,
                              f"nested buffer is {len(data)} bytes, {ref.size_field or 'class size'}"
                              f" says {ref.size}")
        return ref.spec.decode(data, path=ref.field)
