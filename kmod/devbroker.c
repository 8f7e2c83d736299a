// SPDX-License-Identifier: GPL-2.0
/*
 * devbroker: NVIDIA-style character devices (nvidiactl, nvidiaN, nvidia-uvm,
 * nvidia-uvm-tools) whose every open, ioctl and mmap is decided by a user-space
 * broker reading requests from /dev/devbroker-ctl. The broker replies with bytes,
 * denies with an errno, or says "pass": the module then performs the call on the
 * real driver's file, in the caller's own context. Design: docs/kmod.md.
 */
#include <linux/cdev.h>
#include <linux/cgroup.h>
#include <linux/completion.h>
#include <linux/cred.h>
#include <linux/device.h>
#include <linux/file.h>
#include <linux/fs.h>
#include <linux/miscdevice.h>
#include <linux/mm.h>
#include <linux/mman.h>
#include <linux/module.h>
#include <linux/pid_namespace.h>
#include <linux/poll.h>
#include <linux/slab.h>
#include <linux/uaccess.h>
#include <linux/version.h>

#include "devbroker_proto.h"

static int major; /* 0: dynamic; the real driver owns 195 where it is loaded */
module_param(major, int, 0444);
MODULE_PARM_DESC(major, "major of the control and GPU nodes (0: dynamic)");
static int uvm_major;
module_param(uvm_major, int, 0444);
MODULE_PARM_DESC(uvm_major, "major of the UVM nodes (0: dynamic)");
static int gpus = 1;
module_param(gpus, int, 0444);
MODULE_PARM_DESC(gpus, "number of GPU nodes <prefix>0..N-1 (at most 32)");
static char *prefix = "nvidia";
module_param(prefix, charp, 0444);
MODULE_PARM_DESC(prefix, "node names: <prefix>ctl, <prefix>N, <prefix>-uvm, <prefix>-uvm-tools");
static unsigned int timeout_ms = 10000;
module_param(timeout_ms, uint, 0644);
MODULE_PARM_DESC(timeout_ms, "how long a tenant call waits for a verdict");

#define CTL_MINOR 255
#define MAX_GPUS 32
#define NODE_MINORS 256
#define UVM_MINORS 2

/* private_data of a tenant file */
struct dbk_file {
	u64 id;
	u64 generation; /* the broker instance that accepted the open */
	u32 node, minor;
	struct file *real; /* after OPEN PASS: the real driver's file */
};

/* One tenant call (or a RELEASE notification) travelling to the broker and back. */
struct dbk_req {
	struct list_head link; /* on dbk_queue, then dbk_sent; under dbk_lock */
	u64 id;
	u16 op;
	bool notify; /* RELEASE: freed once read, no verdict */
	bool done;   /* verdict (or broker death) recorded; under dbk_lock */
	u32 arg_size;
	struct devbroker_request *rec; /* the record; the reader takes it */
	size_t rec_len;
	/* the verdict */
	u16 verdict;
	u32 error;
	s64 result;
	u64 offset;
	void *data;
	u32 data_size;
	struct file *vfile; /* the verdict's fd, resolved in the broker's fd table */
	struct completion completion;
};

/*
 * One spinlock guards the broker state and both lists; every wait happens outside
 * it. A request is freed only by its waiting caller (or by the reader, for
 * notifications), and only after it has been unlinked under the lock, so the
 * control side never touches a request its caller has given up on.
 */
static DEFINE_SPINLOCK(dbk_lock);
static LIST_HEAD(dbk_queue); /* not yet read by the broker */
static LIST_HEAD(dbk_sent);  /* read, waiting for a verdict */
static DECLARE_WAIT_QUEUE_HEAD(dbk_ctl_wq);
static struct file *dbk_broker; /* the open control file; NULL: no broker */
static struct pid_namespace *dbk_pidns;
static struct user_namespace *dbk_userns;
static u64 dbk_generation; /* bumped at every broker connect */
static u64 dbk_next_id;
static atomic64_t dbk_next_file = ATOMIC64_INIT(0);

static dev_t node_base, uvm_base;
static struct cdev node_cdev, uvm_cdev;
static struct class *dbk_class;

static void dbk_req_free(struct dbk_req *r)
{
	kfree(r->rec);
	kfree(r->data);
	if (r->vfile)
		fput(r->vfile);
	kfree(r);
}

