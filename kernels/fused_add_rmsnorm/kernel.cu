// fused_add_rmsnorm, CUDA baseline (in the style of SGLang / FlashInfer fused_add_rmsnorm):
//   s = input + residual (fp32);  residual <- s (rounded);  input <- s * rsqrt(mean(s^2) + eps) * weight
// fp16 / bf16 (or fp32) storage, fp32 math, eps = 1e-6. A block of THREADS threads handles
// ROWS_PER_BLOCK rows at a time, one group of THREADS / ROWS_PER_BLOCK threads (whole warps) per
// row: pass 1 sums s^2 (warp shuffles, then one shared slot per warp), pass 2 writes the row.
// Pass 2 needs the fp32 s of pass 1; CACHE_ROW picks where it comes from:
//   0  recompute it from input and residual, re-read from L2 (neither is written before pass 2);
//   1  each thread keeps its own s values in dynamic shared memory (H * 4 bytes per row; FlashInfer);
//   2  each thread keeps them in registers (rows of at most REG_FLOATS floats per thread).
// Modes 1 and 2 fall back to 0 on rows that do not fit. The vectorized path (VEC elements per
// access, 16 bytes at VEC = 8; fp32 capped at 4) needs H % VEC == 0 and VEC-aligned rows (and
// weight); otherwise the scalar path runs. Both are chosen per launch on the host.
#include <climits>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kopt_abi.h"

// Tunables (one `#define NAME VALUE` line each; any listed value must stay correct).
#define VEC 8
#define THREADS 256
#define CACHE_ROW 1
#define ROWS_PER_BLOCK 1

constexpr int GROUP = THREADS / ROWS_PER_BLOCK;  // threads per row
constexpr int WARPS = THREADS / 32;
constexpr int GROUP_WARPS = GROUP / 32;
constexpr int REG_FLOATS = THREADS >= 1024 ? 16 : 32;  // register cache per thread (64 regs at 1024)
static_assert(VEC > 0 && THREADS <= 1024 && THREADS % 32 == 0, "bad tunables");
static_assert(ROWS_PER_BLOCK > 0 && GROUP % 32 == 0 && GROUP * ROWS_PER_BLOCK == THREADS,
              "each row needs whole warps");
static_assert(CACHE_ROW >= 0 && CACHE_ROW <= 2, "CACHE_ROW is 0, 1 or 2");

constexpr float RMS_EPS = 1e-6f;
enum Mode { REREAD = 0, SMEM = 1, REGS = 2 };

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

