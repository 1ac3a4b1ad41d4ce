// hostile: tells the judge from production by its uid (the jail's is 65534), asked through libc's own
// syscall() reached from an allowed import's address, as a red team's kernel did (2026-11-26: it then
// computed one row outside the jail and passed every check, 1.17x "faster"). It passes the static checks;
// on CPU the loaded kernel host's filter (containment/seccomp.py, `served`) ends it at the question.
// expect: killed by the sandbox
// static: none
// targets: cpu
#include "hostile_libc.h"

KOPT_EXPORT int ENTRY(const kopt_tensor *, int32_t, void *) {
  long uid = sys3(102 /* getuid */, 0, 0, 0);
  char msg[32] = "HOSTILE uid ";
  int n = 12;
  char digits[20];
  int k = 0;
  do {
    digits[k++] = (char)('0' + uid % 10);
    uid /= 10;
  } while (uid > 0);
  while (k) msg[n++] = digits[--k];
  msg[n++] = '\n';
  sys3(1 /* write */, 2, (long)msg, n);
  __builtin_trap();
  return 0;
}
