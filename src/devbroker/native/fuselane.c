/*
 * devbroker's native reader loop for the FUSE front end.
 *
 * What it is: the mechanical part of a FUSE reader thread (frontends/fuse.py) done in C —
 * read what /dev/fuse has pending, queue the tenants' node ioctls fairly between tenants,
 * hand the next one to the broker, and, once the broker has decided and run it, read and
 * write the tenant's parameter block and send the reply. It decides nothing: every request
 * goes to Python (the node ioctls one at a time, in fair order, parsed; every other request
 * whole, as read), and Python's `FuseFrontend._native_lane_call` asks the same control lane
 * (broker/fastlane.py) the Python reader asks. What it saves is the Python around each
 * system call: on the 2-CPU development machine a FUSE reader spent ~30 µs reading and
 * routing a request, ~35 µs reading and writing the parameter block through the memory
 * gate's effects and ~20 µs sending the reply (docs/benchmarks.md, "The hot path").
 *
 * Why it stays safe, step for step as the Python reader:
 * - The header the broker decides on is the kernel's copy in the request (a restricted FUSE
 *   ioctl carries it), and the parameter block is read once, into this thread's buffer, at
 *   the address and size the broker's decision names (`dvbf_read`): Python decides and runs
 *   the call on that private copy; nothing here reads the tenant's memory again.
 * - Tenant memory is read and written with process_vm_readv/writev, which can block on a
 *   page the tenant controls. The thread publishes when such an access started
 *   (`mem_since`); the front end's watchdog claims an access past the memory gate's deadline
 *   with a compare-and-swap (`dvbf_claim`), answers the request EFAULT itself and counts the
 *   access as stalled; the access, when it returns, sees the claim and reports DVBF_LATE
 *   (the books balance) instead of answering. The claim and the end of an access exchange
 *   the same word, so exactly one of them wins: never two answers, never an access counted
 *   stalled that no one reports back.
 * - Fairness between tenants is the Python reader's (limits.FairQueue): one queue shared by
 *   the front end's threads, each tenant served in turn, one request per turn, so a quiet
 *   tenant's call waits for at most one call of each other busy tenant. Shared, so that a
 *   thread held up in a stalled access leaves what it read to the other threads.
 *
 * No kernel or libc headers beyond POSIX/glibc: the FUSE structures are defined here (the
 * layouts are the kernel's ABI, frontends/fusewire.py has the same).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define DVBF_ABI 1 /* bumped with any change of the structures below (fuse.py checks) */

struct fuse_in_header {
    uint32_t len, opcode;
    uint64_t unique, nodeid;
    uint32_t uid, gid, pid;
    uint16_t total_extlen, padding;
};
struct fuse_ioctl_in {
    uint64_t fh;
    uint32_t flags, cmd;
    uint64_t arg;
    uint32_t in_size, out_size;
};
struct fuse_out_header {
    uint32_t len;
    int32_t error;
    uint64_t unique;
};
struct fuse_ioctl_out {
    int32_t result;
    uint32_t flags, in_iovs, out_iovs;
};
#define FUSE_IOCTL 39

#define DVBF_HDR_MAX 1024     /* the largest ioctl argument queued here (lane.c's DVB_HDR_MAX) */
#define DVBF_REQ_MAX (sizeof(struct fuse_in_header) + sizeof(struct fuse_ioctl_in) + DVBF_HDR_MAX)
#define DVBF_PARAMS_MAX 16384 /* the largest parameter block read here (lane.c's) */
#define DVBF_SLOTS 128        /* node ioctls read and waiting for their turn */
#define DVBF_NODES 1024       /* node inodes (a tenant's /dev entries) */
#define DVBF_SPIN_NS_MAX 1000000

/* dvbf_next's answers */
enum { DVBF_NODE_IOCTL = 1, DVBF_REQUEST, DVBF_IDLE, DVBF_WAKE, DVBF_HUP, DVBF_ERROR };
/* dvbf_read/dvbf_answer: the access came back after the watchdog answered the call */
#define DVBF_LATE (-2)
#define DVBF_WRITE_FAILED (-3)

