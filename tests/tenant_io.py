"""Reading what tenant programs (tests/tenant_prog.py, tenant_isolation.py) print: one JSON
object per line. Shared by the end-to-end test modules."""
from __future__ import annotations

import json
import subprocess
import threading


def lines(text: str) -> list[dict]:
    return [json.loads(x) for x in text.splitlines() if x.startswith("{")]


def readline_json(p: subprocess.Popen, timeout: float = 60) -> dict:
    """The next line a running tenant prints, parsed; fails the test if none comes in time
    or the tenant exited."""
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("line", p.stdout.readline()), daemon=True)
    t.start()
    t.join(timeout)
    assert "line" in box, "the tenant printed nothing in time"
    assert box["line"], f"the tenant exited: {p.stderr.read() if p.stderr else ''}"
    return json.loads(box["line"])
