"""Container images for the test cluster, built from local files (no registry is reachable).

Two single-layer images, written as docker-archive tarballs that `ctr images import` reads:

- the sandbox image: the static pause program (k8s/pause/pause.c) and nothing else;
- the host-tools image: an empty root whose /bin, /sbin, /lib and /lib64 point into /usr, for
  pods that mount the host's /usr read-only (hostPath). Those pods run the host's own sh,
  python3 and nvidia-smi with its libnvidia-ml: the same programs the rest of the suite
  drives, with no copy of a distribution to build and keep in step.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from pathlib import Path

_FIXED_MTIME = 0   # the same inputs give the same digests


def _dir(tf: tarfile.TarFile, name: str, mode: int = 0o755) -> None:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.mtime = tarfile.DIRTYPE, mode, _FIXED_MTIME
    tf.addfile(info)


def _symlink(tf: tarfile.TarFile, name: str, target: str) -> None:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode, info.mtime = tarfile.SYMTYPE, target, 0o777, _FIXED_MTIME
    tf.addfile(info)


def _file(tf: tarfile.TarFile, name: str, data: bytes, mode: int = 0o644) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), mode, _FIXED_MTIME
    tf.addfile(info, io.BytesIO(data))


def pause_layer(pause_binary: bytes) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        _file(tf, "pause", pause_binary, 0o755)
    return buf.getvalue()


def host_tools_layer(host_etc: Path = Path("/etc")) -> bytes:
    """The empty root for pods that mount the host's /usr. Debian reaches nvidia-smi and
    libnvidia-ml.so.1 through /etc/alternatives links, so those links (not their targets,
    which are under /usr) and the loader's cache come from the host's /etc."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for d in ("usr", "etc", "dev", "proc", "sys", "tmp", "run", "var", "var/tmp", "root",
                  "work"):
            _dir(tf, d, 0o1777 if d in ("tmp", "var/tmp") else 0o755)
        for link in ("bin", "sbin", "lib", "lib64"):
            _symlink(tf, link, f"usr/{link}")
        _file(tf, "etc/passwd", b"root:x:0:0:root:/root:/bin/sh\n"
                                b"nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n")
        _file(tf, "etc/group", b"root:x:0:\nnogroup:x:65534:\n")
        if (host_etc / "ld.so.cache").is_file():
            _file(tf, "etc/ld.so.cache", (host_etc / "ld.so.cache").read_bytes())
        alternatives = host_etc / "alternatives"
        if alternatives.is_dir():
            _dir(tf, "etc/alternatives")
            for link in sorted(alternatives.iterdir()):
                if link.is_symlink():
                    _symlink(tf, f"etc/alternatives/{link.name}", os.readlink(link))
    return buf.getvalue()


def docker_archive(ref: str, layer: bytes, config: dict) -> bytes:
    """A one-layer image in the `docker save` format, tagged `ref`."""
    diff_id = "sha256:" + hashlib.sha256(layer).hexdigest()
    image_config = {
        "architecture": "amd64",
        "os": "linux",
        "config": config,
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        "history": [{"created_by": "devbroker.testing.k8s_images"}],
    }
    config_bytes = json.dumps(image_config, sort_keys=True).encode()
    config_name = hashlib.sha256(config_bytes).hexdigest() + ".json"
    layer_name = diff_id.split(":", 1)[1] + "/layer.tar"
    manifest = [{"Config": config_name, "RepoTags": [ref], "Layers": [layer_name]}]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        _file(tf, config_name, config_bytes)
        _dir(tf, layer_name.split("/")[0])
        _file(tf, layer_name, layer)
        _file(tf, "manifest.json", json.dumps(manifest).encode())
    return buf.getvalue()


def write_images(out_dir: Path, pause_binary: Path, pause_ref: str,
                 host_ref: str) -> list[Path]:
    """Write both image archives under out_dir; return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    pause = out_dir / "pause.tar"
    pause.write_bytes(docker_archive(
        pause_ref, pause_layer(pause_binary.read_bytes()),
        {"Entrypoint": ["/pause"], "WorkingDir": "/"}))
    host = out_dir / "host.tar"
    host.write_bytes(docker_archive(
        host_ref, host_tools_layer(),
        {"Cmd": ["/bin/sh"], "WorkingDir": "/",
         "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]}))
    return [pause, host]