struct dvbf_slot {
    uint64_t seq; /* 0: free */
    int32_t tenant;
    uint32_t len;
    uint8_t data[DVBF_REQ_MAX];
};

/* One front end's: its node inodes (nodeid -> tenant) and the queue its threads share. */
struct dvbf_shared {
    pthread_mutex_t lock;
    struct {
        uint64_t nodeid; /* 0: empty */
        int32_t tenant;
    } nodes[DVBF_NODES];
    struct dvbf_slot slots[DVBF_SLOTS];
    int queued;
    uint64_t seq;
    int32_t last_tenant; /* the tenant served last (the next turn is the one after it) */
};

/* The request handed to Python (a node ioctl, parsed; or another request's length). */
struct dvbf_call {
    uint64_t unique, nodeid, fh, arg;
    uint32_t uid, gid, pid, cmd, flags, in_size, out_size, len;
    int32_t tenant;
    int32_t err;     /* DVBF_HUP, DVBF_ERROR: the errno */
    int64_t late_ns; /* DVBF_LATE: how long the claimed access took */
    uint8_t raw[DVBF_REQ_MAX];          /* a node ioctl as read (header, ioctl_in, argument) */
    uint8_t params[DVBF_PARAMS_MAX];    /* the parameter block dvbf_read read */
};

/* One reader thread's. */
struct dvbf_thread {
    struct dvbf_shared *sh;
    int fd, wake_fd;
    int64_t spin_ns, spin_until;
    int64_t mem_since; /* atomic: when an access to tenant memory started; 0 none; -1 claimed */
    size_t bufsize;
    uint8_t *buf; /* one read's worth (any request) */
    struct dvbf_call call;
    uint64_t counters[4]; /* read, queued, answered, late */
};

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

int dvbf_abi(void) { return DVBF_ABI; }
size_t dvbf_call_size(void) { return sizeof(struct dvbf_call); }
size_t dvbf_req_max(void) { return DVBF_REQ_MAX; }
size_t dvbf_params_max(void) { return DVBF_PARAMS_MAX; }

struct dvbf_shared *dvbf_shared_new(void)
{
    struct dvbf_shared *sh = calloc(1, sizeof(*sh));
    if (!sh)
        return NULL;
    pthread_mutex_init(&sh->lock, NULL);
    sh->last_tenant = -1;
    return sh;
}

void dvbf_shared_free(struct dvbf_shared *sh)
{
    if (!sh)
        return;
    pthread_mutex_destroy(&sh->lock);
    free(sh);
}

/* Node inodes: an ioctl on one of them is queued here, for its tenant's turns. Returns 0,
 * or -1 when the table is full (then that node's ioctls reach Python whole, as any request:
 * still answered, only not through the native queue). */
int dvbf_node_put(struct dvbf_shared *sh, uint64_t nodeid, int32_t tenant)
{
    int rc = -1;
    if (!nodeid || tenant < 0)
        return -1;
    pthread_mutex_lock(&sh->lock);
    int free_at = -1;
    for (int k = 0; k < DVBF_NODES; k++) {
        if (sh->nodes[k].nodeid == nodeid) {
            sh->nodes[k].tenant = tenant;
            rc = 0;
            goto out;
        }
        if (!sh->nodes[k].nodeid && free_at < 0)
            free_at = k;
    }
    if (free_at >= 0) {
        sh->nodes[free_at].nodeid = nodeid;
        sh->nodes[free_at].tenant = tenant;
        rc = 0;
    }
out:
    pthread_mutex_unlock(&sh->lock);
    return rc;
}

void dvbf_node_drop(struct dvbf_shared *sh, uint64_t nodeid)
{
    pthread_mutex_lock(&sh->lock);
    for (int k = 0; k < DVBF_NODES; k++)
        if (sh->nodes[k].nodeid == nodeid)
            sh->nodes[k].nodeid = 0;
    pthread_mutex_unlock(&sh->lock);
}

int dvbf_queued(struct dvbf_shared *sh) { return __atomic_load_n(&sh->queued, __ATOMIC_ACQUIRE); }

