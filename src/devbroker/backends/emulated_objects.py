"""The emulated driver's books: its files, RM clients and objects (backends/emulated.py,
emulated_export.py; broker/handover.py carries them to a successor)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from devbroker.abi.nodes import NodeKind

# The handles the driver picks for a client's objects (rs_client.h, RS_UNIQUE_HANDLE_*).
UNIQUE_HANDLE_BASE = 0xCAF00000
UNIQUE_HANDLE_RANGE = 0x80000


@dataclass
class EmuObject:
    handle: int
    rm_class: int
    parent: int
    gpu: int | None = None
    size: int = 0  # device memory held
    children: set[int] = field(default_factory=set)
    # Handles of one object (RM_DUP_OBJECT): the memory is released with the last of them.
    share: list | None = field(default=None, repr=False, compare=False)
    client: Any = field(default=None, repr=False, compare=False)  # the EmuClient holding it
    # The share policies the driver was given for it (NV_ESC_RM_SHARE), as
    # (type, target, access mask, action) in order; kept, not enforced (see RM_SHARE).
    policies: list = field(default_factory=list, repr=False, compare=False)
    # Handles the driver frees together with this one though neither is the other's child:
    # a channel allocated right under a device and the channel group the driver made to
    # wrap it (kchannelDestruct frees that group; freeing the group frees its channel).
    tied: set[int] = field(default_factory=set)


@dataclass
class EmuClient:
    handle: int
    file_id: int
    tgid: int
    objects: dict[int, EmuObject] = field(default_factory=dict)
    # Where the next handle the driver picks for this client comes from (hObjectNew 0, and
    # the driver's own objects in the client): RS_UNIQUE_HANDLE_BASE + an index that only
    # grows, per client (rs_client.c clientGenResourceHandle), skipping handles in use.
    next_generated: int = 0

    def generate_handle(self) -> int | None:
        """A handle the driver picks for a new object of this client (None: none free)."""
        for _ in range(UNIQUE_HANDLE_RANGE):
            h = UNIQUE_HANDLE_BASE + self.next_generated % UNIQUE_HANDLE_RANGE
            self.next_generated += 1
            if h not in self.objects:
                return h
        return None


@dataclass
class EmuFile:
    id: int
    node: NodeKind
    minor: int
    mapping: bytes | None = None  # what an mmap of this file shows (set by RM_MAP_MEMORY)
    registered_ctl: int | None = None
    export: Any = None  # emulated_export.ExportSlots once objects were exported into it
    attached: bool = False  # ATTACH_GPUS_TO_FD was made on it
