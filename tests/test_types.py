"""The strictly typed code type-checks: mypy --strict on what pyproject.toml's [tool.mypy]
names (the bottom layers and the wire codecs), with the version the test extra pins."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_strict_packages_type_check():
    r = subprocess.run([sys.executable, "-m", "mypy", "--config-file",
                        str(ROOT / "pyproject.toml")],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Success: no issues found" in r.stdout
