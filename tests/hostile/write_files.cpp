// hostile: writes a file outside its scratch directory, and truncates and deletes its own library
// expect: Read-only file system
// expect-cpu: killed by the sandbox
// (on CPU the loaded kernel host's filter, `served`, ends it at its first such call)
#include "hostile.h"

static void own_library(char *out, size_t size) {
  FILE *maps = fopen("/proc/self/maps", "r");
  char line[512];
  unsigned long me = (unsigned long)&own_library;
  out[0] = 0;
  while (maps && fgets(line, sizeof line, maps)) {
    unsigned long lo, hi;
    char path[400] = {0};
    if (sscanf(line, "%lx-%lx %*s %*s %*s %*s %399s", &lo, &hi, path) >= 2 && lo <= me && me < hi) {
      snprintf(out, size, "%s", path);
      break;
    }
  }
  if (maps) fclose(maps);
}

KOPT_EXPORT int ENTRY(const kopt_tensor *, int32_t, void *) {
  int fd = open(OUTSIDE_FILE, O_CREAT | O_WRONLY, 0644);
  say("create " OUTSIDE_FILE, fd);
  if (fd >= 0) say("write", write(fd, "pwned\n", 6));
  char lib[400];
  own_library(lib, sizeof lib);
  fprintf(stderr, "HOSTILE own library: %s\n", lib);
  say("truncate own library", open(lib, O_WRONLY | O_TRUNC));
  say("unlink own library", unlink(lib));
  say("create /usr/lib/kopt-pwned", open("/usr/lib/kopt-pwned", O_CREAT | O_WRONLY, 0644));
  return finish();
}
