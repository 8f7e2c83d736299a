"""A seccomp tenant of tests/test_uvm_policy.py: opens /dev/nvidia-uvm (a real driver file,
here a stand-in node), says so on stdout, and keeps it open until a line on stdin."""
from __future__ import annotations

import json
import os
import sys

fd = os.open("/dev/nvidia-uvm", os.O_RDWR)
print(json.dumps({"uvm": fd}), flush=True)
sys.stdin.readline()
os.close(fd)
print(json.dumps({"closed": True}), flush=True)
