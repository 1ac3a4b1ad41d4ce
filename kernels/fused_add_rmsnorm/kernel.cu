// fused_add_rmsnorm, CUDA baseline (in the style of SGLang / FlashInfer fused_add_rmsnorm):
//   s = input + residual (fp32);  residual <- s (rounded);  input <- s * rsqrt(mean(s^2) + eps) * weight
// fp16 / bf16 (or fp32) storage, fp32 math, eps = 1e-6. A block of THREADS threads handles
// ROWS_PER_BLOCK rows at a time, one group of THREADS / ROWS_PER_BLOCK threads (whole warps) per
// row: pass 1 sums s^2 (warp shuffles, then one shared slot per warp), pass 2 writes the row.
// Pass 2 needs the fp32 s of pass 1; CACHE_ROW picks where it comes from:
//   0  recompute it from input and residual, re-read from L2 (neither is written before pass 2);
//   1  each thread keeps its own s values in dynamic shared memory (H * 4 bytes per row; FlashInfer);
//   2  registers, streaming: each thread keeps its raw input and residual packs in registers (rows
//      of at most REG_FLOATS elements per thread), loads the weight in pass 1 too (all its loads in
//      flight at once), stores the new residual in pass 1 as soon as s is known, and recomputes s
//      for pass 2 (measured 1.03-1.04x the default on an H100, docs/tuning-notes.md).
// The defaults (CACHE_ROW 1, THREADS 256, one row per block, no hints) are the FlashInfer-like baseline.
// Modes 1 and 2 fall back to 0 on rows that do not fit. The vectorized path (VEC elements per
// access, 16 bytes at VEC = 8; fp32 capped at 4) needs H % VEC == 0 and VEC-aligned rows (and
// weight); otherwise the scalar path runs. Both are chosen per launch on the host.
#include <climits>
#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kopt_abi.h"

// Tunables (one `#define NAME VALUE` line each; any listed value must stay correct).
#define VEC 8
#define THREADS 256
#define CACHE_ROW 1
#define ROWS_PER_BLOCK 1

// Fixed by measurement, not searched (docs/tuning-notes.md):
//   hints         on 16-byte accesses of input and residual: SMALL_* when the call moves no more
//                 bytes than the L2 holds, the others above that; FIRST_READ_HINT: pass 1 of mode 0
//                 (not the last read). Loads: 0 plain, 2 ld.global.cs (evict first),
//                 3 ld.global.nc.L1::no_allocate, 5 / 6 L2::evict_first / evict_last cache policy.
//                 Stores: 0 plain, 1 st.global.cs (evict first);
//   MIN_BLOCKS    blocks per SM promised to ptxas in mode 2 (__launch_bounds__; 0: none);
//   GRID_WAVES    > 0: cap the grid at that many waves of resident blocks (persistent over rows).
#define SMALL_LOAD_HINT 0
#define SMALL_STORE_HINT 0
#define LOAD_HINT 0
#define STORE_HINT 0
#define FIRST_READ_HINT 0
#define MIN_BLOCKS 0
#define GRID_WAVES 0

constexpr int GROUP = THREADS / ROWS_PER_BLOCK;  // threads per row
constexpr int WARPS = THREADS / 32;
constexpr int GROUP_WARPS = GROUP / 32;
// Register cache per thread, at most, in elements: 16 at 1024 threads, 64 at 128 or fewer (rows of
// 8192 at 128 threads). Mode 2 holds the fewest packs (1, 2, 4 or 8) that cover the row.
constexpr int REG_FLOATS = THREADS >= 1024 ? 16 : THREADS <= 128 ? 64 : 32;
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

// One pack load / store with a cache hint; hints apply to 16-byte packs only (others: plain).
__device__ __forceinline__ uint64_t l2_policy(bool evict_first) {
  uint64_t pol;
  if (evict_first)
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  else
    asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}

