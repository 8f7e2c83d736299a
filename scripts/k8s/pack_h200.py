"""The test cluster's programs, packed to travel to a GPU machine in several device calls.

The device tool sends the working tree plus the paths a call names in `carry`, 64 MiB in all,
and keeps git-ignored files on a machine that stays warm between calls. The cluster's
programs are ~400 MB (~90 MB compressed), so they travel in parts: `.k8spack/a`, `b`, `c`
..., each small enough for one call, one part per call, the last call running the job
(scripts/gpu/run-h200-k8s.sh). Standard library only (the GPU machine has no xz tool for
sure; Python's lzma reads what `xz` writes).

    python3 scripts/k8s/pack_h200.py pack [--limit-mib N]     # here (scripts/k8s/pack-h200.sh)
    python3 scripts/k8s/pack_h200.py unpack [PART ...]         # there: into UNPACKED

Each part holds `*.xz` files under their place in the unpacked tree and `manifest.json`,
which lists every file of every part (so an unpack can say which part it has not seen).
The unpacked tree (UNPACKED: $K8SPACK_ROOT, default /tmp/devbroker-k8spack, outside the
checkout so that it stays whatever a device call does to the tree's ignored files):

    bin/    kube (+ links kube-apiserver ... kubectl), etcd, containerd, containerd-shim-runc-v2,
            ctr, pause, devbroker-dra-plugin
    debian/ Debian 12's runc, CNI plugins, ip, nsenter, unshare, openssl and the
            libraries they need beyond glibc (lib/), for the tools the GPU machine lacks
    whl/    the wheels the GPU machine's Python lacks (trio ...)
"""
from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACK = REPO / ".k8spack"
UNPACKED = Path(os.environ.get("K8SPACK_ROOT", "/tmp/devbroker-k8spack"))
MiB = 1 << 20
# What one device call may carry (tree + carried paths) and what each part may take of it.
CALL_LIMIT = 64 * MiB
PART_LIMIT = 46 * MiB
MARGIN = 2 * MiB
MANIFEST_ROOM = 64 << 10   # each part's manifest.json

CLUSTER_BINARIES = ("kube", "etcd", "containerd", "containerd-shim-runc-v2", "ctr", "pause",
                    "devbroker-dra-plugin")
KUBE_LINKS = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet",
              "kubectl")
# Debian 12 programs the node needs; the GPU machine has no runc and no CNI plugins, and may
# lack the others (the run uses its own when it has them).
DEBIAN_TOOLS = {
    "runc": "/usr/sbin/runc",
    "cni/bridge": "/usr/lib/cni/bridge",
    "cni/host-local": "/usr/lib/cni/host-local",
    "cni/loopback": "/usr/lib/cni/loopback",
    "ip": "/usr/bin/ip",
    "nsenter": "/usr/bin/nsenter",
    "unshare": "/usr/bin/unshare",
    "openssl": "/usr/bin/openssl",
}
DEBIAN_FILES = {"openssl.cnf": "/usr/lib/ssl/openssl.cnf"}
# glibc's own libraries come from the machine that runs the tool, never from here
GLIBC = ("linux-vdso", "ld-linux", "libc.so", "libm.so", "libpthread", "libdl.so", "librt.so",
         "libresolv", "libutil.so")
