// hostile: raw system calls in inline assembly, which no source pattern names: opens the secret file
// expect: HOSTILE asm openat -> -2
// static: refused (makes system calls itself); run here without the static checks, it shows the jail holds
#include <cstdint>

#include "kopt_abi.h"

#ifndef ENTRY
#define ENTRY kopt_scale2
#endif

static long sys3(long n, long a, long b, long c) {
  long ret;
  asm volatile("syscall" : "=a"(ret) : "a"(n), "D"(a), "S"(b), "d"(c) : "rcx", "r11", "memory");
  return ret;
}

KOPT_EXPORT int ENTRY(const kopt_tensor *, int32_t, void *) {
  static const char path[] = "/tmp/kopt-hostile/secret.txt";
  long fd = sys3(257 /* openat */, -100 /* AT_FDCWD */, (long)path, 0);
  char msg[64] = "HOSTILE asm openat -> -";
  int n = 23;
  long v = fd < 0 ? -fd : fd;
  if (fd >= 0) msg[n - 1] = '+';
  char digits[20];
  int k = 0;
  do {
    digits[k++] = (char)('0' + v % 10);
    v /= 10;
  } while (v);
  while (k) msg[n++] = digits[--k];
  msg[n++] = '\n';
  sys3(1 /* write */, 2, (long)msg, n);
  if (fd >= 0) {
    char buf[128];
    long got = sys3(0 /* read */, fd, (long)buf, sizeof buf);
    if (got > 0) sys3(1, 2, (long)buf, got);
  }
  __builtin_trap();
  return 0;
}
