"""The control lane (broker/fastlane.py): the common RM controls decided in a
few lookups on a seccomp listener thread must be decided exactly as the general steps decide
them.

A real tenant process (tests/fastlane_prog.py) sends every control of the recorded PyTorch and
NVML sessions, with their recorded parameters, through `devbroker exec --frontend seccomp`
(and `--frontend fuse`, whose reader threads take the same lane) to a broker with the emulated backend, plus calls that must be refused. The same program runs
against a broker whose lane is off (DEVBROKER_CONTROL_LANE=0): every answer (errno, NVOS54
status, the parameter block after the call) must be the same, the lane must have taken the
controls it may take, and every refusal must still be audited (the lane only ever declines)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from devbroker.abi import registry
from devbroker.broker import continuelane, decision, fastlane, rewrite, rules
from devbroker.testing.policies import one_h200, tenant

HERE = Path(__file__).resolve().parent
# Controls whose answer is a clock reading (the emulator's, like the driver's, moves on
# between two runs): compared by errno and status only.
CLOCKS = {0x20800406}  # NV2080_CTRL_CMD_TIMER_GET_GPU_CPU_TIME_CORRELATION_INFO
# Calls whose parameters hold an address of the program's (different in each run)
ADDRESSES = {"id-info-name"}

POLICY = one_h200(tenant("t", memory_quota="8GiB", capabilities=["nvml", "compute", "uvm"]))


def test_header_layout_in_every_driver_version():
    """The lane reads NVOS54 by the offsets of each version's table; all agree with the
    driver's struct (hClient, hObject, cmd, flags, params, paramsSize, status)."""
    for version in registry.versions():
        h = fastlane.header_of(registry.get(version))
        assert h is not None, version
        assert (h.ioctl_cmd, h.size, h.params_offset, h.status_offset) == \
            (0xC020462A, 32, 16, 28), version
        raw = (1).to_bytes(4, "little") + (2).to_bytes(4, "little") + \
            (0x20801303).to_bytes(4, "little") + bytes(4) + \
            (0x7F0000001000).to_bytes(8, "little") + (1028).to_bytes(4, "little") + bytes(4)
        assert h.unpack(raw) == (1, 2, 0x20801303, 0x7F0000001000, 1028)


def test_rows_with_answers_runs_or_charges_are_never_laned_and_pre_hooks_only_checked():
    """A row the broker answers itself, runs itself or charges is for the general steps
    only; a row with a pre-hook, or whose parameters name client handles, GPU ids or
    pointers, is laned only as a checked control (ControlLane.check on the private copy
    first; pointers must be NULL there); a layout with an fd, or a pointer in an array,
    never."""
    abi = registry.get("580.159.04")
    plan_of = decision.LaneTables().control_plan
    checked = plain = 0
    for cmd, row in rules.CONTROLS.items():
        if row.pre or row.relay_if or row.run or row.charge:
            assert not rules.simple_control(abi, cmd), hex(cmd)
        plan = plan_of(abi, cmd)
        op = abi.control(cmd)
        if row.relay_if or row.run or row.charge or row.driver_flag or op is None or \
                op.params is None or rules.lane_pointers(op.params) is None:
            assert plan is None, hex(cmd)
            continue
        if plan is None:
            continue
        is_checked, ptrs, embedded = plan.checked, plan.null_ptrs, plan.embedded_fields
        pre, post, size = plan.pre, plan.post, plan.size
        gpu_id_off, embedded_only = plan.gpu_id_off, plan.embedded_only
        if embedded_only:  # a check of its embedded buffers' sizes (and NULL pointers) only
            assert is_checked and pre is None and gpu_id_off < 0, hex(cmd)
            assert [p for p, _c, _e in embedded_only] == [o for o, _n in embedded], hex(cmd)
            assert not [p for p, f, o in op.params.walk()
                        if f.kind == "fd" or f.name in rules.CLIENT_HANDLE_FIELDS
                        or f.name in rewrite.GPU_ID_FIELD_NAMES], hex(cmd)
            for (ptr, count, elem), (_o, name) in zip(embedded_only, embedded):
                f = op.params.by_name[name]
                assert op.params.by_name[f.size_field].offset == count, hex(cmd)
                assert elem == (1 if f.points_to == "bytes" else abi.struct(f.points_to).size)
        assert pre is row.pre and post is row.post and size == op.size
        if gpu_id_off >= 0:  # a check of its one GPU id (and NULL pointers) only
            assert is_checked and pre is None and not embedded and len(ptrs) <= 2, hex(cmd)
            names = [(p, f.kind) for p, f, o in op.params.walk()
                     if f.kind in ("ptr", "fd") or f.name in rules.CLIENT_HANDLE_FIELDS
                     or f.name in rewrite.GPU_ID_FIELD_NAMES]
            assert [p for p, k in names if k != "ptr"] == ["gpuId"], (hex(cmd), names)
            assert op.params.by_name["gpuId"].offset == gpu_id_off
            assert cmd not in rewrite.GPU_IDS_ANSWERED
        assert is_checked == (row.pre is not None or not rules.plain_layout(op.params)), hex(cmd)
        # every pointer field is one the check requires NULL; none in a plain layout; those
        # that name embedded buffers (which the native loop may carry) are top-level ones
        # with a count field
        assert ptrs == tuple(o for p, f, o in op.params.walk() if f.kind == "ptr"), hex(cmd)
        assert is_checked or not ptrs
        assert {o for o, _n in embedded} <= set(ptrs), hex(cmd)
        assert all(op.params.by_name[n].size_field for _o, n in embedded), hex(cmd)
        checked += is_checked
        plain += not is_checked
    # the NVML id controls are among the checked ones
    for cmd in (0x201, 0x202, 0x205, 0x214, 0x215, 0x216):
        assert plan_of(abi, cmd).checked is True, hex(cmd)
    assert plan_of(abi, 0x202).null_ptrs  # GET_ID_INFO's szName: laned only when NULL
    assert not plan_of(abi, 0x202).embedded_fields  # (a string with no count field: not embedded)
    assert [n for _o, n in plan_of(abi, 0x80170D).embedded_fields] == ["pChannelHandleList",
                                                            "pChannelList"]
    # NVML's per-GPU queries whose check is their GPU id (a front end may repeat it); the id
    # lists (answered, or with a pre-hook) and a control naming a client are not such
    # CUDA's channel list: both lists of 4-byte handles, their count numChannels (offset 0)
    assert plan_of(abi, 0x80170D).embedded_only == ((8, 0, 4), (16, 0, 4))
    # three embedded strings are more than a settled control carries
    assert plan_of(abi, 0x101).embedded_fields and not plan_of(abi, 0x101).embedded_only
    assert {hex(c) for c in rules.CONTROLS if getattr(plan_of(abi, c), "gpu_id_off", -1) >= 0} == {
        "0x202", "0x205", "0x21b", "0x279", "0x289"}
    assert checked > 10 and plain > 50, (checked, plain)


