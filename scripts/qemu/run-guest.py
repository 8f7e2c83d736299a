#!/usr/bin/env python3
"""Boot the guest and run one shell command: scripts/qemu/run-guest.py 'uname -a'.

Prints the command's output, then the guest dmesg (with --dmesg), and exits with the
command's status (125 when the guest reported none). See devbroker.testing.qemu.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
from devbroker.testing.qemu import build, kernel_problems, run_in_guest  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("command")
ap.add_argument("--timeout", type=float, default=300)
ap.add_argument("--build", action="store_true", help="run build-kernel.sh first")
ap.add_argument("--dmesg", action="store_true")
ap.add_argument("--console", action="store_true")
a = ap.parse_args()
kver = build() if a.build else None
r = run_in_guest(a.command, timeout=a.timeout, kver=kver)
sys.stdout.write(r.output)
if a.console or r.status is None:
    sys.stdout.write("---- console ----\n" + r.console)
if a.dmesg:
    sys.stdout.write("---- dmesg ----\n" + r.dmesg)
for line in kernel_problems(r.dmesg):
    print("KERNEL PROBLEM:", line, file=sys.stderr)
print(f"[guest: status {r.status}, {r.seconds:.1f} s]", file=sys.stderr)
sys.exit(125 if r.status is None else r.status)
