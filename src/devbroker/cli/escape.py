"""`devbroker escape-test`: run the escape-test harness against a front end."""
from __future__ import annotations

import json
import sys


def add_parser(sub) -> None:
    p = sub.add_parser(
        "escape-test",
        help="attack tenant isolation from inside a sandbox; non-zero exit if anything escapes",
        description="Start a throw-away broker (emulated backend, a victim, an attacker and a "
                    "flooding tenant), run every attack of devbroker.escape.attacks from inside "
                    "the attacker's sandbox, match each refusal to the audit log and print a "
                    "table. Exit status 1 if an attack succeeded, lacked its audit record or "
                    "could not be run. Needs root.")
    p.add_argument("--frontend", choices=["fuse", "seccomp"], default="fuse",
                   help="front end to attack (default fuse)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--only", action="append", metavar="ATTACK_ID",
                   help="run only these attacks (repeatable; 'flood' for the flood)")
    p.add_argument("--no-flood", action="store_true", help="skip the request-flood test")
    p.add_argument("--workdir", help="keep the broker's run dir, logs and audit log here")
    p.add_argument("--list", action="store_true", help="list the attacks and exit")
    p.set_defaults(func=cmd_escape_test)


def cmd_escape_test(args) -> int:
    from devbroker.escape.attacks import ATTACKS, FLOOD

    if args.list:
        for a in ATTACKS + [FLOOD]:
            print(f"{a.id:22} {a.std:8} {a.category:18} {'/'.join(a.expect):34} {a.title}")
        return 0
    from devbroker.escape.harness import format_table, run_escape_tests

    try:
        report = run_escape_tests(args.frontend, ids=args.only, flood=not args.no_flood,
                                  workdir=args.workdir)
    except PermissionError as e:
        print(f"devbroker escape-test: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.to_dict(), indent=1))
    else:
        print(format_table(report))
    return 0 if report.ok else 1
