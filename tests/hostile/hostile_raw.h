// The entry point of the hostile candidates that make raw system calls (libc_syscall.cpp,
// raw_asm.cpp): the including file defines `sys3` (how it reaches the kernel) and RAW_LABEL (what it
// says). Opens the secret file, writes RAW_LABEL and the result (+fd or -errno) to stderr, then the
// file's first bytes if it opened, then crashes. It imports nothing and spells no probe a source rule
// names (a literal that said "syscall" would be refused).
#pragma once

KOPT_EXPORT int ENTRY(const kopt_tensor *, int32_t, void *) {
  static const char path[] = "/tmp/kopt-hostile/secret.txt";
  long fd = sys3(257 /* openat */, -100 /* AT_FDCWD */, (long)path, 0);
  char msg[64] = RAW_LABEL;
  int n = sizeof RAW_LABEL - 1;
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
