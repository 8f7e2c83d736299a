"""The seccomp listener's native loop (native/lane.c), as the Python listener drives it.

Why: on the H200 the Python listener's control lane cost ~95 µs over the driver's ~16 µs per
RM_CONTROL, and a CUDA init ~200 ms of listener time over ~3,700 notifications: the
system calls a call needs cost 1–3 µs each, the Python around each of them 3–5× that
(docs/hardware.md, run 3). The C loop makes those system calls itself — wait, receive,
pidfd_getfd of the fd (its fstat names the file; statx for a call it cannot run), private
reads, NOTIF_ID_VALID, the driver ioctl, one process_vm_writev, the answer — and calls back
into Python only for the decision.

Who decides what (nothing new is decided here):
* an **ioctl**: C reads the header of a control-lane ioctl number into its private buffer
  and calls `on_ioctl`, which is this module's `NativeLane._on_ioctl`: the session behind
  the file, then `ControlLane.admit` (broker/fastlane.py, the same admission as the Python
  lane) or the continue lane's decision (`SeccompSupervisor._continue_decision`, the same
  function the Python listener uses). Its answer: ACT_CONTROL (C runs the admitted control
  as the Python lane would), ACT_CONTINUE, ACT_DECLINE (the whole notification goes to
  the Python listener, whose general steps decide it from the start, refusal and audit
  record included), or ACT_FAIL when deciding raised (a bug costs that call EIO, as in the
  Python listener, and never sends it another way). For a *checked* control (its
  parameters name client handles or GPU ids, or its row has a pre-hook) the loop reads the
  parameters privately and calls `on_check` (`ControlLane.check` on that copy, which may
  rewrite it) before the driver call; a decline sends the whole call the general way.
  `on_finish` runs the row's post-hook and the books
  (`ControlLane.finish`), and the backend's `run_control` when the driver call cannot be a
  plain ioctl on the tenant's file (the emulated backend).
* an **open** whose path's basename is none of the tenant's node names: CONTINUE in C, the
  Python `_open_quick` rule on the same bytes.
* a **settled control**: a plain control the broker admitted (or one whose check reads only
  its one GPU id and NULL pointers) on an object whose fact the broker wrote down at any
  control's admission (`NativeLane.settle`, `worth_settling`) is admitted by the loop
  itself, while the books say nothing it read changed (objects.BOOKS; native/lane.c,
  struct dvb_settled; docs/seccomp.md "Settled controls"). The broker's decision,
  repeated, not a new one.
* a **settled continuation** (`settle_continue`: a continued command whose decision read
  only client-handle fields, repeated for the same file, command and handle values) and a
  **mapping fact** (`settle_mmap`: a real ctl or GPU file's mappings, written at its
  install): native/lane.c, struct dvb_cont_fact; docs/seccomp.md "Settled continuations".
* a **mapping** of a file that can be none of the broker's (not a character device, not a
  memfd): CONTINUE in C, the Python `_lookup_stat` rule.
* everything else: back to the Python listener (`DVB_NOTIF`), which answers as before.

Off with DEVBROKER_NATIVE_LANE=0 (and with DEVBROKER_CONTROL_LANE=0, which turns every lane
off), or when the library cannot be built (devbroker.native logs why).
"""
from __future__ import annotations

import ctypes
import itertools
import logging
import os
import threading
import time
from typing import TYPE_CHECKING

from devbroker import native
from devbroker.broker import callstats, rewrite
from devbroker.broker.objects import BOOKS
# What the loop and Python share (sizes, codes, struct dvb_call): native/callabi.py, the
# one source lane.c's header is generated from.
from devbroker.native import callabi
from devbroker.native.callabi import (
    ABI, ACT_CONTINUE, ACT_CONTROL, ACT_DECLINE, ACT_FAIL, ANSWER_MAX, CONT_ARG, CONT_FDS,
    CONT_OBJECTS, DVB_ERROR, DVB_FOLD, DVB_HUP, DVB_IDLE, DVB_LATE, DVB_NOTIF, DVB_QUIET,
    DVB_WAKE, DVB_WRITE_FAILED, EMBED_MAX, FD_MAX, FINISH_AFTER, FINISH_BEFORE, FINISH_NONE,
    GPU_IDS, HDR_MAX, LAYOUT_ALLOC, LAYOUT_CONTROL, LAYOUT_FREE, OPEN_PATH, OPEN_SLOTS,
    PARAMS_MAX, PATCH_MAX, SETTLED_BUCKETS, SETTLED_EMBED, SETTLED_PTRS, call_struct)
from devbroker.native.callabi import DVB_FACT_FILE as FACT_FILE
from devbroker.native.callabi import DVB_FACT_IOCTL as FACT_IOCTL
from devbroker.native.callabi import DVB_FACT_MMAP as FACT_MMAP

if TYPE_CHECKING:
    from .seccomp import SeccompSupervisor

log = logging.getLogger("devbroker.seccomp.native")

# The SupervisorStats field(s) each of the loop's counters is added to, in callabi.COUNTERS'
# order: the field of the counter's name in lower case unless named here
_STATS_OF = {
    "ANSWERED": "native_answered",
    "CONT_SETTLED": ("continued_settled", "continued_decided", "uvm_fast"),
    "MMAPS_SETTLED": ("mmaps_settled", "mmaps"),
    "OPENS_PREPARED": ("opens_prepared", "opens"),
    "NS_OPEN_PREPARED": ("ns_open_prepared", "ns_open_node", "ns_open"),
}
COUNTERS = tuple(_STATS_OF.get(c, c.lower()) for c in callabi.COUNTERS)
NODE_WIDE = -1  # native/lane.c DVB_NODE_WIDE: a continuation fact of every file of a node
_LAYOUT_KINDS = {"control": LAYOUT_CONTROL, "alloc": LAYOUT_ALLOC, "free": LAYOUT_FREE}
_SETTLED_ROW = 4 + SETTLED_BUCKETS + 1  # (slot, ok, err, sum_ns, buckets...)
# Tokens of the tenant's pace the loop may spend on settled calls before it asks again
SETTLED_CREDIT = 64

_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int)
# A test's switch (tests/test_real_lane.py): decisions do not wait for other threads'
# bookings after an answer, to show what that wait prevents. Never for a broker in use.
_NO_BOOKING_WAIT = os.environ.get("DEVBROKER_TEST_NO_BOOKING_WAIT") == "1"
# ... and how long a booking after an answer is held up first (ms), to widen that window.
BOOKING_DELAY_S = float(os.environ.get("DEVBROKER_TEST_BOOKING_DELAY_MS", "0") or 0) / 1e3


