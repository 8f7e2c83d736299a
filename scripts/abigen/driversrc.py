"""Facts read from open-gpu-kernel-modules beyond the struct layouts (scripts/abigen).

* control numbers and names: `#define NVxxxx_CTRL_CMD_* (0x…)` in the SDK's ctrl headers, with
  FINN's `/* finn: Evaluated from "…X_PARAMS_MESSAGE_ID" */` naming the parameter struct;
* each control's flags, parameter size and implementing class: the exported-method tables
  NVOC generates into `src/nvidia/generated/g_*_nvoc.c` (`/*flags=*/ 0x…u`, `/*methodId=*/`,
  `/*paramSize=*/ sizeof(T)`), decoded with the `RMCTRL_FLAGS_*` values of
  `src/nvidia/inc/kernel/rmapi/control.h`;
* classes: `src/nvidia/src/kernel/rmapi/resource_list.h` (`RS_ENTRY`: the external class, its
  allocation parameters `RS_REQUIRED(T)`/`RS_OPTIONAL(T)`/`RS_NONE`, its `RS_FLAGS_*` from
  `resource_desc_flags.h`), and the class numbers of `src/common/sdk/nvidia/inc/class/cl*.h`;
* escapes (`nv-ioctl-numbers.h`, `nv-ioctl-numa.h`, `nv_escape.h`) and UVM commands
  (`uvm_ioctl.h`, `uvm_linux_ioctl.h`), from the preprocessed unit's macros;
* control categories (`NVxxxx_CTRL_<CATEGORY> (0x..)` in the ctrl base headers): the names of
  the ranges that unpublished controls are named after.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from cdecl import eval_c_expr

SDK = "src/common/sdk/nvidia/inc"


def rel(root: Path, path: str | os.PathLike) -> str:
    p = os.path.relpath(os.path.realpath(path), os.path.realpath(root))
    return p


def short_source(path: str) -> str:
    """Header paths as the tables store them: the SDK's prefix dropped ("ctrl/…", "class/…",
    "nvos.h"), other paths from the repository root."""
    return path[len(SDK) + 1:] if path.startswith(SDK + "/") else path


# ---------------------------------------------------------------------- controls (headers)
@dataclass
class HeaderControl:
    name: str
    params: str | None  # the struct FINN's MESSAGE_ID comment names
    file: str


_CMD_FINN = re.compile(r"#define\s+(\w+_CTRL_\w+)\s+\(?\s*(0x[0-9a-fA-F]+)[uU]?\s*\)?"
                       r"\s*/\*\s*finn: Evaluated from \"([^\"]*)\"")
_CMD_PLAIN = re.compile(r"^\s*#\s*define\s+(NV\w+_CTRL_CMD_\w+)\s+\(?\s*(0x[0-9a-fA-F]+)[uU]?\s*\)?"
                        r"\s*(?:/[/*].*)?$", re.M)


def header_controls(root: Path, cats: dict[int, dict[int, str]]) -> dict[int, HeaderControl]:
    """Every control command the SDK headers define. A command is a `*_CTRL_*` define with
    FINN's "Evaluated from (…INTERFACE_ID << 8) | …" comment, or (hand-written headers) a
    `*_CTRL_CMD_*` hex value whose upper 16 bits are the class the name starts with
    (NV2080_… -> 0x2080xxxx) and whose category byte is one the class's base header names."""
    out: dict[int, HeaderControl] = {}
    base = root / SDK
    for path in sorted(base.rglob("*.h")):
        raw = path.read_text(errors="replace")
        src = short_source(rel(root, path))
        for m in _CMD_FINN.finditer(raw):
            cmd = int(m.group(2), 16)
            expr = m.group(3)
            if "INTERFACE_ID" not in expr:
                continue
            mm = re.search(r"(\w+)_MESSAGE_ID", expr)
            out.setdefault(cmd, HeaderControl(m.group(1), mm.group(1) if mm else None, src))
        for m in _CMD_PLAIN.finditer(raw):
            name, cmd = m.group(1), int(m.group(2), 16)
            cm = re.match(r"NV([0-9A-F]{4})_", name)
            if cm is None or int(cm.group(1), 16) != cmd >> 16:
                continue
            if re.search(r"MESSAGE_ID|_FLAGS_|_MAX|_SIZE$|_COUNT$", name):
                continue
            cat = (cmd >> 8) & 0xFF
            if cat == 0 and cmd & 0xFF:  # category RESERVED holds only CMD_NULL
                continue
            if cats.get(cmd >> 16) is not None and cat not in cats[cmd >> 16]:
                continue
            out.setdefault(cmd, HeaderControl(name, None, src))
    return out


