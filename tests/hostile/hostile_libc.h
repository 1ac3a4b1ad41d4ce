// libc's own syscall(), reached from an allowed import's address (the offset between them comes from
// the test, -DLIBC_SYSCALL_OFFSET): no system-call instruction and no import but __errno_location, so the
// candidates that use it (libc_syscall.cpp, judge_uid.cpp) pass every static check. `sys3` returns the
// result, or -errno.
#pragma once
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
