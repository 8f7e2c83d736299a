"""Tenants made at run time: added, changed and removed over the control socket.

A cluster's device plugin cannot write the policy file for every pod that wants a GPU
slice: it asks the running broker (ops `tenant.add`, `tenant.set`, `tenant.rm`,
`tenant.list`, admin role; docs/policy.md "Runtime tenants"). A runtime tenant is then
exactly a policy tenant: each spec is checked by the policy loader's own tenant check (same
keys, same messages), and the broker runs the *effective* policy, the file's tenants and
the runtime ones together, through `Broker.apply_policy` — so its node directory, `devbroker
exec`, CDI, the seccomp hand-over, status and metrics all see it as they see a file tenant,
and a change is a hot policy reload of that tenant.

Kept apart from the file: `policy show` shows the file alone, `policy apply` of a new file
keeps the runtime tenants (and refuses a file naming one of them). The runtime tenants are
written to RUN_DIR/tenants.json at every change (atomically) and read back when the broker
starts; a live upgrade carries them in its hand-over state.

Quotas may oversubscribe the GPU, as a file's tenants may: a quota is a ceiling each tenant
is held to, not memory set aside (the broker refuses an allocation the GPU itself cannot
make, as the driver would).

Removing a tenant: its nodes go and every further call of its open files is refused at
once (the policy reload revokes it); then its processes are ended — those that opened its
files, and every process of their pid namespaces (a `devbroker exec` sandbox or a
container is the tenant's whole) unless that is the broker's own namespace or another
tenant's processes are there too — SIGTERM, then SIGKILL after the grace; files still open
after that are closed by the broker, which frees their RM objects and returns their memory
to the books.
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable

import trio

from devbroker.broker import limits as _limits
from devbroker.broker.control import ControlError, current_peer
from devbroker.broker.effects import STATE_LOCK
from devbroker.broker.interface import ReleaseRequest
from devbroker.broker.policy import (
    BrokerConfig, GpuSpec, Policy, PolicyError, TenantPolicy, _Loader,
)
from devbroker.broker.procinfo import pid_namespace

STATE_FILE = "tenants.json"
STATE_FORMAT = 1
DEFAULT_GRACE = 5.0
GRACE_MAX = 600.0
# After SIGKILL a process is gone within milliseconds unless the kernel holds it (an
# uninterruptible wait in a driver); the broker does not wait for such a one forever.
KILL_WAIT = 10.0
# The front ends close a dead process's files (FUSE RELEASE, the seccomp listener's exit)
# soon after it ends; files still open after this are closed by the broker itself.
RELEASE_WAIT = 5.0
SOURCE = "tenant spec"  # what the loader's messages name as their source


class TenantError(ValueError):
    """A request the broker refuses; str() is the one-line reason for the caller."""


@dataclass(frozen=True)
class RuntimeTenant:
    spec: dict  # as given (partial sets merged in): what is saved and checked again on load
    policy: TenantPolicy

    @property
    def labels(self) -> dict[str, str]:
        return dict(self.policy.labels)


def check_spec(name: Any, spec: Any, labels: Any, broker: BrokerConfig) -> TenantPolicy:
    """A runtime tenant's spec checked as a `[tenant.NAME]` table of a policy file (the
    loader's own check: same keys, same messages), labels being its `labels` table.
    Raises TenantError."""
    if not isinstance(name, str) or not name:
        raise TenantError("a tenant needs a name (\"tenant\": NAME)")
    if not isinstance(spec, dict):
        raise TenantError(f"{SOURCE}: the spec must be an object, not {type(spec).__name__}")
    table = dict(spec)
    if labels is not None:
        table["labels"] = labels
    try:
        return _Loader("", SOURCE).tenant(name, table, ("tenant", name), broker)
    except PolicyError as e:
        raise TenantError(str(e)) from None


def spec_of(tp: TenantPolicy) -> dict:
    """A tenant's policy as a spec object (every key, defaults included): what
    `tenant.list` shows, and what `tenant.add` with it would make again."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(tp):
        if f.name in ("name", "labels"):
            continue
        v = getattr(tp, f.name)
        if f.name == "rate_limit":
            if v is None:
                continue
            v = {"requests_per_second": v.requests_per_second, "burst": v.burst}
        elif f.name == "limits":
            v = {k: getattr(v, k) for k in _limits.KEYS}
        elif isinstance(v, tuple):
            v = list(v)
        if v is not None:
            out[f.name] = v
    return out


