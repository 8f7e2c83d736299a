"""Real containers: Debian's runc 1.1 and crun 1.8 start containers whose
/dev/nvidia* are devbroker's, from a CDI spec written by `devbroker cdi` and a seccomp section
written by `devbroker oci-seccomp`, with no `devbroker exec` anywhere.

* CDI + FUSE nodes: Debian's nvidia-smi 535 in a container sees its tenant's GPU and quota,
  and a second container with another tenant sees its own (the runtime's seccomp hand-over
  carries only stat() to the broker's stat shim there).
* seccomp hand-over: the same client with character nodes, every open/ioctl/mmap through
  the listener the runtime sent to RUN_DIR/oci-seccomp.sock; the audit log names the tenant
  and the container; killing the container frees every session, client and byte.
* refusals: a container naming no tenant of the policy, or two, does not start, and the
  audit log says why.

The bundles' root file systems are the host's /usr and /etc, read-only (tests/oci_helpers.py);
runc/crun come from Debian (scripts/install-container-runtimes.sh).
"""
from __future__ import annotations

import csv
import io
import json
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import DEVBROKER, RunningBroker  # noqa: E402
from devbroker.testing.oci import Runtime, apply_cdi, load_config, make_bundle, save_config  # noqa: E402

pytestmark = [pytest.mark.root, pytest.mark.nvidia]

MiB, GiB = 1 << 20, 1 << 30
UUID = {0: "GPU-0c1d0000-0000-4000-8000-00000000a11c", 1: "GPU-0c1d0000-0000-4000-8000-0000000000b0"}
BUS = {0: "00000000:00:06.0", 1: "00000000:00:07.0"}
POLICY = f"""
[broker]
backend = "emulated"
driver_version = "580.159.04"

[[broker.gpu]]
name = "NVIDIA H200"
uuid = "{UUID[0]}"
pci_bus_id = "0000:00:06.0"
memory = "141GiB"

[[broker.gpu]]
name = "NVIDIA H200"
uuid = "{UUID[1]}"
pci_bus_id = "0000:00:07.0"
memory = "141GiB"

[tenant.alice]
gpus = [0]
memory_quota = "16GiB"

[tenant.bob]
gpus = [1]
memory_quota = "8GiB"
"""
TENANTS = {"alice": (0, 16 * GiB), "bob": (1, 8 * GiB)}
NVIDIA_SMI = "/usr/bin/nvidia-smi"
QUERY = ["--query-gpu=index,name,uuid,pci.bus_id,memory.total,memory.used",
         "--format=csv,noheader"]
TIMEOUT = 120


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    if not Path(NVIDIA_SMI).exists():
        pytest.fail("nvidia-smi is missing: scripts/install-nvidia-clients.sh installs it")
    tmp = tmp_path_factory.mktemp("containers")
    (tmp / "policy.toml").write_text(POLICY)
    b = RunningBroker(tmp / "run", tmp / "policy.toml")
    b.tmp = tmp
    b.specs = {}
    for fe in ("fuse", "seccomp"):
        r = b.cli("cdi", "--frontend", fe, "--output", str(tmp / f"cdi-{fe}.json"))
        assert r.returncode == 0, r.stderr
        b.specs[fe] = json.loads((tmp / f"cdi-{fe}.json").read_text())
    yield b
    b.stop()
    subprocess.run(["umount", "-l", str(b.run_dir / "nodes")], capture_output=True)


@pytest.fixture(params=["runc", "crun"])
def runtime(request, tmp_path):
    for tool in (request.param,):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is not installed: scripts/install-container-runtimes.sh")
    return Runtime(request.param, tmp_path / f"{request.param}-state")


@pytest.fixture
def runc(tmp_path):
    if shutil.which("runc") is None:
        pytest.fail("runc is not installed: scripts/install-container-runtimes.sh")
    return Runtime("runc", tmp_path / "runc-state")


