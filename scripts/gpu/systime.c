/*
 * A diagnostic LD_PRELOAD library for the GPU probes (scripts/gpu/nvml_probe.sh): the wall
 * time a process spends in open/openat, ioctl, mmap and close, split into NVIDIA device
 * files and the rest, written as one JSON line to $SYSTIME_OUT (appended) at exit (and at
 * systime_write(tag) calls: a window the program marks after systime_reset()). Run the
 * same program natively and in a devbroker tenant: the difference per row is what the
 * broker's interception costs there, including what its own per-call metrics cannot see
 * (waiting for a listener to pick the notification up, the answer's wake-up).
 * With $SYSTIME_KINDS set, the NVIDIA ioctls are also counted per kind — the escape, the
 * class of an RM_ALLOC, the control of an RM_CONTROL, the command of a UVM call — and the
 * line gains "kinds": [[key, count, ms], ...] (key: "F<nr>", "F<nr>/<class or control>",
 * or "U<command>", hex), so native and devbroker can be compared call kind by call kind.
 *   cc -O2 -shared -fPIC -o systime.so systime.c -ldl
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
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

/* per-kind table (SYSTIME_KINDS): open addressing, a mutex (a diagnostic; the mutex costs
 * far less than the ioctl it is taken around) */
#define KINDS 1024
static struct { uint64_t key; int64_t n, ns; } kinds[KINDS];
static pthread_mutex_t kinds_lock = PTHREAD_MUTEX_INITIALIZER;
static int kinds_on = -1;

static uint64_t kind_of(unsigned long req, const void *arg)
{
    unsigned type = (req >> 8) & 0xff, nr = req & 0xff;
    if (type != 'F')
        return (1ull << 63) | (uint32_t)req; /* UVM: the command number */
    uint64_t key = (uint64_t)nr << 32;
    if (arg && (nr == 0x2a || nr == 0x2b)) /* RM_CONTROL: cmd at 8; RM_ALLOC: hClass at 12 */
        key |= (1ull << 62) | *(const uint32_t *)((const char *)arg + (nr == 0x2a ? 8 : 12));
    return key;
}

static void add_kind(uint64_t key, int64_t dt)
{
    pthread_mutex_lock(&kinds_lock);
    for (unsigned i = (unsigned)(key * 0x9E3779B97F4A7C15ull >> 54), j = 0; j < KINDS;
         i = (i + 1) % KINDS, j++) {
        if (kinds[i].n == 0 || kinds[i].key == key) {
            kinds[i].key = key;
            kinds[i].n++;
            kinds[i].ns += dt;
            break;
        }
    }
    pthread_mutex_unlock(&kinds_lock);
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
    if (kinds_on < 0)
        kinds_on = getenv("SYSTIME_KINDS") != NULL;
    int nv = nv_fd(fd);
    /* (read before the call: the driver may change the argument) */
    uint64_t key = nv && kinds_on ? kind_of(req, arg) : 0;
    int64_t t0 = now();
    int r = real_ioctl(fd, req, arg);
    if (key)
        add_kind(key, now() - t0);
    add(nv ? IOCTL_NV : IOCTL_OTHER, t0);
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

/* Called by the measured program where its window starts (scripts/gpu/cuda_checks.py init:
 * after `import torch`): everything counted so far is dropped. */
void systime_reset(void)
{
    for (int i = 0; i < NROWS; i++)
        ns[i] = count[i] = 0;
    pthread_mutex_lock(&kinds_lock);
    memset(kinds, 0, sizeof kinds);
    pthread_mutex_unlock(&kinds_lock);
}

static void report_tagged(const char *tag)
{
    const char *out = getenv("SYSTIME_OUT");
    if (!out)
        return;
    FILE *f = fopen(out, "a");
    if (!f)
        return;
    fprintf(f, "{\"pid\": %d, \"window\": \"%s\"", (int)getpid(), tag);
    for (int i = 0; i < NROWS; i++)
        fprintf(f, ", \"%s\": [%lld, %.3f]", names[i], (long long)count[i], ns[i] / 1e6);
    if (kinds_on > 0) {
        fprintf(f, ", \"kinds\": [");
        const char *sep = "";
        for (int i = 0; i < KINDS; i++) {
            if (!kinds[i].n)
                continue;
            uint64_t k = kinds[i].key;
            char name[48];
            if (k >> 63)
                snprintf(name, sizeof name, "U%x", (unsigned)k);
            else if ((k >> 62) & 1)
                snprintf(name, sizeof name, "F%x/%x", (unsigned)(k >> 32) & 0xff, (unsigned)k);
            else
                snprintf(name, sizeof name, "F%x", (unsigned)(k >> 32) & 0xff);
            fprintf(f, "%s[\"%s\", %lld, %.3f]", sep, name, (long long)kinds[i].n, kinds[i].ns / 1e6);
            sep = ", ";
        }
        fprintf(f, "]");
    }
    fprintf(f, "}\n");
    fclose(f);
}

__attribute__((destructor)) static void report(void) { report_tagged("exit"); }

/* The counts since the last systime_reset, as a line of their own, now (a program marks a
 * window of interest: cuda_checks.py bench around its tiny-kernel loop). */
void systime_write(const char *tag) { report_tagged(tag ? tag : "mark"); }
