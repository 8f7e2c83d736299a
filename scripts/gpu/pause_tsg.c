/* An experiment for issue 15 (scripts/gpu/pause_probe.sh): can an unprivileged caller stop
 * a busy CUDA process's channel groups with NVA06C_CTRL_CMD_GPFIFO_SCHEDULE {bEnable = 0},
 * and start them again with {bEnable = 1}, and does the process survive it? Preloaded into
 * an unmodified CUDA process, it notes each channel group CUDA enables (its own
 * GPFIFO_SCHEDULE bEnable=1 calls: fd, client, group), and a thread that has dropped every
 * capability (capset on itself: the driver checks the calling thread, as the broker's
 * listener threads) disables them all at PAUSE_AT and enables them again at RESUME_AT
 * (epoch seconds, environment). Every step is logged to stderr with its time.
 * PAUSE_MODE=channels instead disables the channels CUDA allocated (HOPPER_CHANNEL_GPFIFO_A,
 * noted from its RM_ALLOCs) with NV2080_CTRL_CMD_FIFO_DISABLE_CHANNELS on its subdevice.
 * PAUSE_MODE=escape disables the channels so, and 2 s later sends the process's own
 * GPFIFO_SCHEDULE {bEnable = 1} on each of its groups — what a tenant the broker stopped
 * (preemption, turns) may send — to see whether that lets its work run again.
 *
 *   gcc -O2 -shared -fPIC -o pause_tsg.so pause_tsg.c -lpthread
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#include <linux/capability.h>

#define NV_ESC_RM_CONTROL 0x2a
#define GPFIFO_SCHEDULE 0xa06c0101u
#define NV_ESC_RM_ALLOC 0x2b
#define DISABLE_CHANNELS 0x2080110bu
#define CHANNEL_CLASS 0xc86fu /* HOPPER_CHANNEL_GPFIFO_A */
#define SUBDEVICE_CLASS 0x2080u

struct disable_channels { /* NV2080_CTRL_FIFO_DISABLE_CHANNELS_PARAMS, 536 bytes */
  uint8_t bDisable, pad0[3]; uint32_t numChannels; uint8_t bOnlyDisableScheduling, bRewindGpPut,
  pad1[6]; uint64_t pRunlistPreemptEvent; uint32_t hClientList[64], hChannelList[64];
};
static uint32_t chan_client[64], chan_handle[64];
static int nchan;
static int nsubs;

struct group { int fd; unsigned long req; uint32_t client, handle; };
struct nvos54 { uint32_t hClient, hObject, cmd, flags; uint64_t params; uint32_t paramsSize, status; };
static struct group groups[32];
static struct group subs[8]; /* subdevices CUDA allocated: the fd of their client, and handle */
static int ngroups;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int started;

static double now(void) { struct timespec t; clock_gettime(CLOCK_REALTIME, &t); return t.tv_sec + t.tv_nsec / 1e9; }

static void sleep_until(double at) {
  double d;
  while ((d = at - now()) > 0) usleep(d > 0.1 ? 100000 : (useconds_t)(d * 1e6));
}

static void schedule_all(uint8_t enable) {
  pthread_mutex_lock(&lock);
  for (int i = 0; i < ngroups; i++) {
    uint8_t p[3] = {enable, 0, 0};
    struct nvos54 c = {groups[i].client, groups[i].handle, GPFIFO_SCHEDULE, 0,
                       (uintptr_t)p, sizeof p, 0};
    double t0 = now();
    long rc = syscall(SYS_ioctl, groups[i].fd, groups[i].req, &c);
    fprintf(stderr, "pause: %.3f group %#x bEnable=%u: ioctl %ld status %#x (%.1f us)\n", t0,
            groups[i].handle, enable, rc, c.status, (now() - t0) * 1e6);
  }
  pthread_mutex_unlock(&lock);
}

