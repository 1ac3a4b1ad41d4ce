// hostile: raw system calls through libc's own syscall(), reached from an allowed import's address (the
// offset between them comes from the test): no system-call instruction of its own, nothing imported but
// __errno_location, no probe a source rule names, so it passes every static check; opens the secret file
// expect: HOSTILE via libc openat -> -2
// expect-cpu: killed by the sandbox
// (on CPU the loaded kernel host's filter, `served`, ends it at its first such call)
// static: none
#include "hostile_libc.h"

#define RAW_LABEL "HOSTILE via libc openat -> -"
#include "hostile_raw.h"
