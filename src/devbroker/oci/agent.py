"""The broker's end of ``linux.seccomp.listenerPath``: container runtimes hand over here.

``RUN_DIR/oci-seccomp.sock`` (mode 0600 in the 0700 run dir: only root's tools, i.e. the
runtime, reach it). One container per connection: the runtime sends the OCI container process
state with the seccomp listener attached and closes (devbroker.oci.state). The agent

0. decides who the peer is at accept, before it reads a byte: its kernel credentials AND its
   pid namespace (broker/control.py ``peer_of``/``role_of``: an admin of the broker's own
   pid namespace). A runtime (runc, crun) runs on the host, in that namespace; a root tenant
   of any sandbox or container is in a pid namespace of its own, and a file mode cannot keep
   it out (root passes modes; a run dir it should not see may still be in its view), so it
   is refused here, whichever broker it found;
1. reads the state up to the end of its JSON object (at most 1 MiB, at most 10 s: a
   runtime cannot hold the broker),
   keeps only the fd named ``seccompFd`` and checks it is a seccomp listener;
2. names the tenant (annotation, CDI device request, listenerMetadata, and with
   ``tenant_from=cdi`` the CDI device applied in the bundle's config.json; they must agree)
   and checks it against the running policy;
3. serves the listener with the supervisor the section was written for:
   ``frontend=seccomp`` -> the seccomp front end's :class:`SeccompSupervisor` (the code
   ``devbroker exec --frontend seccomp`` hands over to, ``BrokerService.attach_listener``);
   ``frontend=fuse`` -> a :class:`~devbroker.sandbox.statshim.StatShim` for the tenant's
   FUSE node files (bound at ``/dev/nvidia*`` by the CDI spec), in a thread of its own.

Any failure: an audit record ``container-refused`` with the reason, and the listener is
closed. The container's notified system calls then fail with ENOSYS (that is what the kernel
does once the listener is gone), so a refused container cannot open a file and its start
fails: closed, not open. The runtime reads no answer.
"""
from __future__ import annotations

import errno
import logging
import os
import socket as _socket
import struct
from pathlib import Path

import trio

from devbroker.oci import state as ocistate

log = logging.getLogger("devbroker.oci")

READ_DEADLINE = 10.0
MAX_FDS = 8
SECCOMP_LISTENER_LINK = "anon_inode:seccomp notify"


def _close_all(fds) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _fds_from(anc) -> list[int]:
    fds: list[int] = []
    for level, typ, data in anc:
        if level == _socket.SOL_SOCKET and typ == _socket.SCM_RIGHTS:
            n = len(data) // 4
            fds.extend(struct.unpack(f"={n}i", data[:4 * n]))
    return fds


def is_seccomp_listener(fd: int) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}") == SECCOMP_LISTENER_LINK
    except OSError:
        return False


