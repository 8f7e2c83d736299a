"""`devbroker run | exec | status | policy | demo`."""
from __future__ import annotations

import argparse
import errno
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path


# The uid `devbroker exec` runs a command as when neither --uid nor sudo says otherwise.
NOBODY = 65534


def add_parsers(sub) -> None:
    p = sub.add_parser("run", help="run the broker in the foreground")
    p.add_argument("--policy", help="policy TOML file (default: the built-in example)")
    p.add_argument("--backend", choices=["emulated", "real"],
                   help="override the policy's backend (default: emulated)")
    p.add_argument("--audit", help="audit log path (default RUN_DIR/audit.log)")
    p.add_argument("--record", metavar="FILE",
                   help="write every relayed call to FILE in the nvtrace format")
    p.add_argument("--frontend", choices=["fuse", "seccomp", "kmod", "cuse"], default="fuse",
                   help="how tenants reach the broker: fuse (per-tenant nodes under "
                        "RUN_DIR/nodes; default), seccomp (no node file system: `devbroker "
                        "exec --frontend seccomp` and containers only), kmod (the kernel "
                        "module's /dev nodes) or cuse (CUSE /dev nodes); kmod and cuse tell "
                        "tenants apart by uid (policy key uids). The seccomp hand-over "
                        "socket is served with every front end")
    # Started by a running broker during `devbroker upgrade`, never by hand: FD is the
    # socket its predecessor hands the state and the file descriptors over on.
    p.add_argument("--takeover-fd", type=int, help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("upgrade", help="live upgrade: a new broker process (the code "
                                       "installed now) takes over from the running one "
                                       "without stopping tenants")
    p.add_argument("--python", help="interpreter the new broker runs with (default: the "
                                    "running broker's)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--timeout", type=float, default=180.0,
                   help="seconds to wait for the upgrade (default 180)")
    p.set_defaults(func=cmd_upgrade)

    p = sub.add_parser("exec", help="run a command as a tenant, in a sandbox whose "
                                    "/dev/nvidia* are the broker's nodes")
    p.add_argument("--tenant", required=True)
    p.add_argument("--uid", type=int,
                   help="run the command as this uid (default: the user who ran sudo, else "
                        f"{NOBODY}); --uid 0 for root, which still gets no CAP_SYS_ADMIN, "
                        "no host writes and no broker socket (docs/sandbox.md)")
    p.add_argument("--gid", type=int, help="run the command as this gid (default: the uid's)")
    p.add_argument("--bind", action="append", default=[], metavar="SRC[:DST][:ro|rw]",
                   help="show host path SRC at DST (default SRC) to the command, read-only "
                        "unless :rw; repeatable. The rest of the host file system is "
                        "read-only and /tmp is the command's own")
    p.add_argument("--cwd", help="directory to run the command in (default: the current one; "
                                 "it must be reachable by the command's uid)")
    p.add_argument("--no-stat-shim", dest="stat_shim", action="store_false",
                   help="do not make stat() report the node files as NVIDIA character "
                        "devices (seccomp user notification; see docs/sandbox.md)")
    p.add_argument("--frontend", choices=["auto", "fuse", "seccomp"], default="auto",
                   help="how the tenant reaches the broker: FUSE node files, or seccomp user "
                        "notification on real character nodes (what CUDA needs). auto "
                        "(default): seccomp when the broker runs the real backend, else fuse")
    p.add_argument("argv", nargs="+", metavar="CMD", help="command and arguments (after --)")
    p.set_defaults(func=cmd_exec)

    p = sub.add_parser("status", help="tenants, open files, memory used / quota")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_status)

    pol = sub.add_parser("policy", help="check, show or apply a policy").add_subparsers(
        dest="policy_cmd", metavar="ACTION")
    pol.required = True
    p = pol.add_parser("check", help="validate a policy file (exit 1 with line and reason)")
    p.add_argument("file")
    p.set_defaults(func=cmd_policy_check)
    p = pol.add_parser("show", help="show the running broker's policy (or FILE's)")
    p.add_argument("file", nargs="?")
    p.set_defaults(func=cmd_policy_show)
    p = pol.add_parser("apply", help="apply FILE to the running broker without a restart")
    p.add_argument("file")
    p.set_defaults(func=cmd_policy_apply)
    p = pol.add_parser("allowlist", help="print what tenants may do, and why (markdown)")
    p.set_defaults(func=cmd_policy_allowlist)

    p = sub.add_parser("demo", help="broker + FUSE nodes + emulated GPUs + tenants showing "
                                    "their view")
    p.add_argument("--keep", action="store_true", help="leave the broker running afterwards")
    p.set_defaults(func=cmd_demo)


