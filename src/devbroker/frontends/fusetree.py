"""The static file system a tenant's directory holds, as data (no FUSE in here): its device
nodes (what the broker is told on OPEN) and its read-only files, such as the
/proc/driver/nvidia view the daemon builds for each tenant (broker/procview.py). The FUSE
front end (fuse.py) serves these trees and turns their changes into inode updates.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence, Union

from devbroker.abi.nodes import NodeKind

Content = Union[bytes, str, Callable[[], Union[bytes, str]]]


@dataclass(frozen=True)
class NodeSpec:
    """A device node file: what the broker is told on OPEN."""

    kind: NodeKind
    minor: int = 0


@dataclass(frozen=True)
class TenantTree:
    """Everything one tenant's directory holds.

    ``nodes`` maps a relative path ("nvidiactl", "nvidia-caps/nvidia-cap1") to a NodeSpec;
    ``files`` maps a relative path ("proc/driver/nvidia/version") to read-only content:
    bytes, str, or a callable returning either (called at open, so every open sees a
    consistent snapshot, and at stat for the size).
    """

    nodes: Mapping[str, NodeSpec] = field(default_factory=dict)
    files: Mapping[str, Content] = field(default_factory=dict)

    @classmethod
    def standard(cls, gpus: int | Sequence[int], files: Mapping[str, Content] | None = None, *,
                 uvm: bool = True, extra_nodes: Mapping[str, NodeSpec] | None = None) -> "TenantTree":
        """nvidiactl, one nvidia<minor> per GPU, nvidia-uvm and nvidia-uvm-tools.

        ``gpus`` is either a count (minors 0..gpus-1) or the GPU minors themselves, as the
        broker numbers them in OpenRequest.minor (e.g. the host indices of the tenant's GPUs).
        """
        minors = range(gpus) if isinstance(gpus, int) else list(gpus)
        nodes: dict[str, NodeSpec] = {"nvidiactl": NodeSpec(NodeKind.CTL, 0)}
        for i in minors:
            nodes[f"nvidia{int(i)}"] = NodeSpec(NodeKind.GPU, int(i))
        if uvm:
            nodes["nvidia-uvm"] = NodeSpec(NodeKind.UVM, 0)
            nodes["nvidia-uvm-tools"] = NodeSpec(NodeKind.UVM_TOOLS, 0)
        nodes.update(extra_nodes or {})
        return cls(nodes=nodes, files=dict(files or {}))

    @classmethod
    def from_dict(cls, d: Mapping) -> "TenantTree":
        """The plain form {"gpus": [minors], "uvm": bool, "proc": {path: content}} where
        proc paths are relative to proc/driver/nvidia/ (what the daemon builds)."""
        files = {f"proc/driver/nvidia/{p.lstrip('/')}": c for p, c in (d.get("proc") or {}).items()}
        files.update(d.get("files") or {})
        return cls.standard(d.get("gpus", ()), files, uvm=bool(d.get("uvm", True)),
                            extra_nodes=d.get("nodes"))


def split(path: str) -> list[bytes]:
    parts = [p for p in path.split("/") if p]
    if not parts:
        raise ValueError(f"empty path {path!r}")
    for p in parts:
        if p in (".", "..") or "\0" in p or len(p.encode()) > 255:
            raise ValueError(f"bad path component {p!r} in {path!r}")
    return [p.encode() for p in parts]


def desired(tree: TenantTree) -> dict:
    """Nested dict name -> dict (directory) | NodeSpec | ("file", content)."""
    root: dict = {}
    items = [(p, s) for p, s in tree.nodes.items()] + [(p, ("file", c)) for p, c in tree.files.items()]
    for path, what in items:
        parts = split(path)
        d = root
        for comp in parts[:-1]:
            nxt = d.setdefault(comp, {})
            if not isinstance(nxt, dict):
                raise ValueError(f"{path!r}: {comp.decode()!r} is both a file and a directory")
            d = nxt
        if parts[-1] in d:
            raise ValueError(f"{path!r} is given twice or is also a directory")
        d[parts[-1]] = what
    return root


def render(content: Content) -> bytes:
    value = content() if callable(content) else content
    return value.encode() if isinstance(value, str) else bytes(value)
