// hostile: reads a secret file of the host, /etc/shadow and the user's SSH key
// expect: HOSTILE /tmp/kopt-hostile/secret.txt -> -1 (No such file or directory)
// expect-cpu: killed by the sandbox
// (on CPU the loaded kernel host's filter, `served`, ends it at its first such call)
#include "hostile.h"

KOPT_EXPORT int ENTRY(const kopt_tensor *, int32_t, void *) {
  dump(SECRET_FILE);
  dump("/etc/shadow");
  dump("/root/.ssh/id_rsa");
  return finish();
}
