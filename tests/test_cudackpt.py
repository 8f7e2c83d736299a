"""The real backend's checkpoint executor (backends/cudackpt.py) and its helper program
(devbroker.tools.cudackpt) against a stand-in libcuda built here with gcc
(tests/data/cudackpt_standin.c): real helper processes, a real dlopen, real calls with the
argument blocks read back by the library; no GPU needed. What the real driver does is in
docs/preemption-driver.md (measured on the H200)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from devbroker.backends.checkpoint import CheckpointError, GpuPair
from devbroker.backends.cudackpt import SRC, CudaCheckpointer
from devbroker.backends.real import RealBackend

STANDIN = Path(__file__).resolve().parent / "data" / "cudackpt_standin.c"
OLD = "GPU-b9606f9b-f266-e351-1a0c-4202e8109efb"
NEW = "GPU-00112233-4455-6677-8899-aabbccddeeff"


def _build(out: Path, *flags: str) -> str:
    if not shutil.which("gcc"):
        pytest.skip("gcc not installed")
    subprocess.run(["gcc", "-shared", "-fPIC", "-Wall", "-Werror", *flags, "-o", out, STANDIN],
                   check=True)
    return str(out)


@pytest.fixture(scope="module")
def libs(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("standin")
    return {"new": _build(d / "libcuda-standin.so"),
            "old": _build(d / "libcuda-old.so", "-DOLD_DRIVER")}


@pytest.fixture
def script(monkeypatch, tmp_path):
    """script(OP=ANSWER,..., state=N): the stand-in's answers; returns the call log's path."""
    log = tmp_path / "calls.log"
    monkeypatch.setenv("STANDIN_LOG", str(log))

    def set_(text: str = "", state: int = 0) -> Path:
        monkeypatch.setenv("STANDIN_SCRIPT", text)
        monkeypatch.setenv("STANDIN_STATE", str(state))
        return log
    set_()
    return set_


def calls(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def helper(*args: str, env: dict | None = None) -> tuple[int, dict]:
    e = dict(os.environ, PYTHONPATH=SRC, **(env or {}))
    r = subprocess.run([sys.executable, "-m", "devbroker.tools.cudackpt", *args],
                       capture_output=True, text=True, env=e, timeout=60)
    return r.returncode, json.loads(r.stdout.strip().splitlines()[-1])


def test_every_operation_reaches_the_library_with_its_arguments(libs, script):
    log = script(state=2)
    cp = CudaCheckpointer(library=libs["new"])
    assert cp.supported, cp.why
    assert "13000" in cp.why
    assert cp.state(4242, 30) == "checkpointed"
    cp.lock(4242, 30)
    cp.checkpoint(4242, 30)
    cp.restore(4242, (), 30)
    cp.restore(4242, (GpuPair(OLD, NEW),), 30)
    cp.unlock(4242, 30)
    got = [line.split(" helper=")[0] + " " + line.split(" ", 3)[-1] for line in calls(log)]
    assert got == [
        "state pid=4242 ",
        # the lock carries the driver's own timeout, under the deadline by the helper's start
        "lock pid=4242 timeout=29000 reserved=0",
        "checkpoint pid=4242 reserved=0",
        "init pid=0 ",  # cuInit before a restore (the driver asks for it, or persistence mode)
        "restore pid=4242 count=0 reserved=0",
        "init pid=0 ",
        "restore pid=4242 count=1 reserved=0 "
        "b9606f9bf266e3511a0c4202e8109efb=00112233445566778899aabbccddeeff",
        "unlock pid=4242 reserved=0",
    ]


@pytest.mark.parametrize("state,name", [(0, "running"), (1, "locked"), (3, "failed"),
                                        (5, "restoring")])
def test_states_by_name(libs, script, state, name):
    script(state=state)
    assert CudaCheckpointer(library=libs["new"]).state(7, 30) == name


@pytest.mark.parametrize("op,code,words", [
    ("lock", 800, "lock of process 99 failed: CUDA_ERROR_NOT_PERMITTED (800): the driver refused"),
    ("checkpoint", 801, "checkpoint of process 99 failed: CUDA_ERROR_NOT_SUPPORTED (801): "
                        "the process uses what the driver cannot checkpoint"),
    ("restore", 2, "restore of process 99 failed: CUDA_ERROR_OUT_OF_MEMORY (2): the GPU lacks "
                   "the room"),
    ("unlock", 401, "unlock of process 99 failed: CUDA_ERROR_ILLEGAL_STATE (401)"),
    ("state", 3, "state of process 99 failed: CUDA_ERROR_NOT_INITIALIZED (3): the process has "
                 "no CUDA state"),
    ("lock", 12345, "lock of process 99 failed: CUresult 12345 (12345)"),
])
def test_driver_errors_become_one_line(libs, script, op, code, words):
    script(f"{op}={code}")
    cp = CudaCheckpointer(library=libs["new"])
    with pytest.raises(CheckpointError) as e:
        if op == "restore":
            cp.restore(99, (), 30)
        else:
            getattr(cp, op)(99, 30)
    assert str(e.value).startswith(words)
    assert "\n" not in str(e.value)


def test_a_hung_call_is_killed_at_the_deadline(libs, script):
    log = script("lock=hang")
    cp = CudaCheckpointer(library=libs["new"])
    with pytest.raises(CheckpointError) as e:
        cp.lock(4242, 5.0)
    assert str(e.value).startswith("lock of process 4242 did not finish within 5 s; the helper "
                                   "was killed")
    (line,) = calls(log)
    helper_pid = int(line.split("helper=")[1].split()[0])
    with pytest.raises(ProcessLookupError):  # killed and reaped, not left behind
        os.kill(helper_pid, 0)
    # the next operation runs normally
    script()
    cp.unlock(4242, 30)
    assert calls(log)[-1].startswith("unlock pid=4242")


def test_an_old_driver_is_not_supported(libs, script):
    log = script()
    cp = CudaCheckpointer(library=libs["old"])
    assert cp.supported is False
    assert "lacks cuCheckpointProcessGetState" in cp.why and "r570" in cp.why
    with pytest.raises(CheckpointError, match="r570"):
        cp.lock(5, 30)
    assert calls(log) == []


def test_no_library_is_not_supported(tmp_path, monkeypatch):
    # the library named by $DEVBROKER_LIBCUDA, the real backend's default executor's way
    monkeypatch.setenv("DEVBROKER_LIBCUDA", str(tmp_path / "absent" / "libcuda.so.1"))
    cp = CudaCheckpointer()
    assert cp.supported is False
    assert "cannot load" in cp.why and "absent" in cp.why
    with pytest.raises(CheckpointError, match="cannot load"):
        cp.checkpoint(5, 30)


def test_the_environment_names_the_library(libs, script, monkeypatch):
    log = script(state=1)
    monkeypatch.setenv("DEVBROKER_LIBCUDA", libs["new"])
    assert CudaCheckpointer().state(31, 30) == "locked"
    assert calls(log)[0].startswith("state pid=31")


def test_the_real_backend_uses_this_executor():
    assert isinstance(RealBackend.checkpointer, CudaCheckpointer)


@pytest.mark.parametrize("args,words", [
    (["lock"], "lock needs a process id"),
    (["lock", "0"], "lock needs a process id"),
    (["lock", "abc"], "invalid int value"),
    (["freeze", "5"], "invalid choice"),
    (["lock", "5", "--pairs", f"{OLD}={NEW}"], "--pairs is for restore only"),
    (["restore", "5", "--pairs", OLD], "a GPU pair is OLD=NEW"),
    (["restore", "5", "--pairs", f"{OLD}=MIG-1"], "not a GPU UUID: 'MIG-1'"),
    (["lock", "5", "--timeout-ms", "-1"], "--timeout-ms must fit"),
])
def test_the_helper_refuses_bad_arguments(libs, script, args, words):
    log = script()
    rc, rec = helper(*args, "--libcuda", libs["new"])
    assert rc == 2
    assert rec["ok"] is False and rec["error"] == "usage"
    assert words in rec["why"]
    assert calls(log) == []  # nothing reached the driver


def test_the_helper_reports_driver_answers(libs, script):
    script("checkpoint=801")
    rc, rec = helper("checkpoint", "77", "--libcuda", libs["new"])
    assert rc == 1
    assert rec["error"] == "CUDA_ERROR_NOT_SUPPORTED" and rec["code"] == 801 and rec["pid"] == 77
    rc, rec = helper("restore", "77", "--no-init", "--libcuda", libs["new"])
    assert rc == 0 and rec["ok"] is True and "init" not in rec
    rc, rec = helper("probe", env={"DEVBROKER_LIBCUDA": libs["old"]})
    assert rc == 3 and rec["error"] == "no-symbol"
    assert "cuCheckpointProcessLock" in rec["missing"]


def test_a_slow_checkpoint_names_the_deadline(libs, script):
    script("checkpoint=hang")
    with pytest.raises(CheckpointError, match=r"checkpoint of process 8 did not finish within "
                                              r"5 s; the helper was killed \(the copy runs"):
        CudaCheckpointer(library=libs["new"]).checkpoint(8, 5.0)
