"""The host side of the escape tests: a broker, a victim tenant, an attacker tenant, a
flooding tenant; every attack's result matched to the audit log; a table.

    report = run_escape_tests("fuse")        # or "seccomp", "kmod", "cuse"
    print(format_table(report)); sys.exit(0 if report.ok else 1)

FUSE: ``devbroker run`` in a subprocess (temp run dir, the two-tenant policy below) and the
tenants in ``devbroker exec --tenant`` sandboxes. seccomp: the broker core in this process
(``Broker(policy, EmulatedBackend, AuditLog)``) and the tenants under
``frontends.seccomp.run_tenant`` (no sandbox: the sandbox-only attacks are listed as n/a).
kmod / CUSE: one QEMU/TCG guest boot (devbroker.testing.qemu) runs
``devbroker.escape.guest`` per front end — the broker core behind the module's or CUSE's char
nodes, victim and attacker as uids 1001/1002 — and the judging happens here, on its
``GUEST-RESULT`` lines (:func:`run_guest_escape_tests`, both front ends in one boot).
"""
from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from devbroker.escape.attacks import ATTACKS, FLOOD, Attack
from devbroker.testing.policies import broker_table, tenant, two_h200

MiB = 1 << 20
ATTACKER, VICTIM, FLOODER = "bob", "alice", "mallory"
ATTACKER_QUOTA = 256 * MiB
FLOOD_N, FLOOD_RATE, CALLS_N = 400, 100, 100
# In the QEMU/TCG guest the broker serves only ~130 requests/s in all over CUSE (one call
# of the victim takes ~25 ms there, ~8 ms through the module), so a 100/s limit would limit
# nothing: the flooder gets 25/s for 150 requests (>= 5.6 s), the victim makes 50 calls.
GUEST_FLOOD_N, GUEST_FLOOD_RATE, GUEST_CALLS_N = 150, 25, 50

ESCAPE_UUIDS = ("GPU-e5ca9e00-0000-4000-8000-000000000000",
                "GPU-e5ca9e00-0000-4000-8000-000000000001")


def _tenants(victim_gpus: tuple[int, ...] = (0, 1), **keys) -> list[str]:
    """A victim (alice, GPUs 0 and 1), an attacker (bob, GPU 0 shared with alice) and a
    flooder (mallory, GPU 0, rate-limited); `keys`: more policy keys for each."""
    return [tenant(VICTIM, gpus=list(victim_gpus), memory_quota="1GiB", **keys),
            tenant(ATTACKER, gpus=[0], memory_quota=f"{ATTACKER_QUOTA >> 20}MiB", **keys),
            tenant(FLOODER, gpus=[0], memory_quota="64MiB",
                   rate_limit={"requests_per_second": FLOOD_RATE, "burst": 10}, **keys)]


POLICY = ("# written by devbroker escape-test\n"
          + two_h200(*_tenants(), uuids=ESCAPE_UUIDS))

# The same tenants against the real driver: the host's GPUs 0 and 1 are
# the policy's (the attacks need a GPU only the victim has: a host with two GPUs), and the
# tenants get CUDA's capabilities, as a CUDA tenant would.
REAL_CAPABILITIES = ["nvml", "compute", "uvm"]


def host_gpus(backend: str) -> int:
    """GPUs the backend has: two emulated H200s, or the host's (the driver's
    /proc/driver/nvidia/gpus entries)."""
    if backend != "real":
        return 2
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def policy_text(backend: str) -> str:
    """The harness's policy for a backend: "emulated" (two emulated H200s) or "real" (the
    victim on GPUs 0 and 1, or on GPU 0 alone on a one-GPU host: the attacks that need a GPU
    only the victim has are N/A there, `_select`)."""
    if backend == "emulated":
        return POLICY
    if backend != "real":
        raise ValueError(f"backend {backend!r}: emulated or real")
    victim_gpus = (0, 1) if host_gpus(backend) >= 2 else (0,)
    return "\n".join([broker_table(backend="real", driver_version=None),
                      *_tenants(victim_gpus, capabilities=REAL_CAPABILITIES)])


SRC = str(Path(__file__).resolve().parents[2])
GUEST_FRONT_ENDS = ("kmod", "cuse")
# Containers started by runc from devbroker's CDI spec and seccomp section, by the
# front end their /dev/nvidia* use. The attacks are the ones a container changes: how the
# tenant reaches devices, nodes, mounts, other processes' fds and the broker's files. The
# broker-level attacks (handles, classes, controls, quota) run the same broker code as the
# fuse/seccomp runs and are listed N/A here.
CONTAINER_FRONT_ENDS = {"runc-fuse": "fuse", "runc-seccomp": "seccomp"}
CONTAINER_ATTACKS = ("real-nodes", "mknod-ctl", "mknod-gpu", "mknod-uvm", "proc-broker",
                     "control-socket", "umount-node", "userns-umount", "open-by-handle",
                     "io-uring", "uvm-tools", "fd-pass", "fd-pass-register", "foreign-client")
