"""devbroker's C parts that Python loads with ctypes: built from their source on first use.

`lane.c`, the seccomp listener's native loop (frontends/nativelane.py), and `fuselane.c`,
the FUSE reader threads' (frontends/fusenative.py). Each a shared
library with no Python headers in it, so one build serves every Python version, built with
the host's C compiler (`$CC` when it names one, else `cc`, else `gcc`) into

1. the directory named by DEVBROKER_NATIVE_DIR, else
2. this package's directory when the process may write there (a checkout: scripts/setup.sh
   builds it there ahead of time with `python -m devbroker.native`), else
3. $XDG_CACHE_HOME/devbroker (~/.cache/devbroker),

as `<name>-<digest>.so`, the digest of the source, the headers generated for it
(`headers_of`: lane.c's dvb_call.h, from callabi.py) and the flags: an edited source is
built again, never an old library loaded for it. A library is loaded only when it is owned by this
process's user and not writable by group or others (whoever could rewrite it could run code
in the broker). No compiler, or a failed build: `load` returns None with the reason logged
once, and callers keep their Python path.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

log = logging.getLogger("devbroker.native")

HERE = Path(__file__).resolve().parent
CFLAGS = ["-O2", "-fPIC", "-shared", "-Wall", "-Wextra", "-Wno-unused-parameter",
          "-Werror=implicit-function-declaration", "-Werror=incompatible-pointer-types",
          "-Werror=int-conversion",
          "-fvisibility=default", "-pthread"]
# scripts/sanitize-native.sh: the loops built with AddressSanitizer and UBSan (a library of
# its own: the flags are part of the name's digest) for the tests that drive them.
if os.environ.get("DEVBROKER_NATIVE_SANITIZE") == "1":
    CFLAGS += ["-g", "-O1", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
               "-fno-sanitize-recover=undefined"]
_loaded: dict[str, ctypes.CDLL | None] = {}
_why_not: dict[str, str] = {}
_lock = threading.Lock()


def _compiler() -> list[str] | None:
    """$CC when it names a compiler (it may carry flags: "gcc -m64"), else cc, else gcc.
    (A $CC that is something else, such as a script's own variable that leaked into the
    environment, is passed over rather than trusted.)"""
    cands = []
    env = os.environ.get("CC", "").strip()
    if env:
        try:
            cands.append(shlex.split(env))
        except ValueError:
            pass
    cands += [["cc"], ["gcc"]]
    for argv in cands:
        exe = shutil.which(argv[0]) if argv else None
        if exe and os.path.basename(exe).rstrip("0123456789.-") in _COMPILERS:
            return [exe, *argv[1:]]
    return None


_COMPILERS = {"cc", "gcc", "clang", "x86_64-linux-gnu-gcc", "tcc"}


def _digest(src: bytes) -> str:
    h = hashlib.sha256(src)
    h.update(" ".join(CFLAGS).encode())
    return h.hexdigest()[:16]


def _dirs() -> list[Path]:
    out = []
    env = os.environ.get("DEVBROKER_NATIVE_DIR")
    if env:
        out.append(Path(env))
    out.append(HERE)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    out.append(Path(cache) / "devbroker")
    return out


def _trusted(p: Path) -> bool:
    try:
        st = p.stat()
    except OSError:
        return False
    return st.st_uid == os.geteuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def headers_of(name: str) -> dict[str, str]:
    """The headers `name`.c includes that are generated from Python (lane.c: dvb_call.h,
    from callabi.py, the one source of what Python and the loop share)."""
    if name == "lane":
        from . import callabi
        return {"dvb_call.h": callabi.c_header()}
    return {}


def source_of(name: str) -> bytes:
    """What a build of `name` is made from: its C source and its generated headers."""
    src = (HERE / f"{name}.c").read_bytes()
    for hname, text in sorted(headers_of(name).items()):
        src += f"\n/* {hname} */\n{text}".encode()
    return src


def build(name: str) -> Path:
    """Build `name`.c if no trusted build of this source exists; the library's path.
    Raises RuntimeError with the compiler's message when it cannot."""
    src_path = HERE / f"{name}.c"
    fname = f"{name}-{_digest(source_of(name))}.so"
    for d in _dirs():
        if _trusted(d / fname):
            return d / fname
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler on PATH (cc, gcc, or $CC naming one)")
    errors = []
    for d in _dirs():
        try:
            d.mkdir(parents=True, exist_ok=True)
            if not os.access(d, os.W_OK):
                continue
            fd, tmp = tempfile.mkstemp(prefix=f".{name}-", suffix=".so", dir=d)
            os.close(fd)
        except OSError as e:
            errors.append(f"{d}: {e.strerror or e}")
            continue
        try:
            with tempfile.TemporaryDirectory(prefix=f"devbroker-{name}-") as inc:
                for hname, text in headers_of(name).items():
                    Path(inc, hname).write_text(text)
                r = subprocess.run([*cc, *CFLAGS, "-I", inc, "-o", tmp, str(src_path)],
                                   capture_output=True, text=True, timeout=120)
            if r.returncode != 0:
                raise RuntimeError(f"{cc[0]} failed on {src_path}:\n{r.stderr.strip()}")
            os.chmod(tmp, 0o755)
            os.replace(tmp, d / fname)
            _drop_older(d, name, fname)
            return d / fname
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    raise RuntimeError("nowhere to build it: " + "; ".join(errors or ["no writable directory"]))


