"""Policy loading: good files give the expected values; each class of error names its line."""
from __future__ import annotations

import textwrap

import pytest

from devbroker.broker.allow import CAPABILITIES, DEFAULT_CAPABILITIES
from devbroker.broker.limits import TenantLimits
from devbroker.broker.policy import (
    DEFAULT_RATE_LIMIT, ControlAccess, Policy, PolicyError, RateLimit, default_policy,
    format_size, load_policy, load_policy_text, parse_size,
)

GiB = 1 << 30

GPUS = """\
[broker]
backend = "emulated"
driver_version = "535.309.01"
audit_log = "/var/log/devbroker/audit.jsonl"

[[broker.gpu]]
name = "NVIDIA H200"
uuid = "GPU-00000000-0000-0000-0000-000000000000"
pci_bus_id = "0000:00:06.0"
memory = "141GiB"

[[broker.gpu]]
name = "NVIDIA H200"
uuid = "GPU-00000000-0000-0000-0000-000000000001"
pci_bus_id = "0000:00:07.0"
memory = 151397597184
"""
assert GPUS.count("\n") == 16  # the line numbers below count from here


def policy(tenants: str) -> Policy:
    return load_policy_text(GPUS + tenants, "t.toml")


def error(text: str, *, gpus: bool = True) -> PolicyError:
    with pytest.raises(PolicyError) as info:
        load_policy_text((GPUS if gpus else "") + textwrap.dedent(text), "t.toml")
    e = info.value
    assert str(e) == (f"t.toml, line {e.line}: {e.reason}" if e.line else f"t.toml: {e.reason}")
    return e


# ------------------------------------------------------------------------------ good files
def test_example_policy_loads():
    p = default_policy()
    assert p.broker.backend == "emulated"
    assert p.broker.driver_version == "535.309.01"
    assert [g.memory for g in p.broker.gpus] == [141 * GiB, 141 * GiB]
    assert [g.index for g in p.broker.gpus] == [0, 1]
    assert list(p.tenants) == ["alice", "bob"]
    assert (p.tenants["alice"].gpus, p.tenants["alice"].memory_quota) == ((0,), 16 * GiB)
    assert (p.tenants["bob"].gpus, p.tenants["bob"].memory_quota) == ((1,), 32 * GiB)


