"""The OCI pieces without a runtime: the seccomp sections decide as devbroker
exec's own filters do, the runtime's hand-over is decoded and its tenant named or refused,
and `devbroker cdi`'s spec is a valid CDI spec.

The sections are compiled with the system's libseccomp exactly as runc 1.1 compiles them
(tests/libseccomp.py) and the resulting BPF is run, with the project's cBPF interpreter, on
every x86_64 system call number with the argument values the rules look at, beside
seccompwire.build_filter / build_stat_shim_filter: same action everywhere. The runtime tests
(test_containers.py) then show the kernel doing it.
"""
from __future__ import annotations

import errno
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from devbroker.sandbox import seccompwire as w  # noqa: E402
from devbroker.oci import cdi, profile, state  # noqa: E402
from libseccomp import compile_section  # noqa: E402
from devbroker.testing.oci import CDIError, apply_cdi, validate_cdi  # noqa: E402

ALLOW, NOTIFY = w.SECCOMP_RET_ALLOW, w.SECCOMP_RET_USER_NOTIF
KILL_THREAD = w.SECCOMP_RET_KILL_THREAD
AUDIT_ARCH_AARCH64 = 0xC00000B7
HIGH = 0xABCD_0000_0000_0000  # upper bits of a 64-bit argument the kernel drops for ioctl

IOCTL_CMDS = [0, 1, 2, 3, 0x7FE, 0x7FF, 0x800, 0x801, 0xFFF, 0x1000, 0x4600, 0x46FF, 0x4700,
              0x45FF, 0xC0104629, 0xC020462A, 0x5401, 0x541B, 0x2FFFFFFF, 0x30000000,
              0x30000001, 0x300000FF, 0x30000100, 0x3000FF00, 0x80000000, 0xFFFFFFFF]
ARG_VALUES = {
    "ioctl": [(3, c | h) for c in IOCTL_CMDS for h in (0, HIGH)],
    "mmap": [(0, 4096, 3, f) for f in (0, 0x01, 0x02, 0x20, 0x21, 0x22, 0x100022, 0x100001)],
    "mknod": [(0, m) for m in (w.S_IFCHR | 0o666, w.S_IFBLK | 0o600, 0o010644, 0o100644,
                               0o140777, 0, w.S_IFCHR | w.S_IFBLK)],
    "mknodat": [(w.AT_FDCWD & 0xFFFFFFFF, 0, m) for m in (w.S_IFCHR | 0o666, w.S_IFBLK,
                                                          0o010644, 0o100644, 0)],
}


def _cases():
    names = {v: k for k, v in w.NR.items()}
    for nr in range(0, 470):
        for args in ARG_VALUES.get(names.get(nr, ""), [(0, 0, 0, 0)]):
            yield nr, args


def _decide(prog: bytes, nr: int, args, arch: int = w.AUDIT_ARCH_X86_64) -> int:
    full = [a & 0xFFFFFFFFFFFFFFFF for a in args] + [0] * (6 - len(args))
    return w.run_filter(prog, w.SeccompData(nr, arch, 0, tuple(full[:6])))


@pytest.fixture(scope="module")
def compiled():
    return {fe: compile_section(profile.seccomp_section(fe, "/run/devbroker/oci-seccomp.sock"))
            for fe in profile.FRONTENDS}


def test_section_with_in_kernel_commands_decides_like_the_exec_filter():
    """The same comparison with a real-file tenant's in-kernel UVM rows cut out of the raw
    block (rules.kernel_commands): libseccomp's BPF and build_filter agree on every ioctl
    number around them."""
    from devbroker.abi import registry
    from devbroker.broker import rules

    kernel = rules.kernel_commands(registry.get("580.159.04"),
                                   frozenset(rules.DEFAULT_CAPABILITIES))
    assert kernel
    ours = w.build_filter(w.FilterOptions(kernel_ioctls=kernel))
    theirs = compile_section(profile.seccomp_section(
        "seccomp", "/run/devbroker/oci-seccomp.sock", kernel_ioctls=kernel))
    cmds = sorted({c + d for c in (*kernel, 1, 0x7FF) for d in (-1, 0, 1)} - {-1})
    diffs = [hex(c) for c in cmds for h in (0, HIGH)
             if _decide(ours, w.NR["ioctl"], (3, c | h)) != _decide(theirs, w.NR["ioctl"], (3, c | h))]
    assert not diffs, diffs
    assert _decide(theirs, w.NR["ioctl"], (3, kernel[0])) == ALLOW
    assert _decide(theirs, w.NR["ioctl"], (3, 1)) == NOTIFY


