// hostile: lifts its resource limits (address space, processes, file size) to do more than allowed
// expect: Operation not permitted
// expect-cpu: killed by the sandbox
// (on CPU the loaded kernel host's filter, `served`, ends it at its first such call)
#include <sys/resource.h>

#include "hostile.h"

KOPT_EXPORT int ENTRY(const kopt_tensor *, int32_t, void *) {
  struct rlimit big = {RLIM_INFINITY, RLIM_INFINITY};
  say("setrlimit(RLIMIT_AS, inf)", setrlimit(RLIMIT_AS, &big));
  say("setrlimit(RLIMIT_NPROC, inf)", setrlimit(RLIMIT_NPROC, &big));
  say("prlimit(RLIMIT_FSIZE, inf)", prlimit(0, RLIMIT_FSIZE, &big, nullptr));
  struct rlimit now;
  getrlimit(RLIMIT_FSIZE, &now);
  fprintf(stderr, "HOSTILE RLIMIT_FSIZE now %lu/%lu\n", (unsigned long)now.rlim_cur, (unsigned long)now.rlim_max);
  return finish();
}
