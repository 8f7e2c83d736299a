"""Live upgrade, the state part: the broker's books as plain data, and back.

A running broker hands everything a successor process needs to go on serving the same
tenants (src/devbroker/upgrade.py moves it, with the file descriptors, over a Unix socket):

- the running policy (its canonical TOML: the successor validates it with its own code);
- the broker core's state: tenants with their counters, RM clients and object trees (hence
  the quota accounting), sessions (the open files) with their callers and pid namespaces,
  which client belongs to which tenant and file (the client registry), the id counter, the
  one-time notices;
- the backend's state (emulated backend: its open files, clients, objects and memory used);
- the per-call counters and the alert state (so that counters go on rising and an alert that
  is on is not raised twice);
- the FUSE front end's inode and open-file tables (frontends/fuse.py: export_state).

Everything is JSON (no pickle): the successor is *new code*, possibly with other classes, and
must be able to read the state with a format it knows and refuse one it does not. The format
is versioned (FORMAT). This module reads and writes the Broker's attributes by name and does
not change the core; :func:`check_supported` refuses an export when the core or the backend
grew state this module does not know of (a field added without a hand-over would otherwise be
silently lost in an upgrade); tests/test_upgrade.py keeps the lists honest.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Any

FORMAT = 1

# What the hand-over carries (or deliberately leaves, with the reason in the comment). A
# name appearing on the live objects and missing here stops an upgrade (check_supported).
BROKER_ATTRS = frozenset({
    "backend", "audit", "policy", "sessions", "tenants", "clients", "_ids", "_logged_once",
    "_squats",  # client-squat records written per tenant (their thinning goes on)
    "memgate",  # rebuilt: its stalled threads belong to the old process
    "recorder",  # an upgrade is refused while recording (check_supported)
    "on_policy_change", "spawn", "_trio_token",  # set up by the successor's daemon
    "control_lane", "continue_lane",  # plans derived again; counters start afresh
    # rebuilt: the successor watches every process holding a tenant's files (import_broker)
    "quota_watch",
    "preemption",  # who is preempted, its counters (Preemption.export)
})
SESSION_FIELDS = frozenset({"id", "tenant", "node", "minor", "caller", "file", "closed",
                            "pidns", "prepared"})
TENANT_FIELDS = frozenset({"name", "policy", "limiter", "sessions", "clients", "abi_by_tgid",
                           "refusals", "requests", "continued", "managed"})
CLIENT_FIELDS = frozenset({"handle", "session", "tgid", "objects",
                           # running totals: rebuilt from the objects
                           "charged", "devices", "pinned_total",
                           # not carried: the successor's search for groups the driver
                           # made starts at the client's first picked handle
                           "groups_from"})
OBJECT_FIELDS = frozenset({"handle", "rm_class", "parent", "gpu", "charged", "pinned",
                           "children",
                           "share",  # duplicate groups: exported as groups of handles
                           "owner",  # the client holding it: rebuilt
                           "tenant_share",  # a broad share kept in the books (shares.py)
                           # an index's removal hook (compute's channel groups): the
                           # successor's compute._discover rebuilds the index and the hooks
                           "watch"})
EMULATED_ATTRS = frozenset({"version", "_gpus", "abi", "files", "clients", "_file_ids",
                            "_client_ids", "_object_ids", "used", "notice", "_noticed",
                            "memblock_size", "started",
                            "_notices_of",  # notices said per kind: the successor says anew
                            "_calls",  # its lock: the successor's is new
                            "_card_entries",  # a cache of CARD_INFO's bytes: rebuilt on use
                            # indexes: rebuilt from the clients and checked against `used`
                            "_clients_of_file", "_devices_on", "_held",
                            # its checkpoint model: the processes locked or checkpointed
                            "checkpointer"})
EMU_FILE_FIELDS = frozenset({"id", "node", "minor", "mapping", "registered_ctl", "export",
                             "attached"})
EMU_CLIENT_FIELDS = frozenset({"handle", "file_id", "tgid", "objects", "next_generated"})
EMU_OBJECT_FIELDS = frozenset({"handle", "rm_class", "parent", "gpu", "size", "children",
                               "share", "client", "policies", "tied"})
# frontends/fuse.py exports these itself (FuseFrontend.export_state)
FUSE_INODE_FIELDS = frozenset({"nodeid", "kind", "parent", "name", "tenant", "node", "content",
                               "children", "nlookup", "removed"})
FUSE_HANDLE_FIELDS = frozenset({"kind", "inode", "session", "data", "listing", "served_pages",
                                "poll_kh", "opener", "opener_ns", "passed"})
# frontends/seccomp.py exports these itself (SeccompSupervisor.export_for_handover)
SUPERVISOR_ATTRS = frozenset({
    "tenant", "nodes", "real_files", "stats", "sessions",
    "_by_wd",  # rebuilt from the sessions (their watches are the inotify instance's, passed)
    "_ifd", "_lfd", "_listener",  # passed (SCM_RIGHTS): the inotify instance, the listener
    "_pending",  # empty once paused (pause_for_handover waits for it)
    "_callers",  # a cache of thread pidfds: the successor fills its own
    "_kept_rows",  # a cache of rules.ESCAPES' answer_kept by ioctl: derived again
    # the successor's own: its broker, tables it derives again, threads, locks, events
    "broker", "nvidia_majors", "_basenames", "sizes", "_memfd_dev", "_lfd_refs", "_live",
    "_leaving",
    "_threads_lock", "_recv_lock", "_stopping", "_serving", "_token", "_nursery", "_hup",
    "_changed", "closed", "_handover_hold",
    # calls waiting for their pace token (cancelled by the pause) and those found so:
    # exported as "undecided", answered by the successor
    "_pace_waiters", "_undecided",
    "_listener_tids",  # the ids of this process's listener threads
    "_gate",  # the broker's memory gate (a cached property): the successor's broker's
    "_lane", "_lane_cmds", "_clane",  # the successor's broker's lanes
    # the native loop (frontends/nativelane.py): its threads fold their counters into
    # `stats` at every return and hold no sessions; the successor starts its own
    "_native_lib", "_native",
    # prepared opens: taken back from the loop and closed by pause_for_handover (their
    # sessions end through their watches); the successor prepares its own after its
    # tenants' next opens
    "_prepared", "_open_template", "_opened_paths",
})
SECCOMP_SESSION_FIELDS = frozenset({"id", "node", "minor", "key", "wd", "opener", "released",
                                    "real",
                                    # not carried: the successor's native loop holds no
                                    # file fact of the file (False there: its continuation
                                    # facts for it stay the file's own)
                                    "file_fact"})


class HandoverError(Exception):
    """This broker's state cannot be handed over (the reason says why); nothing changed."""


