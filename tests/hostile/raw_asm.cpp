// hostile: raw system calls in inline assembly, which no source pattern names: opens the secret file
// expect: HOSTILE asm openat -> -2
// expect-cpu: killed by the sandbox
// (on CPU the loaded kernel host's filter, `served`, ends it at its first such call)
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

#define RAW_LABEL "HOSTILE asm openat -> -"
#include "hostile_raw.h"
