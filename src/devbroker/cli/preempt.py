"""`devbroker preempt TENANT` / `devbroker resume TENANT`: the operator's preemption by hand
(docs/preemption.md). A tenant preempted by hand stays in host memory until resumed.
`devbroker migrate TENANT --gpu N`: its GPU state moved to another of its GPUs."""
from __future__ import annotations

import json


def add_parsers(sub) -> None:
    for name, op, text in (
            ("preempt", "tenant.preempt", "checkpoint a tenant's GPU state to host memory "
                                          "(its processes wait) until `devbroker resume`"),
            ("resume", "tenant.resume", "restore a preempted tenant's GPU state")):
        p = sub.add_parser(name, help=text)
        p.add_argument("tenant")
        p.add_argument("--json", action="store_true")
        p.add_argument("--timeout", type=float, default=180.0,
                       help="seconds to wait for the broker (default 180)")
        p.set_defaults(func=cmd_order, op=op)
    p = sub.add_parser("migrate", help="move a tenant's GPU state to another of its GPUs "
                                       "(checkpoint, then restore there)")
    p.add_argument("tenant")
    p.add_argument("--gpu", type=int, required=True, help="the GPU to move it to")
    p.add_argument("--json", action="store_true")
    p.add_argument("--timeout", type=float, default=180.0,
                   help="seconds to wait for the broker (default 180)")
    p.set_defaults(func=cmd_order, op="tenant.migrate")


def cmd_order(args) -> int:
    from devbroker.cli.broker_cmds import _human, ask_broker

    verb = args.op.split(".")[1]
    req = {"op": args.op, "tenant": args.tenant}
    if verb == "migrate":
        req["gpu"] = args.gpu
    reply = ask_broker(args, verb, req, timeout=args.timeout)
    if args.json:
        print(json.dumps(reply, indent=2))
    elif verb == "preempt":
        print(f"tenant {args.tenant} preempted: {_human(reply['bytes'])} of device memory of "
              f"{len(reply['pids'])} process(es) in host memory ({reply['seconds']:.2f} s)")
    elif verb == "migrate":
        print(f"tenant {args.tenant} moved to GPU {args.gpu}")
    else:
        print(f"tenant {args.tenant} resumed")
    return 0
