#!/usr/bin/env python3
"""Benchmark (not a test): the broker's hot path, every path measured in ONE run (issue 14).

One RM_CONTROL NV2080_CTRL_CMD_FB_GET_INFO_V2 (NVML's memory query, three entries) from a
tenant process, timed call by call (devbroker.tools.hotpath), through:

1. the floor: a C libfuse3 server answering the ioctl as it came (scripts/bench/fuse_echo.c,
   built here with gcc against libfuse3-dev; scripts/install-bench-tools.sh installs them);
   and the same answers from a C server whose requests come over io_uring, a queue per CPU
   (scripts/bench/fuse_uring_echo.c; Linux 6.14+, fuse.enable_uring, which this script turns
   on for those rows and back as it was): what the FUSE round trip costs without the
   wake-up of a thread on another CPU;
2. devbroker's FUSE front end with the emulated backend (`devbroker run` + `devbroker exec
   --frontend fuse`);
3. devbroker's FUSE front end with the real backend, its relay process driving a stand-in
   driver node: the same C server mounted as the backend's /dev (every RM call answered
   NV_OK with the argument as sent, so the broker's decode, relay, rewrite and write-back all
   run) and a /proc/driver/nvidia made from the emulator's view; then the same against a
   stand-in that answers in the kernel, as the driver does: nodes of /dev/null's device and
   a seccomp filter on the broker's processes that returns 0 for every 'F' ioctl without
   running it (tests/nvok_standin.py, the stand-in of the real-backend tests) — the same
   answers without the C server's own FUSE round trip; and against the C
   server over io_uring (one FUSE round trip of the two without the cross-CPU wake-up);
4. the seccomp front end with the emulated backend (`devbroker exec --frontend seccomp`),
   the same with the Python listener instead of the native loop (frontends/nativelane.py;
   what the loop buys), and with the broker's control lane off (broker/fastlane.py);
5. throughput with 1, 4 and 16 tenant processes calling as fast as answered (FUSE, emulated),
   and the floor's with 16 (what the machine allows at all);
6. fairness: a quiet tenant (one call every 2 ms) alone, then while another tenant floods
   with 15 busy processes (FUSE, emulated).

Prints a markdown table and writes it into docs/benchmarks.md between the markers
`<!-- bench_hotpath:begin -->` and `<!-- bench_hotpath:end -->` (--doc PATH elsewhere;
--short writes nothing unless --doc is given). --short is what CI runs
(tests/test_bench_hotpath.py): fewer calls, same rows; a crash fails it, a time never does.

    sudo .venv/bin/python scripts/bench_hotpath.py [--short] [--doc PATH] [--n 2000]
                                                  [--json PATH] [--note TEXT]
                                                  [--profile DIR]

Needs root (FUSE mounts, namespaces).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from devbroker.testing.tenant_binds import bind_args  # noqa: E402

CLI = [sys.executable, "-m", "devbroker.cli.main"]
HOTPATH = [sys.executable, "-m", "devbroker.tools.hotpath"]
DOC = REPO / "docs" / "benchmarks.md"
BEGIN, END = "<!-- bench_hotpath:begin -->", "<!-- bench_hotpath:end -->"

GPU = """
[[broker.gpu]]
name = "NVIDIA H200"
uuid = "GPU-11111111-2222-3333-4444-555555555555"
pci_bus_id = "0000:00:06.0"
memory = "141GiB"
"""
# Not paced: what is measured is the broker, not the tenants' own rate limits.
TENANTS = """
[tenant.quiet]
gpus = [0]
memory_quota = "16GiB"
rate_limit = { requests_per_second = 100000000, burst = 100000000 }

