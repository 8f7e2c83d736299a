"""The control lane: the broker's decision for the most common CUDA/NVML calls — RM
controls, and RM allocations of the classes that need no more — made in a few dictionary
lookups instead of the general steps.

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

*Checked* controls (NVML's GPU-id controls cost 150–330 µs each on the H200 down
the general path): a control whose parameters name client handles, GPU ids or pointers, or
whose row has a pre-hook, is admitted on its header and then `ControlLane.check`ed on the
front end's private copy of its parameters before the driver call — the same tests, in
the same order, as handlers.rm_control (every client handle the tenant's, the pre-hook,
which may rewrite the copy, every GPU id the tenant's), every pointer NULL (so the driver
touches no memory but the copy; a buffer behind one goes the general way, which copies
it), and the rate token last. A failed check is `False`: the general way again.

*Allocations* (the allocation lane: a CUDA init's RM_ALLOCs cost ~330–520 µs
each over the driver down the general path on the H200, ~60 ms of its ~140 ms extra): an
NV_ESC_RM_ALLOC (NVOS64 or NVOS21 header) is admitted on its header the same way —
`decision._decide_alloc` checks what handlers.rm_alloc checks before the driver call: the
escape row, the client (the tenant's), the parent (one of its objects, on a GPU it still
has), the new handle (not one it holds), the class row (allowed, granted), the object limit,
no access rights asked for (NVOS64's pRightsRequested NULL), a parameter block of the
class's size (paramsSize 0, as CUDA sends it, makes the driver read its class's own size)
— for the classes `decision.alloc_plan` lets through: not a root client, not bound to the caller
through RM_ALLOC, whose class check reads only the call (LANE_CLASS_CHECKS) and whose
after-hook can be told from the header to have nothing to do (LANE_AFTER_HOOKS: a channel
of a tenant stopped for a high-priority one goes the general way). A class whose layout
names client handles or pointers, or with a class check, is checked on the private copy
(`_check_alloc`: client handles, the class check, pointers NULL; a device's deviceId
one of the tenant's GPUs, which the new object then belongs to). Device memory (charged
classes: NV01_MEMORY_LOCAL_USER, cudaMalloc's) is always checked: its size as the driver
takes it from the card must fit the tenant's quota on the parent's GPU, and a placeholder
object holds those bytes in the books from the check to `finish` (or `release`, when the
front end sends the call the general way after all), as handlers.rm_alloc's `_reserved`
holds them while the driver runs. `finish` puts the new
object into the tenant's books (the handle from the driver's answer, the parent's GPU)
before the tenant has the answer, as handlers.rm_alloc does; the front end's private copies
are the same as a control's (the header the driver reads names the broker's copy of the
parameters).

*Header-only calls*: an RM_FREE (NVOS00) of one of the tenant's objects — its root
client included — is admitted on its header (client and object the tenant's, as handlers.rm_free
requires for a file the broker holds; an object the books do not know goes the general
way) and `finish` drops the object and its children from the books after the driver's
NV_OK; a *plain escape* (`plain_escape`: NV_ESC_NUMA_INFO, NV_ESC_WAIT_OPEN_COMPLETE) is
admitted on its row alone, its argument being the whole call. Neither has a parameter
block (Header.params_offset -1): the front end reads and writes the header only.

What the lane leaves to the front end: the private copies (header and parameters read once
into broker memory, the driver sees only those, the tenant's memory is written after), the
check that the caller is still the thread that made the call, and the driver call itself
(`Backend.run_control`). `tests/test_fastlane.py` runs every control of the recorded PyTorch
and NVML traces through both paths and compares the decisions.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from devbroker.abi import registry
from devbroker.abi import status as nvstatus
from devbroker.abi.errors import DecodeError
from devbroker.abi.nodes import NodeKind
from devbroker.backends.base import DriverResult

from . import compute, handlers, rewrite, rules
from .effects import STATE_LOCK, HandOver, locked, run_blocking
from .refusal import Refusal

log = logging.getLogger("devbroker.fastlane")

if TYPE_CHECKING:
    from .core import Broker, Session
    from .interface import Caller

from .decision import (  # (the decision's data, for the lane's users)  # noqa: F401
    LANE_AFTER_HOOKS, LANE_CLASS_CHECKS, LANE_RUN_AFTER_HOOKS, RM_ALLOC, RM_CONTROL, RM_FREE,
    SETTLED_EMBEDDED, SETTLED_NULL_PTRS, Admitted, Header, LaneTables, _embedded_only,
    _usable_session, decide, fd_escape, header_of, headers_of, own_parent, plain_escape)

@dataclass(frozen=True)
class _HookContext:
    """What an after-hook run by the lane reads of its call (handlers.CallContext's part)."""
    broker: Any
    session: Any
    req: Any


class ControlLane:
    """The broker's side of the control lane (module docstring). One per broker; its methods
    run on seccomp listener threads and take the state lock themselves."""

    def __init__(self, broker: Broker):
        self.broker = broker
        self.tables = LaneTables()  # the escape rows the lane stands for, and the plans
        self.admitted = 0
        self.passed = 0  # declined: sent down the general path
        self.allocations = 0  # of the admitted: RM_ALLOCs (the allocation lane)
        self.frees = 0  # of the admitted: RM_FREEs
        self.settled = 0  # of the admitted: by a front end's settled decision (settleable)
        self._null_only: dict[tuple, bool] = {}  # (abi, class) -> _null_checked_only's
        self._same_escape: dict[int, bool] = {}  # ioctl number -> settleable_escape's
        self._no_refs: dict[int, tuple] = {}  # id(layout) -> (layout, _names_nothing's)

    def ioctl_cmds(self, versions) -> frozenset[int]:
        """The ioctl numbers the lane may take, over the given ABIs (front ends test the
        number before reading anything)."""
        out = set()
        for abi in versions:
            for h in headers_of(abi).values():
                t = self.tables
                row = {"control": t.control, "alloc": t.alloc, "free": t.free}.get(h.kind, True)
                if row is not None:
                    out.add(h.ioctl_cmd)
        return frozenset(out)

    def admit(self, session_id: int, caller: Caller, ioctl_cmd: int,
              hdr: bytes, max_params: int | None = None,
              run_hooks: bool = False) -> Admitted | None:
        """The call if the general path would run it on the driver as sent; None sends it
        down the general path (which decides it again, refusals and audit included).
        max_params: the largest parameter block the front end can copy (a larger one goes
        the general way, before a rate token is taken). run_hooks: the front end runs an
        allocation's after-hook of LANE_RUN_AFTER_HOOKS itself (`run_after`) before the
        tenant has its answer; without it such an allocation goes the general way."""
        with STATE_LOCK:
            got = decide(self.broker, self.tables, session_id, caller, ioctl_cmd, hdr,
                         max_params, run_hooks)
            # Last, as the general path's own first step does: a token, or the general way
            # (it waits for one there). A checked control or allocation takes it in `check`,
            # after its last test; an escape here, whatever its front end's check.
            if got is not None and (not got.checked or got.header.kind == "escape") \
                    and not got.session.tenant.limiter.try_acquire():
                got = None
            if got is None:
                self.passed += 1
            else:
                self.admitted += 1
                self.allocations += got.alloc is not None
                self.frees += got.header.kind == "free"
        return got

    def check(self, adm: Admitted, params: bytearray, embedded_ok: bool = False) -> bool:
        """For a checked control, on the front end's private copy of its parameters, before
        the driver call: what handlers.rm_control does between reading the parameters and
        calling the driver — every client handle the tenant's (`Broker.check_clients`), the
        row's pre-hook (which may rewrite `params`, in place here), every GPU id the
        tenant's (`rewrite.require_own_gpu_ids`) — then the rate token. False: the call
        goes the general way, which decides it again from the start and makes the refusal
        with its audit record (the lane never refuses anything itself).

        embedded_ok: the front end copies *embedded buffers* in and back itself (the native
        loop, which makes the driver call: FIFO_GET_CHANNELLIST's handle and channel lists,
        CUDA's 20 per init, ~435 µs each over the driver the general way on the H200). Their
        pointers may then be set: `adm.embedded` lists each buffer as the general path sizes
        it (handlers.embedded_buffers: the count field of this private copy), at most
        EMBEDDED_MAX buffers of EMBEDDED_BYTES in all; the front end reads them into copies
        of its own, gives the driver those, and writes them back after an NV_OK, as the
        general path does (`_read_embedded`, rm_control's write-back)."""
        if adm.alloc is not None:
            return self._check_alloc(adm, params)
        if adm.header.kind == "escape":  # an fd escape: only a front end that carries fds
            with STATE_LOCK:              # (it asks `fd_target` for each file instead)
                self._declined()
            return False
        with STATE_LOCK:
            b, s = self.broker, adm.session
            if not self._copy_usable(adm, params,
                                     embedded_ok and bool(adm.embedded_fields)):
                return False
            spec = adm.abi.control(adm.cmd).params
            where = f"RM_CONTROL {adm.abi.control_name(adm.cmd)}"
            try:
                value = spec.decode(params)
                b.check_clients(s, value, where=where)
                if adm.pre is not None:
                    value = adm.pre(rewrite.ControlContext(
                        b, s, adm.abi, adm.cmd, value, adm.gpu, adm.client, adm.h_object),
                        value)
                rewrite.require_own_gpu_ids(b, s, adm.abi, adm.cmd, value)
                embedded = self._embedded(adm, value) if embedded_ok else ()
            except (Refusal, DecodeError):
                self._declined()
                return False
            if embedded is None:
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
            adm.embedded = embedded
            return True

    def unknown_client(self, session_id: int, ioctl_cmd: int, hdr: bytes) -> int | None:
        """The root client a control, allocation or free header names on a ctl file when the
        tenant does not hold it yet but may have allocated it itself (a continued call the
        broker did not see answered: Broker.may_adopt); None else. A front end that holds
        a duplicate of the file may then have the broker adopt it
        (`Broker.adopt_client_here`) before `admit`, which sends a call of an unknown
        client the general way (where the same adoption is made)."""
        with STATE_LOCK:
            b = self.broker
            s = b.sessions.get(session_id)
            if s is None or s.closed or s.node is not NodeKind.CTL:
                return None
            h = headers_of(b.abi_of(s)).get(ioctl_cmd)
            if h is None or len(hdr) != h.size or h.kind not in ("control", "alloc", "free"):
                return None
            fields = h.unpack(hdr)
            if h.kind == "alloc" and fields[3] in handlers.ROOT_CLIENT_CLASSES:
                return None  # (a new root client: nothing to adopt yet)
            client = fields[0]
            if not client or client in s.tenant.clients or not b.may_adopt(s, client):
                return None
            return client

    def fd_target(self, adm: Admitted, session_id: int | None) -> bool:
        """For an fd escape (`fd_escape`) in a front end that carries fds: whether the file
        an fd field names — found by the front end from its own duplicate of that very file
        — is one of the tenant's NVIDIA files (`Broker._translate_fds`'s test); the front
        end then gives the driver that duplicate. False: the general way (which refuses
        with its record)."""
        with STATE_LOCK:
            s = adm.session
            ok = (not s.closed and not s.tenant.revoked
                  and self.broker.tenant_file(s.tenant, session_id) is not None)
            if not ok:
                self._declined()
            return ok

    EMBEDDED_MAX = 4  # buffers per control (native/lane.c DVB_EMBED_MAX)
    EMBEDDED_BYTES = 64 << 10  # in all (CUDA's channel lists: 2 x 4 bytes per channel)

    def _embedded(self, adm: Admitted, value) -> tuple | None:
        """The embedded buffers the check's copy names: ((offset, pointer, bytes), ...) for
        each set pointer field of rules.lane_embedded, sized as the general path sizes them;
        None when they are more or larger than a front end carries (the general way)."""
        if not adm.embedded_fields:
            return ()
        sizes = dict(handlers.embedded_buffers(adm.abi, value))
        out = tuple((off, int(getattr(value, name)), sizes[name])
                    for off, name in adm.embedded_fields if name in sizes)
        if len(out) > self.EMBEDDED_MAX or sum(n for _o, _p, n in out) > self.EMBEDDED_BYTES:
            return None
        return out

    def _check_alloc(self, adm: Admitted, params: bytearray) -> bool:
        """A checked allocation, on the private copy of its parameters: what
        handlers.rm_alloc does between reading them and calling the driver — every client
        handle the tenant's, then the class's own check — and the rate token last. False:
        the general way (which refuses, with the audit record)."""
        with STATE_LOCK:
            b, s = self.broker, adm.session
            if not self._copy_usable(adm, params):
                return False
            where = f"RM_ALLOC {adm.abi.class_name(adm.cmd)}"
            try:
                value = adm.abi.rm_class(adm.cmd).params.decode(params)
                b.check_clients(s, value, where=where)
                if adm.alloc.check is not None:
                    adm.alloc.check(None, handlers.AllocCall(adm.cmd, adm.client,
                                                             adm.client.handle, value, where))
                charge = handlers._alloc_charge(value) if adm.alloc.charge else 0
            except (Refusal, DecodeError):
                self._declined(adm)
                return False
            if adm.cmd == handlers.DEVICE_CLASS:
                # handlers.rm_alloc's device test: the driver's device instance names one of
                # the tenant's GPUs, which the new object belongs to (NVML allocates a
                # device per init: ~570 µs over the driver the general way on the H200)
                gpu = b.backend.gpu_index_of_instance(int(value.deviceId))
                if gpu is None or gpu not in s.tenant.gpus:
                    self._declined(adm)
                    return False
                adm.gpu = gpu
            if adm.alloc.charge:
                # handlers.rm_alloc's quota test (b._reserved): the size as the driver takes
                # it from the card, against what the tenant holds on the parent's GPU
                # including the other allocations in flight; a refusal is the general way's
                gpu, tenant = adm.gpu, s.tenant
                if (gpu is None or adm.h_object not in adm.client.objects
                        or (int(value.size) > 0 and not charge)
                        or tenant.used().get(gpu, 0) + charge > tenant.quota(gpu)):
                    self._declined(adm)
                    return False
            if not s.tenant.limiter.try_acquire():
                return False
            if adm.alloc.charge and charge:
                adm.charge = charge
                adm.reserved = b.placeholder_handle()
                adm.client.add(adm.reserved, adm.cmd, adm.h_object, gpu=adm.gpu,
                               charged=charge)
            adm.params_value = value
            return True

    def sent_back(self, adm: Admitted) -> None:
        """A checked call whose check passed but which its front end then sent the general
        way (an embedded buffer it could not read): counted as declined, not admitted, as a
        call the check sends there is."""
        with STATE_LOCK:
            self._declined(adm)

    def release(self, adm: Admitted | None) -> None:
        """An admitted allocation that will not reach `finish` (the front end sent it the
        general way after its check, or its caller went away): the quota it held is given
        back. Safe to call more than once, and for any admitted call."""
        if adm is None or not adm.reserved:
            return
        with STATE_LOCK:
            if adm.reserved:
                adm.client.remove(adm.reserved)
                adm.reserved = 0

    def _copy_usable(self, adm: Admitted, params: bytearray, embedded_ok: bool = False) -> bool:
        """What `check` and `_check_alloc` test first (under the state lock): the session
        still open, the tenant still in the policy, and every pointer field of the private
        copy NULL (a buffer behind one goes the general way, which copies it) — but those
        of embedded buffers when the front end carries them (embedded_ok)."""
        s = adm.session
        if s.closed or s.tenant.revoked:
            return False
        carried = {off for off, _name in adm.embedded_fields} if embedded_ok else ()
        for off in adm.null_ptrs:
            if off not in carried and any(params[off:off + 8]):
                self._declined(adm)
                return False
        return True

    def _declined(self, adm: Admitted | None = None) -> None:
        """An admitted call its check sent the general way after all (for the counters)."""
        self.admitted -= 1
        self.passed += 1
        if adm is not None and adm.alloc is not None:
            self.allocations -= 1

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
        return (adm.alloc is not None or adm.header.kind == "free" or adm.answered
                or (adm.post is not None and not patched) or self.broker.recorder is not None)

    def books_only(self, adm: Admitted) -> bool:
        """Whether `finish` only writes the books — an allocation's new object and the quota
        it held, a free's removal, the request counted — and gives the tenant back the
        driver's answer unchanged: then a front end may call it after the tenant has its
        answer, provided no decision is made in between on books that lack it
        (native/lane.c FINISH_AFTER)."""
        return ((adm.alloc is not None or adm.header.kind == "free") and not adm.answered
                and adm.post is None and self.broker.recorder is None
                and (adm.alloc is None or adm.alloc.after not in LANE_RUN_AFTER_HOOKS))

    def answered(self, adm: Admitted, err: int, end_ns: int) -> None:
        """A call the front end answered without `finish` was answered at end_ns
        (time.perf_counter_ns's clock) with errno err: nothing to do here (the call
        counters' wrapper records its row)."""

    def settleable(self, adm: Admitted) -> bool:
        """Whether this admitted control's decision may be *settled*: repeated by a front
        end, without asking again, for the same control on the same object until the books
        say that something it read changed (objects.BOOKS: the policy epoch, the ring of
        removals; native/lane.c, struct dvb_settled). An allocation: `_settleable_alloc`.
        Otherwise: a control (not a free or escape) decided on its header alone — its row,
        the tenant's capabilities,
        the client and object in the books and on one of the tenant's GPUs, all of which
        those cover — with no check of its parameters but, at most, that its one GPU id is
        one of the tenant's (`Admitted.gpu_id_off`: the front end repeats that test on its
        private copy, with the tenant's GPU ids of the policy epoch) or, for a layout with
        embedded buffers, their sizes (`Admitted.embedded_only`: the front end reads them
        itself into copies of its own, as it does for a checked one) or its GPU-id list
        (`id_list_check`: ATTACH_IDS, DETACH_IDS, whose pre-hook is that check), no other
        pre-hook and a post-hook only as data — a TablePatch, an IdFilter (`_id_filter_only`) or an IdFlag
        (`id_flag`) — and nothing else for `finish` to do (no recording)."""
        if adm.alloc is not None:
            return self._settleable_alloc(adm)
        if adm.header.kind == "free":
            # `decision._decide_free` decided on the header alone: the client the tenant's and the
            # object one of its objects or the client itself — an object fact on this file
            # is that (facts of freed objects go with their removal from the books); the
            # books follow the driver's answer after it (`book_settled`)
            return self.broker.recorder is None
        id_filter = self._id_filter_only(adm)
        id_list = self.id_list_check(adm) is not None
        return (adm.header.kind == "control" and adm.alloc is None
                and (not adm.checked or adm.gpu_id_off >= 0 or bool(adm.embedded_only)
                     or id_filter or id_list)
                and (adm.pre is None or id_list) and not adm.answered
                and (not adm.embedded_fields or bool(adm.embedded_only))
                and (adm.post is None or adm.post in rewrite.AS_TABLE_PATCH or id_filter
                     or self.id_flag(adm) is not None)
                and self.broker.recorder is None)

    def settleable_escape(self, adm: Admitted) -> bool:
        """Whether a plain escape this lane admitted (`decision._decide_escape`) may be
        settled: its decision reads the session, its row (allowed, granted, on this node)
        and, for the version check and SYS_PARAMS, the argument — so a front end may repeat
        it for the same argument byte for byte on another of the tenant's files of the same
        node (native/lane.c struct dvb_escape_fact) — for an fd escape with one fd field
        (REGISTER_FD), but for that field, whose file the front end checks each time (a
        file of the tenant's, `fd_target`'s test). Not while recording. The loop does not know which driver version a
        file's process asked for (its version check: `Tenant.abi_by_tgid`), so either every
        version the broker knows reads this ioctl number as this same escape, or no process
        of the tenant's asked for another version than the broker's (NVML's and CUDA's
        WAIT_OPEN_COMPLETE is not in 535's tables); a process that does so later moves the
        policy epoch (handlers.version), and every settled fact with it."""
        h = adm.header
        if h.kind != "escape" or len(h.fd_offsets) > 1 or self.broker.recorder is not None:
            return False
        same = self._same_escape.get(h.ioctl_cmd)
        if same is None:
            same = self._same_escape[h.ioctl_cmd] = all(
                (g := headers_of(registry.get(v)).get(h.ioctl_cmd)) is not None
                and g.kind == "escape" and g.escape == h.escape
                for v in registry.versions())
        return same or not adm.session.tenant.abi_by_tgid

    def id_list_check(self, adm: Admitted):
        """The pre-hook of a control as an IdListCheck (rewrite.AS_ID_LIST_CHECK:
        restrict_attach_ids), when that list is all its check reads — no post-hook, pointer,
        embedded buffer, fd or client handle — for a front end that repeats it on its
        private copy with the tenant's GPU ids; None for any other."""
        as_check = rewrite.AS_ID_LIST_CHECK.get(adm.pre)
        if as_check is None or adm.post is not None or adm.null_ptrs or adm.embedded_fields:
            return None
        spec = adm.abi.control(adm.cmd).params
        if not self._names_nothing(spec):
            return None
        return as_check(spec)

    def id_flag(self, adm: Admitted):
        """The post-hook of a control whose check is its one GPU id (`Admitted.gpu_id_off`)
        as an IdFlag on that same id (rewrite.AS_ID_FLAG: GET_ID_INFO's IN_USE flag), for a
        front end that applies it itself with the GPU ids the tenant holds a device of;
        None for any other."""
        as_flag = rewrite.AS_ID_FLAG.get(adm.post)
        if as_flag is None or adm.gpu_id_off < 0 or adm.pre is not None:
            return None
        flag = as_flag(adm.abi.control(adm.cmd).params)
        return flag if flag is not None and flag.id_offset == adm.gpu_id_off else None

    def _id_filter_only(self, adm: Admitted) -> bool:
        """A control whose post-hook is an IdFilter (rewrite.AS_ID_FILTER: the GPU-id lists
        the broker answers, GPU_IDS_ANSWERED) and whose check reads nothing — no pointer, fd
        or client handle in its layout, its GPU ids the driver's answer, not the tenant's
        question (rewrite.require_own_gpu_ids skips them): a front end may apply the filter
        itself with the tenant's GPU ids of the policy epoch."""
        flt = rewrite.AS_ID_FILTER.get(adm.post)
        if flt is None or adm.pre is not None or adm.null_ptrs or adm.embedded_fields \
                or adm.cmd not in rewrite.GPU_IDS_ANSWERED:
            return False
        spec = adm.abi.control(adm.cmd).params
        return flt(spec) is not None and self._names_nothing(spec)

    def _names_nothing(self, spec) -> bool:
        """Whether a parameter layout has no pointer, fd or client-handle field (then a
        check that reads only its GPU ids reads nothing else): the layout walked once per
        layout, not at each decided call."""
        got = self._no_refs.get(id(spec))
        if got is None or got[0] is not spec:
            got = (spec, not any(f.kind in ("fd", "ptr") or f.name in rules.CLIENT_HANDLE_FIELDS
                                 for _p, f, _o in spec.walk()))
            self._no_refs[id(spec)] = got
        return got[1]

    def _settleable_alloc(self, adm: Admitted) -> bool:
        """Whether an admitted allocation's decision may be settled: decided on its header
        alone (`decision._decide_alloc`: the client and parent the tenant's and on its GPUs, the
        class on the allowlist and granted, no access rights asked for, the tenant's
        object limit and pace — the front end keeps an allowance of objects and takes a
        pace token per call), no class check, nothing charged, its parameters not checked
        (`decision.alloc_plan`: no client handle, GPU id or pointer in them) or checked only for
        NULL pointers (`_check_alloc` then tests nothing else: system memory's `address`;
        the front end repeats that test on its private copy), no after-hook — but a
        channel's, for a tenant the policy never has stopped (compute.never_stops_channels:
        not low priority, no turns; a channel's stopped state is not in the books' epochs,
        the policy is) — and no recording. The handle it
        makes is the driver's to refuse when it exists (the general path's answer is the
        driver's NV_ERR_INSERT_DUPLICATE_NAME too); the front end books the new object with
        `book_settled` after the answer."""
        rule = adm.alloc
        return (rule is not None and rule.check is None and not rule.parents
                and (rule.after is None or (rule.after in LANE_AFTER_HOOKS
                                            and compute.never_stops_channels(
                                                self.broker, adm.session.tenant)))
                and not rule.charge and adm.header.kind == "alloc"
                and (not adm.checked or self._null_checked_only(adm))
                and self.broker.recorder is None)

    def _null_checked_only(self, adm: Admitted) -> bool:
        """A checked allocation whose `_check_alloc` comes down to its pointers being NULL:
        not a device (its deviceId is looked up), and a layout with no client handle, GPU
        id or fd (`rules.plain_layout` but for pointers), at most SETTLED_NULL_PTRS of
        them."""
        if adm.cmd == handlers.DEVICE_CLASS or len(adm.null_ptrs) > SETTLED_NULL_PTRS:
            return False
        key = (adm.abi, adm.cmd)
        known = self._null_only.get(key)
        if known is None:
            spec = adm.abi.rm_class(adm.cmd).params
            known = self._null_only[key] = not any(
                f.kind == "fd" or f.name in rules.CLIENT_HANDLE_FIELDS
                or f.name in rewrite.GPU_ID_FIELD_NAMES for _p, f, _o in spec.walk())
        return known

    def runs_hook(self, adm: Admitted) -> bool:
        """Whether the front end must run this admitted allocation's after-hook
        (`run_after`) before the tenant has its answer."""
        return adm.alloc is not None and adm.alloc.after in LANE_RUN_AFTER_HOOKS

    def run_after(self, adm: Admitted, hdr_out: bytes, params_in: bytes, req: Any,
                  perform: Callable) -> bool:
        """An allocation a front end admitted with `run_hooks`, after `finish` booked it and
        before the tenant has its answer: the class's after-hook (LANE_RUN_AFTER_HOOKS), as
        handlers.rm_alloc runs it — on the new handle, with the parameters as sent (the
        front end's private copy) — its driver calls performed on this thread through
        `perform` (req: the call's IoctlRequest, whose duplicate of the tenant's file they
        run on). Only on NV_OK. The hook records its own failures (compute._apply); anything
        else is logged and audited, never raised: the allocation stands either way, as on
        the general path. True when a hook ran to its end."""
        rule, h = adm.alloc, adm.header
        if rule is None or rule.after not in LANE_RUN_AFTER_HOOKS:
            return False
        if h.status_offset < 0 or hdr_out[h.status_offset:h.status_offset + 4] != bytes(4):
            return False  # (not NV_OK: nothing was made)
        handle = int.from_bytes(hdr_out[h.new_offset:h.new_offset + 4], "little")
        where = f"RM_ALLOC {adm.abi.class_name(adm.cmd)}"
        try:
            params = (adm.params_value if adm.checked
                      else adm.abi.rm_class(adm.cmd).params.decode(params_in))
        except DecodeError:
            params = None
        ctx = _HookContext(self.broker, adm.session, req)
        call = handlers.AllocCall(adm.cmd, adm.client, adm.client.handle, params, where)
        try:
            run_blocking(locked(rule.after(ctx, call, handle, adm.gpu)), perform)
            return True
        except HandOver as e:  # (a wait this thread cannot do: the steps are dropped)
            e.steps.close()
            why = "its driver calls could not run on the listener's thread"
        except Exception as e:  # a bug must cost the hook, never the tenant's answer
            why = f"{type(e).__name__}: {e}"
        log.error("%s: after-hook failed: %s", where, why)
        self.broker.audit.write("error", tenant=adm.session.tenant.name, what=where,
                                reason=f"handle {handle:#x}: the after-hook "
                                       f"({rule.after.__name__}) did not finish: {why}")
        return False

    def book_settled(self, session_id: int, hdr_out: bytes, ioctl_cmd: int) -> tuple | None:
        """An allocation a front end admitted as settled was answered NV_OK by the driver
        (hdr_out: its header as the driver left it): the new object into the tenant's books,
        as `_finish_alloc` books one (on the parent's GPU, nothing charged), and counted.
        (The broker's session, client, new handle), or None when it was not booked (the
        session or the parent gone meanwhile: a racing free took the new object with it)."""
        with STATE_LOCK:
            s = self.broker.sessions.get(session_id)
            if s is None:
                return None
            h = headers_of(self.broker.abi_of(s)).get(ioctl_cmd)
            if h is None or h.kind not in ("alloc", "free") or len(hdr_out) != h.size:
                return None
            if h.kind == "free":
                self._book_settled_free(s, h, hdr_out)
                return None
            h_root, h_parent, _h_new, cls, _p, _n = h.unpack(hdr_out)
            handle = int.from_bytes(hdr_out[h.new_offset:h.new_offset + 4], "little")
            client = s.tenant.clients.get(h_root)
            parent = client.objects.get(h_parent) if client is not None else None
            if parent is None or not handle:
                return None
            client.add(handle, cls, h_parent, gpu=parent.gpu, charged=0)
            self.allocations += 1
            return s, client.handle, handle

    def _book_settled_free(self, s: Session, h: Header, hdr_out: bytes) -> None:
        """A free the front end admitted as settled, answered NV_OK: the object and its
        children (or the client and everything under it) leave the books, as
        `_finish_free` has them leave (under the state lock)."""
        h_root, _h_parent, h_old = h.unpack(hdr_out)
        client = s.tenant.clients.get(h_root)
        if client is None or h_old not in client.objects:
            return  # (already gone: a racing free of a parent took it)
        handlers.drop_freed(self.broker, client, h_old)
        self.frees += 1

    def settled_calls(self, tenant, key, ok: int, err: int, sum_ns: int,
                      buckets) -> None:
        """Calls a front end admitted as settled (ok: the driver answered, err: with an
        errno): the tenant's requests and the lane's admissions, as `book` would have
        counted them one by one. (`key`, `sum_ns`, `buckets`: the call counters' row, for
        callstats._CountedLane.)"""
        with STATE_LOCK:
            tenant.requests += ok + err
            self.admitted += ok + err
            self.settled += ok + err

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
        status = (int.from_bytes(hdr_out[h.status_offset:h.status_offset + 4], "little")
                  if h.status_offset >= 0 else nvstatus.NV_OK)
        if h.kind == "free":
            return self._finish_free(adm, hdr, params_in, ret, err, hdr_out, status)
        if adm.alloc is not None:
            return self._finish_alloc(adm, hdr, params_in, ret, err, hdr_out, params_out,
                                      status)
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
            self._record(recorder, adm, hdr, params_in, ret, err, hdr_out, out)
        return out

    def _finish_alloc(self, adm: Admitted, hdr: bytes, params_in: bytes, ret: int, err: int,
                      hdr_out: bytes, params_out: bytearray, status: int) -> bytes:
        """After the driver answered an allocation: the new object into the tenant's books
        (before the tenant has its answer, as handlers.rm_alloc), the request counted."""
        h = adm.header
        out = bytes(params_out)
        with STATE_LOCK:
            s = adm.session
            if not adm.booked:
                s.tenant.requests += 1
            if adm.reserved:  # the quota held while the driver ran (the object takes it)
                adm.client.remove(adm.reserved)
                adm.reserved = 0
            if not err and status == nvstatus.NV_OK:
                handle = int.from_bytes(hdr_out[h.new_offset:h.new_offset + 4], "little")
                charge = adm.charge
                if adm.alloc.charge:
                    # the books follow the driver if it says it took more (handlers.rm_alloc)
                    granted = handlers._alloc_charge(
                        adm.abi.rm_class(adm.cmd).params.decode(out))
                    if granted > charge:
                        self.broker.once(("charge", adm.cmd),
                                         f"RM_ALLOC {adm.abi.class_name(adm.cmd)}: "
                                         f"the driver granted {granted} bytes where {charge} "
                                         "were checked against the quota")
                        charge = granted
                # (a racing free of the parent took the new object with it in the driver:
                # nothing to book then)
                if adm.h_object in adm.client.objects:
                    adm.client.add(handle, adm.cmd, adm.h_object, gpu=adm.gpu,
                                   charged=charge)
            recorder = self.broker.recorder
        if recorder is not None:
            self._record(recorder, adm, hdr, params_in, ret, err, hdr_out, out)
        return out

    def _finish_free(self, adm: Admitted, hdr: bytes, params_in: bytes, ret: int, err: int,
                     hdr_out: bytes, status: int) -> bytes:
        """After the driver freed an object: it and its children leave the books (a charge
        held by one of its duplicates moves there); a root client leaves the client books
        with everything under it — as handlers.rm_free."""
        with STATE_LOCK:
            s = adm.session
            if not adm.booked:
                s.tenant.requests += 1
            if not err and status == nvstatus.NV_OK:
                handlers.drop_freed(self.broker, adm.client, adm.h_object)
            recorder = self.broker.recorder
        if recorder is not None:
            self._record(recorder, adm, hdr, params_in, ret, err, hdr_out, b"")
        return b""  # (no parameter block: the header is the answer)

    @staticmethod
    def _record(recorder, adm: Admitted, hdr: bytes, params_in: bytes, ret: int, err: int,
                hdr_out: bytes, out: bytes) -> None:
        s = adm.session
        call = adm.abi.decode_ioctl(s.node, adm.header.ioctl_cmd, hdr)
        block = adm.header.params_offset >= 0  # (a header-only call has no nested buffer)
        recorder.ioctl(s, call, params_in if block else None,
                       DriverResult(arg=hdr_out, nested=out if block else None, result=ret,
                                    errno=err))

