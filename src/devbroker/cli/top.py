"""`devbroker top`: a live per-tenant view in the terminal, built on the control socket.

Every refresh asks the broker for its status (the same JSON as `devbroker status`) and shows
one row per tenant: processes, open files, memory used / quota per GPU, ioctls per second and
refusals per second (differences between two refreshes) and refusals in all, with the active
alerts below. Keys: q quits, + / - change the refresh interval. A broker that goes away (or
is being upgraded) is shown as unreachable and asked again at the next refresh.

The screen is drawn with curses; `--once` prints one plain frame instead (for scripts).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field


def add_parser(sub) -> None:
    p = sub.add_parser("top", help="live per-tenant view: memory, ioctl/s, refusals")
    p.add_argument("-d", "--interval", type=float, default=1.0,
                   help="seconds between refreshes (default 1)")
    p.add_argument("-n", "--iterations", type=int, default=0,
                   help="quit after this many refreshes (default: until q)")
    p.add_argument("--once", action="store_true",
                   help="print one frame without curses and exit (rates need two samples: "
                        "shown as -)")
    p.set_defaults(func=cmd_top)


@dataclass
class Sample:
    at: float
    status: dict | None
    error: str = ""


@dataclass
class View:
    """Turns two consecutive samples into the lines of one frame (no terminal I/O here)."""

    prev: Sample | None = None
    rates: dict = field(default_factory=dict)

    def frame(self, cur: Sample, width: int, interval: float) -> list[str]:
        out = []
        clock = time.strftime("%H:%M:%S", time.localtime())
        if cur.status is None:
            out.append(f"devbroker top - {clock} - broker not reachable: {cur.error}")
            out.append("(asking again every refresh; q quits)")
            self.prev = None
            return [line[:width] for line in out]
        s = cur.status
        alerts = s.get("alerts") or []
        out += _wrap([f"devbroker top - {clock}", f"pid {s.get('pid', '?')}",
                      f"{s['backend']} backend, driver {s['driver']}",
                      f"{len(s['tenants'])} tenants", f"{len(alerts)} alerts",
                      f"every {interval:g} s"], " - ", width)
        out.append("")
        prev = {t["name"]: t for t in (self.prev.status["tenants"] if self.prev
                                      and self.prev.status else [])}
        dt = cur.at - self.prev.at if self.prev else 0.0
        rows = []
        for t in s["tenants"]:
            mem = ", ".join(f"gpu{g} {_human(m['used'])}/{_human(m['quota'])}"
                            + (f" {100 * m['used'] / m['quota']:.0f}%" if m["quota"] else "")
                            for g, m in t["memory"].items()) or "-"
            # (managed ranges are part of each GPU's used memory; pinned host memory is not)
            extra = [f"{what} {_human(n)}" for what, n in (
                ("managed", t.get("managed_memory", 0)),
                ("pinned", (t.get("pinned_host_memory") or {}).get("used", 0))) if n]
            if extra:
                mem += f" ({', '.join(extra)})"
            p = prev.get(t["name"])
            if p is not None and dt > 0:
                ios = f"{max(0, t['requests'] - p['requests']) / dt:.1f}"
                refs = f"{max(0, t['refusals'] - p['refusals']) / dt:.1f}"
            else:
                ios = refs = "-"
            if t.get("preempted"):  # its GPU state in host memory (broker/preemption.py)
                mem = f"PREEMPTED ({t['preempted']}) {mem}"
            rows.append((t["name"], len(t["processes"]), t["open_files"], mem, ios, refs,
                         t["refusals"]))
        # The numbers keep their columns at any width (an 80-column terminal included): the
        # tenant names and the memory column share what is left, memory cut short first.
        room = width - NUMBERS_WIDTH
        name_w = min(max([len("TENANT")] + [len(r[0]) for r in rows]),
                     max(len("TENANT"), room - MEMORY_MIN))
        mem_w = max(MEMORY_MIN, min(max([len(MEMORY)] + [len(r[3]) for r in rows]),
                                    room - name_w))
        out.append(_row(("TENANT", "PROCS", "FILES", MEMORY, "IOCTL/S", "REFUSED/S",
                         "REFUSED"), name_w, mem_w))
        out += [_row(r, name_w, mem_w) for r in rows]
        if alerts:
            out.append("")
            out.append("ALERTS")
            for a in alerts:
                out.append(f"  {a['alert']}: {a.get('message', a['tenant'])}")
        self.prev = cur
        return [line[:width] for line in out]


# Column widths of the numbers (with the spaces between all seven columns); the tenant
# names and the memory column get the rest.
PROCS_W, FILES_W, IOCTL_W, REFUSED_RATE_W, REFUSED_W = 5, 5, 8, 9, 7
NUMBERS_WIDTH = PROCS_W + FILES_W + IOCTL_W + REFUSED_RATE_W + REFUSED_W + 6
MEMORY, MEMORY_MIN = "MEMORY USED / QUOTA", 12


def _cut(text: str, width: int) -> str:
    text = str(text)
    return text if len(text) <= width else text[:width - 1] + "~"


def _row(cols: tuple, name_w: int, mem_w: int) -> str:
    name, procs, files, mem, ios, refs, refused = cols
    return (f"{_cut(name, name_w):<{name_w}} {procs:>{PROCS_W}} {files:>{FILES_W}} "
            f"{_cut(mem, mem_w):<{mem_w}} {ios:>{IOCTL_W}} {refs:>{REFUSED_RATE_W}} "
            f"{refused:>{REFUSED_W}}")


def _wrap(parts: list[str], sep: str, width: int) -> list[str]:
    """parts joined by sep, broken between parts into lines of at most width."""
    lines = [parts[0]]
    for part in parts[1:]:
        if len(lines[-1]) + len(sep) + len(part) <= width:
            lines[-1] += sep + part
        else:
            lines.append("  " + part)
    return lines


def _human(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.4g}{unit}"
    return f"{n}B"


def _sample(control) -> Sample:
    from devbroker.broker.control import ControlError, call

    now = time.monotonic()
    try:
        reply = call(control, {"op": "status"}, timeout=5)
    except (ControlError, OSError, ValueError) as e:
        return Sample(now, None, str(e))
    if not reply.get("ok"):
        return Sample(now, None, str(reply.get("error")))
    return Sample(now, reply)


def cmd_top(args) -> int:
    from devbroker.cli.broker_cmds import _paths

    control = _paths(args).control
    interval = max(0.1, args.interval)
    if args.once:
        cur = _sample(control)
        for line in View().frame(cur, 200, interval):
            print(line)
        return 0 if cur.status is not None else 1
    import curses

    def run(screen) -> int:
        curses.curs_set(0)
        screen.nodelay(True)
        view = View()
        shown = 0
        nonlocal interval
        while True:
            cur = _sample(control)
            height, width = screen.getmaxyx()
            screen.erase()
            for y, line in enumerate(view.frame(cur, width - 1, interval)[:height]):
                screen.addstr(y, 0, line)
            screen.refresh()
            shown += 1
            if args.iterations and shown >= args.iterations:
                return 0
            deadline = time.monotonic() + interval
            while time.monotonic() < deadline:
                key = screen.getch()
                if key in (ord("q"), ord("Q")):
                    return 0
                if key == ord("+"):
                    interval = min(60.0, interval * 2)
                elif key == ord("-"):
                    interval = max(0.1, interval / 2)
                elif key == curses.KEY_RESIZE:
                    break
                time.sleep(0.05)

    return curses.wrapper(run)