# The seccomp listener's wait on a many-CPU host (no synchronous wake-ups, looking for the
# next call for 100 µs after each answer; this machine's default is the other way round).
SPIN = {"DEVBROKER_SECCOMP_SYNC_WAKE": "0", "DEVBROKER_SECCOMP_SPIN_US": "100"}


def _run(start_broker, traces_dir, lane: bool, frontend: str, prog: str = "fastlane_prog.py"):
    env = {"DEVBROKER_CONTROL_LANE": "1" if lane else "0", "DEVBROKER_NATIVE_LANE": "1"}
    if frontend == "seccomp-spin":
        frontend = "seccomp"
        env.update(SPIN)
    elif frontend == "seccomp-python":  # the Python listener's lanes (no native loop)
        frontend = "seccomp"
        env["DEVBROKER_NATIVE_LANE"] = "0"
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        b = start_broker(POLICY)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    b.frontend = frontend
    args = ([str(traces_dir / f"h200-580.159.04-{n}.nvtrace") for n in ("torch", "nvml")]
            if prog == "fastlane_prog.py" else [])
    r = b.exec("t", sys.executable, str(HERE / prog), *args, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    assert lines and lines[-1]["what"] == "done", r.stdout + r.stderr
    # the broker says at start which loop its seccomp listeners run, and why
    started = b.output()
    if frontend == "seccomp":
        want = ("native loop (" if env["DEVBROKER_NATIVE_LANE"] == "1" and lane
                else "Python loop (")
        assert f"seccomp listeners: {want}" in started, started
    st = b.status().get("control_lane", {})
    st_fast = st.get("admitted", 0)
    shown = b.cli("status").stdout  # what the operator sees
    assert f"control lane: {st_fast} calls" in shown, shown
    b.stop()
    detached = [a for a in b.audit() if a.get("event") == "tenant-detached"]
    fast = sum(a.get("controls_fast", 0) for a in detached)
    native = sum(a.get("native_answered", 0) for a in detached)
    if frontend == "fuse":  # no listener counters: the broker's own
        fast = st_fast
    elif env["DEVBROKER_NATIVE_LANE"] == "1" and lane:
        # the native loop answered the lane's calls (and the tenant's other opens) itself
        assert native >= fast > 0, (native, fast)
    else:
        assert native == 0, native
    denies = [a for a in b.audit() if a.get("event") == "deny"]
    if prog != "fastlane_prog.py":
        return lines[:-1], lines[-1], st, denies
    return lines[:-1], lines[-1]["controls"], fast, denies


@pytest.mark.root
@pytest.mark.parametrize("frontend", ["seccomp", "seccomp-spin", "seccomp-python", "fuse"])
def test_lane_answers_as_the_general_path(start_broker, traces_dir, frontend):
    if os.geteuid() != 0:
        pytest.skip("needs root (tenant sandbox)")
    on, n_on, fast_on, denies_on = _run(start_broker, traces_dir, True, frontend)
    off, n_off, fast_off, denies_off = _run(start_broker, traces_dir, False, frontend)
    assert n_on == n_off > 50  # the traces' distinct controls were all sent
    assert fast_off == 0
    # The lane took a good part of the calls (the allowed simple controls and FB_GET_INFO_V2's
    # post-hook row), and none of the refused ones.
    print("lane took", fast_on, "of", len(on), "calls;", len(denies_on), "refusals")
    assert fast_on >= 40, fast_on
    diff = [(a, b) for a, b in zip(on, off)
            if a != b and not ((a["cmd"] in CLOCKS or a["what"] in ADDRESSES)
                               and {**a, "params": ""} == {**b, "params": ""})]
    assert not diff, diff[:5]
    assert len(on) == len(off)
    by_what = {x["what"]: x for x in on if x["what"] != "trace"}
    # refusals: the driver's answers for foreign handles, EINVAL-class for a bad size or
    # pointer, NOT_SUPPORTED-class status for a control not on the allowlist; audited alike
    assert by_what["foreign-client"]["status"] != 0
    assert by_what["foreign-object"]["status"] != 0
    assert by_what["unlisted-control"]["status"] != 0 or by_what["unlisted-control"]["errno"]
    assert by_what["short-params"]["status"] != 0 or by_what["short-params"]["errno"]
    assert by_what["null-params"]["status"] != 0 or by_what["null-params"]["errno"]
    # checked controls: the tenant's own GPU id answered, another id refused, ATTACH_IDS's
    # "all probed" rewritten by its pre-hook to the tenant's GPUs (answered), a foreign one
    # refused — the same answers with the lane on and off (compared above)
    assert by_what["own-gpu-id"]["status"] == 0 and not by_what["own-gpu-id"]["errno"]
    assert by_what["foreign-gpu-id"]["status"] != 0
    assert by_what["attach-all-probed"]["status"] == 0
    assert by_what["attach-foreign"]["status"] != 0
    assert by_what["attached-ids"]["status"] == 0
    assert by_what["id-info-null-name"]["status"] == 0
    what = lambda ds: sorted(d.get("what", "") for d in ds)  # noqa: E731
    assert what(denies_on) == what(denies_off)
    assert len(denies_on) >= 6
    assert any("0x7700" in d.get("reason", "") for d in denies_on), denies_on


def test_continue_lane_admits_exactly_what_the_general_steps_continue(traces_dir):
    """Every UVM command of the recorded PyTorch session, on a UVM file that lives in the
    tenant (as with the real backend): the continue lane admits it exactly when the general
    steps answer "run in the caller" — with the trace's clients the tenant's, and again
    with them another tenant's (then both refuse; only the general steps write the
    record)."""
    import ctypes

    from devbroker.abi import nvtrace
    from devbroker.abi.nodes import NodeKind
    from devbroker.abi.nvtrace import RecordType
    from devbroker.abi.traceview import TraceDecoder
    from devbroker.backends.tenantfile import TenantFile
    from devbroker.broker.effects import perform_blocking, run_blocking
    from devbroker.broker.interface import Caller, IoctlRequest, OpenRequest
    from devbroker.testing.inproc import OwnMemory, make_broker
    from devbroker.testing.policies import two_h200

    abi = registry.get("580.159.04")
    calls = []
    dec = TraceDecoder(abi)
    for rec in nvtrace.read_file(traces_dir / "h200-580.159.04-torch.nvtrace"):
        ev = dec.decode(rec)
        if rec.type == RecordType.IOCTL and ev.call_in is not None and ev.call_in.kind == "uvm":
            size = abi.uvm(rec.cmd).size  # (the recorder keeps a window of long arguments)
            calls.append((rec.cmd, (bytes(rec.in_) + bytes(size))[:size]))
    assert len(calls) > 100
    for owner in ("alice", "bob"):
        b = make_broker(two_h200(tenant("alice", capabilities=["nvml", "compute", "uvm"]),
                                 tenant("bob", gpus=[1], capabilities=["nvml", "compute",
                                                                       "uvm"])))
        caller = Caller(4242, 4242, 0, 0, "pid:[1]")
        ctl = b.open_now(OpenRequest(caller, owner, NodeKind.CTL, 0)).session
        uvm = b.open_now(OpenRequest(caller, "alice", NodeKind.UVM, 0)).session
        s = b.sessions[uvm]
        s.file = TenantFile(NodeKind.UVM, 0, "/dev/nvidia-uvm", (1, 2))
        for cmd, arg in calls:
            spec = abi.uvm(cmd)
            for name in ("hClient",):
                if spec.params is not None and name in spec.params.by_name:
                    h = getattr(spec.params.decode(arg[:spec.size]), name)
                    if h and b.clients.owner(h) is None:
                        b.clients.new(b.sessions[ctl], h)
        lane = b.continue_lane
        admitted = general = 0
        for cmd, arg in calls:
            size = lane.arg_size(uvm, cmd)
            ok = size is not None and lane.admit(uvm, caller, cmd, arg[:size])
            buf = ctypes.create_string_buffer(arg, len(arg))
            req = IoctlRequest(caller, uvm, cmd, ctypes.addressof(buf), None, OwnMemory())
            rep = run_blocking(b.ioctl_steps(req), lambda e: perform_blocking(e, b.memgate))
            assert ok == rep.run_in_caller, (owner, abi.uvm(cmd).name, rep)
            admitted += ok
            general += rep.run_in_caller
        print(owner, "admitted", admitted, "continued by the general steps", general, "of", len(calls))
        if owner == "alice":
            assert admitted == general > 100
        else:  # bob's clients named in alice's UVM calls: continued only where none is named
            assert admitted == general < len(calls)




@pytest.mark.root
def test_native_loop_stalled_tenant_page_is_refused_at_the_deadline(start_broker):
    """The native loop reads the tenant's memory in C: a read that blocks on a page the
    tenant controls is answered EFAULT by the listener's watchdog at the memory gate's
    deadline (audited, counted as stalled while it stays in the kernel), the tenant's
    other calls are served meanwhile, and the read's late return is booked."""
    if os.geteuid() != 0:
        pytest.skip("needs root (tenant sandbox)")
    import errno
    import subprocess
    import time

    # The tenant's root has no CAP_SYS_PTRACE in its sandbox: a userfaultfd that also
    # catches the kernel's faults needs unprivileged ones allowed, for this test only.
    knob = Path("/proc/sys/vm/unprivileged_userfaultfd")
    if not knob.exists():
        pytest.skip("no userfaultfd in this kernel")
    before = knob.read_text().strip()
    knob.write_text("1")
    b = start_broker(POLICY)
    b.frontend = "seccomp"
    from stallers import STALLER

    p = b.exec_popen("t", sys.executable, "-c", STALLER, "/dev", stdin=subprocess.PIPE,
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = lambda: json.loads(p.stdout.readline() or "null")  # noqa: E731
        calling = line()
        assert calling and calling["what"] == "calling", p.stderr.read()
        answered = line()
        assert answered["what"] == "answered"
        assert answered["errno"] == errno.EFAULT, (answered, calling, b.audit()[-5:])
        assert 1.5 < answered["t"] - calling["t"] < 30  # at the deadline (2 s), not at once
        assert b.tenant("t")["memory_stalled"] == 1
        shown = b.cli("status").stdout  # the operator sees which loop serves the tenant
        assert "seccomp listeners: t (native loop" in shown, shown
        # the same tenant's other process is served while the read is still stuck
        r = b.exec("t", sys.executable, "-m", "devbroker.tools.hotpath", "latency", "--n", "50",
                   "--dev", "/dev", timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        p.stdin.write("go\n")
        p.stdin.flush()
        assert line()["what"] == "released"
        for _ in range(200):
            if b.tenant("t")["memory_stalled"] == 0:
                break
            time.sleep(0.05)
        assert b.tenant("t")["memory_stalled"] == 0
    finally:
        p.kill()
        p.wait()
        knob.write_text(before)
    b.stop()
    audit = b.audit()
    late = [a for a in audit if a.get("event") == "deny" and a.get("tenant") == "t"
            and "did not complete within" in a.get("reason", "")]
    assert len(late) == 1, audit
    assert "native loop" in late[0]["what"]
    assert any(a.get("tenant") == "t" and "returned after" in a.get("message", "")
               for a in audit), audit
    detached = [a for a in audit if a.get("event") == "tenant-detached"]
    assert sum(a.get("native_answered", 0) for a in detached) > 0


@pytest.mark.root
@pytest.mark.parametrize("frontend", ["seccomp", "fuse"])
def test_checked_control_racing_thread_never_reaches_another_gpu(start_broker, frontend):
    """A checked control (GPU ids in its parameters) with a tenant thread flipping the id
    between its own GPU and another GPU during the calls: every answer is the own GPU's or
    a refusal (audited), never the other GPU's — the broker decides on its private copy and
    the driver answers that copy. Both outcomes must occur, or the race was not run."""
    if os.geteuid() != 0:
        pytest.skip("needs root (tenant sandbox)")
    from devbroker.testing.policies import two_h200

    b = start_broker(two_h200(tenant("t", gpus=[0], capabilities=["nvml", "compute", "uvm"])))
    b.frontend = frontend
    # the emulated GPUs' ids: (domain << 16) | (bus << 8) | slot, slots 6 and 7
    r = b.exec("t", sys.executable, str(HERE / "race_ids_prog.py"), "0x6", "0x7", "1500",
               timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    got = json.loads([x for x in r.stdout.splitlines() if x.startswith("{")][-1])
    print(frontend, got)
    assert got["other"] == 0, got
    assert got["own"] > 0 and got["refused"] > 0, got
    assert got["errno"] == 0, got
    st = b.status().get("control_lane", {})
    assert st.get("admitted", 0) > 0, st  # the lane took part
    b.stop()
    denies = [a for a in b.audit() if a.get("event") == "deny" and "0x7" in a.get("reason", "")]
    assert denies, "the refusals were not audited"



@pytest.mark.root
@pytest.mark.parametrize("frontend", ["seccomp", "seccomp-python", "fuse"])
def test_allocation_lane_answers_as_the_general_path(start_broker, traces_dir, frontend):
    """The allocation lane (ControlLane._admit_alloc): the same answers, handles, parameter
    blocks and refusals with the lane on and off, the lane's objects in the books (used as
    parents, freed again: RM_FREE of an object the books do not hold is refused), and the
    lane took the allocations it may take and none of the others."""
    if os.geteuid() != 0:
        pytest.skip("needs root (tenant sandbox)")
    on, done_on, st_on, denies_on = _run(start_broker, traces_dir, True, frontend,
                                         "alloclane_prog.py")
    off, done_off, st_off, denies_off = _run(start_broker, traces_dir, False, frontend,
                                             "alloclane_prog.py")
    assert on == off, [(a, b) for a, b in zip(on, off) if a != b][:5]
    assert done_on == done_off and done_on["made"] >= 8, done_on
    by_what = {x["what"]: x for x in on}
    ok = lambda w: by_what[w]["errno"] == 0 and by_what[w]["status"] == 0  # noqa: E731
    for w in ("shared-data", "shared-data-sized", "shared-data-nvos21", "second-subdevice",
              "channel-group", "channel-0", "channel-1", "channel-2"):
        assert ok(w), by_what[w]
    # a channel's parent must be one of the tenant's channel groups (rules.ClassRule
    # .parents): the lane declines one under a channel, the general path refuses it
    assert by_what["channel-under-channel"]["status"] != 0
    # the emulator's (the driver's) own answers through the lane
    assert by_what["vaspace"]["status"] != 0  # allowed, not modelled: NOT_SUPPORTED
    # refusals of the general path, audited alike with the lane on and off
    for w in ("foreign-client", "foreign-parent", "duplicate-handle", "debugger-foreign",
              "unlisted-class", "device-instance-1", "device-instance-7",
              "os-event-kernel-callback", "os-event-foreign-client"):
        assert by_what[w]["status"] != 0 or by_what[w]["errno"], by_what[w]
    frees = [x for x in on if x["what"] == "free"]
    assert len(frees) == done_on["made"] and all(x["status"] == 0 for x in frees), frees
    what = lambda ds: sorted(d.get("what", "") for d in ds)  # noqa: E731
    assert what(denies_on) == what(denies_off)
    assert any("RM_ALLOC" in d.get("what", "") for d in denies_on), denies_on
    # laned: shared data x3, the device and subdevice of open_gpu and the second
    # subdevice, the three channels, the VA space, sysmem and
    # debugger-own (both checked): 12; the rest (the channel under a channel) (the group, refusals, devices of other
    # instances, rights, NULL, wrong size, a pointer set) went the general way
    print("allocation lane:", st_on, [(x["what"], x.get("status")) for x in on][:24])
    # header-only calls: frees the books no longer hold (or never held), another client's
    # — refused on the general path, audited alike (compared above); NUMA_INFO answered
    for w in ("free-twice", "free-unknown", "free-foreign-client"):
        assert by_what[w]["status"] != 0 or by_what[w]["errno"], by_what[w]
    assert "numa-info" in by_what
    # the version check (laned but for another known version: compared above on and off)
    own, unknown = by_what["version-own"], by_what["version-unknown"]
    assert own["errno"] == 0 and (unknown["errno"] or unknown["reply"] != own["reply"]), on
    # a root client freed (laned): its 6 GiB held the quota until then, and came back with it
    assert by_what["root2-vidmem"]["ok"], on
    assert by_what["vidmem-while-root2"]["status"] != 0, by_what["vidmem-while-root2"]
    assert by_what["free-root2"]["status"] == 0, by_what["free-root2"]
    assert ok("vidmem-after-root2"), by_what["vidmem-after-root2"]
    assert by_what["free-under-root2"]["status"] != 0 or by_what["free-under-root2"]["errno"]
    # device memory: the quota holds with the lane as without it (four 2 GiB blocks of the
    # 8 GiB, not a fifth nor one byte more, again after a free)
    for w in ("vidmem-0", "vidmem-1", "vidmem-2", "vidmem-3", "vidmem-free", "vidmem-again"):
        assert ok(w) if w != "vidmem-free" else by_what[w]["status"] == 0, by_what[w]
    for w in ("vidmem-over-quota", "vidmem-one-byte-over"):
        assert by_what[w]["status"] != 0, by_what[w]
    # (and the first client's 6 GiB while the second held its 6)
    assert sum("quota" in d.get("reason", "") for d in denies_on) == 3, denies_on
    assert st_off.get("allocations", 0) == 0
    # + the five device-memory blocks the quota let through (the two over it were
    # declined at the check, the one with an address set at admission), + the second
    # client's subdevice and 6 GiB and the first client's 6 GiB after the root free, + the
    # two clients' devices (open_gpu; the devices of instances 1 and 7 declined at the
    # check), + the tenant's own OS event (its `data` a key: the emulator's NOT_SUPPORTED,
    # as the general path's; the kernel-callback notifier and the foreign client declined);
    # system memory goes the general way (its size is booked as pinned host memory there)
    assert by_what["os-event-own"]["status"] == 0x56, by_what["os-event-own"]
    assert st_on.get("allocations") == 21, st_on
    assert sum("device instance" in d.get("reason", "") for d in denies_on) == 2, denies_on
    # every free of an object the books hold, the second client's root among them: the
    # objects made (each freed once), vidmem-0, vidmem-1, the 6 GiB after the root free,
    # and the root (frees the books do not hold went the general way)
    assert st_on.get("frees") == done_on["made"] + 4, st_on
    assert st_off.get("frees", 0) == 0


@pytest.mark.root
@pytest.mark.parametrize("frontend", ["seccomp", "fuse"])
def test_allocation_lane_quota_holds_against_racing_threads(start_broker, frontend):
    """Three tenant processes (each with its own seccomp listener) of eight threads each
    allocate 1 GiB blocks at one wall-clock instant (96 asked, 8 GiB quota) and hold them:
    with the allocation lane taking device memory, exactly eight are made — the quota test
    and the hold of the bytes are one step under the state lock, so two listeners cannot
    both fit in the same free space."""
    if os.geteuid() != 0:
        pytest.skip("needs root (tenant sandbox)")
    b = start_broker(POLICY)
    b.frontend = frontend
    start_at = time.time() + 3
    procs = [b.exec_popen("t", sys.executable, str(HERE / "alloclane_prog.py"), "race",
                          f"{start_at:.3f}", stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) for _ in range(3)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    got = [json.loads(o.strip().splitlines()[-1]) for o, _e in outs]
    assert sum(g["made"] for g in got) == 8 and sum(g["refused"] for g in got) == 88, got
    assert b.status()["control_lane"]["allocations"] >= 8  # the lane made them
    assert sum(1 for a in b.audit() if "quota" in a.get("reason", "")) == 88


def test_allocation_lane_holds_the_quota_between_check_and_finish():
    """Two device-memory allocations admitted and checked before either reaches the driver
    (two listener threads, interleaved): the first one's bytes are held in the books from
    its check, so the second — which would fit the free space alone — is sent the general
    way (which refuses it, audited); `release` gives the hold back when the first never
    reaches finish, and `finish` turns it into the object's charge when it does."""
    import ctypes

    import trio

    from devbroker.testing.inproc import InProcTenant, make_broker

    b = make_broker(one_h200(tenant("t", memory_quota="8GiB",
                                    capabilities=["nvml", "compute", "uvm"])))
    t = InProcTenant(b, "t", pid=6001)
    ctl, client, dev, _sub = trio.run(t.subdevice)
    lane, abi = b.control_lane, t.abi
    cmd = abi.escape_cmd("NV_ESC_RM_ALLOC", abi.struct("NVOS64_PARAMETERS").size)
    block = abi.rm_class(0x40).params
    keep = []

    def admitted(handle: int, size: int):
        params = block.decode(bytes(block.size)).replace(owner=client, size=size).encode()
        buf = ctypes.create_string_buffer(params, len(params))
        keep.append(buf)
        hdr = t.new("NVOS64_PARAMETERS", hRoot=client, hObjectParent=dev, hObjectNew=handle,
                    hClass=0x40, pAllocParms=ctypes.addressof(buf)).encode()
        adm = lane.admit(t.fds[ctl], t.caller, cmd, hdr)
        assert adm is not None and adm.alloc is not None and adm.checked
        return adm, hdr, bytearray(params)

    used = lambda: b.tenants["t"].used()[0]  # noqa: E731
    a1, h1, p1 = admitted(0xE1, 6 << 30)
    a2, _h2, p2 = admitted(0xE2, 6 << 30)
    assert lane.check(a1, p1) and used() == 6 << 30  # held from the check
    assert not lane.check(a2, p2)  # 6 + 6 > 8 GiB: the general way (which refuses)
    lane.release(a1)  # the first never reached the driver (e.g. its caller went away)
    lane.release(a1)  # (twice is harmless)
    assert used() == 0
    a3, h3, p3 = admitted(0xE3, 6 << 30)
    assert lane.check(a3, p3)
    ret, err, hdr_out = b.backend.run_control(b.sessions[t.fds[ctl]].file, -1, h3, p3,
                                              a3.header, abi)
    out = lane.finish(a3, h3, bytes(p3), ret, err, hdr_out, p3)
    assert int.from_bytes(hdr_out[40:44], "little") == 0 and len(out) == block.size
    obj = b.tenants["t"].clients[client].objects[0xE3]
    assert obj.charged == 6 << 30 and used() == 6 << 30  # the hold became the charge
    assert not [h for h in b.tenants["t"].clients[client].objects if h < 0]  # no holds left


def test_embedded_buffers_are_listed_only_for_a_front_end_that_carries_them():
    """A checked control with embedded buffers (FIFO_GET_CHANNELLIST: the handle and channel
    lists behind two pointers): a front end that does not carry them (the Python lanes,
    FUSE) sends it the general way when a pointer is set; the native loop, which does,
    gets each set buffer listed as the general path sizes it (numChannels x 4 bytes of the
    private copy), and none when they are larger than it carries."""
    import ctypes

    import trio

    from devbroker.testing.inproc import InProcTenant, make_broker

    b = make_broker(one_h200(tenant("t", memory_quota="8GiB",
                                    capabilities=["nvml", "compute", "uvm"])))
    t = InProcTenant(b, "t", pid=6002)
    ctl, client, dev, _sub = trio.run(t.subdevice)
    lane, abi = b.control_lane, t.abi
    CHANNELLIST = 0x80170D
    spec = abi.control(CHANNELLIST).params
    cmd = abi.escape_cmd("NV_ESC_RM_CONTROL", abi.struct("NVOS54_PARAMETERS").size)
    keep = []

    def admitted(n: int, handles: int, channels: int):
        params = spec.decode(bytes(spec.size)).replace(
            numChannels=n, pChannelHandleList=handles, pChannelList=channels).encode()
        buf = ctypes.create_string_buffer(params, len(params))
        keep.append(buf)
        hdr = t.new("NVOS54_PARAMETERS", hClient=client, hObject=dev, cmd=CHANNELLIST,
                    params=ctypes.addressof(buf), paramsSize=spec.size).encode()
        adm = lane.admit(t.fds[ctl], t.caller, cmd, hdr)
        assert adm is not None and adm.checked and adm.embedded_fields
        return adm, bytearray(params)

    a, p = admitted(3, 0x7F0000001000, 0x7F0000002000)
    assert not lane.check(a, p)  # pointers set, not carried: the general way
    a, p = admitted(3, 0x7F0000001000, 0x7F0000002000)
    assert lane.check(a, p, embedded_ok=True)
    assert a.embedded == ((8, 0x7F0000001000, 12), (16, 0x7F0000002000, 12))
    a, p = admitted(2, 0, 0x7F0000002000)  # only the buffers whose pointer is set
    assert lane.check(a, p, embedded_ok=True) and a.embedded == ((16, 0x7F0000002000, 8),)
    a, p = admitted(1 << 20, 0x7F0000001000, 0x7F0000002000)  # 2 x 4 MiB: too large
    assert not lane.check(a, p, embedded_ok=True)
    a, p = admitted(0, 0, 0)  # no buffer at all: laned by any front end
    assert lane.check(a, p) and a.embedded == ()


def test_a_client_the_tenant_allocated_itself_is_named_for_adoption_only_while_it_may_be():
    """`ControlLane.unknown_client` (the native loop then has the broker adopt the client on
    a duplicate of the file, `Broker.adopt_client_here`): the root client a header names on
    a ctl file that lives in the tenant, while that file has continued root allocations not
    yet adopted — never a client the books hold, another tenant's, 0, a new root client's
    allocation, or on a file without such allocations."""
    import struct

    from devbroker.abi.nodes import NodeKind
    from devbroker.backends.tenantfile import TenantFile
    from devbroker.broker.interface import Caller, OpenRequest
    from devbroker.testing.inproc import make_broker
    from devbroker.testing.policies import two_h200

    abi = registry.get("580.159.04")
    caps = ["nvml", "compute", "uvm"]
    b = make_broker(two_h200(tenant("alice", gpus=[0], capabilities=caps),
                             tenant("bob", gpus=[1], capabilities=caps)))
    caller = Caller(4343, 4343, 0, 0, "pid:[1]")
    sid = b.open_now(OpenRequest(caller, "alice", NodeKind.CTL, 0)).session
    f = b.sessions[sid].file = TenantFile(NodeKind.CTL, 0, "/dev/x", (9, 1))
    bob = b.open_now(OpenRequest(caller, "bob", NodeKind.CTL, 0)).session
    b.clients.new(b.sessions[bob], 0xC1D0B0B0)
    lane = b.control_lane
    ctl = abi.escape_cmd("NV_ESC_RM_CONTROL", 32)
    alloc = abi.escape_cmd("NV_ESC_RM_ALLOC", abi.struct("NVOS64_PARAMETERS").size)

    def control(h):
        return struct.pack("<IIIIQII", h, h, 0x201, 0, 0, 0, 0)

    def allocation(root, cls):
        return abi.struct("NVOS64_PARAMETERS").decode(
            bytes(abi.struct("NVOS64_PARAMETERS").size)).replace(
            hRoot=root, hObjectParent=root, hObjectNew=0x5C000001, hClass=cls).encode()

    assert lane.unknown_client(sid, ctl, control(0xC1D0A11C)) is None  # nothing continued
    f.continued_root_allocs = 1  # the tenant allocated a root client itself
    assert lane.unknown_client(sid, ctl, control(0xC1D0A11C)) == 0xC1D0A11C
    assert lane.unknown_client(sid, alloc, allocation(0xC1D0A11C, 0x2080)) == 0xC1D0A11C
    assert lane.unknown_client(sid, alloc, allocation(0, 0x41)) is None  # a new root client
    assert lane.unknown_client(sid, ctl, control(0)) is None
    assert lane.unknown_client(sid, ctl, control(0xC1D0B0B0)) is None  # bob's
    b.clients.new(b.sessions[sid], 0xC1D0A11C)
    f.adopted.add(0xC1D0A11C)
    assert lane.unknown_client(sid, ctl, control(0xC1D0A11C)) is None  # held now
    assert lane.unknown_client(sid, ctl, control(0xC1D0A22C)) is None  # none left to adopt


def test_continue_lane_takes_the_rm_escapes_bound_to_the_caller_as_the_general_steps():
    """The RM escapes the driver binds to the calling process (RM_MAP_MEMORY, the OS events,
    UNMAP, UPDATE_DEVICE_MAPPING_INFO) and UVM commands (UVM_MM_INITIALIZE's uvmFd) on files
    that live in the tenant: the continue lane
    admits each exactly when the general steps answer "run in the caller" — own client,
    objects and files; another tenant's client, object or file; an object that is no
    device or memory of the client; fd -1 (none), a file that is not NVIDIA's; a GPU taken
    away by a policy change."""
    import ctypes

    from devbroker.abi.nodes import NodeKind
    from devbroker.backends.tenantfile import TenantFile
    from devbroker.broker.effects import perform_blocking, run_blocking
    from devbroker.broker.interface import Caller, IoctlRequest, OpenRequest
    from devbroker.testing.inproc import OwnMemory, make_broker
    from devbroker.testing.policies import two_h200

    abi = registry.get("580.159.04")
    caps = ["nvml", "compute", "uvm"]
    b = make_broker(two_h200(tenant("alice", gpus=[0, 1], capabilities=caps),
                             tenant("bob", gpus=[1], capabilities=caps)))
    caller = Caller(4242, 4242, 0, 0, "pid:[1]")
    sids = {}
    for who, node, minor, key in (("alice", NodeKind.CTL, 0, 1), ("alice", NodeKind.GPU, 0, 2),
                                  ("alice", NodeKind.GPU, 1, 3), ("bob", NodeKind.CTL, 0, 4),
                                  ("bob", NodeKind.GPU, 1, 5), ("alice", NodeKind.UVM, 0, 6),
                                  ("bob", NodeKind.UVM, 0, 7)):
        sid = b.open_now(OpenRequest(caller, who, node, minor)).session
        b.sessions[sid].file = TenantFile(node, minor, f"/dev/x{key}", (9, key))
        sids[(who, node, minor)] = sid
    fds = {10: sids[("alice", NodeKind.CTL, 0)], 11: sids[("alice", NodeKind.GPU, 0)],
           12: sids[("alice", NodeKind.GPU, 1)], 20: sids[("bob", NodeKind.GPU, 1)],
           13: sids[("alice", NodeKind.UVM, 0)], 21: sids[("bob", NodeKind.UVM, 0)]}
    mine = b.clients.new(b.sessions[fds[10]], 0xC1D00001)
    theirs = b.clients.new(b.sessions[sids[("bob", NodeKind.CTL, 0)]], 0xC1D00002)
    for c, gpu in ((mine, 0), (theirs, 1)):
        c.add(0xA0, 0x80, c.handle, gpu=gpu)
        c.add(0xA1, 0x80, c.handle, gpu=1)
        c.add(0xB0, 0x40, 0xA0, gpu=gpu)
        c.add(0xB1, 0x40, 0xA1, gpu=1)
    M, U, E, F = ("NV_ESC_RM_MAP_MEMORY", "NV_ESC_RM_UNMAP_MEMORY", "NV_ESC_ALLOC_OS_EVENT",
                  "NV_ESC_FREE_OS_EVENT")

    uvm_cmd = {op.name: n for n, op in abi.uvm_cmds.items()}

    def arg(name, **kw):
        spec = (abi.escape(name) or abi.uvm(uvm_cmd[name])).params
        v = spec.decode(bytes(spec.size))
        inner = {k[2:]: kw.pop(k) for k in list(kw) if k.startswith("p_")}
        if inner:
            v = v.replace(params=v.params.replace(**inner))
        return v.replace(**kw).encode()

    own = dict(p_hClient=mine.handle, p_hDevice=0xA0, p_hMemory=0xB0)
    cases = [
        ("map-own", 11, M, arg(M, fd=11, **own)),
        ("map-own-ctl-fd", 10, M, arg(M, fd=10, **own)),
        ("map-no-fd", 11, M, arg(M, fd=-1, **own)),
        ("map-foreign-fd", 11, M, arg(M, fd=20, **own)),
        ("map-not-nvidia-fd", 11, M, arg(M, fd=7, **own)),
        ("map-negative-fd", 11, M, arg(M, fd=-5, **own)),
        ("map-foreign-client", 11, M, arg(M, fd=11, p_hClient=theirs.handle, p_hDevice=0xA0,
                                          p_hMemory=0xB0)),
        ("map-no-such-memory", 11, M, arg(M, fd=11, **{**own, "p_hMemory": 0xBEEF})),
        ("map-zero-client", 11, M, arg(M, fd=11, **{**own, "p_hClient": 0})),
        ("map-gpu1", 12, M, arg(M, fd=12, p_hClient=mine.handle, p_hDevice=0xA1,
                                p_hMemory=0xB1)),
        ("unmap-own", 11, U, arg(U, hClient=mine.handle, hDevice=0xA0, hMemory=0xB0)),
        ("unmap-foreign", 11, U, arg(U, hClient=theirs.handle, hDevice=0xA0, hMemory=0xB0)),
        ("event-own", 10, E, arg(E, hClient=mine.handle, hDevice=0xA0, fd=10)),
        ("event-foreign-client", 10, E, arg(E, hClient=theirs.handle, hDevice=0xA0, fd=10)),
        ("event-foreign-fd", 10, E, arg(E, hClient=mine.handle, hDevice=0xA0, fd=20)),
        ("free-event-own", 10, F, arg(F, hClient=mine.handle, hDevice=0xA0, fd=10)),
        # UVM (the caller's own va space): a UVM file of the tenant's, another tenant's, a
        # file that is not NVIDIA's
        ("uvm-init", 13, "UVM_INITIALIZE", arg("UVM_INITIALIZE")),
        ("uvm-mm-own", 13, "UVM_MM_INITIALIZE", arg("UVM_MM_INITIALIZE", uvmFd=13)),
        ("uvm-mm-foreign", 13, "UVM_MM_INITIALIZE", arg("UVM_MM_INITIALIZE", uvmFd=21)),
        ("uvm-mm-not-nvidia", 13, "UVM_MM_INITIALIZE", arg("UVM_MM_INITIALIZE", uvmFd=7)),
    ]
    lane = b.continue_lane

    def decide(fd, name, data):
        sid = fds[fd]
        cmd = uvm_cmd[name] if name in uvm_cmd else abi.escape_cmd(name, len(data))
        size = lane.arg_size(sid, cmd)
        ok = size is not None and lane.admit(sid, caller, cmd, data[:size],
                                             resolve_fd=fds.get)
        buf = ctypes.create_string_buffer(data, len(data))
        req = IoctlRequest(caller, sid, cmd, ctypes.addressof(buf), data, OwnMemory(),
                           lambda n: fds.get(n))
        rep = run_blocking(b.ioctl_steps(req), lambda e: perform_blocking(e, b.memgate))
        return ok, rep.run_in_caller

    got = {what: decide(fd, name, data) for what, fd, name, data in cases}
    assert all(lane_ok == general for lane_ok, general in got.values()), got
    continued = {w for w, (ok, _g) in got.items() if ok}
    assert continued == {"map-own", "map-own-ctl-fd", "map-no-fd", "map-gpu1", "unmap-own",
                         "event-own", "free-event-own", "uvm-init", "uvm-mm-own"}, continued
    # GPU 1 taken from alice by a policy change: her objects there are refused the same way
    from devbroker.broker.policy import load_policy_text

    b.apply_policy(load_policy_text(two_h200(tenant("alice", gpus=[0], capabilities=caps),
                                             tenant("bob", gpus=[1], capabilities=caps)),
                                    "test"))
    ok, general = decide(11, M, arg(M, fd=11, p_hClient=mine.handle, p_hDevice=0xA1,
                                    p_hMemory=0xB1))
    assert ok is False and general is False


def test_the_call_counters_wrap_every_lane_method_with_its_signature():
    """With metrics on, front ends talk to the lanes through callstats' counting wrappers:
    every public method a lane has must be there with the same parameters (a missing
    keyword made every UVM and in-caller call of a CUDA init fail with EIO on the H200)."""
    import inspect

    from devbroker.broker import callstats

    for lane_cls, wrapper in ((fastlane.ControlLane, callstats._CountedLane),
                              (continuelane.ContinueLane, callstats._CountedContinue)):
        for name, fn in inspect.getmembers(lane_cls, inspect.isfunction):
            if name.startswith("_"):
                continue
            assert hasattr(wrapper, name), (wrapper.__name__, name)
            want = list(inspect.signature(fn).parameters)
            got = list(inspect.signature(getattr(wrapper, name)).parameters)
            assert got == want, (wrapper.__name__, name, got, want)


def test_settled_calls_are_counted_as_if_answered_one_by_one():
    """A front end's settled calls reach the books in bulk (ControlLane.settled_calls,
    through the call counters' wrapper): the tenant's requests, the lane's admissions and
    settled count, and the call counters' row — verdicts, latency buckets and sum — exactly
    as the same calls recorded one by one."""
    import types

    from devbroker.broker import callstats

    key = ("t0", "ioctl", "NV_ESC_RM_CONTROL", "NV2080_CTRL_CMD_FB_GET_INFO_V2")
    one_by_one, bulk = callstats.CallStats(), callstats.CallStats()
    calls = [(callstats._OK, 8_000), (callstats._OK, 30_000), (callstats._OK, 30_000),
             (callstats._ERROR, 2_000_000)]
    buckets = [0] * callstats._NB
    for verdict, ns in calls:
        one_by_one._record(key, verdict, ns)
        buckets[sum(b < ns for b in callstats._BOUNDS_NS)] += 1
    lane = fastlane.ControlLane(object.__new__(type("B", (), {})))
    tenant = types.SimpleNamespace(requests=5)
    callstats._CountedLane(lane, bulk).settled_calls(tenant, key, 3, 1, 2_068_000, buckets)
    assert bulk.rows == one_by_one.rows
    assert bulk.calls == {key + ("ok",): 3, key + ("error",): 1}
    assert (tenant.requests, lane.admitted, lane.settled) == (9, 4, 4)
    with pytest.raises(ValueError, match="latency buckets"):
        bulk.record_rows(key, 1, 0, 1, buckets[:-1])


def test_settled_continuations_and_mappings_are_counted_as_if_decided_one_by_one():
    """The native loop's settled continuations and mappings reach the books in bulk
    (ContinueLane.settled_calls / settled_maps, through the call counters' wrapper): a
    continuation as the continue lane's admission of it (the tenant's requests and
    continued calls, the lane's admitted and settled) with a "continued" row, a mapping as
    map_check_now's "ok" row — verdicts, latency buckets and sum exactly as recorded one by
    one."""
    import types

    from devbroker.broker import callstats
    from devbroker.broker.continuelane import ContinueLane

    ckey = ("t0", "ioctl", "UVM_REGISTER_GPU", "")
    mkey = ("t0", "mmap", "nvidiactl", "")
    one_by_one, bulk = callstats.CallStats(), callstats.CallStats()
    times = [9_000, 40_000, 41_000]
    buckets = [0] * callstats._NB
    for ns in times:
        one_by_one._record(ckey, callstats._CONTINUED, ns)
        one_by_one._record(mkey, callstats._OK, ns)
        buckets[sum(b < ns for b in callstats._BOUNDS_NS)] += 1
    lane = object.__new__(ContinueLane)
    lane.admitted = lane.passed = lane.settled = 0
    tenant = types.SimpleNamespace(requests=5, continued=2)
    counted = callstats._CountedContinue(lane, bulk)
    counted.settled_calls(tenant, ckey, 3, sum(times), buckets)
    counted.settled_maps(tenant, mkey, 3, sum(times), buckets)
    assert bulk.rows == one_by_one.rows
    assert bulk.calls == {ckey + ("continued",): 3, mkey + ("ok",): 3}
    assert (tenant.requests, tenant.continued) == (8, 5)  # (a mapping counts no request)
    assert (lane.admitted, lane.settled) == (3, 3)
