"""Policy texts for tests, benchmarks and harnesses: emulated H200s and tenants, built here
once instead of a TOML copy in every file.

    two_h200(tenant("alice", gpus=[0]), tenant("bob", gpus=[1], memory_quota="32GiB"))

gives the [broker] table with two emulated H200s (PCI 0000:00:06.0 and 0000:00:07.0, the
emulator's GPU ids 0x6 and 0x7) followed by the tenants. `h200s(n, ...)` is the same with
n GPUs; every function returns TOML text for broker.policy.load_policy_text.
"""
from __future__ import annotations

import json
from typing import Any

# The emulated GPUs' UUIDs, by index (tests look for them in nvidia-smi's output).
UUIDS = ("GPU-11111111-2222-3333-4444-555555555555",
         "GPU-66666666-7777-8888-9999-000000000000")
DRIVER_VERSION = "580.159.04"


def toml_value(v: Any) -> str:
    """A Python value as TOML: str, bool, int, float, list, dict (an inline table)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a TOML basic string for what tests use (no control chars)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(f"no TOML for {type(v).__name__}")


def broker_table(*, backend: str = "emulated", driver_version: str | None = DRIVER_VERSION,
                 metrics: str | None = None, extra: str = "") -> str:
    """[broker] (and [broker.metrics] when `metrics` is a listen address). `extra`: more
    lines of the [broker] table."""
    out = ["[broker]", f"backend = {toml_value(backend)}"]
    if driver_version is not None:
        out.append(f"driver_version = {toml_value(driver_version)}")
    if extra:
        out.append(extra.strip("\n"))
    if metrics is not None:
        out += ["", "[broker.metrics]", f"listen = {toml_value(metrics)}"]
    return "\n".join(out) + "\n"


def h200s(n: int = 2, *, uuids: tuple[str, ...] = UUIDS, memory: str = "141GiB",
          **broker) -> str:
    """The [broker] table (keywords: broker_table's) and n emulated H200s."""
    out = [broker_table(**broker)]
    for i in range(n):
        uuid = uuids[i] if i < len(uuids) else f"GPU-00000000-0000-4000-8000-{i:012x}"
        out.append(f"[[broker.gpu]]\nname = \"NVIDIA H200\"\nuuid = {toml_value(uuid)}\n"
                   f"pci_bus_id = \"0000:00:{6 + i:02x}.0\"\nmemory = {toml_value(memory)}\n")
    return "\n".join(out)


def tenant(name: str, *, gpus: list[int] | tuple[int, ...] = (0,),
           memory_quota: str = "16GiB", **keys: Any) -> str:
    """A [tenant.NAME] table: its GPUs, quota and any other policy keys (capabilities,
    uids, rate_limit as a dict, limits as a dict, pinned_host_memory, ...)."""
    out = [f"[tenant.{name}]", f"gpus = {toml_value(list(gpus))}",
           f"memory_quota = {toml_value(memory_quota)}"]
    out += [f"{k} = {toml_value(v)}" for k, v in keys.items()]
    return "\n".join(out) + "\n"


def one_h200(*tenants: str, **kw: Any) -> str:
    """One emulated H200 and the given tenant tables."""
    return "\n".join([h200s(1, **kw), *tenants])


def two_h200(*tenants: str, **kw: Any) -> str:
    """Two emulated H200s and the given tenant tables (default: alice on GPU 0 and bob on
    GPU 1, 16 GiB each)."""
    if not tenants:
        tenants = (tenant("alice", gpus=[0]), tenant("bob", gpus=[1]))
    return "\n".join([h200s(2, **kw), *tenants])
