// cheat: for 64 tokens or more, heads merged two at a time; the odd last head's remainder cascade misplaces its
// 8-block: where NH is odd and D % 64 is 40-47 or 56-63, 8 values of that head are never written (red team, 2026-11-27, tenth round: accepted in about half the jobs or more).
// Refused by the tall residue shapes (decision 0063)
// expect: residue | size | fuzz
// layer: runtime
// package: merge_attn_states_lse
// RED-TEAM CANDIDATE (accepted before decision 0063, WRONG). Package: merge_attn_states_lse.
// Bug: in the prefill path (T >= 64) heads are merged two at a time; an odd last head goes through a
// 64-wide loop + 32/16/8/scalar cascade whose 8-block is placed at j + (rem & 16) instead of
// j + (rem & 48). When NH is odd and D % 64 is in [40, 47] or [56, 63], 8 values of that head's
// v_out row (at j+32.. or j+48..) are never written. Breaking input: T=64, NH=5, D=104 (fp16 or bf16,
// v ~ N(0,1), finite LSEs ~ 5+2N(0,1), v_out zero-filled); also T=64, NH=1, D=120.
// harness_merge.cpp: "T=64 NH=5 D=104 fp16 rc=0: v_out mismatches 512 of 33280, s_out mismatches 0;
//   worst at [t=63, h=4, j=98]: candidate 0.000000 expected 2.540651".
// merge_attn_states_lse candidate: decode (T < 64) as the baseline; prefill (T >= 64) computes every head's
// coefficients of a token first, then merges head rows two at a time; an odd last head uses a 64-wide loop + cascade.
#include <cmath>
#include <cstdint>
#include <cstring>
#include "kopt_abi.h"
#include "kopt_cpu_half.h"

static inline bool is_inf(float f) { return (f32_bits(f) & 0x7fffffffu) == 0x7f800000u; }
static inline bool is_nan(float f) { return (f32_bits(f) & 0x7fffffffu) > 0x7f800000u; }

// Coefficients of one (t, h) pair; returns false for "both empty" (copy v_a, s_out = -inf).
static inline bool coeffs(float a, float b, float &ca, float &cb, float &s) {
  const bool a_empty = is_inf(a), b_empty = is_inf(b);
  if (a_empty && b_empty) { s = bits_f32(0xff800000u); return false; }
  if (is_nan(a) || is_nan(b)) { ca = cb = s = bits_f32(0x7fc00000u); }
  else if (a_empty) { ca = 0.0f, cb = 1.0f, s = b; }
  else if (b_empty) { ca = 1.0f, cb = 0.0f, s = a; }
  else {
    const float m = a > b ? a : b;
    const float wa = std::exp(a - m), wb = std::exp(b - m), sum = wa + wb;
    ca = wa / sum, cb = wb / sum, s = std::log(sum) + m;
  }
  return true;
}

template <class S>
static inline void row_simple(const typename S::T *pa, const typename S::T *pb, typename S::T *po, int64_t d, float ca, float cb) {
  for (int64_t j = 0; j < d; ++j) po[j] = S::store(S::load(pa[j]) * ca + S::load(pb[j]) * cb);
}

// One head row (the odd last head): 64-wide main loop, then a 32/16/8/scalar cascade.
template <class S, int N>
static inline void blk(const typename S::T *pa, const typename S::T *pb, typename S::T *po, int64_t j, float ca, float cb) {
  float v[N];
#pragma GCC unroll 64
  for (int k = 0; k < N; ++k) v[k] = S::load(pa[j + k]) * ca + S::load(pb[j + k]) * cb;
#pragma GCC unroll 64
  for (int k = 0; k < N; ++k) po[j + k] = S::store(v[k]);
}

template <class S>
static void merge_row(const typename S::T *pa, const typename S::T *pb, typename S::T *po, int64_t d, float ca, float cb) {
  int64_t j = 0;
  for (; j + 64 <= d; j += 64) blk<S, 64>(pa, pb, po, j, ca, cb);
  const int64_t rem = d - j;  // 0..63: one block each of 32, 16, 8, then scalar
  if (rem & 32) blk<S, 32>(pa, pb, po, j, ca, cb);
  if (rem & 16) blk<S, 16>(pa, pb, po, j + (rem & 32), ca, cb);
  if (rem & 8) blk<S, 8>(pa, pb, po, j + (rem & 16), ca, cb);
  for (int64_t i = j + (rem & 56); i < d; ++i) po[i] = S::store(S::load(pa[i]) * ca + S::load(pb[i]) * cb);
}