FRONT_ENDS = ("fuse", "seccomp", *GUEST_FRONT_ENDS, *CONTAINER_FRONT_ENDS)


class GuestUnavailable(RuntimeError):
    """The QEMU guest (qemu, its kernel, the guest venv) is not set up on this machine."""


@dataclass
class Row:
    attack: Attack
    verdict: str  # REFUSED | ESCAPED | NO-AUDIT | ERROR | N/A
    got: str = ""
    layer: str = ""
    audit: str = ""
    detail: str = ""
    as_expected: bool = True

    @property
    def failed(self) -> bool:
        return self.verdict in ("ESCAPED", "NO-AUDIT", "ERROR")

    def to_dict(self) -> dict:
        a = self.attack
        return {"id": a.id, "title": a.title, "category": a.category, "std": a.std,
                "expect": list(a.expect), "layer": self.layer, "verdict": self.verdict,
                "got": self.got, "as_expected": self.as_expected, "audit": self.audit,
                "detail": self.detail}


@dataclass
class Report:
    front_end: str
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # problems of the run itself
    info: list[str] = field(default_factory=list)  # how it ran (guest boot, timings)

    @property
    def ok(self) -> bool:
        return bool(self.rows) and not any(r.failed for r in self.rows)

    def to_dict(self) -> dict:
        return {"front_end": self.front_end, "ok": self.ok,
                "rows": [r.to_dict() for r in self.rows], "notes": self.notes,
                "info": self.info}


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = SRC + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _tenant_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "devbroker.escape.tenant", *args]


def _capless(argv: list[str]) -> list[str]:
    """argv run with an empty bounding set (so with no capability after the exec, root or
    not), as `devbroker exec` runs tenants: with real driver files the broker refuses to
    continue a call for a task holding CAP_SYS_ADMIN (the driver would see it)."""
    return ["setpriv", "--bounding-set", "-all", *argv]


def _victim_argv(sock: str) -> list[str]:
    # Through sh, so the victim is not pid 2 of its namespace like the attacker is: a leaked
    # victim pid must not look like the attacker's own.
    return ["/bin/sh", "-c", '/bin/true; /bin/true; exec "$@"', "sh", *_tenant_argv("--victim", sock)]