def _paths(args):
    from devbroker.daemon import RunPaths

    return RunPaths(Path(args.run_dir))


def ask_broker(args, who: str, request: dict, timeout: float = 30.0) -> dict:
    """One control-socket request for a command: the broker's `ok` reply, or one line
    `devbroker WHO: why` on stderr and exit 1 (no broker, or the broker refused)."""
    from devbroker.broker.control import ControlError, call

    try:
        reply = call(_paths(args).control, request, timeout=timeout)
    except (ControlError, OSError) as e:
        reply = {"ok": False, "error": str(e) or type(e).__name__}
    if not reply.get("ok"):
        print(f"devbroker {who}: {reply.get('error', 'refused')}", file=sys.stderr)
        sys.exit(1)
    return reply


def _load_policy(path: str | None):
    from devbroker.broker.policy import default_policy, load_policy

    return load_policy(path) if path else default_policy()


def _require_root(what: str) -> None:
    if os.geteuid() != 0:
        sys.exit(f"devbroker {what}: needs root (FUSE mounts and namespaces); run it with sudo")


# --------------------------------------------------------------------------- run
def cmd_run(args) -> int:
    import trio

    from devbroker.broker.policy import PolicyError
    from devbroker.daemon import BrokerService, run_forever

    _require_root("run")
    if args.takeover_fd is not None:
        from devbroker.takeover import takeover_main

        return takeover_main(args.run_dir, args.takeover_fd)
    try:
        policy = _load_policy(args.policy)
    except PolicyError as e:
        print(f"devbroker run: {e}", file=sys.stderr)
        return 1
    busy = _run_dir_in_use(args.run_dir)
    if busy:
        print(f"devbroker run: {busy}", file=sys.stderr)
        return 1
    try:
        service = BrokerService(policy, args.run_dir, backend=args.backend, audit_path=args.audit,
                                record=args.record, policy_source=args.policy,
                                frontend=args.frontend)
    except (OSError, PolicyError) as e:  # e.g. --backend real on a host without the NVIDIA
        # driver; a saved runtime tenant (RUN_DIR/tenants.json) the policy no longer fits
        print(f"devbroker run: {e}", file=sys.stderr)
        return 1
    try:
        trio.run(run_forever, service)
    except (OSError, BaseExceptionGroup) as e:
        # A start-up failure the operator can act on (a mount point or socket path in use,
        # a full disk): one line, not trio's traceback of the nursery.
        first = _first_oserror(e)
        if first is None:
            raise
        where = f": {first.filename}" if first.filename else ""
        hint = ("; is another broker using it? Stop that one or give another --run-dir"
                if first.errno in (errno.EBUSY, errno.EADDRINUSE) else "")
        print(f"devbroker run: cannot serve {args.run_dir}: {first.strerror or first}{where}"
              f"{hint}", file=sys.stderr)
        return 1
    finally:
        # The real backend's relay, driver threads and private-node mount go with the broker
        # (unless a successor took them over).
        if not service.handed_over:
            service.backend.stop()
        service.audit.close()  # writes the summaries of rate-limited refusals
    return 0


def _first_oserror(e: BaseException) -> OSError | None:
    """The OSError e is, or the first one inside the exception groups e is."""
    if isinstance(e, OSError):
        return e
    if isinstance(e, BaseExceptionGroup):
        for sub in e.exceptions:
            found = _first_oserror(sub)
            if found is not None:
                return found
    return None


def _run_dir_in_use(run_dir: str) -> str | None:
    """Why a broker must not start on run_dir (another one answers on its control socket),
    else None."""
    from devbroker.broker.control import ControlError, call

    sock = _paths(argparse.Namespace(run_dir=run_dir)).control
    if not sock.exists():
        return None
    try:
        reply = call(sock, {"op": "status"}, timeout=5)
    except (ControlError, OSError, ValueError):
        return None  # a stale socket of a broker that died: the new one replaces it
    pid = reply.get("pid", "?")
    return (f"a broker (pid {pid}) is already running on {run_dir}; stop it first "
            f"(kill {pid}) or give this one another --run-dir")


