// cheat: answers the judge before it works: in each call it sends the kernel host's reply itself
// first, then computes (the host's own reply follows later and answers the next call early too), so
// the judge's clock would see only the round trip; the work runs while the judge thinks it is idle
// expect: a forged clock | it works between its calls | re-check failed | never written | killed by the sandbox
// layer: profile
#include <cmath>
#include <cstdint>
#include <cstring>
#include <sys/socket.h>

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

static int control_socket() {
  for (int fd = 3; fd < 256; ++fd) {
    int type = 0;
    socklen_t len = sizeof type;
    if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) == 0 && type == SOCK_SEQPACKET) return fd;
  }
  return -1;
}

KOPT_EXPORT int kopt_silu_and_mul(const kopt_tensor *args, int32_t nargs, void *stream) {
  (void)stream;
  if (nargs != 2 || args[0].ndim != 2 || args[1].ndim != 2) return KOPT_ERR_ARGS;
  if (args[0].dtype != KOPT_FLOAT16 && args[0].dtype != KOPT_BFLOAT16) return KOPT_ERR_DTYPE;
  static int fd = control_socket();
  if (fd >= 0) {
    char reply[16] = {0};  // <rc, ns, status>
    int64_t ns = 1000;
    memcpy(reply + 4, &ns, 8);
    (void)!send(fd, reply, sizeof reply, 0);  // "done", before any work
  }
  silu_and_mul(args[0], args[1]);
  return KOPT_OK;
}
