/*
 * devbroker's native listener loop for the seccomp front end.
 *
 * What it is: the mechanical part of answering a tenant's notifications — wait, receive,
 * read the few bytes a decision needs into private buffers, make the driver call on the
 * broker's duplicate of the tenant's file, write the results back, answer — done in C, so
 * that a call costs the system calls it needs and not the Python around each of them. It
 * decides nothing itself: every ioctl it takes is decided by the broker (a Python callback
 * into frontends/nativelane.py, which asks broker/fastlane.py's lanes, the same code the
 * Python listener uses), and everything else comes back to the Python listener whole.
 * Two things are decided here by the Python listener's own rules: an open whose path
 * plainly names none of the tenant's nodes (the basename is not one of theirs: CONTINUE,
 * `SeccompSupervisor._open_quick`, with the basenames it was given), and a mapping of a
 * file that can be none of the broker's (not a character device, not a memfd: CONTINUE,
 * `_lookup_stat`'s rule; answer_mmap). And decisions the broker made are repeated here,
 * without asking, while nothing they read has changed: settled controls (struct
 * dvb_settled below), settled continuations and mapping facts (struct dvb_cont_fact).
 *
 * Why each answer stays safe is the Python listener's argument, kept step for step:
 * the header and parameters are read once into this thread's buffers and the driver sees
 * only those (the header's params pointer replaced by the private block's address); the
 * file of a call the loop may run is identified by the broker's own duplicate of the
 * tenant's fd (its dev and inode name the session), taken before anything is decided, and
 * the driver call runs on that duplicate, so the file decided about is the file called; the
 * notification is confirmed pending (NOTIF_ID_VALID) after the last read and dup and
 * before the driver call, and again before anything is written to the tenant. The thread
 * runs without the capabilities the driver checks (dropped by its Python start). Tenant
 * memory is read with process_vm_readv, which can block on a page the tenant controls: the
 * thread publishes when such an access started (`mem_since`), the Python watchdog answers
 * the call with EFAULT past the memory gate's deadline and sets `abandoned`, and the loop
 * reports the late return (DVB_LATE) so the gate's books balance; while the tenant has
 * stalled accesses (`mem_off`) every call goes to the Python listener and its gate.
 *
 * No kernel or libc headers beyond POSIX/glibc are needed: the seccomp structures and
 * ioctl numbers are defined here and checked against the kernel's sizes by the caller.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_send_signal
#define SYS_pidfd_send_signal 424
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif
#define DVB_PIDFD_THREAD O_EXCL /* Linux 6.9: a pidfd for a (non-leader) thread */

/* DVB_ABI, the sizes and codes Python shares, struct dvb_call: generated from
 * native/callabi.py (bump its ABI with any change of the structures below too) */
#include "dvb_call.h"

struct dvb_notif { /* struct seccomp_notif */
    uint64_t id;
    uint32_t pid;
    uint32_t flags;
    int32_t nr;
    uint32_t arch;
    uint64_t ip;
    uint64_t args[6];
};

struct dvb_resp { /* struct seccomp_notif_resp */
    uint64_t id;
    int64_t val;
    int32_t error;
    uint32_t flags;
};
#define DVB_CONTINUE 1 /* SECCOMP_USER_NOTIF_FLAG_CONTINUE */



#define DVB_NAMES_MAX 4096
#define DVB_LANE_CMDS 16
#define DVB_SETTLED_LAYOUTS 8   /* RM_CONTROL and RM_ALLOC header layouts (one per ioctl number) */
#define DVB_SETTLED_CONTROLS 256 /* settled controls: (ABI, ioctl number, control) */
#define DVB_SETTLED_OBJECTS 2048 /* settled objects: (file, client, object) */
#define DVB_SETTLED_CALLERS 1024 /* threads the broker accepted as callers */
#define DVB_CONT_FACTS 512       /* settled continuations: (file, command, client handles) */
#define DVB_CONT_HANDLES 4       /* client-handle fields of one command (UVM: at most 2) */
/* a settled control's embedded buffers in all (ControlLane.EMBEDDED_BYTES) */
#define DVB_EMBED_BYTES (64 << 10)
#define DVB_ANSWERS 8            /* answer facts (struct dvb_answer) */
#define DVB_ESCAPE_FACTS 16      /* settled escapes (struct dvb_escape_fact) */
#define DVB_IDF_MAX 64           /* entries of a settled id filter's lists (the driver's: 32) */
#define DVB_INVALID_GPU_ID 0xFFFFFFFFu
#define DVB_ATTACH_ALL_PROBED 0x0000FFFFu /* NV0000_CTRL_GPU_ATTACH_ALL_PROBED_IDS */


typedef int (*dvb_callback)(int slot);

/*
 * Settled controls (frontends/nativelane.py, "Settled controls"): a plain control the
 * broker admitted — no check of its parameters but, at most, that its one GPU id is the
 * tenant's and its pointers NULL (made here on the private copy: settled_check), no
 * pre-hook, no finish, a post-hook only as a TablePatch — is admitted again here, without
 * the callback, while nothing its decision read has changed. The decision splits in two
 * facts the broker wrote down when it decided:
 *   - the control: in this ABI, with this ioctl number, the tenant may send it with this
 *     parameter size (its row, the tenant's capabilities), and how its answer is patched;
 *   - the object: on this file (dev, inode), this client and object are the tenant's and
 *     on one of its GPUs (the books, the policy), with the patch values for its GPU, and
 *     the file's opener's sandbox (uid, pid namespace: a tag of Python's) that a caller
 *     must share (the session's own check, fastlane._usable_session).
 * A control fact holds for the policy epoch it was decided at; an object fact until the
 * books' removal log names its object, its client or its file, or the policy changes
 * (objects.BooksLog: the policy epoch, the charge epoch, the ring of removals; the loop
 * reads the ring from where it stopped, and forgets every object fact if it fell more than
 * the ring behind); an object's patch values for the charge epoch they were computed at.
 * Facts are written only when nothing they depend on changed while the broker decided
 * (the words read before it decided, dvb_settled_put). The caller is a thread the broker
 * accepted (its thread pidfd, still that thread), the loop thread one
 * that dropped the driver's capabilities, and a token of the tenant's pace taken ahead
 * (`credit`). Everything else is the same run_control as for a decided call.
 */
struct dvb_settled_layout { /* where NVOS54's fields are, for one ioctl number */
    uint32_t ioctl_cmd;      /* (10 × 4 bytes in this order: dvb_settled_layout's argument) */
    int32_t size, client, object, control, params, params_size, status;
    /* An allocation's header (NVOS21/NVOS64; LAYOUT_ALLOC): client is hRoot, object the parent,
     * control the class; its paramsSize may also be 0 (the driver then reads the class's
     * own size); rights: the 8 bytes of its access-rights pointer, which must be 0 (-1:
     * none in this layout). A free's (NVOS00; LAYOUT_FREE): client is hRoot,
     * object hObjectOld; no control, parameters or size (-1), its control fact's control
     * 0 and size 0. kind: LAYOUT_CONTROL, LAYOUT_ALLOC or LAYOUT_FREE. */
    int32_t rights, kind;
};
_Static_assert(sizeof(struct dvb_settled_layout) == 10 * 4, "copied from an int32_t[10]");

struct dvb_settled_control {
    uint64_t epoch;          /* the policy epoch it was decided at; 0: empty */
    uint32_t abi, ioctl_cmd, control, params_size;
    int32_t patched;         /* 1: the answer is patched with the object's values */
    /* its check, when it has one (ControlLane.settleable: a GPU id and NULL pointers) */
    int32_t gpu_id_off, n_null, null_off[DVB_SETTLED_PTRS];
    /* its embedded buffers (fastlane._embedded_only): the pointer at embed_ptr_off names
     * (the u32 at embed_count_off) × embed_elem bytes, read here into the loop's own
     * buffer (settled_embed) as the broker's check would have its front end read them */
    int32_t n_embed, embed_ptr_off[DVB_SETTLED_EMBED], embed_count_off[DVB_SETTLED_EMBED],
            embed_elem[DVB_SETTLED_EMBED];
    /* its post-hook as an id filter (rewrite.IdFilter; idf_count 0: none): the u32 list
     * at idf_ids_off keeps only the tenant's GPU ids, in order, padded with
     * INVALID_GPU_ID, the list at idf_along_off moving with it (-1: none), the list at
     * idf_clear_off all INVALID_GPU_ID (-1: none) */
    int32_t idf_ids_off, idf_count, idf_along_off, idf_clear_off;
    int32_t patch_table_off, patch_entry_size, patch_index_off, patch_data_off,
            patch_capacity, patch_count_off;
    /* its post-hook as an id flag (rewrite.IdFlag; flag_off -1: none): on NV_OK, flag_bit
     * of the u32 at flag_off set when the u32 at flag_id_off (the GPU id its check read)
     * is one of the GPUs the tenant holds a device of (dvb_set_device_ids), else cleared */
    int32_t flag_off, flag_id_off;
    uint32_t flag_bit;
    /* its check as an id list (rewrite.IdListCheck; idl_count 0: none): the u32 list at
     * idl_off, up to its first INVALID_GPU_ID, holds only the tenant's GPU ids, and not
     * ATTACH_ALL_PROBED (which the broker's pre-hook rewrites) */
    int32_t idl_off, idl_count;
    /* the call counters' row of this control (folded by Python: dvb_settled_fold) */
    int64_t ok, err, sum_ns, buckets[DVB_SETTLED_BUCKETS + 1];
};

struct dvb_settled_object {
    uint64_t epoch;          /* the policy epoch it was decided at; 0: empty or forgotten */
    uint64_t sandbox;        /* its session's opener: (uid, pid namespace), as a tag */
    int64_t dev, ino;
    uint32_t client, object, abi;
    uint32_t patch_control;  /* the control the patch values are for (0: none) */
    uint64_t patch_epoch;    /* the charge epoch they hold for */
    int32_t patch_n;
    uint32_t patch_index[DVB_PATCH_MAX], patch_value[DVB_PATCH_MAX];
};

/*
 * Settled continuations: the same idea for the continue lane (broker/continuelane.py), whose
 * decision for a command that names no fd and no object reads only the session (the file,
 * its tenant's policy: node, GPU, the row granted), the caller (accepted, never able to
 * hold CAP_SYS_ADMIN: the callers below are all such threads, see
 * SeccompSupervisor._caller_caps) and the client handles at fixed offsets of the argument
 * (each the tenant's, or 0 where the lane allows it). The fact: on this file, this command
 * is continued when those fields hold these values, for the policy epoch it was decided
 * at; forgotten when the books' ring names its file or one of its clients. The loop reads
 * the handle fields (4 bytes each) into its own buffer and compares them; the kernel then
 * re-reads the whole argument when the tenant's thread runs the call — as after the
 * broker's own decision, and inside the policy for the same reasons (the command's row's
 * `race`, docs/security.md). Written after the tenant has its answer (on_after), the
 * first time the broker continues the call (a UVM command repeats on one file with the
 * same few client handles: 120 UVM calls of the PyTorch trace have 14 keys).
 */
struct dvb_cont_fact {
    uint64_t epoch;          /* the policy epoch it was decided at; 0: empty or forgotten */
    uint64_t sandbox;        /* its session's opener: (uid, pid namespace), as a tag */
    int64_t dev, ino;
    uint32_t kind;           /* DVB_FACT_IOCTL, or DVB_FACT_MMAP: the file may be mapped, or
                                DVB_FACT_FILE: an nvidia-uvm file of the tenant's (one
                                whose mappings stay the broker's to decide) */
    uint32_t cmd, size;      /* the ioctl number; the argument's size (fields lie in it) */
    int32_t n;               /* client-handle fields (0..DVB_CONT_HANDLES) */
    int32_t off[DVB_CONT_HANDLES];
    uint32_t handle[DVB_CONT_HANDLES];
    /* A decision that also reads objects and fds (RM_MAP_MEMORY's: the device and the
     * memory the client's, on GPUs the tenant keeps; the fd one of the tenant's NVIDIA
     * files): the offsets of the client handle and of n_obj object handles, each of which
     * must have an object fact on this file under that client, and of n_fd fds, each -1
     * or naming a file with a mapping fact in the caller's sandbox (a ctl or GPU file of
     * the tenant's). The loop then reads the whole argument privately. */
    int32_t n_obj, obj_client, obj_off[DVB_CONT_OBJECTS];
    int32_t n_fd, fd_off[DVB_CONT_FDS];
    /* its calls since the last fold (the call counters' row: continued) */
    int64_t count, sum_ns, buckets[DVB_SETTLED_BUCKETS + 1];
};

/* A continuation fact for every file of a node (dev DVB_NODE_WIDE, ino the node's rdev):
 * one that reads no object of a file's own (n_obj 0), used for a call on any file with a
 * file fact (DVB_FACT_MMAP or DVB_FACT_FILE) in the fact's sandbox — NVML's UVM commands
 * and CUDA's OS events, each on a file opened just before. */
#define DVB_NODE_WIDE (-1)

/*
 * Answer facts (nativelane.NativeLane.settle_answer): an escape whose whole answer the
 * broker computed from nothing but the tenant's policy and what the driver fixed when it
 * loaded (rules.EscapeRule.answer_kept: CARD_INFO, the host's GPU table cut down to the
 * tenant's GPUs) is answered again here, with the same bytes, for the policy epoch it was
 * computed at: on a file of the tenant's — one with a mapping fact in the caller's
 * sandbox, i.e. a real ctl or GPU file the broker installed for an opener of that sandbox
 * and that is still open (the removal ring forgets it at close) — of the same node (rdev),
 * for a caller in that sandbox, with a token of the tenant's pace. The argument is written,
 * never read: the answer does not depend on it.
 */
struct dvb_answer {
    uint64_t epoch;          /* the policy epoch it was computed at; 0: empty */
    uint64_t sandbox;        /* its files' openers' sandbox (the tenant's), as a tag */
    int64_t rdev;            /* the node it answers on (its char device) */
    uint32_t cmd, size;      /* the ioctl number (its size in it) and the answer's bytes */
    int64_t count, sum_ns, buckets[DVB_SETTLED_BUCKETS + 1]; /* folded: dvb_answer_fold */
    uint8_t data[DVB_ANSWER_MAX];
};
/* A mapping fact (kind DVB_FACT_MMAP, no command, no handles): the broker's
 * map_check_now for a real ctl or GPU file of the tenant's — the session open, the caller
 * in its opener's sandbox; nothing else is checked for those files (the driver checks the
 * mapping context itself) — written when the file is installed; an nvidia-uvm file never
 * has one (its mappings count against the managed-memory allowance, in Python). */

/*
 * A settled escape (nativelane.NativeLane.settle_escape): a plain escape the control lane
 * admitted on its argument alone (fastlane.ControlLane._admit_escape: the row allowed and
 * granted on this node, the session open and the caller in its opener's sandbox, the version
 * asked or the memblock size when the row reads them) — NVML's and CUDA's version check,
 * SYS_PARAMS, WAIT_OPEN_COMPLETE, NUMA_INFO, each on a file opened just before, so a fact
 * per file would never be used twice. The loop admits the same call again when its
 * argument is byte for byte the one decided (what the decision read is in it), on a file
 * of the same node (rdev) that a mapping fact says is the tenant's real ctl or GPU file
 * opened in the caller's sandbox (the session check), for the policy epoch it was decided
 * at; the caller a thread the broker accepted, a token of the tenant's pace. It runs the
 * call on its duplicate of the file with the private copy (or, for an escape the broker
 * answers itself — SYS_PARAMS —, answers the argument as sent and 0). Counted on its
 * control fact (ABI tag 0, the ioctl number, control 0), whose slot it names.
 * An fd escape (REGISTER_FD: NVML twice per init, CUDA 13 times, each naming its ctl file)
 * has one fd field (fd_off), which the argument's match leaves out: the loop takes its own
 * duplicate of the file that fd names in the caller's table, which must have a mapping
 * fact in the caller's sandbox (a real ctl or GPU file of the tenant's: the broker's
 * fd_target test, or stricter), and gives the driver that duplicate — as the decided path
 * does (SeccompSupervisor._native_fds) — the tenant's number back in the answer.
 */
struct dvb_escape_fact {
    uint64_t epoch;          /* the policy epoch it was decided at; 0: empty */
    uint64_t sandbox;        /* its file's opener's sandbox, as a tag */
    int64_t rdev;            /* the node */
    uint32_t cmd, size;      /* the ioctl number, the argument's bytes (its size in it) */
    int32_t answered;        /* 1: the broker's own answer (the argument as sent, 0) */
    int32_t control;         /* the slot of its control fact (its counters) */
    int32_t fd_off;          /* its one fd field (int32), left out of the match; -1: none */
    uint8_t arg[DVB_HDR_MAX];
};

/* The argument matches the fact's, byte for byte but for its fd field. */
static int escape_arg_match(const struct dvb_escape_fact *x, const uint8_t *arg)
{
    if (x->fd_off < 0)
        return !memcmp(x->arg, arg, x->size);
    size_t o = (size_t)x->fd_off;
    return !memcmp(x->arg, arg, o) && !memcmp(x->arg + o + 4, arg + o + 4, x->size - o - 4);
}

struct dvb_settled_caller {
    int64_t tid;             /* 0: empty */
    uint64_t sandbox;        /* its (uid, pid namespace), as a tag */
    int pidfd;               /* a PIDFD_THREAD of it, owned here */
};

