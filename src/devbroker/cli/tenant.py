"""`devbroker tenant add | set | rm | list`: tenants of the running broker, made at run time
(broker/tenancy.py; docs/policy.md "Runtime tenants")."""
from __future__ import annotations

import argparse
import json
import sys


def add_parser(sub) -> None:
    top = sub.add_parser("tenant", help="add, change, remove or list the running broker's "
                                        "tenants (runtime tenants, kept across restarts)")
    cmds = top.add_subparsers(dest="tenant_cmd", metavar="ACTION")
    cmds.required = True

    p = cmds.add_parser("add", help="add a tenant (the same spec again: nothing changes)")
    p.add_argument("name")
    _spec_options(p, required=True)
    p.set_defaults(func=cmd_add)

    p = cmds.add_parser("set", help="change a runtime tenant's keys (a hot reload of it)")
    p.add_argument("name")
    _spec_options(p, required=False)
    p.set_defaults(func=cmd_set)

    p = cmds.add_parser("rm", help="remove a runtime tenant: its processes are ended "
                                   "(SIGTERM, SIGKILL after the grace), its memory freed")
    p.add_argument("name")
    p.add_argument("--grace", type=float, default=5.0,
                   help="seconds between SIGTERM and SIGKILL (default 5)")
    p.set_defaults(func=cmd_rm)

    p = cmds.add_parser("list", help="every tenant, from the policy file or added at run time")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_list)


def _spec_options(p: argparse.ArgumentParser, *, required: bool) -> None:
    p.add_argument("--gpus", help="GPU indexes, comma-separated (\"\" for none)"
                                  + ("" if required else "; only the keys given change"))
    p.add_argument("--memory-quota", help="per GPU, e.g. 8GiB or bytes")
    p.add_argument("--pinned-host-memory", metavar="SIZE",
                   help="host memory its processes may pin (cudaHostAlloc, "
                        "cudaHostRegister), e.g. 16GiB or bytes")
    p.add_argument("--compute-weight", type=int)
    p.add_argument("--priority", choices=["high", "normal", "low"])
    p.add_argument("--capability", action="append", dest="capabilities", metavar="CAP",
                   help="a capability (repeatable; default: the policy's default set)")
    p.add_argument("--uid", action="append", type=int, dest="uids", metavar="N",
                   help="a uid that may use its nodes (repeatable; default: any)")
    p.add_argument("--label", action="append", default=[], metavar="KEY=VALUE",
                   help="a label, e.g. namespace=ml, pod=train-0, container=main "
                        "(repeatable; metrics carry them)")
    p.add_argument("--spec-json", metavar="JSON",
                   help="further keys as a JSON object of a policy [tenant.NAME] table; "
                        "the options above override its keys")


def _spec(args, what: str) -> tuple[dict, dict | None]:
    spec: dict = {}
    if args.spec_json:
        try:
            spec = json.loads(args.spec_json)
        except ValueError as e:
            _fail(what, f"--spec-json: not JSON: {e}")
        if not isinstance(spec, dict):
            _fail(what, "--spec-json must be a JSON object")
    if args.gpus is not None:
        try:
            spec["gpus"] = [int(g) for g in args.gpus.split(",") if g.strip()]
        except ValueError:
            _fail(what, f"--gpus: not a list of GPU indexes: {args.gpus!r}")
    if args.memory_quota is not None:
        q = args.memory_quota
        spec["memory_quota"] = int(q) if q.isdigit() else q
    if args.pinned_host_memory is not None:
        q = args.pinned_host_memory
        spec["pinned_host_memory"] = int(q) if q.isdigit() else q
    for key in ("compute_weight", "priority", "capabilities", "uids"):
        if getattr(args, key) is not None:
            spec[key] = getattr(args, key)
    labels = None
    if args.label:
        labels = {}
        for item in args.label:
            key, sep, value = item.partition("=")
            if not sep:
                _fail(what, f"--label {item!r}: KEY=VALUE expected")
            labels[key] = value
    return spec, labels


def _fail(what: str, message: str):
    print(f"devbroker tenant {what}: {message}", file=sys.stderr)
    sys.exit(1)


def _ask(args, what: str, request: dict, timeout: float = 30.0) -> dict:
    from devbroker.cli.broker_cmds import ask_broker

    return ask_broker(args, f"tenant {what}", request, timeout)


def cmd_add(args) -> int:
    spec, labels = _spec(args, "add")
    req = {"op": "tenant.add", "tenant": args.name, "spec": spec}
    if labels is not None:
        req["labels"] = labels
    reply = _ask(args, "add", req)
    info = reply["tenant"]
    where = f": nodes {info['node_dir']}" if info.get("node_dir") else ""
    print(f"tenant {args.name} {'exists already, the same' if reply['existed'] else 'added'}"
          f"{where}")
    return 0


def cmd_set(args) -> int:
    spec, labels = _spec(args, "set")
    req = {"op": "tenant.set", "tenant": args.name, "spec": spec}
    if labels is not None:
        req["labels"] = labels
    reply = _ask(args, "set", req)
    print(f"tenant {args.name} {'changed' if reply.get('changed') else 'unchanged'}")
    return 0


def cmd_rm(args) -> int:
    # The reply comes once the tenant is gone: its grace, the kill and the files' closing.
    reply = _ask(args, "rm", {"op": "tenant.rm", "tenant": args.name, "grace": args.grace},
                 timeout=args.grace + 60)
    if not reply["existed"]:
        print(f"no tenant {args.name} (nothing to remove)")
    else:
        ended = reply.get("ended") or []
        print(f"tenant {args.name} removed; processes ended: "
              f"{', '.join(map(str, ended)) or 'none'}")
    return 0


def cmd_list(args) -> int:
    from devbroker.broker.policy import format_size

    tenants = _ask(args, "list", {"op": "tenant.list"})["tenants"]
    if args.json:
        print(json.dumps(tenants, indent=2))
        return 0
    print(f"{'TENANT':<16} {'SOURCE':<8} {'GPUS':<8} {'QUOTA':>10} {'PROCS':>5} "
          f"{'MEMORY USED':<24} LABELS")
    for t in tenants:
        used = ", ".join(f"gpu{g}: {format_size(n)}" for g, n in t["memory_used"].items())
        labels = ",".join(f"{k}={v}" for k, v in sorted(t["labels"].items()))
        print(f"{t['name']:<16} {t['source']:<8} "
              f"{','.join(map(str, t['spec']['gpus'])) or '-':<8} "
              f"{format_size(t['spec']['memory_quota']):>10} {t['processes']:>5} "
              f"{used or '-':<24} {labels or '-'}")
    return 0