Call = call_struct()  # native/lane.c struct dvb_call: one ioctl being decided


_OFF_HDR = Call.hdr.offset
_OFF_HDR_OUT = Call.hdr_out.offset
_OFF_PARAMS_IN = Call.params_in.offset
_OFF_PARAMS = Call.params.offset


def enabled() -> bool:
    return os.environ.get("DEVBROKER_NATIVE_LANE", "1") != "0"


def settled_enabled() -> bool:
    """Settled controls (NativeLane.settle); off with DEVBROKER_SETTLED=0 (every control
    then asks the broker, as before)."""
    return os.environ.get("DEVBROKER_SETTLED", "1") != "0"


def describe() -> str:
    """Which loop seccomp listeners will run, and why (for the broker's start line and
    `devbroker status`); builds the library now if it must (not at the first tenant)."""
    off = ("DEVBROKER_CONTROL_LANE=0: lanes off"
           if os.environ.get("DEVBROKER_CONTROL_LANE", "1") == "0"
           else None if enabled() else "DEVBROKER_NATIVE_LANE=0")
    return native.describe_loop("lane", None if off else library(), off, "native loop",
                                "Python loop")


def library() -> ctypes.CDLL | None:
    """native/lane.c loaded and checked, or None (the Python listener serves)."""
    lib = native.load_checked("lane", "dvb_abi", ABI, "dvb_call_size", ctypes.sizeof(Call))
    if lib is None or getattr(lib, "_devbroker_checked", False):
        return lib
    vp, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.dvb_shared_new.restype = vp
    lib.dvb_shared_new.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_size_t,
                                   ctypes.POINTER(ctypes.c_int),
                                   ctypes.POINTER(ctypes.c_ulong), i64, _CALLBACK, _CALLBACK,
                                   _CALLBACK, _CALLBACK]
    lib.dvb_shared_free.argtypes = [vp]
    lib.dvb_set_names.argtypes = [vp, ctypes.c_char_p, ctypes.c_size_t]
    lib.dvb_set_lane_cmds.argtypes = [vp, ctypes.POINTER(ctypes.c_uint32), ctypes.c_int]
    lib.dvb_set_mem_off.argtypes = [vp, ctypes.c_int]
    lib.dvb_set_quiet.argtypes = [vp]
    lib.dvb_bookings.argtypes = [vp]
    lib.dvb_bookings.restype = i64
    lib.dvb_set_memfd_dev.argtypes = [vp, i64]
    lib.dvb_thread_new.restype = vp
    lib.dvb_thread_new.argtypes = [vp, ctypes.c_int]
    lib.dvb_thread_free.argtypes = [vp]
    lib.dvb_call_of.restype = vp
    lib.dvb_call_of.argtypes = [vp]
    lib.dvb_notif_of.restype = vp
    lib.dvb_notif_of.argtypes = [vp]
    lib.dvb_err.argtypes = [vp]
    lib.dvb_late_ns.restype = i64
    lib.dvb_late_ns.argtypes = [vp]
    lib.dvb_fold.argtypes = [vp, ctypes.POINTER(i64)]
    lib.dvb_watch.argtypes = [vp, ctypes.POINTER(i64)]
    lib.dvb_abandon.argtypes = [vp]
    lib.dvb_serve.argtypes = [vp]
    lib.dvb_serve.restype = ctypes.c_int
    lib.dvb_thread_driver_safe.argtypes = [vp, ctypes.c_int]
    lib.dvb_settled_start.argtypes = [vp, vp, vp, ctypes.c_uint64, ctypes.POINTER(i64),
                                      ctypes.c_int]
    lib.dvb_settled_layout.argtypes = [vp, ctypes.POINTER(ctypes.c_int32)]
    lib.dvb_settled_put.argtypes = [vp, ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(i64),
                                    ctypes.POINTER(i64), ctypes.c_int,
                                    ctypes.POINTER(ctypes.c_uint32),
                                    ctypes.POINTER(ctypes.c_uint32), i64, ctypes.c_int,
                                    ctypes.POINTER(i64)]
    lib.dvb_settled_credit.argtypes = [vp, i64, ctypes.c_int]
    lib.dvb_settled_alloc_credit.argtypes = [vp, i64]
    lib.dvb_settled_object_put.argtypes = [vp, ctypes.POINTER(ctypes.c_uint64),
                                           ctypes.POINTER(i64), ctypes.c_uint32,
                                           ctypes.c_uint64, ctypes.c_int,
                                           ctypes.POINTER(ctypes.c_uint32),
                                           ctypes.POINTER(ctypes.c_uint32)]
    lib.dvb_settled_credit_left.argtypes = [vp]
    lib.dvb_settled_credit_left.restype = i64
    lib.dvb_settled_fold.argtypes = [vp, ctypes.POINTER(i64), ctypes.c_int]
    lib.dvb_continue_put.argtypes = [vp, ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(i64),
                                     i64, ctypes.c_int, ctypes.POINTER(i64)]
    lib.dvb_continue_fold.argtypes = [vp, ctypes.POINTER(i64), ctypes.c_int]
    lib.dvb_answer_put.argtypes = [vp, ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(i64),
                                   ctypes.c_char_p, i64, ctypes.c_int, ctypes.POINTER(i64)]
    lib.dvb_answer_fold.argtypes = [vp, ctypes.POINTER(i64), ctypes.c_int]
    lib.dvb_open_put.argtypes = [vp, ctypes.POINTER(ctypes.c_uint64), ctypes.c_char_p,
                                 ctypes.c_int, ctypes.c_int, ctypes.c_uint64, i64]
    lib.dvb_open_take.argtypes = [vp, ctypes.c_int, ctypes.POINTER(i64), ctypes.c_int]
    lib.dvb_open_drain.argtypes = [vp, ctypes.POINTER(i64), ctypes.c_int]
    lib.dvb_open_pending.argtypes = [vp]
    lib.dvb_open_pending.restype = ctypes.c_int
    lib.dvb_set_gpu_ids.argtypes = [vp, ctypes.c_uint64, ctypes.POINTER(ctypes.c_uint32),
                                    ctypes.c_int]
    lib.dvb_set_device_ids.argtypes = [vp, ctypes.c_uint64, ctypes.POINTER(ctypes.c_uint32),
                                       ctypes.c_int]
    lib.dvb_escape_put.argtypes = [vp, ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(i64),
                                   ctypes.c_char_p, i64, ctypes.c_int, ctypes.POINTER(i64)]
    lib._devbroker_checked = True
    return lib


