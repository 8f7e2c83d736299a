"""Differential replay: a recorded real session, call by call, against a driver backend.

Each ioctl of an nvtrace recording (the real driver's own answers: tests/data, and the
broker's `--record` files of the H200 runs in tests/data) is sent to a backend as the broker
would send it, with the handles the real driver gave out replaced by the ones the backend
gave out and fd fields pointing at the backend's files; the answer is compared with the
recorded one: the errno, every NV_STATUS field, and every other field of the answer
(top-level argument and nested parameters; a handle field through the handle map).

Differences are grouped by (call, what) and explained by EXPECTED: each entry says which
differences it covers and why the emulator answers otherwise on purpose (docs/emulator.md,
"Differences from the real driver", is generated from it). `explain()` returns what no entry
covers: the emulator must be fixed, or an entry added with its reason.
"""
from __future__ import annotations

import fnmatch
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from devbroker.abi import status as nvs
from devbroker.abi.errors import DecodeError
from devbroker.abi.nodes import NodeKind
from devbroker.abi.nvtrace import RecordType
from devbroker.abi.spec import StructSpec, StructValue
from devbroker.abi.traceview import TraceDecoder
from devbroker.backends.base import DriverCall


@dataclass
class Difference:
    index: int  # record number in the recording
    call: str  # "RM_CONTROL NV2080_CTRL_CMD_FB_GET_INFO_V2", "NV_ESC_CARD_INFO", "open …"
    what: str  # "errno", "status", "field fbInfoList[3].data", "open", "mmap"
    real: Any
    emulated: Any
    op: int | None = None  # the control or class number (RM_CONTROL / RM_ALLOC)

    @property
    def key(self) -> tuple[str, str]:
        return self.call, self.what


# ---------------------------------------------------------------------- struct helpers
_handle_offsets: dict[tuple[str, int], list[int]] = {}


def handle_offsets(spec: StructSpec, base: int = 0) -> list[int]:
    """Absolute offsets of every handle field, array elements and nested structs included."""
    key = (spec.name, spec.size)
    if base == 0 and key in _handle_offsets:
        return _handle_offsets[key]
    out: list[int] = []
    for f in spec.fields:
        o = base + f.offset
        if f.kind == "handle":
            out.append(o)
        elif f.kind == "struct":
            out += handle_offsets(f.spec, o)
        elif f.kind == "array":
            if isinstance(f.elem, StructSpec):
                for i in range(f.count):
                    out += handle_offsets(f.elem, o + i * f.elem.size)
            elif f.elem == "handle":
                out += [o + 4 * i for i in range(f.count)]
    if base == 0:
        _handle_offsets[key] = out
    return out


def map_handles(buf: bytes, spec: StructSpec | None, hmap: dict[int, int]) -> bytes:
    if spec is None or not hmap:
        return buf
    b = bytearray(buf)
    for o in handle_offsets(spec):
        if o + 4 <= len(b):
            h = int.from_bytes(b[o:o + 4], "little")
            if h in hmap:
                b[o:o + 4] = hmap[h].to_bytes(4, "little")
    return bytes(b)


def leaves(v: StructValue, prefix: str = ""):
    """(path, field kind, value) of every scalar and byte field, arrays element by element."""
    for f in v.spec.fields:
        x = v._get(f)
        p = f"{prefix}{f.name}"
        if isinstance(x, StructValue):
            yield from leaves(x, p + ".")
        elif isinstance(x, list):
            for i, e in enumerate(x):
                if isinstance(e, StructValue):
                    yield from leaves(e, f"{p}[{i}].")
                else:
                    yield f"{p}[{i}]", f.elem, e
        else:
            yield p, f.kind, x