def bundle(broker, tmp: Path, tenant: str, frontend: str, argv: list[str], *,
           tenant_tree: Path | None = None, via: str = "cdi-annotation", **kw) -> Path:
    """A bundle running argv as tenant: the tenant's CDI device applied, then the seccomp
    section. ``via``: how the container names its tenant to the broker."""
    b = tmp / f"bundle-{uuid.uuid4().hex[:8]}"
    b.mkdir()
    annotations = kw.pop("annotations", {})
    if via == "cdi-annotation":  # how CRI runtimes carry a CDI request
        annotations["cdi.k8s.io/devbroker"] = f"devbroker.io/gpu={tenant}"
    make_bundle(b, argv, tenant_tree=tenant_tree, annotations=annotations, **kw)
    config = load_config(b)
    apply_cdi(config, broker.specs[frontend], [f"devbroker.io/gpu={tenant}"])
    save_config(b, config)
    args = ["oci-seccomp", "--frontend", frontend, "--config", str(b / "config.json")]
    if via == "metadata":
        args += ["--tenant", tenant]
    elif via == "cdi-applied":  # one section for every tenant: a Kubernetes profile
        args += ["--tenant-from-cdi"]
    r = broker.cli(*args)
    assert r.returncode == 0, r.stderr
    return b


def run(rt: Runtime, b: Path, timeout: float = TIMEOUT) -> tuple[str, subprocess.CompletedProcess]:
    cid = f"db-{uuid.uuid4().hex[:10]}"
    try:
        r = rt.run(b, cid, capture_output=True, text=True, timeout=timeout,
                   stdin=subprocess.DEVNULL)
    finally:
        rt.delete(cid)
    return cid, r


def _attached(broker, cid: str) -> dict:
    recs = [a for a in broker.audit() if a.get("event") == "tenant-attached"
            and a.get("container") == cid]
    assert len(recs) == 1, broker.audit()[-10:]
    return recs[0]


def _smi_rows(out: str) -> list[list[str]]:
    return [r for r in csv.reader(io.StringIO(out), skipinitialspace=True) if r]


# --------------------------------------------------------------------------- CDI + FUSE
@pytest.mark.parametrize("frontend", ["fuse", "seccomp"])
def test_nvidia_smi_sees_its_tenant(broker, runtime, tmp_path, frontend):
    """Two containers, two tenants, each sees its own GPU with its quota as total memory."""
    for tenant, (gpu, quota) in TENANTS.items():
        b = bundle(broker, tmp_path, tenant, frontend, [NVIDIA_SMI, *QUERY])
        cid, r = run(runtime, b)
        if "blocked by the operating system" in r.stdout:
            pytest.fail("NVML refused /dev/nvidiactl: it did not stat as char 195:255")
        assert r.returncode == 0, f"{runtime.name} {frontend} {tenant}: {r.stdout}{r.stderr}"
        assert _smi_rows(r.stdout) == [["0", "NVIDIA H200", UUID[gpu], BUS[gpu],
                                        f"{quota // MiB} MiB", "0 MiB"]], r.stdout
        rec = _attached(broker, cid)
        assert (rec["tenant"], rec["frontend"], rec["via"]) == (tenant, frontend, "oci"), rec
        assert "CDI device devbroker.io/gpu=" + tenant in rec["named_by"], rec


def test_views_in_the_container(broker, runc, tmp_path):
    """What the hook and the seccomp sections make of /dev, /proc and /sys: the nodes stat
    as NVIDIA character devices (FUSE files through the stat shim, real nodes in seccomp
    mode), NVML is told not to manage device files, nvidia-uvm's major matches, and the
    views cannot be written."""
    script = ("stat -c '%n %F %t:%T' /dev/nvidiactl /dev/nvidia0 /dev/nvidia-uvm; "
              "grep ModifyDeviceFiles /proc/driver/nvidia/params; "
              "grep nvidia /proc/devices; cat /sys/module/nvidia/initstate; "
              "ls /proc/driver; touch /proc/driver/x 2>&1 | sed 's/.*: //'")
    seen = {}
    for frontend in ("fuse", "seccomp"):
        b = bundle(broker, tmp_path, "alice", frontend, ["/bin/sh", "-c", script],
                   via="metadata")
        _cid, r = run(runc, b)
        assert r.returncode == 0, r.stdout + r.stderr
        seen[frontend] = r.stdout
        lines = r.stdout.splitlines()
        uvm = next(int(l.split()[0]) for l in lines if l.endswith(" nvidia-uvm"))
        assert lines[:3] == ["/dev/nvidiactl character special file c3:ff",
                             "/dev/nvidia0 character special file c3:0",
                             f"/dev/nvidia-uvm character special file {uvm:x}:0"], r.stdout
        assert "ModifyDeviceFiles: 0" in lines and "195 nvidia-frontend" in lines, r.stdout
        assert "live" in lines and "nvidia" in lines, r.stdout
        assert lines[-1] == "Read-only file system", r.stdout
    assert seen["fuse"] == seen["seccomp"]


