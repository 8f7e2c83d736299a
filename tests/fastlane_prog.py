"""A tenant program of tests/test_fastlane.py: every RM control of the recorded PyTorch and
NVML sessions (the shared H200 traces), with the parameters they were sent with, issued on
nvidiactl against this tenant's own client, device and subdevice; then calls the broker must
refuse (another client, a wrong paramsSize, a NULL parameter pointer, an object that is not
the tenant's). Prints one JSON line per call: the control, errno, NVOS54 status and a digest
of the parameter block after the call.

    fastlane_prog.py TRACE...
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import json
import sys

from devbroker.abi import nvtrace
from devbroker.abi.nvtrace import RecordType
from devbroker.abi.traceview import TraceDecoder
from devbroker.tools.probe import Client


def main(paths: list[str]) -> int:
    c = Client()
    c.check_version()
    c.open_root()
    g = c.open_gpu(c.attached_ids()[0])
    # The object a control goes to, by the class its number names (cmd >> 16).
    targets = {0x0000: c.hclient, 0x0080: g["hdevice"], 0x2080: g["hsubdevice"]}
    seen: dict[int, bytes] = {}
    for path in paths:
        dec = TraceDecoder(c.abi)
        for rec in nvtrace.read_file(path):
            ev = dec.decode(rec)
            if (rec.type != RecordType.IOCTL or ev.call_in is None
                    or ev.call_in.name != "NV_ESC_RM_CONTROL"):
                continue
            cmd = ev.call_in.value.cmd
            if cmd >> 16 in targets and cmd not in seen and rec.xin:
                seen[cmd] = bytes(rec.xin)
    cmd_nr = c.abi.escape_cmd("NV_ESC_RM_CONTROL", 32)

    def call(what: str, h_client: int, h_object: int, cmd: int, params: bytes | None,
             size: int | None = None) -> None:
        buf = ctypes.create_string_buffer(params or b"\0", max(len(params or b""), 1))
        v = c.new("NVOS54_PARAMETERS", hClient=h_client, hObject=h_object, cmd=cmd,
                  params=ctypes.addressof(buf) if params is not None else 0,
                  paramsSize=len(params or b"") if size is None else size)
        arg = bytearray(v.encode())
        err = 0
        try:
            fcntl.ioctl(c.ctl, cmd_nr, arg, True)
        except OSError as e:
            err = e.errno or errno.EIO
        status = int.from_bytes(arg[28:32], "little")
        out = buf.raw[:len(params or b"")]
        print(json.dumps({"what": what, "cmd": cmd, "errno": err, "status": status,
                          "params": hashlib.sha256(out).hexdigest()[:16]}), flush=True)

    for cmd, params in sorted(seen.items()):
        call("trace", c.hclient, targets[cmd >> 16], cmd, params)
    fb = 0x20801303
    p = seen.get(fb, bytes(c.abi.control(fb).size))
    call("foreign-client", 0xC1D00000, g["hsubdevice"], fb, p)
    call("foreign-object", c.hclient, 0xBAD0BAD0, fb, p)
    call("short-params", c.hclient, g["hsubdevice"], fb, p[:-4])
    call("null-params", c.hclient, g["hsubdevice"], fb, None, size=len(p))
    # Checked controls (GPU ids in the parameters; a pre-hook): the lane decides them on its
    # private copy, or sends them the general way to be refused there.
    from devbroker.broker.rewrite import ATTACH_ALL_PROBED, INVALID_GPU_ID

    def ids_params(cmd: int, **kw) -> bytes:
        return c.params(cmd, **kw).encode()

    own = c.attached_ids()[0]
    call("own-gpu-id", c.hclient, c.hclient, 0x205, ids_params(0x205, gpuId=own))
    call("foreign-gpu-id", c.hclient, c.hclient, 0x205, ids_params(0x205, gpuId=0x7700))
    call("attach-all-probed", c.hclient, c.hclient, 0x215,
         ids_params(0x215, gpuIds=[ATTACH_ALL_PROBED] + [INVALID_GPU_ID] * 31))
    call("attach-foreign", c.hclient, c.hclient, 0x215,
         ids_params(0x215, gpuIds=[0x7700] + [INVALID_GPU_ID] * 31))
    call("attached-ids", c.hclient, c.hclient, 0x201, bytes(c.abi.control(0x201).size))
    # GET_ID_INFO's szName: NULL (as NVML and CUDA send it) is laned; a buffer behind it
    # goes the general way (whose answer the lane-off run gives too)
    call("id-info-null-name", c.hclient, c.hclient, 0x202, ids_params(0x202, gpuId=own))
    name = ctypes.create_string_buffer(64)
    call("id-info-name", c.hclient, c.hclient, 0x202,
         ids_params(0x202, gpuId=own, szName=ctypes.addressof(name)))
    from devbroker.broker import rules

    unlisted = next(k for k, op in sorted(c.abi.controls.items())
                    if k >> 16 == 0x2080 and k not in rules.CONTROLS and op.size)
    call("unlisted-control", c.hclient, g["hsubdevice"], unlisted,
         bytes(c.abi.control(unlisted).size))
    print(json.dumps({"what": "done", "controls": len(seen)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
