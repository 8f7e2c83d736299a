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
        out.append(f"devbroker top - {clock} - pid {s.get('pid', '?')} - {s['backend']} backend, "
                   f"driver {s['driver']} - {len(s['tenants'])} tenants - "
                   f"{len(alerts)} alerts - every {interval:g} s")
        out.append("")
        out.append(f"{'TENANT':<14} {'PROCS':>5} {'FILES':>5} {'MEMORY USED / QUOTA':<34} "
                   f"{'IOCTL/S':>8} {'REFUSED/S':>9} {'REFUSED':>8}")
        prev = {t["name"]: t for t in (self.prev.status["tenants"] if self.prev
                                      and self.prev.status else [])}
        dt = cur.at - self.prev.at if self.prev else 0.0
        for t in s["tenants"]:
            mem = ", ".join(f"gpu{g} {_human(m['used'])}/{_human(m['quota'])}"
                            + (f" {100 * m['used'] / m['quota']:.0f}%" if m["quota"] else "")
                            for g, m in t["memory"].items()) or "-"
            p = prev.get(t["name"])
            if p is not None and dt > 0:
                ios = f"{max(0, t['requests'] - p['requests']) / dt:.1f}"
                refs = f"{max(0, t['refusals'] - p['refusals']) / dt:.1f}"
            else:
                ios = refs = "-"
            out.append(f"{t['name']:<14} {len(t['processes']):>5} {t['open_files']:>5} "
                       f"{mem:<34} {ios:>8} {refs:>9} {t['refusals']:>8}"
                       + (f"  PREEMPTED ({t['preempted']})" if t.get("preempted") else ""))
        if alerts:
            out.append("")
            out.append("ALERTS")
            for a in alerts:
                out.append(f"  {a['alert']}: {a.get('message', a['tenant'])}")
        self.prev = cur
        return [line[:width] for line in out]


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
