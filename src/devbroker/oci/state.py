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
* ``tenant=`` in ``listenerMetadata`` (``devbroker oci-seccomp --tenant``).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from devbroker.oci import profile

TENANT_ANNOTATION = "devbroker.io/tenant"
CDI_KIND = "devbroker.io/gpu"
CDI_ANNOTATION_PREFIX = "cdi.k8s.io/"
SECCOMP_FD_NAME = "seccompFd"
MAX_STATE_BYTES = 1 << 20  # annotations can be large, but not this large

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


def decode_state(payload: bytes) -> ProcessState:
    """The container process state from the bytes the runtime sent."""
    if len(payload) > MAX_STATE_BYTES:
        raise StateError(f"container process state larger than {MAX_STATE_BYTES} bytes")
    try:
        d = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise StateError(f"container process state is not JSON: {e}") from None
    if not isinstance(d, dict):
        raise StateError("container process state is not a JSON object")
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


@dataclass(frozen=True)
class Hand:
    """What the broker makes of a hand-over: the tenant, the front end to serve it with,
    and where each came from (for the audit line)."""

    tenant: str
    frontend: str
    sources: tuple[str, ...]


def identify(state: ProcessState, *, kind: str = CDI_KIND) -> Hand:
    """The tenant and front end of a hand-over, or StateError. Every place that names a
    tenant must name the same one; a container asking for two tenants' devices is refused."""
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
