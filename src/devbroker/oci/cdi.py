"""The CDI spec of a running broker's tenants (sans-IO; ``devbroker cdi`` writes it).

One CDI device per tenant, kind ``devbroker.io/gpu``, named after the tenant:
``podman run --device devbroker.io/gpu=alice …`` (or a CRI runtime's
``cdi.k8s.io/…: devbroker.io/gpu=alice`` annotation). Container Device Interface SPEC.md,
``cdiVersion`` 0.5.0 (the newest Debian 12's podman 4.3 accepts; nothing here needs later
fields).

Per front end (docs/containers.md):

* ``fuse``: the tenant's FUSE node files bound at ``/dev/nvidiactl``, ``/dev/nvidia<N>``,
  ``/dev/nvidia-uvm(-tools)`` as **mounts**, not ``deviceNodes``: they are regular files, so
  no device-cgroup rule is involved and none may be added for 195:*. NVML 535 also needs them
  to ``stat`` as character devices: the container's seccomp section from
  ``devbroker oci-seccomp --frontend fuse`` hands the stat family to the broker's stat shim.
* ``seccomp``: character ``deviceNodes`` (195:255, 195:N, the ``nvidia-uvm`` major) that runc
  creates, cgroup access ``m`` only: the container itself can never read or write them (the
  device cgroup refuses an open that gets past the broker); every open of them is answered
  by the broker through the seccomp listener (``devbroker oci-seccomp --frontend seccomp``),
  which installs files the *broker* opened.

Both: a ``createContainer`` hook (``devbroker oci-hook``, devbroker.oci.hook) that builds the
``/proc/driver/nvidia``, ``/proc/devices`` and ``/sys/module/nvidia`` views a runtime cannot
mount, and ``NVIDIA_VISIBLE_DEVICES=void`` so that an NVIDIA container runtime hook, where one
is installed, adds none of the host's real nodes (nvidia-container-toolkit's convention).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from devbroker.oci.state import CDI_KIND

CDI_VERSION = "0.5.0"
NVIDIA_MAJOR = 195
_CDI_NAME = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9_.-]*[A-Za-z0-9])?$")
_NODE = re.compile(r"^nvidia(ctl|[0-9]+|-uvm|-uvm-tools)$")
HOOK_TIMEOUT = 60  # seconds: a hook that hangs fails the container instead of the runtime


@dataclass(frozen=True)
class TenantNodes:
    name: str
    dir: str  # the tenant's directory on the broker's mount (RUN_DIR/nodes/<name>)
    nodes: tuple[str, ...]  # node file names in it (nvidiactl, nvidia0, nvidia-uvm, ...)


def device_edits(t: TenantNodes, frontend: str, uvm_major: int, hook_argv: list[str]) -> dict:
    edits: dict = {}
    nodes = sorted(n for n in t.nodes if _NODE.match(n))
    if frontend == "fuse":
        edits["mounts"] = [{"hostPath": f"{t.dir}/{n}", "containerPath": f"/dev/{n}",
                            "type": "bind", "options": ["bind", "nosuid", "nodev", "noexec"]}
                           for n in nodes]
    elif frontend == "seccomp":
        devs = []
        for n in nodes:
            if n == "nvidiactl":
                major, minor = NVIDIA_MAJOR, 255
            elif n == "nvidia-uvm":
                major, minor = uvm_major, 0
            elif n == "nvidia-uvm-tools":
                continue  # as devbroker exec: not offered through the seccomp front end
            else:
                major, minor = NVIDIA_MAJOR, int(n[len("nvidia"):])
            devs.append({"path": f"/dev/{n}", "type": "c", "major": major, "minor": minor,
                         "fileMode": 0o666, "permissions": "m"})
        edits["deviceNodes"] = devs
    else:
        raise ValueError(f"front end {frontend!r}: fuse or seccomp")
    edits["hooks"] = [{"hookName": "createContainer", "path": hook_argv[0],
                       "args": [*hook_argv, "--tenant", t.name], "timeout": HOOK_TIMEOUT}]
    return edits


def cdi_spec(tenants: list[TenantNodes], *, frontend: str, uvm_major: int,
             hook_argv: list[str], kind: str = CDI_KIND) -> tuple[dict, list[str]]:
    """(spec, skipped): the CDI spec, and why tenants were left out (names CDI refuses)."""
    if not hook_argv or not hook_argv[0].startswith("/"):
        raise ValueError("the hook's path must be absolute")
    devices, skipped = [], []
    for t in sorted(tenants, key=lambda t: t.name):
        if not _CDI_NAME.match(t.name):
            skipped.append(f"{t.name}: not a valid CDI device name")
            continue
        if "nvidiactl" not in t.nodes:
            skipped.append(f"{t.name}: no nvidiactl node in {t.dir}")
            continue
        devices.append({"name": t.name,
                        "containerEdits": device_edits(t, frontend, uvm_major, hook_argv)})
    if not devices:
        raise ValueError("no tenant to describe" + (f" ({'; '.join(skipped)})" if skipped else ""))
    spec = {"cdiVersion": CDI_VERSION, "kind": kind, "devices": devices,
            "containerEdits": {"env": ["NVIDIA_VISIBLE_DEVICES=void"]}}
    return spec, skipped