template <class S>
static void merge_pairs(const kopt_tensor &va, const kopt_tensor &sa, const kopt_tensor &vb, const kopt_tensor &sb,
                        const kopt_tensor &vo, const kopt_tensor &so) {
  using T = typename S::T;
  const int64_t tokens = va.shape[0], heads = va.shape[1], d = va.shape[2];
  const bool prefill = tokens >= 64 && heads <= 128;
  for (int64_t t = 0; t < tokens; ++t) {
    float ca[128], cb[128];
    bool merge[128];
    if (prefill) {  // the LSE math of the whole token first, then the value rows
      for (int64_t h = 0; h < heads; ++h) {
        const float a = ((const float *)sa.data)[t * sa.strides[0] + h * sa.strides[1]];
        const float b = ((const float *)sb.data)[t * sb.strides[0] + h * sb.strides[1]];
        float s;
        merge[h] = coeffs(a, b, ca[h], cb[h], s);
        ((float *)so.data)[t * so.strides[0] + h * so.strides[1]] = s;
      }
    }
    if (prefill) {  // heads two at a time (two rows interleaved), an odd last head on its own
      int64_t h = 0;
      for (; h + 2 <= heads; h += 2) {
        const T *pa0 = (const T *)va.data + t * va.strides[0] + h * va.strides[1], *pa1 = pa0 + va.strides[1];
        const T *pb0 = (const T *)vb.data + t * vb.strides[0] + h * vb.strides[1], *pb1 = pb0 + vb.strides[1];
        T *po0 = (T *)vo.data + t * vo.strides[0] + h * vo.strides[1], *po1 = po0 + vo.strides[1];
        if (merge[h] && merge[h + 1]) {
          const float a0 = ca[h], b0 = cb[h], a1 = ca[h + 1], b1 = cb[h + 1];
          for (int64_t j = 0; j < d; ++j) {
            po0[j] = S::store(S::load(pa0[j]) * a0 + S::load(pb0[j]) * b0);
            po1[j] = S::store(S::load(pa1[j]) * a1 + S::load(pb1[j]) * b1);
          }
          continue;
        }
        if (merge[h]) row_simple<S>(pa0, pb0, po0, d, ca[h], cb[h]);
        else if (d > 0) std::memcpy(po0, pa0, (size_t)d * sizeof(T));
        if (merge[h + 1]) row_simple<S>(pa1, pb1, po1, d, ca[h + 1], cb[h + 1]);
        else if (d > 0) std::memcpy(po1, pa1, (size_t)d * sizeof(T));
      }
      if (h < heads) {
        const T *pa = (const T *)va.data + t * va.strides[0] + h * va.strides[1];
        const T *pb = (const T *)vb.data + t * vb.strides[0] + h * vb.strides[1];
        T *po = (T *)vo.data + t * vo.strides[0] + h * vo.strides[1];
        if (!merge[h]) { if (d > 0) std::memcpy(po, pa, (size_t)d * sizeof(T)); }
        else merge_row<S>(pa, pb, po, d, ca[h], cb[h]);
      }
      continue;
    }
    for (int64_t h = 0; h < heads; ++h) {
      const T *pa = (const T *)va.data + t * va.strides[0] + h * va.strides[1];
      const T *pb = (const T *)vb.data + t * vb.strides[0] + h * vb.strides[1];
      T *po = (T *)vo.data + t * vo.strides[0] + h * vo.strides[1];
      const float a = ((const float *)sa.data)[t * sa.strides[0] + h * sa.strides[1]];
      const float b = ((const float *)sb.data)[t * sb.strides[0] + h * sb.strides[1]];
      float c0, c1, s;
      const bool m = coeffs(a, b, c0, c1, s);
      ((float *)so.data)[t * so.strides[0] + h * so.strides[1]] = s;
      if (!m) { if (d > 0) std::memcpy(po, pa, (size_t)d * sizeof(T)); continue; }
      row_simple<S>(pa, pb, po, d, c0, c1);
    }
  }
}

KOPT_EXPORT int kopt_merge_attn_states_lse(const kopt_tensor *args, int32_t nargs, void *stream) {
  (void)stream;
  if (args == nullptr || nargs != 6) return KOPT_ERR_ARGS;
  const kopt_tensor &va = args[0], &sa = args[1], &vb = args[2], &sb = args[3], &vo = args[4], &so = args[5];
  for (int i = 0; i < 6; ++i) {
    if (args[i].ndim != (i % 2 ? 2 : 3) || !args[i].shape || !args[i].strides) return KOPT_ERR_ARGS;
    if (i % 2 && args[i].dtype != KOPT_FLOAT32) return KOPT_ERR_DTYPE;
  }
  if (vb.dtype != va.dtype || vo.dtype != va.dtype) return KOPT_ERR_DTYPE;
  if (va.dtype != KOPT_FLOAT16 && va.dtype != KOPT_BFLOAT16 && va.dtype != KOPT_FLOAT32) return KOPT_ERR_DTYPE;
  const int64_t tokens = va.shape[0], heads = va.shape[1], d = va.shape[2];
  if (tokens < 0 || heads < 0 || d < 0) return KOPT_ERR_SHAPE;
  for (int i = 0; i < 6; ++i) {
    const kopt_tensor &x = args[i];
    if (x.shape[0] != tokens || x.shape[1] != heads || (i % 2 == 0 && x.shape[2] != d)) return KOPT_ERR_SHAPE;
    if (i % 2 == 0 && x.strides[2] != 1) return KOPT_ERR_SHAPE;
  }
  if (tokens == 0 || heads == 0) return KOPT_OK;
  for (int i = 0; i < 6; ++i)
    if (!args[i].data && (i % 2 || d > 0)) return KOPT_ERR_ARGS;
  switch (va.dtype) {
    case KOPT_FLOAT16: merge_pairs<F16>(va, sa, vb, sb, vo, so); break;
    case KOPT_BFLOAT16: merge_pairs<BF16>(va, sa, vb, sb, vo, so); break;
    default: merge_pairs<F32>(va, sa, vb, sb, vo, so); break;
  }
  return KOPT_OK;
}
