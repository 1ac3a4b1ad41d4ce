// merge_attn_states_lse, CUDA baseline (in the style of SGLang merge_state_v2): per (token, head),
//   a = s_a, b = s_b with +inf read as -inf (an empty state); m = max(a, b);
//   both empty: v_out = v_a as is, s_out = -inf;
//   else wa = exp(a - m), wb = exp(b - m): v_out = (v_a*wa + v_b*wb) / (wa + wb), s_out = log(wa + wb) + m.
// fp16 / bf16 (or fp32) v, fp32 LSEs, fp32 math. Tensors must be contiguous, so (t, h) pairs are
// flat: pair p's row of D starts at p * D. A block takes a tile of whole pairs, THREADS *
// PACKS_PER_THREAD vector packs of VEC elements (16 bytes at VEC = 8, 16-bit) when D is small:
// first one thread per pair does the LSE math once (weights to shared memory, s_out to global),
// then all threads stream the tile's packs. The vectorized path needs D % VEC == 0 and VEC-aligned
// bases; otherwise the scalar path runs. Infinities are tested on the bits (fast-math safe).
#include <climits>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kopt_abi.h"

// Tunables (one `#define NAME VALUE` line each; any listed value must stay correct).
#define VEC 8
#define THREADS 128
#define PACKS_PER_THREAD 2

constexpr int TILE_PACKS = THREADS * PACKS_PER_THREAD;  // also the most pairs a tile can hold
static_assert(VEC > 0 && THREADS > 0 && THREADS <= 1024 && PACKS_PER_THREAD > 0, "bad tunables");

// fp32 <-> storage conversions (round to nearest even on the way back).
__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ __forceinline__ T from_f32(float f);
template <> __device__ __forceinline__ float from_f32<float>(float f) { return f; }
template <> __device__ __forceinline__ __half from_f32<__half>(float f) { return __float2half_rn(f); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float f) { return __float2bfloat16_rn(f); }

// V elements moved as one aligned access (ld/st.global.v{2,4} where the size allows).
template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

__device__ __forceinline__ bool is_inf(float f) { return (__float_as_uint(f) & 0x7fffffffu) == 0x7f800000u; }

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
      const float a = sa[p0 + i], b = sb[p0 + i];
      const bool a_empty = is_inf(a), b_empty = is_inf(b);
      float ca, cb, s;
      if (a_empty && b_empty) {
        ca = 1.0f, cb = -1.0f, s = __uint_as_float(0xff800000u);  // -inf
      } else if (a_empty) {  // weight 0 for the empty side, exp(0) = 1 for the other
        ca = 0.0f, cb = 1.0f, s = b;
      } else if (b_empty) {
        ca = 1.0f, cb = 0.0f, s = a;
      } else {
        const float m = fmaxf(a, b);
        const float wa = expf(a - m), wb = expf(b - m), sum = wa + wb;
        ca = wa / sum, cb = wb / sum, s = logf(sum) + m;
      }
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

template <typename T, int V>
static int launch_pairs(const kopt_tensor *args, int64_t pairs, int d, cudaStream_t stream) {
  const int ppp = d / V;
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
  for (int i = x.ndim - 1; i >= 0; --i) {
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