@pytest.mark.parametrize("frontend", profile.FRONTENDS)
def test_section_decides_like_the_exec_filter(compiled, frontend):
    ours = w.build_filter() if frontend == "seccomp" else w.build_stat_shim_filter()
    theirs = compiled[frontend]
    diffs = []
    n = 0
    for nr, args in _cases():
        a, b = _decide(ours, nr, args), _decide(theirs, nr, args)
        n += 1
        if a != b:
            diffs.append(f"{w.NR_NAME.get(nr, nr)}{tuple(hex(x) for x in args)}: exec "
                         f"{w.action_name(a)}, runc {w.action_name(b)}")
    assert n > 470 + len(ARG_VALUES["ioctl"])  # every number, the ioctl commands too
    assert not diffs, "\n".join(diffs[:30])
    notified = {nr for nr, args in _cases() if _decide(theirs, nr, args) == NOTIFY}
    want = ({w.NR[x] for x in ("open", "openat", "openat2", "ioctl", "mmap")}
            if frontend == "seccomp" else {w.NR[x] for x in w.STAT_SYSCALLS})
    assert notified == want


def test_seccomp_section_refuses_other_architectures(compiled):
    """No system call of another ABI runs unseen: libseccomp's bad-architecture action
    (runc leaves it at KILL_THREAD) where devbroker exec kills the process (i386) or answers
    ENOSYS (x32)."""
    prog = compiled["seccomp"]
    for arch in (w.AUDIT_ARCH_I386, AUDIT_ARCH_AARCH64):
        for nr in (2, 5, 54, 257, 295):  # i386 open/ioctl, x86_64 openat/...
            assert _decide(prog, nr, (0, 0x4600), arch) == KILL_THREAD
    for nr in (w.NR["openat"], w.NR["ioctl"], w.NR["read"]):
        assert _decide(prog, nr | w.X32_SYSCALL_BIT, (0, 0x4600)) == KILL_THREAD
        assert w.action_name(_decide(w.build_filter(), nr | w.X32_SYSCALL_BIT, (0,))) == \
            f"ERRNO({errno.ENOSYS})"


def test_stat_section_keeps_32bit_programs_running(compiled):
    """The stat shim is not a boundary: i386 and x32 calls are allowed or handed to the shim
    (which lets them through), never killed."""
    prog = compiled["fuse"]
    for nr in range(0, 450):
        assert _decide(prog, nr, (0,), w.AUDIT_ARCH_I386) in (ALLOW, NOTIFY)
        assert _decide(prog, nr | w.X32_SYSCALL_BIT, (0,)) in (ALLOW, NOTIFY)


def test_aligned_blocks_cover_exactly():
    for lo, hi in ((1, 0x7FF), (0x30000000, 0x300000FF), (5, 5), (0, 0xFFFFFFFF), (3, 17)):
        blocks = profile.aligned_blocks(lo, hi)
        probe = list(range(max(0, lo - 3), min(hi + 4, lo + 300))) + \
            list(range(max(0, hi - 300), min(hi + 4, 1 << 32)))
        for x in probe:
            assert any(x & m == v for m, v in blocks) == (lo <= x <= hi), (lo, hi, x)
    assert len(profile.aligned_blocks(1, 0x7FF)) == 11
    with pytest.raises(ValueError):
        profile.aligned_blocks(5, 4)


def test_section_fields():
    s = profile.seccomp_section("seccomp", "/r/oci-seccomp.sock", tenant="alice",
                                flags=["SECCOMP_FILTER_FLAG_WAIT_KILLABLE_RECV"])
    assert s["defaultAction"] == "SCMP_ACT_ALLOW" and s["listenerPath"] == "/r/oci-seccomp.sock"
    assert state.parse_metadata(s["listenerMetadata"]) == {
        "devbroker": "1", "frontend": "seccomp", "tenant": "alice"}
    assert s["flags"] == ["SECCOMP_FILTER_FLAG_WAIT_KILLABLE_RECV"]
    for rule in s["syscalls"]:
        # runc splits rules that compare one argument twice into an OR: never do that
        idx = [a["index"] for a in rule.get("args", [])]
        assert len(idx) == len(set(idx)), rule
    with pytest.raises(ValueError):
        profile.seccomp_section("kmod", "/x")
    with pytest.raises(ValueError):
        profile.seccomp_section("fuse", "relative.sock")


# --------------------------------------------------------------------------- the hand-over
def _state(meta="devbroker=1;frontend=seccomp", annotations=None, **kw) -> bytes:
    d = {"ociVersion": "1.0.2-dev", "fds": ["seccompFd"], "pid": 4242, "metadata": meta,
         "state": {"ociVersion": "1.0.2-dev", "id": "c1", "status": "creating", "pid": 4242,
                   "bundle": "/b", "annotations": annotations or {}}}
    d.update(kw)
    return json.dumps(d).encode()


