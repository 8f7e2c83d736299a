#!/usr/bin/env python3
"""Benchmark (not a test): how long a live upgrade pauses the other tenants while one tenant
floods at its rate limit (issue 51 item 6: at most 200 ms asked).

Starts a broker (emulated backend) with three tenants: "flood" (paced at --rate requests/s,
burst 1) runs --threads threads looping on one ioctl (or, with --kind open, on an open and
close of its nvidiactl), so that calls queue behind its pace; "quiet0" and "quiet1" (on the
other GPU, unpaced) each loop on the same ioctl and note every call's wall-clock start and
duration. Then `devbroker upgrade --json`, and per front end (--frontends fuse,seccomp: the
tenants of one run all go through that one):

- the broker-side pause (freeze to the successor serving: `pause_ms`, with its phases);
- the quiet tenants' longest call that spans the pause, and their longest call in a window
  of the same length just before it (this machine's noise, for comparison);
- whether every call of every tenant was answered right (none failed, none lost).

    sudo .venv/bin/python scripts/bench_upgrade.py [--frontends fuse,seccomp]
        [--threads 80] [--rate 5] [--kind ioctl|open] [--rounds 1]

Needs root (FUSE mount, namespaces). Prints one JSON line per run and a table.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from devbroker.testing.policies import tenant, two_h200
from devbroker.testing.tenant_binds import bind_args

CLI = [sys.executable, "-m", "devbroker.cli.main"]
UUIDS = ("GPU-11111111-2222-3333-4444-555555555550", "GPU-11111111-2222-3333-4444-555555555551")

# N threads looping on one call until "stop" on stdin; then every answer and, for the quiet
# tenants, each call's (wall-clock start, duration).
LOOP = r'''
import json, os, sys, threading, time
from devbroker.tools.probe import Client, NvError
n, kind = int(sys.argv[1]), sys.argv[2]
c = Client(); c.check_version(); c.open_root()
stop, answers, calls, lock = threading.Event(), {}, [], threading.Lock()
def call():
    if kind == "open":
        os.close(os.open("/dev/nvidiactl", os.O_RDWR))
        return "ok"
    return "ok" if c.attached_ids() else "empty"
def loop():
    while not stop.is_set():
        t0, m0 = time.time(), time.monotonic()
        try:
            got = call()
        except (OSError, NvError) as e:
            got = repr(e)
        d = time.monotonic() - m0
        with lock:
            answers[got] = answers.get(got, 0) + 1
            calls.append((t0, d))
ts = [threading.Thread(target=loop) for _ in range(n)]
for t in ts:
    t.start()
print(json.dumps({"what": "ready"}), flush=True)
sys.stdin.readline()
stop.set()
for t in ts:
    t.join()
print(json.dumps({"what": "done", "answers": answers, "calls": calls}), flush=True)
'''


def policy(rate: float) -> str:
    return two_h200(tenant("flood", gpus=[0], rate_limit={"requests_per_second": rate,
                                                          "burst": 1}),
                    tenant("quiet0", gpus=[1]), tenant("quiet1", gpus=[1]),
                    driver_version=None, uuids=UUIDS)


def readline_json(p: subprocess.Popen, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"tenant ended ({p.poll()})")
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError("no answer")


def one_run(frontend: str, a, work: Path) -> dict:
    run_dir = work / f"run-{frontend}"
    run = CLI + ["--run-dir", str(run_dir)]
    log = open(work / f"broker-{frontend}.log", "w")
    broker = subprocess.Popen(run + ["run", "--policy", str(work / "policy.toml")],
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    procs: list[subprocess.Popen] = []
    new_pid = None
    try:
        deadline = time.monotonic() + 60
        while subprocess.run(run + ["status"], capture_output=True).returncode != 0:
            if broker.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the broker did not start: {work}/broker-{frontend}.log")
            time.sleep(0.1)

        def exec_(name: str, n: int, kind: str) -> subprocess.Popen:
            p = subprocess.Popen(run + ["exec", "--tenant", name, "--frontend", frontend,
                                        "--uid", "0", *bind_args(), "--", sys.executable,
                                        "-c", LOOP, str(n), kind],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            procs.append(p)
            return p

        flood = exec_("flood", a.threads, a.kind)
        quiet = [exec_("quiet0", 1, "ioctl"), exec_("quiet1", 1, "ioctl")]
        for p in [flood, *quiet]:
            assert readline_json(p)["what"] == "ready"
        time.sleep(1.5)  # the flood's calls queue behind its pace
        st = json.loads(subprocess.run(run + ["status", "--json"], capture_output=True,
                                       text=True).stdout)
        waited = next(t["rate_limited"] for t in st["tenants"] if t["name"] == "flood")
        r = subprocess.run(run + ["upgrade", "--json"], capture_output=True, text=True,
                           timeout=200)
        if r.returncode != 0:
            return {"frontend": frontend, "upgrade": "failed", "why": r.stderr.strip()[-500:]}
        reply = json.loads(r.stdout)
        new_pid = reply["pid"]
        broker.wait(timeout=30)
        time.sleep(1.0)
        done = []
        for p in [flood, *quiet]:
            p.stdin.write("stop\n")
            p.stdin.flush()
            done.append(readline_json(p))
        frozen, serving = reply["frozen_at"], reply["serving_at"]
        span = serving - frozen
        quiet_calls = [c for d in done[1:] for c in d["calls"]]
        spanning = max([d for s, d in quiet_calls if s <= serving and s + d >= frozen] or [0])
        base = max([d for s, d in quiet_calls if frozen - 1.0 - span <= s < frozen - 1.0]
                   or [0])
        answers = [d["answers"] for d in done]
        return {"frontend": frontend, "kind": a.kind, "threads": a.threads, "rate": a.rate,
                "flood_calls_waited_before": waited, "pause_ms": reply["pause_ms"],
                "phases_ms": reply["phases_ms"],
                "quiet_longest_call_spanning_pause_ms": round(spanning * 1000, 1),
                "quiet_longest_call_in_a_window_before_ms": round(base * 1000, 1),
                "all_answered_right": all(set(x) == {"ok"} for x in answers),
                "answers": answers}
    finally:
        for p in procs:
            p.kill()
            p.wait()
        for pid in (new_pid, broker.pid):
            if pid is not None:
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        try:
            broker.wait(timeout=30)
        except subprocess.TimeoutExpired:
            broker.kill()
        if new_pid is not None:
            for _ in range(100):
                if not os.path.exists(f"/proc/{new_pid}"):
                    break
                time.sleep(0.1)
        subprocess.run(["umount", "-l", str(run_dir / "nodes")], capture_output=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--frontends", default="fuse,seccomp")
    ap.add_argument("--threads", type=int, default=80)
    ap.add_argument("--rate", type=float, default=5.0)
    ap.add_argument("--kind", choices=("ioctl", "open"), default="ioctl")
    ap.add_argument("--rounds", type=int, default=1)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="devbroker-bench-upgrade-"))
    (work / "policy.toml").write_text(policy(a.rate))
    rows = []
    for _ in range(a.rounds):
        for fe in [x for x in a.frontends.split(",") if x]:
            row = one_run(fe, a, work)
            print(json.dumps(row), flush=True)
            rows.append(row)
    print(f"\n{'front end':10} {'pause ms':>9} {'quiet spanning ms':>18} "
          f"{'quiet before ms':>16}  answered right")
    for r in rows:
        if r.get("upgrade") == "failed":
            print(f"{r['frontend']:10} upgrade failed: {r['why'][:80]}")
            continue
        print(f"{r['frontend']:10} {r['pause_ms']:9.1f} "
              f"{r['quiet_longest_call_spanning_pause_ms']:18.1f} "
              f"{r['quiet_longest_call_in_a_window_before_ms']:16.1f}  "
              f"{r['all_answered_right']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
