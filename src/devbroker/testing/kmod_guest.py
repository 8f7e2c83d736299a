"""Guest-side checks of the devbroker kernel module (run inside QEMU by test_kmod_qemu.py).

    insmod kmod/devbroker.ko gpus=2 timeout_ms=3000
    python3 -m devbroker.testing.kmod_guest $DBRUN

Prints one line per check, ``CHECK <name> ok`` or ``CHECK <name> FAIL <why>``, which
pytest on the host turns into assertions. One boot runs every check: booting is the
expensive part.

The broker here is a deliberately tiny stand-in (a select loop over kmodwire), not the
real broker core: it exercises the module's mechanisms (reply, deny, pass, mmap of a broker
memfd, identities, nested reads through process_vm_readv, release notifications, broker
death) with test commands whose meaning is defined below, not NVIDIA's. Where a check needs
a "real driver" for PASS it uses /dev/zero: the module only opens the node the broker named
and forwards calls, so /dev/zero (no ioctl: ENOTTY; mmap: zero pages) is an honest target
for the forwarding itself. Only the standard library and kmodwire/procmem are used.
"""
from __future__ import annotations

import errno
import fcntl
import json
import mmap
import os
import select
import signal
import struct
import sys
import threading
import time
import traceback

from devbroker.frontends import kmodwire as w
from devbroker.frontends.procmem import vm_read, vm_write

CTL_DEV = "/dev/devbroker-ctl"
NODE_CTL, NODE_GPU, NODE_UVM, NODE_UVM_TOOLS = 1, 2, 3, 4


def iowr(nr: int, size: int) -> int:
    return (3 << 30) | (size << 16) | (ord("F") << 8) | nr


# Test commands the stand-in broker understands (sizes as the module will copy them).
VERSION = iowr(0xD2, 72)  # reply bytes: a version string at offset 8
DENIED = iowr(0x4D, 16)  # always denied with EPERM and audited (RM_ACCESS_REGISTRY's nr)
ALLOC = iowr(0x90, 16)  # {u64 size, u32 status, u32 pad}: counts against a 100 MiB quota
HOLD = iowr(0x91, 8)  # never answered until FLUSH: a call the broker sits on
FLUSH = iowr(0x92, 8)  # answer every held call now (late verdicts for dead callers)
ECHO = iowr(0x93, 64)  # reply: {pid, tgid, uid, gid} of the caller + payload reversed
UVM_INIT = 0x30000001  # raw UVM number: no size, the broker reads 16 bytes itself
QUOTA = 100 << 20
NO_MEMORY = 0x51


# ---- the stand-in broker ----------------------------------------------------------