def test_state_decoding():
    st = state.decode_state(_state(annotations={"devbroker.io/tenant": "alice"}))
    assert (st.pid, st.container_id, st.bundle, st.fd_index()) == (4242, "c1", "/b", 0)
    assert state.complete(_state()) and not state.complete(_state()[:-1])
    for bad in (b"", b"[1]", b"{\"state\": 1}", _state(pid=-1), _state(pid="7"),
                _state(fds="seccompFd"), b"\xff\xfe", b" " * (state.MAX_STATE_BYTES + 1)):
        with pytest.raises(state.StateError):
            state.decode_state(bad)
    with pytest.raises(state.StateError, match="no 'seccompFd'"):
        state.decode_state(_state(fds=["other"])).fd_index()


@pytest.mark.parametrize("meta,annotations,want", [
    ("devbroker=1;frontend=fuse;tenant=alice", {}, ("alice", "fuse")),
    ("devbroker=1;frontend=seccomp", {"devbroker.io/tenant": "bob"}, ("bob", "seccomp")),
    ("devbroker=1;frontend=seccomp", {"cdi.k8s.io/gpu": "vendor.com/x=1,devbroker.io/gpu=bob"},
     ("bob", "seccomp")),
    ("devbroker=1;frontend=seccomp;tenant=bob",
     {"devbroker.io/tenant": "bob", "cdi.k8s.io/a": "devbroker.io/gpu=bob"}, ("bob", "seccomp")),
])
def test_tenant_named(meta, annotations, want):
    h = state.identify(state.decode_state(_state(meta, annotations)))
    assert (h.tenant, h.frontend) == want


@pytest.mark.parametrize("meta,annotations,why", [
    ("devbroker=1;frontend=seccomp", {}, "no tenant named"),
    ("frontend=seccomp;tenant=alice", {}, "not devbroker's"),
    ("", {"devbroker.io/tenant": "alice"}, "not devbroker's"),
    ("devbroker=1;frontend=kmod;tenant=alice", {}, "unknown front end"),
    ("devbroker=1;frontend=seccomp;tenant=alice", {"devbroker.io/tenant": "bob"},
     "more than one tenant"),
    ("devbroker=1;frontend=seccomp", {"cdi.k8s.io/x": "devbroker.io/gpu=alice,devbroker.io/gpu=bob"},
     "more than one tenant"),
    ("devbroker=1;frontend=seccomp", {"devbroker.io/tenant": "../alice"}, "bad tenant name"),
])
def test_tenant_refused(meta, annotations, why):
    with pytest.raises(state.StateError, match=why):
        state.identify(state.decode_state(_state(meta, annotations)))


def _config(*tenants, run_dir="/run/d"):
    """A bundle's config.json after a runtime applied these tenants' CDI devices."""
    return {"hooks": {"createContainer": [
        {"path": "/usr/bin/python3", "args": ["/usr/bin/python3", "-m", "devbroker.cli.main",
                                             "--run-dir", run_dir, "oci-hook", "--tenant", t]}
        for t in tenants]}}


def test_tenant_from_the_applied_cdi_device():
    """`oci-seccomp --tenant-from-cdi`: one section for every tenant's containers; the
    tenant is the one whose CDI device (its oci-hook) the runtime put in config.json."""
    s = profile.seccomp_section("fuse", "/r/oci-seccomp.sock", tenant_from_cdi=True)
    # a cluster's runtime grants CAP_MKNOD: this section refuses device nodes itself
    assert [(r["names"], r["action"], r.get("errnoRet")) for r in s["syscalls"]] == [
        (list(profile.w.STAT_SYSCALLS), "SCMP_ACT_NOTIFY", None),
        *[([n], "SCMP_ACT_ERRNO", errno.EPERM) for n in ("mknod", "mknod", "mknodat", "mknodat")]]
    meta = s["listenerMetadata"]
    assert state.parse_metadata(meta) == {"devbroker": "1", "frontend": "fuse",
                                          "tenant_from": "cdi"}
    st = state.decode_state(_state(meta))
    assert state.tenant_from_cdi(st)
    cfg = _config("k8s-1")
    cfg["hooks"]["createContainer"].insert(0, {"path": "/bin/true", "args": ["true", "--tenant", "x"]})
    h = state.identify(st, cdi_tenants=state.hook_tenants(cfg, "/run/d"))
    assert (h.tenant, h.frontend) == ("k8s-1", "fuse") and "config.json" in h.sources[0]
    # another broker's hook names no tenant here; two tenants' devices are refused
    assert state.hook_tenants(_config("k8s-1", run_dir="/run/other"), "/run/d") == []
    with pytest.raises(state.StateError, match="no tenant named"):
        state.identify(st, cdi_tenants=state.hook_tenants(_config(), "/run/d"))
    with pytest.raises(state.StateError, match="more than one tenant"):
        state.identify(st, cdi_tenants=state.hook_tenants(_config("a", "b"), "/run/d"))
    # without tenant_from=cdi the applied device does not count (the sections that name
    # their tenant keep their meaning)
    plain = state.decode_state(_state("devbroker=1;frontend=fuse"))
    assert not state.tenant_from_cdi(plain)
    with pytest.raises(state.StateError, match="no tenant named"):
        state.identify(plain, cdi_tenants=["k8s-1"])
    for bad in ({"hooks": {"createContainer": "x"}}, {"hooks": []}, [],
                {"hooks": {"createContainer": [{"args": ["oci-hook", "--tenant"]}]}}):
        assert state.hook_tenants(bad, "/run/d") == []


