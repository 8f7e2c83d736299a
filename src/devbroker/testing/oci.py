"""Real OCI runtimes for the tests and the escape harness: bundles, a CDI applier, runc, crun.

* :func:`make_bundle` - an OCI bundle whose root file system is built from the host's own
  ``/usr`` and ``/etc`` (read-only binds; Debian 12 has merged ``/usr``, so ``/bin`` and
  ``/lib*`` are symlinks into it): Debian's nvidia-smi and ``/usr/bin/python3`` run in it with
  no image to download. The config is runc's ``runc spec`` default (capabilities AUDIT_WRITE,
  KILL, NET_BIND_SERVICE; masked and read-only /proc paths; a fresh /dev) with
  ``noNewPrivileges``, no network namespace (the escape tests' victim hands out fds over an
  abstract unix socket) and the project's tenant tree at ``/opt/devbroker``.
* :func:`apply_cdi` - runc and crun do not read CDI (podman and CRI runtimes do, and podman
  does not run on this host: docs/containers.md). No CDI tool is packaged for Debian 12 or
  PyPI, so this applies a CDI spec to a config.json the way the reference implementation
  (container-device-interface, pkg/cdi/container-edits.go) does: validation of kind, names and
  edits; ``env`` appended (a variable set twice keeps the last value); ``deviceNodes`` to
  ``linux.devices`` plus a device-cgroup rule with the node's ``permissions`` (empty = rwm);
  ``mounts`` replacing a mount at the same container path, then sorted so that parents are
  mounted before children; ``hooks`` appended to ``hooks.<hookName>``.
* :class:`Runtime` - ``runc`` or ``crun`` from Debian with a private state directory.
  crun 1.8 refuses this host's hybrid cgroups ("cgroups in hybrid mode not supported"):
  an empty cgroup2 mount at /sys/fs/cgroup/unified next to the v1 controllers. It is run in
  a mount namespace of its own where that mount is gone, which crun then treats as cgroup v1
  (the host is untouched).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

CDI_VERSIONS = ("0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0")
_KIND = re.compile(r"^[a-z0-9]([a-z0-9.-]*[a-z0-9])?/[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?$")
_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?$")
_HOOKS = {"prestart", "createRuntime", "createContainer", "startContainer", "poststart",
          "poststop"}
PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class CDIError(ValueError):
    pass


# --------------------------------------------------------------------------- CDI
def validate_cdi(spec: dict) -> None:
    if spec.get("cdiVersion") not in CDI_VERSIONS:
        raise CDIError(f"cdiVersion {spec.get('cdiVersion')!r}")
    if not _KIND.match(spec.get("kind", "")):
        raise CDIError(f"kind {spec.get('kind')!r}")
    devices = spec.get("devices")
    if not devices:
        raise CDIError("a spec needs at least one device")
    known = {"cdiVersion", "kind", "devices", "containerEdits", "annotations"}
    if set(spec) - known:
        raise CDIError(f"unknown fields {sorted(set(spec) - known)}")
    seen = set()
    for d in devices:
        if not _NAME.match(d.get("name", "")) or d["name"] in seen:
            raise CDIError(f"device name {d.get('name')!r}")
        seen.add(d["name"])
        _validate_edits(d.get("containerEdits") or {}, device=True)
    _validate_edits(spec.get("containerEdits") or {}, device=False)


def _validate_edits(e: dict, *, device: bool) -> None:
    known = {"env", "deviceNodes", "mounts", "hooks", "intelRdt", "additionalGids",
             "netDevices"}
    if set(e) - known:
        raise CDIError(f"unknown containerEdits fields {sorted(set(e) - known)}")
    if device and not e:
        raise CDIError("a device needs container edits")
    for v in e.get("env", []):
        if "=" not in v or v.startswith("="):
            raise CDIError(f"env {v!r}")
    for n in e.get("deviceNodes", []):
        if not n.get("path"):
            raise CDIError("device node without a path")
        if n.get("type", "") not in ("", "b", "c", "u", "p"):
            raise CDIError(f"device node type {n.get('type')!r}")
        perms = n.get("permissions", "")
        if perms not in ("", "none") and perms.strip("rwm"):
            raise CDIError(f"device node permissions {perms!r}")
    for m in e.get("mounts", []):
        if not m.get("hostPath") or not m.get("containerPath"):
            raise CDIError(f"mount {m}")
    for h in e.get("hooks", []):
        if h.get("hookName") not in _HOOKS or not str(h.get("path", "")).startswith("/"):
            raise CDIError(f"hook {h}")


def _device_info(path: str) -> tuple[str, int, int, int] | None:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    import stat as _st

    kind = ("c" if _st.S_ISCHR(st.st_mode) else "b" if _st.S_ISBLK(st.st_mode)
            else "p" if _st.S_ISFIFO(st.st_mode) else None)
    if kind is None:
        return None
    return kind, os.major(st.st_rdev), os.minor(st.st_rdev), st.st_mode & 0o7777


def _apply_edits(config: dict, e: dict) -> None:
    process = config.setdefault("process", {})
    env = process.setdefault("env", [])
    for v in e.get("env", []):
        key = v.split("=", 1)[0] + "="
        env[:] = [x for x in env if not x.startswith(key)] + [v]
    linux = config.setdefault("linux", {})
    for n in e.get("deviceNodes", []):
        n = dict(n)
        host = n.get("hostPath") or n["path"]
        minimal = n.get("type") and (n.get("major") or n.get("type") == "p")
        info = _device_info(host)
        if info is None and not minimal:
            raise CDIError(f"CDI host device {host!r} is not a device node")
        if info is not None:
            kind, major, minor, mode = info
            n.setdefault("type", kind)
            if not n.get("major"):
                n["major"], n["minor"] = major, minor
            n.setdefault("fileMode", mode)
        dev = {"path": n["path"], "type": n["type"], "major": n.get("major", 0),
               "minor": n.get("minor", 0)}
        for k in ("fileMode", "uid", "gid"):
            if k in n:
                dev[k] = n[k]
        devs = linux.setdefault("devices", [])
        devs[:] = [d for d in devs if d["path"] != dev["path"]] + [dev]
        if dev["type"] in ("b", "c"):
            access = n.get("permissions", "")
            access = {"": "rwm", "none": ""}.get(access, access)
            rules = linux.setdefault("resources", {}).setdefault("devices", [])
            rules.append({"allow": True, "type": dev["type"], "major": dev["major"],
                          "minor": dev["minor"], "access": access})
    mounts = config.setdefault("mounts", [])
    for m in e.get("mounts", []):
        mounts[:] = [x for x in mounts if x["destination"] != m["containerPath"]]
        oci = {"destination": m["containerPath"], "source": m["hostPath"],
               "options": list(m.get("options", []))}
        if m.get("type"):
            oci["type"] = m["type"]
        mounts.append(oci)
    if e.get("mounts"):
        # stable, by depth: /dev before /dev/nvidiactl whatever order they came in
        mounts.sort(key=lambda x: len(Path(x["destination"]).parts))
    hooks = config.setdefault("hooks", {})
    for h in e.get("hooks", []):
        oci = {"path": h["path"]}
        for k in ("args", "env", "timeout"):
            if k in h:
                oci[k] = h[k]
        hooks.setdefault(h["hookName"], []).append(oci)


def apply_cdi(config: dict, spec: dict, devices: list[str]) -> dict:
    """Inject the named devices (``kind=name`` or bare names of spec's kind) into config."""
    validate_cdi(spec)
    by_name = {d["name"]: d for d in spec["devices"]}
    for want in devices:
        kind, sep, name = want.rpartition("=")
        if sep and kind != spec["kind"]:
            raise CDIError(f"device {want!r} is not of kind {spec['kind']}")
        if name not in by_name:
            raise CDIError(f"unresolvable CDI device {want!r}")
    _apply_edits(config, spec.get("containerEdits") or {})
    for want in devices:
        _apply_edits(config, by_name[want.rpartition("=")[2]].get("containerEdits") or {})
    return config


# --------------------------------------------------------------------------- bundles
def make_bundle(base: Path, args: list[str], *, tenant_tree: Path | None = None,
                env: list[str] | None = None, annotations: dict | None = None,
                cwd: str = "/", uid: int = 0, gid: int = 0,
                binds: tuple[str, ...] = ()) -> Path:
    """An OCI bundle at base (config.json + rootfs/) running args. ``binds``: more host
    directories shown read-only at the same path (a Python environment under /opt, say)."""
    rootfs = base / "rootfs"
    for d in ("usr", "etc", "proc", "sys", "dev", "tmp", "root", "run", "opt/devbroker"):
        (rootfs / d).mkdir(parents=True, exist_ok=True)
    for link, target in (("bin", "usr/bin"), ("sbin", "usr/sbin"), ("lib", "usr/lib"),
                         ("lib64", "usr/lib64")):
        if not (rootfs / link).is_symlink():
            (rootfs / link).symlink_to(target)
    caps = ["CAP_AUDIT_WRITE", "CAP_KILL", "CAP_NET_BIND_SERVICE"]
    mounts = [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
         "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
        {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
         "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"]},
        {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
         "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
        {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue",
         "options": ["nosuid", "noexec", "nodev"]},
        {"destination": "/sys", "type": "sysfs", "source": "sysfs",
         "options": ["nosuid", "noexec", "nodev", "ro"]},
        {"destination": "/usr", "type": "bind", "source": "/usr",
         "options": ["rbind", "ro", "nosuid", "nodev"]},
        {"destination": "/etc", "type": "bind", "source": "/etc",
         "options": ["rbind", "ro", "nosuid", "nodev"]},
        {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs",
         "options": ["nosuid", "nodev", "mode=1777", "size=65536k"]},
    ]
    if tenant_tree is not None:
        mounts.append({"destination": "/opt/devbroker", "type": "bind",
                       "source": str(tenant_tree), "options": ["rbind", "ro", "nosuid", "nodev"]})
    for host in binds:
        (rootfs / host.lstrip("/")).mkdir(parents=True, exist_ok=True)
        mounts.append({"destination": host, "type": "bind", "source": host,
                       "options": ["rbind", "ro", "nosuid", "nodev"]})
    config = {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False, "user": {"uid": uid, "gid": gid}, "args": list(args),
            "env": [PATH_ENV, "HOME=/root", *(env or [])], "cwd": cwd,
            "capabilities": {k: list(caps) for k in ("bounding", "effective", "permitted")},
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024}],
            "noNewPrivileges": True,
        },
        "root": {"path": "rootfs", "readonly": True},
        "hostname": "tenant",
        "mounts": mounts,
        "annotations": dict(annotations or {}),
        "linux": {
            # no network namespace: abstract unix sockets are shared with the host (fd-pass)
            "namespaces": [{"type": t} for t in ("pid", "ipc", "uts", "mount")],
            "maskedPaths": ["/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys",
                            "/proc/latency_stats", "/proc/timer_list", "/proc/timer_stats",
                            "/proc/sched_debug", "/sys/firmware", "/proc/scsi"],
            "readonlyPaths": ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys",
                              "/proc/sysrq-trigger"],
        },
    }
    (base / "config.json").write_text(json.dumps(config, indent=1))
    return base


