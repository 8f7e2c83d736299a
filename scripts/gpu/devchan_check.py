"""A tenant's channel right under the device, seen through devbroker (part 2 of
scripts/gpu/run-h200-devchannel.sh; runs against any broker, the emulated one included).

    python3 scripts/gpu/devchan_check.py --run-dir RUN --tenant T --policy FILE \
        [--audit FILE] -- TENANT-COMMAND...

TENANT-COMMAND starts `python -m devbroker.tools.sched_probe hold 1` as tenant T (through
`devbroker exec`). The check asks it for a channel under its device, then reads the broker's
`status` (the driver's group for that channel, with the timeslice the broker set), has the
tenant read that group's timeslice back from the driver (GET_TIMESLICE on the group's handle),
frees the channel and reads `status` again. Prints one JSON line per step and a summary line
last ({"ok": ...}); exits 0 when every step went as the broker's design says, 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def out(**kw) -> dict:
    print(json.dumps(kw), flush=True)
    return kw


def ask(p: subprocess.Popen, line: str, timeout: float = 60.0) -> dict:
    p.stdin.write(line + "\n")
    p.stdin.flush()
    return answer(p, timeout)


def answer(p: subprocess.Popen, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"the tenant ended (exit {p.poll()})")
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError("no answer from the tenant")


def groups_of(run: Path, tenant: str) -> list[dict]:
    from devbroker.broker.control import call

    st = call(run / "control.sock", {"op": "status"}, timeout=10)
    t = next(x for x in st["tenants"] if x["name"] == tenant)
    return t.get("compute", {}).get("channel_groups", [])


def audit_of(path: Path | None, tenant: str, since: float) -> list[dict]:
    if path is None or not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if r.get("tenant") == tenant and r.get("event") in ("deny", "error"):
            out.append(r)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", required=True, type=Path)
    ap.add_argument("--tenant", required=True)
    ap.add_argument("--policy", required=True)
    ap.add_argument("--audit", type=Path)
    ap.add_argument("command", nargs="+")
    a = ap.parse_args(argv)

    from devbroker.broker import compute
    from devbroker.broker.policy import load_policy_text

    policy = load_policy_text(Path(a.policy).read_text(), a.policy)
    tp = policy.tenants[a.tenant]
    t0 = time.time()
    p = subprocess.Popen(a.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    ok = True
    try:
        first = out(step="tenant-groups", **answer(p, 120))
        own = list(first.get("handles", []))
        r = out(step="device-channel", **ask(p, "device-channel"))
        if r.get("status") != 0:
            out(ok=False, why="the channel under the device was not allocated")
            return 1
        chan = r["handle"]
        # the tenant's slice, over its own group and the driver's (both on the engine the
        # channel asked for when it is the same as the own group's: the GR engine)
        same = r.get("engine") == 1
        want = compute.schedule_for(policy, tp, 0, groups=2 if same else 1).timeslice_us
        groups = groups_of(a.run_dir, a.tenant)
        mine = [g for g in groups if g.get("channel") == chan]
        out(step="status", groups=groups, want_timeslice_us=want)
        if len(mine) != 1:
            out(ok=False, why="status shows no channel group for the channel")
            return 1
        g = mine[0]
        ok &= g.get("timeslice_us") == want and not g.get("error")
        r = out(step="read-back", **ask(p, f"get-handle {g['handle']}"))
        ok &= r.get("status") == 0 and r.get("timeslice_us") == want
        if same:  # the tenant's own group was resized to its half too (a background apply)
            for _ in range(100):
                got = ask(p, "get")["timeslices"]
                if got == [want] * len(own):
                    break
                time.sleep(0.05)
            out(step="own-group", timeslices=got, want=want)
            ok &= got == [want] * len(own)
        r = out(step="free-channel", **ask(p, f"free {chan}"))
        ok &= r.get("status") == 0
        after = groups_of(a.run_dir, a.tenant)
        out(step="status-after-free", groups=after)
        ok &= all(x.get("channel") != chan for x in after)
        bad = audit_of(a.audit, a.tenant, t0)
        out(step="audit", deny_or_error=bad[-10:])
        ok &= not bad
        out(ok=bool(ok), group=g["handle"], channel=chan, timeslice_us=g.get("timeslice_us"),
            want=want)
        return 0 if ok else 1
    finally:
        try:
            p.stdin.write("quit\n")
            p.stdin.close()
        except OSError:
            pass
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()


if __name__ == "__main__":
    sys.exit(main())
