"""The DRA driver gpu.devbroker.io in a real cluster (docs/kubernetes.md).

Real Kubernetes v1.37.2 components (the session's `k8s_cluster`: etcd, apiserver, scheduler,
controller manager, two nodes of containerd + kubelet), one emulated-backend broker per node
with one 32 GiB GPU, and the kubelet plugin (k8s/dra, Go; scripts/k8s/build-dra.sh) per node
as a host process. Pods claim GPU memory through ResourceClaimTemplates; nvidia-smi in them
runs through the tenant's FUSE nodes from the CDI spec and the seccomp hand-over of the
plugin's Localhost profile.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from conftest import RunningBroker

REPO = Path(__file__).resolve().parent.parent
PLUGIN = REPO / ".cache" / "k8s" / "bin" / "devbroker-dra-plugin"
DEVBROKER = str(Path(sys.executable).parent / "devbroker")
DRIVER = "gpu.devbroker.io"
GiB = 1 << 30
TIMEOUT = 180
# How each node's pods reach their GPU (docs/containers.md): node-a the FUSE node files (the
# emulated backend's default), node-b character nodes whose every open, ioctl and mmap goes
# through the seccomp hand-over (what the real backend needs).
FRONTENDS = {"node-a": "fuse", "node-b": "seccomp"}

POLICY = """\
[broker]
backend = "emulated"

[[broker.gpu]]
name = "NVIDIA H200"
uuid = "GPU-5d1c0e7a-0b6e-4f43-9c1a-3a2b7e0d00{n:02d}"
pci_bus_id = "0000:00:{n:02x}.0"
memory = "32GiB"
"""

SMI = "nvidia-smi --query-gpu=name,memory.total --format=csv,noheader && exec sleep 3600"
# nvidia-smi again and again (NVML's whole sequence each time: opens, stats, ioctls), one
# line per run
SMI_LOOP = ("while true; do if nvidia-smi --query-gpu=memory.total --format=csv,noheader "
            ">/dev/null 2>&1; then echo ok; else echo FAIL; fi; sleep 0.2; done")

TEMPLATE = """\
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata:
  name: {name}
  namespace: {ns}
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
"""

POD = """\
apiVersion: v1
kind: Pod
metadata:
  name: {name}
  namespace: {ns}
spec:
  restartPolicy: Never
  terminationGracePeriodSeconds: 2
  {node_selector}
  resourceClaims:
  - name: gpu
    resourceClaimTemplateName: {template}
  containers:
  - name: smi
    image: localhost/devbroker/host:1
    imagePullPolicy: Never
    command: ["sh", "-c", {command}]
    securityContext:
      seccompProfile: {{type: Localhost, localhostProfile: devbroker.json}}
    resources:
      claims:
      - name: gpu
    volumeMounts:
    - {{name: usr, mountPath: /usr, readOnly: true}}
  volumes:
  - {{name: usr, hostPath: {{path: /usr}}}}
