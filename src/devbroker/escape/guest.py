"""The escape tests inside the QEMU guest, against the kernel module's or CUSE's nodes.

    insmod kmod/devbroker.ko major=195 gpus=2        # or: modprobe cuse
    $GUEST_PYTHON -m devbroker.escape.guest --frontend kmod --dir $DBRUN/kmod [--no-flood] \
        [--attacks ID,ID...]

Runs the real broker core + emulated backend behind the front end
(``devbroker.testing.guest_broker serve`` with the policy below), the victim as uid 1001
(alice), the attacker as uid 1002 (bob) and the flooder as uid 1003 (mallory): tenants are
plain processes of those uids on the guest's one set of nodes (char 195:x), mapped to tenants
by ``tenant_by_uid``. Nothing is judged here: the attacker's JSON lines, the broker's ``deny``
audit records and the flood's evidence go out as ``GUEST-RESULT {json}`` lines, and the host
(``devbroker.escape.harness.run_guest_escape_tests``) judges them exactly as for FUSE.

The policy mirrors the host harness's (harness.POLICY): alice has GPUs 0 and 1 and holds
memory on both, bob has GPU 0 (shared with alice) with a 256 MiB quota, mallory GPU 0 with a
rate limit (25/s here: harness.GUEST_FLOOD_RATE says why); each pinned to its uid.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from devbroker.escape.harness import (ATTACKER, ATTACKER_QUOTA, ESCAPE_UUIDS, FLOODER,
                                      GUEST_CALLS_N, GUEST_FLOOD_N, GUEST_FLOOD_RATE, VICTIM,
                                      end_victim)
from devbroker.testing.policies import tenant, two_h200
from devbroker.testing.guest_broker import (REPO, TENANT_PY, TREE, BrokerProc, control_path,
                                            emit, tenant_env)

UIDS = {VICTIM: 1001, ATTACKER: 1002, FLOODER: 1003}
POLICY = ("# devbroker.escape.guest: the escape-test tenants, told apart by uid\n"
          + two_h200(tenant(VICTIM, gpus=[0, 1], memory_quota="1GiB", uids=[UIDS[VICTIM]]),
                     tenant(ATTACKER, gpus=[0], memory_quota=f"{ATTACKER_QUOTA >> 20}MiB",
                            uids=[UIDS[ATTACKER]]),
                     tenant(FLOODER, gpus=[0], memory_quota="64MiB",
                            rate_limit={"requests_per_second": GUEST_FLOOD_RATE, "burst": 10},
                            uids=[UIDS[FLOODER]]),
                     uuids=ESCAPE_UUIDS))
ATTACK_TIMEOUT = 420


def _tenant(*args: str) -> list[str]:
    return [TENANT_PY, "-m", "devbroker.escape.tenant", *args]


def _as(name: str) -> dict:
    uid = UIDS[name]
    return {"user": uid, "group": uid, "extra_groups": [], "cwd": str(TREE)}


def _lines(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def _deny_records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [r for r in _lines(path.read_text()) if r.get("event") == "deny"]


def leave_chroot() -> str:
    """Make this process (and its children) an ordinary, unchrooted one.

    The guest's init (scripts/qemu/init) chroots into the host root over 9p; the kernel
    refuses unprivileged user namespaces to a chrooted caller (EPERM), which would make the
    user-namespace attacks fail for a reason no real machine has. So: step out to the
    initramfs root (PID 1's), take a private mount namespace, mount the 9p root (recursively)
    on top of "/", and enter it through "/.." (a walk that crosses the mount on the root).
    Same files at the same paths, but now root of its mount namespace."""
    import ctypes

    try:
        here, init = os.stat("/"), os.stat("/proc/1/root/")
    except OSError as e:
        return f"not changed ({e})"
    if (here.st_dev, here.st_ino) == (init.st_dev, init.st_ino):
        return "not chrooted"
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_void_p]
    ms_bind, ms_rec, ms_private = 4096, 16384, 1 << 18
    os.chroot("/proc/1/root")  # the initramfs root: the mount namespace's root
    if libc.unshare(0x00020000) != 0:  # CLONE_NEWNS
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")
    if libc.mount(None, b"/", None, ms_rec | ms_private, None) != 0:
        raise OSError(ctypes.get_errno(), "mount --make-rprivate /")
    # where init mounted the 9p root (its /newroot): the directory that is our old root
    src = next((f"/{d}" for d in os.listdir("/") if os.path.isdir(f"/{d}")
                and (os.stat(f"/{d}").st_dev, os.stat(f"/{d}").st_ino)
                == (here.st_dev, here.st_ino)), None)
    if src is None:
        raise OSError("the chroot's directory is not at the top of the initramfs root")
    if libc.mount(src.encode(), b"/", None, ms_bind | ms_rec, None) != 0:
        raise OSError(ctypes.get_errno(), f"mount --rbind {src} /")
    os.chroot("/..")  # ".." at the root crosses into what is mounted on it
    os.chdir(str(REPO))
    if not Path(TENANT_PY).exists():
        raise OSError(f"after leaving the chroot {TENANT_PY} is missing")
    return "left the chroot"


def run(frontend: str, run_dir: Path, ids: list[str], flood: bool) -> int:
    run_dir.mkdir(parents=True, exist_ok=True)
    policy = run_dir / "policy.toml"
    policy.write_text(POLICY)
    b = BrokerProc(frontend, run_dir, policy)
    t0 = time.monotonic()
    try:
        emit("escape_broker_start", frontend=frontend, seconds=round(b.start(), 2))
    except RuntimeError as e:
        emit("escape_broker_start", frontend=frontend, error=str(e))
        return 1
    victim = None
    try:
        sock = f"devbroker-escape-{uuid.uuid4().hex[:12]}"
        victim = subprocess.Popen(_tenant("--victim", sock), stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env=tenant_env(), **_as(VICTIM))
        line = victim.stdout.readline()
        if not line:
            emit("escape_attacks", frontend=frontend, error="victim printed nothing: "
                 + victim.stderr.read()[-2000:])
            return 1
        vinfo = json.loads(line)
        vinfo["host_pid"] = vinfo["pid"]  # one pid namespace in the guest
        vinfo["tenant"] = VICTIM
        vinfo["uid"] = UIDS[VICTIM]
        ctx = {"frontend": frontend, "run_dir": "", "broker_pid": b.p.pid, "own_gpu": 0,
               "victim_gpu": 1, "quota": ATTACKER_QUOTA, "victim": vinfo,
               "control_sock": str(control_path(frontend)),
               "audit_log": str(run_dir / "audit.jsonl"), "victim_uid": UIDS[VICTIM]}
        env = dict(tenant_env(), DEVBROKER_ESCAPE_CTX=json.dumps(ctx))
        ta = time.monotonic()
        rc, out, err = 0, "", ""
        try:
            if ids:
                r = subprocess.run(_tenant(*ids), capture_output=True, text=True, env=env,
                                   timeout=ATTACK_TIMEOUT, **_as(ATTACKER))
                rc, out, err = r.returncode, r.stdout, r.stderr
        except subprocess.TimeoutExpired as e:
            rc, out, err = None, _s(e.stdout), "timeout\n" + _s(e.stderr)
        time.sleep(0.6)  # the last refusal's audit record lands within the judge's window
        emit("escape_attacks", frontend=frontend, rc=rc, results=_lines(out),
             stderr=err[-3000:], seconds=round(time.monotonic() - ta, 1),
             audit=_deny_records(run_dir / "audit.jsonl"))

        if flood:
            tf = time.monotonic()
            # Both start up first (seconds of Python in the guest): the victim waits with its
            # client open until the flood is under way, then makes its calls.
            calls = subprocess.Popen(_tenant("--calls", str(GUEST_CALLS_N), "--wait"),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=tenant_env(),
                                     **_as(VICTIM))
            ready = calls.stdout.readline()
            fl = subprocess.Popen(_tenant("--flood", str(GUEST_FLOOD_N)), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=tenant_env(),
                                  **_as(FLOODER))
            start = fl.stdout.readline()
            try:
                cout, cerr = calls.communicate("go\n", timeout=240)
            except subprocess.TimeoutExpired:
                calls.kill()
                cout, cerr = calls.communicate()
            try:
                rest, ferr = fl.communicate(timeout=240)
            except subprocess.TimeoutExpired:
                fl.kill()
                rest, ferr = fl.communicate()
            fdone = next((x for x in _lines(start + rest) if x.get("what") == "flood-done"),
                         None)
            cdone = next((x for x in _lines(ready + cout) if x.get("what") == "calls-done"),
                         None)
            fstart = next((x for x in _lines(start) if x.get("what") == "flood-start"), None)
            emit("escape_flood", frontend=frontend, flood_done=fdone, calls_done=cdone,
                 flood_start=fstart, status=b.status(), stderr=(ferr[-1000:] + cerr[-1000:]),
                 seconds=round(time.monotonic() - tf, 1))
    finally:
        end_victim(victim)
        rc_b = b.stop() if b.p.poll() is None else b.p.returncode
        emit("escape_broker_stop", frontend=frontend, rc=rc_b, log=b.tail()[-1500:],
             seconds=round(time.monotonic() - t0, 1))
    return 0


def _s(x) -> str:
    if x is None:
        return ""
    return x.decode(errors="replace") if isinstance(x, bytes) else x


def main(argv: list[str] | None = None) -> int:
    from devbroker.escape.attacks import ATTACKS

    ap = argparse.ArgumentParser(prog="python -m devbroker.escape.guest")
    ap.add_argument("--frontend", choices=["kmod", "cuse"], required=True)
    ap.add_argument("--dir", required=True, type=Path)
    ap.add_argument("--no-flood", action="store_true")
    ap.add_argument("--leave-chroot", action="store_true",
                    help="first undo the guest init's chroot (see leave_chroot)")
    ap.add_argument("--attacks", help="comma-separated attack ids (default: every one that "
                                      "applies to the front end; '' for none)")
    a = ap.parse_args(argv)
    if a.attacks is None:
        ids = [x.id for x in ATTACKS if a.frontend in x.frontends]
    else:
        ids = [x for x in a.attacks.split(",") if x]
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    if a.leave_chroot:
        print(f"guest: {leave_chroot()}", file=sys.stderr, flush=True)
    return run(a.frontend, a.dir, ids, not a.no_flood)


if __name__ == "__main__":
    sys.exit(main())
