"""Isolation between tenants through real `devbroker exec` tenants and a real broker
(emulated backend), plus the GPU-id finder (a pure function) over every allowed control.

1. A policy change that takes GPU 0 from alice refuses every further call on her GPU-0
   objects (with an audit record saying the GPU was revoked), still lets her free them, and
   `status` shows her GPU-0 memory until she does.
2. GPU ids are checked wherever the ABI's parameters hold one (0x13a, 0x289 and the rest
   refuse another GPU's id as GET_PCI_INFO does; 0x288's answer lists only hers), and client
   handles in allocation parameters (hParentClient, hTargetClient) must be the tenant's.
3. A node file mapped and written by its owner, passed over a Unix socket (SCM_RIGHTS) to
   another tenant and mapped there: the pages the owner faulted in are neither read nor
   written by the other tenant (FUSE front end: the page cache is the kernel's).
4. A root client asked for with another tenant's handle is answered byte for byte as a
   duplicate of the tenant's own; GET_ID_INFO(_V2)'s in-use flag says only whether the
   tenant itself holds the GPU.
"""
from __future__ import annotations

import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from devbroker.abi import registry
from devbroker.abi import status as nvs
from devbroker.broker import allow, rewrite
from devbroker.testing.policies import tenant, two_h200
from tenant_io import lines, readline_json

HERE = Path(__file__).resolve().parent
TENANT = [sys.executable, str(HERE / "tenant_isolation.py")]
HOLD = [sys.executable, str(HERE / "tenant_prog.py"), "hold"]
GiB = 1 << 30
GPU0_ID, GPU1_ID = 0x6, 0x7  # the emulator's ids of 0000:00:06.0 and 0000:00:07.0

POLICY = two_h200(tenant("alice", gpus=[0]), tenant("bob", gpus=[1]))
# Both on GPU 0: whether the other one uses it must not show.
SHARED = two_h200(tenant("alice", gpus=[0]), tenant("bob", gpus=[0]))


