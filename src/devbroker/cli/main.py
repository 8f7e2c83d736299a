"""`devbroker`: the command line. One module per sub-command group; this file wires them."""
from __future__ import annotations

import argparse
import sys

DEFAULT_RUN_DIR = "/run/devbroker"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="devbroker",
        description="GPU sharing through fake /dev/nvidia* nodes served by a broker that "
                    "parses the NVIDIA driver ABI.")
    p.add_argument("--run-dir", default=DEFAULT_RUN_DIR,
                   help="where the broker keeps its mount, control socket and audit log "
                        f"(default {DEFAULT_RUN_DIR})")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    from devbroker.cli import broker_cmds, escape, oci, preempt, tenant, top, trace

    broker_cmds.add_parsers(sub)
    oci.add_parsers(sub)
    preempt.add_parsers(sub)
    top.add_parser(sub)
    trace.add_parser(sub)
    escape.add_parser(sub)
    tenant.add_parser(sub)
    _run_dir_anywhere(p)
    return p


def _run_dir_anywhere(parser: argparse.ArgumentParser) -> None:
    """Let every command take --run-dir after its name too (`devbroker exec --run-dir X …`),
    as it does before it: each sub-command's parser (nested ones included, whoever added
    them) gets the option with no default of its own, so the top-level default stands unless
    one of the two places gives it. Walked once the tree is built rather than passed as a
    parent to each add_parser, so a command added later cannot miss it."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in set(action.choices.values()):
                if "--run-dir" not in child._option_string_actions:
                    child.add_argument("--run-dir", default=argparse.SUPPRESS,
                                       help=f"as before the command (default {DEFAULT_RUN_DIR})")
                _run_dir_anywhere(child)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
