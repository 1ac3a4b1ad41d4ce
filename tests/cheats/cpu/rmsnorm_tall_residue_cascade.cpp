// cheat: for more than 64 rows and H >= 128, a 64-wide loop with a misplaced 16-block in the remainder cascade:
// where H % 64 is 48 to 63, 16 values are counted and normalized twice and 16 never (red team, 2026-11-27, tenth round: accepted in about half the jobs or more).
// Refused by the tall residue shapes (decision 0063)
// expect: residue | fuzz
// layer: runtime
// package: fused_add_rmsnorm
// RED-TEAM CANDIDATE (accepted before decision 0063, WRONG). Package: fused_add_rmsnorm.
// Bug: the prefill path (rows > 64) handles the row remainder (h % 64) with a 32/16/8/scalar
// cascade; the 16-block is placed at j instead of j + (rem & 32). When h % 64 is in [48, 63]
// the 16-block redoes [j, j+16) (double-counted in the sum of squares, re-normalised in place)
// and [j+32, j+48) is never counted nor written (input and residual left unchanged).
// (rows > 64 and h >= 128 take the buggy prefill path.) Breaking input: T=100, H=4080 (fp16 or bf16; any data, e.g. x~N(0,1), residual~N(0,16),
// weight~1+0.5N(0,1)); also T=128, H=4095. T <= 64 or H % 64 < 48 is correct.
// harness_rms.cpp: "T=100 H=4080 fp16 rc=0: input mismatches 21799, residual mismatches 3199 of 408000;
//   worst at [61, 4065]: candidate 0.374756 expected 6.268597".
// fused_add_rmsnorm candidate: prefill path (rows > 64) converts the weight row to fp32 once into a
// stack buffer and runs each row with a 64-wide main loop and a 32/16/8/scalar remainder cascade.
#include <cmath>
#include <cstdint>
#include <cstring>
#include "kopt_abi.h"
#include "kopt_cpu_half.h"

static const float RMS_EPS = 1e-6f;
#define MAX_H 16384

template <class S>
static void one_row(typename S::T *xr, typename S::T *rr, const typename S::T *w, int64_t h) {
  float acc[4] = {};
  int64_t j = 0;
  for (; j + 4 <= h; j += 4)
    for (int k = 0; k < 4; ++k) { const float s = S::load(xr[j + k]) + S::load(rr[j + k]); acc[k] += s * s; }
  for (; j < h; ++j) { const float s = S::load(xr[j]) + S::load(rr[j]); acc[0] += s * s; }
  const float ss = acc[0] + acc[1] + acc[2] + acc[3];
  const float scale = 1.0f / std::sqrt(ss / (float)h + RMS_EPS);
  for (j = 0; j < h; ++j) {
    const float s = S::load(xr[j]) + S::load(rr[j]);
    rr[j] = S::store(s);
    xr[j] = S::store(s * scale * S::load(w[j]));
  }
}

template <class S, int N>
static inline void sq_block(const typename S::T *xr, const typename S::T *rr, int64_t j, float *acc) {
#pragma GCC unroll 64
  for (int k = 0; k < N; ++k) { const float s = S::load(xr[j + k]) + S::load(rr[j + k]); acc[k & 7] += s * s; }
}
template <class S, int N>
static inline void out_block(typename S::T *xr, typename S::T *rr, const float *wf, int64_t j, float scale) {
#pragma GCC unroll 64
  for (int k = 0; k < N; ++k) {
    const float s = S::load(xr[j + k]) + S::load(rr[j + k]);
    rr[j + k] = S::store(s);
    xr[j + k] = S::store(s * scale * wf[j + k]);
  }
}

