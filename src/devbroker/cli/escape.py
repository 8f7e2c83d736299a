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
                    "could not be run. fuse/seccomp need root; kmod/cuse boot the QEMU/TCG "
                    "guest (scripts/qemu/setup.sh) and run the same attacks there against "
                    "the kernel module's or CUSE's char nodes, tenants as uids 1001/1002.")
    p.add_argument("--frontend",
                   choices=["fuse", "seccomp", "kmod", "cuse", "runc-fuse", "runc-seccomp"],
                   default="fuse",
                   help="front end to attack (default fuse; kmod and cuse run in the QEMU "
                        "guest, ~1-2 min per boot; runc-fuse/runc-seccomp run victim and "
                        "attacker in runc containers made from `devbroker cdi` and "
                        "`devbroker oci-seccomp`)")
    p.add_argument("--guest-timeout", type=float, default=900,
                   help="kmod/cuse: limit for the whole guest boot in seconds (default 900)")
    p.add_argument("--backend", choices=["emulated", "real"], default="emulated",
                   help="emulated (default) or real: the same tenants against the host's "
                        "NVIDIA driver (GPUs 0 and 1; fuse or seccomp; CUDA's capabilities)")
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
            print(f"{a.id:22} {a.std:8} {a.category:18} {'/'.join(a.expect):34} {a.title}"
                  f" [{','.join(a.frontends) if a is not FLOOD else 'all'}]")
        return 0
    from devbroker.escape.harness import (GUEST_FRONT_ENDS, GuestUnavailable, format_table,
                                          run_escape_tests, run_guest_escape_tests)

    try:
        if args.frontend in GUEST_FRONT_ENDS:
            report = run_guest_escape_tests(
                [args.frontend], ids=args.only, flood=not args.no_flood,
                timeout=args.guest_timeout, workdir=args.workdir)[args.frontend]
        else:
            report = run_escape_tests(args.frontend, ids=args.only, flood=not args.no_flood,
                                      workdir=args.workdir, backend=args.backend)
    except (PermissionError, GuestUnavailable) as e:
        print(f"devbroker escape-test: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the real backend on a host without the driver, for one
        print(f"devbroker escape-test: cannot start the {args.backend} backend: {e}",
              file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.to_dict(), indent=1))
    else:
        print(format_table(report))
    return 0 if report.ok else 1
