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
                            ("stats", _stats, "counts by node, escape, class, control; unknowns"),
                            ("replay", _replay, "replay a recorded real session against the "
                             "emulated driver and list where its answers differ")):
        q = tsub.add_parser(name, help=hlp)
        q.add_argument("file", nargs="?" if name == "replay" else None)
        q.add_argument("--version", default=DEFAULT_VERSION,
                       help=f"driver ABI version to decode with (default {DEFAULT_VERSION})")
        if name == "replay":
            q.add_argument("--all", action="store_true",
                           help="also list the differences the emulator makes on purpose")
            q.add_argument("--explain", action="store_true",
                           help="print the table of differences made on purpose (markdown) "
                           "and exit")
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
        print(f"devbroker trace: {args.file}: {e.strerror or e}", file=sys.stderr)
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
    gaps = set(s["unknown"]) - s["unpublished"]
    print(f"\nunknown ({len(s['unknown'])} distinct; {len(s['unpublished'])} of them controls "
          f"NVIDIA publishes no header for, {len(gaps)} gaps in the tables):")
    for name, n in sorted(s["unknown"].items()):
        print(f"  {n:6d}  {name}")
    print(f"\ndecode errors ({len(s['errors'])}):")
    for e in s["errors"]:
        print(f"  {e}")
    return 1 if s["errors"] or gaps else 0


def _replay(args: argparse.Namespace) -> int:
    """Every call of the recording, sent to an emulated driver configured as the recorded
    machine (its GPUs' PCI location, UUID, name and memory, read from the recording):
    differences nothing in testing/emulated_parity.py explains are listed, and make the
    exit status 1."""
    import trio

    from devbroker.testing import emulated_parity as parity
    from devbroker.backends.emulated import EmulatedBackend, EmulatedGpu
    from devbroker.testing.replay import Replay, explain, recorded_gpus, summarize

    if args.explain:
        sys.stdout.write(parity.explanations_markdown())
        return 0
    if not args.file:
        print("devbroker trace replay: give a recording (or --explain)", file=sys.stderr)
        return 2
    abi, recs = _load(args)
    if abi is None:
        return 2
    facts = recorded_gpus(recs, abi)
    if not facts:
        print("devbroker trace replay: the recording shows no GPU (no CARD_INFO answer)",
              file=sys.stderr)
        return 2
    backend = EmulatedBackend([EmulatedGpu(index=i, **f) for i, f in enumerate(facts)],
                              version=abi.version, notice=lambda m: None)
    rp = Replay(backend, abi)
    diffs = trio.run(rp.run, recs)
    used, left = explain(diffs, parity.EXPECTED, parity.covers)
    print(f"file: {args.file}  abi: {abi.version}  calls replayed: {sum(rp.calls.values())}  "
          f"differences: {len(diffs)} ({len(diffs) - len(left)} on purpose, {len(left)} not "
          "explained)")
    if args.all:
        for e, ds in used.items():
            print(f"\non purpose ({len(ds)}): {e.call} / {e.what}: {e.reason}")
            for line in summarize(ds):
                print("  " + line)
    print(f"\nnot explained ({len(left)}):")
    for line in summarize(left):
        print("  " + line)
    return 1 if left else 0
