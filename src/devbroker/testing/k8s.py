"""A real two-node Kubernetes cluster on this machine, for tests (docs/kubernetes.md).

Nothing here is a stand-in: etcd, kube-apiserver, kube-controller-manager, kube-scheduler,
and per node one containerd (with runc and the CNI bridge plugin) and one kubelet, all built
by scripts/k8s/build.sh into .cache/k8s/bin. Each node lives in its own network namespace,
joined to a host bridge that carries the control plane's address:

    host:    bridge dbk<i> 10.233.<i>.1  etcd :2379/:2380, apiserver :6443, cm :10257,
                                         scheduler :10259 (all bound to that address)
    node-a:  netns dbk<i>-node-a, eth0 10.233.<i>.11, pods 10.234.<16i>.0/24 on its cni0
    node-b:  netns dbk<i>-node-b, eth0 10.233.<i>.12, pods 10.234.<16i+1>.0/24

<i> is an instance index claimed under /run/devbroker-k8s, so clusters of several checkouts
can run side by side. Everything else lives under the state directory:

    c = Cluster(Path("/tmp/dbk1234"))
    c.up()                                    # returns when both nodes are Ready
    c.kubectl("get", "nodes")
    c.down()                                  # nothing left: processes, mounts, netns, cgroups

`python -m devbroker.testing.k8s up|down|status [--state-dir DIR]` does the same from a
shell (scripts/k8s/cluster.sh). Only the standard library is used; must run as root.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
import shutil
import signal
import ssl
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Callable
from pathlib import Path

from devbroker.testing import k8s_config as cfg
from devbroker.testing.k8s_images import write_images

REPO = Path(__file__).resolve().parents[3]
DEFAULT_BIN = Path(os.environ.get("DEVBROKER_K8S_BIN", REPO / ".cache" / "k8s" / "bin"))
DEFAULT_STATE = REPO / ".cache" / "k8s" / "run"
CLAIMS = Path("/run/devbroker-k8s")
RUNC = os.environ.get("DEVBROKER_K8S_RUNC", "/usr/sbin/runc")
# Debian's CNI plugins; a machine without them (a GPU host) gets a carried copy
CNI_BIN = os.environ.get("DEVBROKER_K8S_CNI_BIN", "/usr/lib/cni")
# overlayfs unless the state directory's file system cannot be an overlay's upper layer
SNAPSHOTTER = os.environ.get("DEVBROKER_K8S_SNAPSHOTTER", "overlayfs")
CDI_SHARED_DIRS = ["/etc/cdi", "/var/run/cdi"]
NEEDED_BINARIES = ("kube", "etcd", "containerd", "containerd-shim-runc-v2", "ctr", "pause")


class ClusterError(RuntimeError):
    pass


def missing_prerequisites(bin_dir: Path = DEFAULT_BIN) -> list[str]:
    """What keeps a cluster from starting here (empty when it can start)."""
    out = []
    if os.geteuid() != 0:
        out.append("not root")
    out += [f"{bin_dir / b} (scripts/k8s/build.sh)" for b in NEEDED_BINARIES
            if not os.access(bin_dir / b, os.X_OK)]
    out += [p for p in (RUNC, f"{CNI_BIN}/bridge", f"{CNI_BIN}/host-local",
                        f"{CNI_BIN}/loopback") if not os.access(p, os.X_OK)]
    out += [t for t in ("ip", "nsenter", "unshare", "openssl", "mount") if not shutil.which(t)]
    return out


def _run(*argv: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=check, capture_output=True, text=True, **kw)


def _start_time(pid: int) -> str | None:
    """The process's start time in ticks: a pid plus this names one process, not a reuse."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] == "Z":   # exited; reap it if it is our child (the pytest process's daemons)
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        return None
    return fields[19]


