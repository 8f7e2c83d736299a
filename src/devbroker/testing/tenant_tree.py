"""The project files that tenant programs running as other uids need, where any uid can
read them.

Tests run tenants as non-root uids (the sandbox's ``--uid``, the QEMU guest's alice and bob).
Those need the ``devbroker`` package, ``tests/tenant_prog.py`` and a working directory, but
the checkout may sit where they cannot go (a clone under ``/root``, mode 0700), and its modes
are the user's business, not the tests'. So the harness copies what they need here:

    tree = tenant_tree.ensure()      # /var/lib/devbroker-test/tree-<digest>
    tree / "src"                     # PYTHONPATH for tenants (the devbroker package)
    tree / "tests" / "tenant_prog.py"

Made by the test harness (root): directories 0755, files 0644 whatever the umask, under a
0755 root-owned base. The name is a digest of the content, so concurrent runs (or several
checkouts with the same files) share one tree, a changed file gives a new one, and a tree is
never changed once made. Trees not used for a day are removed. The QEMU guest sees it at the
same path (``/var/lib`` is not under the guest's tmpfs mounts); devbroker.testing.qemu tells
guest programs where it is in ``$DEVBROKER_TENANT_TREE``.

Only the standard library is used (pytest imports this on the host).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
BASE = Path(os.environ.get("DEVBROKER_TENANT_BASE", "/var/lib/devbroker-test"))
# Besides the package: programs that tests start as tenants.
PROGRAMS = ("tests/tenant_prog.py", "tests/nvml_script.py")
UNUSED_FOR = 24 * 3600  # seconds before another run removes a tree


def _contents(repo: Path) -> list[tuple[str, bytes]]:
    pkg = repo / "src" / "devbroker"
    paths = [p for p in sorted(pkg.rglob("*"))
             if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"]
    out = [(str(p.relative_to(repo)), p.read_bytes()) for p in paths]
    return out + [(rel, (repo / rel).read_bytes()) for rel in PROGRAMS if (repo / rel).exists()]


def _digest(contents: list[tuple[str, bytes]]) -> str:
    h = hashlib.sha256()
    for rel, data in contents:
        h.update(f"{rel}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()[:16]


def _base(base: Path) -> None:
    base.mkdir(mode=0o755, parents=True, exist_ok=True)
    st = os.lstat(base)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise OSError(f"{base}: expected a directory of uid {os.geteuid()} that no one else "
                      f"can write (found mode {stat.filemode(st.st_mode)}, uid {st.st_uid})")
    os.chmod(base, 0o755)  # the umask may have made it narrower


def ensure(repo: Path = REPO, base: Path = BASE) -> Path:
    """The tree for ``repo``'s current files: made if missing, marked used; returns its path."""
    contents = _contents(repo)
    _base(base)
    tree = base / f"tree-{_digest(contents)}"
    if not tree.is_dir():
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=base))
        try:
            for rel, data in contents:
                dst = tmp / rel
                dst.parent.mkdir(parents=True, exist_ok=True)
                dst.write_bytes(data)
                os.chmod(dst, 0o644)
            for d, _, _ in os.walk(tmp):
                os.chmod(d, 0o755)
            os.rename(tmp, tree)  # atomic: nobody sees a half-made tree
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not tree.is_dir():  # else another run made the same tree meanwhile
                raise
    os.utime(tree)
    _prune(base, tree)
    return tree


def _prune(base: Path, keep: Path) -> None:
    old = time.time() - UNUSED_FOR
    for d in base.iterdir():
        if d != keep and d.name.startswith(("tree-", ".tmp-")):
            try:
                if d.lstat().st_mtime < old:
                    shutil.rmtree(d)
            except OSError:
                pass


if __name__ == "__main__":
    print(ensure())