template <int HINT, typename P>
__device__ __forceinline__ P load_pack(const P *p) {
  if constexpr (sizeof(P) == 16 && HINT != 0) {
    uint4 r;
    if constexpr (HINT == 2) {
      r = __ldcs(reinterpret_cast<const uint4 *>(p));
    } else if constexpr (HINT == 3) {
      asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    } else {
      static_assert(HINT == 5 || HINT == 6, "load hints are 0, 2, 3, 5, 6");
      asm volatile("ld.global.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                   : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p), "l"(l2_policy(HINT == 5)));
    }
    P out;
    __builtin_memcpy(&out, &r, 16);
    return out;
  } else {
    return *p;
  }
}

// A raw pack held in registers (register mode). For 16-bit storage it is kept as 32-bit words and
// unpacked on use: held as an array of 16-bit values, bf16 packs were split into one register per
// element. hide() is an empty asm that "may change" the words, so the compiler cannot carry
// pass 1's fp32 sums across the barrier instead (twice the registers); pass 2 recomputes them.
template <typename T, int V, bool WORDS = (sizeof(T) * V) % 4 == 0>
struct Raw {  // odd sizes (a single 16-bit element): the pack itself
  Pack<T, V> p;
  __device__ __forceinline__ void set(const Pack<T, V> &v) { p = v; }
  __device__ __forceinline__ float get(int k) const { return to_f32(p.v[k]); }
  __device__ __forceinline__ void hide() {}
};
template <typename T, int V>
struct Raw<T, V, true> {
  uint32_t w[sizeof(T) * V / 4];
  __device__ __forceinline__ void set(const Pack<T, V> &v) { __builtin_memcpy(w, &v, sizeof(w)); }
  __device__ __forceinline__ float get(int k) const {
    if constexpr (sizeof(T) == 4) {
      return __uint_as_float(w[k]);
    } else {
      const uint32_t x = w[k / 2];
      if constexpr (std::is_same_v<T, __nv_bfloat16>) return __uint_as_float(k % 2 ? x & 0xffff0000u : x << 16);
      else return __half2float(__ushort_as_half((unsigned short)(k % 2 ? x >> 16 : x & 0xffffu)));
    }
  }
  __device__ __forceinline__ void hide() {
#pragma unroll
    for (int i = 0; i < (int)(sizeof(w) / 4); ++i) asm volatile("" : "+r"(w[i]));
  }
};

template <typename T, int V>
__device__ __forceinline__ float weight_at(const Pack<T, V> &p, int k) { return to_f32(p.v[k]); }
template <typename T, int V>
__device__ __forceinline__ float weight_at(const Raw<T, V> &p, int k) { return p.get(k); }

template <int HINT, typename P>
__device__ __forceinline__ void store_pack(P *p, const P &v) {
  if constexpr (sizeof(P) == 16 && HINT == 1) {
    uint4 r;
    __builtin_memcpy(&r, &v, 16);
    __stcs(reinterpret_cast<uint4 *>(p), r);
  } else {
    static_assert(HINT == 0 || HINT == 1, "store hints are 0, 1");
    *p = v;
  }
}

// RP: register packs per thread (mode 2); LH, SH: load and store hints of this launch.
template <typename T, int V, int MODE, int RP, int LH, int SH>
__global__ void __launch_bounds__(THREADS, MODE == 2 ? MIN_BLOCKS : 0)
fused_add_rmsnorm_kernel(T *__restrict__ x, int64_t xs, T *__restrict__ r, int64_t rs,
                         const T *__restrict__ w, int64_t rows, int h) {
  using P = Pack<T, V>;
  extern __shared__ float4 dyn_smem[];  // SMEM mode: ROWS_PER_BLOCK rows of h floats
  __shared__ float partial[WARPS];
  const int g = threadIdx.x / GROUP;     // the block's row this thread works on
  const int tid = threadIdx.x % GROUP;   // thread index within the row
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int n = h / V;                   // packs per row (exact on the vectorized path)
  // Component-major (k * n + i): consecutive threads hit consecutive banks.
  float *cache = reinterpret_cast<float *>(dyn_smem) + (MODE == SMEM ? (int64_t)g * h : 0);
  const P *wp = reinterpret_cast<const P *>(w);
  // Pass 1 of the re-read mode is not the last read of input and residual (pass 2 wants them
  // from L2): it takes FIRST_READ_HINT; every other load of them is the last one and takes LH.
  constexpr int LH1 = MODE == REREAD ? (sizeof(P) == 16 ? FIRST_READ_HINT : 0) : LH;
  constexpr bool WE = MODE == REGS;  // mode 2 loads the weight in pass 1 too: pass 2 has no loads
  constexpr bool RE = MODE == REGS;  // mode 2 stores the new residual in pass 1, as soon as s is known
  // Grid-stride over row tiles; the loop count is uniform across the block (for __syncthreads).
  for (int64_t base = (int64_t)blockIdx.x * ROWS_PER_BLOCK; base < rows;
       base += (int64_t)gridDim.x * ROWS_PER_BLOCK) {
    const int64_t row = base + g;
    const bool active = row < rows;
    P *xp = reinterpret_cast<P *>(x + (active ? row : 0) * xs);
    P *rp = reinterpret_cast<P *>(r + (active ? row : 0) * rs);
    // Register mode keeps the raw input and residual packs (half the registers of fp32 sums for
    // 16-bit storage) and recomputes the same fp32 add in pass 2: bit-identical s.
    Raw<T, V> ra[MODE == REGS ? RP : 1] = {}, rb[MODE == REGS ? RP : 1] = {};
    Raw<T, V> wregs[WE ? RP : 1] = {};
    float ss = 0.0f;
    if (active) {
      if constexpr (MODE == REGS) {
#pragma unroll
        for (int p = 0; p < RP; ++p) {  // all loads first: 2 * RP packs in flight
          const int i = tid + p * GROUP;
          if (i < n) {
            ra[p].set(load_pack<LH1>(xp + i)), rb[p].set(load_pack<LH1>(rp + i));
            if constexpr (WE) wregs[p].set(wp[i]);
          }
        }
#pragma unroll
        for (int p = 0; p < RP; ++p) {
          const int i = tid + p * GROUP;
          if (i < n) {
            P ro;
#pragma unroll
            for (int k = 0; k < V; ++k) {
              const float s = ra[p].get(k) + rb[p].get(k);
              ss += s * s;
              if constexpr (RE) ro.v[k] = from_f32<T>(s);
            }
            if constexpr (RE) store_pack<SH>(rp + i, ro);
          }
          ra[p].hide(), rb[p].hide();
        }
      } else {
        for (int i = tid; i < n; i += GROUP) {
          const P a = load_pack<LH1>(xp + i), b = load_pack<LH1>(rp + i);
          P ro;
#pragma unroll
          for (int k = 0; k < V; ++k) {
            const float s = to_f32(a.v[k]) + to_f32(b.v[k]);
            ss += s * s;
            if constexpr (MODE == SMEM) cache[k * n + i] = s;
            if constexpr (RE) ro.v[k] = from_f32<T>(s);
          }
          if constexpr (RE) store_pack<SH>(rp + i, ro);
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
      auto finish = [&](int i, const float (&s)[V], const auto &wv) {  // wv: a P or a Raw<T, V>
        if constexpr (RE) {
          P xo;
#pragma unroll
          for (int k = 0; k < V; ++k) xo.v[k] = from_f32<T>(s[k] * scale * weight_at(wv, k));
          store_pack<SH>(xp + i, xo);
        } else {  // the baseline's order: both rows converted, then residual and input stored
          P ro, xo;
#pragma unroll
          for (int k = 0; k < V; ++k) {
            ro.v[k] = from_f32<T>(s[k]);
            xo.v[k] = from_f32<T>(s[k] * scale * weight_at(wv, k));
          }
          store_pack<SH>(rp + i, ro);
          store_pack<SH>(xp + i, xo);
        }
      };
      if constexpr (MODE == REGS) {
#pragma unroll
        for (int p = 0; p < RP; ++p) {
          const int i = tid + p * GROUP;
          if (i < n) {
            float s[V];
#pragma unroll
            for (int k = 0; k < V; ++k) s[k] = ra[p].get(k) + rb[p].get(k);
            if constexpr (WE) {
              finish(i, s, wregs[p]);
            } else {
              Raw<T, V> wv;
              wv.set(wp[i]);
              finish(i, s, wv);
            }
          }
        }
      } else {
        for (int i = tid; i < n; i += GROUP) {
          float s[V];
          if constexpr (MODE == SMEM) {
#pragma unroll
            for (int k = 0; k < V; ++k) s[k] = cache[k * n + i];
          } else {  // the same fp32 add as pass 1: bit-identical s
            const P a = load_pack<LH>(xp + i), b = load_pack<LH>(rp + i);
#pragma unroll
            for (int k = 0; k < V; ++k) s[k] = to_f32(a.v[k]) + to_f32(b.v[k]);
          }
          const P wv = wp[i];  // one vector load (a reference into global memory loads per element)
          finish(i, s, wv);
        }
      }
    }
    if (base + (int64_t)gridDim.x * ROWS_PER_BLOCK < rows) __syncthreads();  // partial[] is reused
  }
}

// Blocks of `kernel` resident on the whole GPU at once (0 if the runtime cannot say).
template <typename K>
[[maybe_unused]] static int64_t resident_blocks(K kernel, int threads, size_t smem) {
  int dev = 0, sms = 0, per_sm = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem) != cudaSuccess)
    return 0;
  return (int64_t)sms * per_sm;
}

// Bytes the L2 holds (queried once; 0 if the runtime cannot say).
[[maybe_unused]] static int64_t l2_bytes() {
  static int64_t bytes = -1;
  if (bytes < 0) {
    int dev = 0, v = 0;
    const bool ok = cudaGetDevice(&dev) == cudaSuccess &&
                    cudaDeviceGetAttribute(&v, cudaDevAttrL2CacheSize, dev) == cudaSuccess;
    bytes = ok ? v : 0;
  }
  return bytes;
}

// One row tile per block, capped to the 1D grid limit or to GRID_WAVES waves of resident blocks
// (the kernel strides over the rest).
template <typename K>
static unsigned grid_for(K kernel, int64_t tiles, size_t smem) {
  int64_t cap = INT_MAX;
  if constexpr (GRID_WAVES > 0) {
    const int64_t resident = resident_blocks(kernel, THREADS, smem);
    if (resident > 0) cap = resident * GRID_WAVES;
  }
  (void)kernel, (void)smem;
  return (unsigned)(tiles < cap ? tiles : cap);
}

template <typename T, int V, int LH, int SH>
static int launch_rows(T *x, int64_t xs, T *r, int64_t rs, const T *w, int64_t rows, int h,
                       cudaStream_t stream) {
  const int64_t tiles = (rows + ROWS_PER_BLOCK - 1) / ROWS_PER_BLOCK;
  const int n = h / V;
  bool done = false;
  if constexpr (CACHE_ROW == 2) {
    // The fewest register packs (1, 2, 4, 8; the scalar path: all of them) that cover a row.
    constexpr int max_rp = REG_FLOATS / V > 0 ? REG_FLOATS / V : 1;
    const int need = (n + GROUP - 1) / GROUP;
    auto go = [&](auto rp_tag) {
      constexpr int RP = decltype(rp_tag)::value;
      auto kernel = fused_add_rmsnorm_kernel<T, V, REGS, RP, LH, SH>;
      kernel<<<grid_for(kernel, tiles, 0), THREADS, 0, stream>>>(x, xs, r, rs, w, rows, h);
      done = true;
    };
    if (need <= max_rp) {
      if constexpr (V == 1 || max_rp == 1) {
        go(std::integral_constant<int, max_rp>{});
      } else {
        if (need <= 1) go(std::integral_constant<int, 1>{});
        else if (need <= 2) go(std::integral_constant<int, 2>{});
        else if constexpr (max_rp >= 4) {
          if (need <= 4) go(std::integral_constant<int, 4>{});
          else if constexpr (max_rp >= 8) go(std::integral_constant<int, 8>{});
        }
      }
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
      auto kernel = fused_add_rmsnorm_kernel<T, V, SMEM, 1, LH, SH>;
      if (bytes > configured) {
        if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes) != cudaSuccess)
          return KOPT_ERR_LAUNCH;
        configured = (int)bytes;
      }
      kernel<<<grid_for(kernel, tiles, (size_t)bytes), THREADS, (size_t)bytes, stream>>>(x, xs, r, rs, w, rows, h);
      done = true;
    }
  }
  if (!done) {
    auto kernel = fused_add_rmsnorm_kernel<T, V, REREAD, 1, LH, SH>;
    kernel<<<grid_for(kernel, tiles, 0), THREADS, 0, stream>>>(x, xs, r, rs, w, rows, h);
  }
  return cudaGetLastError() == cudaSuccess ? KOPT_OK : KOPT_ERR_LAUNCH;
}