def run(broker, tenant: str, *args: str) -> dict[str, dict]:
    r = broker.exec(tenant, *TENANT, *args, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return {x["what"]: x for x in lines(r.stdout)}


def denials(broker, tenant: str) -> list[dict]:
    return [a for a in broker.audit() if a["event"] == "deny" and a["tenant"] == tenant]


@pytest.fixture(params=["fuse", "seccomp"])
def broker(start_broker, request):
    """Through both ways `devbroker exec` reaches the broker (FUSE nodes, seccomp notify)."""
    b = start_broker(POLICY)
    b.frontend = request.param
    return b


# ------------------------------------------------------------------ revoked GPUs
@pytest.mark.root
def test_revoked_gpu_refuses_calls_on_old_objects_and_status_shows_held_memory(
        broker, tmp_path):
    alice = broker.exec_popen("alice", *TENANT, "revoke", "1GiB", stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert readline_json(alice)["what"] == "holding"
        assert broker.tenant("alice")["memory"]["0"]["used"] == 1 * GiB
        moved = tmp_path / "moved.toml"
        moved.write_text(POLICY.replace("gpus = [0]", "gpus = [1]", 1))
        r = broker.cli("policy", "apply", str(moved))
        assert r.returncode == 0, r.stderr
        t = broker.tenant("alice")
        assert t["gpus"] == [1]
        # The operator still sees what alice holds on the GPU she lost.
        assert t["revoked_memory"] == {"0": 1 * GiB}
        r = broker.cli("status")
        assert "gpu0: 1 GiB REVOKED" in r.stdout, r.stdout

        alice.stdin.write("go\n")
        alice.stdin.flush()
        after = {}
        for _ in range(3):
            rec = readline_json(alice)
            after[rec["what"]] = rec["status"]
        assert after == {"alloc-after": nvs.NV_ERR_INSUFFICIENT_PERMISSIONS,
                         "control-after": nvs.NV_ERR_INSUFFICIENT_PERMISSIONS,
                         "subdevice-after": nvs.NV_ERR_INSUFFICIENT_PERMISSIONS}
        revoked = [d for d in denials(broker, "alice") if "GPU 0 was revoked" in d["reason"]]
        assert len(revoked) == 3, denials(broker, "alice")
        assert any("NV20_SUBDEVICE_0" in d["what"] or "0x2080" in d["what"] for d in revoked)
        notices = [a for a in broker.audit() if a["event"] == "notice"
                   and "revoked from tenant alice" in a.get("message", "")]
        assert notices and str(1 * GiB) in notices[0]["message"]
        assert broker.tenant("alice")["revoked_memory"] == {"0": 1 * GiB}

        # Giving the memory back stays allowed, and then nothing is shown any more.
        alice.stdin.write("free\n")
        alice.stdin.flush()
        assert readline_json(alice) == {"what": "free", "status": nvs.NV_OK}
        assert broker.tenant("alice")["revoked_memory"] == {}
        assert "REVOKED" not in broker.cli("status").stdout
    finally:
        alice.stdin.close()
        alice.wait(timeout=30)


# ------------------------------------------------------------------ GPU ids and clients in parameters
@pytest.mark.root
def test_controls_naming_another_gpus_id_are_refused(broker):
    got = run(broker, "alice", "gpu-ids", hex(GPU1_ID))
    # Another GPU's id: refused by the broker as GET_PCI_INFO always was.
    for what in ("p2p-matrix-other", "async-attach-other", "pci-info-other"):
        assert got[what]["status"] == nvs.NV_ERR_INVALID_ARGUMENT, (what, got[what])
    # Her own id reaches the emulator (which does not model 0x13a/0x289: NOT_SUPPORTED).
    assert got["p2p-matrix-own"]["status"] == nvs.NV_ERR_NOT_SUPPORTED
    assert got["async-attach-own"]["status"] == nvs.NV_ERR_NOT_SUPPORTED
    assert got["pci-info-own"]["status"] == nvs.NV_OK
    # GET_ACTIVE_DEVICE_IDS: the driver lists every GPU; she sees only hers.
    assert got["active-devices"]["ids"] == [GPU0_ID]
    reasons = " ".join(d["reason"] for d in denials(broker, "alice"))
    assert f"gpuIdGrpA[0]={GPU1_ID:#x} is not one of the tenant's GPUs" in reasons
    assert f"gpuId={GPU1_ID:#x} is not one of the tenant's GPUs" in reasons


@pytest.mark.root
def test_allocation_parameters_naming_another_tenants_client_are_refused(broker):
    bob = broker.exec_popen("bob", *HOLD, "1GiB", stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        held = readline_json(bob)
        got = run(broker, "alice", "foreign-clients", hex(held["client"]))
        assert got["event-parent-other"]["status"] == nvs.NV_ERR_INVALID_CLIENT
        assert got["device-target-other"]["status"] == nvs.NV_ERR_INVALID_CLIENT
        assert got["device-target-none"]["status"] == nvs.NV_OK  # 0: no target client
        reasons = " ".join(d["reason"] for d in denials(broker, "alice"))
        assert f"hParentClient={held['client']:#x} is not a client of this tenant" in reasons
        assert f"hTargetClient={held['client']:#x} is not a client of this tenant" in reasons
    finally:
        bob.stdin.close()
        bob.wait(timeout=30)


def test_gpu_id_fields_of_every_allowed_control_are_found():
    """The table in broker/rewrite.py against the ABI: every field of an allowed control's
    parameters whose name says GPU id is either checked as a request or listed as an
    answer (filtered by a post-hook); and the finder reads counts and terminators."""
    def names(spec, prefix=""):
        for f in spec.fields:
            if f.kind == "struct":
                yield from names(f.spec, f"{prefix}{f.name}.")
            elif f.kind == "array" and not isinstance(f.elem, str):
                yield from names(f.elem, f"{prefix}{f.name}[].")
            else:
                yield prefix + f.name

    checked = {}
    for version in registry.versions():
        abi = registry.get(version)
        for cmd, op in abi.controls.items():
            if allow.control_rule(cmd) is None or op.params is None:
                continue
            ids = [n for n in names(op.params)
                   if n.rsplit(".", 1)[-1].split("[")[0] in rewrite.GPU_ID_FIELD_NAMES]
            if ids:
                checked[cmd] = ids
                if cmd not in rewrite.GPU_IDS_ANSWERED:
                    # a request: the finder sees the field when it holds an id
                    spec = op.params
                    p = spec.decode(bytes(spec.size))
                    for n in ids:
                        top = n.split("[")[0].split(".")[0]
                        f = spec.by_name[top]
                        if f.kind == "array" and isinstance(f.elem, str):
                            count = rewrite.GPU_ID_COUNT_FIELDS.get(top)
                            p = p.replace(**{top: [0x1234] * f.count})
                            if count in spec.by_name:
                                p = p.replace(**{count: 1})
                        elif f.kind not in ("struct", "array"):
                            p = p.replace(**{top: 0x1234})
                    assert any(i == 0x1234 for _, i in rewrite.gpu_ids_named(p)), (hex(cmd), n)
    assert {0x13A, 0x202, 0x205, 0x215, 0x216, 0x21B, 0x279, 0x289} <= set(checked)
    assert {0x201, 0x214, 0x288} <= set(checked) & rewrite.GPU_IDS_ANSWERED

    abi = registry.get("580.159.04")
    m = abi.control(0x13A).params
    p = m.decode(bytes(m.size)).replace(grpACount=1, grpBCount=2, gpuIdGrpA=[6] + [7] * 7,
                                        gpuIdGrpB=[6, 6] + [7] * 6)
    assert rewrite.gpu_ids_named(p) == [("gpuIdGrpA[0]", 6), ("gpuIdGrpB[0]", 6),
                                        ("gpuIdGrpB[1]", 6)]
    a = abi.control(0x215).params
    p = a.decode(bytes(a.size)).replace(gpuIds=[6, 0xFFFFFFFF] + [7] * 30)
    assert rewrite.gpu_ids_named(p) == [("gpuIds[0]", 6)]  # the driver stops at INVALID
    g = abi.control(0x289).params
    assert rewrite.gpu_ids_named(g.decode(bytes(g.size)).replace(gpuId=7)) == [("gpuId", 7)]


# ------------------------------------------------------------------ other tenants' handles and use
@pytest.mark.root
def test_another_tenants_client_handle_is_answered_as_a_duplicate_of_ones_own(broker):
    bob = broker.exec_popen("bob", *HOLD, "1GiB", stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        held = readline_json(bob)
        got = run(broker, "alice", "client-dup", hex(held["client"]))["dup"]
        # Her own duplicate is answered by the driver; bob's handle by the broker: the same.
        assert got["own_status"] == got["other_status"] == nvs.NV_ERR_INSERT_DUPLICATE_NAME
        assert got["own_rc"] == got["other_rc"] == 0
        assert got["own"] == got["other"]
        assert broker.tenant("bob")["clients"] == 1
    finally:
        bob.stdin.close()
        bob.wait(timeout=30)


@pytest.mark.root
def test_in_use_flag_shows_only_the_tenants_own_use(start_broker):
    b = start_broker(SHARED)
    b.frontend = "fuse"
    bob = b.exec_popen("bob", *HOLD, "1GiB", stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True)
    try:
        readline_json(bob)  # bob holds a device (and memory) on the shared GPU 0
        r = b.exec("alice", *TENANT, "id-info", timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        got = lines(r.stdout)[0]
        # Before alice allocates her own device the GPU is "not in use" to her, though
        # bob's device makes the driver say it is; after, it is, in both versions.
        assert got["before"] & 1 == 0
        assert got["after"] & 1 == 1 and got["v1_after"] & 1 == 1
    finally:
        bob.stdin.close()
        bob.wait(timeout=30)


# ------------------------------------------------------------------ passed node files
@pytest.mark.root
def test_passed_node_file_shows_the_other_tenant_none_of_the_owners_pages(start_broker):
    b = start_broker(SHARED)
    b.frontend = "fuse"
    sock = f"devbroker-test-{uuid.uuid4().hex[:12]}"
    owner = b.exec_popen("alice", *TENANT, "map-owner", sock, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        got = readline_json(owner)
        # The owner's own mapping works: the page (zeros in the emulator) and its write.
        assert got == {"what": "owner", "read": "0" * 16, "wrote": "alice's page, not bob's"}
        r = b.exec("bob", *TENANT, "map-thief", sock, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        thief = lines(r.stdout)[0]
        # Not in bob's view of the page cache, and every access of his is refused.
        assert thief == {"what": "thief", "resident": 0, "read": f"signal {signal.SIGBUS}",
                         "write": f"signal {signal.SIGBUS}"}, thief
        owner.stdin.write("\n")
        owner.stdin.flush()
        # The passed file maps no more pages for anyone (ioctls on it stay the owner's).
        assert readline_json(owner) == {"what": "owner-after", "read": f"signal {signal.SIGBUS}"}
        # One record, the user's (bob), naming the owner.
        passed = [a for a in b.audit() if "passed to another sandbox" in a.get("reason", "")]
        assert len(passed) == 1, passed
        assert passed[0]["tenant"] == "bob" and passed[0]["what"].startswith("alice's nvidiactl")
    finally:
        owner.stdin.close()
        owner.wait(timeout=30)
