// hostile: raw system calls through libc's own syscall(), reached from an allowed import's address (the
// offset between them comes from the test): no system-call instruction of its own, nothing imported but
// __errno_location, no probe a source rule names, so it passes every static check; opens the secret file
// expect: HOSTILE via libc openat -> -2
// expect-cpu: killed by the sandbox
// (on CPU the loaded kernel host's filter, `served`, ends it at its first such call)
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

#define RAW_LABEL "HOSTILE via libc openat -> -"
#include "hostile_raw.h"