struct dvbf_thread *dvbf_thread_new(struct dvbf_shared *sh, int fd, int wake_fd,
                                    size_t bufsize, int64_t spin_ns)
{
    struct dvbf_thread *t = calloc(1, sizeof(*t));
    if (!t)
        return NULL;
    t->buf = malloc(bufsize);
    if (!t->buf) {
        free(t);
        return NULL;
    }
    t->sh = sh;
    t->fd = fd;
    t->wake_fd = wake_fd;
    t->bufsize = bufsize;
    t->spin_ns = spin_ns < 0 ? 0 : spin_ns > DVBF_SPIN_NS_MAX ? DVBF_SPIN_NS_MAX : spin_ns;
    return t;
}

void dvbf_thread_free(struct dvbf_thread *t)
{
    if (!t)
        return;
    free(t->buf);
    free(t);
}

struct dvbf_call *dvbf_call_of(struct dvbf_thread *t) { return &t->call; }
uint8_t *dvbf_buf_of(struct dvbf_thread *t) { return t->buf; }

void dvbf_fold(struct dvbf_thread *t, uint64_t *out)
{
    memcpy(out, t->counters, sizeof(t->counters));
    memset(t->counters, 0, sizeof(t->counters));
}

/* ------------------------------------------------------------------ the fair queue */

static int node_tenant(struct dvbf_shared *sh, uint64_t nodeid) /* (lock held) */
{
    if (!nodeid) /* (an empty slot's: no inode has it) */
        return -1;
    for (int k = 0; k < DVBF_NODES; k++)
        if (sh->nodes[k].nodeid == nodeid)
            return sh->nodes[k].tenant;
    return -1;
}

/* A request just read: a node ioctl small enough is queued (1); anything else is left in
 * t->buf for Python (0); the queue full: -1 (left in t->buf too, for Python's own queue). */
static int queue_request(struct dvbf_thread *t, size_t n)
{
    struct dvbf_shared *sh = t->sh;
    const struct fuse_in_header *h = (const void *)t->buf;
    if (n < sizeof(*h) + sizeof(struct fuse_ioctl_in) || h->opcode != FUSE_IOCTL
        || h->len != n || h->total_extlen || n > DVBF_REQ_MAX)
        return 0;
    const struct fuse_ioctl_in *in = (const void *)(t->buf + sizeof(*h));
    if (in->in_size != n - sizeof(*h) - sizeof(*in))
        return 0; /* (malformed: the Python reader's parser says so, with its error) */
    int rc = 0;
    pthread_mutex_lock(&sh->lock);
    int tenant = node_tenant(sh, h->nodeid);
    if (tenant >= 0) {
        rc = -1;
        for (int k = 0; k < DVBF_SLOTS; k++) {
            struct dvbf_slot *s = &sh->slots[k];
            if (s->seq)
                continue;
            s->seq = ++sh->seq;
            s->tenant = tenant;
            s->len = (uint32_t)n;
            memcpy(s->data, t->buf, n);
            __atomic_add_fetch(&sh->queued, 1, __ATOMIC_RELEASE);
            rc = 1;
            break;
        }
    }
    pthread_mutex_unlock(&sh->lock);
    return rc;
}

/* The next node ioctl in fair order into t->call (1), or 0 when none waits. The tenant
 * after the one served last gets the turn; within a tenant, the oldest request. */
