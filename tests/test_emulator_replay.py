"""The emulated driver against the real one.

1. Differential replay: every call of the recorded real sessions (tests/data: pynvml and
   PyTorch on the H200, the project's shared traces, and the broker's recording of the H200
   relay run) is sent to an emulator configured as the recorded machine; every answer that
   differs (errno, status, any data field) must be explained by an entry of
   testing/emulated_parity.py, and every entry must still explain something. A broken
   emulator is caught (the replay is checked to fail on one).
2. NV_ESC_CHECK_VERSION_STR as RmPerformVersionCheck answers it: QUERY ('2') gets the version
   string and RECOGNIZED, RELAXED ('1') compares up to the first '.', a mismatch is EINVAL
   with RECOGNIZED and the driver's version; through the broker as a client sends it.
3. docs/emulator.md carries the table the replay uses.
"""
from __future__ import annotations

import errno
from pathlib import Path

import pytest

from devbroker.abi import nvtrace, registry
from devbroker.abi import status as nvs
from devbroker.abi.nodes import NodeKind
from devbroker.testing import emulated_parity as parity
from devbroker.backends.base import DriverCall
from devbroker.backends.emulated import CONTROL_HANDLERS, EmulatedBackend, EmulatedGpu
from devbroker.testing.replay import Replay, explain, recorded_gpus, summarize

DATA = Path(__file__).parent / "data"
RECORDINGS = sorted(DATA.glob("h200-*.nvtrace"))
V580 = "580.159.04"
ABI = registry.get(V580)


async def _replay(path: Path, backend_cls=EmulatedBackend):
    recs = nvtrace.read_file(str(path))
    gpus = recorded_gpus(recs, ABI)
    backend = backend_cls([EmulatedGpu(index=i, **g) for i, g in enumerate(gpus)],
                          notice=lambda m: None)
    rp = Replay(backend, ABI)
    diffs = await rp.run(recs)
    return rp, diffs


async def test_recorded_sessions_replay_with_every_difference_explained():
    assert len(RECORDINGS) == 3, RECORDINGS
    used_all: set = set()
    total_calls = 0
    for path in RECORDINGS:
        rp, diffs = await _replay(path)
        total_calls += sum(rp.calls.values())
        used, left = explain(diffs, parity.EXPECTED, parity.covers)
        assert not left, f"{path.name}: differences nothing explains:\n" + "\n".join(
            summarize(left))
        used_all |= set(used)
    stale = [f"{e.call} / {e.what}" for e in parity.EXPECTED if e not in used_all]
    assert not stale, f"entries that explain nothing any more: {stale}"
    assert total_calls > 2800


async def test_the_replay_answers_match_where_the_emulator_models_the_call():
    """The modelled calls of the pynvml session answer exactly as the H200 did, field for
    field, apart from the listed facts of the machine (none for these)."""
    rp, diffs = await _replay(DATA / "h200-580.159.04-nvml.nvtrace")
    exact = {"RM_CONTROL NV0000_CTRL_CMD_GPU_GET_ATTACHED_IDS",
             "RM_CONTROL NV0000_CTRL_CMD_GPU_GET_ID_INFO_V2",
             "RM_CONTROL NV2080_CTRL_CMD_GPU_GET_GID_INFO",
             "RM_CONTROL NV2080_CTRL_CMD_GPU_GET_NAME_STRING",
             "RM_CONTROL NV2080_CTRL_CMD_BUS_GET_PCI_INFO",
             "RM_CONTROL NV2080_CTRL_CMD_MC_GET_ARCH_INFO",
             "NV_ESC_CHECK_VERSION_STR", "RM_ALLOC NV01_DEVICE_0", "RM_ALLOC NV20_SUBDEVICE_0",
             "RM_ALLOC NV01_ROOT"}
    assert exact <= set(rp.calls), exact - set(rp.calls)
    assert not [d for d in diffs if d.call in exact]


