"""The seccomp hand-over of an OCI runtime, and who the container's tenant is (sans-IO).

When a container's seccomp section has ``SCMP_ACT_NOTIFY`` rules and a ``listenerPath``, the
runtime (runc, crun) connects to that unix socket once the filter is installed in the
container's init and sends the OCI *container process state* as JSON, the listener fd attached
(``SCM_RIGHTS``, named ``"seccompFd"`` in ``fds``), then closes the connection. runtime-spec,
config-linux.md "The Container Process State"::

    {"ociVersion": "1.0.2", "fds": ["seccompFd"], "pid": 4422,
     "metadata": "<the section's listenerMetadata>",
     "state": {"ociVersion": "1.0.2", "id": "c1", "status": "creating", "pid": 4422,
               "bundle": "/containers/c1", "annotations": {"key": "value"}}}

The payload may come in several ``sendmsg`` calls (the fds with the first). The spec says the
runtime closes the connection afterwards, but runc 1.1 keeps a duplicate of its end open while
the container runs, so the payload ends where its JSON object ends (:func:`complete`). No
answer is expected: the runtime does not read one.

The tenant is named by the operator's configuration, in any of three places, which must not
disagree:

* the annotation ``devbroker.io/tenant`` (config.json ``annotations``);
* a CDI device of devbroker's kind requested through the CDI annotations
  (``cdi.k8s.io/<key>: "devbroker.io/gpu=alice"``, how CRI runtimes carry CDI requests);
* ``tenant=`` in ``listenerMetadata`` (``devbroker oci-seccomp --tenant``);
* only where ``listenerMetadata`` says ``tenant_from=cdi`` (``devbroker oci-seccomp
  --tenant-from-cdi``): the tenant whose CDI device the runtime applied, i.e. the
  ``devbroker oci-hook --tenant NAME`` hook of this broker in the bundle's config.json
  (:func:`hook_tenants`). The runtime manager writes config.json from the operator's CDI
  specs; the container's own configuration cannot add hooks (a Kubernetes pod cannot), so
  one seccomp section serves the containers of every tenant (a Localhost seccomp profile).
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

from devbroker.oci import profile

TENANT_ANNOTATION = "devbroker.io/tenant"
CDI_KIND = "devbroker.io/gpu"
CDI_ANNOTATION_PREFIX = "cdi.k8s.io/"
SECCOMP_FD_NAME = "seccompFd"
MAX_STATE_BYTES = 1 << 20  # annotations can be large, but not this large
MAX_CONFIG_BYTES = 4 << 20  # a bundle's config.json (``tenant_from=cdi``)

# CDI device names: alphanumerics with - _ . inside (SPEC.md, "CDI Devices").
_CDI_NAME = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9_.-]*[A-Za-z0-9])?$")


class StateError(ValueError):
    """The hand-over cannot be accepted; the message says why (it goes to the audit log)."""


@dataclass(frozen=True)
class ProcessState:
    oci_version: str
    fds: tuple[str, ...]
    pid: int
    metadata: str
    container_id: str
    status: str
    bundle: str
    annotations: dict = field(default_factory=dict, hash=False, compare=False)

    def fd_index(self, name: str = SECCOMP_FD_NAME) -> int:
        try:
            return self.fds.index(name)
        except ValueError:
            raise StateError(f"the runtime sent no {name!r} (fds: {list(self.fds)})") from None


def complete(payload: bytes) -> bool:
    """Whether payload holds a whole JSON document (the state may arrive in pieces)."""
    try:
        json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return False
    return True


def _json_object(raw: bytes, what: str) -> dict:
    """`raw` as a JSON object (UTF-8), else StateError naming `what`."""
    try:
        d = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise StateError(f"{what} is not JSON: {e}") from None
    if not isinstance(d, dict):
        raise StateError(f"{what} is not a JSON object")
    return d


def decode_state(payload: bytes) -> ProcessState:
    """The container process state from the bytes the runtime sent."""
    if len(payload) > MAX_STATE_BYTES:
        raise StateError(f"container process state larger than {MAX_STATE_BYTES} bytes")
    d = _json_object(payload, "container process state")
    st = d.get("state")
    if not isinstance(st, dict):
        raise StateError("container process state without 'state'")
    fds = d.get("fds") or []
    ann = st.get("annotations") or {}
    pid = d.get("pid", st.get("pid"))
    if not (isinstance(fds, list) and all(isinstance(x, str) for x in fds)):
        raise StateError("'fds' is not a list of names")
    if not (isinstance(ann, dict) and all(isinstance(k, str) and isinstance(v, str)
                                          for k, v in ann.items())):
        raise StateError("'state.annotations' is not a map of strings")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        raise StateError(f"bad container pid {pid!r}")
    meta = d.get("metadata") or ""
    if not isinstance(meta, str):
        raise StateError("'metadata' is not a string")
    return ProcessState(
        oci_version=str(d.get("ociVersion", "")), fds=tuple(fds), pid=pid, metadata=meta,
        container_id=str(st.get("id", "")), status=str(st.get("status", "")),
        bundle=str(st.get("bundle", "")), annotations=dict(ann))


def parse_metadata(meta: str) -> dict[str, str]:
    """``listenerMetadata`` as written by :func:`profile.encode_metadata`; {} when it is
    someone else's (no ``devbroker=1`` item)."""
    items = {}
    for part in meta.split(";"):
        k, sep, v = part.strip().partition("=")
        if sep:
            items[k.strip()] = v.strip()
    return items if items.get(profile.METADATA_PREFIX) == "1" else {}


