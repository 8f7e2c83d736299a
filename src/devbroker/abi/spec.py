"""Declarative struct layouts: StructSpec (a C struct's layout) and StructValue (one decoded value).

Why declarative: the broker's policy, fd/handle translation and rewriting must be driven by
tables ("this field is an fd", "this pointer points to the control's params, sized by
paramsSize"), not by per-struct code.  Each Field therefore carries a *kind*:

    plain scalars   u8 u16 u32 u64 i8 i16 i32 i64 bool f32 f64
    roles           handle (u32)  fd (i32)  ptr (u64)  size (u32, or u64 via "size64")
                    status (u32)  class (u32)  cmd (u32)
    aggregates      bytes[n]  array[elem, n]  struct  union (kept as raw bytes)

Layout follows the x86-64 System V C rules the driver is compiled with: every field is
aligned to its natural alignment (NvU64/NvP64 to 8, also where the headers spell it
NV_DECLARE_ALIGNED/NV_ALIGN_BYTES(8)), a struct is aligned to its largest member and its
size is rounded up to that alignment.

Speed: each spec is compiled once into a single struct.Struct that covers the whole struct,
padding included (padding is kept as raw bytes, never dropped, so that encode(decode(x)) == x
even where a client left garbage in padding).  Aggregates are unpacked lazily on first access.
"""
from __future__ import annotations

import re
import struct
from typing import Any, Callable, Iterator

from .errors import DecodeError

# kind -> (struct format char, size); alignment == size for all scalars on x86-64
_SCALAR = {
    "u8": "B", "u16": "H", "u32": "I", "u64": "Q",
    "i8": "b", "i16": "h", "i32": "i", "i64": "q",
    "bool": "B", "f32": "f", "f64": "d",
    "handle": "I", "fd": "i", "ptr": "Q", "size": "I", "size64": "Q",
    "status": "I", "class": "I", "cmd": "I",
}
ROLES = frozenset({"handle", "fd", "ptr", "size", "status", "class", "cmd"})


class Field:
    """One member of a struct.

    kind        see module doc ("size64" is reported as kind "size")
    offset      byte offset inside the struct
    size        bytes
    count       element count for arrays/bytes, else None
    elem        element spec (StructSpec) or scalar kind for arrays
    spec        StructSpec for kind "struct"
    points_to   for ptr fields: a StructSpec, or a symbolic target resolved by DriverABI:
                "control" (RM_CONTROL params, by cmd), "class" (RM_ALLOC params, by hClass),
                "xfer" (XFER_CMD payload, by cmd)
    size_field  for ptr fields: the sibling field that holds the pointee's byte size
    """

    __slots__ = ("name", "kind", "base", "offset", "size", "align", "count", "elem", "spec",
                 "points_to", "size_field", "_index", "_conv", "_sst", "scalar")
    size: int
    align: int
    # set by the StructSpec that lays the field out: its slot in the struct's one unpack,
    # and for arrays of scalars the Struct that converts the slot's bytes
    _index: int
    _conv: struct.Struct | None

    def __init__(self, name: str, kind: str, *, count: int | None = None, elem: Any = None,
                 spec: "StructSpec | None" = None, size: int | None = None, align: int = 1,
                 points_to: Any = None, size_field: str | None = None):
        self.name = name
        self.base = kind
        self.kind = "size" if kind == "size64" else kind
        self.count = count
        self.elem = elem
        self.spec = spec
        self.points_to = points_to
        self.size_field = size_field
        self.offset = 0
        self._sst: struct.Struct | None = None
        # A plain attribute, not a property: read for every field access.
        self.scalar = kind in _SCALAR
        if kind in _SCALAR:
            self._sst = struct.Struct("<" + _SCALAR[kind])  # for single-field reads
            self.size = self.align = self._sst.size
        elif kind in ("bytes", "array"):
            if count is None:
                raise ValueError(f"field {name}: {kind} needs a count")
            if kind == "bytes":
                self.size, self.align = count, 1
            elif isinstance(elem, StructSpec):
                self.size, self.align = elem.size * count, elem.align
            else:
                esz = struct.calcsize("<" + _SCALAR[elem])
                self.size, self.align = esz * count, esz
        elif kind == "struct":
            if spec is None:
                raise ValueError(f"field {name}: struct needs its spec")
            self.size, self.align = spec.size, spec.align
        elif kind == "union":
            if size is None:
                raise ValueError(f"field {name}: union needs its size")
            self.size, self.align = size, align
        else:
            raise ValueError(f"unknown field kind {kind!r}")

    def __repr__(self) -> str:
        extra = f"[{self.count}]" if self.count is not None else ""
        return f"<Field {self.name}:{self.base}{extra} @{self.offset} size {self.size}>"