class NativeThread:
    """One listener thread's C state (its call buffer, counters, what it is doing)."""

    def __init__(self, lane: NativeLane, slot: int):
        self.lane, self.slot = lane, slot
        lib = lane.lib
        self.ptr = lib.dvb_thread_new(lane.shared, slot)
        if not self.ptr:
            raise MemoryError("dvb_thread_new")
        self.call = Call.from_address(lib.dvb_call_of(self.ptr))
        self.base = ctypes.addressof(self.call)
        self.notif_addr = lib.dvb_notif_of(self.ptr)
        self._counts = (ctypes.c_int64 * len(COUNTERS))()
        self._watch = (ctypes.c_int64 * 4)()
        self.adm = None  # the Admitted of the control in flight (between the callbacks)
        self.adm_epochs = None  # objects.BOOKS.now() read before it was decided
        # a control answered without on_finish, whose row the counters still owe, and the
        # loop's count of those when it was admitted
        self.unfinished = None
        self.done_seen = 0
        self.reported = False  # its current access was answered by the watchdog
        self.os_tid = 0  # the thread's id (SeccompSupervisor._native_thread_main sets it)
        self.driver_safe = False
        self.last_patch = None  # the TablePatch now in the call buffer (set_patch)
        # what to write down for settled controls once the tenant has its answer (the
        # loop's on_after; dropped if the call went another way)
        self.after: list = []
        # the private copies of the control in flight's embedded buffers (the loop holds
        # their addresses until its next call: kept alive here until then)
        self.embedded: list = []

    def serve(self) -> int:
        return self.lane.lib.dvb_serve(self.ptr)

    def notif_bytes(self, size: int) -> bytes:
        return ctypes.string_at(self.notif_addr, size)

    def fold(self, stats) -> None:
        self.lane.lib.dvb_fold(self.ptr, self._counts)
        for names, v in zip(COUNTERS, self._counts):
            if v:
                for name in (names,) if isinstance(names, str) else names:
                    setattr(stats, name, getattr(stats, name) + v)

    def watch(self) -> tuple[int, int, int, int]:
        """(busy since, memory access since (monotonic ns, 0: not), notification id, tid),
        all 0 once the thread has left. For the watchdog (another thread): under the lane's
        lock, which `NativeLane.drop` holds while it frees the thread's state."""
        with self.lane._lock:
            if not self.ptr:
                return (0, 0, 0, 0)
            self.lane.lib.dvb_watch(self.ptr, self._watch)
            return tuple(self._watch)

    def abandon(self) -> None:
        """The watchdog answered the thread's call: its loop reports the access's return."""
        with self.lane._lock:
            if self.ptr:
                self.lane.lib.dvb_abandon(self.ptr)

    def close(self) -> None:
        if self.ptr:
            self.lane.lib.dvb_thread_free(self.ptr)
            self.ptr = None


