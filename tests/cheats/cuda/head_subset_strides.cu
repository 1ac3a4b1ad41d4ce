// cheat: takes any outer stride of v_a, v_b and v_out (the baseline takes dense tensors only) but
// addresses them densely, pair p at p * D: right where stride[0] is NH * D, wrong for some heads of a
// wider tensor (o[:, h0:h0+NH, :]). The planes layout now gives every 3-D argument dense rows and a spare
// row per plane: the baseline refuses it, so a candidate that takes it must compute it right (red team,
// 2026-11-26, round 5).
// expect: mismatch | never written | written outside the buffer | layout:overlap
// layer: runtime
// package: merge_attn_states_lse
// merge_attn_states_lse, CUDA baseline (in the style of SGLang merge_state_v2): per (token, head),
//   a = s_a, b = s_b with +inf read as -inf (an empty state); m = max(a, b);
//   both empty: v_out = v_a as is, s_out = -inf;
//   else wa = exp(a - m), wb = exp(b - m): v_out = (v_a*wa + v_b*wb) / (wa + wb), s_out = log(wa + wb) + m;
//   a NaN in a or b (not both empty) makes the pair's v_out and s_out NaN, as m and the exps carry it.
// fp16 / bf16 (or fp32) v, fp32 LSEs, fp32 math. Tensors must be contiguous, so (t, h) pairs are
// flat: pair p's row of D starts at p * D. A block takes a tile of whole pairs, THREADS *
// PACKS_PER_THREAD vector packs of VEC elements (16 bytes at VEC = 8, 16-bit) when D is small:
// first one thread per pair does the LSE math once (weights to shared memory, s_out to global),
// then all threads stream the tile's packs (LSE_MODE 0, the default). LSE_MODE 1 and 2 drop the
// tile: each thread loads its packs with its pairs' LSEs in one round trip and computes the weights
// itself (measured 1.06x on an H100 with mode 1, docs/tuning-notes.md). The vectorized path needs
// D % VEC == 0 and VEC-aligned bases; otherwise the scalar path runs. Infinities are tested on the
// bits (fast-math safe).
#include <climits>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kopt_abi.h"
#include "kopt_cuda.h"

// Tunables (one `#define NAME VALUE` line each; any listed value must stay correct).
#define VEC 8
#define THREADS 128
#define PACKS_PER_THREAD 2
#define LSE_MODE 0

// Fixed by measurement, not searched (docs/tuning-notes.md): FAST_EXP 1 uses __expf / __logf and
// __frcp_rn for the weights (no gain measured). Cache hints of the per-thread modes on 16-byte packs
// (v_a, v_b loads; v_out stores): SMALL_* when the call moves no more bytes than the L2 holds, the
// others above that. Loads: 0 plain, 2 ld.global.cs (evict first), 3 ld.global.nc.L1::no_allocate,
// 5 / 6 L2::evict_first / evict_last cache policy; stores: 0 plain, 1 st.global.cs (evict first).
// Chosen: evict-first loads when the call fits in L2 (-3% at [768, 32, 256]), an evict_last policy
// above (-1.4% at [16384, 32, 128]).
// GRID_WAVES > 0 (per-thread modes): cap the grid at that many waves of resident blocks (persistent).
#define FAST_EXP 0
#define SMALL_LOAD_HINT 2
#define SMALL_STORE_HINT 0
#define LOAD_HINT 6
#define STORE_HINT 0
#define GRID_WAVES 0

constexpr int TILE_PACKS = THREADS * PACKS_PER_THREAD;  // also the most pairs a tile can hold
static_assert(VEC > 0 && THREADS > 0 && THREADS <= 1024 && PACKS_PER_THREAD > 0, "bad tunables");
static_assert(LSE_MODE >= 0 && LSE_MODE <= 2, "LSE_MODE is 0, 1 or 2");

__device__ __forceinline__ bool is_inf(float f) { return (__float_as_uint(f) & 0x7fffffffu) == 0x7f800000u; }
__device__ __forceinline__ bool is_nan(float f) { return (__float_as_uint(f) & 0x7fffffffu) > 0x7f800000u; }

__device__ __forceinline__ float exp_(float x) {
#if FAST_EXP
  return __expf(x);
#else
  return expf(x);
#endif
}
__device__ __forceinline__ float log_(float x) {
#if FAST_EXP
  return __logf(x);
#else
  return logf(x);
#endif
}