def test_read_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_config("k8s-1")))
    assert state.hook_tenants(state.read_config(str(tmp_path)), "/run/d") == ["k8s-1"]
    for bundle, why in (("rel", "not an absolute"), (str(tmp_path / "none"), "config.json")):
        with pytest.raises(state.StateError, match=why):
            state.read_config(bundle)
    (tmp_path / "config.json").write_text("[1]")
    with pytest.raises(state.StateError, match="not a JSON object"):
        state.read_config(str(tmp_path))


# --------------------------------------------------------------------------- CDI
HOOK = ["/usr/bin/python3", "-m", "devbroker.cli.main", "--run-dir", "/run/d", "oci-hook"]
TENANTS = [cdi.TenantNodes("alice", "/run/d/nodes/alice",
                           ("nvidia-uvm", "nvidia-uvm-tools", "nvidia0", "nvidiactl", "proc")),
           cdi.TenantNodes("bob", "/run/d/nodes/bob",
                           ("nvidia-uvm", "nvidia-uvm-tools", "nvidia1", "nvidiactl", "proc")),
           cdi.TenantNodes("bad-", "/run/d/nodes/bad-", ("nvidiactl",))]


def test_cdi_spec_fuse():
    spec, skipped = cdi.cdi_spec(TENANTS, frontend="fuse", uvm_major=238, hook_argv=HOOK)
    validate_cdi(spec)
    assert skipped == ["bad-: not a valid CDI device name"]
    assert [d["name"] for d in spec["devices"]] == ["alice", "bob"]
    config = {"process": {"env": ["PATH=/bin"]}, "mounts": [
        {"destination": "/dev/nvidia1", "type": "bind", "source": "/elsewhere", "options": []},
        {"destination": "/dev", "type": "tmpfs", "source": "tmpfs"}]}
    apply_cdi(config, spec, ["devbroker.io/gpu=bob"])
    dests = [m["destination"] for m in config["mounts"]]
    assert dests[0] == "/dev" and sorted(dests[1:]) == [
        "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia1", "/dev/nvidiactl"]
    bob1 = next(m for m in config["mounts"] if m["destination"] == "/dev/nvidia1")
    assert bob1["source"] == "/run/d/nodes/bob/nvidia1" and "nosuid" in bob1["options"]
    assert "devices" not in config.get("linux", {})  # regular files: no device nodes
    assert config["process"]["env"] == ["PATH=/bin", "NVIDIA_VISIBLE_DEVICES=void"]
    (hook,) = config["hooks"]["createContainer"]
    assert hook["path"] == HOOK[0] and hook["args"][-2:] == ["--tenant", "bob"]
    with pytest.raises(CDIError):
        apply_cdi({}, spec, ["devbroker.io/gpu=carol"])


def test_cdi_spec_seccomp():
    spec, _ = cdi.cdi_spec(TENANTS[:1], frontend="seccomp", uvm_major=511, hook_argv=HOOK)
    validate_cdi(spec)
    config = apply_cdi({}, spec, ["alice"])
    devs = {d["path"]: (d["type"], d["major"], d["minor"]) for d in config["linux"]["devices"]}
    assert devs == {"/dev/nvidiactl": ("c", 195, 255), "/dev/nvidia0": ("c", 195, 0),
                    "/dev/nvidia-uvm": ("c", 511, 0)}
    # the device cgroup lets the container create them, never read or write them: every
    # open is the broker's (through the listener)
    assert {r["access"] for r in config["linux"]["resources"]["devices"]} == {"m"}
    with pytest.raises(ValueError):
        cdi.cdi_spec(TENANTS, frontend="fuse", uvm_major=238, hook_argv=["python3"])
