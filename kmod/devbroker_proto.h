/* SPDX-License-Identifier: GPL-2.0 OR Apache-2.0 */
/*
 * devbroker control protocol: the one definition of the records exchanged over
 * /dev/devbroker-ctl between the kernel module and the user-space broker.
 *
 * The Python codec (src/devbroker/frontends/kmodwire.py) mirrors this file and
 * tests/test_kmod_proto.py compiles a probe against it to check every size and
 * offset, so change both together and bump DEVBROKER_PROTO_VERSION.
 *
 * All fields are native-endian (the broker runs on the same machine) and every
 * struct is laid out without implicit padding, so the layout is the same for any
 * compiler and for Python's struct module.
 *
 * Flow: a tenant call (open/ioctl/mmap) becomes one request; the broker read(2)s
 * it (one record per read) and write(2)s one verdict naming the request id.
 * RELEASE requests are notifications: they take no verdict.
 */
#ifndef DEVBROKER_PROTO_H
#define DEVBROKER_PROTO_H

#ifdef __KERNEL__
#include <linux/types.h>
#else
#include <linux/types.h>
#include <stdint.h>
#endif

#define DEVBROKER_PROTO_VERSION 1
#define DEVBROKER_REQ_MAGIC 0x51524244u /* "DBRQ" */
#define DEVBROKER_VERDICT_MAGIC 0x44524244u /* "DBRD" */

/* Top-level ioctl argument bytes are copied only for _IOC_TYPE == 'F' (the NVIDIA
 * frontend/RM escapes, whose size is _IOC_SIZE). UVM commands are raw numbers
 * without a size: the broker reads them with process_vm_readv. _IOC_SIZE is at
 * most 16383, so one record never carries more than this. */
#define DEVBROKER_ARG_TYPE 'F'
#define DEVBROKER_MAX_ARG 16384

/* A read(2) buffer of this size always holds a whole request. */
#define DEVBROKER_READ_SIZE (sizeof(struct devbroker_request) + DEVBROKER_MAX_ARG)

/* Node kinds: the values of devbroker.abi.nodes.NodeKind. */
enum devbroker_node {
	DEVBROKER_NODE_CTL = 1,
	DEVBROKER_NODE_GPU = 2,
	DEVBROKER_NODE_UVM = 3,
	DEVBROKER_NODE_UVM_TOOLS = 4,
};

enum devbroker_op {
	DEVBROKER_OP_OPEN = 1,
	DEVBROKER_OP_IOCTL = 2,
	DEVBROKER_OP_MMAP = 3,
	DEVBROKER_OP_RELEASE = 4, /* notification, no verdict */
};

enum devbroker_verdict_kind {
	DEVBROKER_REPLY = 1, /* success; see struct devbroker_verdict */
	DEVBROKER_DENY = 2,  /* fail the call with -error */
	DEVBROKER_PASS = 3,  /* perform the call on the real driver's file */
};

/* devbroker_request.flags for MMAP */
#define DEVBROKER_MMAP_SHARED 0x1u

/*
 * Module -> broker. Followed by arg_size bytes of argument (IOCTL on 'F' commands).
 * Identity fields are translated into the broker's pid and user namespaces
 * (0 / overflow id when not visible there).
 */
struct devbroker_request {
	__u32 magic;     /* DEVBROKER_REQ_MAGIC */
	__u16 version;   /* DEVBROKER_PROTO_VERSION */
	__u16 op;        /* enum devbroker_op */
	__u64 id;        /* unique per request, echoed by the verdict */
	__u64 file_id;   /* unique per open file (never reused while loaded) */
	__u32 pid;       /* thread id of the caller */
	__u32 tgid;      /* its process id */
	__u32 uid;       /* effective uid (what permission checks use) */
	__u32 gid;       /* effective gid */
	__u64 cgroup_id; /* cgroup v2 id of the caller (the container) */
	__u64 pidns_ino; /* inode number of the caller's pid namespace */
	__u32 node;      /* enum devbroker_node */
	__u32 minor;     /* GPU index for GPU nodes, else 0 */
	__u32 flags;     /* OPEN: open(2) flags; MMAP: DEVBROKER_MMAP_* */
	__u32 cmd;       /* IOCTL: the command; MMAP: PROT_* bits */
	__u64 arg;       /* IOCTL: the tenant's argument pointer */
	__u64 offset;    /* MMAP: byte offset (vm_pgoff << PAGE_SHIFT) */
	__u64 length;    /* MMAP: length of the mapping in bytes */
	__u32 arg_size;  /* bytes of argument following this header */
	__u32 reserved;
};

/*
 * Broker -> module. Followed by data_size bytes.
 *
 *  OPEN  REPLY: accept (emulated file).      PASS: fd = broker's fd (O_PATH is
 *        enough) naming the real node; the module opens that path again in the
 *        caller's context with the caller's flags and credentials.
 *  IOCTL REPLY: return result; if data_size > 0, first copy data to the tenant's
 *        argument (data_size <= the request's arg_size).
 *        PASS: if data_size > 0, copy data to the tenant's argument first (the
 *        decided bytes), then call the real file's ioctl in the caller's context.
 *  MMAP  REPLY: map fd (a memfd or any mmap-able file of the broker) from byte
 *        offset "offset" (page aligned) in place of the node.
 *        PASS: map the real file (opened by OPEN PASS).
 *  any   DENY: fail with -error (error > 0).
 */
struct devbroker_verdict {
	__u32 magic;     /* DEVBROKER_VERDICT_MAGIC */
	__u16 version;   /* DEVBROKER_PROTO_VERSION */
	__u16 verdict;   /* enum devbroker_verdict_kind */
	__u64 id;        /* the request's id */
	__s64 result;    /* IOCTL REPLY: ioctl(2)'s return value */
	__u64 offset;    /* MMAP REPLY: byte offset into fd */
	__s32 fd;        /* OPEN PASS / MMAP REPLY: fd in the broker's table, else -1 */
	__u32 error;     /* DENY: positive errno */
	__u32 data_size; /* bytes following this header */
	__u32 reserved;
};

#endif /* DEVBROKER_PROTO_H */
