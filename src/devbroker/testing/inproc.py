"""A broker in the test's own process: policy text → Broker (assemble.py, emulated backend),
and a tenant that drives it through the core's own entry points (open, ioctl, release) with
its arguments in this process's memory. No root, no FUSE, no subprocess: for tests of the
policy, quota and rewrite rules (tests/conftest.py's `inproc_broker` fixture).
"""
from __future__ import annotations

import ctypes
from pathlib import Path

from devbroker.abi import registry
from devbroker.abi.nodes import NodeKind
from devbroker.assemble import assemble
from devbroker.broker.audit import AuditLog
from devbroker.broker.core import Broker
from devbroker.broker.interface import Caller, IoctlReply, IoctlRequest, OpenRequest
from devbroker.broker.policy import load_policy_text
from devbroker.testing.policies import two_h200


def make_broker(policy_text: str | None = None, *, audit_path: str | Path | None = None,
                recorder=None, backend=None) -> Broker:
    """A Broker over the policy's backend (the emulated one for the texts of
    testing/policies.py; default: two_h200()), or over `backend` (an instance: a test's
    subclass of the emulator, say)."""
    policy = load_policy_text(policy_text or two_h200(), "test policy")
    audit = AuditLog(audit_path)
    if backend is not None:
        return Broker(policy, backend, audit, recorder=recorder)
    return assemble(policy, audit=audit, recorder=recorder).broker


class OwnMemory:
    """TenantMemory over this process's own memory (the 'tenant' is the test)."""

    def read(self, addr: int, n: int) -> bytes:
        return ctypes.string_at(addr, n)

    def write(self, addr: int, data: bytes) -> None:
        ctypes.memmove(addr, data, len(data))


class InProcTenant:
    """One tenant process talking to the broker core, with fake fd numbers."""

    def __init__(self, broker: Broker, tenant: str = "alice", *, pid: int = 4242,
                 version: str = "580.159.04"):
        self.b = broker
        self.tenant = tenant
        self.abi = registry.get(version)
        self.caller = Caller(pid, pid, 0, 0)
        self.fds: dict[int, int] = {}  # fake fd -> session
        self.keep: list = []

    async def open(self, node: NodeKind, minor: int = 0) -> int:
        rep = await self.b.open(OpenRequest(self.caller, self.tenant, node, minor))
        assert rep.errno == 0, rep
        fd = 100 + len(self.fds)
        self.fds[fd] = rep.session
        return fd

    async def _resolve(self, fd):
        return self.fds.get(fd)

    async def esc(self, fd: int, name: str, value, nested=None, ptr: str = ""
                  ) -> tuple[IoctlReply, object, object]:
        """Send escape `name` with argument `value` (and `nested` behind field `ptr`):
        (reply, decoded answer, nested buffer as the tenant then sees it)."""
        if nested is not None:
            buf = ctypes.create_string_buffer(nested.encode(), nested.spec.size)
            self.keep.append(buf)
            value = value.replace(**{ptr: ctypes.addressof(buf)})
        arg = value.encode()
        rep = await self.b.ioctl(IoctlRequest(self.caller, self.fds[fd],
                                              self.abi.escape_cmd(name, len(arg)), 0,
                                              arg, OwnMemory(), self._resolve))
        out = value.spec.decode(rep.arg_out) if rep.arg_out else None
        got = nested.spec.decode(ctypes.string_at(ctypes.addressof(buf), nested.spec.size)) \
            if nested is not None else None
        return rep, out, got

    def new(self, struct_name, **kw):
        s = self.abi.struct(struct_name)
        return s.decode(bytes(s.size)).replace(**kw)

    def params(self, cmd, **kw):
        s = self.abi.control(cmd).params
        return s.decode(bytes(s.size)).replace(**kw)

    async def alloc(self, ctl, root, parent, cls, params=None, new=0):
        v = self.new("NVOS64_PARAMETERS", hRoot=root, hObjectParent=parent, hObjectNew=new,
                     hClass=cls)
        return await self.esc(ctl, "NV_ESC_RM_ALLOC", v, params, "pAllocParms")

    async def control(self, ctl, client, obj, cmd, params=None, **kw):
        p = params if params is not None else self.params(cmd, **kw)
        v = self.new("NVOS54_PARAMETERS", hClient=client, hObject=obj, cmd=cmd,
                     paramsSize=p.spec.size)
        return await self.esc(ctl, "NV_ESC_RM_CONTROL", v, p, "params")

    async def subdevice(self, gpu: int = 0) -> tuple[int, int, int, int]:
        """A root client, a device on `gpu` and its subdevice, as CUDA makes them:
        (ctl fd, client, device handle 0xA0, subdevice handle 0xB0)."""
        ctl = await self.open(NodeKind.CTL)
        _, out, _ = await self.alloc(ctl, 0, 0, 0x41)
        client = out.hObjectNew
        await self.alloc(ctl, client, client, 0x80,
                         self.new("NV0080_ALLOC_PARAMETERS", deviceId=gpu), new=0xA0)
        await self.alloc(ctl, client, 0xA0, 0x2080, self.new("NV2080_ALLOC_PARAMETERS"),
                         new=0xB0)
        return ctl, client, 0xA0, 0xB0