class OciSeccompAgent:
    """Accepts container runtimes' hand-overs for a BrokerService (daemon.py)."""

    def __init__(self, service, *, sock: _socket.socket | None = None):
        self.service = service
        self.path: Path = service.paths.oci_seccomp
        self.attached = 0
        self.refused = 0
        # Live upgrade (devbroker/upgrade.py): the listening socket a predecessor handed
        # over (sock=), hand-overs accepted and not finished yet, and the accept loop's
        # scope, stopped (not closed) while the broker hands over.
        self.sock = sock
        self.busy = 0
        self.accepting: trio.CancelScope | None = None
        from devbroker.broker.control import RefusalPacer

        self._pacer = RefusalPacer()

    async def serve(self, nursery, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        if self.sock is None:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
            std = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
            std.bind(str(self.path))
            os.chmod(self.path, 0o600)
            std.listen(16)
            self.sock = std
        sock = trio.socket.from_stdlib_socket(self.sock)
        task_status.started()
        while not self.service.handed_over:
            with trio.CancelScope() as self.accepting:
                while True:
                    conn, _ = await sock.accept()
                    self.busy += 1
                    nursery.start_soon(self._counted, conn, nursery)
            self.accepting = None
            while self.service.upgrading:
                await trio.sleep(0.01)

    def stop_accepting(self) -> None:
        if self.accepting is not None:
            self.accepting.cancel()

    async def _counted(self, conn, nursery) -> None:
        try:
            await self._one(conn, nursery)
        finally:
            self.busy -= 1

    async def _peer_may_hand_over(self, conn) -> tuple[bool, tuple[int, int, int]]:
        """Whether the peer may hand over a container at all, decided from what the kernel
        says about it (credentials, pid namespace), with its (pid, uid, gid)."""
        from devbroker.broker.control import ROLE_ADMIN, peer_of, role_of

        try:
            peer = await trio.to_thread.run_sync(peer_of, conn)
        except OSError:
            return False, (0, -1, -1)
        ok = role_of(peer, self.service._access()) == ROLE_ADMIN
        return ok, (peer.pid, peer.uid, peer.gid)

    async def _read(self, conn) -> tuple[bytes, list[int]]:
        """(payload, fds) of one hand-over; the fds are the caller's to close whatever
        happens next."""
        chunks: list[bytes] = []
        fds: list[int] = []
        size = 0
        try:
            with trio.fail_after(READ_DEADLINE):
                msg, anc, flags, _ = await conn.recvmsg(
                    ocistate.MAX_STATE_BYTES + 1, _socket.CMSG_SPACE(4 * MAX_FDS))
                fds = _fds_from(anc)
                if flags & _socket.MSG_CTRUNC:
                    raise ocistate.StateError(f"more than {MAX_FDS} fds sent")
                while msg:
                    chunks.append(msg)
                    size += len(msg)
                    if size > ocistate.MAX_STATE_BYTES:
                        raise ocistate.StateError("container process state larger than "
                                                  f"{ocistate.MAX_STATE_BYTES} bytes")
                    # Done at the end of the JSON object, not at EOF: runc 1.1 keeps its end
                    # of the connection open while the container runs (a dup it never
                    # closes). A strict prefix of an object never parses.
                    if ocistate.complete(b"".join(chunks)):
                        break
                    msg = await conn.recv(65536)
        except trio.TooSlowError:
            _close_all(fds)
            raise ocistate.StateError(f"the runtime did not finish sending its state within "
                                      f"{READ_DEADLINE:.0f} s") from None
        except BaseException:
            _close_all(fds)
            raise
        return b"".join(chunks), fds

    async def _one(self, conn, nursery) -> None:
        audit = self.service.audit
        fds: list[int] = []
        st = None
        hand = None
        peer = (0, -1, -1)
        with conn:
            ok, peer = await self._peer_may_hand_over(conn)
            if not ok:
                # Nothing of it is read: no state parsed, no fd received.
                self.refused += 1
                note = self._pacer.admit(peer[1], trio.current_time())
                if note is not None:
                    audit.write("container-refused", runtime_pid=peer[0], uid=peer[1],
                                reason="the peer is not an admin of the broker's pid "
                                       "namespace (only the host's container runtime hands "
                                       "over)" + note)
                return
            try:
                payload, fds = await self._read(conn)
                st = ocistate.decode_state(payload)
                idx = st.fd_index()
                if idx >= len(fds):
                    raise ocistate.StateError(f"'fds' names {len(st.fds)} fds, "
                                              f"{len(fds)} were sent")
                listener = fds.pop(idx)
                _close_all(fds)
                fds = [listener]
                if not is_seccomp_listener(listener):
                    raise ocistate.StateError("the fd named seccompFd is not a seccomp "
                                              "listener")
                cdi = ()
                if ocistate.tenant_from_cdi(st):
                    config = await trio.to_thread.run_sync(ocistate.read_config, st.bundle)
                    cdi = ocistate.hook_tenants(config, str(self.service.paths.run_dir))
                hand = ocistate.identify(st, cdi_tenants=cdi)
                self.service.check_tenant(hand.tenant)
            except (ocistate.StateError, ValueError, OSError) as e:
                _close_all(fds)
                self.refused += 1
                audit.write("container-refused", tenant=hand.tenant if hand else None,
                            container=st.container_id if st else None,
                            pid=st.pid if st else None, runtime_pid=peer[0],
                            reason=str(e))
                return
        fields = {"via": "oci", "container": st.container_id, "pid": st.pid,
                  "bundle": st.bundle, "named_by": list(hand.sources)}
        try:
            await self.service.attach_listener(nursery, hand.tenant, listener,
                                               frontend=hand.frontend, **fields)
        except Exception as e:  # noqa: BLE001 - a bad hand-over costs that container only
            self.refused += 1
            audit.write("container-refused", tenant=hand.tenant, container=st.container_id,
                        pid=st.pid, runtime_pid=peer[0], reason=f"attaching: {e}")
            return
        self.attached += 1


# --------------------------------------------------------------------------- the stat shim
def stat_shim_for(tenant_dir: Path):
    """A StatShim for the tenant's FUSE node files (blocking file system access: call it in
    a worker thread, never on the broker's trio thread, which serves those very files)."""
    from devbroker.sandbox import statshim
    from devbroker.sandbox.sandbox import tenant_nodes

    names = tenant_nodes(tenant_dir)
    with open("/proc/devices") as f:
        _text, uvm = statshim.proc_devices_view(f.read())
    return statshim.StatShim(statshim.node_table(tenant_dir, names, uvm), names,
                             log=lambda m: log.warning("stat shim: %s", m))


async def serve_stat_shim(shim, listener: int) -> None:
    """Run shim on listener in a thread of its own until no task uses the filter; owns and
    closes listener. Cancellation stops the thread (its stop pipe) and returns."""
    stop_r, stop_w = os.pipe2(os.O_CLOEXEC)

    def run() -> None:
        try:
            shim.serve(listener, stop_r)
        finally:
            os.close(listener)
            os.close(stop_r)

    try:
        await trio.to_thread.run_sync(run, limiter=trio.CapacityLimiter(1),
                                      abandon_on_cancel=True)
    finally:
        try:
            os.write(stop_w, b"x")
        except OSError as e:
            if e.errno != errno.EPIPE:
                raise
        os.close(stop_w)
