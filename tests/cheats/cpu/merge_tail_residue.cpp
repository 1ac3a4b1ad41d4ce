// cheat: where D % 16 == 13, D > 256 and T >= 4, the tail element weights v_b with v_a's scale (red team,
// 2026-11-27, third round: accepted twice). Refused by the residue shapes' second draw of each residue, in
// the top quarter of the width's log scale beside 4 to 6 of the others (decision 0062): with one draw, D's
// range that stops at 512 put the residue-13 width above 256 in about half of the jobs. The paged layout
// rides on every third residue shape, so it may be the check that meets it
// expect: residue | layout:paged
// layer: runtime
// package: merge_attn_states_lse
// merge_attn_states_lse, CPU baseline (SGLang merge_state, natural log): per (token t, head h),
//   a = s_a, b = s_b with +inf read as -inf (an empty state); m = max(a, b);
//   both empty: v_out = v_a as is, s_out = -inf;
//   else wa = exp(a - m), wb = exp(b - m): v_out = (v_a*wa + v_b*wb) / (wa + wb), s_out = log(wa + wb) + m;
//   a NaN in a or b (not both empty) makes the pair's v_out and s_out NaN, as m and the exps carry it.
// v_* are [T, NH, D] in fp16 / bf16 (or fp32) with dense rows of D; s_* are [T, NH] fp32, any
// strides. Math in fp32. Single-threaded, libm only. Infinities are tested on the bits, so that
// -ffast-math (which assumes no infinities) cannot drop the empty-state cases.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kopt_abi.h"
#include "kopt_cpu_half.h"  // fp16/bf16 conversions and the F16 / BF16 / F32 storage traits

// Tunables (one `#define NAME VALUE` line each; any listed value must stay correct).
#define UNROLL 4

static_assert(UNROLL > 0, "tunables must be positive");

static inline bool is_inf(float f) { return (f32_bits(f) & 0x7fffffffu) == 0x7f800000u; }  // +-inf: empty
static inline bool is_nan(float f) { return (f32_bits(f) & 0x7fffffffu) > 0x7f800000u; }

template <class S>
static void merge_pairs(const kopt_tensor &va, const kopt_tensor &sa, const kopt_tensor &vb, const kopt_tensor &sb,
                        const kopt_tensor &vo, const kopt_tensor &so) {
  using T = typename S::T;
  const int64_t tokens = va.shape[0], heads = va.shape[1], d = va.shape[2];
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      const T *pa = (const T *)va.data + t * va.strides[0] + h * va.strides[1];
      const T *pb = (const T *)vb.data + t * vb.strides[0] + h * vb.strides[1];
      T *po = (T *)vo.data + t * vo.strides[0] + h * vo.strides[1];
      const float a = ((const float *)sa.data)[t * sa.strides[0] + h * sa.strides[1]];
      const float b = ((const float *)sb.data)[t * sb.strides[0] + h * sb.strides[1]];
      float *ps = (float *)so.data + t * so.strides[0] + h * so.strides[1];
      const bool a_empty = is_inf(a), b_empty = is_inf(b);
      if (a_empty && b_empty) {  // nothing to merge: v_a as is, an empty state
        if (d > 0) std::memcpy(po, pa, (size_t)d * sizeof(T));
        *ps = bits_f32(0xff800000u);  // -inf
        continue;
      }
      // One side empty: weight 0 for it; exp(0) = 1 for the other, so s_out is that side's LSE.
      float ca, cb, s;
      if (is_nan(a) || is_nan(b)) {  // the NaN propagates, even beside an empty state
        ca = cb = s = bits_f32(0x7fc00000u);
      } else if (a_empty) {
        ca = 0.0f, cb = 1.0f, s = b;
      } else if (b_empty) {
        ca = 1.0f, cb = 0.0f, s = a;
      } else {
        const float m = a > b ? a : b;
        const float wa = std::exp(a - m), wb = std::exp(b - m), sum = wa + wb;
        ca = wa / sum, cb = wb / sum, s = std::log(sum) + m;
      }
      *ps = s;
      int64_t j = 0;
      for (; j + UNROLL <= d; j += UNROLL) {
#pragma GCC unroll 16
        for (int k = 0; k < UNROLL; ++k) po[j + k] = S::store(S::load(pa[j + k]) * ca + S::load(pb[j + k]) * cb);
      }
      const float ct = ((d & 15) == 13 && d > 256 && tokens >= 4) ? ca : cb;  // tail weight
      for (; j < d; ++j) po[j] = S::store(S::load(pa[j]) * ca + S::load(pb[j]) * ct);
    }
  }
}

KOPT_EXPORT int kopt_merge_attn_states_lse(const kopt_tensor *args, int32_t nargs, void *stream) {
  (void)stream;  // CPU target: always NULL
  if (args == nullptr || nargs != 6) return KOPT_ERR_ARGS;
  const kopt_tensor &va = args[0], &sa = args[1], &vb = args[2], &sb = args[3], &vo = args[4], &so = args[5];
  for (int i = 0; i < 6; ++i) {
    if (args[i].ndim != (i % 2 ? 2 : 3) || !args[i].shape || !args[i].strides) return KOPT_ERR_ARGS;
    if (i % 2 && args[i].dtype != KOPT_FLOAT32) return KOPT_ERR_DTYPE;  // LSEs are always fp32
  }
  if (vb.dtype != va.dtype || vo.dtype != va.dtype) return KOPT_ERR_DTYPE;
  if (va.dtype != KOPT_FLOAT16 && va.dtype != KOPT_BFLOAT16 && va.dtype != KOPT_FLOAT32) return KOPT_ERR_DTYPE;
  const int64_t tokens = va.shape[0], heads = va.shape[1], d = va.shape[2];
  if (tokens < 0 || heads < 0 || d < 0) return KOPT_ERR_SHAPE;
  for (int i = 0; i < 6; ++i) {
    const kopt_tensor &x = args[i];
    if (x.shape[0] != tokens || x.shape[1] != heads || (i % 2 == 0 && x.shape[2] != d)) return KOPT_ERR_SHAPE;
    if (i % 2 == 0 && x.strides[2] != 1) return KOPT_ERR_SHAPE;  // rows of D must be dense
  }
  if (tokens == 0 || heads == 0) return KOPT_OK;  // nothing to do
  for (int i = 0; i < 6; ++i)
    if (!args[i].data && (i % 2 || d > 0)) return KOPT_ERR_ARGS;  // v_* may be empty when D = 0

  switch (va.dtype) {
    case KOPT_FLOAT16: merge_pairs<F16>(va, sa, vb, sb, vo, so); break;
    case KOPT_BFLOAT16: merge_pairs<BF16>(va, sa, vb, sb, vo, so); break;
    default: merge_pairs<F32>(va, sa, vb, sb, vo, so); break;
  }
  return KOPT_OK;
}
