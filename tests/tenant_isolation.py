"""Tenant-side programs for the isolation tests (tests/test_tenant_isolation.py), run inside
`devbroker exec` like tests/tenant_prog.py: real ioctls on /dev/nvidia*, one JSON object per
line on stdout."""
from __future__ import annotations

import array
import ctypes
import fcntl
import json
import mmap
import os
import socket
import sys

from devbroker.abi import iowr
from devbroker.tools.probe import Client, NvError, parse_size

INVALID_GPU_ID = 0xFFFFFFFF


def out(**kw) -> None:
    print(json.dumps(kw), flush=True)


def _status(fn) -> int:
    try:
        fn()
        return 0
    except NvError as e:
        return e.status


def _client() -> Client:
    c = Client()
    c.check_version()
    c.open_root()
    return c


def gpu_ids(other: str) -> None:
    """Controls that name GPU ids, with another tenant's GPU id and with our own."""
    c = _client()
    mine = c.attached_ids()[0]
    for who, gid in (("other", int(other, 0)), ("own", mine)):
        pad = [INVALID_GPU_ID] * 7
        p = c.params(0x13A, grpACount=1, grpBCount=1, gpuIdGrpA=[gid] + pad,
                     gpuIdGrpB=[mine] + pad)
        out(what=f"p2p-matrix-{who}", status=_status(lambda: c.control(c.hclient, 0x13A, p)))
        p = c.params(0x289, gpuId=gid)
        out(what=f"async-attach-{who}", status=_status(lambda: c.control(c.hclient, 0x289, p)))
        p = c.params(0x21B, gpuId=gid)
        out(what=f"pci-info-{who}", status=_status(lambda: c.control(c.hclient, 0x21B, p)))
    # GET_ACTIVE_DEVICE_IDS is all output: whatever is sent, only our GPU comes back.
    p = c.params(0x288)
    devs = list(p.devices)
    devs[0] = devs[0].replace(gpuId=int(other, 0))
    got = c.control(c.hclient, 0x288, p.replace(numDevices=1, devices=devs))
    out(what="active-devices", ids=[d.gpuId for d in list(got.devices)[: got.numDevices]])


def foreign_clients(other: str) -> None:
    """Allocation parameters naming another tenant's client (OS event's
    hParentClient, device's hTargetClient)."""
    c = _client()
    bob = int(other, 0)
    g = c.open_gpu(c.attached_ids()[0])
    ev = c.new("NV0005_ALLOC_PARAMETERS", hParentClient=bob, hSrcResource=g["hsubdevice"],
               hClass=0x79, notifyIndex=0, data=3)
    out(what="event-parent-other", status=_status(lambda: c.alloc(g["hsubdevice"], 0x79, ev)))
    dev = c.new("NV0080_ALLOC_PARAMETERS", deviceId=0, hTargetClient=bob)
    out(what="device-target-other", status=_status(lambda: c.alloc(c.hclient, 0x80, dev)))
    dev = c.new("NV0080_ALLOC_PARAMETERS", deviceId=0, hClientShare=0, hTargetClient=0)
    out(what="device-target-none", status=_status(lambda: c.alloc(c.hclient, 0x80, dev)))


def revoke(size: str) -> None:
    """Hold a device and `size` of memory on GPU 0, then (after a line on stdin, when
    the test has moved us to another GPU) use the old device, then free the memory."""
    c = _client()
    g = c.open_gpu(c.attached_ids()[0])
    hmem = c.alloc_device_memory(g["hdevice"], parse_size(size))
    out(what="holding", client=c.hclient)
    sys.stdin.readline()
    out(what="alloc-after", status=_status(
        lambda: c.alloc_device_memory(g["hdevice"], 2 << 20)))
    out(what="control-after", status=_status(
        lambda: c.control(g["hsubdevice"], 0x20800110, c.params(0x20800110))))
    out(what="subdevice-after", status=_status(
        lambda: c.alloc(g["hdevice"], 0x2080, c.new("NV2080_ALLOC_PARAMETERS",
                                                        subDeviceId=0))))
    sys.stdin.readline()
    out(what="free", status=c.free(g["hdevice"], hmem))
    sys.stdin.read()


