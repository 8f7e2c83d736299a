"""Per-driver-version registry.  A version is data: the table generated from the
open-gpu-kernel-modules tag closest to it (scripts/abigen), plus the hand-written facts in
tables/base.py.  See docs/abi.md, "Adding a driver version".

Tables are large (every published control, class and UVM command, ~3000 structs), so a
DriverABI builds each StructSpec and OpSpec the first time it is asked for.
"""
from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Iterator, Mapping
from types import ModuleType
from typing import Any, Generic, TypedDict, TypeVar

from .driver import DriverABI, OpSpec
from .errors import UnknownVersion
from .spec import Field, StructSpec, parse_fields
from .tables import base as _base

# The tag whose table module is complete; every other tag's module holds its differences.
BASE_TAG = "580.142"

# driver version -> the open-gpu-kernel-modules tag its layouts are read from, and why.
# A driver that NVIDIA tagged uses its own tag; the two untagged releases seen on real
# machines use the newest tag of their branch (their ABI was checked against traces).
VERSIONS: dict[str, dict[str, str]] = {
    "595.45.04": {"tag": "595.45.04", "note": "tagged, newest of the 595 branch"},
    "590.48.01": {"tag": "590.48.01", "note": "tagged, newest of the 590 branch"},
    "580.159.04": {"tag": "580.142",
                   "note": "untagged (the H200's driver): layouts from 580.142, the newest "
                           "580 tag; checked against the recorded H200 sessions"},
    "580.142": {"tag": "580.142", "note": "tagged"},
    "575.64.05": {"tag": "575.64.05", "note": "tagged, newest of the 575 branch"},
    "570.211.01": {"tag": "570.211.01", "note": "tagged, newest of the 570 branch"},
    "550.163.01": {"tag": "550.163.01", "note": "tagged, newest of the 550 branch"},
    "535.309.01": {"tag": "535.288.01",
                   "note": "untagged (Debian 12's user-space stack): layouts from 535.288.01, "
                           "the newest 535 tag"},
    "535.288.01": {"tag": "535.288.01", "note": "tagged, newest of the 535 branch"},
}

TABLE_NAMES = ("STRUCTS", "CONTROLS", "CLASSES", "UVM", "ESCAPES", "CATEGORIES", "DEPRECATED",
               "LEGACY")
# A control's or class's row: (name, parameters' struct, header, the driver's flags)
Row = tuple[str, "str | None", str, "tuple[str, ...] | None"]


class RawTables(TypedDict):
    """The data tables of one tag, merged (tables/hdr_*.py say what each holds)."""

    TAG: str
    STRUCTS: dict[str, tuple[str, str]]
    CONTROLS: dict[int, Row]
    CLASSES: dict[int, Row]
    UVM: dict[int, tuple[str, str | None]]
    ESCAPES: dict[int, str]
    CATEGORIES: dict[int, dict[int, str]]
    DEPRECATED: dict[int, int]
    LEGACY: dict[str, int]


_cache: dict[str, DriverABI] = {}
_lock = threading.Lock()


def versions() -> list[str]:
    return sorted(VERSIONS)


def tags() -> list[str]:
    return sorted({v["tag"] for v in VERSIONS.values()})


def supported(version: str) -> bool:
    return version in VERSIONS


def require_supported(version: str, what: str = "driver") -> str:
    """Return `version` if the registry has its tables, else raise UnknownVersion with a
    message that names the supported versions and how to add one."""
    if version in VERSIONS:
        return version
    raise UnknownVersion(
        f"{what} {version!r} has no ABI tables in this devbroker; supported driver versions: "
        f"{', '.join(versions())}. A driver of another version may lay out its structs "
        "differently: add it first (docs/abi.md, \"Adding a driver version\").")


def get(version: str) -> DriverABI:
    abi = _cache.get(version)
    if abi is not None:
        return abi
    if version not in VERSIONS:
        raise UnknownVersion(f"no ABI table for driver {version!r}; known: {', '.join(versions())}")
    with _lock:
        abi = _cache.get(version)
        if abi is None:
            abi = _cache[version] = _build(version, VERSIONS[version])
    return abi


def table_module(tag: str) -> str:
    return "hdr_" + tag.replace(".", "_")


def _load(mod: str) -> ModuleType:
    return importlib.import_module(f"{__package__}.tables.{mod}")


K = TypeVar("K")
V = TypeVar("V")


def _merge(base: dict[K, V], changed: dict[K, V], removed: list[K]) -> dict[K, V]:
    out = dict(base)
    out.update(changed)
    for k in removed:
        out.pop(k, None)
    return out


