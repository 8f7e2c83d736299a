"""One pod with a devbroker GPU claim on a one-node real cluster (scripts/gpu/run-h200-k8s.sh).

    python3 k8s_pod_run.py probe                      # what this machine has (JSON)
    python3 k8s_pod_run.py run --backend real|emulated --bin-dir D --work W --out O

`run` starts the broker (`devbroker run --backend B`), the test cluster of
devbroker.testing.k8s with one node, the DRA kubelet plugin, then a ResourceClaimTemplate of
8 GiB (docs/kubernetes.md's example) and one pod that runs nvidia-smi and, with the real
backend, PyTorch (scripts/gpu/cuda_checks.py init and quota: 6 GiB ok, 12 GiB
OutOfMemoryError); then deletes the pod and checks that its tenant and CDI spec are gone.
If the cluster cannot start or the pod never runs its checks, the fallback runs the same
container by runc with the claim's CDI spec and the seccomp hand-over (as
scripts/gpu/run-h200-runc.sh does). Every wait is bounded by --deadline; results go to
OUT/results.json, logs to W (the shell script bundles them).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DRIVER = "gpu.devbroker.io"
GiB = 1 << 30
CLAIM_MEMORY = "8Gi"
RUN_DIR = Path("/run/devbroker-k8sgpu")

EMULATED_POLICY = """\
[broker]
backend = "emulated"

[[broker.gpu]]
name = "NVIDIA H200"
uuid = "GPU-5d1c0e7a-0b6e-4f43-9c1a-3a2b7e0d0006"
pci_bus_id = "0000:00:06.0"
memory = "32GiB"
"""
# the real backend finds the GPUs; the plugin adds the tenants at run time
REAL_POLICY = '[broker]\nbackend = "real"\n'

TEMPLATE = """\
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata:
  name: gpu-8gi
  namespace: default
spec:
  spec:
    devices:
      requests:
      - name: gpu
        exactly:
          deviceClassName: gpu.devbroker.io
          capacity:
            requests:
              memory: {memory}
              compute: "8"
"""

DONE = "POD-CHECKS-DONE"


def log(msg: str) -> None:
    print(f"k8s-pod-run: {msg}", file=sys.stderr, flush=True)


def sh(*argv: str, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)
    except (OSError, subprocess.TimeoutExpired) as e:
        return subprocess.CompletedProcess(argv, 127, "", str(e))


# ---- probe -----------------------------------------------------------------------------------

def _cgroup_facts() -> dict:
    mounts = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        pre, _, post = line.partition(" - ")
        fs = post.split()[0]
        if fs in ("cgroup", "cgroup2"):
            mounts.append(f"{pre.split()[4]} {fs} {post.split()[2]}")
    out = {"mounts": mounts, "self": Path("/proc/self/cgroup").read_text().split()}
    root = Path("/sys/fs/cgroup")
    if (root / "cgroup.controllers").exists():
        out["v2_controllers"] = (root / "cgroup.controllers").read_text().strip()
        out["v2_subtree_control"] = (root / "cgroup.subtree_control").read_text().strip()
    out["layout"] = ("v2" if (root / "cgroup.controllers").exists() else
                     "hybrid" if any(" cgroup2 " in m for m in mounts) else "v1")
    return out


def _python_facts(py: str) -> dict:
    """Where this machine's python3 and torch live (what a pod must mount to run them)."""
    code = r"""
import json, os, sys
d = {"executable": sys.executable, "real": os.path.realpath(sys.executable),
     "prefix": sys.prefix, "base_prefix": sys.base_prefix, "version": sys.version.split()[0]}
try:
    import torch
    d["torch"] = os.path.dirname(torch.__file__)
    d["torch_version"] = torch.__version__
    d["torch_cuda"] = torch.version.cuda
except Exception as e:
    d["torch_error"] = repr(e)[:200]
print(json.dumps(d))
"""
    r = sh(py, "-c", code, timeout=120)
    try:
        return json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": (r.stderr or r.stdout)[-500:]}


