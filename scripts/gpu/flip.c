/* Racing-thread helper for scripts/gpu/race_attacks.py: rewrites `len` bytes at `dst`
 * alternately with `a` and `b` until *stop becomes non-zero. Called through ctypes from a
 * Python thread (ctypes releases the GIL), so it runs truly in parallel with the ioctl the
 * main thread makes. Built on the GPU host by the race script: gcc -O2 -shared -fPIC. */
#include <string.h>

void flip(volatile unsigned char *dst, const unsigned char *a, const unsigned char *b,
          unsigned long len, volatile int *stop)
{
    while (!*stop) {
        for (unsigned long i = 0; i < len; i++) dst[i] = a[i];
        for (volatile int s = 0; s < 64; s++) ;
        for (unsigned long i = 0; i < len; i++) dst[i] = b[i];
        for (volatile int s = 0; s < 64; s++) ;
    }
}
