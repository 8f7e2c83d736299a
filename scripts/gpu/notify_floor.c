/*
 * The floor of the seccomp path on a host (scripts/gpu/floor_probe.sh, issues 12 and 14):
 * runs a command under a filter given as hex (devbroker's own, seccompwire.build_filter,
 * with the real backend's in-kernel rows) and answers every notification with CONTINUE at
 * once — no file identity, no copy of the argument, no Python, no decision. Whatever a
 * program loses under this supervisor against its native run is what the interception
 * itself costs on the host (the tenant's and the supervisor's wake-ups); whatever devbroker
 * loses beyond that is devbroker's own.
 *
 *   notify_floor [-s] [-p US] [-r FILE] FILTER_HEX cmd args...
 *     -s       SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP on the listener (the kernel runs
 *              supervisor and tenant on one CPU)
 *     -p US    after each answer, look for the next notification without sleeping for US µs
 *     -r FILE  append the closing line there instead of stderr (the command's own last
 *              line stays its last)
 *
 * At the end one line: notifications, mean handling time.
 *   cc -O2 -o notify_floor notify_floor.c
 */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#ifndef SECCOMP_IOCTL_NOTIF_SET_FLAGS
#define SECCOMP_IOCTL_NOTIF_SET_FLAGS SECCOMP_IOW(4, __u64)
#endif
#ifndef SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP
#define SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP 1UL
#endif

static int64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static int hexval(char c)
{
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
}

int main(int argc, char **argv)
{
    int sync_wake = 0, ai = 1;
    int64_t spin_ns = 0;
    const char *report = NULL;
    while (ai < argc && argv[ai][0] == '-') {
        if (!strcmp(argv[ai], "-s"))
            sync_wake = 1, ai++;
        else if (!strcmp(argv[ai], "-p") && ai + 1 < argc)
            spin_ns = atoll(argv[ai + 1]) * 1000, ai += 2;
        else if (!strcmp(argv[ai], "-r") && ai + 1 < argc)
            report = argv[ai + 1], ai += 2;
        else
            break;
    }
    if (argc - ai < 2) {
        fprintf(stderr, "usage: notify_floor [-s] [-p US] [-r FILE] FILTER_HEX cmd args...\n");
        return 2;
    }
    const char *hex = argv[ai++];
    size_t n = strlen(hex) / 2;
    if (n % sizeof(struct sock_filter)) {
        fprintf(stderr, "notify_floor: the filter is not whole instructions\n");
        return 2;
    }
    unsigned char *prog_bytes = malloc(n);
    for (size_t i = 0; i < n; i++) {
        int hi = hexval(hex[2 * i]), lo = hexval(hex[2 * i + 1]);
        if (hi < 0 || lo < 0) {
            fprintf(stderr, "notify_floor: bad hex\n");
            return 2;
        }
        prog_bytes[i] = (unsigned char)(hi << 4 | lo);
    }
    struct sock_fprog prog = {(unsigned short)(n / sizeof(struct sock_filter)),
                              (struct sock_filter *)prog_bytes};
    int sv[2], go[2];
    if (pipe(sv) || pipe(go))
        return 3;
    pid_t child = fork();
    if (child == 0) {
        prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0);
        int lfd = syscall(__NR_seccomp, SECCOMP_SET_MODE_FILTER,
                          SECCOMP_FILTER_FLAG_NEW_LISTENER, &prog);
        if (lfd < 0) {
            perror("notify_floor: seccomp");
            _exit(3);
        }
        /* (write and read are not intercepted by the filter) */
        if (write(sv[1], &lfd, sizeof lfd) != sizeof lfd)
            _exit(3);
        char c;
        if (read(go[0], &c, 1) != 1)
            _exit(3);
        close(lfd);
        execvp(argv[ai], argv + ai);
        perror("notify_floor: exec");
        _exit(127);
    }
    int child_lfd;
    if (read(sv[0], &child_lfd, sizeof child_lfd) != sizeof child_lfd)
        return 3;
    int pidfd = syscall(SYS_pidfd_open, child, 0);
    int lfd = syscall(438 /* pidfd_getfd */, pidfd, child_lfd, 0);
    if (lfd < 0) {
        perror("notify_floor: pidfd_getfd");
        return 3;
    }
    if (sync_wake && ioctl(lfd, SECCOMP_IOCTL_NOTIF_SET_FLAGS,
                           (unsigned long)SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP) < 0)
        perror("notify_floor: SYNC_WAKE_UP (ignored)");
    if (write(go[1], "x", 1) != 1)
        return 3;
    struct seccomp_notif_sizes sz;
    syscall(__NR_seccomp, SECCOMP_GET_NOTIF_SIZES, 0, &sz);
    struct seccomp_notif *req = calloc(1, sz.seccomp_notif > 256 ? sz.seccomp_notif : 256);
    struct seccomp_notif_resp *resp = calloc(1, sz.seccomp_notif_resp > 64 ? sz.seccomp_notif_resp : 64);
    long handled = 0;
    double total_ns = 0;
    int64_t spin_until = 0;
    for (;;) {
        struct pollfd p = {lfd, POLLIN, 0};
        int spinning = spin_ns && now_ns() < spin_until;
        int r = poll(&p, 1, spinning ? 0 : 200);
        int st;
        if (r <= 0 || (p.revents & POLLHUP)) {
            if (waitpid(child, &st, WNOHANG) == child) {
                FILE *f = report ? fopen(report, "a") : NULL;
                fprintf(f ? f : stderr, "notify_floor: %ld notifications, mean handling "
                        "%.2f us (sync %d, spin %lld us)\n", handled,
                        handled ? total_ns / 1e3 / handled : 0.0, sync_wake,
                        (long long)(spin_ns / 1000));
                if (f)
                    fclose(f);
                return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
            }
            if (p.revents & POLLHUP)
                usleep(1000);
            continue;
        }
        memset(req, 0, sz.seccomp_notif);
        if (ioctl(lfd, SECCOMP_IOCTL_NOTIF_RECV, req) < 0)
            continue;
        int64_t t0 = now_ns();
        memset(resp, 0, sz.seccomp_notif_resp);
        resp->id = req->id;
        resp->flags = SECCOMP_USER_NOTIF_FLAG_CONTINUE;
        ioctl(lfd, SECCOMP_IOCTL_NOTIF_SEND, resp);
        int64_t t1 = now_ns();
        total_ns += (double)(t1 - t0);
        handled++;
        spin_until = t1 + spin_ns;
    }
}