def _libs() -> dict:
    r = sh("ldconfig", "-p")
    out = {}
    for name in ("libcuda.so.1", "libnvidia-ml.so.1"):
        hit = [ln.split("=>")[-1].strip() for ln in r.stdout.splitlines()
               if ln.strip().startswith(name + " ")]
        out[name] = hit[0] if hit else None
    return out


def _overlay_ok(base: Path) -> str:
    d = base / f".overlay-probe-{os.getpid()}"
    for s in ("l", "u", "w", "m"):
        (d / s).mkdir(parents=True, exist_ok=True)
    r = sh("mount", "-t", "overlay", "overlay", "-o",
           f"lowerdir={d}/l,upperdir={d}/u,workdir={d}/w", str(d / "m"))
    if r.returncode == 0:
        sh("umount", str(d / "m"))
    shutil.rmtree(d, ignore_errors=True)
    return "ok" if r.returncode == 0 else r.stderr.strip()[:200]


def _netns_ok() -> str:
    """A bridge, a veth into a new network namespace: what the cluster's network needs."""
    ns, br, veth = "dbkprobe", "dbkprobe0", "dbkprobe1"
    steps = [("ip", "link", "add", br, "type", "bridge"),
             ("ip", "netns", "add", ns),
             ("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns),
             ("ip", "link", "set", veth, "master", br, "up")]
    res = "ok"
    for s in steps:
        r = sh(*s)
        if r.returncode != 0:
            res = f"{' '.join(s)}: {r.stderr.strip()[:200]}"
            break
    sh("ip", "link", "del", veth)
    sh("ip", "netns", "del", ns)
    sh("ip", "link", "del", br)
    return res


def probe(py: str, state_base: Path) -> dict:
    caps = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("CapBnd", "CapEff")):
            k, v = line.split(":")
            caps[k] = v.strip()
    bnd = int(caps.get("CapBnd", "0"), 16)
    facts = {
        "kernel": os.uname().release,
        "os": next((ln.split("=", 1)[1].strip('"') for ln in
                    Path("/etc/os-release").read_text().splitlines()
                    if ln.startswith("PRETTY_NAME=")), "?") if Path("/etc/os-release").exists()
        else "?",
        "glibc": os.confstr("CS_GNU_LIBC_VERSION"),
        "cgroups": _cgroup_facts(),
        "caps": caps,
        "cap_sys_resource": bool(bnd >> 24 & 1),
        "tools": {t: shutil.which(t) for t in ("ip", "nsenter", "unshare", "openssl", "mount",
                                               "umount", "runc", "iptables", "xz",
                                               "nvidia-smi", "ldconfig")},
        "filesystems": sorted({ln.split()[-1] for ln in
                               Path("/proc/filesystems").read_text().splitlines()}
                              & {"overlay", "tmpfs", "cgroup", "cgroup2", "fuse"}),
        "state_fs": sh("stat", "-f", "-c", "%T", str(state_base)).stdout.strip(),
        "overlay_mount": _overlay_ok(state_base),
        "netns_bridge_veth": _netns_ok(),
        "python": _python_facts(py),
        "libs": _libs(),
        "env_PATH": os.environ.get("PATH", ""),
        "env_LD_LIBRARY_PATH": os.environ.get("LD_LIBRARY_PATH", ""),
        "dev_nvidia": sorted(p.name for p in Path("/dev").glob("nvidia*")),
        "driver": (Path("/proc/driver/nvidia/version").read_text().splitlines()[0]
                   if Path("/proc/driver/nvidia/version").exists() else None),
        "disk_free_gib": round(shutil.disk_usage(state_base).free / GiB, 1),
        "mem_total_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB, 1),
        "cpus": os.cpu_count(),
    }
    return facts


