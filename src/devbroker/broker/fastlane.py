"""The control lane: the broker's decision for the most common CUDA/NVML call, made in a
few dictionary lookups instead of the general steps (issues 12 and 14).

Most of what CUDA and NVML send is NV_ESC_RM_CONTROL with a control whose row changes
nothing and whose parameter block holds nothing the broker looks at (`rules.simple_control`:
173 of the 231 controls of a PyTorch run). For those the general path (core.Broker.
_ioctl_steps -> handlers.rm_control) decodes the NVOS54 header into objects, walks the rule
tables through generator layers and effects, and ends by copying the parameter block to the
driver and back; on the H200 that cost ~200 µs per call against the driver's ~17 µs.

The lane answers one question, `ControlLane.admit`: would the general path run this call on
the driver unchanged (or with only a post-hook on the answer)? It checks, from the 32-byte
header the front end read into its own memory, everything the general path checks before it
would call the driver — the session and its tenant (not revoked, the same sandbox, the GPU
not revoked), the escape row (RM_CONTROL allowed, on this node), the client and the object
(the tenant's, on a GPU it still has), the control row (allowed, granted, not reserved by the
driver), the parameter size (the layout's) and the parameter pointer (not NULL) — and takes
the tenant's rate-limit token last. Anything else — a refusal, an unknown client (adoption),
a broker answer or run, a charge, a control with an fd or a pointer inside an array in its
parameters, an empty token bucket — is `None`: the front end sends the call down the
general path, which makes every refusal with its audit record. So the lane can only ever
allow what the general path allows, and never refuses anything itself.

*Checked* controls (issue 14: NVML's GPU-id controls cost 150–330 µs each on the H200 down
the general path): a control whose parameters name client handles, GPU ids or pointers, or
whose row has a pre-hook, is admitted on its header and then `ControlLane.check`ed on the
front end's private copy of its parameters before the driver call — the same tests, in
the same order, as handlers.rm_control (every client handle the tenant's, the pre-hook,
which may rewrite the copy, every GPU id the tenant's), every pointer NULL (so the driver
touches no memory but the copy; a buffer behind one goes the general way, which copies
it), and the rate token last. A failed check is `False`: the general way again.

What the lane leaves to the front end: the private copies (header and parameters read once
into broker memory, the driver sees only those, the tenant's memory is written after), the
check that the caller is still the thread that made the call, and the driver call itself
(`Backend.run_control`). `tests/test_fastlane.py` runs every control of the recorded PyTorch
and NVML traces through both paths and compares the decisions.
"""
from __future__ import annotations

import struct
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from devbroker.abi import ioc
from devbroker.abi import status as nvstatus
from devbroker.abi.driver import NV_IOCTL_MAGIC
from devbroker.abi.errors import DecodeError
from devbroker.abi.nodes import NodeKind
from devbroker.backends.base import DriverResult

from . import handlers, rewrite, rules
from .effects import STATE_LOCK
from .refusal import Refusal

if TYPE_CHECKING:
    from devbroker.abi.driver import DriverABI

    from .core import Broker, Session
    from .interface import Caller
    from .objects import RmClient

RM_CONTROL = "NV_ESC_RM_CONTROL"


@dataclass(frozen=True)
class Header:
    """Where NVOS54's fields are in one driver version's layout (read from its table)."""
    ioctl_cmd: int  # the ioctl number: _IOWR('F', nr, sizeof(NVOS54_PARAMETERS))
    size: int
    unpack: Callable[[bytes], tuple]  # -> (hClient, hObject, cmd, params, paramsSize)
    params_offset: int  # the params pointer (replaced by the broker's copy's address)
    status_offset: int


_HEADERS: dict[Any, Header | None] = {}
_HEADERS_LOCK = threading.Lock()