class StructSpec:
    """The layout of one C struct, named by the driver's typedef name."""

    def __init__(self, name: str, fields: list[Field], *, source: str = ""):
        self.name = name
        self.source = source  # header file the layout was taken from
        self.fields: list[Field] = []
        self.by_name: dict[str, Field] = {}
        fmt = ["<"]
        off = 0
        align = 1
        nslot = 0
        for f in fields:
            pad = (-off) % f.align
            if pad:
                fmt.append(f"{pad}s")
                nslot += 1
                off += pad
            f.offset = off
            f._index = nslot
            fmt.append(_SCALAR[f.base] if f.scalar else f"{f.size}s")
            nslot += 1
            off += f.size
            align = max(align, f.align)
            self.fields.append(f)
            self.by_name[f.name] = f
        pad = (-off) % align
        if pad:
            fmt.append(f"{pad}s")
            off += pad
        self.size = off
        self.align = align
        self._st = struct.Struct("".join(fmt))
        # fields that need converting after unpack (aggregates): index -> field
        self._lazy = {f._index: f for f in self.fields if not f.scalar}
        for f in self.fields:
            f._conv = None
            if f.kind == "array" and not isinstance(f.elem, StructSpec):
                f._conv = struct.Struct(f"<{f.count}{_SCALAR[f.elem]}")
        assert self._st.size == self.size, (name, self._st.size, self.size)

    # ---------------------------------------------------------------- decode / encode
    def decode(self, buf: bytes | bytearray | memoryview, *, base: int = 0, path: str = "",
               exact: bool = False, partial: bool = False) -> "StructValue":
        """Decode `buf`; bytes beyond the struct are kept (see StructValue.trailing).

        partial=True accepts a buffer shorter than the struct (a recorder's capture window):
        the missing tail reads as zeros and encode() returns only the bytes that were given.
        `base` and `path` only shape error messages for nested buffers."""
        n = len(buf)
        if partial and n < self.size:
            v = StructValue(self, bytes(buf) + bytes(self.size - n), b"")
            v._limit = n
            return v
        if n < self.size:
            for f in self.fields:
                if f.offset + f.size > n:
                    raise DecodeError(base + f.offset, _join(path, f.name),
                                      f"truncated: {self.name} needs {self.size} bytes, got {n}")
            raise DecodeError(base + n, _join(path, "<padding>"),
                              f"truncated: {self.name} needs {self.size} bytes, got {n}")
        if exact and n != self.size:
            raise DecodeError(base + self.size, _join(path, "<end>"),
                              f"wrong size: {self.name} is {self.size} bytes, got {n}")
        raw = buf if type(buf) is bytes else bytes(buf)
        if n == self.size:
            return StructValue(self, raw, b"")
        return StructValue(self, raw[: self.size], raw[self.size:])

    def encode(self, value: "StructValue | dict[str, Any]") -> bytes:
        if isinstance(value, StructValue):
            return value.encode()
        return self.zero().replace(**value).encode()

    def zero(self) -> "StructValue":
        return StructValue(self, bytes(self.size), b"")

    def field_at(self, offset: int) -> str:
        """Dotted name of the field covering byte `offset` (for error messages)."""
        for f in self.fields:
            if f.offset <= offset < f.offset + f.size:
                if f.spec is not None:  # kind "struct"
                    return f.name + "." + f.spec.field_at(offset - f.offset)
                return f.name
        return "<padding>"

    def walk(self, prefix: str = "") -> Iterator[tuple[str, Field, int]]:
        """Yield (dotted path, field, absolute offset) for every field, nested included
        (arrays of structs are described once, as path[])."""
        for f in self.fields:
            p = _join(prefix, f.name)
            yield p, f, f.offset
            if f.spec is not None:  # kind "struct"
                for q, g, o in f.spec.walk(p):
                    yield q, g, f.offset + o
            elif f.kind == "array" and isinstance(f.elem, StructSpec):
                for q, g, o in f.elem.walk(p + "[]"):
                    yield q, g, f.offset + o

    def fields_of_kind(self, kind: str) -> list[str]:
        return [p for p, f, _ in self.walk() if f.kind == kind]

    def __repr__(self) -> str:
        return f"<StructSpec {self.name} size {self.size}>"


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


