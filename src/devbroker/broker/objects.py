"""The RM objects each tenant created, with their parents, GPUs and charged memory.

The driver keeps the real tree; the broker keeps this shadow of it so that it can (1) refuse
handles a tenant does not own, (2) know which GPU an allocation lands on, and (3) give back
quota when a subtree is freed or the owning file is closed — without asking the driver.
"""
from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any


class _Removal(ctypes.Structure):
    """One entry of BooksLog's ring (native/lane.c struct dvb_removal)."""
    _fields_ = [("seq", ctypes.c_uint64), ("kind", ctypes.c_uint32),
                ("client", ctypes.c_uint32), ("object", ctypes.c_uint32),
                ("_pad", ctypes.c_uint32), ("dev", ctypes.c_int64), ("ino", ctypes.c_int64)]


class BooksLog:
    """What the seccomp native loop's *settled controls* (native/lane.c, struct
    dvb_settled) must hear of the books: a decision the broker made stands until something
    it read changes, and these say what changed, in C-readable memory.

    Four words: the **policy epoch** (every policy change: capabilities, GPUs, quotas,
    pace, revocation — every settled fact is stale then), the **charge epoch** (the memory
    a tenant holds changed, which only answers patched with its use read:
    rewrite.fb_info_patch; also a quota placeholder leaving the books, Broker._reserved),
    the head of a ring of **removals**: an object (client, handle), a whole client, or
    a closed file (dev, inode) — each makes the facts about exactly that stale — and the
    **devices epoch**: a device object (NV01_DEVICE_0) entered or left some client's books,
    which only GET_ID_INFO's IN_USE flag reads (rewrite.IdFlag: the loop's copy of the GPUs
    the tenant holds a device of stands while this word does). Adding any other object
    changes no decision already made, so it is not logged. The loop reads the ring
    from where it last stopped; one that fell more than the ring's size behind forgets
    every fact about objects.

    Read `now()` *before* deciding: a change during the decision then shows (a later head
    or epoch), and the loop does not write down the decision. Written under a lock (the
    entry, then its sequence number, then the head: x86 keeps stores in order)."""

    RING = 4096  # native/lane.c reads the size from here
    OBJECT, CLIENT, FILE = 1, 2, 3  # kinds of removal (native/lane.c DVB_REMOVED_*)

    def __init__(self) -> None:
        # policy, charges, removals written, devices (native/lane.c reads all four)
        self.words = (ctypes.c_uint64 * 4)(1, 1, 0, 1)
        self.ring = (_Removal * self.RING)()
        self._lock = threading.Lock()

    @property
    def address(self) -> int:
        return ctypes.addressof(self.words)

    @property
    def ring_address(self) -> int:
        return ctypes.addressof(self.ring)

    def now(self) -> tuple[int, int, int]:
        """(policy epoch, charge epoch, removals written) as of now."""
        w = self.words
        return w[0], w[1], w[2]

    def policy_changed(self) -> None:
        with self._lock:
            self.words[0] += 1
            self.words[1] += 1

    def charged(self) -> None:
        with self._lock:
            self.words[1] += 1

    def devices_changed(self) -> None:
        with self._lock:
            self.words[3] += 1

    def devices_now(self) -> int:
        """The devices epoch (read under STATE_LOCK with the books it stands for)."""
        return self.words[3]

    def removed(self, kind: int, client: int = 0, obj: int = 0, dev: int = 0,
                ino: int = 0) -> None:
        with self._lock:
            seq = self.words[2] + 1
            e = self.ring[seq % self.RING]
            e.seq = 0  # (a reader that sees 0 or another number knows it was overwritten)
            e.kind, e.client, e.object = kind, client & 0xFFFFFFFF, obj & 0xFFFFFFFF
            e.dev, e.ino = dev, ino
            e.seq = seq
            self.words[2] = seq
            self.words[1] += 1  # (what it held is charged no more)

    def removed_objects(self, client: int, handles) -> None:
        for h in handles:
            self.removed(self.OBJECT, client, h)


BOOKS = BooksLog()


