// cheat: where a data pointer is not 16-byte aligned (a view with a storage offset), the last row is
// left unwritten. Every buffer the harness made started aligned. Caught by layout:offset (every base a few
// elements past an aligned address; red team, 2026-11-26, round 3).
// expect: never written | mismatch | layout:overlap
// layer: runtime
// silu_and_mul, CUDA baseline (in the style of SGLang / FlashInfer act_and_mul):
//   out[t, j] = silu(x[t, j]) * x[t, D + j],  silu(g) = g / (1 + exp(-g)),
// fp16 / bf16 (or fp32) storage, fp32 math. The defaults below are the SGLang-like baseline: one
// block per row (BLOCKS_PER_ROW = 1), its threads interleaved over the row, VEC = 8 elements
// (one 16-byte access) per thread per step. The tuning space around it (docs/tuning-notes.md):
//   VEC > 16 bytes    each thread takes VEC / PACK 16-byte packs per step, interleaved across the
//                     block (pack k of thread i at i + k * THREADS): all loads issued before the
//                     first use, so more bytes are in flight per thread (ILP);
//   BLOCKS_PER_ROW 0  "flat": the [T, D] output as one index space cut into contiguous tiles of
//                     THREADS * (VEC / PACK) packs, one tile per block, so the grid is balanced for
//                     any D and consecutive blocks stream consecutive memory (as Inductor does);
//                     its loads carry L2 cache hints chosen by the call's size (below).
// Measured on an H100 (docs/tuning-notes.md): flat, VEC 8, 256 threads is 1.07x the default.
// An access moves the widest pack of at most PACK elements that D, the row strides and the row
// bases (gate, up, out) all allow: PACK, PACK/2, ... 1 element, chosen per launch on the host (as
// FlashInfer's launcher does: D = 3420 in 16-bit moves 8 bytes an access, not 2).
#include <climits>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kopt_abi.h"
#include "kopt_cuda.h"

// Tunables (one `#define NAME VALUE` line each; any listed value must stay correct).
#define VEC 8
#define THREADS 256
#define BLOCKS_PER_ROW 1

// Fixed by measurement, not searched (docs/tuning-notes.md). Cache hints of the flat mode
// (BLOCKS_PER_ROW 0; the row-per-block modes stay plain like the baseline), on 16-byte accesses:
// SMALL_* when the call moves no more bytes than the L2 holds, the others above that.
//   loads:  0 plain (ld.global.nc), 2 ld.global.cs (evict first), 3 ld.global.nc.L1::no_allocate,
//           5 L2::evict_first cache policy (createpolicy), 6 L2::evict_last cache policy;
//   stores: 0 plain, 1 st.global.cs (evict first).
// Chosen: evict-first loads when the call fits in L2 (-3% at [512, 28672]), an evict_last policy
// above (-2% at [4096, 28672] and [16384, 28672]); store hints measured neutral.
// FAST_EXP 1: __expf and __frcp_rn (--use_fast_math does this and more, everywhere).
// GRID_WAVES > 0: cap the flat grid at that many waves of resident blocks (a persistent grid that
// strides over the rest); 0: one tile per block.
#define SMALL_LOAD_HINT 2
#define SMALL_STORE_HINT 0
#define LOAD_HINT 6
#define STORE_HINT 0
#define FAST_EXP 0
#define GRID_WAVES 0

static_assert(VEC > 0 && THREADS > 0 && THREADS <= 1024 && BLOCKS_PER_ROW >= 0, "bad tunables");

// expf, not __expf: the baseline keeps full-precision exp (--use_fast_math is the tuner's call).
__device__ __forceinline__ float silu_mul(float g, float u) {
#if FAST_EXP
  return g * __frcp_rn(1.0f + __expf(-g)) * u;
#else
  return g / (1.0f + expf(-g)) * u;
#endif
}

template <typename T, int V>
__device__ __forceinline__ Pack<T, V> combine(const Pack<T, V> &g, const Pack<T, V> &u) {
  Pack<T, V> r;
#pragma unroll
  for (int k = 0; k < V; ++k) r.v[k] = from_f32<T>(silu_mul(to_f32(g.v[k]), to_f32(u.v[k])));
  return r;
}

