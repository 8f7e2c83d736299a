/* A stand-in libcuda for tests/test_cudackpt.py: exports the driver's five checkpoint
 * entry points (and cuInit, cuDriverGetVersion) with scripted answers, so the helper
 * program (devbroker.tools.cudackpt) makes a real dlopen and real calls.
 *
 * $STANDIN_SCRIPT: comma-separated OP=ANSWER (OP: state lock checkpoint restore unlock;
 *   ANSWER: a CUresult number, or "hang" to block forever). Unnamed ops answer 0.
 * $STANDIN_STATE: the CUprocessState that state reports (default 0).
 * $STANDIN_LOG: a file each call appends one line to: its name, the pid, its own pid
 *   (the helper's: a test checks it was killed), and what the argument block held, read
 *   at the offsets NVIDIA's documentation gives (every block is 64 bytes).
 * Built without the checkpoint symbols with -DOLD_DRIVER (a driver before r570).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

__attribute__((unused)) static int answer(const char *op) {
    const char *s = getenv("STANDIN_SCRIPT");
    size_t n = strlen(op);
    while (s && *s) {
        if (strncmp(s, op, n) == 0 && s[n] == '=') {
            const char *v = s + n + 1;
            if (strncmp(v, "hang", 4) == 0)
                for (;;) pause();
            return atoi(v);
        }
        s = strchr(s, ',');
        if (s) s++;
    }
    return 0;
}

static void logf_(const char *fmt, const char *op, int pid, const char *extra) {
    const char *p = getenv("STANDIN_LOG");
    FILE *f = p ? fopen(p, "a") : NULL;
    if (!f) return;
    fprintf(f, fmt, op, pid, (int)getpid(), extra);
    fclose(f);
}

static void note(const char *op, int pid, const char *extra) {
    logf_("%s pid=%d helper=%d %s\n", op, pid, extra);
}

/* "reserved=0" when bytes [from, 64) of the block are all zero */
__attribute__((unused)) static int zero_from(const void *args, size_t from) {
    const unsigned char *b = args;
    for (size_t i = from; i < 64; i++)
        if (b[i]) return 0;
    return 1;
}

__attribute__((unused)) static void hex(char *out, const unsigned char *b) {
    for (int i = 0; i < 16; i++) sprintf(out + 2 * i, "%02x", b[i]);
}

int cuDriverGetVersion(int *v) { *v = 13000; return 0; }

int cuInit(unsigned int flags) { note("init", (int)flags, ""); return 0; }

#ifndef OLD_DRIVER
int cuCheckpointProcessGetState(int pid, int *state) {
    const char *s = getenv("STANDIN_STATE");
    note("state", pid, "");
    int rc = answer("state");
    if (rc == 0) *state = s ? atoi(s) : 0;
    return rc;
}

int cuCheckpointProcessLock(int pid, void *args) {
    char extra[64];
    uint32_t timeout;
    memcpy(&timeout, args, 4);
    snprintf(extra, sizeof extra, "timeout=%u reserved=%s", timeout,
             zero_from(args, 4) ? "0" : "set");
    note("lock", pid, extra);
    return answer("lock");
}

int cuCheckpointProcessCheckpoint(int pid, void *args) {
    note("checkpoint", pid, zero_from(args, 0) ? "reserved=0" : "reserved=set");
    return answer("checkpoint");
}

int cuCheckpointProcessRestore(int pid, void *args) {
    char extra[256] = "";
    const unsigned char *pairs;
    uint32_t count;
    memcpy(&pairs, args, sizeof pairs);
    memcpy(&count, (const char *)args + 8, 4);
    int n = snprintf(extra, sizeof extra, "count=%u reserved=%s", count,
                     zero_from(args, 12) ? "0" : "set");
    for (uint32_t i = 0; pairs && i < count && i < 2; i++) {
        char old[33], new_[33];
        hex(old, pairs + 32 * i);
        hex(new_, pairs + 32 * i + 16);
        n += snprintf(extra + n, sizeof extra - n, " %s=%s", old, new_);
    }
    note("restore", pid, extra);
    return answer("restore");
}

int cuCheckpointProcessUnlock(int pid, void *args) {
    note("unlock", pid, zero_from(args, 0) ? "reserved=0" : "reserved=set");
    return answer("unlock");
}
#endif