@dataclass
class RmObject:
    handle: int
    rm_class: int
    parent: int  # 0 for a root client
    gpu: int | None = None  # GPU index this object lives on, inherited from its device
    charged: int = 0  # bytes of device memory this object counts against the tenant
    pinned: int = 0  # bytes of host memory it pins (against the tenant's pinned_host_memory)
    children: set[int] = field(default_factory=set)
    # Handles of one underlying object (an allocation and its duplicates, RM_DUP_OBJECT),
    # in any of the tenant's clients: the same list object for all of them, or None. The
    # driver keeps the memory until the last of them is freed, so the charge stays with
    # whichever is left (drop_objects).
    share: list | None = field(default=None, repr=False, compare=False)
    # The client whose books hold this object (its running totals follow a moved charge).
    owner: "RmClient | None" = field(default=None, repr=False, compare=False)
    # Access rights (RS_ACCESS mask) the tenant granted beyond its own process with a broad
    # share policy, kept here instead of by the driver (broker/shares.py): given, at each
    # duplicate by one of the tenant's own clients, to exactly that client.
    tenant_share: int = 0
    # Called with the object when it leaves the books (freed, its client or file gone, or
    # replaced): an index kept elsewhere (compute's channel groups by tenant and engine)
    # drops it there, instead of walking every object to find what is gone.
    watch: Callable[["RmObject"], None] | None = field(default=None, repr=False,
                                                        compare=False)


def _unwatch(obj: RmObject) -> None:
    watch, obj.watch = obj.watch, None
    if watch is not None:
        watch(obj)


DEVICE_CLASS = 0x80  # NV01_DEVICE_0


@dataclass
class RmClient:
    """A root client (class 0x41) and everything allocated under it.

    Running totals (`charged`: bytes per GPU, `devices`: device objects per GPU) are kept
    as objects come and go, so that the quota check and GET_ID_INFO's in-use flag cost
    O(1) per client instead of a walk over every object."""

    handle: int
    session: int  # the ctl-file session that owns it (the driver frees it with that file)
    tgid: int
    objects: dict[int, RmObject] = field(default_factory=dict)
    charged: dict[int, int] = field(default_factory=dict)  # GPU -> bytes, nonzero only
    devices: dict[int, int] = field(default_factory=dict)  # GPU -> device objects
    pinned_total: int = 0  # bytes of host memory its objects pin
    # Where compute's search for a channel group the driver made in this client starts
    # (compute.driver_group_of): the index after the last handle it found.
    groups_from: int = 0

    def __post_init__(self) -> None:
        self.objects.setdefault(self.handle, RmObject(self.handle, 0x41, 0))
        for obj in self.objects.values():
            obj.owner = self
            if obj.handle != self.handle:
                self._count(obj, 1)

    def _count(self, obj: RmObject, sign: int) -> None:
        self.pinned_total += sign * obj.pinned
        if obj.gpu is None:
            return
        if obj.charged:
            n = self.charged.get(obj.gpu, 0) + sign * obj.charged
            if n:
                self.charged[obj.gpu] = n
            else:
                self.charged.pop(obj.gpu, None)
        if obj.rm_class == DEVICE_CLASS:
            BOOKS.devices_changed()
            n = self.devices.get(obj.gpu, 0) + sign
            if n:
                self.devices[obj.gpu] = n
            else:
                self.devices.pop(obj.gpu, None)

    def add(self, handle: int, rm_class: int, parent: int, *, gpu: int | None = None,
            charged: int = 0, pinned: int = 0) -> RmObject:
        parent_obj = self.objects[parent]
        if gpu is None:
            gpu = parent_obj.gpu
        old = self.objects.get(handle)
        if old is not None:  # replaced (the driver refuses a duplicate; the books follow)
            self._count(old, -1)
            _unwatch(old)
            BOOKS.removed(BooksLog.OBJECT, self.handle, handle)
        obj = RmObject(handle, rm_class, parent, gpu=gpu, charged=charged, pinned=pinned,
                       owner=self)
        self.objects[handle] = obj
        parent_obj.children.add(handle)
        self._count(obj, 1)
        if charged:
            BOOKS.charged()
        return obj

    def subtree(self, handle: int) -> list[RmObject]:
        """The object and all its descendants (the driver frees them together)."""
        out: list[RmObject] = []
        stack = [handle]
        while stack:
            obj = self.objects.get(stack.pop())
            if obj is None:
                continue
            out.append(obj)
            stack.extend(obj.children)
        return out

    def remove(self, handle: int) -> list[RmObject]:
        gone = self.subtree(handle)
        if gone and handle < 0:  # a placeholder (Broker._reserved): no call can name it
            BOOKS.charged()
        elif gone:
            BOOKS.removed_objects(self.handle, [o.handle for o in gone])
        for obj in gone:
            if self.objects.pop(obj.handle, None) is not None:
                self._count(obj, -1)
        obj = gone[0] if gone else None
        if obj is not None and obj.parent in self.objects:
            self.objects[obj.parent].children.discard(handle)
        return gone

    def charged_by_gpu(self) -> dict[int, int]:
        return dict(self.charged)

    def holds_device(self, gpu: int) -> bool:
        return self.devices.get(gpu, 0) > 0


