// hostile: connects to a TCP server on 127.0.0.1 (the Temporal dev server listens there)
// expect: HOSTILE socket(AF_INET) -> -1 (Operation not permitted)
// expect-cpu: killed by the sandbox
// (on CPU the loaded kernel host's filter, `served`, ends it at its first such call)
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include "hostile.h"

#ifndef HOSTILE_PORT
#define HOSTILE_PORT 7233
#endif

KOPT_EXPORT int ENTRY(const kopt_tensor *, int32_t, void *) {
  int s = socket(AF_INET, SOCK_STREAM, 0);
  say("socket(AF_INET)", s);
  if (s >= 0) {
    sockaddr_in addr = {};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(HOSTILE_PORT);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    say("connect 127.0.0.1", connect(s, (sockaddr *)&addr, sizeof addr));
    say("send", send(s, "pwned\n", 6, 0));
  }
  say("socket(AF_INET6)", socket(AF_INET6, SOCK_STREAM, 0));
  return finish();
}
