#!/usr/bin/env python3
"""Benchmark (not a test): a quiet tenant's latency alone and next to each kind of noisy tenant.

Starts a broker (emulated backend, FUSE front end) with two tenants on one GPU. The quiet
tenant runs NVML's start-up sequence N times (python -m devbroker.tools.noisy quiet: ~25
requests each — opens, ioctls, a /proc read) and reports each sequence's latency; first
alone, then while the noisy tenant floods with every request kind through FUSE (node opens,
ioctls, page reads, /proc reads, lookups, readdirs, polls, RM clients and objects past its
limits; `noisy flood`, T threads per kind). Then next to each of the issue-51 neighbours:

- `hoard`: the noisy tenant holds G channel groups (--groups; its object limit allows them)
  and loops on its most expensive call, one more group allocated (its compute share set,
  the tenant's slice divided among all of them) and freed (`noisy hoard`);
- `control`: C connections to the broker's control socket (--connections), each sending
  bytes without a newline and held open (run from the host: the operator's socket);
- `other-opens`: the noisy tenant through seccomp, opening and mmapping a file that is none
  of the broker's as fast as it is answered (`noisy flood --kinds other-open,other-mmap`:
  each is a seccomp notification).

All runs in the same broker, one after the other, so the comparison is made on the same
machine state. Prints the quiet tenant's p50/p90 alone and next to each, with the p50
ratio (issues 13 and 51 ask for p50 within 2x). --only picks scenarios.

    sudo .venv/bin/python scripts/bench_noisy.py [--n 40] [--noisy-rate 100]
        [--threads-per-kind 2] [--groups 1000] [--connections 200]
        [--only flood,hoard,control,other-opens]

--noisy-rate 0 leaves the noisy tenant at the policy's default rate (broker/limits.py:
DEFAULT_RATE) instead of the issue's 100/s. Needs root (FUSE mount, namespaces).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from devbroker.testing.policies import one_h200, tenant

from devbroker.testing.tenant_binds import bind_args

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "devbroker.cli.main"]
NOISY = [sys.executable, "-m", "devbroker.tools.noisy"]

def policy(noisy_rate: float) -> str:
    """Two tenants on one emulated H200: the quiet one unpaced (what is measured is the
    broker, not its own limit), the noisy one at `noisy_rate` (0: the policy default)."""
    noisy = {"rate_limit": {"requests_per_second": noisy_rate, "burst": 10}} if noisy_rate > 0 else {}
    return one_h200(
        tenant("quiet", rate_limit={"requests_per_second": 1000000, "burst": 1000000}),
        tenant("noisy", limits={"open_files": 256, "rm_clients": 64, "rm_objects": 1100},
               capabilities=["nvml", "compute"], **noisy))


def pct(xs: list[int], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] / 1000.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=40, help="NVML sequences per run")
    ap.add_argument("--noisy-rate", type=float, default=100.0,
                    help="the noisy tenant's requests/s (0: the policy default)")
    ap.add_argument("--threads-per-kind", type=int, default=2)
    ap.add_argument("--groups", type=int, default=1000, help="channel groups the hoarder holds")
    ap.add_argument("--connections", type=int, default=200,
                    help="control-socket connections of the control flood")
    ap.add_argument("--only", default="flood,hoard,control,other-opens")
    a = ap.parse_args()
    only = [x for x in a.only.split(",") if x]
    work = Path(tempfile.mkdtemp(prefix="devbroker-bench-"))
    (work / "policy.toml").write_text(policy(a.noisy_rate))
    run = CLI + ["--run-dir", str(work / "run")]
    log = open(work / "broker.log", "w")
    broker = subprocess.Popen(run + ["run", "--policy", str(work / "policy.toml")],
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while subprocess.run(run + ["status"], capture_output=True).returncode != 0:
            if broker.poll() is not None or time.monotonic() > deadline:
                print("the broker did not start; see", work / "broker.log", file=sys.stderr)
                return 1
            time.sleep(0.1)

        def exec_(tenant: str, *argv: str, frontend: str = "auto", **kw) -> subprocess.Popen:
            return subprocess.Popen(run + ["exec", "--tenant", tenant, "--frontend", frontend,
                                           "--uid", "0", *bind_args(), "--", *argv],
                                    text=True, **kw)

        def noise_flood(kinds: str = "", frontend: str = "auto"):
            extra = ["--kinds", kinds] if kinds else []
            f = exec_("noisy", *NOISY, "flood", "--seconds", "3600", "--threads-per-kind",
                      str(a.threads_per_kind), *extra, frontend=frontend,
                      stdout=subprocess.PIPE)
            assert json.loads(f.stdout.readline())["what"] == "flood-start"
            return f

        def noise_hoard():
            f = exec_("noisy", *NOISY, "hoard", "--groups", str(a.groups), "--seconds", "3600",
                      stdout=subprocess.PIPE)
            first = json.loads(f.stdout.readline())
            assert first["what"] == "hoard-start", first
            return f

        def noise_control():
            import socket

            held = []
            for _ in range(a.connections):
                s_ = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s_.connect(str(work / "run" / "control.sock"))
                s_.sendall(b'{"op": "status"' + b" " * 4000)  # never a newline
                held.append(s_)
            return held

        def quiet_run(noise) -> dict:
            q = exec_("quiet", *NOISY, "quiet", "--n", str(a.n), "--wait",
                      stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            assert json.loads(q.stdout.readline())["what"] == "ready"
            f = noise() if noise is not None else None
            if f is not None:
                time.sleep(1.0)  # let every noisy thread get going
            q.stdin.write("go\n")
            q.stdin.flush()
            out = json.loads(q.stdout.readline())
            q.wait()
            if isinstance(f, list):
                for s_ in f:
                    s_.close()
            elif f is not None:
                f.send_signal(signal.SIGTERM)
                f.wait(timeout=60)
            return out

        scenarios = {"flood": lambda: noise_flood(),
                     "hoard": noise_hoard,
                     "control": noise_control,
                     "other-opens": lambda: noise_flood("other-open,other-mmap", "seccomp")}
        alone = quiet_run(None)
        results = {}
        for name in only:
            results[name] = quiet_run(scenarios[name])
        status = json.loads(subprocess.run(run + ["status", "--json"], capture_output=True,
                                           text=True).stdout)
    finally:
        broker.send_signal(signal.SIGTERM)
        try:
            broker.wait(timeout=30)
        except subprocess.TimeoutExpired:
            broker.kill()
        subprocess.run(["umount", "-l", str(work / "run" / "nodes")], capture_output=True)
    la = alone["latencies_us"]
    noisy = next(t for t in status["tenants"] if t["name"] == "noisy")
    load = os.getloadavg()
    print(f"quiet tenant, NVML start-up sequence x {a.n} (ms); machine load average "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f} ({os.cpu_count()} CPUs)")
    print(f"  alone:            p50 {pct(la, .5):7.2f}  p90 {pct(la, .9):7.2f}  "
          f"right {alone['all_right']}")
    ok = alone["all_right"]
    for name, r in results.items():
        lf = r["latencies_us"]
        ratio = statistics.median(lf) / statistics.median(la)
        print(f"  next to {name:<11} p50 {pct(lf, .5):7.2f}  p90 {pct(lf, .9):7.2f}  "
              f"p50 ratio {ratio:.2f}x  right {r['all_right']}")
        ok = ok and r["all_right"]
    print(f"noisy tenant: rate {'default' if a.noisy_rate <= 0 else f'{a.noisy_rate:g}/s'}, "
          f"{a.threads_per_kind} threads per kind, {a.groups} groups held, "
          f"{a.connections} control connections; requests waited {noisy['rate_limited']}, "
          f"refused {noisy['refusals']}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