# ---------------------------------------------------------------------- the replay
@dataclass
class Replay:
    backend: Any
    abi: Any
    files: dict[int, Any] = field(default_factory=dict)  # recorded fd -> backend file
    pids: dict[int, int] = field(default_factory=dict)  # recorded fd -> the pid that opened it
    hmap: dict[int, int] = field(default_factory=dict)  # real handle -> backend handle
    diffs: list[Difference] = field(default_factory=list)
    calls: Counter = field(default_factory=Counter)
    # real handles of objects the real driver made and the backend did not: a later call
    # on one of them differs as a consequence, and says so ("… on an object not made here")
    missing: set = field(default_factory=set)
    _op: int | None = None
    _orphan: bool = False

    def _diff(self, i, call, what, real, emu, op=None):
        if self._orphan:
            what += " (on an object the backend did not make)"
        self.diffs.append(Difference(i, call, what, real, emu, op))

    async def run(self, records) -> list[Difference]:
        dec = TraceDecoder(self.abi)
        for i, rec in enumerate(records):
            ev = dec.decode(rec)
            if rec.type == RecordType.OPEN:
                self._open(i, rec)
            elif rec.type == RecordType.CLOSE:
                f = self.files.pop(rec.fd, None)
                if f is not None:
                    self.backend.close(f)
            elif rec.type == RecordType.MMAP:
                self._mmap(i, rec)
            elif rec.type == RecordType.IOCTL:
                await self._ioctl(i, rec, ev)
        return self.diffs

    def _open(self, i, rec):
        self._orphan = False
        node = NodeKind.from_path(rec.path)
        name = rec.path.rsplit("/", 1)[-1]
        minor = int(name[6:]) if node is NodeKind.GPU else 0
        try:
            f = self.backend.open(node, minor)
            err = 0
        except OSError as e:
            f, err = None, e.errno
        real = rec.err if rec.ret < 0 else 0
        if (real == 0) != (err == 0):
            self._diff(i, f"open {name}", "open", real, err)
        if f is not None and rec.ret >= 0:
            self.files[rec.ret] = f
            self.pids[rec.ret] = rec.pid

    def _mmap(self, i, rec):
        self._orphan = False
        f = self.files.get(rec.fd)
        if f is None:
            return
        try:
            length, _flags, offset = rec.mmap_args
            self.backend.map_read(f, offset, min(length, 4096))
            err = 0
        except (OSError, DecodeError) as e:
            err = getattr(e, "errno", 0) or -1
        real = rec.err if rec.ret else 0
        if (real == 0) != (err == 0):
            self._diff(i, f"mmap of {f.node.name.lower()}", "mmap", real, err)

    async def _ioctl(self, i, rec, ev):
        if ev.error is not None or ev.call_in is None:
            self._diff(i, f"ioctl {rec.cmd:#x}", "decode", str(ev.error), None)
            return
        f = self.files.get(rec.fd)
        if f is None:  # a descriptor opened before the recording started
            return
        call = ev.call_in
        label, op = call.name, None
        if call.name == "NV_ESC_RM_CONTROL":
            label, op = f"RM_CONTROL {ev.op_name}", call.value.cmd
        elif call.name == "NV_ESC_RM_ALLOC":
            label, op = f"RM_ALLOC {self.abi.class_name(call.value.hClass)}", call.value.hClass
        self._op = op
        self.calls[label] += 1
        # a call naming an object the backend never made differs as a consequence
        hv = [int.from_bytes(call.encode()[o:o + 4], "little")
              for o in handle_offsets(call.value.spec)] if call.value is not None else []
        if ev.ref is not None and ev.ref.spec is not None and rec.xin:
            xb = rec.xin[:ev.ref.size]
            hv += [int.from_bytes(xb[o:o + 4], "little") for o in handle_offsets(ev.ref.spec)
                   if o + 4 <= len(xb)]
        self._orphan = any(h in self.missing for h in hv)
        # the call as the broker would pass it on: the backend's handles and files
        arg = map_handles(call.encode(), call.value.spec if call.value is not None else None,
                          self.hmap)
        emu_call = self.abi.decode_ioctl(ev.node, rec.cmd, arg, window=True)
        nested = None
        ref = ev.ref
        if ref is not None and rec.xin:
            raw = rec.xin[:ref.size]
            nested = map_handles(raw, ref.spec, self.hmap)
        fd_files = {}
        if emu_call.value is not None:
            for path in emu_call.value.spec.fields_of_kind("fd"):
                top = path.split(".")[0]
                if "." in path or "[" in path:
                    continue
                tf = self._fd_file(getattr(emu_call.value, top), rec.pid, top)
                if tf is not None:
                    fd_files[top] = tf
        embedded = {}
        if ref is not None and ref.spec is not None and nested is not None:
            pv = ref.spec.decode(nested)
            for fl in ref.spec.fields:
                if fl.kind == "ptr" and fl.points_to == "bytes" and getattr(pv, fl.name):
                    embedded[fl.name] = bytearray(getattr(pv, fl.size_field))
        dc = DriverCall(emu_call, nested=nested, fd_files=fd_files, abi=self.abi,
                        tgid=rec.pid, embedded=embedded)
        res = await self.backend.ioctl(f, dc)
        real_errno = rec.err if rec.ret < 0 else 0
        if real_errno != (res.errno or 0):
            self._diff(i, label, "errno", real_errno, res.errno, op)
            self._lost(call, rec, res)
            return
        if real_errno or not rec.out:
            return
        if self._compare_top(i, label, call, rec, res):
            self._lost(call, rec, res)
            return  # a status that differs says it all
        if ref is not None and ref.spec is not None and rec.xout and res.nested is not None:
            self._compare(i, label, ref.spec.decode(rec.xin[:ref.size]),
                          ref.spec.decode(rec.xout[:ref.size]),
                          ref.spec.decode(res.nested[:ref.size]), "")

    # the node kinds an fd field can name (the driver checks them: nv.c, escape.c, uvm)
    FD_KINDS = {"ctl_fd": (NodeKind.CTL,), "rmCtrlFd": (NodeKind.CTL,),
                "uvmFd": (NodeKind.UVM,), "fd": (NodeKind.CTL, NodeKind.GPU)}

    def _fd_file(self, fd: int, pid: int, fname: str = "fd"):
        """The backend file an fd field names. The broker's own recordings (--record) keep
        the relay's descriptor numbers in fd fields, which the recording never opened (or
        that collide with a session id of another kind): those resolve to the caller's most
        recently opened file of the kind the field takes (NVML opens a fresh nvidiactl just
        before RM_MAP_MEMORY; REGISTER_FD names the process's nvidiactl)."""
        kinds = self.FD_KINDS.get(fname, (NodeKind.CTL,))
        f = self.files.get(fd)
        if f is not None and f.node in kinds and self.pids.get(fd) == pid:
            return f
        for rfd in reversed(list(self.files)):
            cand = self.files[rfd]
            if self.pids.get(rfd) == pid and cand.node is kinds[0]:
                return cand
        return f

    def _lost(self, call, rec, res):
        """An allocation the real driver made and the backend refused: remember its handle."""
        if call.name in ("NV_ESC_RM_ALLOC",) and call.value is not None:
            out = call.value.spec.decode(rec.out[:call.value.spec.size])
            if out.status == nvs.NV_OK:
                self.missing.add(out.hObjectNew)
        elif call.name == "NV_ESC_RM_ALLOC_MEMORY" and call.value is not None:
            out = call.value.spec.decode(rec.out[:call.value.spec.size])
            if out.params.status == nvs.NV_OK:
                self.missing.add(out.params.hObjectNew)

    def _compare_top(self, i, label, call, rec, res) -> bool:
        if call.value is None:
            return False
        spec = call.value.spec
        n = min(len(rec.out), spec.size, len(res.arg))
        real_in = spec.decode(rec.in_[:n], partial=True)
        real_out = spec.decode(rec.out[:n], partial=True)
        emu_out = spec.decode(res.arg[:n], partial=True)
        return self._compare(i, label, real_in, real_out, emu_out, "", limit=n)

    def _compare(self, i, label, real_in, real_out, emu_out, prefix, limit=None) -> bool:
        """Compare one answer field by field; True when a status field differed (then only
        the status is reported: the data of a call that failed on one side says nothing)."""
        status_diff = False
        rows = []
        offs = {p: o for p, _f, o in real_out.spec.walk()}
        for (p, kind, ri), (_, _, ro), (_, _, eo) in zip(leaves(real_in), leaves(real_out),
                                                         leaves(emu_out)):
            if limit is not None:
                top = p.split(".")[0].split("[")[0]
                if offs.get(top, 0) >= limit:
                    continue
            if kind == "handle":
                if ro != ri and ro not in self.hmap:  # the driver gave out a handle
                    self.hmap[ro] = eo
                    continue
                if self.hmap.get(ro, ro) == eo:
                    continue
            if ro == eo:
                continue
            if kind == "status":
                status_diff = True
                self._diff(i, label, "status", nvs.name(ro), nvs.name(eo), self._op)
            else:
                rows.append((p, ro, eo))
        if status_diff:
            return True
        for p, ro, eo in rows:
            self._diff(i, label, f"field {prefix}{p}", ro, eo, self._op)
        return False


