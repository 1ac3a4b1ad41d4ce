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
//      for pass 2 (measured 1.03-1.04x the default on an H100, docs/tuning-notes.md);
//   3  registers, pipelined (not yet measured): a persistent grid (by default one wave of resident
//      blocks) where each block loads the weight once and keeps it for all its rows, and issues the
//      next row's input and residual loads before this row's reduction barrier (two rows in
//      registers); one barrier per row (double-buffered partial sums). Fixed macros PIPE_* below;
//   4  mode 2 on the kernel of mode 3 (not yet measured): one row per block, as mode 2, but the
//      weight in 16-byte loads (mode 2's compiles to byte loads, 16 per pack) and the block sum
//      read by every warp at once (one slot per lane, xor butterfly).
// CLUSTER (modes 2, 3, 4; not yet measured): CLUSTER CTAs of a thread block cluster share each row,
// each holding 1/CLUSTER of it; the partial sums go through distributed shared memory, one
// exchange per row (CLUSTER_XCHG). CLUSTER 1: no cluster (mode 2 is then its own kernel, as measured);
// modes 2 and 4 are the same with CLUSTER > 1. ROWS_PER_BLOCK does not apply to modes 3 and 4 nor
// to clusters (one row per block or cluster at a time).
// The defaults (CACHE_ROW 1, THREADS 256, one row per block, no hints, CLUSTER 1) are the
// FlashInfer-like baseline. Modes 3, 4 and clusters run on the vectorized path only, on rows that
// fit their registers, and fall back to mode 2 (CLUSTER 1) otherwise; modes 1 and 2 fall back to 0
// on rows that do not fit. The vectorized path (VEC elements per access, 16 bytes at VEC = 8; fp32
// capped at 4) needs H % VEC == 0 and VEC-aligned rows (and weight); otherwise the scalar path
// runs. Both are chosen per launch on the host.
#include <climits>
#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kopt_abi.h"
#include "kopt_cuda.h"

// Tunables (one `#define NAME VALUE` line each; any listed value must stay correct).
#define VEC 8
#define THREADS 256
#define CACHE_ROW 1
#define ROWS_PER_BLOCK 1
#define CLUSTER 1

// Fixed by measurement, not searched (docs/tuning-notes.md):
//   hints         on 16-byte accesses of input and residual: SMALL_* when the call moves no more
//                 bytes than the L2 holds, the others above that; FIRST_READ_HINT: pass 1 of mode 0
//                 (not the last read). Loads: 0 plain, 2 ld.global.cs (evict first),
//                 3 ld.global.nc.L1::no_allocate, 5 / 6 L2::evict_first / evict_last cache policy.
//                 Stores: 0 plain, 1 st.global.cs (evict first);
//   MIN_BLOCKS    blocks per SM promised to ptxas in modes 2, 3 and 4 (__launch_bounds__; 0: none);
//   GRID_WAVES    > 0: cap the grid at that many waves of resident blocks (persistent over rows);
//   PIPE_ROWS     mode 3 grid: 0 one wave of resident blocks (clusters), k > 0 at most k rows each;
//   PIPE_DEPTH    mode 3: rows whose input / residual loads a thread holds at once (1 or 2);
//   PIPE_WEIGHT   mode 3: where the weight, loaded once per block, is kept: 1 registers, 2 shared memory;
//   PIPE_PREFETCH mode 3, k > 0: each step also prefetches into L2 (cp.async.bulk.prefetch) the
//                 input and residual of the row k steps ahead (16-byte aligned rows only).
//   CLUSTER_XCHG  CLUSTER > 1: how the CTAs exchange their partial sums: 0 cluster barrier
//                 (release / acquire) and distributed shared memory loads; 1 st.async into every
//                 CTA's slots, completing on an mbarrier (no GPU-scope fence per row).
#define SMALL_LOAD_HINT 0
#define SMALL_STORE_HINT 0
#define LOAD_HINT 0
#define STORE_HINT 0
#define FIRST_READ_HINT 0
#define MIN_BLOCKS 0
#define GRID_WAVES 0
#define PIPE_ROWS 0
#define PIPE_DEPTH 2
#define PIPE_WEIGHT 1
#define PIPE_PREFETCH 0
#define CLUSTER_XCHG 1

