"""A tenant-side probe: the NVML-style ioctl sequence, done by hand, printing what it sees.

It talks to /dev/nvidiactl and /dev/nvidiaN exactly as NVML does (BRIEF §2, the nvml trace):
version check, card info, root client, attached ids, id info, REGISTER_FD, device,
subdevice, name, UUID, framebuffer info — and can allocate device memory the way CUDA does
(class 0x40, 2 MiB aligned) to show the quota at work. It works against the real driver too.

    python -m devbroker.tools.probe [--json] [--alloc SIZE] [--keep]
"""
from __future__ import annotations

import argparse
import ctypes
import fcntl
import json
import os
import re
import sys

from devbroker.abi import registry
from devbroker.abi import status as nvs

NV01_ROOT_CLIENT = 0x41
NV01_DEVICE_0 = 0x80
NV20_SUBDEVICE_0 = 0x2080
NV01_MEMORY_LOCAL_USER = 0x40
RM_USER_SHARED_DATA = 0xDE
INVALID_GPU_ID = 0xFFFFFFFF
# What CUDA sent for its device allocations in the torch trace (BRIEF §2).
CUDA_MEM_FLAGS = 0x1C101
CUDA_MEM_ATTR = 0x18000000
TWO_MIB = 2 << 20


class NvError(Exception):
    def __init__(self, what: str, status: int):
        super().__init__(f"{what}: {nvs.name(status)} ({status:#x})")
        self.status = status


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([KMGT]i?B?)?\s*", text, re.I)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}")
    mult = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    return int(m.group(1)) * mult[(m.group(2) or "")[:1].upper()]


def driver_version(default: str) -> str:
    try:
        text = open("/proc/driver/nvidia/version").read()
    except OSError:
        return default
    m = re.search(r"\s(\d+\.\d+(?:\.\d+)?)\s", text)
    return m.group(1) if m else default