def client_dup(other: str) -> None:
    """A root client asked for with a handle we hold, and with one another tenant
    holds: both answers, as raw bytes (ioctl result and the whole argument)."""
    c = _client()
    spec = c.abi.escape("NV_ESC_RM_ALLOC")

    def raw_alloc(handle: int) -> tuple[int, bytes]:
        v = c.new("NVOS64_PARAMETERS", hRoot=0, hObjectParent=0, hObjectNew=handle,
                  hClass=0x41, pAllocParms=0, paramsSize=0)
        buf = bytearray(v.encode())
        rc = fcntl.ioctl(c.ctl, iowr(spec.number, len(buf)), buf, True)
        return rc, bytes(buf)

    rc, own = raw_alloc(c.hclient)  # our own client, from open_root
    rc2, theirs = raw_alloc(int(other, 0))
    status_of = c.abi.struct("NVOS64_PARAMETERS")
    out(what="dup", own_rc=rc, other_rc=rc2,
        own_status=status_of.decode(own).status, other_status=status_of.decode(theirs).status,
        # the argument with the asked-for handle blanked: everything else must be the same
        own=status_of.decode(own).replace(hObjectNew=0).encode().hex(),
        other=status_of.decode(theirs).replace(hObjectNew=0).encode().hex())


def id_info() -> None:
    """GET_ID_INFO_V2's flags for our GPU before and after we hold a device on it."""
    c = _client()
    gid = c.attached_ids()[0]
    before = c.control(c.hclient, 0x205, c.params(0x205, gpuId=gid)).gpuFlags
    c.open_gpu(gid)
    after = c.control(c.hclient, 0x205, c.params(0x205, gpuId=gid)).gpuFlags
    old = c.control(c.hclient, 0x202, c.params(0x202, gpuId=gid)).gpuFlags
    out(what="id-info", before=before, after=after, v1_after=old)


SECRET = b"alice's page, not bob's"
PAGE = 4096


def map_owner(sock: str) -> None:
    """The owner: map the page, read it, write into it (the pages are now in the
    kernel's page cache of the node), then hand the mapped file to whoever asks."""
    c = _client()
    fd, m = c.map_shared_data(c.open_gpu(c.attached_ids()[0]))
    first = m[:PAGE]
    m[:len(SECRET)] = SECRET
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind("\0" + sock)
    srv.listen(1)
    out(what="owner", read=first.hex()[:16], wrote=m[:len(SECRET)].decode())
    conn, _ = srv.accept()
    conn.sendmsg([b"F"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
    conn.close()
    sys.stdin.readline()
    # The file went to another sandbox: it maps no more pages, the owner's included (the
    # access faults: SIGBUS, reported by the parent of a forked reader).
    out(what="owner-after", read=_touch(m, write=False))


def _touch(m: mmap.mmap, *, write: bool) -> str:
    """Read (or write) the mapping's first bytes in a child: a refused page kills the
    toucher with SIGBUS, which is the answer, not a failure of the test program."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            if write:
                m[:4] = b"bob!"
                os.write(w, b"wrote")
            else:
                os.write(w, bytes(m[:len(SECRET)]))
        finally:
            os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 4096):
        data += chunk
    os.close(r)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return f"signal {os.WTERMSIG(status)}"
    return data.decode(errors="replace")


def map_thief(sock: str) -> None:
    """The other tenant: get the owner's mapped node file over the socket, map it
    and try to read and write the pages the owner faulted in."""
    own = _client()  # bob's own client (the audit record names him by it)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect("\0" + sock)
    _, anc, _, _ = s.recvmsg(1, socket.CMSG_SPACE(4))
    fd = array.array("i", anc[0][2][:4])[0]
    m = mmap.mmap(fd, PAGE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    vec = (ctypes.c_ubyte * 1)()
    libc = ctypes.CDLL(None, use_errno=True)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(PAGE), vec)
    out(what="thief", resident=vec[0] & 1, read=_touch(m, write=False),
        write=_touch(m, write=True))
    own.close()


if __name__ == "__main__":
    cmd, *rest = sys.argv[1:]
    {"gpu-ids": gpu_ids, "foreign-clients": foreign_clients, "revoke": revoke,
     "client-dup": client_dup, "id-info": id_info, "map-owner": map_owner,
     "map-thief": map_thief}[cmd](*rest)