@dataclass
class Daemon:
    name: str
    pid: int
    started: str   # _start_time at launch
    log: str

    def alive(self) -> bool:
        return _start_time(self.pid) == self.started

    def stop(self, grace: float = 10.0) -> None:
        if not self.alive():
            return
        os.kill(self.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        if self.alive():
            os.kill(self.pid, signal.SIGKILL)
            while self.alive():
                time.sleep(0.05)


@dataclass
class Cluster:
    state_dir: Path = DEFAULT_STATE
    bin_dir: Path = DEFAULT_BIN
    node_names: tuple[str, ...] = ("node-a", "node-b")
    log: Callable[[str], None] = lambda msg: print(f"k8s: {msg}", file=sys.stderr, flush=True)
    plan: cfg.ClusterPlan | None = None
    daemons: list[Daemon] = field(default_factory=list)
    images: list[Path] = field(default_factory=list)   # the image archives of this `up`

    def __post_init__(self) -> None:
        # absolute: the paths go into config files and the claim
        self.state_dir = Path(self.state_dir).resolve()
        self.bin_dir = Path(self.bin_dir).resolve()

    # ---- facts the tests use --------------------------------------------------------------

    @property
    def kubeconfig(self) -> Path:
        return self._plan().admin_kubeconfig

    @property
    def server(self) -> str:
        return self._plan().server

    @property
    def nodes(self) -> dict[str, cfg.NodePlan]:
        return {n.name: n for n in self._plan().nodes()}

    def kubectl(self, *args: str, check: bool = True, timeout: float = 120,
                input: str | None = None) -> subprocess.CompletedProcess:
        """Run kubectl (v1.37.2, the multi-call binary) as the cluster admin."""
        argv = [str(self.bin_dir / "kube"), "kubectl", f"--kubeconfig={self.kubeconfig}", *args]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, input=input)
        if check and r.returncode != 0:
            raise ClusterError(f"kubectl {' '.join(args)}: exit {r.returncode}: "
                               f"{r.stderr.strip()}")
        return r

    def ctr(self, node: str, *args: str) -> subprocess.CompletedProcess:
        n = self.nodes[node]
        return _run(str(self.bin_dir / "ctr"), "--address", str(n.containerd_socket),
                    "-n", "k8s.io", *args)

    def _plan(self) -> cfg.ClusterPlan:
        if self.plan is None:
            self._load()
        if self.plan is None:
            raise ClusterError(f"no cluster in {self.state_dir}")
        return self.plan

    # ---- state on disk (so `down` works from another process) -----------------------------

    def _state_file(self) -> Path:
        return self.state_dir / "cluster.json"

    def _save(self) -> None:
        assert self.plan is not None
        self._state_file().write_text(json.dumps({
            "instance": self.plan.instance,
            "nodes": list(self.plan.node_names),
            "bin_dir": str(self.bin_dir),
            "daemons": [d.__dict__ for d in self.daemons],
        }, indent=1))

    def _load(self) -> bool:
        try:
            st = json.loads(self._state_file().read_text())
        except (OSError, ValueError):
            return False
        self.plan = cfg.ClusterPlan(st["instance"], self.state_dir, tuple(st["nodes"]))
        self.node_names = self.plan.node_names
        self.bin_dir = Path(st["bin_dir"])
        self.daemons = [Daemon(**d) for d in st["daemons"]]
        return True

    # ---- instance claim ------------------------------------------------------------------

    def _claim_instance(self) -> int:
        CLAIMS.mkdir(parents=True, exist_ok=True)
        me = str(self.state_dir.resolve())
        for i in range(cfg.MAX_INSTANCES):
            claim = CLAIMS / f"{i}.claim"
            try:
                fd = os.open(claim, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                owner = claim.read_text().strip()
                if owner == me or not _claim_live(owner, i):
                    claim.write_text(me + "\n")   # ours already, or its cluster is gone
                    return i
                continue
            with os.fdopen(fd, "w") as f:
                f.write(me + "\n")
            return i
        raise ClusterError(f"all {cfg.MAX_INSTANCES} cluster instances are in use "
                           f"({CLAIMS})")

    # ---- up ------------------------------------------------------------------------------

    def up(self, timeout: float = 300) -> None:
        missing = missing_prerequisites(self.bin_dir)
        if missing:
            raise ClusterError("cannot start a cluster: missing " + ", ".join(missing))
        names, bin_dir = self.node_names, self.bin_dir
        if self._load() and any(d.alive() for d in self.daemons):
            raise ClusterError(f"a cluster already runs from {self.state_dir}: down first")
        self.node_names, self.bin_dir = names, bin_dir   # not a stale state file's
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.plan = cfg.ClusterPlan(self._claim_instance(), self.state_dir, self.node_names)
        self.daemons = []
        t0 = time.monotonic()
        try:
            self._cleanup_leftovers()
            self._save()
            self._make_files()
            self._make_network()
            self._share_state_dir()
            self._start_control_plane(timeout)
            for n in self._plan().nodes():
                self._start_node(n, timeout)
            self._wait_nodes_ready(timeout)
            # Pods are refused until the service-account controller has made "default".
            self._wait("the default service account",
                       lambda: self.kubectl("get", "serviceaccount", "default",
                                            check=False).returncode == 0, timeout)
        except BaseException:
            self.log(f"up failed; logs in {self.state_dir}; tearing down")
            self.down()
            raise
        self.log(f"up in {time.monotonic() - t0:.0f}s: {self.server}, "
                 f"kubeconfig {self.kubeconfig}")

    def _spawn(self, name: str, argv: list[str], env: dict | None = None) -> Daemon:
        logf = self.state_dir / "logs" / f"{name}.log"
        logf.parent.mkdir(parents=True, exist_ok=True)
        with open(logf, "ab") as out:
            p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                 start_new_session=True, env=env or _base_env(self.bin_dir))
        started = _start_time(p.pid)
        d = Daemon(name, p.pid, started or "", str(logf))
        self.daemons.append(d)
        self._save()
        # the Popen object is dropped: the daemon outlives this process under `cluster.sh up`
        p.returncode = 0
        return d

    def _wait(self, what: str, ready, timeout: float, daemon: Daemon | None = None) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready():
                return
            if daemon is not None and not daemon.alive():
                raise ClusterError(f"{daemon.name} exited while waiting for {what}: "
                                   f"{_tail(daemon.log)}")
            time.sleep(0.5)
        raise ClusterError(f"timed out after {timeout:.0f}s waiting for {what}"
                           + (f": {_tail(daemon.log)}" if daemon else ""))

    def _make_files(self) -> None:
        plan = self._plan()
        pki = plan.pki
        pki.mkdir(parents=True, exist_ok=True)
        _make_pki(pki, plan.host_ip)
        tokens = {"admin": (secrets.token_hex(16), "system:masters"),
                  "system:kube-controller-manager": (secrets.token_hex(16), ""),
                  "system:kube-scheduler": (secrets.token_hex(16), "")}
        for n in plan.nodes():
            tokens[f"system:node:{n.name}"] = (secrets.token_hex(16), "system:nodes")
        (pki / "tokens.csv").write_text(cfg.token_file(tokens))
        os.chmod(pki / "tokens.csv", 0o600)
        ca = pki / "ca.crt"

        def kc(path: Path, user: str) -> None:
            path.write_text(cfg.kubeconfig(plan.server, ca, user, tokens[user][0]))
            os.chmod(path, 0o600)
        kc(plan.admin_kubeconfig, "admin")
        kc(self.state_dir / "controller-manager.kubeconfig", "system:kube-controller-manager")
        kc(self.state_dir / "scheduler.kubeconfig", "system:kube-scheduler")
        images = write_images(self.state_dir / "images", self.bin_dir / "pause",
                              cfg.PAUSE_IMAGE, cfg.HOST_IMAGE)
        for n in plan.nodes():
            for d in (n.state_dir, n.run_dir, n.kubelet_root, n.cdi_dir, n.state_dir / "cni",
                      n.state_dir / "sysctl"):
                d.mkdir(parents=True, exist_ok=True)
            kc(n.kubeconfig, f"system:node:{n.name}")
            (n.state_dir / "cni" / "10-dbk.conflist").write_text(cfg.cni_conflist(n))
            (n.state_dir / "containerd.toml").write_text(cfg.containerd_config(
                n, RUNC, CNI_BIN, [str(n.cdi_dir), *CDI_SHARED_DIRS], SNAPSHOTTER))
            (n.state_dir / "kubelet.json").write_text(cfg.kubelet_config(n, ca))
            for key, value in cfg.KUBELET_SYSCTLS.items():
                (n.state_dir / "sysctl" / key.replace("/", ".")).write_text(f"{value}\n")
        self.images = images

    def _make_network(self) -> None:
        plan = self._plan()
        _run("ip", "link", "add", plan.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{plan.host_ip}/{plan.subnet_prefix}", "dev", plan.bridge)
        _run("ip", "link", "set", plan.bridge, "up")
        for n in plan.nodes():
            _run("ip", "netns", "add", n.netns)
            _run("ip", "link", "add", n.host_veth, "type", "veth", "peer", "name", "eth0",
                 "netns", n.netns)
            _run("ip", "link", "set", n.host_veth, "master", plan.bridge, "up")
            _run("ip", "-n", n.netns, "addr", "add", f"{n.ip}/{plan.subnet_prefix}",
                 "dev", "eth0")
            _run("ip", "-n", n.netns, "link", "set", "lo", "up")
            _run("ip", "-n", n.netns, "link", "set", "eth0", "up")
            _run("ip", "-n", n.netns, "route", "add", "default", "via", plan.host_ip)
            _make_cgroups(n.cgroup_root)

    def _share_state_dir(self) -> None:
        """Make the state dir a shared mount so the kubelet's volume mounts, made in its own
        mount namespace (where the sysctls read as it wants), reach containerd's."""
        s = str(self.state_dir.resolve())
        _run("mount", "--bind", s, s)
        _run("mount", "--make-shared", s)

    def _start_control_plane(self, timeout: float) -> None:
        plan = self._plan()
        pki, ip, kube = plan.pki, plan.host_ip, str(self.bin_dir / "kube")
        etcd = self._spawn("etcd", [
            str(self.bin_dir / "etcd"), "--name=default",
            f"--data-dir={self.state_dir / 'etcd'}",
            f"--listen-client-urls={plan.etcd_url}",
            f"--advertise-client-urls={plan.etcd_url}",
            f"--listen-peer-urls=http://{ip}:{cfg.ETCD_PEER_PORT}",
            f"--initial-advertise-peer-urls=http://{ip}:{cfg.ETCD_PEER_PORT}",
            f"--initial-cluster=default=http://{ip}:{cfg.ETCD_PEER_PORT}",
            "--unsafe-no-fsync",   # a test cluster's data need not survive a crash
            "--log-level=warn"])
        self._wait("etcd", lambda: _http_ok(f"{plan.etcd_url}/health"), timeout, etcd)
        self.log("etcd ready")
        apiserver = self._spawn("kube-apiserver", [
            kube, "kube-apiserver",
            f"--etcd-servers={plan.etcd_url}",
            f"--bind-address={ip}", f"--advertise-address={ip}",
            f"--secure-port={cfg.APISERVER_PORT}",
            f"--tls-cert-file={pki / 'apiserver.crt'}",
            f"--tls-private-key-file={pki / 'apiserver.key'}",
            f"--client-ca-file={pki / 'ca.crt'}",
            f"--token-auth-file={pki / 'tokens.csv'}",
            # Node,RBAC as kubeadm sets it: a DRA driver that needs a permission it would not
            # have in a real cluster fails here too.
            "--authorization-mode=Node,RBAC",
            "--enable-admission-plugins=NodeRestriction",
            "--allow-privileged=true",
            f"--service-cluster-ip-range={cfg.SERVICE_CIDR}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            f"--kubelet-client-certificate={pki / 'apiserver-kubelet-client.crt'}",
            f"--kubelet-client-key={pki / 'apiserver-kubelet-client.key'}",
            "--kubelet-preferred-address-types=InternalIP",
            "--profiling=false", "--v=1"])
        self._wait("kube-apiserver /readyz", lambda: self._api_ok("/readyz"), timeout,
                   apiserver)
        self.log("kube-apiserver ready")
        common = [f"--bind-address={ip}", "--leader-elect=false", "--profiling=false", "--v=1"]
        cmk = str(self.state_dir / "controller-manager.kubeconfig")
        self._spawn("kube-controller-manager", [
            kube, "kube-controller-manager", f"--kubeconfig={cmk}",
            f"--authentication-kubeconfig={cmk}", f"--authorization-kubeconfig={cmk}",
            f"--secure-port={cfg.CONTROLLER_MANAGER_PORT}",
            "--use-service-account-credentials=true",
            f"--service-account-private-key-file={pki / 'sa.key'}",
            f"--root-ca-file={pki / 'ca.crt'}",
            f"--cluster-signing-cert-file={pki / 'ca.crt'}",
            f"--cluster-signing-key-file={pki / 'ca.key'}",
            f"--flex-volume-plugin-dir={self.state_dir / 'volume-plugins'}",
            "--controllers=*", *common])
        sk = str(self.state_dir / "scheduler.kubeconfig")
        self._spawn("kube-scheduler", [
            kube, "kube-scheduler", f"--kubeconfig={sk}",
            f"--authentication-kubeconfig={sk}", f"--authorization-kubeconfig={sk}",
            f"--secure-port={cfg.SCHEDULER_PORT}", *common])

    def _api_ok(self, path: str) -> bool:
        token = _kubeconfig_token(self.kubeconfig)
        return _http_ok(f"{self.server}{path}", token=token, ca=self._plan().pki / "ca.crt")

    def _start_node(self, n: cfg.NodePlan, timeout: float) -> None:
        netns = f"/run/netns/{n.netns}"
        containerd = self._spawn(f"{n.name}-containerd", [
            "nsenter", f"--net={netns}", "--",
            str(self.bin_dir / "containerd"), f"--config={n.state_dir / 'containerd.toml'}"])
        self._wait(f"{n.name} containerd", lambda: self._ctr_ok(n), timeout, containerd)
        for image in self.images:
            r = _run(str(self.bin_dir / "ctr"), "--address", str(n.containerd_socket),
                     "-n", "k8s.io", "images", "import", "--platform", "linux/amd64",
                     str(image), check=False)
            if r.returncode != 0:
                raise ClusterError(f"{n.name}: ctr images import {image.name}: {r.stderr}")
        # The kubelet gets a mount namespace of its own whose /proc/sys files read as it wants
        # (see k8s_config.KUBELET_SYSCTLS), and where the two host paths it uses whatever its
        # --root-dir are the node's own: every kubelet would share them otherwise. The shared
        # state dir carries its volume mounts out to containerd.
        binds = [(n.state_dir / "sysctl" / k.replace("/", "."), f"/proc/sys/{k}")
                 for k in cfg.KUBELET_SYSCTLS]
        for src, dst in cfg.KUBELET_FIXED_DIRS.items():
            (n.state_dir / src).mkdir(parents=True, exist_ok=True)
            Path(dst).mkdir(parents=True, exist_ok=True)   # the mount point, left empty
            binds.append((n.state_dir / src, dst))
        script = "".join(f"mount --bind {shlex.quote(str(a))} {shlex.quote(str(b))} && "
                         for a, b in binds)
        script += 'exec "$0" "$@"'
        self._spawn(f"{n.name}-kubelet", [
            "nsenter", f"--net={netns}", "--",
            "unshare", "--mount", "--propagation", "unchanged", "--",
            "/bin/sh", "-c", script,
            str(self.bin_dir / "kube"), "kubelet",
            f"--config={n.state_dir / 'kubelet.json'}",
            f"--kubeconfig={n.kubeconfig}",
            f"--root-dir={n.kubelet_root}",
            f"--cert-dir={n.kubelet_root / 'pki'}",
            f"--hostname-override={n.name}",
            f"--node-ip={n.ip}",
            "--v=1"])
        self.log(f"{n.name}: containerd and kubelet started")

    def _ctr_ok(self, n: cfg.NodePlan) -> bool:
        if not n.containerd_socket.exists():
            return False
        r = _run(str(self.bin_dir / "ctr"), "--address", str(n.containerd_socket),
                 "version", check=False)
        return r.returncode == 0

    def _wait_nodes_ready(self, timeout: float) -> None:
        def ready() -> bool:
            r = self.kubectl("get", "nodes", "-o", "json", check=False)
            if r.returncode != 0:
                return False
            ok = set()
            for item in json.loads(r.stdout)["items"]:
                for c in item["status"].get("conditions", []):
                    if c["type"] == "Ready" and c["status"] == "True":
                        ok.add(item["metadata"]["name"])
            return ok >= set(self.node_names)
        kubelets = [d for d in self.daemons if d.name.endswith("-kubelet")]
        deadline = time.monotonic() + timeout
        while not ready():
            for d in self.daemons:
                if not d.alive():
                    raise ClusterError(f"{d.name} exited: {_tail(d.log)}")
            if time.monotonic() > deadline:
                raise ClusterError("nodes not Ready in time: "
                                   + self.kubectl("get", "nodes", check=False).stdout
                                   + "".join(_tail(d.log) for d in kubelets))
            time.sleep(1)
        self.log("nodes Ready: " + ", ".join(self.node_names))

    # ---- down ----------------------------------------------------------------------------

    def down(self) -> None:
        """Stop everything this state dir started and remove what it made; idempotent."""
        if self.plan is None and not self._load():
            return
        plan = self._plan()
        for d in reversed(self.daemons):
            if d.name.endswith("-kubelet"):
                d.stop()
        for n in plan.nodes():
            _kill_cgroup_tree(n.cgroup_root)
            _kill_shims(n.containerd_socket)
        for d in reversed(self.daemons):
            d.stop()
        self._cleanup_leftovers()
        claim = CLAIMS / f"{plan.instance}.claim"
        try:
            if claim.read_text().strip() == str(self.state_dir.resolve()):
                claim.unlink()
        except OSError:
            pass
        try:
            self._state_file().unlink()
        except OSError:
            pass

    def _cleanup_leftovers(self) -> None:
        """Remove mounts, network and cgroups of this instance, whoever left them."""
        plan = self._plan()
        for n in plan.nodes():
            _kill_cgroup_tree(n.cgroup_root)
            _kill_shims(n.containerd_socket)
        for root in (str(self.state_dir.resolve()), str(plan.run_dir)):
            _unmount_under(root)
        for n in plan.nodes():
            _run("ip", "netns", "del", n.netns, check=False)
            _run("ip", "link", "del", n.host_veth, check=False)
            _remove_cgroups(n.cgroup_root)
        _run("ip", "link", "del", plan.bridge, check=False)
        shutil.rmtree(plan.run_dir, ignore_errors=True)

    def leftovers(self) -> list[str]:
        """What this cluster left behind after `down` (empty when nothing)."""
        plan, state_dir = self._plan(), self.state_dir
        out = []
        netns = _run("ip", "netns", "list", check=False).stdout.split()
        links = _run("ip", "-o", "link", "show", check=False).stdout
        for n in plan.nodes():
            if n.netns in netns:
                out.append(f"netns {n.netns}")
            if f" {n.host_veth}@" in links or f" {n.host_veth}:" in links:
                out.append(f"link {n.host_veth}")
            out += [f"cgroup {d}" for d in _cgroup_dirs(n.cgroup_root)]
            out += [f"shim pid {pid}" for pid in _shims(n.containerd_socket)]
        if f" {plan.bridge}:" in links:
            out.append(f"bridge {plan.bridge}")
        out += [f"mount {mp}" for mp in _mounts_under(str(state_dir.resolve()))
                + _mounts_under(str(plan.run_dir))]
        out += [f"process {d.name} pid {d.pid}" for d in self.daemons if d.alive()]
        return out

    def status(self) -> str:
        if not self._load():
            return f"no cluster in {self.state_dir}"
        lines = [f"instance {self._plan().instance}: {self.server} "
                 f"(kubeconfig {self.kubeconfig})"]
        lines += [f"  {d.name:28} pid {d.pid:7} {'running' if d.alive() else 'DEAD'}"
                  for d in self.daemons]
        r = self.kubectl("get", "nodes", "-o", "wide", check=False)
        lines.append(r.stdout.rstrip() or r.stderr.rstrip())
        return "\n".join(lines)


# ---- helpers -------------------------------------------------------------------------------

def _base_env(bin_dir: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBECONFIG", "GO"))}
    # containerd finds its shim on PATH
    env["PATH"] = f"{bin_dir}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    return env


def _tail(path: str, lines: int = 15) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:]) + "\n"
    except OSError:
        return ""


