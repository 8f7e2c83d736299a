"""The brokers on this host, as far as a sandbox must hide them.

A tenant must reach no broker's run directory (control socket, hand-over sockets, audit log,
the real backend's private device nodes), whichever broker it belongs to and whichever front
end that broker serves; root in a tenant passes file modes, so only what its mount namespace
shows counts. A broker with the FUSE front end shows up in mountinfo (its node mount), but one
with the seccomp front end mounts nothing. So each running broker writes down where its files
are (`register`, one small JSON file per broker process under `REGISTRY`, which is itself
under the default run directory's prefix), and the sandbox covers (`paths_to_hide`):

* every directory named ``/run/devbroker*`` (the default run dir and its usual siblings, the
  registry among them);
* each registered broker's run directory;
* each registered broker's audit log where it lives outside its run directory: the log's
  directory, so that the rotated files (``audit.log.1`` …) are covered with the live one and
  stay covered across rotations — a cover on a file is dropped by the kernel when the host
  renames that file, which rotation does. A log kept in a directory every program needs
  (``/``, ``/var/log``, ``/tmp`` …, `SHARED_DIRS`) or beside other files cannot be covered
  whole; there the live file and the rotated files that exist are covered, which holds only
  until the next rotation (the broker says so at start: give the audit log a directory of
  its own).

Standard library only: it is loaded into every ``devbroker exec``.
"""
from __future__ import annotations

import glob
import json
import os
from pathlib import Path

REGISTRY = Path("/run/devbroker-brokers")
RUN_DIR_GLOB = "/run/devbroker*"
ROTATED_KEEP = 9  # rotated audit files looked for beside a log in a shared directory

# Directories every program may need: a cover over one of these would break the tenant.
SHARED_DIRS = frozenset({
    "/", "/bin", "/boot", "/etc", "/home", "/lib", "/lib64", "/media", "/mnt", "/opt",
    "/root", "/run", "/sbin", "/srv", "/tmp", "/usr", "/var", "/var/lib", "/var/log",
    "/var/tmp", "/var/cache", "/var/run", "/dev", "/proc", "/sys",
})


def register(run_dir: str | os.PathLike[str], audit: str | os.PathLike[str] | None,
             registry: Path = REGISTRY) -> Path:
    """Write down this broker process's run dir and audit log; returns the entry (for
    `unregister`). Entries of processes that are gone are removed on the way."""
    registry.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(registry, 0o700)
    for old in registry.glob("*.json"):
        try:
            if not os.path.exists(f"/proc/{int(old.stem)}"):
                old.unlink()
        except (ValueError, OSError):
            pass
    entry = registry / f"{os.getpid()}.json"
    tmp = registry / f".{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"run_dir": str(Path(run_dir).resolve()),
                   "audit": str(Path(audit).resolve()) if audit else None}, f)
    os.replace(tmp, entry)
    return entry


def unregister(entry: Path) -> None:
    try:
        entry.unlink()
    except FileNotFoundError:
        pass


def audit_outside(run_dir: str | os.PathLike[str], audit: str | os.PathLike[str]) -> bool:
    """Whether the audit log lives outside the run dir (which is covered whole anyway)."""
    run = os.path.abspath(run_dir).rstrip("/") + "/"
    return not os.path.abspath(audit).startswith(run)


def audit_dir_is_shared(audit: str | os.PathLike[str]) -> bool:
    """Whether the audit log's directory is one a sandbox cannot cover whole: a directory
    every program needs, or one that holds anything but the log and its rotated files (a
    cover would take those from the tenant too: a home, a project it binds in)."""
    path = os.path.abspath(audit)
    parent, name = os.path.split(path)
    if parent in SHARED_DIRS:
        return True
    try:
        entries = os.listdir(parent)
    except OSError:
        return False  # (not there yet: made by the broker for its log alone)
    return any(e != name and not (e.startswith(name + ".") and e[len(name) + 1:].isdigit())
               for e in entries)


def audit_paths(audit: str | os.PathLike[str]) -> list[str]:
    """What hides an audit log with its rotated files: its directory, or (in a directory
    shared with other files) the live file and the rotated ones that exist now."""
    path = os.path.abspath(audit)
    if not audit_dir_is_shared(path):
        return [os.path.dirname(path)]
    return [path] + [f"{path}.{i}" for i in range(1, ROTATED_KEEP + 1)
                     if os.path.exists(f"{path}.{i}")]


def paths_to_hide(registry: Path = REGISTRY) -> list[str]:
    """Every broker file location this host's registry and naming convention tell of, as
    the host sees them (existing or not; the sandbox covers those that exist)."""
    out = sorted(p for p in glob.glob(RUN_DIR_GLOB) if os.path.isdir(p))
    try:
        entries = sorted(registry.glob("*.json"))
    except OSError:
        entries = []
    for entry in entries:
        try:
            d = json.loads(entry.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(d, dict):
            continue
        run_dir, audit = d.get("run_dir"), d.get("audit")
        if isinstance(run_dir, str):
            out.append(run_dir)
        if isinstance(audit, str) and not (isinstance(run_dir, str)
                                           and not audit_outside(run_dir, audit)):
            out.extend(audit_paths(audit))
    # (a run dir named as a directory every program needs would take the tenant's view away)
    return [p for p in out if os.path.abspath(p) not in SHARED_DIRS]
