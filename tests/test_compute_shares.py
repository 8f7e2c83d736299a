"""Compute shares. Policy keys (validated, hot-reloadable), the driver values they
turn into, and the enforcement with real brokers and real `devbroker exec` tenants on the
emulated driver (which models channel groups and their scheduling controls the way the 580
driver answers them): the policy's values on every new channel group, a tenant's own
SET_TIMESLICE / SET_INTERLEAVE_LEVEL rewritten (racing threads included) and audited, the
scheduling controls that act beyond the tenant's own group refused, a policy apply moving
the values of running groups, `devbroker status` showing shares. What the values do to GPU
time is measured on the H200 (scripts/gpu/compute_shares.sh), not here."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from devbroker.abi import status as nvs
from devbroker.broker import compute
from devbroker.broker.policy import PolicyError, load_policy_text
from tenant_io import readline_json

GPUS = """
[broker]
backend = "emulated"
driver_version = "580.159.04"

[[broker.gpu]]
name = "NVIDIA H200"
uuid = "GPU-11111111-2222-3333-4444-555555555555"
pci_bus_id = "0000:00:06.0"
memory = "141GiB"
"""


def policy(a: str = "", b: str = "") -> str:
    return GPUS + f"""
[tenant.alpha]
gpus = [0]
memory_quota = "16GiB"
{a}

