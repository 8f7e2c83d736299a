"""The operator's control socket: JSON lines over a Unix stream socket, with roles.

Requests: {"op": "status"}, {"op": "gpus"}, {"op": "policy.show"}, {"op": "policy.apply", "text": ..., "name": ...},
{"op": "tenant.dir", "tenant": ...}. Each gets one JSON line back: {"ok": true, ...} or
{"ok": false, "error": "..."}. A bad policy is refused with its line and reason, and the
running policy stays in force.

Who may ask what is decided per connection from the caller's kernel credentials
(SO_PEERCRED, and its groups from /proc, pinned with a pidfd so a recycled pid cannot stand
in for it), never from anything the caller says (a root tenant that reaches another
broker's socket must not be able to apply a policy there):

* **admin** (every op): uid 0, or a uid/group the policy's `[control] admin_uids` /
  `admin_groups` names;
* **read** (`status`, `gpus`, `policy.show`): a uid/group in `readonly_uids` / `readonly_groups`;
* nobody else. And only callers in the broker's own pid namespace get any role: a tenant of
  `devbroker exec` (or of any container) is in a pid namespace of its own, so even a root
  tenant that found a socket gets nothing.

The role is decided when the connection is accepted, before a byte of it is read: a caller
without one is closed at once (one audit record, paced per uid), so a world-connectable
socket costs an unprivileged user one short-lived fd per attempt, never a buffer. What a
connection may hold is bounded too: at most `MAX_PER_UID` connections of one uid (other
than root) and `MAX_CONNECTIONS` in all are served at a time (the rest are closed at
accept), and a request line is at most `MAX_READ_REQUEST` bytes for the read role
(`MAX_REQUEST` for admins, whose `policy.apply` carries a policy text).
"""
from __future__ import annotations

import contextvars
import errno
import inspect
import json
import os
import signal
import socket
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import trio

MAX_REQUEST = 1 << 20
MAX_READ_REQUEST = 4096  # `status` and `policy.show` requests are a few dozen bytes
MAX_CONNECTIONS = 64  # served at a time, all callers together
MAX_PER_UID = 8  # served at a time for one uid other than root
REFUSALS_PER_UID = 5  # audit records of refused connections per uid per second (then counted)
REQUEST_TIMEOUT = 10.0  # seconds a connection may take to send its request line
ROLE_READ = "read"
ROLE_ADMIN = "admin"
# The role each operation needs (anything not listed needs admin).
OP_ROLES = {"status": ROLE_READ, "policy.show": ROLE_READ, "gpus": ROLE_READ,
            "policy.apply": ROLE_ADMIN, "tenant.dir": ROLE_ADMIN}
_SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)  # Linux 6.5
# The caller of the request being handled (each connection is its own trio task, with its
# own context): handlers that audit what they change say who asked (current_peer()).
_PEER: contextvars.ContextVar["Peer | None"] = contextvars.ContextVar("peer", default=None)


def current_peer() -> "Peer | None":
    return _PEER.get()


@dataclass(frozen=True)
class Peer:
    """The process at the other end of a connection, as the kernel names it."""

    pid: int
    uid: int
    gid: int
    groups: frozenset[int]
    same_pidns: bool  # in the broker's own pid namespace

    def describe(self) -> str:
        return f"pid {self.pid} uid {self.uid} gid {self.gid}"


def peer_of(sock: socket.socket) -> Peer:
    """The credentials of a connected Unix socket's peer. Its groups and pid namespace are
    read from /proc/<pid>, and the peer is then checked to be alive through a pidfd taken
    for the connection (SO_PEERPIDFD; pidfd_open on older kernels): what was read was that
    very process, not one that got its pid later."""
    pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                        struct.calcsize("3i")))
    pidfd = -1
    try:
        try:
            pidfd = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERPIDFD)
        except OSError:
            pidfd = os.pidfd_open(pid) if pid > 0 else -1
        groups: set[int] = {gid}
        same = False
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("Groups:"):
                        groups.update(int(g) for g in line.split()[1:])
            same = os.readlink(f"/proc/{pid}/ns/pid") == os.readlink("/proc/self/ns/pid")
            if pidfd >= 0:
                signal.pidfd_send_signal(pidfd, 0)
            else:
                same = False
        except (OSError, ValueError):
            same = False  # gone, or unreadable: no role
        return Peer(pid, uid, gid, frozenset(groups), same)
    finally:
        if pidfd >= 0:
            os.close(pidfd)


