// hostile: reads the secret file from a static constructor, at library load, before any check runs
// expect: HOSTILE /tmp/kopt-hostile/secret.txt -> -1 (No such file or directory)
#include "hostile.h"

struct AtLoad {
  AtLoad() {
    dump(SECRET_FILE);
    finish();
  }
};
static AtLoad at_load;

KOPT_EXPORT int ENTRY(const kopt_tensor *, int32_t, void *) { return KOPT_OK; }
