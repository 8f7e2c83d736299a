"""Attacks on managed (nvidia-uvm) ranges: map past the quota in many small pieces, unmap
and map again from racing threads to be counted once for two ranges, grow a range the
broker charged (mremap). Run in the attacker's process like every attack (attacks.py).

A managed range is an mmap of the process's own nvidia-uvm file at an address equal to its
offset (the driver refuses any other), shared and read-write: each piece here is mapped
MAP_FIXED into a reservation of the process's own, as libcuda does.
"""
from __future__ import annotations

import ctypes
import errno
import faulthandler
import fcntl
import os
import threading

from devbroker.escape.outcome import Outcome, ename, escaped, refused


libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.syscall.restype = ctypes.c_long

UVM_INITIALIZE = 0x30000001  # UVM_INITIALIZE_PARAMS: flags u64, rmStatus u32 (16 bytes)
PROT_NONE, PROT_RW = 0, 3
MAP_SHARED, MAP_PRIVATE, MAP_FIXED, MAP_ANONYMOUS, MAP_NORESERVE = 1, 2, 0x10, 0x20, 0x4000
MREMAP_MAYMOVE = 1
SYS_mremap = 25
MAP_FAILED = ctypes.c_void_p(-1).value
PIECE_ALIGN = 2 << 20


class ManagedSpace:
    """The process's nvidia-uvm file (initialized) and a reservation to map ranges in."""

    def __init__(self, span: int):
        faulthandler.enable()  # (a fault in a range says where, in the attacker's stderr)
        self.fd = os.open("/dev/nvidia-uvm", os.O_RDWR)
        fcntl.ioctl(self.fd, UVM_INITIALIZE, bytearray(16), True)
        base = libc.mmap(None, span + PIECE_ALIGN, PROT_NONE,
                         MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
        if base in (None, MAP_FAILED):
            raise OSError(ctypes.get_errno(), "reservation failed")
        self.base = (base + PIECE_ALIGN - 1) // PIECE_ALIGN * PIECE_ALIGN
        self.span = span

    def map(self, offset: int, length: int) -> int:
        """Map [base+offset, +length) managed: 0, or the errno."""
        addr = self.base + offset
        got = libc.mmap(addr, length, PROT_RW, MAP_SHARED | MAP_FIXED, self.fd, addr)
        if got in (None, MAP_FAILED):
            return ctypes.get_errno() or errno.EIO
        return 0

    def unmap(self, offset: int, length: int) -> None:
        libc.munmap(self.base + offset, length)

    def close(self) -> None:
        """Give everything back (the attacks run one after another in one process)."""
        libc.munmap(self.base, self.span)
        os.close(self.fd)

    def __enter__(self) -> "ManagedSpace":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def mapped(self) -> int:
        """Bytes of nvidia-uvm mappings this process holds now (its own maps)."""
        st = os.fstat(self.fd)
        want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x} {st.st_ino} "
        total = 0
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 5 and f"{parts[3]} {parts[4]} " == want:
                    lo, hi = (int(x, 16) for x in parts[0].split("-"))
                    total += hi - lo
        return total


def a_managed_pieces(ctx):
    """Map managed memory in pieces of 1/16 of the quota until refused: what was mapped must
    stay within the quota, and the refusal be the driver's out of memory."""
    piece = max(PIECE_ALIGN, ctx.quota // 16 // PIECE_ALIGN * PIECE_ALIGN)
    with ManagedSpace(piece * 48) as space:
        for i in range(48):
            err = space.map(i * piece, piece)
            if err:
                held = space.mapped()
                if held > ctx.quota:
                    return escaped(f"{held} bytes of managed ranges mapped in a "
                                   f"{ctx.quota}-byte quota", ename(err))
                return refused(ename(err), f"piece {i + 1} of {piece} bytes refused; "
                                           f"{held} bytes mapped")
        return escaped(f"48 pieces of {piece} bytes mapped in a {ctx.quota}-byte quota")


def a_managed_remap_race(ctx):
    """Map a range of nearly the whole quota, unmap it, then map such a range again from
    four threads at once: one may be counted for the space the unmapped range left, never
    two (the broker must not count the old range as gone while a new one is in flight)."""
    size = max(PIECE_ALIGN, ctx.quota * 3 // 4 // PIECE_ALIGN * PIECE_ALIGN)
    with ManagedSpace(size * 5) as space:
        err = space.map(0, size)
        if err:
            return Outcome("error", ename(err), "the first range was refused")
        space.unmap(0, size)
        start = threading.Barrier(4)
        errs: list[int] = [0] * 4

        def worker(i: int) -> None:
            start.wait()
            errs[i] = space.map((i + 1) * size, size)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        held = space.mapped()
        won = sum(1 for e in errs if not e)
        if held > ctx.quota or won > 1:
            return escaped(f"{won} of 4 racing ranges of {size} bytes mapped ({held} bytes) "
                           f"in a {ctx.quota}-byte quota")
        bad = sorted({ename(e) for e in errs if e})
        return refused("/".join(bad) or "none refused",
                       f"{won} of 4 racing ranges mapped after the unmap; {held} bytes held")


def a_managed_grow(ctx):
    """Grow a charged managed range with mremap, in place and moved: the driver marks each
    range VM_DONTEXPAND (the kernel refuses, EFAULT). Where the file allows it (the emulated
    backend's placeholder), the grown range must be counted: the next range is refused."""
    half = max(PIECE_ALIGN, ctx.quota // 2 // PIECE_ALIGN * PIECE_ALIGN)
    with ManagedSpace(half * 8) as space:
        err = space.map(0, half)
        if err:
            return Outcome("error", ename(err), "the first range was refused")
        addr = space.base
        got = []
        for flags in (0, MREMAP_MAYMOVE):
            r = libc.syscall(SYS_mremap, ctypes.c_void_p(addr), ctypes.c_size_t(half),
                             ctypes.c_size_t(half * 3), ctypes.c_int(flags), ctypes.c_void_p(0))
            if r == -1:
                got.append(ename(ctypes.get_errno()))
                continue
            addr = r
            # grown: the broker's next look must count it (3/2 of the quota is mapped now)
            err = space.map(half * 4, PIECE_ALIGN)
            held = space.mapped()
            libc.munmap(ctypes.c_void_p(r), half * 3)
            if not err:
                return escaped(f"a range grown to {half * 3} bytes by mremap and another mapped "
                               f"({held} bytes) in a {ctx.quota}-byte quota")
            return refused("COUNTED", f"mremap grew the range (the file allows it); the next "
                                      f"range was refused {ename(err)}: {held} bytes counted")
        out = refused("/".join(sorted(set(got))), "mremap of a managed range refused (grow in "
                      "place and moved)")
        out.by_kernel = True
        return out
