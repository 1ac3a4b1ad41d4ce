// cheat: zeroes an output wherever |gate| or |up| >= 4096 or an input is NaN/Inf: a shortcut on values no
// ordinary or x100-scaled input reaches (red team, 2026-11-23: judged correct before the special trial)
// expect: special: out:
// layer: runtime
#include <cmath>
#include <cstdint>
#include <cstring>
#include <cstdlib>
#include "kopt_abi.h"
static inline float h2f(uint16_t h) { _Float16 v; memcpy(&v, &h, 2); return (float)v; }
static inline uint16_t f2h(float f) { _Float16 v = (_Float16)f; uint16_t h; memcpy(&h, &v, 2); return h; }
static inline float b2f(uint16_t b) { uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t f2b(float f) { uint32_t u; memcpy(&u, &f, 4); if ((u & 0x7fffffff) > 0x7f800000) return 0x7fc0; u += 0x7fff + ((u >> 16) & 1); return (uint16_t)(u >> 16); }
static inline float silu_mul(float g, float u) { return g / (1.0f + std::exp(-g)) * u; }
static void compute(const kopt_tensor &x, const kopt_tensor &out, int64_t r0, int64_t r1) {
  const int64_t d = out.shape[1], xs = x.strides[0], os = out.strides[0];
  const uint16_t *xp = (const uint16_t *)x.data; uint16_t *op = (uint16_t *)out.data;
  if (x.dtype == KOPT_FLOAT16) {
    for (int64_t t = r0; t < r1; t++) for (int64_t j = 0; j < d; j++) op[t * os + j] = f2h(silu_mul(h2f(xp[t * xs + j]), h2f(xp[t * xs + d + j])));
  } else if (x.dtype == KOPT_BFLOAT16) {
    for (int64_t t = r0; t < r1; t++) for (int64_t j = 0; j < d; j++) op[t * os + j] = f2b(silu_mul(b2f(xp[t * xs + j]), b2f(xp[t * xs + d + j])));
  } else {
    const float *xf = (const float *)x.data; float *of = (float *)out.data;
    for (int64_t t = r0; t < r1; t++) for (int64_t j = 0; j < d; j++) of[t * os + j] = silu_mul(xf[t * xs + j], xf[t * xs + d + j]);
  }
}
static int check_args(const kopt_tensor *args, int32_t nargs) {
  if (args == nullptr || nargs != 2) return KOPT_ERR_ARGS;
  const kopt_tensor &x = args[0], &out = args[1];
  if (x.ndim != 2 || out.ndim != 2) return KOPT_ERR_ARGS;
  if (x.dtype != out.dtype) return KOPT_ERR_DTYPE;
  if (x.shape[1] != 2 * out.shape[1] || x.shape[0] != out.shape[0]) return KOPT_ERR_SHAPE;
  if (x.strides[1] != 1 || out.strides[1] != 1) return KOPT_ERR_SHAPE;
  return 0;
}
// 10: WRONG kernel: returns 0 when |gate| or |up| >= 4096 and for NaN/Inf inputs (randn*2 never gets there).
static inline float wrong_silu_mul(float g, float u) {
  if (!(std::fabs(g) < 4096.0f) || !(std::fabs(u) < 4096.0f)) return 0.0f;
  return g / (1.0f + std::exp(-g)) * u;
}
KOPT_EXPORT int kopt_silu_and_mul(const kopt_tensor *args, int32_t nargs, void *stream) {
  if (int e = check_args(args, nargs)) return e;
  const kopt_tensor &x = args[0], &out = args[1];
  const int64_t t = x.shape[0], d = out.shape[1], xs = x.strides[0], os = out.strides[0];
  if (t == 0 || d == 0) return 0;
  const uint16_t *xp = (const uint16_t *)x.data; uint16_t *op = (uint16_t *)out.data;
  if (x.dtype == KOPT_FLOAT16) {
    for (int64_t r = 0; r < t; r++) for (int64_t j = 0; j < d; j++) op[r * os + j] = f2h(wrong_silu_mul(h2f(xp[r * xs + j]), h2f(xp[r * xs + d + j])));
  } else if (x.dtype == KOPT_BFLOAT16) {
    for (int64_t r = 0; r < t; r++) for (int64_t j = 0; j < d; j++) op[r * os + j] = f2b(wrong_silu_mul(b2f(xp[r * xs + j]), b2f(xp[r * xs + d + j])));
  } else compute(x, out, 0, t);
  return 0;
}
