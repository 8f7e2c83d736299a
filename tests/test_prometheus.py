"""Debian's Prometheus server scraping a running broker.

A real `prometheus` (installed by scripts/install-ops-tools.sh) is started on a free loopback
port with a config that scrapes the broker's endpoint every second and evaluates the shipped
rules file (deploy/prometheus/devbroker-rules.yml). Tenant processes do real allocations
through the FUSE nodes; the test reads what Prometheus stored through its HTTP API.
"""
from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from devbroker.testing.policies import one_h200, tenant

from tenant_io import readline_json

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RULES = REPO / "deploy" / "prometheus" / "devbroker-rules.yml"
TENANT = [sys.executable, str(HERE / "tenant_prog.py")]
MiB = 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is missing: scripts/test.sh installs it (scripts/install-ops-tools.sh)")
    return path


def policy(metrics_port: int, extra: str = "") -> str:
    return one_h200(tenant("alice", memory_quota="1GiB"), tenant("bob", memory_quota="1GiB"),
                    driver_version=None, metrics=f"127.0.0.1:{metrics_port}", extra=extra)


class Prometheus:
    def __init__(self, tmp: Path, targets: list[str]):
        self.port = free_port()
        self.dir = tmp / "prometheus"
        self.dir.mkdir()
        config = self.dir / "prometheus.yml"
        config.write_text(json.dumps({  # JSON is YAML
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [{"job_name": "devbroker",
                                "static_configs": [{"targets": targets}]}],
        }))
        self.log = open(self.dir / "log", "w+")
        self.proc = subprocess.Popen(
            [tool("prometheus"), f"--config.file={config}",
             f"--storage.tsdb.path={self.dir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.wait(lambda: self._get("/-/ready", raw=True) is not None, "Prometheus ready")

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def _get(self, path: str, raw: bool = False):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as r:
                data = r.read()
        except OSError:
            return None
        return data if raw else json.loads(data)

    def query(self, expr: str) -> list[dict]:
        reply = self._get("/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
        assert reply is None or reply["status"] == "success", reply
        return reply["data"]["result"] if reply else []

    def value(self, expr: str) -> float | None:
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else None

    def alerts(self) -> list[dict]:
        reply = self._get("/api/v1/alerts")
        return reply["data"]["alerts"] if reply else []

    def wait(self, pred, what: str, timeout: float = 60.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"prometheus exited {self.proc.returncode}: "
                                     f"{self.output()}")
            value = pred()
            if value:
                return value
            time.sleep(0.25)
        raise AssertionError(f"timed out waiting for {what}; prometheus log: {self.output()}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture
def prometheus(tmp_path):
    started: list[Prometheus] = []

    def start(targets: list[str]) -> Prometheus:
        p = Prometheus(tmp_path, targets)
        started.append(p)
        return p

    yield start
    for p in started:
        p.stop()


def test_shipped_rules_pass_promtool_check_and_unit_tests():
    r = subprocess.run([tool("promtool"), "check", "rules", str(RULES)], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS: 5 rules found" in r.stdout
    # The rules' own unit tests: the quota alert fires at 90 % of the quota and not at 80 %
    # or for a tenant without quota; the escape alert follows the broker's.
    r = subprocess.run([tool("promtool"), "test", "rules", "devbroker-rules-test.yml"],
                       capture_output=True, text=True, cwd=HERE / "data")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout
    # The example scrape configuration beside them is a valid configuration that loads them.
    r = subprocess.run([tool("promtool"), "check", "config",
                        str(RULES.parent / "prometheus-example.yml")], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS: 5 rules found" in r.stdout


@pytest.mark.root
def test_prometheus_sees_allocation_and_quota_alert_fires(start_broker, prometheus):
    mport = free_port()
    broker = start_broker(policy(mport))
    assert broker.status()["metrics"] == f"http://127.0.0.1:{mport}/metrics"
    prom = prometheus([f"127.0.0.1:{mport}"])
    used = 'devbroker_tenant_memory_used_bytes{tenant="alice",gpu="0"}'
    prom.wait(lambda: prom.value('up{job="devbroker"}') == 1.0, "the broker scraped")
    assert prom.wait(lambda: prom.value(used) is not None, "alice's memory series") is True
    assert prom.value(used) == 0.0
    assert prom.value('devbroker_tenant_memory_quota_bytes{tenant="alice"}') == 1024 * MiB

    holders = []
    try:
        # A real tenant process allocates 256 MiB through its FUSE nodes and holds it.
        p = broker.exec_popen("alice", *TENANT, "hold", "256MiB", stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
        holders.append(p)
        assert readline_json(p)["memory"]["used"] == 256 * MiB
        prom.wait(lambda: prom.value(used) == 256 * MiB, "256 MiB in Prometheus")
        # The calls it made are counted by kind, with their latency.
        allocs = prom.value('sum(devbroker_calls_total{tenant="alice",op="ioctl",'
                            'call="NV_ESC_RM_ALLOC",command="NV01_MEMORY_LOCAL_USER",'
                            'verdict="ok"})')
        assert allocs == 1.0
        assert prom.value('sum(devbroker_call_duration_seconds_count{'
                          'call="NV_ESC_RM_CONTROL"})') > 0
        assert not [a for a in prom.alerts() if a["labels"]["alertname"] ==
                    "DevbrokerTenantQuotaNearlyFull"]

        # A second process takes alice to 976 MiB of 1 GiB (95 %): the rule fires.
        p = broker.exec_popen("alice", *TENANT, "hold", "720MiB", stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
        holders.append(p)
        assert readline_json(p)["memory"]["used"] == 976 * MiB

        def firing():
            return [a for a in prom.alerts()
                    if a["labels"]["alertname"] == "DevbrokerTenantQuotaNearlyFull"
                    and a["state"] == "firing"]

        alerts = prom.wait(firing, "the quota alert firing")
        assert [(a["labels"]["tenant"], a["labels"]["gpu"]) for a in alerts] == [("alice", "0")]
        assert alerts[0]["annotations"]["summary"] == \
            "tenant alice uses 95.3 % of its quota on GPU 0"
        assert prom.value(used) == 976 * MiB
        # The broker raised its own alert too: an audit record and the gauge.
        prom.wait(lambda: prom.value('devbroker_alert_active{alert="quota",tenant="alice"}')
                  == 1.0, "the broker's quota alert in Prometheus")
        records = [a for a in broker.audit() if a["event"] == "alert"]
        assert [(a["alert"], a["tenant"], a["gpu"]) for a in records] == [("quota", "alice", 0)]
        assert records[0]["value"] == 95.31 and records[0]["threshold"] == 90
        assert prom.value('devbroker_tenant_memory_used_bytes{tenant="bob"}') == 0.0

        # Freed again: the alert ends, in Prometheus and in the audit log.
        p.stdin.close()
        p.wait(timeout=30)
        prom.wait(lambda: prom.value(used) == 256 * MiB, "the memory given back")
        prom.wait(lambda: not firing(), "the quota alert resolved")
        # The broker's own checker runs on its period, not Prometheus's: wait for it too.
        assert prom.wait(lambda: any(a["event"] == "alert-resolved" and a["tenant"] == "alice"
                                     for a in broker.audit()),
                         "the broker's alert-resolved record") is True
    finally:
        for p in holders:
            p.kill()
            p.wait()