class Client:
    """An RM client on an open nvidiactl, speaking through raw ioctls."""

    def __init__(self, version: str | None = None, dev: str = "/dev"):
        self.dev = dev
        self.version = version or driver_version("580.159.04")
        self.abi = registry.get(self.version if self.version in registry.versions()
                                else "580.159.04")
        self.ctl = os.open(f"{dev}/nvidiactl", os.O_RDWR | os.O_CLOEXEC)
        self.gpu_fds: dict[int, int] = {}
        self.hclient = 0
        self._next = 0xA55A0000

    def handle(self) -> int:
        self._next += 0x10
        return self._next

    # -- raw escapes
    def escape(self, fd: int, name: str, value) -> object:
        buf = bytearray(value.encode())
        fcntl.ioctl(fd, self.abi.escape_cmd(name, len(buf)), buf, True)
        return value.spec.decode(bytes(buf))

    def new(self, struct: str, **fields):
        spec = self.abi.struct(struct)
        return spec.decode(bytes(spec.size)).replace(**fields)

    def check_version(self) -> int:
        v = self.new("nv_ioctl_rm_api_version_t",
                     versionString=self.version.encode().ljust(64, b"\0"))
        return self.escape(self.ctl, "NV_ESC_CHECK_VERSION_STR", v).reply

    def card_info(self) -> list:
        entry = self.abi.struct("nv_ioctl_card_info_t")
        buf = bytearray(entry.size * 32)
        fcntl.ioctl(self.ctl, self.abi.escape_cmd("NV_ESC_CARD_INFO", len(buf)), buf, True)
        return [entry.decode(bytes(buf[i * entry.size:(i + 1) * entry.size])) for i in range(32)]

    def alloc(self, parent: int, cls: int, params=None, handle: int | None = None,
              root: int | None = None) -> int:
        pbuf = ctypes.create_string_buffer(params.encode()) if params is not None else None
        v = self.new("NVOS64_PARAMETERS", hRoot=self.hclient if root is None else root,
                     hObjectParent=parent, hObjectNew=self.handle() if handle is None else handle,
                     hClass=cls, pAllocParms=ctypes.addressof(pbuf) if pbuf else 0,
                     paramsSize=0)
        out = self.escape(self.ctl, "NV_ESC_RM_ALLOC", v)
        if out.status != nvs.NV_OK:
            raise NvError(f"RM_ALLOC class {cls:#x}", out.status)
        self.last_alloc_params = (params.spec.decode(pbuf.raw[: params.spec.size])
                                  if pbuf else None)
        return out.hObjectNew

    def control(self, hobject: int, cmd: int, params):
        pbuf = ctypes.create_string_buffer(params.encode(), params.spec.size)
        v = self.new("NVOS54_PARAMETERS", hClient=self.hclient, hObject=hobject, cmd=cmd,
                     params=ctypes.addressof(pbuf), paramsSize=params.spec.size)
        out = self.escape(self.ctl, "NV_ESC_RM_CONTROL", v)
        if out.status != nvs.NV_OK:
            raise NvError(f"RM_CONTROL {self.abi.control_name(cmd)}", out.status)
        return params.spec.decode(pbuf.raw[: params.spec.size])

    def free(self, parent: int, handle: int) -> int:
        v = self.new("NVOS00_PARAMETERS", hRoot=self.hclient, hObjectParent=parent,
                     hObjectOld=handle)
        return self.escape(self.ctl, "NV_ESC_RM_FREE", v).status

    def params(self, cmd: int, **fields):
        spec = self.abi.control(cmd).params
        return spec.decode(bytes(spec.size)).replace(**fields)

    # -- the NVML-style sequence
    def open_root(self) -> None:
        self.hclient = self.alloc(0, NV01_ROOT_CLIENT, handle=0, root=0)

    def attached_ids(self) -> list[int]:
        p = self.control(self.hclient, 0x201, self.params(0x201))
        return [i for i in p.gpuIds if i != INVALID_GPU_ID]

    def open_gpu(self, gpu_id: int) -> dict:
        info = self.control(self.hclient, 0x205, self.params(0x205, gpuId=gpu_id))
        # The node's minor number comes from CARD_INFO: the device instance is not it (the
        # driver numbers instances at attach time).
        minor = next((int(e.minor_number) for e in self.card_info()
                      if e.valid and int(e.gpu_id) == gpu_id), info.deviceInstance)
        fd = os.open(f"{self.dev}/nvidia{minor}", os.O_RDWR | os.O_CLOEXEC)
        self.gpu_fds[minor] = fd
        self.escape(fd, "NV_ESC_REGISTER_FD", self.new("nv_ioctl_register_fd_t",
                                                       ctl_fd=self.ctl))
        hdev = self.alloc(self.hclient, NV01_DEVICE_0,
                          self.new("NV0080_ALLOC_PARAMETERS", deviceId=info.deviceInstance))
        hsub = self.alloc(hdev, NV20_SUBDEVICE_0,
                          self.new("NV2080_ALLOC_PARAMETERS", subDeviceId=0))
        name = self.control(hsub, 0x20800110, self.params(0x20800110))
        gid = self.control(hsub, 0x2080014A, self.params(0x2080014A, flags=0))
        return {"gpu_id": gpu_id, "minor": minor, "hdevice": hdev, "hsubdevice": hsub,
                "name": _cstr(bytes(name.gpuNameString.raw)),
                "uuid": _cstr(bytes(gid.data)[: gid.length])}

    def memory(self, hsub: int) -> dict:
        p = self.params(0x20801303)
        entries = list(p.fbInfoList)
        for i, idx in enumerate((0x08, 0x09, 0x16)):  # TOTAL_RAM_SIZE, HEAP_SIZE, HEAP_FREE
            entries[i] = entries[i].replace(index=idx)
        p = self.control(hsub, 0x20801303, p.replace(fbInfoListSize=3, fbInfoList=entries))
        got = {e.index: e.data for e in list(p.fbInfoList)[:3]}
        total, free = got[0x08] * 1024, got[0x16] * 1024
        return {"total": total, "free": free, "used": total - free}

    def map_shared_data(self, g: dict, length: int = 2608):
        """What NVML does for RM's shared-data page (BRIEF §2): a fresh nvidiactl fd,
        RM_MAP_MEMORY of an RM_USER_SHARED_DATA object (class 0xde) with that fd, then a
        shared mapping of the fd. Returns (fd, mmap object), read-write. The length is
        NVML's (2608 on 580.159.04; the H200 refuses 4096 with NV_ERR_INVALID_LIMIT)."""
        import mmap

        fd = self.map_shared_data_fd(g, length)
        return fd, mmap.mmap(fd, length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)

    def map_shared_data_fd(self, g: dict, length: int = 2608) -> int:
        """`map_shared_data` up to the mapping: the fresh nvidiactl fd with its mapping made
        (RM_MAP_MEMORY), for callers that map it their own way."""
        hshared = self.alloc(g["hsubdevice"], RM_USER_SHARED_DATA,
                             self.new("NV00DE_ALLOC_PARAMETERS"))
        fd = os.open(f"{self.dev}/nvidiactl", os.O_RDWR | os.O_CLOEXEC)
        spec = self.abi.escape("NV_ESC_RM_MAP_MEMORY").params
        v = spec.decode(bytes(spec.size))
        v = v.replace(params=v.params.replace(hClient=self.hclient, hDevice=g["hdevice"],
                                              hMemory=hshared, length=length), fd=fd)
        out = self.escape(self.ctl, "NV_ESC_RM_MAP_MEMORY", v)
        if out.params.status != nvs.NV_OK:
            os.close(fd)
            raise NvError("RM_MAP_MEMORY of RM_USER_SHARED_DATA", out.params.status)
        return fd

    def alloc_device_memory(self, hdev: int, size: int) -> int:
        p = self.new("NV_MEMORY_ALLOCATION_PARAMS", owner=self.hclient, type=0,
                     flags=CUDA_MEM_FLAGS, attr=CUDA_MEM_ATTR, size=size, alignment=TWO_MIB)
        return self.alloc(hdev, NV01_MEMORY_LOCAL_USER, p)

    def close(self) -> None:
        for fd in self.gpu_fds.values():
            os.close(fd)
        os.close(self.ctl)