# --------------------------------------------------------------------------- seccomp hand-over
@pytest.mark.parametrize("frontend", ["seccomp", "fuse"])
def test_killing_the_container_frees_everything(broker, runc, tmp_path, tenant_tree, frontend):
    """A container holding 512 MiB through the hand-over (named by annotation): the audit log
    names tenant and container; after `runc kill -9` the broker holds nothing of it
    (`devbroker status`)."""
    b = bundle(broker, tmp_path, "bob", frontend,
               ["/usr/bin/python3", "-m", "devbroker.tools.probe", "--alloc", "512MiB",
                "--keep"], tenant_tree=tenant_tree, via="annotation",
               annotations={"devbroker.io/tenant": "bob"},
               env=["PYTHONPATH=/opt/devbroker/src"])
    cid = f"db-{uuid.uuid4().hex[:10]}"
    proc = runc.popen(b, cid, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                      stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.strip() == "holding":
                break
        assert lines and lines[-1].strip() == "holding", "".join(lines) + proc.stderr.read()
        bob = broker.tenant("bob")
        assert bob["memory"]["1"]["used"] == 512 * MiB and bob["open_files"] > 0, bob
        assert bob["processes"] and bob["clients"] > 0, bob
        rec = _attached(broker, cid)
        assert (rec["tenant"], rec["frontend"]) == ("bob", frontend), rec
        assert broker.cli("status").returncode == 0  # also while a container is attached
        assert rec["named_by"] == ["annotation devbroker.io/tenant"], rec
        st = runc.state(cid)
        assert st and st["pid"] == rec["pid"], (st, rec)
        assert runc.kill(cid, signal.SIGKILL).returncode == 0
        assert proc.wait(timeout=60) != 0
        deadline = time.monotonic() + 30
        while True:
            bob = broker.tenant("bob")
            if not (bob["open_files"] or bob["processes"] or bob["clients"]
                    or bob["memory"]["1"]["used"]):
                break
            assert time.monotonic() < deadline, f"still held after the kill: {bob}"
            time.sleep(0.2)
        out = broker.cli("status").stdout
        assert "bob          1            0     0     0 gpu1: 0 B / 8 GiB" in out, out
        assert any(a.get("event") == "tenant-detached" and a.get("container") == cid
                   for a in broker.audit())
    finally:
        if proc.poll() is None:
            proc.kill()
        runc.delete(cid)


@pytest.mark.parametrize("annotations,metadata_tenant,reason", [
    ({"devbroker.io/tenant": "mallory"}, None, "no tenant 'mallory' in the running policy"),
    ({"devbroker.io/tenant": "alice"}, "bob", "names more than one tenant"),
    ({}, None, "no tenant named"),
])
def test_refused_container_does_not_start(broker, runc, tmp_path, annotations,
                                          metadata_tenant, reason):
    """A hand-over the broker refuses leaves the container without its listener: its first
    open fails (ENOSYS) and the runtime reports the start failed; the audit log says why."""
    b = tmp_path / "bundle"
    b.mkdir()
    make_bundle(b, [NVIDIA_SMI, "-L"], annotations=annotations)
    config = load_config(b)
    apply_cdi(config, broker.specs["seccomp"], ["devbroker.io/gpu=alice"])
    save_config(b, config)
    args = ["oci-seccomp", "--frontend", "seccomp", "--config", str(b / "config.json")]
    if metadata_tenant:
        args += ["--tenant", metadata_tenant]
    assert broker.cli(*args).returncode == 0
    # the annotation --tenant writes would mask the conflict under test: put alice's back
    if metadata_tenant:
        config = load_config(b)
        config["annotations"] = dict(annotations)
        save_config(b, config)
    before = broker.status()["tenants"]
    cid, r = run(runc, b)
    assert r.returncode != 0, r.stdout
    assert "GPU 0" not in r.stdout
    recs = [a for a in broker.audit() if a.get("event") == "container-refused"
            and a.get("container") == cid]
    assert len(recs) == 1 and reason in recs[0]["reason"], broker.audit()[-5:]
    assert not any(a.get("container") == cid for a in broker.audit()
                   if a.get("event") == "tenant-attached")
    after = broker.status()["tenants"]
    assert [(t["name"], t["requests"], t["open_files"]) for t in after] == \
        [(t["name"], t["requests"], t["open_files"]) for t in before]


@pytest.mark.parametrize("frontend", ["fuse", "seccomp"])
def test_tenant_from_the_applied_cdi_device(broker, runc, tmp_path, frontend):
    """`oci-seccomp --tenant-from-cdi` names no tenant, and the container carries no
    annotation: the broker takes the tenant whose CDI device the runtime applied (its hook
    in config.json), as a cluster's containers are named (docs/kubernetes.md)."""
    for tenant, (gpu, quota) in TENANTS.items():
        b = bundle(broker, tmp_path, tenant, frontend, [NVIDIA_SMI, *QUERY], via="cdi-applied")
        assert "annotations" not in load_config(b) or not load_config(b)["annotations"]
        cid, r = run(runc, b)
        assert r.returncode == 0, f"{frontend} {tenant}: {r.stdout}{r.stderr}"
        assert _smi_rows(r.stdout) == [["0", "NVIDIA H200", UUID[gpu], BUS[gpu],
                                        f"{quota // MiB} MiB", "0 MiB"]], r.stdout
        rec = _attached(broker, cid)
        assert rec["tenant"] == tenant, rec
        assert rec["named_by"] == [f"CDI device devbroker.io/gpu={tenant} applied (config.json)"]


def test_cdi_spec_of_named_tenants_and_the_gpus_op(broker, tmp_path):
    """`devbroker cdi --tenant` writes only those tenants' devices (a spec file per claim);
    an unknown name is an error. The read-only `gpus` op lists the backend's GPUs."""
    out = tmp_path / "bob.json"
    r = broker.cli("cdi", "--frontend", "fuse", "--tenant", "bob", "-o", str(out))
    assert r.returncode == 0, r.stderr
    spec = json.loads(out.read_text())
    assert [d["name"] for d in spec["devices"]] == ["bob"]
    assert spec["devices"] == [d for d in broker.specs["fuse"]["devices"] if d["name"] == "bob"]
    r = broker.cli("cdi", "--tenant", "bob", "--tenant", "mallory")
    assert r.returncode == 1 and "no tenant 'mallory'" in r.stderr and not r.stdout
    g = broker.control({"op": "gpus"})
    assert g["ok"] and g["backend"] == "emulated"
    assert [(x["index"], x["uuid"], x["pci_bus_id"], x["memory"]) for x in g["gpus"]] == \
        [(i, UUID[i], f"0000:00:0{6 + i}.0", 141 * GiB) for i in (0, 1)]


def test_cli_writes_usable_sections(broker, tmp_path):
    """`devbroker oci-seccomp` alone prints the section; --config refuses to overwrite an
    existing seccomp section unless told to."""
    r = broker.cli("oci-seccomp", "--frontend", "seccomp", "--tenant", "alice")
    section = json.loads(r.stdout)
    assert section["listenerPath"] == str((broker.run_dir / "oci-seccomp.sock").resolve())
    assert section["listenerMetadata"].endswith("tenant=alice")
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"linux": {"seccomp": {"defaultAction": "SCMP_ACT_ALLOW"}}}))
    r = broker.cli("oci-seccomp", "--frontend", "fuse", "--config", str(cfg))
    assert r.returncode == 1 and "already has a seccomp section" in r.stderr
    r = broker.cli("oci-seccomp", "--frontend", "fuse", "--config", str(cfg), "--replace")
    assert r.returncode == 0
    got = json.loads(cfg.read_text())
    assert got["process"]["noNewPrivileges"] is True
    assert got["linux"]["seccomp"]["syscalls"][0]["names"] == ["stat", "fstat", "lstat",
                                                               "newfstatat", "statx"]
    # auto: the broker runs the emulated backend, so FUSE nodes
    auto = json.loads(broker.cli("cdi").stdout)
    assert auto == broker.specs["fuse"]