static struct dbk_req *dbk_req_new(u16 op, struct dbk_file *f, u32 arg_size)
{
	struct dbk_req *r = kzalloc(sizeof(*r), GFP_KERNEL);
	struct devbroker_request *rec;

	if (!r)
		return NULL;
	r->rec_len = sizeof(*rec) + arg_size;
	rec = r->rec = kzalloc(r->rec_len, GFP_KERNEL);
	if (!rec) {
		kfree(r);
		return NULL;
	}
	r->op = op;
	r->arg_size = arg_size;
	r->notify = op == DEVBROKER_OP_RELEASE;
	init_completion(&r->completion);
	rec->magic = DEVBROKER_REQ_MAGIC;
	rec->version = DEVBROKER_PROTO_VERSION;
	rec->op = op;
	rec->file_id = f->id;
	rec->node = f->node;
	rec->minor = f->minor;
	rec->arg_size = arg_size;
	rec->pidns_ino = task_active_pid_ns(current)->ns.inum;
#ifdef CONFIG_CGROUPS
	rcu_read_lock();
	rec->cgroup_id = cgroup_id(task_dfl_cgroup(current));
	rcu_read_unlock();
#endif
	return r;
}

/* Under dbk_lock with a broker present: ids as the broker's namespaces see them. */
static void dbk_fill_identity(struct devbroker_request *rec)
{
	rec->pid = task_pid_nr_ns(current, dbk_pidns);
	rec->tgid = task_tgid_nr_ns(current, dbk_pidns);
	rec->uid = from_kuid_munged(dbk_userns, current_euid());
	rec->gid = from_kgid_munged(dbk_userns, current_egid());
}

/*
 * Send r and wait for its verdict. Returns 0 with the verdict in r, or -errno:
 * ENODEV (open with no broker), EIO (no broker, a file of a dead broker, or the
 * broker died while the call was pending), ETIMEDOUT, EINTR (fatal signal).
 * The caller keeps ownership of r in every case.
 */
static int dbk_call(struct dbk_req *r, struct dbk_file *f)
{
	long left;
	int err = 0;

	spin_lock(&dbk_lock);
	if (!dbk_broker) {
		spin_unlock(&dbk_lock);
		return r->op == DEVBROKER_OP_OPEN ? -ENODEV : -EIO;
	}
	if (r->op == DEVBROKER_OP_OPEN)
		f->generation = dbk_generation;
	else if (f->generation != dbk_generation) {
		/* opened under a broker that has died: its session is gone */
		spin_unlock(&dbk_lock);
		return -EIO;
	}
	r->id = r->rec->id = ++dbk_next_id;
	dbk_fill_identity(r->rec);
	list_add_tail(&r->link, &dbk_queue);
	spin_unlock(&dbk_lock);
	wake_up_interruptible(&dbk_ctl_wq);

	/* Killable, not interruptible: an ordinary signal must not fail a driver call
	 * (CUDA does not expect EINTR from ioctl), but a killed tenant must not wait. */
	left = wait_for_completion_killable_timeout(&r->completion,
						    msecs_to_jiffies(timeout_ms));
	spin_lock(&dbk_lock);
	if (!r->done) {
		/* Gave up first. A verdict arriving later finds no request (ENOENT). */
		list_del(&r->link);
		r->done = true;
		err = left < 0 ? -EINTR : -ETIMEDOUT;
	} else if (!r->verdict) {
		err = -EIO; /* the broker died with the call pending */
	}
	spin_unlock(&dbk_lock);
	return err;
}

/* Queue a RELEASE notification; dropped when there is no broker (or a new one). */
static void dbk_notify_release(struct dbk_file *f)
{
	struct dbk_req *r = dbk_req_new(DEVBROKER_OP_RELEASE, f, 0);

	if (!r)
		return;
	spin_lock(&dbk_lock);
	if (dbk_broker && f->generation == dbk_generation) {
		r->id = r->rec->id = ++dbk_next_id;
		dbk_fill_identity(r->rec);
		list_add_tail(&r->link, &dbk_queue);
		r = NULL;
	}
	spin_unlock(&dbk_lock);
	if (r)
		dbk_req_free(r);
	else
		wake_up_interruptible(&dbk_ctl_wq);
}

/* ---- tenant nodes ---------------------------------------------------------- */

