/* What libcuda makes of each errno a refused managed mapping can return, measured natively
 * (scripts/gpu/run-h200-uvm.sh): an LD_PRELOAD shim over mmap/mmap64 that logs every mmap
 * of /dev/nvidia-uvm (address, length, prot, flags, offset, result) to $SHIM_LOG and, with
 * $INJECT_ERRNO set, fails those of at least $INJECT_MIN bytes (default 64 MiB) with that
 * errno before the kernel sees them, as the broker's refusal does. With $INJECT_FAKE set
 * instead, such an mmap "succeeds" without mapping anything (the caller's own reservation
 * stays) and the UVM_VALIDATE_VA_RANGE that libcuda may send for that range next (the
 * driver's way of saying whether a mapping really made a range: uvm.c, uvm_mmap) answers
 * rmStatus $INJECT_STATUS (default 0x51, NV_ERR_NO_MEMORY): a second way a refusal could
 * reach CUDA, measured the same way. If libcuda does not call mmap (or ioctl) through the
 * dynamic linker, nothing is logged: the run says so.
 *   gcc -O2 -shared -fPIC -o uvm_errno_shim.so uvm_errno_shim.c -ldl */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdarg.h>
#include <stdint.h>
#include <sys/mman.h>
#include <sys/types.h>
#include <unistd.h>

typedef void *(*mmap_fn)(void *, size_t, int, int, int, off_t);
typedef int (*ioctl_fn)(int, unsigned long, void *);

#define UVM_VALIDATE_VA_RANGE 0x48 /* params: base u64, length u64, rmStatus u32 */
static uintptr_t faked_base; /* the last range "mapped" by INJECT_FAKE */

static int is_uvm(int fd)
{
    char link[64], target[256];
    ssize_t n;
    if (fd < 0)
        return 0;
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    n = readlink(link, target, sizeof target - 1);
    if (n <= 0)
        return 0;
    target[n] = 0;
    return strcmp(target, "/dev/nvidia-uvm") == 0;
}

static void note(const char *via, void *addr, size_t len, int prot, int flags, off_t off,
                 void *res, int err)
{
    const char *path = getenv("SHIM_LOG");
    FILE *f = path ? fopen(path, "a") : NULL;
    if (!f)
        return;
    fprintf(f, "{\"via\": \"%s\", \"addr\": %lu, \"len\": %zu, \"prot\": %d, \"flags\": %d, "
               "\"offset\": %lld, \"result\": %lu, \"errno\": %d}\n", via,
            (unsigned long)addr, len, prot, flags, (long long)off, (unsigned long)res, err);
    fclose(f);
}

static void *shim(const char *name, void *addr, size_t len, int prot, int flags, int fd,
                  off_t off)
{
    mmap_fn real = (mmap_fn)dlsym(RTLD_NEXT, name);
    const char *inj = getenv("INJECT_ERRNO"), *min = getenv("INJECT_MIN");
    size_t at_least = min ? strtoull(min, NULL, 0) : (64UL << 20);
    void *res;
    if (!is_uvm(fd))
        return real(addr, len, prot, flags, fd, off);
    if (getenv("INJECT_FAKE") && len >= at_least && addr) {
        note(name, addr, len, prot, flags, off, addr, -1);
        faked_base = (uintptr_t)addr;
        return addr;
    }
    if (inj && len >= at_least) {
        note(name, addr, len, prot, flags, off, MAP_FAILED, atoi(inj));
        errno = atoi(inj);
        return MAP_FAILED;
    }
    res = real(addr, len, prot, flags, fd, off);
    note(name, addr, len, prot, flags, off, res, res == MAP_FAILED ? errno : 0);
    return res;
}

void *mmap(void *addr, size_t len, int prot, int flags, int fd, off_t off)
{
    return shim("mmap", addr, len, prot, flags, fd, off);
}

void *mmap64(void *addr, size_t len, int prot, int flags, int fd, off_t off)
{
    return shim("mmap64", addr, len, prot, flags, fd, off);
}

int ioctl(int fd, unsigned long cmd, ...)
{
    ioctl_fn real = (ioctl_fn)dlsym(RTLD_NEXT, "ioctl");
    va_list ap;
    void *arg;
    va_start(ap, cmd);
    arg = va_arg(ap, void *);
    va_end(ap);
    if (cmd == UVM_VALIDATE_VA_RANGE && faked_base && arg && is_uvm(fd)
            && *(uint64_t *)arg == faked_base) {
        const char *st = getenv("INJECT_STATUS");
        *(uint32_t *)((char *)arg + 16) = st ? (uint32_t)strtoul(st, NULL, 0) : 0x51;
        note("validate", (void *)faked_base, 0, 0, 0, 0, NULL, 0);
        return 0;
    }
    return real(fd, cmd, arg);
}
