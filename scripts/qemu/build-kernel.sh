#!/bin/sh
# Fetch Debian's current guest kernel (linux-image + headers for the version that the
# linux-image-amd64 metapackage points at), unpack it into .cache/qemu/<kver>/root without
# installing anything on the host, build kmod/ against those headers and make a busybox
# initramfs that mounts the host root over 9p. Idempotent: finished steps are skipped.
# Prints "KVER=<version>" last so callers can parse it.
set -eu
REPO=$(cd "$(dirname "$0")/../.." && pwd)
CACHE=${DEVBROKER_QEMU_CACHE:-$REPO/.cache/qemu}

# The version is whatever Debian's metapackage depends on today (Debian moves it).
dep_of() { apt-cache depends "$1" | sed -n "s/^  Depends: \($2\)\$/\1/p" | head -n1; }
IMG=$(dep_of linux-image-amd64 'linux-image-[0-9].*')
[ -n "$IMG" ] || { echo "cannot resolve linux-image-amd64 (run apt-get update?)" >&2; exit 1; }
KVER=${IMG#linux-image-}
HDR=linux-headers-$KVER
HDR_COMMON=$(dep_of "$HDR" 'linux-headers-.*-common')
KBUILD=$(dep_of "$HDR" 'linux-kbuild-[0-9.]*')
DIR=$CACHE/$KVER
ROOT=$DIR/root
mkdir -p "$DIR/debs" "$ROOT"

if [ ! -e "$DIR/.unpacked" ]; then
    (cd "$DIR/debs" && apt-get download -q "$IMG" "$HDR" "$HDR_COMMON" "$KBUILD")
    for d in "$DIR"/debs/*.deb; do dpkg-deb -x "$d" "$ROOT"; done
    depmod -b "$ROOT" "$KVER"
    # Debian's per-flavour Makefile includes the common tree by absolute /usr/src path;
    # point it at our unpacked copy so nothing on the host is used (or needed).
    sed -i "s|^include /usr/src/|include $ROOT/usr/src/|" "$ROOT/usr/src/$HDR/Makefile"
    touch "$DIR/.unpacked"
fi

# Booting the uncompressed ELF (PVH entry) skips the in-guest XZ decompression, which is
# slow under TCG. The vmlinuz payload is an XZ stream: find its magic and decompress.
if [ ! -s "$DIR/vmlinux" ]; then
    python3 - "$ROOT/boot/vmlinuz-$KVER" "$DIR/vmlinux.xz" <<'PY'
import sys
data = open(sys.argv[1], "rb").read()
off = data.find(b"\xfd7zXZ\x00")
assert off > 0, "no XZ stream in vmlinuz"
open(sys.argv[2], "wb").write(data[off:])
PY
    # The stream is followed by trailing bytes; xz reports that, the output is complete.
    xz -dc "$DIR/vmlinux.xz" > "$DIR/vmlinux.tmp" 2>/dev/null || true
    head -c4 "$DIR/vmlinux.tmp" | grep -q ELF
    mv "$DIR/vmlinux.tmp" "$DIR/vmlinux"; rm -f "$DIR/vmlinux.xz"
fi

# kbuild runs from the unpacked headers; their scripts/ and tools come from linux-kbuild.
KDIR=$ROOT/usr/src/$HDR
make -s -C "$KDIR" M="$REPO/kmod" modules >&2

# Initramfs: static busybox + the modules needed to reach the 9p root and to lay the guest's
# module tree over it (overlay; scripts/qemu/init), in load order.
if [ ! -s "$DIR/initramfs.cpio.gz" ] || [ "$0" -nt "$DIR/initramfs.cpio.gz" ] \
        || [ "$(dirname "$0")/init" -nt "$DIR/initramfs.cpio.gz" ]; then
    IR=$DIR/initramfs; rm -rf "$IR"; mkdir -p "$IR/bin" "$IR/mods" "$IR/proc" "$IR/sys" "$IR/dev" "$IR/newroot"
    cp /bin/busybox "$IR/bin/busybox"
    cp "$(dirname "$0")/init" "$IR/init"; chmod +x "$IR/init"
    MODDIR=$ROOT/lib/modules/$KVER
    python3 - "$MODDIR" "$IR/mods" virtio_pci 9pnet_virtio 9p overlay <<'PY'
import os, shutil, sys, lzma
moddir, out, *wanted = sys.argv[1:]
deps = {}
for line in open(os.path.join(moddir, "modules.dep")):
    path, _, rest = line.partition(":")
    deps[os.path.basename(path).split(".ko")[0].replace("-", "_")] = (path, rest.split())
order = []
def visit(name):
    path, ds = deps[name]
    for d in ds:
        visit(os.path.basename(d).split(".ko")[0].replace("-", "_"))
    if path not in order:
        order.append(path)
for w in wanted:
    if w in deps:  # absent means built in
        visit(w)
with open(os.path.join(out, "order"), "w") as f:
    for i, path in enumerate(order):
        src = os.path.join(moddir, path)
        dst = os.path.join(out, "%02d.ko" % i)
        if src.endswith(".xz"):
            open(dst, "wb").write(lzma.open(src).read())
        else:
            shutil.copy(src, dst)
        f.write("%02d.ko %s\n" % (i, os.path.basename(path)))
PY
    (cd "$IR" && find . | cpio -o -H newc --quiet | gzip -1) > "$DIR/initramfs.cpio.gz"
fi
echo "KVER=$KVER"