# ---- what the pod needs of this machine --------------------------------------------------------

def _host_dirs(var: str, skip: tuple[str, ...]) -> list[str]:
    return [d for d in os.environ.get(var, "").split(":")
            if d and os.path.isabs(d) and not d.startswith(skip) and os.path.isdir(d)]


def pod_mounts(facts: dict, skip: tuple[str, ...]) -> tuple[list[str], dict[str, str]]:
    """Host directories the pod shows read-only at the same path (beyond /usr, which the
    host-tools image borrows anyway), and its PATH and LD_LIBRARY_PATH: python3's prefixes,
    torch's directory, nvidia-smi's, the NVIDIA libraries' and LD_LIBRARY_PATH's
    directories here."""
    py = facts.get("python", {})
    want = [py.get("prefix"), py.get("base_prefix"), os.path.dirname(py.get("real") or "/usr"),
            py.get("torch"), *(os.path.dirname(p) for p in facts.get("libs", {}).values() if p),
            os.path.dirname(facts["tools"].get("nvidia-smi") or "/usr/bin"),
            *_host_dirs("LD_LIBRARY_PATH", skip)]
    roots: list[str] = []
    for p in want:
        if not p or not os.path.isabs(p):
            continue
        parts = Path(os.path.realpath(p)).parts
        if len(parts) < 2 or parts[1] in ("usr", "proc", "sys", "dev", "run", "tmp", "etc"):
            continue
        # /opt/torch/.venv/... -> /opt/torch: a directory of its own, not all of /opt
        roots.append(str(Path(*parts[:3])) if len(parts) >= 3 else str(Path(*parts)))
    mounts = sorted({r for r in roots if os.path.isdir(r)})
    mounts = [m for m in mounts if not any(m != o and m.startswith(o + "/") for o in mounts)]
    path = [os.path.dirname(py["executable"])] if py.get("executable") else []
    path += [d for d in _host_dirs("PATH", skip) if d not in path]
    path += [d for d in "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".split(":")
             if d not in path]
    env = {"PATH": ":".join(path), "PYTHONUNBUFFERED": "1", "HOME": "/root"}
    ld = _host_dirs("LD_LIBRARY_PATH", skip)
    if ld:
        env["LD_LIBRARY_PATH"] = ":".join(ld)
    return mounts, env


def pod_command(backend: str, python: str) -> str:
    smi = "nvidia-smi --query-gpu=name,memory.total --format=csv,noheader"
    # this machine's python3, from the mounts pod_mounts names
    cmds = [f"echo SMI $({smi}) rc=$?", "nvidia-smi",
            f"{python} -c 'import sys; print(\"PY\", sys.version.split()[0])'"]
    if backend == "real":
        chk = "/work/scripts/gpu/cuda_checks.py"
        cmds += [f"{python} {chk} init 2>&1 | tail -5", f"{python} {chk} quota 2>&1 | tail -5"]
    cmds += [f"echo {DONE}", "exec sleep 3600"]
    return "; ".join(cmds)


def pod_yaml(name: str, command: str, mounts: list[str], env: dict[str, str]) -> str:
    vols = [{"name": "usr", "hostPath": {"path": "/usr"}},
            {"name": "checkout", "hostPath": {"path": str(REPO)}}]
    vmounts = [{"name": "usr", "mountPath": "/usr", "readOnly": True},
               {"name": "checkout", "mountPath": "/work", "readOnly": True}]
    for i, m in enumerate(mounts):
        vols.append({"name": f"host{i}", "hostPath": {"path": m}})
        vmounts.append({"name": f"host{i}", "mountPath": m, "readOnly": True})
    pod = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 2,
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "gpu-8gi"}],
            "containers": [{
                "name": "main",
                "image": "localhost/devbroker/host:1",
                "imagePullPolicy": "Never",
                "command": ["sh", "-c", command],
                "env": [{"name": k, "value": v} for k, v in env.items()],
                # per container: the pod's sandbox (pause) has no claim
                "securityContext": {"seccompProfile": {"type": "Localhost",
                                                       "localhostProfile": "devbroker.json"}},
                "resources": {"claims": [{"name": "gpu"}]},
                "volumeMounts": vmounts,
            }],
            "volumes": vols,
        },
    }
    return json.dumps(pod, indent=1)