class StructValue:
    """One decoded struct: attribute access, iteration over (name, value), replace(), encode().

    Immutable: replace() returns a new value.  Bytes beyond the struct (a UVM argument
    window, an RM_ALLOC window) are kept in `.trailing` and re-emitted by encode()."""

    __slots__ = ("spec", "_raw", "trailing", "_vals", "_cache", "_dirty", "_limit")

    def __init__(self, spec: StructSpec, raw: bytes, trailing: bytes = b""):
        self.spec = spec
        self._raw = raw
        self.trailing = trailing
        self._vals: list[Any] | None = None
        self._cache: dict[int, Any] = {}
        self._dirty = False
        self._limit: int | None = None  # set for partial (windowed) decodes

    @property
    def partial(self) -> bool:
        return self._limit is not None

    def _values(self) -> list[Any]:
        v = self._vals
        if v is None:
            v = self._vals = list(self.spec._st.unpack(self._raw))
        return v

    def __getattr__(self, name: str) -> Any:
        try:
            f = self.spec.by_name[name]
        except KeyError:
            raise AttributeError(f"{self.spec.name} has no field {name!r}") from None
        if f.scalar:  # the hot case (an NVOS54's handles and command), in one frame
            v = self._vals
            if v is None:
                # One unpack of the whole struct (one C call; array fields stay bytes)
                # costs about what one field's unpack_from does, and the next field is a
                # list index.
                v = self._vals = list(self.spec._st.unpack(self._raw))
            return v[f._index]
        return self._get(f)

    def _get(self, f: Field) -> Any:
        i = f._index
        if f.scalar:
            if self._vals is None:
                self._vals = list(self.spec._st.unpack(self._raw))
            return self._vals[i]
        c = self._cache.get(i)
        if c is not None:
            return c
        raw = self._values()[i]
        if f.kind == "array":
            if f._conv is not None:
                c = list(f._conv.unpack(raw))
            else:
                es = f.elem.size
                c = [StructValue(f.elem, raw[k * es:(k + 1) * es])
                     for k in range(f.count or 0)]
        elif f.spec is not None:  # kind "struct"
            c = StructValue(f.spec, raw)
        else:  # bytes, union
            c = raw
        self._cache[i] = c
        return c

    def __getitem__(self, name: str) -> Any:
        return getattr(self, name)

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        for f in self.spec.fields:
            yield f.name, self._get(f)

    def keys(self) -> list[str]:
        return [f.name for f in self.spec.fields]

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in self.spec.fields:
            v = self._get(f)
            if isinstance(v, StructValue):
                v = v.to_dict()
            elif isinstance(v, list) and v and isinstance(v[0], StructValue):
                v = [e.to_dict() for e in v]
            out[f.name] = v
        return out

    def element(self, name: str, k: int) -> Any:
        """Entry k of an array field, decoded alone (a control that asks for 3 of 128
        entries need not build 128 values)."""
        f = self.spec.by_name[name]
        if f.kind != "array" or f.count is None or not 0 <= k < f.count:
            raise IndexError(f"{self.spec.name}.{name}[{k}]")
        c = self._cache.get(f._index)
        if c is not None:
            return c[k]
        raw = self._values()[f._index]
        if f._conv is not None:
            esz = f.size // f.count
            return struct.unpack_from("<" + _SCALAR[f.elem], raw, k * esz)[0]
        es = f.elem.size
        return StructValue(f.elem, raw[k * es:(k + 1) * es])

    def raw_field(self, name: str) -> bytes:
        """The bytes of one array, struct or bytes field as they are in the value (for
        rewrites that patch a few entries of a long table in place)."""
        f = self.spec.by_name[name]
        if f.scalar:
            raise TypeError(f"{self.spec.name}.{name} is a scalar")
        c = self._cache.get(f._index)
        if c is not None:  # changed since decode: encode what it is now
            return self.encode()[f.offset:f.offset + f.size]
        raw: bytes = self._values()[f._index]
        return raw

    def replace_elements(self, name: str, changes: dict[int, Any]) -> "StructValue":
        """A new value with entries of one array field replaced (by index), the others'
        bytes untouched."""
        f = self.spec.by_name[name]
        if f.kind != "array" or f.count is None:
            raise TypeError(f"{self.spec.name}.{name} is not an array")
        if not changes:
            return self
        c = self._cache.get(f._index)
        if c is not None:  # decoded already: the general path
            new = list(c)
            for k, v in changes.items():
                new[k] = v
            return self.replace(**{name: new})
        buf = bytearray(self._values()[f._index])
        esz = f.size // f.count
        for k, v in changes.items():
            if not 0 <= k < f.count:
                raise IndexError(f"{self.spec.name}.{name}[{k}]")
            if f._conv is not None:
                b = struct.pack("<" + _SCALAR[f.elem], v)
            else:
                b = v.encode()[:esz] if isinstance(v, StructValue) else f.elem.encode(v)
            buf[k * esz:(k + 1) * esz] = b
        return self.replace(**{name: bytes(buf)})

    def replace(self, **kw: Any) -> "StructValue":
        vals = list(self._values())
        cache = dict(self._cache)
        for name, v in kw.items():
            f = self.spec.by_name.get(name)
            if f is None:
                raise AttributeError(f"{self.spec.name} has no field {name!r}")
            i = f._index
            cache.pop(i, None)
            if f.scalar:
                try:
                    struct.pack("<" + _SCALAR[f.base], v)
                except struct.error as e:
                    raise ValueError(f"{self.spec.name}.{name}: {e}") from None
                vals[i] = v
                continue
            if isinstance(v, StructValue):
                b = v.encode()[: v.spec.size]
            elif isinstance(v, (bytes, bytearray, memoryview)):
                b = bytes(v)
            elif f.kind == "array" and f.count is not None:
                v = list(v)
                if len(v) > f.count:
                    raise ValueError(f"{self.spec.name}.{name}: {len(v)} > {f.count} elements")
                if f._conv is not None:
                    v = v + [0] * (f.count - len(v))
                    b = f._conv.pack(*v)
                else:
                    b = b"".join(e.encode()[: f.elem.size] if isinstance(e, StructValue)
                                 else f.elem.encode(e) for e in v)
                    b += bytes(f.size - len(b))
            elif f.spec is not None and isinstance(v, dict):  # kind "struct"
                b = f.spec.encode(v)
            else:
                raise TypeError(f"{self.spec.name}.{name}: cannot set from {type(v).__name__}")
            if len(b) < f.size:  # e.g. a short string for a char[] field
                b = b + bytes(f.size - len(b))
            if len(b) != f.size:
                raise ValueError(f"{self.spec.name}.{name}: {len(b)} bytes, field is {f.size}")
            vals[i] = b
        new = StructValue(self.spec, self._raw, self.trailing)
        new._vals = vals
        new._cache = cache
        new._dirty = True
        new._limit = self._limit
        return new

    def encode(self) -> bytes:
        if not self._dirty:
            out = self._raw + self.trailing if self.trailing else self._raw
        else:
            out = self.spec._st.pack(*self._values()) + self.trailing
        return out if self._limit is None else out[: self._limit]

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, StructValue) and other.spec.name == self.spec.name
                and other.encode() == self.encode())

    def __hash__(self) -> int:
        return hash((self.spec.name, self.encode()))

    def __repr__(self) -> str:
        return f"{self.spec.name}({format_value(self)})"