def _cstr(b: bytes) -> str:
    return b.split(b"\0", 1)[0].decode("ascii", "replace")


def _human(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= (1 << 30) else f"{n / (1 << 20):.0f} MiB"


def _version_verdict(reply) -> str:
    """NV_ESC_CHECK_VERSION_STR's reply in words (the driver's NV_RM_API_VERSION_REPLY_*)."""
    return {0: "the driver does NOT recognize this version (reply UNRECOGNIZED)",
            1: "the driver recognizes this version (reply RECOGNIZED)",
            None: "no reply to the version check"}.get(reply, f"version check reply {reply}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="devbroker-probe", description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--alloc", type=parse_size, action="append", default=[],
                    help="allocate this much device memory on each GPU (repeatable)")
    ap.add_argument("--keep", action="store_true", help="do not free the allocations")
    ap.add_argument("--dev", default="/dev")
    args = ap.parse_args(argv)
    report: dict = {"gpus": []}
    try:
        c = Client(dev=args.dev)
    except OSError as e:
        print(f"probe: cannot open {args.dev}/nvidiactl: {e.strerror}", file=sys.stderr)
        return 2
    try:
        report["version_reply"] = c.check_version()
        report["cards"] = [e.minor_number for e in c.card_info() if e.valid]
        c.open_root()
        report["client"] = c.hclient
        for gpu_id in c.attached_ids():
            g = c.open_gpu(gpu_id)
            g["memory"] = c.memory(g["hsubdevice"])
            g["allocations"] = []
            held = []
            for size in args.alloc:
                try:
                    h = c.alloc_device_memory(g["hdevice"], size)
                    held.append(h)
                    g["allocations"].append({"size": size, "status": "NV_OK"})
                except NvError as e:
                    g["allocations"].append({"size": size, "status": nvs.name(e.status)})
            if args.alloc:
                g["memory_after_alloc"] = c.memory(g["hsubdevice"])
            if not args.keep:
                for h in held:
                    c.free(g["hdevice"], h)
                if held:
                    g["memory_after_free"] = c.memory(g["hsubdevice"])
            report["gpus"].append(g)
    except NvError as e:
        report["error"] = str(e)
    except OSError as e:
        report["error"] = f"{e.strerror or e} (errno {e.errno})"
    if args.json:
        print(json.dumps(report))
    else:
        print(f"driver {c.version}: {_version_verdict(report.get('version_reply'))}; "
              f"GPUs visible (minor numbers): {report.get('cards')}")
        for g in report["gpus"]:
            m = g["memory"]
            print(f"GPU {g['minor']}: {g['name']}  {g['uuid']}  id {g['gpu_id']:#x}")
            print(f"    memory total {_human(m['total'])}, used {_human(m['used'])}, "
                  f"free {_human(m['free'])}")
            for a in g["allocations"]:
                print(f"    allocate {_human(a['size'])}: {a['status']}")
            if "memory_after_alloc" in g:
                m = g["memory_after_alloc"]
                print(f"    after allocating: used {_human(m['used'])} of {_human(m['total'])}")
        if "error" in report:
            print(f"error: {report['error']}")
    if args.keep:
        # Hold the allocations until killed (tests use this to kill a tenant mid-use).
        print("holding", flush=True)
        try:
            sys.stdin.read()
        except KeyboardInterrupt:
            pass
    return 1 if "error" in report else 0


if __name__ == "__main__":
    sys.exit(main())
