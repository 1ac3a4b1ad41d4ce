// hostile: leaves its process group (setsid) and forks a child that would outlive the harness
// expect: killed by the sandbox
#include <sys/syscall.h>

#include "hostile.h"

KOPT_EXPORT int ENTRY(const kopt_tensor *, int32_t, void *) {
  say("setsid", setsid());
  long pid = syscall(SYS_fork);
  if (pid == 0) {
    for (;;) pause();  // the escapee
  }
  say("fork", pid);
  return finish();
}
