"""The native parts are built from source by devbroker.native (native/lane.c): where, with
which compiler, and which libraries it refuses to load."""
from __future__ import annotations

import ctypes
import os
import subprocess
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
    planted = tmp_path / f"lane-{native._digest(native.source_of('lane'))}.so"
    planted.write_bytes(b"not a library")
    planted.chmod(0o666)  # writable by anyone: whoever wrote it could run code in the broker
    assert not native._trusted(planted)
    monkeypatch.setattr(native, "_dirs", lambda: [tmp_path])
    built = native.build("lane")  # built again over it, not loaded
    assert built == planted and native._trusted(built)
    assert ctypes.CDLL(str(built)).dvb_abi() >= 1


def test_c_and_python_see_one_call_structure_generated_from_one_source(tmp_path):
    """struct dvb_call, the sizes and the codes are written once (native/callabi.py): the
    header lane.c includes is generated from it, and a C program built against that header
    finds every field of the structure at the offset the ctypes side uses, and every code
    at the value Python uses."""
    from devbroker.native import callabi

    (tmp_path / "dvb_call.h").write_text(callabi.c_header())
    Call = callabi.call_struct()
    fields = [name for _t, name, _n, _why in callabi.CALL]
    codes = [n for _what, names in callabi.ENUMS for n in names]
    prog = ['#include <stddef.h>', '#include <stdio.h>', '#include "dvb_call.h"',
            "int main(void) {",
            '    printf("size %zu\\n", sizeof(struct dvb_call));',
            '    printf("abi %d\\n", DVB_ABI);']
    prog += [f'    printf("{f} %zu\\n", offsetof(struct dvb_call, {f}));' for f in fields]
    prog += [f'    printf("{c} %d\\n", (int){c});' for c in codes]
    prog += [f'    printf("DVB_{n} %d\\n", (int)DVB_{n});' for n, _v, _w in callabi.SIZES]
    prog += [f'    printf("C_{c} %d\\n", (int)C_{c});' for c in callabi.COUNTERS]
    prog += ['    printf("C_COUNT %d\\n", (int)C_COUNT);']
    prog += ["    return 0;", "}"]
    (tmp_path / "probe.c").write_text("\n".join(prog) + "\n")
    cc = native._compiler()
    exe = tmp_path / "probe"
    subprocess.run([*cc, "-I", str(tmp_path), "-o", str(exe), str(tmp_path / "probe.c")],
                   check=True, timeout=120)
    got = dict(line.split() for line in subprocess.run(
        [str(exe)], capture_output=True, text=True, check=True).stdout.splitlines())
    assert int(got["size"]) == ctypes.sizeof(Call)
    assert int(got["abi"]) == callabi.ABI
    for f in fields:
        assert int(got[f]) == getattr(Call, f).offset, f
    for c in codes:
        assert int(got[c]) == getattr(callabi, c), c
    for n, v, _w in callabi.SIZES:
        assert int(got[f"DVB_{n}"]) == v == getattr(callabi, n), n
    for i, c in enumerate(callabi.COUNTERS):  # (dvb_fold copies them out in this order)
        assert int(got[f"C_{c}"]) == i, c
    assert int(got["C_COUNT"]) == len(callabi.COUNTERS)
    # and lane.c holds none of it by hand
    src = (native.HERE / "lane.c").read_text()
    assert "struct dvb_call {" not in src and "#define DVB_ABI" not in src
    assert "enum { C_NOTIFICATIONS" not in src
    assert not [n for n, _v, _w in callabi.SIZES if f"#define DVB_{n} " in src]
