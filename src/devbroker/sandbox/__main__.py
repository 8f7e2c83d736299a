"""python -m devbroker.sandbox --tenant-dir DIR [options] -- CMD ARGS...

The child interpreter run_in_sandbox starts; also usable by hand. Exit status: the
command's (128+N if killed by signal N), 125 if the sandbox failed, 126/127 if the command
could not be executed.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from devbroker.sandbox.sandbox import (
    EXIT_SETUP_FAILED, ROOT_CAPABILITIES, Bind, SandboxError, SandboxSpec, run_here,
)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def parse_args(argv: list[str]) -> SandboxSpec:
    ap = argparse.ArgumentParser(prog="python -m devbroker.sandbox")
    ap.add_argument("--tenant-dir", required=True, type=Path)
    ap.add_argument("--uid", type=int)
    ap.add_argument("--gid", type=int)
    ap.add_argument("--groups", type=_ints, default=())
    ap.add_argument("--cwd")
    ap.add_argument("--hide", action="append", type=Path, default=[])
    ap.add_argument("--readonly", action="append", type=Path, default=[])
    ap.add_argument("--caps", help="comma-separated capabilities kept when running as root")
    ap.add_argument("--driver-version")
    ap.add_argument("--pass-fd", action="append", type=int, default=[])
    ap.add_argument("--no-stat-shim", dest="stat_shim", action="store_false",
                    help="do not fake stat() of the node files as NVIDIA character devices")
    ap.add_argument("--frontend", choices=["fuse", "seccomp"], default="fuse")
    ap.add_argument("--seccomp-socket")
    ap.add_argument("--tenant")
    ap.add_argument("--kernel-ioctls", type=_ints, default=(),
                    help="seccomp front end: comma-separated UVM command numbers the kernel "
                    "runs without asking the broker (the broker's tenant.dir answer)")
    ap.add_argument("--report-socket",
                    help="the broker's control socket: refusals the sandbox makes are "
                    "written to its audit log")
    ap.add_argument("--bind", action="append", default=[], metavar="SRC[:DST][:ro|rw]",
                    help="show a host path (read-only unless :rw); repeatable")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    caps = frozenset(c for c in a.caps.split(",") if c) if a.caps is not None else ROOT_CAPABILITIES
    return SandboxSpec(tenant_dir=a.tenant_dir, argv=tuple(command), uid=a.uid, gid=a.gid,
                       groups=a.groups, cwd=a.cwd, hide=tuple(a.hide),
                       readonly=tuple(a.readonly), capabilities=caps,
                       driver_version=a.driver_version, pass_fds=tuple(a.pass_fd),
                       stat_shim=a.stat_shim, frontend=a.frontend,
                       seccomp_socket=a.seccomp_socket, tenant=a.tenant,
                       kernel_ioctls=tuple(a.kernel_ioctls), report_socket=a.report_socket,
                       binds=tuple(Bind.parse(b) for b in a.bind))


def main(argv: list[str] | None = None) -> int:
    try:
        spec = parse_args(sys.argv[1:] if argv is None else argv)
        return run_here(spec)
    except SandboxError as e:
        print(f"devbroker exec: {e}", file=sys.stderr)
        return EXIT_SETUP_FAILED


if __name__ == "__main__":
    sys.exit(main())