# ---------------------------------------------------------------------- controls (driver)
@dataclass
class ExportEntry:
    cmd: int
    flags: int
    access: int
    param_type: str | None  # sizeof(T) in the table; None for paramSize 0
    func: str
    klass: str  # the NVOC class whose table lists it (Subdevice, Device, RmClientResource…)
    file: str


_EXPORT = re.compile(
    r"/\*flags=\*/\s*(0x[0-9a-fA-F]+)u?,\s*"
    r"/\*accessRight=\*/\s*(0x[0-9a-fA-F]+)u?,\s*"
    r"/\*methodId=\*/\s*(0x[0-9a-fA-F]+)u?,\s*"
    r"/\*paramSize=\*/\s*(sizeof\((\w+)\)|0\s*(?:/\*[^*]*\*/)?),\s*"
    r"/\*pClassInfo=\*/\s*&\(__nvoc_class_def_(\w+)\.classInfo\),\s*"
    r"(?:#if NV_PRINTF_STRINGS_ALLOWED\s*)?/\*func=\*/\s*\"(\w+)\"", re.S)


def export_tables(root: Path) -> dict[int, list[ExportEntry]]:
    out: dict[int, list[ExportEntry]] = {}
    for path in sorted((root / "src/nvidia/generated").glob("g_*_nvoc.c")):
        raw = path.read_text(errors="replace")
        if "methodId" not in raw:
            continue
        for m in _EXPORT.finditer(raw):
            e = ExportEntry(int(m.group(3), 16), int(m.group(1), 16), int(m.group(2), 16),
                            m.group(5), m.group(7), m.group(6), rel(root, path))
            out.setdefault(e.cmd, []).append(e)
    return out


def _flag_defines(path: Path, prefix: str) -> dict[str, str]:
    raw = path.read_text(errors="replace")
    raw = re.sub(r"/\*.*?\*/", " ", raw, flags=re.S)
    raw = re.sub(r"//[^\n]*", " ", raw)
    return {m.group(1): m.group(2).strip() for m in re.finditer(
        rf"^\s*#\s*define\s+({prefix}\w*)\s+(.+)$", raw, flags=re.M)}


def _single_bits(defs: dict[str, str], prefix: str) -> dict[int, str]:
    """bit value -> flag name (without the prefix), for the defines that are one bit."""
    def ident(n):
        if n in defs:
            return eval_c_expr(_nvbit(defs[n]), ident)
        return None
    out: dict[int, str] = {}
    for name, body in defs.items():
        try:
            v = eval_c_expr(_nvbit(body), ident)
        except Exception:
            continue
        if v and v & (v - 1) == 0:
            out.setdefault(v, name[len(prefix):])
    return out


def _nvbit(s: str) -> str:
    return re.sub(r"NVBIT\s*\(\s*(\d+)\s*\)", r"(1 << \1)", s)


def rmctrl_flag_bits(root: Path) -> dict[int, str]:
    """RMCTRL_FLAGS_* bit -> name ("PRIVILEGED", "NON_PRIVILEGED", "INTERNAL", …).
    KERNEL_PRIVILEGED and NONE are 0 in the driver: a control with none of NON_PRIVILEGED,
    PRIVILEGED and INTERNAL is kernel-only (control.c, rmControlValidateClientPrivilegeAccess)."""
    path = root / "src/nvidia/inc/kernel/rmapi/control.h"
    return _single_bits(_flag_defines(path, "RMCTRL_FLAGS_"), "RMCTRL_FLAGS_")


