/*
 * A diagnostic LD_PRELOAD library for the GPU probes (scripts/gpu/nvml_probe.sh): the wall
 * time a process spends in open/openat, ioctl, mmap and close, split into NVIDIA device
 * files and the rest, written as one JSON line to $SYSTIME_OUT (appended) at exit. Run the
 * same program natively and in a devbroker tenant: the difference per row is what the
 * broker's interception costs there, including what its own per-call metrics cannot see
 * (waiting for a listener to pick the notification up, the answer's wake-up).
 *   cc -O2 -shared -fPIC -o systime.so systime.c -ldl
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

enum { OPEN_NV, OPEN_OTHER, IOCTL_NV, IOCTL_OTHER, MMAP_NV, MMAP_OTHER, CLOSE_ALL, NROWS };
static const char *names[NROWS] = {"open_nvidia", "open_other", "ioctl_nvidia", "ioctl_other",
                                   "mmap_nvidia", "mmap_other", "close"};
static volatile int64_t ns[NROWS], count[NROWS];
static volatile char nvfd[4096]; /* fds opened on /dev/nvidia* */

static int64_t now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void add(int row, int64_t t0)
{
    __atomic_add_fetch(&ns[row], now() - t0, __ATOMIC_RELAXED);
    __atomic_add_fetch(&count[row], 1, __ATOMIC_RELAXED);
}

static int is_nv(const char *p) { return p && strncmp(p, "/dev/nvidia", 11) == 0; }

static void mark(int fd, int nv)
{
    if (fd >= 0 && fd < 4096)
        nvfd[fd] = (char)nv;
}

static int nv_fd(int fd) { return fd >= 0 && fd < 4096 && nvfd[fd]; }

#define REAL(name, ret, ...) \
    static ret (*real_##name)(__VA_ARGS__); \
    if (!real_##name) real_##name = (ret (*)(__VA_ARGS__))dlsym(RTLD_NEXT, #name)

static int do_open(const char *which, int dirfd, const char *path, int flags, mode_t mode)
{
    int64_t t0 = now();
    int fd;
    if (!strcmp(which, "openat")) {
        REAL(openat, int, int, const char *, int, ...);
        fd = real_openat(dirfd, path, flags, mode);
    } else if (!strcmp(which, "openat64")) {
        REAL(openat64, int, int, const char *, int, ...);
        fd = real_openat64(dirfd, path, flags, mode);
    } else if (!strcmp(which, "open64")) {
        REAL(open64, int, const char *, int, ...);
        fd = real_open64(path, flags, mode);
    } else {
        REAL(open, int, const char *, int, ...);
        fd = real_open(path, flags, mode);
    }
    int nv = is_nv(path);
    add(nv ? OPEN_NV : OPEN_OTHER, t0);
    mark(fd, nv);
    return fd;
}

static mode_t mode_of(int flags, va_list ap)
{
    return (flags & (O_CREAT | O_TMPFILE)) ? va_arg(ap, mode_t) : 0;
}

int open(const char *p, int f, ...) { va_list a; va_start(a, f); mode_t m = mode_of(f, a); va_end(a); return do_open("open", AT_FDCWD, p, f, m); }
int open64(const char *p, int f, ...) { va_list a; va_start(a, f); mode_t m = mode_of(f, a); va_end(a); return do_open("open64", AT_FDCWD, p, f, m); }
int openat(int d, const char *p, int f, ...) { va_list a; va_start(a, f); mode_t m = mode_of(f, a); va_end(a); return do_open("openat", d, p, f, m); }
int openat64(int d, const char *p, int f, ...) { va_list a; va_start(a, f); mode_t m = mode_of(f, a); va_end(a); return do_open("openat64", d, p, f, m); }

int ioctl(int fd, unsigned long req, ...)
{
    va_list a;
    va_start(a, req);
    void *arg = va_arg(a, void *);
    va_end(a);
    REAL(ioctl, int, int, unsigned long, ...);
    int64_t t0 = now();
    int r = real_ioctl(fd, req, arg);
    add(nv_fd(fd) ? IOCTL_NV : IOCTL_OTHER, t0);
    return r;
}

void *mmap(void *addr, size_t len, int prot, int flags, int fd, off_t off)
{
    REAL(mmap, void *, void *, size_t, int, int, int, off_t);
    int64_t t0 = now();
    void *r = real_mmap(addr, len, prot, flags, fd, off);
    add(nv_fd(fd) ? MMAP_NV : MMAP_OTHER, t0);
    return r;
}

void *mmap64(void *addr, size_t len, int prot, int flags, int fd, off_t off)
{
    return mmap(addr, len, prot, flags, fd, off);
}

int close(int fd)
{
    REAL(close, int, int);
    int64_t t0 = now();
    mark(fd, 0);
    int r = real_close(fd);
    add(CLOSE_ALL, t0);
    return r;
}

__attribute__((destructor)) static void report(void)
{
    const char *out = getenv("SYSTIME_OUT");
    if (!out)
        return;
    FILE *f = fopen(out, "a");
    if (!f)
        return;
    fprintf(f, "{\"pid\": %d", (int)getpid());
    for (int i = 0; i < NROWS; i++)
        fprintf(f, ", \"%s\": [%lld, %.3f]", names[i], (long long)count[i], ns[i] / 1e6);
    fprintf(f, "}\n");
    fclose(f);
}