# ---------------------------------------------------------------------- formatting
def format_value(v: StructValue, *, max_items: int = 8,
                 status_name: Callable[[int], str] | None = None) -> str:
    """Compact one-line rendering; handles/ptrs/classes/cmds in hex, zero-filled arrays
    summarised, bytes that look like C strings shown as strings."""
    parts = []
    for f in v.spec.fields:
        x = v._get(f)
        parts.append(f"{f.name}={_fmt(f, x, max_items, status_name)}")
    return " ".join(parts)


def _fmt(f: Field, x: Any, max_items: int, status_name: Callable[[int], str] | None) -> str:
    if isinstance(x, StructValue):
        return "{" + format_value(x, max_items=max_items, status_name=status_name) + "}"
    if isinstance(x, bytes):
        if f.kind == "bytes":
            s = x.split(b"\0", 1)[0]
            if s and all(32 <= c < 127 for c in s) and not any(x[len(s):]):
                return repr(s.decode())
        if not any(x):
            return f"0*{len(x)}"
        return x.hex() if len(x) <= 32 else x[:32].hex() + f"…({len(x)}B)"
    if isinstance(x, list):
        n = len(x)
        while n and (x[n - 1] == 0 or (isinstance(x[n - 1], StructValue)
                                        and not any(x[n - 1].encode()))):
            n -= 1
        sub = Field.__new__(Field)
        sub.kind = f.elem if isinstance(f.elem, str) else "struct"
        items = [_fmt(sub, e, max_items, status_name) for e in x[:min(n, max_items)]]
        more = f",…+{n - max_items}" if n > max_items else ""
        return "[" + ",".join(items) + more + "]" + (f"/{len(x)}" if n < len(x) else "")
    if f.kind == "status" and status_name is not None:
        return status_name(x) if x else "NV_OK"
    if f.kind in ("handle", "ptr", "class", "cmd") or (isinstance(x, int) and x > 0xffff):
        return hex(x)
    return str(x)