[tenant.beta]
gpus = [0]
memory_quota = "16GiB"
{b}
"""


HOLD = [sys.executable, "-m", "devbroker.tools.sched_probe", "hold"]


# --------------------------------------------------------------------------- policy keys
def test_keys_default_parse_and_round_trip():
    p = load_policy_text(policy('compute_weight = 3\npriority = "high"', ""), "p.toml")
    a, b = p.tenants["alpha"], p.tenants["beta"]
    assert (a.compute_weight, a.priority) == (3, "high")
    assert (b.compute_weight, b.priority) == (1, "normal")
    assert load_policy_text(p.to_toml(), "again.toml") == p
    assert "compute weight 3, priority high" in p.describe()


@pytest.mark.parametrize("line,reason", [
    ("compute_weight = 0", "compute_weight must be at least 1"),
    ("compute_weight = -2", "compute_weight must be at least 1"),
    ('compute_weight = "3"', "compute_weight must be an integer"),
    ("compute_weight = 2.5", "compute_weight must be an integer"),
    ("compute_weight = true", "compute_weight must be an integer"),
    ("compute_weight = 65", "beyond 64"),
    ('priority = "urgent"', "priority must be one of high, normal, low"),
    ("priority = 1", "priority must be a string"),
    ('priorty = "high"', "unknown key 'priorty'"),
])
def test_bad_values_are_refused_with_their_line(line, reason):
    text = policy("", line)
    with pytest.raises(PolicyError) as e:
        load_policy_text(text, "bad.toml")
    want = text.splitlines().index(line) + 1
    assert e.value.line == want, str(e.value)
    assert reason in e.value.reason


@pytest.mark.parametrize("line,reason", [
    ("compute_turns_ms = 5", "compute_turns_ms must be 0 (off) or 20..10000"),
    ("compute_turns_ms = 20000", "compute_turns_ms must be 0 (off) or 20..10000"),
    ("compute_turns_ms = -1", "compute_turns_ms must be at least 0"),
    ('compute_turns_ms = "100"', "compute_turns_ms must be an integer"),
])
def test_bad_turns_are_refused_with_their_line(line, reason):
    text = policy().replace("[broker]", "[broker]\n" + line, 1)
    with pytest.raises(PolicyError) as e:
        load_policy_text(text, "bad.toml")
    assert e.value.line == text.splitlines().index(line) + 1, str(e.value)
    assert reason in e.value.reason
    good = load_policy_text(policy().replace("[broker]", "[broker]\ncompute_turns_ms = 100", 1),
                            "good.toml")
    assert good.broker.compute_turns_ms == 100
    assert load_policy_text(good.to_toml(), "again.toml") == good


# --------------------------------------------------------------------------- values
def _tenants(*specs):
    p = load_policy_text(GPUS + "".join(
        f'\n[tenant.t{i}]\ngpus = [0]\nmemory_quota = "1GiB"\ncompute_weight = {w}\n'
        f'priority = "{pr}"\n' for i, (w, pr) in enumerate(specs)), "v.toml")
    return p, list(p.tenants.values())


def test_weights_become_proportional_timeslices():
    p, (a, b) = _tenants((3, "normal"), (1, "normal"))
    sa, sb = compute.schedule_for(p, a, 0), compute.schedule_for(p, b, 0)
    # one round of the GPU, divided 3:1
    assert (sa.timeslice_us, sb.timeslice_us) == (6144, 2048) == (
        compute.ROUND_US * 3 // 4, compute.ROUND_US // 4)
    assert sa.interleave == sb.interleave == compute.INTERLEAVE_MEDIUM
    assert compute.share_of(p, a, 0) == pytest.approx(0.75)
    # More tenants: the round stays, the ratio holds, the slices shrink.
    p, ts = _tenants(*[(8, "normal")] * 2, (2, "normal"))
    slices = [compute.schedule_for(p, t, 0).timeslice_us for t in ts]
    assert sum(slices) <= compute.ROUND_US
    assert slices[0] == slices[1] and slices[0] / slices[2] == pytest.approx(4, rel=1e-3)
    # ... down to the shortest slice a switch is worth
    p, ts = _tenants((64, "normal"), (1, "normal"))
    assert compute.schedule_for(p, ts[1], 0).timeslice_us == compute.MIN_SLICE_US


def test_priority_levels_and_the_low_tenants_short_slice():
    p, (hi, lo, no) = _tenants((1, "high"), (4, "low"), (1, "normal"))
    assert compute.schedule_for(p, hi, 0).interleave == compute.INTERLEAVE_HIGH
    assert compute.schedule_for(p, no, 0).interleave == compute.INTERLEAVE_MEDIUM
    s = compute.schedule_for(p, lo, 0)
    assert (s.interleave, s.timeslice_us) == (compute.INTERLEAVE_LOW,
                                              compute.LOW_PRIORITY_SLICE_US)
    # Without a high tenant on the GPU a low one keeps its weight's slice.
    p, (lo, no) = _tenants((4, "low"), (1, "normal"))
    assert compute.schedule_for(p, lo, 0).timeslice_us == compute.ROUND_US * 4 // 5


def test_a_tenants_groups_on_one_engine_split_its_slice():
    p, (a, _) = _tenants((3, "normal"), (1, "normal"))
    one = compute.schedule_for(p, a, 0, groups=1).timeslice_us
    assert compute.schedule_for(p, a, 0, groups=3).timeslice_us == one // 3
    assert compute.schedule_for(p, a, 0, groups=1000).timeslice_us == compute.MIN_SLICE_US


# --------------------------------------------------------------------------- tenants
@pytest.fixture(params=["fuse", "seccomp"])
def start(start_broker, request):
    """Brokers whose tenants reach them through FUSE node files (decisions on the trio
    thread) or seccomp notification (decisions on the listener threads)."""
    def go(text: str):
        b = start_broker(text)
        b.frontend = request.param
        return b
    return go


def _hold(b, tenant: str, n: int = 1):
    p = b.exec_popen(tenant, *HOLD, str(n), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                     stderr=subprocess.PIPE, text=True)
    first = readline_json(p)
    assert first["what"] == "groups", first
    return p, first


def _ask(p, line: str) -> dict:
    p.stdin.write(line + "\n")
    p.stdin.flush()
    return readline_json(p)


def _quit(p) -> None:
    try:
        p.stdin.write("quit\n")
        p.stdin.close()
    except BrokenPipeError:
        pass  # the tenant died: its exit status says why
    assert p.wait(timeout=60) == 0, p.stderr.read()


def test_new_groups_get_the_policys_values_and_tenant_sets_are_rewritten(start):
    b = start(policy("compute_weight = 3", ""))
    pa, ga = _hold(b, "alpha")
    pb, gb = _hold(b, "beta")
    try:
        base = compute.ROUND_US // 4  # 3:1
        assert ga["timeslices"] == [3 * base] and gb["timeslices"] == [base]
        # CUDA asks for 2048 µs itself; a greedy tenant for a second: both run as the
        # policy's value, and the driver's answer is NV_OK (the tenant cannot tell).
        for asked in (2048, 1_000_000):
            r = _ask(pb, f"set {asked}")
            assert r["status"] == [nvs.NV_OK] and r["timeslices"] == [base], r
        # HIGH asked by a normal-priority tenant: rewritten to the policy's MEDIUM, which
        # the driver keeps from unprivileged callers too (as the H200 did)
        r = _ask(pb, "level 2")
        assert r["status"] == [nvs.NV_ERR_INSUFFICIENT_PERMISSIONS]
        rewrites = [a for a in b.audit() if a["event"] == "rewrite" and a["tenant"] == "beta"]
        reasons = " | ".join(a["reason"] for a in rewrites)
        assert "timesliceUs 1000000 asked, the policy's 2048 set" in reasons, reasons
        assert "tsgInterleaveLevel 2 asked, the policy's 1 set" in reasons, reasons
        st = b.tenant("beta")["compute"]
        assert (st["weight"], st["priority"], st["share"]) == (1, "normal", {"0": 0.25})
        [grp] = st["channel_groups"]
        # levels refused to the broker: said once, then timeslices alone
        assert (grp["timeslice_us"], grp["interleave"]) == (base, "driver's")
        notes = [a for a in b.audit() if a["event"] == "notice"
                 and "SET_INTERLEAVE_LEVEL" in a.get("reason", "")]
        assert len(notes) == 1, notes
        assert not [a for a in b.audit() if a["event"] == "error"
                    and a.get("what") == "compute share"]
        assert grp["rewrites"] == 2  # 2048 was the policy's value already
        assert b.tenant("alpha")["compute"]["share"] == {"0": 0.75}
        out = b.cli("status")
        assert out.returncode == 0 and "75%" in out.stdout and "normal" in out.stdout, out.stdout
    finally:
        _quit(pa)
        _quit(pb)


def test_racing_threads_get_no_more_than_the_policy(start):
    b = start(policy('priority = "low"', 'priority = "high"'))
    p, g = _hold(b, "alpha", 2)
    try:
        # alpha is low next to a high tenant: the shortest slice.
        want = compute.LOW_PRIORITY_SLICE_US
        assert g["timeslices"] == [want, want]
        r = _ask(p, "race 4 200")
        # the level calls among them meet the driver's refusal of unprivileged callers (as
        # on the H200); every timeslice call ran with the policy's value
        assert set(r["failed"]) <= {nvs.NV_ERR_INSUFFICIENT_PERMISSIONS}, r
        assert r["timeslices"] == [want, want], r
        [grp_status] = {(x["timeslice_us"], x["interleave"])
                        for x in b.tenant("alpha")["compute"]["channel_groups"]}
        assert grp_status == (want, "driver's")
    finally:
        _quit(p)


def test_controls_beyond_the_tenants_own_group_are_refused(start):
    b = start(policy())
    p, _ = _hold(b, "alpha")
    try:
        assert _ask(p, "realtime")["status"] == nvs.NV_ERR_INSUFFICIENT_PERMISSIONS
        assert _ask(p, "policy")["status"] == nvs.NV_ERR_INSUFFICIENT_PERMISSIONS
        denied = " | ".join(a.get("reason", "") for a in b.audit() if a["event"] == "deny")
        assert "MAKE_REALTIME" in denied and "RUNLIST_SET_SCHED_POLICY" in denied, denied
    finally:
        _quit(p)


def test_groups_of_one_tenant_share_its_slice_and_new_ones_resize_the_old(start):
    b = start(policy("compute_weight = 4", ""))
    p1, g1 = _hold(b, "alpha", 1)
    try:
        full = compute.ROUND_US * 4 // 5
        assert g1["timeslices"] == [full]
        p2, g2 = _hold(b, "alpha", 1)  # a second process of the same tenant
        try:
            assert g2["timeslices"] == [full // 2]
            got = _poll(p1, [full // 2])  # the first process's group, resized meanwhile
            assert got == [full // 2]
        finally:
            _quit(p2)
    finally:
        _quit(p1)


def _poll(p, want: list[int], timeout: float = 20.0) -> list[int]:
    """The tenant's view of its groups' timeslices, until it is `want` (applied by a
    background task) or the timeout: returns the last seen."""
    deadline = time.monotonic() + timeout
    while True:
        got = _ask(p, "get")["timeslices"]
        if got == want or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def test_policy_apply_moves_running_groups_and_a_bad_policy_changes_nothing(start,
                                                                            tmp_path):
    b = start(policy("compute_weight = 3", ""))
    pa, ga = _hold(b, "alpha")
    pb, gb = _hold(b, "beta")
    base = compute.ROUND_US // 4
    try:
        assert (ga["timeslices"], gb["timeslices"]) == ([3 * base], [base])
        bad = tmp_path / "bad.toml"
        bad.write_text(policy("compute_weight = 0", ""))
        r = b.cli("policy", "apply", str(bad))
        assert r.returncode != 0 and "compute_weight must be at least 1" in r.stderr + r.stdout
        assert _ask(pa, "get")["timeslices"] == [3 * base]
        good = tmp_path / "good.toml"
        good.write_text(policy("", 'compute_weight = 2\npriority = "high"'))
        r = b.cli("policy", "apply", str(good))
        assert r.returncode == 0, r.stderr
        one, two = compute.ROUND_US // 3, compute.ROUND_US * 2 // 3  # 1:2
        assert _poll(pa, [one]) == [one]
        assert _poll(pb, [two]) == [two]
        st = b.tenant("beta")["compute"]
        assert (st["priority"], st["channel_groups"][0]["interleave"]) == ("high", "driver's")
        assert st["share"] == {"0": pytest.approx(2 / 3, abs=1e-3)}
    finally:
        _quit(pa)
        _quit(pb)


def test_the_tenant_file_is_found_in_the_holders_fd_table(tmp_path):
    """Applying a policy change to a tenant whose driver file lives in the tenant (seccomp
    front end, real backend) takes the file from a process that holds it: found by inode
    in /proc/<pid>/fd, duplicated with pidfd_getfd, never another file."""
    from types import SimpleNamespace

    path = tmp_path / "node"
    path.write_bytes(b"x")
    other = tmp_path / "other"
    other.write_bytes(b"y")
    holder = subprocess.Popen([sys.executable, "-c",
                               f"import os,sys; a=os.open({str(other)!r}, os.O_RDONLY); "
                               f"b=os.open({str(path)!r}, os.O_RDONLY); print(b, flush=True); "
                               "sys.stdin.read()"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        fd_in_holder = int(holder.stdout.readline())
        st = os.stat(path)
        tenant = SimpleNamespace(tgids=lambda: {holder.pid})
        s = SimpleNamespace(file=SimpleNamespace(key=(st.st_dev, st.st_ino)),
                            caller=SimpleNamespace(pid=holder.pid), tenant=tenant)
        lent = compute.lend_tenant_file(s)
        assert lent is not None and lent.fd == fd_in_holder
        dup = lent.dup_fd(lent.fd)
        try:
            assert (os.fstat(dup).st_dev, os.fstat(dup).st_ino) == (st.st_dev, st.st_ino)
        finally:
            os.close(dup)
        gone = os.stat(tmp_path)  # a key no process holds
        s.file.key = (gone.st_dev, gone.st_ino)
        assert compute.lend_tenant_file(s) is None
    finally:
        holder.stdin.close()
        holder.wait(timeout=10)


def test_the_probe_of_the_gpu_script_sees_only_the_policys_values(start):
    """`sched_probe probe` (part (a) of scripts/gpu/compute_shares.sh) through the broker:
    whatever it sets, the group holds the policy's values; what acts beyond it is refused."""
    b = start(policy("compute_weight = 2", ""))
    r = b.exec("alpha", sys.executable, "-m", "devbroker.tools.sched_probe", "probe")
    assert r.returncode == 0, r.stderr
    got = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    want = compute.ROUND_US * 2 // 3
    by = {}
    for g in got:
        by.setdefault(g["what"], []).append(g)
    assert by["get-default"] == [{"what": "get-default", "status": 0, "timeslice_us": want}]
    assert len(by["set-timeslice"]) == 13
    assert {(x["status"], x["timeslice_us"]) for x in by["set-timeslice"]} == {(0, want)}
    # levels: the driver's refusal of an unprivileged caller, for every level (as on the H200)
    denied = nvs.NV_ERR_INSUFFICIENT_PERMISSIONS
    assert [x["status"] for x in by["set-interleave"]] == [denied] * 4
    assert by["get-interleave"][0]["status"] == denied  # not on the allowlist
    assert by["make-realtime"][0]["status"] == denied
    assert by["runlist-sched-policy-interleaved"][0]["status"] == denied


