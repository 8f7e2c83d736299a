"""The emulated backend: a simulated NVIDIA driver with N configurable GPUs.

It answers what NVML and nvidia-smi ask with values derived from its configuration (names,
UUIDs, PCI ids, memory sizes) and keeps real memory accounting per GPU. What it does not
model it answers the way the driver answers what it does not support: the RM status
NV_ERR_NOT_SUPPORTED (logged once per command), never a made-up success. It cannot run GPU
work: channel and engine classes are NOT_SUPPORTED too.
"""
from __future__ import annotations

import errno
import itertools
import struct
import logging
import threading
import time
import uuid as uuidlib
from dataclasses import dataclass
from typing import Callable

from devbroker.abi import registry, vidmem
from devbroker.abi import status as nvs
from devbroker.abi.nodes import NodeKind
from devbroker.backends.base import DriverCall, DriverResult, NotHere, PciLocation
from devbroker.backends import emulated_export  # noqa: F401  (registers its control handlers)
from devbroker.backends import emulated_sched  # channel groups: registers controls
from devbroker.backends.emulated_ckpt import EmulatedCheckpointer
from devbroker.backends.emulated_controls import CONTROL_HANDLERS, H200_FACTS
from devbroker.backends.emulated_objects import EmuClient, EmuFile, EmuObject

log = logging.getLogger("devbroker.emulated")

GiB = 1 << 30

# Values the real driver uses, from the headers (see docs/emulator.md).
NV_RM_API_VERSION_REPLY_UNRECOGNIZED = 0
NV_RM_API_VERSION_REPLY_RECOGNIZED = 1
NV_RM_API_VERSION_CMD_STRICT = 0
NV_RM_API_VERSION_CMD_RELAXED = ord("1")
NV_RM_API_VERSION_CMD_QUERY = ord("2")
NV_RM_API_VERSION_STRING_LENGTH = 64
NV_PCI_VENDOR_NVIDIA = 0x10DE
NV01_ROOT_CLIENT = 0x41
# NVOS33_FLAGS (nvos.h): escape.c resets the caching type to DEFAULT on every RM_MAP_MEMORY
NVOS33_FLAGS_CACHING_TYPE_SHIFT, NVOS33_FLAGS_CACHING_TYPE_MASK = 23, 0x7 << 23
NVOS33_FLAGS_CACHING_TYPE_DEFAULT = 6
NVOS33_FLAGS_MAPPING_SHIFT, NVOS33_FLAGS_MAPPING_MASK = 15, 0x3 << 15
NVOS33_FLAGS_MAPPING_DIRECT = 1


@dataclass(frozen=True)
class EmulatedGpu(PciLocation):
    index: int
    name: str = "NVIDIA H200"
    uuid: str = ""
    pci_bus_id: str = "0000:00:06.0"
    memory_bytes: int = 141 * GiB
    pci_device_id: int = 0x2335  # H200 (GH100)

    @property
    def gpu_id(self) -> int:
        # The driver's GPU id encodes domain/bus/device; the H200 at 0000:00:06.0 reported
        # 0x6 in GET_ATTACHED_IDS (BRIEF §2), which this formula reproduces.
        return (self.domain << 16) | (self.bus << 8) | self.slot

    @property
    def uuid_bytes(self) -> bytes:
        return uuidlib.UUID(self.uuid.removeprefix("GPU-")).bytes


def default_gpus(n: int = 2) -> list[EmulatedGpu]:
    return [EmulatedGpu(index=i, uuid=str(_stable_uuid(i)).join(("GPU-", "")),
                        pci_bus_id=f"0000:00:{6 + i:02x}.0") for i in range(n)]


def _stable_uuid(i: int) -> uuidlib.UUID:
    return uuidlib.uuid5(uuidlib.NAMESPACE_URL, f"devbroker-emulated-gpu-{i}")


# Bytes of RM_USER_SHARED_DATA (0xde) a mapping may cover, by driver branch: NVML maps 2608
# (the 580.159.04 recording), and the H200 answered NV_ERR_INVALID_LIMIT for 4096 (two-GPU
# run, 2026-11-30 22:18, the escape harness's fd-pass-mmap set-up). Unmeasured branches: no
# check.
USER_SHARED_DATA_SIZE = {"580": 2608}
# Distinct "not modelled" notices of one kind (EmulatedBackend._note): enough for every
# real client's, few enough that a tenant naming index after index cannot fill the log.
NOTICES_PER_KIND = 32