# --------------------------------------------------------------------------- exec
def cmd_exec(args) -> int:
    from devbroker.broker.control import ControlError, call
    from devbroker.sandbox import Bind, SandboxError, exec_main

    _require_root("exec")
    argv = list(args.argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    try:  # mistakes in the command line first: no broker needed to report them
        binds = [Bind.parse(b) for b in args.bind]
        uid, gid = _tenant_ids(args, binds)
    except SandboxError as e:
        print(f"devbroker exec: {e}", file=sys.stderr)
        return 125
    try:
        info = call(_paths(args).control, {"op": "tenant.dir", "tenant": args.tenant})
    except ControlError as e:
        print(f"devbroker exec: {e}", file=sys.stderr)
        return 125
    if not info.get("ok"):
        print(f"devbroker exec: {info.get('error')}", file=sys.stderr)
        return 125
    # The run dir holds the control socket (root may apply policies through it) and the
    # audit log: a tenant must not reach either, so the sandbox covers it.
    frontend = args.frontend
    if frontend == "auto":
        frontend = "seccomp" if info.get("real_files") else "fuse"
    # The audit log may live outside the run dir (policy audit_log, --audit): hidden too.
    hide = [Path(args.run_dir)] + ([Path(info["audit"])] if info.get("audit") else [])
    try:
        return exec_main(Path(info["dir"]), argv, uid=uid, gid=gid, cwd=args.cwd,
                         hide=hide, stat_shim=args.stat_shim,
                         frontend=frontend, seccomp_socket=info.get("seccomp"),
                         tenant=args.tenant, binds=binds,
                         kernel_ioctls=info.get("kernel_ioctls", ()) if frontend == "seccomp"
                         else (), report_socket=str(_paths(args).control))
    except SandboxError as e:
        print(f"devbroker exec: cannot set up the sandbox: {e}", file=sys.stderr)
        return 125


def _tenant_ids(args, binds=()) -> tuple[int, int | None]:
    """Who the command runs as: --uid, else the user who ran `sudo devbroker exec`, else the
    owner of the directories bound writable (`--bind DIR:DIR:rw` as root: the command is
    there to write into DIR), else nobody — never root unless asked (a root tenant
    can take over the host). A writable bind that only root may write refuses to start, naming
    --uid, rather than run a command that fails at its first write."""
    if args.uid is not None:
        return args.uid, args.gid
    sudo_uid, sudo_gid = os.environ.get("SUDO_UID", ""), os.environ.get("SUDO_GID", "")
    if sudo_uid.isdigit() and int(sudo_uid) != 0:
        return int(sudo_uid), (args.gid if args.gid is not None
                               else int(sudo_gid) if sudo_gid.isdigit() else None)
    owner = _writable_binds_owner(binds)
    if owner is not None:
        return owner[0], args.gid if args.gid is not None else owner[1]
    return NOBODY, args.gid if args.gid is not None else NOBODY


def _writable_binds_owner(binds) -> tuple[int, int] | None:
    """(uid, gid) of the one non-root owner of the writable binds' sources (those anyone may
    write left aside); None when there are none. SandboxError, naming --uid, when root owns
    them or their owners differ."""
    from devbroker.sandbox import SandboxError

    owners: dict[tuple[int, int], str] = {}
    for b in binds:
        if not b.writable:
            continue
        try:
            st = os.stat(b.src)
        except OSError:
            continue  # the sandbox reports a missing source itself
        if st.st_mode & 0o002:  # anyone may write there: nobody too
            continue
        owners.setdefault((st.st_uid, st.st_gid), b.text())
    if not owners:
        return None
    uids = {uid for uid, _ in owners}
    if len(uids) == 1 and 0 not in uids:
        return next(iter(owners))
    bind = next(iter(owners.values()))
    if uids == {0}:
        src = bind.split(":")[0]
        raise SandboxError(f"--bind {bind}: {src} is root's, and the command would run as "
                           f"nobody (uid {NOBODY}), which may not write there; add --uid 0 to "
                           "run it as root (without capabilities), or --uid UID of a user who "
                           "may write there (docs/sandbox.md)")
    mixed = ", ".join(f"{b.split(':')[0]}: uid {u}" for (u, _), b in owners.items())
    raise SandboxError(f"the writable --bind directories have different owners ({mixed}); "
                       "choose the uid the command runs as with --uid")


# --------------------------------------------------------------------------- status
def cmd_status(args) -> int:
    snap = ask_broker(args, "status", {"op": "status"})
    if args.json:
        print(json.dumps(snap, indent=2))
        return 0
    print(f"backend {snap['backend']} (driver {snap['driver']}), nodes {snap['mount']}, "
          f"policy {snap['policy']}")
    print(f"{'TENANT':<12} {'GPUS':<8} {'FILES':>5} {'PROCS':>5} {'OBJS':>5} "
          f"{'MEMORY USED / QUOTA':<32} {'REQS':>7} {'DENIED':>6}  {'GPU SHARE, PRIORITY'}")
    for t in snap["tenants"]:
        mem = ", ".join(f"gpu{g}: {_human(m['used'])} / {_human(m['quota'])}"
                        for g, m in t["memory"].items()) or "-"
        # Memory still held on a GPU a policy change took away.
        revoked = ", ".join(f"gpu{g}: {_human(n)} REVOKED"
                            for g, n in t.get("revoked_memory", {}).items())
        mem = f"{mem}, {revoked}" if revoked else mem
        # of the used memory, managed (nvidia-uvm) ranges; pinned host memory / its limit
        if t.get("managed_memory"):
            mem += f" (managed {_human(t['managed_memory'])})"
        pinned = t.get("pinned_host_memory") or {}
        if pinned.get("used"):
            mem += f", pinned host {_human(pinned['used'])} / {_human(pinned['limit'])}"
        print(f"{t['name']:<12} {','.join(map(str, t['gpus'])) or '-':<8} {t['open_files']:>5} "
              f"{len(t['processes']):>5} {t['objects']:>5} {mem:<32} {t['requests']:>7} "
              f"{t['refusals']:>6}  {_share(t)}")
    lanes = [(name, snap[key]) for name, key in (("control lane", "control_lane"),
                                                  ("continue lane", "continue_lane"))
             if key in snap]
    if lanes:  # broker/fastlane.py: calls decided in a few lookups, and those sent on
        print("; ".join(f"{name}: {c['admitted']} calls"
                        + (f" ({c['allocations']} allocations)" if c.get("allocations") else "")
                        + (f", {c['settled']} of them settled" if c.get("settled") else "")
                        + f", {c['declined']} sent the general way" for name, c in lanes))
    qw = snap.get("quota_watch")
    if qw:  # broker/quotawatch.py: the driver's own accounting against the books
        print(f"quota watch: {qw['watching']} processes watched, {qw['looks']} looks at the "
              f"driver's accounting, {qw['killed']} processes killed")
    listeners = snap.get("seccomp") or []
    if listeners:  # frontends/nativelane.py: which loop answers each tenant process tree
        print("seccomp listeners: " + ", ".join(
            f"{x['tenant']} ({x.get('loop', 'python')} loop, {x.get('notifications', 0)} "
            f"notifications, {x.get('native_answered', 0)} answered in C)" for x in listeners))
    return 0


def _share(t: dict) -> str:
    """Each GPU's share of time when every tenant there is busy (the weight), and
    the priority."""
    c = t.get("compute")
    if not c:
        return "-"
    shares = ", ".join(f"gpu{g}: {100 * f:.0f}%" for g, f in c["share"].items()) or "-"
    # A low tenant preempted by a high one holding a context there (compute.preempt_all)
    stopped = ", ".join(f"gpu{g}: {n} channel(s)" for g, n in c.get("stopped", {}).items())
    # Weighted turns (turns.py): on each GPU where the tenant takes turns, whose turn it is
    turns = ", ".join(f"gpu{g}: {state}" for g, state in c.get("turns", {}).items())
    # Priority preemption (broker/preemption.py): its GPU state in host memory
    pre = (f"; PREEMPTED ({t['preempted']})" if t.get("preempted")
           else "; preemptible" if t.get("preemptible") else "")
    return (f"{shares} (weight {c['weight']}), {c['priority']}{pre}"
            + (f"; STOPPED for a high-priority tenant ({stopped})" if "stopped" in c else "")
            + (f"; turns ({turns})" if turns else ""))


def _human(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.4g} {unit}"
    return f"{n} B"


# --------------------------------------------------------------------------- upgrade
def cmd_upgrade(args) -> int:
    req = {"op": "upgrade"}
    if args.python:
        req["python"] = args.python
    reply = ask_broker(args, "upgrade", req, timeout=args.timeout)
    if args.json:
        print(json.dumps(reply))
    else:
        pause = reply.get("pause_ms")
        print(f"broker pid {reply['pid']} took over from pid {reply['old_pid']} "
              f"({reply['sessions']} open files; tenants' calls paused "
              f"{'%.1f ms' % pause if pause is not None else 'an unknown time'})")
    return 0


# --------------------------------------------------------------------------- policy
def cmd_policy_check(args) -> int:
    from devbroker.broker.policy import PolicyError, load_policy

    try:
        policy = load_policy(args.file)
    except PolicyError as e:
        print(f"devbroker policy check: {e}", file=sys.stderr)
        return 1
    print(f"{args.file}: OK ({len(policy.tenants)} tenants: {', '.join(sorted(policy.tenants))})")
    return 0


def cmd_policy_show(args) -> int:
    from devbroker.broker.policy import PolicyError, load_policy

    if args.file:
        try:
            print(load_policy(args.file).describe())
        except PolicyError as e:
            print(f"devbroker policy show: {e}", file=sys.stderr)
            return 1
        return 0
    reply = ask_broker(args, "policy show", {"op": "policy.show"})
    print(f"# running policy, from {reply['source']}")
    if reply.get("runtime_tenants"):  # not the file's: `devbroker tenant list` shows them
        print(f"# and runtime tenants: {', '.join(reply['runtime_tenants'])}")
    print(reply["text"])
    return 0


def cmd_policy_apply(args) -> int:
    try:
        text = Path(args.file).read_text()
    except OSError as e:
        print(f"devbroker policy apply: {args.file}: {e.strerror}", file=sys.stderr)
        return 1
    reply = ask_broker(args, "policy apply",
                       {"op": "policy.apply", "text": text, "name": args.file})
    print(f"applied {args.file}: tenants {', '.join(reply['tenants'])}")
    return 0


def cmd_policy_allowlist(args) -> int:
    from devbroker.broker.allowdoc import allowlist_markdown

    print(allowlist_markdown())
    return 0


# --------------------------------------------------------------------------- demo
def cmd_demo(args) -> int:
    """Start a broker on the built-in example, show each tenant's view, stop it."""
    _require_root("demo")
    me = [sys.executable, "-m", "devbroker.cli.main", "--run-dir", args.run_dir]
    paths = _paths(args)
    print(f"== starting the broker (emulated GPUs, FUSE nodes under {paths.mount})", flush=True)
    broker = subprocess.Popen(me + ["run"], stdin=subprocess.DEVNULL)
    try:
        if not _wait_for_socket(paths.control, broker):
            print("devbroker demo: the broker did not start", file=sys.stderr)
            return 1
        subprocess.run(me + ["status"], check=False)
        for tenant in _demo_tenants(paths):
            print(f"\n== tenant {tenant}: what it sees through devbroker", flush=True)
            for opts, cmd in _demo_commands():
                print(f"$ devbroker exec --tenant {tenant} {' '.join(opts)}{' ' if opts else ''}"
                      f"-- {' '.join(cmd)}", flush=True)
                # In / : the demo's own directory (the checkout, perhaps under /tmp or a
                # 0700 home) is none of the tenant's business.
                subprocess.run(me + ["exec", "--tenant", tenant, *opts, "--"] + cmd,
                               check=False, cwd="/")
        print("\n== broker status after the tenants ran", flush=True)
        subprocess.run(me + ["status"], check=False)
        print(f"\n== audit log ({paths.audit}), last lines", flush=True)
        try:
            for line in paths.audit.read_text().splitlines()[-6:]:
                print(line)
        except OSError:
            pass
        if shutil.which("nvidia-smi"):
            print(DEMO_REFUSALS_NOTE, flush=True)
        if args.keep:
            print(f"\nbroker left running (pid {broker.pid}); stop it with kill {broker.pid}")
            return 0
    finally:
        if not args.keep:
            broker.terminate()
            try:
                broker.wait(timeout=20)
            except subprocess.TimeoutExpired:
                broker.kill()
    return 0


# What the DENIED column and the "deny" lines of the demo are: they surprise a first reader.
DEMO_REFUSALS_NOTE = """
The refusals above are expected: nvidia-smi tries, in every run, a few classes and controls a
tenant may not use (display, diagnostics, power management). They are not on the allowlist:
the broker refuses each with an audit line, and nvidia-smi shows what it can without them.
`devbroker policy allowlist` says what a tenant may do, and why."""


def _wait_for_socket(path: Path, proc: subprocess.Popen, timeout: float = 60) -> bool:
    from devbroker.broker.control import ControlError, call

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            if call(path, {"op": "status"}, timeout=2).get("ok"):
                return True
        except (ControlError, OSError):
            pass
        time.sleep(0.1)
    return False


def _demo_tenants(paths) -> list[str]:
    from devbroker.broker.control import call

    snap = call(paths.control, {"op": "status"})
    return [t["name"] for t in snap["tenants"]]


def _demo_commands() -> list[tuple[list[str], list[str]]]:
    """(exec options, command). nvidia-smi runs as exec's default uid (nobody); the probe is
    this interpreter, which may live where only root can go (a venv under /root), so it runs
    as root — and with the checkout bound in when it is under /tmp (the tenant's /tmp is
    its own)."""
    from devbroker.testing.tenant_binds import bind_args

    cmds = []
    if shutil.which("nvidia-smi"):
        cmds.append(([], ["nvidia-smi"]))
    cmds.append((["--uid", "0", *bind_args()],
                 [sys.executable, "-m", "devbroker.tools.probe", "--alloc", "1GiB"]))
    return cmds