# --------------------------------------------------------------------------- preemption
def _inproc_pair():
    """A broker (emulated, in this process) with tenants hi (priority high) and lo (low) on
    GPU 0, each with a root client, device, subdevice; lo with a channel group and two
    channels."""
    import trio

    from devbroker.testing.inproc import InProcTenant, make_broker
    from devbroker.testing.policies import one_h200, tenant

    caps = ["nvml", "compute", "uvm"]
    b = make_broker(one_h200(tenant("hi", priority="high", capabilities=caps),
                             tenant("lo", priority="low", capabilities=caps)))
    hi, lo = InProcTenant(b, "hi", pid=5001), InProcTenant(b, "lo", pid=5002)

    async def setup(t, channels):
        ctl, client, dev, sub = await t.subdevice()
        _, out, _ = await t.alloc(ctl, client, dev, 0xA06C,
                                  t.new("NV_CHANNEL_GROUP_ALLOCATION_PARAMETERS", engineType=1),
                                  new=0xC0)
        assert out.status == nvs.NV_OK, out
        chans = []
        for i in range(channels):
            _, out, _ = await t.alloc(ctl, client, 0xC0, 0xC86F,
                                      t.new("NV_CHANNEL_ALLOC_PARAMS"), new=0xD0 + i)
            assert out.status == nvs.NV_OK, out
            chans.append(0xD0 + i)
        return ctl, client, chans

    lo_ctl, lo_client, lo_chans = trio.run(setup, lo, 2)
    return b, hi, lo, setup, (lo_ctl, lo_client, lo_chans)


