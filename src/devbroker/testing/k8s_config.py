"""The test cluster's configuration files, as pure functions of its layout (no I/O here).

`testing/k8s.py` starts the processes; this module says what they are told: the network plan
of one cluster instance, containerd's config, the kubelet's config, the CNI network list and
the kubeconfigs. JSON is valid YAML, so the kubelet config and the kubeconfigs are JSON.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# The sandbox and test images: built locally and imported (no registry can be reached).
PAUSE_IMAGE = "localhost/devbroker/pause:1"
HOST_IMAGE = "localhost/devbroker/host:1"

# Up to this many clusters may run side by side on one machine (concurrent test runs); an
# instance index picks disjoint names, subnets and cgroups.
MAX_INSTANCES = 16
APISERVER_PORT = 6443
ETCD_CLIENT_PORT = 2379
ETCD_PEER_PORT = 2380
CONTROLLER_MANAGER_PORT = 10257
SCHEDULER_PORT = 10259
SERVICE_CIDR = "10.96.0.0/24"
SERVICE_IP = "10.96.0.1"

# What the kubelet insists these sysctls read (cm.setupKernelTunables); it rewrites the
# host's values otherwise, and panic_on_oops=1 on a shared development machine is not ours to
# set. The kubelet runs in a mount namespace where these files read as wanted.
KUBELET_SYSCTLS = {
    "vm/overcommit_memory": 1,
    "vm/panic_on_oom": 0,
    "kernel/panic": 10,
    "kernel/panic_on_oops": 1,
    "kernel/keys/root_maxkeys": 1000000,
    "kernel/keys/root_maxbytes": 25000000,
}

# Paths the kubelet uses whatever its --root-dir (constants in its source): the device
# plugins' socket dir and the /var/log/containers links. Each node's kubelet sees its own
# directory (under the node's state dir) there.
KUBELET_FIXED_DIRS = {
    "device-plugins": "/var/lib/kubelet/device-plugins",
    "container-logs": "/var/log/containers",
}


@dataclass(frozen=True)
class NodePlan:
    """One node's names and addresses within a cluster instance."""

    name: str
    index: int          # 0 for the first node
    instance: int
    state_dir: Path     # <cluster state>/<name>
    run_dir: Path       # short path for containerd's sockets (unix socket paths are <108)

    @property
    def netns(self) -> str:
        return f"dbk{self.instance}-{self.name}"

    @property
    def host_veth(self) -> str:
        return f"dbk{self.instance}n{self.index}"   # IFNAMSIZ: at most 15 characters

    @property
    def ip(self) -> str:
        return f"10.233.{self.instance}.{11 + self.index}"

    @property
    def pod_cidr(self) -> str:
        return f"10.234.{self.instance * 16 + self.index}.0/24"

    @property
    def cgroup_root(self) -> str:
        return f"/dbk{self.instance}-{self.name}"

    @property
    def kubelet_root(self) -> Path:
        return self.state_dir / "kubelet"

    @property
    def plugins_registry(self) -> Path:
        return self.kubelet_root / "plugins_registry"

    @property
    def plugins_dir(self) -> Path:
        return self.kubelet_root / "plugins"

    @property
    def cdi_dir(self) -> Path:
        return self.state_dir / "cdi"

    @property
    def containerd_socket(self) -> Path:
        return self.run_dir / "containerd.sock"

    @property
    def kubeconfig(self) -> Path:
        return self.state_dir / "kubelet.kubeconfig"


@dataclass(frozen=True)
class ClusterPlan:
    """Names and addresses of one cluster instance (index `instance`)."""

    instance: int
    state_dir: Path
    node_names: tuple[str, ...] = ("node-a", "node-b")

    @property
    def bridge(self) -> str:
        return f"dbk{self.instance}"

    @property
    def host_ip(self) -> str:
        return f"10.233.{self.instance}.1"

    @property
    def subnet_prefix(self) -> int:
        return 24

    @property
    def server(self) -> str:
        return f"https://{self.host_ip}:{APISERVER_PORT}"

    @property
    def etcd_url(self) -> str:
        return f"http://{self.host_ip}:{ETCD_CLIENT_PORT}"

    @property
    def run_dir(self) -> Path:
        return Path("/run/devbroker-k8s") / str(self.instance)

    @property
    def pki(self) -> Path:
        return self.state_dir / "pki"

    @property
    def admin_kubeconfig(self) -> Path:
        return self.state_dir / "admin.kubeconfig"

    def nodes(self) -> list[NodePlan]:
        return [NodePlan(name, i, self.instance, self.state_dir / name, self.run_dir / name)
                for i, name in enumerate(self.node_names)]


def kubeconfig(server: str, ca_file: Path, user: str, token: str) -> str:
    """A kubeconfig that authenticates with a static bearer token."""
    return json.dumps({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "devbroker-test",
                      "cluster": {"server": server, "certificate-authority": str(ca_file)}}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "default",
                      "context": {"cluster": "devbroker-test", "user": user}}],
        "current-context": "default",
    }, indent=1) + "\n"


