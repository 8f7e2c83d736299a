"""Live upgrade: a new broker process takes over from the running one while tenants keep
making calls (docs/operations.md has the operator's side).

`devbroker upgrade` asks the running broker (control op ``upgrade``). The running broker:

1. starts its successor — ``python -m devbroker.cli.main run --takeover-fd N``, the code
   installed *now*, in the same service cgroup and with the same stdout/stderr — with one end
   of a Unix socketpair, and waits for its hello (it has imported everything it needs);
2. freezes: stops the metrics endpoint and the seccomp hand-over socket from accepting
   (connections wait in their backlogs), stops reading FUSE requests and waits until every
   request already read has been answered (tenants' further calls wait in the kernel's FUSE
   queue: none fails, none is lost);
3. sends its state (broker/handover.py: JSON) with the file descriptors the successor serves
   on, by SCM_RIGHTS: the /dev/fuse connection, the control socket, the seccomp hand-over
   socket and the metrics socket, all listening or connected as they are;
4. waits for the successor to say it has rebuilt the books (``ready``), tells it to go,
   and steps aside: it closes its copies without unmounting or closing anything the
   successor serves, answers the operator with the successor's pid and the pause, and exits.

The successor serves from the first request the kernel hands it, tells a service manager it
is the service's main process now (sd_notify READY=1, MAINPID=), and acknowledges. Until
``go``, any failure (the successor dies, refuses the state, takes too long) calls the upgrade
off: the running broker resumes reading where it stopped and nobody noticed anything but
the pause. What is not carried yet is refused up front (handover.check_supported).
The successor's side is takeover.py: it builds a BrokerService (daemon.py), which starts
upgrades through this module.
"""
from __future__ import annotations

import array
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import time
from typing import Any

import trio

from devbroker.broker import handover
from devbroker.frontends.fuse import _Handle, _Inode
from devbroker.frontends.seccomp import Session as SeccompSession

HELLO_TIMEOUT = 60.0  # the successor's start (Python, imports) on a busy machine
DRAIN_TIMEOUT = 10.0  # requests in flight to finish (a rate-limited tenant may be waiting)
READY_TIMEOUT = 30.0  # the successor to rebuild the books
GO_TIMEOUT = 30.0
WARM_UP_NICENESS = 10
MAX_MESSAGE = 1 << 30
# File descriptors per message (the kernel's SCM_MAX_FD is 253); more go in batches ahead of
# the message they belong to (two per seccomp listener: many tenants make many).
MAX_FDS = 250


class UpgradeError(Exception):
    """The upgrade was refused or called off; the running broker goes on serving."""


# ------------------------------------------------------------------------------ the wire
class Channel:
    """Length-prefixed JSON messages with file descriptors (SCM_RIGHTS) over a trio Unix
    stream socket."""

    _HEADER = struct.Struct("!Q")

    def __init__(self, sock):
        self.sock = sock
        self._buf = b""
        self._fds: list[int] = []  # received with the batches ahead of a message

    async def send(self, obj: Any, fds: list[int] = ()) -> None:
        fds = list(fds)
        while len(fds) > MAX_FDS:
            await self._send({"fds_follow": True}, fds[:MAX_FDS])
            fds = fds[MAX_FDS:]
        await self._send(obj, fds)

    async def recv(self) -> tuple[Any, list[int]]:
        while True:
            try:
                obj, fds = await self._recv()
            except BaseException:
                close_fds(self._fds)
                self._fds = []
                raise
            self._fds.extend(fds)
            if not (isinstance(obj, dict) and obj.get("fds_follow")):
                fds, self._fds = self._fds, []
                return obj, fds

    async def _send(self, obj: Any, fds: list[int]) -> None:
        data = json.dumps(obj, separators=(",", ":")).encode()
        buf = memoryview(self._HEADER.pack(len(data)) + data)
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        n = await self.sock.sendmsg([buf[:1 << 16]], anc)
        buf = buf[n:]
        while buf:
            n = await self.sock.send(buf)
            buf = buf[n:]

    async def _recv(self) -> tuple[Any, list[int]]:
        fds: list[int] = []
        while len(self._buf) < self._HEADER.size or len(self._buf) < self._need():
            data, anc, flags, _ = await self.sock.recvmsg(
                1 << 16, socket.CMSG_SPACE(MAX_FDS * 4), socket.MSG_CMSG_CLOEXEC)
            for level, typ, d in anc:
                if level == socket.SOL_SOCKET and typ == socket.SCM_RIGHTS:
                    fds.extend(array.array("i", d[:len(d) - len(d) % 4]))
            if flags & socket.MSG_CTRUNC:
                close_fds(fds)
                raise UpgradeError("more file descriptors than expected")
            if not data:
                close_fds(fds)
                raise EOFError("the other broker process closed the connection")
            self._buf += data
        n = self._need()
        obj, self._buf = json.loads(self._buf[self._HEADER.size:n]), self._buf[n:]
        return obj, fds

    def _need(self) -> int:
        (length,) = self._HEADER.unpack_from(self._buf)
        if length > MAX_MESSAGE:
            raise UpgradeError(f"a message of {length} bytes")
        return self._HEADER.size + length


