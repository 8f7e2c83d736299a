"""Run one command in a QEMU/TCG guest that boots Debian's kernel with the host root.

The guest (scripts/qemu/init) mounts the host's / read-only over 9p, tmpfs on /tmp and /run,
a per-run directory read-write at the same absolute path, and the guest kernel's modules
(from the cache, never the host's /lib/modules) at /lib/modules/<kver>, then chroots and
runs the command with the repository as the working directory. Paths are the same inside
and out, so tests can hand files to the guest through the run directory; the checkout and
the cache stay visible even under /tmp. Guest programs run devbroker from the tenant tree
($DEVBROKER_TENANT_TREE, also on PYTHONPATH; devbroker.testing.tenant_tree), which every uid
can read: tenants run as other uids, and the checkout may be where they cannot (/root).

    kver = build()                           # fetch kernel, build kmod/, make initramfs
    r = run_in_guest("insmod kmod/devbroker.ko && ls /dev", timeout=120)
    r.status, r.output, r.dmesg, kernel_problems(r.dmesg)

Only the standard library is used: pytest runs this on the host.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
SCRIPTS = REPO / "scripts" / "qemu"
CACHE = Path(os.environ.get("DEVBROKER_QEMU_CACHE", REPO / ".cache" / "qemu"))
# Python for guest-side programs: a venv from Debian's /usr/bin/python3 (starts in ~0.5 s
# over 9p, unlike pyenv's) with trio and the repo's src/ on its path; made by setup.sh.
GUEST_VENV = CACHE / "venv-guest"
QEMU = "qemu-system-x86_64"


class GuestError(RuntimeError):
    pass


@dataclass
class GuestResult:
    status: int | None  # the command's exit status; None if the guest never reported one
    output: str  # the command's stdout and stderr, interleaved
    dmesg: str  # the guest kernel log after the command
    console: str  # the serial console (boot messages, panics)
    seconds: float  # wall time of the whole boot-run-poweroff


def guest_python() -> str:
    """The interpreter guest-side programs should use."""
    p = GUEST_VENV / "bin" / "python3"
    return str(p) if p.exists() else "/usr/bin/python3"


def qemu_available() -> bool:
    return shutil.which(QEMU) is not None


def build() -> str:
    """Fetch/unpack the guest kernel, build kmod/ and the initramfs; return the version."""
    p = subprocess.run(
        [str(SCRIPTS / "build-kernel.sh")], capture_output=True, text=True, timeout=900
    )
    if p.returncode != 0:
        raise GuestError(f"build-kernel.sh failed ({p.returncode}):\n{p.stderr[-4000:]}")
    m = re.search(r"^KVER=(\S+)$", p.stdout, re.M)
    if not m:
        raise GuestError(f"build-kernel.sh printed no KVER:\n{p.stdout[-2000:]}")
    return m.group(1)


def _kernel_dir(kver: str | None) -> Path:
    if kver:
        return CACHE / kver
    dirs = sorted(d for d in CACHE.glob("*") if (d / "vmlinux").exists())
    if not dirs:
        raise GuestError("no guest kernel built; run scripts/qemu/build-kernel.sh")
    return dirs[-1]


def _tenant_tree() -> Path | None:
    """The tenant tree for this checkout; None where it cannot be made (not root): guest
    programs then give tenants the checkout itself."""
    from devbroker.testing import tenant_tree

    try:
        return tenant_tree.ensure(REPO)
    except OSError:
        return None


def run_in_guest(
    cmd: str, timeout: float = 300, kver: str | None = None, files: dict[str, str] | None = None
) -> GuestResult:
    """Boot, run `cmd` (a /bin/sh script) from the repo root, power off.

    `files` are written into the run directory first; the script finds that directory in
    $DBRUN (it is writable there and readable here afterwards).
    """
    kdir = _kernel_dir(kver)
    kver = kdir.name
    tree = _tenant_tree()
    # Host directories the guest must see even where its tmpfs mounts cover them; parents
    # first (the cache is usually inside the checkout).
    keep = sorted({str(REPO), str(CACHE)} | ({str(tree)} if tree else set()), key=len)
    runs = CACHE / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    rundir = Path(tempfile.mkdtemp(prefix="run-", dir=runs))
    try:
        for name, text in (files or {}).items():
            (rundir / name).write_text(text)
        (rundir / "cmd.sh").write_text(
            f"export DBRUN={rundir} GUEST_PYTHON={guest_python()}\n"
            # devbroker itself from the tree too: children that drop to a tenant's uid
            # import the modules they use after the drop
            + (f"export DEVBROKER_TENANT_TREE={tree} PYTHONPATH={tree}/src\n" if tree else "")
            + f"cd {REPO}\n{cmd}\n"
        )
        append = " ".join(
            [
                "console=ttyS0",
                "panic=-1",
                "oops=panic" if os.environ.get("DEVBROKER_QEMU_OOPS_PANIC") else "",
                "loglevel=4",
                "rdinit=/init",
                f"dbrun={rundir}",
                f"dbklib={kdir}/root/lib",  # holds modules/<kver>
                f"dbkeep={':'.join(keep)}",
            ]
        )
        argv = [
            QEMU, "-M", "q35", "-accel", "tcg", "-cpu", "qemu64", "-smp", "2", "-m", "1G",
            "-nographic", "-no-reboot", "-monitor", "none", "-serial", "stdio",
            "-kernel", str(kdir / "vmlinux"), "-initrd", str(kdir / "initramfs.cpio.gz"),
            "-append", append,
            "-fsdev", "local,id=hostroot,path=/,security_model=none,readonly=on,multidevs=remap",
            "-device", "virtio-9p-pci,fsdev=hostroot,mount_tag=hostroot",
            "-fsdev", f"local,id=rundir,path={rundir},security_model=none,multidevs=remap",
            "-device", "virtio-9p-pci,fsdev=rundir,mount_tag=rundir",
        ]  # fmt: skip
        t0 = time.monotonic()
        try:
            p = subprocess.run(
                argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout
            )
            console = p.stdout.decode(errors="replace") + p.stderr.decode(errors="replace")
        except subprocess.TimeoutExpired as e:
            console = (e.stdout or b"").decode(errors="replace") + "\n[harness: timeout]\n"
        seconds = time.monotonic() - t0

        def read(name: str) -> str:
            f = rundir / name
            return f.read_text(errors="replace") if f.exists() else ""

        status_text = read("status").strip()
        return GuestResult(
            status=int(status_text) if status_text.isdigit() else None,
            output=read("output"),
            dmesg=read("dmesg"),
            console=console,
            seconds=seconds,
        )
    finally:
        if not os.environ.get("DEVBROKER_QEMU_KEEP"):
            shutil.rmtree(rundir, ignore_errors=True)


_PROBLEM = re.compile(
    r"WARNING:|BUG:|Oops|general protection|Call Trace|RIP:|kernel BUG|"
    r"refcount_t:|list_(add|del) corruption|INFO: task .* blocked|"
    r"possible circular locking|sleeping function called from invalid context|Kernel panic"
)


def kernel_problems(dmesg: str) -> list[str]:
    """dmesg lines that mean a kernel warning, bug or oops (empty when clean)."""
    return [line for line in dmesg.splitlines() if _PROBLEM.search(line)]