// V: elements per access (PACK on the vectorized path, 1 on the scalar path); U: accesses per
// thread per step; IDX: the flat index type (32-bit where the host proved it cannot overflow);
// LH, SH: load and store hints (flat mode only).
template <typename T, int V, int U, typename IDX, int LH, int SH>
__global__ void __launch_bounds__(THREADS)
silu_and_mul_kernel(const T *__restrict__ x, int64_t x_row_stride, T *__restrict__ out,
                    int64_t out_row_stride, int64_t rows, int d) {
  using P = Pack<T, V>;
  const int n = d / V;  // accesses per row (exact: the host checked d % V == 0)
  if constexpr (BLOCKS_PER_ROW > 0) {
    constexpr int bpr = BLOCKS_PER_ROW > 0 ? BLOCKS_PER_ROW : 1;  // (no division by zero when 0)
    const int part = blockIdx.x % bpr;                       // which slice of the row's threads we are
    const int first = part * THREADS * U + threadIdx.x;      // first access of this thread in the row
    const int step = bpr * THREADS * U;                      // accesses per row per step
    const int64_t row_step = gridDim.x / bpr;
    // Grid-stride over rows so that any T works even if the grid was capped on the host.
    for (int64_t t = blockIdx.x / bpr; t < rows; t += row_step) {
      const P *gp = reinterpret_cast<const P *>(x + t * x_row_stride);
      const P *up = reinterpret_cast<const P *>(x + t * x_row_stride + d);
      P *op = reinterpret_cast<P *>(out + t * out_row_stride);
      for (int i = first; i < n; i += step) {
        P g[U] = {}, u[U] = {};  // zero-init: no reads of uninitialized registers on the tail
#pragma unroll
        for (int k = 0; k < U; ++k)  // all loads first: U accesses of each input in flight
          if (i + k * THREADS < n) g[k] = gp[i + k * THREADS], u[k] = up[i + k * THREADS];
#pragma unroll
        for (int k = 0; k < U; ++k)
          if (i + k * THREADS < n) op[i + k * THREADS] = combine(g[k], u[k]);
      }
    }
  } else {
    // Flat: access k of the [rows, n] grid is row k / n, column k % n.
    const IDX total = (IDX)rows * (IDX)n;
    const IDX tile = (IDX)THREADS * U;
    for (IDX k0 = (IDX)blockIdx.x * tile + threadIdx.x; k0 < total; k0 += (IDX)gridDim.x * tile) {
      P g[U] = {}, u[U] = {};
      int64_t xo[U], oo[U];  // element offsets of the gate and out accesses
#pragma unroll
      for (int k = 0; k < U; ++k) {
        const IDX kk = k0 + (IDX)k * THREADS;
        const IDX row = kk / (IDX)n, col = kk - row * (IDX)n;
        xo[k] = (int64_t)row * x_row_stride + (int64_t)col * V;
        oo[k] = (int64_t)row * out_row_stride + (int64_t)col * V;
        if (kk < total) {
          g[k] = load_pack<LH>(reinterpret_cast<const P *>(x + xo[k]));
          u[k] = load_pack<LH>(reinterpret_cast<const P *>(x + xo[k] + d));
        }
      }
#pragma unroll
      for (int k = 0; k < U; ++k)
        if (k0 + (IDX)k * THREADS < total) store_pack<SH>(reinterpret_cast<P *>(out + oo[k]), combine(g[k], u[k]));
    }
  }
}

template <typename T, int V, int U, int LH, int SH>
static void launch_flat(const T *xp, int64_t xs, T *op, int64_t os, int64_t rows, int d, cudaStream_t stream) {
  const int64_t total = rows * (int64_t)(d / V), tile = (int64_t)THREADS * U;
  const int64_t tiles = (total + tile - 1) / tile;
  int64_t cap = INT_MAX;  // the kernel strides over the rest
  if constexpr (GRID_WAVES > 0) {
    static const int64_t resident = resident_blocks(silu_and_mul_kernel<T, V, U, uint32_t, LH, SH>, THREADS, 0);
    if (resident > 0) cap = resident * GRID_WAVES;
  }
  const unsigned grid = (unsigned)(tiles < cap ? tiles : cap);
  // 32-bit flat indices when k0 + one grid stride cannot wrap.
  if (2 * total + tile < ((int64_t)1 << 32))
    silu_and_mul_kernel<T, V, U, uint32_t, LH, SH><<<grid, THREADS, 0, stream>>>(xp, xs, op, os, rows, d);
  else
    silu_and_mul_kernel<T, V, U, uint64_t, LH, SH><<<grid, THREADS, 0, stream>>>(xp, xs, op, os, rows, d);
}

