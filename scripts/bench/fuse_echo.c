/* The floor of the hot-path benchmark (scripts/bench_hotpath.py) and the real backend's
 * stand-in driver node: a libfuse3 server whose every file answers every ioctl at once,
 * leaving the argument as it came (so an NVIDIA RM call comes back with the status the
 * caller put in: NV_OK). Built at run time with gcc against Debian's libfuse3-dev.
 *
 *   fuse_echo MOUNTPOINT -f -s -o allow_other
 *
 * Files: nvidiactl, nvidia0..nvidia7, nvidia-uvm, nvidia-uvm-tools, floor; all 0666 regular
 * files (FUSE serves no character devices). */
#define FUSE_USE_VERSION 35
#include <fuse.h>
#include <errno.h>
#include <string.h>
#include <sys/stat.h>

static const char *names[] = {"nvidiactl", "nvidia0", "nvidia1", "nvidia2", "nvidia3",
                              "nvidia4", "nvidia5", "nvidia6", "nvidia7", "nvidia-uvm",
                              "nvidia-uvm-tools", "floor", NULL};

static int known(const char *path) {
    for (int i = 0; names[i]; i++)
        if (path[0] == '/' && strcmp(path + 1, names[i]) == 0)
            return 1;
    return 0;
}

static int echo_getattr(const char *path, struct stat *st, struct fuse_file_info *fi) {
    (void)fi;
    memset(st, 0, sizeof(*st));
    if (strcmp(path, "/") == 0) {
        st->st_mode = S_IFDIR | 0755;
        st->st_nlink = 2;
        return 0;
    }
    if (!known(path))
        return -ENOENT;
    st->st_mode = S_IFREG | 0666;
    st->st_nlink = 1;
    st->st_size = 1 << 20;
    return 0;
}

static int echo_readdir(const char *path, void *buf, fuse_fill_dir_t fill, off_t off,
                        struct fuse_file_info *fi, enum fuse_readdir_flags flags) {
    (void)off; (void)fi; (void)flags;
    if (strcmp(path, "/") != 0)
        return -ENOENT;
    fill(buf, ".", NULL, 0, 0);
    fill(buf, "..", NULL, 0, 0);
    for (int i = 0; names[i]; i++)
        fill(buf, names[i], NULL, 0, 0);
    return 0;
}

static int echo_open(const char *path, struct fuse_file_info *fi) {
    if (!known(path))
        return -ENOENT;
    fi->direct_io = 1;
    fi->nonseekable = 1;
    return 0;
}

static int echo_read(const char *path, char *buf, size_t size, off_t off,
                     struct fuse_file_info *fi) {
    (void)path; (void)off; (void)fi;
    memset(buf, 0, size); /* mappings of the stand-in read zeros */
    return (int)size;
}

/* The argument is already in `data` (in_size bytes), and what is left there is the reply
 * (out_size bytes): answering is returning. */
static int echo_ioctl(const char *path, unsigned int cmd, void *arg, struct fuse_file_info *fi,
                      unsigned int flags, void *data) {
    (void)path; (void)cmd; (void)arg; (void)fi; (void)flags; (void)data;
    return 0;
}

static const struct fuse_operations ops = {
    .getattr = echo_getattr,
    .readdir = echo_readdir,
    .open = echo_open,
    .read = echo_read,
    .ioctl = echo_ioctl,
};

int main(int argc, char *argv[]) {
    return fuse_main(argc, argv, &ops, NULL);
}