def _pass(b) -> bool:
    from devbroker.broker.effects import locked, perform_blocking, run_blocking

    return run_blocking(locked(compute.preempt_all(b)), lambda e: perform_blocking(e, b.memgate))


def test_low_tenants_channels_stop_while_a_high_tenant_holds_a_group_and_run_again_after():
    """Priority: the channels of a `low` tenant are stopped in the driver while a
    `high` tenant holds a channel group on its GPU (FIFO_DISABLE_CHANNELS on the low
    tenant's own subdevice: what made a high tenant's latency loop next to a busy low one
    run as alone on the H200), a channel the low tenant makes meanwhile is stopped before it
    has the handle, and all of them run again once the high tenant's group is gone; each
    change is audited and shown by status. The tenant itself may not send the control."""
    import trio

    from devbroker.backends.emulated_sched import channel_stopped

    b, hi, lo, setup, (lo_ctl, lo_client, lo_chans) = _inproc_pair()
    stopped = lambda: [channel_stopped(b.backend, lo_client, h) for h in lo_chans]  # noqa: E731
    assert _pass(b) is True  # a high and a low tenant in the policy: the broker watches
    assert stopped() == [False, False]  # no high tenant holds a group: nothing stopped
    hi_ctl, hi_client, _ = trio.run(setup, hi, 1)
    _pass(b)
    assert stopped() == [True, True]
    st = b.snapshot()
    lo_st = next(t for t in st["tenants"] if t["name"] == "lo")["compute"]
    assert lo_st["stopped"] == {"0": 2}, lo_st
    # a new channel of the preempted tenant: stopped at allocation, before its handle
    _, out, _ = trio.run(lambda: lo.alloc(lo_ctl, lo_client, 0xC0, 0xC86F,
                                          lo.new("NV_CHANNEL_ALLOC_PARAMS"), new=0xDF))
    assert out.status == nvs.NV_OK
    assert channel_stopped(b.backend, lo_client, 0xDF) is True
    # the tenant's own FIFO_DISABLE_CHANNELS (any client's channels by handle): refused
    rep, out, _ = trio.run(lambda: lo.control(lo_ctl, lo_client, 0xB0, 0x2080110B,
                                              bDisable=0, numChannels=1,
                                              hClientList=[lo_client] + [0] * 63,
                                              hChannelList=[0xD0] + [0] * 63))
    assert out.status != nvs.NV_OK
    assert channel_stopped(b.backend, lo_client, 0xD0) is True
    # the high tenant frees its group: the low tenant's channels run again
    rep, out, _ = trio.run(lambda: hi.esc(hi_ctl, "NV_ESC_RM_FREE", hi.new(
        "NVOS00_PARAMETERS", hRoot=hi_client, hObjectParent=0xA0, hObjectOld=0xC0)))
    assert out.status == nvs.NV_OK
    assert _pass(b) is True  # still a high and a low tenant in the policy: keep watching
    assert stopped() == [False, False] and channel_stopped(b.backend, lo_client, 0xDF) is False
    lo_st = next(t for t in b.snapshot()["tenants"] if t["name"] == "lo")["compute"]
    assert "stopped" not in lo_st, lo_st
    preempt = [a["reason"] for a in b.audit.recent if a["event"] == "preempt"]
    assert len(preempt) == 2, preempt
    assert "2 channel(s) stopped: high-priority tenant(s) hi" in preempt[0], preempt
    assert "running again" in preempt[1], preempt
    denies = [a for a in b.audit.recent if a["event"] == "deny" and a["tenant"] == "lo"]
    assert any("FIFO_DISABLE_CHANNELS" in a.get("what", "") + a.get("reason", "")
               for a in denies), denies
    assert not [a for a in b.audit.recent if a["event"] == "error"]


