"""The broker's policy: which tenants exist, what GPUs and how much memory each may use.

A TOML file (docs/policy.md has the schema) is loaded into an immutable `Policy`. Loading is
strict: an unknown key, a wrong type, a GPU the broker does not have, a negative or
oversized quota, a duplicate tenant are all `PolicyError`s naming the file, the line and
the reason — a typo must never silently widen (or narrow) what a tenant may do.
"""
from __future__ import annotations

import ipaddress
import math
import re
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from devbroker.broker import limits as _limits
from devbroker.broker.rules import CAPABILITIES, DEFAULT_CAPABILITIES
from devbroker.broker.limits import TenantLimits

BACKENDS = ("emulated", "real")
DEFAULT_DRIVER_VERSION = "535.309.01"
EXAMPLE_POLICY = "example-policy.toml"

_UNITS = {
    "": 1, "B": 1,
    "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40,
    "kB": 10**3, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$")
_UUID = re.compile(r"^GPU-[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")
_PCI_BUS_ID = re.compile(r"^[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")
_TENANT_NAME = re.compile(r"^[a-z_][a-z0-9_-]{0,63}$")  # also a directory name on the mount
_VERSION = re.compile(r"^[0-9]+\.[0-9]+(\.[0-9]+)?$")


class PolicyError(ValueError):
    """A policy that cannot be used; str() is ``file, line N: reason`` (``file: reason``
    when the problem has no line, e.g. an unreadable file or a section missing entirely)."""

    def __init__(self, file: str, line: int | None, reason: str):
        self.file, self.line, self.reason = file, line, reason
        super().__init__(f"{file}, line {line}: {reason}" if line else f"{file}: {reason}")


# ------------------------------------------------------------------------------ the model
@dataclass(frozen=True)
class GpuSpec:
    index: int
    name: str
    uuid: str
    pci_bus_id: str
    memory: int  # bytes


@dataclass(frozen=True)
class RateLimit:
    requests_per_second: float
    burst: int


# What a tenant without `rate_limit` gets (broker/limits.py says why this much).
DEFAULT_RATE_LIMIT = RateLimit(_limits.DEFAULT_RATE, _limits.DEFAULT_BURST)


# What a tenant without `pinned_host_memory` may pin: a fixed size rather than a share of
# the host's RAM, so that a policy means the same on every host it is applied to (a CUDA
# process pins ~60 MiB for itself at init; PyTorch's pinned-memory data loaders a few GiB).
DEFAULT_PINNED_HOST_MEMORY = 16 << 30


@dataclass(frozen=True)
class TenantPolicy:
    name: str
    gpus: tuple[int, ...]
    memory_quota: int  # bytes, on each of the tenant's GPUs
    capabilities: tuple[str, ...]
    # Paces every request kind (opens, page and /proc reads, lookups, ioctls). None (only
    # from code, never from a file: a file without the key gets DEFAULT_RATE_LIMIT): unpaced.
    rate_limit: RateLimit | None = None
    uids: tuple[int, ...] | None = None  # None: any uid may use the tenant's nodes
    limits: TenantLimits = _limits.DEFAULTS  # open files, RM clients, RM objects
    # Share of GPU time when other tenants are busy on the same GPU (relative to theirs) and
    # scheduling priority: enforced as channel-group timeslices and runlist interleave levels
    # (broker/compute.py, docs/compute-shares.md).
    compute_weight: int = 1
    priority: str = "normal"  # one of PRIORITIES
    # A higher-priority tenant's allocation may checkpoint this tenant's processes to host
    # memory when the GPU is full ([broker.preemption], broker/preemption.py).
    preemptible: bool = False
    # Free-form names the cluster knows the tenant by (Kubernetes: namespace, pod,
    # container): shown in status and added to its metrics (docs/operations.md). Sorted
    # (key, value) pairs, so that the policy stays hashable and comparable.
    labels: tuple[tuple[str, str], ...] = ()
    # Host memory its processes may hold pinned through the driver (cudaHostAlloc: system
    # memory allocations; cudaHostRegister: OS-descriptor allocations). Pinned pages cannot
    # be swapped or reclaimed, so one tenant could otherwise take the host's memory.
    pinned_host_memory: int = DEFAULT_PINNED_HOST_MEMORY


# Scheduling priorities a policy may name (broker/compute.py maps them to interleave levels).
PRIORITIES = ("high", "normal", "low")
# A weight is a ratio of timeslices; beyond this the smallest slice of a busy GPU would be
# below what the hardware can express next to the largest (compute.py scales them).
COMPUTE_WEIGHT_MAX = 64


@dataclass(frozen=True)
class ControlAccess:
    """Who may use the control socket, besides root of the broker's pid namespace (always
    admin). Checked against the caller's SO_PEERCRED uid and its groups (docs/security.md)."""

    admin_uids: tuple[int, ...] = ()
    admin_groups: tuple[int, ...] = ()
    readonly_uids: tuple[int, ...] = ()
    readonly_groups: tuple[int, ...] = ()

    def opens_socket(self) -> bool:
        """Whether anyone but root may connect (the socket is then 0666, the run dir 0711)."""
        return any((self.admin_uids, self.admin_groups, self.readonly_uids,
                    self.readonly_groups))


@dataclass(frozen=True)
class MetricsConfig:
    """The Prometheus endpoint ([broker.metrics]); absent: no endpoint (docs/policy.md)."""

    host: str  # an IP literal (what `listen` names, without brackets)
    port: int  # 0: any free port (the bound one is in `devbroker status`)
    allow_remote: bool = False

    @property
    def listen(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True)
class AlertConfig:
    """Thresholds that raise an `alert` audit record and devbroker_alert_active
    ([broker.alerts]); 0 turns one off."""

    quota_percent: float = 90.0  # a tenant's memory used on one GPU >= this % of its quota
    refusals_per_minute: int = 120  # refusals of one tenant in the last 60 s, at least
    escape_attempts: int = 3  # escape attempts of one tenant within escape_window seconds
    escape_window: int = 600


@dataclass(frozen=True)
class PreemptionConfig:
    """Priority preemption by checkpoint ([broker.preemption], docs/preemption.md): an
    allocation the GPU cannot hold waits while lower-priority preemptible tenants' processes
    go to host memory."""

    enabled: bool = False
    host_memory: int = 64 << 30  # bytes of host memory checkpoints may hold, all together
    # seconds a waiting allocation may wait for its preemption: a 60 GiB process took 35 s
    # to checkpoint on the H200 (docs/preemption-driver.md)
    wait: float = 120.0
    lock_timeout: float = 10.0  # seconds a process has to answer the driver's lock


@dataclass(frozen=True)
class BrokerConfig:
    backend: str
    driver_version: str
    audit_log: str | None
    gpus: tuple[GpuSpec, ...]  # for "real", may be empty: the host's GPUs are used
    metrics: MetricsConfig | None = None
    alerts: AlertConfig = AlertConfig()
    # Weighted turns on shared GPUs (broker/turns.py, docs/policy.md): the length of a round
    # of turns in ms; 0: off (shares by the driver's timeslices alone)
    compute_turns_ms: int = 0
    preemption: PreemptionConfig = PreemptionConfig()


@dataclass(frozen=True, eq=True)
class Policy:
    broker: BrokerConfig
    tenants: Mapping[str, TenantPolicy]  # read-only mapping, in file order
    source: str = field(default="<policy>", compare=False)
    control: ControlAccess = ControlAccess()

    def to_toml(self) -> str:
        """Canonical TOML; load_policy_text(p.to_toml()) == p."""
        b = self.broker
        out = ["[broker]", f"backend = {_q(b.backend)}", f"driver_version = {_q(b.driver_version)}"]
        if b.audit_log is not None:
            out.append(f"audit_log = {_q(b.audit_log)}")
        if b.compute_turns_ms:
            out.append(f"compute_turns_ms = {b.compute_turns_ms}")
        if b.metrics is not None:
            out += ["", "[broker.metrics]", f"listen = {_q(b.metrics.listen)}",
                    f"allow_remote = {'true' if b.metrics.allow_remote else 'false'}"]
        if b.preemption != PreemptionConfig():
            pre = b.preemption
            out += ["", "[broker.preemption]",
                    f"enabled = {'true' if pre.enabled else 'false'}",
                    f"host_memory = {_size_toml(pre.host_memory)}",
                    f"wait = {pre.wait!r}", f"lock_timeout = {pre.lock_timeout!r}"]
        a = b.alerts
        out += ["", "[broker.alerts]", f"quota_percent = {a.quota_percent:g}",
                f"refusals_per_minute = {a.refusals_per_minute}",
                f"escape_attempts = {a.escape_attempts}", f"escape_window = {a.escape_window}"]
        for g in b.gpus:
            out += ["", "[[broker.gpu]]", f"name = {_q(g.name)}", f"uuid = {_q(g.uuid)}",
                    f"pci_bus_id = {_q(g.pci_bus_id)}", f"memory = {_size_toml(g.memory)}"]
        for t in self.tenants.values():
            out += ["", f"[tenant.{t.name}]",
                    f"gpus = [{', '.join(map(str, t.gpus))}]",
                    f"memory_quota = {_size_toml(t.memory_quota)}",
                    f"capabilities = [{', '.join(map(_q, t.capabilities))}]"]
            if t.rate_limit is not None:
                rps = t.rate_limit.requests_per_second
                rps_text = str(int(rps)) if float(rps).is_integer() else repr(float(rps))
                out.append(f"rate_limit = {{ requests_per_second = {rps_text}, "
                           f"burst = {t.rate_limit.burst} }}")
            if t.uids is not None:
                out.append(f"uids = [{', '.join(map(str, t.uids))}]")
            if t.limits != _limits.DEFAULTS:
                out.append("limits = { " + ", ".join(f"{k} = {getattr(t.limits, k)}"
                                                     for k in _limits.KEYS) + " }")
            if t.compute_weight != 1:
                out.append(f"compute_weight = {t.compute_weight}")
            if t.priority != "normal":
                out.append(f"priority = {_q(t.priority)}")
            if t.preemptible:
                out.append("preemptible = true")
            if t.pinned_host_memory != DEFAULT_PINNED_HOST_MEMORY:
                out.append(f"pinned_host_memory = {_size_toml(t.pinned_host_memory)}")
            if t.labels:
                out.append("labels = { " + ", ".join(f"{k} = {_q(v)}" for k, v in t.labels)
                           + " }")
        c = self.control
        if c != ControlAccess():
            out += ["", "[control]"]
            for key in _CONTROL_KEYS:
                out.append(f"{key} = [{', '.join(map(str, getattr(c, key)))}]")
        return "\n".join(out) + "\n"

    def describe(self) -> str:
        """A human summary for `devbroker policy show`."""
        b = self.broker
        lines = [f"policy {self.source}: backend {b.backend}, driver {b.driver_version}, "
                 f"audit log {b.audit_log or '(broker default)'}",
                 f"  metrics: {b.metrics.listen if b.metrics else 'off'}; alerts: quota "
                 f"{b.alerts.quota_percent:g} %, {b.alerts.refusals_per_minute} refusals/min, "
                 f"{b.alerts.escape_attempts} escape attempts in {b.alerts.escape_window} s "
                 "(0 = off)"]
        pre = b.preemption
        lines.append(f"  preemption: {'on' if pre.enabled else 'off'}; checkpoints may hold "
                     f"{format_size(pre.host_memory)} of host memory, an allocation waits at "
                     f"most {pre.wait:g} s, a lock {pre.lock_timeout:g} s")
        for g in b.gpus:
            lines.append(f"  GPU {g.index}: {g.name}  {g.uuid}  {g.pci_bus_id}  {format_size(g.memory)}")
        if not b.gpus:
            lines.append("  GPUs: the host's")
        for t in self.tenants.values():
            rate = (f"{t.rate_limit.requests_per_second:g} req/s, burst {t.rate_limit.burst}"
                    if t.rate_limit else "unpaced")
            uids = ", ".join(map(str, t.uids)) if t.uids is not None else "any"
            lines.append(f"  tenant {t.name}: GPUs {', '.join(map(str, t.gpus))}; "
                         f"quota {format_size(t.memory_quota)} per GPU; "
                         f"pinned host memory {format_size(t.pinned_host_memory)}; "
                         f"capabilities {', '.join(t.capabilities) or '(none)'}; "
                         f"rate {rate}; uids {uids}; at most {t.limits.open_files} open "
                         f"files, {t.limits.rm_clients} RM clients, {t.limits.rm_objects} "
                         f"RM objects; compute weight {t.compute_weight}, priority "
                         f"{t.priority}{', preemptible' if t.preemptible else ''}")
        if not self.tenants:
            lines.append("  no tenants")
        c = self.control
        lines.append(f"  control socket: admin root (broker's pid namespace)"
                     f"{', uids ' + ', '.join(map(str, c.admin_uids)) if c.admin_uids else ''}"
                     f"{', gids ' + ', '.join(map(str, c.admin_groups)) if c.admin_groups else ''}"
                     f"; read-only uids {', '.join(map(str, c.readonly_uids)) or '-'}, "
                     f"gids {', '.join(map(str, c.readonly_groups)) or '-'}")
        return "\n".join(lines)


# ------------------------------------------------------------------------------ loading
def load_policy(path: str | Path) -> Policy:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise PolicyError(str(path), None, f"cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise PolicyError(str(path), None, f"not UTF-8 text: {e.reason}") from None
    return load_policy_text(text, str(path))


def load_policy_text(text: str, name: str = "<policy>") -> Policy:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise PolicyError(name, *_toml_error_at(str(e), text)) from None
    return _Loader(text, name).policy(data)


def default_policy() -> Policy:
    """The built-in policy: the packaged example (two tenants on two emulated H200s)."""
    ref = resources.files("devbroker") / "data" / EXAMPLE_POLICY
    return load_policy_text(ref.read_text(encoding="utf-8"), f"<built-in {EXAMPLE_POLICY}>")


def parse_size(value: Any) -> int:
    """Bytes from an int or a string like "16GiB", "512 MiB", "1.5GiB", "80GB".

    Raises ValueError with the reason. Bare K/M/G are refused: binary or decimal would be
    a guess, and a quota off by 7% is exactly the silent error a policy must not have.
    """
    if isinstance(value, bool):
        raise ValueError("expected a size, got a boolean")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must not be negative ({value})")
        return value
    if isinstance(value, float):
        raise ValueError("a size in bytes must be an integer or a string with a unit")
    if not isinstance(value, str):
        raise ValueError(f"expected a size, got {_type_name(value)}")
    if value.strip().startswith("-"):
        raise ValueError(f"size must not be negative ({value!r})")
    m = _SIZE.match(value)
    if not m:
        raise ValueError(f"not a size: {value!r} (e.g. 16GiB, 512MiB, 17179869184)")
    number, unit = m.groups()
    if unit not in _UNITS:
        raise ValueError(f"unknown unit {unit!r} in {value!r} "
                         f"(use B, KiB, MiB, GiB, TiB, or kB, MB, GB, TB)")
    if "." in number:
        whole, frac = number.split(".")
        numerator = int(whole + frac) * _UNITS[unit]
        denominator = 10 ** len(frac)
        if numerator % denominator:
            raise ValueError(f"{value!r} is not a whole number of bytes")
        return numerator // denominator
    return int(number) * _UNITS[unit]


def format_size(n: int) -> str:
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        if n >= _UNITS[unit] and n % _UNITS[unit] == 0:
            return f"{n // _UNITS[unit]} {unit}"
    return f"{n} B"


# ------------------------------------------------------------------------------ internals
def _q(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _size_toml(n: int) -> str:
    text = format_size(n)
    return _q(text.replace(" ", "")) if not text.endswith(" B") else str(n)


def _type_name(v: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a float", str: "a string",
            list: "an array", dict: "a table"}.get(type(v), type(v).__name__)


def _toml_error_at(msg: str, text: str) -> tuple[int | None, str]:
    """(line, reason) of a tomllib error. A bracket left open is noticed where the next key
    starts — the line after the mistake ("Unclosed array", or "Invalid value" when a key
    follows inside the open array): the user is shown the line that opened it."""
    reason = _toml_error_reason(msg)
    line = _toml_error_line(msg, text)
    if line is None:
        return line, reason
    opened = _opening_line(text, line)
    if opened is None:
        return line, reason
    if msg.startswith(("Unclosed array", "Unclosed inline table")):
        return opened, reason
    lines = text.splitlines()
    if line <= len(lines) and re.match(r'\s*[A-Za-z0-9_."\'-]+\s*=', lines[line - 1]):
        return opened, f"{reason}: the array or table opened here is not closed before " \
                       f"line {line}"
    return line, reason


def _toml_error_line(msg: str, text: str) -> int | None:
    m = re.search(r"at line (\d+)", msg)
    if m:
        return int(m.group(1))
    if "end of document" in msg:
        return max(1, text.count("\n") + (0 if text.endswith("\n") else 1))
    return None


def _opening_line(text: str, before: int) -> int | None:
    """The line (1-based) of the outermost `[` or `{` of a value still open at line
    `before`, or None. Strings and comments are skipped; a line starting with `[` outside
    a value is a table header, not an array."""
    depth, opened = 0, None
    for n, raw in enumerate(text.splitlines()[:before - 1], start=1):
        line = re.sub(r'"(?:[^"\\]|\\.)*"|\'[^\']*\'', '""', raw).split("#", 1)[0]
        if depth == 0 and line.lstrip().startswith("["):
            continue  # [table] or [[array of tables]]
        for ch in line:
            if ch in "[{":
                if depth == 0:
                    opened = n
                depth += 1
            elif ch in "]}" and depth:
                depth -= 1
    return opened if depth else None


def _toml_error_reason(msg: str) -> str:
    reason = re.sub(r"\s*\((at line \d+, column \d+|at end of document)\)\s*$", "", msg)
    return f"TOML syntax: {reason}"


class _Loader:
    """Validates the parsed TOML; every error is located in the text by its key path."""

    def __init__(self, text: str, name: str):
        self.name = name
        self.lines = _KeyLines(text)

    def fail(self, path: tuple, reason: str):
        raise PolicyError(self.name, self.lines.find(path), reason)

    def table(self, value: Any, path: tuple, allowed: Mapping[str, str], what: str) -> dict:
        if not isinstance(value, dict):
            self.fail(path, f"{what} must be a table, not {_type_name(value)}")
        for key in value:
            if key not in allowed:
                self.fail(path + (key,), f"unknown key {key!r} in {what} "
                                         f"(allowed: {', '.join(allowed)})")
        return value

    def string(self, value: Any, path: tuple, what: str) -> str:
        if not isinstance(value, str):
            self.fail(path, f"{what} must be a string, not {_type_name(value)}")
        return value

    def integer(self, value: Any, path: tuple, what: str, minimum: int = 0) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(path, f"{what} must be an integer, not {_type_name(value)}")
        if value < minimum:
            self.fail(path, f"{what} must be at least {minimum}, not {value}")
        return value

    def size(self, value: Any, path: tuple, what: str) -> int:
        try:
            return parse_size(value)
        except ValueError as e:
            self.fail(path, f"{what}: {e}")

    def int_list(self, value: Any, path: tuple, what: str) -> tuple[int, ...]:
        if not isinstance(value, list):
            self.fail(path, f"{what} must be an array of integers, not {_type_name(value)}")
        out = []
        for v in value:
            out.append(self.integer(v, path, f"each of {what}"))
            if out.count(out[-1]) > 1:
                self.fail(path, f"{what} lists {out[-1]} twice")
        return tuple(out)

    # -- sections
    def policy(self, data: dict) -> Policy:
        self.table(data, (), {"broker": "", "tenant": "", "control": ""}, "the policy")
        broker = self.broker(data.get("broker", {}))
        tenants: dict[str, TenantPolicy] = {}
        raw = data.get("tenant", {})
        if isinstance(raw, list):  # [[tenant]] with name = "..."
            for i, t in enumerate(raw):
                path = ("tenant", i)
                self.table(t, path, _TENANT_KEYS | {"name": ""}, "a [[tenant]]")
                if "name" not in t:
                    self.fail(path, "a [[tenant]] needs a name")
                name = self.string(t["name"], path + ("name",), "tenant name")
                if name in tenants:
                    self.fail(path + ("name",), f"duplicate tenant {name!r}")
                tenants[name] = self.tenant(name, t, path, broker)
        elif isinstance(raw, dict):  # [tenant.NAME]; tomllib itself refuses a duplicate
            for name, t in raw.items():
                tenants[name] = self.tenant(name, t, ("tenant", name), broker)
        else:
            self.fail(("tenant",), "tenant must be [tenant.NAME] tables or [[tenant]] entries")
        control = self.control(data.get("control", {}))
        return Policy(broker=broker, tenants=MappingProxyType(tenants), source=self.name,
                      control=control)

    def control(self, c: Any) -> ControlAccess:
        path = ("control",)
        self.table(c, path, {k: "" for k in _CONTROL_KEYS}, "[control]")
        got = {k: self.int_list(c[k], path + (k,), k) for k in _CONTROL_KEYS if k in c}
        for k, ids in got.items():
            if 0 in ids:
                self.fail(path + (k,), f"{k} lists 0: root is always admin; a read-only "
                                       "root would be a false promise")
        return ControlAccess(**got)

    def broker(self, b: Any) -> BrokerConfig:
        path = ("broker",)
        self.table(b, path, _BROKER_KEYS, "[broker]")
        backend = self.string(b.get("backend", "emulated"), path + ("backend",), "backend")
        if backend not in BACKENDS:
            self.fail(path + ("backend",), f"backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
        version = self.string(b.get("driver_version", DEFAULT_DRIVER_VERSION),
                              path + ("driver_version",), "driver_version")
        known = _known_driver_versions()
        if known and version not in known:
            self.fail(path + ("driver_version",),
                      f"driver_version {version!r} is not one the ABI tables know "
                      f"({', '.join(known)})")
        elif not _VERSION.match(version):
            self.fail(path + ("driver_version",), f"not a driver version: {version!r}")
        audit = b.get("audit_log")
        if audit is not None:
            audit = self.string(audit, path + ("audit_log",), "audit_log")
            if not audit:
                self.fail(path + ("audit_log",), "audit_log must not be empty (omit it for the default)")
        raw_gpus = b.get("gpu", [])
        if not isinstance(raw_gpus, list):
            self.fail(path + ("gpu",), "GPUs are given as [[broker.gpu]] tables")
        gpus = tuple(self.gpu(i, g) for i, g in enumerate(raw_gpus))
        for field_name in ("uuid", "pci_bus_id"):
            seen: dict[str, int] = {}
            for g in gpus:
                value = getattr(g, field_name).lower()
                if value in seen:
                    self.fail(("broker", "gpu", g.index, field_name),
                              f"GPU {g.index} has the same {field_name} as GPU {seen[value]}")
                seen[value] = g.index
        if backend == "emulated" and not gpus:
            self.fail(path, "the emulated backend needs at least one [[broker.gpu]]")
        metrics = self.metrics(b["metrics"]) if "metrics" in b else None
        alerts = self.alerts(b["alerts"]) if "alerts" in b else AlertConfig()
        turns = self.integer(b.get("compute_turns_ms", 0), path + ("compute_turns_ms",),
                             "compute_turns_ms")
        if turns and not _TURNS_MIN_MS <= turns <= _TURNS_MAX_MS:
            self.fail(path + ("compute_turns_ms",),
                      f"compute_turns_ms must be 0 (off) or {_TURNS_MIN_MS}..{_TURNS_MAX_MS} "
                      f"ms (a round of turns; each switch costs ~1 ms), not {turns}")
        preemption = (self.preemption(b["preemption"]) if "preemption" in b
                      else PreemptionConfig())
        return BrokerConfig(backend=backend, driver_version=version, audit_log=audit, gpus=gpus,
                            metrics=metrics, alerts=alerts, compute_turns_ms=turns,
                            preemption=preemption)

    def preemption(self, p: Any) -> PreemptionConfig:
        path = ("broker", "preemption")
        self.table(p, path, _PREEMPTION_KEYS, "[broker.preemption]")
        enabled = p.get("enabled", False)
        if not isinstance(enabled, bool):
            self.fail(path + ("enabled",),
                      f"enabled must be true or false, not {_type_name(enabled)}")
        host = PreemptionConfig.host_memory
        if "host_memory" in p:
            host = self.size(p["host_memory"], path + ("host_memory",), "host_memory")
            if host == 0:
                self.fail(path + ("host_memory",), "host_memory = 0 lets no checkpoint be "
                          "taken; set enabled = false to turn preemption off")
        seconds = {}
        for key, low, high in (("wait", 0.1, 3600.0), ("lock_timeout", 0.1, 600.0)):
            v = p.get(key, getattr(PreemptionConfig, key))
            if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                    or not low <= v <= high):
                # A waiting allocation holds its caller's thread; beyond an hour it is a hang.
                self.fail(path + (key,), f"{key} must be a number of seconds from {low:g} to "
                          f"{high:g}, not {v!r}")
            seconds[key] = float(v)
        return PreemptionConfig(enabled=enabled, host_memory=host, **seconds)

    def metrics(self, m: Any) -> MetricsConfig:
        path = ("broker", "metrics")
        self.table(m, path, _METRICS_KEYS, "[broker.metrics]")
        if "listen" not in m:
            self.fail(path, "[broker.metrics] needs listen (e.g. \"127.0.0.1:9464\"); "
                            "omit the table for no endpoint")
        where = path + ("listen",)
        listen = self.string(m["listen"], where, "listen")
        host, sep, port_text = listen.rpartition(":")
        if not sep or not port_text.isdigit():
            self.fail(where, f"listen must be ADDRESS:PORT (e.g. 127.0.0.1:9464), not {listen!r}")
        port = int(port_text)
        if port > 65535:
            self.fail(where, f"port {port} is not a TCP port (0..65535)")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        if host == "localhost":
            host = "127.0.0.1"
        try:
            addr = ipaddress.ip_address(host)
        except ValueError:
            self.fail(where, f"listen needs an IP address (no host names: what a name resolves "
                             f"to can change), not {host!r}")
        allow_remote = m.get("allow_remote", False)
        if not isinstance(allow_remote, bool):
            self.fail(path + ("allow_remote",),
                      f"allow_remote must be true or false, not {_type_name(allow_remote)}")
        if not addr.is_loopback and not allow_remote:
            # The endpoint has no authentication and names every tenant, its processes and
            # its memory: reachable from other hosts only when the operator says so.
            self.fail(where, f"{listen} is reachable from other hosts; the endpoint has no "
                             "authentication: use a loopback address, or set allow_remote = "
                             "true to mean it")
        return MetricsConfig(host=str(addr), port=port, allow_remote=allow_remote)

    def alerts(self, a: Any) -> AlertConfig:
        path = ("broker", "alerts")
        self.table(a, path, _ALERT_KEYS, "[broker.alerts]")
        pct = a.get("quota_percent", AlertConfig.quota_percent)
        if (isinstance(pct, bool) or not isinstance(pct, (int, float)) or not math.isfinite(pct)
                or not 0 <= pct <= 100):
            self.fail(path + ("quota_percent",),
                      f"quota_percent must be a number from 0 (off) to 100, not {pct!r}")
        return AlertConfig(
            quota_percent=float(pct),
            refusals_per_minute=self.integer(a.get("refusals_per_minute",
                                                   AlertConfig.refusals_per_minute),
                                             path + ("refusals_per_minute",),
                                             "refusals_per_minute"),
            escape_attempts=self.integer(a.get("escape_attempts", AlertConfig.escape_attempts),
                                         path + ("escape_attempts",), "escape_attempts"),
            escape_window=self.integer(a.get("escape_window", AlertConfig.escape_window),
                                       path + ("escape_window",), "escape_window (seconds)", 1))

    def gpu(self, i: int, g: Any) -> GpuSpec:
        path = ("broker", "gpu", i)
        self.table(g, path, _GPU_KEYS, "a [[broker.gpu]]")
        for key in _GPU_KEYS:
            if key not in g:
                self.fail(path, f"GPU {i} needs {key!r}")
        name = self.string(g["name"], path + ("name",), "name")
        uuid = self.string(g["uuid"], path + ("uuid",), "uuid")
        if not _UUID.match(uuid):
            self.fail(path + ("uuid",), f"uuid must look like GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx, not {uuid!r}")
        bus = self.string(g["pci_bus_id"], path + ("pci_bus_id",), "pci_bus_id")
        if not _PCI_BUS_ID.match(bus):
            self.fail(path + ("pci_bus_id",), f"pci_bus_id must look like 0000:00:06.0, not {bus!r}")
        memory = self.size(g["memory"], path + ("memory",), "memory")
        if memory == 0:
            self.fail(path + ("memory",), "memory must be more than 0")
        return GpuSpec(index=i, name=name, uuid=uuid, pci_bus_id=bus.lower(), memory=memory)

    def tenant(self, name: str, t: Any, path: tuple, broker: BrokerConfig) -> TenantPolicy:
        self.table(t, path, _TENANT_KEYS if path[1] == name else _TENANT_KEYS | {"name": ""},
                   f"tenant {name!r}")
        name_path = path + ("name",) if "name" in t else path
        if not _TENANT_NAME.match(name):
            self.fail(name_path, f"tenant name {name!r} must be lower-case letters, digits, "
                                 f"'_' or '-' (it names the tenant's node directory)")
        for key in ("gpus", "memory_quota"):
            if key not in t:
                self.fail(path, f"tenant {name!r} needs {key!r}")
        # gpus = [] is a tenant that may run NVIDIA clients but sees no GPU:
        # it gets "no devices" and cannot open a GPU node.
        gpus = self.int_list(t["gpus"], path + ("gpus",), "gpus")
        by_index = {g.index: g for g in broker.gpus}
        if broker.gpus:
            for gpu in gpus:
                if gpu not in by_index:
                    self.fail(path + ("gpus",), f"GPU {gpu} is not one of the broker's GPUs "
                                                f"(0..{len(broker.gpus) - 1})")
        quota = self.size(t["memory_quota"], path + ("memory_quota",), "memory_quota")
        for gpu in gpus:
            if gpu in by_index and quota > by_index[gpu].memory:
                self.fail(path + ("memory_quota",),
                          f"memory_quota {format_size(quota)} exceeds GPU {gpu}'s "
                          f"{format_size(by_index[gpu].memory)}")
        caps_path = path + ("capabilities",)
        raw_caps = t.get("capabilities", list(DEFAULT_CAPABILITIES))
        if not isinstance(raw_caps, list):
            self.fail(caps_path, f"capabilities must be an array of strings, not {_type_name(raw_caps)}")
        caps: list[str] = []
        for c in raw_caps:
            c = self.string(c, caps_path, "each capability")
            if c not in CAPABILITIES:
                self.fail(caps_path, f"unknown capability {c!r} "
                                     f"(known: {', '.join(sorted(CAPABILITIES))})")
            if c not in caps:
                caps.append(c)
        rate = DEFAULT_RATE_LIMIT
        if "rate_limit" in t:
            rate = self.rate_limit(t["rate_limit"], path + ("rate_limit",))
        limits = _limits.DEFAULTS
        if "limits" in t:
            limits = self.limits(t["limits"], path + ("limits",))
        uids = None
        if "uids" in t:
            uids = self.int_list(t["uids"], path + ("uids",), "uids")
            if not uids:
                self.fail(path + ("uids",), "uids = [] admits nobody; omit it to admit any uid")
        weight = 1
        if "compute_weight" in t:
            weight = self.integer(t["compute_weight"], path + ("compute_weight",),
                                  "compute_weight", 1)
            if weight > COMPUTE_WEIGHT_MAX:
                self.fail(path + ("compute_weight",), f"compute_weight = {weight} is beyond "
                          f"{COMPUTE_WEIGHT_MAX} (weights are ratios of timeslices: see "
                          "docs/compute-shares.md)")
        priority = "normal"
        if "priority" in t:
            priority = self.string(t["priority"], path + ("priority",), "priority")
            if priority not in PRIORITIES:
                self.fail(path + ("priority",), f"priority must be one of "
                          f"{', '.join(PRIORITIES)}, not {priority!r}")
        preemptible = t.get("preemptible", False)
        if not isinstance(preemptible, bool):
            self.fail(path + ("preemptible",),
                      f"preemptible must be true or false, not {_type_name(preemptible)}")
        labels = self.labels(t["labels"], path + ("labels",)) if "labels" in t else ()
        pinned = DEFAULT_PINNED_HOST_MEMORY
        if "pinned_host_memory" in t:
            pinned = self.size(t["pinned_host_memory"], path + ("pinned_host_memory",),
                               "pinned_host_memory")
        return TenantPolicy(name=name, gpus=gpus, memory_quota=quota, capabilities=tuple(caps),
                            rate_limit=rate, uids=uids, limits=limits,
                            compute_weight=weight, priority=priority, labels=labels,
                            preemptible=preemptible, pinned_host_memory=pinned)

    def labels(self, lab: Any, path: tuple) -> tuple[tuple[str, str], ...]:
        # They become Prometheus label values and status columns: short, printable, few.
        if not isinstance(lab, dict):
            self.fail(path, f"labels must be a table of strings, not {_type_name(lab)}")
        if len(lab) > _LABELS_MAX:
            self.fail(path, f"at most {_LABELS_MAX} labels, not {len(lab)}")
        for key, value in lab.items():
            if not isinstance(key, str) or not _LABEL_KEY.match(key):
                self.fail(path, f"label name {key!r} must be lower-case letters and '_'")
            value = self.string(value, path + (key,), f"label {key}")
            if len(value) > _LABEL_VALUE_MAX or not value.isprintable():
                self.fail(path + (key,), f"label {key} must be printable and at most "
                                         f"{_LABEL_VALUE_MAX} characters")
        return tuple(sorted(lab.items()))

    def limits(self, lim: Any, path: tuple) -> TenantLimits:
        self.table(lim, path, {k: "" for k in _limits.KEYS}, "limits")
        got = {}
        for key in _limits.KEYS:
            if key in lim:
                # 1 at least: a tenant that may hold no file or client could run nothing,
                # which is what removing it from the policy is for.
                got[key] = self.integer(lim[key], path + (key,), f"limits.{key}", 1)
                if got[key] > _LIMIT_MAX:
                    self.fail(path + (key,), f"limits.{key} = {got[key]} is beyond any "
                                             f"sane use (at most {_LIMIT_MAX})")
        return TenantLimits(**got)

    def rate_limit(self, r: Any, path: tuple) -> RateLimit:
        self.table(r, path, _RATE_KEYS, "rate_limit")
        if "requests_per_second" not in r:
            self.fail(path, "rate_limit needs requests_per_second")
        rps = r["requests_per_second"]
        if isinstance(rps, bool) or not isinstance(rps, (int, float)) or not math.isfinite(rps) or rps <= 0:
            self.fail(path + ("requests_per_second",),
                      f"requests_per_second must be a number above 0, not {rps!r}")
        burst = self.integer(r.get("burst", max(1, math.ceil(rps))), path + ("burst",), "burst", 1)
        return RateLimit(requests_per_second=rps, burst=burst)


_BROKER_KEYS = {"backend": "", "driver_version": "", "audit_log": "", "gpu": "", "metrics": "",
                "alerts": "", "compute_turns_ms": "", "preemption": ""}
_PREEMPTION_KEYS = {"enabled": "", "host_memory": "", "wait": "", "lock_timeout": ""}
# a round of turns (broker/turns.py): below 20 ms it would be mostly switches (each ~1 ms of
# the driver's time per 20 channels)
_TURNS_MIN_MS, _TURNS_MAX_MS = 20, 10_000
_METRICS_KEYS = {"listen": "", "allow_remote": ""}
_ALERT_KEYS = {"quota_percent": "", "refusals_per_minute": "", "escape_attempts": "",
               "escape_window": ""}
_GPU_KEYS = {"name": "", "uuid": "", "pci_bus_id": "", "memory": ""}
_TENANT_KEYS = {"gpus": "", "memory_quota": "", "capabilities": "", "rate_limit": "", "uids": "",
                "limits": "", "compute_weight": "", "priority": "", "labels": "",
                "preemptible": "", "pinned_host_memory": ""}
# Label names are Prometheus label names too; a Kubernetes pod name is at most 253 characters.
_LABEL_KEY = re.compile(r"^[a-z_]{1,63}$")
_LABEL_VALUE_MAX = 253
_LABELS_MAX = 16
_CONTROL_KEYS = ("admin_uids", "admin_groups", "readonly_uids", "readonly_groups")
# Each RM object costs the broker ~0.5 KiB: 2^24 of them would be 8 GiB.
_LIMIT_MAX = 1 << 24
_RATE_KEYS = {"requests_per_second": "", "burst": ""}


def _known_driver_versions() -> list[str]:
    try:
        from devbroker.abi import registry
    except ImportError:  # the ABI package is optional for validating a policy
        return []
    return list(registry.versions())


# ------------------------------------------------------------------------------ key → line
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'[^\']*\'')


class _KeyLines:
    """Where each key path is written: the line of `key =`, `[table]` or `[[array]]`.

    tomllib gives values without positions, so semantic errors are located by scanning the
    text: table headers set the current path (an array of tables adds its entry's index),
    `key = value` lines add to it, and one-line inline tables add their keys too. A path not
    found is looked up without its last part (e.g. a missing key reports its table).
    """

    def __init__(self, text: str):
        self.where: dict[tuple, int] = {}
        self._scan(text)

    def find(self, path: tuple) -> int | None:
        while path:
            if path in self.where:
                return self.where[path]
            path = path[:-1]
        return None

    def _note(self, path: tuple, line: int) -> None:
        self.where.setdefault(path, line)

    def _scan(self, text: str) -> None:
        table: tuple = ()
        arrays: dict[tuple, int] = {}  # array-of-tables path -> index of its last entry
        depth = 0  # open brackets of a multi-line value
        in_string = None  # the delimiter of an open multi-line string
        for lineno, raw in enumerate(text.splitlines(), 1):
            line = raw
            if in_string:
                if in_string in line:
                    line = line.split(in_string, 1)[1]
                    in_string = None
                else:
                    continue
            stripped = line.strip()
            if depth == 0 and stripped.startswith("["):
                is_array = stripped.startswith("[[")
                keys, _ = _parse_key(stripped, 2 if is_array else 1)
                path = self._resolve(tuple(keys), arrays)
                for n in range(1, len(path)):  # implicit parents: first header under them
                    self._note(path[:n], lineno)
                if is_array:
                    arrays[path] = arrays.get(path, -1) + 1
                    self._note(path, lineno)
                    path = path + (arrays[path],)
                self._note(path, lineno)
                table = path
                continue
            if depth == 0:
                keys, pos = _parse_key(line, 0)
                if keys and line[pos:].lstrip().startswith("="):
                    path = table + tuple(keys)
                    self._note(path, lineno)
                    value = line[pos:].lstrip()[1:]
                    self._inline(path, value, lineno)
                    line = value
                else:
                    continue
            for quote in ('"""', "'''"):
                if line.count(quote) % 2 == 1:
                    in_string = quote
                    line = line.split(quote, 1)[0]
            code = _STRINGS.sub("", line).split("#", 1)[0]
            depth = max(0, depth + code.count("[") + code.count("{") - code.count("]") - code.count("}"))

    def _resolve(self, keys: tuple, arrays: dict[tuple, int]) -> tuple:
        # [tenant.rate_limit] after [[tenant]] belongs to the last tenant entry.
        out: tuple = ()
        for k in keys:
            out = out + (k,)
            if out in arrays and out != keys:
                out = out + (arrays[out],)
        return out

    def _inline(self, path: tuple, value: str, lineno: int) -> None:
        code = _STRINGS.sub('""', value).split("#", 1)[0]
        if not code.strip().startswith("{"):
            return
        for m in re.finditer(r"[{,]\s*([A-Za-z0-9_-]+)\s*=", code):
            self._note(path + (m.group(1),), lineno)


def _parse_key(s: str, pos: int) -> tuple[list[str], int]:
    """A dotted TOML key at s[pos:] (bare, "basic" or 'literal' parts): (parts, end)."""
    keys: list[str] = []
    while True:
        while pos < len(s) and s[pos] in " \t":
            pos += 1
        if pos < len(s) and s[pos] in "\"'":
            q = s[pos]
            end = pos + 1
            while end < len(s) and s[end] != q:
                end += 2 if (q == '"' and s[end] == "\\") else 1
            part = s[pos + 1:end]
            if q == '"':
                part = part.encode().decode("unicode_escape") if "\\" in part else part
            keys.append(part)
            pos = end + 1
        else:
            m = _BARE_KEY.match(s, pos)
            if not m:
                return keys, pos
            keys.append(m.group(0))
            pos = m.end()
        while pos < len(s) and s[pos] in " \t":
            pos += 1
        if pos < len(s) and s[pos] == ".":
            pos += 1
            continue
        return keys, pos
