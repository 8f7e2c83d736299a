"""Tenants made at run time (broker/tenancy.py): `devbroker tenant add|set|rm|list` against a
real `devbroker run`, with tenant processes in `devbroker exec` sandboxes (FUSE and seccomp
front ends, emulated backend), across a restart and a live upgrade."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from devbroker.broker.policy import PolicyError, load_policy_text
from devbroker.broker.tenancy import TenantError, check_spec, spec_of
from devbroker.testing.policies import one_h200, tenant, two_h200
from tenant_io import readline_json
from test_metrics import scrape, total
from test_prometheus import free_port
from test_upgrade import alive, successors  # noqa: F401  (a fixture)

HERE = Path(__file__).resolve().parent
TENANT = [sys.executable, str(HERE / "tenant_prog.py")]
NVIDIA_SMI = "/usr/bin/nvidia-smi"
LABELS = ["--label", "namespace=ml", "--label", "pod=train-0", "--label", "container=main"]
MiB = 1 << 20


def tenants(broker) -> dict[str, dict]:
    r = broker.cli("tenant", "list", "--json")
    assert r.returncode == 0, r.stderr
    return {t["name"]: t for t in json.loads(r.stdout)}


def smi_total_mib(broker, name: str, frontend: str = "auto") -> int:
    broker.frontend = frontend
    r = broker.exec(name, NVIDIA_SMI, "--query-gpu=memory.total", "--format=csv,noheader,nounits")
    assert r.returncode == 0, r.stdout + r.stderr
    return int(r.stdout.split()[0])


# ------------------------------------------------------------------------------ no root needed
def test_a_spec_is_checked_by_the_policy_loader_with_its_messages():
    """A runtime spec gets exactly the reason a policy file's [tenant.NAME] table would."""
    head = two_h200(tenant("alice"))
    cases = [({"gpus": [0], "memory_quota": "8G"}, 'memory_quota = "8G"'),
             ({"gpus": [2], "memory_quota": "1GiB"}, 'memory_quota = "1GiB"'),
             ({"gpus": [0]}, None),
             ({"gpus": [0], "memory_quota": "1GiB", "colour": "red"}, 'colour = "red"'),
             ({"gpus": [0], "memory_quota": "200GiB"}, 'memory_quota = "200GiB"'),
             ({"gpus": [0], "memory_quota": "1GiB", "priority": "urgent"},
              'memory_quota = "1GiB"\npriority = "urgent"')]
    broker = load_policy_text(head).broker
    for spec, _ in cases:
        table = "\n".join(f"{k} = {json.dumps(v)}" for k, v in spec.items())
        with pytest.raises(PolicyError) as file_error:
            load_policy_text(head + f"\n[tenant.carol]\n{table}\n")
        with pytest.raises(TenantError) as runtime_error:
            check_spec("carol", spec, None, broker)
        assert str(runtime_error.value) == f"tenant spec: {file_error.value.reason}"
    with pytest.raises(TenantError, match="must be lower-case"):
        check_spec("Carol", {"gpus": [0], "memory_quota": 1}, None, broker)
    with pytest.raises(TenantError, match="label name 'Pod'"):
        check_spec("carol", {"gpus": [0], "memory_quota": 1}, {"Pod": "x"}, broker)
    with pytest.raises(TenantError, match="label pod must be printable"):
        check_spec("carol", {"gpus": [0], "memory_quota": 1}, {"pod": "a\nb"}, broker)


def test_file_tenants_may_have_labels_and_they_round_trip():
    text = two_h200(tenant("alice")) + '[tenant.alice.labels]\nnamespace = "ml"\npod = "p-0"\n'
    p = load_policy_text(text)
    assert p.tenants["alice"].labels == (("namespace", "ml"), ("pod", "p-0"))
    assert load_policy_text(p.to_toml()) == p
    # a spec read back from a tenant makes the same tenant again
    tp = p.tenants["alice"]
    assert check_spec("alice", spec_of(tp), dict(tp.labels), p.broker) == tp