# ---------------------------------------------------------------------- compact DSL
# A struct is written as a whitespace-separated list of "name:type" items, e.g.
#   "hClient:handle params:ptr->control@paramsSize paramsSize:size gpuIds:u32[32]"
# type is a scalar kind, bytes[N], a known struct name (optionally [N]),
# union<SIZE,ALIGN>, or ptr->TARGET@SIZEFIELD.
_ITEM = re.compile(r"^([A-Za-z_][\w]*):([\w<>,\-@.]+?)(?:\[(\d+)\])?$")


def parse_fields(text: str, lookup: Callable[[str], "StructSpec"]) -> list[Field]:
    out = []
    for item in text.split():
        m = _ITEM.match(item)
        if not m:
            raise ValueError(f"bad field item {item!r}")
        name, typ, cnt = m.group(1), m.group(2), m.group(3)
        n = int(cnt) if cnt is not None else None
        if typ.startswith("ptr->"):
            tgt, _, szf = typ[5:].partition("@")
            out.append(Field(name, "ptr", points_to=tgt, size_field=szf or None))
        elif typ.startswith("union<"):
            sz, al = typ[6:-1].split(",")
            out.append(Field(name, "union", size=int(sz) * (n or 1), align=int(al)))
        elif typ == "bytes":
            out.append(Field(name, "bytes", count=n))
        elif typ in _SCALAR:
            out.append(Field(name, "array", elem=typ, count=n) if n is not None
                       else Field(name, typ))
        else:
            sub = lookup(typ)
            out.append(Field(name, "array", elem=sub, count=n) if n is not None
                       else Field(name, "struct", spec=sub))
    return out
