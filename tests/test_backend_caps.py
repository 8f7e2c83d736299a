"""What a backend offers is said by its class (backends/base.py Backend), not guessed from
its name or probed with getattr."""
import re
from pathlib import Path

import pytest

from devbroker.backends.base import Backend
from devbroker.backends.emulated import EmulatedBackend
from devbroker.backends.real import RealBackend

SRC = Path(__file__).resolve().parents[1] / "src" / "devbroker"

# The documented capabilities and each backend's value (what the code above did by name).
CAPS = {
    "host_proc": {EmulatedBackend: False, RealBackend: True},
    "tenant_files": {EmulatedBackend: False, RealBackend: True},
    "reports_tenant_pids": {EmulatedBackend: True, RealBackend: False},
    "counts_process_memory": {EmulatedBackend: False, RealBackend: True},
    "handover_format": {EmulatedBackend: "emulated", RealBackend: "real"},
}
METHODS = ("gpus", "open", "close", "ioctl", "ioctl_blocking", "map_read",
           "gpu_index_of_instance", "memory_in_use", "prepare_tenant_files", "stop",
           "can_run_control", "control_is_plain_ioctl", "run_control")


def test_protocol_lists_the_capabilities():
    declared = set(Backend.__annotations__) - {"name", "version", "memblock_size",
                                               "relayed_here",  # (a counter)
                                               "checkpointer"}  # (an executor, below)
    assert declared == set(CAPS)


@pytest.mark.parametrize("cls", [EmulatedBackend, RealBackend])
def test_each_backend_class_says_what_it_offers(cls):
    for cap, values in CAPS.items():
        assert cap in vars(cls), f"{cls.__name__} does not say {cap}"
        assert getattr(cls, cap) == values[cls], cap
    for m in METHODS:
        assert callable(getattr(cls, m, None)), f"{cls.__name__}.{m}"
    assert callable(getattr(cls, "process_vidmem", None)) == cls.counts_process_memory
    assert callable(getattr(cls, "process_vidmem_many", None)) == cls.counts_process_memory


def test_emulated_instance():
    b = EmulatedBackend()
    assert hasattr(b, "memblock_size")  # int or None (the host's, where readable)
    assert b.memory_in_use() is b.used
    assert b.gpu_index_of_instance(0) == 0 and b.gpu_index_of_instance(99) is None
    b.prepare_tenant_files()
    b.stop()
    # Class attributes: the hand-over's list of the instance's state is unchanged.
    assert not set(CAPS) & set(vars(b))


def test_real_memory_in_use_is_the_drivers():
    assert RealBackend.memory_in_use(RealBackend.__new__(RealBackend)) is None


def test_no_name_checks_or_getattr_probes_of_the_backend():
    bad = re.compile(r"backend\.name\s*(==|!=|not in|in)\s|getattr\([^)]*backend\b[^)]*,")
    found = []
    for p in SRC.rglob("*.py"):
        if p.parent.name == "backends":  # a backend reading its own state
            continue
        for i, line in enumerate(p.read_text().splitlines(), 1):
            if bad.search(line) and "getattr(broker, \"backend\"" not in line:
                found.append(f"{p.relative_to(SRC)}:{i}: {line.strip()}")
    assert not found, "\n".join(found)


@pytest.mark.parametrize("cls", [EmulatedBackend, RealBackend])
def test_each_backend_has_a_checkpointer(cls):
    """Preemption asks `backend.checkpointer` (backends/checkpoint.py); one without the
    driver's API says why instead of lacking the attribute."""
    ck = cls().checkpointer if cls is EmulatedBackend else cls.checkpointer
    assert isinstance(ck.supported, bool) and isinstance(ck.why, str)
    for m in ("state", "lock", "checkpoint", "restore", "unlock"):
        assert callable(getattr(ck, m, None)), m
