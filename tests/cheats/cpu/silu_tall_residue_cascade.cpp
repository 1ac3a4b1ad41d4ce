// cheat: for 256 rows or more, a 64-wide loop with a 32/16/8 remainder cascade whose 16-block is misplaced: where D
// % 64 is 48 to 63, 16 outputs of every row are never written (red team, 2026-11-27, tenth round: accepted in about half the jobs or more).
// Refused by the tall residue shapes (decision 0063)
// expect: residue | fuzz
// layer: runtime
// package: silu_and_mul
// RED-TEAM CANDIDATE (accepted before decision 0063, WRONG). Package: silu_and_mul.
// Bug: the prefill path (T >= 256) handles the row remainder (D % 64) with a 32/16/8/scalar cascade;
// the 16-block is placed at j instead of j + (rem & 32). When D % 64 is in [48, 63] the 16-block
// recomputes [j, j+16) and out[j+32 .. j+48) of every row is never written (keeps its old contents).
// Breaking input: T=256, D=4080 (fp16 or bf16, x ~ 2*N(0,1), out zero-filled); also T=512, D=3580.
// T < 256 or D % 64 < 48 is correct.
// harness_silu.cpp: "T=256 D=4080 fp16 rc=0: out mismatches 4087 of 1044480;
//   worst at [199, 4076]: candidate 0.000000 expected 31.081551".
// silu_and_mul candidate: decode rows (T < 256) as the baseline; prefill (T >= 256, the CUDA bucket edge)
// runs each row with a 64-wide main loop and a 32/16/8/scalar remainder cascade.
#include <cmath>
#include <cstdint>
#include <cstring>
#include "kopt_abi.h"
#include "kopt_cpu_half.h"

static inline float silu_mul(float g, float u) { return g / (1.0f + std::exp(-g)) * u; }

template <class S>
static void decode_row(const typename S::T *xg, typename S::T *o, int64_t d) {
  const typename S::T *xu = xg + d;
  for (int64_t j = 0; j < d; ++j) o[j] = S::store(silu_mul(S::load(xg[j]), S::load(xu[j])));
}

template <class S, int N>
static inline void blk(const typename S::T *xg, const typename S::T *xu, typename S::T *o, int64_t j) {
  float v[N];
#pragma GCC unroll 64
  for (int k = 0; k < N; ++k) v[k] = silu_mul(S::load(xg[j + k]), S::load(xu[j + k]));
#pragma GCC unroll 64
  for (int k = 0; k < N; ++k) o[j + k] = S::store(v[k]);
}

template <class S>
static void prefill_row(const typename S::T *xg, typename S::T *o, int64_t d) {
  const typename S::T *xu = xg + d;
  int64_t j = 0;
  for (; j + 64 <= d; j += 64) blk<S, 64>(xg, xu, o, j);
  const int64_t rem = d - j;  // 0..63: one block each of 32, 16, 8, then scalar
  if (rem & 32) blk<S, 32>(xg, xu, o, j);
  if (rem & 16) blk<S, 16>(xg, xu, o, j);
  if (rem & 8) blk<S, 8>(xg, xu, o, j + (rem & 48));
  for (int64_t i = j + (rem & 56); i < d; ++i) o[i] = S::store(silu_mul(S::load(xg[i]), S::load(xu[i])));
}

template <class S>
static void rows_impl(const typename S::T *x, int64_t xs, typename S::T *out, int64_t os, int64_t rows, int64_t d) {
  if (rows >= 256) {
    for (int64_t t = 0; t < rows; ++t) prefill_row<S>(x + t * xs, out + t * os, d);
  } else {
    for (int64_t t = 0; t < rows; ++t) decode_row<S>(x + t * xs, out + t * os, d);
  }
}

KOPT_EXPORT int kopt_silu_and_mul(const kopt_tensor *args, int32_t nargs, void *stream) {
  (void)stream;
  if (args == nullptr || nargs != 2) return KOPT_ERR_ARGS;
  for (int i = 0; i < 2; ++i)
    if (args[i].ndim != 2 || !args[i].shape || !args[i].strides) return KOPT_ERR_ARGS;
  const kopt_tensor &x = args[0], &out = args[1];
  const int32_t dt = x.dtype;
  if (out.dtype != dt || (dt != KOPT_FLOAT16 && dt != KOPT_BFLOAT16 && dt != KOPT_FLOAT32)) return KOPT_ERR_DTYPE;
  const int64_t rows = x.shape[0], d = out.shape[1];
  if (rows < 0 || d < 0 || out.shape[0] != rows || x.shape[1] != 2 * d) return KOPT_ERR_SHAPE;
  if (x.strides[1] != 1 || out.strides[1] != 1) return KOPT_ERR_SHAPE;
  if (rows == 0 || d == 0) return KOPT_OK;
  if (!x.data || !out.data) return KOPT_ERR_ARGS;
  const int64_t xs = x.strides[0], os = out.strides[0];
  switch (x.dtype) {
    case KOPT_FLOAT16: rows_impl<F16>((const uint16_t *)x.data, xs, (uint16_t *)out.data, os, rows, d); break;
    case KOPT_BFLOAT16: rows_impl<BF16>((const uint16_t *)x.data, xs, (uint16_t *)out.data, os, rows, d); break;
    default: rows_impl<F32>((const float *)x.data, xs, (float *)out.data, os, rows, d); break;
  }
  return KOPT_OK;
}