/*
 * Prepared opens (SeccompSupervisor._prepare_opens, docs/seccomp.md "Prepared opens"): the
 * broker decides an open of one of the tenant's node paths before it is asked — its
 * policy (the tenant, the node, its GPU, the open-file limit), its session, its driver file
 * through a private node, the inotify watch that ends it, the mapping fact — for the
 * tenant's sandbox, at a quiet moment, and leaves the file here. An open that names that
 * exact absolute path (open or openat, no O_NONBLOCK: the file's status flags are the
 * prepared file's), from a caller the broker accepted in that sandbox (struct
 * dvb_settled_caller, still that thread), while the policy epoch it was decided at
 * stands and a token of the tenant's pace is left, is answered here with the file
 * (SECCOMP_IOCTL_NOTIF_ADDFD with SEND: installed and answered in one step, by the kernel,
 * only while the notification is pending — a racing thread's change of the path after
 * the read changes nothing, the kernel never opens it). The installation is written down
 * (struct dvb_opened) for Python, which books the opener at its next visit, before it
 * decides anything else. A slot whose epoch went stale is never used; Python takes it
 * back (dvb_open_take) and closes its file.
 */
struct dvb_open_slot {
    uint64_t epoch;          /* the policy epoch it was decided at; 0: empty */
    uint64_t sandbox;        /* the tenant's sandbox (uid, pid namespace), as a tag */
    int64_t id;              /* Python's name for it (its session) */
    int fd;                  /* the broker's file, owned here while the slot is full */
    int path_len;
    char path[DVB_OPEN_PATH];
};

struct dvb_opened {          /* a prepared open answered (or given up): for Python */
    int64_t id, tid, newfd;  /* newfd < 0: -errno, the slot's file closed unused */
};

struct dvb_removal { /* objects._Removal: one entry of the books' ring of removals */
    uint64_t seq;
    uint32_t kind, client, object, pad;
    int64_t dev, ino;
};
enum { DVB_REMOVED_OBJECT = 1, DVB_REMOVED_CLIENT, DVB_REMOVED_FILE };

struct dvb_settled {
    pthread_mutex_t lock;
    /* objects.BOOKS: [0] the policy epoch, [1] the charge epoch, [2] removals written,
     * [3] the devices epoch; NULL: settled controls off */
    const volatile uint64_t *epochs;
    const volatile struct dvb_removal *ring;
    uint64_t ring_size, ring_seen;   /* the ring's entries, the last one read */
    int64_t credit;                  /* calls it may still admit (-1: the tenant is unpaced) */
    int64_t alloc_credit;            /* objects settled allocations may still make (the
                                        tenant's limits.rm_objects, less a margin) */
    int64_t unfolded;                /* settled calls counted since the last fold */
    int64_t conts_unfolded;          /* ... settled continuations */
    int64_t bounds[DVB_SETTLED_BUCKETS];
    int n_bounds;
    struct dvb_settled_layout layouts[DVB_SETTLED_LAYOUTS];
    int n_layouts;
    struct dvb_settled_control controls[DVB_SETTLED_CONTROLS];
    struct dvb_settled_object objects[DVB_SETTLED_OBJECTS];
    struct dvb_settled_caller callers[DVB_SETTLED_CALLERS];
    struct dvb_cont_fact conts[DVB_CONT_FACTS];
    struct dvb_answer answers[DVB_ANSWERS];
    struct dvb_escape_fact escapes[DVB_ESCAPE_FACTS];
    int64_t answers_unfolded;
    /* the tenant's GPU ids, as of the policy epoch gpu_ids_epoch (0: none given) */
    uint32_t gpu_ids[DVB_GPU_IDS];
    int n_gpu_ids;
    uint64_t gpu_ids_epoch;
    /* the ids of the GPUs the tenant holds a device object of, as of the books' devices
     * epoch device_ids_epoch (0: none given): an id flag's values */
    uint32_t device_ids[DVB_GPU_IDS];
    int n_device_ids;
    uint64_t device_ids_epoch;
    struct dvb_open_slot open_slots[DVB_OPEN_SLOTS];
    struct dvb_opened opened[DVB_OPEN_SLOTS];
    int n_opened;
};

struct dvb_shared {
    int listener, wake_fd;
    int nr_ioctl, nr_open, nr_openat, nr_openat2, nr_mmap;
    int64_t memfd_dev;       /* memfds' st_dev (a placeholder file is one); -1: not given */
    unsigned long req_recv, req_send, req_id_valid, req_addfd;
    size_t notif_size;
    int64_t spin_ns;
    volatile int mem_off;
    int quiet; /* Python has work for a quiet moment: DVB_QUIET after 1 ms without a call */
    /* Threads between receiving a notification and its answer (in C or in Python): the
     * tenant is waiting for the broker, so it is no quiet moment even when no notification
     * came for 1 ms — a free or an allocation the driver takes ~0.4–0.9 ms over (NVML's
     * subdevice and device) had the quiet work's driver opens run beside it and took
     * ~60–110 µs longer on the H200 (docs/benchmarks.md). */
    int64_t answering;
    /* CLOCK_MONOTONIC ns of the last notification received or answered: a quiet moment is
     * 1 ms after it with none held (a poll that began before a long call times out the
     * moment that call is answered — the tenant's next call is then ~µs away) */
    int64_t last_active;
    uint32_t lane_cmds[DVB_LANE_CMDS];
    int n_lane_cmds;
    char names[DVB_NAMES_MAX]; /* NUL-separated basenames that may be ours */
    size_t names_len;
    dvb_callback on_ioctl, on_check, on_finish, on_after;
    pthread_mutex_t recv_lock;
    /* Calls answered whose books are not written yet (FINISH_AFTER: raised just before
     * the answer is sent, lowered when on_finish returns). Python's decisions on other
     * listener threads wait while it is not 0 (dvb_bookings), so none decides on books
     * that miss an object the tenant already has its answer for. */
    int64_t bookings;
    struct dvb_settled settled;
};

#define DVB_PIDFDS 8

struct dvb_thread {
    struct dvb_shared *sh;
    int slot;
    int last_rc;
    int err;                        /* errno of DVB_ERROR / DVB_WRITE_FAILED */
    volatile int64_t busy_since;    /* CLOCK_MONOTONIC ns while answering in C, else 0 */
    int holds;                      /* 1: counted in sh->answering (a notification taken) */
    volatile int64_t mem_since;     /* ... while reading or writing tenant memory, else 0 */
    volatile int64_t cur_id, cur_pid; /* the notification being answered */
    volatile int abandoned;         /* set by the watchdog: the call was answered EFAULT */
    int64_t late_ns;                /* how long the abandoned access took (DVB_LATE) */
    int64_t spin_until;
    int driver_safe;                /* the thread dropped the driver's capabilities */
    int64_t counters[C_COUNT];
    unsigned char notif[256];       /* the notification handed back (DVB_NOTIF) */
    struct dvb_call call;
    /* a settled control's embedded buffers (settled_admit fills it from the control's
     * fact, answer_ioctl empties it) and the loop's copies of them */
    struct { int32_t n, ptr_off[DVB_SETTLED_EMBED], count_off[DVB_SETTLED_EMBED],
             elem[DVB_SETTLED_EMBED]; } sembed;
    uint8_t embed_buf[DVB_EMBED_BYTES];
    /* a settled control's id filter (settled_admit fills it, with the tenant's GPU ids of
     * the policy epoch it admitted the call in; answer_ioctl empties it) */
    struct { int32_t ids_off, count, along_off, clear_off, n_ids;
             uint32_t ids[DVB_GPU_IDS]; } sidf;
    /* a settled control's id flag (settled_admit fills it, with the GPUs the tenant held
     * a device of when it admitted the call; answer_ioctl empties it; off -1: none) */
    struct { int32_t off, id_off, n_ids; uint32_t bit, ids[DVB_GPU_IDS]; } sflag;
    /* a settled control's id-list check (settled_admit fills it; answer_ioctl empties it) */
    struct { int32_t off, count; } sidl;
    /* pidfds of the tenant threads this thread made driver calls for (thread_pidfd) */
    struct { int64_t tid; int fd; } pidfds[DVB_PIDFDS];
    unsigned pidfd_next;
    /* the broker's duplicate of the file the current ioctl names (answer_ioctl: taken
     * first, its fstat is the file's identity, the driver call runs on it; -1: none) */
    int file_dup;
};

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

int dvb_abi(void) { return DVB_ABI; }
size_t dvb_call_size(void) { return sizeof(struct dvb_call); }
size_t dvb_params_max(void) { return DVB_PARAMS_MAX; }

struct dvb_shared *dvb_shared_new(int listener, int wake_fd, size_t notif_size,
                                  const int *nrs, const unsigned long *reqs, int64_t spin_ns,
                                  dvb_callback on_ioctl, dvb_callback on_check,
                                  dvb_callback on_finish, dvb_callback on_after)
{
    if (notif_size < sizeof(struct dvb_notif) || notif_size > 256)
        return NULL;
    struct dvb_shared *sh = calloc(1, sizeof(*sh));
    if (!sh)
        return NULL;
    sh->listener = listener;
    sh->wake_fd = wake_fd;
    sh->notif_size = notif_size;
    sh->nr_ioctl = nrs[0];
    sh->nr_open = nrs[1];
    sh->nr_openat = nrs[2];
    sh->nr_openat2 = nrs[3];
    sh->nr_mmap = nrs[4];
    sh->memfd_dev = -1;
    sh->req_recv = reqs[0];
    sh->req_send = reqs[1];
    sh->req_id_valid = reqs[2];
    sh->req_addfd = reqs[3];
    sh->spin_ns = spin_ns;
    sh->on_ioctl = on_ioctl;
    sh->on_check = on_check;
    sh->on_finish = on_finish;
    sh->on_after = on_after;
    pthread_mutex_init(&sh->recv_lock, NULL);
    pthread_mutex_init(&sh->settled.lock, NULL);
    for (int i = 0; i < DVB_SETTLED_CALLERS; i++)
        sh->settled.callers[i].pidfd = -1;
    for (int i = 0; i < DVB_OPEN_SLOTS; i++)
        sh->settled.open_slots[i].fd = -1;
    return sh;
}

void dvb_shared_free(struct dvb_shared *sh)
{
    if (sh) {
        for (int i = 0; i < DVB_SETTLED_CALLERS; i++)
            if (sh->settled.callers[i].pidfd >= 0)
                close(sh->settled.callers[i].pidfd);
        for (int i = 0; i < DVB_OPEN_SLOTS; i++) /* (Python takes them back first) */
            if (sh->settled.open_slots[i].fd >= 0)
                close(sh->settled.open_slots[i].fd);
        pthread_mutex_destroy(&sh->settled.lock);
        pthread_mutex_destroy(&sh->recv_lock);
        free(sh);
    }
}

int dvb_set_names(struct dvb_shared *sh, const char *names, size_t len)
{
    if (len > DVB_NAMES_MAX)
        return -1;
    memcpy(sh->names, names, len);
    sh->names_len = len;
    return 0;
}

int dvb_set_lane_cmds(struct dvb_shared *sh, const uint32_t *cmds, int n)
{
    if (n < 0 || n > DVB_LANE_CMDS)
        return -1;
    memcpy(sh->lane_cmds, cmds, sizeof(uint32_t) * n);
    sh->n_lane_cmds = n;
    return 0;
}

void dvb_set_mem_off(struct dvb_shared *sh, int off) { sh->mem_off = off; }

/* For file mappings: the memfds' device (a placeholder session's file is a memfd, a real
 * one a character device: the only files the Python listener's _lookup_stat can find a
 * session behind). Until given, every mapping goes to the Python listener. */
void dvb_set_memfd_dev(struct dvb_shared *sh, int64_t dev)
{
    __atomic_store_n(&sh->memfd_dev, dev, __ATOMIC_RELEASE);
}
void dvb_set_quiet(struct dvb_shared *sh) { __atomic_store_n(&sh->quiet, 1, __ATOMIC_RELEASE); }
int64_t dvb_bookings(struct dvb_shared *sh) { return __atomic_load_n(&sh->bookings, __ATOMIC_ACQUIRE); }

struct dvb_thread *dvb_thread_new(struct dvb_shared *sh, int slot)
{
    struct dvb_thread *t = calloc(1, sizeof(*t));
    if (t) {
        t->sh = sh;
        t->slot = slot;
        for (int k = 0; k < DVB_PIDFDS; k++)
            t->pidfds[k].fd = -1;
    }
    return t;
}

static void answered_all(struct dvb_thread *t)
{
    if (t->holds) {
        __atomic_store_n(&t->sh->last_active, now_ns(), __ATOMIC_RELEASE);
        __atomic_sub_fetch(&t->sh->answering, 1, __ATOMIC_ACQ_REL);
        t->holds = 0;
    }
}

void dvb_thread_free(struct dvb_thread *t)
{
    if (!t)
        return;
    answered_all(t);
    for (int k = 0; k < DVB_PIDFDS; k++)
        if (t->pidfds[k].fd >= 0)
            close(t->pidfds[k].fd);
    free(t);
}
void dvb_thread_driver_safe(struct dvb_thread *t, int safe) { t->driver_safe = safe; }
struct dvb_call *dvb_call_of(struct dvb_thread *t) { return &t->call; }
unsigned char *dvb_notif_of(struct dvb_thread *t) { return t->notif; }
int dvb_err(struct dvb_thread *t) { return t->err; }
int64_t dvb_late_ns(struct dvb_thread *t) { return t->late_ns; }

/* Copy the counters out and zero them (the owning thread only). */
void dvb_fold(struct dvb_thread *t, int64_t *out)
{
    memcpy(out, t->counters, sizeof(t->counters));
    memset(t->counters, 0, sizeof(t->counters));
}

/* For the watchdog (another thread): busy_since, mem_since, cur_id, cur_pid. */
void dvb_watch(struct dvb_thread *t, int64_t *out)
{
    out[0] = t->busy_since;
    out[1] = t->mem_since;
    out[2] = t->cur_id;
    out[3] = t->cur_pid;
}

void dvb_abandon(struct dvb_thread *t) { t->abandoned = 1; }

/* ---------------------------------------------------------------- the listener's calls */

/* The broker's own duplicate of fd `fd` of tenant thread `tid` (pidfd_getfd), or -1.
 * Through a pidfd of that thread this listener thread keeps (one of DVB_PIDFDS, the oldest
 * replaced): a CUDA process makes hundreds of driver calls from a few threads, and a
 * pidfd_open + close per call were two of the loop's system calls per executed call. A
 * pidfd names one task for its life and is this thread's alone (no other thread can close
 * it or see its number reused meanwhile). When the task it names has exited, pidfd_getfd
 * fails with ESRCH, even if a new thread now has the number `tid`: then a fresh pidfd is
 * opened for the thread that made this call (pending in its notification, so alive). */
static int tenant_fd_dup(struct dvb_thread *t, int64_t tid, int fd)
{
    int k = 0;
    while (k < DVB_PIDFDS && !(t->pidfds[k].fd >= 0 && t->pidfds[k].tid == tid))
        k++;
    if (k < DVB_PIDFDS) {
        int dup = (int)syscall(SYS_pidfd_getfd, t->pidfds[k].fd, fd, 0);
        if (dup >= 0 || errno != ESRCH)
            return dup;
        close(t->pidfds[k].fd); /* that task is gone: the number is another thread's now */
        t->pidfds[k].fd = -1;
    } else {
        k = (int)(t->pidfd_next++ % DVB_PIDFDS);
        if (t->pidfds[k].fd >= 0)
            close(t->pidfds[k].fd);
        t->pidfds[k].fd = -1;
    }
    int pidfd = (int)syscall(SYS_pidfd_open, (pid_t)tid, DVB_PIDFD_THREAD);
    if (pidfd < 0)
        return -1;
    t->pidfds[k].tid = tid;
    t->pidfds[k].fd = pidfd;
    return (int)syscall(SYS_pidfd_getfd, pidfd, fd, 0);
}

static int id_valid(struct dvb_shared *sh, uint64_t id)
{
    return ioctl(sh->listener, sh->req_id_valid, &id) == 0;
}

static void send_resp(struct dvb_thread *t, uint64_t id, int64_t val, int error, int cont)
{
    /* error: a positive errno here, negative to the kernel (the syscall's -1/errno) */
    struct dvb_resp r = {.id = id, .val = val, .error = -error,
                         .flags = cont ? DVB_CONTINUE : 0};
    int64_t t0 = now_ns();
    if (ioctl(t->sh->listener, t->sh->req_send, &r) < 0)
        t->counters[C_STALE]++; /* ENOENT: the task died or was interrupted, or answered */
    t->counters[C_NS_SEND] += now_ns() - t0;
    t->counters[C_ANSWERED]++;
}

/* Tenant memory: one process_vm_readv/writev, published for the watchdog (mem_since).
 * Returns the bytes moved or -1 (errno). */
static ssize_t tenant_rw(struct dvb_thread *t, pid_t pid, int write, struct iovec *l,
                         struct iovec *r, unsigned long n)
{
    t->mem_since = now_ns();
    ssize_t got = write ? process_vm_writev(pid, l, n, r, n, 0)
                        : process_vm_readv(pid, l, n, r, n, 0);
    int e = errno;
    if (t->abandoned)
        t->late_ns = now_ns() - t->mem_since;
    t->mem_since = 0;
    errno = e;
    return got;
}

static ssize_t tenant_read(struct dvb_thread *t, pid_t pid, uint64_t addr, void *buf,
                           size_t len)
{
    struct iovec l = {buf, len}, r = {(void *)(uintptr_t)addr, len};
    return tenant_rw(t, pid, 0, &l, &r, 1);
}

static ssize_t tenant_write2(struct dvb_thread *t, pid_t pid, uint64_t a1, void *b1,
                             size_t n1, uint64_t a2, void *b2, size_t n2)
{
    struct iovec l[2] = {{b1, n1}, {b2, n2}};
    struct iovec r[2] = {{(void *)(uintptr_t)a1, n1}, {(void *)(uintptr_t)a2, n2}};
    return tenant_rw(t, pid, 1, l, r, 2);
}

/* ------------------------------------------------------------------------- answers */
/* Each returns 0 (answered here, or the task is gone), DVB_NOTIF (the Python listener
 * answers it), or another DVB_ code for the loop to return. */

