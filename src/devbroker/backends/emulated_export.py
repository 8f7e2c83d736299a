"""The emulated driver's object export through nvidiactl fds, modelled on
cliresCtrlCmdOsUnix{ExportObjectsToFd,ImportObjectsFromFd,GetExportObjectInfo}_IMPL in
NVIDIA's open kernel modules (src/nvidia/arch/nvalloc/unix/src/osapi.c, tag 580.x):

- The fd names a ctl file (the driver refuses others: NV_ERR_INVALID_PARAMETER). Its first
  export sets up `maxObjects` slots, the device instance of `hDevice` (NV_MAX_DEVICES when 0)
  and 64 bytes of metadata; a second setup of the same file keeps the first.
- Exporting an object duplicates it into an internal client of the driver's: the memory then
  lives until the slot is written again or the export file is closed, whatever the exporter
  frees. Modelled as a hidden client of the export file (closed with it).
- Importing gives the importer a new handle (its own or one the driver picks) of the
  slot's object, under hParent; an empty slot reports type NONE.

The broker finds the export file in DriverCall.fd_files["params.fd"] (the tenant's fd,
translated). Handlers take the call too (`wants_call`)."""
from __future__ import annotations

from dataclasses import dataclass, field

from devbroker.abi import status as nvs
from devbroker.abi.nodes import NodeKind
from devbroker.backends.emulated_controls import CONTROL_HANDLERS
from devbroker.backends.emulated_objects import EmuClient, EmuObject

NV_MAX_DEVICES = 32
NV_U32_MAX = 0xFFFFFFFF
EXPORT_MAX_OBJECTS = 512  # NV0000_CTRL_OS_UNIX_EXPORT_OBJECTS_TO_FD_MAX_OBJECTS
IMPORT_MAX_OBJECTS = 128  # NV0000_CTRL_OS_UNIX_IMPORT_OBJECTS_TO_FD_MAX_OBJECTS
# NV0000_CTRL_CMD_OS_UNIX_IMPORT_OBJECT_TYPE_*
TYPE_NONE, TYPE_VIDMEM, TYPE_SYSMEM = 0, 1, 2
VIDMEM_CLASSES = frozenset({0x40, 0x50})  # NV01_MEMORY_LOCAL_USER, NV50_MEMORY_VIRTUAL...
EXPORT_CLIENT_BASE = 0xE0000000  # the hidden clients' handles (one per export file)


@dataclass
class ExportSlots:
    client: EmuClient  # the driver's internal client that keeps exported objects alive
    device_instance: int
    metadata: bytes
    slots: list[int | None] = field(default_factory=list)  # handle in `client`, or None


def _wants_call(fn):
    fn.wants_call = True
    return fn


def _register(cmd: int):
    def register(fn):
        CONTROL_HANDLERS[cmd] = _wants_call(fn)
        return fn
    return register


def _export_file(backend, dc):
    f = dc.fd_files.get("params.fd")
    if f is None or getattr(f, "node", None) is not NodeKind.CTL:
        return None
    return f


def _instance_of(client, h: int) -> int:
    """The device instance an object lives on (the emulator numbers them as its GPUs)."""
    gpu = client.objects[h].gpu
    return NV_MAX_DEVICES if gpu is None else gpu


