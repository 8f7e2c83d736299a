"""The broker's metrics endpoint and threshold alerts, read straight from the
endpoint (tests/test_prometheus.py has Prometheus itself scraping it).

Real tenant processes in `devbroker exec` sandboxes make real calls through the FUSE nodes;
refusals come from the broker core and reach the counters through the audit log."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tenant_io import lines, readline_json
from test_prometheus import free_port, policy

pytestmark = pytest.mark.root

HERE = Path(__file__).resolve().parent
TENANT = [sys.executable, str(HERE / "tenant_prog.py")]


def scrape(url: str) -> dict[tuple, float]:
    """{(metric sample name, frozenset of labels): value}"""
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def total(samples: dict, name: str, **labels) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def wait_for(pred, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_calls_refusals_and_alerts(start_broker):
    port = free_port()
    broker = start_broker(policy(port, "\n[broker.alerts]\nrefusals_per_minute = 3\n"
                                       "escape_attempts = 2\nescape_window = 600\n"))
    url = f"http://127.0.0.1:{port}/metrics"
    before = scrape(url)
    assert total(before, "devbroker_tenant_requests_total", tenant="alice") == 0
    assert total(before, "devbroker_info", backend="emulated", pid=str(broker.proc.pid)) == 1
    assert total(before, "devbroker_alert_threshold", alert="refusal_rate") == 3

    # alice: three refused calls (an escape, a class, a control) -> refusal-rate alert
    r = broker.exec("alice", *TENANT, "refusals")
    assert r.returncode == 0, r.stdout + r.stderr
    # bob, twice: a call on alice's client handle -> escape attempts
    p = broker.exec_popen("alice", *TENANT, "hold", "64MiB", stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True)
    try:
        held = readline_json(p)
        for _ in range(2):
            r = broker.exec("bob", *TENANT, "foreign-client", hex(held["client"]))
            assert lines(r.stdout)[0]["status"] != 0
    finally:
        p.stdin.close()
        p.wait(timeout=30)

    alerts = wait_for(lambda: {(a["alert"], a["tenant"]) for a in broker.audit()
                               if a["event"] == "alert"} >= {("refusal_rate", "alice"),
                                                             ("escape_attempts", "bob")}
                      and [a for a in broker.audit() if a["event"] == "alert"],
                      "the broker's alert records")
    assert {(a["alert"], a["tenant"]) for a in alerts} == {("refusal_rate", "alice"),
                                                          ("escape_attempts", "bob")}
    by = {a["alert"]: a for a in alerts}
    assert by["refusal_rate"]["value"] == 3 and by["refusal_rate"]["threshold"] == 3
    assert by["escape_attempts"]["value"] == 2
    assert "escape attempts" in by["escape_attempts"]["message"]
    status = broker.status()
    assert {(a["alert"], a["tenant"]) for a in status["alerts"]} == \
        {("refusal_rate", "alice"), ("escape_attempts", "bob")}

    m = scrape(url)
    # Refusals by reason: every one sorted into a named reason, none left as "other".
    assert total(m, "devbroker_refusals_total", tenant="alice") == 3
    assert total(m, "devbroker_refusals_total", tenant="alice", reason="not_allowed") == 2
    assert total(m, "devbroker_refusals_total", tenant="bob", reason="foreign_object") == 2
    assert total(m, "devbroker_refusals_total", reason="other") == 0
    assert total(m, "devbroker_escape_attempts_total", tenant="bob") == 2
    assert total(m, "devbroker_escape_attempts_total", tenant="alice") == 0
    # The same refusals seen as call verdicts, by kind.
    assert total(m, "devbroker_calls_total", tenant="alice", verdict="refused") == 3
    assert total(m, "devbroker_calls_total", tenant="alice", verdict="refused",
                 call="NV_ESC_RM_ACCESS_REGISTRY") == 1
    assert total(m, "devbroker_calls_total", tenant="alice", verdict="refused",
                 call="NV_ESC_RM_CONTROL",
                 command="NV2080_CTRL_CMD_GPU_SET_ECC_CONFIGURATION") == 1
    assert total(m, "devbroker_calls_total", tenant="bob", verdict="refused") == 2
    ok = total(m, "devbroker_calls_total", tenant="alice", op="ioctl", verdict="ok")
    assert ok > 10
    # Every call counted is in the latency histograms too (labelled by kind only).
    counted = total(m, "devbroker_calls_total")
    assert total(m, "devbroker_call_duration_seconds_count") == counted
    assert total(m, "devbroker_call_duration_seconds_bucket", le="+Inf") == counted
    assert total(m, "devbroker_tenant_requests_total", tenant="alice") > 0
    assert total(m, "devbroker_alert_active", alert="escape_attempts", tenant="bob") == 1
    assert total(m, "devbroker_alert_active", alert="refusal_rate", tenant="alice") == 1
    assert total(m, "devbroker_alert_active", alert="quota") == 0
    assert total(m, "devbroker_alerts_raised_total", alert="escape_attempts", tenant="bob") == 1
    # The memory was given back when the holder exited.
    wait_for(lambda: total(scrape(url), "devbroker_tenant_open_files", tenant="alice") == 0,
             "alice's files closed")
    m = scrape(url)
    assert total(m, "devbroker_tenant_memory_used_bytes", tenant="alice") == 0
    assert total(m, "devbroker_gpu_memory_used_bytes", gpu="0") == 0
    assert total(m, "devbroker_gpu_memory_total_bytes", gpu="0") == 141 << 30


def test_endpoint_follows_the_policy_and_a_bad_address_is_refused(start_broker, tmp_path):
    first, second = free_port(), free_port()
    broker = start_broker(policy(first))
    assert total(scrape(f"http://127.0.0.1:{first}/metrics"), "devbroker_gpu_tenants") == 2
    # Moved by a policy apply: the old port closes, the new one serves.
    moved = tmp_path / "moved.toml"
    moved.write_text(policy(second))
    r = broker.cli("policy", "apply", str(moved))
    assert r.returncode == 0, r.stderr
    assert broker.status()["metrics"] == f"http://127.0.0.1:{second}/metrics"
    assert total(scrape(f"http://127.0.0.1:{second}/metrics"), "devbroker_gpu_tenants") == 2
    with pytest.raises(OSError):
        scrape(f"http://127.0.0.1:{first}/metrics")
    # A port someone else holds: the policy is refused, the running one (and endpoint) stays.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        busy = tmp_path / "busy.toml"
        busy.write_text(policy(taken.getsockname()[1]))
        r = broker.cli("policy", "apply", str(busy))
        assert r.returncode == 1
        assert "stays in force" in r.stderr and "Address already in use" in r.stderr
    assert broker.status()["metrics"] == f"http://127.0.0.1:{second}/metrics"
    assert total(scrape(f"http://127.0.0.1:{second}/metrics"), "devbroker_gpu_tenants") == 2
    # A policy without [broker.metrics]: no endpoint at all.
    off = tmp_path / "off.toml"
    off.write_text(policy(second).replace(f'[broker.metrics]\nlisten = "127.0.0.1:{second}"',
                                          ""))
    r = broker.cli("policy", "apply", str(off))
    assert r.returncode == 0, r.stderr
    assert broker.status()["metrics"] is None
    with pytest.raises(OSError):
        scrape(f"http://127.0.0.1:{second}/metrics")


def test_idle_connections_cannot_pile_up_threads(start_broker):
    """A tenant shares the host's network namespace: it can connect to a loopback endpoint.
    Connections that send nothing hold at most MAX_CONNECTIONS threads, and only until
    their timeout; scrapes work again afterwards."""
    from devbroker.broker.metrics import MetricsEndpoint

    port = free_port()
    broker = start_broker(policy(port))
    url = f"http://127.0.0.1:{port}/metrics"
    scrape(url)
    tasks = Path(f"/proc/{broker.proc.pid}/task")
    baseline = len(os.listdir(tasks))
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(40)]
    try:
        time.sleep(1.5)  # the server accepts them (its loop polls twice a second)
        threads = len(os.listdir(tasks))
        assert threads <= baseline + MetricsEndpoint.MAX_CONNECTIONS, (baseline, threads)
        closed = 0
        for s in idle:
            s.settimeout(0.2)
            try:
                closed += s.recv(1) == b""
            except socket.timeout:
                pass
        assert closed >= 40 - MetricsEndpoint.MAX_CONNECTIONS  # refused at once
    finally:
        for s in idle:
            s.close()
    # The held ones time out (or were closed by us): the endpoint answers again.
    wait_for(lambda: _scrapes(url), "a scrape after the idle connections", timeout=30)


def _scrapes(url: str) -> bool:
    try:
        return total(scrape(url), "devbroker_gpu_tenants") == 2
    except OSError:
        return False


def test_seccomp_tenants_calls_are_counted_too(start_broker):
    """The seccomp front end decides calls on its listener threads (broker/effects.py): the
    wrapper counts those as it counts the trio thread's, refusals included."""
    port = free_port()
    broker = start_broker(policy(port))
    broker.frontend = "seccomp"
    r = broker.exec("alice", *TENANT, "refusals")
    assert r.returncode == 0, r.stdout + r.stderr
    m = scrape(f"http://127.0.0.1:{port}/metrics")
    assert total(m, "devbroker_calls_total", tenant="alice", op="open", verdict="ok") >= 2
    assert total(m, "devbroker_calls_total", tenant="alice", op="ioctl",
                 call="NV_ESC_RM_CONTROL", verdict="ok") >= 1
    assert total(m, "devbroker_calls_total", tenant="alice", verdict="refused") == 3
    assert total(m, "devbroker_refusals_total", tenant="alice") == 3