def parse_pod_log(text: str) -> dict:
    res: dict = {}
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("SMI "):
            res["smi"] = s[4:]
        elif s.startswith("PY "):
            res["python"] = s[3:]
        elif s.startswith("{") and s.endswith("}"):
            try:
                d = json.loads(s)
            except ValueError:
                continue
            res["quota" if "twelve_gib" in d else "init"] = d
        elif s == DONE:
            res["done"] = True
    return res


# ---- the run -----------------------------------------------------------------------------------

class Deadline:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self, reserve: float = 0) -> float:
        return max(0.0, self.end - time.monotonic() - reserve)


def wait(what: str, cond, timeout: float, every: float = 1.0):
    log(f"waiting for {what} (at most {timeout:.0f}s)")
    end = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() >= end:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(every)


class Broker:
    def __init__(self, py: str, backend: str, work: Path):
        self.py, self.work = py, work
        self.run_dir = RUN_DIR
        shutil.rmtree(self.run_dir, ignore_errors=True)
        self.run_dir.mkdir(parents=True)
        policy = work / "policy.toml"
        policy.write_text(REAL_POLICY if backend == "real" else EMULATED_POLICY)
        self.log_path = work / "broker.log"
        self.audit = work / "audit.log"
        self.proc = subprocess.Popen(
            [py, "-m", "devbroker.cli.main", "--run-dir", str(self.run_dir), "run",
             "--backend", backend, "--policy", str(policy), "--audit", str(self.audit)],
            stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True)

    def control(self, req: dict) -> dict:
        from devbroker.broker.control import call
        return call(self.run_dir / "control.sock", req, timeout=10)

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"broker exited {self.proc.returncode}: "
                               f"{self.log_path.read_text()[-2000:]}")
        try:
            return bool(self.control({"op": "status"}).get("ok")) and \
                (self.run_dir / "oci-seccomp.sock").exists()
        except Exception:
            return False

    def tenants(self) -> dict:
        r = self.control({"op": "tenant.list"})
        return {t["name"]: t for t in r.get("tenants", [])}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        sh("umount", "-l", str(self.run_dir / "nodes"))


def devbroker_wrapper(py: str, path: Path) -> Path:
    """`devbroker` for the plugin: this interpreter, the checkout's sources, the wheels."""
    path.write_text("#!/bin/sh\n"
                    f"export PYTHONPATH={os.environ.get('PYTHONPATH', '')}\n"
                    f'exec {py} -m devbroker.cli.main "$@"\n')
    path.chmod(0o755)
    return path


def audit_records(broker: Broker) -> list[dict]:
    out = []
    try:
        for line in broker.audit.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    except OSError:
        pass
    return out