def close_fds(fds) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _attached(service) -> dict[str, int]:
    """Tenants attached (or being attached) through front ends a hand-over cannot carry.
    Attached seccomp listeners pass; one being attached at the freeze (its hand-over
    connection accepted, not yet served) does not."""
    return {"seccomp (being attached)": service._attaching + service.oci_agent.busy,
            "container stat shim": len(service.stat_shims)}


def front_end_state(supervisors=()) -> list[tuple[str, frozenset[str] | set[str], frozenset[str]]]:
    """The front ends' state the hand-over carries, for handover.check_supported: the FUSE
    tables' records, and the seccomp supervisors given with their sessions."""
    checks = [("a FUSE inode", handover.field_names(_Inode), handover.FUSE_INODE_FIELDS),
              ("a FUSE open file", handover.field_names(_Handle), handover.FUSE_HANDLE_FIELDS)]
    if supervisors:
        checks.append(("a seccomp session", handover.field_names(SeccompSession),
                       handover.SECCOMP_SESSION_FIELDS))
        checks += [("a seccomp supervisor", set(vars(sup)), handover.SUPERVISOR_ATTRS)
                   for sup in supervisors]
    return checks


def sd_notify(state: str) -> bool:
    """Tell a service manager (systemd Type=notify) something; False when there is none."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(addr)
            s.sendall(state.encode())
    except OSError:
        return False
    return True


# ------------------------------------------------------------------------------ the running broker
def export_service(service) -> tuple[dict[str, Any], list[int]]:
    """The whole state of a paused broker service, as JSON-able data, and the backend's
    file descriptors that go with it (the real backend's relay channels and files)."""
    from devbroker.broker.effects import STATE_LOCK

    with STATE_LOCK:  # nothing should run now (paused); the books' lock says so for sure
        return _export_service(service)


def _export_service(service) -> tuple[dict[str, Any], list[int]]:
    metrics = service.metrics.address if service.metrics is not None else None
    backend_fds: list[int] = []
    if service.backend.handover_format == "real":
        from devbroker.backends import realhandover

        files = realhandover._files_of(service.broker)
        index = {id(f): i for i, f in enumerate(files)}
        backend_state, backend_fds = realhandover.export_real(service.backend, files)
        broker_state = handover.export_broker(service.broker, lambda f: index[id(f)])
    else:
        backend_state = handover.export_emulated(service.backend)
        broker_state = handover.export_broker(service.broker)
    return {
        "format": handover.FORMAT,
        "from_pid": os.getpid(),
        # the file's policy, and the tenants added at run time (broker/tenancy.py) apart
        "policy": {"text": service.tenancy.file_policy.to_toml(),
                   "source": service.policy_source},
        "runtime_tenants": service.tenancy.export(),
        "audit_path": str(service.audit.path) if service.audit.path else None,
        "backend": {"name": service.backend.name, "state": backend_state},
        "broker": broker_state,
        "callstats": service.callstats.export_state(),
        "alerts": service.alerts.export_state(),
        "fuse": service.frontend.export_state(),
        "metrics": list(metrics) if metrics else None,
    }, backend_fds


async def hand_over(service, *, python: str | None = None):
    """The running broker's side (module doc, steps 1–4). Returns the control reply."""
    from devbroker.broker.control import Reply

    fe = service.frontend
    try:
        handover.check_supported(service.broker, frontends=_attached(service),
                                 front_state=front_end_state(service.supervisors))
    except handover.HandoverError as e:
        raise UpgradeError(f"live upgrade refused: {e}") from None
    t_start = time.monotonic()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    argv = [python or sys.executable, "-m", "devbroker.cli.main",
            "--run-dir", str(service.paths.run_dir), "run", "--takeover-fd", str(theirs.fileno())]
    # The successor starts (interpreter, imports, tables: about a second of CPU) at a low
    # priority, so that on a busy host this broker and its tenants keep the CPU; it takes
    # this process's priority back before the hand-over (takeover.takeover_main).
    env = dict(os.environ, DEVBROKER_PRIORITY=str(os.getpriority(os.PRIO_PROCESS, 0)))
    nice = shutil.which("nice")
    if nice is not None:
        argv = [nice, "-n", str(WARM_UP_NICENESS)] + argv
    try:
        proc = subprocess.Popen(argv, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                env=env)
    except OSError as e:
        ours.close()
        theirs.close()
        raise UpgradeError(f"live upgrade: cannot start {argv[0]}: {e}") from None
    theirs.close()
    chan = Channel(trio.socket.from_stdlib_socket(ours))
    metrics_sock = None
    frozen = t_freeze = None
    dups: list[socket.socket] = []
    sups: list = []  # the seccomp supervisors paused for the hand-over
    owned: list[int] = []  # fds the export opened for the successor only (the relay's pidfd)
    try:
        with trio.fail_after(HELLO_TIMEOUT):
            hello, _ = await chan.recv()
        if hello.get("format") != handover.FORMAT:
            raise UpgradeError(f"the new broker speaks hand-over format {hello.get('format')}, "
                               f"this one {handover.FORMAT}")
        # Freeze. Scrapes and seccomp hand-overs wait in their backlogs.
        if service.metrics is not None:
            metrics_sock = await trio.to_thread.run_sync(service.metrics.pause)
        service.stop_accepting_seccomp()
        service.oci_agent.stop_accepting()
        await trio.sleep(0)
        handover.check_supported(service.broker, frontends=_attached(service),
                                 front_state=front_end_state(service.supervisors))
        t_freeze, wall_freeze = time.monotonic(), time.time()
        frozen = True
        sups = list(service.supervisors)
        with trio.fail_after(DRAIN_TIMEOUT):
            # FUSE stops reading and every seccomp listener stops receiving; both answer
            # what they already hold. Tenants' further calls wait in the kernel.
            async with trio.open_nursery() as nursery:
                nursery.start_soon(fe.pause)
                for sup in sups:
                    nursery.start_soon(sup.pause_for_handover)
        t_drained = time.monotonic()
        if set(service.supervisors) != set(sups):  # cannot happen: accepting has stopped
            raise UpgradeError("a seccomp tenant was attached during the freeze")
        state, backend_fds = export_service(service)
        if service.backend.handover_format == "real":  # the relay's channels
            owned = [backend_fds[state["backend"]["state"]["fds"]["channels"]]]
        books = handover.books(service.broker)
        dups = [service.control.sock.dup(), service._seccomp_sock.dup(),
                service.oci_agent.sock.dup()]
        fds = [fe.fd] + [d.fileno() for d in dups]
        if metrics_sock is not None:
            fds.append(metrics_sock.fileno())
        # Each seccomp listener with its inotify instance (the session ends queued there).
        state["seccomp"] = []
        for sup in sups:
            sup_state, sup_fds = sup.export_for_handover()
            sup_state["fds"] = list(range(len(fds), len(fds) + len(sup_fds)))
            fds += sup_fds
            state["seccomp"].append(sup_state)
        # The real backend's relay channels, its pidfd and the broker's GPU files.
        state["backend"]["fds"] = list(range(len(fds), len(fds) + len(backend_fds)))
        fds += backend_fds
        state["fd_count"] = len(fds)
        await chan.send(state, fds)
        t_sent = time.monotonic()
        with trio.fail_after(READY_TIMEOUT):
            reply, _ = await chan.recv()
        t_ready = time.monotonic()
        if not reply.get("ready"):
            raise UpgradeError(f"the new broker refused the state: {reply.get('error')}")
        await chan.send({"go": True})
    except (Exception, trio.TooSlowError) as e:
        # Called off: this process serves on from where it stopped.
        if proc.poll() is None:
            proc.kill()
        await trio.to_thread.run_sync(proc.wait)
        for d in dups:
            d.close()
        close_fds(owned)
        for sup in sups:
            sup.resume_after_handover()
        if frozen:
            fe.resume()
        if metrics_sock is not None:
            cfg = service.broker.policy.broker.metrics
            service.metrics.start(cfg.host, metrics_sock.getsockname()[1], sock=metrics_sock)
        reason = ("the new broker did not answer in time" if isinstance(e, trio.TooSlowError)
                  else f"{type(e).__name__}: {e}" if not isinstance(e, UpgradeError) else str(e))
        raise UpgradeError(f"live upgrade called off, broker pid {os.getpid()} goes on "
                           f"serving: {reason}") from None
    # Committed: the successor serves the mount and the seccomp listeners from now on.
    service.handed_over = True
    for sup in sups:
        sup.detach_after_handover()
    close_fds(owned)
    service.control.keep_path()
    for d in dups:
        d.close()
    ack = {}
    with trio.move_on_after(GO_TIMEOUT):
        try:
            ack, _ = await chan.recv()
        except (EOFError, OSError, ValueError):
            pass
    serving_at = ack.get("serving_at")
    pause = (serving_at - t_freeze) if serving_at else None
    result = {"pid": proc.pid, "old_pid": os.getpid(),
              "pause_ms": round(pause * 1000, 3) if pause is not None else None,
              # wall-clock bounds of the pause, for comparing with what tenants saw
              "frozen_at": wall_freeze, "serving_at": ack.get("serving_wall"),
              "total_ms": round((time.monotonic() - t_start) * 1000, 1),
              "sessions": len(service.broker.sessions), "books": books,
              "seccomp_listeners": len(sups),
              # where the pause went: requests in flight answered, state exported and sent,
              # the successor's import, its start of serving
              "phases_ms": {"drain": _ms(t_drained - t_freeze), "export": _ms(t_sent - t_drained),
                            "import": _ms(t_ready - t_sent),
                            "start": _ms(serving_at - t_ready) if serving_at else None}}
    service.audit.write("upgrade", to_pid=proc.pid, pause_ms=result["pause_ms"],
                        total_ms=result["total_ms"], sessions=result["sessions"], books=books)
    return Reply(result, then=service.finish)


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)