def field_names(cls) -> frozenset[str]:
    """The fields of a dataclass: what a check of check_supported compares."""
    return frozenset(f.name for f in dataclasses.fields(cls))


def check_supported(broker, *, frontends: dict[str, int] | None = None,
                    front_state=()) -> None:
    """Raise HandoverError unless every piece of state can be carried: the broker's and the
    backend's, and the front ends' (`front_state`: (what, names it has, names carried) for
    each, from upgrade.front_end_state: the front ends sit above this module)."""
    from devbroker.backends.emulated import EmuClient, EmuFile, EmuObject
    from devbroker.broker.core import Session, TenantState
    from devbroker.broker.objects import RmClient, RmObject

    if broker.backend.handover_format is None:
        raise HandoverError(f"the {broker.backend.name} backend cannot be handed over")
    if broker.recorder is not None:
        raise HandoverError("the broker is recording (--record): restart it without, then "
                            "upgrade")
    if why := broker.preemption.handover_refusal():
        raise HandoverError(why)
    for name, n in (frontends or {}).items():
        if n:
            raise HandoverError(f"{n} tenant(s) attached through the {name} front end cannot "
                                "be handed over yet (FUSE and attached seccomp listeners can)")
    checks = [
        ("the broker", set(vars(broker)), BROKER_ATTRS),
        ("a session", field_names(Session), SESSION_FIELDS),
        ("a tenant", field_names(TenantState), TENANT_FIELDS),
        ("an RM client", field_names(RmClient), CLIENT_FIELDS),
        ("an RM object", field_names(RmObject), OBJECT_FIELDS),
        ("an emulated file", field_names(EmuFile), EMU_FILE_FIELDS),
        ("an emulated client", field_names(EmuClient), EMU_CLIENT_FIELDS),
        ("an emulated object", field_names(EmuObject), EMU_OBJECT_FIELDS),
        *front_state,
    ]
    if broker.backend.handover_format == "emulated":
        checks.append(("the emulated backend", set(vars(broker.backend)), EMULATED_ATTRS))
    else:  # backends/realhandover.py carries the relay, its files and the tenant files
        from devbroker.backends.realhandover import unknown_state

        checks += [(what, set(names), frozenset()) for what, names in
                   unknown_state(broker.backend)]
    for what, have, known in checks:
        unknown = sorted(have - known)
        if unknown:
            raise HandoverError(f"{what} has state the hand-over does not carry: "
                                f"{', '.join(unknown)} (broker/handover.py)")


