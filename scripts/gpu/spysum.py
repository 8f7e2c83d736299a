"""Summary of a py-spy raw profile (`py-spy record -f raw --threads`), for the GPU probes:
the 30 functions most often on top of the stack (self) and the 60 most often anywhere on it
(inclusive), as percentages of all samples.

    python3 scripts/gpu/spysum.py PROFILE.txt
"""
from __future__ import annotations

import collections
import sys


def main(path: str) -> None:
    selfc: collections.Counter = collections.Counter()
    incl: collections.Counter = collections.Counter()
    tot = 0
    for line in open(path):
        stack, _, n = line.rstrip().rpartition(" ")
        if not n.isdigit():
            continue
        tot += int(n)
        frames = stack.split(";")
        selfc[frames[-1]] += int(n)
        for f in set(frames):
            incl[f] += int(n)
    print("samples", tot)
    for f, n in selfc.most_common(30):
        print(f"{n * 100 / tot:5.1f}% self {f[:160]}")
    for f, n in incl.most_common(60):
        print(f"{n * 100 / tot:5.1f}% incl {f[:160]}")


if __name__ == "__main__":
    main(sys.argv[1])