[tenant.noisy]
gpus = [0]
memory_quota = "16GiB"
rate_limit = { requests_per_second = 100000000, burst = 100000000 }
"""
EMULATED_POLICY = '[broker]\nbackend = "emulated"\ndriver_version = "580.159.04"\n' + GPU + TENANTS
REAL_POLICY = '[broker]\nbackend = "real"\ndriver_version = "580.159.04"\n' + TENANTS


def log(msg: str) -> None:
    print(f"bench_hotpath: {msg}", file=sys.stderr, flush=True)


def pct(ns: list[int], p: float) -> float:
    xs = sorted(ns)
    return xs[min(len(xs) - 1, int(p * len(xs)))] / 1000.0


def json_line(proc: subprocess.Popen, what: str, timeout: float) -> dict:
    """The next JSON line the program prints (other lines are passed to stderr)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"program ended before its {what!r} line (rc {proc.wait()})")
        try:
            d = json.loads(line)
        except ValueError:
            sys.stderr.write(line)
            continue
        if d.get("what") == what:
            return d
    raise RuntimeError(f"no {what!r} line within {timeout} s")


def end_child(p: subprocess.Popen) -> None:
    """A child that runs until its stdin closes: close it, wait up to 30 s, else kill."""
    p.stdin.close()
    try:
        p.wait(timeout=30)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def run_json(argv: list[str], what: str, timeout: float = 300) -> dict:
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    try:
        d = json_line(p, what, timeout)
        if p.wait(timeout=60) != 0:
            raise RuntimeError(f"{argv[-4:]} exited {p.returncode}")
        return d
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


# ------------------------------------------------------------------ the C server
def build_echo(work: Path) -> Path:
    if not shutil.which("gcc") or subprocess.run(["pkg-config", "--exists", "fuse3"]).returncode:
        if os.geteuid() == 0:
            subprocess.run(["sh", str(REPO / "scripts" / "install-bench-tools.sh")], check=True)
        else:
            raise SystemExit("gcc and libfuse3-dev missing: run scripts/install-bench-tools.sh")
    flags = subprocess.run(["pkg-config", "--cflags", "--libs", "fuse3"], check=True,
                           capture_output=True, text=True).stdout.split()
    out = work / "fuse_echo"
    subprocess.run(["gcc", "-O2", "-o", str(out), str(REPO / "scripts" / "bench" / "fuse_echo.c"),
                    *flags], check=True)
    return out


def build_uring_echo(work: Path) -> Path:
    out = work / "fuse_uring_echo"
    subprocess.run(["gcc", "-O2", "-o", str(out),
                    str(REPO / "scripts" / "bench" / "fuse_uring_echo.c"), "-lpthread"],
                   check=True)
    return out


URING_PARAM = Path("/sys/module/fuse/parameters/enable_uring")


def uring_unavailable() -> str | None:
    """Why FUSE servers cannot use io_uring here, or None."""
    if not URING_PARAM.exists():
        return "this kernel has no FUSE io_uring transport (Linux 6.14+, CONFIG_FUSE_IO_URING)"
    if os.geteuid() != 0:
        return "turning fuse.enable_uring on needs root"
    return None


class UringOn:
    """fuse.enable_uring on while in the block (new mounts may negotiate io_uring), then as
    it was."""

    def __enter__(self):
        self.was = URING_PARAM.read_text().strip()
        URING_PARAM.write_text("Y")
        return self

    def __exit__(self, *exc):
        URING_PARAM.write_text(self.was)


class EchoServer:
    """fuse_echo mounted at a directory (single-threaded, like the broker's one reader)."""

    def __init__(self, binary: Path, mount: Path):
        self.mount = mount
        mount.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen([str(binary), str(mount), "-f", "-s", "-o", "allow_other"])
        deadline = time.monotonic() + 10
        while not (mount / "nvidiactl").exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("fuse_echo did not come up")
            time.sleep(0.05)

    def stop(self) -> None:
        subprocess.run(["umount", "-l", str(self.mount)], capture_output=True)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class UringEchoServer(EchoServer):
    """fuse_uring_echo mounted at a directory: requests over io_uring, one ring thread
    pinned to each CPU."""

    def __init__(self, binary: Path, mount: Path):
        self.mount = mount
        mount.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen([str(binary), str(mount)], stdout=subprocess.PIPE, text=True)
        ready, _, _ = select.select([self.proc.stdout], [], [], 10)
        line = self.proc.stdout.readline().split() if ready else []
        if line != ["ready", "uring"]:  # ("ready dev": the kernel did not offer io_uring)
            self.stop()
            raise RuntimeError(f"fuse_uring_echo did not come up over io_uring ({line or 'no line'}"
                               f", rc {self.proc.poll()})")