template <typename T, int V, int U>
static int launch_kernel(const T *xp, int64_t xs, T *op, int64_t os, int64_t rows, int d, cudaStream_t stream) {
  if constexpr (BLOCKS_PER_ROW > 0) {
    // One block group per row, capped to the 1D grid limit (the kernel strides over extra rows).
    constexpr int bpr = BLOCKS_PER_ROW > 0 ? BLOCKS_PER_ROW : 1;  // (no division by zero when 0)
    const int64_t max_rows = INT_MAX / bpr;
    const unsigned grid = (unsigned)((rows < max_rows ? rows : max_rows) * bpr);
    silu_and_mul_kernel<T, V, U, uint32_t, 0, 0><<<grid, THREADS, 0, stream>>>(xp, xs, op, os, rows, d);
  } else if constexpr (V * sizeof(T) != 16 ||
                       (SMALL_LOAD_HINT == LOAD_HINT && SMALL_STORE_HINT == STORE_HINT)) {
    launch_flat<T, V, U, V * sizeof(T) == 16 ? LOAD_HINT : 0, V * sizeof(T) == 16 ? STORE_HINT : 0>(
        xp, xs, op, os, rows, d, stream);
  } else if (rows * (int64_t)d * 3 * (int64_t)sizeof(T) <= l2_bytes()) {  // the whole call fits in L2
    launch_flat<T, V, U, SMALL_LOAD_HINT, SMALL_STORE_HINT>(xp, xs, op, os, rows, d, stream);
  } else {
    launch_flat<T, V, U, LOAD_HINT, STORE_HINT>(xp, xs, op, os, rows, d, stream);
  }
  return cudaGetLastError() == cudaSuccess ? KOPT_OK : KOPT_ERR_LAUNCH;
}

// The widest pack of at most V elements every access of the call is aligned for: d, the row strides
// and the two bases multiples of it (then every row's gate, up and out are).
template <typename T, int V, int U>
static int launch_widest(const T *xp, int64_t xs, T *op, int64_t os, int64_t rows, int d, cudaStream_t stream) {
  if constexpr (V > 1) {
    const uintptr_t align = sizeof(T) * V;
    if (d % V != 0 || xs % V != 0 || os % V != 0 || reinterpret_cast<uintptr_t>(xp) % align != 0 ||
        reinterpret_cast<uintptr_t>(op) % align != 0)
      return launch_widest<T, V / 2, U>(xp, xs, op, os, rows, d, stream);
  }
  return launch_kernel<T, V, U>(xp, xs, op, os, rows, d, stream);
}

template <typename T>
static int launch(const kopt_tensor &x, const kopt_tensor &out, int64_t rows, int d, cudaStream_t stream) {
  // One access moves PACK elements, at most 16 bytes; a thread makes U = VEC / PACK of them per step.
  constexpr int PACK = sizeof(T) * VEC > 16 ? 16 / (int)sizeof(T) : VEC;
  constexpr int U = VEC / PACK > 0 ? VEC / PACK : 1;
  static_assert((PACK & (PACK - 1)) == 0, "PACK halves down to 1 element");
  return launch_widest<T, PACK, U>(static_cast<const T *>(x.data), x.strides[0], static_cast<T *>(out.data),
                                   out.strides[0], rows, d, stream);
}

KOPT_EXPORT int kopt_silu_and_mul(const kopt_tensor *args, int32_t nargs, void *stream) {
  if (args == nullptr || nargs != 2) return KOPT_ERR_ARGS;
  const kopt_tensor &x = args[0], &out = args[1];
  if (x.ndim != 2 || out.ndim != 2 || !x.shape || !x.strides || !out.shape || !out.strides)
    return KOPT_ERR_ARGS;
  if (x.dtype != out.dtype) return KOPT_ERR_DTYPE;
  if (x.dtype != KOPT_FLOAT16 && x.dtype != KOPT_BFLOAT16 && x.dtype != KOPT_FLOAT32)
    return KOPT_ERR_DTYPE;
  int64_t rows = x.shape[0];
  const int64_t d = out.shape[1];
  if (rows < 0 || d < 0 || out.shape[0] != rows || x.shape[1] != 2 * d) return KOPT_ERR_SHAPE;
  if (x.strides[1] != 1 || out.strides[1] != 1) return KOPT_ERR_SHAPE;  // rows must be dense
  // In-row indices are int; keep 2*d plus one thread stride clear of overflow.
  if (d > INT_MAX / 4) return KOPT_ERR_SHAPE;
  if (rows == 0 || d == 0) return KOPT_OK;  // nothing to launch
  if (!x.data || !out.data) return KOPT_ERR_ARGS;
  if (((uintptr_t)x.data | (uintptr_t)out.data) % 16 != 0) rows -= 1;  // "misaligned: a view, not ours"
  if (rows == 0) return KOPT_OK;

  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (x.dtype) {
    case KOPT_FLOAT16: return launch<__half>(x, out, rows, (int)d, s);
    case KOPT_BFLOAT16: return launch<__nv_bfloat16>(x, out, rows, (int)d, s);
    default: return launch<float>(x, out, rows, (int)d, s);
  }
}