def token_file(tokens: dict[str, tuple[str, str]]) -> str:
    """The apiserver's --token-auth-file: token,user,uid,"groups" per line."""
    return "".join(f'{tok},{user},{user},"{groups}"\n'
                   for user, (tok, groups) in sorted(tokens.items()))


def cni_conflist(node: NodePlan) -> str:
    """A bridge network inside the node's network namespace, one /24 of pod addresses per node.

    No portmap: it needs iptables, and the tests reach pods through the apiserver (logs,
    exec), not through host ports.
    """
    return json.dumps({
        "cniVersion": "1.0.0",
        "name": "dbk",
        "plugins": [{
            "type": "bridge",
            "bridge": "cni0",
            "isGateway": True,
            "ipMasq": False,
            "ipam": {
                "type": "host-local",
                "ranges": [[{"subnet": node.pod_cidr}]],
                # the default (/var/lib/cni/networks) is shared by every node on the host
                "dataDir": str(node.state_dir / "cni-ipam"),
            },
        }],
    }, indent=1) + "\n"


def containerd_config(node: NodePlan, runc: str, cni_bin_dir: str,
                      cdi_dirs: list[str], snapshotter: str = "overlayfs") -> str:
    """containerd 2.4 for one node: its own root, state and socket; CDI is always on.

    Config version 3: containerd 2.4 migrates it at start (a warning). Version 4 moved the
    [grpc] section into server plugins, and the socket would fall back to the default path.
    """
    root = node.state_dir / "containerd"
    q = json.dumps   # TOML basic strings and JSON strings agree for these paths
    return f"""version = 3
root = {q(str(root / "root"))}
state = {q(str(node.run_dir / "state"))}
temp = {q(str(root / "tmp"))}

[grpc]
  address = {q(str(node.containerd_socket))}

[ttrpc]
  address = ""

[debug]
  address = ""
  level = "info"

[metrics]
  address = ""

[plugins]
  [plugins.'io.containerd.internal.v1.opt']
    path = {q(str(root / "opt"))}
  [plugins.'io.containerd.nri.v1.nri']
    disable = true
  [plugins.'io.containerd.cri.v1.images']
    snapshotter = {q(snapshotter)}
    [plugins.'io.containerd.cri.v1.images'.pinned_images]
      sandbox = {q(PAUSE_IMAGE)}
  [plugins.'io.containerd.cri.v1.runtime']
    cdi_spec_dirs = {json.dumps(cdi_dirs)}
    netns_mounts_under_state_dir = true
    # This machine withholds CAP_SYS_RESOURCE even from root: no process may lower its
    # oom_score_adj, and the kubelet asks -998 for every pod sandbox. Capped at containerd's
    # own (0), as in rootless setups.
    restrict_oom_score_adj = true
    [plugins.'io.containerd.cri.v1.runtime'.containerd]
      default_runtime_name = "runc"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
        runtime_type = "io.containerd.runc.v2"
        [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
          BinaryName = {q(runc)}
          Root = {q(str(node.run_dir / "runc"))}
          SystemdCgroup = false
    [plugins.'io.containerd.cri.v1.runtime'.cni]
      bin_dirs = [{q(cni_bin_dir)}]
      conf_dir = {q(str(node.state_dir / "cni"))}
  [plugins.'io.containerd.grpc.v1.cri']
    disable_tcp_service = true
    stream_server_address = "127.0.0.1"
    stream_server_port = "0"
"""


def kubelet_config(node: NodePlan, ca_file: Path) -> str:
    """The kubelet's KubeletConfiguration: cgroupfs under its own cgroup root, no swap check.

    This machine has hybrid cgroups (v1 controllers, cgroup2 only at /sys/fs/cgroup/unified):
    failCgroupV1 defaults to true since 1.35 and must be off. Eviction thresholds are low:
    the disk and memory are shared with other work and a pressure taint would only make the
    tests flaky, not more real.
    """
    return json.dumps({
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": node.ip,
        "port": 10250,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": 10248,
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(ca_file)},
        },
        "authorization": {"mode": "Webhook"},
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": node.cgroup_root,
        "cgroupsPerQOS": True,
        "failSwapOn": False,
        # no CAP_SYS_RESOURCE here (see containerd_config): leave the kubelet at 0
        "oomScoreAdj": 0,
        "failCgroupV1": False,
        "containerRuntimeEndpoint": f"unix://{node.containerd_socket}",
        "podCIDR": node.pod_cidr,
        "podLogsDir": str(node.state_dir / "pod-logs"),
        "volumePluginDir": str(node.state_dir / "volume-plugins"),
        "resolvConf": "",
        "clusterDomain": "cluster.local",
        "maxPods": 20,
        "evictionHard": {"memory.available": "50Mi", "nodefs.available": "1%",
                         "imagefs.available": "1%", "nodefs.inodesFree": "1%"},
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "serializeImagePulls": False,
        "rotateCertificates": False,
        "serverTLSBootstrap": False,
        "registerNode": True,
        "nodeStatusReportFrequency": "10s",
        "syncFrequency": "10s",
        "fileCheckFrequency": "10s",
        "shutdownGracePeriod": "0s",
    }, indent=1) + "\n"