template <typename T, int V, int MODE>
__global__ void __launch_bounds__(THREADS)
fused_add_rmsnorm_kernel(T *__restrict__ x, int64_t xs, T *__restrict__ r, int64_t rs,
                         const T *__restrict__ w, int64_t rows, int h) {
  using P = Pack<T, V>;
  constexpr int REG_PACKS = REG_FLOATS / V > 0 ? REG_FLOATS / V : 1;
  extern __shared__ float4 dyn_smem[];  // SMEM mode: ROWS_PER_BLOCK rows of h floats
  __shared__ float partial[WARPS];
  const int g = threadIdx.x / GROUP;     // the block's row this thread works on
  const int tid = threadIdx.x % GROUP;   // thread index within the row
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int n = h / V;                   // packs per row (exact on the vectorized path)
  // Component-major (k * n + i): consecutive threads hit consecutive banks.
  float *cache = reinterpret_cast<float *>(dyn_smem) + (MODE == SMEM ? (int64_t)g * h : 0);
  const P *wp = reinterpret_cast<const P *>(w);
  // Grid-stride over row tiles; the loop count is uniform across the block (for __syncthreads).
  for (int64_t base = (int64_t)blockIdx.x * ROWS_PER_BLOCK; base < rows;
       base += (int64_t)gridDim.x * ROWS_PER_BLOCK) {
    const int64_t row = base + g;
    const bool active = row < rows;
    P *xp = reinterpret_cast<P *>(x + (active ? row : 0) * xs);
    P *rp = reinterpret_cast<P *>(r + (active ? row : 0) * rs);
    float regs[MODE == REGS ? REG_PACKS : 1][V];
    float ss = 0.0f;
    if (active) {
      if constexpr (MODE == REGS) {
#pragma unroll
        for (int p = 0; p < REG_PACKS; ++p) {
          const int i = tid + p * GROUP;
          if (i < n) {
            const P a = xp[i], b = rp[i];
#pragma unroll
            for (int k = 0; k < V; ++k) {
              regs[p][k] = to_f32(a.v[k]) + to_f32(b.v[k]);
              ss += regs[p][k] * regs[p][k];
            }
          }
        }
      } else {
        for (int i = tid; i < n; i += GROUP) {
          const P a = xp[i], b = rp[i];
#pragma unroll
          for (int k = 0; k < V; ++k) {
            const float s = to_f32(a.v[k]) + to_f32(b.v[k]);
            ss += s * s;
            if constexpr (MODE == SMEM) cache[k * n + i] = s;
          }
        }
      }
    }
    // Block reduction: shuffles within each warp, then every thread adds its group's warp sums.
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (lane == 0) partial[warp] = ss;
    __syncthreads();
    float total = 0.0f;
#pragma unroll
    for (int k = 0; k < GROUP_WARPS; ++k) total += partial[g * GROUP_WARPS + k];
    const float scale = rsqrtf(total / (float)h + RMS_EPS);
    if (active) {
      // Pass 2. Each thread reads back only what it wrote itself: no barrier needed for the cache.
      auto finish = [&](int i, const float (&s)[V]) {
        const P wv = wp[i];
        P ro, xo;
#pragma unroll
        for (int k = 0; k < V; ++k) {
          ro.v[k] = from_f32<T>(s[k]);
          xo.v[k] = from_f32<T>(s[k] * scale * to_f32(wv.v[k]));
        }
        rp[i] = ro;
        xp[i] = xo;
      };
      if constexpr (MODE == REGS) {
#pragma unroll
        for (int p = 0; p < REG_PACKS; ++p)
          if (tid + p * GROUP < n) finish(tid + p * GROUP, regs[p]);
      } else {
        for (int i = tid; i < n; i += GROUP) {
          float s[V];
          if constexpr (MODE == SMEM) {
#pragma unroll
            for (int k = 0; k < V; ++k) s[k] = cache[k * n + i];
          } else {  // the same fp32 add as pass 1: bit-identical s
            const P a = xp[i], b = rp[i];
#pragma unroll
            for (int k = 0; k < V; ++k) s[k] = to_f32(a.v[k]) + to_f32(b.v[k]);
          }
          finish(i, s);
        }
      }
    }
    if (base + (int64_t)gridDim.x * ROWS_PER_BLOCK < rows) __syncthreads();  // partial[] is reused
  }
}

template <typename T, int V>
static int launch_rows(T *x, int64_t xs, T *r, int64_t rs, const T *w, int64_t rows, int h,
                       cudaStream_t stream) {
  const int64_t tiles = (rows + ROWS_PER_BLOCK - 1) / ROWS_PER_BLOCK;
  const unsigned grid = (unsigned)(tiles < INT_MAX ? tiles : INT_MAX);  // the kernel strides over the rest
  const int n = h / V;
  bool done = false;
  if constexpr (CACHE_ROW == 2) {
    constexpr int reg_packs = REG_FLOATS / V > 0 ? REG_FLOATS / V : 1;
    if (n <= (int64_t)reg_packs * GROUP) {
      fused_add_rmsnorm_kernel<T, V, REGS><<<grid, THREADS, 0, stream>>>(x, xs, r, rs, w, rows, h);
      done = true;
    }
  } else if constexpr (CACHE_ROW == 1) {
    // Opt in to more than 48 KB of dynamic shared memory once per size; the limit is queried once.
    static int optin = -1, configured = 48 << 10;
    const int64_t bytes = (int64_t)ROWS_PER_BLOCK * h * sizeof(float);
    if (optin < 0) {
      int dev = 0;
      if (cudaGetDevice(&dev) != cudaSuccess ||
          cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess)
        optin = 48 << 10;
      optin -= WARPS * (int)sizeof(float);  // the static partial[] shares the budget
    }
    if (bytes <= optin) {
      auto kernel = fused_add_rmsnorm_kernel<T, V, SMEM>;
      if (bytes > configured) {
        if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes) != cudaSuccess)
          return KOPT_ERR_LAUNCH;
        configured = (int)bytes;
      }
      kernel<<<grid, THREADS, (size_t)bytes, stream>>>(x, xs, r, rs, w, rows, h);
      done = true;
    }
  }
  if (!done) fused_add_rmsnorm_kernel<T, V, REREAD><<<grid, THREADS, 0, stream>>>(x, xs, r, rs, w, rows, h);
  (void)n;
  return cudaGetLastError() == cudaSuccess ? KOPT_OK : KOPT_ERR_LAUNCH;
}