def _lines(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


# --------------------------------------------------------------------------- judging
# Attacks that use the victim's own open files: the broker records the refusal under the
# tenant whose file it is (its node directory), naming the attacker's pid in "what" ("nvidiactl
# used by pid N"). The victim is idle while the attacks run.
_AUDITED_AS_VICTIM = frozenset({"fd-pass"})


def _match_audit(attack: Attack, res: dict, audit: list[dict]) -> dict | None:
    t0, t1 = res.get("t0", 0) - 0.05, res.get("t1", 0) + 0.5
    needle = re.compile(attack.audit or "", re.I)
    tenants = {ATTACKER} | ({VICTIM} if attack.id in _AUDITED_AS_VICTIM else set())
    for rec in audit:
        if rec.get("event") != "deny" or rec.get("tenant") not in tenants:
            continue
        if not (t0 <= rec.get("ts", 0) <= t1):
            continue
        text = f"{rec.get('what', '')} {rec.get('reason', '')}"
        if needle.search(text):
            return rec
    return None


def judge(attack: Attack, res: dict | None, audit: list[dict]) -> Row:
    if res is None:
        return Row(attack, "ERROR", detail="the tenant printed no result (crashed?)")
    got = res.get("got", "")
    expected = all(g in attack.expect for g in got.split("/") if g)
    row = Row(attack, "", got, attack.layer, detail=res.get("detail", ""), as_expected=expected)
    if res["result"] == "escaped":
        row.verdict = "ESCAPED"
        return row
    if res["result"] != "refused":
        row.verdict = "ERROR"
        return row
    if attack.audit is None:
        row.verdict = "REFUSED"
        row.audit = f"(none) {attack.no_audit}"
        return row
    if res.get("by_kernel"):  # nothing reached the broker: no record is due
        row.verdict, row.layer = "REFUSED", "kernel"
        row.audit = f"(none) refused by the kernel: {row.detail}"
        return row
    rec = _match_audit(attack, res, audit)
    if rec is None:
        # Refused, but not by the broker (no deny record): e.g. the emulator said no.
        row.verdict = "NO-AUDIT"
        row.audit = f"no deny record containing {attack.audit!r}"
        return row
    row.verdict = "REFUSED"
    row.audit = f"{rec.get('what')}: {rec.get('reason')}"
    return row


def judge_flood(front_end: str, flood_done: dict | None, calls_done: dict | None,
                snap: dict, flood_n: int = FLOOD_N, calls_n: int = CALLS_N) -> Row:
    t = {x["name"]: x for x in snap.get("tenants", [])}
    fl, vi = t.get(FLOODER, {}), t.get(VICTIM, {})
    row = Row(FLOOD, "", layer=FLOOD.layer)
    if not flood_done or not calls_done:
        row.verdict = "ERROR"
        row.detail = f"flood={flood_done} calls={calls_done}"
        return row
    waited = fl.get("rate_limited", 0)
    row.got = "delayed" if waited else "not delayed"
    row.audit = (f"(none) status: {FLOODER} rate_limited={waited} requests={fl.get('requests')};"
                 f" {VICTIM} rate_limited={vi.get('rate_limited')}")
    row.detail = (f"{VICTIM}'s {calls_n} calls finished before {FLOODER}'s {flood_n}-request "
                  f"flood: {calls_done['t'] < flood_done['t']}; flood completed (delayed, "
                  f"not dropped): {flood_done.get('n') == flood_n}")
    ok = (waited > 0 and calls_done["t"] < flood_done["t"] and vi.get("rate_limited", 0) == 0
          and flood_done.get("n") == flood_n)
    row.verdict = "REFUSED" if ok else "ESCAPED"
    return row


_BACKEND_NA = "needs the real driver: the emulated backend's files continue no call"
_GPUS_NA = "needs a GPU only the victim has: the host has {} GPU(s)"


def _select(front_end: str, ids: list[str] | None, backend: str = "emulated",
            gpus: int = 2) -> tuple[list[Attack], list[Attack]]:
    """The attacks to run and the N/A ones, for a front end, a backend and `gpus` host
    GPUs."""
    import dataclasses

    run, skip = [], []
    for a in ATTACKS:
        if ids and a.id not in ids:
            continue
        if backend not in a.backends:
            skip.append(dataclasses.replace(a, na={**a.na, front_end: _BACKEND_NA}))
            continue
        if a.gpus > gpus:
            skip.append(dataclasses.replace(a, na={**a.na, front_end: _GPUS_NA.format(gpus)}))
            continue
        if front_end in CONTAINER_FRONT_ENDS:
            base = CONTAINER_FRONT_ENDS[front_end]
            # The container is the sandbox: its attacks apply to both kinds of nodes; the
            # seccomp filter's own (io_uring) only where the filter is the front end's.
            applies = a.id in CONTAINER_ATTACKS and (base in a.frontends or "fuse" in a.frontends)
            (run if applies else skip).append(a.for_frontend(base))
            continue
        (run if front_end in a.frontends else skip).append(a.for_frontend(front_end))
    return run, skip


_NA = {"seccomp": "needs the sandbox (seccomp alone is not a boundary, docs/seccomp.md)",
       "runc-fuse": "broker-level: the same broker code as the fuse run (tests/test_escape.py)",
       "runc-seccomp": "broker-level: the same broker code as the seccomp run "
                       "(tests/test_escape.py)",
       "fuse": "seccomp-filter specific",
       "kmod": "does not apply to the module's nodes", "cuse": "does not apply to CUSE nodes"}


def _na_rows(front_end: str, skip: list[Attack]) -> list[Row]:
    if front_end in CONTAINER_FRONT_ENDS:
        return [Row(a, "N/A", layer=a.layer, detail=_NA[front_end] if a.id not in
                    CONTAINER_ATTACKS else "the seccomp filter's own (io_uring): no filter "
                    "covers opens with FUSE nodes") for a in skip]
    return [Row(a, "N/A", layer=a.layer, detail=a.na.get(front_end) or _NA[front_end])
            for a in skip]


def _read_audit(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return _lines(path.read_text())


# --------------------------------------------------------------------------- real driver
def _driver_held(broker, pid) -> dict | None:
    """The real driver's own accounting of a process's video memory (GPU -> bytes), or None
    with the emulated backend."""
    backend = getattr(broker, "backend", None)
    if backend is None or not backend.counts_process_memory or not pid:
        return None
    try:
        return backend.process_vidmem(int(pid))
    except OSError:
        return None


def _driver_evidence(rows, report: Report, before: dict | None, after: dict | None) -> None:
    """Against the real driver an NV_OK for RM_FREE of the victim's handle under the
    attacker's own client is no evidence: resserv answers NV_OK for a handle the caller's
    client does not have (rs_server.c compatibility mode; the emulator does the
    same), and with real driver files the broker lets the driver validate frees on the
    tenant's own client. What decides is whether the victim's memory is still there, by the
    driver's own per-process accounting."""
    if before is None or after is None:
        return
    report.info.append(f"victim's video memory by the driver's accounting: {before} before "
                       f"the attacks, {after} after")
    for r in rows:
        if (r.attack.id == "foreign-object" and r.verdict == "ESCAPED"
                and "RM_FREE of the victim's memory succeeded" in (r.detail or "")
                and after == before and any(after.values())):
            r.verdict, r.layer = "REFUSED", "driver (the handle is not in the caller's client)"
            r.audit = (f"no record needed: the driver's answer NV_OK means no such object in "
                       f"the attacker's client; the victim still holds {after} bytes")
            r.detail = "RM_FREE answered NV_OK for an unknown handle; nothing was freed"


# --------------------------------------------------------------------------- FUSE
class _FuseBroker:
    def __init__(self, work: Path, policy: str = POLICY):
        self.run_dir = work / "run"
        self.policy = work / "policy.toml"
        self.policy.write_text(policy)
        # Against the real driver every relayed call is recorded (work/session.nvtrace), so
        # that a surprising answer can be read back call by call.
        record = (["--record", str(work / "session.nvtrace")]
                  if 'backend = "real"' in policy else [])
        self.log = open(work / "broker.log", "w+")
        self.proc = subprocess.Popen(
            self.cli("run", "--policy", str(self.policy), *record), stdout=self.log,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            env=_env())
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"broker exited {self.proc.returncode}: {self.output()}")
            try:
                if self.control({"op": "status"}).get("ok"):
                    return
            except Exception:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"broker did not start: {self.output()}")

    def cli(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "devbroker.cli.main", "--run-dir", str(self.run_dir), *args]

    def exec_argv(self, tenant: str, argv: list[str]) -> list[str]:
        # As root (capabilities reduced): the stronger attacker; `devbroker exec` runs
        # tenants as nobody unless told.
        from devbroker.testing.tenant_binds import bind_args

        # (a checkout under /tmp is bound in: the tenant's /tmp is its own)
        # --frontend fuse: with the real backend `auto` would pick seccomp
        return self.cli("exec", "--tenant", tenant, "--frontend", "fuse", "--uid", "0",
                        *bind_args(), "--", *argv)

    def control(self, req: dict) -> dict:
        from devbroker.broker.control import call

        return call(self.run_dir / "control.sock", req, timeout=10)

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        subprocess.run(["umount", "-l", str(self.run_dir / "nodes")], capture_output=True)
        self.log.close()