def _claim_live(owner: str, instance: int) -> bool:
    try:
        st = json.loads((Path(owner) / "cluster.json").read_text())
    except (OSError, ValueError):
        return False
    return st.get("instance") == instance and any(
        _start_time(d["pid"]) == d["started"] for d in st.get("daemons", []))


def _http_ok(url: str, token: str | None = None, ca: Path | None = None) -> bool:
    req = urllib.request.Request(url)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    ctx = ssl.create_default_context(cafile=str(ca)) if ca else None
    try:
        with urllib.request.urlopen(req, timeout=5, context=ctx) as r:
            return r.status == 200
    except (OSError, ValueError):
        return False


def _kubeconfig_token(path: Path) -> str:
    return json.loads(path.read_text())["users"][0]["user"]["token"]


def _openssl(*args: str) -> None:
    _run("openssl", *args)


def _make_pki(pki: Path, host_ip: str) -> None:
    """A CA, the apiserver's serving cert, its client cert for kubelets, the SA key pair."""
    if (pki / "sa.pub").exists():
        return
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", str(pki / "ca.key"), "-out", str(pki / "ca.crt"),
             "-days", "3650", "-subj", "/CN=devbroker-test-ca")

    def cert(name: str, subj: str, ext: str) -> None:
        key, csr, crt = (str(pki / f"{name}.{s}") for s in ("key", "csr", "crt"))
        extf = pki / f"{name}.ext"
        extf.write_text(ext)
        _openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                 "-nodes", "-keyout", key, "-out", csr, "-subj", subj)
        _openssl("x509", "-req", "-in", csr, "-CA", str(pki / "ca.crt"),
                 "-CAkey", str(pki / "ca.key"), "-CAcreateserial", "-days", "3650",
                 "-out", crt, "-extfile", str(extf))
    cert("apiserver", "/CN=kube-apiserver",
         "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\n"
         "extendedKeyUsage=serverAuth\n"
         f"subjectAltName=IP:{host_ip},IP:127.0.0.1,IP:{cfg.SERVICE_IP},DNS:localhost,"
         "DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,"
         "DNS:kubernetes.default.svc.cluster.local\n")
    cert("apiserver-kubelet-client", "/O=system:masters/CN=kube-apiserver-kubelet-client",
         "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\n"
         "extendedKeyUsage=clientAuth\n")
    _openssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048",
             "-out", str(pki / "sa.key"))
    _openssl("pkey", "-in", str(pki / "sa.key"), "-pubout", "-out", str(pki / "sa.pub"))