def run_cluster(a, res: dict, broker: Broker, facts: dict, dl: Deadline) -> None:
    from devbroker.testing.k8s import Cluster

    state = Path(f"/tmp/dbkgpu{os.getpid()}")
    cluster = Cluster(state_dir=state, bin_dir=a.bin_dir, node_names=("node-a",),
                      log=lambda m: log(f"cluster: {m}"))
    res["state_dir"] = str(state)
    plugin = None
    a.cleanup.append(lambda: _cluster_down(cluster, a.work))
    t0 = time.monotonic()
    cluster.up(timeout=min(150, dl.left(200)))
    res["cluster_up_s"] = round(time.monotonic() - t0, 1)
    res["stage"] = "cluster up"
    node = cluster.nodes["node-a"]
    kubectl = cluster.kubectl

    def describe() -> None:
        for args in (("get", "nodes,pods,resourceclaims,resourceslices", "-A", "-o", "wide"),
                     ("describe", "pod", "gpu-pod"), ("get", "events", "-A")):
            r = kubectl(*args, check=False, timeout=30)
            print(f"--- kubectl {' '.join(args)}\n{r.stdout[-6000:]}{r.stderr[-1000:]}",
                  file=sys.stderr)
    a.describe = describe

    plugin_log = a.work / "plugin.log"
    plugin_argv = [str(a.bin_dir / "devbroker-dra-plugin"), "--run-dir", str(broker.run_dir),
                   "--node-name", "node-a", "--cdi-dir", str(node.cdi_dir),
                   "--kubeconfig", str(cluster.kubeconfig),
                   "--plugin-dir", str(node.plugins_dir / DRIVER),
                   "--registrar-dir", str(node.plugins_registry),
                   "--seccomp-dir", str(node.kubelet_root / "seccomp"),
                   "--devbroker", str(devbroker_wrapper(a.py, a.bin_dir / "devbroker")),
                   "--grace", "2s", "--frontend", "seccomp"]
    plugin = subprocess.Popen(plugin_argv, stdout=open(plugin_log, "w"),
                              stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                              start_new_session=True)
    a.cleanup.insert(0, lambda: _stop(plugin))
    kubectl("apply", "-f", str(REPO / "deploy" / "k8s" / "deviceclass.yaml"))

    def slice_():
        if plugin.poll() is not None:
            raise RuntimeError(f"plugin exited {plugin.returncode}: "
                               f"{plugin_log.read_text()[-2000:]}")
        items = json.loads(kubectl("get", "resourceslices", "-o", "json").stdout)["items"]
        return [s for s in items if s["spec"]["driver"] == DRIVER]
    slices = wait("the plugin's ResourceSlice", slice_, min(60, dl.left(150)))
    dev = slices[0]["spec"]["devices"][0]
    res["resourceslice_device"] = {"name": dev["name"],
                                   "productName": dev["attributes"].get("productName"),
                                   "memory": dev["capacity"]["memory"]["value"]}
    log(f"ResourceSlice: {res['resourceslice_device']}")
    res["stage"] = "plugin published its GPU"

    kubectl("apply", "-f", "-", input=TEMPLATE.format(memory=CLAIM_MEMORY))
    spec = pod_yaml("gpu-pod", a.command, a.mounts, a.pod_env)
    (a.work / "pod.json").write_text(spec)
    kubectl("apply", "-f", "-", input=spec)

    def pod() -> dict:
        return json.loads(kubectl("get", "pod", "gpu-pod", "-o", "json").stdout)

    def checks_done():
        p = pod()
        phase = p["status"].get("phase")
        if phase in ("Failed", "Succeeded"):
            return {"phase": phase}
        if phase != "Running":
            return None
        text = kubectl("logs", "gpu-pod", check=False).stdout
        return {"phase": phase, "log": text} if DONE in text else None
    t0 = time.monotonic()
    got = wait("the pod's checks", checks_done, min(240, dl.left(120)), every=2)
    res["pod_run_s"] = round(time.monotonic() - t0, 1)
    text = kubectl("logs", "gpu-pod", check=False).stdout
    print(f"--- pod log\n{text}", file=sys.stderr)
    (a.work / "pod.log").write_text(text)
    res["pod_phase"] = got["phase"]
    res["pod"] = parse_pod_log(text)
    res["stage"] = "pod ran its checks"

    p = pod()
    claim_name = p["status"]["resourceClaimStatuses"][0]["resourceClaimName"]
    claim = json.loads(kubectl("get", "resourceclaim", claim_name, "-o", "json").stdout)
    tenant = f"k8s-{claim['metadata']['uid']}"
    results = claim["status"]["allocation"]["devices"]["results"]
    res["claim"] = {"name": claim_name, "tenant": tenant,
                    "consumed": [r.get("consumedCapacity") for r in results]}
    t = broker.tenants().get(tenant)
    res["tenant_while_running"] = t
    status = broker.control({"op": "status"})
    res["tenant_status_while_running"] = next(
        ({k: x.get(k) for k in ("name", "processes", "memory_used", "memory_quota", "requests",
                                "refusals", "labels") if k in x}
         for x in status.get("tenants", []) if x["name"] == tenant), None)
    cdi = node.cdi_dir / f"{DRIVER}-{tenant}.json"
    res["cdi_spec_while_running"] = cdi.exists()
    res["attached"] = [r for r in audit_records(broker) if r.get("event") == "tenant-attached"
                       and r.get("tenant") == tenant]

    t0 = time.monotonic()
    kubectl("delete", "pod", "gpu-pod", "--wait=true", timeout=max(10, min(90, dl.left(60))))
    wait("the claim's tenant to go", lambda: tenant not in broker.tenants(),
         min(60, dl.left(45)))
    res["delete_s"] = round(time.monotonic() - t0, 1)
    res["tenant_after_delete"] = broker.tenants().get(tenant)
    res["cdi_spec_after_delete"] = cdi.exists()
    res["stage"] = "pod deleted, tenant gone"
    log(f"tenant {tenant} gone after the pod's deletion; CDI spec left: {cdi.exists()}")


