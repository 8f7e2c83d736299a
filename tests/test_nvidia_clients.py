"""NVIDIA's own clients (Debian's nvidia-smi / libnvidia-ml1 535.309.01) against the emulated
backend, inside `devbroker exec --tenant …` sandboxes, checked against the policy.

A broker runs as a subprocess on a policy written here (two emulated H200s; alice: GPU 0,
16 GiB; bob: GPUs 0 and 1, 8 GiB each). Alice holds 1 GiB through the broker (the probe
tool, `--keep`) while the clients run. The broker speaks 580.159.04 by default; the 535
clients ask for 535.309.01 and are answered in that ABI.

The clients run unmodified: `devbroker exec` alone gets NVML past its stat() check of
/dev/nvidiactl (the sandbox's seccomp stat shim, docs/sandbox.md). Process lists are checked
with a holder in the same exec as the client (one pid namespace, as in a container).
"""
from __future__ import annotations

import csv
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from devbroker.testing.tenant_binds import bind_args

pytestmark = [pytest.mark.nvidia, pytest.mark.root]

HERE = Path(__file__).resolve().parent
NVIDIA_SMI = shutil.which("nvidia-smi")
MiB = 1 << 20
GiB = 1 << 30

UUID0 = "GPU-5d1c0e7a-0b6e-4f43-9c1a-3a2b7e0d0001"
UUID1 = "GPU-5d1c0e7a-0b6e-4f43-9c1a-3a2b7e0d0002"
BUS = {0: "00000000:00:06.0", 1: "00000000:00:07.0"}
POLICY = f"""
[broker]
backend = "emulated"
driver_version = "580.159.04"

[[broker.gpu]]
name = "NVIDIA H200"
uuid = "{UUID0}"
pci_bus_id = "0000:00:06.0"
memory = "141GiB"

[[broker.gpu]]
name = "NVIDIA H200"
uuid = "{UUID1}"
pci_bus_id = "0000:00:07.0"
memory = "141GiB"

[tenant.alice]
gpus = [0]
memory_quota = "16GiB"

[tenant.bob]
gpus = [0, 1]
memory_quota = "8GiB"
"""
TENANTS = {"alice": {"gpus": [0], "quota": 16 * GiB}, "bob": {"gpus": [0, 1], "quota": 8 * GiB}}
UUIDS = {0: UUID0, 1: UUID1}
ALICE_HOLDS = 1 * GiB
TIMEOUT = 90

if os.geteuid() != 0:
    pytest.skip("needs root (FUSE mount, namespaces)", allow_module_level=True)
if NVIDIA_SMI is None:
    pytest.skip("nvidia-smi is not installed (scripts/install-nvidia-clients.sh installs "
                "Debian's nvidia-smi and libnvidia-ml1 535.309.01)", allow_module_level=True)


def _env(tmp: Path) -> dict:
    return dict(os.environ)


class Broker:
    def __init__(self, run_dir: Path, env: dict):
        self.run_dir = run_dir
        self.env = env
        self.cli = [sys.executable, "-m", "devbroker.cli.main", "--run-dir", str(run_dir)]

    frontend = "auto"

    def exec(self, tenant: str, *argv: str, as_root: bool = False,
             **kw) -> subprocess.CompletedProcess:
        # nvidia-smi runs as `devbroker exec`'s default uid (nobody); Python programs as root,
        # since the venv's interpreter may be where only root can go.
        ids = ["--uid", "0"] if as_root else []
        return subprocess.run(self.cli + ["exec", "--tenant", tenant, "--frontend",
                                          self.frontend, *ids, *bind_args(), "--", *argv],
                              capture_output=True, text=True, timeout=TIMEOUT, env=self.env,
                              **kw)

    def smi(self, tenant: str, *args: str) -> str:
        r = self.exec(tenant, NVIDIA_SMI, *args)
        if "blocked by the operating system" in r.stdout + r.stderr:
            pytest.fail("NVML refused /dev/nvidiactl: it is not a character device 195:255 "
                        "in the sandbox (the exec's stat shim, docs/sandbox.md)")
        assert r.returncode == 0, f"nvidia-smi {' '.join(args)} in {tenant}: rc {r.returncode}\n" \
                                  f"{r.stdout}\n{r.stderr}"
        return r.stdout

    def audit(self) -> list[dict]:
        return [json.loads(l) for l in (self.run_dir / "audit.log").read_text().splitlines()
                if l.strip()]