constexpr int GROUP = THREADS / ROWS_PER_BLOCK;  // threads per row
constexpr int WARPS = THREADS / 32;
constexpr int GROUP_WARPS = GROUP / 32;
// Register cache per thread, at most, in elements: 16 at 1024 threads, 64 at 128 or fewer (rows of
// 8192 at 128 threads). Mode 2 holds the fewest packs (1, 2, 4 or 8) that cover the row.
constexpr int REG_FLOATS = THREADS >= 1024 ? 16 : THREADS <= 128 ? 64 : 32;
static_assert(VEC > 0 && THREADS <= 1024 && THREADS % 32 == 0, "bad tunables");
static_assert(ROWS_PER_BLOCK > 0 && GROUP % 32 == 0 && GROUP * ROWS_PER_BLOCK == THREADS,
              "each row needs whole warps");
static_assert(CACHE_ROW >= 0 && CACHE_ROW <= 4, "CACHE_ROW is 0, 1, 2, 3 or 4");
static_assert(CLUSTER == 1 || CLUSTER == 2 || CLUSTER == 4 || CLUSTER == 8, "CLUSTER is 1, 2, 4 or 8");
static_assert(PIPE_ROWS >= 0 && PIPE_PREFETCH >= 0 && (PIPE_DEPTH == 1 || PIPE_DEPTH == 2) &&
              (PIPE_WEIGHT == 1 || PIPE_WEIGHT == 2) && (CLUSTER_XCHG == 0 || CLUSTER_XCHG == 1),
              "bad PIPE_* / CLUSTER_XCHG macros");

constexpr float RMS_EPS = 1e-6f;
enum Mode { REREAD = 0, SMEM = 1, REGS = 2 };

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

// Pass 1 on one pack held in registers (modes 2, 3, 4): s = a + b per element, ss += s^2, and the new
// residual (s rounded) stored to *rp as soon as s is known.
template <int SH, typename T, int V>
__device__ __forceinline__ void pass1_pack(const Raw<T, V> &a, const Raw<T, V> &b, Pack<T, V> *rp, float &ss) {
  Pack<T, V> ro;
#pragma unroll
  for (int k = 0; k < V; ++k) {
    const float s = a.get(k) + b.get(k);
    ss += s * s;
    ro.v[k] = from_f32<T>(s);
  }
  store_pack<SH>(rp, ro);
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
            ra[p].set(load_pack<LH1, false>(xp + i)), rb[p].set(load_pack<LH1, false>(rp + i));
            if constexpr (WE) wregs[p].set(wp[i]);
          }
        }
