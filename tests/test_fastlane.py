"""The control lane (broker/fastlane.py; issues 12, 14): the common RM controls decided in a
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
import sys
from pathlib import Path

import pytest

from devbroker.abi import registry
from devbroker.broker import fastlane, rules
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
    lane = fastlane.ControlLane(object.__new__(type("B", (), {})))
    checked = plain = 0
    for cmd, row in rules.CONTROLS.items():
        if row.pre or row.relay_if or row.run or row.charge:
            assert not rules.simple_control(abi, cmd), hex(cmd)
        plan = lane._plan(abi, cmd)
        op = abi.control(cmd)
        if row.relay_if or row.run or row.charge or row.driver_flag or op is None or \
                op.params is None or rules.lane_pointers(op.params) is None:
            assert plan is None, hex(cmd)
            continue
        if plan is None:
            continue
        _cap, post, size, pre, is_checked, ptrs = plan
        assert pre is row.pre and post is row.post and size == op.size
        assert is_checked == (row.pre is not None or not rules.plain_layout(op.params)), hex(cmd)
        # every pointer field is one the check requires NULL; none in a plain layout
        assert ptrs == tuple(o for p, f, o in op.params.walk() if f.kind == "ptr"), hex(cmd)
        assert is_checked or not ptrs
        checked += is_checked
        plain += not is_checked
    # the NVML id controls are among the checked ones
    for cmd in (0x201, 0x202, 0x205, 0x214, 0x215, 0x216):
        assert lane._plan(abi, cmd)[4] is True, hex(cmd)
    assert lane._plan(abi, 0x202)[5]  # GET_ID_INFO's szName: laned only when NULL
    assert checked > 10 and plain > 50, (checked, plain)


# The seccomp listener's wait on a many-CPU host (no synchronous wake-ups, looking for the
# next call for 100 µs after each answer; this machine's default is the other way round).
SPIN = {"DEVBROKER_SECCOMP_SYNC_WAKE": "0", "DEVBROKER_SECCOMP_SPIN_US": "100"}


def _run(start_broker, traces_dir, lane: bool, frontend: str):
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
    traces = [str(traces_dir / f"h200-580.159.04-{n}.nvtrace") for n in ("torch", "nvml")]
    r = b.exec("t", sys.executable, str(HERE / "fastlane_prog.py"), *traces, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    assert lines and lines[-1]["what"] == "done", r.stdout + r.stderr
    # the broker says at start which loop its seccomp listeners run, and why
    started = b.output()
    if frontend == "seccomp":
        want = ("native loop (" if env["DEVBROKER_NATIVE_LANE"] == "1" and lane
                else "Python loop (")
        assert f"seccomp listeners: {want}" in started, started
    st_fast = b.status().get("control_lane", {}).get("admitted", 0)
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