static int node_open(struct inode *inode, struct file *file)
{
	unsigned int minor = iminor(inode);
	struct dbk_file *f;
	struct dbk_req *r;
	int err;

	f = kzalloc(sizeof(*f), GFP_KERNEL);
	if (!f)
		return -ENOMEM;
	if (imajor(inode) == MAJOR(uvm_base)) {
		f->node = minor ? DEVBROKER_NODE_UVM_TOOLS : DEVBROKER_NODE_UVM;
	} else if (minor == CTL_MINOR) {
		f->node = DEVBROKER_NODE_CTL;
	} else if (minor < gpus) {
		f->node = DEVBROKER_NODE_GPU;
		f->minor = minor;
	} else {
		kfree(f);
		return -ENXIO;
	}
	f->id = atomic64_inc_return(&dbk_next_file);

	r = dbk_req_new(DEVBROKER_OP_OPEN, f, 0);
	if (!r) {
		kfree(f);
		return -ENOMEM;
	}
	r->rec->flags = file->f_flags;
	err = dbk_call(r, f);
	if (!err && r->verdict == DEVBROKER_DENY)
		err = -r->error;
	if (!err && r->verdict == DEVBROKER_PASS) {
		/* Open the node the broker named, again, here: the driver's open runs
		 * in the tenant's context with the tenant's credentials and flags. */
		struct file *real = dentry_open(&r->vfile->f_path,
						file->f_flags & ~(O_CREAT | O_EXCL | O_TRUNC),
						current_cred());
		if (IS_ERR(real)) {
			err = PTR_ERR(real);
			dbk_notify_release(f); /* the broker counted this open */
		} else {
			f->real = real;
		}
	}
	dbk_req_free(r);
	if (err) {
		kfree(f);
		return err;
	}
	file->private_data = f;
	return stream_open(inode, file);
}

static int node_release(struct inode *inode, struct file *file)
{
	struct dbk_file *f = file->private_data;

	dbk_notify_release(f);
	if (f->real)
		fput(f->real);
	kfree(f);
	return 0;
}

static long node_ioctl(struct file *file, unsigned int cmd, unsigned long arg)
{
	struct dbk_file *f = file->private_data;
	void __user *uarg = (void __user *)arg;
	u32 size = _IOC_TYPE(cmd) == DEVBROKER_ARG_TYPE ? _IOC_SIZE(cmd) : 0;
	struct dbk_req *r;
	long ret;

	r = dbk_req_new(DEVBROKER_OP_IOCTL, f, size);
	if (!r)
		return -ENOMEM;
	r->rec->cmd = cmd;
	r->rec->arg = arg;
	/* The only copy of the argument the broker decides on: read once, here. */
	if (size && copy_from_user(r->rec + 1, uarg, size)) {
		dbk_req_free(r);
		return -EFAULT;
	}
	ret = dbk_call(r, f);
	if (ret)
		goto out;
	switch (r->verdict) {
	case DEVBROKER_DENY:
		ret = -r->error;
		break;
	case DEVBROKER_REPLY:
		if (r->data_size && copy_to_user(uarg, r->data, r->data_size))
			ret = -EFAULT;
		else
			ret = r->result;
		break;
	case DEVBROKER_PASS:
		/* Write back what the broker decided (it may have rewritten fields),
		 * then let the driver do its own copy in the tenant's context. */
		if (!f->real)
			ret = -EIO;
		else if (r->data_size && copy_to_user(uarg, r->data, r->data_size))
			ret = -EFAULT;
		else if (!f->real->f_op->unlocked_ioctl)
			ret = -ENOTTY;
		else
			ret = f->real->f_op->unlocked_ioctl(f->real, cmd, arg);
		break;
	}
out:
	dbk_req_free(r);
	return ret;
}