static int answer_prepared_open(struct dvb_thread *t, struct dvb_notif *n, const char *path,
                                size_t len, int64_t t0);

/* A token of the tenant's pace for a notification the loop answers itself without the
 * broker (an open of another file, an mmap): every notification costs the broker's CPU, so
 * each is charged, from the credit Python took ahead of the tenant's bucket (-1: unpaced).
 * 0: none left, the Python listener answers it and waits for the pace there. */
static int take_pace(struct dvb_settled *m)
{
    int ok = 1;
    pthread_mutex_lock(&m->lock);
    if (!m->credit)
        ok = 0;
    else if (m->credit > 0)
        m->credit--;
    pthread_mutex_unlock(&m->lock);
    return ok;
}

static int answer_open(struct dvb_thread *t, struct dvb_notif *n)
{
    struct dvb_shared *sh = t->sh;
    int64_t t0 = now_ns();
    uint64_t ptr = n->nr == sh->nr_open ? n->args[0] : n->args[1];
    long page = sysconf(_SC_PAGESIZE);
    size_t len = page - ptr % page;
    char buf[257];
    if (sh->mem_off)
        return DVB_NOTIF;
    if (len > 256)
        len = 256;
    t->call.path_len = 0;
    ssize_t got = tenant_read(t, n->pid, ptr, buf, len);
    if (t->abandoned)
        return DVB_LATE;
    if (got <= 0)
        return DVB_NOTIF;
    char *end = memchr(buf, 0, got);
    if (!end)
        return DVB_NOTIF; /* long or unterminated: the general steps read the whole path */
    char *slash = memrchr(buf, '/', end - buf);
    const char *base = slash ? slash + 1 : buf;
    size_t blen = end - base;
    for (size_t i = 0; i < sh->names_len;) {
        size_t l = strlen(sh->names + i);
        if (l == blen && memcmp(sh->names + i, base, l) == 0) {
            /* may be one of our nodes: a prepared open, else the Python listener decides,
             * on this copy */
            int rc = answer_prepared_open(t, n, buf, end - buf, t0);
            if (rc != DVB_NOTIF)
                return rc;
            struct dvb_call *c = &t->call;
            c->id = (int64_t)n->id;
            c->path_len = end - buf + 1;
            memcpy(c->hdr, buf, (size_t)c->path_len);
            return DVB_NOTIF;
        }
        i += l + 1;
    }
    if (!take_pace(&sh->settled)) {
        struct dvb_call *c = &t->call; /* (the path read whole: Python reads no more) */
        c->id = (int64_t)n->id;
        c->path_len = end - buf + 1;
        memcpy(c->hdr, buf, (size_t)c->path_len);
        return DVB_NOTIF;
    }
    send_resp(t, n->id, 0, 0, 1);
    t->counters[C_OPENS_CONTINUED]++;
    t->counters[C_NS_OPEN] += now_ns() - t0;
    return 0;
}

static int lane_cmd(struct dvb_shared *sh, uint32_t cmd)
{
    for (int i = 0; i < sh->n_lane_cmds; i++)
        if (sh->lane_cmds[i] == cmd)
            return 1;
    return 0;
}

/* rewrite.TablePatch.apply on the private parameter block (bounds checked against it) */
static void apply_patch(struct dvb_call *c, size_t size)
{
    uint32_t count, index;
    if (c->patch_n <= 0 || c->patch_n > DVB_PATCH_MAX || c->patch_count_off < 0
        || (size_t)c->patch_count_off + 4 > size)
        return;
    memcpy(&count, c->params + c->patch_count_off, 4);
    if (count > (uint64_t)c->patch_capacity)
        count = (uint32_t)c->patch_capacity;
    for (uint32_t i = 0; i < count; i++) {
        size_t base = (size_t)c->patch_table_off + (size_t)i * (size_t)c->patch_entry_size;
        if (base + (size_t)c->patch_index_off + 4 > size || base + (size_t)c->patch_data_off + 4 > size)
            return;
        memcpy(&index, c->params + base + c->patch_index_off, 4);
        for (int k = 0; k < c->patch_n; k++)
            if (c->patch_index[k] == index) {
                memcpy(c->params + base + c->patch_data_off, &c->patch_value[k], 4);
                break;
            }
    }
}

static int run_control_once(struct dvb_thread *t, struct dvb_notif *n, int64_t t0,
                            int64_t t1, int64_t t2);
static void apply_id_filter(struct dvb_thread *t, size_t size);
static void apply_id_flag(struct dvb_thread *t, size_t size);
static void settled_count(struct dvb_thread *t, int64_t ns);
static int settled_check(struct dvb_shared *sh, const struct dvb_call *c, size_t size);
static int settled_list_check(struct dvb_shared *sh, const struct dvb_thread *t, size_t size);

/* An admitted call (run_control_once), then the fd duplicates its check gave the loop
 * closed, on every way out. */
static int run_control(struct dvb_thread *t, struct dvb_notif *n, int64_t t0, int64_t t1,
                       int64_t t2)
{
    int rc = run_control_once(t, n, t0, t1, t2);
    struct dvb_call *c = &t->call;
    for (int k = 0; k < c->fd_n && k < DVB_FD_MAX; k++)
        if (c->fd_dup[k] >= 0)
            close((int)c->fd_dup[k]);
    c->fd_n = 0;
    return rc;
}

/* FINISH_AFTER: the broker's books for a call the driver ran (an allocation's new object,
 * a free's removal, the quota the call held), written once the tenant has its answer: the
 * tenant's next instructions run meanwhile (a CUDA init spends ~300 µs of its own between
 * two NVIDIA calls on average). The count of such bookings is raised before the answer is
 * sent, so a decision on another listener thread about the tenant's next call waits for
 * them (nativelane: `SeccompSupervisor._await_bookings`); what the loop decides by itself
 * meanwhile cannot name the new object (no fact names an object before the broker booked
 * it) and a fact of a freed one sends its call to the driver, which refuses it (docs/
 * security.md). Nothing is written to the tenant here. */
static void finish_after(struct dvb_thread *t)
{
    int64_t t0 = now_ns();
    t->sh->on_finish(t->slot); /* (a failure was logged there: books only, no answer) */
    t->counters[C_LANE_NS_FINISH] += now_ns() - t0;
    t->counters[C_FINISHED_AFTER]++;
}

static void answer_then_book(struct dvb_thread *t, uint64_t id, int64_t val, int error)
{
    struct dvb_call *c = &t->call;
    if (c->finish != FINISH_AFTER) {
        send_resp(t, id, val, error, 0);
        return;
    }
    __atomic_add_fetch(&t->sh->bookings, 1, __ATOMIC_ACQ_REL);
    send_resp(t, id, val, error, 0);
    finish_after(t);
    __atomic_sub_fetch(&t->sh->bookings, 1, __ATOMIC_ACQ_REL);
}

/* A call with FINISH_AFTER that the loop does not answer itself (stale, a failed or stalled
 * write-back, whose answer comes from the Python listener or the watchdog): its books now,
 * before the loop returns, as they were written before the answer. */
static int book_now(struct dvb_thread *t, int rc)
{
    if (t->call.finish == FINISH_AFTER)
        finish_after(t);
    return rc;
}

/* A settled control's post-hook as an id filter (rewrite.IdFilter.apply_block, the same
 * steps): on the private parameter block the driver answered NV_OK in, the GPU-id list
 * keeps the tenant's ids (t->sidf.ids, the policy epoch's) in the driver's order, padded
 * with INVALID_GPU_ID; the list along it moves with its ids (emptied slots 0); the list
 * to clear reads all INVALID_GPU_ID. (Offsets within the block: dvb_settled_put.) */
static void apply_id_filter(struct dvb_thread *t, size_t size)
{
    struct dvb_call *c = &t->call;
    int32_t n = t->sidf.count;
    uint32_t ids[DVB_IDF_MAX], along[DVB_IDF_MAX], kept_ids[DVB_IDF_MAX], kept_along[DVB_IDF_MAX];
    if (n <= 0 || n > DVB_IDF_MAX || t->sidf.ids_off < 0
        || (size_t)t->sidf.ids_off + 4 * (size_t)n > size
        || (t->sidf.along_off >= 0 && (size_t)t->sidf.along_off + 4 * (size_t)n > size)
        || (t->sidf.clear_off >= 0 && (size_t)t->sidf.clear_off + 4 * (size_t)n > size))
        return;
    memcpy(ids, c->params + t->sidf.ids_off, 4 * (size_t)n);
    if (t->sidf.along_off >= 0)
        memcpy(along, c->params + t->sidf.along_off, 4 * (size_t)n);
    int kept = 0;
    for (int i = 0; i < n; i++) {
        int mine = 0;
        for (int k = 0; k < t->sidf.n_ids && !mine; k++)
            mine = t->sidf.ids[k] == ids[i];
        if (!mine)
            continue;
        kept_ids[kept] = ids[i];
        kept_along[kept] = t->sidf.along_off >= 0 ? along[i] : 0;
        kept++;
    }
    for (int i = kept; i < n; i++) {
        kept_ids[i] = DVB_INVALID_GPU_ID;
        kept_along[i] = 0;
    }
    memcpy(c->params + t->sidf.ids_off, kept_ids, 4 * (size_t)n);
    if (t->sidf.along_off >= 0)
        memcpy(c->params + t->sidf.along_off, kept_along, 4 * (size_t)n);
    if (t->sidf.clear_off >= 0)
        for (int i = 0; i < n; i++)
            memcpy(c->params + t->sidf.clear_off + 4 * i, &(uint32_t){DVB_INVALID_GPU_ID}, 4);
}

/* A settled control's post-hook as an id flag (rewrite.IdFlag.apply_block, the same steps):
 * on the private parameter block the driver answered NV_OK in, the flag bit of the u32 at
 * t->sflag.off is set when the block's GPU id is one the tenant held a device of at
 * admission (t->sflag.ids, the books' devices epoch then), and cleared otherwise — what
 * the tenant alone would see (GET_ID_INFO's IN_USE: rewrite.id_info_in_use). */
static void apply_id_flag(struct dvb_thread *t, size_t size)
{
    struct dvb_call *c = &t->call;
    if (t->sflag.off < 0 || t->sflag.id_off < 0 || (size_t)t->sflag.off + 4 > size
        || (size_t)t->sflag.id_off + 4 > size)
        return;
    uint32_t flags, id;
    int held = 0;
    memcpy(&flags, c->params + t->sflag.off, 4);
    memcpy(&id, c->params + t->sflag.id_off, 4);
    for (int k = 0; k < t->sflag.n_ids && k < DVB_GPU_IDS && !held; k++)
        held = t->sflag.ids[k] == id;
    flags = held ? (flags | t->sflag.bit) : (flags & ~t->sflag.bit);
    memcpy(c->params + t->sflag.off, &flags, 4);
}

/* A settled control's embedded buffers, sized from the private parameters as the broker's
 * check sizes them (handlers.embedded_buffers: count × element bytes; a NULL pointer stays
 * NULL for the driver and names no buffer): each read once from the tenant into the
 * loop's own buffer, whose address replaces the tenant's pointer in the private block the
 * driver gets; run_control_once puts the tenant's pointers back after the driver call and
 * writes the copies back on NV_OK, as for a checked control's (c->embed_*). 0: more than
 * DVB_EMBED_BYTES in all, or a read that fell short (the general way reads again and
 * answers, with its refusal for an absurd size). */
static int settled_embed(struct dvb_thread *t, struct dvb_notif *n, size_t size)
{
    struct dvb_call *c = &t->call;
    size_t used = 0;
    c->embed_n = 0;
    for (int k = 0; k < t->sembed.n && k < DVB_SETTLED_EMBED; k++) {
        int32_t po = t->sembed.ptr_off[k], co = t->sembed.count_off[k];
        if (po < 0 || (size_t)po + 8 > size || co < 0 || (size_t)co + 4 > size)
            return 0;
        uint64_t ptr, len;
        uint32_t count;
        memcpy(&ptr, c->params + po, 8);
        memcpy(&count, c->params + co, 4);
        if (!ptr)
            continue;
        len = (uint64_t)count * (uint64_t)(uint32_t)t->sembed.elem[k];
        used = (used + 7) & ~(size_t)7;
        if (len > DVB_EMBED_BYTES - used)
            return 0;
        uint8_t *copy = t->embed_buf + used;
        if (len && tenant_read(t, n->pid, ptr, copy, (size_t)len) != (ssize_t)len)
            return 0;
        int i = (int)c->embed_n++;
        uint64_t addr = (uint64_t)(uintptr_t)copy;
        c->embed_off[i] = po;
        c->embed_ptr[i] = (int64_t)ptr;
        c->embed_addr[i] = (int64_t)addr;
        c->embed_len[i] = (int64_t)len;
        memcpy(c->params + po, &addr, 8);
        used += (size_t)len;
    }
    return 1;
}

static int run_control_once(struct dvb_thread *t, struct dvb_notif *n, int64_t t0,
                            int64_t t1, int64_t t2)
{
    struct dvb_shared *sh = t->sh;
    struct dvb_call *c = &t->call;
    size_t size = (size_t)c->params_size, hlen = (size_t)c->hdr_len;
    int dup = -1;
    if (size > DVB_PARAMS_MAX || sh->mem_off
        || (size && (c->params_off < 0 || (size_t)c->params_off + 8 > hlen)))
        return DVB_NOTIF;
    if (size && !c->params_read) { /* (none: the header alone, or read by on_ioctl) */
        ssize_t got = tenant_read(t, n->pid, (uint64_t)c->params_ptr, c->params, size);
        if (t->abandoned)
            return DVB_LATE;
        if (got != (ssize_t)size)
            return DVB_NOTIF; /* the general path reads again and answers with its record */
        memcpy(c->params_in, c->params, size);
    }
    if ((c->gpu_id_off >= 0 || c->n_null) && !settled_check(sh, c, size))
        return DVB_NOTIF; /* the broker's general way decides it (and refuses it there) */
    if (c->settled >= 0 && t->sidl.count && !settled_list_check(sh, t, size))
        return DVB_NOTIF; /* (the same: a GPU not the tenant's, or "all probed") */
    if (c->settled >= 0 && t->sembed.n) {
        int r = settled_embed(t, n, size);
        if (t->abandoned)
            return DVB_LATE;
        if (!r)
            return DVB_NOTIF; /* (too large, or unreadable: the general way reads again) */
    }
    if (c->check) {
        /* A checked control: the broker decides on this private copy (client handles, GPU
         * ids, the row's pre-hook, which may rewrite c->params in place) before anything
         * runs; a decline sends the whole call the general way, which reads again. */
        int act = sh->on_check(t->slot);
        if (act == ACT_FAIL) {
            send_resp(t, n->id, 0, EIO, 0);
            return 0;
        }
        if (act != ACT_CONTROL)
            return DVB_NOTIF;
        if (c->embed_n > DVB_EMBED_MAX)
            return DVB_NOTIF;
        for (int k = 0; k < c->embed_n; k++)
            if (c->embed_off[k] < 0 || (size_t)c->embed_off[k] + 8 > size || !c->driver)
                return DVB_NOTIF; /* (the check's promise, held here too) */
        if (c->fd_n > DVB_FD_MAX)
            return DVB_NOTIF;
        for (int k = 0; k < c->fd_n; k++)
            if (c->fd_off[k] < 0 || (size_t)c->fd_off[k] + 4 > hlen || !c->driver)
                return DVB_NOTIF;
    }
    int64_t t3 = now_ns();
    if (c->driver) {
        /* The broker's own duplicate of the tenant's file, taken through the calling
         * thread's pidfd before anything was decided (answer_ioctl: every call with a
         * header read has one): the file the decision is about, whatever the tenant's fd
         * number names now. */
        dup = t->file_dup;
        if (dup < 0)
            return DVB_NOTIF;
    }
    /* The reads and the dup reached the thread that made the call. */
    if (!id_valid(sh, n->id)) {
        t->counters[C_STALE]++;
        return 0;
    }
    int64_t t4 = now_ns();
    if (c->driver) {
        uint8_t priv[DVB_HDR_MAX];
        uint64_t block = (uint64_t)(uintptr_t)c->params;
        memcpy(priv, c->hdr, hlen);
        if (size)
            memcpy(priv + c->params_off, &block, 8);
        int r = ioctl(dup, (unsigned long)(uint32_t)c->cmd, priv);
        c->err = r < 0 ? errno : 0;
        c->ret = r < 0 ? -1 : r;
        if (size) /* the tenant's pointer */
            memcpy(priv + c->params_off, c->hdr + c->params_off, 8);
        memcpy(c->hdr_out, priv, hlen);
    }
    for (int k = 0; k < c->embed_n && k < DVB_EMBED_MAX; k++) /* the tenant's pointers */
        memcpy(c->params + c->embed_off[k], &c->embed_ptr[k], 8);
    for (int k = 0; c->driver && k < c->fd_n && k < DVB_FD_MAX; k++) { /* its fd numbers */
        int32_t orig = (int32_t)c->fd_orig[k];
        memcpy(c->hdr_out + c->fd_off[k], &orig, 4);
    }
    int64_t t5 = now_ns();
    if (c->finish == FINISH_AFTER && !c->driver)
        c->finish = FINISH_BEFORE; /* (on_finish runs the call itself: before the answer) */
    if (c->settled >= 0 && !c->driver) {
        /* a settled escape the broker answers itself (SYS_PARAMS): the argument as sent
         * (the private copy the fact matched), 0 — its `finish`, without the callback */
        c->ret = c->err = 0;
        memcpy(c->hdr_out, c->hdr, hlen);
    } else if (!c->driver || c->finish == FINISH_BEFORE) {
        int fin = sh->on_finish(t->slot); /* run (emulated) and/or books and post-hook */
        if (fin == 0)
            return DVB_NOTIF; /* the backend could not run it here: the general way */
        if (fin < 0) {
            send_resp(t, n->id, 0, EIO, 0); /* a bug costs this call, not the listener */
            return 0;
        }
    }
    if (t->sidf.count && c->settled >= 0 && !c->err && c->status_off >= 0
        && (size_t)c->status_off + 4 <= hlen) {
        uint32_t status;
        memcpy(&status, c->hdr_out + c->status_off, 4);
        if (status == 0) /* NV_OK: the post-hook's filter of the answer */
            apply_id_filter(t, size);
    }
    if (t->sflag.off >= 0 && c->settled >= 0 && !c->err && c->status_off >= 0
        && (size_t)c->status_off + 4 <= hlen) {
        uint32_t status;
        memcpy(&status, c->hdr_out + c->status_off, 4);
        if (status == 0) /* NV_OK: the post-hook's flag */
            apply_id_flag(t, size);
    }
    if (c->patch_n && !c->err && c->status_off >= 0 && (size_t)c->status_off + 4 <= hlen) {
        uint32_t status;
        memcpy(&status, c->hdr_out + c->status_off, 4);
        if (status == 0) /* NV_OK: the post-hook's rewrite of the answer */
            apply_patch(c, size);
    }
    if (c->settled >= 0) { /* its control's row (folded by Python) */
        settled_count(t, now_ns() - t1);
    } else if (!c->finish) { /* the call's row, recorded by Python at its next visit */
        c->done_err = c->err;
        c->done_ns = now_ns();
        c->done_count++;
    }
    int64_t t6 = now_ns();
    t->counters[C_IOCTLS]++;
    t->counters[C_CONTROLS_FAST]++;
    t->counters[C_LANE_NS_READ] += (t1 - t0) + (t3 - t2);
    t->counters[C_LANE_NS_ADMIT] += t2 - t1;
    t->counters[C_LANE_NS_DUP] += t4 - t3;
    t->counters[C_LANE_NS_DRIVER] += t5 - t4;
    t->counters[C_LANE_NS_FINISH] += t6 - t5;
    if (c->err) { /* the driver's failure: the tenant's buffers stay as they were */
        answer_then_book(t, n->id, 0, (int)c->err);
        return 0;
    }
    if (!id_valid(sh, n->id)) {
        t->counters[C_STALE]++;
        return book_now(t, 0);
    }
    if (c->embed_n) {
        uint32_t status = 1;
        if (c->status_off >= 0 && (size_t)c->status_off + 4 <= hlen)
            memcpy(&status, c->hdr_out + c->status_off, 4);
        for (int k = 0; status == 0 && k < c->embed_n && k < DVB_EMBED_MAX; k++) {
            struct iovec l = {(void *)(uintptr_t)c->embed_addr[k], (size_t)c->embed_len[k]};
            struct iovec r = {(void *)(uintptr_t)c->embed_ptr[k], (size_t)c->embed_len[k]};
            ssize_t w = tenant_rw(t, n->pid, 1, &l, &r, 1);
            if (t->abandoned)
                return book_now(t, DVB_LATE);
            if (w != (ssize_t)c->embed_len[k]) {
                t->err = errno ? errno : EFAULT;
                return book_now(t, DVB_WRITE_FAILED);
            }
        }
    }
    ssize_t put = size ? tenant_write2(t, n->pid, (uint64_t)c->params_ptr, c->params, size,
                                       (uint64_t)c->argp, c->hdr_out, hlen)
                       : tenant_write2(t, n->pid, (uint64_t)c->argp, c->hdr_out, hlen, 0, NULL, 0);
    if (t->abandoned)
        return book_now(t, DVB_LATE);
    if (put != (ssize_t)(size + hlen)) {
        t->err = errno ? errno : EFAULT;
        return book_now(t, DVB_WRITE_FAILED); /* the Python listener audits it, answers EFAULT */
    }
    t->counters[C_LANE_NS_WRITE] += now_ns() - t6;
    answer_then_book(t, n->id, c->ret, 0);
    if (c->after)
        sh->on_after(t->slot); /* (the tenant runs on meanwhile) */
    return 0;
}