static void channels_all(uint8_t disable) {
  pthread_mutex_lock(&lock);
  struct disable_channels p;
  memset(&p, 0, sizeof p);
  p.bDisable = disable;
  p.numChannels = (uint32_t)nchan;
  for (int i = 0; i < nchan; i++) { p.hClientList[i] = chan_client[i]; p.hChannelList[i] = chan_handle[i]; }
  struct group *sub = NULL;
  for (int i = 0; i < nsubs; i++)
    if (nchan && subs[i].client == chan_client[0]) sub = &subs[i];
  struct nvos54 c = {sub ? sub->client : 0, sub ? sub->handle : 0, DISABLE_CHANNELS, 0,
                     (uintptr_t)&p, sizeof p, 0};
  double t0 = now();
  long rc = sub ? syscall(SYS_ioctl, sub->fd, sub->req, &c) : -1;
  fprintf(stderr, "pause: %.3f DISABLE_CHANNELS bDisable=%u on %d channel(s) of subdevice %#x: "
          "ioctl %ld status %#x (%.1f us)\n", t0, disable, nchan, sub ? sub->handle : 0, rc,
          c.status, (now() - t0) * 1e6);
  pthread_mutex_unlock(&lock);
}

static void *pauser(void *unused) {
  (void)unused;
  struct __user_cap_header_struct h = {_LINUX_CAPABILITY_VERSION_3, 0};
  struct __user_cap_data_struct d[2];
  memset(d, 0, sizeof d);
  long cr = syscall(SYS_capset, &h, d); /* this thread only */
  const char *pa = getenv("PAUSE_AT"), *ra = getenv("RESUME_AT");
  if (!pa || !ra) return NULL;
  fprintf(stderr, "pause: thread capabilities dropped: capset %ld\n", cr);
  const char *mode = getenv("PAUSE_MODE");
  int escape = mode && !strcmp(mode, "escape");
  int channels = escape || (mode && !strcmp(mode, "channels"));
  sleep_until(atof(pa));
  if (channels) channels_all(1); else schedule_all(0);
  fprintf(stderr, "pause: %.3f paused %d group(s) / %d channel(s)\n", now(), ngroups, nchan);
  if (escape) {
    sleep_until(atof(pa) + 2);
    schedule_all(1);
    fprintf(stderr, "pause: %.3f the process's own GPFIFO_SCHEDULE bEnable=1 on %d group(s)\n",
            now(), ngroups);
  }
  sleep_until(atof(ra));
  if (channels) channels_all(0); else schedule_all(1);
  fprintf(stderr, "pause: %.3f resumed\n", now());
  return NULL;
}

int ioctl(int fd, unsigned long req, ...) {
  va_list ap;
  va_start(ap, req);
  void *arg = va_arg(ap, void *);
  va_end(ap);
  long rc = syscall(SYS_ioctl, fd, req, arg);
  if (_IOC_TYPE(req) == 'F' && _IOC_NR(req) == NV_ESC_RM_ALLOC && rc == 0 &&
      (_IOC_SIZE(req) == 48 || _IOC_SIZE(req) == 32)) {
    uint32_t *v = arg;
    uint32_t status = _IOC_SIZE(req) == 48 ? v[10] : v[7];
    if (status == 0 && v[3] == CHANNEL_CLASS) {
      pthread_mutex_lock(&lock);
      if (nchan < 64) { chan_client[nchan] = v[0]; chan_handle[nchan] = v[2]; nchan++; }
      pthread_mutex_unlock(&lock);
    } else if (status == 0 && v[3] == SUBDEVICE_CLASS) {
      pthread_mutex_lock(&lock);
      if (nsubs < 8)
        subs[nsubs++] = (struct group){fd, _IOC(_IOC_READ | _IOC_WRITE, 'F', NV_ESC_RM_CONTROL, 32),
                                       v[0], v[2]};
      pthread_mutex_unlock(&lock);
    }
  }
  if (_IOC_TYPE(req) == 'F' && _IOC_NR(req) == NV_ESC_RM_CONTROL && _IOC_SIZE(req) == 32) {
    struct nvos54 *c = arg;
    if (c->cmd == GPFIFO_SCHEDULE && c->paramsSize >= 1 && c->params && rc == 0 &&
        c->status == 0 && *(uint8_t *)(uintptr_t)c->params == 1) {
      pthread_mutex_lock(&lock);
      if (ngroups < 32)
        groups[ngroups++] = (struct group){fd, req, c->hClient, c->hObject};
      int start = !started;
      started = 1;
      pthread_mutex_unlock(&lock);
      fprintf(stderr, "pause: CUDA enabled group %#x (client %#x, fd %d)\n", c->hObject,
              c->hClient, fd);
      if (start) {
        pthread_t th;
        pthread_create(&th, NULL, pauser, NULL);
        pthread_detach(th);
      }
    }
  }
  return (int)rc;
}
