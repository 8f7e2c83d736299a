"""procmem: another process's memory and file descriptors, through the real syscalls."""
from __future__ import annotations

import ctypes
import errno
import os
import subprocess
import sys

import pytest

from devbroker.broker.interface import ProcessMemory
from devbroker.frontends.procmem import MAX_TRANSFER, pidfd_getfd, vm_read, vm_write

CHILD = r"""
import ctypes, os, sys
buf = ctypes.create_string_buffer(b"hello from the child" + bytes(12), 32)
fd = os.open("/proc/self/comm", os.O_RDONLY)
print(ctypes.addressof(buf), fd, flush=True)
sys.stdin.readline()
print(buf.raw.hex(), flush=True)
"""


@pytest.fixture
def child():
    p = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    addr, fd = map(int, p.stdout.readline().split())
    yield p, addr, fd
    p.kill()
    p.wait()


def test_read_and_write_other_process(child):
    p, addr, _ = child
    assert vm_read(p.pid, addr, 20) == b"hello from the child"
    vm_write(p.pid, addr + 6, b"FROM")
    mem = ProcessMemory(p.pid)
    assert mem.read(addr, 20) == b"hello FROM the child"
    p.stdin.write("\n")
    p.stdin.flush()
    assert bytes.fromhex(p.stdout.readline().strip())[:20] == b"hello FROM the child"


def test_errors(child):
    p, addr, _ = child
    for n in (-1, MAX_TRANSFER + 1, 1 << 62):
        with pytest.raises(OSError) as ei:
            vm_read(p.pid, addr, n)
        assert ei.value.errno == errno.EINVAL
    with pytest.raises(OSError) as ei:
        vm_read(p.pid, 8, 16)  # page 0 is never mapped
    assert ei.value.errno == errno.EFAULT
    with pytest.raises(OSError) as ei:
        vm_write(p.pid, 8, b"x")
    assert ei.value.errno == errno.EFAULT
    with pytest.raises(OSError) as ei:
        vm_read(p.pid, (1 << 64) - 4, 16)
    assert ei.value.errno == errno.EFAULT
    assert vm_read(p.pid, addr, 0) == b""


def test_vanished_process():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    with pytest.raises(OSError) as ei:
        vm_read(p.pid, 0x1000, 8)
    assert ei.value.errno == errno.ESRCH


def test_read_spanning_two_pages_of_own_process():
    buf = ctypes.create_string_buffer(bytes(range(256)) * 40)  # > one page
    assert vm_read(os.getpid(), ctypes.addressof(buf), 10240) == bytes(range(256)) * 40


@pytest.mark.skipif(os.geteuid() != 0, reason="pidfd_getfd on another process needs ptrace rights")
def test_pidfd_getfd(child):
    p, _, fd = child
    dup = pidfd_getfd(p.pid, fd)
    try:
        assert os.readlink(f"/proc/self/fd/{dup}") == f"/proc/{p.pid}/comm"
        assert os.get_inheritable(dup) is False
    finally:
        os.close(dup)
    with pytest.raises(OSError) as ei:
        pidfd_getfd(p.pid, 9999)
    assert ei.value.errno == errno.EBADF
