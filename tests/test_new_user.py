"""A new user's first hour: the README's examples as written, the mistakes a new
user makes on the command line (through real `devbroker` processes), and what the scripts
and the checkout promise — nothing read from beside the checkout, nothing upgraded."""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from devbroker.testing.policies import two_h200, tenant

from conftest import DEVBROKER, REPO

README = REPO / "README.md"
POLICY = two_h200(tenant("alice", gpus=[0]), tenant("bob", gpus=[1], memory_quota="32GiB"))
# An unprivileged owner for the directories the README's example binds.
OWNER = 4321


def one_line(text: str) -> str:
    """The single line of text (a user's mistake gets one line, never a traceback)."""
    lines = text.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in text and "Errno" not in text, text
    return lines[0]


# ------------------------------------------------------------------------ the checkout
def test_what_the_tests_read_is_in_the_checkout(traces_dir):
    # a clone has nothing beside it: the H200 recordings come from tests/data
    assert traces_dir.resolve().is_relative_to(REPO.resolve())
    for name in ("torch", "nvml"):
        assert (traces_dir / f"h200-580.159.04-{name}.nvtrace").stat().st_size > 0
    # and no test module builds a path beside the checkout (../shared, parents[2], ...)
    beside = re.compile(r"""\.\./shared|parent\.parent\.parent|parents\[[2-9]\]|"""
                        r"""parents\[1\]\.parent|REPO\.parent|/ ["']shared["']""")
    offenders = [f"{p.name}:{n}" for p in sorted((REPO / "tests").glob("*.py"))
                 for n, line in enumerate(p.read_text().splitlines(), 1)
                 if beside.search(line.split("#", 1)[0]) and p.name != Path(__file__).name]
    assert offenders == []


def test_the_location_copies_run_the_tests_that_read_the_recordings():
    text = (REPO / "scripts" / "test-locations.sh").read_text()
    assert "tests/test_cuda_rules.py tests/test_fastlane.py" in text
    assert "test_lane_answers_as_the_general_path" in text  # the one whose tenant reads them