_raw: dict[str, RawTables] = {}


def raw_tag_tables(tag: str) -> RawTables:
    """The merged data tables of one tag (before building specs)."""
    tabs = _raw.get(tag)
    if tabs is not None:
        return tabs
    b = _load(table_module(BASE_TAG))
    d = _load(table_module(tag)) if tag != BASE_TAG else None

    def table(k: str) -> Any:  # the generated modules' own annotations give the types
        base = getattr(b, k)
        if d is None:
            return base
        return _merge(base, getattr(d, k + "_CHANGED"), getattr(d, k + "_REMOVED"))

    tabs = RawTables(TAG=tag, STRUCTS=table("STRUCTS"), CONTROLS=table("CONTROLS"),
                     CLASSES=table("CLASSES"), UVM=table("UVM"), ESCAPES=table("ESCAPES"),
                     CATEGORIES=table("CATEGORIES"), DEPRECATED=table("DEPRECATED"),
                     LEGACY=table("LEGACY"))
    _raw[tag] = tabs
    return tabs


def raw_tables(version: str) -> RawTables:
    """The merged data tables of a driver version (used by tests and tools)."""
    return raw_tag_tables(VERSIONS[version]["tag"])


def _annotate(name: str, dsl: str) -> str:
    items = []
    for item in dsl.split():
        fname, _, typ = item.partition(":")
        new = _base.ANNOTATIONS.get((name, fname))
        if new is not None:
            cnt = typ[typ.index("["):] if "[" in typ else ""
            typ = new + cnt
        items.append(f"{fname}:{typ}")
    return " ".join(items)


class _Lazy(Mapping[K, V], Generic[K, V]):
    """A read-only mapping whose values are built on first access (thread-safe enough: two
    threads may both build one value; either result is the same)."""

    def __init__(self, keys: Mapping[K, object] | set[K], build: Callable[[K], V]):
        self._keys = keys
        self._build = build
        self._done: dict[K, V] = {}

    def __getitem__(self, key: K) -> V:
        v = self._done.get(key)
        if v is None:
            if key not in self._keys:
                raise KeyError(key)
            v = self._done[key] = self._build(key)
        return v

    def get(self, key: K, default: Any = None) -> Any:  # Mapping.get without a raise
        v = self._done.get(key)
        if v is not None:
            return v
        if key not in self._keys:
            return default
        return self[key]

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __iter__(self) -> Iterator[K]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def _build(version: str, v: dict[str, str]) -> DriverABI:
    tabs = raw_tables(version)
    raw = dict(tabs["STRUCTS"])

    def make(name: str) -> StructSpec:
        dsl, src = raw[name]
        if dsl.startswith("="):  # typedef alias of another struct
            return structs[dsl[1:]]
        if dsl.startswith("union<"):
            sz, al = dsl[6:-1].split(",")
            return StructSpec(name, [Field("raw", "union", size=int(sz), align=int(al))],
                              source=src)
        return StructSpec(name, parse_fields(_annotate(name, dsl), structs.__getitem__),
                          source=src)

    structs: _Lazy[str, StructSpec] = _Lazy(raw, make)

    def spec_or_none(name: str | None) -> StructSpec | None:
        return structs[name] if name and name in raw else None

    escapes = {}
    for nr, ename in tabs["ESCAPES"].items():
        sname, extra = _base.ESCAPE_STRUCTS.get(ename, (None, _base.EscapeExtra()))
        kind = "frontend" if nr >= 200 else "rm"
        variants: dict[int, StructSpec] = {}
        for vn in extra.get("variants", ()):
            vs = spec_or_none(vn)
            if vs is not None:
                variants[vs.size] = vs
        escapes[nr] = OpSpec(kind, nr, ename, spec_or_none(sname), variants=variants,
                             array_of=spec_or_none(extra.get("array_of")),
                             source="nv-ioctl-numbers.h/nv_escape.h")
    ctl_tab = tabs["CONTROLS"]
    deprecated = tabs["DEPRECATED"]
    legacy = tabs["LEGACY"]

    def control_flags(cmd: int) -> frozenset[str] | None:
        """The driver's flags for a control, as the kernel applies them: a deprecated control
        runs as its V2 control (its flags, plus DEPRECATED_V2); a number with the GSS legacy
        bits (on a GPU object) is forwarded to GSP (GSS_LEGACY, or GSS_LEGACY_PRIVILEGED when
        only root may send it); NO_EXPORT_ENTRY: the kernel's export tables do not list it."""
        entry = ctl_tab.get(deprecated.get(cmd, cmd)) or ctl_tab.get(cmd)
        flags = entry[3] if entry is not None else None
        extra: set[str] = set()
        if cmd in deprecated:
            extra.add("DEPRECATED_V2")
        mask, priv = legacy.get("gss_mask", 0), legacy.get("gss_privileged_mask", 0)
        if mask and cmd & mask and cmd >> 16:
            extra.add("GSS_LEGACY_PRIVILEGED" if priv and cmd & priv == priv else "GSS_LEGACY")
        if flags is None and not extra:
            return None
        if flags is None:
            extra.add("NO_EXPORT_ENTRY")
        return frozenset(flags or ()) | extra

    def make_control(cmd: int) -> OpSpec:
        if cmd in ctl_tab:
            cname, pname, src, _flags = ctl_tab[cmd]
            return OpSpec("control", cmd, cname, spec_or_none(pname), source=src,
                          driver_flags=control_flags(cmd))
        return unpublished(cmd)

    categories = tabs["CATEGORIES"]

    def unpublished(cmd: int) -> OpSpec:
        """A control no header of this tag defines: named by its range, no published
        layout; opaque bytes of the size real clients were seen to send, where known."""
        name = unpublished_control_name(cmd, categories)
        size = _base.UNPUBLISHED_CONTROLS.get(cmd)
        ps = None
        if size is not None:
            ps = StructSpec(name.replace("_CTRL_CMD_", "_CTRL_", 1) + "_PARAMS",
                            parse_fields(f"data:bytes[{size}]", structs.__getitem__),
                            source="observed")
        return OpSpec("control", cmd, name, ps, flags=frozenset({"unpublished"}),
                      source="in no open header (named by its range)",
                      driver_flags=control_flags(cmd))

    ctl_keys = set(ctl_tab) | set(_base.UNPUBLISHED_CONTROLS)
    controls = _Lazy(ctl_keys, make_control)
    cls_tab = tabs["CLASSES"]

    def make_class(cid: int) -> OpSpec:
        cname, pname, src, flags = cls_tab[cid]
        return OpSpec("class", cid, cname, spec_or_none(pname), source=src,
                      driver_flags=None if flags is None else frozenset(flags))

    classes = _Lazy(set(cls_tab), make_class)
    uvm = {cmd: OpSpec("uvm", cmd, uname, spec_or_none(pname), source="uvm_ioctl.h")
           for cmd, (uname, pname) in tabs["UVM"].items()}
    return DriverABI(version, tag=tabs["TAG"], escapes=escapes, controls=controls,
                     classes=classes, uvm=uvm, structs=structs, unpublished=unpublished)


