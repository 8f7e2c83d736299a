"""The audit log stays bounded whatever a tenant does: refusal records are
rate-limited per tenant with a summary of what was left out, and the file is rotated. Real
files; the clock is injected so the test does not depend on the machine's speed."""
from __future__ import annotations

import json

from devbroker.broker.audit import AuditLog


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_flooding_tenant_is_summarised_and_the_others_are_not(tmp_path):
    clock = Clock()
    log = AuditLog(tmp_path / "audit.log", deny_rate=10, deny_burst=100, clock=clock)
    for i in range(5000):
        log.deny(tenant="bob", pid=7, node="nvidiactl", what=f"ioctl {i}", reason="refused")
    for i in range(20):
        log.deny(tenant="alice", pid=8, node="nvidiactl", what=f"ioctl {i}", reason="refused")
    recs = _records(tmp_path / "audit.log")
    bob = [r for r in recs if r.get("tenant") == "bob" and r["event"] == "deny"]
    alice = [r for r in recs if r.get("tenant") == "alice" and r["event"] == "deny"]
    assert len(bob) == 100  # the burst, then nothing while bob keeps flooding
    assert len(alice) == 20  # another tenant's records are not crowded out
    assert not any(r["event"] == "suppressed" for r in recs)
    # One second later bob's next refusal gets through, preceded by the summary.
    clock.t += 1.0
    log.deny(tenant="bob", pid=7, node="nvidiactl", what="ioctl last", reason="refused")
    recs = _records(tmp_path / "audit.log")
    summary = [r for r in recs if r["event"] == "suppressed"]
    assert len(summary) == 1 and summary[0]["tenant"] == "bob"
    assert summary[0]["count"] == 4900
    assert summary[0]["example"]["what"] == "ioctl 4999"
    assert recs[-1]["what"] == "ioctl last"
    # Events other than refusals (notices, policy changes) are never suppressed.
    for i in range(300):
        log.write("notice", message=f"n{i}")
    log.close()
    assert sum(r["event"] == "notice" for r in _records(tmp_path / "audit.log")) == 300


def test_what_is_suppressed_at_the_end_is_summarised_on_close(tmp_path):
    log = AuditLog(tmp_path / "audit.log", deny_rate=1, deny_burst=2, clock=Clock())
    for _ in range(10):
        log.deny(tenant="bob", what="x", reason="y")
    log.close()
    recs = _records(tmp_path / "audit.log")
    assert [r["event"] for r in recs] == ["deny", "deny", "suppressed"]
    assert recs[-1]["count"] == 8


def test_the_file_is_rotated_and_old_files_are_dropped(tmp_path):
    path = tmp_path / "audit.log"
    log = AuditLog(path, max_bytes=4000, keep=3, deny_rate=0)
    for i in range(1000):
        log.write("notice", message=f"line {i:04d}")
    log.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["audit.log", "audit.log.1", "audit.log.2", "audit.log.3"]
    for name in files:
        assert (tmp_path / name).stat().st_size <= 4000
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o600
    # The newest lines are in audit.log, the ones before in .1, and so on: nothing reordered.
    last = _records(path)[-1]["message"]
    assert last == "line 0999"
    first_of_current = _records(path)[0]["message"]
    last_of_1 = _records(tmp_path / "audit.log.1")[-1]["message"]
    assert int(last_of_1.split()[1]) + 1 == int(first_of_current.split()[1])


def test_every_kind_of_a_tenants_records_is_paced_and_summarised(tmp_path):
    """`rewrite` records (one per SET_TIMESLICE a tenant sends to a group)
    were not paced at all. Every kind that names a tenant is now, each kind on its own (a
    flood of one cannot hide the tenant's records of another)."""
    clock = Clock()
    log = AuditLog(tmp_path / "audit.log", deny_rate=10, deny_burst=100, clock=clock)
    for i in range(3000):
        log.write("rewrite", tenant="bob", pid=7, what="RM_CONTROL SET_TIMESLICE",
                  reason=f"timesliceUs {i} asked")
    log.deny(tenant="bob", pid=7, what="ioctl 0x1", reason="refused")  # another kind
    recs = _records(tmp_path / "audit.log")
    assert sum(r["event"] == "rewrite" for r in recs) == 100
    assert [r["what"] for r in recs if r["event"] == "deny"] == ["ioctl 0x1"]
    clock.t += 1.0
    log.write("rewrite", tenant="bob", pid=7, what="RM_CONTROL SET_TIMESLICE",
              reason="timesliceUs last asked")
    log.close()
    recs = _records(tmp_path / "audit.log")
    [summary] = [r for r in recs if r["event"] == "suppressed"]
    assert (summary["tenant"], summary["kind"], summary["count"]) == ("bob", "rewrite", 2900)
    assert "2900 more 'rewrite' records like this" in summary["reason"]
    assert summary["example"]["reason"] == "timesliceUs 2999 asked"


