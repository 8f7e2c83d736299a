/* A FUSE server on raw /dev/fuse whose requests come over io_uring (FUSE_OVER_IO_URING,
 * Linux 6.14+, fuse.enable_uring=Y): the hot-path benchmark's floor with per-CPU queues
 * (scripts/bench_hotpath.py). Every file answers every ioctl at once with the argument as
 * it came, as scripts/bench/fuse_echo.c does; what differs is the transport. With
 * /dev/fuse, a request is read by whichever server thread waits, on whatever CPU, and the
 * wake-up across CPUs is most of a round trip on a small VM. Over io_uring the kernel puts
 * a request on the queue of the CPU the caller runs on, and that queue's entries belong to
 * a thread pinned to that CPU: the caller blocks and the server runs where it ran.
 *
 *   fuse_uring_echo MOUNTPOINT [ENTRIES_PER_QUEUE]
 *
 * Prints "ready uring" once its ring threads are started (the kernel holds requests until
 * every CPU's queue has an entry registered), or "ready dev" when the kernel did not offer
 * io_uring (then reads of /dev/fuse serve everything), and runs until the mount goes. Files: nvidiactl, nvidia0..7, nvidia-uvm, nvidia-uvm-tools, floor (0666). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/fuse.h>
#include <linux/io_uring.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

/* The io_uring transport's ABI (include/uapi/linux/fuse.h, 7.42); older headers lack it. */
#define OVER_IO_URING (1ULL << 41)
#define URING_CMD_REGISTER 1
#define URING_CMD_COMMIT_AND_FETCH 2
struct uring_ent_in_out {
    uint64_t flags, commit_id;
    uint32_t payload_sz, padding;
    uint64_t reserved;
};
struct uring_req_header {
    uint8_t in_out[128]; /* fuse_in_header on fetch, fuse_out_header on commit */
    uint8_t op_in[128];  /* the request's first argument (its per-opcode struct) */
    struct uring_ent_in_out ent;
};
struct uring_cmd_req {
    uint64_t flags, commit_id;
    uint16_t qid;
    uint8_t padding[6];
};

#define PAYLOAD (1u << 20)
#define MAX_WRITE (1u << 17)

static const char *names[] = {"nvidiactl", "nvidia0", "nvidia1", "nvidia2", "nvidia3",
                              "nvidia4", "nvidia5", "nvidia6", "nvidia7", "nvidia-uvm",
                              "nvidia-uvm-tools", "floor", NULL};
static int fuse_fd;

/* ------------------------------------------------------------------ answering */

/* One request: `op` its first argument (per-opcode struct), `rest` what follows. Returns the
 * length of the reply's body, written to `out`, or a negative errno (ENOSYS for opcodes it
 * does not serve); *noreply is set for requests that get no reply (FORGET, INTERRUPT). */
static int answer(const struct fuse_in_header *h, const uint8_t *op, const uint8_t *rest,
                  size_t rest_len, uint8_t *out, int *noreply)
{
    *noreply = 0;
    switch (h->opcode) {
    case FUSE_LOOKUP: {
        if (h->nodeid != FUSE_ROOT_ID)
            return -ENOENT;
        for (int i = 0; names[i]; i++) {
            size_t n = strlen(names[i]);
            if (rest_len >= n && memcmp(rest, names[i], n) == 0 && (rest_len == n || !rest[n])) {
                struct fuse_entry_out *e = (void *)out;
                memset(e, 0, sizeof(*e));
                e->nodeid = 2 + i;
                e->attr.ino = 2 + i;
                e->attr.mode = S_IFREG | 0666;
                e->attr.nlink = 1;
                e->attr.size = 1 << 20;
                e->entry_valid = e->attr_valid = 3600;
                return sizeof(*e);
            }
        }
        return -ENOENT;
    }
    case FUSE_GETATTR: {
        struct fuse_attr_out *a = (void *)out;
        memset(a, 0, sizeof(*a));
        a->attr_valid = 3600;
        a->attr.ino = h->nodeid;
        a->attr.nlink = 1;
        a->attr.mode = h->nodeid == FUSE_ROOT_ID ? (S_IFDIR | 0755) : (S_IFREG | 0666);
        if (h->nodeid == FUSE_ROOT_ID)
            a->attr.nlink = 2;
        return sizeof(*a);
    }
    case FUSE_OPEN:
    case FUSE_OPENDIR: {
        struct fuse_open_out *o = (void *)out;
        memset(o, 0, sizeof(*o));
        o->open_flags = h->opcode == FUSE_OPEN ? (FOPEN_DIRECT_IO | FOPEN_NONSEEKABLE) : 0;
        return sizeof(*o);
    }
    case FUSE_READDIR:
        return 0; /* (empty: the benchmark looks names up) */
    case FUSE_RELEASE:
    case FUSE_RELEASEDIR:
    case FUSE_FLUSH:
    case FUSE_ACCESS:
        return 0;
    case FUSE_IOCTL: {
        const struct fuse_ioctl_in *in = (const void *)op;
        struct fuse_ioctl_out *o = (void *)out;
        memset(o, 0, sizeof(*o));
        size_t n = in->out_size < in->in_size ? in->out_size : in->in_size;
        if (n > rest_len)
            n = rest_len;
        memcpy(out + sizeof(*o), rest, n); /* the argument as it came */
        if (in->out_size > n)
            memset(out + sizeof(*o) + n, 0, in->out_size - n);
        return sizeof(*o) + in->out_size;
    }
    case FUSE_FORGET:
    case FUSE_BATCH_FORGET:
    case FUSE_INTERRUPT:
        *noreply = 1;
        return 0;
    default:
        return -ENOSYS;
    }
}