def _until(pred, what: str, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.1)


def test_a_low_tenant_is_stopped_while_a_high_tenant_holds_a_context(start):
    """The same with real tenant processes (`devbroker exec`, both front ends) and the
    broker's watching task: a low tenant's channel is stopped within a look (0.25 s) of a
    high tenant's channel group appearing, a channel it makes meanwhile is stopped at
    once, its own FIFO_DISABLE_CHANNELS is refused, and everything runs again once the high
    tenant's process is gone; `devbroker status` says so, the audit has both records."""
    b = start(policy('priority = "high"', 'priority = "low"'))
    plo, _ = _hold(b, "beta")
    try:
        assert _ask(plo, "channel")["status"] == nvs.NV_OK
        time.sleep(0.5)
        assert "stopped" not in b.tenant("beta")["compute"]  # no high tenant yet
        phi, _ = _hold(b, "alpha")
        try:
            st = _until(lambda: b.tenant("beta")["compute"].get("stopped"),
                        "the low tenant's channel stopped")
            assert st == {"0": 1}, st
            r = _ask(plo, "channel")  # made while stopped: stopped before it has the handle
            assert r["status"] == nvs.NV_OK
            assert b.tenant("beta")["compute"]["stopped"] == {"0": 2}
            assert _ask(plo, "disable 0")["status"] != nvs.NV_OK  # not the tenant's to send
            out = b.cli("status").stdout
            assert "STOPPED for a high-priority tenant (gpu0: 2 channel(s))" in out, out
        finally:
            _quit(phi)
        _until(lambda: "stopped" not in b.tenant("beta")["compute"],
               "the low tenant running again after the high tenant left")
    finally:
        _quit(plo)
    recs = [a for a in b.audit() if a["event"] == "preempt" and a["tenant"] == "beta"]
    assert any("1 channel(s) stopped: high-priority tenant(s) alpha" in a["reason"]
               for a in recs), recs
    assert any("2 channel(s) running again" in a["reason"] for a in recs), recs
    assert any(a["event"] == "deny" and "FIFO_DISABLE_CHANNELS" in a.get("reason", "")
               + a.get("what", "") for a in b.audit()), "the tenant's own call not audited"
    assert not [a for a in b.audit() if a["event"] == "error"]


# --------------------------------------------------------------------------- turns
def _turns_policy(ms: int, wa: int = 3, wb: int = 1) -> str:
    from devbroker.testing.policies import one_h200, tenant

    caps = ["nvml", "compute", "uvm"]
    text = one_h200(tenant("a", compute_weight=wa, capabilities=caps),
                    tenant("b", compute_weight=wb, capabilities=caps))
    return text.replace("[broker]", f"[broker]\ncompute_turns_ms = {ms}", 1)


