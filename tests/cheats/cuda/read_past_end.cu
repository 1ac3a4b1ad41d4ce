// cheat: each thread also reads the element one row below the one it computes (a "prefetch" of the
// next row) and keeps it only when it is not NaN; rows of the last row read past the end of `x`. The
// values are never used, every output is right, nothing is written outside a buffer: poison and
// guards cannot see it, compute-sanitizer only at the shapes it runs. Only a buffer whose end abuts
// unmapped memory faults on it, at any size (issue #25, item 4).
// expect: goes through `x`
// layer: fault
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kopt_abi.h"

// The honest part every cheat shares: a plain grid-stride silu_and_mul, fp32 math.
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ void from_f(__half &o, float f) { o = __float2half_rn(f); }
__device__ __forceinline__ void from_f(__nv_bfloat16 &o, float f) { o = __float2bfloat16_rn(f); }

template <typename T>
__global__ void silu_kernel(const T *x, int64_t xs, T *out, int64_t os, int64_t rows, int64_t d) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < rows * d; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t t = i / d, j = i % d;
    const float g = to_f(x[t * xs + j]), u = to_f(x[t * xs + d + j]);
    from_f(out[t * os + j], g / (1.0f + expf(-g)) * u);
  }
}

static int check(const kopt_tensor *args, int32_t nargs) {
  if (nargs != 2 || args[0].ndim != 2 || args[1].ndim != 2) return KOPT_ERR_ARGS;
  if (args[0].dtype != args[1].dtype || (args[0].dtype != KOPT_FLOAT16 && args[0].dtype != KOPT_BFLOAT16))
    return KOPT_ERR_DTYPE;
  if (args[0].strides[1] != 1 || args[1].strides[1] != 1) return KOPT_ERR_SHAPE;
  return KOPT_OK;
}

static unsigned blocks_for(int64_t n) { return (unsigned)((n + 255) / 256 < 65535 ? (n + 255) / 256 : 65535); }

[[maybe_unused]] static int launch(const kopt_tensor &x, const kopt_tensor &out, cudaStream_t s) {
  const int64_t rows = x.shape[0], d = out.shape[1], n = rows * d;
  if (n == 0) return KOPT_OK;
  if (x.dtype == KOPT_FLOAT16)
    silu_kernel<<<blocks_for(n), 256, 0, s>>>((const __half *)x.data, x.strides[0], (__half *)out.data, out.strides[0], rows, d);
  else
    silu_kernel<<<blocks_for(n), 256, 0, s>>>((const __nv_bfloat16 *)x.data, x.strides[0], (__nv_bfloat16 *)out.data,
                                              out.strides[0], rows, d);
  return cudaGetLastError() == cudaSuccess ? KOPT_OK : KOPT_ERR_LAUNCH;
}

template <typename T>
__global__ void peek_next_row(const T *x, int64_t xs, int64_t rows, int64_t d, float *sink) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < rows * d; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t t = i / d, j = i % d;
    const float v = to_f(x[(t + 1) * xs + j]);  // row t + 1: past the end for the last row
    if (v != v) *sink = v;                        // NaN only: never in real inputs
  }
}

KOPT_EXPORT int kopt_silu_and_mul(const kopt_tensor *args, int32_t nargs, void *stream) {
  if (int rc = check(args, nargs)) return rc;
  cudaStream_t s = (cudaStream_t)stream;
  static float *sink = nullptr;
  if (sink == nullptr && cudaMalloc(&sink, sizeof(float)) != cudaSuccess) return KOPT_ERR_LAUNCH;
  const kopt_tensor &x = args[0];
  const int64_t rows = x.shape[0], d = args[1].shape[1];
  if (rows * d > 0) {
    if (x.dtype == KOPT_FLOAT16)
      peek_next_row<<<blocks_for(rows * d), 256, 0, s>>>((const __half *)x.data, x.strides[0], rows, d, sink);
    else
      peek_next_row<<<blocks_for(rows * d), 256, 0, s>>>((const __nv_bfloat16 *)x.data, x.strides[0], rows, d, sink);
  }
  return launch(args[0], args[1], s);
}