def _next(counter: itertools.count) -> int:
    """The value an itertools.count would give next (consumes it: the exporter is done)."""
    return next(counter)


def _key(k: Any) -> Any:
    return list(k) if isinstance(k, tuple) else k


def _unkey(k: Any) -> Any:
    return tuple(_unkey(x) for x in k) if isinstance(k, list) else k


def books(broker) -> dict[str, Any]:
    """Per tenant: memory used per GPU, RM clients and objects, open files (the accounting a
    predecessor and its successor must agree on, compared in the upgrade's audit records)."""
    out = {}
    for key, t in broker.tenants.items():
        out[key] = {"memory": {str(g): n for g, n in sorted(t.used().items())},
                    "clients": len(t.clients),
                    "objects": sum(len(c.objects) for c in t.clients.values()),
                    "open_files": len(t.sessions)}
    return out


def _share_groups(clients) -> list[list[list[int]]]:
    """Duplicate groups (RM_DUP_OBJECT: one object under several handles, possibly in
    several clients): each as [[client handle, object handle], ...] in the group's order."""
    groups: dict[int, list] = {}
    for c in clients:
        for obj in c.objects.values():
            if obj.share is not None:
                groups.setdefault(id(obj.share), obj.share)
    out = []
    for members in groups.values():
        out.append([[_client_handle(m), m.handle] for m in members])
    return out


def _client_handle(obj) -> int:
    holder = getattr(obj, "owner", None) or getattr(obj, "client", None)
    return holder.handle


def _link_shares(groups, clients: dict[int, Any]) -> None:
    for group in groups:
        members = [clients[c].objects[h] for c, h in group]
        for m in members:
            m.share = members


# ------------------------------------------------------------------------------ broker core
def _objects(objects: dict) -> list[list]:
    return [[o.handle, o.rm_class, o.parent, o.gpu, o.charged, sorted(o.children),
             o.tenant_share, o.pinned] for o in objects.values()]


def export_broker(broker, file_id=lambda f: f.id) -> dict[str, Any]:
    """The core's books; each session's backend file as file_id(file) (the emulated
    backend's own ids; the real backend's hand-over numbers its files itself)."""
    from devbroker.broker.core import _RevokedTenant

    tenants = []
    for key, t in broker.tenants.items():
        tenants.append({
            "key": key, "name": t.name, "revoked": isinstance(t.policy, _RevokedTenant),
            "refusals": t.refusals, "requests": t.requests, "continued": t.continued,
            "rate_limited": t.limiter.waited,
            "managed": t.managed.export(),
            "abi_by_tgid": [[tgid, abi.version] for tgid, abi in t.abi_by_tgid.items()],
            "clients": [{"handle": c.handle, "session": c.session, "tgid": c.tgid,
                         "objects": _objects(c.objects)} for c in t.clients.values()],
            "shares": _share_groups(t.clients.values()),
        })
    tenant_key = {id(t): key for key, t in broker.tenants.items()}
    sessions = []
    for s in broker.sessions.values():
        sessions.append({
            "id": s.id, "tenant": tenant_key[id(s.tenant)], "node": int(s.node),
            "minor": s.minor, "caller": [s.caller.pid, s.caller.tid, s.caller.uid, s.caller.gid],
            "file": file_id(s.file), "clients": sorted(broker.clients.of_session(s.id)),
            "closed": s.closed,
            "pidns": s.pidns,
            "prepared": s.prepared,
        })
    return {
        "next_id": _next(broker._ids),
        "tenants": tenants,
        "sessions": sessions,
        # (the tenants' clients and the sessions say it too; kept: the format is unchanged)
        "client_owner": [[h, name] for h, name in broker.clients.owners()],
        "logged_once": [_key(k) for k in broker._logged_once],
        "squats": dict(broker._squats),
        "preemption": broker.preemption.export(),
    }