def test_turns_stop_every_other_tenant_for_its_weights_part_of_a_round():
    """`[broker] compute_turns_ms`: the tenants holding channel groups on a GPU take turns
    (turns.py): in a's turn b's channels are stopped in the (emulated) driver and a's run,
    for a's weight's part of the round (3:1 of 400 ms: 300 and 100 ms), then the other way
    round; a channel a tenant makes while it waits is stopped before it has the handle;
    status says whose turn it is; turns off by a policy change let everything run."""
    import trio

    from devbroker.backends.emulated_sched import channel_stopped
    from devbroker.broker import turns
    from devbroker.broker.effects import locked, perform_blocking, run_blocking
    from devbroker.broker.policy import load_policy_text
    from devbroker.testing.inproc import InProcTenant, make_broker

    b = make_broker(_turns_policy(400))
    ta, tb = InProcTenant(b, "a", pid=5101), InProcTenant(b, "b", pid=5102)

    async def setup(t):
        ctl, client, dev, sub = await t.subdevice()
        _, out, _ = await t.alloc(ctl, client, dev, 0xA06C,
                                  t.new("NV_CHANNEL_GROUP_ALLOCATION_PARAMETERS", engineType=1),
                                  new=0xC0)
        assert out.status == nvs.NV_OK, out
        for i in range(2):
            _, out, _ = await t.alloc(ctl, client, 0xC0, 0xC86F,
                                      t.new("NV_CHANNEL_ALLOC_PARAMS"), new=0xD0 + i)
            assert out.status == nvs.NV_OK, out
        return ctl, client

    (ca, cla), (_cb, clb) = trio.run(setup, ta), trio.run(setup, tb)
    step = lambda: run_blocking(locked(turns.step(b, 0)),  # noqa: E731
                                lambda e: perform_blocking(e, b.memgate))
    stopped = lambda cl, hs=(0xD0, 0xD1): [channel_stopped(b.backend, cl, h) for h in hs]  # noqa: E731
    turn_of = lambda name: next(t for t in b.snapshot()["tenants"]  # noqa: E731
                                if t["name"] == name)["compute"].get("turns")
    assert step() == pytest.approx(0.3)  # a's turn: 3/4 of 400 ms
    assert stopped(cla) == [False, False] and stopped(clb) == [True, True]
    assert turn_of("a") == {"0": "running"} and turn_of("b") == {"0": "waiting"}
    assert step() == pytest.approx(0.1)  # b's turn
    assert stopped(cla) == [True, True] and stopped(clb) == [False, False]
    # a channel of a's while it waits: stopped at allocation, and runs in a's next turn
    _, out, _ = trio.run(lambda: ta.alloc(ca, cla, 0xC0, 0xC86F,
                                          ta.new("NV_CHANNEL_ALLOC_PARAMS"), new=0xD7))
    assert out.status == nvs.NV_OK and channel_stopped(b.backend, cla, 0xD7) is True
    assert step() == pytest.approx(0.3)
    assert stopped(cla, (0xD0, 0xD1, 0xD7)) == [False] * 3 and stopped(clb) == [True, True]
    # a's process gone (its channel group freed): no turns with one tenant; b runs
    _, out, _ = trio.run(lambda: ta.esc(ca, "NV_ESC_RM_FREE", ta.new(
        "NVOS00_PARAMETERS", hRoot=cla, hObjectParent=0xA0, hObjectOld=0xC0)))
    assert out.status == nvs.NV_OK
    assert step() is None and stopped(clb) == [False, False]
    assert turn_of("b") is None
    # back with a group; then turns off by a policy change: everything runs
    trio.run(lambda: ta.alloc(ca, cla, 0xA0, 0xA06C, ta.new(
        "NV_CHANNEL_GROUP_ALLOCATION_PARAMETERS", engineType=1), new=0xC1))
    assert step() is not None
    b.apply_policy(load_policy_text(_turns_policy(0), "off"))
    assert step() is None
    assert stopped(clb) == [False, False]
    recs = [a["reason"] for a in b.audit.recent if a.get("event") == "turns"]
    assert any("turns of 400 ms among a (3), b (1)" in r for r in recs), recs
    assert any("no turns" in r for r in recs), recs
    assert not [a for a in b.audit.recent if a.get("event") == "error"]


