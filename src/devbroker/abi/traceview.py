"""Decoding a recorded trace into named events (sans-IO: takes Records, returns values/lines).

Used by `devbroker trace show/stats` and by the tests that prove every record decodes.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TypedDict

from . import status as _status
from .driver import NV_IOCTL_MAGIC, DriverABI, IoctlCall, NestedRef
from .errors import DecodeError
from .nodes import NodeKind
from .nvtrace import Record, RecordType
from .spec import StructValue, _fmt


@dataclass
class Event:
    rec: Record
    node: NodeKind | None = None
    call_in: IoctlCall | None = None
    call_out: IoctlCall | None = None
    ref: NestedRef | None = None
    nested_in: StructValue | None = None
    nested_out: StructValue | None = None
    error: DecodeError | None = None
    op_name: str = ""  # control / class / xfer name of the nested buffer
    notes: list[str] = field(default_factory=list)


class TraceDecoder:
    """Keeps the fd -> node map of a trace and decodes each record."""

    def __init__(self, abi: DriverABI):
        self.abi = abi
        self.fds: dict[int, NodeKind] = {}

    def node_for(self, rec: Record) -> NodeKind:
        # Prefer the command itself (README: fd numbers may be misattributed): 'F' commands
        # whose size matches the buffer go to the NVIDIA char nodes, the rest to UVM.
        known = self.fds.get(rec.fd)
        if (rec.cmd >> 8) & 0xFF == NV_IOCTL_MAGIC and (rec.cmd >> 16) & 0x3FFF == len(rec.in_):
            return known if known in (NodeKind.CTL, NodeKind.GPU, NodeKind.CAP) else NodeKind.CTL
        return known if known in (NodeKind.UVM, NodeKind.UVM_TOOLS) else NodeKind.UVM

    def decode(self, rec: Record) -> Event:
        ev = Event(rec)
        if rec.type == RecordType.OPEN:
            ev.node = NodeKind.from_path(rec.path)
            if rec.ret >= 0:
                self.fds[rec.ret] = ev.node
            return ev
        if rec.type == RecordType.CLOSE:
            ev.node = self.fds.pop(rec.fd, None)
            return ev
        if rec.type != RecordType.IOCTL:
            ev.node = self.fds.get(rec.fd)
            return ev
        ev.node = self.node_for(rec)
        abi = self.abi
        try:
            call = ev.call_in = abi.decode_ioctl(ev.node, rec.cmd, rec.in_, window=True)
            ev.call_out = (abi.decode_ioctl(ev.node, rec.cmd, rec.out, window=True)
                           if rec.out else None)
            ref = ev.ref = abi.nested(call)
            v = call.value
            if call.name == "NV_ESC_RM_CONTROL" and v is not None:
                ev.op_name = abi.control_name(v.cmd)
            if ref is not None:
                ev.op_name = ref.op.name if ref.op else _unknown_op(call)
                # the recorder captured min(size, readable) bytes; class-sized windows are longer
                if ref.spec is not None:
                    if rec.xin:
                        ev.nested_in = abi.decode_nested(call, rec.xin, ref)
                    if rec.xout:
                        ev.nested_out = abi.decode_nested(call, rec.xout, ref)
            elif call.name == "NV_ESC_RM_ALLOC" and v is not None:
                op = abi.rm_class(v.hClass)
                ev.op_name = op.name if op else _unknown_op(call)
        except DecodeError as e:
            ev.error = e
        return ev


def _unknown_op(call: IoctlCall) -> str:
    v = call.value
    if v is None:
        return f"UNKNOWN({call.name})"
    if call.name == "NV_ESC_RM_CONTROL":
        return f"UNKNOWN_CONTROL(0x{v.cmd:x})"
    if call.name == "NV_ESC_RM_ALLOC":
        return f"UNKNOWN_CLASS(0x{v.hClass:x})"
    return f"UNKNOWN_XFER(0x{v.cmd:x})"


def _render(abi: DriverABI, v: StructValue, max_items: int = 6) -> str:
    parts = []
    for f in v.spec.fields:
        x = v._get(f)
        if f.kind == "cmd" and v.spec.name == "NVOS54_PARAMETERS":
            s = f"{abi.control_name(x)}(0x{x:x})"
        elif f.kind == "class":
            s = f"{abi.class_name(x)}(0x{x:x})"
        elif f.kind == "fd":
            s = f"fd:{x}"
        elif isinstance(x, StructValue):
            s = "{" + _render(abi, x, max_items) + "}"
        else:
            s = _fmt(f, x, max_items, _status.name)
        parts.append(f"{f.name}={s}")
    return " ".join(parts)


def format_event(abi: DriverABI, i: int, ev: Event) -> str:
    r = ev.rec
    head = f"#{i} @{r.offset} pid={r.pid} tid={r.tid}"
    node = ev.node.name.lower() if ev.node is not None else "?"
    if r.type == RecordType.OPEN:
        return f"{head} open {r.path} node={node} -> fd {r.ret}" + (f" errno={r.err}" if r.err else "")
    if r.type == RecordType.CLOSE:
        return f"{head} close fd={r.fd} node={node} ret={r.ret}"
    if r.type == RecordType.MMAP:
        try:
            ln, fl, off = r.mmap_args
            a = f"len=0x{ln:x} flags=0x{fl:x} offset=0x{off:x}"
        except DecodeError:
            a = "args=?"
        return (f"{head} mmap fd={r.fd} node={node} prot=0x{r.cmd:x} {a} -> 0x{r.arg:x}"
                + (f" errno={r.err}" if r.ret else ""))
    if r.type == RecordType.DURATION:
        return f"{head} duration fd={r.fd} {r.arg} ns"
    if r.type != RecordType.IOCTL:
        return f"{head} type={r.type} (unknown record type)"
    res = f"-> {r.ret}" + (f" errno={r.err}" if r.err else "")
    if ev.error is not None:
        return f"{head} ioctl fd={r.fd} node={node} cmd=0x{r.cmd:x} DECODE-ERROR {ev.error} {res}"
    call = ev.call_out or ev.call_in
    if call is None:  # the decoder made no call of it and said no error: never expected
        return f"{head} ioctl fd={r.fd} node={node} cmd=0x{r.cmd:x} (not decoded) {res}"
    s = f"{head} ioctl fd={r.fd} node={node} {call.kind} {call.name}"
    if ev.op_name:
        s += f" [{ev.op_name}]"
    if call.value is not None:
        s += " " + _render(abi, call.value)
    nv = ev.nested_out or ev.nested_in
    if nv is not None:
        s += f" | {nv.spec.name}{{{_render(abi, nv)}}}"
    return s + " " + res


class TraceStats(TypedDict):
    records: Counter[str]
    nodes: Counter[str]
    escapes: Counter[str]
    uvm: Counter[str]
    classes: Counter[str]
    controls: Counter[str]
    statuses: Counter[str]
    unknown: Counter[str]
    unpublished: set[str]
    errors: list[str]


def stats(abi: DriverABI, records: Iterable[Record]) -> TraceStats:
    """Counts by node, escape, UVM command, class, control and status, and what the tables
    do not know: `unknown` counts every escape, UVM command, class or control without a
    table entry, and every control NVIDIA publishes no header for (named by its range,
    "… (unpublished: no published layout)"); `unpublished` holds the keys of `unknown` that
    are such controls. Anything else in `unknown` is a gap in the tables."""
    dec = TraceDecoder(abi)
    out = TraceStats(records=Counter(), nodes=Counter(), escapes=Counter(), uvm=Counter(),
                     classes=Counter(), controls=Counter(), statuses=Counter(),
                     unknown=Counter(), unpublished=set(), errors=[])
    for i, rec in enumerate(records):
        ev = dec.decode(rec)
        try:
            out["records"][RecordType(rec.type).name.lower()] += 1
        except ValueError:
            out["records"][f"type{rec.type}"] += 1
        if rec.type == RecordType.OPEN and ev.node is not None:
            out["nodes"][f"open {ev.node.name.lower()}"] += 1
        if rec.type != RecordType.IOCTL:
            continue
        out["nodes"][ev.node.name.lower() if ev.node is not None else "?"] += 1
        if ev.error is not None:
            out["errors"].append(f"#{i} @{rec.offset}: {ev.error}")
            continue
        c = ev.call_in
        if c is None:
            continue
        if c.spec is None:
            out["unknown"][c.name] += 1
        (out["uvm"] if c.kind == "uvm" else out["escapes"])[c.name] += 1
        v = (ev.call_out or c).value
        if c.name == "NV_ESC_RM_CONTROL" and v is not None and c.value is not None:
            out["controls"][ev.op_name] += 1
            out["statuses"][_status.name(v.status)] += 1
            op = abi.control_op(c.value.cmd)
            if op.unpublished:
                key = f"{op.name} (0x{op.number:x}, unpublished: no published layout)"
                out["unknown"][key] += 1
                out["unpublished"].add(key)
                continue
        elif c.name == "NV_ESC_RM_ALLOC" and v is not None:
            out["classes"][ev.op_name] += 1
            out["statuses"][_status.name(v.status)] += 1
        if ev.op_name.startswith("UNKNOWN"):
            out["unknown"][ev.op_name] += 1
        if ev.ref is not None and ev.ref.spec is None and ev.ref.size \
                and not ev.op_name.startswith("UNKNOWN"):
            out["unknown"][f"{ev.op_name} (no param layout)"] += 1
    return out