static int node_mmap(struct file *file, struct vm_area_struct *vma)
{
	struct dbk_file *f = file->private_data;
	struct file *target = NULL;
	struct dbk_req *r;
	int ret;

	/* Called with the tenant's mmap_lock held for writing: the broker must not
	 * read this process's memory while answering (it would wait for us). */
	r = dbk_req_new(DEVBROKER_OP_MMAP, f, 0);
	if (!r)
		return -ENOMEM;
	r->rec->offset = (u64)vma->vm_pgoff << PAGE_SHIFT;
	r->rec->length = vma->vm_end - vma->vm_start;
	r->rec->cmd = (vma->vm_flags & VM_READ ? PROT_READ : 0) |
		      (vma->vm_flags & VM_WRITE ? PROT_WRITE : 0) |
		      (vma->vm_flags & VM_EXEC ? PROT_EXEC : 0);
	r->rec->flags = vma->vm_flags & VM_SHARED ? DEVBROKER_MMAP_SHARED : 0;
	ret = dbk_call(r, f);
	if (ret)
		goto out;
	if (r->verdict == DEVBROKER_DENY) {
		ret = -r->error;
		goto out;
	}
	if (r->verdict == DEVBROKER_REPLY) {
		target = r->vfile; /* the broker's memory file */
		vma->vm_pgoff = r->offset >> PAGE_SHIFT;
	} else {
		target = f->real;
	}
	if (!target || !target->f_op->mmap) {
		ret = -ENODEV;
		goto out;
	}
	/* Make the mapping the target's own (as overlayfs does): later faults and
	 * the vma's file reference no longer involve this module. */
	vma_set_file(vma, target);
	ret = call_mmap(target, vma);
out:
	dbk_req_free(r);
	return ret;
}

static __poll_t node_poll(struct file *file, poll_table *wait)
{
	struct dbk_file *f = file->private_data;

	/* Driver events (RM OS events) exist only on passed files; emulated files
	 * have none, so a poll simply waits for its timeout. */
	if (f->real)
		return vfs_poll(f->real, wait);
	return 0;
}

static const struct file_operations node_fops = {
	.owner = THIS_MODULE,
	.open = node_open,
	.release = node_release,
	.unlocked_ioctl = node_ioctl,
	.mmap = node_mmap,
	.poll = node_poll,
	.llseek = no_llseek,
};

/* ---- control device -------------------------------------------------------- */

static int ctl_open(struct inode *inode, struct file *file)
{
	if (!capable(CAP_SYS_ADMIN))
		return -EPERM;
	spin_lock(&dbk_lock);
	if (dbk_broker) {
		spin_unlock(&dbk_lock);
		return -EBUSY; /* one broker at a time */
	}
	dbk_broker = file;
	dbk_generation++;
	dbk_pidns = get_pid_ns(task_active_pid_ns(current));
	dbk_userns = file->f_cred->user_ns; /* pinned by the file's cred */
	spin_unlock(&dbk_lock);
	return stream_open(inode, file);
}

/* The broker is gone (exited, crashed or closed): fail everything at once. */
static int ctl_release(struct inode *inode, struct file *file)
{
	struct dbk_req *r, *tmp;
	struct pid_namespace *ns;
	LIST_HEAD(dead);

	spin_lock(&dbk_lock);
	dbk_broker = NULL;
	ns = dbk_pidns;
	dbk_pidns = NULL;
	dbk_userns = NULL;
	list_splice_init(&dbk_sent, &dead);
	list_splice_tail_init(&dbk_queue, &dead);
	list_for_each_entry_safe(r, tmp, &dead, link) {
		list_del(&r->link);
		if (r->notify) {
			kfree(r->rec);
			kfree(r);
			continue;
		}
		r->done = true; /* verdict 0: dbk_call reports EIO */
		complete(&r->completion);
	}
	spin_unlock(&dbk_lock);
	put_pid_ns(ns);
	return 0;
}

static ssize_t ctl_read(struct file *file, char __user *buf, size_t count, loff_t *ppos)
{
	struct devbroker_request *rec;
	struct dbk_req *r;
	size_t len;
	u64 id;
	int err;

	if (count < DEVBROKER_READ_SIZE)
		return -EINVAL;
	spin_lock(&dbk_lock);
	while (list_empty(&dbk_queue)) {
		spin_unlock(&dbk_lock);
		if (file->f_flags & O_NONBLOCK)
			return -EAGAIN;
		err = wait_event_interruptible(dbk_ctl_wq, !list_empty(&dbk_queue));
		if (err)
			return err;
		spin_lock(&dbk_lock);
	}
	r = list_first_entry(&dbk_queue, struct dbk_req, link);
	list_del(&r->link);
	rec = r->rec;
	len = r->rec_len;
	id = r->id;
	r->rec = NULL;
	if (r->notify)
		kfree(r);
	else
		list_add_tail(&r->link, &dbk_sent);
	spin_unlock(&dbk_lock);

	if (copy_to_user(buf, rec, len)) {
		/* A bad buffer must not lose a call: requeue it if still pending. */
		spin_lock(&dbk_lock);
		list_for_each_entry(r, &dbk_sent, link) {
			if (r->id == id) {
				r->rec = rec;
				rec = NULL;
				list_move(&r->link, &dbk_queue);
				break;
			}
		}
		spin_unlock(&dbk_lock);
		kfree(rec);
		return -EFAULT;
	}
	kfree(rec);
	return len;
}

