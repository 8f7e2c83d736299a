"""The driver's checkpoint API on a native process, through devbroker's executor
(backends/cudackpt.py: one helper process per call), timed and checked.

    PYTHONPATH=src python3 scripts/gpu/ckpt_native.py [--gib N] [--cycles N] [--pairs]
                                                     [--stop] [--bad-pair] [--no-cuda]
                                                     [--no-init-first]

Starts scripts/gpu/ckpt_holder.py holding N GiB, then per cycle: state, lock, checkpoint
(host memory and the GPU's used memory read before and after), restore, unlock, and the
holder's checksum. --pairs: the second cycle restores with the GPU pair UUID=UUID (the same
GPU: the r580 pairs layout accepted). --stop: SIGSTOP the holder and try to lock it (the
bounded wait), then SIGCONT. --bad-pair: last, a restore naming a GPU that does not exist,
then a plain restore (is a failed restore retryable?). --no-cuda: `state` of a process
without CUDA. Prints what it does as it goes; the last line is one JSON summary.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from devbroker.backends.checkpoint import CheckpointError, GpuPair
from devbroker.backends.cudackpt import CudaCheckpointer

HERE = Path(__file__).resolve().parent
RES: dict = {}


def say(*a) -> None:
    print(f"[{time.strftime('%T')}]", *a, flush=True)


def host_used_mib() -> int:
    m = {}
    for line in open("/proc/meminfo"):
        k, v = line.split(":", 1)
        m[k] = int(v.split()[0])
    return (m["MemTotal"] - m["MemAvailable"]) // 1024


def gpu_used_mib() -> int | None:
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=memory.used",
                            "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=20)
        return int(r.stdout.split()[0])
    except Exception:
        return None


def gpu_uuid() -> str | None:
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
        return r.stdout.split()[0]
    except Exception:
        return None


class Holder:
    def __init__(self, gib: int):
        self.p = subprocess.Popen([sys.executable, str(HERE / "ckpt_holder.py"), str(gib)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.first = self.read()
        self.pid = self.p.pid

    def read(self) -> dict:
        line = self.p.stdout.readline()
        if not line:
            raise SystemExit(f"holder exited {self.p.wait()}")
        return json.loads(line)

    def ask(self, cmd: str) -> dict:
        self.p.stdin.write(cmd + "\n")
        self.p.stdin.flush()
        return self.read()

    def end(self) -> None:
        try:
            self.p.stdin.write("exit\n")
            self.p.stdin.flush()
            self.p.wait(timeout=30)
        except Exception:
            self.p.kill()
            self.p.wait()


def timed(cp: CudaCheckpointer, op: str, pid: int, timeout_s: float, *extra: str) -> dict:
    t0 = time.monotonic()
    try:
        rec = cp.call(op, pid, timeout_s, *extra)
        rec["wall_s"] = round(time.monotonic() - t0, 3)
    except CheckpointError as e:
        rec = {"ok": False, "line": str(e), "wall_s": round(time.monotonic() - t0, 3)}
    say(op, json.dumps(rec))
    return rec


def cycle(cp: CudaCheckpointer, h: Holder, n: int, pairs: tuple[GpuPair, ...],
          no_init: bool = False) -> dict:
    r = {"state0": timed(cp, "state", h.pid, 10)}
    r["host_before_mib"], r["gpu_before_mib"] = host_used_mib(), gpu_used_mib()
    r["lock"] = timed(cp, "lock", h.pid, 30, "--timeout-ms", "20000")
    r["state_locked"] = timed(cp, "state", h.pid, 10)
    r["checkpoint"] = timed(cp, "checkpoint", h.pid, 300)
    r["host_ckpt_mib"], r["gpu_ckpt_mib"] = host_used_mib(), gpu_used_mib()
    r["state_ckpt"] = timed(cp, "state", h.pid, 10)
    extra = ("--pairs", ",".join(f"{p.old_uuid}={p.new_uuid}" for p in pairs)) if pairs else ()
    extra += ("--no-init",) if no_init else ()
    r["restore"] = timed(cp, "restore", h.pid, 300, *extra)
    r["state_restored"] = timed(cp, "state", h.pid, 10)
    r["unlock"] = timed(cp, "unlock", h.pid, 30)
    r["host_after_mib"], r["gpu_after_mib"] = host_used_mib(), gpu_used_mib()
    r["check"] = h.ask("check")
    r["work"] = h.ask("work")
    say(f"cycle {n}: host MiB {r['host_before_mib']} -> {r['host_ckpt_mib']} -> "
        f"{r['host_after_mib']}; GPU MiB {r['gpu_before_mib']} -> {r['gpu_ckpt_mib']} -> "
        f"{r['gpu_after_mib']}; check {r['check']}; work {r['work']}")
    return r


HOG = """
import sys, torch
free, total = torch.cuda.mem_get_info()
x = torch.empty(free - (1 << 30), dtype=torch.uint8, device="cuda")
print(free - (1 << 30), flush=True)
sys.stdin.readline()
"""


def hog_restore(cp: CudaCheckpointer, h: Holder) -> dict:
    r = {"lock": timed(cp, "lock", h.pid, 30, "--timeout-ms", "20000"),
         "checkpoint": timed(cp, "checkpoint", h.pid, 300)}
    hog = subprocess.Popen([sys.executable, "-c", HOG], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True)
    r["hog_bytes"] = hog.stdout.readline().strip()
    say("hog holds", r["hog_bytes"], "bytes; GPU used MiB", gpu_used_mib())
    r["restore_full"] = timed(cp, "restore", h.pid, 120)
    r["state_after_full"] = timed(cp, "state", h.pid, 10)
    hog.stdin.write("\n")
    hog.stdin.flush()
    hog.wait()
    r["restore_again"] = timed(cp, "restore", h.pid, 120)
    r["state_again"] = timed(cp, "state", h.pid, 10)
    if r["state_again"].get("state") == "locked":
        r["unlock"] = timed(cp, "unlock", h.pid, 10)
        r["check"] = h.ask("check")
        say("after the hog:", r["check"])
    return r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=int, default=4)
    ap.add_argument("--cycles", type=int, default=2)
    ap.add_argument("--pairs", action="store_true")
    ap.add_argument("--stop", action="store_true")
    ap.add_argument("--bad-pair", action="store_true")
    ap.add_argument("--no-cuda", action="store_true")
    ap.add_argument("--hog", action="store_true",
                    help="last: a restore while another process holds the GPU's free memory, "
                         "then again once it has gone (is a refused restore retryable?)")
    ap.add_argument("--no-init-first", action="store_true",
                    help="the first cycle's restore without cuInit in the helper")
    a = ap.parse_args()
    cp = CudaCheckpointer()
    RES["supported"], RES["why"] = cp.supported, cp.why
    say("probe:", RES["supported"], RES["why"])
    if not cp.supported:
        print(json.dumps(RES))
        return
    if a.no_cuda:
        sl = subprocess.Popen(["sleep", "60"])
        RES["state_no_cuda"] = timed(cp, "state", sl.pid, 10)
        RES["lock_no_cuda"] = timed(cp, "lock", sl.pid, 10, "--timeout-ms", "2000")
        sl.kill()
        sl.wait()
    RES["host_idle_mib"], RES["gpu_idle_mib"] = host_used_mib(), gpu_used_mib()
    h = Holder(a.gib)
    say("holder", h.first)
    RES["holder"] = h.first
    uuid = gpu_uuid()
    RES["uuid"] = uuid
    for n in range(1, a.cycles + 1):
        pairs = (GpuPair(uuid, uuid),) if (a.pairs and n == 2 and uuid) else ()
        RES[f"cycle{n}"] = cycle(cp, h, n, pairs, no_init=a.no_init_first and n == 1)
    if a.stop:
        say("SIGSTOP the holder, then lock with a 4 s deadline")
        os.kill(h.pid, signal.SIGSTOP)
        time.sleep(0.5)
        r = {"lock": timed(cp, "lock", h.pid, 4, "--timeout-ms", "2500")}
        r["state_stopped"] = timed(cp, "state", h.pid, 5)
        os.kill(h.pid, signal.SIGCONT)
        time.sleep(0.5)
        r["state_cont"] = timed(cp, "state", h.pid, 10)
        if r["state_cont"].get("state") == "locked":
            r["unlock"] = timed(cp, "unlock", h.pid, 10)
        r["check"] = h.ask("check")
        say("after SIGCONT:", r["check"])
        RES["stop"] = r
    if a.bad_pair and uuid:
        r = {"lock": timed(cp, "lock", h.pid, 30, "--timeout-ms", "20000"),
             "checkpoint": timed(cp, "checkpoint", h.pid, 300)}
        bogus = "GPU-00000000-0000-0000-0000-000000000000"
        r["restore_bad"] = timed(cp, "restore", h.pid, 120, "--pairs", f"{uuid}={bogus}")
        r["state_after_bad"] = timed(cp, "state", h.pid, 10)
        r["restore_again"] = timed(cp, "restore", h.pid, 120)
        r["state_again"] = timed(cp, "state", h.pid, 10)
        if r["state_again"].get("state") == "locked":
            r["unlock"] = timed(cp, "unlock", h.pid, 10)
            r["check"] = h.ask("check")
        RES["bad_pair"] = r
    if a.hog:
        RES["hog"] = hog_restore(cp, h)
    h.end()
    RES["host_end_mib"], RES["gpu_end_mib"] = host_used_mib(), gpu_used_mib()
    print(json.dumps(RES), flush=True)


if __name__ == "__main__":
    main()