async def test_a_wrong_answer_is_caught(monkeypatch):
    """The replay is able to fail: an emulator that reports a wrong GPU id is caught, and no
    entry of the table excuses it."""
    from devbroker.backends import emulated_controls

    def wrong_ids(backend, client, obj, p):
        return nvs.NV_OK, p.replace(gpuIds=[0x7] + [0xFFFFFFFF] * (len(p.gpuIds) - 1))

    monkeypatch.setitem(CONTROL_HANDLERS, 0x201, wrong_ids)
    assert emulated_controls.get_attached_ids is not wrong_ids
    _rp, diffs = await _replay(DATA / "h200-580.159.04-nvml.nvtrace")
    _used, left = explain(diffs, parity.EXPECTED, parity.covers)
    assert left and {(d.call, d.what, d.real, d.emulated) for d in left} == {
        ("RM_CONTROL NV0000_CTRL_CMD_GPU_GET_ATTACHED_IDS", "field gpuIds[0]", 6, 7)}


# ---------------------------------------------------------------- CHECK_VERSION_STR
def _version_call(cmd: int, text: bytes):
    from devbroker.abi import iowr

    spec = ABI.struct("nv_ioctl_rm_api_version_t")
    v = spec.zero().replace(cmd=cmd, versionString=text.ljust(64, b"\0"))
    return ABI.decode_ioctl(NodeKind.CTL, iowr(210, spec.size), v.encode())


async def _ask(backend, cmd, text):
    f = backend.open(NodeKind.CTL, 0)
    res = await backend.ioctl(f, DriverCall(_version_call(cmd, text)))
    out = ABI.struct("nv_ioctl_rm_api_version_t").decode(res.arg)
    return res.errno, out.reply, bytes(out.versionString).split(b"\0", 1)[0]


@pytest.mark.parametrize("cmd,text,want", [
    (ord("2"), b"", (0, 1, b"580.159.04")),  # QUERY: the version, whatever was sent
    (ord("2"), b"999.1", (0, 1, b"580.159.04")),
    (0, b"580.159.04", (0, 1, b"580.159.04")),  # STRICT, equal
    (0, b"535.309.01", (0, 1, b"535.309.01")),  # another version the emulator speaks
    (0, b"580.159", (errno.EINVAL, 1, b"580.159.04")),  # STRICT, not equal
    (ord("1"), b"580.1.2", (0, 1, b"580.1.2")),  # RELAXED: equal through the first '.'
    (ord("1"), b"581.159.04", (errno.EINVAL, 1, b"580.159.04")),
    (0x33, b"580.159.04", (0, 1, b"580.159.04")),  # another cmd compares strictly
])
async def test_check_version_str_answers_as_the_driver(cmd, text, want):
    assert await _ask(EmulatedBackend(), cmd, text) == want


async def test_version_query_through_the_broker():
    """An NVML-style client's version check: cmd '2' through the broker core gets the
    version and RECOGNIZED, not EINVAL."""
    from test_record import POLICY, Tenant

    from devbroker.broker.core import Broker
    from devbroker.broker.policy import load_policy_text

    t = Tenant(Broker(load_policy_text(POLICY, "test"), EmulatedBackend()))
    ctl = await t.open(NodeKind.CTL)
    rep, out, _ = await t.esc(ctl, "NV_ESC_CHECK_VERSION_STR", t.new(
        "nv_ioctl_rm_api_version_t", cmd=ord("2")))
    assert rep.errno == 0 and out.reply == 1
    assert bytes(out.versionString).split(b"\0", 1)[0] == b"580.159.04"


def test_docs_carry_the_table_of_differences():
    doc = (Path(__file__).resolve().parents[1] / "docs" / "emulator.md").read_text()
    assert parity.explanations_markdown() in doc, (
        "docs/emulator.md is out of date: paste `devbroker trace replay --explain`")
