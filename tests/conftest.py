"""Shared fixtures: paths, a broker in this process (inproc_broker), and a real broker
process with its FUSE nodes (start_broker)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from k8s_fixtures import k8s_cluster  # noqa: F401  (the session's Kubernetes test cluster)

REPO = Path(__file__).resolve().parent.parent
# Everything a test reads lies in the checkout: a user's clone has nothing beside it.
DATA = REPO / "tests" / "data"


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def traces_dir() -> Path:
    """The H200 recordings (nvtrace) the tests replay: tests/data, inside the checkout, where
    a tenant bound to the checkout (testing/tenant_binds.py) can read them too."""
    return DATA


@pytest.fixture(scope="session")
def tenant_tree() -> Path:
    """The project's files for tenants that run as other uids, in a directory every uid can
    read and enter (devbroker.testing.tenant_tree): the checkout may be under a 0700 home."""
    from devbroker.testing import tenant_tree

    return tenant_tree.ensure(REPO)


@pytest.fixture
def inproc_broker(tmp_path):
    """policy text (testing/policies.py; None: two_h200()) -> a Broker in this process with
    the emulated backend, its audit log in tmp_path (no root, FUSE or subprocess). Drive it
    with devbroker.testing.inproc.InProcTenant."""
    from devbroker.testing.inproc import make_broker

    def make(policy_text: str | None = None, **kw):
        return make_broker(policy_text, audit_path=tmp_path / "audit.jsonl", **kw)

    return make


def pytest_collection_modifyitems(config, items):
    not_root = os.geteuid() != 0 or not os.path.exists("/dev/fuse")
    slow = os.environ.get("DEVBROKER_SLOW") == "1"
    for item in items:
        if "root" in item.keywords and not_root:
            item.add_marker(pytest.mark.skip(reason="needs root and /dev/fuse"))
        if "slow" in item.keywords and not slow:
            item.add_marker(pytest.mark.skip(reason="slow suite: set DEVBROKER_SLOW=1"))


DEVBROKER = [sys.executable, "-m", "devbroker.cli.main"]


class RunningBroker:
    """`devbroker run` in a subprocess, with helpers to act as operator and tenant."""

    def __init__(self, run_dir: Path, policy: Path | None, backend: str | None = None,
                 extra: list[str] | None = None):
        self.run_dir = run_dir
        self.policy = policy
        args = DEVBROKER + ["--run-dir", str(run_dir), "run"]
        if policy:
            args += ["--policy", str(policy)]
        if backend:
            args += ["--backend", backend]
        args += extra or []
        self.log = open(run_dir.parent / f"{run_dir.name}-broker.log", "w+")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self._wait_ready()

    def _wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"broker exited {self.proc.returncode}: {self.output()}")
            try:
                if self.control({"op": "status"}).get("ok"):
                    return
            except Exception:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"broker did not start: {self.output()}")

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def control(self, req: dict) -> dict:
        from devbroker.broker.control import call

        return call(self.run_dir / "control.sock", req, timeout=10)

    def status(self) -> dict:
        return self.control({"op": "status"})

    def tenant(self, name: str) -> dict:
        return next(t for t in self.status()["tenants"] if t["name"] == name)

    def cli(self, *args: str, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(DEVBROKER + ["--run-dir", str(self.run_dir), *args],
                              capture_output=True, text=True, timeout=timeout, **kw)

    # How `devbroker exec` reaches the broker: "auto" (the CLI's default), "fuse" or
    # "seccomp"; tests parametrized over front ends set it.
    frontend = "auto"

    # Tenants run as root unless a test says otherwise (`devbroker exec` itself defaults to
    # nobody): the stronger tenant, and the venv's interpreter may sit where only root can
    # go. Options such as --bind go in `opts`.
    def _exec_args(self, tenant: str, argv, uid: int | None, opts) -> list[str]:
        from devbroker.testing.tenant_binds import bind_args

        ids = ["--uid", str(uid)] if uid is not None else []
        # A checkout under /tmp is not in the tenant's view (its /tmp is its own): bound in.
        return ["exec", "--tenant", tenant, "--frontend", self.frontend, *ids, *bind_args(),
                *opts, "--", *argv]

    def exec(self, tenant: str, *argv: str, timeout: float = 120, uid: int | None = 0,
             opts: tuple = (), **kw):
        return self.cli(*self._exec_args(tenant, argv, uid, opts), timeout=timeout, **kw)

    def exec_popen(self, tenant: str, *argv: str, uid: int | None = 0, opts: tuple = (),
                   **kw) -> subprocess.Popen:
        return subprocess.Popen(DEVBROKER + ["--run-dir", str(self.run_dir),
                                             *self._exec_args(tenant, argv, uid, opts)], **kw)

    def audit(self) -> list[dict]:
        path = self.run_dir / "audit.log"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture
def start_broker(tmp_path):
    """Factory: start_broker(policy_text=None, backend=None) -> RunningBroker."""
    started: list[RunningBroker] = []

    def start(policy_text: str | None = None, *, backend: str | None = None,
              extra: list[str] | None = None, run_dir: Path | None = None) -> RunningBroker:
        policy = None
        if policy_text is not None:
            policy = tmp_path / f"policy{len(started)}.toml"
            policy.write_text(policy_text)
        rd = run_dir or (tmp_path / f"run{len(started)}")
        b = RunningBroker(rd, policy, backend, extra)
        started.append(b)
        return b

    yield start
    for b in started:
        b.stop(signal.SIGKILL if b.proc.poll() is None else signal.SIGTERM)
        subprocess.run(["umount", "-l", str(b.run_dir / "nodes")], capture_output=True)


def pytest_configure(config):
    # The broker runs from this checkout even when the package is not installed.
    src = str(REPO / "src")
    os.environ["PYTHONPATH"] = src + (os.pathsep + os.environ["PYTHONPATH"]
                                      if os.environ.get("PYTHONPATH") else "")
