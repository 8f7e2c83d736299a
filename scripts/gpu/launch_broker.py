"""Start the broker for the H200 run: `devbroker run`'s code path, with a fallback policy
reader while devbroker.broker.policy is not in the tree.

    python3 scripts/gpu/launch_broker.py --run-dir D --policy P --record F --audit A

Uses devbroker.broker.policy.load_policy when it exists and accepts the file; otherwise reads
the same TOML (scripts/gpu/h200-policy.toml) into plain objects with the attributes the
broker core reads (tenants.<name>.gpus / memory_quota / capabilities; broker.backend).
Prints which reader it used.
"""
from __future__ import annotations

import argparse
import re
import sys
import tomllib
from types import SimpleNamespace


def _size(v) -> int:
    if isinstance(v, int):
        return v
    m = re.fullmatch(r"\s*(\d+)\s*([KMGT]?)i?B?\s*", str(v), re.I)
    if not m:
        raise ValueError(f"not a size: {v!r}")
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30, "T": 40}[m.group(2).upper()]


def fallback_policy(path: str):
    with open(path, "rb") as fh:
        d = tomllib.load(fh)
    tenants = {}
    for name, t in d.get("tenants", {}).items():
        tenants[name] = SimpleNamespace(
            name=name, gpus=tuple(t.get("gpus", [])), memory_quota=_size(t.get("memory_quota", 0)),
            capabilities=tuple(t.get("capabilities", ["nvml"])), uids=t.get("uids"),
            rate_limit=None)
    b = d.get("broker", {})
    broker = SimpleNamespace(backend=b.get("backend", "real"), gpus=[],
                             driver_version=b.get("driver_version", "580.159.04"))
    text = open(path).read()
    return SimpleNamespace(tenants=tenants, broker=broker, to_toml=lambda: text,
                           describe=lambda: text)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--policy", required=True)
    ap.add_argument("--record")
    ap.add_argument("--audit")
    ap.add_argument("--backend", default="real")
    a = ap.parse_args()
    policy = None
    try:
        from devbroker.broker.policy import load_policy

        policy = load_policy(a.policy)
        print(f"launch_broker: policy read by devbroker.broker.policy", file=sys.stderr)
    except Exception as e:  # module missing, or a format it does not accept yet
        print(f"launch_broker: devbroker.broker.policy unusable ({type(e).__name__}: {e}); "
              "reading the TOML with the fallback reader", file=sys.stderr)
        policy = fallback_policy(a.policy)
    import trio

    from devbroker.daemon import BrokerService, run_forever

    service = BrokerService(policy, a.run_dir, backend=a.backend, audit_path=a.audit,
                            record=a.record, policy_source=a.policy)
    try:
        trio.run(run_forever, service)
    finally:
        stop = getattr(service.backend, "stop", None)
        if stop:
            stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
