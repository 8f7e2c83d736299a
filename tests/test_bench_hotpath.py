"""The hot-path benchmark's short run: it completes and reports every path.

Runs `scripts/bench_hotpath.py --short` for real (the C libfuse3 floor built with gcc, a
broker with the real backend and its relay against the stand-in node, `devbroker run` with
FUSE and seccomp tenants, throughput with 1/4/16 tenant processes, the fairness pair) and
checks that each row of the table has a number. No time is asserted: speed is judged in the
benchmark's own table, against the floor measured in the same run (docs/benchmarks.md).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (FUSE mounts)")

ROWS = ["floor", "fuse-emulated", "fuse-real", "fuse-real-kernel",
        "seccomp-emulated", "seccomp-emulated-python", "seccomp-emulated-nolane"]
# The rows over FUSE's io_uring transport, where the kernel has it (Linux 6.14+): measured
# (the script turns fuse.enable_uring on for them and back), else said why not.
URING_ROWS = ["floor-uring", "fuse-real-uring"]
URING_PARAM = Path("/sys/module/fuse/parameters/enable_uring")


def test_short_run_reports_every_path(tmp_path):
    doc = tmp_path / "bench.md"
    doc.write_text("# before\n\n<!-- bench_hotpath:begin -->\nold\n<!-- bench_hotpath:end -->\n"
                   "\nafter\n")
    out = tmp_path / "numbers.json"
    uring_was = URING_PARAM.read_text() if URING_PARAM.exists() else None
    p = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_hotpath.py"), "--short",
                        "--doc", str(doc), "--json", str(out)],
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    nums = json.loads(out.read_text())["numbers"]
    rows = ROWS + (URING_ROWS if uring_was is not None else [])
    want = [f"{r}.{q}" for r in rows for q in ("p50_us", "p90_us")]
    want += [f"throughput-{n}.calls_per_s" for n in (1, 4, 16)]
    want += ["floor-throughput-16.calls_per_s"]
    want += ["quiet-alone.p50_us", "quiet-flooded.p50_us", "quiet.ratio"]
    for key in want:
        assert key in nums, key
        assert isinstance(nums[key], (int, float)) and math.isfinite(nums[key]) \
            and nums[key] > 0, (key, nums[key])
    text = doc.read_text()
    if uring_was is not None:  # turned on for those rows only, and back as it was
        assert URING_PARAM.read_text() == uring_was
        assert "C server over io_uring" in text and "that C FUSE server over io_uring" in text
    else:
        assert text.count("not measured: this kernel has no FUSE io_uring transport") == 2
    # the marked section was replaced, what is around it kept
    assert text.startswith("# before\n") and text.rstrip().endswith("after")
    assert "old" not in text and text.count("<!-- bench_hotpath:begin -->") == 1
    for label in ("the floor", "FUSE + emulated", "stand-in node", "answering in the kernel",
                  "seccomp front end",
                  "16 tenant processes", "floods"):
        assert label in text, label