def test_tenants_take_turns_through_devbroker(start):
    """Turns with real tenant processes (`devbroker exec`, both front ends) and the broker's
    turns task: two tenants holding channel groups on one GPU are each seen running and
    waiting within a second (200 ms rounds, 3:1), `devbroker status` says whose turn it is,
    and when one leaves the other no longer waits."""
    text = policy("compute_weight = 3", "").replace(
        "[broker]", "[broker]\ncompute_turns_ms = 200", 1)
    b = start(text)
    pa, _ = _hold(b, "alpha")
    pb, _ = _hold(b, "beta")
    try:
        assert _ask(pa, "channel")["status"] == nvs.NV_OK
        assert _ask(pb, "channel")["status"] == nvs.NV_OK
        seen: dict[str, set] = {"alpha": set(), "beta": set()}
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not all(len(v) == 2 for v in seen.values()):
            st = b.status()
            for t in st["tenants"]:
                turn = t.get("compute", {}).get("turns", {}).get("0")
                if turn:
                    seen[t["name"]].add(turn)
            time.sleep(0.02)
        assert seen == {"alpha": {"running", "waiting"}, "beta": {"running", "waiting"}}, seen
        out = b.cli("status").stdout
        assert "turn" in out, out
    finally:
        _quit(pb)
    _until(lambda: "turns" not in b.tenant("alpha")["compute"], "turns over with one tenant")
    _quit(pa)
    recs = [a["reason"] for a in b.audit() if a["event"] == "turns"]
    assert any("turns of 200 ms among alpha (3), beta (1)" in r for r in recs), recs
    assert any("no turns" in r for r in recs), recs
    assert not [a for a in b.audit() if a["event"] == "error"]


def test_a_tenant_stopped_for_a_high_priority_one_takes_no_turns():
    """Turns and priority together: a `low` tenant stopped while a `high` one holds a
    channel group is no member of the turns (the high tenant is alone: no turns), and a
    turn never lets run what preemption holds."""
    import trio

    from devbroker.backends.emulated_sched import channel_stopped
    from devbroker.broker import turns
    from devbroker.broker.effects import locked, perform_blocking, run_blocking
    from devbroker.testing.inproc import InProcTenant, make_broker
    from devbroker.testing.policies import one_h200, tenant

    caps = ["nvml", "compute", "uvm"]
    text = one_h200(tenant("hi", priority="high", capabilities=caps),
                    tenant("lo", priority="low", capabilities=caps))
    b = make_broker(text.replace("[broker]", "[broker]\ncompute_turns_ms = 100", 1))
    hi, lo = InProcTenant(b, "hi", pid=5201), InProcTenant(b, "lo", pid=5202)

    async def setup(t):
        ctl, client, dev, _sub = await t.subdevice()
        await t.alloc(ctl, client, dev, 0xA06C,
                      t.new("NV_CHANNEL_GROUP_ALLOCATION_PARAMETERS", engineType=1), new=0xC0)
        _, out, _ = await t.alloc(ctl, client, 0xC0, 0xC86F, t.new("NV_CHANNEL_ALLOC_PARAMS"),
                                  new=0xD0)
        assert out.status == nvs.NV_OK, out
        return client

    clo, chi = trio.run(setup, lo), trio.run(setup, hi)
    perform = lambda e: perform_blocking(e, b.memgate)  # noqa: E731
    run_blocking(locked(compute.preempt_all(b)), perform)
    assert channel_stopped(b.backend, clo, 0xD0) is True  # preempted
    assert [t.name for t in turns.members(b, 0)] == ["hi"]
    assert run_blocking(locked(turns.step(b, 0)), perform) is None  # alone: no turns
    assert channel_stopped(b.backend, clo, 0xD0) is True  # (turns let run nothing held)
    assert channel_stopped(b.backend, chi, 0xD0) is False


# --------------------------------------------------------------------------- cost
def _groups_broker(n: int):
    """An in-process broker (emulated H200) whose tenant `hoard` holds n channel groups on
    engine 1, allocated through the broker (each through compute.after_alloc)."""
    import trio

    from devbroker.testing.inproc import InProcTenant, make_broker
    from devbroker.testing.policies import one_h200, tenant

    b = make_broker(one_h200(tenant("hoard", capabilities=["nvml", "compute"],
                                    limits={"rm_objects": 4096})))
    t = InProcTenant(b, "hoard", pid=5101)

    async def setup():
        ctl, client, dev, _sub = await t.subdevice()
        for i in range(n):
            _, out, _ = await t.alloc(ctl, client, dev, 0xA06C, t.new(
                "NV_CHANNEL_GROUP_ALLOCATION_PARAMETERS", engineType=1), new=0x1000 + i)
            assert out.status == nvs.NV_OK, out
        return ctl, client, dev

    ctl, client, dev = trio.run(setup)
    return b, t, ctl, client, dev


def _group_timeslice(b, client: int, handle: int) -> int:
    from devbroker.backends.emulated_sched import _sched

    return _sched(b.backend.clients[client].objects[handle])["timeslice"]


def test_a_new_channel_group_costs_the_same_whatever_the_tenant_holds(monkeypatch):
    """One more channel group of a tenant holding many walked every group
    of the tenant for every one of them (O(G²) under the state lock: 430 ms per allocation
    at G=1000 for every other tenant's call). Counted, not timed: how many groups the
    broker looks at to allocate one more does not grow with how many the tenant holds."""
    import trio

    b, t, ctl, client, dev = _groups_broker(120)
    looked = []
    real_alive = compute._alive
    monkeypatch.setattr(compute, "_alive", lambda broker, g: looked.append(g) or
                        real_alive(broker, g))

    async def one_more():
        _, out, _ = await t.alloc(ctl, client, dev, 0xA06C, t.new(
            "NV_CHANNEL_GROUP_ALLOCATION_PARAMETERS", engineType=1), new=0x2000)
        assert out.status == nvs.NV_OK, out

    trio.run(one_more)
    assert len(looked) <= 2, f"{len(looked)} groups looked at for one allocation"
    # and the new group got the tenant's slice divided among its 121 groups (the floor)
    assert _group_timeslice(b, client, 0x2000) == compute.MIN_SLICE_US


