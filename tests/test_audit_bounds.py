"""The audit log stays bounded whatever a tenant does (issue 13 item 8): refusal records are
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