def _drop_older(d: Path, name: str, keep: str) -> None:
    """Builds of earlier sources of `name` in d, ours (a process that loaded one keeps its
    mapping: unlinking a loaded library is safe)."""
    for old in d.glob(f"{name}-*.so"):
        if old.name != keep and _trusted(old):
            try:
                old.unlink()
            except OSError:
                pass


def load(name: str) -> ctypes.CDLL | None:
    """The library `name` (built if needed), or None (the reason logged once; `why_not`)."""
    with _lock:
        if name in _loaded:
            return _loaded[name]
        lib = None
        try:
            lib = ctypes.CDLL(str(build(name)))
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            _why_not[name] = str(e)
            log.warning("native %s not available, the Python path serves instead: %s", name, e)
        _loaded[name] = lib
        return lib


# name -> the library whose ABI version and call size load_checked accepted
_abi_ok: dict[str, ctypes.CDLL] = {}


def load_checked(name: str, abi_fn: str, abi: int, size_fn: str, size: int) -> ctypes.CDLL | None:
    """`load(name)`, its ABI version (`abi_fn()`) and call-structure size (`size_fn()`)
    checked against what the Python side was written for: a library that disagrees is
    never used (None, the reason logged and in `why_not`)."""
    lib = load(name)
    if lib is None or _abi_ok.get(name) is lib:
        return lib
    got_abi, got_size = getattr(lib, abi_fn), getattr(lib, size_fn)
    got_abi.restype, got_size.restype = ctypes.c_int, ctypes.c_size_t
    if got_abi() != abi or got_size() != size:
        why = f"{lib._name}: ABI {got_abi()}, call size {got_size()}; expected {abi}, {size}"
        log.warning("native %s not used: %s", name, why)
        _why_not[name] = why
        return None
    _abi_ok[name] = lib
    return lib


def why_not(name: str) -> str | None:
    return _why_not.get(name)


def describe_loop(name: str, lib: ctypes.CDLL | None, off: str | None, native_words: str,
                  python_words: str) -> str:
    """A front end's start-line words for which loop serves: the Python one when a switch
    turned the native one off (`off` says which), or when library `name` could not be
    loaded (`lib` None: why not), else the native one and its file."""
    if off:
        return f"{python_words} ({off})"
    if lib is None:
        return (f"{python_words} (the native one is unavailable: "
                f"{why_not(name) or 'ABI mismatch'})")
    return f"{native_words} ({lib._name})"


def main(argv: list[str] | None = None) -> int:
    """`python -m devbroker.native [NAME...]`: build now (setup scripts), print the paths."""
    names = (argv if argv is not None else sys.argv[1:]) or ["lane", "fuselane"]
    for n in names:
        try:
            print(build(n))
        except RuntimeError as e:
            print(f"devbroker.native: {n}: {e}", file=sys.stderr)
            return 1
    return 0
