// hostile: opens the zygote's memory through /proc and attaches to it with ptrace
// expect: killed by the sandbox
#include <sys/ptrace.h>

#include "hostile.h"

#ifndef TARGET_PID
#define TARGET_PID 1
#endif
#define STR2(x) #x
#define STR(x) STR2(x)

KOPT_EXPORT int ENTRY(const kopt_tensor *, int32_t, void *) {
  say("open /proc/" STR(TARGET_PID) "/mem", open("/proc/" STR(TARGET_PID) "/mem", O_RDWR));
  say("ptrace(ATTACH)", ptrace(PTRACE_ATTACH, TARGET_PID, nullptr, nullptr));
  return finish();
}