/* ----------------------------------------------------------------- settled controls */
/* (struct dvb_settled says what they are and why a hit is the broker's own decision.) */

#define SETTLED_PROBE 8 /* slots looked at from a key's home slot */

static uint64_t mix64(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    return x ^ (x >> 33);
}

static uint64_t epoch_now(const struct dvb_settled *m, int k)
{
    return __atomic_load_n(&m->epochs[k], __ATOMIC_ACQUIRE);
}

/* Turn settled controls on: the books' words and ring of removals (objects.BooksLog) and
 * the bounds of the call counters' latency buckets (ns). */
int dvb_settled_start(struct dvb_shared *sh, const uint64_t *epochs,
                      const struct dvb_removal *ring, uint64_t ring_size,
                      const int64_t *bounds, int n_bounds)
{
    struct dvb_settled *m = &sh->settled;
    if (n_bounds < 0 || n_bounds > DVB_SETTLED_BUCKETS || !ring_size)
        return -1;
    pthread_mutex_lock(&m->lock);
    memcpy(m->bounds, bounds, sizeof(int64_t) * n_bounds);
    m->n_bounds = n_bounds;
    m->ring = ring;
    m->ring_size = ring_size;
    m->ring_seen = __atomic_load_n(&epochs[2], __ATOMIC_ACQUIRE);
    m->epochs = epochs;
    pthread_mutex_unlock(&m->lock);
    return 0;
}

/* Where NVOS54's fields are for one RM_CONTROL ioctl number (one per driver layout). */
int dvb_settled_layout(struct dvb_shared *sh, const int32_t *f /* ioctl, size, client,
                       object, control, params, params_size, status, rights, kind */)
{
    struct dvb_settled *m = &sh->settled;
    int rc = -1;
    if (f[1] <= 0 || f[1] > DVB_HDR_MAX
        || (f[9] != LAYOUT_CONTROL && f[9] != LAYOUT_ALLOC && f[9] != LAYOUT_FREE))
        return -1;
    for (int k = 2; k < 8; k++) {
        if (f[9] == LAYOUT_FREE && k >= 4 && k <= 6) { /* (no control, parameters, size) */
            if (f[k] != -1)
                return -1;
            continue;
        }
        if (f[k] < 0 || f[k] + (k == 5 ? 8 : 4) > f[1])
            return -1;
    }
    if (f[8] < -1 || f[8] + 8 > f[1] || (f[8] >= 0 && f[9] != LAYOUT_ALLOC))
        return -1;
    pthread_mutex_lock(&m->lock);
    for (int i = 0; i < m->n_layouts; i++)
        if (m->layouts[i].ioctl_cmd == (uint32_t)f[0]) { /* two ABIs that disagree: none */
            rc = memcmp(&m->layouts[i], f, sizeof(m->layouts[i])) ? -1 : 0;
            goto out;
        }
    if (m->n_layouts < DVB_SETTLED_LAYOUTS) {
        memcpy(&m->layouts[m->n_layouts++], f, sizeof(m->layouts[0]));
        rc = 0;
    }
out:
    pthread_mutex_unlock(&m->lock);
    return rc;
}

static const struct dvb_settled_layout *settled_layout(const struct dvb_settled *m,
                                                        uint32_t ioctl_cmd)
{
    for (int i = 0; i < m->n_layouts; i++)
        if (m->layouts[i].ioctl_cmd == ioctl_cmd)
            return &m->layouts[i];
    return NULL;
}

/* The control a call's control fact is keyed by: the header's (an allocation's class);
 * a free's is 0 (its layout has no such field). */
static uint32_t layout_control(const struct dvb_settled_layout *l, const uint8_t *hdr)
{
    uint32_t control = 0;
    if (l->kind != LAYOUT_FREE)
        memcpy(&control, hdr + l->control, 4);
    return control;
}

static uint64_t control_home(uint32_t abi, uint32_t ioctl_cmd, uint32_t control)
{
    return mix64(((uint64_t)abi << 32 | ioctl_cmd) ^ mix64(control));
}

/* (by client and object alone: a removal names those, not the file) */
static uint64_t object_home(uint32_t client, uint32_t object)
{
    return mix64((uint64_t)client << 32 | object);
}

static struct dvb_settled_control *find_control(struct dvb_settled *m, uint64_t epoch,
                                                uint32_t abi, uint32_t ioctl_cmd,
                                                uint32_t control)
{
    uint64_t h = control_home(abi, ioctl_cmd, control);
    for (int k = 0; k < SETTLED_PROBE; k++) {
        struct dvb_settled_control *e = &m->controls[(h + k) % DVB_SETTLED_CONTROLS];
        if (e->epoch == epoch && e->abi == abi && e->ioctl_cmd == ioctl_cmd
            && e->control == control)
            return e;
    }
    return NULL;
}

static struct dvb_settled_object *find_object(struct dvb_settled *m, uint64_t epoch,
                                              int64_t dev, int64_t ino, uint32_t client,
                                              uint32_t object)
{
    uint64_t h = object_home(client, object);
    for (int k = 0; k < SETTLED_PROBE; k++) {
        struct dvb_settled_object *e = &m->objects[(h + k) % DVB_SETTLED_OBJECTS];
        if (e->epoch == epoch && e->dev == dev && e->ino == ino && e->client == client
            && e->object == object)
            return e;
    }
    return NULL;
}

/* Forget the object facts a removal names (kind, and client/object or dev/inode). */
static void forget(struct dvb_settled *m, uint32_t kind, uint32_t client, uint32_t object,
                   int64_t dev, int64_t ino)
{
    if (kind != DVB_REMOVED_OBJECT) /* (continuations name no object) */
        for (int i = 0; i < DVB_CONT_FACTS; i++) {
            struct dvb_cont_fact *e = &m->conts[i];
            int hit = kind == DVB_REMOVED_FILE && e->dev == dev && e->ino == ino;
            for (int k = 0; kind == DVB_REMOVED_CLIENT && k < e->n && k < DVB_CONT_HANDLES; k++)
                hit |= e->handle[k] == client;
            if (hit)
                e->epoch = 0;
        }
    if (kind == DVB_REMOVED_OBJECT) {
        uint64_t h = object_home(client, object);
        for (int k = 0; k < SETTLED_PROBE; k++) {
            struct dvb_settled_object *e = &m->objects[(h + k) % DVB_SETTLED_OBJECTS];
            if (e->client == client && e->object == object)
                e->epoch = 0;
        }
        return;
    }
    for (int i = 0; i < DVB_SETTLED_OBJECTS; i++) {
        struct dvb_settled_object *e = &m->objects[i];
        if (kind == DVB_REMOVED_CLIENT ? e->client == client
                                       : (e->dev == dev && e->ino == ino))
            e->epoch = 0;
    }
}

/* Read the books' ring of removals from where this table stopped (under m->lock): each
 * names the facts it makes stale; a ring this table fell behind by more than its size, or
 * an entry rewritten while read, forgets every object and continuation fact. */
static void catch_up(struct dvb_settled *m)
{
    uint64_t head = __atomic_load_n(&m->epochs[2], __ATOMIC_ACQUIRE);
    if (head == m->ring_seen)
        return;
    int lost = head - m->ring_seen > m->ring_size;
    for (uint64_t seq = m->ring_seen + 1; !lost && seq <= head; seq++) {
        const volatile struct dvb_removal *r = &m->ring[seq % m->ring_size];
        uint64_t s1 = __atomic_load_n(&r->seq, __ATOMIC_ACQUIRE);
        uint32_t kind = r->kind, client = r->client, object = r->object;
        int64_t dev = r->dev, ino = r->ino;
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        if (s1 != seq || r->seq != seq) {
            lost = 1;
            break;
        }
        forget(m, kind, client, object, dev, ino);
    }
    if (lost) {
        for (int i = 0; i < DVB_SETTLED_OBJECTS; i++)
            m->objects[i].epoch = 0;
        for (int i = 0; i < DVB_CONT_FACTS; i++)
            m->conts[i].epoch = 0;
    }
    m->ring_seen = head;
}

/* The sandbox tag of a thread the broker accepted, while it is still that thread (its
 * pidfd: a thread that ended fails the signal 0, and a new thread with the number has
 * another pidfd); 0 for any other. */
static uint64_t caller_sandbox(struct dvb_settled *m, int64_t tid)
{
    for (int k = 0; k < SETTLED_PROBE; k++) {
        struct dvb_settled_caller *e = &m->callers[(mix64((uint64_t)tid) + k)
                                                   % DVB_SETTLED_CALLERS];
        if (e->tid == tid)
            return syscall(SYS_pidfd_send_signal, e->pidfd, 0, NULL, 0) == 0 ? e->sandbox : 0;
    }
    return 0;
}

/* The slot to write a key into: the matching one, else the first empty or stale one,
 * else the home slot (the oldest fact loses); one pass over the probe window. */
#define PICK_SLOT(table, n, home, match, stale)                                          \
    ({                                                                                   \
        int _pick = -1, _free = -1;                                                      \
        for (int k = 0; k < SETTLED_PROBE && _pick < 0; k++) {                           \
            int i = (int)(((home) + k) % (n));                                           \
            __typeof__(&(table)[0]) e = &(table)[i];                                     \
            if (match)                                                                   \
                _pick = i;                                                               \
            else if (_free < 0 && (stale))                                               \
                _free = i;                                                               \
        }                                                                                \
        _pick >= 0 ? _pick : _free >= 0 ? _free : (int)((home) % (n));                  \
    })

/* Put the caller's thread pidfd (owned here from now on) and sandbox tag (under m->lock). */
static void caller_put(struct dvb_settled *m, int64_t tid, int pidfd, uint64_t sandbox)
{
    int ki = PICK_SLOT(m->callers, DVB_SETTLED_CALLERS, mix64((uint64_t)tid),
                       e->tid == tid, !e->tid);
    struct dvb_settled_caller *k = &m->callers[ki];
    if (k->pidfd >= 0)
        close(k->pidfd);
    k->tid = tid;
    k->pidfd = pidfd;
    k->sandbox = sandbox;
}

/* A fact writer's refusal of a bad value: the caller's pidfd (owned by the writer) closed,
 * nothing written. */
static int refuse_put(int pidfd)
{
    if (pidfd >= 0)
        close(pidfd);
    return -1;
}

/* For the fact writers: take the table's lock and read the books' ring, unless settled
 * facts are off or what the broker read before deciding has moved since — the policy
 * epoch (every fact), and with `no_removals` any removal too; then nothing is written: the
 * lock is not held, the caller's pidfd is closed, and -1 is returned. */
static int put_begin(struct dvb_settled *m, const uint64_t *epochs, int no_removals,
                     int pidfd, uint64_t *now)
{
    pthread_mutex_lock(&m->lock);
    if (m->epochs) {
        catch_up(m);
        *now = epoch_now(m, 0);
        if (epochs[0] == *now && (!no_removals || epochs[2] == m->ring_seen))
            return 0;
    }
    pthread_mutex_unlock(&m->lock);
    if (pidfd >= 0)
        close(pidfd);
    return -1;
}

/* The object fact obj (dev, ino, client, object, ABI tag, the session's sandbox tag) for the
 * policy epoch now, in its slot (under m->lock); the patch values kept only when the slot
 * held this very fact already. */
static struct dvb_settled_object *object_fact_put(struct dvb_settled *m, uint64_t now,
                                                  const int64_t *obj)
{
    int64_t dev = obj[0], ino = obj[1];
    uint32_t client = (uint32_t)obj[2], object = (uint32_t)obj[3];
    int oi = PICK_SLOT(m->objects, DVB_SETTLED_OBJECTS, object_home(client, object),
                       e->dev == dev && e->ino == ino && e->client == client
                           && e->object == object && e->epoch,
                       e->epoch != now);
    struct dvb_settled_object *o = &m->objects[oi];
    if (!(o->epoch == now && o->dev == dev && o->ino == ino && o->client == client
          && o->object == object))
        o->patch_control = 0; /* a new fact: no patch values yet */
    o->epoch = now;
    o->dev = dev;
    o->ino = ino;
    o->client = client;
    o->object = object;
    o->abi = (uint32_t)obj[4];
    o->sandbox = (uint64_t)obj[5];
    return o;
}

/* The control fact (abi, ioctl number, control) for the policy epoch now, in its slot (under
 * m->lock): its counters kept when the slot held this very control, else the counters of
 * another control it held go to evicted (3 + buckets; evicted[0] its slot) for Python to
 * record. The caller fills in the decision. */
static struct dvb_settled_control *control_fact_put(struct dvb_settled *m, uint64_t now,
                                                    uint32_t abi, uint32_t ioctl_cmd,
                                                    uint32_t control, int64_t *evicted)
{
    int ci = PICK_SLOT(m->controls, DVB_SETTLED_CONTROLS, control_home(abi, ioctl_cmd, control),
                       e->abi == abi && e->ioctl_cmd == ioctl_cmd && e->control == control
                           && e->epoch,
                       e->epoch != now);
    struct dvb_settled_control *c = &m->controls[ci];
    if (c->epoch && !(c->abi == abi && c->ioctl_cmd == ioctl_cmd && c->control == control)) {
        evicted[0] = ci; /* another control's row: Python records what it counted */
        evicted[1] = c->ok;
        evicted[2] = c->err;
        evicted[3] = c->sum_ns;
        memcpy(evicted + 4, c->buckets, sizeof(c->buckets));
        c->ok = c->err = c->sum_ns = 0;
        memset(c->buckets, 0, sizeof(c->buckets));
    } else if (!c->epoch) {
        c->ok = c->err = c->sum_ns = 0;
        memset(c->buckets, 0, sizeof(c->buckets));
    }
    c->epoch = now;
    c->abi = abi;
    c->ioctl_cmd = ioctl_cmd;
    c->control = control;
    return c;
}