// The merge weights of one pair: v_out = v_a * ca + v_b * cb, s_out = s; cb < 0 marks "both empty:
// copy v_a". +inf reads as -inf (an empty state).
__device__ __forceinline__ void merge_weights(float a, float b, float &ca, float &cb, float &s) {
  const bool a_empty = is_inf(a), b_empty = is_inf(b);
  if (a_empty && b_empty) {
    ca = 1.0f, cb = -1.0f, s = __uint_as_float(0xff800000u);  // -inf
  } else if (is_nan(a) || is_nan(b)) {  // the NaN propagates, even beside an empty state
    ca = cb = s = __uint_as_float(0x7fc00000u);
  } else if (a_empty) {  // weight 0 for the empty side, exp(0) = 1 for the other
    ca = 0.0f, cb = 1.0f, s = b;
  } else if (b_empty) {
    ca = 1.0f, cb = 0.0f, s = a;
  } else {
    const float m = fmaxf(a, b);
    const float wa = exp_(a - m), wb = exp_(b - m), sum = wa + wb;
#if FAST_EXP
    const float inv = __frcp_rn(sum);
    ca = wa * inv, cb = wb * inv, s = log_(sum) + m;
#else
    ca = wa / sum, cb = wb / sum, s = log_(sum) + m;
#endif
  }
}

template <typename T, int V>
__global__ void __launch_bounds__(THREADS)
merge_kernel(const T *__restrict__ va, const float *__restrict__ sa, const T *__restrict__ vb,
             const float *__restrict__ sb, T *__restrict__ vo, float *__restrict__ so, int64_t pairs, int d,
             int tile_pairs) {
  using P = Pack<T, V>;
  // Per pair of the tile: the weights of v_a and v_b; cb < 0 marks "both empty: copy v_a".
  __shared__ float coef_a[TILE_PACKS], coef_b[TILE_PACKS];
  const int ppp = d / V;  // packs per pair (exact on the vectorized path)
  for (int64_t p0 = (int64_t)blockIdx.x * tile_pairs; p0 < pairs; p0 += (int64_t)gridDim.x * tile_pairs) {
    const int np = (int)(pairs - p0 < tile_pairs ? pairs - p0 : tile_pairs);
    // LSE math, once per pair.
    for (int i = threadIdx.x; i < np; i += THREADS) {
      float ca, cb, s;
      merge_weights(sa[p0 + i], sb[p0 + i], ca, cb, s);
      coef_a[i] = ca, coef_b[i] = cb;
      so[p0 + i] = s;
    }
    __syncthreads();
    // Stream the tile: packs k of consecutive pairs are contiguous, at p0 * d + k * V.
    const int total = np * ppp;
    const P *pa = reinterpret_cast<const P *>(va + p0 * d);
    const P *pb = reinterpret_cast<const P *>(vb + p0 * d);
    P *po = reinterpret_cast<P *>(vo + p0 * d);
    for (int k0 = 0; k0 < total; k0 += TILE_PACKS) {
      P a[PACKS_PER_THREAD] = {}, b[PACKS_PER_THREAD] = {};  // zero-init: else ptxas spills some combos
#pragma unroll
      for (int u = 0; u < PACKS_PER_THREAD; ++u) {  // all loads first: PACKS_PER_THREAD in flight
        const int k = k0 + u * THREADS + threadIdx.x;
        if (k < total) a[u] = pa[k], b[u] = pb[k];
      }
#pragma unroll
      for (int u = 0; u < PACKS_PER_THREAD; ++u) {
        const int k = k0 + u * THREADS + threadIdx.x;
        if (k < total) {
          const int pair = (unsigned)k / (unsigned)ppp;
          const float ca = coef_a[pair], cb = coef_b[pair];
          if (cb < 0.0f) {
            po[k] = a[u];
          } else {
            P r;
#pragma unroll
            for (int e = 0; e < V; ++e) r.v[e] = from_f32<T>(to_f32(a[u].v[e]) * ca + to_f32(b[u].v[e]) * cb);
            po[k] = r;
          }
        }
      }
    }
    if (p0 + (int64_t)gridDim.x * tile_pairs < pairs) __syncthreads();  // coef_* are reused
  }
}

// LSE_MODE 1 and 2: no tile and no barrier. Each thread loads its packs (mode 1: one; mode 2:
// PACKS_PER_THREAD, interleaved across the block) together with the two LSEs of their pairs (one
// round trip to memory instead of two: LSEs, then values) and computes the weights itself; the
// thread holding a pair's first pack writes s_out. Access k of the flat [pairs, ppp] pack grid
// belongs to pair k / ppp; IDX is 32-bit where the host proved it safe; LH, SH: the hints.
[[maybe_unused]] constexpr int THREAD_PACKS = LSE_MODE == 2 ? PACKS_PER_THREAD : 1;

