"""A running broker: the assembled core (assemble.py) with its front end, control socket,
seccomp hand-over socket, OCI agent, metrics and alerts, for `devbroker run` and tests."""
from __future__ import annotations

import contextlib
import gc
import logging
import os
import shutil
import signal
import sys
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from devbroker import upgrade
from devbroker.assemble import FRONTENDS, assemble, node_frontend
from devbroker.assemble import make_backend  # noqa: F401  (its earlier home)
from devbroker.broker import preemption, procview
from devbroker.broker.alerts import AlertMonitor
from devbroker.broker.audit import AuditLog
from devbroker.broker.callstats import CallStats, InstrumentedBroker
from devbroker.broker.control import (
    ROLE_ADMIN, ControlError, ControlServer, Peer, RefusalPacer, peer_of, role_of,
)
from devbroker.broker.core import Broker
from devbroker.broker.record import Recorder
from devbroker.broker.tenancy import STATE_FILE, Tenancy
from devbroker.upgrade import sd_notify

log = logging.getLogger("devbroker")


@dataclass
class RunPaths:
    run_dir: Path

    @property
    def mount(self) -> Path:
        return self.run_dir / "nodes"

    @property
    def control(self) -> Path:
        return self.run_dir / "control.sock"

    @property
    def audit(self) -> Path:
        return self.run_dir / "audit.log"

    @property
    def seccomp(self) -> Path:
        """Where a sandbox (or a container runtime) hands over a tenant's seccomp listener."""
        return self.run_dir / "seccomp.sock"

    @property
    def oci_seccomp(self) -> Path:
        """Where container runtimes send a container's seccomp listener (OCI
        linux.seccomp.listenerPath; devbroker.oci.agent)."""
        return self.run_dir / "oci-seccomp.sock"

    def tenant_dir(self, tenant: str) -> Path:
        return self.mount / tenant


def tenant_tree(broker: Broker) -> dict[str, dict]:
    """What the front end shows: per tenant, its nodes and its /proc/driver/nvidia view."""
    backend = broker.backend
    host = procview.HOST_PROC if backend.host_proc else None
    tree = {}
    for name, t in broker.tenants.items():
        if t.revoked:
            continue
        tree[name] = {
            "gpus": list(t.gpus),
            "uvm": True,
            "proc": procview.tenant_view(backend.gpus(), t.gpus, backend.version, host=host),
        }
    return tree


def write_tenant_dirs(root: Path, tree: dict[str, dict]) -> None:
    """Each tenant's directory as plain files under `root`, for a broker without the FUSE
    front end (--frontend seccomp): the sandbox takes from it which nodes the tenant has
    (empty files; the seccomp front end makes them character nodes) and its
    /proc/driver/nvidia view. Rewritten whole on every policy change."""
    from devbroker.frontends.fusetree import TenantTree

    root.mkdir(parents=True, exist_ok=True)
    for name, spec in tree.items():
        view = TenantTree.from_dict(spec)
        new = root / f".{name}.new"
        shutil.rmtree(new, ignore_errors=True)
        for rel in view.nodes:
            (new / rel).parent.mkdir(parents=True, exist_ok=True)
            (new / rel).write_bytes(b"")
        for rel, content in view.files.items():
            data = content() if callable(content) else content
            (new / rel).parent.mkdir(parents=True, exist_ok=True)
            (new / rel).write_bytes(data.encode() if isinstance(data, str) else bytes(data))
        shutil.rmtree(root / name, ignore_errors=True)
        os.rename(new, root / name)
    for old in root.iterdir():
        if old.name not in tree:
            shutil.rmtree(old, ignore_errors=True)


