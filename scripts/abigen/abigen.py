#!/usr/bin/env python3
"""Generate devbroker's ABI tables from NVIDIA's open-gpu-kernel-modules (developer tool).

    .venv/bin/python scripts/abigen/abigen.py --git-dir OGKM.git TAG [TAG ...]
    .venv/bin/python scripts/abigen/abigen.py --git-dir OGKM.git --all
    .venv/bin/python scripts/abigen/abigen.py --src /path/to/checkout-at-TAG TAG

For each tag it reads the published headers and the driver's own tables and writes:

* `src/devbroker/abi/tables/hdr_<tag>.py`: every control (number, name, parameter struct,
  RMCTRL flags), every class (name, allocation parameters, RS flags), every escape and UVM
  command, the control categories, and the layout (devbroker's field DSL) of every struct
  they reach. The base tag's module is complete; the others hold what differs from it.
* `tests/data/abi/parity-<tag>.json.gz`: sizeof, alignment and every field's offset and size
  of each of those structs as gcc computes them from the headers (a C probe compiled and run
  here), so that CI checks the tables against the compiler without the headers or network.

Needs gcc and the project's venv (it lays structs out with devbroker.abi.spec and checks the
result against the probe before writing anything). Facts only are written: names, numbers,
types and array lengths; no NVIDIA code is copied. See docs/abi.md, "Adding a driver version".
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "src"))

import cdecl  # noqa: E402
import driversrc  # noqa: E402
import emit  # noqa: E402
import probe  # noqa: E402
from devbroker.abi.spec import Field, StructSpec, parse_fields  # noqa: E402
from devbroker.abi.tables import base as hand  # noqa: E402

# What `git archive` extracts (the headers and the driver-source files the readers need).
ARCHIVE_PATHS = ["src/common/sdk/nvidia/inc", "src/common/inc", "kernel-open/common/inc",
                 "kernel-open/nvidia-uvm", "src/nvidia/arch/nvalloc/unix/include",
                 "src/nvidia/generated", "src/nvidia/inc/kernel/rmapi",
                 "src/nvidia/src/kernel/rmapi", "src/nvidia/interface/deprecated"]
INCLUDE_DIRS = ["src/common/sdk/nvidia/inc", "src/common/sdk/nvidia/inc/ctrl",
                "kernel-open/common/inc", "src/nvidia/arch/nvalloc/unix/include",
                "kernel-open/nvidia-uvm", "src/common/inc"]
# The translation unit: every SDK ctrl/class/alloc header plus the ioctl headers.
TOP_HEADERS = ["nvtypes.h", "nvos.h"]
TAIL_HEADERS = ["nv-ioctl.h", "nv-ioctl-numa.h", "nv_escape.h", "nv-unix-nvos-params-wrappers.h",
                "uvm_linux_ioctl.h"]

BUILTIN = {
    ("char",): "u8", ("signed", "char"): "i8", ("unsigned", "char"): "u8",
    ("short",): "i16", ("signed", "short"): "i16", ("unsigned", "short"): "u16",
    ("int",): "i32", ("signed",): "i32", ("unsigned",): "u32",
    ("long",): "i64", ("unsigned", "long"): "u64", ("long", "long"): "i64",
    ("unsigned", "long", "long"): "u64", ("float",): "f32", ("double",): "f64",
    ("_Bool",): "bool",
}
ROLE_TYPEDEFS = {"NvHandle": "handle", "NvP64": "ptr", "NV_STATUS": "status", "NvBool": "bool"}


def canon_builtin(words: str) -> str:
    w = [x for x in words.split() if x not in ("int",) or words.strip() == "int"]
    if "signed" in w and len(w) > 1 and "char" not in w:
        w.remove("signed")
    key = tuple(sorted(w, key=lambda x: ("unsigned", "signed", "short", "long", "char").index(x)
                       if x in ("unsigned", "signed", "short", "long", "char") else 9))
    if key not in BUILTIN:
        raise ValueError(f"unsupported builtin type {words!r}")
    return BUILTIN[key]


class Reader:
    """One tag: the preprocessed headers, the driver's tables, and the DSL built from them."""

    def __init__(self, root: Path, tag: str, workdir: Path):
        self.root, self.tag, self.work = root, tag, workdir
        self.unit = self._preprocess()
        self.dsl: dict[str, str] = {}  # struct key -> DSL (or "=alias", "union<s,a>")
        self.sources: dict[str, str] = {}
        self.cexpr: dict[str, str] = {}  # struct key -> the C type expression the probe uses
        self.scalar: set[str] = set()  # keys that are scalar typedefs (NvHandle as params)
        # (struct, "_anonN") -> a member of that anonymous struct/union: C reaches the
        # unnamed member's offset only through the names inside it
        self.anon_first: dict[tuple[str, str], str] = {}
        self.specs: dict[str, StructSpec] = {}
        self.problems: list[str] = []

    # ------------------------------------------------------------------ preprocessing
    def tu_text(self) -> str:
        inc = self.root / "src/common/sdk/nvidia/inc"
        lines = ["#include <stddef.h>"] + [f'#include "{h}"' for h in TOP_HEADERS]
        for sub in ("ctrl", "class", "alloc"):
            for p in sorted((inc / sub).rglob("*.h")):
                lines.append(f'#include "{p.relative_to(inc)}"')
        lines += [f'#include "{h}"' for h in TAIL_HEADERS]
        return "\n".join(lines) + "\n"

    def include_flags(self) -> list[str]:
        out = []
        for d in INCLUDE_DIRS:
            out += ["-I", str(self.root / d)]
        return out

    def _preprocess(self) -> cdecl.Unit:
        tu = self.work / "all.c"
        tu.write_text(self.tu_text())
        r = subprocess.run(["gcc", "-E", "-dD", *self.include_flags(), str(tu)],
                           capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"abigen: {self.tag}: gcc -E failed:\n{r.stderr[-4000:]}")
        return cdecl.Unit(r.stdout)

    # ------------------------------------------------------------------ types -> DSL
    def source_of(self, file: str) -> str:
        try:
            return driversrc.short_source(driversrc.rel(self.root, file))
        except ValueError:
            return file

    def want(self, name: str) -> str | None:
        """Make sure the type `name` (a typedef or record key) is in the DSL table; return
        its key, or None (and a problem note) when the headers do not define it."""
        if name in self.dsl:
            return name
        u = self.unit
        if name in u.typedefs:
            td = u.typedefs[name]
            spec, decl = td.spec, td.decl
            if decl.pointer or decl.function:
                self.problems.append(f"{name}: a pointer type, not a parameter struct")
                return None
            if spec.kind in ("struct", "union"):
                rec = u.record(spec.record) or u.record(u.tags.get((spec.kind, spec.name)))
                if rec is None:
                    self.problems.append(f"{name}: incomplete {spec.kind} {spec.name}")
                    return None
                if decl.dims:
                    self.problems.append(f"{name}: an array typedef")
                    return None
                if rec.key != name:  # typedef of another named record
                    target = self.want_record(rec, rec.key)
                    self.dsl[name] = "=" + target
                    self.sources[name] = self.source_of(td.file)
                    self.cexpr[name] = name
                    return name
                return self.want_record(rec, name)
            if spec.kind == "typedef" and not decl.dims:
                inner = u.typedefs.get(spec.name)
                if inner is not None and inner.spec.kind in ("struct", "union", "typedef") \
                        and not inner.decl.pointer and not inner.decl.dims:
                    target = self.want(spec.name)
                    if target is not None and not target in self.scalar:
                        self.dsl[name] = "=" + target
                        self.sources[name] = self.source_of(td.file)
                        self.cexpr[name] = name
                        return name
            # a scalar typedef used as parameters (NvHandle for the root client)
            kind, count = self.field_type(name, TypeSpec_typedef(name), cdecl.Declarator("value"))
            if count is None and not kind.startswith(("union", "struct:")):
                self.dsl[name] = f"value:{kind}"
                self.sources[name] = self.source_of(td.file)
                self.cexpr[name] = name
                self.scalar.add(name)
                return name
            self.problems.append(f"{name}: unsupported typedef")
            return None
        rec = u.record(name)
        if rec is not None:
            return self.want_record(rec, name)
        self.problems.append(f"{name}: not defined in the headers")
        return None

    def want_record(self, rec, key: str, cexpr: str | None = None) -> str:
        if key in self.dsl:
            return key
        self.dsl[key] = "<building>"
        self.sources[key] = self.source_of(rec.file)
        self.cexpr[key] = key if cexpr is None else cexpr
        items = []
        for i, m in enumerate(rec.members):
            d = m.decl
            if d.bits is not None:
                raise SystemExit(f"abigen: {key}: bitfield {d.name}: the DSL has no bitfields")
            fname = d.name
            if fname is None:
                fname = f"_anon{i}"
                inner = self.unit.record(m.spec.record)
                first = inner.members[0].decl.name if inner and inner.members else None
                if first is None:
                    raise SystemExit(f"abigen: {key}: nested anonymous members")
                self.anon_first[(key, fname)] = first
            kind, count = self.field_type(f"{key}__{fname}", m.spec, d, parent=key,
                                          member=fname)
            if kind == "u8" and count is not None:
                items.append(f"{fname}:bytes[{count}]")
            elif count is not None:
                items.append(f"{fname}:{kind}[{count}]")
            else:
                if kind == "u32" and fname in ("status", "Status", "rmStatus"):
                    kind = "status"
                elif kind == "u32" and fname == "hClass":
                    kind = "class"
                items.append(f"{fname}:{kind}")
        if rec.kind == "union":
            self.dsl[key] = self._union_dsl(key, items)
        else:
            self.dsl[key] = " ".join(items)
        return key

    def _union_dsl(self, key: str, items: list[str]) -> str:
        size, align = 0, 1
        for f in parse_fields(" ".join(items), self.spec):
            size, align = max(size, f.size), max(align, f.align)
        size += (-size) % align
        return f"union<{size},{align}>"

    def field_type(self, anon_key: str, spec, decl, parent: str | None = None,
                   member: str = ""):
        """(DSL kind or struct key, element count or None) of one declared member."""
        u = self.unit
        count = None
        for dim in decl.dims:
            n = u.eval_tokens(dim, sizeof=self.sizeof) if dim else 0
            count = n if count is None else count * n
        if decl.pointer or decl.function:
            return "ptr", count
        role = None
        while spec.kind == "typedef":
            if spec.name in ROLE_TYPEDEFS and role is None:
                role = ROLE_TYPEDEFS[spec.name]
            td = u.typedefs.get(spec.name)
            if td is None:
                raise SystemExit(f"abigen: unknown typedef {spec.name}")
            if td.decl.pointer or td.decl.function:
                return "ptr", count
            for dim in td.decl.dims:
                n = u.eval_tokens(dim, sizeof=self.sizeof)
                count = n if count is None else count * n
            if td.spec.kind in ("struct", "union"):
                rec = u.record(td.spec.record) or u.record(u.tags.get((td.spec.kind, td.spec.name)))
                if rec is None:
                    raise SystemExit(f"abigen: incomplete type {spec.name}")
                if not td.decl.dims:
                    return self.want(spec.name), count
                return self.want_record(rec, rec.key), count
            spec = td.spec
        if spec.kind == "builtin":
            base = canon_builtin(spec.name)
            if role is not None:
                base = role
            return base, count
        if spec.kind == "enum":
            return "u32", count
        rec = u.record(spec.record) or u.record(u.tags.get((spec.kind, spec.name)))
        if rec is None:
            raise SystemExit(f"abigen: {anon_key}: incomplete {spec.kind} {spec.name}")
        if rec.key.startswith("anon:"):  # an anonymous body declared in this member
            new = anon_key
            index = "".join("[0]" for _ in decl.dims)
            pexpr = self.cexpr[parent]
            if member.startswith("_anon") or pexpr is None:
                ctype = None  # an unnamed member has no C expression of its own
            else:
                ctype = f"__typeof__((({pexpr}*)0)->{member}{index})"
            del u.records[rec.key]
            u.renamed[rec.key] = new
            rec.key = new
            u.records[new] = rec
            return self.want_record(rec, new, cexpr=ctype or ""), count
        if " " in rec.key:  # a body known only by its tag: keyed "<kind>_<tag>", C "struct tag"
            cname = rec.key
            new = rec.key.replace(" ", "_")
            del u.records[rec.key]
            u.renamed[rec.key] = new
            rec.key = new
            u.records[new] = rec
            return self.want_record(rec, new, cexpr=cname), count
        return self.want_record(rec, rec.key), count

    # ------------------------------------------------------------------ layout
    def spec(self, key: str) -> StructSpec:
        s = self.specs.get(key)
        if s is not None:
            return s
        dsl = self.dsl[key]
        if dsl.startswith("="):
            s = self.spec(dsl[1:])
        elif dsl.startswith("union<"):
            sz, al = dsl[6:-1].split(",")
            s = StructSpec(key, [Field("raw", "union", size=int(sz), align=int(al))])
        else:
            s = StructSpec(key, parse_fields(dsl, self.spec))
        self.specs[key] = s
        return s

    def sizeof(self, type_name: str) -> int:
        t = type_name.strip()
        simple = {"NvU8": 1, "NvS8": 1, "NvU16": 2, "NvS16": 2, "NvU32": 4, "NvS32": 4,
                  "NvU64": 8, "NvS64": 8, "NvP64": 8, "NvHandle": 4, "NvBool": 1, "char": 1,
                  "int": 4, "unsigned": 4}
        if t in simple:
            return simple[t]
        key = self.want(re.sub(r"^(struct|union)\s+", "", t))
        if key is None:
            raise ValueError(f"sizeof({t})")
        return self.spec(key).size


