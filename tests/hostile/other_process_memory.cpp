// hostile: opens the memory of every other process it can see for writing (the judge, whose memory
// holds the key and the references: PID 2; and the baseline's kernel host, whose code it would
// patch: PID 3, started before the candidate's)
// expect: HOSTILE /proc/3/mem -> -1
// expect-cpu: killed by the sandbox
// (on CPU the loaded kernel host's filter, `served`, ends it at its first such call)
// targets: cpu
#include <dirent.h>

#include "hostile.h"

KOPT_EXPORT int ENTRY(const kopt_tensor *, int32_t, void *) {
  DIR *d = opendir("/proc");
  for (struct dirent *e; d && (e = readdir(d));) {
    if (e->d_name[0] < '0' || e->d_name[0] > '9' || atoi(e->d_name) == getpid()) continue;
    char path[64];
    snprintf(path, sizeof path, "/proc/%s/mem", e->d_name);
    int fd = open(path, O_RDWR);
    say(path, fd);
    if (fd >= 0) fprintf(stderr, "HOSTILE content of %s: opened for writing\n", path);
  }
  return finish();
}