def test_a_new_policy_file_must_still_fit_the_runtime_tenants():
    """`policy apply` checks the runtime tenants again against the new file's GPUs; refused,
    the running policy (file and runtime tenants) stays."""
    from devbroker.assemble import assemble
    from devbroker.broker.tenancy import Tenancy

    first = load_policy_text(two_h200(tenant("alice")))
    built = assemble(first)
    tenancy = Tenancy(built.broker, built.audit, first)
    tenancy.add({"tenant": "carol", "spec": {"gpus": [1], "memory_quota": "4GiB"}}, "test")
    with pytest.raises(PolicyError, match="runtime tenant carol would no longer fit: tenant "
                                          r"spec: GPU 1 is not one of the broker's GPUs \(0..0\)"):
        tenancy.apply_file_policy(load_policy_text(one_h200(tenant("alice"))))
    assert tenancy.file_policy is first
    assert sorted(built.broker.policy.tenants) == ["alice", "carol"]
    tenancy.apply_file_policy(load_policy_text(two_h200(tenant("alice"), tenant("erin"))))
    assert sorted(built.broker.policy.tenants) == ["alice", "carol", "erin"]


# ------------------------------------------------------------------------------ root
@pytest.mark.root
def test_which_processes_a_removal_ends():
    """A tenant's pid namespace is ended whole, unless another tenant uses it or it is the
    broker's own; a pid whose process is not the one seen (another uid) is left alone."""
    import signal as _signal
    import time

    import trio

    from devbroker.broker.procinfo import pid_namespace
    from devbroker.broker.tenancy import end_processes, processes_of

    box = subprocess.Popen(["unshare", "--pid", "--fork", "sh", "-c",
                            "sleep 300 & sleep 300 & wait"], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while True:  # unshare's child (sh) and its two sleeps, in a namespace of their own
            own = pid_namespace(os.getpid())
            kids = [int(d) for d in os.listdir("/proc") if d.isdigit()
                    and pid_namespace(int(d)) not in (None, own)
                    and pid_namespace(int(d)) == pid_namespace(box.pid + 1)]
            if len(kids) == 3:
                break
            assert time.monotonic() < deadline, kids
            time.sleep(0.05)
        ns = pid_namespace(kids[0])
        opener = {max(kids): (ns, 0)}
        assert set(processes_of(opener)) == set(kids)
        assert set(processes_of(opener, {ns})) == {max(kids)}  # another tenant's there too
        mine = {box.pid: (own, 0)}
        assert set(processes_of(mine)) == {box.pid}  # the broker's namespace: openers only
        # an opener's uid that is not the process's: not signalled
        assert trio.run(end_processes, {max(kids): (ns, 4242)}, 0) == set()
        ended = trio.run(end_processes, processes_of(opener), 0.5)
        assert ended == set(kids)
        box.wait(timeout=30)  # (the sleeps took SIGTERM; sh, the namespace's init, ends then)
        assert not any(alive(pid) for pid in kids)
    finally:
        if box.poll() is None:
            os.killpg(box.pid, _signal.SIGKILL)
            box.wait()


@pytest.mark.root
def test_add_set_list_and_rm_through_the_cli(start_broker):
    port = free_port()
    broker = start_broker(two_h200(tenant("alice", gpus=[0], memory_quota="1GiB"),
                                   metrics=f"127.0.0.1:{port}"))
    r = broker.cli("tenant", "add", "carol", "--gpus", "1", "--memory-quota", "4GiB", *LABELS)
    assert r.returncode == 0, r.stderr
    assert "added" in r.stdout
    # the same again: nothing changes; another spec: refused in one line, exit 1
    r = broker.cli("tenant", "add", "carol", "--gpus", "1", "--memory-quota", "4096MiB",
                   *LABELS)
    assert r.returncode == 0 and "exists already" in r.stdout, r.stdout + r.stderr
    r = broker.cli("tenant", "add", "carol", "--gpus", "0", "--memory-quota", "4GiB", *LABELS)
    assert r.returncode == 1
    assert r.stderr.strip() == ("devbroker tenant add: tenant carol exists with another spec "
                                "(gpus): `tenant set` changes it")
    # a bad spec: the loader's own message; a file tenant's name: refused
    r = broker.cli("tenant", "add", "dave", "--gpus", "0", "--memory-quota", "8G")
    assert r.returncode == 1 and r.stderr.count("\n") == 1
    assert "memory_quota: bare K/M/G" in r.stderr or "unknown unit 'G'" in r.stderr, r.stderr
    r = broker.cli("tenant", "add", "alice", "--gpus", "0", "--memory-quota", "1GiB")
    assert r.returncode == 1 and "is in the policy file" in r.stderr
    refused = [a for a in broker.audit() if a["event"] == "tenant-refused"]
    assert [(a["op"], a["tenant"]) for a in refused] == [
        ("tenant.add", "carol"), ("tenant.add", "dave"), ("tenant.add", "alice")]

    listed = tenants(broker)
    assert listed["alice"]["source"] == "policy"
    carol = listed["carol"]
    assert carol["source"] == "runtime" and carol["spec"]["gpus"] == [1]
    assert carol["spec"]["memory_quota"] == 4 << 30
    assert carol["labels"] == {"namespace": "ml", "pod": "train-0", "container": "main"}
    assert carol["node_dir"] == str(broker.run_dir / "nodes" / "carol")
    assert sorted(os.listdir(broker.run_dir / "nodes")) == ["alice", "carol"]
    r = broker.cli("tenant", "list")
    assert r.returncode == 0
    row = next(line for line in r.stdout.splitlines() if line.startswith("carol "))
    assert "runtime" in row and "4 GiB" in row and "pod=train-0" in row

    # what the tenant's nvidia-smi sees is its quota, before and after a change
    assert smi_total_mib(broker, "carol") == 4096
    r = broker.cli("tenant", "set", "carol", "--memory-quota", "6GiB")
    assert r.returncode == 0 and "changed" in r.stdout, r.stderr
    assert smi_total_mib(broker, "carol") == 6144
    # CDI names it as it names a file tenant
    r = broker.cli("cdi")
    assert r.returncode == 0, r.stderr
    assert {"alice", "carol"} <= {d["name"] for d in json.loads(r.stdout)["devices"]}

    # its metrics carry its labels (a refusal too)
    r = broker.exec("carol", *TENANT, "refusals")
    assert r.returncode == 0, r.stdout + r.stderr
    m = scrape(f"http://127.0.0.1:{port}/metrics")
    pod = {"tenant": "carol", "namespace": "ml", "pod": "train-0", "container": "main"}
    assert total(m, "devbroker_tenant_memory_quota_bytes", **pod, gpu="1") == 6 << 30
    assert total(m, "devbroker_refusals_total", **pod) == 3
    assert total(m, "devbroker_tenant_memory_quota_bytes", tenant="alice", pod="") == 1 << 30

    r = broker.cli("tenant", "rm", "carol")
    assert r.returncode == 0 and "removed" in r.stdout, r.stderr
    r = broker.cli("tenant", "rm", "carol")  # again: nothing to do, and fine
    assert r.returncode == 0 and "no tenant carol" in r.stdout
    assert sorted(tenants(broker)) == ["alice"]
    assert os.listdir(broker.run_dir / "nodes") == ["alice"]
    assert [t["name"] for t in broker.status()["tenants"]] == ["alice"]
    events = [a for a in broker.audit() if a["event"].startswith("tenant-")
              and a["event"] not in ("tenant-attached", "tenant-detached", "tenant-refused")]
    assert [a["event"] for a in events] == ["tenant-added", "tenant-changed", "tenant-removed"]
    assert all(a["by"].startswith("pid ") and " uid 0 " in a["by"] for a in events)
    assert events[1]["changed"] == "memory_quota"
    assert json.loads((broker.run_dir / "tenants.json").read_text())["tenants"] == []


@pytest.mark.root
@pytest.mark.parametrize("frontend", ["fuse", "seccomp"])
def test_rm_ends_the_tenants_processes_and_its_memory_returns(start_broker, frontend):
    port = free_port()
    broker = start_broker(one_h200(tenant("alice", memory_quota="1GiB"),
                                   metrics=f"127.0.0.1:{port}"),
                          extra=["--frontend", frontend])
    broker.frontend = frontend

    def gpu_used() -> float:  # what the (emulated) driver has allocated on the GPU
        return total(scrape(f"http://127.0.0.1:{port}/metrics"),
                     "devbroker_gpu_memory_used_bytes", gpu="0")
    before = gpu_used()
    r = broker.cli("tenant", "add", "carol", "--gpus", "0", "--memory-quota", "1GiB")
    assert r.returncode == 0, r.stderr
    # one process that ignores SIGTERM (ended by SIGKILL after the grace), one that does not
    stubborn = ("import runpy, signal, sys; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                f"sys.argv = [{TENANT[1]!r}, 'hold', '128MiB']; "
                f"runpy.run_path({TENANT[1]!r}, run_name='__main__')")
    procs = [broker.exec_popen("carol", *TENANT, "hold", "64MiB", stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True),
             broker.exec_popen("carol", sys.executable, "-c", stubborn, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)]
    try:
        held = [readline_json(p) for p in procs]
        assert all(h["what"] == "holding" for h in held), held
        assert tenants(broker)["carol"]["memory_used"] == {"0": 192 * MiB}
        assert tenants(broker)["carol"]["processes"] == 2
        assert gpu_used() >= before + 192 * MiB
        r = broker.cli("tenant", "rm", "carol", "--grace", "1")
        assert r.returncode == 0, r.stderr
        ended = [int(pid) for pid in r.stdout.split("processes ended: ")[1].split(", ")]
        assert len(ended) >= 2  # the holders, and their sandboxes' other processes
        for p in procs:
            p.wait(timeout=30)  # the sandboxes end with their tenant processes
        assert not any(alive(pid) for pid in ended)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    removed = next(a for a in broker.audit() if a["event"] == "tenant-removed")
    assert removed["memory_freed"] == {"0": 192 * MiB}
    assert "memory_held" not in removed
    # the books and the GPU have the memory back; no trace of carol is left
    assert gpu_used() == before
    assert [t["name"] for t in broker.status()["tenants"]] == ["alice"]
    # the same name again is a new, empty tenant
    r = broker.cli("tenant", "add", "carol", "--gpus", "0", "--memory-quota", "1GiB")
    assert r.returncode == 0, r.stderr
    assert tenants(broker)["carol"]["memory_used"] == {"0": 0}


@pytest.mark.root
def test_a_restart_keeps_runtime_tenants_and_policy_apply_too(start_broker, tmp_path):
    policy = one_h200(tenant("alice", memory_quota="1GiB"))
    broker = start_broker(policy)
    r = broker.cli("tenant", "add", "carol", "--gpus", "0", "--memory-quota", "2GiB", *LABELS)
    assert r.returncode == 0, r.stderr
    saved = json.loads((broker.run_dir / "tenants.json").read_text())
    assert saved["tenants"][0]["name"] == "carol"
    assert oct((broker.run_dir / "tenants.json").stat().st_mode & 0o777) == "0o600"

    # a new policy file keeps it; one that names it is refused, the running one stays
    new = tmp_path / "new.toml"
    new.write_text(one_h200(tenant("alice", memory_quota="1GiB"),
                            tenant("erin", memory_quota="1GiB")))
    r = broker.cli("policy", "apply", str(new))
    assert r.returncode == 0, r.stderr
    assert sorted(tenants(broker)) == ["alice", "carol", "erin"]
    clash = tmp_path / "clash.toml"
    clash.write_text(one_h200(tenant("alice"), tenant("carol")))
    r = broker.cli("policy", "apply", str(clash))
    assert r.returncode == 1
    assert "carol exist as runtime tenants" in r.stderr, r.stderr
    assert tenants(broker)["carol"]["source"] == "runtime"
    # policy show is the file's policy (what apply takes back)
    shown = broker.control({"op": "policy.show"})
    assert "[tenant.carol]" not in shown["text"] and shown["runtime_tenants"] == ["carol"]
    r = broker.cli("policy", "show")
    assert r.returncode == 0 and "# and runtime tenants: carol" in r.stdout

    assert broker.stop() == 0
    again = start_broker(policy, run_dir=broker.run_dir)
    listed = tenants(again)
    assert listed["carol"]["source"] == "runtime"
    assert listed["carol"]["labels"]["pod"] == "train-0"
    assert smi_total_mib(again, "carol") == 2048

    # a saved tenant the policy now names itself: the broker says so and does not start
    assert again.stop() == 0
    with pytest.raises(RuntimeError, match="tenants.json: tenant 'carol' is in the policy"):
        start_broker(one_h200(tenant("carol")), run_dir=broker.run_dir)


@pytest.mark.root
def test_a_live_upgrade_keeps_runtime_tenants_and_their_processes(start_broker, successors):
    broker = start_broker(one_h200(tenant("alice", memory_quota="1GiB")))
    r = broker.cli("tenant", "add", "carol", "--gpus", "0", "--memory-quota", "1GiB", *LABELS)
    assert r.returncode == 0, r.stderr
    p = broker.exec_popen("carol", *TENANT, "hold", "64MiB", stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True)
    try:
        held = readline_json(p)
        # what the successor knows of carol, it knows from the hand-over (not the file)
        (broker.run_dir / "tenants.json").unlink()
        r = broker.cli("upgrade", "--json", timeout=200)
        assert r.returncode == 0, r.stderr
        successors.append(json.loads(r.stdout)["pid"])
        carol = tenants(broker)["carol"]
        assert carol["source"] == "runtime" and carol["labels"]["namespace"] == "ml"
        assert carol["memory_used"] == {"0": 64 * MiB} and carol["processes"] == 1
        # the successor removes it as its predecessor would have
        r = broker.cli("tenant", "rm", "carol", "--grace", "1")
        assert r.returncode == 0, r.stderr
        ended = [int(pid) for pid in r.stdout.split("processes ended: ")[1].split(", ")]
        p.wait(timeout=30)
        assert held["what"] == "holding" and not any(alive(pid) for pid in ended)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert sorted(tenants(broker)) == ["alice"]
    removed = next(a for a in broker.audit() if a["event"] == "tenant-removed")
    assert removed["memory_freed"] == {"0": 64 * MiB}
    assert json.loads((broker.run_dir / "tenants.json").read_text())["tenants"] == []


@pytest.mark.root
@pytest.mark.nvidia
def test_a_container_of_a_runtime_tenant_and_its_removal(start_broker, tmp_path, tenant_tree):
    """What a Kubernetes node does: a tenant added at run time, a CDI spec written after it,
    containers (runc) naming it through the seccomp hand-over (oci-seccomp.sock); removing
    the tenant ends the container holding its memory, and the memory returns."""
    import shutil
    import uuid

    from devbroker.testing.oci import Runtime, apply_cdi, load_config, make_bundle, save_config

    if shutil.which("runc") is None:
        pytest.fail("runc is not installed: scripts/install-container-runtimes.sh")
    runc = Runtime("runc", tmp_path / "runc-state")
    broker = start_broker(one_h200(tenant("alice", memory_quota="1GiB")))
    r = broker.cli("tenant", "add", "carol", "--gpus", "0", "--memory-quota", "3GiB", *LABELS)
    assert r.returncode == 0, r.stderr
    r = broker.cli("cdi", "--frontend", "seccomp", "--output", str(tmp_path / "cdi.json"))
    assert r.returncode == 0, r.stderr
    spec = json.loads((tmp_path / "cdi.json").read_text())

    def bundle(argv, **kw) -> Path:
        b = tmp_path / f"bundle-{uuid.uuid4().hex[:8]}"
        b.mkdir()
        make_bundle(b, argv, annotations={"cdi.k8s.io/devbroker": "devbroker.io/gpu=carol"},
                    **kw)
        config = load_config(b)
        apply_cdi(config, spec, ["devbroker.io/gpu=carol"])
        save_config(b, config)
        r = broker.cli("oci-seccomp", "--frontend", "seccomp", "--config",
                       str(b / "config.json"))
        assert r.returncode == 0, r.stderr
        return b

    cid = f"db-{uuid.uuid4().hex[:10]}"
    try:
        r = runc.run(bundle([NVIDIA_SMI, "--query-gpu=memory.total", "--format=csv,noheader"]),
                     cid, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
        assert r.returncode == 0, r.stdout + r.stderr
        assert r.stdout.strip() == "3072 MiB"
    finally:
        runc.delete(cid)
    attached = [a for a in broker.audit() if a["event"] == "tenant-attached"]
    assert [(a["tenant"], a.get("container")) for a in attached] == [("carol", cid)]

    cid = f"db-{uuid.uuid4().hex[:10]}"
    b = bundle(["/usr/bin/python3", "-m", "devbroker.tools.probe", "--alloc", "256MiB",
                "--keep"], tenant_tree=tenant_tree, env=["PYTHONPATH=/opt/devbroker/src"])
    proc = runc.popen(b, cid, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                      stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:
            if line.strip() == "holding":
                break
        assert tenants(broker)["carol"]["memory_used"] == {"0": 256 * MiB}
        r = broker.cli("tenant", "rm", "carol", "--grace", "1")
        assert r.returncode == 0, r.stderr
        assert proc.wait(timeout=60) != 0  # the container ended with its tenant
    finally:
        if proc.poll() is None:
            proc.kill()
        runc.delete(cid)
    removed = next(a for a in broker.audit() if a["event"] == "tenant-removed")
    assert removed["memory_freed"] == {"0": 256 * MiB} and removed["ended"]
    assert [t["name"] for t in broker.status()["tenants"]] == ["alice"]
