"""The test cluster itself (devbroker.testing.k8s): real etcd, apiserver, scheduler,
controller-manager, and two nodes of containerd + runc + kubelet, each in its own network
namespace. A pod scheduled to each node must run there, get an address from that node's pod
range and its service-account token volume, and its output must come back through the
apiserver from that node's kubelet (kubectl logs)."""
from __future__ import annotations

import ipaddress
import json
import shutil
import time

import pytest

from devbroker.testing import k8s_config

pytestmark = pytest.mark.root


def pod_manifest(name: str, node: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"test": "k8s-cluster"}},
        "spec": {
            "restartPolicy": "Never",
            # the scheduler places it: a node selector, not spec.nodeName
            "nodeSelector": {"kubernetes.io/hostname": node},
            "terminationGracePeriodSeconds": 1,
            "containers": [{
                "name": "main",
                "image": k8s_config.HOST_IMAGE,
                "imagePullPolicy": "Never",
                "command": ["/bin/sh", "-c",
                            'echo "hello from $NODE_NAME"; '
                            "ls /var/run/secrets/kubernetes.io/serviceaccount; "
                            "python3 -c 'import sys; print(\"python\", sys.version_info[0])'"],
                "env": [{"name": "NODE_NAME",
                         "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}],
                "volumeMounts": [{"name": "usr", "mountPath": "/usr", "readOnly": True}],
            }],
            "volumes": [{"name": "usr", "hostPath": {"path": "/usr", "type": "Directory"}}],
        },
    }


def wait_phase(cluster, name: str, phases: set[str], timeout: float = 180) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        pod = json.loads(cluster.kubectl("get", "pod", name, "-o", "json").stdout)
        if pod["status"].get("phase") in phases:
            return pod
        if time.monotonic() > deadline:
            events = cluster.kubectl("get", "events", "-o", "wide", check=False).stdout
            raise AssertionError(f"pod {name} stuck in {pod['status']}\n{events}")
        time.sleep(1)


def test_both_nodes_ready(k8s_cluster):
    nodes = json.loads(k8s_cluster.kubectl("get", "nodes", "-o", "json").stdout)["items"]
    by_name = {n["metadata"]["name"]: n for n in nodes}
    assert set(by_name) == {"node-a", "node-b"}
    for name, node in by_name.items():
        ready = [c for c in node["status"]["conditions"] if c["type"] == "Ready"]
        assert ready and ready[0]["status"] == "True", (name, node["status"]["conditions"])
        addrs = {a["type"]: a["address"] for a in node["status"]["addresses"]}
        assert addrs["InternalIP"] == k8s_cluster.nodes[name].ip
        assert node["status"]["nodeInfo"]["kubeletVersion"] == "v1.37.2"
        assert node["status"]["nodeInfo"]["containerRuntimeVersion"].startswith(
            "containerd://2.4.2")
    # The check the fixture's teardown makes (nothing left after down) sees a live cluster.
    kinds = {what.split()[0] for what in k8s_cluster.leftovers()}
    assert {"netns", "link", "bridge", "cgroup", "mount", "process"} <= kinds


def test_a_pod_runs_on_each_node(k8s_cluster):
    names = {node: f"hello-{node}" for node in ("node-a", "node-b")}
    for node, name in names.items():
        k8s_cluster.kubectl("apply", "-f", "-", input=json.dumps(pod_manifest(name, node)))
    try:
        for node, name in names.items():
            pod = wait_phase(k8s_cluster, name, {"Succeeded", "Failed"})
            logs = k8s_cluster.kubectl("logs", name).stdout
            assert pod["status"]["phase"] == "Succeeded", (pod["status"], logs)
            assert pod["spec"]["nodeName"] == node
            assert f"hello from {node}\n" in logs
            assert "token\n" in logs            # the projected service-account volume
            assert "python 3\n" in logs         # the host's /usr, mounted read-only
            pod_ip = ipaddress.ip_address(pod["status"]["podIP"])
            assert pod_ip in ipaddress.ip_network(k8s_cluster.nodes[node].pod_cidr)
    finally:
        k8s_cluster.kubectl("delete", "pod", "-l", "test=k8s-cluster", "--wait=true",
                            "--timeout=120s")
    left = k8s_cluster.kubectl("get", "pods", "-l", "test=k8s-cluster", "-o", "name").stdout
    assert left.strip() == ""


def test_exec_in_a_running_pod(k8s_cluster):
    """kubectl exec goes apiserver -> the node's kubelet -> its containerd's stream server,
    and the container lives under that node's own cgroup root."""
    pod = pod_manifest("sleeper", "node-b")
    pod["spec"]["containers"][0]["command"] = ["/bin/sh", "-c", "sleep 600"]
    k8s_cluster.kubectl("apply", "-f", "-", input=json.dumps(pod))
    try:
        wait_phase(k8s_cluster, "sleeper", {"Running"})
        out = k8s_cluster.kubectl("exec", "sleeper", "--", "/bin/sh", "-c",
                                  "echo exec-ok; grep memory /proc/self/cgroup").stdout
        assert out.startswith("exec-ok\n"), out
        root = k8s_cluster.nodes["node-b"].cgroup_root
        assert f":memory:{root}/kubepods/besteffort/pod" in out, out
    finally:
        k8s_cluster.kubectl("delete", "pod", "sleeper", "--wait=true", "--timeout=120s")


@pytest.mark.nvidia
def test_host_tools_pod_loads_nvml(k8s_cluster):
    """The host-tools image runs Debian's nvidia-smi from the host's /usr: it finds
    libnvidia-ml.so.1 through the image's /etc/alternatives links and gets as far as NVML's
    init, which fails: the pod has no device node (a DRA driver's claim gives one)."""
    if shutil.which("nvidia-smi") is None:
        pytest.skip("nvidia-smi is not installed (scripts/install-nvidia-clients.sh)")
    pod = pod_manifest("nvml", "node-b")
    pod["spec"]["containers"][0]["command"] = ["/bin/sh", "-c", "nvidia-smi; echo rc=$?"]
    k8s_cluster.kubectl("apply", "-f", "-", input=json.dumps(pod))
    try:
        wait_phase(k8s_cluster, "nvml", {"Succeeded", "Failed"})
        logs = k8s_cluster.kubectl("logs", "nvml").stdout
        # Both are NVML's own answers (nvmlInit failed), so the library was loaded; without
        # it nvidia-smi says it "couldn't find libnvidia-ml.so", without the alternatives
        # links the shell finds no nvidia-smi (rc=127).
        assert ("Failed to initialize NVML" in logs
                or "couldn't communicate with the NVIDIA driver" in logs), logs
        assert "rc=127" not in logs and "rc=0\n" not in logs, logs
    finally:
        k8s_cluster.kubectl("delete", "pod", "nvml", "--wait=true", "--timeout=120s")


def test_dra_api_and_claim_controller(k8s_cluster):
    """What a DRA driver builds on, with no driver yet: resource.k8s.io/v1 is served, the
    apiserver has consumable capacity on, and the controller manager's resource-claim
    controller makes a pod's ResourceClaim from its template (the pod then waits: no driver
    publishes devices of that class)."""
    kinds = k8s_cluster.kubectl("api-resources", "--api-group=resource.k8s.io",
                                "-o", "name").stdout.split()
    assert {"resourceclaims.resource.k8s.io", "resourceclaimtemplates.resource.k8s.io",
            "resourceslices.resource.k8s.io", "deviceclasses.resource.k8s.io"} <= set(kinds)
    metrics = k8s_cluster.kubectl("get", "--raw", "/metrics").stdout
    assert 'kubernetes_feature_enabled{name="DRAConsumableCapacity",stage="BETA"} 1' in metrics

    template = {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
        "metadata": {"name": "one-thing", "labels": {"test": "k8s-cluster"}},
        "spec": {"spec": {"devices": {"requests": [
            {"name": "thing", "exactly": {"deviceClassName": "nothing.example.com"}}]}}},
    }
    pod = pod_manifest("claims", "node-a")
    pod["spec"]["resourceClaims"] = [{"name": "thing",
                                      "resourceClaimTemplateName": "one-thing"}]
    pod["spec"]["containers"][0]["resources"] = {"claims": [{"name": "thing"}]}
    k8s_cluster.kubectl("apply", "-f", "-", input=json.dumps(template))
    k8s_cluster.kubectl("apply", "-f", "-", input=json.dumps(pod))
    try:
        deadline = time.monotonic() + 120
        while True:
            got = json.loads(k8s_cluster.kubectl("get", "pod", "claims", "-o", "json").stdout)
            statuses = got["status"].get("resourceClaimStatuses") or []
            if statuses and statuses[0].get("resourceClaimName"):
                break
            assert time.monotonic() < deadline, got["status"]
            time.sleep(1)
        claim_name = statuses[0]["resourceClaimName"]
        claim = json.loads(k8s_cluster.kubectl("get", "resourceclaim", claim_name,
                                               "-o", "json").stdout)
        owner = claim["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["name"]) == ("Pod", "claims")
        assert claim["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] == \
            "nothing.example.com"
        assert got["status"]["phase"] == "Pending"   # nothing can allocate it
    finally:
        k8s_cluster.kubectl("delete", "pod,resourceclaimtemplate", "-l", "test=k8s-cluster",
                            "--wait=true", "--timeout=120s")
