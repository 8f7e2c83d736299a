"""Assembles a running broker: policy → backend → broker core → front end → control socket."""
from __future__ import annotations

import logging
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from devbroker.broker import procview
from devbroker.broker.audit import AuditLog
from devbroker.broker.control import ControlError, ControlServer
from devbroker.broker.core import Broker

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

    def tenant_dir(self, tenant: str) -> Path:
        return self.mount / tenant


def make_backend(policy: Any, backend: str | None = None, *, notice=None):
    name = backend or policy.broker.backend
    if name == "emulated":
        from devbroker.backends.emulated import EmulatedBackend, EmulatedGpu

        gpus = [EmulatedGpu(index=i, name=g.name, uuid=g.uuid, pci_bus_id=g.pci_bus_id,
                            memory_bytes=g.memory) for i, g in enumerate(policy.broker.gpus)]
        return EmulatedBackend(gpus, version=policy.broker.driver_version, notice=notice)
    if name == "real":
        from devbroker.backends.real import RealBackend

        return RealBackend(notice=notice)
    raise ValueError(f"unknown backend {name!r} (emulated, real)")


def tenant_tree(broker: Broker) -> dict[str, dict]:
    """What the front end shows: per tenant, its nodes and its /proc/driver/nvidia view."""
    backend = broker.backend
    host = procview.HOST_PROC if backend.name == "real" else None
    tree = {}
    for name, t in broker.tenants.items():
        if " (revoked)" in name:
            continue
        tree[name] = {
            "gpus": list(t.gpus),
            "uvm": True,
            "proc": procview.tenant_view(backend.gpus(), t.gpus, backend.version, host=host),
        }
    return tree


class BrokerService:
    """The broker with its FUSE front end and control socket, for `devbroker run` and tests."""

    def __init__(self, policy: Any, run_dir: str | Path, *, backend: str | None = None,
                 audit_path: str | Path | None = None, record: str | Path | None = None,
                 policy_source: str | None = None):
        self.paths = RunPaths(Path(run_dir))
        self.policy_source = policy_source
        self.audit = AuditLog(audit_path or getattr(policy.broker, "audit_log", None)
                              or self.paths.audit)
        self.backend = make_backend(policy, backend,
                                    notice=lambda m: self.audit.write("notice", message=m))
        recorder = None
        if record:
            from devbroker.broker.record import Recorder

            recorder = Recorder(record)
        self.broker = Broker(policy, self.backend, self.audit, recorder=recorder)
        self.frontend = None

    # -- control socket handlers
    def _status(self, req: dict) -> dict:
        snap = self.broker.snapshot()
        snap["mount"] = str(self.paths.mount)
        snap["policy"] = self.policy_source or "built-in example"
        return snap

    def _policy_show(self, req: dict) -> dict:
        return {"source": self.policy_source or "built-in example",
                "text": self.broker.policy.to_toml()}

    def _policy_apply(self, req: dict) -> dict:
        from devbroker.broker.policy import PolicyError, load_policy_text

        name = req.get("name") or "<policy>"
        try:
            policy = load_policy_text(req.get("text", ""), name)
            self.broker.apply_policy(policy)
        except PolicyError as e:
            self.audit.write("policy-refused", source=name, error=str(e))
            raise ControlError(f"policy refused, the running policy stays in force: {e}")
        except ValueError as e:
            self.audit.write("policy-refused", source=name, error=str(e))
            raise ControlError(f"policy refused, the running policy stays in force: {name}: {e}")
        self.policy_source = name
        self.audit.write("policy-applied", source=name)
        return {"tenants": sorted(policy.tenants)}

    def _tenant_dir(self, req: dict) -> dict:
        t = req.get("tenant")
        if t not in self.broker.tenants or " (revoked)" in t:
            raise ControlError(f"no tenant {t!r} in the running policy "
                               f"(tenants: {', '.join(sorted(self.broker.tenants))})")
        return {"dir": str(self.paths.tenant_dir(t)), "gpus": list(self.broker.tenants[t].gpus)}

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        from devbroker.frontends.fuse import FuseFrontend, detach_stale_mount

        # The run dir holds the control socket and the audit log: the operator's alone.
        # Tenants reach their nodes through bind mounts, which need no access to it.
        self.paths.run_dir.mkdir(parents=True, exist_ok=True)
        self.paths.run_dir.chmod(0o700)
        # A broker that died leaves its mount behind (ENOTCONN on any access): detach it
        # before touching the path, so a restart serves again without operator help.
        await trio.to_thread.run_sync(detach_stale_mount, str(self.paths.mount))
        self.paths.mount.mkdir(parents=True, exist_ok=True)
        control = ControlServer(self.paths.control, {
            "status": self._status,
            "policy.show": self._policy_show,
            "policy.apply": self._policy_apply,
            "tenant.dir": self._tenant_dir,
        })
        async with FuseFrontend(self.paths.mount, self.broker) as fe:
            self.frontend = fe
            fe.set_tree(tenant_tree(self.broker))
            self.broker.on_policy_change.append(lambda p: fe.set_tree(tenant_tree(self.broker)))
            async with trio.open_nursery() as nursery:
                await nursery.start(control.serve)
                self.audit.write("started", backend=self.backend.name,
                                 driver=self.backend.version, mount=str(self.paths.mount),
                                 tenants=sorted(self.broker.tenants))
                task_status.started(self)
                await fe.wait_closed()
                nursery.cancel_scope.cancel()


async def run_forever(service: BrokerService, *, quiet: bool = False) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            await nursery.start(service.serve)
            if not quiet:
                print(f"devbroker: {service.backend.name} backend (driver "
                      f"{service.backend.version}), nodes under {service.paths.mount}, "
                      f"control socket {service.paths.control}", file=sys.stderr, flush=True)
                for name in sorted(service.broker.tenants):
                    print(f"devbroker: tenant {name}: {service.paths.tenant_dir(name)}",
                          file=sys.stderr, flush=True)
            async for _ in signals:
                nursery.cancel_scope.cancel()
                break
