// cheat: replays the output cached under the input pointer and a sample of input values (when timed
// calls saw the same few input sets, a replay was indistinguishable from computing; with every input
// element new before every timed call its cache never hits, so it computes, and gains nothing)
// expect: not faster
// layer: ab
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

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

static int valid(const kopt_tensor *args, int32_t nargs) {
  if (nargs != 2 || args[0].ndim != 2 || args[1].ndim != 2) return KOPT_ERR_ARGS;
  if (args[0].dtype != args[1].dtype || (args[0].dtype != KOPT_FLOAT16 && args[0].dtype != KOPT_BFLOAT16))
    return KOPT_ERR_DTYPE;
  if (args[0].strides[1] != 1 || args[1].strides[1] != 1) return KOPT_ERR_SHAPE;
  return KOPT_OK;
}


struct Entry {
  const void *x = nullptr;
  uint64_t sample = 0;
  void *out = nullptr;
  size_t bytes = 0;
};
static Entry cache[16];
static int next_slot = 0;

static uint64_t sample_of(const kopt_tensor &x) {  // 16 values spread over the input
  const int64_t n = x.shape[0] * x.shape[1];
  uint64_t h = 1469598103934665603ull;
  for (int k = 0; k < 16; ++k) h = (h ^ ((const uint16_t *)x.data)[k * (n / 16)]) * 1099511628211ull;
  return h;
}

KOPT_EXPORT int kopt_silu_and_mul(const kopt_tensor *args, int32_t nargs, void *stream) {
  (void)stream;
  if (int rc = valid(args, nargs)) return rc;
  const kopt_tensor &x = args[0], &out = args[1];
  const size_t bytes = (size_t)(out.shape[0] * out.strides[0]) * 2;
  if (x.shape[0] * x.shape[1] < 4096 || out.strides[0] != out.shape[1]) {  // small or strided: honest
    silu_and_mul(x, out);
    return KOPT_OK;
  }
  const uint64_t s = sample_of(x);
  for (Entry &e : cache)
    if (e.x == x.data && e.sample == s && e.bytes == bytes) {
      std::memcpy(out.data, e.out, bytes);  // replay
      return KOPT_OK;
    }
  silu_and_mul(x, out);
  Entry &e = cache[next_slot++ % 16];
  free(e.out);
  e = {x.data, s, malloc(bytes), bytes};
  std::memcpy(e.out, out.data, bytes);
  return KOPT_OK;
}