def TypeSpec_typedef(name):
    return cdecl.TypeSpec("typedef", name)


# ---------------------------------------------------------------------- one tag
def camel_to_snake(s: str) -> str:
    s = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", s)
    s = re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1_\2", s)
    return s.upper()


def name_from_export(cmd: int, func: str) -> str:
    """NVOC's implementing function -> a header-style name, for the few exported controls no
    header names (subdeviceCtrlCmdGpuAcquireComputeModeReservation ->
    NV2080_CTRL_CMD_GPU_ACQUIRE_COMPUTE_MODE_RESERVATION)."""
    m = re.search(r"CtrlCmd(\w+)$", func)
    tail = camel_to_snake(m.group(1)) if m else camel_to_snake(func)
    return f"NV{cmd >> 16:04X}_CTRL_CMD_{tail}"


def read_tag(root: Path, tag: str, work: Path) -> dict:
    t0 = time.time()
    rd = Reader(root, tag, work)
    u = rd.unit
    ctl_bits = driversrc.rmctrl_flag_bits(root)
    cats = driversrc.categories(root)
    hdr = driversrc.header_controls(root, cats)
    exp = driversrc.export_tables(root)
    controls: dict[int, tuple] = {}
    notes: list[str] = []
    for cmd in sorted(set(hdr) | set(exp)):
        h, e = hdr.get(cmd), (exp.get(cmd) or [None])[0]
        name = h.name if h else name_from_export(cmd, e.func)
        params = None
        if e is not None:
            params = e.param_type  # what the driver checks paramsSize against
            if h and h.params and e.param_type and h.params != e.param_type:
                fk = rd.want(h.params) if (h.params in u.typedefs or u.record(h.params)) else None
                ek = rd.want(e.param_type)
                if fk is None or ek is None or rd.spec(fk).size != rd.spec(ek).size:
                    notes.append(f"{name}: FINN names {h.params}, the export table "
                                 f"{e.param_type} (a different size): the export table's is used")
        else:
            cands = []
            if h and h.params:
                cands.append(h.params)
            cands += [name + "_PARAMS", name.replace("_CMD_", "_", 1) + "_PARAMS"]
            params = next((c for c in cands if c in u.typedefs or u.record(c)), None)
        key = rd.want(params) if params else None
        if params and key is None:
            notes.append(f"{name}: parameter struct {params} not found")
        flags = None
        if e is not None:
            flags = tuple(driversrc.decode_bits(e.flags, ctl_bits))
        src = h.file if h else e.file
        controls[cmd] = (name, key, src, flags)
    # classes: the driver's resource list first, then the class headers
    classes: dict[int, tuple] = {}
    chdr = driversrc.class_headers(root)
    for ent in driversrc.rs_entries(root):
        cid = u.define_value(ent.class_name)
        if cid is None:
            notes.append(f"class {ent.class_name}: no number in the headers")
            continue
        key = rd.want(ent.param_type) if ent.param_type else None
        src = chdr.get(ent.class_name, ("src/nvidia/src/kernel/rmapi/resource_list.h",))[0]
        flags = tuple(ent.flags) + (("ROOT_OBJECT",) if ent.root else ())
        classes.setdefault(cid, (ent.class_name, key, src, flags))
    for cname, (src, fparams) in chdr.items():
        cid = u.define_value(cname)
        if cid is None or cid in classes:
            if cid is not None and fparams and classes[cid][1] is None and classes[cid][3] is None:
                classes[cid] = (classes[cid][0], rd.want(fparams), classes[cid][2], None)
            continue
        key = rd.want(fparams) if fparams else None
        classes[cid] = (cname, key, src, None)
    classes = dict(sorted(classes.items()))
    by_name = {v[0]: k for k, v in controls.items()}
    deprecated = driversrc.deprecated_controls(root, by_name)
    legacy = driversrc.gss_legacy_masks(root)
    uvm = {}
    for cmd, name in driversrc.uvm_commands(u).items():
        p = name + "_PARAMS"
        uvm[cmd] = (name, rd.want(p) if (p in u.typedefs or u.record(p)) else None)
    escs = driversrc.escapes(u)
    # structs the hand-written facts name (escape arguments, annotation targets)
    for _nm, (sname, extra) in hand.ESCAPE_STRUCTS.items():
        for s in [sname, *extra.get("variants", ()), extra.get("array_of")]:
            if s and (s in u.typedefs or u.record(s)):
                rd.want(s)
    for (sname, _f), role in hand.ANNOTATIONS.items():
        if sname in u.typedefs or u.record(sname):
            rd.want(sname)
        m = re.match(r"ptr->(\w+)@", role)
        if m and m.group(1) not in ("bytes", "control", "class", "xfer") and \
                (m.group(1) in u.typedefs or u.record(m.group(1))):
            rd.want(m.group(1))
    if "NvU32" not in rd.dsl:
        rd.want("NvU32")
    for k in rd.dsl:
        rd.spec(k)
    print(f"abigen: {tag}: {len(controls)} controls, {len(classes)} classes, {len(uvm)} UVM "
          f"commands, {len(escs)} escapes, {len(rd.dsl)} structs ({time.time() - t0:.1f} s)",
          file=sys.stderr)
    return {"reader": rd, "controls": controls, "classes": classes, "uvm": uvm,
            "escapes": escs, "categories": cats, "deprecated": deprecated, "legacy": legacy,
            "notes": notes}