class EmulatedBackend:
    name = "emulated"
    # The emulated driver answers as the real one answers the broker's relay: a caller
    # without CAP_SYS_ADMIN (controls the driver keeps for root refuse; emulated_sched.py).
    privileged_caller = False
    # Capabilities (backends/base.py Backend says what each means): a simulated driver has
    # no host files to show or hand out, answers GET_PIDS with the callers' own tgids
    # (DriverCall.tgid), keeps no per-process account the broker could check, and hands
    # its books over as JSON.
    host_proc = False
    tenant_files = False
    reports_tenant_pids = True
    counts_process_memory = False
    handover_format = "emulated"
    relayed_here = 0  # (no relayed files: base.py Backend.relayed_here)

    def __init__(self, gpus: list[EmulatedGpu] | None = None, *, version: str = "580.159.04",
                 notice: Callable[[str], None] | None = None):
        self.version = version
        self._gpus = list(gpus) if gpus is not None else default_gpus()
        self.abi = registry.get(version)
        self.files: dict[int, EmuFile] = {}
        self.clients: dict[int, EmuClient] = {}
        self._file_ids = itertools.count(1)
        self._client_ids = itertools.count(1)
        self._object_ids = itertools.count(1)
        self.used = {g.index: 0 for g in self._gpus}
        # Indexes kept as objects come and go, so that no call's work grows with the clients
        # and objects other tenants hold (with 132k parked clients, a walk over all of them
        # for GET_ID_INFO_V2's in-use flag cost ~26 ms a call).
        self._clients_of_file: dict[int, set[int]] = {}  # file id -> client handles
        self._devices_on: dict[int, int] = {}  # GPU -> device objects (GET_ID_INFO in-use)
        self._held: dict[int, dict[int, int]] = {}  # GPU -> {tgid: device memory bytes}
        self.notice = notice or (lambda msg: log.info("%s", msg))
        self._noticed: set = set()
        self._notices_of: dict = {}  # kind -> distinct notices said (_note)
        self.memblock_size = _host_memblock_size()
        self.started = time.time()
        self._calls = threading.RLock()
        self._card_entries: dict = {}  # CARD_INFO's valid entries, by layout and GPUs
        # The checkpoint API's model (emulated_ckpt.py): a checkpointed process's memory is
        # not on the GPU (`used`), though its objects and `_held` stay.
        self.checkpointer = EmulatedCheckpointer(self)

    # ------------------------------------------------------------------ Backend API
    def gpu_index_of_instance(self, instance: int) -> int | None:
        """The emulated driver numbers device instances as its GPUs."""
        return instance if 0 <= instance < len(self._gpus) else None

    def gpus(self) -> list[EmulatedGpu]:
        return self._gpus

    def memory_in_use(self) -> dict[int, int]:
        """The emulator's own accounting of device memory (GPU index -> bytes)."""
        return self.used

    def prepare_tenant_files(self) -> None:
        """Nothing to prepare: no tenant files (tenant_files is False)."""

    def stop(self) -> None:
        """Nothing outside this process's memory."""

    def open(self, node: NodeKind, minor: int) -> EmuFile:
        if node is NodeKind.GPU and not (0 <= minor < len(self._gpus)):
            raise OSError(errno.ENODEV, "no such GPU")
        if node not in (NodeKind.CTL, NodeKind.GPU, NodeKind.UVM):
            raise OSError(errno.ENODEV, f"{node.name} is not emulated")
        f = EmuFile(next(self._file_ids), node, minor)
        self.files[f.id] = f
        return f

    def close(self, file: EmuFile) -> None:
        with self._calls:
            self.files.pop(file.id, None)
            for h in list(self._clients_of_file.get(file.id, ())):
                self._free_client(h)

    def map_read(self, file: EmuFile, offset: int, length: int) -> bytes:
        data = file.mapping
        if data is None:
            raise OSError(errno.EINVAL, "no mapping context on this file")
        chunk = data[offset:offset + length]
        return chunk + bytes(max(0, min(length, len(data) - offset) - len(chunk)))

    async def ioctl(self, file: EmuFile, dc: DriverCall) -> DriverResult:
        return self.ioctl_blocking(file, dc)

    def ioctl_blocking(self, file: EmuFile, dc: DriverCall) -> DriverResult:
        """The emulator answers on the calling thread (a seccomp listener's or trio's); its
        books are one lock's: calls from two threads run one after the other, as a driver
        serialises on its own locks."""
        call = dc.call
        handler = getattr(self, call.name, None) if call.name.isupper() or call.name.startswith("NV_") else None
        if handler is None:
            return self._not_modelled(dc)
        with self._calls:
            return handler(file, dc)

    def _not_modelled(self, dc) -> DriverResult:
        """An escape or UVM command the emulator does not model: NV_ERR_NOT_SUPPORTED in its
        status field (top level, or in the `params` it wraps), as the driver reports what it
        cannot do; EINVAL only for the few without a status field."""
        call = dc.call
        v = call.value
        target = v
        if v is not None and "params" in v.spec.by_name and v.spec.by_name["params"].kind == "struct":
            target = v.params
        status = ([f.name for f in target.spec.fields if f.kind == "status"]
                  if target is not None else [])
        if not status:
            self._note(("escape", call.name), f"emulator: {call.name} is not modelled: EINVAL")
            return DriverResult(arg=call.encode(), errno=errno.EINVAL)
        self._note(("escape", call.name), f"emulator: {call.name} is not modelled: "
                   "NV_ERR_NOT_SUPPORTED")
        out = target.replace(**{status[0]: nvs.NV_ERR_NOT_SUPPORTED})
        if target is not v:
            out = v.replace(params=out)
        return DriverResult(arg=out.encode())

    # ------------------------------------------------------------------ helpers
    def _note(self, key, msg: str) -> None:
        """Say once what the emulation does not model. Some keys come from the tenant (an FB
        or GPU info index: 2^32 of them), so at most NOTICES_PER_KIND distinct ones of a
        kind are said and remembered, then one notice that the rest are left out."""
        if key in self._noticed:
            return
        kind = key[0]
        n = self._notices_of.get(kind, 0)
        if n < NOTICES_PER_KIND:
            self._noticed.add(key)
            self.notice(msg)
        elif n == NOTICES_PER_KIND:
            self.notice(f"emulator: more than {NOTICES_PER_KIND} '{kind}' items are not "
                        "modelled; the others are not noted")
        else:
            return
        self._notices_of[kind] = n + 1

    def _abi_for(self, call):
        return self.abi

    def _status(self, dc: DriverCall, status: int, nested: bytes | None = None,
                **fields) -> DriverResult:
        v = dc.call.value.replace(status=status, **fields)
        return DriverResult(arg=v.encode(), nested=nested if nested is not None else dc.nested)

    def _gpu_of(self, client: EmuClient, handle: int) -> int | None:
        obj = client.objects.get(handle)
        return obj.gpu if obj else None

    def _free_client(self, h: int) -> None:
        c = self.clients.pop(h, None)
        if c is None:
            return
        owned = self._clients_of_file.get(c.file_id)
        if owned is not None:
            owned.discard(h)
            if not owned:
                del self._clients_of_file[c.file_id]
        for obj in c.objects.values():
            self._release(c, obj)

    def _release(self, c: EmuClient, obj: EmuObject) -> None:
        """A handle of client c is gone: out of the indexes; its memory goes back unless
        another handle of the same object (a duplicate) still holds it, which then holds it."""
        self._unindex(c, obj)
        members = obj.share
        if members is not None:
            members[:] = [m for m in members if m is not obj]
            obj.share = None
            if members and obj.size:
                heir = members[0]
                self._unindex(heir.client, heir)
                heir.size += obj.size
                self._index(heir.client, heir)
                obj.size = 0

    def _index(self, c: EmuClient, obj: EmuObject) -> None:
        if obj.gpu is None or c is None:
            return
        if obj.rm_class == 0x80:
            self._devices_on[obj.gpu] = self._devices_on.get(obj.gpu, 0) + 1
        if obj.size:
            if not self.checkpointer.away(c.tgid):
                self.used[obj.gpu] += obj.size
            held = self._held.setdefault(obj.gpu, {})
            held[c.tgid] = held.get(c.tgid, 0) + obj.size

    def _unindex(self, c: EmuClient, obj: EmuObject) -> None:
        if obj.gpu is None or c is None:
            return
        if obj.rm_class == 0x80:
            self._devices_on[obj.gpu] -= 1
        if obj.size:
            if not self.checkpointer.away(c.tgid):
                self.used[obj.gpu] -= obj.size
            held = self._held[obj.gpu]
            held[c.tgid] -= obj.size
            if not held[c.tgid]:
                del held[c.tgid]

    # ------------------------------------------------------------------ frontend escapes
    def NV_ESC_CHECK_VERSION_STR(self, f, dc):
        """As RmPerformVersionCheck (osapi.c): the reply is RECOGNIZED whatever follows (the
        ioctl exists); cmd QUERY ('2') copies the driver's version string and succeeds;
        RELAXED ('1') compares up to the first '.'; anything else compares the whole string.
        A mismatch copies the driver's version into versionString and fails with EINVAL.
        The emulator speaks every version of the registry (the broker then decodes the
        client's calls with that version's ABI), so any of them matches; QUERY reports the
        version it was configured as."""
        v = dc.call.value.replace(reply=NV_RM_API_VERSION_REPLY_RECOGNIZED)
        size = len(bytes(v.versionString))
        mine = self.version.encode()[: size - 1].ljust(size, b"\0")
        if v.cmd == NV_RM_API_VERSION_CMD_QUERY:
            return DriverResult(arg=v.replace(versionString=mine).encode())
        asked = bytes(v.versionString)
        relaxed = v.cmd == NV_RM_API_VERSION_CMD_RELAXED
        if any(_version_matches(asked, k.encode(), relaxed) for k in registry.versions()):
            return DriverResult(arg=v.encode())
        return DriverResult(arg=v.replace(versionString=mine).encode(), errno=errno.EINVAL)

    def NV_ESC_SYS_PARAMS(self, f, dc):
        return DriverResult(arg=dc.call.encode())

    def NV_ESC_CARD_INFO(self, f, dc):
        """As nvidia_read_card_info (nv.c): every entry zeroed, then one valid entry per GPU;
        fewer entries than GPUs is EINVAL. The emulated GPU has no PCI BARs or interrupt
        line in this machine: their addresses and the IRQ read 0; the BAR sizes are facts of
        the board where recorded (H200_FACTS), else 0."""
        v = dc.call.value
        if hasattr(v, "entries"):
            f = v.spec.by_name["entries"]
            count, elem = f.count, f.elem
        else:  # a bare array of entries
            count, elem = len(v), v[0].spec
        if count < len(self._gpus):
            return DriverResult(arg=dc.call.encode(), errno=errno.EINVAL)
        # The valid entries' bytes are the same every time for the same GPUs: built once.
        key = (elem, tuple((g.index, g.gpu_id, g.domain, g.bus, g.slot, g.pci_device_id)
                           for g in self._gpus))
        head = self._card_entries.get(key)
        if head is None:
            head = b"".join(self._card_entry(elem, g).encode() for g in self._gpus)
            self._card_entries[key] = head
        table = head + bytes(elem.size * (count - len(self._gpus)))
        if hasattr(v, "entries"):
            return DriverResult(arg=v.replace(entries=table).encode())
        return DriverResult(arg=table)

    @staticmethod
    def _card_entry(elem, g):
        e = elem.zero()
        bars = _board_facts(g.pci_device_id)
        return e.replace(valid=1, pci_info=e.pci_info.replace(
            domain=g.domain, bus=g.bus, slot=g.slot,
            vendor_id=NV_PCI_VENDOR_NVIDIA, device_id=g.pci_device_id),
            gpu_id=g.gpu_id, reg_size=bars.get("bar0_size", 0),
            fb_size=bars.get("bar1_size", 0), minor_number=g.index)

    def NV_ESC_RM_SHARE(self, f, dc):
        """The share policy of an object (rmapiShare): the client and the object must exist.
        The policy is kept on the object as the driver keeps its list (COMPOSE adds to it,
        REVOKE takes the same policy out, anything else replaces the list) but not enforced:
        the emulated duplicates follow the default policy (any client may duplicate)."""
        v = dc.call.value
        c = self.clients.get(v.hClient)
        if c is None:
            return self._status(dc, nvs.NV_ERR_INVALID_CLIENT)
        obj = c.objects.get(v.hObject)
        if obj is None:
            return self._status(dc, nvs.NV_ERR_INVALID_OBJECT_HANDLE)
        p = v.sharePolicy
        entry = (int(p.type), int(p.target), int(list(p.accessMask.limbs)[0]),
                 int(p.action) & 0x2)  # (REQUIRE: part of what the policy is)
        if p.action & 0x1:  # RS_SHARE_ACTION_FLAG_REVOKE
            obj.policies = [e for e in obj.policies if e[:3] != entry[:3]]
        elif p.action & 0x4:  # RS_SHARE_ACTION_FLAG_COMPOSE
            obj.policies.append(entry)
        else:
            obj.policies = [entry]
        return self._status(dc, nvs.NV_OK)

    def NV_ESC_ATTACH_GPUS_TO_FD(self, f, dc):
        """nv.c (580): a ctl file only, once per file (EINVAL again); each nonzero id is
        opened with nvidia_dev_get, whose failure the driver ignores (an unknown id is not
        an error). The emulated GPUs are always initialised: holding them changes nothing."""
        if f.node is not NodeKind.CTL or f.attached or not dc.call.value.entries:
            return DriverResult(arg=dc.call.encode(), errno=errno.EINVAL)
        f.attached = True
        return DriverResult(arg=dc.call.encode())

    def NV_ESC_REGISTER_FD(self, f, dc):
        ctl = dc.fd_files.get("ctl_fd")
        if ctl is None or ctl.node is not NodeKind.CTL:
            return DriverResult(arg=dc.call.encode(), errno=errno.EINVAL)
        f.registered_ctl = ctl.id
        return DriverResult(arg=dc.call.encode())

    def NV_ESC_WAIT_OPEN_COMPLETE(self, f, dc):
        return DriverResult(arg=dc.call.value.replace(rc=0, adapterStatus=0).encode())

    def NV_ESC_NUMA_INFO(self, f, dc):
        # No NUMA-onlined GPU memory in the emulation: nid -1, status "disabled".
        v = dc.call.value
        return DriverResult(arg=v.replace(nid=-1, status=0, memblock_size=self.memblock_size or 0,
                                          numa_mem_addr=0, numa_mem_size=0).encode())

    # ------------------------------------------------------------------ RM escapes
    def NV_ESC_RM_ALLOC(self, f, dc):
        v = dc.call.value
        cls = v.hClass
        if cls in (0x0, 0x41):
            h = v.hObjectNew
            while not h or (h in self.clients and not v.hObjectNew):
                # Numbered in order like the driver's, skipping handles in use (as RM's
                # search for a free client handle does): a client someone allocated with
                # an explicit handle never makes another caller's allocation fail.
                h = 0xC1D00000 | next(self._client_ids)
            if h in self.clients:
                return self._status(dc, nvs.NV_ERR_INSERT_DUPLICATE_NAME)
            c = EmuClient(h, f.id, dc.tgid)
            c.objects[h] = EmuObject(h, NV01_ROOT_CLIENT, 0, client=c)
            self.clients[h] = c
            self._clients_of_file.setdefault(f.id, set()).add(h)
            # escape.c forces every user-space client allocation to NV01_ROOT_CLIENT
            return self._status(dc, nvs.NV_OK, hObjectNew=h, hClass=NV01_ROOT_CLIENT)
        c = self.clients.get(v.hRoot)
        if c is None:
            return self._status(dc, nvs.NV_ERR_INVALID_CLIENT)
        parent = c.objects.get(v.hObjectParent)
        if parent is None:
            return self._status(dc, nvs.NV_ERR_INVALID_OBJECT_PARENT)
        h = v.hObjectNew or c.generate_handle()
        if h is None:
            return self._status(dc, nvs.NV_ERR_INSUFFICIENT_RESOURCES)
        if h in c.objects:
            return self._status(dc, nvs.NV_ERR_INSERT_DUPLICATE_NAME)
        spec = (dc.abi or self.abi).rm_class(cls)
        params = spec.params.decode(dc.nested) if (spec and spec.params and dc.nested) else None
        alloc = self.CLASS_ALLOC.get(cls)
        if alloc is None:
            self._note(("class", cls), f"emulator: class {self.abi.class_name(cls)} "
                       f"({cls:#x}) is not modelled: NV_ERR_NOT_SUPPORTED")
            return self._status(dc, nvs.NV_ERR_NOT_SUPPORTED)
        status, gpu, size, params = alloc(self, c, parent, params)
        if status != nvs.NV_OK:
            return self._status(dc, status)
        obj = EmuObject(h, cls, parent.handle, gpu=gpu, size=size, client=c)
        c.objects[h] = obj
        parent.children.add(h)
        self._index(c, obj)
        made = self.CLASS_MADE.get(cls)
        if made is not None:  # what the driver's constructor makes beside the object
            params = made(self, c, parent, obj, params)
        nested = params.encode() if params is not None else dc.nested
        return self._status(dc, nvs.NV_OK, nested=nested, hObjectNew=h)

    def _alloc_device(self, c, parent, params):
        if parent.rm_class not in (0x0, 0x41):
            return nvs.NV_ERR_INVALID_OBJECT_PARENT, None, 0, params
        dev = params.deviceId if params is not None else 0
        if not (0 <= dev < len(self._gpus)):
            return nvs.NV_ERR_INVALID_ARGUMENT, None, 0, params
        return nvs.NV_OK, dev, 0, params

    def _alloc_subdevice(self, c, parent, params):
        if parent.rm_class != 0x80:
            return nvs.NV_ERR_INVALID_OBJECT_PARENT, None, 0, params
        sub = params.subDeviceId if params is not None else 0
        if sub != 0:  # one subdevice per device (no SLI)
            return nvs.NV_ERR_INVALID_ARGUMENT, None, 0, params
        return nvs.NV_OK, parent.gpu, 0, params

    def _alloc_on_subdevice(self, c, parent, params):
        if parent.rm_class != 0x2080:
            return nvs.NV_ERR_INVALID_OBJECT_PARENT, None, 0, params
        return nvs.NV_OK, parent.gpu, 0, params

    def _alloc_local_memory(self, c, parent, params):
        if parent.gpu is None:
            return nvs.NV_ERR_INVALID_OBJECT_PARENT, None, 0, params
        size = int(params.size) if params is not None else 0
        if size <= 0:
            return nvs.NV_ERR_INVALID_ARGUMENT, None, 0, params
        gpu = parent.gpu
        # As the driver (abi/vidmem.py): the size is rounded up to the page size it picks,
        # and the requested alignment only places the offset. Rounding the size up to the
        # alignment charged 1 byte with a 135 GiB alignment as 135 GiB.
        page = vidmem.page_size(size, params.attr, params.attr2)
        if page is None:
            return nvs.NV_ERR_INVALID_ARGUMENT, None, 0, params
        align = int(params.alignment or 0)
        if not vidmem.alignment_usable(align, page):
            if int(params.flags) & vidmem.ALLOC_FLAGS_ALIGNMENT_FORCE:
                return nvs.NV_ERR_INVALID_ARGUMENT, None, 0, params
            align = 0
        align = max(align, page)
        size = vidmem.charged_size(size, params.attr, params.attr2)
        if self.used[gpu] + size > self._gpus[gpu].memory_bytes:
            return nvs.NV_ERR_NO_MEMORY, None, 0, params
        # A made-up address, aligned as asked: nothing is ever accessed through it. (Not an
        # address space either: offsets of live allocations may repeat after frees.)
        offset = (self.used[gpu] + align - 1) // align * align
        if offset + size > self._gpus[gpu].memory_bytes:
            offset = 0  # 0 satisfies every alignment
        # limit is the last byte relative to the allocation (size - 1), as the H200 answered
        params = params.replace(size=size, offset=offset, limit=size - 1)
        return nvs.NV_OK, gpu, size, params

    def _alloc_system_memory(self, c, parent, params):
        # NV01_MEMORY_SYSTEM (cudaHostAlloc, CUDA's own host buffers): host pages under a
        # device; no device memory (size 0 in the GPU's accounting)
        if parent.rm_class != 0x80:
            return nvs.NV_ERR_INVALID_OBJECT_PARENT, None, 0, params
        size = int(params.size) if params is not None else 0
        if size <= 0:
            return nvs.NV_ERR_INVALID_ARGUMENT, None, 0, params
        size = (size + 4095) // 4096 * 4096
        return nvs.NV_OK, parent.gpu, 0, params.replace(size=size, limit=size - 1)

    CLASS_ALLOC = {
        0x80: _alloc_device,
        0x3E: _alloc_system_memory,
        0x2080: _alloc_subdevice,
        0xDE: _alloc_on_subdevice,
        0x40: _alloc_local_memory,
        emulated_sched.CHANNEL_GROUP: emulated_sched.alloc_channel_group,
        emulated_sched.CHANNEL: emulated_sched.alloc_channel,
    }
    # Run after an object of the class entered the client: (backend, client, parent, the new
    # object, params) -> the params of the answer.
    CLASS_MADE = {
        emulated_sched.CHANNEL: emulated_sched.channel_made,
    }

    def NV_ESC_RM_FREE(self, f, dc):
        v = dc.call.value
        c = self.clients.get(v.hRoot)
        if c is None:
            return self._status(dc, nvs.NV_ERR_INVALID_CLIENT)
        if v.hObjectOld == v.hRoot:
            self._free_client(v.hRoot)
            return self._status(dc, nvs.NV_OK)
        if v.hObjectOld not in c.objects:
            # resserv's compatibility mode (rs_server.c): freeing an object that does not
            # exist in an existing client is NV_OK (CUDA frees handles before it allocates
            # them: the H200 answered NV_OK)
            return self._status(dc, nvs.NV_OK)
        stack = [v.hObjectOld]
        while stack:
            obj = c.objects.pop(stack.pop(), None)
            if obj is None:
                continue
            stack.extend(obj.children)
            stack.extend(obj.tied)
            self._release(c, obj)
            par = c.objects.get(obj.parent)
            if par:
                par.children.discard(obj.handle)
        return self._status(dc, nvs.NV_OK)

    def NV_ESC_RM_DUP_OBJECT(self, f, dc):
        """A new handle (hObject, or one the driver picks) under hParent of hClient for
        object hObjectSrc of hClientSrc; both handles then hold the same memory."""
        v = dc.call.value
        dst, src = self.clients.get(v.hClient), self.clients.get(v.hClientSrc)
        if dst is None or src is None:
            return self._status(dc, nvs.NV_ERR_INVALID_CLIENT)
        parent = dst.objects.get(v.hParent)
        if parent is None:
            return self._status(dc, nvs.NV_ERR_INVALID_OBJECT_PARENT)
        obj = src.objects.get(v.hObjectSrc)
        if obj is None or v.hObjectSrc == v.hClientSrc:
            return self._status(dc, nvs.NV_ERR_INVALID_OBJECT_HANDLE)
        h = v.hObject or dst.generate_handle()
        if h is None:
            return self._status(dc, nvs.NV_ERR_INSUFFICIENT_RESOURCES)
        if h in dst.objects:
            return self._status(dc, nvs.NV_ERR_INSERT_DUPLICATE_NAME)
        new = EmuObject(h, obj.rm_class, parent.handle, gpu=obj.gpu, client=dst)
        if obj.share is None:
            obj.share = [obj]
        obj.share.append(new)
        new.share = obj.share
        dst.objects[h] = new
        parent.children.add(h)
        self._index(dst, new)  # a duplicated device counts for the in-use flag too
        return self._status(dc, nvs.NV_OK, hObject=h)

    def NV_ESC_RM_MAP_MEMORY(self, f, dc):
        v = dc.call.value
        p = v.params
        c = self.clients.get(p.hClient)
        target = dc.fd_files.get("fd")
        if c is None or p.hMemory not in c.objects or target is None:
            return DriverResult(arg=v.replace(params=p.replace(
                status=nvs.NV_ERR_INVALID_OBJECT_HANDLE)).encode())
        obj = c.objects[p.hMemory]
        if obj.rm_class != 0xDE:
            self._note(("map", obj.rm_class), "emulator: mapping class "
                       f"{obj.rm_class:#x} is not modelled: NV_ERR_NOT_SUPPORTED")
            return DriverResult(arg=v.replace(params=p.replace(
                status=nvs.NV_ERR_NOT_SUPPORTED)).encode())
        # RM_USER_SHARED_DATA (0xde): the page RM publishes polled counters in. The
        # emulation has no counters to publish, so the page reads as zeros (a consistent,
        # never-updated snapshot), and NVML falls back to "N/A" for what it would show.
        limit = USER_SHARED_DATA_SIZE.get(self.version.split(".")[0])
        if limit is not None and int(p.offset) + int(p.length) > limit:
            return DriverResult(arg=v.replace(params=p.replace(
                status=nvs.NV_ERR_INVALID_LIMIT)).encode())
        length = max(int(p.length), 1)
        target.mapping = bytes((length + 4095) // 4096 * 4096)
        # escape.c: the caching type is always reset to DEFAULT; RM maps this system-memory
        # page DIRECT (what the H200 answered for it).
        flags = (p.flags & ~NVOS33_FLAGS_CACHING_TYPE_MASK & ~NVOS33_FLAGS_MAPPING_MASK
                 | NVOS33_FLAGS_CACHING_TYPE_DEFAULT << NVOS33_FLAGS_CACHING_TYPE_SHIFT
                 | NVOS33_FLAGS_MAPPING_DIRECT << NVOS33_FLAGS_MAPPING_SHIFT)
        return DriverResult(arg=v.replace(params=p.replace(
            status=nvs.NV_OK, flags=flags,
            pLinearAddress=0x7E0000000000 + target.id * 0x10000)).encode())

    def NV_ESC_RM_UNMAP_MEMORY(self, f, dc):
        arg = dc.call.with_status(nvs.NV_OK)  # NVOS34's status
        return DriverResult(arg=dc.call.encode() if arg is None else arg)

    def NV_ESC_RM_CONTROL(self, f, dc):
        v = dc.call.value
        status, nested = self._control(v.hClient, v.hObject, v.cmd, dc.abi or self.abi,
                                       dc.nested, dc)
        return self._status(dc, status, nested=nested)

    def _control(self, h_client: int, h_object: int, cmd: int, abi, nested: bytes | None,
                 dc: DriverCall | None = None) -> tuple[int, bytes | None]:
        """(status, parameters after the call; None: as sent) of one control."""
        c = self.clients.get(h_client)
        if c is None:
            return nvs.NV_ERR_INVALID_CLIENT, None
        obj = c.objects.get(h_object)
        if obj is None:
            return nvs.NV_ERR_INVALID_OBJECT_HANDLE, None
        handler = CONTROL_HANDLERS.get(cmd)
        spec = abi.control(cmd)
        if handler is None or spec is None or spec.params is None or nested is None:
            self._note(("control", cmd), f"emulator: control {self.abi.control_name(cmd)} "
                       f"({cmd:#x}) is not modelled: NV_ERR_NOT_SUPPORTED")
            return nvs.NV_ERR_NOT_SUPPORTED, None
        if getattr(handler, "raw", False):  # (on the block's bytes; None: as sent)
            return handler(self, c, obj, spec.params, nested)
        params = spec.params.decode(nested)
        if getattr(handler, "wants_call", False):  # fds in the parameters (emulated_export)
            if dc is None:
                raise NotHere
            status, params = handler(self, c, obj, params, dc)
        elif getattr(handler, "wants_embedded", False):
            if dc is None:
                raise NotHere
            status, params = handler(self, c, obj, params, dc.embedded, abi=abi)
        else:
            status, params = handler(self, c, obj, params)
        return status, params.encode()

    def can_run_control(self, file: EmuFile) -> bool:
        return True

    def control_is_plain_ioctl(self, file: EmuFile) -> bool:
        return False  # the emulator answers in Python (run_control below)

    def run_control(self, file: EmuFile, fd: int, hdr: bytes, params: bytearray, header,
                    abi) -> tuple[int, int, bytes]:
        """A control (or an allocation) the broker admitted unchanged (broker/fastlane.py):
        the same answer as through NV_ESC_RM_CONTROL (NV_ESC_RM_ALLOC), from the header's
        fields and the parameter block."""
        if header.kind != "control":  # an allocation, a free, a plain escape
            call = abi.decode_ioctl(file.node, header.ioctl_cmd, hdr)
            res = self.ioctl_blocking(file, DriverCall(call, bytes(params) if params else None,
                                                       abi=abi, tgid=0))  # (no root clients)
            if res.nested is not None and len(res.nested) == len(params):
                params[:] = res.nested
            return res.result, res.errno, res.arg
        h_client, h_object, cmd, _ptr, _size = header.unpack(hdr)
        with self._calls:
            status, out = self._control(h_client, h_object, cmd, abi, bytes(params))
        if out is not None:
            params[:] = out
        priv = bytearray(hdr)
        struct.pack_into("<I", priv, header.status_offset, status)
        return 0, 0, bytes(priv)

    # ------------------------------------------------------------------ UVM
    def UVM_INITIALIZE(self, f, dc):
        return self._uvm_ok(dc)

    def UVM_DEINITIALIZE(self, f, dc):
        return self._uvm_ok(dc)

    def UVM_MM_INITIALIZE(self, f, dc):
        return self._uvm_ok(dc)

    def _uvm_ok(self, dc):
        arg = dc.call.with_status(nvs.NV_OK)
        return DriverResult(arg=dc.call.encode() if arg is None else arg)

    # Prefetch and advice on managed ranges (cudaMemPrefetchAsync, cudaMemAdvise): no va
    # space is modelled and nothing moves, so each is done, NV_OK, as the driver answers
    # them on a range of the caller's (the ranges are the broker's books: broker/managed.py)
    def _uvm_hint(self, f, dc):
        return self._uvm_ok(dc)

    UVM_MIGRATE = UVM_SET_PREFERRED_LOCATION = UVM_UNSET_PREFERRED_LOCATION = _uvm_hint
    UVM_SET_ACCESSED_BY = UVM_UNSET_ACCESSED_BY = _uvm_hint
    UVM_ENABLE_READ_DUPLICATION = UVM_DISABLE_READ_DUPLICATION = _uvm_hint

    # ------------------------------------------------------------------ control support
    def gpu_by_id(self, gpu_id: int) -> EmulatedGpu | None:
        for g in self._gpus:
            if g.gpu_id == gpu_id:
                return g
        return None

    def device_in_use(self, gpu: int) -> bool:
        """A device object of this GPU exists in some client (GET_ID_INFO's IN_USE flag)."""
        return self._devices_on.get(gpu, 0) > 0

    def memory_by_pid(self, gpu: int) -> dict[int, int]:
        """Device memory each process (tgid) holds on this GPU through its clients."""
        return dict(self._held.get(gpu, {}))

    def pids_on(self, gpu: int) -> list[int]:
        """The processes holding device memory on this GPU (what GET_PIDS lists)."""
        return sorted(self._held.get(gpu, {}))


def _board_facts(pci_device_id: int) -> dict:
    return H200_FACTS.get(pci_device_id, {})


def _version_matches(client: bytes, rm: bytes, relaxed: bool) -> bool:
    """RmPerformVersionCheck's comparison: character by character up to the first
    difference; equal through the terminating NUL (or, relaxed, through the first '.')."""
    for i in range(NV_RM_API_VERSION_STRING_LENGTH):
        c = client[i] if i < len(client) else 0
        r = rm[i] if i < len(rm) else 0
        if c != r:
            return False
        if relaxed and c == ord("."):
            return True
        if c == 0:
            return True
    return False


def _host_memblock_size() -> int | None:
    try:
        with open("/sys/devices/system/memory/block_size_bytes") as fh:
            return int(fh.read().strip(), 16)
    except (OSError, ValueError):
        return None
