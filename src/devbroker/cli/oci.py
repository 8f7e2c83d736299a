"""`devbroker cdi | oci-seccomp | oci-hook`: containers started by an OCI runtime (runc, crun,
podman) get a tenant's devices without `devbroker exec` (docs/containers.md)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from devbroker.cli.broker_cmds import ask_broker

FRONTEND_HELP = ("fuse: /dev/nvidia* are the broker's FUSE node files (bind mounts) and only "
                 "stat() goes through seccomp; seccomp: /dev/nvidia* are character nodes and "
                 "every open/ioctl/mmap of them goes to the broker through seccomp user "
                 "notification (what CUDA needs with the real backend). auto (default): "
                 "seccomp when the broker runs the real backend, else fuse")


def add_parsers(sub) -> None:
    p = sub.add_parser("cdi", help="write a CDI spec for the running broker's tenants "
                                   "(kind devbroker.io/gpu, one device per tenant)")
    p.add_argument("--frontend", choices=["auto", "fuse", "seccomp"], default="auto",
                   help=FRONTEND_HELP)
    p.add_argument("--output", "-o", metavar="FILE",
                   help="write here (e.g. /etc/cdi/devbroker.json) instead of stdout")
    p.add_argument("--tenant", action="append", default=[], metavar="NAME",
                   help="only this tenant's device (repeatable; default: every tenant). A "
                        "spec file per tenant is what a cluster's DRA driver writes")
    p.set_defaults(func=cmd_cdi)

    p = sub.add_parser("oci-seccomp", help="the linux.seccomp section that hands a "
                                           "container's seccomp listener to the broker")
    p.add_argument("--frontend", choices=["auto", "fuse", "seccomp"], default="auto",
                   help=FRONTEND_HELP)
    p.add_argument("--tenant", help="name the tenant in listenerMetadata (else: the "
                                    "devbroker.io/tenant annotation or a CDI device request)")
    p.add_argument("--tenant-from-cdi", action="store_true",
                   help="the tenant is the one whose CDI device the runtime applied to the "
                        "container (its oci-hook in the bundle's config.json): one section "
                        "for every container, e.g. a Kubernetes Localhost seccomp profile")
    p.add_argument("--flag", action="append", default=[], metavar="SECCOMP_FILTER_FLAG_…",
                   help="OCI seccomp flag to add, e.g. SECCOMP_FILTER_FLAG_WAIT_KILLABLE_RECV "
                        "(runtimes that know it; runc 1.1 and crun 1.8 do not)")
    p.add_argument("--config", metavar="CONFIG_JSON",
                   help="write the section into this config.json (sets noNewPrivileges, and "
                        "the devbroker.io/tenant annotation with --tenant) instead of printing")
    p.add_argument("--replace", action="store_true",
                   help="with --config: replace a seccomp section that is already there")
    p.set_defaults(func=cmd_oci_seccomp)

    p = sub.add_parser("oci-hook", help="createContainer hook (run by the runtime, state on "
                                        "stdin): the tenant's /proc/driver/nvidia, "
                                        "/proc/devices and /sys/module views")
    p.add_argument("--tenant", required=True)
    p.set_defaults(func=cmd_oci_hook)


def _frontend(args, what: str) -> str:
    if args.frontend != "auto":
        return args.frontend
    snap = ask_broker(args, f"{what}: --frontend auto asks the broker", {"op": "status"})
    return "seccomp" if snap.get("backend") == "real" else "fuse"


def hook_argv(run_dir: str) -> list[str]:
    """How the runtime runs `devbroker oci-hook`: this interpreter (absolute, so the runtime
    needs no PATH), the package as a module."""
    return [os.path.abspath(sys.executable), "-m", "devbroker.cli.main",
            "--run-dir", os.path.abspath(run_dir), "oci-hook"]


def cmd_cdi(args) -> int:
    from devbroker.daemon import RunPaths
    from devbroker.sandbox.statshim import proc_devices_view
    from devbroker.oci.cdi import TenantNodes, cdi_spec

    frontend = _frontend(args, "cdi")
    snap = ask_broker(args, "cdi", {"op": "status"})
    paths = RunPaths(Path(args.run_dir).resolve())
    tenants = []
    known = {t["name"] for t in snap["tenants"]}
    missing = [n for n in args.tenant if n not in known]
    if missing:
        print(f"devbroker cdi: no tenant {', '.join(map(repr, missing))} in the running broker",
              file=sys.stderr)
        return 1
    for t in snap["tenants"]:
        if args.tenant and t["name"] not in args.tenant:
            continue
        d = paths.tenant_dir(t["name"])
        try:
            nodes = tuple(sorted(os.listdir(d)))
        except OSError:
            continue  # revoked, or not served
        tenants.append(TenantNodes(t["name"], str(d), nodes))
    with open("/proc/devices") as f:
        _text, uvm = proc_devices_view(f.read())
    try:
        spec, skipped = cdi_spec(tenants, frontend=frontend, uvm_major=uvm,
                                 hook_argv=hook_argv(args.run_dir))
    except ValueError as e:
        print(f"devbroker cdi: {e}", file=sys.stderr)
        return 1
    for why in skipped:
        print(f"devbroker cdi: left out {why}", file=sys.stderr)
    text = json.dumps(spec, indent=2) + "\n"
    if args.output:
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.tmp")
        tmp.write_text(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, out)  # runtimes rescan spec dirs: never show them half a file
        print(f"devbroker cdi: {len(spec['devices'])} devices ({frontend}) written to {out}",
              file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def _kernel_ioctls(args) -> tuple[int, ...]:
    """The UVM numbers the named tenant's filter may let the kernel run unasked, as the
    running broker answers `devbroker exec` (rules.kernel_commands: real driver files and
    the tenant's capabilities only). Without --tenant, or without an answer, none: every
    NVIDIA-looking ioctl is notified, which is always safe, only slower."""
    if not args.tenant:
        return ()
    from devbroker.broker.control import ControlError, call
    from devbroker.daemon import RunPaths

    try:
        info = call(RunPaths(Path(args.run_dir)).control,
                    {"op": "tenant.dir", "tenant": args.tenant})
    except ControlError as e:
        print(f"devbroker oci-seccomp: no in-kernel rows (the broker did not answer: {e})",
              file=sys.stderr)
        return ()
    if not info.get("ok"):
        print(f"devbroker oci-seccomp: no in-kernel rows: {info.get('error')}", file=sys.stderr)
        return ()
    return tuple(int(c) for c in info.get("kernel_ioctls", ()))


def cmd_oci_seccomp(args) -> int:
    from devbroker.daemon import RunPaths
    from devbroker.oci.profile import seccomp_section
    from devbroker.oci.state import TENANT_ANNOTATION

    frontend = _frontend(args, "oci-seccomp")
    listener = str(RunPaths(Path(args.run_dir).resolve()).oci_seccomp)
    kernel = _kernel_ioctls(args) if frontend == "seccomp" else ()
    if args.tenant and args.tenant_from_cdi:
        print("devbroker oci-seccomp: --tenant or --tenant-from-cdi, not both", file=sys.stderr)
        return 1
    section = seccomp_section(frontend, listener, tenant=args.tenant, flags=args.flag,
                              kernel_ioctls=kernel, tenant_from_cdi=args.tenant_from_cdi)
    if not args.config:
        print(json.dumps(section, indent=2))
        return 0
    path = Path(args.config)
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        print(f"devbroker oci-seccomp: {path}: {e}", file=sys.stderr)
        return 1
    linux = config.setdefault("linux", {})
    if linux.get("seccomp") and not args.replace:
        print(f"devbroker oci-seccomp: {path} already has a seccomp section (--replace "
              "drops it: a runtime installs one section per container)", file=sys.stderr)
        return 1
    linux["seccomp"] = section
    # no_new_privs, as devbroker exec sets it: setuid binaries gain nothing under the filter.
    config.setdefault("process", {})["noNewPrivileges"] = True
    if args.tenant:
        config.setdefault("annotations", {})[TENANT_ANNOTATION] = args.tenant
    path.write_text(json.dumps(config, indent=2) + "\n")
    return 0


def cmd_oci_hook(args) -> int:
    from devbroker.daemon import RunPaths
    from devbroker.oci.hook import HookError, run_hook

    tenant_dir = RunPaths(Path(args.run_dir)).tenant_dir(args.tenant)
    try:
        run_hook(sys.stdin.read(), tenant_dir)
    except (HookError, OSError) as e:
        print(f"devbroker oci-hook: tenant {args.tenant}: {e}", file=sys.stderr)
        return 1
    return 0