def extract(git_dir: str, tag: str, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    arch = subprocess.run(["git", "--git-dir", git_dir, "archive", tag, *ARCHIVE_PATHS],
                          capture_output=True)
    if arch.returncode:
        raise SystemExit(f"abigen: git archive {tag}: {arch.stderr.decode()[-2000:]}")
    subprocess.run(["tar", "-x", "-C", str(dest)], input=arch.stdout, check=True)
    return dest


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tags", nargs="*", help="open-gpu-kernel-modules tags (e.g. 580.142)")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--git-dir", help="a clone (or bare mirror) of NVIDIA/open-gpu-kernel-modules")
    src.add_argument("--src", help="a checkout of one tag (give exactly one TAG)")
    ap.add_argument("--all", action="store_true",
                    help="every tag the registry uses (src/devbroker/abi/registry.py VERSIONS)")
    ap.add_argument("--base", default=None, help="the tag whose table is complete (default: "
                    "the registry's BASE_TAG); the others are written as differences from it")
    ap.add_argument("--keep", help="keep the extracted sources and probe files here")
    args = ap.parse_args(argv)
    from devbroker.abi import registry
    base_tag = args.base or registry.BASE_TAG
    tags = list(args.tags)
    if args.all:
        tags = sorted({v["tag"] for v in registry.VERSIONS.values()} | set(tags))
    if not tags:
        ap.error("give tags or --all")
    if args.src and len(tags) != 1:
        ap.error("--src takes exactly one TAG")
    # the base first: the other tags' modules are differences from it
    tags.sort(key=lambda t: t != base_tag)
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="abigen-"))
    try:
        for tag in tags:
            root = Path(args.src) if args.src else extract(args.git_dir, tag, work / tag / "src")
            tw = work / tag
            tw.mkdir(parents=True, exist_ok=True)
            data = read_tag(root, tag, tw)
            rd = data["reader"]
            measured = probe.run(rd, tw)
            bad = probe.compare(rd, measured)
            if bad:
                print("\n".join(bad[:50]), file=sys.stderr)
                raise SystemExit(f"abigen: {tag}: {len(bad)} layout differences between "
                                 "devbroker's layout engine and gcc: nothing written")
            for n in rd.problems:
                print(f"abigen: {tag}: note: {n}", file=sys.stderr)
            for n in data["notes"]:
                print(f"abigen: {tag}: note: {n}", file=sys.stderr)
            path = emit.write_table(REPO, tag, base_tag, data)
            ppath = emit.write_parity(REPO, tag, measured)
            print(f"abigen: {tag}: wrote {path.relative_to(REPO)} and "
                  f"{ppath.relative_to(REPO)}", file=sys.stderr)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
