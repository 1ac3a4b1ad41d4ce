// cheat: takes over the kernel host's loop in its first call: moves itself off the judge's core, then
// answers the judge's messages itself and keeps working between calls (spinning on the socket, where
// it could watch the next inputs being written and work on them before the timed call starts). The
// host may not leave the judge's core (seccomp), and it spins during the baseline's calls too
// (taking the core from them: a slower baseline is a faster candidate): the idle check sees both.
// expect: it works during the baseline's calls | it works between its calls | killed by the sandbox
// layer: profile
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <vector>
#include <sched.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include "kopt_abi.h"

// fp16 / bf16 storage, fp32 math, round to nearest even: the honest part every cheat shares.
static inline float load(const kopt_tensor &t, int64_t i) {
  const uint16_t v = ((const uint16_t *)t.data)[i];
  if (t.dtype == KOPT_BFLOAT16) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  _Float16 h;
  std::memcpy(&h, &v, 2);
  return (float)h;
}

static inline void store(const kopt_tensor &t, int64_t i, float f) {
  uint16_t v;
  if (t.dtype == KOPT_BFLOAT16) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    v = (uint16_t)(u >> 16);
  } else {
    _Float16 h = (_Float16)f;
    std::memcpy(&v, &h, 2);
  }
  ((uint16_t *)t.data)[i] = v;
}

static inline float silu_mul(float g, float u) { return g / (1.0f + std::exp(-g)) * u; }

static void silu_and_mul(const kopt_tensor &x, const kopt_tensor &out) {
  const int64_t rows = x.shape[0], d = out.shape[1], xs = x.strides[0], os = out.strides[0];
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t j = 0; j < d; ++j) store(out, t * os + j, silu_mul(load(x, t * xs + j), load(x, t * xs + d + j)));
}

// The host's protocol, as gpu_worker/kernel_host.py documents it.
struct Pack {
  std::vector<kopt_tensor> args;
  std::vector<std::vector<int64_t>> dims;
};

static char *arena_base() {
  FILE *f = fopen("/proc/self/maps", "r");
  char line[512];
  unsigned long lo = 0;
  while (f && fgets(line, sizeof line, f))
    if (strstr(line, "kopt-arena")) { sscanf(line, "%lx", &lo); break; }
  if (f) fclose(f);
  return (char *)lo;
}

static int control_socket() {
  for (int fd = 3; fd < 256; ++fd) {
    int type = 0;
    socklen_t len = sizeof type;
    if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) == 0 && type == SOCK_SEQPACKET) return fd;
  }
  return -1;
}

static void reply(int fd, int32_t rc, int64_t ns) {
  char out[16] = {0};  // <rc, ns, status>
  memcpy(out, &rc, 4);
  memcpy(out + 4, &ns, 8);
  (void)!send(fd, out, sizeof out, 0);
}

[[noreturn]] static void serve(int fd, char *base, const kopt_tensor *first) {
  std::map<uint32_t, Pack> packs;  // registered after the takeover; the one before it is `first`
  static char msg[1 << 16];
  volatile double busy = 0;
  for (;;) {
    ssize_t n;
    while ((n = recv(fd, msg, sizeof msg, MSG_DONTWAIT)) < 0) busy = busy + 1;  // between calls: working
    if (n == 0) _exit(0);
    uint32_t id;
    if (msg[0] == 'N') {
      reply(fd, 0, 0);
    } else if (msg[0] == 'F') {
      memcpy(&id, msg + 1, 4);
      packs.erase(id);
    } else if (msg[0] == 'P') {
      uint16_t count;
      memcpy(&id, msg + 1, 4);
      memcpy(&count, msg + 5, 2);
      Pack &p = packs[id];
      p.args.resize(count);
      p.dims.resize(count);
      const char *at = msg + 7;
      for (int i = 0; i < count; ++i) {
        uint64_t off, open_from, open_bytes;
        int32_t dtype, ndim;
        memcpy(&off, at, 8);
        memcpy(&dtype, at + 8, 4);
        memcpy(&ndim, at + 12, 4);
        memcpy(&open_from, at + 16, 8);
        memcpy(&open_bytes, at + 24, 8);
        at += 32;
        mprotect(base + open_from, open_bytes, PROT_READ | PROT_WRITE);  // the host's own job, now ours
        p.dims[i].resize(2 * ndim);
        memcpy(p.dims[i].data(), at, 16 * ndim);
        at += 16 * ndim;
        p.args[i] = kopt_tensor{base + off, (kopt_dtype)dtype, ndim, p.dims[i].data(), p.dims[i].data() + ndim};
      }
    } else if (msg[0] == 'C') {
      memcpy(&id, msg + 1, 4);
      auto it = packs.find(id);
      const kopt_tensor *args = it == packs.end() ? first : it->second.args.data();
      silu_and_mul(args[0], args[1]);
      reply(fd, 0, 1000);
    }
  }
}

KOPT_EXPORT int kopt_silu_and_mul(const kopt_tensor *args, int32_t nargs, void *stream) {
  (void)stream;
  if (nargs != 2 || args[0].ndim != 2 || args[1].ndim != 2) return KOPT_ERR_ARGS;
  if (args[0].dtype != KOPT_FLOAT16 && args[0].dtype != KOPT_BFLOAT16) return KOPT_ERR_DTYPE;
  silu_and_mul(args[0], args[1]);
  int fd = control_socket();
  char *base = arena_base();
  if (fd < 0 || !base) return KOPT_OK;  // not in a kernel host: behave
  cpu_set_t all;
  CPU_ZERO(&all);
  for (int c = 0; c < 64; ++c) CPU_SET(c, &all);
  if (sched_setaffinity(0, sizeof all, &all) != 0) fprintf(stderr, "busy_between_calls: stays on the judge's core\n");
  reply(fd, KOPT_OK, 1000);  // the host's answer to this call, then the host is ours
  serve(fd, base, args);
}