def decode_bits(value: int, bits: dict[int, str]) -> list[str]:
    names = [bits[b] for b in sorted(bits) if value & b]
    rest = value & ~sum(b for b in bits)
    if rest:
        names.append(f"0x{rest:x}")
    return names


# ---------------------------------------------------------------------- classes
@dataclass
class RsEntry:
    class_name: str
    internal: str
    param_type: str | None
    required: bool
    flags: list[str]
    root: bool  # parents RS_ROOT_OBJECT: a client, made by serverAllocClient (no class check)


def rs_entries(root: Path) -> list[RsEntry]:
    base = root / "src/nvidia/src/kernel/rmapi"
    flag_defs = _flag_defines(base / "resource_desc_flags.h", "RS_FLAGS_")

    def ident(n):
        if n in flag_defs:
            return eval_c_expr(_nvbit(flag_defs[n]), ident)
        return None
    bits = _single_bits(flag_defs, "RS_FLAGS_")
    raw = (base / "resource_list.h").read_text(errors="replace")
    raw = re.sub(r"/\*.*?\*/", " ", raw, flags=re.S)
    raw = re.sub(r"//[^\n]*", " ", raw)
    out = []
    for m in re.finditer(r"RS_ENTRY\s*\(", raw):
        depth, j = 1, m.end()
        while depth:
            depth += {"(": 1, ")": -1}.get(raw[j], 0)
            j += 1
        args, cur, d = [], "", 0
        for ch in raw[m.end():j - 1]:
            if ch == "," and d == 0:
                args.append(cur.strip())
                cur = ""
                continue
            d += {"(": 1, ")": -1}.get(ch, 0)
            cur += ch
        args.append(cur.strip())
        if len(args) != 8:
            raise ValueError(f"RS_ENTRY with {len(args)} arguments: {args[:2]}")
        cls, internal, _multi, parents, alloc, _prio, flags, _rights = args
        pm = re.match(r"RS_(REQUIRED|OPTIONAL)\s*\(\s*(\w+)\s*\)", alloc)
        value = eval_c_expr(_nvbit(" ".join(flags.split())), ident)
        out.append(RsEntry(cls, internal, pm.group(2) if pm else None,
                           bool(pm and pm.group(1) == "REQUIRED"), decode_bits(value, bits),
                           parents.strip() == "RS_ROOT_OBJECT"))
    return out


def class_headers(root: Path) -> dict[str, tuple[str, str | None]]:
    """class define name -> (header, FINN's allocation-parameters struct or None), for every
    `#define NAME (0x…)` in class/cl*.h that is a class number: FINN marks it with
    "…_MESSAGE_ID", or its value is the number in the file's name (cl2080.h: 0x2080)."""
    out: dict[str, tuple[str, str | None]] = {}
    for path in sorted((root / SDK / "class").glob("cl*.h")):
        raw = path.read_text(errors="replace")
        fm = re.match(r"cl([0-9a-fA-F]+)", path.stem)
        file_id = int(fm.group(1), 16) if fm else None
        src = short_source(rel(root, path))
        for m in re.finditer(r"^\s*#\s*define\s+([A-Z]\w+)\s+\(?\s*(0x[0-9a-fA-F]+)[uU]?\s*\)?"
                             r"[ \t]*(/\*\s*finn: Evaluated from \"(\w+)_MESSAGE_ID\"\s*\*/)?",
                             raw, flags=re.M):
            name, value = m.group(1), int(m.group(2), 16)
            params = m.group(4)
            if name.endswith(("_MESSAGE_ID", "_H", "_H_")):
                continue
            if params or value == file_id:
                out.setdefault(name, (src, params))
    return out


# ---------------------------------------------------------------------- escapes, UVM
ESCAPE_FILES = ("nv-ioctl-numbers.h", "nv-ioctl-numa.h", "nv_escape.h")


def escapes(unit) -> dict[int, str]:
    out: dict[int, str] = {}
    for name, (body, file) in unit.defines.items():
        if not name.startswith("NV_ESC_") or os.path.basename(file) not in ESCAPE_FILES:
            continue
        v = unit.define_value(name)
        if v is not None:
            out.setdefault(v, name)
    return dict(sorted(out.items()))