def import_broker(broker, state: dict[str, Any], files: dict[int, Any]) -> None:
    """Put exported books into a freshly built Broker (same policy, backend imported)."""
    from devbroker.abi import registry
    from devbroker.abi.nodes import NodeKind
    from devbroker.broker.core import Session, TenantState, _RevokedTenant
    from devbroker.broker.interface import Caller
    from devbroker.broker.objects import ClientRegistry, RmClient, RmObject
    from devbroker.broker.ratelimit import TokenBucket

    for td in state["tenants"]:
        key = td["key"]
        if td["revoked"]:
            t = broker.tenants[key] = TenantState(td["name"], _RevokedTenant(),
                                                  TokenBucket(0, 0))
        else:
            t = broker.tenants.get(key)
            if t is None:
                raise HandoverError(f"tenant {key!r} of the running broker is not in the "
                                    "policy the successor loaded")
        t.refusals, t.requests, t.continued = td["refusals"], td["requests"], td["continued"]
        t.limiter.waited = td["rate_limited"]
        # (a predecessor that kept a per-process allowance instead has nothing to give)
        t.managed.load(td.get("managed", []))
        t.abi_by_tgid = {int(tgid): registry.get(v) for tgid, v in td["abi_by_tgid"]}
    broker.sessions = {}
    for sd in state["sessions"]:
        t = broker.tenants[sd["tenant"]]
        s = Session(sd["id"], t, NodeKind(sd["node"]), sd["minor"], Caller(*sd["caller"]),
                    files[sd["file"]], closed=sd["closed"], pidns=sd["pidns"],
                    prepared=bool(sd.get("prepared", False)))
        broker.sessions[s.id] = s
        t.sessions[s.id] = s
    # The quota watch's list of processes is not passed: the successor watches every
    # process that holds a tenant's files (a superset), from its first look on.
    if broker.quota_watch is not None:
        for t in broker.tenants.values():
            for tgid in t.tgids():
                broker.quota_watch.watch(tgid, t.name)
    # The clients go into the registry through their sessions, in the order they were made
    # (that of client_owner), each into its tenant's books.
    made = {}
    for td in state["tenants"]:
        for cd in td["clients"]:
            # (a predecessor without share books sends six fields, one without pinned
            # host memory seven: nothing kept)
            objects = {handle: RmObject(handle, cls, parent, gpu=gpu, charged=charged,
                                        children=set(children),
                                        tenant_share=int(rest[0]) if rest else 0,
                                        pinned=int(rest[1]) if len(rest) > 1 else 0)
                       for handle, cls, parent, gpu, charged, children, *rest
                       in cd["objects"]}
            # RmClient's running totals and each object's owner follow from its objects.
            c = RmClient(cd["handle"], cd["session"], cd["tgid"], objects=objects)
            s = broker.sessions.get(c.session)
            if s is None or s.tenant is not broker.tenants[td["key"]]:
                raise HandoverError(f"client {c.handle:#x} of tenant {td['key']!r} names "
                                    f"session {c.session}, not an open file of that tenant")
            made[c.handle] = (s, c)
    broker.clients = ClientRegistry()
    for h in dict.fromkeys([int(h) for h, _ in state["client_owner"]] + list(made)):
        if h in made:
            broker.clients.add(*made[h])
    for td in state["tenants"]:
        _link_shares(td.get("shares", []), broker.tenants[td["key"]].clients)
    # The three records of who holds what must agree.
    owners = {int(h): t for h, t in state["client_owner"]}
    if dict(broker.clients.owners()) != owners or any(
            set(sd["clients"]) != broker.clients.of_session(sd["id"])
            for sd in state["sessions"]):
        raise HandoverError("the exported books disagree on which tenant and file hold "
                            "which client (client_owner, the tenants' clients and the "
                            "sessions' clients)")
    broker._ids = itertools.count(int(state["next_id"]))
    broker._logged_once = {_unkey(k) for k in state["logged_once"]}
    # (absent from a predecessor that kept no such count)
    broker._squats = {str(t): int(n) for t, n in state.get("squats", {}).items()}
    broker.preemption.restore_state(state.get("preemption", {}))