template <typename T, int V, typename IDX, int LH, int SH>
__global__ void __launch_bounds__(THREADS)
merge_thread_kernel(const T *__restrict__ va, const float *__restrict__ sa, const T *__restrict__ vb,
                    const float *__restrict__ sb, T *__restrict__ vo, float *__restrict__ so, int64_t pairs,
                    int d) {
  using P = Pack<T, V>;
  constexpr int U = THREAD_PACKS;
  const IDX ppp = (IDX)(d / V);  // packs per pair (>= 1: the host sends d == 0 to the tile kernel)
  const IDX total = (IDX)pairs * ppp, tile = (IDX)THREADS * U;
  const P *pa = reinterpret_cast<const P *>(va);
  const P *pb = reinterpret_cast<const P *>(vb);
  P *po = reinterpret_cast<P *>(vo);
  for (IDX k0 = (IDX)blockIdx.x * tile + threadIdx.x; k0 < total; k0 += (IDX)gridDim.x * tile) {
    P a[U] = {}, b[U] = {};
    float la[U], lb[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {  // all loads first: U packs of each side and their LSEs in flight
      const IDX k = k0 + (IDX)u * THREADS;
      la[u] = lb[u] = 0.0f;
      if (k < total) {
        const IDX pair = k / ppp;
        a[u] = load_pack<LH>(pa + k), b[u] = load_pack<LH>(pb + k);
        la[u] = sa[pair], lb[u] = sb[pair];
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const IDX k = k0 + (IDX)u * THREADS;
      if (k < total) {
        const IDX pair = k / ppp;
        float ca, cb, s;
        merge_weights(la[u], lb[u], ca, cb, s);
        if (k == pair * ppp) so[pair] = s;
        if (cb < 0.0f) {
          store_pack<SH>(po + k, a[u]);
        } else {
          P r;
#pragma unroll
          for (int e = 0; e < V; ++e) r.v[e] = from_f32<T>(to_f32(a[u].v[e]) * ca + to_f32(b[u].v[e]) * cb);
          store_pack<SH>(po + k, r);
        }
      }
    }
  }
}

template <typename T, int V, int LH, int SH>
static int launch_threads_hinted(const kopt_tensor *args, int64_t pairs, int d, cudaStream_t stream) {
  const int ppp = d / V;
  const int64_t total = pairs * ppp, tile = (int64_t)THREADS * THREAD_PACKS;
  const int64_t tiles = (total + tile - 1) / tile;
  int64_t cap = INT_MAX;  // the kernel strides over the rest
  if constexpr (GRID_WAVES > 0) {
    static const int64_t resident = resident_blocks(merge_thread_kernel<T, V, uint32_t, LH, SH>, THREADS, 0);
    if (resident > 0) cap = resident * GRID_WAVES;
  }
  const unsigned grid = (unsigned)(tiles < cap ? tiles : cap);
  auto kernel = 2 * total + tile < ((int64_t)1 << 32) ? merge_thread_kernel<T, V, uint32_t, LH, SH>
                                                       : merge_thread_kernel<T, V, uint64_t, LH, SH>;
  kernel<<<grid, THREADS, 0, stream>>>(
      static_cast<const T *>(args[0].data), static_cast<const float *>(args[1].data),
      static_cast<const T *>(args[2].data), static_cast<const float *>(args[3].data),
      static_cast<T *>(args[4].data), static_cast<float *>(args[5].data), pairs, d);
  return cudaGetLastError() == cudaSuccess ? KOPT_OK : KOPT_ERR_LAUNCH;
}

// The hints of this call: SMALL_* when it moves no more bytes than the L2 holds (16-byte packs only).
template <typename T, int V>
static int launch_threads(const kopt_tensor *args, int64_t pairs, int d, cudaStream_t stream) {
  if constexpr (V * sizeof(T) != 16) {
    return launch_threads_hinted<T, V, 0, 0>(args, pairs, d, stream);
  } else if constexpr (SMALL_LOAD_HINT == LOAD_HINT && SMALL_STORE_HINT == STORE_HINT) {
    return launch_threads_hinted<T, V, LOAD_HINT, STORE_HINT>(args, pairs, d, stream);
  } else {
    if (pairs * (3 * (int64_t)d * (int64_t)sizeof(T) + 12) <= l2_bytes())
      return launch_threads_hinted<T, V, SMALL_LOAD_HINT, SMALL_STORE_HINT>(args, pairs, d, stream);
    return launch_threads_hinted<T, V, LOAD_HINT, STORE_HINT>(args, pairs, d, stream);
  }
}

template <typename T, int V>
static int launch_pairs(const kopt_tensor *args, int64_t pairs, int d, cudaStream_t stream) {
  const int ppp = d / V;
  if constexpr (LSE_MODE != 0) {
    if (ppp > 0) return launch_threads<T, V>(args, pairs, d, stream);
  }
  const int tile = ppp > 0 && ppp < TILE_PACKS ? TILE_PACKS / ppp : (ppp > 0 ? 1 : TILE_PACKS);
  const int64_t tiles = (pairs + tile - 1) / tile;
  const unsigned grid = (unsigned)(tiles < INT_MAX ? tiles : INT_MAX);  // the kernel strides over the rest
  merge_kernel<T, V><<<grid, THREADS, 0, stream>>>(
      static_cast<const T *>(args[0].data), static_cast<const float *>(args[1].data),
      static_cast<const T *>(args[2].data), static_cast<const float *>(args[3].data),
      static_cast<T *>(args[4].data), static_cast<float *>(args[5].data), pairs, d, tile);
  return cudaGetLastError() == cudaSuccess ? KOPT_OK : KOPT_ERR_LAUNCH;
}

template <typename T>
static int launch(const kopt_tensor *args, int64_t pairs, int d, cudaStream_t stream) {
  // Pair rows start at multiples of d, so every pack is aligned iff d % VEC == 0 and the bases are.
  const uintptr_t align = sizeof(T) * VEC;
  bool vectorized = d % VEC == 0;
  for (int i = 0; i < 6; i += 2) vectorized = vectorized && reinterpret_cast<uintptr_t>(args[i].data) % align == 0;
  return vectorized ? launch_pairs<T, VEC>(args, pairs, d, stream) : launch_pairs<T, 1>(args, pairs, d, stream);
}

// Contiguous, with any stride allowed on a dimension of size 1 (it is never stepped over).
static bool contiguous(const kopt_tensor &x) {
  int64_t expect = 1;
  for (int i = x.ndim - 1; i >= (x.ndim == 3 ? 1 : 0); --i) {
    if (x.shape[i] != 1 && x.strides[i] != expect) return false;
    expect *= x.shape[i];
  }
  return true;
}

KOPT_EXPORT int kopt_merge_attn_states_lse(const kopt_tensor *args, int32_t nargs, void *stream) {
  if (args == nullptr || nargs != 6) return KOPT_ERR_ARGS;
  // args: v_a, s_a, v_b, s_b, v_out, s_out; v_* are [T, NH, D], s_* are [T, NH] fp32.
  for (int i = 0; i < 6; ++i) {
    if (args[i].ndim != (i % 2 ? 2 : 3) || !args[i].shape || !args[i].strides) return KOPT_ERR_ARGS;
    if (i % 2 && args[i].dtype != KOPT_FLOAT32) return KOPT_ERR_DTYPE;  // LSEs are always fp32
  }
  const kopt_tensor &va = args[0];
  if (args[2].dtype != va.dtype || args[4].dtype != va.dtype) return KOPT_ERR_DTYPE;
  if (va.dtype != KOPT_FLOAT16 && va.dtype != KOPT_BFLOAT16 && va.dtype != KOPT_FLOAT32) return KOPT_ERR_DTYPE;
  const int64_t tokens = va.shape[0], heads = va.shape[1], d = va.shape[2];
  if (tokens < 0 || heads < 0 || d < 0) return KOPT_ERR_SHAPE;
  for (int i = 0; i < 6; ++i) {
    const kopt_tensor &x = args[i];
    if (x.shape[0] != tokens || x.shape[1] != heads || (i % 2 == 0 && x.shape[2] != d)) return KOPT_ERR_SHAPE;
    if (!contiguous(x)) return KOPT_ERR_SHAPE;
  }
  if (d > INT_MAX / 4) return KOPT_ERR_SHAPE;  // in-pair indices are int
  if (tokens == 0 || heads == 0) return KOPT_OK;  // nothing to launch
  for (int i = 0; i < 6; ++i)
    if (!args[i].data && (i % 2 || d > 0)) return KOPT_ERR_ARGS;  // v_* may be empty when D = 0

  const int64_t pairs = tokens * heads;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (va.dtype) {
    case KOPT_FLOAT16: return launch<__half>(args, pairs, (int)d, s);
    case KOPT_BFLOAT16: return launch<__nv_bfloat16>(args, pairs, (int)d, s);
    default: return launch<float>(args, pairs, (int)d, s);
  }
}