def _cgroup_hierarchies() -> list[Path]:
    """Mount points of the v1 hierarchies and of the cgroup2 one (hybrid: .../unified)."""
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        pre, _, post = line.partition(" - ")
        fstype = post.split()[0]
        if fstype in ("cgroup", "cgroup2"):
            out.append(Path(pre.split()[4]))
    return out


def _make_cgroups(root: str) -> None:
    """The node's cgroup root in every hierarchy (the kubelet refuses a missing one)."""
    for h in _cgroup_hierarchies():
        d = h / root.lstrip("/")
        d.mkdir(exist_ok=True)
        if (h / "cpuset.cpus").exists():   # a v1 cpuset starts empty: no task could join
            for f in ("cpuset.cpus", "cpuset.mems"):
                (d / f).write_text((h / f).read_text())


def _cgroup_dirs(root: str) -> list[Path]:
    """Every cgroup under root in every hierarchy, deepest first."""
    dirs = []
    for h in _cgroup_hierarchies():
        top = h / root.lstrip("/")
        if top.is_dir():
            dirs += [Path(p) for p, _, _ in os.walk(top)]
    return sorted(dirs, key=lambda p: len(p.parts), reverse=True)


def _kill_cgroup_tree(root: str) -> None:
    """SIGKILL every process in the node's cgroups (its pods' containers)."""
    for _ in range(50):
        pids = set()
        for d in _cgroup_dirs(root):
            try:
                pids |= {int(p) for p in (d / "cgroup.procs").read_text().split()}
            except OSError:
                pass
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