/* The size of the per-opcode struct in front of a /dev/fuse request's other arguments. */
static size_t op_size(uint32_t opcode)
{
    switch (opcode) {
    case FUSE_GETATTR: return sizeof(struct fuse_getattr_in);
    case FUSE_OPEN: case FUSE_OPENDIR: return sizeof(struct fuse_open_in);
    case FUSE_READDIR: return sizeof(struct fuse_read_in);
    case FUSE_RELEASE: case FUSE_RELEASEDIR: return sizeof(struct fuse_release_in);
    case FUSE_FLUSH: return sizeof(struct fuse_flush_in);
    case FUSE_ACCESS: return sizeof(struct fuse_access_in);
    case FUSE_IOCTL: return sizeof(struct fuse_ioctl_in);
    default: return 0;
    }
}

/* ------------------------------------------------------------------ /dev/fuse */

static int ring_on; /* the kernel accepted the io_uring transport */

static void *dev_reader(void *unused)
{
    (void)unused;
    uint8_t *buf = malloc(PAYLOAD + 4096), *out = malloc(PAYLOAD);
    for (;;) {
        ssize_t n = read(fuse_fd, buf, PAYLOAD + 4096);
        if (n < 0) {
            if (errno == EINTR || errno == ENOENT || errno == EAGAIN)
                continue;
            exit(0); /* ENODEV: unmounted */
        }
        const struct fuse_in_header *h = (const void *)buf;
        size_t os = op_size(h->opcode);
        const uint8_t *op = buf + sizeof(*h), *rest = op + os;
        size_t rest_len = (size_t)n > sizeof(*h) + os ? (size_t)n - sizeof(*h) - os : 0;
        int noreply;
        int r = answer(h, op, rest, rest_len, out + sizeof(struct fuse_out_header), &noreply);
        if (noreply)
            continue;
        struct fuse_out_header *oh = (void *)out;
        oh->unique = h->unique;
        oh->error = r < 0 ? r : 0;
        oh->len = sizeof(*oh) + (r > 0 ? r : 0);
        (void)!write(fuse_fd, out, oh->len);
    }
    return NULL;
}

/* ------------------------------------------------------------------ io_uring */

struct ring {
    int fd, qid, entries;
    unsigned *sq_head, *sq_tail, *sq_mask, *sq_array, *cq_head, *cq_tail, *cq_mask;
    uint8_t *sqes;
    struct io_uring_cqe *cqes;
    unsigned pending;
    struct uring_req_header **hdr;
    uint8_t **payload;
    struct iovec *iov;
};