# ---------------------------------------------------------------------- explanations
@dataclass(frozen=True)
class Expected:
    """Differences the emulator makes on purpose: `call` and `what` are fnmatch patterns
    over Difference.call and .what; `reason` says why (it is what docs/emulator.md shows)."""
    call: str
    what: str
    reason: str
    real: str = "*"  # pattern over str(real value)
    emulated: str = "*"
    only: str = ""  # a named condition the table's owner checks too (see explain's `covers`)

    def covers(self, d: Difference) -> bool:
        return (fnmatch.fnmatchcase(d.call, self.call) and fnmatch.fnmatchcase(d.what, self.what)
                and fnmatch.fnmatchcase(str(d.real), self.real)
                and fnmatch.fnmatchcase(str(d.emulated), self.emulated))


def explain(diffs: list[Difference], expected, covers=None) -> tuple[dict, list[Difference]]:
    """(entry -> the differences it covers, the differences nothing covers)."""
    covers = covers or (lambda e, d: e.covers(d))
    used: dict[Expected, list[Difference]] = defaultdict(list)
    left = []
    for d in diffs:
        for e in expected:
            if covers(e, d):
                used[e].append(d)
                break
        else:
            left.append(d)
    return used, left


def summarize(diffs: list[Difference]) -> list[str]:
    by: dict[tuple[str, str], list[Difference]] = defaultdict(list)
    for d in diffs:
        by[d.key].append(d)
    out = []
    for (call, what), ds in sorted(by.items()):
        d = ds[0]
        out.append(f"{len(ds):5d}x {call}: {what}: real {_short(d.real)} emulated "
                   f"{_short(d.emulated)} (first at record #{d.index})")
    return out