"""


class Plugin:
    """devbroker-dra-plugin for one node, as a host process."""

    def __init__(self, cluster, node: str, broker: RunningBroker, log: Path, frontend: str):
        n = cluster.nodes[node]
        self.node, self.cdi_dir = node, n.cdi_dir
        self.argv = [str(PLUGIN), "--run-dir", str(broker.run_dir), "--node-name", node,
                     "--cdi-dir", str(n.cdi_dir), "--kubeconfig", str(cluster.kubeconfig),
                     "--plugin-dir", str(n.plugins_dir / DRIVER),
                     "--registrar-dir", str(n.plugins_registry),
                     "--seccomp-dir", str(n.kubelet_root / "seccomp"),
                     "--devbroker", DEVBROKER, "--grace", "2s", "--frontend", frontend]
        self.log = log
        self.proc = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, stdout=open(self.log, "a"),
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()


class Dra:
    def __init__(self, cluster, tmp: Path):
        self.cluster = cluster
        self.ns = f"dra-{uuid.uuid4().hex[:6]}"
        self.brokers: dict[str, RunningBroker] = {}
        self.successors: list[int] = []  # brokers started by a live upgrade
        self.plugins: dict[str, Plugin] = {}
        for i, node in enumerate(sorted(cluster.nodes)):
            (tmp / f"{node}.toml").write_text(POLICY.format(n=6 + i))
            self.brokers[node] = RunningBroker(tmp / f"run-{node}", tmp / f"{node}.toml")
            self.plugins[node] = Plugin(cluster, node, self.brokers[node],
                                        tmp / f"plugin-{node}.log", FRONTENDS[node])
        self.kubectl("apply", "-f", str(REPO / "deploy" / "k8s" / "deviceclass.yaml"))
        self.kubectl("create", "namespace", self.ns)
        self.wait(lambda: len(self.slices()) == len(cluster.nodes), "a ResourceSlice per node")

    def kubectl(self, *args, **kw):
        return self.cluster.kubectl(*args, **kw)

    def json(self, *args) -> dict:
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def slices(self) -> list[dict]:
        return [s for s in self.json("resourceslices")["items"] if s["spec"]["driver"] == DRIVER]

    def wait(self, cond, what: str, timeout: float = TIMEOUT):
        deadline = time.monotonic() + timeout
        while True:
            got = cond()
            if got:
                return got
            if time.monotonic() > deadline:
                pytest.fail(f"timed out waiting for {what}\n{self.diagnose()}")
            time.sleep(1)

    def diagnose(self) -> str:
        out = self.kubectl("get", "pods,resourceclaims", "-n", self.ns, "-o", "wide",
                           check=False).stdout
        out += self.kubectl("get", "events", "-n", self.ns, check=False).stdout[-3000:]
        for node, p in self.plugins.items():
            out += f"\n--- plugin {node} (exit {p.proc.poll()}):\n" + p.log.read_text()[-3000:]
        return out

    def template(self, name: str, memory: str) -> None:
        self.kubectl("apply", "-f", "-", input=TEMPLATE.format(name=name, ns=self.ns,
                                                               memory=memory))

    def pod(self, name: str, template: str, node: str | None = None, command: str = SMI) -> None:
        sel = f"nodeSelector: {{kubernetes.io/hostname: {node}}}" if node else ""
        self.kubectl("apply", "-f", "-", input=POD.format(
            name=name, ns=self.ns, template=template, node_selector=sel,
            command=json.dumps(command)))

    def logs(self, name: str) -> list[str]:
        return self.kubectl("logs", "-n", self.ns, name, check=False).stdout.split()

    def get_pod(self, name: str) -> dict:
        return self.json("pod", name, "-n", self.ns)

    def smi(self, name: str) -> str:
        """The pod's nvidia-smi line, once it is running."""
        def line():
            p = self.get_pod(name)
            if p["status"].get("phase") not in ("Running", "Succeeded", "Failed"):
                return None
            out = self.kubectl("logs", "-n", self.ns, name, check=False).stdout.strip()
            return out or None
        return self.wait(line, f"pod {name}'s nvidia-smi")

    def pending_reason(self, name: str) -> str | None:
        p = self.get_pod(name)
        for c in p["status"].get("conditions", []):
            if c["type"] == "PodScheduled" and c["status"] == "False" and c.get("message"):
                return c["message"]
        return None

    def claim_of(self, pod: str) -> dict:
        st = self.get_pod(pod)["status"]["resourceClaimStatuses"]
        return self.json("resourceclaim", st[0]["resourceClaimName"], "-n", self.ns)

    def delete_pod(self, name: str) -> None:
        self.kubectl("delete", "pod", "-n", self.ns, name, "--wait=true", timeout=TIMEOUT)

    def tenants(self, node: str) -> dict[str, dict]:
        r = self.brokers[node].control({"op": "tenant.list"})
        assert r.get("ok"), r
        return {t["name"]: t for t in r["tenants"]}

    def close(self) -> None:
        self.kubectl("delete", "namespace", self.ns, "--wait=true", check=False, timeout=TIMEOUT)
        for p in self.plugins.values():
            p.stop()
        for pid in self.successors:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for b in self.brokers.values():
            b.stop()
            subprocess.run(["umount", "-l", str(b.run_dir / "nodes")], capture_output=True)