# ------------------------------------------------------------------------------ emulated backend
def export_emulated(backend) -> dict[str, Any]:
    return {
        "version": backend.version,
        "files": [[f.id, int(f.node), f.minor, f.mapping.hex() if f.mapping is not None
                   else None, f.registered_ctl, f.attached,
                   None if f.export is None else
                   [f.export.client.handle, f.export.device_instance, f.export.metadata.hex(),
                    list(f.export.slots)]] for f in backend.files.values()],
        "clients": [{"handle": c.handle, "file_id": c.file_id, "tgid": c.tgid,
                     "next_generated": c.next_generated,
                     "objects": [[o.handle, o.rm_class, o.parent, o.gpu, o.size,
                                  sorted(o.children), [list(p) for p in o.policies],
                                  sorted(o.tied)]
                                 for o in c.objects.values()]}
                    for c in backend.clients.values()],
        "shares": _share_groups(backend.clients.values()),
        "next_file": _next(backend._file_ids), "next_client": _next(backend._client_ids),
        "next_object": _next(backend._object_ids),
        "used": [[g, n] for g, n in backend.used.items()],
        "noticed": [_key(k) for k in backend._noticed],
        "memblock_size": backend.memblock_size, "started": backend.started,
        "checkpointed": sorted([pid, st] for pid, st in backend.checkpointer.states.items()),
    }


def import_emulated(backend, state: dict[str, Any]) -> dict[int, Any]:
    """Fill a fresh EmulatedBackend; returns its files by id (for the broker's sessions)."""
    from devbroker.abi.nodes import NodeKind
    from devbroker.backends.emulated import EmuClient, EmuFile, EmuObject

    if state["version"] != backend.version:
        raise HandoverError(f"the emulated driver version changed ({state['version']} -> "
                            f"{backend.version})")
    backend.files = {}
    exports = {}
    for fid, node, minor, mapping, registered, attached, export in state["files"]:
        backend.files[fid] = EmuFile(fid, NodeKind(node), minor,
                                     bytes.fromhex(mapping) if mapping is not None else None,
                                     registered, attached=attached)
        if export is not None:
            exports[fid] = export
    backend.clients = {}
    for cd in state["clients"]:
        c = EmuClient(cd["handle"], cd["file_id"], cd["tgid"],
                      next_generated=int(cd.get("next_generated", 0)))
        for handle, cls, parent, gpu, size, children, *rest in cd["objects"]:
            c.objects[handle] = EmuObject(handle, cls, parent, gpu=gpu, size=size,
                                          children=set(children), client=c,
                                          policies=[tuple(p) for p in (rest[0] if rest
                                                                       else [])],
                                          tied=set(rest[1]) if len(rest) > 1 else set())
        backend.clients[c.handle] = c
    _link_shares(state.get("shares", []), backend.clients)
    from devbroker.backends.emulated_export import ExportSlots
    for fid, (handle, instance, metadata, slots) in exports.items():
        backend.files[fid].export = ExportSlots(backend.clients[handle], instance,
                                                bytes.fromhex(metadata), list(slots))
    backend._file_ids = itertools.count(int(state["next_file"]))
    backend._client_ids = itertools.count(int(state["next_client"]))
    backend._object_ids = itertools.count(int(state["next_object"]))
    # The indexes (memory used and held per process, devices, clients per file) are
    # rebuilt from the clients, and must come to the memory the exporter had in use.
    backend.used = {g.index: 0 for g in backend.gpus()}
    # (before the index: a checkpointed process's memory is not on the GPU)
    backend.checkpointer.states = {int(pid): st for pid, st in state.get("checkpointed", [])}
    backend._clients_of_file, backend._devices_on, backend._held = {}, {}, {}
    for c in backend.clients.values():
        backend._clients_of_file.setdefault(c.file_id, set()).add(c.handle)
        for obj in c.objects.values():
            backend._index(c, obj)
    exported = {int(g): int(n) for g, n in state["used"]}
    if {g: n for g, n in backend.used.items() if n} != {g: n for g, n in exported.items() if n}:
        raise HandoverError(f"the emulated backend's objects come to {backend.used} bytes "
                            f"in use, its books said {exported}")
    backend._noticed = {_unkey(k) for k in state["noticed"]}
    backend.memblock_size = state["memblock_size"]
    backend.started = state["started"]
    return backend.files