static int ring_setup(struct ring *r, unsigned depth)
{
    struct io_uring_params p = {.flags = IORING_SETUP_SQE128};
    r->fd = (int)syscall(__NR_io_uring_setup, depth, &p);
    if (r->fd < 0)
        return -1;
    size_t sq_len = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    size_t cq_len = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    if (p.features & IORING_FEAT_SINGLE_MMAP)
        sq_len = cq_len = sq_len > cq_len ? sq_len : cq_len;
    uint8_t *sq = mmap(0, sq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd,
                       IORING_OFF_SQ_RING);
    uint8_t *cq = p.features & IORING_FEAT_SINGLE_MMAP
                      ? sq
                      : mmap(0, cq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE,
                             r->fd, IORING_OFF_CQ_RING);
    r->sqes = mmap(0, p.sq_entries * 128, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE,
                   r->fd, IORING_OFF_SQES);
    if (sq == MAP_FAILED || cq == MAP_FAILED || r->sqes == MAP_FAILED)
        return -1;
    r->sq_head = (void *)(sq + p.sq_off.head);
    r->sq_tail = (void *)(sq + p.sq_off.tail);
    r->sq_mask = (void *)(sq + p.sq_off.ring_mask);
    r->sq_array = (void *)(sq + p.sq_off.array);
    r->cq_head = (void *)(cq + p.cq_off.head);
    r->cq_tail = (void *)(cq + p.cq_off.tail);
    r->cq_mask = (void *)(cq + p.cq_off.ring_mask);
    r->cqes = (void *)(cq + p.cq_off.cqes);
    return 0;
}

static void ring_push(struct ring *r, int cmd, unsigned ent, uint64_t commit_id)
{
    unsigned tail = *r->sq_tail, idx = tail & *r->sq_mask;
    struct io_uring_sqe *sqe = (void *)(r->sqes + (size_t)idx * 128);
    memset(sqe, 0, 128);
    sqe->opcode = IORING_OP_URING_CMD;
    sqe->fd = fuse_fd;
    sqe->cmd_op = cmd;
    sqe->user_data = ent;
    if (cmd == URING_CMD_REGISTER) {
        sqe->addr = (uint64_t)(uintptr_t)&r->iov[2 * ent];
        sqe->len = 2;
    }
    struct uring_cmd_req *req = (void *)sqe->cmd;
    req->commit_id = commit_id;
    req->qid = (uint16_t)r->qid;
    r->sq_array[idx] = idx;
    __atomic_store_n(r->sq_tail, tail + 1, __ATOMIC_RELEASE);
    r->pending++;
}

static void *ring_thread(void *arg)
{
    struct ring *r = arg;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(r->qid, &set);
    (void)sched_setaffinity(0, sizeof(set), &set); /* (outside our cpuset: served unpinned) */
    if (ring_setup(r, (unsigned)r->entries * 2) < 0) {
        perror("io_uring_setup");
        exit(1);
    }
    r->hdr = calloc(r->entries, sizeof(*r->hdr));
    r->payload = calloc(r->entries, sizeof(*r->payload));
    r->iov = calloc(2 * r->entries, sizeof(*r->iov));
    for (int e = 0; e < r->entries; e++) {
        r->hdr[e] = aligned_alloc(4096, 4096);
        r->payload[e] = aligned_alloc(4096, PAYLOAD);
        r->iov[2 * e] = (struct iovec){r->hdr[e], sizeof(struct uring_req_header)};
        r->iov[2 * e + 1] = (struct iovec){r->payload[e], PAYLOAD};
        ring_push(r, URING_CMD_REGISTER, e, 0);
    }
    for (;;) {
        int got = (int)syscall(__NR_io_uring_enter, r->fd, r->pending, 1, IORING_ENTER_GETEVENTS,
                               NULL, 0);
        if (got < 0 && errno != EINTR) {
            perror("io_uring_enter");
            exit(1);
        }
        if (got > 0)
            r->pending -= (unsigned)got < r->pending ? (unsigned)got : r->pending;
        unsigned head = *r->cq_head;
        while (head != __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE)) {
            struct io_uring_cqe *c = &r->cqes[head & *r->cq_mask];
            unsigned e = (unsigned)c->user_data;
            int res = c->res;
            head++;
            if (res < 0) { /* ENOTCONN etc.: the connection went */
                if (res == -ENOTCONN || res == -ECONNABORTED || res == -ECANCELED)
                    exit(0);
                fprintf(stderr, "fuse_uring_echo: queue %d: %s\n", r->qid, strerror(-res));
                exit(1);
            }
            struct uring_req_header *hd = r->hdr[e];
            struct fuse_in_header h;
            memcpy(&h, hd->in_out, sizeof(h));
            uint64_t commit = hd->ent.commit_id;
            int noreply;
            uint8_t *pl = r->payload[e];
            static __thread uint8_t *scratch;
            if (!scratch)
                scratch = malloc(PAYLOAD);
            int n = answer(&h, hd->op_in, pl, hd->ent.payload_sz, scratch, &noreply);
            struct fuse_out_header oh = {.unique = h.unique, .error = n < 0 ? n : 0};
            oh.len = sizeof(oh) + (n > 0 ? n : 0);
            if (n > 0)
                memcpy(pl, scratch, n);
            memcpy(hd->in_out, &oh, sizeof(oh));
            hd->ent.payload_sz = n > 0 ? n : 0;
            ring_push(r, URING_CMD_COMMIT_AND_FETCH, e, commit);
        }
        __atomic_store_n(r->cq_head, head, __ATOMIC_RELEASE);
    }
    return NULL;
}

