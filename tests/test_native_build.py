"""The native parts are built from source by devbroker.native (native/lane.c): where, with
which compiler, and which libraries it refuses to load."""
from __future__ import annotations

import ctypes
import os
import sys

from devbroker import native


def test_builds_with_the_hosts_compiler_and_the_library_loads(tmp_path, monkeypatch):
    monkeypatch.setattr(native, "_dirs", lambda: [tmp_path])
    older = tmp_path / "lane-0123456789abcdef.so"  # a build of an earlier source
    older.write_bytes(b"old")
    older.chmod(0o755)
    lib = native.build("lane")
    assert not older.exists()  # replaced, not left to pile up
    assert lib.parent == tmp_path and lib.name.startswith("lane-")
    assert native._trusted(lib)
    assert ctypes.CDLL(str(lib)).dvb_abi() >= 1
    assert native.build("lane") == lib  # built once per source


def test_a_cc_that_is_not_a_compiler_is_passed_over(monkeypatch, tmp_path):
    # a script's own variable named CC (here: a Python one-liner) must never be run
    monkeypatch.setenv("CC", f"{sys.executable} -c 'raise SystemExit(3)'")
    cc = native._compiler()
    assert cc is not None and os.path.basename(cc[0]) in ("cc", "gcc")
    monkeypatch.setenv("CC", "gcc -m64")
    cc = native._compiler()
    assert os.path.basename(cc[0]) == "gcc" and cc[1:] == ["-m64"]
    monkeypatch.setattr(native, "_dirs", lambda: [tmp_path])
    monkeypatch.setenv("CC", f"{sys.executable} -c 'raise SystemExit(3)'")
    assert native.build("lane").exists()


def test_a_library_others_can_write_is_not_loaded(tmp_path, monkeypatch):
    src = (native.HERE / "lane.c").read_bytes()
    planted = tmp_path / f"lane-{native._digest(src)}.so"
    planted.write_bytes(b"not a library")
    planted.chmod(0o666)  # writable by anyone: whoever wrote it could run code in the broker
    assert not native._trusted(planted)
    monkeypatch.setattr(native, "_dirs", lambda: [tmp_path])
    built = native.build("lane")  # built again over it, not loaded
    assert built == planted and native._trusted(built)
    assert ctypes.CDLL(str(built)).dvb_abi() >= 1