def test_freed_groups_leave_the_split_at_once():
    """The books' index follows frees (RmObject.watch): after freeing two of four groups,
    a new one gets a third of the tenant's slice, not a fifth."""
    import trio

    b, t, ctl, client, dev = _groups_broker(4)
    full = compute.tenant_slice(b.policy, b.tenants["hoard"].policy, 0)
    assert _group_timeslice(b, client, 0x1003) == full // 4

    async def free_two_and_alloc():
        for h in (0x1000, 0x1001):
            _, out, _ = await t.esc(ctl, "NV_ESC_RM_FREE", t.new(
                "NVOS00_PARAMETERS", hRoot=client, hObjectParent=dev, hObjectOld=h))
            assert out.status == nvs.NV_OK, out
        _, out, _ = await t.alloc(ctl, client, dev, 0xA06C, t.new(
            "NV_CHANNEL_GROUP_ALLOCATION_PARAMETERS", engineType=1), new=0x2000)
        assert out.status == nvs.NV_OK, out

    trio.run(free_two_and_alloc)
    assert _group_timeslice(b, client, 0x2000) == full // 3
    groups = b.snapshot()["tenants"][0]["compute"]["channel_groups"]
    assert sorted(g["handle"] for g in groups) == [0x1002, 0x1003, 0x2000]


def test_a_channel_under_the_device_is_not_refused_by_the_broker(start):
    """The driver's checkpoint, inside the tenant's process, allocates a channel right under
    the device (seen on the H200: refusing it failed the checkpoint). The driver then wraps such a channel in a channel group of
    its own (kernel_channel.c, kchannelConstruct_IMPL, 580.142); the broker lets it through
    to the driver (the emulator answers as it models it) with no refusal of its own, and a
    channel in the tenant's group is allocated as before."""
    b = start(policy("compute_weight = 3", ""))
    p, _ = _hold(b, "alpha")
    try:
        _ask(p, "device-channel")
        denied = [a for a in b.audit() if a["event"] == "deny" and a["tenant"] == "alpha"
                  and "HOPPER_CHANNEL_GPFIFO_A" in a.get("what", "")]
        assert denied == [], denied
        r = _ask(p, "channel")
        assert r["status"] == nvs.NV_OK, r
    finally:
        _quit(p)


def test_a_tenant_being_checkpointed_takes_no_turns_and_its_channels_run():
    """Turns and preemption by checkpoint: the driver's lock waits for the work of the
    process's channels, so a tenant under preemption leaves the turns and the channels
    turns stopped run again before the lock (a stopped one made it time out on the H200)."""
    import trio

    from devbroker.backends.emulated_sched import channel_stopped
    from devbroker.broker import turns
    from devbroker.broker.effects import locked, perform_blocking, run_blocking
    from devbroker.testing.inproc import InProcTenant, make_broker

    from devbroker.testing.policies import one_h200, tenant

    caps = ["nvml", "compute", "uvm"]
    text = one_h200(tenant("a", capabilities=caps, preemptible=True, priority="low"),
                    tenant("b", capabilities=caps, priority="low"))
    text = text.replace("[broker]", "[broker]\ncompute_turns_ms = 400", 1)
    b = make_broker(text + "\n[broker.preemption]\nenabled = true\n")
    ta, tb = InProcTenant(b, "a", pid=5301), InProcTenant(b, "b", pid=5302)

    async def setup(t):
        ctl, client, dev, _sub = await t.subdevice()
        await t.alloc(ctl, client, dev, 0xA06C,
                      t.new("NV_CHANNEL_GROUP_ALLOCATION_PARAMETERS", engineType=1), new=0xC0)
        _, out, _ = await t.alloc(ctl, client, 0xC0, 0xC86F, t.new("NV_CHANNEL_ALLOC_PARAMS"),
                                  new=0xD0)
        assert out.status == nvs.NV_OK, out
        return client

    cla, clb = trio.run(setup, ta), trio.run(setup, tb)
    perform = lambda e: perform_blocking(e, b.memgate)  # noqa: E731
    run_blocking(locked(turns.step(b, 0)), perform)  # a's turn
    run_blocking(locked(turns.step(b, 0)), perform)  # b's turn: a's channel stopped
    assert channel_stopped(b.backend, cla, 0xD0) is True

    async def preempt():
        return await b.preemption.preempt("a")

    assert trio.run(preempt) is None
    assert channel_stopped(b.backend, cla, 0xD0) is False  # ran before the lock
    assert [t.name for t in turns.members(b, 0)] == ["b"]
    assert run_blocking(locked(turns.step(b, 0)), perform) is None  # b alone: no turns
    assert channel_stopped(b.backend, cla, 0xD0) is False