def test_go_unit_tests():
    """The plugin's own unit tests (k8s/dra/internal/...): a claim's allocation to a tenant
    spec, the published devices, the containers using a claim."""
    if shutil.which("go") is None:
        pytest.skip("no Go toolchain (scripts/k8s/build.sh needs one too)")
    r = subprocess.run(["go", "test", "./..."], cwd=REPO / "k8s" / "dra", capture_output=True,
                       text=True, timeout=900, env={**os.environ, "GOFLAGS": "-buildvcs=false"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ok  \tdevbroker.io/k8s/dra/internal/driver" in r.stdout, r.stdout


@pytest.fixture(scope="module")
def dra(k8s_cluster, tmp_path_factory):
    r = subprocess.run(["bash", str(REPO / "scripts" / "k8s" / "build-dra.sh")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    d = Dra(k8s_cluster, tmp_path_factory.mktemp("dra"))
    try:
        yield d
    finally:
        d.close()


@pytest.fixture(autouse=True)
def _no_pods_left(request):
    """Each test starts on empty GPUs: its pods are deleted after it (their claims
    unprepared, tenants removed)."""
    yield
    if "dra" in request.fixturenames:
        d = request.getfixturevalue("dra")
        d.kubectl("delete", "pods", "--all", "-n", d.ns, "--wait=true", timeout=TIMEOUT)


def _smi_total(line: str) -> str:
    return line.split(",")[-1].strip()


def test_slices_publish_each_nodes_gpu_with_consumable_memory(dra):
    by_node = {s["spec"]["nodeName"]: s for s in dra.slices()}
    assert sorted(by_node) == sorted(dra.cluster.nodes)
    for node, s in by_node.items():
        assert s["spec"]["pool"]["name"] == node
        (dev,) = s["spec"]["devices"]
        assert dev["name"] == "gpu-0" and dev["allowMultipleAllocations"] is True
        assert dev["attributes"]["productName"] == {"string": "NVIDIA H200"}
        assert dev["capacity"]["memory"]["value"] == "32Gi"
        assert dev["capacity"]["memory"]["requestPolicy"]["validRange"]["step"] == "1Mi"


def test_two_pods_share_a_gpu_and_a_third_waits_for_capacity(dra):
    """8 GiB and 16 GiB of node-a's 32 GiB GPU: each pod's nvidia-smi shows its claim as the
    total; a further 16 GiB pod stays Pending with the scheduler's reason until the 8 GiB pod
    is deleted, which returns its capacity (and removes its tenant and CDI spec)."""
    dra.template("gpu-8", "8Gi")
    dra.template("gpu-16", "16Gi")
    dra.pod("p8", "gpu-8", node="node-a")
    dra.pod("p16", "gpu-16", node="node-a")
    assert _smi_total(dra.smi("p8")) == "8192 MiB"
    assert _smi_total(dra.smi("p16")) == "16384 MiB"
    assert dra.smi("p8").startswith("NVIDIA H200")

    claim8 = dra.claim_of("p8")
    tenant8 = f"k8s-{claim8['metadata']['uid']}"
    (res,) = claim8["status"]["allocation"]["devices"]["results"]
    assert (res["pool"], res["device"], res["consumedCapacity"]["memory"]) == \
        ("node-a", "gpu-0", "8Gi")
    t = dra.tenants("node-a")[tenant8]
    assert t["source"] == "runtime" and t["spec"]["gpus"] == [0]
    assert t["labels"] == {"namespace": dra.ns, "pod": "p8", "claim": claim8["metadata"]["name"],
                           "container": "smi"}
    assert (dra.plugins["node-a"].cdi_dir / f"{DRIVER}-{tenant8}.json").exists()

    dra.pod("p16b", "gpu-16", node="node-a")
    reason = dra.wait(lambda: dra.pending_reason("p16b"), "p16b's scheduling failure")
    assert "cannot allocate all claims" in reason, reason
    assert dra.get_pod("p16b")["status"]["phase"] == "Pending"

    dra.delete_pod("p8")
    dra.wait(lambda: tenant8 not in dra.tenants("node-a"), "the deleted pod's tenant to go")
    assert not (dra.plugins["node-a"].cdi_dir / f"{DRIVER}-{tenant8}.json").exists()
    assert _smi_total(dra.smi("p16b")) == "16384 MiB"


def test_the_scheduler_places_by_remaining_capacity(dra):
    """node-a's GPU filled (16 + 16 GiB): a 24 GiB pod goes to node-b; a pod asking more
    than any GPU has stays Pending."""
    dra.template("gpu-24", "24Gi")
    dra.template("gpu-40", "40Gi")
    dra.template("gpu-16", "16Gi")
    for i in range(2):
        dra.pod(f"fill-{i}", "gpu-16", node="node-a")
        dra.smi(f"fill-{i}")
    dra.pod("p24", "gpu-24")
    assert _smi_total(dra.smi("p24")) == "24576 MiB"
    assert dra.get_pod("p24")["spec"]["nodeName"] == "node-b"
    dra.pod("p40", "gpu-40")
    reason = dra.wait(lambda: dra.pending_reason("p40"), "p40's scheduling failure")
    assert "cannot allocate all claims" in reason, reason


def test_a_restarted_plugin_loses_no_claim(dra):
    """Kill the plugin (SIGKILL) while pods run; restarted, it unprepares their claims
    (tenant and CDI spec gone) and prepares new ones: it keeps nothing the broker does not."""
    dra.template("gpu-2", "2Gi")
    dra.pod("r1", "gpu-2", node="node-b")
    dra.smi("r1")
    tenant = f"k8s-{dra.claim_of('r1')['metadata']['uid']}"
    plugin = dra.plugins["node-b"]
    plugin.kill()
    assert tenant in dra.tenants("node-b")
    plugin.start()
    dra.delete_pod("r1")
    dra.wait(lambda: tenant not in dra.tenants("node-b"), "r1's tenant to go")
    assert not (plugin.cdi_dir / f"{DRIVER}-{tenant}.json").exists()
    dra.pod("r2", "gpu-2", node="node-b")
    assert _smi_total(dra.smi("r2")) == "2048 MiB"


def test_a_live_upgrade_under_running_pods_fails_no_call(dra):
    """`devbroker upgrade` on node-b's broker while a pod runs nvidia-smi in a loop: no run
    fails, before, across or after it; the new broker keeps the claims' tenants and the
    plugin removes them through it. (node-b's pods use the seccomp front end: the broker
    refuses to upgrade while containers with FUSE nodes hold a stat shim, node-a's kind.)"""
    dra.template("gpu-1", "1Gi")
    dra.pod("loop", "gpu-1", node="node-b", command=SMI_LOOP)
    dra.wait(lambda: dra.logs("loop").count("ok") >= 3, "the loop's first runs")
    tenant = f"k8s-{dra.claim_of('loop')['metadata']['uid']}"
    broker = dra.brokers["node-b"]
    before = set(dra.tenants("node-b"))
    r = broker.cli("upgrade", "--json", timeout=200)
    assert r.returncode == 0, r.stderr
    new_pid = json.loads(r.stdout)["pid"]
    dra.successors.append(new_pid)
    assert broker.proc.wait(timeout=30) == 0 and broker.status()["pid"] == new_pid
    after_upgrade = len(dra.logs("loop"))
    dra.wait(lambda: dra.logs("loop")[after_upgrade:].count("ok") >= 10,
             "ten runs after the upgrade")
    lines = dra.logs("loop")
    assert "FAIL" not in lines, f"{lines.count('FAIL')} of {len(lines)} runs failed"
    assert set(dra.tenants("node-b")) == before and tenant in before
    dra.delete_pod("loop")
    dra.wait(lambda: tenant not in dra.tenants("node-b"), "the loop's tenant to go")


ESCAPE_POD = """\
apiVersion: v1
kind: Pod
metadata:
  name: {name}
  namespace: {ns}
spec:
  restartPolicy: Never
  terminationGracePeriodSeconds: 2
  nodeSelector: {{kubernetes.io/hostname: {node}}}
  resourceClaims:
  - {{name: victim, resourceClaimTemplateName: gpu-1}}
  - {{name: attacker, resourceClaimTemplateName: gpu-1}}
  containers:
  - name: victim
    image: localhost/devbroker/host:1
    imagePullPolicy: Never
    stdin: true       # the victim holds its client and memory until stdin closes
    command: ["python3", "-m", "devbroker.escape.tenant", "--victim", "{sock}"]
    env: [{{name: PYTHONPATH, value: /opt/devbroker/src}}]
    securityContext: &sc
      seccompProfile: {{type: Localhost, localhostProfile: devbroker.json}}
    resources: {{claims: [{{name: victim}}]}}
    volumeMounts: {mounts}
  - name: attacker
    image: localhost/devbroker/host:1
    imagePullPolicy: Never
    command: ["sh", "-c", "while [ ! -s /ctx/ctx.json ]; do sleep 0.2; done; DEVBROKER_ESCAPE_CTX=$(cat /ctx/ctx.json) exec python3 -m devbroker.escape.tenant {ids}"]
    env: [{{name: PYTHONPATH, value: /opt/devbroker/src}}]
    securityContext: *sc
    resources: {{claims: [{{name: attacker}}]}}
    volumeMounts: {mounts_ctx}
  volumes:
  - {{name: usr, hostPath: {{path: /usr}}}}
  - {{name: tree, hostPath: {{path: {tree}}}}}
  - {{name: ctx, hostPath: {{path: {ctx}}}}}
"""


@pytest.mark.parametrize("node", ["node-a", "node-b"])
def test_the_escape_harness_in_a_pod(dra, tmp_path, monkeypatch, node):
    """The escape harness's container attacks (those `devbroker escape-test --frontend
    runc-fuse|runc-seccomp` runs) from one container of a pod against another container's
    claim in the same pod (their own network namespace: the victim's fds are offered on an
    abstract socket): nothing escapes, every refusal as the runc run judges it. The
    containers keep containerd's default capabilities (CAP_MKNOD among them): the plugin's
    profile refuses device nodes."""
    from devbroker.escape import harness
    from devbroker.testing import tenant_tree

    base = FRONTENDS[node]
    run, _skip = harness._select(f"runc-{base}", None, gpus=1)
    ids = [a.id for a in run]
    ctx_dir = tmp_path / "ctx"
    ctx_dir.mkdir()
    mounts = ("[{name: usr, mountPath: /usr, readOnly: true}, "
              "{name: tree, mountPath: /opt/devbroker, readOnly: true}]")
    name = f"escape-{node}"
    dra.template("gpu-1", "1Gi")
    dra.kubectl("apply", "-f", "-", input=ESCAPE_POD.format(
        name=name, ns=dra.ns, node=node, sock=f"devbroker-escape-{uuid.uuid4().hex[:12]}",
        ids=" ".join(ids), tree=tenant_tree.ensure(), ctx=ctx_dir, mounts=mounts,
        mounts_ctx=mounts[:-1] + ", {name: ctx, mountPath: /ctx, readOnly: true}]"))

    def victim_line():
        out = dra.kubectl("logs", "-n", dra.ns, name, "-c", "victim", check=False).stdout
        return next((x for x in harness._lines(out) if x.get("what") == "victim"), None)
    vinfo = dra.wait(victim_line, "the victim's handles")
    claims = {s["name"]: s["resourceClaimName"]
              for s in dra.get_pod(name)["status"]["resourceClaimStatuses"]}
    tenant = {k: "k8s-" + dra.json("resourceclaim", v, "-n", dra.ns)["metadata"]["uid"]
              for k, v in claims.items()}
    procs = dra.tenants(node)[tenant["victim"]]
    broker = dra.brokers[node]
    host = next(t for t in broker.status()["tenants"] if t["name"] == tenant["victim"])
    vinfo.update(host_pid=host["processes"][0] if host["processes"] else None,
                 tenant=tenant["victim"])
    assert procs["processes"] >= 1
    # The node has one GPU, which both claims share: the attacks that need a GPU only the
    # victim has are left out (_select, gpus=1); "the victim's GPU" is GPU 1, a node neither
    # container has (/dev/nvidia1), and the victim's GPU id is that of the shared GPU.
    vinfo["gpu_ids"]["1"] = vinfo["gpu_ids"]["0"]
    ctx = {"frontend": base, "run_dir": str(broker.run_dir), "broker_pid": broker.status()["pid"],
           "own_gpu": 0, "victim_gpu": 1, "quota": GiB, "victim": vinfo}
    (ctx_dir / "ctx.json").write_text(json.dumps(ctx))

    def attacker_done():
        st = dra.get_pod(name)["status"].get("containerStatuses", [])
        return any(c["name"] == "attacker" and "terminated" in c["state"] for c in st)
    dra.wait(attacker_done, "the attacks", timeout=600)
    out = dra.kubectl("logs", "-n", dra.ns, name, "-c", "attacker").stdout
    results = {x["id"]: x for x in harness._lines(out) if "id" in x}
    audit = harness._read_audit(broker.run_dir / "audit.log")
    # the harness's deny records are looked for under its tenants' names
    monkeypatch.setattr(harness, "ATTACKER", tenant["attacker"])
    monkeypatch.setattr(harness, "VICTIM", tenant["victim"])
    rows = [harness.judge(a, results.get(a.id), audit) for a in run]
    table = "\n".join(f"{r.attack.id}: {r.verdict} {r.got} {r.detail[:160]}" for r in rows)
    assert rows and not [r for r in rows if r.verdict == "ESCAPED"], table
    assert not [r for r in rows if r.failed], table
    attached = {a.get("tenant") for a in audit if a.get("event") == "tenant-attached"
                and a.get("via") == "oci"}
    assert {tenant["victim"], tenant["attacker"]} <= attached
    dra.delete_pod(name)