static int take_next(struct dvbf_thread *t)
{
    struct dvbf_shared *sh = t->sh;
    if (!__atomic_load_n(&sh->queued, __ATOMIC_ACQUIRE))
        return 0;
    pthread_mutex_lock(&sh->lock);
    int best = -1, best_after = 0;
    for (int k = 0; k < DVBF_SLOTS; k++) {
        const struct dvbf_slot *s = &sh->slots[k];
        if (!s->seq)
            continue;
        int after = s->tenant > sh->last_tenant; /* its turn comes before the wrap */
        if (best < 0)
            goto take;
        const struct dvbf_slot *b = &sh->slots[best];
        if (after != best_after) {
            if (after)
                goto take;
            continue;
        }
        if (s->tenant < b->tenant || (s->tenant == b->tenant && s->seq < b->seq))
            goto take;
        continue;
    take:
        best = k;
        best_after = after;
    }
    if (best >= 0) {
        struct dvbf_slot *s = &sh->slots[best];
        struct dvbf_call *c = &t->call;
        const struct fuse_in_header *h = (const void *)s->data;
        const struct fuse_ioctl_in *in = (const void *)(s->data + sizeof(*h));
        memcpy(c->raw, s->data, s->len);
        c->len = s->len;
        c->unique = h->unique;
        c->nodeid = h->nodeid;
        c->uid = h->uid;
        c->gid = h->gid;
        c->pid = h->pid;
        c->fh = in->fh;
        c->flags = in->flags;
        c->cmd = in->cmd;
        c->arg = in->arg;
        c->in_size = in->in_size;
        c->out_size = in->out_size;
        c->tenant = s->tenant;
        sh->last_tenant = s->tenant;
        s->seq = 0;
        __atomic_sub_fetch(&sh->queued, 1, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&sh->lock);
    return best >= 0;
}

/* ------------------------------------------------------------------ reading */

/* Read what is pending (non-blocking) until nothing is, the queue is full, or a request
 * is for Python: DVBF_REQUEST (in t->buf, length in call.len), 0 (read all there was),
 * DVBF_HUP / DVBF_ERROR (call.err). */
static int read_pending(struct dvbf_thread *t)
{
    for (int k = 0; k < DVBF_SLOTS; k++) {
        ssize_t n = read(t->fd, t->buf, t->bufsize);
        if (n == 0) { /* (never from /dev/fuse; the end of any other file) */
            t->call.err = ENODEV;
            return DVBF_HUP;
        }
        if (n < 0) {
            if (errno == EAGAIN)
                return 0;
            if (errno == EINTR || errno == ENOENT) /* (ENOENT: withdrawn before read) */
                continue;
            t->call.err = errno;
            return errno == ENODEV || errno == ECONNABORTED || errno == EBADF ? DVBF_HUP
                                                                           : DVBF_ERROR;
        }
        t->counters[0]++;
        int q = queue_request(t, (size_t)n);
        if (q <= 0) {
            t->call.len = (uint32_t)n;
            return DVBF_REQUEST;
        }
        t->counters[1]++;
    }
    return 0;
}

/* The next thing for Python to do. read: 0 while the front end pauses (only what is queued
 * is handed out, nothing more is read). Waits up to 200 ms when nothing is pending (after
 * an answer, first looks for the tenant's next request for spin_ns without sleeping: the
 * wake-up across CPUs is most of a FUSE round trip on a small machine). */
int dvbf_next(struct dvbf_thread *t, int read_more)
{
    for (;;) {
        if (!read_more)
            return take_next(t) ? DVBF_NODE_IOCTL : DVBF_IDLE;
        /* Everything pending first, then the next turn: a quiet tenant's request that came
         * in meanwhile is in the queue before the turn is given (limits.FairQueue's rule). */
        int r = read_pending(t);
        if (r)
            return r;
        if (take_next(t))
            return DVBF_NODE_IOCTL;
        struct pollfd p[2] = {{.fd = t->fd, .events = POLLIN}, {.fd = t->wake_fd, .events = POLLIN}};
        int timeout = now_ns() < t->spin_until ? 0 : 200;
        if (!timeout)
            /* Looking, not sleeping: give the CPU to anything else runnable on it first.
             * The tenant whose answer was just sent may be woken on this very CPU (the
             * scheduler likes to wake a task where its waker runs); a look that kept the
             * CPU would hold that tenant off for the whole look, each call. */
            sched_yield();
        int got = poll(p, 2, timeout);
        if (got < 0 && errno != EINTR) {
            t->call.err = errno;
            return DVBF_ERROR;
        }
        if (got > 0 && p[1].revents)
            return DVBF_WAKE;
        if (got == 0 && timeout)
            return DVBF_IDLE;
    }
}

/* ------------------------------------------------------------------ tenant memory */

/* One process_vm_readv/writev, published for the watchdog. DVBF_LATE when the watchdog
 * claimed it meanwhile (the call is answered already). */
static ssize_t tenant_rw(struct dvbf_thread *t, pid_t pid, int write, void *buf, size_t len,
                         uint64_t addr)
{
    struct iovec l = {buf, len}, r = {(void *)(uintptr_t)addr, len};
    int64_t started = now_ns();
    __atomic_store_n(&t->mem_since, started, __ATOMIC_RELEASE);
    ssize_t got = write ? process_vm_writev(pid, &l, 1, &r, 1, 0)
                        : process_vm_readv(pid, &l, 1, &r, 1, 0);
    int e = errno;
    if (__atomic_exchange_n(&t->mem_since, 0, __ATOMIC_ACQ_REL) == -1) {
        t->call.late_ns = now_ns() - started;
        t->counters[3]++;
        return DVBF_LATE;
    }
    errno = e;
    return got;
}

/* For the watchdog (another thread): when the thread's current access started, or 0. */
int64_t dvbf_mem_since(struct dvbf_thread *t) { return __atomic_load_n(&t->mem_since, __ATOMIC_ACQUIRE); }

/* The watchdog's claim of an access it saw start at `since`: 1 when it is now the
 * watchdog's to answer (the thread will report DVBF_LATE), 0 when the access ended first. */
int dvbf_claim(struct dvbf_thread *t, int64_t since)
{
    int64_t want = since;
    return since > 0 && __atomic_compare_exchange_n(&t->mem_since, &want, -1, 0,
                                                    __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
}

/* The parameter block the broker's decision names, into call.params: the bytes read, -1
 * (errno), or DVBF_LATE. */
ssize_t dvbf_read(struct dvbf_thread *t, uint64_t addr, size_t len)
{
    if (len > DVBF_PARAMS_MAX) {
        errno = E2BIG;
        return -1;
    }
    if (!len)
        return 0;
    return tenant_rw(t, (pid_t)t->call.pid, 0, t->call.params, len, addr);
}

/* ------------------------------------------------------------------ answering */

static void reply(struct dvbf_thread *t, int error, int32_t result, const uint8_t *out,
                  size_t out_len)
{
    struct fuse_out_header oh = {.error = -error, .unique = t->call.unique};
    struct fuse_ioctl_out io = {.result = result};
    struct iovec v[3] = {{&oh, sizeof(oh)}, {&io, sizeof(io)}, {(void *)out, out_len}};
    int n = error ? 1 : out_len ? 3 : 2;
    oh.len = (uint32_t)(sizeof(oh) + (error ? 0 : sizeof(io) + out_len));
    /* ENOENT: the request was interrupted and withdrawn; the reply has no reader */
    (void)!writev(t->fd, v, n);
    t->counters[2]++;
    t->spin_until = now_ns() + t->spin_ns;
}

/* An error reply (a positive errno, 1..511) for the call in hand. */
void dvbf_error(struct dvbf_thread *t, int error)
{
    reply(t, error > 0 && error < 512 ? error : EIO, 0, NULL, 0);
}

/* The call's answer: `params` written back to the tenant at `addr` (none when len is 0),
 * then the reply with `result` and the out buffer `out` (the header the tenant gets back).
 * 0: answered; DVBF_WRITE_FAILED: the write-back failed and the call was answered EFAULT
 * (the tenant's buffers may hold part of it, as with the Python reader); DVBF_LATE: the
 * watchdog answered meanwhile (nothing more is sent). */
int dvbf_answer(struct dvbf_thread *t, int32_t result, const uint8_t *out, size_t out_len,
                uint64_t addr, const uint8_t *params, size_t len)
{
    if (len) {
        ssize_t put = tenant_rw(t, (pid_t)t->call.pid, 1, (void *)params, len, addr);
        if (put == DVBF_LATE)
            return DVBF_LATE;
        if (put != (ssize_t)len) {
            reply(t, EFAULT, 0, NULL, 0);
            return DVBF_WRITE_FAILED;
        }
    }
    reply(t, 0, result, out, out_len);
    return 0;
}
