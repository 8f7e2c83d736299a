"""The one place a broker is put together: policy → backend → core → front end.

`devbroker run` (daemon.BrokerService), the QEMU guest harness (testing/guest_broker.py) and
the escape harness (escape/harness.py) all build their broker with `assemble` and their
shared-node front end with `node_frontend`, so that what is tested is what runs.

Front ends (`FRONTENDS`):

- ``fuse``: the FUSE file system of per-tenant nodes under RUN_DIR/nodes (frontends/fuse.py),
  plus the seccomp hand-over socket (`devbroker exec --frontend seccomp`).
- ``seccomp``: no node file system at all; tenants come only through the seccomp hand-over
  socket and the OCI agent (frontends/seccomp.py).
- ``kmod``: the kernel module's /dev/nvidia* nodes (kmod/, frontends/kmod.py), tenants told
  apart by uid (policy key ``uids``).
- ``cuse``: CUSE character devices (frontends/cuse.py), tenants by uid as for kmod.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from devbroker.backends.emulated import EmulatedBackend, EmulatedGpu
from devbroker.backends.real import RealBackend
from devbroker.broker.audit import AuditLog
from devbroker.broker.core import Broker
from devbroker.frontends.cuse import CuseFrontend
from devbroker.frontends.kmod import KmodFrontend, tenant_by_uid

FRONTENDS = ("fuse", "seccomp", "kmod", "cuse")
BACKENDS = ("emulated", "real")


def make_backend(policy: Any, backend: Any = None, *,
                 notice: Callable[[str], None] | None = None,
                 private_dir: str | Path | None = None):
    """The backend the policy names (or `backend`): the emulated driver, or the real one;
    `backend` may also be one built already (a live upgrade's adopted real backend)."""
    if backend is not None and not isinstance(backend, str):
        return backend
    name = backend or policy.broker.backend
    if name == "emulated":
        gpus = [EmulatedGpu(index=i, name=g.name, uuid=g.uuid, pci_bus_id=g.pci_bus_id,
                            memory_bytes=g.memory) for i, g in enumerate(policy.broker.gpus)]
        return EmulatedBackend(gpus, version=policy.broker.driver_version, notice=notice)
    if name == "real":
        return RealBackend(notice=notice, private_dir=private_dir)
    raise ValueError(f"unknown backend {name!r} ({', '.join(BACKENDS)})")


@dataclass
class Assembly:
    """A broker core with its backend and audit log, before any front end."""
    policy: Any
    audit: AuditLog
    backend: Any
    broker: Broker


def assemble(policy: Any, *, backend: str | None = None, audit: AuditLog | None = None,
             audit_path: str | Path | None = None, recorder: Any = None,
             private_dir: str | Path | None = None) -> Assembly:
    """Policy → backend → core. `audit` (or a new log at `audit_path`, else the policy's
    ``audit_log``) receives the backend's notices too."""
    if audit is None:
        audit = AuditLog(audit_path or getattr(policy.broker, "audit_log", None))
    log = audit
    be = make_backend(policy, backend, notice=lambda m: log.write("notice", message=m),
                      private_dir=private_dir)
    return Assembly(policy, audit, be, Broker(policy, be, audit, recorder=recorder))


def node_frontend(kind: str, broker: Broker, *, front: Any = None, **options):
    """The front end of shared device nodes, `kind` "kmod" or "cuse", as an async context
    manager. Tenants are told apart by uid (the policy's ``uids``, read at each open).
    `front`: the object the front end hands calls to (default: the broker; daemon passes
    its instrumented wrapper). `options` go to the front end's constructor (CUSE: gpus)."""
    tenant_of = tenant_by_uid(broker)
    target = front if front is not None else broker
    if kind == "kmod":
        return KmodFrontend(target, tenant_of=tenant_of, **options)
    if kind == "cuse":
        options.setdefault("gpus", list(range(len(broker.backend.gpus()))))
        return CuseFrontend(target, tenant_of=tenant_of, **options)
    raise ValueError(f"{kind!r} is not a shared-node front end (kmod, cuse)")
