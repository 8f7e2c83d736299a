"""A tenant program of tests/test_fastlane.py for the allocation lane: RM_ALLOCs of the
classes the lane takes (paramsSize 0 as CUDA sends it, the layout's size, the NVOS21
header), objects made through the lane used as parents and freed again (the broker's books
must hold them: RM_FREE of an object the books do not know is refused), and allocations the
lane must send the general way (another client, a parent that is not the tenant's, a handle
that exists, access rights asked for, no parameters, a wrong size, a class not on the
allowlist, a checked class with a pointer set or a foreign context). Prints one JSON line per
call: what, errno, NVOS64/NVOS21 status, the new handle and a digest of the parameters
after the call.

    alloclane_prog.py
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import json
import sys

from devbroker.tools.probe import Client, NvError

CHANNEL_GROUP, CHANNEL, SHARED_DATA, VASPACE, VIDMEM = 0xA06C, 0xC86F, 0xDE, 0x90F1, 0x40
GiB = 1 << 30
SYSMEM, DEBUGGER, PROFILER, SUBDEVICE = 0x3E, 0x83DE, 0x90CC, 0x2080


def race(start_at: float) -> int:
    """Eight threads allocate 1 GiB blocks of device memory at once (wall-clock time
    start_at, so that several processes of the tenant, each with its own listener, race
    too), four each, against the tenant's quota, and hold them until start_at + 4. Prints
    the count of blocks made and of refusals."""
    import threading
    import time

    c = Client()
    c.check_version()
    c.open_root()
    g = c.open_gpu(c.attached_ids()[0])
    spec = c.abi.rm_class(VIDMEM).params
    block = spec.decode(bytes(spec.size)).replace(owner=c.hclient, type=0, size=GiB).encode()
    cmd = c.abi.escape_cmd("NV_ESC_RM_ALLOC", c.abi.struct("NVOS64_PARAMETERS").size)
    got: list[int] = []
    refused: list[int] = []
    start = threading.Barrier(8)

    def worker(k: int) -> None:
        start.wait()
        time.sleep(max(0.0, start_at - time.time()))
        for i in range(4):
            buf = ctypes.create_string_buffer(block, len(block))
            arg = bytearray(c.new("NVOS64_PARAMETERS", hRoot=c.hclient,
                                  hObjectParent=g["hdevice"], hObjectNew=0x7A000000 + k * 16 + i,
                                  hClass=VIDMEM, pAllocParms=ctypes.addressof(buf)).encode())
            fcntl.ioctl(c.ctl, cmd, arg, True)
            (got if int.from_bytes(arg[40:44], "little") == 0 else refused).append(1)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    time.sleep(max(0.0, start_at + 4 - time.time()))  # held while the others try
    print(json.dumps({"what": "race", "made": len(got), "refused": len(refused)}), flush=True)
    return 0


def main() -> int:
    c = Client()
    c.check_version()
    c.open_root()
    g = c.open_gpu(c.attached_ids()[0])
    hdev, hsub = g["hdevice"], g["hsubdevice"]
    made: list[tuple[int, int]] = []  # (parent, handle), to free at the end

    def params_of(cls: int, **fields) -> bytes:
        spec = c.abi.rm_class(cls).params
        return spec.decode(bytes(spec.size)).replace(**fields).encode()

    def alloc(what: str, parent: int, cls: int, params: bytes | None, *, size: int = 0,
              handle: int | None = None, root: int | None = None, rights: int = 0,
              layout: str = "NVOS64_PARAMETERS") -> int:
        buf = ctypes.create_string_buffer(params or b"\0", max(len(params or b""), 1))
        fields = dict(hRoot=c.hclient if root is None else root, hObjectParent=parent,
                      hObjectNew=c.handle() if handle is None else handle, hClass=cls,
                      pAllocParms=ctypes.addressof(buf) if params is not None else 0,
                      paramsSize=size)
        if layout == "NVOS64_PARAMETERS":
            fields["pRightsRequested"] = rights
        v = c.new(layout, **fields)
        arg = bytearray(v.encode())
        err = 0
        try:
            fcntl.ioctl(c.ctl, c.abi.escape_cmd("NV_ESC_RM_ALLOC", len(arg)), arg, True)
        except OSError as e:
            err = e.errno or errno.EIO
        out = v.spec.decode(bytes(arg))
        if not err and out.status == 0:
            made.append((parent, out.hObjectNew))
        print(json.dumps({"what": what, "cls": cls, "errno": err, "status": out.status,
                          "handle": out.hObjectNew,
                          "params": hashlib.sha256(buf.raw[:len(params or b"")]).hexdigest()[:16]}),
              flush=True)
        return out.hObjectNew if not err and out.status == 0 else 0

    # laned: the class's size from the driver (0), the layout's size, the NVOS21 header
    alloc("shared-data", hsub, SHARED_DATA, params_of(SHARED_DATA))
    alloc("shared-data-sized", hsub, SHARED_DATA, params_of(SHARED_DATA),
          size=c.abi.rm_class(SHARED_DATA).size)
    alloc("shared-data-nvos21", hsub, SHARED_DATA, params_of(SHARED_DATA),
          layout="NVOS21_PARAMETERS")
    alloc("second-subdevice", hdev, SUBDEVICE, params_of(SUBDEVICE))
    # a channel group (general: its after-hook sets the compute share), a channel in it
    # through the lane, then the lane's channel as a parent... and freed (books!)
    tsg = alloc("channel-group", hdev, CHANNEL_GROUP, params_of(CHANNEL_GROUP))
    chans = [alloc(f"channel-{i}", tsg, CHANNEL, params_of(CHANNEL)) for i in range(3)]
    alloc("channel-under-channel", chans[0], CHANNEL, params_of(CHANNEL))  # driver: bad parent
    # allowed but not modelled by the emulator: the driver's (emulator's) NOT_SUPPORTED
    alloc("vaspace", hdev, VASPACE, params_of(VASPACE))
    # checked: pointer fields must be NULL; the debugger only on the tenant's own context
    alloc("sysmem", hdev, SYSMEM, params_of(SYSMEM))
    alloc("sysmem-address-set", hdev, SYSMEM, params_of(SYSMEM, address=0x1000))
    alloc("debugger-own", hdev, DEBUGGER, params_of(DEBUGGER, hAppClient=c.hclient,
                                                    hClass3dObject=chans[1]))
    alloc("debugger-foreign", hdev, DEBUGGER, params_of(DEBUGGER, hAppClient=0xC1D0BEEF,
                                                        hClass3dObject=chans[1]))
    # an OS event (laned, checked: its `data` is a key the driver looks up, not a pointer,
    # rules.CLASSES 0x79 `keys`): of the tenant's own client; a kernel-callback notifier
    # and another client as the parent refused the general way
    EVENT = 0x79
    alloc("os-event-own", hsub, EVENT, params_of(EVENT, hParentClient=c.hclient,
                                                 hSrcResource=hsub, hClass=EVENT,
                                                 notifyIndex=1, data=5))
    alloc("os-event-kernel-callback", hsub, EVENT, params_of(
        EVENT, hParentClient=c.hclient, hSrcResource=hsub, hClass=0x78, notifyIndex=1,
        data=5))
    alloc("os-event-foreign-client", hsub, EVENT, params_of(
        EVENT, hParentClient=0xC1D0BEEF, hSrcResource=hsub, hClass=EVENT, notifyIndex=1,
        data=5))
    # a device (laned, checked: its deviceId must name one of the tenant's GPUs): instance
    # 1 and 7 name none (the tenant has GPU 0 of a one-GPU host), refused the general way
    DEVICE = 0x80
    alloc("device-instance-1", c.hclient, DEVICE, params_of(DEVICE, deviceId=1))
    alloc("device-instance-7", c.hclient, DEVICE, params_of(DEVICE, deviceId=7))
    # sent the general way, refused or answered by the driver there
    alloc("foreign-client", hsub, SHARED_DATA, params_of(SHARED_DATA), root=0xC1D00000)
    alloc("foreign-parent", 0xBAD0BAD0, SHARED_DATA, params_of(SHARED_DATA))
    alloc("duplicate-handle", hsub, SHARED_DATA, params_of(SHARED_DATA), handle=hsub)
    alloc("rights", hsub, SHARED_DATA, params_of(SHARED_DATA), rights=ctypes.addressof(
        ctypes.create_string_buffer(64)))
    alloc("null-params", hsub, SHARED_DATA, None)
    alloc("wrong-size", hsub, SHARED_DATA, params_of(SHARED_DATA) + bytes(8), size=16)
    alloc("unlisted-class", hsub, PROFILER, bytes(64))
    # device memory against the tenant's 8 GiB quota (the lane holds the bytes in the books
    # while the driver runs): four 2 GiB blocks fit, a fifth does not; one freed, it fits
    attr2 = 0  # the driver's default page size for the size
    vid = [alloc(f"vidmem-{i}", hdev, VIDMEM,
                 params_of(VIDMEM, owner=c.hclient, type=0, size=2 * GiB, attr2=attr2))
           for i in range(4)]
    alloc("vidmem-over-quota", hdev, VIDMEM,
          params_of(VIDMEM, owner=c.hclient, type=0, size=2 * GiB, attr2=attr2))
    alloc("vidmem-one-byte-over", hdev, VIDMEM,
          params_of(VIDMEM, owner=c.hclient, type=0, size=1, attr2=attr2))
    status = c.free(hdev, vid[0])
    made.remove((hdev, vid[0]))
    print(json.dumps({"what": "vidmem-free", "status": status}), flush=True)
    alloc("vidmem-again", hdev, VIDMEM,
          params_of(VIDMEM, owner=c.hclient, type=0, size=2 * GiB, attr2=attr2))
    c.free(hdev, vid[1])
    made.remove((hdev, vid[1]))
    alloc("vidmem-address-set", hdev, VIDMEM,
          params_of(VIDMEM, owner=c.hclient, type=0, size=4096, address=0x1000))
    # every object made above (the lane's among them) freed, children first
    for parent, handle in reversed(made):
        status = c.free(parent, handle)
        print(json.dumps({"what": "free", "handle": handle, "status": status}), flush=True)
    # frees the lane must send the general way: freed already (the books no longer hold it:
    # refused), a handle never made, another client's, the root client itself (last)
    for what, root, handle in (("free-twice", None, made[0][1] if made else 0x1234),
                               ("free-unknown", None, 0xBADBAD),
                               ("free-foreign-client", 0xC1D00000, hsub)):
        v = c.new("NVOS00_PARAMETERS", hRoot=c.hclient if root is None else root,
                  hObjectParent=hdev, hObjectOld=handle)
        try:
            st = c.escape(c.ctl, "NV_ESC_RM_FREE", v).status
            err = 0
        except OSError as e:
            st, err = -1, e.errno
        print(json.dumps({"what": what, "status": st, "errno": err}), flush=True)
    # plain escapes (the whole argument is the call): NUMA_INFO on the GPU file
    numa = c.new("nv_ioctl_numa_info_t")
    try:
        got = c.escape(c.gpu_fds[g["minor"]], "NV_ESC_NUMA_INFO", numa)
        print(json.dumps({"what": "numa-info", "errno": 0,
                          "digest": hashlib.sha256(got.encode()).hexdigest()[:16]}), flush=True)
    except OSError as e:
        print(json.dumps({"what": "numa-info", "errno": e.errno}), flush=True)
    # a root client freed (the lane takes it: NVML frees its clients so): a second client
    # holds 6 GiB of the 8 GiB quota; after its RM_FREE the first client's 6 GiB fit (the
    # books gave the charge back with the client), and the freed client is no longer the
    # tenant's (a free under it is refused)
    c2 = Client()
    c2.open_root()
    g2 = c2.open_gpu(c2.attached_ids()[0])
    try:
        held = c2.alloc_device_memory(g2["hdevice"], 6 * GiB)
    except NvError as e:
        held = 0
        print(json.dumps({"what": "root2-vidmem-error", "error": str(e)}), flush=True)
    print(json.dumps({"what": "root2-vidmem", "ok": bool(held)}), flush=True)
    alloc("vidmem-while-root2", hdev, VIDMEM,
          params_of(VIDMEM, owner=c.hclient, type=0, size=6 * GiB, attr2=attr2))
    v = c2.new("NVOS00_PARAMETERS", hRoot=c2.hclient, hObjectParent=c2.hclient,
               hObjectOld=c2.hclient)
    print(json.dumps({"what": "free-root2", "status": c2.escape(c2.ctl, "NV_ESC_RM_FREE",
                                                              v).status}), flush=True)
    big = alloc("vidmem-after-root2", hdev, VIDMEM,
                params_of(VIDMEM, owner=c.hclient, type=0, size=6 * GiB, attr2=attr2))
    v = c2.new("NVOS00_PARAMETERS", hRoot=c2.hclient, hObjectParent=g2["hdevice"],
               hObjectOld=g2["hsubdevice"])
    try:
        st, err = c2.escape(c2.ctl, "NV_ESC_RM_FREE", v).status, 0
    except OSError as e:
        st, err = -1, e.errno
    print(json.dumps({"what": "free-under-root2", "status": st, "errno": err}), flush=True)
    if big:
        made.remove((hdev, big))
        c.free(hdev, big)
    # the version check (laned unless it asks for another version the registry has, which
    # switches the process's ABI: the general way, last here for that reason)
    for what, asked in (("version-own", c.abi.version), ("version-unknown", "1.2.3"),
                        ("version-other-known", "535.309.01")):
        v = c.new("nv_ioctl_rm_api_version_t", versionString=asked.encode().ljust(64, b"\0"))
        try:
            got = c.escape(c.ctl, "NV_ESC_CHECK_VERSION_STR", v)
            print(json.dumps({"what": what, "errno": 0, "reply": got.reply,
                              "version": bytes(got.versionString).split(b"\0")[0].decode()}),
                  flush=True)
        except OSError as e:
            print(json.dumps({"what": what, "errno": e.errno}), flush=True)
    print(json.dumps({"what": "done", "made": len(made)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(race(float(sys.argv[2])) if sys.argv[1:2] == ["race"] else main())
