"""The RM objects each tenant created, with their parents, GPUs and charged memory.

The driver keeps the real tree; the broker keeps this shadow of it so that it can (1) refuse
handles a tenant does not own, (2) know which GPU an allocation lands on, and (3) give back
quota when a subtree is freed or the owning file is closed — without asking the driver.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RmObject:
    handle: int
    rm_class: int
    parent: int  # 0 for a root client
    gpu: int | None = None  # GPU index this object lives on, inherited from its device
    charged: int = 0  # bytes of device memory this object counts against the tenant
    children: set[int] = field(default_factory=set)
    # Handles of one underlying object (an allocation and its duplicates, RM_DUP_OBJECT),
    # in any of the tenant's clients: the same list object for all of them, or None. The
    # driver keeps the memory until the last of them is freed, so the charge stays with
    # whichever is left (drop_objects).
    share: list | None = field(default=None, repr=False, compare=False)


@dataclass
class RmClient:
    """A root client (class 0x41) and everything allocated under it."""

    handle: int
    session: int  # the ctl-file session that owns it (the driver frees it with that file)
    tgid: int
    objects: dict[int, RmObject] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.objects.setdefault(self.handle, RmObject(self.handle, 0x41, 0))

    def add(self, handle: int, rm_class: int, parent: int, *, gpu: int | None = None,
            charged: int = 0) -> RmObject:
        parent_obj = self.objects[parent]
        if gpu is None:
            gpu = parent_obj.gpu
        obj = RmObject(handle, rm_class, parent, gpu=gpu, charged=charged)
        self.objects[handle] = obj
        parent_obj.children.add(handle)
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
        for obj in gone:
            self.objects.pop(obj.handle, None)
        obj = gone[0] if gone else None
        if obj is not None and obj.parent in self.objects:
            self.objects[obj.parent].children.discard(handle)
        return gone

    def charged_by_gpu(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for obj in self.objects.values():
            if obj.charged and obj.gpu is not None:
                out[obj.gpu] = out.get(obj.gpu, 0) + obj.charged
        return out


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
        members = obj.share
        if members is None:
            continue
        members[:] = [m for m in members if m is not obj]  # by identity
        obj.share = None
        if obj.charged and members:
            members[0].charged += obj.charged
            obj.charged = 0