/*
 * The broker settled a control (nativelane.NativeLane.settle): write down its two facts
 * and its caller. obj: dev, ino, client, object, abi, the session's sandbox tag, the
 * caller's sandbox tag; ctl: abi, ioctl number, control,
 * parameter size, patched, the TablePatch layout (6 values, when patched), and its check
 * (the GPU id's offset or -1, the NULL pointers' count and two offsets), its embedded
 * buffers (count, three values each for two), its id filter (4 values) and its id flag
 * (the flags' offset or -1, the GPU id's offset — its check's — and the bit); patch_n
 * values (index, value) for the object's GPU; epochs: the policy epoch, the charge epoch
 * and the removals written, read before the broker decided (a change since: nothing is
 * written, but for the control fact when only removals came); pidfd: a thread pidfd of the caller, owned here from now
 * on (-1: none). evicted (3 + buckets): the counters of a control whose slot this one
 * takes (evicted[0] its slot, -1 for none), for Python to record. Returns the control's
 * slot, or -1 when the facts were not written (settled controls off, a bad value).
 */
int dvb_settled_put(struct dvb_shared *sh, const uint64_t *epochs, const int64_t *obj,
                    const int64_t *ctl, int patch_n, const uint32_t *patch_index,
                    const uint32_t *patch_value, int64_t tid, int pidfd, int64_t *evicted)
{
    struct dvb_settled *m = &sh->settled;
    int slot = -1;
    evicted[0] = -1;
    if (patch_n < 0 || patch_n > DVB_PATCH_MAX || (ctl[4] && !patch_n)
        || ctl[11] < -1 || (ctl[11] >= 0 && ctl[11] + 4 > ctl[3])
        || ctl[12] < 0 || ctl[12] > DVB_SETTLED_PTRS
        || (ctl[12] > 0 && (ctl[13] < 0 || ctl[13] + 8 > ctl[3]))
        || (ctl[12] > 1 && (ctl[14] < 0 || ctl[14] + 8 > ctl[3]))
        || ctl[15] < 0 || ctl[15] > DVB_SETTLED_EMBED || (ctl[15] && ctl[4])
        || (ctl[15] > 0 && (ctl[16] < 0 || ctl[16] + 8 > ctl[3] || ctl[17] < 0
                            || ctl[17] + 4 > ctl[3] || ctl[18] < 1 || ctl[18] > DVB_EMBED_BYTES))
        || (ctl[15] > 1 && (ctl[19] < 0 || ctl[19] + 8 > ctl[3] || ctl[20] < 0
                            || ctl[20] + 4 > ctl[3] || ctl[21] < 1 || ctl[21] > DVB_EMBED_BYTES))
        || ctl[23] < 0 || ctl[23] > DVB_IDF_MAX
        || (ctl[23] > 0 && (ctl[4] || ctl[15] || ctl[22] < 0 || ctl[22] + 4 * ctl[23] > ctl[3]
                            || ctl[24] < -1 || ctl[24] + 4 * ctl[23] > ctl[3]
                            || ctl[25] < -1 || ctl[25] + 4 * ctl[23] > ctl[3]))
        || ctl[26] < -1 || (ctl[26] >= 0 && ctl[26] + 4 > ctl[3])
        || (ctl[26] >= 0 && (ctl[4] || ctl[23] || ctl[27] != ctl[11] || ctl[27] < 0
                             || ctl[28] <= 0 || ctl[28] > 0xFFFFFFFFLL))
        || ctl[30] < 0 || ctl[30] > DVB_IDF_MAX
        || (ctl[30] > 0 && (ctl[29] < 0 || ctl[29] + 4 * ctl[30] > ctl[3] || ctl[11] >= 0
                            || ctl[23] || ctl[26] >= 0 || ctl[4] || ctl[15])))
        return refuse_put(pidfd);
    uint64_t now;
    if (put_begin(m, epochs, 0, pidfd, &now) < 0) /* (a removal: no object fact, below) */
        return -1;
    /* the object: only if nothing was removed while the broker decided */
    uint32_t control = (uint32_t)ctl[2];
    if (epochs[2] == m->ring_seen) {
        struct dvb_settled_object *o = object_fact_put(m, now, obj);
        if (patch_n) {
            o->patch_control = control;
            o->patch_epoch = epochs[1];
            o->patch_n = patch_n;
            memcpy(o->patch_index, patch_index, sizeof(uint32_t) * patch_n);
            memcpy(o->patch_value, patch_value, sizeof(uint32_t) * patch_n);
        }
    }
    /* the caller */
    if (pidfd >= 0)
        caller_put(m, tid, pidfd, (uint64_t)obj[6]);
    /* the control */
    struct dvb_settled_control *c = control_fact_put(m, now, (uint32_t)ctl[0],
                                                     (uint32_t)ctl[1], control, evicted);
    int ci = (int)(c - m->controls);
    c->params_size = (uint32_t)ctl[3];
    c->patched = (int32_t)ctl[4];
    c->gpu_id_off = (int32_t)ctl[11];
    c->n_null = (int32_t)ctl[12];
    c->null_off[0] = (int32_t)ctl[13];
    c->null_off[1] = (int32_t)ctl[14];
    c->n_embed = (int32_t)ctl[15];
    for (int k = 0; k < DVB_SETTLED_EMBED; k++) {
        c->embed_ptr_off[k] = (int32_t)ctl[16 + 3 * k];
        c->embed_count_off[k] = (int32_t)ctl[17 + 3 * k];
        c->embed_elem[k] = (int32_t)ctl[18 + 3 * k];
    }
    c->idf_ids_off = (int32_t)ctl[22];
    c->idf_count = (int32_t)ctl[23];
    c->idf_along_off = (int32_t)ctl[24];
    c->idf_clear_off = (int32_t)ctl[25];
    c->flag_off = (int32_t)ctl[26];
    c->flag_id_off = (int32_t)ctl[27];
    c->flag_bit = (uint32_t)ctl[28];
    c->idl_off = (int32_t)ctl[29];
    c->idl_count = (int32_t)ctl[30];
    if (c->patched) {
        c->patch_table_off = (int32_t)ctl[5];
        c->patch_entry_size = (int32_t)ctl[6];
        c->patch_index_off = (int32_t)ctl[7];
        c->patch_data_off = (int32_t)ctl[8];
        c->patch_capacity = (int32_t)ctl[9];
        c->patch_count_off = (int32_t)ctl[10];
    }
    slot = ci;
    pthread_mutex_unlock(&m->lock);
    return slot;
}

/* Tokens of the tenant's pace taken ahead for settled calls (unpaced: no count). */
void dvb_settled_credit(struct dvb_shared *sh, int64_t n, int unpaced)
{
    struct dvb_settled *m = &sh->settled;
    pthread_mutex_lock(&m->lock);
    if (unpaced)
        m->credit = -1;
    else
        m->credit = (m->credit < 0 ? 0 : m->credit) + n;
    pthread_mutex_unlock(&m->lock);
}

/* Objects the loop's settled allocations may still make before the broker looks again
 * (SeccompSupervisor._alloc_credit: the tenant's limits.rm_objects less what its books
 * hold and a margin, refreshed at each allocation it books). */
void dvb_settled_alloc_credit(struct dvb_shared *sh, int64_t n)
{
    struct dvb_settled *m = &sh->settled;
    pthread_mutex_lock(&m->lock);
    m->alloc_credit = n < 0 ? 0 : n;
    pthread_mutex_unlock(&m->lock);
}

/*
 * An object fact written when the broker books a new object (an allocation it admitted or
 * a settled one): on this file, this client and object are the tenant's, on one of its GPUs
 * (the parent's, which the admission checked against the policy), and the opener's sandbox
 * — what a control fact's decision reads of the object, true of a new object as of the
 * epochs read before it was booked (nothing is written if a removal came since: the parent
 * may be gone). Controls and allocations on it are then settled from their first call when
 * their control fact stands (CUDA's channels: each gets its copy engine object, engine id
 * and work-submit token once). obj: dev, ino, client, object, abi, the session's sandbox
 * tag; patch_n values (index, value) of the control patch_control's TablePatch for the
 * object's GPU, as of the charge epoch patch_epoch (0: none). Returns 0, or -1 when not
 * written.
 */
int dvb_settled_object_put(struct dvb_shared *sh, const uint64_t *epochs, const int64_t *obj,
                           uint32_t patch_control, uint64_t patch_epoch, int patch_n,
                           const uint32_t *patch_index, const uint32_t *patch_value)
{
    struct dvb_settled *m = &sh->settled;
    uint64_t now;
    if (patch_n < 0 || patch_n > DVB_PATCH_MAX || (patch_n && !patch_control))
        return -1;
    if (put_begin(m, epochs, 1, -1, &now) < 0)
        return -1;
    struct dvb_settled_object *o = object_fact_put(m, now, obj);
    if (patch_n) { /* (a subdevice's: FB_GET_INFO_V2's quota view, as of patch_epoch) */
        o->patch_control = patch_control;
        o->patch_epoch = patch_epoch;
        o->patch_n = patch_n;
        memcpy(o->patch_index, patch_index, sizeof(uint32_t) * (size_t)patch_n);
        memcpy(o->patch_value, patch_value, sizeof(uint32_t) * (size_t)patch_n);
    }
    pthread_mutex_unlock(&m->lock);
    return 0;
}

int64_t dvb_settled_credit_left(struct dvb_shared *sh)
{
    pthread_mutex_lock(&sh->settled.lock);
    int64_t n = sh->settled.credit;
    pthread_mutex_unlock(&sh->settled.lock);
    return n;
}

/* The call counters' rows of settled calls since the last fold: up to max rows of
 * (slot, ok, err, sum_ns, buckets...), each zeroed here; returns the rows written. */
int dvb_settled_fold(struct dvb_shared *sh, int64_t *out, int max)
{
    struct dvb_settled *m = &sh->settled;
    int rows = 0, width = 4 + DVB_SETTLED_BUCKETS + 1;
    if (!__atomic_load_n(&m->unfolded, __ATOMIC_RELAXED))
        return 0; /* (nothing counted: no lock, no scan) */
    pthread_mutex_lock(&m->lock);
    m->unfolded = 0;
    for (int i = 0; i < DVB_SETTLED_CONTROLS; i++) {
        struct dvb_settled_control *c = &m->controls[i];
        if (!c->ok && !c->err)
            continue;
        if (rows == max) {
            m->unfolded = 1; /* more than fit: the next fold goes on */
            break;
        }
        int64_t *row = out + (size_t)rows++ * width;
        row[0] = i;
        row[1] = c->ok;
        row[2] = c->err;
        row[3] = c->sum_ns;
        memcpy(row + 4, c->buckets, sizeof(c->buckets));
        c->ok = c->err = c->sum_ns = 0;
        memset(c->buckets, 0, sizeof(c->buckets));
    }
    pthread_mutex_unlock(&m->lock);
    return rows;
}

/* The tenant's GPU ids for settled controls' GPU-id checks, as of the policy epoch the
 * caller read before computing them (a later epoch: none, until given again). */
static int set_ids(struct dvb_settled *m, uint32_t *dst, int *n_dst, uint64_t *epoch_dst,
                   uint64_t epoch, const uint32_t *ids, int n)
{
    if (n < 0 || n > DVB_GPU_IDS)
        return -1;
    pthread_mutex_lock(&m->lock);
    memcpy(dst, ids, sizeof(uint32_t) * (size_t)n);
    *n_dst = n;
    *epoch_dst = epoch;
    pthread_mutex_unlock(&m->lock);
    return 0;
}

int dvb_set_gpu_ids(struct dvb_shared *sh, uint64_t epoch, const uint32_t *ids, int n)
{
    struct dvb_settled *m = &sh->settled;
    return set_ids(m, m->gpu_ids, &m->n_gpu_ids, &m->gpu_ids_epoch, epoch, ids, n);
}

/* The GPUs the tenant holds a device object of, for settled id flags, as of the books'
 * devices epoch the caller read with them (under the broker's state lock): used while
 * that epoch is the books' (epochs[3]). */
int dvb_set_device_ids(struct dvb_shared *sh, uint64_t epoch, const uint32_t *ids, int n)
{
    struct dvb_settled *m = &sh->settled;
    return set_ids(m, m->device_ids, &m->n_device_ids, &m->device_ids_epoch, epoch, ids, n);
}

/* A settled control's check on the private parameters (ControlLane.check for a control
 * whose check reads only these): the pointers NULL, the GPU id one of the tenant's (as of
 * the current policy epoch). 0: the broker decides the call (it refuses it, with its
 * record, or finds the facts stale). */
static int settled_check(struct dvb_shared *sh, const struct dvb_call *c, size_t size)
{
    struct dvb_settled *m = &sh->settled;
    uint64_t zero = 0, p;
    for (int k = 0; k < c->n_null && k < DVB_SETTLED_PTRS; k++) {
        if (c->null_off[k] < 0 || (size_t)c->null_off[k] + 8 > size)
            return 0;
        memcpy(&p, c->params + c->null_off[k], 8);
        if (p != zero)
            return 0;
    }
    if (c->gpu_id_off < 0)
        return 1;
    if ((size_t)c->gpu_id_off + 4 > size)
        return 0;
    uint32_t id;
    int ok = 0;
    memcpy(&id, c->params + c->gpu_id_off, 4);
    pthread_mutex_lock(&m->lock);
    if (m->epochs && m->gpu_ids_epoch == epoch_now(m, 0))
        for (int k = 0; k < m->n_gpu_ids && !ok; k++)
            ok = m->gpu_ids[k] == id;
    pthread_mutex_unlock(&m->lock);
    return ok;
}

/* A settled control's id-list check on the private parameters (rewrite.IdListCheck, the
 * check restrict_attach_ids makes: ATTACH_IDS, DETACH_IDS): the list read up to its first
 * INVALID_GPU_ID (the driver reads no further) holds only the tenant's GPU ids (as of the
 * current policy epoch) and not ATTACH_ALL_PROBED, which the broker's pre-hook rewrites to
 * the tenant's ids. 0: the broker decides the call (it refuses a GPU not the tenant's,
 * with its record, or rewrites "all probed"). */
static int settled_list_check(struct dvb_shared *sh, const struct dvb_thread *t, size_t size)
{
    struct dvb_settled *m = &sh->settled;
    const struct dvb_call *c = &t->call;
    int32_t off = t->sidl.off, n = t->sidl.count;
    if (off < 0 || n <= 0 || n > DVB_IDF_MAX || (size_t)off + 4 * (size_t)n > size)
        return 0;
    int ok = 1;
    pthread_mutex_lock(&m->lock);
    if (!m->epochs || m->gpu_ids_epoch != epoch_now(m, 0) || !m->n_gpu_ids)
        ok = 0;
    for (int i = 0; i < n && ok; i++) {
        uint32_t id;
        memcpy(&id, c->params + off + 4 * i, 4);
        if (id == DVB_INVALID_GPU_ID)
            break;
        int mine = 0;
        for (int k = 0; k < m->n_gpu_ids && !mine; k++)
            mine = m->gpu_ids[k] == id;
        ok = mine && id != DVB_ATTACH_ALL_PROBED;
    }
    pthread_mutex_unlock(&m->lock);
    return ok;
}

/* A control lane ioctl whose header the loop read: admitted here when both of its facts
 * are settled for the current epoch (fills the call as on_ioctl would: driver call here,
 * no check, no finish, the patch if any); 0 leaves it to the callback. */
