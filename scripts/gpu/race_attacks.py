"""The racing-thread attacks of the escape harness (devbroker/escape/races.py), one at a time,
inside `devbroker exec` on the real GPU (scripts/gpu/run-h200-cuda.sh runs them this way;
`devbroker escape-test --frontend seccomp --backend real` runs them in the harness):

    python3 race_attacks.py nvos02-class | root-class | direct-open

Each prints one JSON line: {"attack", "result": refused|escaped|error, "got", "detail"}.
"""
from __future__ import annotations

import json
import sys

from devbroker.escape import races
from devbroker.escape.attacks import Ctx

if __name__ == "__main__":
    name = sys.argv[1]
    fn = {"nvos02-class": races.a_race_nvos02_class, "root-class": races.a_race_root_class,
          "direct-open": races.a_race_direct_open}[name]
    o = fn(Ctx())
    print(json.dumps({"attack": name, **o.to_dict()}), flush=True)