def with_runtime(file_policy: Policy, runtime: dict[str, RuntimeTenant]) -> Policy:
    """The policy the broker runs: the file's, with the runtime tenants after its own."""
    tenants = dict(file_policy.tenants)
    tenants.update((name, rt.policy) for name, rt in runtime.items())
    return Policy(broker=file_policy.broker, tenants=MappingProxyType(tenants),
                  source=file_policy.source, control=file_policy.control)


def write_state(path: Path, runtime: dict[str, RuntimeTenant]) -> None:
    """RUN_DIR/tenants.json, all or nothing: a crash leaves the old file or the new one."""
    data = {"format": STATE_FORMAT, "tenants": export(runtime)}
    fd, tmp = tempfile.mkstemp(prefix=".tenants.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o600)
        os.rename(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)  # the rename itself on disk
    finally:
        os.close(dfd)


def export(runtime: dict[str, RuntimeTenant]) -> list[dict]:
    """The runtime tenants as plain data (the state file's and the live upgrade's)."""
    return [{"name": name, "spec": rt.spec, "labels": rt.labels}
            for name, rt in runtime.items()]


def read_state(path: Path) -> list[dict]:
    """The saved tenants ([] without a file). PolicyError naming the file if unusable."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    except (OSError, UnicodeDecodeError) as e:
        raise PolicyError(str(path), None, f"cannot read: {e}") from None
    try:
        data = json.loads(text)
    except ValueError as e:
        raise PolicyError(str(path), None, f"not JSON: {e}") from None
    if not isinstance(data, dict) or data.get("format") != STATE_FORMAT \
            or not isinstance(data.get("tenants"), list):
        raise PolicyError(str(path), None, f"not a runtime tenants file of format "
                                           f"{STATE_FORMAT}")
    return data["tenants"]


def _under_state_lock(method):
    """Listener threads change the books and sessions under STATE_LOCK (effects.py)."""
    def locked(*args, **kw):
        with STATE_LOCK:
            return method(*args, **kw)
    locked.__name__, locked.__doc__ = method.__name__, method.__doc__
    return locked


class Tenancy:
    """The runtime tenants of one broker, and the file policy they run beside.

    ``node_dir(name)``: the tenant's node directory (None without one: kmod/CUSE);
    ``state_path``: RUN_DIR/tenants.json (None: not saved, e.g. a broker in a test)."""

    def __init__(self, broker, audit, file_policy: Policy, *, state_path: Path | None = None,
                 node_dir: Callable[[str], str | None] = lambda name: None):
        self.broker = broker
        self.audit = audit
        self.file_policy = file_policy
        self.state_path = state_path
        self.node_dir = node_dir
        self.runtime: dict[str, RuntimeTenant] = {}
        # Removals waiting for their processes: a live upgrade waits until none is (the
        # old process would otherwise close files whose books the successor holds now).
        self.removing = 0

    # -- start, policy reload, live upgrade
    def restore(self, saved: list[dict] | None = None) -> None:
        """Take the runtime tenants a live upgrade handed over (`saved`), or those of the
        state file; each is checked again. PolicyError (naming the file) when one no longer
        fits — the operator decides (`tenant rm` on the old broker, or edit the file):
        a broker that silently dropped a tenant would leave its pods without their GPU."""
        where = str(self.state_path) if saved is None else "<handed-over tenants>"
        if saved is None:
            saved = read_state(self.state_path) if self.state_path is not None else []
        runtime: dict[str, RuntimeTenant] = {}
        for entry in saved:
            if not isinstance(entry, dict):
                raise PolicyError(where, None, "each tenant must be an object")
            name = entry.get("name")
            if not isinstance(name, str):
                raise PolicyError(where, None, f"a tenant's name must be a string, not {name!r}")
            try:
                if name in self.file_policy.tenants:
                    raise TenantError(f"tenant {name!r} is in the policy file "
                                      f"{self.file_policy.source} too")
                if name in runtime:
                    raise TenantError(f"tenant {name!r} is listed twice")
                tp = check_spec(name, entry.get("spec"), entry.get("labels") or None,
                                self._gpu_config())
            except TenantError as e:
                raise PolicyError(where, None, str(e)) from None
            runtime[name] = RuntimeTenant(dict(entry.get("spec")), tp)
        if runtime:
            self.runtime = runtime
            self.broker.apply_policy(with_runtime(self.file_policy, runtime))

    def apply_file_policy(self, policy: Policy) -> None:
        """`policy apply`: the new file with the runtime tenants kept. PolicyError if the
        file names a runtime tenant (two owners of one name would be one tenant changed
        by whichever spoke last)."""
        clash = sorted(set(policy.tenants) & set(self.runtime))
        if clash:
            raise PolicyError(policy.source, None, f"tenant(s) {', '.join(clash)} exist as "
                              "runtime tenants (`devbroker tenant list`): remove them with "
                              "`devbroker tenant rm` first, or name the file's otherwise")
        # The runtime tenants checked again against the new file's GPUs.
        old, self.file_policy = self.file_policy, policy
        try:
            for name, rt in self.runtime.items():
                try:
                    check_spec(name, rt.spec, rt.labels, self._gpu_config())
                except TenantError as e:
                    raise PolicyError(policy.source, None, f"runtime tenant {name} would no "
                                      f"longer fit: {e}") from None
            self.broker.apply_policy(with_runtime(policy, self.runtime))
        except BaseException:
            self.file_policy = old
            raise

    def export(self) -> list[dict]:
        return export(self.runtime)

    # -- the control ops
    def handlers(self, busy: Callable[[], str | None] = lambda: None) -> dict[str, Callable]:
        """The control socket's ops (all admin: control.OP_ROLES lists them not), each
        refused with `busy()`'s reason while that says one (a live upgrade: a change now
        would not reach the successor)."""
        def who() -> str:
            peer = current_peer()
            return peer.describe() if peer is not None else "the broker"

        def refused_now() -> None:
            why = busy()
            if why:
                raise ControlError(why)

        def refused(req: dict, e: Exception) -> ControlError:
            self.audit.write("tenant-refused", op=req.get("op"), tenant=str(req.get("tenant")),
                             by=who(), error=str(e))
            return ControlError(str(e))

        def op(fn):
            def handle(req: dict):
                refused_now()
                try:
                    return fn(req, who())
                except TenantError as e:
                    raise refused(req, e) from None
            return handle

        async def rm(req: dict):
            refused_now()
            try:
                return await self.rm(req, who())
            except TenantError as e:
                raise refused(req, e) from None

        return {"tenant.add": op(self.add), "tenant.set": op(self.set),
                "tenant.rm": rm, "tenant.list": op(self.list)}

    def add(self, req: dict, who: str) -> dict:
        name, spec, labels = req.get("tenant"), req.get("spec", {}), req.get("labels")
        if isinstance(name, str) and name in self.file_policy.tenants:
            raise TenantError(f"tenant {name!r} is in the policy file "
                              f"{self.file_policy.source}: change it there")
        tp = check_spec(name, spec, labels, self._gpu_config())
        old = self.runtime.get(name)
        if old is not None:
            if old.policy == tp:
                return {"tenant": self.info(name), "existed": True}
            raise TenantError(f"tenant {name} exists with another spec "
                              f"({_differences(old.policy, tp)}): `tenant set` changes it")
        self._change({**self.runtime, name: RuntimeTenant(dict(spec), tp)})
        self.audit.write("tenant-added", tenant=name, by=who, spec=spec_of(tp),
                         labels=dict(tp.labels))
        return {"tenant": self.info(name), "existed": False}

    def set(self, req: dict, who: str) -> dict:
        name, partial = req.get("tenant"), req.get("spec", {})
        if isinstance(name, str) and name in self.file_policy.tenants:
            raise TenantError(f"tenant {name!r} is in the policy file "
                              f"{self.file_policy.source}: change it there and `devbroker "
                              "policy apply`")
        old = self.runtime.get(name) if isinstance(name, str) else None
        if old is None:
            raise TenantError(f"no runtime tenant {name!r}")
        if not isinstance(partial, dict):
            raise TenantError(f"{SOURCE}: the spec must be an object, not "
                              f"{type(partial).__name__}")
        spec = {**old.spec, **partial}
        labels = req.get("labels")
        tp = check_spec(name, spec, old.labels if labels is None else labels,
                        self._gpu_config())
        if tp != old.policy:
            self._change({**self.runtime, name: RuntimeTenant(spec, tp)})
            self.audit.write("tenant-changed", tenant=name, by=who,
                             changed=_differences(old.policy, tp), spec=spec_of(tp),
                             labels=dict(tp.labels))
        return {"tenant": self.info(name), "changed": tp != old.policy}

    async def rm(self, req: dict, who: str) -> dict:
        name, grace = req.get("tenant"), req.get("grace", DEFAULT_GRACE)
        if (isinstance(grace, bool) or not isinstance(grace, (int, float))
                or not 0 <= grace <= GRACE_MAX):
            raise TenantError(f"grace must be a number of seconds from 0 to {GRACE_MAX:g}, "
                              f"not {grace!r}")
        if isinstance(name, str) and name in self.file_policy.tenants:
            raise TenantError(f"tenant {name!r} is in the policy file "
                              f"{self.file_policy.source}: remove it there and `devbroker "
                              "policy apply`")
        if not isinstance(name, str) or name not in self.runtime:
            return {"existed": False}
        state = self.broker.tenants[name]
        with STATE_LOCK:  # (listener threads change sessions and books under it)
            before, openers = state.used(), openers_of(state)
            shared = {ns for t in self.broker.tenants.values() if t is not state
                      for ns in t.openers().values()}
        runtime = dict(self.runtime)
        del runtime[name]
        # From here on its nodes are gone and every call of its open files is refused
        # (and what its seccomp filters let the kernel run ends with the processes, next).
        self._change(runtime, ending=frozenset({name}))
        self.removing += 1
        try:
            pids = await trio.to_thread.run_sync(processes_of, openers, shared)
            ended = await end_processes(pids, grace)
            closed = await self._close_files(state)
        finally:
            self.removing -= 1
        with STATE_LOCK:
            left = {g: n for g, n in state.used().items() if n}
            for key, t in list(self.broker.tenants.items()):
                if t is state and not state.sessions and not state.clients:
                    del self.broker.tenants[key]  # nothing left to show of it
        self.audit.write("tenant-removed", tenant=name, by=who, grace=grace,
                         ended=sorted(ended), files_closed=closed,
                         memory_freed={str(g): n - left.get(g, 0)
                                       for g, n in before.items() if n},
                         **({"memory_held": {str(g): n for g, n in left.items()}}
                            if left else {}))
        return {"existed": True, "ended": sorted(ended)}

    def list(self, req: dict | None = None, who: str = "") -> dict:
        return {"tenants": [self.info(name) for name in self.broker.policy.tenants]}

    @_under_state_lock
    def info(self, name: str) -> dict:
        tp = self.broker.policy.tenants[name]
        t = self.broker.tenants.get(name)
        return {"name": name, "source": "runtime" if name in self.runtime else "policy",
                "spec": spec_of(tp), "labels": dict(tp.labels),
                "node_dir": self.node_dir(name),
                "processes": len(t.tgids()) if t is not None else 0,
                "memory_used": {str(g): n for g, n in t.used().items()} if t else {}}

    # -- internals
    def _change(self, runtime: dict[str, RuntimeTenant], *,
                ending: frozenset[str] = frozenset()) -> None:
        """Run the new set (a hot reload of the effective policy), then save it. Raises
        TenantError, and changes nothing, when the broker refuses it. `ending`: tenants
        removed whose processes the caller ends next (Broker.apply_policy)."""
        try:
            self.broker.apply_policy(with_runtime(self.file_policy, runtime), ending=ending)
        except ValueError as e:
            raise TenantError(str(e)) from None
        self.runtime = runtime
        if self.state_path is not None:
            write_state(self.state_path, runtime)

    def _gpu_config(self) -> BrokerConfig:
        """The file's [broker] with the GPUs the broker has (a real backend's policy may
        list none: the host's are used), for the loader's GPU and quota checks."""
        b = self.file_policy.broker
        if b.gpus:
            return b
        gpus = tuple(GpuSpec(index=getattr(g, "index", i), name=g.name, uuid=g.uuid,
                             pci_bus_id=g.pci_bus_id, memory=int(g.memory_bytes))
                     for i, g in enumerate(self.broker.backend.gpus()))
        return dataclasses.replace(b, gpus=gpus)

    async def _close_files(self, state) -> int:
        """Wait for the front ends to close the ended processes' files; close the rest
        (a file passed to a process outside the tenant's namespaces, or a process the
        kernel would not let go): their clients are freed, their memory returned."""
        deadline = time.monotonic() + RELEASE_WAIT
        while state.sessions and time.monotonic() < deadline:
            await trio.sleep(0.05)
        left = list(state.sessions)
        for sid in left:
            self.broker.release_now(ReleaseRequest(session=sid))
        return len(left)


def _differences(old: TenantPolicy, new: TenantPolicy) -> str:
    a, b = spec_of(old), spec_of(new)
    keys = [k for k in {**a, **b} if a.get(k) != b.get(k)]
    if old.labels != new.labels:
        keys.append("labels")
    return ", ".join(keys) or "none"


def openers_of(state) -> dict[int, tuple[str | None, int | None]]:
    """The processes that opened a tenant's files: pid -> (its pid namespace, its uid)."""
    return {x.caller.pid: (x.pidns, x.caller.uid) for x in state.sessions.values()
            if not x.prepared}