def role_of(peer: Peer, access: Any) -> str | None:
    """The role a peer gets under a policy's ControlAccess (None: no role at all)."""
    if not peer.same_pidns:
        return None
    if (peer.uid == 0 or peer.uid in getattr(access, "admin_uids", ())
            or peer.groups & set(getattr(access, "admin_groups", ()))):
        return ROLE_ADMIN
    if (peer.uid in getattr(access, "readonly_uids", ())
            or peer.groups & set(getattr(access, "readonly_groups", ()))):
        return ROLE_READ
    return None


def allowed(role: str | None, op: str) -> bool:
    need = OP_ROLES.get(op, ROLE_ADMIN)
    return role == ROLE_ADMIN or (role == ROLE_READ and need == ROLE_READ)


class RefusalPacer:
    """How many records of refused connections a uid may write: REFUSALS_PER_UID a second;
    the ones left out are counted into its next record. Refusing must not let a caller
    without a role fill the disk (the control socket, the hand-over sockets)."""

    def __init__(self, per_second: int = REFUSALS_PER_UID, remember: int = 4096):
        self.per_second, self.remember = per_second, remember
        self._seen: dict[int, tuple[float, int, int]] = {}  # uid -> (second, n, left out)

    def admit(self, uid: int, now: float) -> str | None:
        """None: leave this one out; else the note to add to its record ("" or the count of
        those left out before it)."""
        second, count, dropped = self._seen.get(uid, (now, 0, 0))
        if now - second >= 1.0:
            second, count = now, 0
        if count >= self.per_second:
            self._seen[uid] = (second, count, dropped + 1)
            return None
        self._seen[uid] = (second, count + 1, 0)
        if len(self._seen) > self.remember:  # (uids seen: bounded, the oldest forgotten)
            self._seen.pop(next(iter(self._seen)))
        return f" ({dropped} more refused before this one, not recorded)" if dropped else ""


class Reply:
    """A handler's reply with something to do once it has been sent (live upgrade: the old
    broker exits only after telling the operator which process took over)."""

    def __init__(self, fields: dict, then: Callable[[], None] | None = None):
        self.fields = fields
        self.then = then