WHEELS = ("trio", "outcome", "sniffio", "prometheus_client")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def tree_size() -> int:
    """Bytes of the working tree a device call sends (tracked + untracked, not ignored)."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO,
                         capture_output=True, check=True).stdout
    total = 0
    for name in out.split(b"\0"):
        p = REPO / os.fsdecode(name)
        if name and p.is_file() and not p.is_symlink():
            total += p.stat().st_size
    return total


def shared_libs(binary: str) -> list[str]:
    """The non-glibc shared libraries `binary` loads here (ldd), resolved."""
    r = subprocess.run(["ldd", binary], capture_output=True, text=True)
    libs = []
    for line in r.stdout.splitlines():
        parts = line.split("=>")
        if len(parts) != 2:
            continue
        name, path = parts[0].strip(), parts[1].split("(")[0].strip()
        if path and not name.startswith(GLIBC):
            libs.append(path)
    return libs


def debian_version(path: str) -> str:
    r = subprocess.run(["dpkg", "-S", path], capture_output=True, text=True)
    pkg = r.stdout.split(":")[0].strip() if r.returncode == 0 else ""
    if not pkg:
        return "?"
    v = subprocess.run(["dpkg-query", "-W", "-f=${Version}", pkg], capture_output=True,
                       text=True).stdout
    return f"{pkg} {v}"


def inputs(bin_dir: Path, wheel_dir: Path) -> tuple[dict[str, Path], dict[str, str]]:
    """{path in the unpacked tree: source file here}, and where the Debian files came from."""
    files: dict[str, Path] = {}
    sources: dict[str, str] = {}
    for b in CLUSTER_BINARIES:
        files[f"bin/{b}"] = bin_dir / b
    for name, src in {**DEBIAN_TOOLS, **DEBIAN_FILES}.items():
        real = os.path.realpath(src)
        files[f"debian/{name}"] = Path(real)
        sources[name] = debian_version(real if os.path.exists(real) else src)
        if name in DEBIAN_TOOLS:
            for lib in shared_libs(real):
                files[f"debian/lib/{os.path.basename(lib)}"] = Path(os.path.realpath(lib))
                sources.setdefault(os.path.basename(lib), debian_version(lib))
    for w in sorted(wheel_dir.glob("*.whl")):
        files[f"whl/{w.name}"] = w
    missing = [str(p) for p in files.values() if not p.is_file()]
    if missing:
        sys.exit("pack: missing " + ", ".join(missing))
    wheels = {w.name.split("-")[0].lower() for w in wheel_dir.glob("*.whl")}
    lacking = [w for w in WHEELS if w not in wheels]
    if lacking:
        sys.exit(f"pack: {wheel_dir} lacks wheels for {', '.join(lacking)} "
                 "(scripts/k8s/pack-h200.sh downloads them)")
    return files, sources


def compressed(src: Path, digest: str, cache: Path) -> Path:
    """src compressed (xz -6), kept in cache by its content's hash: a second pack, or a pack
    in a copy of this checkout with .k8spack/.cache copied along, compresses nothing again."""
    out = cache / f"{digest}.xz"
    if out.exists():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    if shutil.which("xz"):
        with open(src, "rb") as i, open(tmp, "wb") as o:
            subprocess.run(["xz", "-6", "-T2", "-c"], stdin=i, stdout=o, check=True)
    else:
        with open(src, "rb") as i, lzma.open(tmp, "wb", preset=6) as o:
            shutil.copyfileobj(i, o, 1 << 20)
    os.replace(tmp, out)
    return out


def assign_parts(sizes: dict[str, int], limit: int) -> dict[str, str]:
    """First fit, largest first, the wheels in every part (a part installs its own): the
    fewest parts named a, b, c ... of at most `limit` bytes each."""
    names = "abcdefgh"
    always = sum(s for p, s in sizes.items() if p.startswith("whl/"))
    limit -= MANIFEST_ROOM
    room: list[int] = []
    where: dict[str, str] = {}
    for path, size in sorted(sizes.items(), key=lambda kv: -kv[1]):
        if path.startswith("whl/"):
            continue
        for i, free in enumerate(room):
            if size <= free:
                room[i] -= size
                where[path] = names[i]
                break
        else:
            if size + always > limit:
                sys.exit(f"pack: {path} ({size / MiB:.1f} MiB compressed) does not fit a part "
                         f"of {limit / MiB:.1f} MiB")
            room.append(limit - always - size)
            where[path] = names[len(room) - 1]
    return where


def pack(limit_mib: float | None, bin_dir: Path, wheel_dir: Path) -> int:
    tree = tree_size()
    limit = PART_LIMIT if limit_mib is None else int(limit_mib * MiB)
    limit = min(limit, CALL_LIMIT - tree - MARGIN)
    files, sources = inputs(bin_dir, wheel_dir)
    cache = PACK / ".cache"
    entries = []
    for path, src in sorted(files.items()):
        digest = sha256(src)
        xz = compressed(src, digest, cache)
        entries.append({"path": path, "sha256": digest, "size": src.stat().st_size,
                        "xz_size": xz.stat().st_size, "mode": src.stat().st_mode & 0o777,
                        "_xz": str(xz)})
        print(f"pack: {path:42} {src.stat().st_size / MiB:7.1f} MiB -> "
              f"{xz.stat().st_size / MiB:6.1f} MiB", file=sys.stderr)
    where = assign_parts({e["path"]: e["xz_size"] for e in entries}, limit)
    parts = sorted(set(where.values()))
    for e in entries:
        e["part"] = where.get(e["path"], "*")
    manifest = {
        "version": 1,
        "parts": parts,
        "links": {f"bin/{n}": "kube" for n in KUBE_LINKS},
        "sources": sources,
        "files": [{k: v for k, v in e.items() if not k.startswith("_")} for e in entries],
    }
    for old in PACK.glob("[a-h]"):
        shutil.rmtree(old)
    sizes = {}
    for part in parts:
        d = PACK / part
        for e in entries:
            if e["part"] in (part, "*"):
                dst = d / f"{e['path']}.xz"
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(e["_xz"], dst)
        (d / "manifest.json").write_text(json.dumps({**manifest, "this_part": part},
                                                    indent=1) + "\n")
        sizes[part] = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
    print(f"pack: working tree {tree / MiB:.1f} MiB; parts of at most {limit / MiB:.1f} MiB:",
          file=sys.stderr)
    for part in parts:
        inside = ", ".join(e["path"].split("/", 1)[1] for e in entries
                           if e["part"] == part and not e["path"].startswith("debian/lib/"))
        print(f"pack:   .k8spack/{part}  {sizes[part] / MiB:5.1f} MiB "
              f"(+tree = {(sizes[part] + tree) / MiB:5.1f} of 64 MiB): {inside}",
              file=sys.stderr)
    print(json.dumps({"parts": parts, "sizes_mib": {p: round(s / MiB, 2)
                                                     for p, s in sizes.items()},
                      "tree_mib": round(tree / MiB, 2)}))
    return 0


# ---- on the GPU machine -------------------------------------------------------------------

def unpack(parts: list[str], root: Path) -> int:
    """Unpack the parts present (or those named) into root; say what is still missing.
    Exit 0 when every file of every part is in place and verified."""
    manifests = {}
    for d in sorted(PACK.glob("[a-h]")):
        if (d / "manifest.json").is_file():
            manifests[d.name] = json.loads((d / "manifest.json").read_text())
    if not manifests:
        print("unpack: no part here (.k8spack/<part>/manifest.json): carry one", file=sys.stderr)
        return 2
    manifest = next(iter(manifests.values()))
    wanted = parts or list(manifests)
    root.mkdir(parents=True, exist_ok=True)
    (root / "manifest.json").write_text(json.dumps(manifest, indent=1))
    missing: list[str] = []
    missing_parts: set[str] = set()
    for e in manifest["files"]:
        dst = root / e["path"]
        if dst.is_file() and dst.stat().st_size == e["size"] and sha256(dst) == e["sha256"]:
            continue
        # the wheels are in every part: take them from any part that is here
        from_parts = [e["part"]] if e["part"] != "*" else wanted
        src = next((PACK / p / f"{e['path']}.xz" for p in from_parts if p in wanted
                    and (PACK / p / f"{e['path']}.xz").is_file()), None)
        if src is None:
            missing.append(f"{e['path']} (part {e['part']})")
            missing_parts.add(e["part"])
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(f".{dst.name}.tmp")
        with lzma.open(src, "rb") as i, open(tmp, "wb") as o:
            shutil.copyfileobj(i, o, 1 << 20)
        if sha256(tmp) != e["sha256"]:
            tmp.unlink()
            print(f"unpack: {e['path']}: checksum mismatch (a broken transfer?)",
                  file=sys.stderr)
            return 1
        os.chmod(tmp, e["mode"])
        os.replace(tmp, dst)
        print(f"unpack: {e['path']} ({e['size'] / MiB:.1f} MiB) from part "
              f"{src.relative_to(PACK).parts[0]}", file=sys.stderr)
    for link, target in manifest["links"].items():
        p = root / link
        if not p.is_symlink():
            p.parent.mkdir(parents=True, exist_ok=True)
            p.symlink_to(target)
    if missing:
        got = [p for p in manifest["parts"] if p not in missing_parts]
        print(f"unpack: parts in place: {', '.join(got) or 'none'}; parts still to carry: "
              f"{', '.join(sorted(missing_parts))} ({'; '.join(missing)})", file=sys.stderr)
        return 3
    print(f"unpack: all {len(manifest['files'])} files of parts "
          f"{', '.join(manifest['parts'])} in place under {root}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack")
    p.add_argument("--limit-mib", type=float)
    p.add_argument("--bin-dir", type=Path, default=Path(os.environ.get(
        "DEVBROKER_K8S_BIN", REPO / ".cache" / "k8s" / "bin")))
    p.add_argument("--wheels", type=Path, default=REPO / ".whl")
    u = sub.add_parser("unpack")
    u.add_argument("parts", nargs="*")
    u.add_argument("--root", type=Path, default=UNPACKED)
    a = ap.parse_args(argv)
    if a.cmd == "pack":
        return pack(a.limit_mib, a.bin_dir, a.wheels)
    return unpack(a.parts, a.root)


if __name__ == "__main__":
    sys.exit(main())