def op_names(version: str) -> dict[str, dict[int, str]]:
    """The names of a version's escapes, controls, classes and UVM commands, read from its
    tables without building a layout: what labels need (building every control's layout,
    as iterating ``get(version).controls`` does, takes a second or more of a broker's start).
    The same names as the built specs'."""
    tabs = raw_tables(version)
    controls = {cmd: entry[0] for cmd, entry in tabs["CONTROLS"].items()}
    for cmd in _base.UNPUBLISHED_CONTROLS:
        controls.setdefault(cmd, unpublished_control_name(cmd, tabs["CATEGORIES"]))
    return {"escapes": dict(tabs["ESCAPES"]), "controls": controls,
            "classes": {cid: entry[0] for cid, entry in tabs["CLASSES"].items()},
            "uvm": {cmd: entry[0] for cmd, entry in tabs["UVM"].items()}}


def unpublished_control_name(cmd: int, categories: dict[int, dict[int, str]]) -> str:
    """A stable name for a control in no header: its class, the name of its category (the
    range NVIDIA's headers name, e.g. CLK_LEGACY_NON_PRIVILEGED for 0x2080_90xx) and its
    index: 0x20809001 -> NV2080_CTRL_CMD_CLK_LEGACY_NON_PRIVILEGED_UNPUBLISHED_01."""
    cls, cat, idx = cmd >> 16, (cmd >> 8) & 0xFF, cmd & 0xFF
    prefix = f"NV{cls:04X}_CTRL_CMD"
    cname = categories.get(cls, {}).get(cat)
    if cname is not None and cname != "RESERVED":
        return f"{prefix}_{cname}_UNPUBLISHED_{idx:02X}"
    return f"{prefix}_UNPUBLISHED_{cat:02X}{idx:02X}"