static int settled_admit(struct dvb_thread *t)
{
    struct dvb_settled *m = &t->sh->settled;
    struct dvb_call *c = &t->call;
    int ok = 0;
    if (!m->epochs || !t->driver_safe || !c->hdr_len)
        return 0;
    pthread_mutex_lock(&m->lock);
    const struct dvb_settled_layout *l = settled_layout(m, (uint32_t)c->cmd);
    if (!l || l->size != c->hdr_len)
        goto out;
    uint32_t client, object, control = layout_control(l, c->hdr), params_size = 0;
    uint64_t params = 0;
    int is_free = l->kind == LAYOUT_FREE;
    memcpy(&client, c->hdr + l->client, 4);
    memcpy(&object, c->hdr + l->object, 4);
    if (!is_free) {
        memcpy(&params, c->hdr + l->params, 8);
        memcpy(&params_size, c->hdr + l->params_size, 4);
    }
    catch_up(m);
    uint64_t now = epoch_now(m, 0);
    /* (a free: the object to free is the tenant's — the root client itself included —
     * while its fact stands; a removal from the books takes the fact with it) */
    struct dvb_settled_object *o = find_object(m, now, c->dev, c->ino, client, object);
    if (!o)
        goto out;
    struct dvb_settled_control *e = find_control(m, now, o->abi, (uint32_t)c->cmd, control);
    if (!e || (!params && !is_free) || e->params_size > DVB_PARAMS_MAX
        || (is_free && e->params_size)
        || (e->params_size != params_size
            && !(l->kind == LAYOUT_ALLOC && params_size == 0)))
        goto out;
    if (l->kind == LAYOUT_ALLOC) {
        /* An allocation settled (nativelane.NativeLane.settle, ControlLane.settleable): no
         * access rights asked for, an object of the tenant's allowance left; the driver
         * refuses a handle that exists in the client itself (NV_ERR_INSERT_DUPLICATE_NAME,
         * the general path's answer too), and the broker books the new object after the
         * answer (FINISH_AFTER), before it decides anything else. */
        uint64_t rights = 0;
        if (l->rights >= 0)
            memcpy(&rights, c->hdr + l->rights, 8);
        if (rights || m->alloc_credit <= 0)
            goto out;
    }
    if (e->patched && (o->patch_control != control || o->patch_epoch != epoch_now(m, 1)))
        goto out; /* its patch values are for another control, or memory changed since */
    if (e->idf_count && (m->gpu_ids_epoch != now || !m->n_gpu_ids))
        goto out; /* (the tenant's GPU ids as of this epoch: the filter's values) */
    if (e->flag_off >= 0
        && (!m->device_ids_epoch || m->device_ids_epoch != epoch_now(m, 3)
            || __atomic_load_n(&t->sh->bookings, __ATOMIC_ACQUIRE)))
        goto out; /* (the flag's values: the GPUs the tenant holds a device of now — not
                   * while a device may be on its way into or out of the books, or since
                   * the loop's copy of them) */
    if (!m->credit || !o->sandbox || caller_sandbox(m, c->tid) != o->sandbox)
        goto out; /* (the session's own check: the caller in the opener's sandbox) */
    if (m->credit > 0)
        m->credit--;
    if (l->kind == LAYOUT_ALLOC)
        m->alloc_credit--;
    c->params_ptr = (int64_t)params;
    c->params_size = e->params_size; /* (an allocation's 0: the class's size, read here) */
    c->params_off = l->params;       /* (a free's -1: the header alone) */
    c->status_off = l->status;
    c->driver = 1;
    c->check = 0;
    /* an allocation's new object, a free's removal: into the books after the answer */
    c->finish = l->kind != LAYOUT_CONTROL ? FINISH_AFTER : FINISH_NONE;
    c->gpu_id_off = e->gpu_id_off;
    c->n_null = e->n_null;
    for (int k = 0; k < DVB_SETTLED_PTRS; k++)
        c->null_off[k] = e->null_off[k];
    t->sidf.count = e->idf_count;
    if (e->idf_count) {
        t->sidf.ids_off = e->idf_ids_off;
        t->sidf.along_off = e->idf_along_off;
        t->sidf.clear_off = e->idf_clear_off;
        t->sidf.n_ids = m->n_gpu_ids;
        memcpy(t->sidf.ids, m->gpu_ids, sizeof(uint32_t) * (size_t)m->n_gpu_ids);
    }
    t->sidl.off = e->idl_off;
    t->sidl.count = e->idl_count;
    t->sflag.off = e->flag_off;
    if (e->flag_off >= 0) {
        t->sflag.id_off = e->flag_id_off;
        t->sflag.bit = e->flag_bit;
        t->sflag.n_ids = m->n_device_ids;
        memcpy(t->sflag.ids, m->device_ids, sizeof(uint32_t) * (size_t)m->n_device_ids);
    }
    t->sembed.n = e->n_embed;
    for (int k = 0; k < DVB_SETTLED_EMBED; k++) {
        t->sembed.ptr_off[k] = e->embed_ptr_off[k];
        t->sembed.count_off[k] = e->embed_count_off[k];
        t->sembed.elem[k] = e->embed_elem[k];
    }
    c->patch_n = 0;
    if (e->patched) {
        c->patch_table_off = e->patch_table_off;
        c->patch_entry_size = e->patch_entry_size;
        c->patch_index_off = e->patch_index_off;
        c->patch_data_off = e->patch_data_off;
        c->patch_capacity = e->patch_capacity;
        c->patch_count_off = e->patch_count_off;
        memcpy(c->patch_index, o->patch_index, sizeof(uint32_t) * o->patch_n);
        memcpy(c->patch_value, o->patch_value, sizeof(uint32_t) * o->patch_n);
        c->patch_n = o->patch_n;
    }
    c->settled = e - m->controls;
    ok = 1;
out:
    pthread_mutex_unlock(&m->lock);
    return ok;
}

/* The call counters' latency bucket of a call that took ns (callstats._BOUNDS_NS). */
static int bucket_of(const struct dvb_settled *m, int64_t ns)
{
    int b = 0;
    while (b < m->n_bounds && m->bounds[b] < ns)
        b++;
    return b;
}

/* A settled call's row in its control's counters (the slot still that control's). */
static void settled_count(struct dvb_thread *t, int64_t ns)
{
    struct dvb_settled *m = &t->sh->settled;
    struct dvb_call *c = &t->call;
    const struct dvb_settled_layout *l;
    pthread_mutex_lock(&m->lock);
    struct dvb_settled_control *e = &m->controls[c->settled % DVB_SETTLED_CONTROLS];
    l = settled_layout(m, (uint32_t)c->cmd);
    if (e->ioctl_cmd == (uint32_t)c->cmd
        && (l ? e->control == layout_control(l, c->hdr)
              : (e->abi == 0 && e->control == 0))) { /* (a settled escape's: no layout) */
        int b = bucket_of(m, ns);
        if (c->err)
            e->err++;
        else
            e->ok++;
        e->sum_ns += ns;
        e->buckets[b]++;
        m->unfolded++;
    }
    pthread_mutex_unlock(&m->lock);
}

/* ------------------------------------------------------------ settled continuations */
/* (struct dvb_cont_fact says what they are and why a hit is the broker's own decision.) */

static uint64_t cont_home(int64_t dev, int64_t ino, uint32_t cmd)
{
    return mix64((uint64_t)dev ^ mix64((uint64_t)ino ^ ((uint64_t)cmd << 40)));
}

/* A fact's counts as one row for Python (slot, calls, 0, sum_ns, buckets...), taken: the
 * fact's counters start again from zero (under m->lock). */
static void fact_take(struct dvb_cont_fact *e, int slot, int64_t *row)
{
    row[0] = slot;
    row[1] = e->count;
    row[2] = 0;
    row[3] = e->sum_ns;
    memcpy(row + 4, e->buckets, sizeof(e->buckets));
    e->count = e->sum_ns = 0;
    memset(e->buckets, 0, sizeof(e->buckets));
}

/*
 * The broker continued a call whose decision a continuation fact can hold
 * (nativelane.NativeLane.settle_continue), or installed a file it lets the tenant map
 * (settle_mmap): f = dev, ino, cmd, argument size, the opener's sandbox tag, the caller's
 * sandbox tag, kind, n, then n offsets and n handle values (as the broker read and checked
 * them; none for a mapping); epochs as for dvb_settled_put (read before it decided:
 * a change since, of the policy or a removal, and nothing is written). evicted (3 +
 * buckets): the counts of a fact whose slot this one takes (evicted[0] its slot, -1 for
 * none). Returns the fact's slot, or -1 when nothing was written.
 */
int dvb_continue_put(struct dvb_shared *sh, const uint64_t *epochs, const int64_t *f,
                     int64_t tid, int pidfd, int64_t *evicted)
{
    struct dvb_settled *m = &sh->settled;
    int n = (int)f[7], slot = -1;
    uint32_t kind = (uint32_t)f[6];
    evicted[0] = -1;
    if (n < 0 || n > DVB_CONT_HANDLES || f[3] < 0 || f[3] > (1 << 14) || !f[4]
        || (kind != DVB_FACT_IOCTL && kind != DVB_FACT_MMAP && kind != DVB_FACT_FILE)
        || (kind != DVB_FACT_IOCTL && (n || f[2] || f[3] || f[0] == DVB_NODE_WIDE)))
        return refuse_put(pidfd);
    for (int k = 0; k < n; k++)
        if (f[8 + k] < 0 || f[8 + k] + 4 > f[3])
            return refuse_put(pidfd);
    /* then: n_obj, the client's offset, DVB_CONT_OBJECTS object offsets, n_fd, DVB_CONT_FDS
     * fd offsets */
    const int64_t *x = f + 8 + 2 * n;
    int n_obj = (int)x[0], n_fd = (int)x[2 + DVB_CONT_OBJECTS];
    int bad = n_obj < 0 || n_obj > DVB_CONT_OBJECTS || n_fd < 0 || n_fd > DVB_CONT_FDS
              || ((n_obj || n_fd) && (kind != DVB_FACT_IOCTL || f[3] > DVB_CONT_ARG))
              || (n_obj && (x[1] < 0 || x[1] + 4 > f[3]))
              || (n_obj && f[0] == DVB_NODE_WIDE); /* (objects are a file's own) */
    for (int k = 0; k < n_obj && !bad; k++)
        bad = x[2 + k] < 0 || x[2 + k] + 4 > f[3];
    for (int k = 0; k < n_fd && !bad; k++)
        bad = x[3 + DVB_CONT_OBJECTS + k] < 0 || x[3 + DVB_CONT_OBJECTS + k] + 4 > f[3];
    if (bad)
        return refuse_put(pidfd);
    uint64_t now;
    if (put_begin(m, epochs, 1, pidfd, &now) < 0)
        return -1;
    int64_t dev = f[0], ino = f[1];
    uint32_t cmd = (uint32_t)f[2], handle[DVB_CONT_HANDLES] = {0};
    for (int k = 0; k < n; k++)
        handle[k] = (uint32_t)f[8 + n + k];
    int i = PICK_SLOT(m->conts, DVB_CONT_FACTS, cont_home(dev, ino, cmd),
                      e->epoch && e->dev == dev && e->ino == ino && e->kind == kind
                          && e->cmd == cmd && e->n == n
                          && !memcmp(e->handle, handle, sizeof(handle)),
                      e->epoch != now);
    struct dvb_cont_fact *e = &m->conts[i];
    if (e->count && !(e->dev == dev && e->ino == ino && e->kind == kind && e->cmd == cmd
                      && e->n == n && !memcmp(e->handle, handle, sizeof(handle)))) {
        fact_take(e, i, evicted); /* another fact's calls: Python records them */
    }
    e->epoch = now;
    e->sandbox = (uint64_t)f[4];
    e->dev = dev;
    e->ino = ino;
    e->kind = kind;
    e->cmd = cmd;
    e->size = (uint32_t)f[3];
    e->n = n;
    for (int k = 0; k < DVB_CONT_HANDLES; k++) {
        e->off[k] = k < n ? (int32_t)f[8 + k] : 0;
        e->handle[k] = handle[k];
    }
    e->n_obj = n_obj;
    e->obj_client = n_obj ? (int32_t)x[1] : 0;
    for (int k = 0; k < DVB_CONT_OBJECTS; k++)
        e->obj_off[k] = k < n_obj ? (int32_t)x[2 + k] : 0;
    e->n_fd = n_fd;
    for (int k = 0; k < DVB_CONT_FDS; k++)
        e->fd_off[k] = k < n_fd ? (int32_t)x[3 + DVB_CONT_OBJECTS + k] : 0;
    if (pidfd >= 0)
        caller_put(m, tid, pidfd, (uint64_t)f[5]);
    slot = i;
    pthread_mutex_unlock(&m->lock);
    return slot;
}

/* The counts of settled continuations since the last fold, as dvb_settled_fold's rows
 * (slot, count, 0, sum_ns, buckets...). */
int dvb_continue_fold(struct dvb_shared *sh, int64_t *out, int max)
{
    struct dvb_settled *m = &sh->settled;
    int rows = 0, width = 4 + DVB_SETTLED_BUCKETS + 1;
    if (!__atomic_load_n(&m->conts_unfolded, __ATOMIC_RELAXED))
        return 0;
    pthread_mutex_lock(&m->lock);
    m->conts_unfolded = 0;
    for (int i = 0; i < DVB_CONT_FACTS; i++) {
        struct dvb_cont_fact *e = &m->conts[i];
        if (!e->count)
            continue;
        if (rows == max) {
            m->conts_unfolded = 1;
            break;
        }
        fact_take(e, i, out + (size_t)rows++ * width);
    }
    pthread_mutex_unlock(&m->lock);
    return rows;
}

/* A call a continuation or mapping fact answered, in the fact's counters (under m->lock;
 * folded by Python: dvb_continue_fold). */
static void fact_count(struct dvb_settled *m, struct dvb_cont_fact *e, int64_t ns)
{
    e->count++;
    e->sum_ns += ns;
    e->buckets[bucket_of(m, ns)]++;
    m->conts_unfolded++;
}

/* An ioctl the broker may have continued before on this file: 1 when a continuation fact
 * holds for it now (the loop answers CONTINUE, counted), 0 to ask the broker, DVB_LATE
 * when the read of a handle field came back after the watchdog answered. The lock is not
 * held while tenant memory is read (a page the tenant controls must never stall other
 * listener threads' lookups): the fact is looked up again after the read. */
static int tenant_fd_statx(pid_t pid, int fd, unsigned int mask, struct statx *sx);

/* A continue fact's objects and fds against what the loop read (under m->lock): each object
 * handle has an object fact on this file under the client the argument names, each fd is
 * -1 (fd_ok) or names a file with a mapping fact in the fact's sandbox. */
static int cont_objects_hold(struct dvb_settled *m, uint64_t now, const struct dvb_cont_fact *e,
                             const struct dvb_call *c, const uint8_t *arg, const int *fd_ok,
                             const int64_t *fd_dev, const int64_t *fd_ino)
{
    uint32_t client, object;
    if (e->n_obj) {
        memcpy(&client, arg + e->obj_client, 4);
        for (int k = 0; k < e->n_obj && k < DVB_CONT_OBJECTS; k++) {
            memcpy(&object, arg + e->obj_off[k], 4);
            struct dvb_settled_object *o = find_object(m, now, c->dev, c->ino, client, object);
            if (!o || o->sandbox != e->sandbox)
                return 0;
        }
    }
    for (int k = 0; k < e->n_fd && k < DVB_CONT_FDS; k++) {
        if (fd_ok[k])
            continue;
        int found = 0;
        uint64_t home = cont_home(fd_dev[k], fd_ino[k], 0);
        for (int j = 0; j < SETTLED_PROBE && !found; j++) {
            const struct dvb_cont_fact *f = &m->conts[(home + j) % DVB_CONT_FACTS];
            found = f->epoch == now && f->dev == fd_dev[k] && f->ino == fd_ino[k]
                    && (f->kind == DVB_FACT_MMAP || f->kind == DVB_FACT_FILE)
                    && f->sandbox == e->sandbox;
        }
        if (!found)
            return 0;
    }
    return 1;
}

/* The sandbox of the file (dev, ino) by its file fact — a mapping fact (a real ctl or GPU
 * file of the tenant's) or a uvm file's (DVB_FACT_FILE) — for the policy epoch now; 0 when
 * it has none (under m->lock). */
static uint64_t file_fact_sandbox(struct dvb_settled *m, uint64_t now, int64_t dev, int64_t ino)
{
    uint64_t home = cont_home(dev, ino, 0);
    for (int k = 0; k < SETTLED_PROBE; k++) {
        const struct dvb_cont_fact *e = &m->conts[(home + k) % DVB_CONT_FACTS];
        if (e->epoch == now && e->dev == dev && e->ino == ino
            && (e->kind == DVB_FACT_MMAP || e->kind == DVB_FACT_FILE))
            return e->sandbox;
    }
    return 0;
}

static int continue_admit(struct dvb_thread *t, int64_t t0)
{
    struct dvb_settled *m = &t->sh->settled;
    struct dvb_call *c = &t->call;
    uint32_t cmd = (uint32_t)c->cmd, handle[DVB_CONT_HANDLES] = {0};
    int32_t off[DVB_CONT_HANDLES] = {0};
    int n = -1, ok = 0, whole = 0, nf = 0;
    uint32_t size = 0;
    int32_t fo[DVB_CONT_FDS] = {0};
    uint8_t arg[DVB_CONT_ARG];
    int64_t fd_dev[DVB_CONT_FDS] = {0}, fd_ino[DVB_CONT_FDS] = {0};
    if (!m->epochs || t->sh->mem_off)
        return 0;
    /* this file's facts first, then the node's (DVB_NODE_WIDE: for any file of the node
     * with a file fact in the fact's sandbox) */
    int64_t kdev = c->dev, kino = c->ino;
    uint64_t home = cont_home(kdev, kino, cmd);
    pthread_mutex_lock(&m->lock);
    catch_up(m);
    uint64_t now = epoch_now(m, 0);
    for (int pass = 0; pass < 2 && n < 0; pass++) {
        if (pass) {
            if (!c->rdev)
                break;
            kdev = DVB_NODE_WIDE;
            kino = c->rdev;
            home = cont_home(kdev, kino, cmd);
        }
        for (int k = 0; k < SETTLED_PROBE && n < 0; k++) {
            struct dvb_cont_fact *e = &m->conts[(home + k) % DVB_CONT_FACTS];
            if (e->epoch == now && e->dev == kdev && e->ino == kino
                && e->kind == DVB_FACT_IOCTL && e->cmd == cmd) {
                n = e->n;
                memcpy(off, e->off, sizeof(off));
                whole = e->n_obj || e->n_fd;
                size = e->size;
                nf = e->n_fd; /* (one plan per command: every fact of it has these) */
                memcpy(fo, e->fd_off, sizeof(fo));
            }
        }
    }
    pthread_mutex_unlock(&m->lock);
    if (n < 0)
        return 0;
    if (whole) {
        /* The whole argument, privately (its handles, objects and fds read from this copy,
         * as the broker's decision reads its own; the kernel re-reads the argument when the
         * tenant's thread runs the call, as after that decision: the row's `race`). */
        struct iovec l = {arg, size}, r = {(void *)(uintptr_t)(uint64_t)c->argp, size};
        if (size > DVB_CONT_ARG)
            return 0;
        ssize_t got = tenant_rw(t, (pid_t)c->tid, 0, &l, &r, 1);
        if (t->abandoned)
            return DVB_LATE;
        if (got != (ssize_t)size)
            return 0;
        for (int k = 0; k < n; k++)
            memcpy(&handle[k], arg + off[k], 4);
    } else if (n > 0) {
        struct iovec l[DVB_CONT_HANDLES], r[DVB_CONT_HANDLES];
        for (int k = 0; k < n; k++) {
            l[k] = (struct iovec){&handle[k], 4};
            r[k] = (struct iovec){(void *)(uintptr_t)((uint64_t)c->argp + (uint64_t)off[k]), 4};
        }
        ssize_t got = tenant_rw(t, (pid_t)c->tid, 0, l, r, (unsigned long)n);
        if (t->abandoned)
            return DVB_LATE;
        if (got != (ssize_t)(4 * n))
            return 0; /* the broker reads it again and answers */
    }
    int fd_ok[DVB_CONT_FDS] = {0};
    if (whole) {
        /* the fds' files, by their identity in the caller's table (outside the lock) */
        for (int k = 0; k < nf && k < DVB_CONT_FDS; k++) {
            int32_t fd;
            struct statx sx;
            if ((uint32_t)fo[k] + 4 > size)
                return 0;
            memcpy(&fd, arg + fo[k], 4);
            if (fd == -1) {
                fd_ok[k] = 1; /* no file: the driver sees -1, as the broker allows */
                continue;
            }
            if (fd < 0 || tenant_fd_statx((pid_t)c->tid, fd, STATX_TYPE | STATX_INO, &sx) < 0
                || !S_ISCHR(sx.stx_mode))
                return 0;
            fd_dev[k] = (int64_t)makedev(sx.stx_dev_major, sx.stx_dev_minor);
            fd_ino[k] = (int64_t)sx.stx_ino;
        }
    }
    pthread_mutex_lock(&m->lock);
    catch_up(m);
    now = epoch_now(m, 0);
    for (int k = 0; k < SETTLED_PROBE && !ok; k++) {
        struct dvb_cont_fact *e = &m->conts[(home + k) % DVB_CONT_FACTS];
        if (!(e->epoch == now && e->dev == kdev && e->ino == kino
              && e->kind == DVB_FACT_IOCTL && e->cmd == cmd
              && e->n == n && !memcmp(e->off, off, sizeof(off))
              && !memcmp(e->handle, handle, sizeof(handle))))
            continue;
        if (!m->credit || !e->sandbox || caller_sandbox(m, c->tid) != e->sandbox)
            break; /* (the session's own check: the caller in the opener's sandbox) */
        if (kdev == DVB_NODE_WIDE && file_fact_sandbox(m, now, c->dev, c->ino) != e->sandbox)
            break; /* (a node's fact: this file one of the tenant's, the same sandbox) */
        if ((e->n_obj || e->n_fd)
            && (!whole || e->size != size || e->n_fd != nf
                || memcmp(e->fd_off, fo, sizeof(fo))
                || !cont_objects_hold(m, now, e, c, arg, fd_ok, fd_dev, fd_ino)))
            break; /* (the broker decides it) */
        if (m->credit > 0)
            m->credit--;
        fact_count(m, e, now_ns() - t0);
        ok = 1;
    }
    pthread_mutex_unlock(&m->lock);
    return ok;
}