// The hints of this call: SMALL_* when it moves no more bytes than the L2 holds (16-byte packs only).
template <typename T, int V>
static int launch_hinted(T *x, int64_t xs, T *r, int64_t rs, const T *w, int64_t rows, int h,
                         cudaStream_t stream) {
  if constexpr (V * sizeof(T) != 16) {
    return launch_rows<T, V, 0, 0>(x, xs, r, rs, w, rows, h, stream);
  } else if constexpr (SMALL_LOAD_HINT == LOAD_HINT && SMALL_STORE_HINT == STORE_HINT) {
    return launch_rows<T, V, LOAD_HINT, STORE_HINT>(x, xs, r, rs, w, rows, h, stream);
  } else {
    if (rows * (int64_t)h * 4 * (int64_t)sizeof(T) <= l2_bytes())
      return launch_rows<T, V, SMALL_LOAD_HINT, SMALL_STORE_HINT>(x, xs, r, rs, w, rows, h, stream);
    return launch_rows<T, V, LOAD_HINT, STORE_HINT>(x, xs, r, rs, w, rows, h, stream);
  }
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
  if (vectorized) return launch_hinted<T, V>(xp, xs, rp, rs, wp, rows, h, stream);
  return launch_hinted<T, 1>(xp, xs, rp, rs, wp, rows, h, stream);
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
