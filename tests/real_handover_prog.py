"""Programs of the real backend's live-upgrade tests (tests/test_upgrade.py):

    real_handover_prog.py loop               a tenant: NV_ESC_CHECK_VERSION_STR on
        /dev/nvidiactl in a loop until "stop" on stdin, then the answers it got (errno:
        count), the calls and the longest one;

    real_handover_prog.py old DEV PROC RUN   builds a RealBackend on stand-in nodes, makes
        relayed calls, hands the backend to a successor it starts (`new`), exits;
    real_handover_prog.py new FD             adopts it and makes the same calls, then (on
        "again" from stdin) once more after the old process has gone, then stops it.

Each prints JSON lines (the calls' results). The stand-in nodes are character devices
everyone has (/dev/null for the control node: ioctls answer ENOTTY; /dev/zero for the GPU
node: pages of zeros): the mechanism carried does not depend on the driver."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import trio

from devbroker import upgrade
from devbroker.abi.nodes import NodeKind
from devbroker.backends import realhandover
from devbroker.backends import relaywire as w


def out(**kw) -> None:
    print(json.dumps(kw), flush=True)


def calls(b, files) -> dict:
    """What the relay answers on the relayed files, synchronously and from trio."""
    ctl, gpu = files[0], files[1]
    req = w.IoctlRequest(ctl.rfd, 0xC020462A, [w.Buffer(bytes(32)), w.Buffer(b"params", 0, 16)])
    rep = b.relay.ioctl(b.relay.sync, req)
    arep = trio.run(b.relay.aioctl, req)
    page = b.map_read(gpu, 4096, 100)
    info = b.relay.info()
    return {"ioctl": [rep.ret, rep.errno, rep.buffers[1].decode()],
            "aioctl": [arep.ret, arep.errno], "page_zeros": page == bytes(100),
            "relay_pid": info.pid, "relay_fds": info.open_fds,
            "gpu_fds": [os.fstat(fd).st_rdev for fd in b._broker_gpu_fds]}


def old(dev: str, proc: str, run: str) -> int:
    from devbroker.backends.real import RealBackend

    b = RealBackend(dev=dev, proc=proc, relay_uid=None, channels=2, discover=False,
                    private_dir=os.path.join(run, "private-nodes"))
    b.prepare_tenant_files()  # the private-node tmpfs and the broker's GPU file
    ctl = b.open(NodeKind.CTL, 0)
    gpu = b.open(NodeKind.GPU, 0)
    gpu.map_length = 8192  # as a decided RM_MAP_MEMORY would have set it
    tf = b.open(NodeKind.CTL, 0, tenant_file=True)  # a seccomp tenant's file ...
    installed = tf.install_fd
    tf.install_fd = -1  # ... installed in the tenant (here: kept by this process)
    tf.adopted.add(0xC1D00001)
    files = [ctl, gpu, tf]
    out(what="before", **calls(b, files), mounted=b._private.mounted,
        unknown=realhandover.unknown_state(b))  # what a live RealBackend has that is not carried
    state, fds = realhandover.export_real(b, files)
    ours, theirs = socket.socketpair()
    succ = subprocess.Popen([sys.executable, __file__, "new", str(theirs.fileno())],
                            pass_fds=[theirs.fileno()], stdin=sys.stdin, stdout=sys.stdout)
    theirs.close()

    async def hand():
        chan = upgrade.Channel(trio.socket.from_stdlib_socket(ours))
        await chan.send(state, fds)
        reply, _ = await chan.recv()
        return reply

    reply = trio.run(hand)
    os.close(installed)
    out(what="handed", successor=succ.pid, reply=reply)
    return 0  # exits without stopping the backend: the successor has it


def new(fd: int) -> int:
    sock = socket.socket(fileno=fd)

    async def take():
        chan = upgrade.Channel(trio.socket.from_stdlib_socket(sock))
        state, fds = await chan.recv()
        b, files = realhandover.import_real(state, fds)
        await chan.send({"ready": True})
        return b, files

    b, files = trio.run(take)
    tf = files[2]
    out(what="adopted", **calls(b, files), mounted=b._private.mounted,
        tenant_file=[tf.path, list(tf.key), sorted(tf.adopted), tf.runs_in_caller],
        private_dir=str(b._private.dir))
    sys.stdin.readline()  # the old process has exited (the test waited for it)
    out(what="after", **calls(b, files), relay_alive=b.relay.proc.poll() is None)
    b.stop()  # closes the channels: the relay exits (seen through its pidfd)
    out(what="stopped", relay_exited=b.relay.proc.returncode is not None,
        still_mounted=os.path.ismount(b._private.dir))
    return 0


def loop() -> int:
    import fcntl
    import select
    import time

    from devbroker.abi import iowr, registry

    spec = registry.get("580.159.04").escape("NV_ESC_CHECK_VERSION_STR")
    arg = spec.params.decode(bytes(spec.params.size)).replace(
        versionString=b"580.159.04").encode()
    fd = os.open("/dev/nvidiactl", os.O_RDWR)
    answers: dict[str, int] = {}
    calls, longest, slow = 0, 0.0, []
    while True:
        buf = bytearray(arg)
        t0, w0 = time.monotonic(), time.time()
        try:
            fcntl.ioctl(fd, iowr(spec.number, len(buf)), buf, True)
            got = "0"
        except OSError as e:
            got = str(e.errno)
        dt = time.monotonic() - t0
        answers[got] = answers.get(got, 0) + 1
        calls += 1
        longest = max(longest, dt)
        if dt >= 0.005 and len(slow) < 2000:
            slow.append([round(w0, 6), round(dt, 6)])
        if calls == 1:
            out(what="ready", pid=os.getpid(), fd=list(os.fstat(fd)[1:3]))
        if select.select([sys.stdin], [], [], 0)[0]:
            sys.stdin.readline()
            out(what="done", calls=calls, answers=answers, longest_call_s=longest,
                slow_calls=slow, fd=list(os.fstat(fd)[1:3]))
            return 0


if __name__ == "__main__":
    if sys.argv[1] == "loop":
        sys.exit(loop())
    if sys.argv[1] == "old":
        sys.exit(old(*sys.argv[2:5]))
    sys.exit(new(int(sys.argv[2])))