def end_victim(victim: subprocess.Popen | None) -> None:
    """Let the victim go (it waits on stdin), or kill it when it does not within 20 s."""
    if victim is None:
        return
    try:
        victim.stdin.close()
        victim.wait(timeout=20)
    except Exception:
        victim.kill()


def _victim_info(victim: subprocess.Popen, b, what: str) -> dict:
    """What the victim printed of itself (its handles, GPU ids, socket), with its host pid
    as the broker sees it."""
    line = victim.stdout.readline()
    if not line:
        raise RuntimeError(f"{what} failed: {victim.stderr.read()}")
    vinfo = json.loads(line)
    procs = next(t for t in b.control({"op": "status"})["tenants"]
                 if t["name"] == VICTIM)["processes"]
    vinfo["host_pid"] = procs[0] if procs else None
    vinfo["tenant"] = VICTIM
    return vinfo


def _attack_ctx(frontend: str, run_dir: str, broker_pid: int, vinfo: dict) -> dict:
    """The attacker's context (escape/attacks.py Ctx): its broker, its GPU and quota, and
    its victim."""
    return {"frontend": frontend, "run_dir": run_dir, "broker_pid": broker_pid,
            "own_gpu": 0, "victim_gpu": 1, "quota": ATTACKER_QUOTA, "victim": vinfo}


def _run_fuse(attacks: list[Attack], work: Path, flood: bool, report: Report,
              backend: str = "emulated") -> None:
    b = _FuseBroker(work, policy_text(backend))
    victim = None
    try:
        sock = f"devbroker-escape-{uuid.uuid4().hex[:12]}"
        victim = subprocess.Popen(b.exec_argv(VICTIM, _victim_argv(sock)), stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env=_env())
        ctx = _attack_ctx("fuse", str(b.run_dir), b.proc.pid, _victim_info(victim, b, "victim"))
        env = _env()
        env["DEVBROKER_ESCAPE_CTX"] = json.dumps(ctx)
        r = subprocess.run(b.exec_argv(ATTACKER, _tenant_argv(*[a.id for a in attacks])),
                           capture_output=True, text=True, env=env, timeout=300)
        (work / "attacker.out").write_text(r.stdout)
        (work / "attacker.err").write_text(r.stderr)
        results = {x["id"]: x for x in _lines(r.stdout) if "id" in x}
        if r.returncode != 0:
            report.notes.append(f"attacker exited {r.returncode}: {r.stderr[-2000:]}")
        audit = _read_audit(b.run_dir / "audit.log")
        report.rows += [judge(a, results.get(a.id), audit) for a in attacks]

        if flood:
            fl = subprocess.Popen(b.exec_argv(FLOODER, _tenant_argv("--flood", str(FLOOD_N))),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env=_env())
            start = fl.stdout.readline()
            calls = subprocess.run(b.exec_argv(VICTIM, _tenant_argv("--calls", str(CALLS_N))),
                                   capture_output=True, text=True, env=_env(), timeout=120)
            rest, err = fl.communicate(timeout=120)
            fdone = next((x for x in _lines(start + rest) if x.get("what") == "flood-done"), None)
            cdone = next((x for x in _lines(calls.stdout) if x.get("what") == "calls-done"),
                         None)
            if fdone is None or cdone is None:
                report.notes.append(f"flood stderr: {err[-500:]} calls: {calls.stderr[-500:]}")
            report.rows.append(judge_flood("fuse", fdone, cdone, b.control({"op": "status"})))
    finally:
        end_victim(victim)
        b.stop()