def _stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()


def _cluster_down(cluster, work: Path) -> None:
    logs = cluster.state_dir / "logs"
    if logs.is_dir():
        shutil.copytree(logs, work / "cluster-logs", dirs_exist_ok=True)
    cluster.down()
    left = cluster.leftovers() if cluster.plan else []
    if left:
        log(f"the cluster left behind: {left}")
    else:
        shutil.rmtree(cluster.state_dir, ignore_errors=True)


def run_fallback(a, res: dict, broker: Broker, dl: Deadline) -> None:
    """The pod's container by runc: the claim's tenant made as the plugin makes it (tenant.add,
    8 GiB), its CDI spec, the seccomp hand-over named by the tenant."""
    from devbroker.testing.oci import Runtime, apply_cdi, load_config, make_bundle, save_config

    tenant = "k8s-fallback"
    db = [a.py, "-m", "devbroker.cli.main", "--run-dir", str(broker.run_dir)]
    r = broker.control({"op": "tenant.add", "tenant": tenant,
                        "spec": {"gpus": [0], "memory_quota": 8 * GiB, "compute_weight": 8},
                        "labels": {"pod": "gpu-pod", "namespace": "default",
                                   "container": "main", "claim": "fallback"}})
    res["fallback_tenant_add"] = r
    cdi = a.work / "fallback-cdi.json"
    r = sh(*db, "cdi", "--frontend", "seccomp", "--tenant", tenant, "--output", str(cdi))
    if r.returncode != 0:
        raise RuntimeError(f"devbroker cdi: {r.stderr}")
    spec = json.loads(cdi.read_text())
    bundle = a.work / "fallback-bundle"
    shutil.rmtree(bundle, ignore_errors=True)
    bundle.mkdir()
    env = [f"{k}={v}" for k, v in a.pod_env.items()]
    make_bundle(bundle, ["sh", "-c", a.command.replace("exec sleep 3600", "true")],
                binds=tuple(a.mounts), env=env)
    cfg = load_config(bundle)
    # the checkout at /work, as the pod has it
    (bundle / "rootfs" / "work").mkdir(exist_ok=True)
    cfg["mounts"].append({"destination": "/work", "type": "bind", "source": str(REPO),
                          "options": ["rbind", "ro", "nosuid", "nodev"]})
    apply_cdi(cfg, spec, [f"devbroker.io/gpu={tenant}"])
    save_config(bundle, cfg)
    r = sh(*db, "oci-seccomp", "--frontend", "seccomp", "--tenant", tenant,
           "--config", str(bundle / "config.json"))
    if r.returncode != 0:
        raise RuntimeError(f"devbroker oci-seccomp: {r.stderr}")
    rt = Runtime("runc", a.work / "runc-state")
    cid = f"k8s-fallback-{uuid.uuid4().hex[:6]}"
    try:
        p = rt.run(bundle, cid, capture_output=True, text=True,
                   timeout=max(30, min(240, dl.left(30))))
    finally:
        rt.delete(cid)
    print(f"--- fallback container: rc {p.returncode}\n{p.stdout[-6000:]}\n{p.stderr[-3000:]}",
          file=sys.stderr)
    (a.work / "fallback.log").write_text(p.stdout + "\n--- stderr\n" + p.stderr)
    res["fallback_rc"] = p.returncode
    res["fallback_pod"] = parse_pod_log(p.stdout)
    res["fallback_attached"] = [x for x in audit_records(broker)
                                if x.get("event") == "tenant-attached"
                                and x.get("tenant") == tenant]
    r = broker.control({"op": "tenant.rm", "tenant": tenant, "grace": 2})
    res["fallback_tenant_rm"] = r
    res["fallback_tenant_after_rm"] = broker.tenants().get(tenant)


