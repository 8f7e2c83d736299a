"""`devbroker top` through a real pseudo-terminal, its screen read back with a VT100
emulator (pyte), while real tenant processes allocate and make calls."""
from __future__ import annotations

import fcntl
import os
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import pyte
import pytest

from devbroker.testing.policies import one_h200, tenant

from conftest import DEVBROKER
from tenant_io import readline_json

pytestmark = pytest.mark.root

HERE = Path(__file__).resolve().parent
TENANT = [sys.executable, str(HERE / "tenant_prog.py")]
ROWS, COLS = 24, 110

POLICY = one_h200(tenant("alice", memory_quota="1GiB"), tenant("bob", memory_quota="2GiB"),
                  driver_version=None)


class Terminal:
    """A program on the slave side of a pty; what it drew, as a screen."""

    def __init__(self, argv: list[str]):
        self.master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", ROWS, COLS, 0, 0))
        self.screen = pyte.Screen(COLS, ROWS)
        self.stream = pyte.ByteStream(self.screen)
        self.lock = threading.Lock()
        env = dict(os.environ, TERM="xterm", LINES=str(ROWS), COLUMNS=str(COLS))
        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env,
                                     start_new_session=True)
        os.close(slave)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self.master, 65536)
            except OSError:  # EIO: the slave side is closed
                return
            if not data:
                return
            with self.lock:
                self.stream.feed(data)

    def lines(self) -> list[str]:
        with self.lock:
            return [line.rstrip() for line in self.screen.display]

    def row(self, tenant: str) -> str | None:
        return next((line for line in self.lines() if line.startswith(tenant + " ")), None)

    def wait(self, pred, what: str, timeout: float = 30.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = pred()
            if value:
                return value
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}; screen:\n" + "\n".join(self.lines()))

    def type(self, text: str) -> None:
        os.write(self.master, text.encode())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.close(self.master)


def columns(row: str) -> list[str]:
    return row.split()


def test_top_shows_memory_ioctl_rate_refusals_and_alerts(start_broker):
    broker = start_broker(POLICY)
    term = Terminal(DEVBROKER + ["--run-dir", str(broker.run_dir), "top", "-d", "0.3"])
    holders = []
    try:
        header = term.wait(lambda: next((line for line in term.lines()
                                          if line.startswith("devbroker top")), None),
                           "the header")
        assert f"pid {broker.proc.pid}" in header and "emulated backend" in header
        assert "2 tenants" in header and "0 alerts" in header
        assert term.wait(lambda: "TENANT" in "".join(term.lines()), "the column titles")
        alice = term.wait(lambda: term.row("alice"), "alice's row")
        assert "gpu0 0B/1GiB 0%" in alice
        # a process of alice's allocates 512 MiB and holds it
        p = broker.exec_popen("alice", *TENANT, "hold", "512MiB", stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
        holders.append(p)
        readline_json(p)
        alice = term.wait(lambda: (r := term.row("alice")) and "512MiB/1GiB 50%" in r and r,
                          "alice's 512 MiB on screen")
        procs, files = columns(alice)[1:3]
        assert (procs, files) == ("1", "2")  # nvidiactl + nvidia0 of one process

        # bob makes calls in a loop: its ioctl rate shows, alice's is 0.0
        loop = broker.exec_popen("bob", *TENANT, "nvml-loop", stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        holders.append(loop)
        readline_json(loop)

        def bob_rate():
            r = term.row("bob")
            rate = columns(r)[-3] if r else "-"
            return rate != "-" and float(rate) > 0 and float(rate)

        assert term.wait(bob_rate, "bob's ioctl rate") > 0
        assert columns(term.row("alice"))[-3] == "0.0"
        loop.stdin.write("stop\n")
        loop.stdin.flush()
        done = readline_json(loop)
        assert done["failed"] == 0

        # alice: three refused calls
        r = broker.exec("alice", *TENANT, "refusals")
        assert r.returncode == 0, r.stderr
        term.wait(lambda: (r := term.row("alice")) and columns(r)[-1] == "3",
                  "alice's 3 refusals")

        # alice passes 90 % of her quota: the alert appears under the table
        p = broker.exec_popen("alice", *TENANT, "hold", "448MiB", stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
        holders.append(p)
        readline_json(p)
        alert = term.wait(lambda: next((line for line in term.lines()
                                         if line.strip().startswith("quota:")), None),
                          "the quota alert")
        assert "tenant alice uses" in alert and "(93.8 %, threshold 90 %)" in alert
        assert "1 alerts" in term.lines()[0]
        assert "960MiB/1GiB 94%" in term.row("alice")

        term.type("q")
        assert term.proc.wait(timeout=10) == 0
    finally:
        for p in holders:
            p.kill()
            p.wait()
        term.close()


def test_top_says_when_the_broker_is_not_reachable(tmp_path):
    term = Terminal(DEVBROKER + ["--run-dir", str(tmp_path / "none"), "top", "-d", "0.2",
                                 "-n", "3"])
    try:
        line = term.wait(lambda: next((x for x in term.lines() if "not reachable" in x), None),
                         "the unreachable line")
        assert "no broker is listening" in line
        assert term.proc.wait(timeout=10) == 0  # -n 3: three refreshes, then out
    finally:
        term.close()
    r = subprocess.run(DEVBROKER + ["--run-dir", str(tmp_path / "none"), "top", "--once"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and "not reachable" in r.stdout