def broker_main(log_path: str, ready_fd: int) -> None:
    """Serve /dev/devbroker-ctl until killed; every event goes to log_path (JSON lines)."""
    ctl = os.open(CTL_DEV, os.O_RDWR)
    log = open(log_path, "a", buffering=1)
    zero = os.open("/dev/zero", os.O_PATH)  # the "real node" for PASS opens
    files: dict[int, dict] = {}  # file_id -> {"node", "alloc"}
    held: list[int] = []
    memfds: list[int] = []

    def event(**kw):
        log.write(json.dumps(kw) + "\n")

    def send(v: w.VerdictRecord) -> None:
        try:
            os.write(ctl, w.encode_verdict(v))
        except OSError as e:  # ENOENT: the caller gave up (killed, timed out)
            event(ev="verdict_failed", id=v.id, errno=e.errno)

    os.write(ready_fd, b"r")
    os.close(ready_fd)
    while True:
        req = w.parse_request(os.read(ctl, w.READ_SIZE))
        who = dict(pid=req.pid, tgid=req.tgid, uid=req.uid, gid=req.gid, cg=req.cgroup_id)
        if req.op == w.Op.OPEN:
            event(ev="open", file=req.file_id, node=req.node, minor=req.minor, **who)
            if req.node == NODE_UVM_TOOLS:
                event(ev="audit", what="open uvm-tools refused", **who)
                send(w.deny(req.id, errno.EACCES))
            elif req.node == NODE_GPU and req.minor == 1:
                files[req.file_id] = {"node": req.node, "alloc": 0, "pass": True}
                send(w.pass_(req.id, fd=zero))
            else:
                files[req.file_id] = {"node": req.node, "alloc": 0, "pass": False}
                send(w.reply(req.id))
        elif req.op == w.Op.RELEASE:
            f = files.pop(req.file_id, None)
            event(ev="release", file=req.file_id, freed=f and f["alloc"],
                  usage=sum(x["alloc"] for x in files.values()))  # fmt: skip
        elif req.op == w.Op.MMAP:
            event(ev="mmap", file=req.file_id, offset=req.offset, length=req.length,
                  prot=req.cmd, shared=req.flags)  # fmt: skip
            if files[req.file_id]["pass"]:
                send(w.pass_(req.id))
            else:
                fd = os.memfd_create("devbroker-page")
                os.ftruncate(fd, req.length)
                os.pwrite(fd, b"DEVBROKER-PAGE", 0)
                memfds.append(fd)  # kept: the broker may update the page later
                send(w.map_file(req.id, fd, 0))
                os.pwrite(fd, b"UPDATED", 64)  # visible through the tenant's shared map
        elif req.op == w.Op.IOCTL:
            f = files[req.file_id]
            if f["pass"]:
                send(w.pass_(req.id))
            elif req.cmd == VERSION:
                send(w.reply(req.id, data=req.data[:8] + b"535.309.01".ljust(64, b"\0")))
            elif req.cmd == DENIED:
                event(ev="audit", what="denied", cmd=req.cmd, **who)
                send(w.deny(req.id, errno.EPERM))
            elif req.cmd == ALLOC:
                size, _, _ = struct.unpack("=QII", req.data)
                usage = sum(x["alloc"] for x in files.values())
                status = 0
                if usage + size > QUOTA:
                    status = NO_MEMORY  # the driver's own answer to "too big" (BRIEF §6)
                else:
                    f["alloc"] += size
                event(ev="alloc", file=req.file_id, size=size, status=status,
                      usage=sum(x["alloc"] for x in files.values()))  # fmt: skip
                send(w.reply(req.id, data=struct.pack("=QII", size, status, 0)))
            elif req.cmd == HOLD:
                event(ev="held", id=req.id, **who)
                held.append(req.id)
            elif req.cmd == FLUSH:
                for hid in held:
                    send(w.reply(hid))
                held.clear()
                send(w.reply(req.id))
            elif req.cmd == ECHO:
                head = struct.pack("=IIII", req.pid, req.tgid, req.uid, req.gid)
                send(w.reply(req.id, result=len(req.data), data=head + req.data[16:][::-1]))
            elif req.cmd == UVM_INIT and req.node == NODE_UVM:
                # No size in the command: read the caller's struct ourselves (it is
                # blocked in the ioctl, so its memory is stable for us), write status.
                flags = struct.unpack("=Q", vm_read(req.pid, req.arg, 8))[0]
                vm_write(req.pid, req.arg + 8, struct.pack("=I", 0x1234))
                event(ev="uvm_init", flags=flags, **who)
                send(w.reply(req.id))
            else:
                send(w.deny(req.id, errno.ENOTTY))


class Broker:
    """The stand-in broker in a child process (so that it can be SIGKILLed)."""

    def __init__(self, log_path: str):
        r, wfd = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            # Keep no tenant file of the parent open: a broker holding one would delay
            # its release (and the RELEASE notification) until the broker dies.
            os.closerange(3, wfd)
            os.closerange(wfd + 1, 4096)
            try:
                broker_main(log_path, wfd)
            except BaseException:
                traceback.print_exc()
            os._exit(1)
        os.close(wfd)
        if os.read(r, 1) != b"r":
            raise RuntimeError("broker did not start")
        os.close(r)

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)


def in_child(fn, *args, uid: int | None = None) -> tuple[int, object]:
    """Run fn in a forked process; return (exit status, its JSON-able result)."""
    r, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        code = 0
        try:
            if uid is not None:
                os.setresgid(uid, uid, uid)
                os.setresuid(uid, uid, uid)
            out = fn(*args)
        except BaseException as e:
            out, code = f"{type(e).__name__}: {e}", 1
        os.write(wfd, json.dumps(out).encode())
        os._exit(code)
    os.close(wfd)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), json.loads(data) if data else None


