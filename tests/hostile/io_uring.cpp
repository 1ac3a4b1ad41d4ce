// hostile: sets up an io_uring, whose SOCKET and CONNECT operations get past a filter on socket()
// expect: killed by the sandbox
#include <sys/syscall.h>

#include "hostile.h"

KOPT_EXPORT int ENTRY(const kopt_tensor *, int32_t, void *) {
  char params[120] = {0};  // struct io_uring_params
  long fd = syscall(425 /* io_uring_setup */, 8, params);
  say("io_uring_setup", fd);
  return finish();
}