# ------------------------------------------------------------------ the daemon (emulated)
class Daemon:
    def __init__(self, work: Path):
        self.work = work
        work.mkdir(parents=True, exist_ok=True)
        (work / "policy.toml").write_text(EMULATED_POLICY)
        self.run = CLI + ["--run-dir", str(work / "run")]
        self.log = open(work / "broker.log", "w")
        self.proc = subprocess.Popen(self.run + ["run", "--policy", str(work / "policy.toml")],
                                     stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + 60
        while subprocess.run(self.run + ["status"], capture_output=True).returncode != 0:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the broker did not start; see {work / 'broker.log'}")
            time.sleep(0.1)

    def exec_argv(self, tenant: str, frontend: str, argv: list[str]) -> list[str]:
        return self.run + ["exec", "--tenant", tenant, "--uid", "0", "--frontend", frontend,
                           *bind_args(), "--", *argv]

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        subprocess.run(["umount", "-l", str(self.work / "run" / "nodes")], capture_output=True)


# ------------------------------------------------------------------ the stand-in broker
STANDIN_NODES = ["nvidiactl"] + [f"nvidia{i}" for i in range(8)] + ["nvidia-uvm",
                                                                    "nvidia-uvm-tools"]


class KernelStandin:
    """A /dev of nodes with /dev/null's device (c 1:3) under the names of the driver's: the
    broker's processes run under tests/nvok_standin.py's filter, so an 'F' ioctl on them
    returns 0 with the argument as sent, answered by the kernel (KERNEL_STANDIN)."""

    def __init__(self, mount: Path):
        self.mount = mount
        mount.mkdir(parents=True, exist_ok=True)
        os.chmod(mount, 0o755)
        for name in STANDIN_NODES:
            os.mknod(mount / name, 0o666 | 0o020000, os.makedev(1, 3))
            os.chmod(mount / name, 0o666)

    def stop(self) -> None:
        pass


KERNEL_STANDIN = [sys.executable, str(REPO / "tests" / "nvok_standin.py")]


def serve_standin(work: Path, echo_bin: Path, kind: str = "fuse") -> int:
    """(In a child process.) A broker with the real backend whose /dev is fuse_echo (kind
    "fuse"), fuse_uring_echo ("fuse-uring": echo_bin is that program) or KernelStandin's
    nodes ("kernel": this process runs under nvok_standin.py) and whose /proc/driver/nvidia
    is the emulator's view, serving the FUSE front end at work/nodes."""
    import trio

    from devbroker.backends.emulated import EmulatedGpu
    from devbroker.backends.real import RealBackend
    from devbroker.broker import procview
    from devbroker.broker.audit import AuditLog
    from devbroker.broker.callstats import CallStats, InstrumentedBroker
    from devbroker.broker.core import Broker
    from devbroker.broker.policy import load_policy_text
    from devbroker.daemon import tenant_tree
    from devbroker.frontends.fuse import FuseFrontend

    dev = (EchoServer(echo_bin, work / "standin-dev") if kind == "fuse"
           else UringEchoServer(echo_bin, work / "standin-dev") if kind == "fuse-uring"
           else KernelStandin(work / "standin-dev"))
    proc = work / "standin-proc"
    gpu = EmulatedGpu(index=0, name="NVIDIA H200", uuid="GPU-11111111-2222-3333-4444-555555555555",
                      pci_bus_id="0000:00:06.0", memory_bytes=141 << 30)
    for rel, data in procview.tenant_view([gpu], (0,), "580.159.04").items():
        (proc / rel).parent.mkdir(parents=True, exist_ok=True)
        (proc / rel).write_bytes(data)
    try:
        backend = RealBackend(dev=str(dev.mount), proc=proc, discover=False,
                              private_dir=work / "private-nodes")
        audit = AuditLog(work / "standin-audit.log")
        broker = Broker(load_policy_text(REAL_POLICY, "standin"), backend, audit)
        front = InstrumentedBroker(broker, CallStats())

        async def main():
            async with FuseFrontend(work / "nodes", front) as fe:
                fe.set_tree(tenant_tree(broker))
                async with trio.open_nursery() as n:
                    broker.set_spawner(n.start_soon)
                    print(json.dumps({"what": "ready"}), flush=True)
                    await trio.to_thread.run_sync(sys.stdin.read)
                    n.cancel_scope.cancel()

        trio.run(main)
        backend.relay.stop()
    finally:
        dev.stop()
    return 0


# ------------------------------------------------------------------ profiles (--profile)
class Profile:
    """py-spy sampling a broker process while one row is measured (collapsed stacks)."""

    def __init__(self, outdir: Path | None, name: str, pid: int):
        self.proc = None
        if outdir is None:
            return
        spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        if not os.path.exists(spy):
            raise SystemExit("--profile needs py-spy (pip install py-spy)")
        outdir.mkdir(parents=True, exist_ok=True)
        self.out = outdir / f"{name}.collapsed"
        self.proc = subprocess.Popen([spy, "record", "-p", str(pid), "-f", "raw", "-r", "500",
                                      "--nonblocking", "-o", str(self.out)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)  # attached before the calls start

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        if self.out.exists():
            (self.out.parent / (self.out.stem + ".top.txt")).write_text(summarize(self.out))


def summarize(path: Path, top: int = 25) -> str:
    """Own (leaf) and inclusive sample shares per function, from py-spy's raw output;
    idle waits (poll, sleep, lock waits of idle threads) are left out."""
    own: dict[str, int] = {}
    incl: dict[str, int] = {}
    total = 0
    idle = ("poll (", "select (", "wait (", "_park (", "run (trio", "get_events (", "sleep (",
            "readline (", "_wait_for_tstate_lock", "read (sys",
            "_work (trio/_core/_thread_cache.py:211)",  # an idle worker waiting for a job
            "_reader_main (devbroker/frontends/fuse.py:")  # a reader thread in poll()
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        frames = stack.split(";")
        if any(frames[-1].startswith(i) or i in frames[-1] for i in idle):
            continue
        n = int(n)
        total += n
        own[frames[-1]] = own.get(frames[-1], 0) + n
        for f in set(frames):
            incl[f] = incl.get(f, 0) + n
    if not total:
        return "no busy samples\n"
    out = [f"busy samples: {total}", "", "own %  function"]
    out += [f"{100 * c / total:5.1f}  {f}" for f, c in
            sorted(own.items(), key=lambda kv: -kv[1])[:top]]
    out += ["", "incl %  function"]
    out += [f"{100 * c / total:5.1f}  {f}" for f, c in
            sorted(incl.items(), key=lambda kv: -kv[1])[:top]]
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------ the run
def standin_row(a, work: Path, echo_bin: Path, rows: dict, key: str, kind: str,
                wrap: list[str]) -> None:
    """FUSE + real backend against a stand-in driver (serve_standin's `kind`), in a child
    process started through `wrap`; its latency row under rows[key]."""
    log(f"FUSE + real backend against the stand-in node ({kind})")
    sw = work / key
    sw.mkdir()
    os.chmod(sw, 0o755)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO / "src")] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    host = subprocess.Popen(wrap + [sys.executable, __file__, "_standin", str(sw),
                                    str(echo_bin), kind],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        json_line(host, "ready", 60)
        from devbroker.backends.real import gpu_id_of

        prof = Profile(a.profile, key, host.pid)
        d = run_json(HOTPATH + ["latency", "--n", str(a.n), "--dev", str(sw / "nodes" / "quiet"),
                                "--gpu-id", hex(gpu_id_of("0000:00:06.0"))], "latency")
        prof.stop()
        rows[key] = {"ns": d["ns"]}
    finally:
        end_child(host)


def measure(a) -> dict:
    work = Path(tempfile.mkdtemp(prefix="devbroker-hotpath-"))
    os.chmod(work, 0o755)  # the relay (uid 65534) opens the stand-in's nodes under it
    rows: dict[str, dict] = {}
    n = a.n
    echo_bin = build_echo(work)

    log("floor: C libfuse3 server")
    echo = EchoServer(echo_bin, work / "floor")
    try:
        d = run_json(HOTPATH + ["latency", "--raw", "--n", str(n), "--dev", str(echo.mount)],
                     "latency")
        rows["floor"] = {"ns": d["ns"]}
        d = run_json(HOTPATH + ["throughput", "--raw", "--procs", "16", "--seconds",
                                str(a.seconds), "--dev", str(echo.mount)], "throughput")
        rows["floor-throughput-16"] = {"calls": d["calls"], "seconds": d["seconds"]}
    finally:
        echo.stop()

    why = uring_unavailable()
    if why is None:
        uring_bin = build_uring_echo(work)
        with UringOn():
            log("floor over io_uring: C server, a queue per CPU")
            try:
                server = UringEchoServer(uring_bin, work / "floor-uring")
            except RuntimeError as e:
                why = str(e)
            else:
                try:
                    d = run_json(HOTPATH + ["latency", "--raw", "--n", str(n), "--dev",
                                            str(server.mount)], "latency")
                    rows["floor-uring"] = {"ns": d["ns"]}
                finally:
                    server.stop()
            if why is None:
                standin_row(a, work, uring_bin, rows, "fuse-real-uring", "fuse-uring", [])
    if why is not None:
        log(f"rows over io_uring not measured: {why}")
        rows["floor-uring"] = rows["fuse-real-uring"] = {"not": why}

    standin_row(a, work, echo_bin, rows, "fuse-real", "fuse", [])
    standin_row(a, work, echo_bin, rows, "fuse-real-kernel", "kernel", KERNEL_STANDIN)

    log("devbroker run (emulated backend)")
    daemon = Daemon(work / "daemon")
    try:
        log("FUSE + emulated")
        prof = Profile(a.profile, "fuse-emulated", daemon.proc.pid)
        d = run_json(daemon.exec_argv("quiet", "fuse", HOTPATH + ["latency", "--n", str(n)]),
                     "latency")
        prof.stop()
        rows["fuse-emulated"] = {"ns": d["ns"]}
        log("seccomp + emulated")
        prof = Profile(a.profile, "seccomp-emulated", daemon.proc.pid)
        d = run_json(daemon.exec_argv("quiet", "seccomp", HOTPATH + ["latency", "--n", str(n)]),
                     "latency")
        prof.stop()
        rows["seccomp-emulated"] = {"ns": d["ns"]}
        for procs in (1, 4, 16):
            log(f"throughput, {procs} tenant processes")
            prof = Profile(a.profile if procs == 16 else None, "throughput-16", daemon.proc.pid)
            d = run_json(daemon.exec_argv("quiet", "fuse", HOTPATH + [
                "throughput", "--procs", str(procs), "--seconds", str(a.seconds)]), "throughput")
            prof.stop()
            if not d["ok"]:
                raise RuntimeError(f"a throughput caller failed ({procs} processes)")
            rows[f"throughput-{procs}"] = {"calls": d["calls"], "seconds": d["seconds"]}
        log("fairness: quiet tenant alone, then next to a flood")
        quiet_argv = HOTPATH + ["quiet", "--n", str(a.quiet_n), "--interval", "0.002", "--wait"]
        rows["quiet-alone"] = quiet_run(daemon, quiet_argv, None)
        rows["quiet-flooded"] = quiet_run(daemon, quiet_argv, 15)
    finally:
        daemon.stop()
    for key, env, what in (
            ("seccomp-emulated-python", "DEVBROKER_NATIVE_LANE",
             "seccomp + emulated, the Python listener (what the native loop buys)"),
            ("seccomp-emulated-nolane", "DEVBROKER_CONTROL_LANE",
             "seccomp + emulated, control lane off (what the lanes buy)")):
        log(what)
        os.environ[env] = "0"
        try:
            daemon = Daemon(work / f"daemon-{key}")
        finally:
            os.environ.pop(env, None)
        try:
            d = run_json(daemon.exec_argv("quiet", "seccomp", HOTPATH + ["latency", "--n", str(n)]),
                         "latency")
            rows[key] = {"ns": d["ns"]}
        finally:
            daemon.stop()
    shutil.rmtree(work, ignore_errors=True)
    return rows


def quiet_run(daemon: Daemon, argv: list[str], flood_procs: int | None) -> dict:
    q = subprocess.Popen(daemon.exec_argv("quiet", "fuse", argv), stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    f = None
    try:
        json_line(q, "ready", 60)
        if flood_procs:
            f = subprocess.Popen(daemon.exec_argv("noisy", "fuse", HOTPATH + [
                "flood", "--procs", str(flood_procs)]), stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, text=True)
            json_line(f, "flood-start", 120)
            time.sleep(0.5)  # every flooding process calling
        q.stdin.write("go\n")
        q.stdin.flush()
        d = json_line(q, "quiet", 300)
        q.wait(timeout=60)
        return {"ns": d["ns"]}
    finally:
        if f is not None:
            end_child(f)
        if q.poll() is None:
            q.kill()
            q.wait()


# ------------------------------------------------------------------ the table
# Issue 14's "real backend against a stand-in node ≤ 150 µs" is judged on the stand-in that
# answers in the kernel, in the caller's own system call, as the driver does. Against a
# stand-in that is itself a FUSE server each call makes two FUSE round trips, the broker's
# and the stand-in's, so that row carries the floor twice (docs/benchmarks.md, "Which
# stand-in"): shown, with the stand-in over io_uring beside it, not judged.
LATENCY_ROWS = [
    ("floor", "C libfuse3 server answering the ioctl (the floor)", None),
    ("floor-uring", "C server over io_uring, a queue per CPU (no wake-up across CPUs)", None),
    ("fuse-emulated", "devbroker FUSE + emulated backend", 100),
    ("fuse-real-kernel", "devbroker FUSE + real backend against a stand-in node answering in "
     "the kernel (nvok_standin.py)", 150),
    ("fuse-real", "the same (lane calls local) against a stand-in node that is a C FUSE server "
     "(libfuse3): two FUSE round trips", None),
    ("fuse-real-uring", "the same, that C FUSE server over io_uring", None),
    ("seccomp-emulated", "devbroker seccomp front end + emulated backend", None),
    ("seccomp-emulated-python", "the same, the Python listener (DEVBROKER_NATIVE_LANE=0)", None),
    ("seccomp-emulated-nolane", "the same, control lane off (DEVBROKER_CONTROL_LANE=0)", None),
]


def table(rows: dict, a) -> tuple[str, dict]:
    """The markdown table and the numbers it shows (for --json and the CI test)."""
    nums: dict[str, float] = {}
    lines = ["| path | n | p50 µs | p90 µs | target |", "| --- | ---: | ---: | ---: | --- |"]
    for key, label, target in LATENCY_ROWS:
        if "not" in rows[key]:
            lines.append(f"| {label} | | | | not measured: {rows[key]['not']} |")
            continue
        ns = rows[key]["ns"]
        p50, p90 = pct(ns, .5), pct(ns, .9)
        nums[f"{key}.p50_us"], nums[f"{key}.p90_us"] = p50, p90
        verdict = "" if target is None else (
            f"≤ {target}: {'met' if p50 <= target else '**missed**'}")
        lines.append(f"| {label} | {len(ns)} | {p50:.1f} | {p90:.1f} | {verdict} |")
    lines += ["", "| throughput (FUSE + emulated, one tenant) | calls/s | target |",
              "| --- | ---: | --- |"]
    r = rows["floor-throughput-16"]
    nums["floor-throughput-16.calls_per_s"] = r["calls"] / r["seconds"]
    lines.append(f"| the floor (C server), 16 processes: this machine's ceiling | "
                 f"{r['calls'] / r['seconds']:,.0f} | |")
    for procs in (1, 4, 16):
        r = rows[f"throughput-{procs}"]
        rate = r["calls"] / r["seconds"]
        nums[f"throughput-{procs}.calls_per_s"] = rate
        verdict = "" if procs != 16 else (
            f"≥ 10,000: {'met' if rate >= 10000 else '**missed**'}")
        lines.append(f"| {procs} tenant process{'es' if procs > 1 else ''} | {rate:,.0f} | "
                     f"{verdict} |")
    alone, flooded = rows["quiet-alone"]["ns"], rows["quiet-flooded"]["ns"]
    a50, f50 = pct(alone, .5), pct(flooded, .5)
    ratio = f50 / a50 if a50 else float("inf")
    nums.update({"quiet-alone.p50_us": a50, "quiet-flooded.p50_us": f50,
                 "quiet.ratio": ratio})
    lines += ["", "| fairness (FUSE + emulated) | n | p50 µs | p90 µs | target |",
              "| --- | ---: | ---: | ---: | --- |",
              f"| quiet tenant (one call every 2 ms) alone | {len(alone)} | {a50:.1f} | "
              f"{pct(alone, .9):.1f} | |",
              f"| the same while another tenant floods (15 processes) | {len(flooded)} | "
              f"{f50:.1f} | {pct(flooded, .9):.1f} | ≤ 2× alone: "
              f"{'met' if ratio <= 2 else '**missed**'} ({ratio:.2f}×) |"]
    return "\n".join(lines), nums


def write_doc(path: Path, text: str) -> None:
    old = path.read_text() if path.exists() else ""
    block = f"{BEGIN}\n{text}\n{END}"
    if BEGIN in old and END in old:
        new = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _m: block, old,
                     flags=re.S)
    else:
        new = old.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(new)


def main() -> int:
    if len(sys.argv) == 5 and sys.argv[1] == "_standin":
        return serve_standin(Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--short", action="store_true", help="CI's run: fewer calls, same rows")
    ap.add_argument("--n", type=int, help="calls per latency row (default 2000; short 200)")
    ap.add_argument("--doc", type=Path, help="markdown file whose marked section is rewritten "
                                             "(default docs/benchmarks.md; short: none)")
    ap.add_argument("--json", type=Path, help="also write the numbers as JSON here")
    ap.add_argument("--note", default="", help="a line printed above the table")
    ap.add_argument("--profile", type=Path, metavar="DIR",
                    help="sample the broker with py-spy during the FUSE rows and the 16-process "
                         "throughput (DIR/<row>.collapsed and a summary DIR/<row>.top.txt)")
    a = ap.parse_args()
    if os.geteuid() != 0:
        print("bench_hotpath: needs root (FUSE mounts, namespaces)", file=sys.stderr)
        return 2
    a.n = a.n or (200 if a.short else 2000)
    a.seconds = 0.5 if a.short else 2.0
    a.quiet_n = 100 if a.short else 500
    t0 = time.monotonic()
    rows = measure(a)
    text, nums = table(rows, a)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    head = (f"`scripts/bench_hotpath.py{' --short' if a.short else ''}`, {when}, "
            f"{os.cpu_count()} CPUs, Python {sys.version.split()[0]}, one run "
            f"({time.monotonic() - t0:.0f} s). One RM_CONTROL FB_GET_INFO_V2 (3 entries) "
            "per call, timed in the tenant." + (f" {a.note}" if a.note else ""))
    out = head + "\n\n" + text
    print(out)
    doc = a.doc if a.doc is not None else (None if a.short else DOC)
    if doc is not None:
        write_doc(doc, out)
    if a.json is not None:
        a.json.write_text(json.dumps({"numbers": nums, "short": a.short}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