def test_good_file_values(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text(GPUS + textwrap.dedent("""
        [tenant.alice]
        gpus = [0, 1]
        memory_quota = "16GiB"
        capabilities = ["nvml"]
        rate_limit = { requests_per_second = 100.5, burst = 20 }
        uids = [1000, 1001]

        [tenant.bob]
        gpus = [1]
        memory_quota = 1073741824
    """))
    p = load_policy(path)
    assert p.source == str(path)
    b = p.broker
    assert b.audit_log == "/var/log/devbroker/audit.jsonl"
    assert b.gpus[1].memory == 151397597184
    assert b.gpus[1].pci_bus_id == "0000:00:07.0"
    alice = p.tenants["alice"]
    assert alice.gpus == (0, 1)
    assert alice.memory_quota == 16 * GiB
    assert alice.capabilities == ("nvml",)
    assert alice.rate_limit == RateLimit(100.5, 20)
    assert alice.uids == (1000, 1001)
    bob = p.tenants["bob"]
    assert bob.memory_quota == GiB
    assert bob.capabilities == tuple(DEFAULT_CAPABILITIES)  # absent: the default set
    # absent: every tenant is paced at the default rate, and holds at
    # most the default counts
    assert bob.rate_limit == DEFAULT_RATE_LIMIT and bob.uids is None
    assert bob.limits == TenantLimits()


def test_array_of_tables_form_and_defaults():
    p = load_policy_text(textwrap.dedent("""
        [[broker.gpu]]
        name = "G"
        uuid = "GPU-00000000-0000-0000-0000-00000000000a"
        pci_bus_id = "0000:01:00.0"
        memory = "80GB"

        [[tenant]]
        name = "carol"
        gpus = [0]
        memory_quota = "1.5GiB"
        rate_limit = { requests_per_second = 10 }
    """), "t.toml")
    assert p.broker.backend == "emulated" and p.broker.audit_log is None
    assert p.broker.gpus[0].memory == 80 * 10**9
    carol = p.tenants["carol"]
    assert carol.memory_quota == 3 * GiB // 2
    assert carol.rate_limit == RateLimit(10, 10)  # burst defaults to one second's worth


def test_real_backend_needs_no_gpu_list():
    p = load_policy_text('[broker]\nbackend = "real"\n[tenant.a]\ngpus = [3]\nmemory_quota = 0\n')
    assert p.broker.gpus == () and p.tenants["a"].gpus == (3,)


def test_policy_is_immutable():
    p = default_policy()
    with pytest.raises(AttributeError):
        p.broker = None  # type: ignore[misc]
    with pytest.raises(TypeError):
        p.tenants["eve"] = p.tenants["alice"]  # type: ignore[index]
    with pytest.raises(AttributeError):
        p.tenants["alice"].memory_quota = 1  # type: ignore[misc]


def test_to_toml_round_trips_and_describe():
    for p in (default_policy(), policy('[tenant.x]\ngpus = [0, 1]\nmemory_quota = 12345\nuids = [7]\n'
                                        'rate_limit = { requests_per_second = 2.5, burst = 3 }\n')):
        again = load_policy_text(p.to_toml(), "again")
        assert again == p
        assert again.to_toml() == p.to_toml()
    text = default_policy().describe()
    assert "tenant alice: GPUs 0; quota 16 GiB per GPU" in text
    assert "141 GiB" in text


def test_capability_names_come_from_the_allowlist():
    assert set(DEFAULT_CAPABILITIES) <= set(CAPABILITIES)
    names = sorted(CAPABILITIES)
    p = policy(f'[tenant.a]\ngpus = [0]\nmemory_quota = 0\ncapabilities = {names!r}\n'.replace("'", '"'))
    assert set(p.tenants["a"].capabilities) == set(names)


@pytest.mark.parametrize("text,expected", [
    (0, 0), (17179869184, 16 * GiB), ("16GiB", 16 * GiB), ("16 GiB", 16 * GiB),
    ("512MiB", 512 << 20), ("1.5GiB", 3 * GiB // 2), ("80GB", 80 * 10**9), ("4096", 4096),
    ("10B", 10), ("2TiB", 2 << 40), ("3kB", 3000),
])
def test_sizes(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["-1GiB", -1, "16G", "16 gigs", "1.3B", True, 1.5, "", "GiB"])
def test_bad_sizes(bad):
    with pytest.raises(ValueError):
        parse_size(bad)


def test_format_size():
    assert format_size(141 * GiB) == "141 GiB"
    assert format_size(1536 << 20) == "1536 MiB"
    assert format_size(1000) == "1000 B"


# ------------------------------------------------------------------------------ errors
def test_syntax_error_has_tomllib_line():
    e = error("""
        [tenant.a]
        gpus = [0]
        memory_quota = "1GiB" x
    """)
    assert e.line == 20 and e.reason.startswith("TOML syntax")


def test_unclosed_array_names_the_line_that_opened_it():
    # tomllib notices the missing ] at the next key (line 20): the mistake is on line 19
    e = error("""
        [tenant.a]
        gpus = [0
        memory_quota = "1GiB"
    """)
    assert (e.line, e.reason) == (19, "TOML syntax: Unclosed array")
    # an open array that runs on into the next key's line: tomllib says "Invalid value" there
    e = error("""
        [tenant.a]
        name = "not [ an array"   # nor [ this
        gpus = [0,
          1,

        memory_quota = "1GiB"
    """)
    assert e.line == 20 and "not closed before line 23" in e.reason, e
    # a bad value inside a multi-line array stays where it is
    e = error("""
        [tenant.a]
        gpus = [0,
          x,
        ]
    """)
    assert (e.line, e.reason) == (20, "TOML syntax: Invalid value")


def test_duplicate_tenant_table():
    e = error("""
        [tenant.a]
        gpus = [0]
        memory_quota = 1

        [tenant.a]
        gpus = [1]
        memory_quota = 1
    """)
    assert e.line == 22 and "TOML syntax" in e.reason


def test_duplicate_tenant_entry():
    e = error("""
        [[tenant]]
        name = "a"
        gpus = [0]
        memory_quota = 1

        [[tenant]]
        name = "a"
        gpus = [1]
        memory_quota = 1
    """)
    assert (e.line, e.reason) == (24, "duplicate tenant 'a'")


def test_unknown_key_in_tenant():
    e = error("""
        [tenant.alice]
        gpus = [0]
        memory_qouta = "1GiB"
    """)
    assert e.line == 20
    assert e.reason.startswith("unknown key 'memory_qouta' in tenant 'alice'")


def test_unknown_key_in_broker_and_top_level():
    e = error('[broker]\nbackend = "emulated"\ndriver = "535.309.01"\n', gpus=False)
    assert (e.line, e.reason.split(" (")[0]) == (3, "unknown key 'driver' in [broker]")
    e = error('\n\n[tenants.a]\ngpus = [0]\n')
    assert e.line == 19 and "unknown key 'tenants'" in e.reason


def test_unknown_key_in_gpu_and_inline_rate_limit():
    text = GPUS.replace('memory = "141GiB"', 'memory = "141GiB"\nmemroy = 1')
    with pytest.raises(PolicyError) as info:
        load_policy_text(text, "t.toml")
    assert info.value.line == 11 and "unknown key 'memroy'" in info.value.reason
    e = error("""
        [tenant.a]
        gpus = [0]
        memory_quota = 1
        rate_limit = { requests_per_second = 5, brust = 2 }
    """)
    assert e.line == 21 and "unknown key 'brust' in rate_limit" in e.reason


def test_gpu_index_not_on_broker():
    e = error("""
        [tenant.a]
        memory_quota = 1
        gpus = [0, 2]
    """)
    assert (e.line, e.reason) == (20, "GPU 2 is not one of the broker's GPUs (0..1)")


def test_negative_quota():
    e = error("""
        [tenant.a]
        gpus = [0]
        memory_quota = -1
    """)
    assert e.line == 20 and "must not be negative" in e.reason
    e = error("""
        [tenant.a]
        gpus = [0]
        memory_quota = "-2GiB"
    """)
    assert e.line == 20 and "must not be negative" in e.reason


def test_quota_larger_than_gpu():
    e = error("""
        [tenant.a]
        gpus = [0]
        memory_quota = "200GiB"
    """)
    assert (e.line, e.reason) == (20, "memory_quota 200 GiB exceeds GPU 0's 141 GiB")


def test_bad_unit_and_type():
    e = error("""
        [tenant.a]
        gpus = [0]
        memory_quota = "16G"
    """)
    assert e.line == 20 and "unknown unit 'G'" in e.reason
    e = error("""
        [tenant.a]
        gpus = "0"
        memory_quota = 1
    """)
    assert e.line == 19 and "gpus must be an array of integers" in e.reason


def test_unknown_capability():
    e = error("""
        [tenant.a]
        gpus = [0]
        memory_quota = 1
        capabilities = ["nvml", "profiling"]
    """)
    assert e.line == 21 and e.reason.startswith("unknown capability 'profiling'")


def test_missing_required_key_points_at_the_table():
    e = error("""
        # a comment
        [tenant.a]
        gpus = [0]
    """)
    assert (e.line, e.reason) == (19, "tenant 'a' needs 'memory_quota'")


def test_broker_errors():
    e = error('[broker]\nbackend = "cuda"\n', gpus=False)
    assert (e.line, e.reason) == (2, "backend must be one of emulated, real, not 'cuda'")
    e = error('[broker]\n\n\ndriver_version = "999.1.2"\n', gpus=False)
    assert e.line == 4 and "driver_version '999.1.2'" in e.reason
    dup = GPUS.replace("000000000001", "000000000000")
    with pytest.raises(PolicyError) as info:
        load_policy_text(dup, "t.toml")
    assert info.value.line == 14  # the second GPU's uuid line
    assert info.value.reason == "GPU 1 has the same uuid as GPU 0"
    bad_bus = GPUS.replace("0000:00:07.0", "00:07.0")
    with pytest.raises(PolicyError) as info:
        load_policy_text(bad_bus, "t.toml")
    assert info.value.line == 15 and "pci_bus_id" in info.value.reason


def test_rate_limit_and_uids_errors():
    e = error("""
        [tenant.a]
        gpus = [0]
        memory_quota = 1
        rate_limit = { requests_per_second = 0 }
    """)
    assert e.line == 21 and "above 0" in e.reason
    e = error("""
        [tenant.a]
        gpus = [0]
        memory_quota = 1
        uids = []
    """)
    assert e.line == 21 and "admits nobody" in e.reason
    e = error("""
        [tenant.a]
        gpus = [0, 0]
        memory_quota = 1
    """)
    assert (e.line, e.reason) == (19, "gpus lists 0 twice")


def test_limits_and_control_access_load_round_trip_and_errors():
    p = load_policy_text(GPUS + textwrap.dedent("""
        [tenant.a]
        gpus = [0]
        memory_quota = 1
        limits = { open_files = 64, rm_objects = 1000 }

        [control]
        admin_uids = [1000]
        readonly_uids = [1001, 1002]
        readonly_groups = [27]
    """), "t.toml")
    a = p.tenants["a"]
    assert a.limits == TenantLimits(open_files=64, rm_clients=TenantLimits().rm_clients,
                                    rm_objects=1000)
    assert p.control == ControlAccess(admin_uids=(1000,), readonly_uids=(1001, 1002),
                                      readonly_groups=(27,))
    assert p.control.opens_socket() and not ControlAccess().opens_socket()
    assert load_policy_text(p.to_toml()) == p
    assert "at most 64 open files" in p.describe()
    e = error("""
        [tenant.a]
        gpus = [0]
        memory_quota = 1
        limits = { open_files = 0 }
    """)
    assert e.line == 21 and "limits.open_files must be at least 1" in e.reason
    e = error("""
        [tenant.a]
        gpus = [0]
        memory_quota = 1
        limits = { rm_object = 5 }
    """)
    assert e.line == 21 and "unknown key 'rm_object' in limits" in e.reason
    e = error("""
        [tenant.a]
        gpus = [0]
        memory_quota = 1

        [control]
        readonly_uids = [0]
    """)
    assert e.line == 23 and "root is always admin" in e.reason
    e = error("""
        [tenant.a]
        gpus = [0]
        memory_quota = 1

        [control]
        admins = [5]
    """)
    assert e.line == 23 and "unknown key 'admins' in [control]" in e.reason


def test_subtable_under_array_of_tables_is_located():
    e = error("""
        [[tenant]]
        name = "a"
        gpus = [0]
        memory_quota = 1

        [[tenant]]
        name = "b"
        gpus = [1]
        memory_quota = 1
        [tenant.rate_limit]
        requests_per_second = -3
    """)
    assert e.line == 28 and "above 0" in e.reason


def test_bad_tenant_name():
    e = error("""
        [tenant."../etc"]
        gpus = [0]
        memory_quota = 1
    """)
    assert e.line == 18 and "tenant name '../etc'" in e.reason


def test_unreadable_file(tmp_path):
    with pytest.raises(PolicyError) as info:
        load_policy(tmp_path / "missing.toml")
    assert info.value.file.endswith("missing.toml") and info.value.line is None


#-------------------------------------------------------------------- metrics and alerts
TENANT = '\n[tenant.a]\ngpus = [0]\nmemory_quota = "1GiB"\n'


def test_metrics_and_alerts_defaults_and_values():
    p = policy(TENANT)
    assert p.broker.metrics is None  # no endpoint unless the policy asks for one
    a = p.broker.alerts
    assert (a.quota_percent, a.refusals_per_minute, a.escape_attempts, a.escape_window) == \
        (90.0, 120, 3, 600)
    p = policy('[broker.metrics]\nlisten = "127.0.0.1:9464"\n\n[broker.alerts]\n'
               'quota_percent = 80.5\nrefusals_per_minute = 0\nescape_attempts = 1\n'
               'escape_window = 60\n' + TENANT)
    m = p.broker.metrics
    assert (m.host, m.port, m.allow_remote, m.listen) == ("127.0.0.1", 9464, False,
                                                          "127.0.0.1:9464")
    a = p.broker.alerts
    assert (a.quota_percent, a.refusals_per_minute, a.escape_attempts, a.escape_window) == \
        (80.5, 0, 1, 60)
    assert load_policy_text(p.to_toml()) == p
    assert "metrics: 127.0.0.1:9464" in p.describe()
    for listen, host in (("localhost:1", "127.0.0.1"), ("[::1]:9464", "::1"),
                         ("127.0.0.2:0", "127.0.0.2")):
        m = policy(f'[broker.metrics]\nlisten = "{listen}"\n' + TENANT).broker.metrics
        assert m.host == host
        assert load_policy_text(policy(f'[broker.metrics]\nlisten = "{listen}"\n'
                                       + TENANT).to_toml()).broker.metrics == m
    m = policy('[broker.metrics]\nlisten = "0.0.0.0:9464"\nallow_remote = true\n'
               + TENANT).broker.metrics
    assert (m.host, m.allow_remote) == ("0.0.0.0", True)


@pytest.mark.parametrize("body, line, reason", [
    ('listen = "0.0.0.0:9464"', 18, "reachable from other hosts; the endpoint has no "
                                    "authentication"),
    ('listen = "[2001:db8::1]:9464"', 18, "reachable from other hosts"),
    ('listen = "metrics.example:9464"', 18, "needs an IP address"),
    ('listen = "127.0.0.1"', 18, "must be ADDRESS:PORT"),
    ('listen = "127.0.0.1:70000"', 18, "not a TCP port"),
    ('listen = 9464', 18, "listen must be a string"),
    ('allow_remote = true', 17, "needs listen"),
    ('listen = "127.0.0.1:1"\nallow_remote = "yes"', 19, "allow_remote must be true or false"),
    ('listen = "127.0.0.1:1"\nport = 3', 19, "unknown key 'port' in [broker.metrics]"),
])
def test_metrics_errors(body, line, reason):
    e = error("[broker.metrics]\n" + body + "\n")
    assert e.line == line and reason in e.reason


@pytest.mark.parametrize("body, line, reason", [
    ("quota_percent = 101", 18, "from 0 (off) to 100"),
    ("quota_percent = true", 18, "from 0 (off) to 100"),
    ("refusals_per_minute = -1", 18, "at least 0"),
    ("escape_attempts = 1.5", 18, "must be an integer"),
    ("escape_window = 0", 18, "at least 1"),
    ("quota = 90", 18, "unknown key 'quota' in [broker.alerts]"),
])
def test_alert_errors(body, line, reason):
    e = error("[broker.alerts]\n" + body + "\n")
    assert e.line == line and reason in e.reason


def test_pinned_host_memory_defaults_round_trips_and_is_validated():
    from devbroker.broker.policy import DEFAULT_PINNED_HOST_MEMORY, PolicyError, load_policy_text
    from devbroker.testing.policies import one_h200, tenant

    p = load_policy_text(one_h200(tenant("a", pinned_host_memory="1GiB"), tenant("b"),
                                  driver_version=None))
    assert p.tenants["a"].pinned_host_memory == 1 << 30
    assert p.tenants["b"].pinned_host_memory == DEFAULT_PINNED_HOST_MEMORY == 16 << 30
    assert load_policy_text(p.to_toml()) == p
    assert "pinned host memory 1 GiB" in p.describe()
    with pytest.raises(PolicyError, match="pinned_host_memory"):
        load_policy_text(one_h200(tenant("a", pinned_host_memory="lots"), driver_version=None))