/* The file behind the caller's fd number, as the kernel has it cached (AT_STATX_DONT_SYNC:
 * never a round trip to a file's server); -1 when there is none. */
static int tenant_fd_statx(pid_t pid, int fd, unsigned int mask, struct statx *sx)
{
    char path[64];
    snprintf(path, sizeof(path), "/proc/%u/fd/%d", (unsigned)pid, fd);
    return statx(AT_FDCWD, path, AT_STATX_DONT_SYNC, mask, sx);
}

/* The broker answered an escape whose answer it may keep (rules.EscapeRule.answer_kept):
 * f = the node's rdev, the ioctl number, the answer's size, the opener's sandbox tag, the
 * caller's sandbox tag; data: the answer as the tenant got it; epochs as for
 * dvb_settled_put (the policy epoch read before the broker decided: a change since, and
 * nothing is written). evicted (3 + buckets): the counts of an answer whose slot this one
 * takes. Returns its slot, or -1 when nothing was written. */
int dvb_answer_put(struct dvb_shared *sh, const uint64_t *epochs, const int64_t *f,
                   const uint8_t *data, int64_t tid, int pidfd, int64_t *evicted)
{
    struct dvb_settled *m = &sh->settled;
    evicted[0] = -1;
    uint32_t cmd = (uint32_t)f[1], size = (uint32_t)f[2];
    if (f[2] <= 0 || f[2] > DVB_ANSWER_MAX || size != ((cmd >> 16) & 0x3fff) || !f[3])
        return refuse_put(pidfd);
    uint64_t now;
    if (put_begin(m, epochs, 0, pidfd, &now) < 0)
        return -1;
    caller_put(m, tid, pidfd, (uint64_t)f[4]);
    int slot = -1, stale = -1;
    for (int k = 0; k < DVB_ANSWERS && slot < 0; k++) {
        struct dvb_answer *a = &m->answers[k];
        if (a->epoch && a->sandbox == (uint64_t)f[3] && a->rdev == f[0] && a->cmd == cmd)
            slot = k;
        else if (stale < 0 && a->epoch != now)
            stale = k;
    }
    if (slot < 0)
        slot = stale >= 0 ? stale : (int)(cmd % DVB_ANSWERS);
    struct dvb_answer *a = &m->answers[slot];
    if (a->count && !(a->sandbox == (uint64_t)f[3] && a->rdev == f[0] && a->cmd == cmd)) {
        evicted[0] = slot; /* another answer's calls: Python records them */
        evicted[1] = a->count;
        evicted[2] = 0;
        evicted[3] = a->sum_ns;
        memcpy(evicted + 4, a->buckets, sizeof(a->buckets));
        a->count = a->sum_ns = 0;
        memset(a->buckets, 0, sizeof(a->buckets));
    }
    a->epoch = now;
    a->sandbox = (uint64_t)f[3];
    a->rdev = f[0];
    a->cmd = cmd;
    a->size = size;
    memcpy(a->data, data, size);
    pthread_mutex_unlock(&m->lock);
    return slot;
}

static int file_is_tenants(struct dvb_settled *m, uint64_t now, int64_t dev, int64_t ino,
                           uint64_t sandbox);

/*
 * The broker admitted a plain escape the loop may admit again (struct dvb_escape_fact):
 * f: rdev, ioctl number, the argument's size, answered, the file opener's sandbox tag, the
 * caller's sandbox tag, the offset of its one fd field or -1; arg: the argument as decided;
 * epochs as for dvb_settled_put (a policy change since: nothing written); pidfd: the caller's, owned here from now on.
 * evicted as for dvb_settled_put. Returns its control fact's slot (its counters), or -1.
 */
int dvb_escape_put(struct dvb_shared *sh, const uint64_t *epochs, const int64_t *f,
                   const uint8_t *arg, int64_t tid, int pidfd, int64_t *evicted)
{
    struct dvb_settled *m = &sh->settled;
    evicted[0] = -1;
    uint32_t cmd = (uint32_t)f[1], size = (uint32_t)f[2];
    if (f[2] <= 0 || f[2] > DVB_HDR_MAX || size != ((cmd >> 16) & 0x3fff) || !f[4]
        || (f[3] != 0 && f[3] != 1) || f[6] < -1 || f[6] + 4 > f[2] || (f[6] >= 0 && f[3]))
        return refuse_put(pidfd);
    uint64_t now;
    if (put_begin(m, epochs, 0, pidfd, &now) < 0)
        return -1;
    caller_put(m, tid, pidfd, (uint64_t)f[5]);
    struct dvb_settled_control *c = control_fact_put(m, now, 0, cmd, 0, evicted);
    c->params_size = 0;
    c->patched = 0;
    c->gpu_id_off = -1;
    c->n_null = 0;
    c->n_embed = 0;
    c->idf_count = 0;
    c->flag_off = -1;
    c->idl_count = 0;
    int slot = -1, stale = -1;
    for (int k = 0; k < DVB_ESCAPE_FACTS && slot < 0; k++) {
        struct dvb_escape_fact *x = &m->escapes[k];
        if (x->epoch == now && x->sandbox == (uint64_t)f[4] && x->rdev == f[0] && x->cmd == cmd
            && x->fd_off == (int32_t)f[6] && escape_arg_match(x, arg))
            slot = k;
        else if (stale < 0 && x->epoch != now)
            stale = k;
    }
    if (slot < 0) /* (all of this epoch and others: one written over, by the argument) */
        slot = stale >= 0 ? stale : (int)((mix64(cmd) ^ arg[size - 1]) % DVB_ESCAPE_FACTS);
    struct dvb_escape_fact *x = &m->escapes[slot];
    x->epoch = now;
    x->sandbox = (uint64_t)f[4];
    x->rdev = f[0];
    x->cmd = cmd;
    x->size = size;
    x->answered = (int32_t)f[3];
    x->control = (int32_t)(c - m->controls);
    x->fd_off = (int32_t)f[6];
    memcpy(x->arg, arg, size);
    if (x->fd_off >= 0)
        memset(x->arg + x->fd_off, 0, 4); /* (not part of the match) */
    pthread_mutex_unlock(&m->lock);
    return x->control;
}

/* A plain escape a settled escape holds for (struct dvb_escape_fact): admitted here (fills
 * the call as settled_admit does: the driver call on the loop's duplicate with its private
 * copy of the argument, or the argument as sent for an answered one); 0 leaves it to the
 * callback. */
/* The escape fact that holds for this call now, with its control fact (its counters), and
 * the call's file one of the tenant's in the caller's sandbox; NULL for none (under
 * m->lock). */
static struct dvb_escape_fact *escape_lookup(struct dvb_settled *m, uint64_t now,
                                             const struct dvb_call *c, uint64_t sandbox)
{
    struct dvb_escape_fact *hit = NULL;
    for (int k = 0; k < DVB_ESCAPE_FACTS && !hit; k++) {
        struct dvb_escape_fact *x = &m->escapes[k];
        if (x->epoch == now && x->cmd == (uint32_t)c->cmd && x->size == (uint32_t)c->hdr_len
            && x->rdev == c->rdev && x->sandbox && x->sandbox == sandbox
            && escape_arg_match(x, c->hdr))
            hit = x;
    }
    if (!hit || !file_is_tenants(m, now, c->dev, c->ino, sandbox))
        return NULL;
    const struct dvb_settled_control *e = &m->controls[hit->control];
    if (e->epoch != now || e->abi != 0 || e->ioctl_cmd != (uint32_t)c->cmd || e->control)
        return NULL; /* (its counters' slot went to another control: decided again) */
    return hit;
}

static int escape_admit(struct dvb_thread *t)
{
    struct dvb_settled *m = &t->sh->settled;
    struct dvb_call *c = &t->call;
    int ok = 0;
    if (!m->epochs || !t->driver_safe || !c->hdr_len || !S_ISCHR(c->mode) || t->file_dup < 0)
        return 0;
    pthread_mutex_lock(&m->lock);
    catch_up(m);
    uint64_t now = epoch_now(m, 0);
    uint64_t sandbox = caller_sandbox(m, c->tid);
    struct dvb_escape_fact *hit = escape_lookup(m, now, c, sandbox);
    if (!hit || !m->credit)
        goto out;
    int32_t fd_off = hit->fd_off;
    if (fd_off >= 0) {
        /* the file its fd names: the loop's own duplicate, one of the tenant's by a mapping
         * fact in the caller's sandbox (two syscalls: the lock is let go meanwhile, and
         * the fact looked up again after) */
        int32_t fd;
        memcpy(&fd, c->hdr + fd_off, 4);
        pthread_mutex_unlock(&m->lock);
        struct stat st;
        int dup = fd < 0 ? -1 : tenant_fd_dup(t, c->tid, fd);
        if (dup >= 0 && fstat(dup, &st) < 0) {
            close(dup);
            dup = -1;
        }
        pthread_mutex_lock(&m->lock);
        catch_up(m);
        if (dup >= 0 && epoch_now(m, 0) == now)
            hit = escape_lookup(m, now, c, sandbox); /* (still this fact, file and call) */
        if (dup < 0 || epoch_now(m, 0) != now || !hit || hit->fd_off != fd_off
            || !file_is_tenants(m, now, (int64_t)st.st_dev, (int64_t)st.st_ino, sandbox)
            || !m->credit) {
            if (dup >= 0)
                close(dup);
            goto out; /* (the broker decides: it refuses what is not the tenant's) */
        }
        c->fd_n = 1; /* (run_control closes it however the call ends) */
        c->fd_off[0] = fd_off;
        c->fd_orig[0] = fd;
        c->fd_dup[0] = dup;
        memcpy(c->hdr + fd_off, &(int32_t){dup}, 4);
    }
    if (m->credit > 0)
        m->credit--;
    c->params_ptr = c->params_size = 0;
    c->params_off = -1;
    c->status_off = -1;
    c->driver = !hit->answered;
    c->check = 0;
    c->finish = FINISH_NONE;
    c->settled = hit->control;
    ok = 1;
out:
    pthread_mutex_unlock(&m->lock);
    return ok;
}

/* The answer facts' counts since the last fold: rows (slot, count, 0, sum_ns, buckets). */
int dvb_answer_fold(struct dvb_shared *sh, int64_t *out, int max)
{
    struct dvb_settled *m = &sh->settled;
    int rows = 0, width = 4 + DVB_SETTLED_BUCKETS + 1;
    if (!__atomic_load_n(&m->answers_unfolded, __ATOMIC_RELAXED))
        return 0;
    pthread_mutex_lock(&m->lock);
    m->answers_unfolded = 0;
    for (int i = 0; i < DVB_ANSWERS && rows < max; i++) {
        struct dvb_answer *a = &m->answers[i];
        if (!a->count)
            continue;
        int64_t *row = out + (size_t)rows++ * width;
        row[0] = i;
        row[1] = a->count;
        row[2] = 0;
        row[3] = a->sum_ns;
        memcpy(row + 4, a->buckets, sizeof(a->buckets));
        a->count = a->sum_ns = 0;
        memset(a->buckets, 0, sizeof(a->buckets));
    }
    pthread_mutex_unlock(&m->lock);
    return rows;
}

/* Whether a mapping fact of the policy epoch `now` says the file (dev, ino) is a real ctl
 * or GPU file the broker installed for an opener of `sandbox` (under m->lock). */
static int file_is_tenants(struct dvb_settled *m, uint64_t now, int64_t dev, int64_t ino,
                           uint64_t sandbox)
{
    uint64_t home = cont_home(dev, ino, 0);
    for (int k = 0; k < SETTLED_PROBE; k++) {
        struct dvb_cont_fact *e = &m->conts[(home + k) % DVB_CONT_FACTS];
        if (e->epoch == now && e->dev == dev && e->ino == ino && e->kind == DVB_FACT_MMAP)
            return e->sandbox && e->sandbox == sandbox;
    }
    return 0;
}

/* An ioctl an answer fact holds for (struct dvb_answer): the answer written to the
 * argument and sent. 1: answered (or stale: nothing to answer); 0: the broker decides it
 * (no fact, or the write fell short: the general path writes again and answers);
 * DVB_LATE: the write came back after the watchdog answered. */
static int answer_admit(struct dvb_thread *t, struct dvb_notif *n, int64_t t0)
{
    struct dvb_shared *sh = t->sh;
    struct dvb_settled *m = &sh->settled;
    struct dvb_call *c = &t->call;
    uint32_t size = ((uint32_t)c->cmd >> 16) & 0x3fff;
    int hit = -1;
    if (!m->epochs || sh->mem_off || !size || size > DVB_ANSWER_MAX || !S_ISCHR(c->mode))
        return 0;
    pthread_mutex_lock(&m->lock);
    catch_up(m);
    uint64_t now = epoch_now(m, 0);
    uint64_t sandbox = caller_sandbox(m, c->tid);
    for (int k = 0; k < DVB_ANSWERS && hit < 0; k++) {
        struct dvb_answer *a = &m->answers[k];
        if (a->epoch == now && a->cmd == (uint32_t)c->cmd && a->size == size
            && a->rdev == c->rdev && a->sandbox && a->sandbox == sandbox)
            hit = k;
    }
    if (hit >= 0 && (!m->credit || !file_is_tenants(m, now, c->dev, c->ino, sandbox)))
        hit = -1;
    if (hit >= 0) {
        if (m->credit > 0)
            m->credit--;
        memcpy(t->embed_buf, m->answers[hit].data, size); /* (the thread's own copy) */
    }
    pthread_mutex_unlock(&m->lock);
    if (hit < 0)
        return 0;
    if (!id_valid(sh, n->id)) {
        t->counters[C_STALE]++;
        return 1;
    }
    struct iovec l = {t->embed_buf, size}, r = {(void *)(uintptr_t)(uint64_t)c->argp, size};
    ssize_t put = tenant_rw(t, (pid_t)c->tid, 1, &l, &r, 1);
    if (t->abandoned)
        return DVB_LATE;
    if (put != (ssize_t)size)
        return 0;
    send_resp(t, n->id, 0, 0, 0);
    int64_t ns = now_ns() - t0;
    pthread_mutex_lock(&m->lock);
    struct dvb_answer *a = &m->answers[hit];
    if (a->epoch) { /* (counted on the fact; a fact written over meanwhile loses one call) */
        a->count++;
        a->sum_ns += ns;
        a->buckets[bucket_of(m, ns)]++;
        m->answers_unfolded++;
    }
    pthread_mutex_unlock(&m->lock);
    t->counters[C_IOCTLS]++;
    t->counters[C_ANSWERS_SETTLED]++;
    t->counters[C_NS_IOCTL] += ns;
    return 1;
}

static int answer_ioctl_on(struct dvb_thread *t, struct dvb_notif *n);

/* An ioctl notification. For an ioctl number the loop may run itself (lane_cmd: RM
 * controls, allocations, frees, plain escapes) the file its fd names is identified by the
 * broker's own duplicate of it (pidfd_getfd through the calling thread's pidfd, then
 * fstat): the file the decision is about is the one a driver call runs on, and one
 * duplicate costs less than a statx through /proc/<tid>/fd (~2 against ~4 µs on the
 * development machine) followed by the duplicate an executed call needs anyway. Any other
 * number (continued, or the Python listener's) is identified by that statx alone. The
 * duplicate is closed on every way out. */
static int answer_ioctl(struct dvb_thread *t, struct dvb_notif *n)
{
    t->file_dup = -1;
    int rc = answer_ioctl_on(t, n);
    if (t->file_dup >= 0)
        close(t->file_dup);
    t->file_dup = -1;
    return rc;
}

