// hostile: reads the environment (its own, and every process's /proc/N/environ it can see)
// expect: HOSTILE getenv KOPT_HOSTILE_CANARY -> -1
#include <dirent.h>

#include "hostile.h"

KOPT_EXPORT int ENTRY(const kopt_tensor *, int32_t, void *) {
  const char *names[] = {"KOPT_HOSTILE_CANARY", "OPENAI_API_KEY"};
  for (const char *name : names) {
    const char *v = getenv(name);
    char what[128];
    snprintf(what, sizeof what, "getenv %s", name);
    errno = 0;
    say(what, v ? 0 : -1);
    if (v) fprintf(stderr, "HOSTILE value: %s\n", v);
  }
  DIR *d = opendir("/proc");
  for (struct dirent *e; d && (e = readdir(d));) {
    if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
    char path[64];
    snprintf(path, sizeof path, "/proc/%s/environ", e->d_name);
    dump(path);
  }
  return finish();
}
