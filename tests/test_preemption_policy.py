"""The policy's side of priority preemption (docs/preemption.md): `preemptible` per tenant
and the [broker.preemption] section, validated with line and reason."""
from __future__ import annotations

import textwrap

import pytest

from devbroker.broker.policy import PolicyError, PreemptionConfig, load_policy_text

GiB = 1 << 30

HEAD = """\
[broker]
backend = "emulated"
driver_version = "580.159.04"

[[broker.gpu]]
name = "NVIDIA H200"
uuid = "GPU-00000000-0000-0000-0000-000000000000"
pci_bus_id = "0000:00:06.0"
memory = "8GiB"
"""


def load(text: str):
    return load_policy_text(HEAD + textwrap.dedent(text), "p.toml")


def error(text: str) -> PolicyError:
    with pytest.raises(PolicyError) as info:
        load(text)
    return info.value


def test_defaults_are_off_and_not_preemptible():
    p = load("""
        [tenant.a]
        gpus = [0]
        memory_quota = "1GiB"
    """)
    assert p.broker.preemption == PreemptionConfig()
    assert not p.broker.preemption.enabled
    assert p.broker.preemption.host_memory == 64 * GiB
    assert not p.tenants["a"].preemptible
    assert "preemption: off" in p.describe()


def test_values_round_trip_through_toml():
    p = load("""
        [broker.preemption]
        enabled = true
        host_memory = "16GiB"
        wait = 5
        lock_timeout = 2.5

        [tenant.low]
        gpus = [0]
        memory_quota = "4GiB"
        priority = "low"
        preemptible = true
    """)
    pre = p.broker.preemption
    assert (pre.enabled, pre.host_memory, pre.wait, pre.lock_timeout) == (True, 16 * GiB, 5.0, 2.5)
    assert p.tenants["low"].preemptible
    assert load_policy_text(p.to_toml(), "again.toml") == p
    assert "priority low, preemptible" in p.describe()
    assert "preemption: on" in p.describe()


@pytest.mark.parametrize("line, reason", [
    ("enabled = 1", "enabled must be true or false, not an integer"),
    ('host_memory = "lots"', "host_memory:"),
    ("host_memory = 0", "host_memory = 0 lets no checkpoint be taken"),
    ("wait = 0", "wait must be a number of seconds from 0.1 to 3600"),
    ('wait = "30s"', "wait must be a number of seconds"),
    ("lock_timeout = 1e9", "lock_timeout must be a number of seconds from 0.1 to 600"),
    ("timeout = 3", "unknown key 'timeout' in [broker.preemption]"),
])
def test_bad_section_names_line_and_reason(line, reason):
    e = error(f"""
        [broker.preemption]
        {line}
    """)
    assert e.line == 12 and reason in e.reason, (e.line, e.reason)


def test_bad_preemptible():
    e = error("""
        [tenant.a]
        gpus = [0]
        memory_quota = 1
        preemptible = "yes"
    """)
    assert (e.line, e.reason) == (14, "preemptible must be true or false, not a string")
