"""The operator's control socket: JSON lines over a Unix stream socket (root only).

Requests: {"op": "status"}, {"op": "policy.show"}, {"op": "policy.apply", "text": ..., "name": ...},
{"op": "tenant.dir", "tenant": ...}. Each gets one JSON line back: {"ok": true, ...} or
{"ok": false, "error": "..."}. A bad policy is refused with its line and reason, and the
running policy stays in force.
"""
from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any, Callable

import trio

MAX_REQUEST = 1 << 20


class ControlServer:
    def __init__(self, path: str | Path, handlers: dict[str, Callable[[dict], Any]]):
        self.path = Path(path)
        self.handlers = handlers

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        await sock.bind(str(self.path))
        os.chmod(self.path, 0o600)  # the policy is the operator's, not the tenants'
        sock.listen(16)
        listener = trio.SocketListener(sock)
        task_status.started()
        try:
            await trio.serve_listeners(self._handle, [listener])
        finally:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass

    async def _handle(self, stream: trio.SocketStream) -> None:
        async with stream:
            buf = b""
            while b"\n" not in buf:
                chunk = await stream.receive_some(65536)
                if not chunk:
                    return
                buf += chunk
                if len(buf) > MAX_REQUEST:
                    await stream.send_all(_line({"ok": False, "error": "request too large"}))
                    return
            try:
                req = json.loads(buf.split(b"\n", 1)[0])
                handler = self.handlers.get(req.get("op"))
                if handler is None:
                    reply = {"ok": False, "error": f"unknown op {req.get('op')!r}"}
                else:
                    reply = {"ok": True, **(handler(req) or {})}
            except ControlError as e:
                reply = {"ok": False, "error": str(e)}
            except Exception as e:  # a bad request must never take the broker down
                reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            await stream.send_all(_line(reply))


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
        s.sendall(_line(request))
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
