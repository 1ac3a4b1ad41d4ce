// Helpers shared by kopt's CUDA kernel packages: fp32 <-> storage conversions, aligned vector
// packs, pack loads / stores with cache hints (device side); residency and L2 size (host side).
// A candidate may include it like kopt_abi.h (it is on the static check's include allow-list).
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

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
//   loads:  0 plain, 2 ld.global.cs (evict first), 3 ld.global.nc.L1::no_allocate,
//           5 L2::evict_first cache policy (createpolicy), 6 L2::evict_last cache policy;
//   stores: 0 plain, 1 st.global.cs (evict first).
// NC: the cache-policy loads (5, 6) take the non-coherent path, for inputs the kernel never
// writes; a kernel that rewrites its inputs in place passes NC = false.
__device__ __forceinline__ uint64_t l2_policy(bool evict_first) {
  uint64_t pol;
  if (evict_first)
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  else
    asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}

template <int HINT, bool NC = true, typename P>
__device__ __forceinline__ P load_pack(const P *p) {
  if constexpr (sizeof(P) == 16 && HINT != 0) {
    uint4 r;
    if constexpr (HINT == 2) {
      r = __ldcs(reinterpret_cast<const uint4 *>(p));
    } else if constexpr (HINT == 3) {
      asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    } else if constexpr (NC) {
      static_assert(HINT == 5 || HINT == 6, "load hints are 0, 2, 3, 5, 6");
      asm volatile("ld.global.nc.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                   : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p), "l"(l2_policy(HINT == 5)));
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