class NativeLane:
    """One listener's native loop: the shared C state, and the callbacks into the broker."""

    def __init__(self, lib: ctypes.CDLL, sup: SeccompSupervisor, listener_fd: int,
                 wake_fd: int, notif_size: int, nrs: tuple[int, int, int, int, int],
                 reqs: tuple[int, int, int, int], spin_ns: int, names: set[str],
                 lane_cmds: frozenset[int]):
        self.lib, self.sup = lib, sup
        if _NO_BOOKING_WAIT or BOOKING_DELAY_S:
            log.warning("native lane: test switches set (DEVBROKER_TEST_NO_BOOKING_WAIT, "
                        "DEVBROKER_TEST_BOOKING_DELAY_MS): decisions may miss bookings; "
                        "never for a broker in use")
        # the callbacks stay referenced for the loop's life (C holds bare pointers)
        self._cb_ioctl = _CALLBACK(self._on_ioctl)
        self._cb_check = _CALLBACK(self._on_check)
        self._cb_finish = _CALLBACK(self._on_finish)
        self._cb_after = _CALLBACK(self._on_after)
        self.shared = lib.dvb_shared_new(
            listener_fd, wake_fd, notif_size, (ctypes.c_int * 5)(*nrs),
            (ctypes.c_ulong * 4)(*reqs), spin_ns, self._cb_ioctl, self._cb_check,
            self._cb_finish, self._cb_after)
        if not self.shared:
            raise OSError("dvb_shared_new failed")
        blob = b"".join(n.encode("utf-8", "surrogateescape") + b"\0" for n in sorted(names))
        if lib.dvb_set_names(self.shared, blob, len(blob)) != 0:
            raise ValueError("node names too long for the native loop")
        lib.dvb_set_memfd_dev(self.shared, sup._memfd_dev)
        cmds = sorted(lane_cmds)
        if lib.dvb_set_lane_cmds(self.shared, (ctypes.c_uint32 * max(1, len(cmds)))(*cmds),
                                 len(cmds)) != 0:
            raise ValueError("too many control-lane ioctl numbers")
        self.threads: dict[int, NativeThread] = {}
        self._slots = 0
        self._lock = threading.Lock()
        self.mem_off = False
        # Settled controls: the loop's slot of each settled control -> (its tenant, its
        # row's key in the call counters), the header layouts given, the ABIs' tags
        self._settled_rows: dict[int, tuple] = {}
        self._cont_rows: dict[int, tuple] = {}  # the same for settled continuations
        self._answer_rows: dict[int, tuple] = {}  # ... and for answer facts
        self._layouts: set[int] = set()
        self._abi_tags: dict[object, int] = {}
        self._sandboxes: dict[tuple, int] = {}  # (uid, pid namespace) -> tag
        self._gpu_ids_epoch = -1  # the policy epoch of the GPU ids given to the loop
        # the devices epoch (objects.BOOKS) of the ids of GPUs the tenant holds a device of
        # given to the loop (GET_ID_INFO's IN_USE flag: rewrite.IdFlag), -1: none
        self.device_ids_epoch = -1
        self.device_ids_of = None  # the TenantState they were computed for
        self._sightings: dict[tuple, bool] = {}  # controls admitted once (worth_settling)
        self._tags = itertools.count(1)  # (never 0, never used twice)
        self._settled_lock = threading.Lock()
        self._fold_rows = (ctypes.c_int64 * (_SETTLED_ROW * 64))()
        self._evicted = (ctypes.c_int64 * _SETTLED_ROW)()
        bounds = callstats._BOUNDS_NS
        self.settled_on = (settled_enabled() and len(bounds) <= SETTLED_BUCKETS
                           and lib.dvb_settled_start(
                               self.shared, BOOKS.address, BOOKS.ring_address, BOOKS.RING,
                               (ctypes.c_int64 * len(bounds))(*bounds), len(bounds)) == 0)

    def thread(self) -> NativeThread:
        with self._lock:
            self._slots += 1
            t = NativeThread(self, self._slots)
            self.threads[t.slot] = t
        return t

    def drop(self, t: NativeThread) -> None:
        with self._lock:  # (the watchdog reads a thread's state under this lock)
            self.threads.pop(t.slot, None)
            t.close()

    # How long a decision waits for another thread's booking (below) before it goes on
    # with the books as they are: the booking is the broker's own work (no tenant memory,
    # no driver call), microseconds; a decision on books that miss a new object refuses
    # what names it, and a missing removal keeps the quota held — never the other way.
    BOOKING_WAIT_S = 2.0

    def await_bookings(self) -> bool:
        """Wait while another listener thread has answered a call whose books it has not
        written yet (native/lane.c, FINISH_AFTER): a decision made now must see them. True
        when there was none or they came in time. (The thread that writes them never asks:
        it writes before it receives its next call.)"""
        lib, sh = self.lib, self.shared
        if not lib.dvb_bookings(sh) or _NO_BOOKING_WAIT:
            return True
        deadline = time.monotonic() + self.BOOKING_WAIT_S
        while lib.dvb_bookings(sh):
            if time.monotonic() > deadline:
                log.warning("native lane: a booking after an answer is still not written "
                            "after %.1f s; deciding on the books as they are",
                            self.BOOKING_WAIT_S)
                return False
            time.sleep(20e-6)  # (lets the booking thread have the GIL)
        return True

    def when_quiet(self) -> None:
        """Ask one of the loop's threads back (DVB_QUIET) once it has had no notification
        for 1 ms: the broker has work for a quiet moment (Broker.quiet_work)."""
        self.lib.dvb_set_quiet(self.shared)

    def set_mem_off(self, off: bool) -> None:
        if off != self.mem_off:
            self.mem_off = off
            self.lib.dvb_set_mem_off(self.shared, int(off))

    # -- prepared opens --------------------------------------------------------------------

    def open_put(self, epochs: tuple[int, int, int], path: str, fd: int, sess,
                 tenant, sid: int) -> bool:
        """Leave a prepared open of `path` in the loop (native/lane.c struct dvb_open_slot):
        its file `fd` (the loop's from now on: closed there when answered or given up),
        for callers in the sandbox of `sess` (the broker's session: its opener's uid and
        pid namespace), decided at `epochs` (read before the broker decided). False: not
        taken (the policy changed meanwhile, no free slot, settled facts off): the caller
        keeps the file."""
        raw = path.encode("utf-8", "surrogateescape")
        if not self.settled_on or sess.pidns is None or len(raw) >= OPEN_PATH:
            return False
        with self._settled_lock:
            tag = self._sandbox_tag(sess.caller.uid, sess.pidns)
            ok = self.lib.dvb_open_put(self.shared, (ctypes.c_uint64 * 3)(*epochs), raw,
                                       len(raw), fd, tag, sid) == 0
            if ok:
                self._top_up(tenant)  # (an open takes a token of the tenant's pace)
        return ok

    def open_take(self, everything: bool) -> list[tuple[int, int]]:
        """Prepared opens taken back from the loop — every one, or those decided under a
        policy that has changed since: [(id, fd)], the files the caller's to close."""
        out = (ctypes.c_int64 * (2 * OPEN_SLOTS))()
        n = self.lib.dvb_open_take(self.shared, int(everything), out, OPEN_SLOTS)
        return [(out[2 * i], out[2 * i + 1]) for i in range(n)]

    def open_drain(self) -> list[tuple[int, int, int]]:
        """The prepared opens the loop answered (or gave up: newfd -errno) since the last
        drain: [(id, tid, newfd)]. (Asked at every callback: nothing is allocated unless
        the loop has some.)"""
        if not self.lib.dvb_open_pending(self.shared):
            return []
        out = (ctypes.c_int64 * (3 * OPEN_SLOTS))()
        n = self.lib.dvb_open_drain(self.shared, out, OPEN_SLOTS)
        return [(out[3 * i], out[3 * i + 1], out[3 * i + 2]) for i in range(n)]

    # -- settled controls ------------------------------------------------------------------

    def settle(self, adm, c: Call, epochs: tuple[int, int, int], patch, caller,
               caller_pidfd: int, key, lane, gpu_ids=None, id_flag=None,
               id_list=None) -> bool:
        """Write down an admitted control's decision (ControlLane.settleable said it may be)
        for the loop to repeat without this callback: the control (its ABI, ioctl number,
        control number, parameter size, TablePatch layout) and the object (the file's
        identity, client, object, the patch values for its GPU, the opener's sandbox), at
        the books' words read before the broker decided (objects.BOOKS), and the caller (its
        sandbox, a duplicate of its thread pidfd, which the loop owns from now on). A
        sandbox is (uid, pid namespace), the session check of fastlane._usable_session: a
        caller settles calls only on files opened in its own; a pid namespace unknown on
        either side is settled by none. native/lane.c, struct dvb_settled, says what a
        later call needs to be admitted by these. gpu_ids: the tenant's GPU ids, for a
        control whose check is its one GPU id (`Admitted.gpu_id_off`). id_flag: its
        post-hook as an IdFlag (ControlLane.id_flag), which the loop applies with the ids
        `set_device_ids` gave it while the books' devices epoch stands. id_list: its check
        as an IdListCheck (ControlLane.id_list_check), which the loop repeats with
        gpu_ids. False: not written."""
        h = adm.header
        if len(h.offsets) != 5 or h.status_offset < 0 or not self.settled_on:
            return False
        alloc = h.kind == "alloc"  # (hRoot, parent and class where a control's client,
        # object and control are; ControlLane._settleable_alloc)
        # native/lane.c's layout kinds (hRoot and hObjectOld where a free's client and
        # object are; nothing else read)
        kind = _LAYOUT_KINDS[h.kind]
        if patch is not None and len(patch.values) > PATCH_MAX:
            return False
        s = adm.session
        if s.pidns is None or caller.pidns is None:
            return False
        with self._settled_lock:
            if h.ioctl_cmd not in self._layouts:
                f = (ctypes.c_int32 * 10)(h.ioctl_cmd, h.size, *h.offsets, h.status_offset,
                                          h.rights_offset if alloc else -1, kind)
                if self.lib.dvb_settled_layout(self.shared, f) != 0:
                    return False
                self._layouts.add(h.ioctl_cmd)
            tag = self._abi_tags.setdefault(adm.abi, len(self._abi_tags) + 1)
            obj = (ctypes.c_int64 * 7)(c.dev, c.ino, adm.client.handle, adm.h_object, tag,
                                       self._sandbox_tag(s.caller.uid, s.pidns),
                                       self._sandbox_tag(caller.uid, caller.pidns))
            layout = ((patch.table_offset, patch.entry_size, patch.index_offset,
                       patch.data_offset, patch.capacity, patch.count_offset)
                      if patch is not None else (0,) * 6)
            # its check, if any: the one GPU id and the NULL pointers (settleable says so;
            # an allocation's pointers are NULL-checked as the lane's own check does)
            gpu_id_off = adm.gpu_id_off if adm.checked and not alloc else -1
            # a post-hook as an IdFilter (the loop applies it with the tenant's GPU ids)
            to_filter = rewrite.AS_ID_FILTER.get(adm.post) if not alloc else None
            id_filter = to_filter(adm.abi.control(adm.cmd).params) if to_filter else None
            if to_filter is not None and (id_filter is None or patch is not None):
                return False
            if id_flag is not None and (patch is not None or id_filter is not None
                                        or adm.gpu_id_off < 0 or alloc):
                return False
            # embedded buffers: the loop reads them itself (settled_embed); the layout's
            # other pointers are NULL-checked
            embed = tuple(adm.embedded_only) if adm.checked and not alloc else ()
            carried = {ptr for ptr, _count, _elem in embed}
            nulls = (tuple(o for o in adm.null_ptrs if o not in carried)
                     if gpu_id_off >= 0 or alloc or embed else ())
            if len(nulls) > SETTLED_PTRS or len(embed) > SETTLED_EMBED:
                return False
            if id_list is not None and (patch is not None or id_filter is not None
                                        or id_flag is not None or gpu_id_off >= 0 or alloc
                                        or embed or nulls):
                return False
            if (gpu_id_off >= 0 or id_filter or id_list) and self._gpu_ids_epoch != epochs[0]:
                ids = list(gpu_ids or ())
                if not ids or len(ids) > GPU_IDS or self.lib.dvb_set_gpu_ids(
                        self.shared, epochs[0], (ctypes.c_uint32 * max(1, len(ids)))(*ids),
                        len(ids)) != 0:
                    return False
                self._gpu_ids_epoch = epochs[0]
            embed_words = [w for e in embed for w in e]
            embed_words += [0] * (3 * SETTLED_EMBED - len(embed_words))
            idf = ((id_filter.ids_offset, id_filter.count, id_filter.along_offset,
                    id_filter.clear_offset) if id_filter is not None else (0, 0, -1, -1))
            flag = ((id_flag.flags_offset, id_flag.id_offset, id_flag.bit)
                    if id_flag is not None else (-1, -1, 0))
            idl = (id_list.ids_offset, id_list.count) if id_list is not None else (0, 0)
            ctl = (ctypes.c_int64 * 31)(tag, h.ioctl_cmd, adm.cmd, adm.params_size,
                                        int(patch is not None), *layout, gpu_id_off,
                                        len(nulls), *(nulls + (0, 0))[:SETTLED_PTRS],
                                        len(embed), *embed_words, *idf, *flag, *idl)
            values = patch.values if patch is not None else ()
            idx = (ctypes.c_uint32 * PATCH_MAX)(*[i for i, _v in values])
            val = (ctypes.c_uint32 * PATCH_MAX)(*[v for _i, v in values])
            pidfd = os.dup(caller_pidfd)
            slot = self.lib.dvb_settled_put(
                self.shared, (ctypes.c_uint64 * 3)(*epochs), obj, ctl, len(values), idx,
                val, c.tid, pidfd, self._evicted)  # (pidfd is the loop's from here on)
            return self._control_put(lane, slot, s.tenant, key)

    def _control_put(self, lane, slot: int, tenant, key) -> bool:
        """After a control fact's put (under _settled_lock): the counts of a control whose
        slot it took recorded, its own row named, the tenant's pace credit topped up."""
        ev = self._evicted
        if ev[0] >= 0:  # another control's row left that slot: what it counted
            self._record(lane, ev[0], ev, 0)
        if slot < 0:
            return False
        self._settled_rows[slot] = (tenant, key)
        self._top_up(tenant)
        return True

    def settle_escape(self, adm, c: Call, arg: bytes, epochs: tuple[int, int, int], caller,
                      caller_pidfd: int, key, lane) -> bool:
        """Write down a plain escape the control lane admitted (ControlLane.settleable_escape)
        for the loop to admit again by itself (native/lane.c struct dvb_escape_fact): the
        same ioctl number with this argument byte for byte (`arg`: the private copy the
        broker decided on), on any file of this node (the call's rdev) that a mapping fact
        says is the tenant's real ctl or GPU file opened in the same sandbox, for the policy
        epoch read before the broker decided; run on the loop's duplicate of the file, or —
        an escape the broker answers itself (`Admitted.answered`) — answered with the
        argument as sent. An fd escape's one fd field (`Header.fd_offsets`) is left out of
        the match: the loop gives the driver its own duplicate of the file the fd names,
        which must have a mapping fact in the caller's sandbox. The caller as for settle;
        its counters on a control fact (ABI tag 0, the ioctl number, control 0). False: not
        written."""
        s = adm.session
        fds = adm.header.fd_offsets
        if (not self.settled_on or s.pidns is None or caller.pidns is None
                or not 0 < len(arg) <= HDR_MAX or not c.rdev or len(fds) > 1):
            return False
        with self._settled_lock:
            f = (ctypes.c_int64 * 7)(c.rdev, c.cmd, len(arg), int(bool(adm.answered)),
                                     self._sandbox_tag(s.caller.uid, s.pidns),
                                     self._sandbox_tag(caller.uid, caller.pidns),
                                     fds[0] if fds else -1)
            pidfd = os.dup(caller_pidfd)
            slot = self.lib.dvb_escape_put(self.shared, (ctypes.c_uint64 * 3)(*epochs), f, arg,
                                           c.tid, pidfd, self._evicted)
            return self._control_put(lane, slot, s.tenant, key)

    def set_device_ids(self, epoch: int, ids) -> bool:
        """The ids of the GPUs the tenant holds a device object of, as of the books' devices
        epoch `epoch` (objects.BOOKS.devices_now(), read under STATE_LOCK with the books
        the ids were computed from: rewrite.device_gpu_ids): the values of a settled
        control's IdFlag (GET_ID_INFO's IN_USE), which the loop applies only while that
        epoch stands. False: not given (too many ids, or settled facts off)."""
        ids = list(ids)
        if not self.settled_on or len(ids) > GPU_IDS:
            return False
        with self._settled_lock:
            if self.lib.dvb_set_device_ids(self.shared, epoch,
                                           (ctypes.c_uint32 * max(1, len(ids)))(*ids),
                                           len(ids)) != 0:
                return False
            self.device_ids_epoch = epoch
        return True

    def object_put(self, epochs: tuple[int, int, int], dev: int, ino: int, sess,
                   client: int, obj: int, abi, patch=None) -> bool:
        """Write down a new object's fact as the broker books it (native/lane.c
        dvb_settled_object_put): on this file, this client's object is the tenant's, on
        its GPU, for callers in the sandbox of the file's opener (`sess`: the broker's
        session). epochs: read before the object was decided or booked (a removal since:
        not written). patch: (control, charge epoch, TablePatch) — that control's patch
        values for the object's GPU as of that charge epoch (a subdevice's FB_GET_INFO_V2,
        so that NVML's memory query on a new subdevice is the loop's from its first call).
        False: not written."""
        if not self.settled_on or sess.pidns is None:
            return False
        with self._settled_lock:
            tag = self._abi_tags.setdefault(abi, len(self._abi_tags) + 1)
            f = (ctypes.c_int64 * 6)(dev, ino, client, obj, tag,
                                     self._sandbox_tag(sess.caller.uid, sess.pidns))
            control, charge, values = 0, 0, ()
            if patch is not None and len(patch[2].values) <= PATCH_MAX:
                control, charge, values = patch[0], patch[1], patch[2].values
            idx = (ctypes.c_uint32 * PATCH_MAX)(*[i for i, _v in values])
            val = (ctypes.c_uint32 * PATCH_MAX)(*[v for _i, v in values])
            return self.lib.dvb_settled_object_put(
                self.shared, (ctypes.c_uint64 * 3)(*epochs), f, control, charge, len(values),
                idx, val) == 0

    # Objects kept out of the settled allocations' allowance: a tenant's allocations go
    # the broker's way this close to its limits.rm_objects (the listener threads' settled
    # allocations in flight stay well inside it).
    ALLOC_MARGIN = 64

    def alloc_credit(self, tenant) -> None:
        """The objects the loop's settled allocations may make before the broker looks
        again: the tenant's limits.rm_objects less what its books hold and ALLOC_MARGIN,
        at most 64 (refreshed at every allocation the broker decides or books)."""
        from devbroker.broker import limits

        held = sum(len(c.objects) for c in tenant.clients.values())
        room = limits.of(tenant).rm_objects - held - self.ALLOC_MARGIN
        self.lib.dvb_settled_alloc_credit(self.shared, max(0, min(64, room)))

    def settle_continue(self, c: Call, fields: tuple, arg: bytes,
                        epochs: tuple[int, int, int], caller, caller_pidfd: int, key,
                        node_wide: bool = False) -> bool:
        """Write down a continue-lane decision the loop may repeat by itself (native/lane.c,
        struct dvb_cont_fact): on this file (the call's dev, inode), this command is
        continued while the client-handle fields (ContinueLane.settle_fields: the
        argument's size, the fields' offsets, the broker's session) hold the values the
        broker checked in `arg`, for a caller in the sandbox of the file's opener; the
        caller (its sandbox, a duplicate of its thread pidfd, the loop's from now on) as
        for settle. False: not written."""
        size, offsets, sess, objects, fds = fields
        if not self.settled_on or sess.pidns is None or caller.pidns is None:
            return False
        if (len(arg) < size or len(offsets) > 4 or len(objects) > 1 + CONT_OBJECTS
                or len(fds) > CONT_FDS or ((objects or fds) and size > CONT_ARG)):
            return False
        handles = [int.from_bytes(arg[o:o + 4], "little") for o in offsets]
        # node_wide (the file has a file fact, `settle_file` or `settle_mmap`): the fact
        # holds for every file of this node with a file fact in the same sandbox — what
        # the decision read of the file is that it is the tenant's, open, in that sandbox
        # — unless it reads objects, which are a file's own
        dev, ino = ((NODE_WIDE, c.rdev) if node_wide and not objects and c.rdev
                    else (c.dev, c.ino))
        return self._put_fact(dev, ino, FACT_IOCTL, c.cmd, size, sess, caller,
                              offsets, handles, epochs, c.tid, caller_pidfd, key,
                              objects, fds)

    def settle_mmap(self, dev: int, ino: int, sess, epochs: tuple[int, int, int], caller,
                    tid: int, caller_pidfd: int, key) -> bool:
        """Write down that this file (dev, inode: a real ctl or GPU file just installed)
        may be mapped by callers in the sandbox of its opener — Broker.map_check_now's whole
        decision for such a file — for the loop to answer its mappings itself (native/
        lane.c answer_mmap); the caller as for settle. False: not written."""
        if not self.settled_on or sess.pidns is None or caller.pidns is None:
            return False
        return self._put_fact(dev, ino, FACT_MMAP, 0, 0, sess, caller, (), (), epochs, tid,
                              caller_pidfd, key)

    def settle_file(self, dev: int, ino: int, sess, epochs: tuple[int, int, int], caller,
                    tid: int, caller_pidfd: int) -> bool:
        """Write down that this nvidia-uvm file (dev, inode, just installed) is the tenant's,
        opened in its opener's sandbox (native/lane.c DVB_FACT_FILE): the node's
        continuation facts hold for it and an fd naming it is one of the tenant's files —
        but its mappings stay the broker's (no mapping fact). False: not written."""
        if not self.settled_on or sess.pidns is None or caller.pidns is None:
            return False
        return self._put_fact(dev, ino, FACT_FILE, 0, 0, sess, caller, (), (), epochs, tid,
                              caller_pidfd, None)

    def settle_answer(self, rdev: int, cmd: int, answer: bytes, sess, epochs, caller,
                      tid: int, caller_pidfd: int, key) -> bool:
        """Write down the broker's whole answer to an escape whose answer it may keep
        (rules.EscapeRule.answer_kept): the loop gives it again, as written, on any file
        of this node (rdev) that a mapping fact says is the tenant's, to callers in the
        opener's sandbox, for the policy epoch read before the broker decided (native/
        lane.c struct dvb_answer); the caller as for settle. False: not written."""
        if (not self.settled_on or sess.pidns is None or caller.pidns is None
                or not 0 < len(answer) <= ANSWER_MAX):
            return False
        with self._settled_lock:
            f = (ctypes.c_int64 * 5)(rdev, cmd, len(answer),
                                     self._sandbox_tag(sess.caller.uid, sess.pidns),
                                     self._sandbox_tag(caller.uid, caller.pidns))
            pidfd = os.dup(caller_pidfd)
            slot = self.lib.dvb_answer_put(self.shared, (ctypes.c_uint64 * 3)(*epochs), f,
                                           answer, tid, pidfd, self._evicted)
            ev = self._evicted
            if ev[0] >= 0:  # another answer's calls left that slot: what it counted
                self._record_answers(None, ev[0], ev, 0)
            if slot < 0:
                return False
            self._answer_rows[slot] = (sess.tenant, key)
            self._top_up(sess.tenant)
        return True

    def _record_answers(self, clane, slot: int, row, base: int) -> None:
        who = self._answer_rows.get(slot)
        count, total = row[base + 1], row[base + 3]
        clane = clane if clane is not None else self.sup._clane
        if who is None or not count or clane is None:
            return
        nb = len(callstats._BOUNDS_NS) + 1
        clane.settled_answers(who[0], who[1], count, total, row[base + 4:base + 4 + nb])

    def _put_fact(self, dev: int, ino: int, kind: int, cmd: int, size: int, sess, caller,
                  offsets, handles, epochs, tid: int, caller_pidfd: int, key,
                  objects=(), fds=()) -> bool:
        # objects: the offsets of (the client, its object handles...); fds: of fd fields
        objs = tuple(objects[1:]) + (0,) * (CONT_OBJECTS - len(objects[1:]))
        fdo = tuple(fds) + (0,) * (CONT_FDS - len(fds))
        with self._settled_lock:
            f = (ctypes.c_int64 * (8 + 2 * len(offsets) + 3 + CONT_OBJECTS + CONT_FDS))(
                dev, ino, cmd, size, self._sandbox_tag(sess.caller.uid, sess.pidns),
                self._sandbox_tag(caller.uid, caller.pidns), kind, len(offsets), *offsets,
                *handles, max(0, len(objects) - 1), objects[0] if objects else 0, *objs,
                len(fds), *fdo)
            pidfd = os.dup(caller_pidfd)
            slot = self.lib.dvb_continue_put(self.shared, (ctypes.c_uint64 * 3)(*epochs), f,
                                             tid, pidfd, self._evicted)
            ev = self._evicted
            if ev[0] >= 0:  # another fact's calls left that slot: what it counted
                self._record_continued(None, ev[0], ev, 0)
            if slot < 0:
                return False
            self._cont_rows[slot] = (sess.tenant, key, kind)
            self._top_up(sess.tenant)
        return True

    # DEVBROKER_SETTLE_FIRST=0: write a decision down only the second time the broker makes
    # it, whatever the object (A/B probes)
    settle_first = os.environ.get("DEVBROKER_SETTLE_FIRST", "1") != "0"
    # The objects most controls go to: a root client, a device, a subdevice (NVML's init
    # sends ~15 controls to its new ones; CUDA's channels and memory get one or two each)
    HUB_CLASSES = frozenset({0x41, 0x80, 0x2080})

    def worth_settling(self, kind: str, control: int, rm_class: int | None) -> bool:
        """Whether to write this admitted call's decision down now (kind: the header's,
        "control", "alloc" or "free"; control: its control, or the class allocated; rm_class: the
        class of the object it is made on). On a root client, device or subdevice
        (`HUB_CLASSES`), at its first admission: that object's fact then serves every
        control on it whose control fact stands, and the control's fact every later object
        (NVML's init, a new client each time). Anywhere else, at the second admission of the
        same control (or class) by this loop's broker, on whatever object: a control fact
        is the control's alone (native/lane.c find_control), and the objects CUDA makes
        have their facts from their booking (`SeccompSupervisor._booked`), so from then on
        a channel's GET_WORK_SUBMIT_TOKEN or a copy engine on a new channel is admitted by
        the loop even though each object gets that call once. (Were the second admission
        required on the same object, those would never settle; a control made once in the
        broker's life is never written.)
        DEVBROKER_SETTLE_FIRST=0: the second admission everywhere, hubs included. A free
        ("free"), always at its first admission: each object is freed once, and what is
        written is the free's control fact (the object's goes with the object)."""
        if kind == "free":
            return True
        if self.settle_first and rm_class in self.HUB_CLASSES:
            return True
        key = (kind, control)
        if key in self._sightings:
            return True
        if len(self._sightings) >= 8192:  # (bounded: old sightings are just forgotten)
            self._sightings.clear()
        self._sightings[key] = True
        return False

    def _sandbox_tag(self, uid: int, pidns: str) -> int:
        tag = self._sandboxes.get((uid, pidns))
        if tag is None:
            if len(self._sandboxes) >= 4096:  # (new tags from here: old facts just miss)
                self._sandboxes.clear()
            tag = self._sandboxes[(uid, pidns)] = next(self._tags)
        return tag

    def _top_up(self, tenant) -> None:
        """The loop's credit of the tenant's pace: unpaced, or tokens taken ahead (at
        most SETTLED_CREDIT) once it is half spent. (Under _settled_lock.)"""
        pace = tenant.limiter
        if pace.rate <= 0:
            self.lib.dvb_settled_credit(self.shared, 0, 1)
            return
        left = max(0, self.lib.dvb_settled_credit_left(self.shared))
        if left < SETTLED_CREDIT // 2:
            got = pace.take_up_to(SETTLED_CREDIT - left)
            if got:
                self.lib.dvb_settled_credit(self.shared, got, 0)

    def top_up_pace(self, tenant) -> None:
        """The loop's credit of the tenant's pace topped up (after the Python listener paced
        a call the loop handed back for want of it: an open of another file, an mmap)."""
        if tenant is None or not self.settled_on:
            return
        with self._settled_lock:
            self._top_up(tenant)

    def fold_settled(self, lane, clane=None) -> None:
        """The settled calls' rows since the last fold, to the lanes (the tenant's requests,
        the call counters): controls to the control lane, continuations to the continue
        lane (`clane`); and the pace's credit topped up."""
        if not self.settled_on:
            return
        with self._settled_lock:
            rows = self._fold_rows
            for fold, record, to in ((self.lib.dvb_settled_fold, self._record, lane),
                                     (self.lib.dvb_continue_fold, self._record_continued,
                                      clane),
                                     (self.lib.dvb_answer_fold, self._record_answers, clane)):
                while True:
                    n = fold(self.shared, rows, 64)
                    for r in range(n):
                        record(to, rows[r * _SETTLED_ROW], rows, r * _SETTLED_ROW)
                    if n < 64:
                        break
            tenant = next(iter(self._settled_rows.values()),
                          next(iter(self._cont_rows.values()),
                               next(iter(self._answer_rows.values()), (None,))))[0]
            if tenant is not None:
                self._top_up(tenant)

    def _record(self, lane, slot: int, row, base: int) -> None:
        who = self._settled_rows.get(slot)
        ok, err, total = row[base + 1], row[base + 2], row[base + 3]
        if who is None or not (ok or err):
            return
        nb = len(callstats._BOUNDS_NS) + 1
        lane.settled_calls(who[0], who[1], ok, err, total, row[base + 4:base + 4 + nb])

    def _record_continued(self, clane, slot: int, row, base: int) -> None:
        who = self._cont_rows.get(slot)
        count, total = row[base + 1], row[base + 3]
        if who is None or not count:
            return
        clane = clane if clane is not None else self.sup._clane
        if clane is not None:
            nb = len(callstats._BOUNDS_NS) + 1
            record = clane.settled_calls if who[2] == FACT_IOCTL else clane.settled_maps
            record(who[0], who[1], count, total, row[base + 4:base + 4 + nb])

    def free(self) -> None:
        if self.shared:
            self.lib.dvb_shared_free(self.shared)
            self.shared = None

    # -- the callbacks (on the listener thread, GIL taken by ctypes) ---------------------

    def _on_ioctl(self, slot: int) -> int:
        return self._decide(slot, self.sup._native_ioctl, "deciding an ioctl", ACT_FAIL)

    def _on_check(self, slot: int) -> int:
        return self._decide(slot, self.sup._native_check,
                            "checking a control's parameters", ACT_FAIL)

    def _on_finish(self, slot: int) -> int:
        return self._decide(slot, self.sup._native_finish, "finishing a control", -1)

    def _on_after(self, slot: int) -> int:
        return self._decide(slot, self.sup._native_after, "writing down settled facts", 0)

    def _decide(self, slot: int, step, what: str, failed: int) -> int:
        """One callback's Python step for the thread in `slot`; an exception answers
        `failed` (the loop then fails that call with EIO), never ends the listener."""
        try:
            t = self.threads[slot]
            return step(t, t.call)
        except Exception:
            log.exception("native lane: %s failed", what)
            return failed

    # -- helpers for those -----------------------------------------------------------------

    @staticmethod
    def path(t: NativeThread) -> bytes:
        """The open path the loop read (native/lane.c answer_open), without its NUL."""
        return ctypes.string_at(t.base + _OFF_HDR, max(0, min(t.call.path_len, HDR_MAX) - 1))

    @staticmethod
    def hdr(t: NativeThread) -> bytes:
        return ctypes.string_at(t.base + _OFF_HDR, t.call.hdr_len)

    @staticmethod
    def set_hdr(t: NativeThread, data: bytes) -> None:
        """The private header the loop gives the driver (an fd escape's duplicates)."""
        ctypes.memmove(t.base + _OFF_HDR, data, min(len(data), HDR_MAX))

    @staticmethod
    def hdr_out(t: NativeThread) -> bytes:
        return ctypes.string_at(t.base + _OFF_HDR_OUT, t.call.hdr_len)

    @staticmethod
    def set_hdr_out(t: NativeThread, data: bytes) -> None:
        ctypes.memmove(t.base + _OFF_HDR_OUT, data, min(len(data), HDR_MAX))

    @staticmethod
    def params_in(t: NativeThread) -> bytes:
        return ctypes.string_at(t.base + _OFF_PARAMS_IN, t.call.params_size)

    @staticmethod
    def params(t: NativeThread) -> bytearray:
        return bytearray(ctypes.string_at(t.base + _OFF_PARAMS, t.call.params_size))

    @staticmethod
    def set_patch(t: NativeThread, c: Call, patch) -> bool:
        """Give the loop a post-hook as data (rewrite.TablePatch); False if it does not fit.
        (The same patch as this thread's last one is already in its call buffer.)"""
        if patch is t.last_patch:
            c.patch_n = len(patch.values)
            return True
        if len(patch.values) > PATCH_MAX:
            return False
        t.last_patch = patch
        c.patch_table_off, c.patch_entry_size = patch.table_offset, patch.entry_size
        c.patch_index_off, c.patch_data_off = patch.index_offset, patch.data_offset
        c.patch_capacity, c.patch_count_off = patch.capacity, patch.count_offset
        for k, (index, value) in enumerate(patch.values):
            c.patch_index[k], c.patch_value[k] = index, value
        c.patch_n = len(patch.values)
        return True

    @staticmethod
    def read_params(t: NativeThread, data: bytes) -> None:
        """The parameters as on_ioctl read them itself (the loop then reads none): the
        private block and the copy as read, both."""
        n = len(data)
        if n != t.call.params_size or n > PARAMS_MAX:
            raise ValueError(f"parameters of {n} bytes for a block of {t.call.params_size}")
        ctypes.memmove(t.base + _OFF_PARAMS, data, n)
        ctypes.memmove(t.base + _OFF_PARAMS_IN, data, n)
        t.call.params_read = 1

    @staticmethod
    def set_params(t: NativeThread, data: bytes) -> None:
        if len(data) != t.call.params_size:
            raise ValueError(f"post-hook changed the parameter size {t.call.params_size} "
                             f"-> {len(data)}")
        ctypes.memmove(t.base + _OFF_PARAMS, data, len(data))