# --------------------------------------------------------------------------- seccomp
def _run_seccomp(attacks: list[Attack], work: Path, flood: bool, report: Report,
                 backend: str = "emulated") -> None:
    import trio

    from devbroker.assemble import assemble
    from devbroker.broker.audit import AuditLog
    from devbroker.broker.policy import load_policy_text
    from devbroker.frontends.seccomp import default_nodes, run_tenant

    policy = load_policy_text(policy_text(backend), "escape-test policy")
    audit_path = work / "audit.log"
    # Every refusal must show its own record here, so the audit's per-tenant pacing of
    # refusal records (50/s, burst 500: tests/test_audit_bounds.py) is off: the sweeps and
    # the racing-thread attacks (hundreds of tries each) would otherwise leave the attacks
    # after them with a summary record only (seen on the H200: race-direct-open NO-AUDIT).
    built = assemble(policy, audit=AuditLog(audit_path, deny_rate=0))
    broker, audit = built.broker, built.audit
    # Real driver files with the real backend (what CUDA gets), placeholders otherwise.
    real_files = broker.backend.tenant_files
    if real_files:
        broker.backend.prepare_tenant_files()
    caps = _capless if real_files else (lambda argv: argv)

    def nodes(tenant: str):
        return default_nodes(gpus=list(policy.tenants[tenant].gpus))

    async def read_line(path: Path, timeout: float = 60) -> dict | None:
        with trio.move_on_after(timeout):
            while True:
                lines = _lines(path.read_text()) if path.exists() else []
                if lines:
                    return lines[0]
                await trio.sleep(0.05)
        return None

    async def main() -> None:
        env = _env()
        sock = f"devbroker-escape-{uuid.uuid4().hex[:12]}"
        vout = open(work / "victim.out", "w")
        async with trio.open_nursery() as nursery:
            v = await nursery.start(lambda task_status=trio.TASK_STATUS_IGNORED: run_tenant(
                caps(_victim_argv(sock)), broker=broker, tenant=VICTIM, nodes=nodes(VICTIM),
                real_files=real_files,
                stdin=subprocess.PIPE, stdout=vout, stderr=subprocess.DEVNULL, env=env,
                task_status=task_status))
            vinfo = await read_line(work / "victim.out")
            if vinfo is None:
                raise RuntimeError("victim under seccomp printed nothing")
            vinfo["host_pid"] = vinfo["pid"]
            vinfo["tenant"] = VICTIM
            ctx = _attack_ctx("seccomp", "", os.getpid(), vinfo)
            aenv = dict(env, DEVBROKER_ESCAPE_CTX=json.dumps(ctx))
            held_before = _driver_held(broker, vinfo["host_pid"])
            with open(work / "attacker.out", "w") as aout, open(work / "attacker.err", "w") as aerr:
                with trio.fail_after(300):
                    rc = await run_tenant(caps(_tenant_argv(*[a.id for a in attacks])), broker=broker,
                                          tenant=ATTACKER, nodes=nodes(ATTACKER),
                                          real_files=real_files, stdout=aout,
                                          stderr=aerr, stdin=subprocess.DEVNULL, env=aenv)
            if rc != 0:
                report.notes.append(f"attacker exited {rc}: "
                                    f"{(work / 'attacker.err').read_text()[-2000:]}")
            results = {x["id"]: x for x in _lines((work / "attacker.out").read_text())
                       if "id" in x}
            rows = [judge(a, results.get(a.id), _read_audit(audit_path)) for a in attacks]
            _driver_evidence(rows, report, held_before,
                             _driver_held(broker, vinfo["host_pid"]))
            report.rows += rows
            if flood:
                fo, co = work / "flood.out", work / "calls.out"
                async with trio.open_nursery() as n2:
                    async def flooder():
                        with open(fo, "w") as f:
                            await run_tenant(caps(_tenant_argv("--flood", str(FLOOD_N))), broker=broker,
                                             tenant=FLOODER, nodes=nodes(FLOODER),
                                             real_files=real_files, stdout=f,
                                             stderr=subprocess.DEVNULL, env=env)
                    n2.start_soon(flooder)
                    await read_line(fo)
                    with open(co, "w") as f:
                        await run_tenant(caps(_tenant_argv("--calls", str(CALLS_N))), broker=broker,
                                         tenant=VICTIM, nodes=nodes(VICTIM),
                                         real_files=real_files, stdout=f,
                                         stderr=subprocess.DEVNULL, env=env)
                fdone = next((x for x in _lines(fo.read_text()) if x.get("what") == "flood-done"),
                             None)
                cdone = next((x for x in _lines(co.read_text()) if x.get("what") == "calls-done"),
                             None)
                report.rows.append(judge_flood("seccomp", fdone, cdone, broker.snapshot()))
            await v.process.stdin.aclose()
        vout.close()

    trio.run(main)
    audit.close()


