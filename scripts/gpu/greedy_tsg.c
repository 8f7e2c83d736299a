/* A greedy tenant for scripts/gpu/compute_shares.sh part (d) (issue 15): preloaded into an
 * unmodified CUDA process, it turns CUDA's own NVA06C_CTRL_CMD_SET_TIMESLICE (2048 us on its
 * compute channel group) into a request for GREEDY_US, keeps rewriting the parameter from a
 * second thread while the call is in flight (the racing-thread attack: a supervisor that let
 * the kernel re-read the argument would be beaten), then asks for the HIGH interleave level
 * on the same group and reads the timeslice back. Every step is logged to stderr.
 *
 *   gcc -O2 -shared -fPIC -o greedy_tsg.so greedy_tsg.c -lpthread
 *   LD_PRELOAD=./greedy_tsg.so python3 compute_workload.py matmul ...
 *
 * GREEDY_US sets the timeslice asked (default 1 s); GREEDY_LEVEL the interleave level asked
 * (0 LOW, 1 MEDIUM, 2 HIGH: the default; "none": leave the level alone). The sweep in
 * scripts/gpu/compute_sweep.sh uses it to set chosen slices in plain processes.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/ioctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#define NV_ESC_RM_CONTROL 0x2a
#define SET_TIMESLICE 0xa06c0103u
#define GET_TIMESLICE 0xa06c0104u
#define SET_INTERLEAVE_LEVEL 0xa06c0107u
#define LEVEL_HIGH 2u

struct nvos54 { /* NVOS54_PARAMETERS, 32 bytes */
  uint32_t hClient, hObject, cmd, flags;
  uint64_t params;
  uint32_t paramsSize, status;
};

static uint64_t greedy_us = 1000000;
static volatile int racing;
static int hooked;

static void *flip(void *p) {
  volatile uint64_t *ts = p;
  while (racing) *ts = greedy_us;
  return NULL;
}

static long control(int fd, unsigned long req, struct nvos54 *base, uint32_t cmd, void *p,
                    uint32_t size) {
  struct nvos54 c = *base;
  c.cmd = cmd; c.params = (uintptr_t)p; c.paramsSize = size; c.status = 0;
  long rc = syscall(SYS_ioctl, fd, req, &c);
  return rc < 0 ? rc : (long)c.status;
}

int ioctl(int fd, unsigned long req, ...) {
  va_list ap;
  va_start(ap, req);
  void *arg = va_arg(ap, void *);
  va_end(ap);
  if (_IOC_TYPE(req) == 'F' && _IOC_NR(req) == NV_ESC_RM_CONTROL && _IOC_SIZE(req) == 32) {
    struct nvos54 *c = arg;
    if (c->cmd == SET_TIMESLICE && c->paramsSize == 8 && c->params) {
      const char *env = getenv("GREEDY_US");
      if (env) greedy_us = strtoull(env, NULL, 0);
      uint64_t *ts = (uint64_t *)(uintptr_t)c->params;
      uint64_t cuda_asked = *ts;
      *ts = greedy_us;
      racing = 1;
      pthread_t th;
      int threaded = pthread_create(&th, NULL, flip, ts) == 0;
      long rc = syscall(SYS_ioctl, fd, req, arg);
      racing = 0;
      if (threaded) pthread_join(th, NULL);
      hooked++;
      fprintf(stderr, "greedy: group %#x: CUDA asked %llu us, greedy asked %llu us (racing "
              "thread %s): ioctl %ld, status %#x\n", c->hObject,
              (unsigned long long)cuda_asked, (unsigned long long)greedy_us,
              threaded ? "on" : "off", rc, c->status);
      const char *lenv = getenv("GREEDY_LEVEL");
      if (!lenv || lenv[0] != 'n') {
        uint32_t level = lenv ? (uint32_t)strtoul(lenv, NULL, 0) : LEVEL_HIGH;
        fprintf(stderr, "greedy: SET_INTERLEAVE_LEVEL %u: %#lx\n", level,
                control(fd, req, c, SET_INTERLEAVE_LEVEL, &level, sizeof level));
      }
      uint64_t got = 0;
      long st = control(fd, req, c, GET_TIMESLICE, &got, sizeof got);
      fprintf(stderr, "greedy: GET_TIMESLICE: status %#lx, %llu us\n", st,
              (unsigned long long)got);
      return (int)rc;
    }
  }
  return (int)syscall(SYS_ioctl, fd, req, arg);
}

__attribute__((destructor)) static void report(void) {
  if (hooked) fprintf(stderr, "greedy: %d SET_TIMESLICE call(s) hooked\n", hooked);
}
