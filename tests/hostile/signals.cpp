// hostile: signals the processes above it (its parent, the zygote, the worker) in every way Linux offers
// expect: Operation not permitted
// expect-cpu: killed by the sandbox
// (on CPU the loaded kernel host's filter, `served`, ends it at its first such call)
#include <csignal>
#include <sys/syscall.h>

#include "hostile.h"

#ifndef TARGET_PID
#define TARGET_PID 1
#endif

KOPT_EXPORT int ENTRY(const kopt_tensor *, int32_t, void *) {
  const long targets[] = {TARGET_PID, getppid(), 0};
  for (long pid : targets) {
    char what[96];
    snprintf(what, sizeof what, "kill(%ld, SIGKILL)", pid);
    say(what, kill((pid_t)pid, SIGKILL));
    siginfo_t info = {};
    info.si_signo = SIGKILL;
    info.si_code = -1;  // SI_QUEUE
    snprintf(what, sizeof what, "rt_sigqueueinfo(%ld)", pid);
    say(what, syscall(SYS_rt_sigqueueinfo, pid, SIGKILL, &info));
    snprintf(what, sizeof what, "tgkill(%ld)", pid);
    say(what, syscall(SYS_tgkill, pid, pid, SIGKILL));
    snprintf(what, sizeof what, "pidfd_open(%ld)", pid);
    say(what, syscall(434 /* pidfd_open */, pid, 0));
  }
  return finish();
}