def _short(x) -> str:
    if isinstance(x, (bytes, bytearray)):
        t = bytes(x).rstrip(b"\0")
        return (t[:24].hex() + ("…" if len(t) > 24 else "")) if t else "zeros"
    if isinstance(x, int) and x > 0xFFFF:
        return hex(x)
    return repr(x)


# ---------------------------------------------------------------------- the recorded machine
def recorded_gpus(records, abi) -> list[dict]:
    """The configuration facts of the recorded machine's GPUs, from its own answers: PCI
    location and device id (CARD_INFO), UUID (GET_GID_INFO, binary form), name
    (GET_NAME_STRING) and memory size (FB_GET_INFO_V2 TOTAL_RAM_SIZE, KiB), so that an
    emulated backend can be configured as that machine before the replay."""
    gpus: dict[int, dict] = {}
    dec = TraceDecoder(abi)
    for rec in records:
        ev = dec.decode(rec)
        if rec.type != RecordType.IOCTL or ev.error is not None or ev.call_out is None:
            continue
        c = ev.call_out
        if c.name == "NV_ESC_CARD_INFO":
            for k, e in enumerate(c.value.entries):
                if e.valid:
                    p = e.pci_info
                    gpus.setdefault(k, {}).update(
                        pci_bus_id=f"{p.domain:04x}:{p.bus:02x}:{p.slot:02x}.0",
                        pci_device_id=p.device_id)
        n = ev.nested_out
        if n is None or c.value.status != nvs.NV_OK:
            continue
        g = gpus.setdefault(0, {})
        if ev.op_name == "NV2080_CTRL_CMD_GPU_GET_GID_INFO" and n.flags & 0x3 == 0x2:
            import uuid as _uuid
            g["uuid"] = "GPU-" + str(_uuid.UUID(bytes=bytes(n.data)[:16]))
        elif ev.op_name == "NV2080_CTRL_CMD_GPU_GET_NAME_STRING" and n.gpuNameStringFlags == 0:
            g["name"] = bytes(n.gpuNameString.raw).split(b"\0", 1)[0].decode("ascii", "replace")
        elif ev.op_name == "NV2080_CTRL_CMD_FB_GET_INFO_V2":
            for e in n.fbInfoList[: n.fbInfoListSize]:
                if e.index == 0x08:  # NV2080_CTRL_FB_INFO_INDEX_TOTAL_RAM_SIZE, KiB
                    g["memory_bytes"] = e.data * 1024
    return [gpus[k] for k in sorted(gpus)]
