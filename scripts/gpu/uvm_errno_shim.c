/* What libcuda makes of each errno a refused managed mapping can return, measured natively
 * (scripts/gpu/run-h200-uvm.sh): an LD_PRELOAD shim over mmap/mmap64 that logs every mmap
 * of /dev/nvidia-uvm (address, length, prot, flags, offset, result) to $SHIM_LOG and, with
 * $INJECT_ERRNO set, fails those of at least $INJECT_MIN bytes (default 64 MiB) with that
 * errno before the kernel sees them, as the broker's refusal does. If libcuda does not call
 * mmap through the dynamic linker, nothing is logged: the run says so.
 *   gcc -O2 -shared -fPIC -o uvm_errno_shim.so uvm_errno_shim.c -ldl */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/types.h>
#include <unistd.h>

typedef void *(*mmap_fn)(void *, size_t, int, int, int, off_t);

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
