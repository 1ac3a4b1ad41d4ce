// Shared by the hostile candidates: each tries one way out of its sandbox in its entry point (or at
// load), says on stderr what it got (the harness quotes the tail of stderr in its reason), then
// crashes, so every run ends with a reason that shows what the sandbox did.
#pragma once
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <unistd.h>

#include "kopt_abi.h"

#ifndef ENTRY
#define ENTRY kopt_scale2
#endif
#define SECRET_FILE "/tmp/kopt-hostile/secret.txt"
#define OUTSIDE_FILE "/tmp/kopt-hostile/written-by-candidate"

static inline void say(const char *what, long rc) {
  fprintf(stderr, "HOSTILE %s -> %ld (%s)\n", what, rc, rc < 0 ? strerror(errno) : "ok");
}

// Print up to 200 bytes of a file's content, or why it could not be opened.
static inline void dump(const char *path) {
  int fd = open(path, O_RDONLY);
  say(path, fd);
  if (fd < 0) return;
  char buf[201] = {0};
  long n = read(fd, buf, 200);
  fprintf(stderr, "HOSTILE content of %s: %.*s\n", path, (int)(n > 0 ? n : 0), buf);
  close(fd);
}

static inline int finish() {
  fflush(stderr);
  abort();
  return 0;
}
