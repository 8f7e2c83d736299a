"""The emulated driver's books: its files, RM clients and objects (backends/emulated.py,
emulated_export.py; broker/handover.py carries them to a successor)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from devbroker.abi.nodes import NodeKind


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


@dataclass
class EmuClient:
    handle: int
    file_id: int
    tgid: int
    objects: dict[int, EmuObject] = field(default_factory=dict)


@dataclass
class EmuFile:
    id: int
    node: NodeKind
    minor: int
    mapping: bytes | None = None  # what an mmap of this file shows (set by RM_MAP_MEMORY)
    registered_ctl: int | None = None
    export: Any = None  # emulated_export.ExportSlots once objects were exported into it
    attached: bool = False  # ATTACH_GPUS_TO_FD was made on it