static int answer_ioctl_on(struct dvb_thread *t, struct dvb_notif *n)
{
    struct dvb_shared *sh = t->sh;
    struct dvb_call *c = &t->call;
    int64_t t0 = now_ns();
    struct stat st;
    c->id = (int64_t)n->id;
    c->tid = n->pid;
    c->fd = (int)n->args[0];
    c->cmd = (uint32_t)n->args[1];
    c->argp = (int64_t)n->args[2];
    c->mode = 0; /* 0 until read below: the Python listener reuses the file's identity */
    c->hdr_len = 0;
    c->params_ptr = c->params_size = 0;
    c->params_off = -1;
    c->driver = c->finish = c->check = 0;
    c->ret = c->err = 0;
    c->patch_n = 0;
    c->embed_n = 0;
    t->sembed.n = 0; /* (a settled control's: settled_admit sets them) */
    t->sidf.count = 0;
    t->sflag.off = -1;
    t->sidl.count = 0;
    c->fd_n = 0;
    c->settled = -1;
    c->after = 0;
    c->path_len = 0;
    c->params_read = 0;
    c->gpu_id_off = -1;
    c->n_null = 0;
    c->status_off = -1;
    if (c->fd < 0)
        return DVB_NOTIF;
    int laned = lane_cmd(sh, (uint32_t)c->cmd);
    if (laned) { /* (a call the loop may run: its duplicate now, see answer_ioctl) */
        t->file_dup = tenant_fd_dup(t, n->pid, (int)c->fd);
        if (t->file_dup < 0 || fstat(t->file_dup, &st) < 0)
            return DVB_NOTIF; /* (no such fd, or the thread is gone: the Python listener) */
        c->dev = (int64_t)st.st_dev;
        c->ino = (int64_t)st.st_ino;
        c->mode = st.st_mode;
        c->rdev = (int64_t)st.st_rdev;
    } else { /* (continued or the Python listener's: the identity alone) */
        struct statx sx;
        if (tenant_fd_statx(n->pid, (int)c->fd, STATX_TYPE | STATX_MODE | STATX_INO, &sx) < 0)
            return DVB_NOTIF;
        c->dev = (int64_t)makedev(sx.stx_dev_major, sx.stx_dev_minor);
        c->ino = (int64_t)sx.stx_ino;
        c->mode = sx.stx_mode;
        c->rdev = (int64_t)makedev(sx.stx_rdev_major, sx.stx_rdev_minor);
    }
    size_t size = (c->cmd >> 16) & 0x3fff; /* _IOC_SIZE */
    if (laned && size <= DVB_HDR_MAX && !sh->mem_off) {
        ssize_t got = tenant_read(t, n->pid, (uint64_t)c->argp, c->hdr, size);
        if (t->abandoned)
            return DVB_LATE;
        if (got == (ssize_t)size)
            c->hdr_len = (int64_t)size;
    }
    int64_t t1 = now_ns();
    if (!c->hdr_len) { /* (a continued call's header is never read as a control's) */
        int answered = answer_admit(t, n, t0);
        if (answered == DVB_LATE)
            return DVB_LATE;
        if (answered)
            return 0;
        int cont = continue_admit(t, t0);
        if (cont == DVB_LATE)
            return DVB_LATE;
        if (cont) {
            send_resp(t, n->id, 0, 0, 1);
            t->counters[C_IOCTLS]++;
            t->counters[C_CONT_SETTLED]++;
            t->counters[C_NS_IOCTL] += now_ns() - t0;
            return 0;
        }
    }
    int settled = escape_admit(t) || settled_admit(t); /* else the broker decides (callback) */
    int act = settled ? ACT_CONTROL : sh->on_ioctl(t->slot);
    int64_t t2 = now_ns();
    int rc;
    if (settled)
        t->counters[C_SETTLED]++;
    if (act == ACT_CONTINUE) {
        send_resp(t, n->id, 0, 0, 1);
        if (c->after)
            sh->on_after(t->slot); /* (a continuation written down; the tenant runs on) */
        rc = 0;
    } else if (act == ACT_FAIL) { /* a bug in the decision: this call fails, closed */
        send_resp(t, n->id, 0, EIO, 0);
        rc = 0;
    } else if (act == ACT_CONTROL && c->hdr_len) {
        rc = run_control(t, n, t0, t1, t2);
    } else {
        rc = DVB_NOTIF;
    }
    if (rc == 0)
        t->counters[C_NS_IOCTL] += now_ns() - t0;
    return rc;
}

/* ----------------------------------------------------------------- prepared opens */
/* (struct dvb_open_slot says what they are and why answering one is the broker's decision.) */

/* A prepared open of `path` for the caller, answered with its file: 0, or DVB_NOTIF when
 * none applies (the Python listener decides, as without them). */
static int answer_prepared_open(struct dvb_thread *t, struct dvb_notif *n, const char *path,
                                size_t len, int64_t t0)
{
    struct dvb_shared *sh = t->sh;
    struct dvb_settled *m = &sh->settled;
    uint64_t flags = n->nr == sh->nr_open ? n->args[1] : n->args[2];
    if (!m->epochs || (n->nr != sh->nr_open && n->nr != sh->nr_openat) || path[0] != '/'
        || len >= DVB_OPEN_PATH || (flags & O_NONBLOCK))
        return DVB_NOTIF; /* (openat2's resolve flags, O_NONBLOCK: the Python listener) */
    int fd = -1;
    int64_t id = 0;
    pthread_mutex_lock(&m->lock);
    catch_up(m);
    uint64_t now = epoch_now(m, 0);
    for (int i = 0; i < DVB_OPEN_SLOTS && fd < 0; i++) {
        struct dvb_open_slot *e = &m->open_slots[i];
        if (e->epoch != now || e->fd < 0 || (size_t)e->path_len != len
            || memcmp(e->path, path, len) != 0)
            continue;
        if (!m->credit || caller_sandbox(m, n->pid) != e->sandbox)
            break; /* (one sandbox per listener: no other slot would do) */
        if (m->credit > 0)
            m->credit--;
        fd = e->fd;
        id = e->id;
        e->fd = -1;
        e->epoch = 0;
    }
    pthread_mutex_unlock(&m->lock);
    if (fd < 0)
        return DVB_NOTIF;
    struct { /* struct seccomp_notif_addfd */
        uint64_t id;
        uint32_t flags, srcfd, newfd, newfd_flags;
    } add = {.id = n->id, .flags = 1u << 1 /* SECCOMP_ADDFD_FLAG_SEND */, .srcfd = (uint32_t)fd,
             .newfd = 0, .newfd_flags = (flags & O_CLOEXEC) ? O_CLOEXEC : 0};
    int64_t t1 = now_ns();
    int newfd = ioctl(sh->listener, sh->req_addfd, &add);
    int e = errno;
    t->counters[C_NS_SEND] += now_ns() - t1;
    close(fd); /* installed: the tenant's reference is the only one; else unused, gone */
    pthread_mutex_lock(&m->lock);
    if (m->n_opened < DVB_OPEN_SLOTS) /* (room for every slot: Python drains them all) */
        m->opened[m->n_opened++] = (struct dvb_opened){
            .id = id, .tid = n->pid, .newfd = newfd >= 0 ? newfd : -e};
    pthread_mutex_unlock(&m->lock);
    if (newfd < 0) {
        if (e == ENOENT) { /* the caller is gone (or was interrupted): nothing to answer */
            t->counters[C_STALE]++;
            return 0;
        }
        return DVB_NOTIF; /* (EMFILE, ...: the Python listener's open answers it) */
    }
    __atomic_store_n(&sh->quiet, 1, __ATOMIC_RELEASE); /* (Python prepares the next one) */
    t->counters[C_ANSWERED]++;
    t->counters[C_OPENS_PREPARED]++;
    t->counters[C_NS_OPEN_PREPARED] += now_ns() - t0;
    return 0;
}

/* Leave a prepared open of `path` (its file `fd`, owned here from now on) for callers of
 * the sandbox `sandbox`, decided at the words `epochs` (read before the broker decided):
 * 0, or -1 when it is not taken (the policy changed meanwhile, no free slot, settled
 * facts off, a bad path) and the caller keeps the file. */
int dvb_open_put(struct dvb_shared *sh, const uint64_t *epochs, const char *path,
                 int path_len, int fd, uint64_t sandbox, int64_t id)
{
    struct dvb_settled *m = &sh->settled;
    uint64_t now;
    int rc = -1;
    if (path_len <= 0 || path_len >= DVB_OPEN_PATH || fd < 0 || !sandbox)
        return -1;
    if (put_begin(m, epochs, 0, -1, &now) < 0)
        return -1;
    for (int i = 0; i < DVB_OPEN_SLOTS; i++) {
        struct dvb_open_slot *e = &m->open_slots[i];
        if (e->fd >= 0)
            continue; /* (a stale one too: Python takes it back, with its file) */
        e->epoch = now;
        e->sandbox = sandbox;
        e->id = id;
        e->fd = fd;
        e->path_len = path_len;
        memcpy(e->path, path, (size_t)path_len);
        rc = 0;
        break;
    }
    pthread_mutex_unlock(&m->lock);
    return rc;
}

/* Take prepared opens back (every one with `all`, else those of a past policy epoch):
 * their (id, fd) pairs, up to max, the files the caller's from now on. Returns how many. */
int dvb_open_take(struct dvb_shared *sh, int all, int64_t *out, int max)
{
    struct dvb_settled *m = &sh->settled;
    int n = 0;
    pthread_mutex_lock(&m->lock);
    uint64_t now = m->epochs ? (catch_up(m), epoch_now(m, 0)) : 0;
    for (int i = 0; i < DVB_OPEN_SLOTS && n < max; i++) {
        struct dvb_open_slot *e = &m->open_slots[i];
        if (e->fd < 0 || (!all && e->epoch == now))
            continue;
        out[2 * n] = e->id;
        out[2 * n + 1] = e->fd;
        n++;
        e->fd = -1;
        e->epoch = 0;
    }
    pthread_mutex_unlock(&m->lock);
    return n;
}

/* How many prepared opens the loop answered (or gave up) that Python has not drained: a
 * look without the lock (the callbacks ask at every visit). */
int dvb_open_pending(struct dvb_shared *sh)
{
    return __atomic_load_n(&sh->settled.n_opened, __ATOMIC_RELAXED);
}

/* The prepared opens answered (or given up) since the last call: rows of (id, tid, newfd),
 * up to max (DVB_OPEN_SLOTS holds them all). Returns how many. */
int dvb_open_drain(struct dvb_shared *sh, int64_t *out, int max)
{
    struct dvb_settled *m = &sh->settled;
    if (!__atomic_load_n(&m->n_opened, __ATOMIC_RELAXED))
        return 0; /* (nothing: no lock) */
    pthread_mutex_lock(&m->lock);
    int n = m->n_opened < max ? m->n_opened : max;
    memcpy(out, m->opened, sizeof(struct dvb_opened) * (size_t)n);
    memmove(m->opened, m->opened + n, sizeof(struct dvb_opened) * (size_t)(m->n_opened - n));
    m->n_opened -= n;
    pthread_mutex_unlock(&m->lock);
    return n;
}

/* A file mapping (the filter notifies every one that is not anonymous): CONTINUE for a
 * file that can be none of the broker's (neither a character device nor a memfd: the
 * Python listener's _lookup_stat finds a session behind no other kind of file, and an
 * NVIDIA node is a character device), and for a character device a mapping fact holds
 * for (struct dvb_cont_fact, DVB_FACT_MMAP) with a caller from its opener's sandbox;
 * everything else (any other character device, a memfd, a failed statx) goes to the
 * Python listener. */
static int answer_mmap(struct dvb_thread *t, struct dvb_notif *n)
{
    struct dvb_shared *sh = t->sh;
    struct dvb_settled *m = &sh->settled;
    int64_t t0 = now_ns();
    int fd = (int)n->args[4];
    int64_t memfd_dev = __atomic_load_n(&sh->memfd_dev, __ATOMIC_ACQUIRE);
    struct statx sx;
    if (fd < 0 || memfd_dev < 0)
        return DVB_NOTIF;
    if (tenant_fd_statx(n->pid, fd, STATX_TYPE | STATX_INO, &sx) < 0)
        return DVB_NOTIF;
    int64_t dev = (int64_t)makedev(sx.stx_dev_major, sx.stx_dev_minor);
    if (!S_ISCHR(sx.stx_mode)) {
        if (dev == memfd_dev || !take_pace(m))
            return DVB_NOTIF;
        send_resp(t, n->id, 0, 0, 1);
        t->counters[C_MMAPS_CONTINUED]++;
        t->counters[C_NS_MMAP] += now_ns() - t0;
        return 0;
    }
    int ok = 0;
    if (!m->epochs)
        return DVB_NOTIF;
    uint64_t home = cont_home(dev, (int64_t)sx.stx_ino, 0);
    pthread_mutex_lock(&m->lock);
    catch_up(m);
    uint64_t now = epoch_now(m, 0);
    for (int k = 0; k < SETTLED_PROBE && !ok; k++) {
        struct dvb_cont_fact *e = &m->conts[(home + k) % DVB_CONT_FACTS];
        if (!(e->epoch == now && e->dev == dev && e->ino == (int64_t)sx.stx_ino
              && e->kind == DVB_FACT_MMAP))
            continue;
        if (!e->sandbox || caller_sandbox(m, n->pid) != e->sandbox || !m->credit)
            break;
        if (m->credit > 0)
            m->credit--; /* (a token of the tenant's pace, as every call the loop answers) */
        fact_count(m, e, now_ns() - t0);
        ok = 1;
    }
    pthread_mutex_unlock(&m->lock);
    if (!ok)
        return DVB_NOTIF;
    send_resp(t, n->id, 0, 0, 1);
    t->counters[C_MMAPS_SETTLED]++;
    t->counters[C_NS_MMAP] += now_ns() - t0;
    return 0;
}

/* Wait for, receive and answer notifications until one needs the Python listener (or the
 * loop has news for it). The GIL is not held (ctypes releases it). */
int dvb_serve(struct dvb_thread *t)
{
    struct dvb_shared *sh = t->sh;
    struct dvb_notif *n = (struct dvb_notif *)t->notif;
    int64_t started = now_ns();
    int handled = 0;
    answered_all(t); /* (one the Python listener answered, if any) */
    if (t->last_rc == DVB_NOTIF || t->last_rc == DVB_WRITE_FAILED)
        t->spin_until = now_ns() + sh->spin_ns; /* the Python listener just answered one */
    for (;;) {
        if (handled >= 512 || (handled && now_ns() - started > 100000000))
            return t->last_rc = DVB_FOLD; /* the Python side folds counters, checks its state */
        pthread_mutex_lock(&sh->recv_lock);
        int spinning = sh->spin_ns && now_ns() < t->spin_until;
        int quiet = __atomic_load_n(&sh->quiet, __ATOMIC_ACQUIRE);
        struct pollfd p[2] = {{sh->listener, POLLIN, 0}, {sh->wake_fd, POLLIN, 0}};
        int r = poll(p, 2, spinning ? 0 : quiet ? 1 : 200);
        if (r < 0) {
            int e = errno;
            pthread_mutex_unlock(&sh->recv_lock);
            if (e == EINTR)
                continue;
            t->err = e;
            return t->last_rc = DVB_ERROR;
        }
        if (r == 0) {
            pthread_mutex_unlock(&sh->recv_lock);
            if (spinning)
                continue;
            if (quiet && !__atomic_load_n(&sh->answering, __ATOMIC_ACQUIRE)
                && now_ns() - __atomic_load_n(&sh->last_active, __ATOMIC_ACQUIRE) >= 1000000
                && __atomic_exchange_n(&sh->quiet, 0, __ATOMIC_ACQ_REL))
                return t->last_rc = DVB_QUIET; /* (one thread does the work) */
            return t->last_rc = DVB_IDLE;
        }
        if (p[1].revents) {
            pthread_mutex_unlock(&sh->recv_lock);
            return t->last_rc = DVB_WAKE; /* live upgrade: leave now */
        }
        if (!(p[0].revents & POLLIN)) {
            pthread_mutex_unlock(&sh->recv_lock);
            if (p[0].revents & (POLLHUP | POLLERR | POLLNVAL))
                return t->last_rc = DVB_HUP;
            continue;
        }
        memset(t->notif, 0, sizeof(t->notif)); /* the kernel insists on zeroes */
        int64_t t0 = now_ns();
        r = ioctl(sh->listener, sh->req_recv, t->notif);
        int e = errno;
        t->counters[C_NS_RECV] += now_ns() - t0;
        pthread_mutex_unlock(&sh->recv_lock);
        if (r < 0) {
            if (e == ENOENT || e == EINTR)
                continue;
            t->err = e;
            return t->last_rc = DVB_ERROR;
        }
        t->counters[C_NOTIFICATIONS]++;
        __atomic_add_fetch(&sh->answering, 1, __ATOMIC_ACQ_REL);
        __atomic_store_n(&sh->last_active, now_ns(), __ATOMIC_RELEASE);
        t->holds = 1;
        t->cur_id = (int64_t)n->id;
        t->cur_pid = n->pid;
        t->busy_since = now_ns();
        int rc = DVB_NOTIF;
        if (n->nr == sh->nr_ioctl)
            rc = answer_ioctl(t, n);
        else if (n->nr == sh->nr_open || n->nr == sh->nr_openat || n->nr == sh->nr_openat2)
            rc = answer_open(t, n);
        else if (n->nr == sh->nr_mmap)
            rc = answer_mmap(t, n);
        t->busy_since = 0;
        if (rc == DVB_LATE)
            t->abandoned = 0;
        if (rc != 0)
            return t->last_rc = rc; /* (still counted: the Python listener answers it) */
        answered_all(t);
        handled++;
        t->spin_until = now_ns() + sh->spin_ns;
    }
}