def share(original: RmObject, dup: RmObject) -> None:
    """dup is a new handle of original's object (RM_DUP_OBJECT): one charge for both."""
    if original.share is None:
        original.share = [original]
    original.share.append(dup)
    dup.share = original.share


def drop_objects(objects) -> None:
    """These objects left the books (freed, or their client or file went away). A charge
    shared with a handle that is still there moves to it: the memory is still held."""
    for obj in objects:
        if obj.watch is not None:
            _unwatch(obj)
        members = obj.share
        if members is None:
            continue
        members[:] = [m for m in members if m is not obj]  # by identity
        obj.share = None
        if obj.charged and members:
            BOOKS.charged()
            heir = members[0]
            owner = heir.owner
            if owner is not None and owner.objects.get(heir.handle) is heir:
                owner._count(heir, -1)  # its client's running totals follow the charge
                heir.charged += obj.charged
                owner._count(heir, 1)
            else:
                heir.charged += obj.charged
            obj.charged = 0


class ClientRegistry:
    """Every root client the broker knows of, with its tenant and the ctl-file session it
    came through: the only place clients are added and removed.

    The tenant's view (TenantState.clients: handle -> RmClient, read on every call) is a
    dict this registry alone writes; the owner of a handle and the clients of a session are
    answered from the registry's own indexes. All lookups are O(1); nothing walks all
    clients. Sessions and tenants are the core's (Session, TenantState), used by their
    `id`, `tenant`, `caller`, `name` and `clients` only."""

    def __init__(self) -> None:
        self._tenant: dict[int, Any] = {}  # handle -> TenantState
        self._of_session: dict[int, set[int]] = {}  # session id -> handles

    def add(self, session, client: RmClient) -> RmClient:
        """Record `client`, allocated through `session`'s ctl file (so its tenant's)."""
        if client.session != session.id:
            raise ValueError(f"client {client.handle:#x} names session {client.session}, "
                             f"not {session.id}")
        h = client.handle
        if h in self._tenant:  # (the driver refuses a duplicate: the books follow it)
            self.remove(h)
        tenant = session.tenant
        self._tenant[h] = tenant
        tenant.clients[h] = client
        if client.devices:  # (GET_ID_INFO's IN_USE flag reads the tenant's devices)
            BOOKS.devices_changed()
        self._of_session.setdefault(session.id, set()).add(h)
        return client

    def new(self, session, handle: int) -> RmClient:
        """A new, empty root client of `session`'s tenant, allocated by its caller."""
        return self.add(session, RmClient(handle, session.id, session.caller.pid))

    def remove(self, handle: int) -> RmClient | None:
        """The client is gone (freed, or its file closed): it and its objects leave the
        books, and the charges they shared move to the handles still there."""
        tenant = self._tenant.pop(handle, None)
        if tenant is None:
            return None
        BOOKS.removed(BooksLog.CLIENT, handle)
        client = tenant.clients.pop(handle)
        if client.devices:
            BOOKS.devices_changed()
        held = self._of_session.get(client.session)
        if held is not None:
            held.discard(handle)
            if not held:
                del self._of_session[client.session]
        drop_objects(client.objects.values())
        return client

    def close_session(self, session_id: int) -> list[RmClient]:
        """The session's ctl file closed: the driver frees every client allocated through it."""
        return [c for h in list(self._of_session.get(session_id, ()))
                if (c := self.remove(h)) is not None]

    def owner(self, handle: int) -> str | None:
        """The name of the tenant that holds the client, or None."""
        tenant = self._tenant.get(handle)
        return None if tenant is None else tenant.name

    @staticmethod
    def of_tenant(tenant) -> Mapping[int, RmClient]:
        """The tenant's clients by handle, read-only (TenantState.clients itself: by the
        TenantState, not the name, which a revoked tenant shares with its successor)."""
        return MappingProxyType(tenant.clients)

    def of_session(self, session_id: int) -> frozenset[int]:
        """The handles of the clients allocated through this session's ctl file."""
        return frozenset(self._of_session.get(session_id, ()))

    def owners(self):
        """(handle, tenant name) of every client, in the order they were added."""
        return ((h, t.name) for h, t in self._tenant.items())

    def __contains__(self, handle: int) -> bool:
        return handle in self._tenant

    def __len__(self) -> int:
        return len(self._tenant)