def uvm_commands(unit) -> dict[int, str]:
    out: dict[int, str] = {}
    for name, (body, file) in unit.defines.items():
        base = os.path.basename(file)
        m = re.fullmatch(r"UVM_IOCTL_BASE\s*\(\s*(\d+)\s*\)", body)
        if base == "uvm_ioctl.h" and m:
            out.setdefault(int(m.group(1)), name)
        elif base == "uvm_linux_ioctl.h" and re.fullmatch(r"0x3000000\d", body):
            out.setdefault(int(body, 16), name)
    return dict(sorted(out.items()))


# ---------------------------------------------------------------------- categories
def categories(root: Path) -> dict[int, dict[int, str]]:
    """Control categories per class: {0x2080: {0x90: "CLK_LEGACY_NON_PRIVILEGED", …}}: the run
    of `#define NVxxxx_CTRL_<NAME> (0x..)` lines that starts at NVxxxx_CTRL_RESERVED (0x00)
    in the class's ctrl base header."""
    out: dict[int, dict[int, str]] = {}
    line_re = re.compile(r"^\s*#\s*define\s+NV([0-9A-F]{4})_CTRL_([A-Z0-9_]+)\s+\(\s*0x([0-9a-fA-F]{1,2})\s*\)")
    for path in sorted((root / SDK / "ctrl").rglob("*.h")):
        lines = path.read_text(errors="replace").splitlines()
        for i, line in enumerate(lines):
            m = line_re.match(line)
            if not m or m.group(2) != "RESERVED":
                continue
            cls = int(m.group(1), 16)
            cats = out.setdefault(cls, {})
            for nxt in lines[i:]:
                mm = line_re.match(nxt)
                if mm is None or int(mm.group(1), 16) != cls:
                    break
                cats.setdefault(int(mm.group(3), 16), mm.group(2))
    return out


# ---------------------------------------------------------------------- deprecated, GSS legacy
DEPRECATED_DIR = "src/nvidia/interface/deprecated"


def deprecated_controls(root: Path, by_name: dict[str, int]) -> dict[int, int]:
    """cmd -> the V2 control the kernel converts it to (rmapi_deprecated_control.c:
    rmDeprecatedControlTable); the caller's call then runs as the V2 control, with its flags."""
    path = root / DEPRECATED_DIR / "rmapi_deprecated_control.c"
    if not path.exists():
        return {}
    raw = path.read_text(errors="replace")
    table = re.search(r"rmDeprecatedControlTable\[\]\s*=\s*\{(.*?)\};", raw, re.S)
    out: dict[int, int] = {}
    for m in re.finditer(r"\{\s*(NV\w+)\s*,\s*V2_CONVERTER\((_\w+)\)", table.group(1) if table else ""):
        old, conv = m.group(1), m.group(2)
        body = re.search(r"V2_CONVERTER\(" + re.escape(conv) + r"\)\s*\([^)]*\)\s*\{(.*?)\n\}",
                         raw, re.S)
        if body is None or old not in by_name:
            continue
        nm = re.search(r"\b(NV\w+_CTRL_CMD_\w+_V2)\b", body.group(1))
        if nm and nm.group(1) in by_name:
            out[by_name[old]] = by_name[nm.group(1)]
    return out


def gss_legacy_masks(root: Path) -> dict[str, int]:
    """RM_GSS_LEGACY_MASK*: a control number with the 0x8000 bit (a LEGACY_* category) on a
    GPU driven by GSP firmware is forwarded to GSP as is (rmapi_gss_legacy_control.c:
    RmGssLegacyRpcCmd), without the kernel's export-table lookup and flags; with both bits of
    the privileged mask only root (or the kernel) may send it."""
    path = root / DEPRECATED_DIR / "rmapi_deprecated.h"
    if not path.exists():
        return {}
    defs = _flag_defines(path, "RM_GSS_LEGACY_MASK")
    out = {}
    for name, key in (("RM_GSS_LEGACY_MASK", "gss_mask"),
                      ("RM_GSS_LEGACY_MASK_PRIVILEGED", "gss_privileged_mask")):
        if name in defs:
            out[key] = int(defs[name].rstrip("uU"), 0)
    return out
