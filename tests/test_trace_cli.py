"""The real `devbroker trace` command, run as a subprocess."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TRACES = REPO.parent / "shared" / "traces"
NVML = TRACES / "h200-580.159.04-nvml.nvtrace"


def run(*args):
    return subprocess.run([sys.executable, "-m", "devbroker.cli.main", "trace", *args],
                          capture_output=True, text=True, timeout=120, cwd=REPO)


@pytest.fixture
def nvml():
    if not NVML.exists():
        pytest.skip("shared traces not present")
    return str(NVML)


def test_show_prints_every_record_decoded(nvml):
    p = run("show", nvml)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert len(lines) == 133  # one line per record
    fb = [l for l in lines if "[NV2080_CTRL_CMD_FB_GET_INFO_V2]" in l]
    assert fb and "status=NV_OK" in fb[0] and "index=8 data=0x8c66c00" in fb[0]
    assert any("NV_ESC_REGISTER_FD ctl_fd=fd:" in l for l in lines)
    assert any("NV_ESC_RM_MAP_MEMORY" in l and "fd=fd:" in l for l in lines)
    assert any("hClass=NV20_SUBDEVICE_0(0x2080)" in l for l in lines)
    assert not any("UNKNOWN" in l or "DECODE-ERROR" in l for l in lines)


def test_stats_counts_and_no_unknowns(nvml):
    p = run("stats", nvml)
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "    37  NV_ESC_RM_CONTROL" in out
    assert "controls (37 total, 25 distinct)" in out
    assert "unknown (0 distinct)" in out and "decode errors (0)" in out


def test_stats_with_535_reports_mismatches(nvml):
    p = run("stats", "--version", "535.309.01", nvml)
    assert p.returncode == 1
    assert "UNKNOWN(0xc00846da)" in p.stdout and "paramsSize 384 != " in p.stdout


def test_bad_file_is_a_clean_error(tmp_path):
    bad = tmp_path / "bad.nvtrace"
    bad.write_bytes(b"NVTR" + bytes(20))
    p = run("show", str(bad))
    assert p.returncode == 2 and "header" in p.stderr and "Traceback" not in p.stderr
