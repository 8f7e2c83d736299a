"""The C probe: gcc's own sizeof/alignof/offsetof of every struct the tables describe.

The probe includes the same headers as the reader, lists one entry per struct and one per
field, and prints what the compiler computed. abigen compares that with devbroker's layout
engine before it writes anything, and stores it (tests/data/abi/parity-<tag>.json.gz) so CI
can run the same comparison without the headers.
"""
from __future__ import annotations

import subprocess
from pathlib import Path


def c_source(rd) -> str:
    lines = [rd.tu_text(), "#include <stdio.h>",
             "struct probe_entry { const char *s, *f; unsigned long a, b; };",
             "static const struct probe_entry E[] = {"]
    for key, dsl in rd.dsl.items():
        if dsl.startswith("="):
            continue
        t = rd.cexpr[key]
        if not t:  # the type of an unnamed member: checked through its parent
            continue
        lines.append(f'  {{"{key}", "", sizeof({t}), _Alignof({t})}},')
        if key in rd.scalar or dsl.startswith("union<"):
            continue
        for item in dsl.split():
            f = item.split(":", 1)[0]
            if (key, f) in rd.anon_first:
                inner = rd.anon_first[(key, f)]
                lines.append(f'  {{"{key}", "{f}", offsetof({t}, {inner}), 0}},')
                continue
            lines.append(f'  {{"{key}", "{f}", offsetof({t}, {f}), sizeof((({t}*)0)->{f})}},')
    lines += ["};",
              "int main(void) {",
              "  for (unsigned long i = 0; i < sizeof(E) / sizeof(E[0]); i++)",
              '    printf("%s\\t%s\\t%lu\\t%lu\\n", E[i].s, E[i].f, E[i].a, E[i].b);',
              "  return 0;", "}"]
    return "\n".join(lines) + "\n"


def run(rd, work: Path) -> dict:
    """{struct: [size, align, [[field, offset, size], ...]]} as gcc lays them out (x86-64)."""
    src = work / "probe.c"
    exe = work / "probe"
    src.write_text(c_source(rd))
    r = subprocess.run(["gcc", "-O0", "-w", *rd.include_flags(), "-o", str(exe), str(src)],
                       capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"abigen: {rd.tag}: the probe does not compile:\n{r.stderr[-6000:]}")
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    res: dict[str, list] = {}
    for line in out.splitlines():
        s, f, a, b = line.split("\t")
        if not f:
            res[s] = [int(a), int(b), []]
        else:
            res[s][2].append([f, int(a), int(b)])
    return res


def compare(rd, measured: dict) -> list[str]:
    bad = []
    for key, dsl in rd.dsl.items():
        if dsl.startswith("="):
            continue
        spec = rd.spec(key)
        got = measured.get(key)
        if got is None:
            if rd.cexpr.get(key):
                bad.append(f"{key}: not probed")
            continue
        size, align, fields = got
        if (spec.size, spec.align) != (size, align):
            bad.append(f"{key}: devbroker size/align {spec.size}/{spec.align}, gcc {size}/{align}")
        for f, off, fsize in fields:
            mine = spec.by_name.get(f)
            if mine is None:
                bad.append(f"{key}.{f}: missing")
            elif (mine.offset, mine.size if fsize else 0) != (off, fsize):
                bad.append(f"{key}.{f}: devbroker @{mine.offset}+{mine.size}, gcc @{off}+{fsize}")
    return bad