@_register(0x3D0B)  # NV0000_CTRL_CMD_OS_UNIX_EXPORT_OBJECTS_TO_FD
def export_objects(backend, client, obj, p, dc):
    f = _export_file(backend, dc)
    if f is None:
        return nvs.NV_ERR_INVALID_PARAMETER, p
    ex = getattr(f, "export", None)
    fresh = ex is None
    if fresh:
        if p.maxObjects == 0:
            return nvs.NV_ERR_INVALID_PARAMETER, p
        if p.hDevice:
            dev = client.objects.get(p.hDevice)
            if dev is None:
                return nvs.NV_ERR_OBJECT_NOT_FOUND, p
            if dev.rm_class != 0x80:
                return nvs.NV_ERR_INVALID_PARAMETER, p
            instance = dev.gpu
        else:
            instance = NV_MAX_DEVICES
        hidden = EmuClient(EXPORT_CLIENT_BASE | f.id, f.id, client.tgid)
        hidden.objects[hidden.handle] = EmuObject(hidden.handle, 0x41, 0, client=hidden)
        ex = ExportSlots(hidden, instance, bytes(p.metadata), [None] * p.maxObjects)
    if p.numObjects > EXPORT_MAX_OBJECTS:
        return nvs.NV_ERR_INVALID_PARAMETER, p
    if p.numObjects + p.index > len(ex.slots):
        return nvs.NV_ERR_OUT_OF_RANGE, p
    wanted = list(p.objects)[:p.numObjects]
    for h in wanted:
        if not h:
            continue
        if h not in client.objects or h == client.handle:
            return nvs.NV_ERR_OBJECT_NOT_FOUND, p
        if _instance_of(client, h) != ex.device_instance:
            return nvs.NV_ERR_INVALID_PARAMETER, p
    if fresh:
        f.export = ex
        backend.clients[ex.client.handle] = ex.client
        backend._clients_of_file.setdefault(f.id, set()).add(ex.client.handle)
    hidden = ex.client
    for i, h in enumerate(wanted):
        k = p.index + i
        old = ex.slots[k]
        if old is not None:  # the slot's previous object is let go
            gone = hidden.objects.pop(old, None)
            if gone is not None:
                backend._release(hidden, gone)
            ex.slots[k] = None
        if not h:
            continue
        src = client.objects[h]
        handle = 0xE1000000 | next(backend._object_ids)
        new = EmuObject(handle, src.rm_class, hidden.handle, gpu=src.gpu, client=hidden)
        if src.share is None:
            src.share = [src]
        src.share.append(new)
        new.share = src.share
        hidden.objects[handle] = new
        ex.slots[k] = handle
    return nvs.NV_OK, p


@_register(0x3D0C)  # NV0000_CTRL_CMD_OS_UNIX_IMPORT_OBJECTS_FROM_FD
def import_objects(backend, client, obj, p, dc):
    f = _export_file(backend, dc)
    ex = getattr(f, "export", None) if f is not None else None
    if ex is None or p.numObjects > IMPORT_MAX_OBJECTS:
        return nvs.NV_ERR_INVALID_PARAMETER, p
    if p.numObjects + p.index > len(ex.slots):
        return nvs.NV_ERR_OUT_OF_RANGE, p
    parent = client.objects.get(p.hParent)
    if parent is None:
        return nvs.NV_ERR_INVALID_OBJECT_PARENT, p
    objects, types = list(p.objects), bytearray(p.objectTypes)
    made: list[int] = []
    for i in range(p.numObjects):
        slot = ex.slots[p.index + i]
        if slot is None:
            types[i] = TYPE_NONE
            continue
        src = ex.client.objects[slot]
        h = objects[i] or client.generate_handle()
        if h is None or h in client.objects:
            for m in made:  # the driver frees what it imported before failing
                gone = client.objects.pop(m)
                parent.children.discard(m)
                backend._release(client, gone)
            return nvs.NV_ERR_INSERT_DUPLICATE_NAME, p
        new = EmuObject(h, src.rm_class, parent.handle, gpu=src.gpu, client=client)
        src.share.append(new)
        new.share = src.share
        client.objects[h] = new
        parent.children.add(h)
        backend._index(client, new)
        made.append(h)
        objects[i] = h
        types[i] = TYPE_VIDMEM if src.rm_class in VIDMEM_CLASSES else TYPE_SYSMEM
    return nvs.NV_OK, p.replace(objects=objects, objectTypes=bytes(types))


@_register(0x3D08)  # NV0000_CTRL_CMD_OS_UNIX_GET_EXPORT_OBJECT_INFO
def export_object_info(backend, client, obj, p, dc):
    f = _export_file(backend, dc) if p.fd >= 0 else None
    ex = getattr(f, "export", None) if f is not None else None
    if ex is None:
        return nvs.NV_ERR_INVALID_PARAMETER, p
    p = p.replace(maxObjects=len(ex.slots), deviceInstance=ex.device_instance,
                  metadata=ex.metadata)
    if "gpuInstanceId" in p.spec.by_name:  # (not in 535's parameters)
        p = p.replace(gpuInstanceId=NV_U32_MAX)
    return nvs.NV_OK, p