/* Is verdict v acceptable for request r? */
static bool verdict_fits(const struct dbk_req *r, const struct devbroker_verdict *v)
{
	bool wants_fd = (r->op == DEVBROKER_OP_OPEN && v->verdict == DEVBROKER_PASS) ||
			(r->op == DEVBROKER_OP_MMAP && v->verdict == DEVBROKER_REPLY);

	if (v->data_size > r->arg_size || wants_fd != (v->fd >= 0))
		return false;
	if (r->op == DEVBROKER_OP_MMAP && !PAGE_ALIGNED(v->offset))
		return false;
	return true;
}

static ssize_t ctl_write(struct file *file, const char __user *buf, size_t count, loff_t *ppos)
{
	struct devbroker_verdict v;
	struct file *vfile = NULL;
	void *data = NULL;
	struct dbk_req *r;
	ssize_t ret = -ENOENT;

	if (count < sizeof(v))
		return -EINVAL;
	if (copy_from_user(&v, buf, sizeof(v)))
		return -EFAULT;
	if (v.magic != DEVBROKER_VERDICT_MAGIC || v.version != DEVBROKER_PROTO_VERSION ||
	    v.data_size > DEVBROKER_MAX_ARG || count != sizeof(v) + v.data_size)
		return -EINVAL;
	if (v.verdict < DEVBROKER_REPLY || v.verdict > DEVBROKER_PASS ||
	    (v.verdict == DEVBROKER_DENY && (v.error == 0 || v.error >= MAX_ERRNO)) ||
	    (v.verdict == DEVBROKER_REPLY && v.result < 0))
		return -EINVAL;
	if (v.data_size) {
		data = memdup_user(buf + sizeof(v), v.data_size);
		if (IS_ERR(data))
			return PTR_ERR(data);
	}
	if (v.fd >= 0) {
		/* We run in the broker: its fd table. _raw accepts O_PATH fds, which is
		 * all OPEN PASS needs (a path to open again) and lets the broker name a
		 * node without opening the driver itself. An O_PATH file has no mmap, so
		 * MMAP REPLY with one fails cleanly with ENODEV. */
		vfile = fget_raw(v.fd);
		if (!vfile) {
			kfree(data);
			return -EBADF;
		}
	}

	spin_lock(&dbk_lock);
	list_for_each_entry(r, &dbk_sent, link) {
		if (r->id != v.id)
			continue;
		if (!verdict_fits(r, &v)) {
			ret = -EINVAL; /* stays pending: the broker may answer again */
			break;
		}
		list_del(&r->link);
		r->verdict = v.verdict;
		r->error = v.error;
		r->result = v.result;
		r->offset = v.offset;
		r->data = data;
		r->data_size = v.data_size;
		r->vfile = vfile;
		r->done = true;
		complete(&r->completion);
		data = NULL;
		vfile = NULL;
		ret = count;
		break;
	}
	spin_unlock(&dbk_lock);
	kfree(data);
	if (vfile)
		fput(vfile);
	return ret;
}

static __poll_t ctl_poll(struct file *file, poll_table *wait)
{
	__poll_t mask = EPOLLOUT | EPOLLWRNORM;

	poll_wait(file, &dbk_ctl_wq, wait);
	spin_lock(&dbk_lock);
	if (!list_empty(&dbk_queue))
		mask |= EPOLLIN | EPOLLRDNORM;
	spin_unlock(&dbk_lock);
	return mask;
}

static const struct file_operations ctl_fops = {
	.owner = THIS_MODULE,
	.open = ctl_open,
	.release = ctl_release,
	.read = ctl_read,
	.write = ctl_write,
	.poll = ctl_poll,
	.llseek = no_llseek,
};

static struct miscdevice ctl_dev = {
	.minor = MISC_DYNAMIC_MINOR,
	.name = "devbroker-ctl",
	.fops = &ctl_fops,
	.mode = 0600,
};

/* ---- module ---------------------------------------------------------------- */