def header_of(abi: DriverABI) -> Header | None:
    """NVOS54's layout in `abi`, or None when its table has no RM_CONTROL (the lane is
    then off for that version)."""
    known = _HEADERS.get(abi, False)
    if known is not False:
        return known
    with _HEADERS_LOCK:
        hdr = None
        for nr, spec in abi.escapes.items():
            if spec.name != RM_CONTROL or spec.params is None:
                continue
            f = spec.params.by_name
            need = ("hClient", "hObject", "cmd", "params", "paramsSize", "status")
            if all(n in f for n in need):
                unpack = _fixed_unpacker([f[n].offset for n in need[:5]],
                                         ["I", "I", "I", "Q", "I"])
                size = spec.params.size
                if unpack is not None:
                    hdr = Header(ioc.ioc(ioc.IOC_READ | ioc.IOC_WRITE, NV_IOCTL_MAGIC, nr, size), size, unpack,
                                 f["params"].offset, f["status"].offset)
            break
        _HEADERS[abi] = hdr
        return hdr


def _fixed_unpacker(offsets: list[int], kinds: list[str]) -> Callable[[bytes], tuple] | None:
    """One struct.unpack_from for fields at these offsets (pad bytes between them)."""
    order = sorted(zip(offsets, kinds, range(len(kinds))))
    fmt, pos = "<", 0
    for off, kind, _i in order:
        if off < pos:
            return None
        fmt += f"{off - pos}x" if off > pos else ""
        fmt += kind
        pos = off + struct.calcsize("<" + kind)
    s = struct.Struct(fmt)
    perm = [i for _o, _k, i in order]
    if perm == list(range(len(kinds))):
        return lambda b, _u=s.unpack_from: _u(b)

    def unpack(b: bytes, _u=s.unpack_from, _p=perm) -> tuple:
        got = _u(b)
        out = [0] * len(got)
        for j, i in enumerate(_p):
            out[i] = got[j]
        return tuple(out)
    return unpack


def _usable_session(b: Broker, session_id: int, caller: Caller) -> Session | None:
    """The session, when the general path would go on with it: open, its tenant in the
    running policy, and the caller in the opener's sandbox (core.Broker._same_sandbox
    without its refusal: same uid, same pid namespace; an unknown namespace on either side
    goes the general way, which reads it). Both lanes start here."""
    s = b.sessions.get(session_id)
    if s is None or s.closed or s.tenant.revoked:
        return None
    if caller.uid != s.caller.uid or (s.pidns is not None and (
            caller.pidns is None or caller.pidns != s.pidns)):
        return None
    return s


@dataclass(slots=True)
class Admitted:
    """A control the general path would run as sent: what the front end needs to run it."""
    session: Session
    abi: DriverABI
    header: Header
    client: RmClient
    h_object: int
    cmd: int
    params_ptr: int
    params_size: int
    gpu: int | None
    post: Callable | None  # the row's post-hook (rewrite.py), run on an NV_OK answer
    mark: Any = None  # the call counters' (callstats._CountedLane): start and row
    booked: bool = False  # the tenant's request already counted (ControlLane.book)
    # A checked control (ControlLane.check must pass on the private parameters before the
    # driver runs it): its row's pre-hook, and the parameters as checked (for the post-hook)
    checked: bool = False
    pre: Callable | None = None
    params_value: Any = None
    null_ptrs: tuple = ()  # offsets of pointer fields that must be NULL (checked controls)