@pytest.fixture(scope="module", params=["fuse", "seccomp"])
def broker(tmp_path_factory, request):
    """One broker per front end: the clients run unmodified through FUSE node files (with the
    stat shim) and through seccomp user notification on character nodes."""
    tmp = tmp_path_factory.mktemp("nvclients")
    (tmp / "policy.toml").write_text(POLICY)
    env = _env(tmp)
    b = Broker(tmp / "run", env)
    b.frontend = request.param
    proc = subprocess.Popen(b.cli + ["run", "--policy", str(tmp / "policy.toml")],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=env)
    holder = None
    try:
        deadline = time.monotonic() + 60
        while True:
            st = subprocess.run(b.cli + ["status", "--json"], capture_output=True, text=True,
                                timeout=30, env=env)
            if st.returncode == 0:
                break
            assert proc.poll() is None, proc.stdout.read().decode(errors="replace")
            assert time.monotonic() < deadline, "broker did not start"
            time.sleep(0.2)
        # Alice holds 1 GiB of device memory through the broker for the whole module.
        holder = subprocess.Popen(
            b.cli + ["exec", "--tenant", "alice", "--frontend", b.frontend, "--uid", "0",
                     *bind_args(), "--",
                     sys.executable, "-m",
                     "devbroker.tools.probe", "--alloc", "1GiB", "--keep"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, env=env)
        lines = []
        deadline = time.monotonic() + 60
        for line in holder.stdout:
            lines.append(line)
            if line.strip() == "holding" or time.monotonic() > deadline:
                break
        assert lines and lines[-1].strip() == "holding", "".join(lines)
        b.holder = holder
        yield b
    finally:
        if holder is not None:
            holder.stdin.close()
            try:
                holder.wait(timeout=30)
            except subprocess.TimeoutExpired:
                holder.kill()
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _used(tenant: str, gpu: int) -> int:
    return ALICE_HOLDS if (tenant, gpu) == ("alice", 0) else 0


@pytest.mark.parametrize("tenant", sorted(TENANTS))
def test_list(broker, tenant):
    out = broker.smi(tenant, "-L")
    got = re.findall(r"^GPU (\d+): (.+) \(UUID: (GPU-[0-9a-f-]+)\)$", out, re.M)
    want = [(str(i), "NVIDIA H200", UUIDS[g]) for i, g in enumerate(TENANTS[tenant]["gpus"])]
    assert got == want, out


@pytest.mark.parametrize("tenant", sorted(TENANTS))
def test_query_gpu_csv(broker, tenant):
    out = broker.smi(tenant, "--query-gpu=index,name,uuid,pci.bus_id,memory.total,memory.used,"
                             "memory.free", "--format=csv")
    rows = list(csv.reader(io.StringIO(out), skipinitialspace=True))
    assert rows[0] == ["index", "name", "uuid", "pci.bus_id", "memory.total [MiB]",
                       "memory.used [MiB]", "memory.free [MiB]"], out
    quota = TENANTS[tenant]["quota"]
    assert len(rows) - 1 == len(TENANTS[tenant]["gpus"]), out
    for row, gpu in zip(rows[1:], TENANTS[tenant]["gpus"]):
        idx, name, uuid, bus, total, used, free = row
        assert (name, uuid, bus) == ("NVIDIA H200", UUIDS[gpu], BUS[gpu]), row
        assert total == f"{quota // MiB} MiB", row
        assert used == f"{_used(tenant, gpu) // MiB} MiB", row
        assert free == f"{(quota - _used(tenant, gpu)) // MiB} MiB", row


@pytest.mark.parametrize("tenant", sorted(TENANTS))
def test_default_view(broker, tenant):
    out = broker.smi(tenant)
    assert "NVIDIA-SMI 535.309.01" in out, out
    quota = TENANTS[tenant]["quota"] // MiB
    for gpu in TENANTS[tenant]["gpus"]:
        assert BUS[gpu] in out, out
        assert f"{_used(tenant, gpu) // MiB}MiB / {quota}MiB" in out.replace(" /  ", " / "), out
    for other in set(BUS) - set(TENANTS[tenant]["gpus"]):
        assert BUS[other] not in out, out
    assert re.search(r"\| N/A\s+N/A\s+N/A\s+N/A /\s+N/A \|", out), out  # fan temp perf power


def test_default_view_has_no_err(broker):
    out = broker.smi("alice")
    # Unmodelled values are N/A (NOT_SUPPORTED), never ERR! (a refusal) or a number.
    assert "ERR!" not in out.split("Processes:")[0], out


@pytest.mark.parametrize("tenant", sorted(TENANTS))
def test_driver_version(broker, tenant):
    # SYSTEM_GET_BUILD_VERSION through its embedded buffers: the version the client's
    # handshake agreed on (the emulator speaks 535.309.01 to Debian's NVML).
    assert re.search(r"Driver Version: 535\.309\.01 ", broker.smi(tenant)), tenant
    assert re.search(r"^Driver Version\s+: 535\.309\.01$", broker.smi(tenant, "-q"), re.M)


@pytest.mark.parametrize("tenant", sorted(TENANTS))
def test_query_full(broker, tenant):
    out = broker.smi(tenant, "-q")
    assert re.search(r"^Attached GPUs\s+: %d$" % len(TENANTS[tenant]["gpus"]), out, re.M), out
    assert re.findall(r"^\s+GPU UUID\s+: (\S+)$", out, re.M) == \
        [UUIDS[g] for g in TENANTS[tenant]["gpus"]], out
    fb = re.findall(r"FB Memory Usage\n\s+Total\s+: (\d+) MiB\n(?:\s+Reserved\s+: (\d+) MiB\n)?"
                    r"\s+Used\s+: (\d+) MiB\n\s+Free\s+: (\d+) MiB", out)
    assert [(int(t), int(u)) for t, _r, u, _f in fb] == \
        [(TENANTS[tenant]["quota"] // MiB, _used(tenant, g) // MiB)
         for g in TENANTS[tenant]["gpus"]], out
    assert re.search(r"GPU Current Temp\s+: N/A", out), out


def _pynvml(broker, tenant) -> dict:
    r = broker.exec(tenant, sys.executable, str(HERE / "nvml_script.py"), as_root=True)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout)


@pytest.mark.parametrize("tenant", sorted(TENANTS))
def test_pynvml(broker, tenant):
    out = _pynvml(broker, tenant)
    gpus = TENANTS[tenant]["gpus"]
    assert out["count"] == len(gpus) and out["shutdown"] is True, out
    for d, gpu in zip(out["devices"], gpus):
        assert d["name"] == "NVIDIA H200" and d["uuid"] == UUIDS[gpu], d
        assert d["pci_bus_id"] == BUS[gpu], d
        quota = TENANTS[tenant]["quota"]
        assert d["memory"] == {"total": quota, "used": _used(tenant, gpu),
                               "free": quota - _used(tenant, gpu)}, d


def test_unmodelled_is_na_and_noticed_once(broker):
    """An unmodelled query is NOT_SUPPORTED (N/A), logged once however often it is asked:
    the inforom ECC object version (GET_INFOROM_OBJECT_VERSION, sent several times by each
    nvidia-smi -q)."""
    for t in TENANTS:
        out = broker.smi(t, "-q")
        assert re.search(r"^\s+ECC Object\s+: N/A$", out, re.M), out
    notices = [e["message"] for e in broker.audit() if e.get("event") == "notice"]
    assert len([m for m in notices if "(0x2080014b)" in m]) == 1, notices
    assert any("GET_INFOROM_OBJECT_VERSION" in m and "NV_ERR_NOT_SUPPORTED" in m
               for m in notices), notices
    assert len(notices) == len(set(notices)), "a notice was logged twice"


def test_refused_query_is_insufficient_permissions(broker):
    """A query the policy refuses (accounting state names a GPU id: REFUSED_CONTROLS) shows
    as the driver's refusal, and the audit log says why."""
    out = broker.smi("alice", "-q")
    assert re.search(r"^\s+Accounting Mode\s+: Insufficient Permissions$", out, re.M), out
    assert any(e.get("event") == "deny" and "(0xb02)" in e.get("reason", "")
               for e in broker.audit())


def test_two_tenants_isolated(broker):
    """Bob sees his two GPUs, his quota and none of alice's use; alice sees her GPU only."""
    for tenant, other in (("alice", "bob"), ("bob", "alice")):
        out = broker.smi(tenant, "--query-gpu=uuid,memory.total,memory.used",
                         "--format=csv,noheader")
        rows = [r.split(", ") for r in out.strip().splitlines()]
        assert [r[0] for r in rows] == [UUIDS[g] for g in TENANTS[tenant]["gpus"]], out
        for (uuid, total, used), g in zip(rows, TENANTS[tenant]["gpus"]):
            assert total == f"{TENANTS[tenant]['quota'] // MiB} MiB", out
            assert used == f"{_used(tenant, g) // MiB} MiB", out


# Run last: the in-exec holder allocates on top of the module-wide one.
IN_EXEC_HOLDS = 512 * MiB
HOLD_AND_QUERY = (
    "sleep 60 | {py} -m devbroker.tools.probe --alloc 512MiB --keep >/dev/null & "
    "echo HOLDER=$!; sleep 3; "
    "echo NVML=$({py} {script}); "
    "echo CSV; {smi} --query-compute-apps=pid,used_memory --format=csv,noheader; "
    "echo SMI; {smi}; kill $! 2>/dev/null; true")


def _hold_and_query(broker, tenant):
    r = broker.exec(tenant, "sh", "-c", HOLD_AND_QUERY.format(
        py=sys.executable, script=HERE / "nvml_script.py", smi=NVIDIA_SMI), as_root=True)
    assert r.returncode == 0, r.stdout + r.stderr
    holder = int(re.search(r"^HOLDER=(\d+)$", r.stdout, re.M).group(1))
    nvml = json.loads(re.search(r"^NVML=(.*)$", r.stdout, re.M).group(1))
    csv_part = r.stdout.split("\nCSV\n", 1)[1].split("\nSMI\n", 1)[0]
    return holder, nvml, csv_part, r.stdout.split("\nSMI\n", 1)[1]


def test_processes_are_the_tenants_own(broker):
    """The process list is the tenant's own processes in the caller's pid namespace, with
    the memory each holds: alice's in-exec holder (512 MiB), not the module-wide holder (in
    another exec, another pid namespace), and nothing of alice's for bob."""
    holder, nvml, csv_out, smi = _hold_and_query(broker, "alice")
    assert nvml["devices"][0]["processes"] == [{"pid": holder, "used": IN_EXEC_HOLDS}], nvml
    assert csv_out.strip().splitlines() == [f"{holder}, {IN_EXEC_HOLDS // MiB} MiB"], csv_out
    assert re.search(rf"\|\s+0\s+N/A\s+N/A\s+{holder}\s+C\s+\S*python\S*\s+"
                     rf"{IN_EXEC_HOLDS // MiB}MiB \|", smi), smi
    # Bob, while alice's module-wide holder still holds 1 GiB on GPU 0: nothing of hers.
    bob = _pynvml(broker, "bob")["devices"]
    assert [d["processes"] for d in bob] == [[], []], bob
    assert "No running processes found" in broker.smi("bob")
