"""The real `devbroker trace` command, run as a subprocess."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data"  # the H200 recordings (copies of ../shared/traces and ours)
NVML = DATA / "h200-580.159.04-nvml.nvtrace"
RECORDINGS = sorted(DATA.glob("*.nvtrace"))


def run(*args):
    return subprocess.run([sys.executable, "-m", "devbroker.cli.main", "trace", *args],
                          capture_output=True, text=True, timeout=120, cwd=REPO)


@pytest.fixture
def nvml():
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
    # a control no header defines is named by its range (0x20809064: category 0x90 of NV2080)
    assert any("NV2080_CTRL_CMD_CLK_LEGACY_NON_PRIVILEGED_UNPUBLISHED_64(0x20809064)" in l
               for l in lines)


def test_stats_counts_and_no_unknowns(nvml):
    p = run("stats", nvml)
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "    37  NV_ESC_RM_CONTROL" in out
    assert "controls (37 total, 25 distinct)" in out
    assert ("unknown (2 distinct; 2 of them controls NVIDIA publishes no header for, 0 gaps "
            "in the tables)") in out and "decode errors (0)" in out


@pytest.mark.parametrize("rec", RECORDINGS, ids=lambda p: p.name)
def test_stats_lists_only_unpublished_controls_as_unknown(rec):
    """On every recording of real traffic, what `trace stats` cannot name with a
    layout is a control NVIDIA publishes no header for, named by its range."""
    p = run("stats", str(rec))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr
    unknown = p.stdout.split("\nunknown (", 1)[1].split("\ndecode errors", 1)[0]
    lines = [l.strip() for l in unknown.splitlines()[1:] if l.strip()]
    assert lines, "the recordings do send unpublished controls"
    for line in lines:
        assert "_UNPUBLISHED_" in line and "unpublished: no published layout" in line, line
    assert "UNKNOWN" not in p.stdout


def test_replay_against_the_emulator_explains_every_difference(nvml):
    p = run("replay", nvml)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "calls replayed: 57" in p.stdout and "0 not explained" in p.stdout
    p = run("replay", "--all", nvml)
    assert "on purpose" in p.stdout and "NV_ESC_CARD_INFO" in p.stdout
    p = run("replay", "--explain")
    assert p.returncode == 0 and p.stdout.startswith("<!-- generated from")


def test_stats_with_535_reports_mismatches(nvml):
    p = run("stats", "--version", "535.309.01", nvml)
    assert p.returncode == 1
    assert "UNKNOWN(0xc00846da)" in p.stdout and "paramsSize 384 != " in p.stdout


def test_bad_file_is_a_clean_error(tmp_path):
    bad = tmp_path / "bad.nvtrace"
    bad.write_bytes(b"NVTR" + bytes(20))
    p = run("show", str(bad))
    assert p.returncode == 2 and "header" in p.stderr and "Traceback" not in p.stderr
