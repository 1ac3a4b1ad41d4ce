// cheat: the last row is never written once T*D reaches 2^25 (a 4096-token prefill at D=8192): every
// fuzzed shape stays under the fuzz budget (2^24 elements on CUDA), so only the gates' large shape meets
// it (red team, 2026-11-26, CPU twin: accepted by kopt evaluate in all three packages).
// expect: never written
// layer: runtime
// large: yes
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
__global__ void silu_kernel(const T *x, int64_t xs, T *out, int64_t os, int64_t rows, int64_t d, int64_t upto) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < rows * upto; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t t = i / upto, j = i % upto;
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

KOPT_EXPORT int kopt_silu_and_mul(const kopt_tensor *args, int32_t nargs, void *stream) {
  if (int rc = check(args, nargs)) return rc;
  cudaStream_t s = (cudaStream_t)stream;
  const kopt_tensor &x = args[0], &out = args[1];
  const int64_t rows = x.shape[0], d = out.shape[1];
  const int64_t upto = d;
  const int64_t written = rows * d >= (int64_t(1) << 25) ? rows - 1 : rows;  // "the tail row is padding"
  const int64_t n = written * upto;
  if (n == 0) return KOPT_OK;
  const unsigned blocks = (unsigned)((n + 255) / 256 < 65535 ? (n + 255) / 256 : 65535);
  if (x.dtype == KOPT_FLOAT16)
    silu_kernel<<<blocks, 256, 0, s>>>((const __half *)x.data, x.strides[0], (__half *)out.data, out.strides[0], written, d,
                                       upto);
  else
    silu_kernel<<<blocks, 256, 0, s>>>((const __nv_bfloat16 *)x.data, x.strides[0], (__nv_bfloat16 *)out.data,
                                       out.strides[0], written, d, upto);
  return cudaGetLastError() == cudaSuccess ? KOPT_OK : KOPT_ERR_LAUNCH;
}