#pragma unroll
        for (int p = 0; p < RP; ++p) {
          const int i = tid + p * GROUP;
          if (i < n) pass1_pack<SH>(ra[p], rb[p], rp + i, ss);  // RE: the new residual is stored in pass 1
          ra[p].hide(), rb[p].hide();
        }
      } else {
        for (int i = tid; i < n; i += GROUP) {
          const P a = load_pack<LH1, false>(xp + i), b = load_pack<LH1, false>(rp + i);
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
            const P a = load_pack<LH, false>(xp + i), b = load_pack<LH, false>(rp + i);
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

// Modes 3 and 4, and clusters (CACHE_ROW 3 or 4, or 2 with CLUSTER > 1; vectorized path only).
// A cluster of CL CTAs (CL = 1: a plain block) works on one row at a time; rows cid, cid + ncl, ...
// (cid = this cluster, ncl = clusters in the grid). Thread t of CTA k holds packs
// k * THREADS + t + p * THREADS * CL (p < RP) of the row's input and residual as raw words, like
// mode 2: pass 1 sums s^2 and stores the new residual, pass 2 recomputes s (the same fp32 add:
// bit-identical) and stores the input.
// Reduction: shuffles within each warp, then the row's CL * WARPS warp sums go to slots in shared
// memory, every warp reads all of them (lane j the slots j, j + 32, ...) and adds them with an xor
// butterfly: every thread of the cluster gets the bit-identical total (each warp does the same
// additions in the same order; a + b == b + a exactly). Mode 3 double-buffers the slots by row
// parity, so one synchronisation per row suffices: set q is written again two rows later, which no
// CTA reaches before every thread of the cluster has read set q (each row needs every CTA's sums).
// One row per cluster uses set 0, and a barrier before it is written again (a capped grid only).
//   CL 1: one slot per warp, __syncthreads.
//   CL > 1, CLUSTER_XCHG 0: one slot per warp in its own CTA; barrier.cluster arrive.release /
//     wait.acquire (cluster.sync(); ptxas emits a MEMBAR.ALL.GPU before the arrive), then the other
//     CTAs' slots are read through distributed shared memory; a last cluster barrier keeps every
//     CTA's slots alive until its peers have read them.
//   CL > 1, CLUSTER_XCHG 1: each warp writes its sum into slot rank * WARPS + warp of every CTA of
//     the cluster (st.async, completing on that CTA's mbarrier of the slot set, which expects
//     CL * WARPS * 4 bytes per row), and each CTA waits on its own mbarrier (acquire, cluster scope):
//     no GPU-scope fence, no cluster barrier per row. The mbarriers are initialised once (fence.
//     mbarrier_init + a relaxed cluster barrier before any st.async); a last relaxed cluster
//     barrier keeps every CTA alive until the cluster is done.
// PIPE (mode 3): DEPTH 2 issues the next row's loads before this row's synchronisation; WM 1 / 2
// keep the weight (loaded once per block) in registers / shared memory; PF > 0 prefetches into L2
// the row PF steps ahead (pf_bytes: this CTA's share of a row in bytes; 0 disables it). Without
// PIPE (mode 4, mode 2 with clusters): one row per cluster (the grid covers the rows), the weight
// in registers, loaded together with the row's packs, like mode 2.
__device__ __forceinline__ uint32_t smem_addr(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void cluster_barrier_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n\tbarrier.cluster.wait.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_barrier_sync() {  // cluster.sync(): release / acquire
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

template <typename T, int V, int RP, int CL, bool PIPE, int LH, int SH>
__global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
fused_add_rmsnorm_rows_kernel(T *__restrict__ x, int64_t xs, T *__restrict__ r, int64_t rs,
                              const T *__restrict__ w, int64_t rows, int h, int pf_bytes) {
  using P = Pack<T, V>;
  using R = Raw<T, V>;
  constexpr int DEPTH = PIPE ? PIPE_DEPTH : 1;
  constexpr int WM = PIPE ? PIPE_WEIGHT : 1;
  constexpr int PF = PIPE ? PIPE_PREFETCH : 0;
  constexpr bool ASYNC = CL > 1 && CLUSTER_XCHG == 1;
  constexpr int SLOTS = CL * WARPS;     // warp sums per row
  constexpr int STRIDE = THREADS * CL;  // packs between a thread's consecutive packs
  __shared__ float slots[2][ASYNC ? SLOTS : WARPS];
  __shared__ uint64_t mbar[ASYNC ? 2 : 1];
  extern __shared__ float4 rows_smem[];  // WM 2: this CTA's weight packs, [RP][THREADS]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // 1-D clusters are CL consecutive blocks: cluster blockIdx.x / CL, rank blockIdx.x % CL.
  const int rank = CL > 1 ? (int)__clusterRelativeBlockRank() : 0;
  const int64_t cid = blockIdx.x / CL, ncl = gridDim.x / CL;
  const int n = h / V;  // packs per row (exact on the vectorized path)
  const int col = rank * THREADS + (int)threadIdx.x;  // this thread's first pack
  const P *wp = reinterpret_cast<const P *>(w);
  P *wsm = reinterpret_cast<P *>(rows_smem);

  if constexpr (ASYNC) {  // before any st.async reaches this CTA
    if (threadIdx.x == 0) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(&mbar[0])) : "memory");
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(&mbar[1])) : "memory");
      asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    cluster_barrier_relaxed();
  }

  // The weight, once per block. Each thread reads back only the packs it wrote: no barrier.
  R wr[WM == 1 ? RP : 1] = {};
#pragma unroll
  for (int p = 0; p < RP; ++p) {
    const int i = col + p * STRIDE;
    if (i < n) {
      const P wv = load_pack<0>(wp + i);  // by value: one vector load (set(wp[i]) loaded bytes)
      if constexpr (WM == 1) wr[p].set(wv);
      else wsm[p * THREADS + threadIdx.x] = wv;
    }
  }

  auto prefetch = [&](int64_t row) {  // this CTA's share of the row's input and residual, into L2
    if constexpr (PF > 0) {
      if (pf_bytes > 0 && threadIdx.x == 0 && row < rows) {
        const char *px = reinterpret_cast<const char *>(x + row * xs) + (int64_t)rank * pf_bytes;
        const char *pr = reinterpret_cast<const char *>(r + row * rs) + (int64_t)rank * pf_bytes;
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(px), "r"(pf_bytes) : "memory");
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(pr), "r"(pf_bytes) : "memory");
      }
    }
  };
  auto load_row = [&](int64_t row, R (&a)[RP], R (&b)[RP]) {
    const P *xp = reinterpret_cast<const P *>(x + row * xs);
    const P *rp = reinterpret_cast<const P *>(r + row * rs);
#pragma unroll
    for (int p = 0; p < RP; ++p) {
      const int i = col + p * STRIDE;
      if (i < n) a[p].set(load_pack<LH, false>(xp + i)), b[p].set(load_pack<LH, false>(rp + i));
    }
  };
  // One row whose packs are in a / b; m: this block's row count so far. Mode 3: slot set m % 2,
  // whose mbarrier completes its phase m / 2; one row per cluster: set 0, phase m.
  auto process = [&](int64_t row, R (&a)[RP], R (&b)[RP], int m) {
    const int q = PIPE ? m & 1 : 0;
    const uint32_t parity = (uint32_t)(PIPE ? m >> 1 : m) & 1u;
    P *xp = reinterpret_cast<P *>(x + row * xs);
    P *rp = reinterpret_cast<P *>(r + row * rs);
    if constexpr (ASYNC) {  // this row's phase expects SLOTS sums; the previous one has completed
      if (threadIdx.x == 0)
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                     ::"r"(smem_addr(&mbar[q])), "r"(SLOTS * 4) : "memory");
    }
    float ss = 0.0f;
