"""kmodwire must match kmod/devbroker_proto.h byte for byte (no kernel needed: gcc only)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from devbroker.frontends import kmodwire as w

HEADER_DIR = Path(__file__).resolve().parents[1] / "kmod"


def _probe(tmp_path: Path) -> dict[str, int]:
    if not shutil.which("gcc"):
        pytest.skip("gcc not installed")
    lines = []
    for struct_name, fields in (("request", w.REQUEST_FIELDS), ("verdict", w.VERDICT_FIELDS)):
        lines.append(f'P("{struct_name}.sizeof", sizeof(struct devbroker_{struct_name}));')
        for name, _ in fields:
            s = f"struct devbroker_{struct_name}"
            lines.append(f'P("{struct_name}.{name}.off", offsetof({s}, {name}));')
            lines.append(f'P("{struct_name}.{name}.size", sizeof((({s} *)0)->{name}));')
    for const in ("DEVBROKER_PROTO_VERSION", "DEVBROKER_REQ_MAGIC", "DEVBROKER_VERDICT_MAGIC",
                  "DEVBROKER_MAX_ARG", "DEVBROKER_ARG_TYPE", "DEVBROKER_READ_SIZE",
                  "DEVBROKER_MMAP_SHARED", "DEVBROKER_OP_OPEN", "DEVBROKER_OP_IOCTL",
                  "DEVBROKER_OP_MMAP", "DEVBROKER_OP_RELEASE", "DEVBROKER_REPLY",
                  "DEVBROKER_DENY", "DEVBROKER_PASS", "DEVBROKER_NODE_CTL",
                  "DEVBROKER_NODE_GPU", "DEVBROKER_NODE_UVM", "DEVBROKER_NODE_UVM_TOOLS"):  # fmt: skip
        lines.append(f'P("{const}", {const});')
    src = tmp_path / "probe.c"
    src.write_text(
        "#include <stdio.h>\n#include <stddef.h>\n#include \"devbroker_proto.h\"\n"
        '#define P(n, v) printf("%s %llu\\n", n, (unsigned long long)(v))\n'
        "int main(void) {\n" + "\n".join(lines) + "\nreturn 0; }\n"
    )
    exe = tmp_path / "probe"
    subprocess.run(["gcc", "-Wall", "-Werror", f"-I{HEADER_DIR}", "-o", exe, src], check=True)
    out = subprocess.run([exe], check=True, capture_output=True, text=True).stdout
    return {k: int(v) for k, v in (line.split() for line in out.splitlines())}


def test_layout_matches_header(tmp_path):
    c = _probe(tmp_path)
    for struct_name, fields, size in (("request", w.REQUEST_FIELDS, w.REQUEST_SIZE),
                                      ("verdict", w.VERDICT_FIELDS, w.VERDICT_SIZE)):  # fmt: skip
        assert c[f"{struct_name}.sizeof"] == size
        for name, (off, fsize) in w.field_offsets(fields).items():
            assert (c[f"{struct_name}.{name}.off"], c[f"{struct_name}.{name}.size"]) == (off, fsize), name
    assert c["DEVBROKER_PROTO_VERSION"] == w.PROTO_VERSION
    assert c["DEVBROKER_REQ_MAGIC"] == w.REQ_MAGIC
    assert c["DEVBROKER_VERDICT_MAGIC"] == w.VERDICT_MAGIC
    assert c["DEVBROKER_MAX_ARG"] == w.MAX_ARG
    assert c["DEVBROKER_ARG_TYPE"] == w.ARG_TYPE
    assert c["DEVBROKER_READ_SIZE"] == w.READ_SIZE
    assert c["DEVBROKER_MMAP_SHARED"] == w.MMAP_SHARED
    for op in w.Op:
        assert c[f"DEVBROKER_OP_{op.name}"] == op
    for v in w.Verdict:
        assert c[f"DEVBROKER_{v.name}"] == v


def test_node_kinds_match_abi(tmp_path):
    from devbroker.abi.nodes import NodeKind

    c = _probe(tmp_path)
    for name in ("CTL", "GPU", "UVM", "UVM_TOOLS"):
        assert c[f"DEVBROKER_NODE_{name}"] == NodeKind[name]


def test_request_round_trip_and_errors():
    req = w.Request(op=w.Op.IOCTL, id=7, file_id=3, pid=10, tgid=9, uid=1000, gid=1000,
                    cgroup_id=1234, pidns_ino=4026531836, node=1, minor=0, flags=0,
                    cmd=0xC00446D6, arg=0x7FFF0000, offset=0, length=0, data=b"\1\2\3\4")  # fmt: skip
    buf = w.encode_request(req)
    assert w.parse_request(buf) == req
    with pytest.raises(w.ProtocolError):
        w.parse_request(buf[:-1])  # length disagrees with arg_size
    with pytest.raises(w.ProtocolError):
        w.parse_request(b"\0" * w.REQUEST_SIZE)  # bad magic
    assert w.arg_size(0xC00446D6) == 4  # _IOWR('F', 214, 4)
    assert w.arg_size(0x30000001) == 0  # UVM raw number


def test_verdict_round_trip():
    for v in (w.reply(1, 5, b"xy"), w.deny(2, 1), w.pass_(3, fd=4), w.map_file(4, 9, 4096)):
        assert w.parse_verdict(w.encode_verdict(v)) == v