# ------------------------------------------------------------------------ --run-dir
def _subparsers(parser: argparse.ArgumentParser, path=()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield path + (name,), child
                yield from _subparsers(child, path + (name,))


def test_every_command_takes_run_dir_after_its_name():
    from devbroker.cli.main import build_parser

    commands = list(_subparsers(build_parser()))
    assert len(commands) > 10
    missing = [" ".join(path) for path, p in commands if "--run-dir" not in
               p._option_string_actions]
    assert missing == []
    # the top-level default stands unless one of the two places gives it
    ns = build_parser().parse_args(["status"])
    assert ns.run_dir == "/run/devbroker"
    ns = build_parser().parse_args(["policy", "show", "--run-dir", "/x"])
    assert ns.run_dir == "/x"


@pytest.mark.root
def test_run_dir_after_the_command_reaches_that_broker(start_broker):
    b = start_broker(POLICY)
    r = subprocess.run(DEVBROKER + ["status", "--run-dir", str(b.run_dir)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "alice" in r.stdout, r.stderr
    r = subprocess.run(DEVBROKER + ["exec", "--run-dir", str(b.run_dir), "--tenant", "bob",
                                    "--uid", "0", "--", "sh", "-c", "ls /dev | grep nvidia"],
                       capture_output=True, text=True, timeout=60, cwd="/")
    assert r.returncode == 0, r.stderr
    assert "nvidia1" in r.stdout.split() and "nvidia0" not in r.stdout.split()


# ------------------------------------------------------------------------ devbroker run
@pytest.mark.root
def test_a_second_broker_on_a_run_dir_in_use_says_so_in_one_line(start_broker):
    b = start_broker(POLICY)
    r = subprocess.run(DEVBROKER + ["run", "--run-dir", str(b.run_dir)],
                       capture_output=True, text=True, timeout=60)
    line = one_line(r.stderr)
    assert r.returncode == 1
    assert f"a broker (pid {b.proc.pid}) is already running on {b.run_dir}" in line
    assert f"kill {b.proc.pid}" in line and "--run-dir" in line
    # its control socket gone, its FUSE mount still live: still one line with what to do
    (b.run_dir / "control.sock").rename(b.run_dir / "moved.sock")
    try:
        r = subprocess.run(DEVBROKER + ["--run-dir", str(b.run_dir), "run"],
                           capture_output=True, text=True, timeout=60)
    finally:
        (b.run_dir / "moved.sock").rename(b.run_dir / "control.sock")
    line = one_line(r.stderr)
    assert r.returncode == 1
    assert f"a live FUSE file system is mounted at {b.run_dir}/nodes" in line
    assert "another --run-dir" in line
    assert b.status()["ok"]  # the first broker serves on


# ------------------------------------------------------------------------ devbroker exec
@pytest.fixture
def closed_dir():
    """A PATH directory nobody may search (like root's /root/.cargo/bin), outside /tmp so
    that the tenant sees it as the host has it."""
    closed = Path(tempfile.mkdtemp(prefix="devbroker-closed-path-", dir="/var/tmp"))  # 0700
    (closed / "bin").mkdir()
    yield closed / "bin"
    shutil.rmtree(closed)


@pytest.mark.root
def test_a_missing_program_is_not_found_even_behind_a_closed_path_dir(start_broker,
                                                                        closed_dir):
    b = start_broker(POLICY)
    env = dict(os.environ, PATH=f"{closed_dir}:/usr/bin:/bin")
    r = subprocess.run(DEVBROKER + ["--run-dir", str(b.run_dir), "exec", "--tenant", "alice",
                                    "--", "no-such-program"],
                       capture_output=True, text=True, timeout=60, env=env, cwd="/")
    assert r.returncode == 127, r.stderr
    assert one_line(r.stderr) == ("devbroker exec: no-such-program: command not found "
                                  "(searched PATH as uid 65534); give its full path")
    # a program that is there runs, though that directory comes first
    r = subprocess.run(DEVBROKER + ["--run-dir", str(b.run_dir), "exec", "--tenant", "alice",
                                    "--", "id", "-u"],
                       capture_output=True, text=True, timeout=60, env=env, cwd="/")
    assert (r.returncode, r.stdout.strip(), r.stderr) == (0, "65534", "")
    # found but not executable: 126, the path and the uid, as text
    r = b.exec("alice", "/etc/passwd", uid=None, cwd="/")
    assert r.returncode == 126
    assert one_line(r.stderr) == ("devbroker exec: /etc/passwd: Permission denied (as uid "
                                  "65534); check its mode, or choose the uid with --uid")


@pytest.mark.root
def test_a_directory_under_the_hosts_tmp_says_once_why_it_runs_in_root(start_broker, tmp_path):
    b = start_broker(POLICY)
    here = tmp_path / "work"
    here.mkdir()
    r = b.exec("alice", "pwd", uid=0, cwd=here)
    assert r.returncode == 0 and r.stdout == "/\n"
    assert one_line(r.stderr) == (
        f"devbroker exec: running in /: the current directory {here} is under the host's "
        f"/tmp, which the command does not see (its /tmp is its own); --bind {here} keeps "
        "it, --cwd DIR chooses another")
    # bound, it is kept, and nothing is said
    r = b.exec("alice", "pwd", uid=0, cwd=here, opts=("--bind", str(here)))
    assert (r.returncode, r.stdout, r.stderr) == (0, f"{here}\n", "")
    # asked for by --cwd and not there: refused, in one line with what to do
    r = b.exec("alice", "pwd", uid=0, opts=("--cwd", str(here)))
    assert r.returncode == 125
    assert one_line(r.stderr) == (f"devbroker exec: --cwd {here}: not in the command's view "
                                  "(the host's files, a /tmp of its own, the --bind targets); "
                                  "--bind it or choose another --cwd")


def _readme_line(pattern: str) -> str:
    lines = [line.split("#", 1)[0].strip() for line in README.read_text().splitlines()]
    found = [line for line in lines if re.fullmatch(pattern, line)]
    assert len(found) == 1, found
    return found[0]


TRAIN = "import os\nopen('checkpoint.pt', 'w').write(str(os.getuid()))\nprint('trained')\n"


@pytest.mark.root
def test_readme_exec_with_a_writable_bind_runs_as_written(start_broker, tmp_path):
    """`devbroker exec --tenant alice --bind $PWD:$PWD:rw -- python3 train.py`, as root (no
    sudo): in a user's directory it runs as that user and writes there; in root's it
    refuses up front with one line naming --uid."""
    if not os.access("/usr/bin/python3", os.X_OK):
        pytest.skip("the example runs python3 from the host (/usr/bin/python3)")
    line = _readme_line(r"devbroker exec --tenant alice --bind \$PWD:\$PWD:rw -- python3 \S+")
    b = start_broker(POLICY)
    # the README's `devbroker`, on this broker: its --run-dir after the command's name
    shell = (f'devbroker() {{ sub=$1; shift; "$DEVBROKER_PY" -m devbroker.cli.main "$sub" '
             f'--run-dir "$RUN_DIR" "$@"; }}\n{line}\n')
    env = {k: v for k, v in os.environ.items() if k not in ("SUDO_UID", "SUDO_GID")}
    env.update(DEVBROKER_PY=sys.executable, RUN_DIR=str(b.run_dir))
    tmp_path.chmod(0o755)
    users = tmp_path / "users-project"
    users.mkdir()
    (users / "train.py").write_text(TRAIN)
    os.chown(users, OWNER, OWNER)
    r = subprocess.run(["bash", "-c", shell], cwd=users, env=env, capture_output=True,
                       text=True, timeout=120)
    assert (r.returncode, r.stdout, r.stderr) == (0, "trained\n", "")
    ck = users / "checkpoint.pt"
    assert ck.read_text() == str(OWNER) and (ck.stat().st_uid, ck.stat().st_gid) == (OWNER,
                                                                                      OWNER)

    roots = tmp_path / "roots-project"
    roots.mkdir()
    (roots / "train.py").write_text(TRAIN)
    r = subprocess.run(["bash", "-c", shell], cwd=roots, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 125 and r.stdout == ""
    msg = one_line(r.stderr)
    assert msg.startswith(f"devbroker exec: --bind {roots}:{roots}:rw: {roots} is root's")
    assert "add --uid 0" in msg and not (roots / "checkpoint.pt").exists()
    # with the hint followed, it runs (as root, without capabilities)
    r = subprocess.run(["bash", "-c", shell.replace(" --bind", " --uid 0 --bind")], cwd=roots,
                       env=env, capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stderr) == (0, "")
    assert (roots / "checkpoint.pt").read_text() == "0"


# ------------------------------------------------------------------------ the demo
@pytest.mark.root
def test_demo_from_a_directory_under_tmp_warns_of_nothing_and_explains_refusals(tmp_path):
    run_dir = tmp_path / "demo-run"
    r = subprocess.run(DEVBROKER + ["--run-dir", str(run_dir), "demo"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "devbroker exec:" not in out and "Errno" not in out and "Traceback" not in out
    # the probe says what its driver check means
    assert out.count("driver 535.309.01: the driver recognizes this version") == 2
    assert "reply 1" not in out
    if shutil.which("nvidia-smi"):  # nvidia-smi's probing is refused: said to be expected
        assert "The refusals above are expected" in out
    subprocess.run(["umount", "-l", str(run_dir / "nodes")], capture_output=True)


def test_trace_of_a_missing_file_is_one_line(tmp_path):
    r = subprocess.run(DEVBROKER + ["trace", "show", str(tmp_path / "none.nvtrace")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert one_line(r.stderr) == (f"devbroker trace: {tmp_path / 'none.nvtrace'}: No such "
                                  "file or directory")


# ------------------------------------------------------------------------ devbroker top
def test_top_keeps_every_column_in_80_columns():
    from devbroker.cli.top import Sample, View

    status = {"pid": 4242, "backend": "emulated", "driver": "535.309.01", "alerts": [],
              "tenants": [{"name": "alice", "processes": [1], "open_files": 2,
                           "memory": {"0": {"used": 512 << 20, "quota": 16 << 30}},
                           "requests": 100, "refusals": 4},
                          {"name": "bob", "processes": [], "open_files": 0,
                           "memory": {"0": {"used": 1 << 30, "quota": 32 << 30},
                                      "1": {"used": 0, "quota": 32 << 30}},
                           "requests": 50, "refusals": 12345}]}
    view = View()
    view.frame(Sample(1.0, status), 79, 1.0)
    later = dict(status, tenants=[dict(t, requests=t["requests"] + 10)
                                  for t in status["tenants"]])
    lines = view.frame(Sample(2.0, later), 79, 1.0)  # curses draws width - 1 of 80
    assert all(len(line) <= 79 for line in lines), lines
    text = "\n".join(lines)
    assert "4242" in text and "0 alerts" in text and "every 1 s" in text  # the whole header
    titles = next(line for line in lines if line.startswith("TENANT"))
    assert titles.split()[-3:] == ["IOCTL/S", "REFUSED/S", "REFUSED"]
    bob = next(line for line in lines if line.startswith("bob "))
    assert bob.split()[-3:] == ["10.0", "0.0", "12345"]
    assert bob.split()[1:3] == ["0", "0"]


# ------------------------------------------------------------------------ escape harness
def test_the_race_harness_leaves_no_files_behind(tmp_path):
    if not shutil.which("gcc"):
        pytest.skip("the flipping thread is built with gcc")
    r = subprocess.run([sys.executable, "-c", "from devbroker.escape import races\n"
                        "assert races._flip_lib() is not None"],
                       env=dict(os.environ, TMPDIR=str(tmp_path)), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------ the docs
def test_docs_say_what_the_code_does():
    from devbroker.abi import registry
    from devbroker.daemon import RunPaths

    policy_md = (REPO / "docs" / "policy.md").read_text()
    row = next(line for line in policy_md.splitlines()
               if line.startswith("| `broker.driver_version`"))
    assert re.findall(r"\d+\.\d+(?:\.\d+)?", row) == list(registry.versions())
    default = RunPaths(Path("/r")).audit.name
    example = (REPO / "src" / "devbroker" / "data" / "example-policy.toml").read_text()
    assert f"<run dir>/{default}" in example
    assert f"default: <run dir>/{default}" in policy_md
    errors = policy_md.split("## Errors", 1)[1].split("\n## ", 1)[0]
    # each class of error is named once
    assert errors.count("unknown capability") == 1 and errors.count("bad tenant name") == 1


# ------------------------------------------------------------------------ the scripts
def test_scripts_install_only_what_is_missing_and_upgrade_nothing():
    scripts = REPO / "scripts"
    installs = {str(p.relative_to(REPO)) for p in scripts.rglob("*.sh")
                if re.search(r"apt-get\s+(-\S+\s+)*install\b", p.read_text())}
    assert installs == {"scripts/apt-install.sh"}, installs
    helper = (scripts / "apt-install.sh").read_text()
    assert "--no-upgrade" in helper and "--no-install-recommends" in helper
    # packages that are there: nothing to do, nothing said, no apt-get (no root needed)
    r = subprocess.run(["sh", str(scripts / "apt-install.sh"), "t", "coreutils", "dpkg"],
                       capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PATH="/usr/bin:/bin"))
    assert (r.returncode, r.stdout, r.stderr) == (0, "", "")


def test_readme_lists_what_the_scripts_change_outside_the_checkout():
    readme = README.read_text()
    for what in ("/etc/apt/sources.list.d/debian.sources", "contrib non-free",
                 "/usr/sbin/policy-rc.d", "/run/devbroker-demo", "/var/lib/devbroker-test",
                 "--no-upgrade"):
        assert what in readme, what
    # every absolute path the install scripts write is among them
    scripts = REPO / "scripts"
    written = set()
    for p in [*scripts.glob("install-*.sh"), scripts / "setup.sh", scripts / "apt-install.sh"]:
        text = p.read_text()
        written |= set(re.findall(r"^\w+=(/(?:etc|usr|var|opt)/\S+)", text, re.M))
        written |= set(re.findall(r"> *(/(?:etc|usr|var|opt)/\S+)", text))
    assert written and all(w in readme for w in written), written