def processes_of(openers: dict[int, tuple[str | None, int | None]],
                 shared: set = frozenset()) -> dict[int, tuple[str | None, int | None]]:
    """A tenant's processes: those that opened its files, and every process of their pid
    namespaces — a `devbroker exec` sandbox or a container is the tenant's whole — but the
    broker's own (kmod/CUSE tenants share the host's) and those `shared` with another
    tenant's processes: there, the openers alone. pid -> (pid namespace, uid) to check
    before signalling that the pid still names the process seen (uid None: any)."""
    own = pid_namespace(os.getpid())
    out = dict(openers)
    spaces = {ns for ns, _uid in openers.values()
              if ns is not None and ns != own and ns not in shared}
    if spaces:
        for entry in os.scandir("/proc"):
            if entry.name.isdigit() and int(entry.name) not in out:
                ns = pid_namespace(int(entry.name))
                if ns in spaces:
                    out[int(entry.name)] = (ns, None)
    out.pop(os.getpid(), None)
    return out


def _still(pid: int, ns: str | None, uid: int | None) -> bool:
    """Whether pid (pinned by a pidfd already) is the process seen: same pid namespace,
    and where its opener's uid is known, that uid among its real, effective, saved and
    file-system uids (an opener that exited leaves its pid to any process of its
    namespace; in the broker's own that could be anyone's)."""
    if ns is not None and pid_namespace(pid) != ns:
        return False
    if uid is None:
        return True
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Uid:"):
                    return uid in {int(u) for u in line.split()[1:]}
    except OSError:
        pass
    return False