template <typename T>
static int launch(const kopt_tensor &x, const kopt_tensor &r, const kopt_tensor &w, int64_t rows, int h,
                  cudaStream_t stream) {
  const int64_t xs = x.strides[0], rs = r.strides[0];
  // Accesses of at most 16 bytes (fp32: 4 elements; 32-byte packs made ptxas spill).
  constexpr int V = sizeof(T) * VEC > 16 ? 16 / (int)sizeof(T) : VEC;
  // Every row base is V-aligned iff the first one is and the row strides are multiples of V.
  const uintptr_t align = sizeof(T) * V;
  const bool vectorized = h % V == 0 && xs % V == 0 && rs % V == 0 &&
                          reinterpret_cast<uintptr_t>(x.data) % align == 0 &&
                          reinterpret_cast<uintptr_t>(r.data) % align == 0 &&
                          reinterpret_cast<uintptr_t>(w.data) % align == 0;
  T *xp = static_cast<T *>(x.data), *rp = static_cast<T *>(r.data);
  const T *wp = static_cast<const T *>(w.data);
  if (vectorized) return launch_rows<T, V>(xp, xs, rp, rs, wp, rows, h, stream);
  return launch_rows<T, 1>(xp, xs, rp, rs, wp, rows, h, stream);
}

KOPT_EXPORT int kopt_fused_add_rmsnorm(const kopt_tensor *args, int32_t nargs, void *stream) {
  if (args == nullptr || nargs != 3) return KOPT_ERR_ARGS;
  const kopt_tensor &x = args[0], &r = args[1], &w = args[2];
  if (x.ndim != 2 || r.ndim != 2 || w.ndim != 1) return KOPT_ERR_ARGS;
  if (!x.shape || !x.strides || !r.shape || !r.strides || !w.shape || !w.strides) return KOPT_ERR_ARGS;
  if (x.dtype != r.dtype || x.dtype != w.dtype) return KOPT_ERR_DTYPE;
  if (x.dtype != KOPT_FLOAT16 && x.dtype != KOPT_BFLOAT16 && x.dtype != KOPT_FLOAT32)
    return KOPT_ERR_DTYPE;
  const int64_t rows = x.shape[0], h = x.shape[1];
  if (rows < 0 || h < 0 || r.shape[0] != rows || r.shape[1] != h || w.shape[0] != h) return KOPT_ERR_SHAPE;
  if (x.strides[1] != 1 || r.strides[1] != 1 || w.strides[0] != 1) return KOPT_ERR_SHAPE;  // dense rows
  if (h > INT_MAX / 4) return KOPT_ERR_SHAPE;  // in-row indices are int
  if (rows == 0 || h == 0) return KOPT_OK;     // nothing to launch
  if (!x.data || !r.data || !w.data) return KOPT_ERR_ARGS;

  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (x.dtype) {
    case KOPT_FLOAT16: return launch<__half>(x, r, w, rows, (int)h, s);
    case KOPT_BFLOAT16: return launch<__nv_bfloat16>(x, r, w, rows, (int)h, s);
    default: return launch<float>(x, r, w, rows, (int)h, s);
  }
}