def judge(pod: dict, backend: str) -> dict:
    """What the pod's (or the fallback container's) output shows against what it must."""
    out = {"smi_total_8gib": (pod.get("smi") or "").rsplit(",", 1)[-1].split(" rc=")[0].strip()
           == "8192 MiB",
           "smi_rc0": (pod.get("smi") or "").endswith("rc=0"),
           "python_ran": bool(pod.get("python")), "done": bool(pod.get("done"))}
    if backend == "real":
        init, quota = pod.get("init") or {}, pod.get("quota") or {}
        out["torch_init_ok"] = init.get("ok") is True and init.get("mem_total") == 8 * GiB
        out["six_gib_ok"] = quota.get("six_gib") == "ok"
        out["twelve_gib_oom"] = quota.get("twelve_gib") == "OutOfMemoryError"
    return out


def cmd_run(a) -> int:
    dl = Deadline(a.deadline)
    res: dict = {"backend": a.backend, "mode": "cluster", "stage": "start", "ok": False}
    a.work.mkdir(parents=True, exist_ok=True)
    a.cleanup = []
    a.describe = None
    skip = (str(a.bin_dir.parent),)   # the unpacked pack: PATH's carried tools
    facts = json.loads(a.facts.read_text()) if a.facts else probe(a.py, Path("/tmp"))
    a.mounts, a.pod_env = pod_mounts(facts, skip)
    python = (facts.get("python") or {}).get("executable") or "python3"
    a.command = pod_command(a.backend, python)
    res["pod_mounts"], res["pod_env"], res["pod_command"] = a.mounts, a.pod_env, a.command
    log(f"pod mounts {a.mounts}; env {a.pod_env}")
    broker = Broker(a.py, a.backend, a.work)
    try:
        wait("the broker", broker.ready, min(60, dl.left()), every=0.2)
        res["gpus"] = broker.control({"op": "gpus"}).get("gpus")
        log(f"broker ready; GPUs {res['gpus']}")
        cluster_error = None
        if os.environ.get("K8S_FORCE_FALLBACK") != "1":
            try:
                run_cluster(a, res, broker, facts, dl)
            except Exception as e:
                cluster_error = f"{type(e).__name__}: {e}"
                res["cluster_error"] = cluster_error[-4000:]
                log(f"FAILED at stage {res['stage']!r}: {cluster_error[-3000:]}")
                if a.describe:
                    a.describe()
                _tails(a.work, broker)
        else:
            cluster_error = "K8S_FORCE_FALLBACK=1"
            res["cluster_error"] = cluster_error
        for f in a.cleanup:
            try:
                f()
            except Exception as e:
                log(f"cleanup: {e}")
        a.cleanup = []
        res["checks"] = judge(res.get("pod") or {}, a.backend)
        if cluster_error is None:
            res["checks"].update(
                tenant_labelled=(res.get("tenant_while_running") or {}).get("labels", {})
                .get("pod") == "gpu-pod",
                attached_via_oci=bool(res.get("attached")) and all(
                    x.get("via") == "oci" for x in res["attached"]),
                tenant_gone=res.get("tenant_after_delete") is None,
                cdi_spec_gone=res.get("cdi_spec_after_delete") is False)
            res["ok"] = all(res["checks"].values())
        if not res["ok"] and dl.left() > 40:
            # the cluster could not run the pod (or its checks failed): the same container
            # by runc says whether the node or the cluster's part is at fault
            log("=" * 20 + " FALLBACK: the pod's container by runc, CDI spec + seccomp "
                f"hand-over (the cluster part ended at {res['stage']!r}) " + "=" * 20)
            try:
                run_fallback(a, res, broker, dl)
                fb = judge(res.get("fallback_pod") or {}, a.backend)
                fb["attached_via_oci"] = bool(res.get("fallback_attached"))
                fb["tenant_gone"] = res.get("fallback_tenant_after_rm") is None
                res["fallback_checks"] = fb
                if all(fb.values()):
                    res["mode"], res["ok"] = "fallback", True
            except Exception as e:
                res["fallback_error"] = f"{type(e).__name__}: {e}"[-3000:]
                log(f"fallback FAILED: {res['fallback_error']}")
    finally:
        for f in a.cleanup:
            try:
                f()
            except Exception as e:
                log(f"cleanup: {e}")
        try:
            res["broker_status_end"] = {
                t["name"]: {k: t.get(k) for k in ("processes", "open_files", "memory_used")}
                for t in broker.control({"op": "status"}).get("tenants", [])}
        except Exception as e:
            res["broker_status_end"] = repr(e)
        res["audit_denies"] = [x for x in audit_records(broker)
                               if x.get("event") in ("deny", "error")][-10:]
        broker.stop()
        res["left_s"] = round(dl.left(), 1)
        (a.out / "results.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    log(f"checks: {res.get('checks')}")
    if "fallback_checks" in res:
        log(f"fallback checks: {res['fallback_checks']}")
    log(f"RESULT: {'OK' if res['ok'] else 'FAILED'} ({res['mode']}, stage {res['stage']!r})")
    return (0 if res["mode"] == "cluster" else 2) if res["ok"] else 1


def _tails(work: Path, broker: Broker) -> None:
    """The last lines of every log that says why a pod did not run."""
    files = [broker.log_path, work / "plugin.log"]
    for d in Path("/tmp").glob(f"dbkgpu{os.getpid()}/logs"):
        files += sorted(d.glob("*.log"))
    for f in files:
        try:
            lines = f.read_text(errors="replace").splitlines()[-40:]
        except OSError:
            continue
        print(f"--- tail {f}\n" + "\n".join(lines), file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("probe")
    p.add_argument("--state-base", type=Path, default=Path("/tmp"))
    r = sub.add_parser("run")
    r.add_argument("--backend", choices=("real", "emulated"), required=True)
    r.add_argument("--bin-dir", type=Path, required=True)
    r.add_argument("--work", type=Path, required=True)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--facts", type=Path, help="the probe's JSON (else probed now)")
    r.add_argument("--deadline", type=float, default=420, help="seconds for everything")
    a = ap.parse_args(argv)
    a.py = sys.executable
    if a.cmd == "probe":
        print(json.dumps(probe(a.py, a.state_base), indent=1))
        return 0
    a.bin_dir = a.bin_dir.resolve()
    return cmd_run(a)


if __name__ == "__main__":
    sys.exit(main())
