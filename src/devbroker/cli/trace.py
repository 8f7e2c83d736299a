"""`devbroker trace show|stats FILE`: read an nvtrace and print it decoded."""
from __future__ import annotations

import argparse
import sys

DEFAULT_VERSION = "580.159.04"


def add_parser(sub) -> None:
    p = sub.add_parser("trace", help="decode nvtrace files (recorded NVIDIA ioctl traffic)")
    tsub = p.add_subparsers(dest="trace_command", metavar="SUBCOMMAND")
    tsub.required = True
    for name, func, hlp in (("show", _show, "every record, decoded, one per line"),
                            ("stats", _stats, "counts by node, escape, class, control; unknowns")):
        q = tsub.add_parser(name, help=hlp)
        q.add_argument("file")
        q.add_argument("--version", default=DEFAULT_VERSION,
                       help=f"driver ABI version to decode with (default {DEFAULT_VERSION})")
        q.set_defaults(func=func)


def _load(args):
    from devbroker.abi import DecodeError, UnknownVersion, nvtrace, registry

    try:
        abi = registry.get(args.version)
    except UnknownVersion as e:
        print(f"devbroker trace: {e}", file=sys.stderr)
        return None, None
    try:
        with open(args.file, "rb") as f:
            data = f.read()
    except OSError as e:
        print(f"devbroker trace: {e}", file=sys.stderr)
        return None, None
    try:
        recs = list(nvtrace.iter_records(data))
    except DecodeError as e:
        print(f"devbroker trace: {args.file}: {e}", file=sys.stderr)
        return None, None
    return abi, recs


def _show(args: argparse.Namespace) -> int:
    from devbroker.abi.traceview import TraceDecoder, format_event

    abi, recs = _load(args)
    if abi is None:
        return 2
    dec = TraceDecoder(abi)
    bad = 0
    out = sys.stdout
    for i, rec in enumerate(recs):
        ev = dec.decode(rec)
        bad += ev.error is not None
        out.write(format_event(abi, i, ev) + "\n")
    return 1 if bad else 0


def _stats(args: argparse.Namespace) -> int:
    from devbroker.abi.traceview import stats

    abi, recs = _load(args)
    if abi is None:
        return 2
    s = stats(abi, recs)
    print(f"file: {args.file}  abi: {abi.version} (headers {abi.tag})  records: {len(recs)}")
    for key in ("records", "nodes", "escapes", "uvm", "classes", "controls", "statuses"):
        c = s[key]
        print(f"\n{key} ({sum(c.values())} total, {len(c)} distinct):")
        for name, n in sorted(c.items(), key=lambda kv: (-kv[1], kv[0])):
            print(f"  {n:6d}  {name}")
    print(f"\nunknown ({len(s['unknown'])} distinct):")
    for name, n in sorted(s["unknown"].items()):
        print(f"  {n:6d}  {name}")
    print(f"\ndecode errors ({len(s['errors'])}):")
    for e in s["errors"]:
        print(f"  {e}")
    return 1 if s["errors"] or s["unknown"] else 0
