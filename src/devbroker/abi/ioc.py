"""Linux ioctl request numbers, as include/uapi/asm-generic/ioctl.h encodes them (x86-64 and
arm64): nr in bits 0-7, type 8-15, argument size 16-29, direction 30-31. The one home of this
arithmetic: the NVIDIA ABI (driver.py: the 'F' escapes), and the FUSE/CUSE, seccomp and
kernel-module wire codecs of the front ends use it."""
from __future__ import annotations

IOC_NONE = 0
IOC_WRITE = 1
IOC_READ = 2


def ioc(direction: int, type_: int, nr: int, size: int) -> int:
    """_IOC(dir, type, nr, size)."""
    return (direction << 30) | (size << 16) | (type_ << 8) | nr


def ioc_nr(cmd: int) -> int:
    return cmd & 0xFF


def ioc_type(cmd: int) -> int:
    return (cmd >> 8) & 0xFF


def ioc_size(cmd: int) -> int:
    return (cmd >> 16) & 0x3FFF


def ioc_dir(cmd: int) -> int:
    return (cmd >> 30) & 0x3