class ControlLane:
    """The broker's side of the control lane (module docstring). One per broker; its methods
    run on seccomp listener threads and take the state lock themselves."""

    def __init__(self, broker: Broker):
        self.broker = broker
        escape = rules.ESCAPES.get(RM_CONTROL)
        # The lane mirrors handlers.rm_control: if the escape row ever gets another handler,
        # a rewrite of its own or an in-caller reason, the lane is off rather than wrong.
        self.escape = (escape if escape is not None and escape.handler is handlers.rm_control
                       and escape.rewrite is None and not escape.in_caller else None)
        self.admitted = 0
        self.passed = 0  # declined: sent down the general path
        self._plans: dict[tuple, tuple | None] = {}  # (abi, cmd) -> _plan's answer

    def ioctl_cmds(self, versions) -> frozenset[int]:
        """The ioctl numbers the lane may take, over the given ABIs (front ends test the
        number before reading anything)."""
        out = set()
        for abi in versions:
            h = header_of(abi)
            if h is not None:
                out.add(h.ioctl_cmd)
        return frozenset(out)

    def admit(self, session_id: int, caller: Caller, ioctl_cmd: int,
              hdr: bytes, max_params: int | None = None) -> Admitted | None:
        """The call if the general path would run it on the driver as sent; None sends it
        down the general path (which decides it again, refusals and audit included).
        max_params: the largest parameter block the front end can copy (a larger one goes
        the general way, before a rate token is taken)."""
        with STATE_LOCK:
            got = self._admit(session_id, caller, ioctl_cmd, hdr, max_params)
            if got is None:
                self.passed += 1
            else:
                self.admitted += 1
        return got

    def _admit(self, session_id: int, caller: Caller, ioctl_cmd: int,
               hdr: bytes, max_params: int | None = None) -> Admitted | None:
        b = self.broker
        escape = self.escape
        if escape is None:
            return None
        s = _usable_session(b, session_id, caller)
        if s is None:
            return None
        tenant = s.tenant
        if s.node is NodeKind.GPU and s.minor not in tenant.gpus:
            return None
        if not b.backend.can_run_control(s.file):  # a relayed file: the general way
            return None
        abi = b._abi(s)
        h = header_of(abi)
        if h is None or ioctl_cmd != h.ioctl_cmd or len(hdr) != h.size:
            return None
        caps = tenant.policy.capabilities
        if not escape.granted(caps) or s.node not in escape.nodes:
            return None
        h_client, h_object, cmd, params_ptr, params_size = h.unpack(hdr)
        client = tenant.clients.get(h_client)
        if client is None:  # not the tenant's, or not adopted yet: the general path decides
            return None
        obj = client.objects.get(h_object)
        if obj is None or (obj.gpu is not None and obj.gpu not in tenant.gpus):
            return None
        plan = self._plan(abi, cmd)
        if plan is None or plan[0] not in caps:
            return None
        _cap, post, size, pre, checked, ptrs = plan
        if params_size != size or params_ptr == 0 or (
                max_params is not None and size > max_params):
            return None
        # Last, as the general path's own first step does: a token, or the general way (it
        # waits for one there). A checked control takes it in `check`, after its last test.
        if not checked and not tenant.limiter.try_acquire():
            return None
        return Admitted(s, abi, h, client, h_object, cmd, params_ptr, params_size, obj.gpu,
                        post, checked=checked, pre=pre, null_ptrs=ptrs)

    def check(self, adm: Admitted, params: bytearray) -> bool:
        """For a checked control, on the front end's private copy of its parameters, before
        the driver call: what handlers.rm_control does between reading the parameters and
        calling the driver — every client handle the tenant's (`Broker._check_clients`), the
        row's pre-hook (which may rewrite `params`, in place here), every GPU id the
        tenant's (`rewrite.require_own_gpu_ids`) — then the rate token. False: the call
        goes the general way, which decides it again from the start and makes the refusal
        with its audit record (the lane never refuses anything itself)."""
        with STATE_LOCK:
            b, s = self.broker, adm.session
            if s.closed or s.tenant.revoked:
                return False
            for off in adm.null_ptrs:  # a buffer behind a pointer: the general path copies it
                if any(params[off:off + 8]):
                    self._declined()
                    return False
            spec = adm.abi.control(adm.cmd).params
            where = f"RM_CONTROL {adm.abi.control_name(adm.cmd)}"
            try:
                value = spec.decode(params)
                b._check_clients(s, value, where=where)
                if adm.pre is not None:
                    value = adm.pre(rewrite.ControlContext(
                        b, s, adm.abi, adm.cmd, value, adm.gpu, adm.client, adm.h_object),
                        value)
                rewrite.require_own_gpu_ids(b, s, adm.abi, adm.cmd, value)
            except (Refusal, DecodeError):
                self._declined()
                return False
            if adm.pre is not None:
                out = value.encode()
                if len(out) != len(params):
                    return False
                params[:] = out
            if not s.tenant.limiter.try_acquire():
                return False
            adm.params_value = value
            return True

    def _declined(self) -> None:
        """An admitted call its check sent the general way after all (for the counters)."""
        self.admitted -= 1
        self.passed += 1

    def _plan(self, abi: DriverABI, cmd: int) -> tuple | None:
        """(capability, post-hook, parameter size, pre-hook, checked, pointer offsets) of a
        control the lane may take in this ABI, None for one it may not. It may take a
        control whose row is on the allowlist, not reserved by the driver's flags, neither
        answered, run nor charged by the broker, and whose layout has no fd and no pointer
        inside an array (rules.lane_pointers). It is *checked* (ControlLane.check on the
        private copy before the driver call) when its row has a pre-hook or its layout
        holds something the broker looks at: client handles, GPU ids, pointers (which must
        then be NULL); else the header alone decides. A post-hook on the answer is allowed.
        The tables do not change while the broker runs, so this is computed once per (ABI,
        control) on the allowlist (a number not on it costs a lookup, and is not
        remembered)."""
        row = rules.CONTROLS.get(cmd)
        if row is None:
            return None
        key = (abi, cmd)
        try:
            return self._plans[key]
        except KeyError:
            pass
        plan = None
        rule = rules.control_rule(cmd, abi)
        op = abi.control(cmd)
        ptrs = (rules.lane_pointers(op.params)
                if op is not None and op.params is not None else None)
        if (rule is not None and not rule.driver_flag
                and rule.relay_if is None and rule.run is None and not rule.charge
                and ptrs is not None and op.size):
            checked = rule.pre is not None or not rules.plain_layout(op.params)
            plan = (rule.capability, rule.post, op.size, rule.pre, checked, ptrs)
        self._plans[key] = plan
        return plan

    def table_patch(self, adm: Admitted):
        """The row's post-hook as data (rewrite.TablePatch) for a front end that applies it
        itself after an NV_OK answer, with the values as of now; None when the hook has no
        such form or a recording wants the answer through `finish`."""
        as_patch = rewrite.AS_TABLE_PATCH.get(adm.post)
        if as_patch is None or self.broker.recorder is not None:
            return None
        with STATE_LOCK:
            return as_patch(adm.session, adm.gpu, adm.abi.control(adm.cmd).params)

    def needs_finish(self, adm: Admitted, patched: bool = False) -> bool:
        """Whether `finish` has anything to do besides counting the request: a post-hook
        (unless the front end applies it as a TablePatch), or a recording."""
        return (adm.post is not None and not patched) or self.broker.recorder is not None

    def answered(self, adm: Admitted, err: int, end_ns: int) -> None:
        """A call the front end answered without `finish` was answered at end_ns
        (time.perf_counter_ns's clock) with errno err: nothing to do here (the call
        counters' wrapper records its row)."""

    def book(self, adm: Admitted) -> None:
        """Count the request now, for a front end that will not call `finish` (nothing
        else to do there: `needs_finish` False)."""
        with STATE_LOCK:
            adm.session.tenant.requests += 1
        adm.booked = True

    def finish(self, adm: Admitted, hdr: bytes, params_in: bytes, ret: int, err: int,
               hdr_out: bytes, params_out: bytearray) -> bytes:
        """After the driver answered: the books (a request of the tenant's; the recording,
        when the broker keeps one), and the parameters the tenant gets back: through the
        row's post-hook when there is one and the driver said NV_OK, as handlers.rm_control
        does. (Nothing is written to the tenant when err is set.)"""
        h = adm.header
        status = int.from_bytes(hdr_out[h.status_offset:h.status_offset + 4], "little")
        with STATE_LOCK:
            s = adm.session
            if not adm.booked:
                s.tenant.requests += 1
            out = bytes(params_out)
            if adm.post is not None and not err and status == nvstatus.NV_OK:
                spec = adm.abi.control(adm.cmd).params
                asked = adm.params_value if adm.checked else spec.decode(params_in)
                ctx = rewrite.ControlContext(self.broker, s, adm.abi, adm.cmd, asked,
                                             adm.gpu, adm.client, adm.h_object)
                out = adm.post(ctx, spec.decode(out)).encode()
            recorder = self.broker.recorder
        if recorder is not None:
            call = adm.abi.decode_ioctl(s.node, h.ioctl_cmd, hdr)
            recorder.ioctl(s, call, params_in,
                           DriverResult(arg=hdr_out, nested=out, result=ret, errno=err))
        return out