def ioctl_ptr(fd: int, cmd: int, addr: int) -> int:
    """ioctl with a raw pointer argument (fcntl.ioctl takes only a C int there)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
    ret = libc.ioctl(fd, cmd, addr)
    if ret < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return ret


def errno_of(fn) -> int:
    try:
        fn()
    except OSError as e:
        return e.errno
    return 0


# ---- checks -----------------------------------------------------------------------

RESULTS: list[tuple[str, bool, str]] = []


def check(name: str, ok: bool, detail: object = "") -> None:
    RESULTS.append((name, bool(ok), str(detail)))
    print(f"CHECK {name} {'ok' if ok else 'FAIL'} {detail}", flush=True)


def events(log_path: str) -> list[dict]:
    with open(log_path) as f:
        return [json.loads(line) for line in f]


def tenant_basic() -> dict:
    out = {}
    fd = os.open("/dev/nvidiactl", os.O_RDWR)
    buf = bytearray(72)
    struct.pack_into("=I", buf, 0, 0x1)
    out["ret"] = fcntl.ioctl(fd, VERSION, buf, True)
    out["version"] = bytes(buf[8:18]).decode()
    out["denied"] = errno_of(lambda: fcntl.ioctl(fd, DENIED, bytearray(16), True))
    out["unknown"] = errno_of(lambda: fcntl.ioctl(fd, iowr(0x7F, 4), bytearray(4), True))
    payload = bytes(range(48))
    buf = bytearray(16) + bytearray(payload)
    out["echo_ret"] = fcntl.ioctl(fd, ECHO, buf, True)
    pid, tgid, uid, gid = struct.unpack_from("=IIII", buf)
    out["ids"] = [pid == threading.get_native_id(), tgid == os.getpid(), uid, gid]
    out["echo_ok"] = bytes(buf[16:]) == payload[::-1]
    # a read-only argument buffer: the reply cannot be written back
    addr = readonly_page()
    out["efault"] = errno_of(lambda: ioctl_ptr(fd, ECHO, addr))
    # emulated mmap: a page of the broker's memfd, updated by the broker afterwards
    page = mmap.mmap(fd, 4096, mmap.MAP_SHARED, mmap.PROT_READ)
    out["page"] = page[:14].decode()
    deadline = time.monotonic() + 2  # the broker writes it just after its verdict
    while page[64:71] != b"UPDATED" and time.monotonic() < deadline:
        time.sleep(0.01)
    out["page_update"] = page[64:71].decode()
    page.close()
    os.close(fd)
    return out


def readonly_page() -> int:
    """Address of a fresh read-only anonymous page (Python's mmap hides addresses)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]  # fmt: skip
    return libc.mmap(None, 4096, mmap.PROT_READ, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)


def tenant_uvm() -> dict:
    import ctypes

    fd = os.open("/dev/nvidia-uvm", os.O_RDWR)
    params = (ctypes.c_uint8 * 16)()
    struct.pack_into("=Q", params, 0, 0xABCD)
    ret = ioctl_ptr(fd, UVM_INIT, ctypes.addressof(params))
    status = struct.unpack_from("=I", params, 8)[0]
    os.close(fd)
    return {"ret": ret, "status": status}


def tenant_pass() -> dict:
    fd = os.open("/dev/nvidia1", os.O_RDWR)
    out = {"ioctl": errno_of(lambda: fcntl.ioctl(fd, ECHO, bytearray(64), True))}
    m = mmap.mmap(fd, 8192, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    m[0:4] = b"abcd"  # /dev/zero's shared mapping is anonymous shared memory
    out["mmap"] = m[0:4].decode() + ":" + str(m[4096:4100] == b"\0" * 4)
    m.close()
    os.close(fd)
    return out


def tenant_alloc(sizes: list[int]) -> list[int]:
    fd = os.open("/dev/nvidiactl", os.O_RDWR)
    out = []
    for size in sizes:
        buf = bytearray(struct.pack("=QII", size, 0, 0))
        fcntl.ioctl(fd, ALLOC, buf, True)
        out.append(struct.unpack_from("=QII", buf)[1])
    os.close(fd)
    return out


def tenant_alloc_and_hang(size: int, ready_w: int) -> None:
    fd = os.open("/dev/nvidiactl", os.O_RDWR)
    fcntl.ioctl(fd, ALLOC, bytearray(struct.pack("=QII", size, 0, 0)), True)
    os.write(ready_w, b"r")
    fcntl.ioctl(fd, HOLD, bytearray(8), True)  # killed while the broker sits on this


def tenant_echo_many(n: int, seed: int) -> bool:
    fd = os.open("/dev/nvidiactl", os.O_RDWR)
    for i in range(n):
        payload = bytes((seed + i + k) & 0xFF for k in range(48))
        buf = bytearray(16) + bytearray(payload)
        if fcntl.ioctl(fd, ECHO, buf, True) != 64 or bytes(buf[16:]) != payload[::-1]:
            return False
        if struct.unpack_from("=II", buf)[1] != os.getpid():
            return False
    os.close(fd)
    return True


def tenant_threads_same_fd() -> dict:
    """8 threads share one file, each with its own buffer, while a 9th keeps rewriting a
    buffer that is also in flight: every reply must reach the thread that asked (the
    request ids keep calls on one file apart) and nothing may fail."""
    fd = os.open("/dev/nvidiactl", os.O_RDWR)
    bad: list[str] = []
    shared = bytearray(64)
    stop = threading.Event()

    def worker(seed: int) -> None:
        for i in range(30):
            payload = bytes((seed * 31 + i + k) & 0xFF for k in range(48))
            buf = bytearray(16) + bytearray(payload)
            if fcntl.ioctl(fd, ECHO, buf, True) != 64 or bytes(buf[16:]) != payload[::-1]:
                bad.append(f"thread {seed} call {i}")
            if struct.unpack_from("=I", buf)[0] != threading.get_native_id():
                bad.append(f"thread {seed} call {i}: wrong tid")

    def flipper() -> None:
        while not stop.is_set():
            shared[16:] = bytes([0xFF]) * 48
            shared[16:] = bytes(48)

    def racer() -> None:
        while not stop.is_set():
            fcntl.ioctl(fd, ECHO, shared, True)  # any snapshot is a valid answer

    side = [threading.Thread(target=flipper), threading.Thread(target=racer)]
    workers = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in side + workers:
        t.start()
    for t in workers:
        t.join()
    stop.set()
    for t in side:
        t.join()
    os.close(fd)
    return {"bad": bad}


def main(rundir: str) -> int:
    log = os.path.join(rundir, "broker.log")
    open(log, "w").close()

    # 0. no broker: opens fail at once with ENODEV
    t0 = time.monotonic()
    e = errno_of(lambda: os.open("/dev/nvidiactl", os.O_RDWR))
    check("no_broker_open_enodev", e == errno.ENODEV and time.monotonic() - t0 < 1, e)

    broker = Broker(log)
    check("second_broker_ebusy", errno_of(lambda: os.open(CTL_DEV, os.O_RDWR)) == errno.EBUSY)

    # 1. open, reply bytes, deny with audit, unknown command, identities, mmap
    st, out = in_child(tenant_basic, uid=1000)
    check("tenant_basic_ran", st == 0, out)
    if st == 0:
        check("ioctl_reply_bytes", out["ret"] == 0 and out["version"] == "535.309.01", out)
        check("ioctl_denied_eperm", out["denied"] == errno.EPERM, out["denied"])
        check("ioctl_unknown_enotty", out["unknown"] == errno.ENOTTY, out["unknown"])
        check("ioctl_identity", out["echo_ret"] == 64 and out["ids"] == [True, True, 1000, 1000]
              and out["echo_ok"], out)  # fmt: skip
        check("reply_to_readonly_buffer_efault", out["efault"] == errno.EFAULT, out["efault"])
        check("mmap_broker_memfd", out["page"] == "DEVBROKER-PAGE", out["page"])
        check("mmap_shared_update", out["page_update"] == "UPDATED", out["page_update"])
    ev = events(log)
    audits = [x for x in ev if x["ev"] == "audit" and x.get("what") == "denied"]
    check("audit_has_identity", len(audits) == 1 and audits[0]["uid"] == 1000, audits)
    opens = [x for x in ev if x["ev"] == "open"]
    rels = [x for x in ev if x["ev"] == "release"]
    check("open_release_paired", len(opens) == 1 and [r["file"] for r in rels] ==
          [opens[0]["file"]], (opens, rels))  # fmt: skip
    check("open_cgroup_id", opens and opens[0]["cg"] > 0, opens)

    # 2. refused open (audited), UVM raw command via process_vm_readv/writev, pass
    e = errno_of(lambda: os.open("/dev/nvidia-uvm-tools", os.O_RDWR))
    check("open_refused_eacces", e == errno.EACCES, e)
    st, out = in_child(tenant_uvm)
    check("uvm_raw_cmd_nested_rw", st == 0 and out == {"ret": 0, "status": 0x1234}, out)
    st, out = in_child(tenant_pass)
    check("pass_ioctl_reaches_real_file", st == 0 and out["ioctl"] == errno.ENOTTY, out)
    check("pass_mmap_maps_real_file", st == 0 and out["mmap"] == "abcd:True", out)

    # 3. quota: 60 + 30 fit in 100 MiB, 20 more does not (status 0x51, ioctl returns 0)
    st, out = in_child(tenant_alloc, [60 << 20, 30 << 20, 20 << 20])
    check("quota_status_no_memory", st == 0 and out == [0, 0, NO_MEMORY], out)

    # 4. a tenant killed mid-call: prompt death, its allocation is released, the
    # broker's late verdict is refused with ENOENT
    r, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            tenant_alloc_and_hang(50 << 20, wfd)
        finally:
            os._exit(3)
    os.close(wfd)
    os.read(r, 1)
    os.close(r)
    time.sleep(0.3)  # let the HOLD reach the broker
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    os.waitpid(pid, 0)
    check("killed_mid_call_exits_promptly", time.monotonic() - t0 < 1.0, time.monotonic() - t0)
    fd = os.open("/dev/nvidiactl", os.O_RDWR)
    fcntl.ioctl(fd, FLUSH, bytearray(8), True)
    os.close(fd)
    time.sleep(0.2)
    ev = events(log)
    freed = [x for x in ev if x["ev"] == "release" and x.get("freed") == 50 << 20]
    check("killed_tenant_released", len(freed) == 1 and freed[0]["usage"] == 0, freed)
    late = [x for x in ev if x["ev"] == "verdict_failed"]
    check("late_verdict_enoent", len(late) == 1 and late[0]["errno"] == errno.ENOENT, late)

    # 5. timeout: a held call fails with ETIMEDOUT after timeout_ms
    with open("/sys/module/devbroker/parameters/timeout_ms", "w") as f:
        f.write("500")
    fd = os.open("/dev/nvidiactl", os.O_RDWR)
    t0 = time.monotonic()
    e = errno_of(lambda: fcntl.ioctl(fd, HOLD, bytearray(8), True))
    dt = time.monotonic() - t0
    check("held_call_times_out", e == errno.ETIMEDOUT and 0.4 < dt < 2.0, (e, dt))
    os.close(fd)
    with open("/sys/module/devbroker/parameters/timeout_ms", "w") as f:
        f.write("10000")

    # 6. 16 concurrent tenants, 40 calls each; then a tenant racing its own threads
    t0 = time.monotonic()
    pids = []
    for i in range(16):
        pid = os.fork()
        if pid == 0:
            ok = False
            try:
                ok = tenant_echo_many(40, i * 7)
            finally:
                os._exit(0 if ok else 1)
        pids.append(pid)
    codes = [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids]
    check("concurrent_16_tenants", codes == [0] * 16, (codes, round(time.monotonic() - t0, 2)))
    st, out = in_child(tenant_threads_same_fd)
    check("threads_share_one_file", st == 0 and out == {"bad": []}, out)

    # 7. broker death: a pending call and every later call on its files fail at once
    fd_old = os.open("/dev/nvidiactl", os.O_RDWR)
    result = {}

    def blocked():
        t = time.monotonic()
        result["errno"] = errno_of(lambda: fcntl.ioctl(fd_old, HOLD, bytearray(8), True))
        result["t"] = time.monotonic() - t

    th = threading.Thread(target=blocked)
    th.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    broker.kill()
    th.join(5)
    check("broker_death_pending_eio", result.get("errno") == errno.EIO
          and time.monotonic() - t0 < 1.0, result)  # fmt: skip
    e = errno_of(lambda: fcntl.ioctl(fd_old, VERSION, bytearray(72), True))
    check("broker_death_later_call_eio", e == errno.EIO, e)
    e = errno_of(lambda: os.open("/dev/nvidiactl", os.O_RDWR))
    check("broker_death_open_enodev", e == errno.ENODEV, e)

    # 8. broker restart: new files work, files of the dead broker stay dead
    broker = Broker(log)
    st, out = in_child(tenant_echo_many, 5, 1)
    check("broker_restart_new_files_work", st == 0 and out is True, out)
    e = errno_of(lambda: fcntl.ioctl(fd_old, VERSION, bytearray(72), True))
    check("broker_restart_old_file_eio", e == errno.EIO, e)
    os.close(fd_old)
    broker.kill()
    failed = [n for n, ok, _ in RESULTS if not ok]
    print(f"SUMMARY {len(RESULTS) - len(failed)}/{len(RESULTS)} ok; failed: {failed}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