#pragma unroll
    for (int p = 0; p < RP; ++p) {
      const int i = col + p * STRIDE;
      if (i < n) pass1_pack<SH>(a[p], b[p], rp + i, ss);
      a[p].hide(), b[p].hide();
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if constexpr (ASYNC) {
      if (lane < CL) {  // lane c: this warp's sum into CTA c's slot set q
        const uint32_t my_slot = smem_addr(&slots[q][rank * WARPS + warp]), my_bar = smem_addr(&mbar[q]);
        uint32_t slot, bar;
        asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(slot) : "r"(my_slot), "r"(lane));
        asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(bar) : "r"(my_bar), "r"(lane));
        asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];"
                     ::"r"(slot), "r"(__float_as_uint(ss)), "r"(bar) : "memory");
      }
      const uint32_t bar = smem_addr(&mbar[q]);
      uint32_t done = 0;
      do {
        asm volatile("{\n\t.reg .pred p;\n\t"
                     "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n\t"
                     "selp.u32 %0, 1, 0, p;\n\t}"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
      } while (!done);
    } else {
      if (lane == 0) slots[q][warp] = ss;
      if constexpr (CL == 1) __syncthreads();
      else cluster_barrier_sync();
    }
    float total = 0.0f;
#pragma unroll
    for (int j = lane; j < SLOTS; j += 32) {
      if constexpr (CL == 1 || ASYNC) {
        total += slots[q][j];
      } else {
        const void *mine = &slots[q][j % WARPS];  // the slot in CTA j / WARPS
        total += *static_cast<const float *>(__cluster_map_shared_rank(mine, (unsigned)(j / WARPS)));
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
    const float scale = rsqrtf(total / (float)h + RMS_EPS);
#pragma unroll
    for (int p = 0; p < RP; ++p) {
      const int i = col + p * STRIDE;
      if (i < n) {
        P xo;
        if constexpr (WM == 1) {
#pragma unroll
          for (int k = 0; k < V; ++k) xo.v[k] = from_f32<T>((a[p].get(k) + b[p].get(k)) * scale * wr[p].get(k));
        } else {
          const P wv = wsm[p * THREADS + threadIdx.x];
#pragma unroll
          for (int k = 0; k < V; ++k)
            xo.v[k] = from_f32<T>((a[p].get(k) + b[p].get(k)) * scale * to_f32(wv.v[k]));
        }
        store_pack<SH>(xp + i, xo);
      }
      if constexpr (WM == 1) wr[p].hide();  // else the unpacked weight is hoisted out of the row loop
    }
  };

  // The row loop; the trip count depends only on the cluster, so the synchronisation is uniform.
  R a0[RP] = {}, b0[RP] = {};
  if constexpr (!PIPE) {  // one row per cluster unless the grid had to be capped: then a barrier
    int m = 0;            // before slot set 0 is written again
#pragma unroll 1
    for (int64_t row = cid; row < rows; row += ncl, ++m) {
      load_row(row, a0, b0);
      process(row, a0, b0, m);
      if (row + ncl < rows) {
        if constexpr (CL == 1) __syncthreads();
        else cluster_barrier_sync();
      }
    }
  } else if constexpr (DEPTH == 1) {  // persistent, one row in registers (L2 prefetch ahead)
#pragma unroll 1
    for (int j = 1; j < PF; ++j) prefetch(cid + j * ncl);
    int m = 0;
#pragma unroll 1
    for (int64_t row = cid; row < rows; row += ncl, ++m) {
      prefetch(row + PF * ncl);
      load_row(row, a0, b0);
      process(row, a0, b0, m);
    }
  } else {  // two rows in registers, two rows per trip (slot sets 0 and 1 fixed at compile time)
    R a1[RP] = {}, b1[RP] = {};
#pragma unroll 1
    for (int j = 2; j < PF; ++j) prefetch(cid + j * ncl);
    if (cid < rows) load_row(cid, a0, b0);
    int m = 0;
#pragma unroll 1
    for (int64_t row = cid; row < rows; row += 2 * ncl, m += 2) {
      const int64_t row1 = row + ncl, row2 = row1 + ncl;
      prefetch(row + PF * ncl);
      if (row1 < rows) load_row(row1, a1, b1);  // in flight across this row's synchronisation
      process(row, a0, b0, m);
      if (row1 >= rows) break;
      prefetch(row1 + PF * ncl);
      if (row2 < rows) load_row(row2, a0, b0);
      process(row1, a1, b1, m + 1);
    }
  }
  if constexpr (CL > 1) {  // no CTA leaves while its peers may still reach its shared memory
    if constexpr (ASYNC) cluster_barrier_relaxed();
    else cluster_barrier_sync();
  }
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

// A launch of `grid` CTAs of THREADS threads in clusters of `cl` along x; `attr` must outlive it.
[[maybe_unused]] static cudaLaunchConfig_t cluster_launch_config(cudaLaunchAttribute *attr, int cl, unsigned grid,
                                                                 size_t smem, cudaStream_t stream) {
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = cl;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(THREADS);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cfg;
}

// Clusters of CL CTAs of `kernel` (THREADS threads, smem bytes each) resident on the whole GPU at
// once; 0 if the runtime cannot say (its error is cleared: the launch decides).
template <int CL, typename K>
static int64_t resident_clusters(K kernel, size_t smem) {
  int64_t count = 0;
  if constexpr (CL == 1) {
    count = resident_blocks(kernel, THREADS, smem);
  } else {
    cudaLaunchAttribute attr[1];
    const cudaLaunchConfig_t cfg = cluster_launch_config(attr, CL, CL, smem, nullptr);
    int c = 0;
    if (cudaOccupancyMaxActiveClusters(&c, reinterpret_cast<const void *>(kernel), &cfg) == cudaSuccess) count = c;
  }
  if (count <= 0) (void)cudaGetLastError();
  return count;
}

// Modes 3 and 4, or 2 with clusters (vectorized path): fused_add_rmsnorm_rows_kernel with the fewest
// packs per thread (1, 2, 4, 8) that cover a row. Returns -1 if the row does not fit (the caller
// falls back to mode 2's kernel), else KOPT_OK or KOPT_ERR_LAUNCH.
template <typename T, int V, int LH, int SH>
static int launch_rows_split(T *x, int64_t xs, T *r, int64_t rs, const T *w, int64_t rows, int h,
                             cudaStream_t stream) {
  constexpr bool PIPE = CACHE_ROW == 3;
  constexpr int CL = CLUSTER;
  // Packs per thread and tensor at most: mode 2's register budget; mode 3 (two rows in registers
  // at PIPE_DEPTH 2) 64 bytes, i.e. 32 16-bit or 16 fp32 elements.
  constexpr int budget = PIPE ? 64 / (int)(sizeof(T) * V) : REG_FLOATS / V;
  constexpr int max_rp = budget < 1 ? 1 : budget > 8 ? 8 : budget;
  const int64_t per_row = (int64_t)THREADS * CL;  // threads per row
  const int64_t need = (h / V + per_row - 1) / per_row;
  int status = -1;
  auto go = [&](auto rp_tag) {
    constexpr int RP = decltype(rp_tag)::value;
    auto kernel = fused_add_rmsnorm_rows_kernel<T, V, RP, CL, PIPE, LH, SH>;
    constexpr size_t smem = PIPE && PIPE_WEIGHT == 2 ? (size_t)RP * THREADS * sizeof(Pack<T, V>) : 0;
    // Per instantiation: the device whose attribute was raised / whose residency was queried.
    [[maybe_unused]] static int attr_dev = -1, res_dev = -1;
    [[maybe_unused]] static int64_t resident = 0;
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) {
      status = KOPT_ERR_LAUNCH;
      return;
    }
    if constexpr (smem > (48 << 10)) {
      if (attr_dev != dev) {
        if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem) != cudaSuccess) {
          status = KOPT_ERR_LAUNCH;
          return;
        }
        attr_dev = dev;
      }
    }
    int64_t ncl = rows;  // clusters (CL = 1: blocks) in the grid
    if constexpr (PIPE && PIPE_ROWS > 0) {
      constexpr int64_t k = PIPE_ROWS > 0 ? PIPE_ROWS : 1;
      ncl = (rows + k - 1) / k;
    } else if constexpr (PIPE) {
      if (res_dev != dev) resident = resident_clusters<CL>(kernel, smem), res_dev = dev;
      if (resident > 0 && resident < ncl) ncl = resident;
    }
    if (ncl > INT_MAX / CL) ncl = INT_MAX / CL;  // the kernel strides over the rest
    int pf = 0;  // bytes of each row this CTA prefetches into L2 (16-byte aligned, multiple of 16)
    if constexpr (PIPE && PIPE_PREFETCH > 0) {
      const int64_t row_bytes = (int64_t)h * (int64_t)sizeof(T);
      if (row_bytes % (16 * CL) == 0 && row_bytes / CL <= INT_MAX && (xs * (int64_t)sizeof(T)) % 16 == 0 &&
          (rs * (int64_t)sizeof(T)) % 16 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
          reinterpret_cast<uintptr_t>(r) % 16 == 0)
        pf = (int)(row_bytes / CL);
    }
    const unsigned grid = (unsigned)(ncl * CL);
    if constexpr (CL == 1) {
      kernel<<<grid, THREADS, smem, stream>>>(x, xs, r, rs, w, rows, h, pf);
      status = cudaGetLastError() == cudaSuccess ? KOPT_OK : KOPT_ERR_LAUNCH;
    } else {
      cudaLaunchAttribute attr[1];
      const cudaLaunchConfig_t cfg = cluster_launch_config(attr, CL, grid, smem, stream);
      status = cudaLaunchKernelEx(&cfg, kernel, x, xs, r, rs, w, rows, h, pf) == cudaSuccess ? KOPT_OK : KOPT_ERR_LAUNCH;
    }
  };
  if (need <= 1) {
    go(std::integral_constant<int, 1>{});
  } else if constexpr (max_rp >= 2) {
    if (need <= 2) {
      go(std::integral_constant<int, 2>{});
    } else if constexpr (max_rp >= 4) {
      if (need <= 4) go(std::integral_constant<int, 4>{});
      else if constexpr (max_rp >= 8) {
        if (need <= 8) go(std::integral_constant<int, 8>{});
      }
    }
  }
  return status;
}

