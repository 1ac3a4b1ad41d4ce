// hostile: raw system calls through libc's own syscall(), reached from an allowed import's address (the
// offset between them comes from the test): no system-call instruction of its own, nothing imported but
// __errno_location, no probe a source rule names, so it passes every static check; opens the secret file
// expect: HOSTILE via libc openat -> -2
// static: none
#include <cstdint>

#include "kopt_abi.h"

#ifndef ENTRY
#define ENTRY kopt_scale2
#endif
#ifndef LIBC_SYSCALL_OFFSET
#define LIBC_SYSCALL_OFFSET 0  // the test passes syscall's address minus __errno_location's, in libc
#endif

extern "C" int *__errno_location(void) noexcept;
typedef long (*syscall_fn)(long number, ...);

static long sys3(long n, long a, long b, long c) {
  const syscall_fn call = (syscall_fn)((const char *)&__errno_location + (LIBC_SYSCALL_OFFSET));
  const long r = call(n, a, b, c);
  return r < 0 ? -*__errno_location() : r;
}

KOPT_EXPORT int ENTRY(const kopt_tensor *, int32_t, void *) {
  static const char path[] = "/tmp/kopt-hostile/secret.txt";
  long fd = sys3(257 /* openat */, -100 /* AT_FDCWD */, (long)path, 0);
  char msg[64] = "HOSTILE via libc openat -> -";  // (a literal that said "syscall" would be refused)
  int n = 28;
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