class ContinueLane:
    """The same idea for the UVM commands the driver binds to the caller (issue 12): ~120
    of a CUDA init's ioctls are UVM commands whose row lets the kernel continue them in the
    tenant once the broker has checked the RM clients they name (handlers.uvm). `admit`
    answers whether the general steps would continue this one: the session is a real
    driver file of the tenant's (UVM node), the command's row is `handlers.uvm` with an
    in-caller reason and no fd fields (UVM_MM_INITIALIZE names a file: general way), granted
    to the tenant, and every client handle in the argument is 0 or the tenant's
    (`Broker._check_clients`, the same function); the rate token is taken last. A refusal
    is never made here: the general steps make it, with the audit record. The front end
    refuses to continue for a caller that could hold CAP_SYS_ADMIN (the general rule) and
    answers CONTINUE; what a racing thread can do with the re-read argument is the row's
    `race` (docs/security.md), as for the general path."""

    def __init__(self, broker: Broker):
        self.broker = broker
        self.admitted = 0
        self.passed = 0
        self._plans: dict[tuple, tuple | None] = {}  # (abi, cmd) -> (layout, row) or None

    def _plan(self, abi: DriverABI, cmd: int) -> tuple | None:
        key = (abi, cmd)
        try:
            return self._plans[key]
        except KeyError:
            pass
        spec = abi.uvm(cmd)
        plan = None
        if spec is not None and spec.params is not None and spec.size:
            row = rules.UVM_COMMANDS.get(spec.name)
            if (row is not None and row.handler is handlers.uvm and row.in_caller
                    and row.rewrite is None and not row.fd_fields(spec.params)):
                plan = (spec, row)
        if len(self._plans) < 4096:  # command numbers come from the tenant
            self._plans[key] = plan
        return plan

    def arg_size(self, session_id: int, cmd: int) -> int | None:
        """The argument size to read for this command on this session, None when the lane
        cannot take it at all (the front end then reads nothing)."""
        with STATE_LOCK:
            s = self.broker.sessions.get(session_id)
            if (s is None or s.closed or s.node is not NodeKind.UVM
                    or not getattr(s.file, "runs_in_caller", False)):
                return None
            plan = self._plan(self.broker._abi(s), cmd)
            return plan[0].size if plan is not None else None

    def admit(self, session_id: int, caller: Caller, cmd: int, arg: bytes) -> bool:
        with STATE_LOCK:
            ok = self._admit(session_id, caller, cmd, arg)
            if ok:
                self.admitted += 1
            else:
                self.passed += 1
            return ok

    def _admit(self, session_id: int, caller: Caller, cmd: int, arg: bytes) -> bool:
        b = self.broker
        s = _usable_session(b, session_id, caller)
        if (s is None or s.node is not NodeKind.UVM
                or not getattr(s.file, "runs_in_caller", False)):
            return False
        tenant = s.tenant
        plan = self._plan(b._abi(s), cmd)
        if plan is None:
            return False
        spec, row = plan
        if not row.granted(tenant.policy.capabilities) or s.node not in row.nodes \
                or len(arg) != spec.size:
            return False
        try:
            b._check_clients(s, spec.params.decode(arg), where=spec.name, zero_ok=True)
        except Refusal:
            return False
        if not tenant.limiter.try_acquire():
            return False
        tenant.requests += 1
        tenant.continued += 1
        return True