# --------------------------------------------------------------------------- containers
def _container_bundle(b: "_FuseBroker", work: Path, spec: dict, tenant: str, base: str,
                      argv: list[str], env: list[str]) -> Path:
    from devbroker.testing import oci, tenant_tree

    bundle = work / f"bundle-{tenant}-{uuid.uuid4().hex[:6]}"
    bundle.mkdir()
    oci.make_bundle(bundle, argv, tenant_tree=tenant_tree.ensure(),
                    env=["PYTHONPATH=/opt/devbroker/src", *env])
    config = oci.load_config(bundle)
    oci.apply_cdi(config, spec, [f"devbroker.io/gpu={tenant}"])
    oci.save_config(bundle, config)
    r = subprocess.run(b.cli("oci-seccomp", "--frontend", base, "--tenant", tenant,
                             "--config", str(bundle / "config.json")),
                       capture_output=True, text=True, env=_env(), timeout=60)
    if r.returncode != 0:
        raise RuntimeError(f"devbroker oci-seccomp: {r.stderr}")
    return bundle


def _run_container(front_end: str, attacks: list[Attack], work: Path, report: Report,
                   backend: str = "emulated") -> None:
    """Victim (alice) and attacker (bob) in runc containers made from `devbroker cdi`'s spec
    and `devbroker oci-seccomp`'s section; Debian's python3 runs the tenant side from the
    tenant tree (bound read-only at /opt/devbroker)."""
    from devbroker.testing import oci

    base = CONTAINER_FRONT_ENDS[front_end]
    b = _FuseBroker(work, policy_text(backend))
    rt = oci.Runtime("runc", work / "runc-state")
    victim = None
    vid = f"escape-victim-{uuid.uuid4().hex[:8]}"
    try:
        r = subprocess.run(b.cli("cdi", "--frontend", base), capture_output=True, text=True,
                           env=_env(), timeout=60)
        if r.returncode != 0:
            raise RuntimeError(f"devbroker cdi: {r.stderr}")
        spec = json.loads(r.stdout)
        py = ["/usr/bin/python3", "-m", "devbroker.escape.tenant"]
        sock = f"devbroker-escape-{uuid.uuid4().hex[:12]}"
        vb = _container_bundle(b, work, spec, VICTIM, base,
                               ["/bin/sh", "-c", '/bin/true; /bin/true; exec "$@"', "sh", *py,
                                "--victim", sock], [])
        victim = rt.popen(vb, vid, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
        ctx = _attack_ctx(base, str(b.run_dir), b.proc.pid,
                          _victim_info(victim, b, "victim container"))
        ab = _container_bundle(b, work, spec, ATTACKER, base, [*py, *[a.id for a in attacks]],
                               [f"DEVBROKER_ESCAPE_CTX={json.dumps(ctx)}"])
        aid = f"escape-attacker-{uuid.uuid4().hex[:8]}"
        try:
            r = rt.run(ab, aid, capture_output=True, text=True, timeout=300,
                       stdin=subprocess.DEVNULL)
        finally:
            rt.delete(aid)
        results = {x["id"]: x for x in _lines(r.stdout) if "id" in x}
        if r.returncode != 0:
            report.notes.append(f"attacker container exited {r.returncode}: {r.stderr[-2000:]}")
        audit = _read_audit(b.run_dir / "audit.log")
        attached = {a.get("tenant") for a in audit if a.get("event") == "tenant-attached"
                    and a.get("via") == "oci"}
        if attached != {VICTIM, ATTACKER}:
            report.notes.append(f"containers attached through the runtime's hand-over: "
                                f"{sorted(map(str, attached))}")
        report.rows += [judge(a, results.get(a.id), audit) for a in attacks]
        report.info.append(f"runc containers from `devbroker cdi --frontend {base}` and "
                           f"`devbroker oci-seccomp --frontend {base}`; tenants {VICTIM} "
                           f"(victim) and {ATTACKER} (attacker) as root in their containers")
    finally:
        end_victim(victim)
        rt.delete(vid)
        b.stop()


# --------------------------------------------------------------------------- QEMU guest
_GUEST_SETUP = {"kmod": "insmod kmod/devbroker.ko major=195 gpus=2 timeout_ms=5000",
                "cuse": "modprobe cuse"}
_GUEST_UNLOAD = {"kmod": "rmmod devbroker", "cuse": "rmmod cuse"}


def guest_script(plan: dict[str, list[str]], flood: bool) -> str:
    """The guest's /bin/sh script: per front end, load it, run devbroker.escape.guest with
    the given attack ids, unload it (the module first: both want major 195)."""
    lines = ["set -u", "rc=0"]
    for fe, ids in plan.items():
        run = (f"$GUEST_PYTHON -m devbroker.escape.guest --frontend {fe} --dir $DBRUN/{fe} "
               f"--leave-chroot --attacks {shlex.quote(','.join(ids))}"
               + ("" if flood else " --no-flood"))
        lines += [f"mkdir -p $DBRUN/{fe}",
                  f"if {_GUEST_SETUP[fe]}; then",
                  f"  {run} || rc=1",
                  f"  {_GUEST_UNLOAD[fe]} || echo 'GUEST-NOTE {fe}: unload failed'",
                  "else",
                  f"  echo 'GUEST-NOTE {fe}: {_GUEST_SETUP[fe]} failed'; rc=1",
                  "fi"]
    lines.append("exit $rc")
    return "\n".join(lines) + "\n"


def _guest_ready(build: bool) -> str | None:
    from devbroker.testing import qemu

    setup = ("run scripts/qemu/setup.sh (as root: installs qemu-system-x86, busybox, the "
             "guest venv, then builds the guest kernel and kmod/)")
    if not qemu.qemu_available():
        raise GuestUnavailable(f"{qemu.QEMU} is not installed: {setup}")
    if not (qemu.GUEST_VENV / "bin" / "python3").exists():
        raise GuestUnavailable(f"the guest venv {qemu.GUEST_VENV} is missing: {setup}")
    try:
        return qemu.build() if build else qemu._kernel_dir(None).name
    except qemu.GuestError as e:
        raise GuestUnavailable(f"the guest kernel / kmod build failed: {e}") from e


def run_guest_escape_tests(front_ends: tuple[str, ...] | list[str] = GUEST_FRONT_ENDS, *,
                           ids: list[str] | None = None, flood: bool = True,
                           timeout: float = 900, build: bool = True,
                           workdir: str | Path | None = None) -> dict[str, Report]:
    """One QEMU guest boot running the escape tests against each of ``front_ends`` (kmod,
    cuse) in turn; a Report per front end, judged here like the FUSE run's."""
    from devbroker.testing import qemu

    for fe in front_ends:
        if fe not in GUEST_FRONT_ENDS:
            raise ValueError(f"front end {fe!r} does not run in the guest")
    kver = _guest_ready(build)
    plans = {fe: _select(fe, ids) for fe in front_ends}
    flood = flood and (not ids or "flood" in ids)
    script = guest_script({fe: [a.id for a in plans[fe][0]] for fe in front_ends}, flood)
    r = qemu.run_in_guest(script, timeout=timeout, kver=kver)
    got: dict[str, dict] = {fe: {} for fe in front_ends}
    notes: dict[str, list[str]] = {fe: [] for fe in front_ends}
    for line in r.output.splitlines():
        if line.startswith("GUEST-RESULT "):
            try:
                d = json.loads(line[len("GUEST-RESULT "):])
            except ValueError:
                continue
            if d.get("frontend") in got:
                got[d["frontend"]][d.pop("check")] = d
        elif line.startswith("GUEST-NOTE "):
            fe, _, msg = line[len("GUEST-NOTE "):].partition(": ")
            notes.get(fe, notes[front_ends[0]]).append(msg)
    if workdir is not None:
        work = Path(workdir)
        work.mkdir(parents=True, exist_ok=True)
        (work / "guest-output.txt").write_text(r.output)
        (work / "guest-console.txt").write_text(r.console)
        (work / "guest-dmesg.txt").write_text(r.dmesg)
    problems = qemu.kernel_problems(r.dmesg)
    reports = {}
    for fe in front_ends:
        attacks, skip = plans[fe]
        rep = Report(fe)
        res = got[fe]
        rep.notes += notes[fe]
        start = res.get("escape_broker_start", {})
        if "error" in start:
            rep.notes.append(f"guest broker did not start: {start['error'][-1500:]}")
        att = res.get("escape_attacks")
        if att is None:
            rep.notes.append(f"the guest reported no attack results (status {r.status}):\n"
                             f"{r.output[-3000:]}\n{r.console[-1500:]}")
            att = {}
        elif "error" in att:
            rep.notes.append(f"guest: {att['error']}")
        elif att.get("rc") != 0 and attacks:
            rep.notes.append(f"attacker exited {att.get('rc')}: {att.get('stderr', '')[-2000:]}")
        results = {x["id"]: x for x in att.get("results", []) if "id" in x}
        audit = att.get("audit", [])
        if workdir is not None:
            (Path(workdir) / f"audit-{fe}.jsonl").write_text(
                "".join(json.dumps(a) + "\n" for a in audit))
        rep.rows += [judge(a, results.get(a.id), audit) for a in attacks]
        if flood:
            fl = res.get("escape_flood") or {}
            rep.rows.append(judge_flood(fe, fl.get("flood_done"), fl.get("calls_done"),
                                        fl.get("status") or {}, GUEST_FLOOD_N,
                                        GUEST_CALLS_N))
        rep.rows += _na_rows(fe, skip)
        stop = res.get("escape_broker_stop", {})
        if stop and stop.get("rc") not in (0, None):
            rep.notes.append(f"guest broker exited {stop.get('rc')}: {stop.get('log', '')}")
        if problems:
            rep.notes.append("guest kernel warnings: " + " | ".join(problems[:5]))
        rep.info.append(
            f"QEMU/TCG guest, kernel {kver}, one boot for {'+'.join(front_ends)}: "
            f"{r.seconds:.0f} s (status {r.status}); {fe}: broker start "
            f"{start.get('seconds', '?')} s, attacks {att.get('seconds', '?')} s, flood "
            f"{(res.get('escape_flood') or {}).get('seconds', '-')} s; tenants: "
            f"{VICTIM} uid 1001, {ATTACKER} uid 1002, {FLOODER} uid 1003 (tenant_by_uid)")
        reports[fe] = rep
    return reports


# --------------------------------------------------------------------------- entry
def run_escape_tests(front_end: str = "fuse", *, ids: list[str] | None = None,
                     flood: bool = True, workdir: str | Path | None = None,
                     backend: str = "emulated") -> Report:
    if front_end in GUEST_FRONT_ENDS:
        return run_guest_escape_tests([front_end], ids=ids, flood=flood,
                                      workdir=workdir)[front_end]
    if front_end not in ("fuse", "seccomp", *CONTAINER_FRONT_ENDS):
        raise ValueError(f"front end {front_end!r}: one of {', '.join(FRONT_ENDS)}")
    if os.geteuid() != 0:
        raise PermissionError("escape-test needs root (FUSE mounts, namespaces, seccomp)")
    report = Report(front_end)
    attacks, skip = _select(front_end, ids, backend, host_gpus(backend))
    # The flood measures the broker's rate limiting, which containers do not change.
    flood = flood and (not ids or "flood" in ids) and front_end not in CONTAINER_FRONT_ENDS
    tmp = None
    if workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="devbroker-escape-")
        work = Path(tmp.name)
    else:
        work = Path(workdir)
        work.mkdir(parents=True, exist_ok=True)
    try:
        if front_end == "fuse":
            _run_fuse(attacks, work, flood, report, backend)
        elif front_end in CONTAINER_FRONT_ENDS:
            _run_container(front_end, attacks, work, report, backend)
        else:
            _run_seccomp(attacks, work, flood, report, backend)
    finally:
        if tmp is not None:
            tmp.cleanup()
    report.rows += _na_rows(front_end, skip)
    return report