def test_one_tenants_noise_never_rotates_out_another_tenants_refusals(tmp_path):
    """One tenant at its pace rotated another tenant's refusals out of all
    four files in ~9 minutes. A tenant may fill at most half of the current file, so alone
    it never makes the file rotate; what it left out is summarised after the rotation."""
    clock = Clock()
    path = tmp_path / "audit.log"
    log = AuditLog(path, deny_rate=50, deny_burst=500, max_bytes=50_000, keep=3, clock=clock)
    for i in range(3):
        log.deny(tenant="alice", pid=8, node="nvidiactl", what=f"escape {i}", reason="refused")
    for second in range(600):  # ten minutes of bob at his pace, every kind he can make
        clock.t += 1.0
        for i in range(60):
            log.write("rewrite", tenant="bob", pid=7, what="RM_CONTROL SET_TIMESLICE",
                      reason=f"channel group {i:#x}: timesliceUs {second} asked")
            log.deny(tenant="bob", pid=7, what=f"ioctl {i}", reason="not on the allowlist")
    files = sorted(tmp_path.iterdir())
    kept = [r for f in files for r in _records(f)]
    assert [r["what"] for r in kept if r.get("tenant") == "alice"] == [
        "escape 0", "escape 1", "escape 2"]
    assert files == [path]  # bob alone never filled a file
    assert path.stat().st_size <= 50_000
    # the broker's own records (no tenant) still rotate the file, and bob's summary comes
    for i in range(2000):
        log.write("notice", message=f"line {i:04d}")
    log.close()
    kept = [r for f in sorted(tmp_path.iterdir()) for r in _records(f)]
    summaries = [r for r in kept if r["event"] == "suppressed" and r["tenant"] == "bob"]
    assert summaries and any("share of the audit file" in r["reason"] for r in summaries)
    assert sum(r["count"] for r in summaries) + sum(
        r.get("tenant") == "bob" and r["event"] in ("deny", "rewrite") for r in kept) \
        == 600 * 60 * 2


def test_the_emulators_not_modelled_notices_are_bounded(tmp_path):
    """Each FB info index a tenant named made one "not modelled" notice
    (2^32 of them). At most NOTICES_PER_KIND of a kind, then one that says the rest are
    left out."""
    import trio

    from devbroker.abi import status as nvs
    from devbroker.backends.emulated import NOTICES_PER_KIND
    from devbroker.testing.inproc import InProcTenant, make_broker
    from devbroker.testing.policies import one_h200, tenant

    b = make_broker(one_h200(tenant("bob", capabilities=["nvml"])),
                    audit_path=tmp_path / "audit.log")
    t = InProcTenant(b, "bob", pid=5201)

    async def ask():
        ctl, client, _dev, sub = await t.subdevice()
        statuses = set()
        for index in range(0x1000, 0x1000 + 200):
            p = t.params(0x20801303)
            entries = list(p.fbInfoList)
            entries[0] = entries[0].replace(index=index)
            p = p.replace(fbInfoListSize=1, fbInfoList=entries)
            _, out, _ = await t.control(ctl, client, sub, 0x20801303, p)
            statuses.add(out.status)
        return statuses

    statuses = trio.run(ask)
    assert statuses == {nvs.NV_ERR_NOT_SUPPORTED}
    b.audit.close()
    notices = [r for r in _records(tmp_path / "audit.log") if r["event"] == "notice"
               and "FB info index" in r.get("message", "")]
    assert len(notices) == NOTICES_PER_KIND
    assert any("are not modelled; the others are not noted" in r.get("message", "")
               for r in _records(tmp_path / "audit.log"))