def load_config(bundle: Path) -> dict:
    return json.loads((bundle / "config.json").read_text())


def save_config(bundle: Path, config: dict) -> None:
    (bundle / "config.json").write_text(json.dumps(config, indent=1))


# --------------------------------------------------------------------------- runtimes
def hybrid_cgroups() -> bool:
    """A v1 hierarchy with a cgroup2 mount beside it at /sys/fs/cgroup/unified."""
    from devbroker.sandbox.linux import mountinfo

    types = {mp: fs for mp, _root, fs in mountinfo()}
    return types.get("/sys/fs/cgroup") == "tmpfs" and \
        types.get("/sys/fs/cgroup/unified") == "cgroup2"


class Runtime:
    def __init__(self, name: str, state_root: Path):
        self.name = name
        self.binary = shutil.which(name)
        if self.binary is None:
            raise FileNotFoundError(f"{name} is not installed "
                                    "(scripts/install-container-runtimes.sh)")
        self.state_root = state_root
        state_root.mkdir(parents=True, exist_ok=True)

    def argv(self, *args: str) -> list[str]:
        cmd = [self.binary, "--root", str(self.state_root), *args]
        if self.name == "crun" and hybrid_cgroups():
            # crun refuses hybrid cgroups: hide the cgroup2 mount in a mount namespace of
            # its own (private propagation: the host keeps it)
            return ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                    'umount /sys/fs/cgroup/unified && exec "$@"', "sh", *cmd]
        return cmd

    def run(self, bundle: Path, cid: str, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv("run", "--bundle", str(bundle), cid), **kw)

    def popen(self, bundle: Path, cid: str, **kw) -> subprocess.Popen:
        return subprocess.Popen(self.argv("run", "--bundle", str(bundle), cid), **kw)

    def state(self, cid: str) -> dict | None:
        r = subprocess.run(self.argv("state", cid), capture_output=True, text=True, timeout=30)
        return json.loads(r.stdout) if r.returncode == 0 else None

    def kill(self, cid: str, sig: int = signal.SIGKILL) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv("kill", cid, str(int(sig))), capture_output=True,
                              text=True, timeout=30)

    def delete(self, cid: str) -> None:
        subprocess.run(self.argv("delete", "--force", cid), capture_output=True, timeout=30)