def cdi_requests(annotations: dict[str, str], kind: str = CDI_KIND) -> list[str]:
    """Device names of ``kind`` requested through CDI annotations (``cdi.k8s.io/<key>``:
    comma-separated qualified names ``vendor/class=name``)."""
    names = []
    for key, value in annotations.items():
        if not key.startswith(CDI_ANNOTATION_PREFIX):
            continue
        for dev in value.split(","):
            k, sep, name = dev.strip().partition("=")
            if sep and k == kind:
                names.append(name)
    return names


def hook_tenants(config: dict, run_dir: str) -> list[str]:
    """Tenants named by ``devbroker oci-hook`` createContainer hooks of the broker at
    run_dir in a bundle's config.json (what the tenants' CDI devices add: oci/cdi.py)."""
    hooks = config.get("hooks") if isinstance(config, dict) else None
    entries = hooks.get("createContainer") if isinstance(hooks, dict) else None
    names = []
    for h in entries if isinstance(entries, list) else ():
        args = h.get("args") if isinstance(h, dict) else None
        if not (isinstance(args, list) and all(isinstance(a, str) for a in args)):
            continue
        if "oci-hook" not in args or "--run-dir" not in args or "--tenant" not in args:
            continue
        at = args.index("oci-hook")
        rd, tn = args.index("--run-dir"), args.index("--tenant")
        if not (rd < at < tn and tn + 1 < len(args) and rd + 1 < at):
            continue
        if os.path.realpath(args[rd + 1]) == os.path.realpath(run_dir):
            names.append(args[tn + 1])
    return names


def read_config(bundle: str) -> dict:
    """A bundle's config.json (the runtime's peer is root, checked before this is asked)."""
    if not bundle.startswith("/"):
        raise StateError(f"bundle {bundle!r} is not an absolute path")
    try:
        with open(os.path.join(bundle, "config.json"), "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise StateError(f"the bundle's config.json: {e.strerror or e}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise StateError(f"the bundle's config.json is larger than {MAX_CONFIG_BYTES} bytes")
    return _json_object(raw, "the bundle's config.json")


def tenant_from_cdi(state: ProcessState) -> bool:
    return parse_metadata(state.metadata).get("tenant_from") == profile.TENANT_FROM_CDI


@dataclass(frozen=True)
class Hand:
    """What the broker makes of a hand-over: the tenant, the front end to serve it with,
    and where each came from (for the audit line)."""

    tenant: str
    frontend: str
    sources: tuple[str, ...]


def identify(state: ProcessState, *, kind: str = CDI_KIND,
             cdi_tenants: list[str] | tuple[str, ...] = ()) -> Hand:
    """The tenant and front end of a hand-over, or StateError. Every place that names a
    tenant must name the same one; a container asking for two tenants' devices is refused.
    ``cdi_tenants``: :func:`hook_tenants` of the bundle, counted only where the section
    says ``tenant_from=cdi``."""
    meta = parse_metadata(state.metadata)
    if not meta:
        raise StateError("listenerMetadata is not devbroker's (write the seccomp section with "
                         "`devbroker oci-seccomp`)")
    frontend = meta.get("frontend", "")
    if frontend not in profile.FRONTENDS:
        raise StateError(f"unknown front end {frontend!r} in listenerMetadata")
    named: list[tuple[str, str]] = []
    if meta.get("tenant"):
        named.append(("listenerMetadata", meta["tenant"]))
    if state.annotations.get(TENANT_ANNOTATION):
        named.append((f"annotation {TENANT_ANNOTATION}", state.annotations[TENANT_ANNOTATION]))
    for name in cdi_requests(state.annotations, kind):
        named.append((f"CDI device {kind}={name}", name))
    if meta.get("tenant_from") == profile.TENANT_FROM_CDI:
        for name in cdi_tenants:
            named.append((f"CDI device {kind}={name} applied (config.json)", name))
    if not named:
        raise StateError(f"no tenant named (annotation {TENANT_ANNOTATION}, a CDI device "
                         f"{kind}=NAME, or tenant= in listenerMetadata)")
    tenants = {t for _, t in named}
    if len(tenants) != 1:
        raise StateError("the container names more than one tenant: " +
                         ", ".join(f"{src}: {t!r}" for src, t in named))
    tenant = tenants.pop()
    if not _CDI_NAME.match(tenant):
        raise StateError(f"bad tenant name {tenant!r}")
    return Hand(tenant, frontend, tuple(src for src, _ in named))