#if LINUX_VERSION_CODE >= KERNEL_VERSION(6, 2, 0)
static char *dbk_devnode(const struct device *dev, umode_t *mode)
#else
static char *dbk_devnode(struct device *dev, umode_t *mode)
#endif
{
	if (mode)
		*mode = 0666; /* like the real nodes; the broker decides per call */
	return NULL;
}

static int dbk_add_device(dev_t devt, const char *fmt, const char *a, int b)
{
	struct device *d = device_create(dbk_class, NULL, devt, NULL, fmt, a, b);

	return PTR_ERR_OR_ZERO(d);
}

static void dbk_remove_devices(void)
{
	int i;

	device_destroy(dbk_class, MKDEV(MAJOR(node_base), CTL_MINOR));
	for (i = 0; i < gpus; i++)
		device_destroy(dbk_class, MKDEV(MAJOR(node_base), i));
	device_destroy(dbk_class, uvm_base);
	device_destroy(dbk_class, uvm_base + 1);
}

static int __init dbk_init(void)
{
	int err, i;

	if (gpus < 0 || gpus > MAX_GPUS)
		return -EINVAL;
	node_base = MKDEV(major, 0);
	err = major ? register_chrdev_region(node_base, NODE_MINORS, "devbroker")
		    : alloc_chrdev_region(&node_base, 0, NODE_MINORS, "devbroker");
	if (err)
		return err;
	uvm_base = MKDEV(uvm_major, 0);
	err = uvm_major ? register_chrdev_region(uvm_base, UVM_MINORS, "devbroker-uvm")
			: alloc_chrdev_region(&uvm_base, 0, UVM_MINORS, "devbroker-uvm");
	if (err)
		goto err_node_region;
	cdev_init(&node_cdev, &node_fops);
	err = cdev_add(&node_cdev, node_base, NODE_MINORS);
	if (err)
		goto err_uvm_region;
	cdev_init(&uvm_cdev, &node_fops);
	err = cdev_add(&uvm_cdev, uvm_base, UVM_MINORS);
	if (err)
		goto err_node_cdev;
#if LINUX_VERSION_CODE >= KERNEL_VERSION(6, 4, 0)
	dbk_class = class_create("devbroker");
#else
	dbk_class = class_create(THIS_MODULE, "devbroker");
#endif
	if (IS_ERR(dbk_class)) {
		err = PTR_ERR(dbk_class);
		goto err_uvm_cdev;
	}
	dbk_class->devnode = dbk_devnode;
	err = dbk_add_device(MKDEV(MAJOR(node_base), CTL_MINOR), "%sctl", prefix, 0);
	for (i = 0; !err && i < gpus; i++)
		err = dbk_add_device(MKDEV(MAJOR(node_base), i), "%s%d", prefix, i);
	if (!err)
		err = dbk_add_device(uvm_base, "%s-uvm", prefix, 0);
	if (!err)
		err = dbk_add_device(uvm_base + 1, "%s-uvm-tools", prefix, 0);
	if (!err)
		err = misc_register(&ctl_dev);
	if (err)
		goto err_devices;
	pr_info("devbroker: protocol %d, nodes %d:*, uvm %d:*, %d GPU(s)\n",
		DEVBROKER_PROTO_VERSION, MAJOR(node_base), MAJOR(uvm_base), gpus);
	return 0;

err_devices:
	dbk_remove_devices(); /* device_destroy ignores devices never created */
	class_destroy(dbk_class);
err_uvm_cdev:
	cdev_del(&uvm_cdev);
err_node_cdev:
	cdev_del(&node_cdev);
err_uvm_region:
	unregister_chrdev_region(uvm_base, UVM_MINORS);
err_node_region:
	unregister_chrdev_region(node_base, NODE_MINORS);
	return err;
}

/* Runs only when no file of ours is open (fops.owner pins the module), so there is
 * no broker and no pending call: ctl_release has emptied both lists. */
static void __exit dbk_exit(void)
{
	misc_deregister(&ctl_dev);
	dbk_remove_devices();
	class_destroy(dbk_class);
	cdev_del(&uvm_cdev);
	cdev_del(&node_cdev);
	unregister_chrdev_region(uvm_base, UVM_MINORS);
	unregister_chrdev_region(node_base, NODE_MINORS);
}

module_init(dbk_init);
module_exit(dbk_exit);
MODULE_LICENSE("GPL");
MODULE_DESCRIPTION("devbroker: brokered NVIDIA-style device nodes");
