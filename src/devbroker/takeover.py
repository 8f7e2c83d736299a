"""Live upgrade, the successor's side: `devbroker run --takeover-fd FD` (upgrade.py has the
protocol and the running broker's side; docs/operations.md the operator's).

The successor imports and builds everything slow while its predecessor still serves, says
hello, receives the state and the file descriptors, rebuilds the books into a new
BrokerService (build_service), says ready, and on ``go`` serves on the adopted descriptors.
It sits above daemon.py, whose BrokerService it builds; the running broker's side sits
below it, so the daemon can start an upgrade without reaching up.
"""
from __future__ import annotations

import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from devbroker.abi import registry
from devbroker.backends import realhandover
from devbroker.broker import handover
from devbroker.broker import metrics  # noqa: F401 - its name tables, built before the hello
from devbroker.broker.callstats import CallStats
from devbroker.broker.policy import default_policy, load_policy_text
from devbroker.daemon import BrokerService, run_forever
from devbroker.frontends.seccomp import SeccompSupervisor, get_notif_sizes
from devbroker.upgrade import (DRAIN_TIMEOUT, GO_TIMEOUT, HELLO_TIMEOUT, Channel,
                               UpgradeError, close_fds)


@dataclass
class Adopted:
    """What a successor serves on, handed over by its predecessor."""

    fuse: tuple[int, dict]  # the /dev/fuse fd and the front end's exported tables
    control: socket.socket
    seccomp: socket.socket
    oci: socket.socket  # RUN_DIR/oci-seccomp.sock (container runtimes' hand-overs)
    metrics: socket.socket | None
    # seccomp supervisors with their listener fds, served once the successor serves
    supervisors: list
    from_pid: int
    books: dict  # handover.books() right after the import, before serving
    sessions: int


def build_service(run_dir: str | Path, state: dict[str, Any], fds: list[int]) -> BrokerService:
    """A BrokerService with the predecessor's books, not yet serving."""
    if state.get("format") != handover.FORMAT:
        raise handover.HandoverError(f"hand-over format {state.get('format')} (this broker "
                                     f"reads {handover.FORMAT})")
    want = state.get("fd_count", 5 if state.get("metrics") else 4)
    if len(fds) != want:
        raise handover.HandoverError(f"{len(fds)} file descriptors handed over, {want} expected")
    source = state["policy"]["source"]
    policy = load_policy_text(state["policy"]["text"], source or "<handed over>")
    name = state["backend"]["name"]
    if name == "real":
        # The predecessor's relay and files (backends/realhandover.py), not a new relay.
        backend, files = realhandover.import_real(
            state["backend"]["state"], [fds[i] for i in state["backend"]["fds"]])
        service = BrokerService(policy, run_dir, backend=backend,
                                audit_path=state["audit_path"], policy_source=source,
                                runtime_tenants=state.get("runtime_tenants"))
        backend.notice = lambda m: service.audit.write("notice", message=m)
        backend.notice(f"real backend: relay pid {backend.relay.pid} adopted with "
                       f"{len(files)} session files")
    elif name == "emulated":
        service = BrokerService(policy, run_dir, backend=name,
                                audit_path=state["audit_path"], policy_source=source,
                                runtime_tenants=state.get("runtime_tenants"))
        files = handover.import_emulated(service.backend, state["backend"]["state"])
    else:
        raise handover.HandoverError(f"backend {name} cannot be taken over")
    handover.import_broker(service.broker, state["broker"], files)
    service.callstats.import_state(state["callstats"])
    service.alerts.import_state(state["alerts"])
    metrics_sock = None
    if state.get("metrics"):
        metrics_sock = socket.socket(fileno=fds[4])
    supervisors = []
    if state.get("seccomp"):
        sizes = get_notif_sizes()
        for sup_state in state["seccomp"]:
            service.check_tenant(sup_state["tenant"])
            listener, inotify = (fds[i] for i in sup_state["fds"])
            sup = SeccompSupervisor.adopt(service.front, sup_state, inotify, sizes=sizes)
            supervisors.append((sup, listener))
    service.adopted = Adopted(fuse=(fds[0], state["fuse"]),
                              control=socket.socket(fileno=fds[1]),
                              seccomp=socket.socket(fileno=fds[2]),
                              oci=socket.socket(fileno=fds[3]), metrics=metrics_sock,
                              supervisors=supervisors,
                              from_pid=int(state["from_pid"]),
                              books=handover.books(service.broker),
                              sessions=len(service.broker.sessions))
    return service


def takeover_main(run_dir: str, fd: int) -> int:
    """`devbroker run --takeover-fd FD`: the successor's side."""
    # Everything slow happens before the hello, while the predecessor still serves: imports,
    # the ABI tables of every driver version, the metric name tables; at the low priority the
    # predecessor started us with (hand_over), which is given back before the hello.
    _warm_up(run_dir)
    try:
        prio = int(os.environ.pop("DEVBROKER_PRIORITY", ""))
        os.setpriority(os.PRIO_PROCESS, 0, prio)  # lowering niceness: root may
    except (ValueError, PermissionError):
        pass
    sock = socket.socket(fileno=fd)
    return trio.run(_takeover, run_dir, sock)


def _warm_up(run_dir: str) -> None:
    for version in registry.versions():
        registry.get(version)
    CallStats()
    # A throwaway service on the built-in policy: the first construction imports and builds
    # what later ones reuse (about 20 ms here), which must not fall into the pause. It
    # touches no file (the audit log opens on its first record, which it never gets).
    BrokerService(default_policy(), run_dir, backend="emulated")


async def _takeover(run_dir: str, sock: socket.socket) -> int:
    chan = Channel(trio.socket.from_stdlib_socket(sock))
    await chan.send({"format": handover.FORMAT, "pid": os.getpid()})
    fds: list[int] = []
    try:
        with trio.fail_after(HELLO_TIMEOUT + DRAIN_TIMEOUT):
            state, fds = await chan.recv()
    except (EOFError, OSError, ValueError, UpgradeError, trio.TooSlowError) as e:
        close_fds(fds)
        print(f"devbroker: live upgrade: no state from the running broker: {e}",
              file=sys.stderr, flush=True)
        return 1
    try:
        service = build_service(run_dir, state, fds)
    except Exception as e:  # noqa: BLE001 - any refusal is reported and calls the upgrade off
        close_fds(fds)
        await chan.send({"ready": False, "error": f"{type(e).__name__}: {e}"})
        print(f"devbroker: live upgrade: cannot take over: {e}", file=sys.stderr, flush=True)
        return 1
    await chan.send({"ready": True})
    try:
        with trio.fail_after(GO_TIMEOUT):
            go, _ = await chan.recv()
    except (EOFError, OSError, ValueError, trio.TooSlowError) as e:
        go = {"error": str(e)}
    if not go.get("go"):
        # The running broker still serves: close our copies, unmount nothing.
        close_fds([service.adopted.fuse[0]])
        print(f"devbroker: live upgrade called off: {go.get('error', go)}", file=sys.stderr,
              flush=True)
        return 1

    async def started():
        await chan.send({"serving_at": time.monotonic(), "serving_wall": time.time(),
                         "pid": os.getpid()})
        print(f"devbroker: took over from pid {service.adopted.from_pid} "
              f"({len(service.broker.sessions)} open files)", file=sys.stderr, flush=True)

    try:
        await run_forever(service, quiet=True, started=started)
    finally:
        if not service.handed_over:
            service.backend.stop()
        service.audit.close()
    return 0