class ControlServer:
    """Handlers take the request and return a dict, a Reply, or an awaitable of either.

    `access()` returns the running policy's ControlAccess (read at each connection, so a
    policy apply takes effect at once); `on_refusal(peer, op, reason)` records a refused
    caller (the audit log). Without `access`, only root of the broker's pid namespace."""

    def __init__(self, path: str | Path, handlers: dict[str, Callable[[dict], Any]], *,
                 access: Callable[[], Any] | None = None,
                 on_refusal: Callable[[Peer, str, str], None] | None = None,
                 sock: socket.socket | None = None):
        self.path = Path(path)
        self.handlers = handlers
        self.access = access or (lambda: None)
        self.on_refusal = on_refusal
        # A live upgrade passes the listening socket on (connections waiting in its backlog
        # are answered by the successor): sock= serves one handed over.
        self.sock = sock
        self._kept = False
        self._open_total = 0
        self._open_by_uid: dict[int, int] = {}
        self._pacer = RefusalPacer()

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        if self.sock is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
            std = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            std.bind(str(self.path))
            self.set_mode()
            std.listen(16)
            self.sock = std
        sock = trio.socket.from_stdlib_socket(self.sock)
        task_status.started()
        try:
            async with trio.open_nursery() as nursery:
                while True:
                    try:
                        conn, _ = await sock.accept()
                    except OSError as e:
                        # Out of fds or memory (a flood, or the host): wait and accept
                        # again, as trio's listeners do; a connection that went away
                        # before it was accepted: next.
                        if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS,
                                       errno.ENOMEM):
                            await trio.sleep(0.1)
                        continue
                    self._admit(conn, nursery)
        finally:
            if not self._kept:
                try:
                    self.path.unlink()
                except FileNotFoundError:
                    pass

    def keep_path(self) -> None:
        """A successor serves the listening socket now (live upgrade): this server's closing
        must leave the path alone."""
        self._kept = True

    def set_mode(self) -> None:
        """0600 while only root has a role; 0666 when the policy gives others one (each
        connection is then checked by its credentials, not by the file's mode)."""
        access = self.access()
        opened = access is not None and access.opens_socket()
        try:
            os.chmod(self.path, 0o666 if opened else 0o600)
        except FileNotFoundError:
            pass

    def _admit(self, conn, nursery) -> None:
        """A connection just accepted: served (its role decided first, in `_handle`) while
        the bounds leave room, else closed at once. Nothing of it is read here; the uid is
        SO_PEERCRED's, which costs no /proc read."""
        try:
            uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                      struct.calcsize("3i")))[1]
        except OSError:
            conn.close()
            return
        # (root's own tools are bounded by the total only: `devbroker exec` asks once per
        # tenant it starts, and an operator may start many at once)
        per_uid = self._open_by_uid.get(uid, 0)
        if self._open_total >= MAX_CONNECTIONS or (uid != 0 and per_uid >= MAX_PER_UID):
            conn.close()
            self._refused_record(uid, Peer(0, uid, -1, frozenset(), False), "connect",
                                 "too many connections open" + (
                                     "" if self._open_total >= MAX_CONNECTIONS
                                     else f" for uid {uid}"))
            return
        self._open_total += 1
        self._open_by_uid[uid] = self._open_by_uid.get(uid, 0) + 1
        nursery.start_soon(self._counted, conn, uid)

    async def _counted(self, conn, uid: int) -> None:
        try:
            await self._handle(trio.SocketStream(conn))
        finally:
            self._open_total -= 1
            left = self._open_by_uid.get(uid, 1) - 1
            if left:
                self._open_by_uid[uid] = left
            else:
                self._open_by_uid.pop(uid, None)

    def _refused_record(self, uid: int, peer: Peer, op: str, why: str) -> None:
        """One audit record per refused connection, at most REFUSALS_PER_UID a second for
        a uid (the ones left out are counted into its next record): refusing must not let
        a caller without a role fill the disk."""
        if self.on_refusal is None:
            return
        note = self._pacer.admit(uid, trio.current_time())
        if note is not None:
            self.on_refusal(peer, op, why + note)

    async def _handle(self, stream: trio.SocketStream) -> None:
        async with stream:
            try:
                peer = await trio.to_thread.run_sync(peer_of, stream.socket)
            except OSError:
                return
            role = role_of(peer, self.access())
            if role is None:
                # Decided before anything is read: a caller without a role gets one line
                # saying why and the connection closed, never a buffer or a task that waits.
                why = ("not in the broker's pid namespace" if not peer.same_pidns
                       else f"uid {peer.uid} has no control role")
                self._refused_record(peer.uid, peer, "connect", why)
                with trio.move_on_after(1):
                    try:
                        await stream.send_all(_line({"ok": False,
                                                     "error": f"permission denied: {why}"}))
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        pass
                return
            cap = MAX_REQUEST if role == ROLE_ADMIN else MAX_READ_REQUEST
            buf = b""
            # A caller that connects and says nothing holds one task, for a while only.
            with trio.move_on_after(REQUEST_TIMEOUT) as idle:
                while b"\n" not in buf:
                    chunk = await stream.receive_some(65536)
                    if not chunk:
                        return
                    buf += chunk
                    if len(buf) > cap:
                        await stream.send_all(_line({"ok": False,
                                                     "error": "request too large"}))
                        return
            if idle.cancelled_caught:
                return
            then = None
            try:
                req = json.loads(buf.split(b"\n", 1)[0])
                op = req.get("op")
                handler = self.handlers.get(op)
                if not allowed(role, str(op)):
                    why = ("not in the broker's pid namespace" if not peer.same_pidns else
                           f"uid {peer.uid} has no control role" if role is None else
                           f"role {role} may not {op}")
                    if self.on_refusal is not None:
                        self.on_refusal(peer, str(op), why)
                    reply = {"ok": False, "error": f"permission denied: {why}"}
                elif handler is None:
                    reply = {"ok": False, "error": f"unknown op {req.get('op')!r}"}
                else:
                    _PEER.set(peer)
                    result = handler(req)
                    if inspect.isawaitable(result):
                        result = await result
                    if isinstance(result, Reply):
                        result, then = result.fields, result.then
                    reply = {"ok": True, **(result or {})}
            except ControlError as e:
                reply = {"ok": False, "error": str(e)}
            except Exception as e:  # a bad request must never take the broker down
                reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            try:
                await stream.send_all(_line(reply))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the client went away; what it asked for is done all the same
            finally:
                if then is not None:
                    then()


class ControlError(Exception):
    pass


def _line(obj: dict) -> bytes:
    return (json.dumps(obj, default=str) + "\n").encode()


def call(path: str | Path, request: dict, timeout: float = 10.0) -> dict:
    """Synchronous client used by the CLI."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(str(path))
    except (FileNotFoundError, ConnectionRefusedError) as e:
        raise ControlError(f"no broker is listening on {path} ({e.strerror}); "
                           "start one with `devbroker run`") from None
    with s:
        try:
            s.sendall(_line(request))
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused at accept: the broker's one line says why
        return read_reply(s)


def read_reply(s: socket.socket) -> dict:
    """One JSON line answered by the broker (the control socket, the seccomp hand-over)."""
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = s.recv(65536)
        if not chunk:
            break
        buf += chunk
    if not buf:
        raise ControlError("the broker closed the connection without answering")
    return json.loads(buf)