async def end_processes(pids: dict[int, tuple[str | None, int | None]],
                        grace: float) -> set[int]:
    """SIGTERM, then SIGKILL to those alive after `grace` seconds; returns the pids
    signalled. Each is pinned with a pidfd first and then checked to be the process seen
    (`_still`), so a pid reused meanwhile is never signalled."""
    fds: dict[int, int] = {}
    try:
        for pid, (ns, uid) in pids.items():
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                continue  # already gone
            if not _still(pid, ns, uid):
                os.close(fd)
                continue
            fds[pid] = fd
        signalled = set()
        for pid, fd in fds.items():
            if _signal(fd, signal.SIGTERM):
                signalled.add(pid)
        alive = await _wait_exit(fds, grace)
        for pid in alive:
            _signal(fds[pid], signal.SIGKILL)
        await _wait_exit({p: fds[p] for p in alive}, KILL_WAIT)
        return signalled
    finally:
        for fd in fds.values():
            os.close(fd)


def _signal(pidfd: int, sig: int) -> bool:
    try:
        signal.pidfd_send_signal(pidfd, sig)
        return True
    except ProcessLookupError:
        return False


async def _wait_exit(fds: dict[int, int], timeout: float) -> list[int]:
    """The pids still alive after `timeout` (a pidfd polls readable when its process ends)."""
    alive = dict(fds)

    async def wait_one(pid, fd):
        await trio.lowlevel.wait_readable(fd)
        alive.pop(pid, None)

    with trio.move_on_after(timeout):
        async with trio.open_nursery() as nursery:
            for pid, fd in fds.items():
                nursery.start_soon(wait_one, pid, fd)
    return list(alive)