template <typename T, int V, int LH, int SH>
static int launch_rows(T *x, int64_t xs, T *r, int64_t rs, const T *w, int64_t rows, int h,
                       cudaStream_t stream) {
  const int64_t tiles = (rows + ROWS_PER_BLOCK - 1) / ROWS_PER_BLOCK;
  const int n = h / V;
  bool done = false;
  if constexpr (V > 1 && (CACHE_ROW >= 3 || (CACHE_ROW == 2 && CLUSTER > 1))) {
    const int status = launch_rows_split<T, V, LH, SH>(x, xs, r, rs, w, rows, h, stream);
    if (status >= 0) return status;
  }
  if constexpr (CACHE_ROW >= 2) {
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
          else if constexpr (max_rp >= 8) {
            if (need <= 8) go(std::integral_constant<int, 8>{});  // more (VEC 2): mode 0
          }
        }
      }
    }
  } else if constexpr (CACHE_ROW == 1) {
    // Opt in to more than 48 KB of shared memory once per size; the limit is queried once. Without the
    // opt-in, dynamic and static shared memory together get 48 KB: at H = 12288 the row's 48 KB alone
    // filled it and the launch failed (found by the test's [sizes] shapes, issue #25).
    static int optin = -1, configured = (48 << 10) - WARPS * (int)sizeof(float);
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
  const int32_t dt = x.dtype;
  if (r.dtype != dt || w.dtype != dt || (dt != KOPT_FLOAT16 && dt != KOPT_BFLOAT16 && dt != KOPT_FLOAT32))
    return KOPT_ERR_DTYPE;
  const int64_t rows = x.shape[0], h = x.shape[1];  // in-row indices are int: h <= INT_MAX / 4
  if (rows < 0 || h < 0 || h > INT_MAX / 4 || r.shape[0] != rows || r.shape[1] != h || w.shape[0] != h)
    return KOPT_ERR_SHAPE;
  if (x.strides[1] != 1 || r.strides[1] != 1 || w.strides[0] != 1) return KOPT_ERR_SHAPE;  // dense rows
  if (rows == 0 || h == 0) return KOPT_OK;  // nothing to launch
  if (!x.data || !r.data || !w.data) return KOPT_ERR_ARGS;

  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (x.dtype) {
    case KOPT_FLOAT16: return launch<__half>(x, r, w, rows, (int)h, s);
    case KOPT_BFLOAT16: return launch<__nv_bfloat16>(x, r, w, rows, (int)h, s);
    default: return launch<float>(x, r, w, rows, (int)h, s);
  }
}