def _remove_cgroups(root: str) -> None:
    for d in _cgroup_dirs(root):
        try:
            d.rmdir()
        except OSError:
            pass


def _shims(socket: Path) -> list[int]:
    """The shim processes that serve this node's containerd socket."""
    needle = str(socket).encode()
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            argv = (p / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"containerd-shim-runc-v2") and needle in argv:
            out.append(int(p.name))
    return out


def _kill_shims(socket: Path) -> None:
    """containerd's shims outlive containerd: kill those that serve this node's socket."""
    for pid in _shims(socket):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _mounts_under(root: str) -> list[str]:
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        mp = line.split()[4].replace("\\040", " ")
        if mp == root or mp.startswith(root.rstrip("/") + "/"):
            points.append(mp)
    return points


def _unmount_under(root: str) -> None:
    """Unmount everything at or below root, deepest first (lazy: a busy one goes too)."""
    for _ in range(5):
        points = _mounts_under(root)
        if not points:
            return
        for mp in sorted(points, key=len, reverse=True):
            _run("umount", "-l", mp, check=False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m devbroker.testing.k8s",
                                 description="the test cluster (docs/kubernetes.md)")
    ap.add_argument("command", choices=("up", "down", "status"))
    ap.add_argument("--state-dir", type=Path, default=DEFAULT_STATE)
    ap.add_argument("--bin-dir", type=Path, default=DEFAULT_BIN)
    ap.add_argument("--timeout", type=float, default=300)
    a = ap.parse_args(argv)
    c = Cluster(state_dir=a.state_dir, bin_dir=a.bin_dir)
    try:
        if a.command == "up":
            c.up(timeout=a.timeout)
            print(f"export KUBECONFIG={c.kubeconfig}")
            print(f"alias kubectl='{c.bin_dir / 'kubectl'}'")
        elif a.command == "down":
            c.down()
        else:
            print(c.status())
    except ClusterError as e:
        print(f"k8s: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