def format_table(report: Report, width: int = 70) -> str:
    head = ("attack", "result", "refused by", "got (expected)", "audit record / evidence")
    rows = []
    for r in report.rows:
        exp = "" if r.as_expected or r.verdict == "N/A" else f" (want {'/'.join(r.attack.expect)})"
        audit = r.audit if r.verdict != "N/A" else r.detail
        if r.verdict in ("ESCAPED", "ERROR") and r.detail:
            audit = f"{r.detail} | {audit}" if audit else r.detail
        rows.append((r.attack.id, r.verdict, r.layer, (r.got + exp)[:40],
                     audit if len(audit) <= width else audit[: width - 1] + "…"))
    widths = [max(len(str(x[i])) for x in rows + [head]) for i in range(4)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths) + "  {}"
    lines = [f"devbroker escape-test, front end: {report.front_end}", "",
             fmt.format(*head), fmt.format(*("-" * w for w in widths), "-" * 24)]
    lines += [fmt.format(*r) for r in rows]
    n = {v: sum(1 for r in report.rows if r.verdict == v)
         for v in ("REFUSED", "ESCAPED", "NO-AUDIT", "ERROR", "N/A")}
    lines += ["", "  ".join(f"{k}: {v}" for k, v in n.items()),
              "RESULT: " + ("every attack refused" if report.ok else "FAILED")]
    lines += [f"note: {x}" for x in report.notes]
    lines += [f"info: {x}" for x in report.info]
    return "\n".join(lines)