/* The kernel makes a queue per possible CPU and waits until every one has an entry. */
static int possible_cpus(void)
{
    FILE *f = fopen("/sys/devices/system/cpu/possible", "r");
    int lo = -1, hi = -1;
    if (!f)
        return -1;
    int got = fscanf(f, "%d-%d", &lo, &hi);
    fclose(f);
    if (got < 1 || lo != 0)
        return -1;
    return got == 2 ? hi + 1 : 1;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: fuse_uring_echo MOUNTPOINT [ENTRIES_PER_QUEUE]\n");
        return 2;
    }
    int entries = argc > 2 ? atoi(argv[2]) : 4;
    fuse_fd = open("/dev/fuse", O_RDWR | O_CLOEXEC);
    if (fuse_fd < 0) {
        perror("/dev/fuse");
        return 1;
    }
    char opts[128];
    snprintf(opts, sizeof(opts), "fd=%d,rootmode=40000,user_id=0,group_id=0,allow_other", fuse_fd);
    if (mount("fuse_uring_echo", argv[1], "fuse", MS_NOSUID | MS_NODEV, opts) < 0) {
        perror("mount");
        return 1;
    }
    /* INIT first (the ring needs the connection's sizes), on this thread. */
    uint8_t *buf = malloc(PAYLOAD + 4096);
    ssize_t n = read(fuse_fd, buf, PAYLOAD + 4096);
    if (n < (ssize_t)sizeof(struct fuse_in_header) || ((struct fuse_in_header *)buf)->opcode != FUSE_INIT) {
        fprintf(stderr, "fuse_uring_echo: no INIT\n");
        return 1;
    }
    /* (the INIT answer: dev_reader's, on a buffer already read) */
    {
        const struct fuse_in_header *h = (const void *)buf;
        const struct fuse_init_in *in = (const void *)(h + 1);
        struct fuse_out_header oh = {.unique = h->unique};
        struct fuse_init_out io = {0};
        uint64_t offered = in->flags | (in->flags & FUSE_INIT_EXT ? (uint64_t)in->flags2 << 32 : 0);
        io.major = FUSE_KERNEL_VERSION;
        io.minor = in->minor < FUSE_KERNEL_MINOR_VERSION ? in->minor : FUSE_KERNEL_MINOR_VERSION;
        io.max_readahead = in->max_readahead;
        io.max_write = MAX_WRITE;
        uint64_t want = FUSE_INIT_EXT | (offered & OVER_IO_URING);
        io.flags = (uint32_t)want;
        io.flags2 = (uint32_t)(want >> 32);
        ring_on = (offered & OVER_IO_URING) != 0;
        oh.len = sizeof(oh) + sizeof(io);
        struct iovec v[2] = {{&oh, sizeof(oh)}, {&io, sizeof(io)}};
        if (writev(fuse_fd, v, 2) < 0) {
            perror("INIT reply");
            return 1;
        }
    }
    pthread_t t;
    pthread_create(&t, NULL, dev_reader, NULL);
    if (ring_on) {
        int cpus = possible_cpus();
        if (cpus <= 0) {
            fprintf(stderr, "fuse_uring_echo: cannot read the possible CPUs\n");
            return 1;
        }
        for (int q = 0; q < cpus; q++) {
            struct ring *r = calloc(1, sizeof(*r));
            r->qid = q;
            r->entries = entries;
            pthread_create(&t, NULL, ring_thread, r);
        }
    }
    printf("ready %s\n", ring_on ? "uring" : "dev");
    fflush(stdout);
    pthread_join(t, NULL);
    return 0;
}