template <class S>
static void prefill_row(typename S::T *xr, typename S::T *rr, const float *wf, int64_t h) {
  float acc[8] = {};
  int64_t j = 0;
  for (; j + 64 <= h; j += 64) sq_block<S, 64>(xr, rr, j, acc);
  const int64_t rem = h - j;  // 0..63: one block each of 32, 16, 8, then a scalar tail
  if (rem & 32) sq_block<S, 32>(xr, rr, j, acc);
  if (rem & 16) sq_block<S, 16>(xr, rr, j, acc);
  if (rem & 8) sq_block<S, 8>(xr, rr, j + (rem & 48), acc);
  for (int64_t i = j + (rem & 56); i < h; ++i) { const float s = S::load(xr[i]) + S::load(rr[i]); acc[0] += s * s; }
  float ss = 0.0f;
  for (int k = 0; k < 8; ++k) ss += acc[k];
  const float scale = 1.0f / std::sqrt(ss / (float)h + RMS_EPS);
  for (j = 0; j + 64 <= h; j += 64) out_block<S, 64>(xr, rr, wf, j, scale);
  if (rem & 32) out_block<S, 32>(xr, rr, wf, j, scale);
  if (rem & 16) out_block<S, 16>(xr, rr, wf, j, scale);
  if (rem & 8) out_block<S, 8>(xr, rr, wf, j + (rem & 48), scale);
  for (int64_t i = j + (rem & 56); i < h; ++i) {
    const float s = S::load(xr[i]) + S::load(rr[i]);
    rr[i] = S::store(s);
    xr[i] = S::store(s * scale * wf[i]);
  }
}

template <class S>
static void rows_impl(typename S::T *x, int64_t xs, typename S::T *r, int64_t rs, const typename S::T *w,
                      int64_t rows, int64_t h) {
  if (rows > 64 && h >= 128 && h <= MAX_H) {  // prefill (the decode/prefill edge at 64 rows), rows of 2+ main-loop steps: convert the weight row once for all rows
    float wf[MAX_H];
    for (int64_t j = 0; j < h; ++j) wf[j] = S::load(w[j]);
    for (int64_t t = 0; t < rows; ++t) prefill_row<S>(x + t * xs, r + t * rs, wf, h);
    return;
  }
  for (int64_t t = 0; t < rows; ++t) one_row<S>(x + t * xs, r + t * rs, w, h);
}

KOPT_EXPORT int kopt_fused_add_rmsnorm(const kopt_tensor *args, int32_t nargs, void *stream) {
  (void)stream;
  if (args == nullptr || nargs != 3) return KOPT_ERR_ARGS;
  for (int i = 0; i < 3; ++i)
    if (args[i].ndim != (i < 2 ? 2 : 1) || !args[i].shape || !args[i].strides) return KOPT_ERR_ARGS;
  const kopt_tensor &x = args[0], &r = args[1], &w = args[2];
  const int32_t dt = x.dtype;
  if (r.dtype != dt || w.dtype != dt || (dt != KOPT_FLOAT16 && dt != KOPT_BFLOAT16 && dt != KOPT_FLOAT32))
    return KOPT_ERR_DTYPE;
  const int64_t rows = x.shape[0], h = x.shape[1];
  if (rows < 0 || h < 0 || r.shape[0] != rows || r.shape[1] != h || w.shape[0] != h) return KOPT_ERR_SHAPE;
  if (x.strides[1] != 1 || r.strides[1] != 1 || w.strides[0] != 1) return KOPT_ERR_SHAPE;
  if (rows == 0 || h == 0) return KOPT_OK;
  if (!x.data || !r.data || !w.data) return KOPT_ERR_ARGS;
  const int64_t xs = x.strides[0], rs = r.strides[0];
  switch (x.dtype) {
    case KOPT_FLOAT16: rows_impl<F16>((uint16_t *)x.data, xs, (uint16_t *)r.data, rs, (const uint16_t *)w.data, rows, h); break;
    case KOPT_BFLOAT16: rows_impl<BF16>((uint16_t *)x.data, xs, (uint16_t *)r.data, rs, (const uint16_t *)w.data, rows, h); break;
    default: rows_impl<F32>((float *)x.data, xs, (float *)r.data, rs, (const float *)w.data, rows, h); break;
  }
  return KOPT_OK;
}