class BrokerService:
    """The broker with its front end and control socket, for `devbroker run` and tests.

    ``frontend`` (assemble.FRONTENDS): "fuse" (default: per-tenant nodes under RUN_DIR/nodes),
    "seccomp" (no node file system: tenants only through the seccomp hand-over socket and
    the OCI agent), "kmod" or "cuse" (shared /dev nodes, tenants by uid). The seccomp
    hand-over socket and the OCI agent are served with every front end."""

    def __init__(self, policy: Any, run_dir: str | Path, *, backend: str | None = None,
                 audit_path: str | Path | None = None, record: str | Path | None = None,
                 policy_source: str | None = None, frontend: str = "fuse",
                 runtime_tenants: list | None = None):
        if frontend not in FRONTENDS:
            raise ValueError(f"unknown front end {frontend!r} ({', '.join(FRONTENDS)})")
        self.paths = RunPaths(Path(run_dir))
        self.policy_source = policy_source
        self.frontend_kind = frontend
        audit = AuditLog(audit_path or getattr(policy.broker, "audit_log", None)
                         or self.paths.audit)
        recorder = Recorder(record) if record else None
        built = assemble(policy, backend=backend, audit=audit, recorder=recorder,
                         private_dir=self.paths.run_dir / "private-nodes")
        self.audit, self.backend, self.broker = built.audit, built.backend, built.broker
        # Tenants added over the control socket (broker/tenancy.py): those a live upgrade
        # handed over (runtime_tenants), else those saved in the run dir.
        self.tenancy = Tenancy(
            self.broker, self.audit, policy, state_path=self.paths.run_dir / STATE_FILE,
            node_dir=lambda name: (str(self.paths.tenant_dir(name))
                                   if frontend in ("fuse", "seccomp") else None))
        self.tenancy.restore(runtime_tenants)
        # Observed at the boundaries, never inside the core: calls where the front ends
        # hand them over (InstrumentedBroker), refusals through the audit log.
        self.callstats = CallStats()
        self.alerts = AlertMonitor(self.audit)
        self.audit.observers += [self.callstats.note_refusal, self.alerts.observe]
        self.front = InstrumentedBroker(self.broker, self.callstats)
        self.metrics = None  # broker.metrics.MetricsEndpoint while [broker.metrics] is set
        self.started = 0.0
        self.frontend = None
        self.control: ControlServer | None = None
        # Live upgrade (upgrade.py, takeover.py): what a predecessor handed over (set before
        # serve()), whether an upgrade is under way, and whether this process handed over.
        self.adopted = None
        self.upgrading = False
        self.handed_over = False
        self.done = trio.Event()  # serve() returns when set
        self._seccomp_sock = None  # the listening socket of RUN_DIR/seccomp.sock
        self._handover_pacer = RefusalPacer()  # its refusal records, per uid
        self._seccomp_accepting: trio.CancelScope | None = None
        self._attaching = 0  # seccomp hand-overs accepted and not yet attached or refused
        self.oci_agent = None
        self.supervisors: set = set()  # seccomp supervisors of attached tenants
        self.stat_shims: set = set()  # stat shims of containers with FUSE nodes (oci/agent.py)

    # -- control socket handlers
    def _status(self, req: dict) -> dict:
        snap = self.broker.snapshot()
        snap["mount"] = str(self.paths.mount)
        snap["policy"] = self.policy_source or "built-in example"
        # Each seccomp listener (one per tenant process tree): what it answered and how.
        snap["seccomp"] = [{"tenant": sup.tenant, "threads": sup.live_threads,
                            "loop": getattr(sup, "listener_loop", "python"),
                            **dataclasses.asdict(sup.stats)}
                           for sup in list(self.supervisors)]
        snap["pid"] = os.getpid()
        snap["gc_frozen"] = gc.get_freeze_count()  # (run_forever: the startup's objects)
        snap["metrics"] = self.metrics.url if self.metrics is not None else None
        snap["alerts"] = [{"alert": a, "tenant": t, **({"gpu": int(g)} if g else {}), **v}
                          for (a, t, g), v in sorted(self.alerts.active.items())]
        return snap

    # -- the metrics endpoint
    def _metrics_snapshot(self) -> dict:
        from devbroker.broker.metrics import metrics_snapshot

        return metrics_snapshot(self.broker, self.callstats, self.alerts, self.audit,
                                started=self.started)

    def _configure_metrics(self, cfg, *, sock=None) -> None:
        """Start, move or stop the endpoint for the policy's [broker.metrics] (cfg, or None).
        Raises OSError when the new address cannot be bound; the old endpoint then stays."""
        from devbroker.broker.metrics import BrokerCollector, MetricsEndpoint

        want = (cfg.host, cfg.port) if cfg is not None else None
        have = self.metrics.address if self.metrics is not None else None
        if have is not None and want is not None and want[0] == have[0] and want[1] in (0, have[1]):
            return
        new = None
        if want is not None:
            token = trio.lowlevel.current_trio_token()
            collector = BrokerCollector(
                lambda: trio.from_thread.run_sync(self._metrics_snapshot, trio_token=token))
            new = MetricsEndpoint(collector)
            new.start(cfg.host, cfg.port, sock=sock)
        if self.metrics is not None:
            self.metrics.stop()
        self.metrics = new
        if new is not None:
            self.audit.write("metrics", listen=new.url)

    def _policy_show(self, req: dict) -> dict:
        # The file's policy: what `policy apply` takes back (runtime tenants: tenant.list).
        return {"source": self.policy_source or "built-in example",
                "text": self.tenancy.file_policy.to_toml(),
                "runtime_tenants": sorted(self.tenancy.runtime)}

    def _policy_apply(self, req: dict) -> dict:
        from devbroker.broker.policy import PolicyError, load_policy_text

        name = req.get("name") or "<policy>"
        if self.upgrading:
            raise ControlError("a live upgrade is under way: apply the policy to the new "
                               "broker once `devbroker upgrade` has returned")
        try:
            policy = load_policy_text(req.get("text", ""), name)
            try:
                self._configure_metrics(policy.broker.metrics)
            except OSError as e:
                raise ValueError(f"[broker.metrics] listen {policy.broker.metrics.listen}: "
                                 f"{e.strerror or e}") from None
            self.tenancy.apply_file_policy(policy)  # the runtime tenants kept
        except PolicyError as e:
            self.audit.write("policy-refused", source=name, error=str(e))
            raise ControlError(f"policy refused, the running policy stays in force: {e}")
        except ValueError as e:
            self.audit.write("policy-refused", source=name, error=str(e))
            raise ControlError(f"policy refused, the running policy stays in force: {name}: {e}")
        self.policy_source = name
        self.audit.write("policy-applied", source=name)
        return {"tenants": sorted(policy.tenants)}

    def _gpus(self, req: dict) -> dict:
        """The backend's GPUs (read-only): what a cluster driver publishes as devices."""
        return {"backend": self.backend.name,
                "gpus": [{"index": g.index, "name": g.name, "uuid": g.uuid,
                          "pci_bus_id": g.pci_bus_id, "memory": g.memory_bytes}
                         for g in sorted(self.backend.gpus(), key=lambda g: g.index)]}

    def _tenant_dir(self, req: dict) -> dict:
        t = req.get("tenant")
        if t not in self.broker.policy.tenants:
            raise ControlError(f"no tenant {t!r} in the running policy "
                               f"(tenants: {', '.join(sorted(self.broker.policy.tenants))})")
        return {"dir": str(self.paths.tenant_dir(t)), "gpus": list(self.broker.tenants[t].gpus),
                "seccomp": str(self.paths.seccomp), "backend": self.backend.name,
                "real_files": self.backend.tenant_files,
                # ioctl numbers the tenant's seccomp filter lets the kernel run unasked
                "kernel_ioctls": list(self.broker.kernel_ioctls(t)),
                # for `devbroker exec` to hide it when it is outside the run dir
                "audit": str(self.audit.path) if self.audit.path else None}

    def _tenant_refused(self, req: dict) -> dict:
        """A refusal a tenant's sandbox made itself (its stat shim, in the `devbroker exec`
        process, refuses the mapping of a broker placeholder that reached a FUSE tenant):
        written as the broker's own refusals are (an admin's op: the exec runs as root of
        this pid namespace)."""
        tenant, pid, what, reason = (req.get(k) for k in ("tenant", "pid", "what", "reason"))
        if not (isinstance(tenant, str) and isinstance(pid, int) and isinstance(what, str)
                and isinstance(reason, str)):
            raise ControlError("tenant.refused needs tenant, pid, what and reason")
        self.audit.deny(tenant=tenant[:64], pid=pid, what=what[:200], reason=reason[:300],
                        by="sandbox")
        return {}

    def _control_refused(self, peer: Peer, op: str, reason: str) -> None:
        self.audit.write("control-refused", pid=peer.pid, uid=peer.uid, op=op, reason=reason)

    def _access(self):
        return getattr(self.broker.policy, "control", None)

    def _set_modes(self, control: ControlServer | None = None) -> None:
        """The run dir is 0700 unless the policy gives a non-root uid a control role: then
        0711 (the socket reachable; nothing in the dir listable, and the audit log 0600,
        the seccomp socket 0600 and the FUSE mount's 0700 root still keep them out)."""
        access = self._access()
        self.paths.run_dir.chmod(0o711 if access is not None and access.opens_socket()
                                 else 0o700)
        if control is not None:
            control.set_mode()

    # -- the seccomp hand-over socket
    async def _serve_seccomp(self, nursery, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Accept tenants' seccomp listeners: one message per connection, a JSON object
        {"tenant": NAME} with the listener fd attached (SCM_RIGHTS); the reply is one JSON
        line. The socket is in the run dir (0700): only the operator's tools reach it."""
        import json
        import os
        import socket as _socket
        import struct

        if self._seccomp_sock is None:
            path = self.paths.seccomp
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            std = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
            std.bind(str(path))
            os.chmod(path, 0o600)
            std.listen(16)
            self._seccomp_sock = std
        sock = trio.socket.from_stdlib_socket(self._seccomp_sock)
        task_status.started()
        # Stopped (not closed) while a live upgrade hands over: connections wait in the
        # backlog for whichever process serves next. The successor has a duplicate of the
        # listening socket; this process's copy goes when the process does.
        while not self.handed_over:
            with trio.CancelScope() as self._seccomp_accepting:
                while True:
                    conn, _ = await sock.accept()
                    self._attaching += 1  # until attached or refused (live upgrade)
                    try:
                        peer = await trio.to_thread.run_sync(peer_of, conn)
                    except OSError:
                        conn.close()
                        self._attaching -= 1
                        continue
                    if role_of(peer, self._access()) != ROLE_ADMIN:
                        # Handing over a listener names the tenant it serves: whoever may
                        # do it could be any tenant. The operator's `devbroker exec` only.
                        note = self._handover_pacer.admit(peer.uid, trio.current_time())
                        if note is not None:
                            self._control_refused(peer, "seccomp hand-over",
                                                  "only an admin of the broker's pid namespace"
                                                  + note)
                        conn.close()
                        self._attaching -= 1
                        continue
                    nursery.start_soon(self._attach_seccomp, conn, nursery, json, os,
                                       _socket, struct)
            self._seccomp_accepting = None
            while self.upgrading:
                await trio.sleep(0.01)

    async def _attach_seccomp(self, conn, nursery, json, os, _socket, struct) -> None:
        try:
            await self._attach_seccomp_counted(conn, nursery, json, os, _socket, struct)
        finally:
            self._attaching -= 1

    async def _attach_seccomp_counted(self, conn, nursery, json, os, _socket, struct) -> None:
        with conn:
            fds: list[int] = []
            tenant = None
            try:
                with trio.fail_after(10):
                    msg, anc, _flags, _addr = await conn.recvmsg(
                        65536, _socket.CMSG_SPACE(4 * 4))
                for level, typ, data in anc:
                    if level == _socket.SOL_SOCKET and typ == _socket.SCM_RIGHTS:
                        n = len(data) // 4
                        fds.extend(struct.unpack(f"={n}i", data[:4 * n]))
                req = json.loads(msg.decode() or "{}")
                tenant = req.get("tenant")
                if len(fds) != 1:
                    raise ValueError("send exactly one seccomp listener fd")
                listener = fds.pop()
                await self.attach_listener(nursery, tenant, listener, frontend="seccomp")
            except Exception as e:  # noqa: BLE001 - a bad hand-over costs that tenant only
                for fd in fds:
                    os.close(fd)
                self.audit.write("error", tenant=str(tenant), what="seccomp hand-over",
                                 reason=str(e))
                try:
                    await conn.send((json.dumps({"ok": False, "error": str(e)}) + "\n").encode())
                except OSError:
                    pass
                return
            await conn.send(b'{"ok": true}\n')

    def check_tenant(self, tenant) -> None:
        """ValueError unless tenant is one of the running policy's (not revoked)."""
        if not isinstance(tenant, str) or tenant not in self.broker.policy.tenants:
            raise ValueError(f"no tenant {tenant!r} in the running policy")

    async def attach_listener(self, nursery, tenant: str, listener: int, *,
                              frontend: str = "seccomp", **audit_fields) -> None:
        """Serve a tenant's seccomp listener from now on (its ownership passes here, also
        when this raises). ``frontend``: "seccomp" (the seccomp front end's supervisor: opens,
        ioctls, mmaps) or "fuse" (the stat shim for the tenant's FUSE node files, for
        containers whose /dev/nvidia* are those files). Used by ``devbroker exec`` (over
        RUN_DIR/seccomp.sock) and by container runtimes (devbroker.oci.agent)."""
        import os

        try:
            self.check_tenant(tenant)
            real = self.backend.tenant_files
            if frontend == "seccomp":
                from devbroker.frontends.seccomp import SeccompSupervisor, default_nodes

                sup = SeccompSupervisor(self.front, tenant,
                                        default_nodes(gpus=self.broker.tenants[tenant].gpus),
                                        real_files=real)
            elif frontend == "fuse":
                from devbroker.oci.agent import stat_shim_for

                # In a worker thread: the node files are this process's own FUSE mount.
                sup = await trio.to_thread.run_sync(stat_shim_for,
                                                    self.paths.tenant_dir(tenant))
            else:
                raise ValueError(f"unknown front end {frontend!r}")
        except BaseException:
            os.close(listener)
            raise
        self.audit.write("tenant-attached", tenant=tenant, frontend=frontend,
                         files="real" if real and frontend == "seccomp" else
                         "placeholder" if frontend == "seccomp" else "fuse nodes",
                         **audit_fields)
        self._serve_listener(nursery, sup, listener, tenant, frontend, audit_fields)

    def _serve_listener(self, nursery, sup, listener: int, tenant: str, frontend: str,
                        audit_fields: dict) -> None:
        """Serve an attached (or, after a live upgrade, adopted) listener until its tenant
        is gone; the listener fd is closed then."""
        import os

        running = self.supervisors if frontend == "seccomp" else self.stat_shims
        running.add(sup)

        async def serve_one():
            try:
                if frontend == "fuse":
                    from devbroker.oci.agent import serve_stat_shim

                    await serve_stat_shim(sup, listener)  # closes the listener
                else:
                    try:
                        await sup.serve(listener)
                    finally:
                        os.close(listener)
            finally:
                running.discard(sup)
                # What the listener answered over its life, and the time it took (after a
                # live upgrade the successor serves it on, and writes this when it ends).
                if not (self.handed_over and frontend == "seccomp"):
                    stats = getattr(sup, "stats", None)
                    where = {k: audit_fields[k] for k in ("via", "container", "pid", "adopted")
                             if k in audit_fields}
                    self.audit.write("tenant-detached", tenant=tenant, frontend=frontend,
                                     **where, **(dataclasses.asdict(stats)
                                                 if dataclasses.is_dataclass(stats) else {}))
        nursery.start_soon(serve_one)

    # -- live upgrade (src/devbroker/upgrade.py does the protocol)
    async def _upgrade(self, req: dict):
        if self.upgrading:
            raise ControlError("a live upgrade is already under way")
        if self.tenancy.removing:
            raise ControlError("a tenant is being removed: upgrade once `devbroker tenant "
                               "rm` has returned")
        self.upgrading = True
        try:
            return await upgrade.hand_over(self, python=req.get("python"))
        except upgrade.UpgradeError as e:
            self.audit.write("upgrade-failed", reason=str(e))
            raise ControlError(str(e)) from None
        finally:
            self.upgrading = False

    def stop_accepting_seccomp(self) -> None:
        if self._seccomp_accepting is not None:
            self._seccomp_accepting.cancel()

    def finish(self) -> None:
        """Stop serving (after a hand-over: without unmounting or closing what the successor
        now serves)."""
        self.done.set()

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        import time

        from devbroker.frontends.fuse import FuseFrontend, detach_stale_mount
        from devbroker.oci.agent import OciSeccompAgent

        adopted = self.adopted
        if adopted is None:
            # The run dir holds the control socket and the audit log: the operator's
            # alone. Tenants reach their nodes through bind mounts, which need no access
            # to it.
            self.paths.run_dir.mkdir(parents=True, exist_ok=True)
            self._set_modes()
            # A broker that died leaves its mount behind (ENOTCONN on any access): detach
            # it before touching the path, so a restart serves again without operator help.
            if self.frontend_kind == "fuse":
                await trio.to_thread.run_sync(detach_stale_mount, str(self.paths.mount))
                self.paths.mount.mkdir(parents=True, exist_ok=True)
        else:
            self._seccomp_sock = adopted.seccomp
        # Where this broker's files are, for every sandbox on the host to hide (a broker
        # without the FUSE front end shows in no mount table): sandbox/brokers.py.
        from devbroker.sandbox import brokers

        try:
            registered = brokers.register(self.paths.run_dir, self.audit.path)
        except OSError as e:  # (a broker without root: no sandbox it could serve either)
            log.warning("cannot write down where this broker's files are for sandboxes to "
                        "hide (%s): only /run/devbroker* and FUSE mounts are hidden", e)
            registered = None
        if self.audit.path and brokers.audit_outside(self.paths.run_dir, self.audit.path) \
                and brokers.audit_dir_is_shared(self.audit.path):
            log.warning("the audit log %s shares its directory, which sandboxes therefore "
                        "cannot cover whole: its rotated files show to root tenants after a "
                        "rotation; give it a directory of its own", self.audit.path)
        control = self.control = ControlServer(self.paths.control, {
            "status": self._status,
            "policy.show": self._policy_show,
            "gpus": self._gpus,
            "policy.apply": self._policy_apply,
            "tenant.dir": self._tenant_dir,
            "tenant.refused": self._tenant_refused,
            "upgrade": self._upgrade,
            **self.tenancy.handlers(lambda: "a live upgrade is under way: change tenants on "
                                    "the new broker once `devbroker upgrade` has returned"
                                    if self.upgrading else None),
            **preemption.control_ops(self.broker),  # tenant.preempt, tenant.resume
        }, access=self._access, on_refusal=self._control_refused,
            sock=adopted.control if adopted else None)
        self.broker.on_policy_change.append(lambda p: self._set_modes(control))
        self.started = time.time()
        try:
            self._configure_metrics(self.broker.policy.broker.metrics,
                                    sock=adopted.metrics if adopted else None)
        except OSError as e:
            raise OSError(e.errno, f"metrics endpoint "
                                   f"{self.broker.policy.broker.metrics.listen}: {e.strerror}")
        fuse = self.frontend_kind == "fuse"
        if fuse:
            nodes = FuseFrontend(self.paths.mount, self.front,
                                 adopt=adopted.fuse if adopted else None)
        elif self.frontend_kind in ("kmod", "cuse"):
            nodes = node_frontend(self.frontend_kind, self.broker, front=self.front)
        else:  # seccomp: tenants come only through the hand-over socket and the OCI agent
            nodes = contextlib.nullcontext()
            write_tenant_dirs(self.paths.mount, tenant_tree(self.broker))
            self.broker.on_policy_change.append(
                lambda p: write_tenant_dirs(self.paths.mount, tenant_tree(self.broker)))
        try:
            async with nodes as fe:
                self.frontend = fe
                if fuse:
                    fe.set_tree(tenant_tree(self.broker))
                    self.broker.on_policy_change.append(
                        lambda p: fe.set_tree(tenant_tree(self.broker)))
                async with trio.open_nursery() as nursery:
                    await nursery.start(control.serve)
                    await nursery.start(self._serve_seccomp, nursery)
                    self.oci_agent = OciSeccompAgent(self,
                                                     sock=adopted.oci if adopted else None)
                    await nursery.start(self.oci_agent.serve, nursery)
                    nursery.start_soon(self.alerts.run, self.broker)
                    self.broker.set_spawner(nursery.start_soon)
                    # while this thread still may mount (real.py)
                    self.backend.prepare_tenant_files()
                    if adopted is not None:
                        # The predecessor's seccomp listeners: what the kernel queued while
                        # neither process received is answered from here on.
                        for sup, listener in adopted.supervisors:
                            self._serve_listener(nursery, sup, listener, sup.tenant, "seccomp",
                                                 {"adopted": True})
                        adopted.supervisors = []
                    if adopted is None:
                        self.audit.write("started", backend=self.backend.name,
                                         driver=self.backend.version,
                                         frontend=self.frontend_kind,
                                         mount=str(self.paths.mount) if fuse else None,
                                         tenants=sorted(self.broker.tenants),
                                         metrics=self.metrics.url if self.metrics else None)
                    else:
                        self.audit.write("upgraded", from_pid=adopted.from_pid,
                                         backend=self.backend.name,
                                         tenants=sorted(self.broker.tenants),
                                         sessions=adopted.sessions, books=adopted.books)

                    async def fuse_closed():
                        await fe.wait_closed()
                        self.done.set()
                    if fuse:
                        nursery.start_soon(fuse_closed)
                    task_status.started(self)
                    await self.done.wait()
                    if self.handed_over and fuse:
                        fe.detach()
                    nursery.cancel_scope.cancel()
        finally:
            if registered is not None:
                brokers.unregister(registered)
            if self.metrics is not None:
                self.metrics.stop()
                self.metrics = None


async def run_forever(service: BrokerService, *, quiet: bool = False,
                      started=None) -> None:
    """Serve until SIGINT/SIGTERM, the FUSE connection ending, or a hand-over to a
    successor. `started`: an async callable run once serving (the successor's ack)."""
    async def on_signal(signals, cancel_scope):
        async for _ in signals:
            cancel_scope.cancel()
            return

    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(on_signal, signals, nursery.cancel_scope)
            await nursery.start(service.serve)
            # Everything loaded so far (the ABI tables, the rule tables: ~250,000 objects) lives
            # as long as the broker: out of the collector's sight, so that no full collection
            # (~150 ms over them on the development machine: docs/hardware.md) ever
            # stops every listener thread in the middle of a tenant's call.
            import gc

            gc.collect()
            gc.freeze()
            # A service manager (systemd Type=notify) learns that this process serves, and
            # after a live upgrade that it is the service's main process now.
            import os

            sd_notify(f"READY=1\nMAINPID={os.getpid()}\nSTATUS=serving "
                      f"{len(service.broker.tenants)} tenants")
            if started is not None:
                await started()
            if not quiet:
                nodes = (f"nodes under {service.paths.mount}"
                         if service.frontend_kind == "fuse" else
                         f"{service.frontend_kind} front end")
                print(f"devbroker: {service.backend.name} backend (driver "
                      f"{service.backend.version}), {nodes}, "
                      f"control socket {service.paths.control}", file=sys.stderr, flush=True)
                if service.frontend_kind in ("fuse", "seccomp"):  # they take seccomp tenants
                    from devbroker.frontends.nativelane import describe

                    print(f"devbroker: seccomp listeners: {describe()}", file=sys.stderr,
                          flush=True)
                if service.frontend_kind == "fuse":
                    from devbroker.frontends import fusenative

                    print(f"devbroker: FUSE readers: {fusenative.describe()}",
                          file=sys.stderr, flush=True)
                if service.metrics is not None:
                    print(f"devbroker: metrics at {service.metrics.url}", file=sys.stderr,
                          flush=True)
                for name in sorted(service.broker.tenants):
                    print(f"devbroker: tenant {name}: {service.paths.tenant_dir(name)}",
                          file=sys.stderr, flush=True)
            await service.done.wait()
            nursery.cancel_scope.cancel()
