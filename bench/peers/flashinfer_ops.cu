// C entry points over FlashInfer's header-only kernels, for bench/peers.py: launched as FlashInfer's
// own Python front end launches them (silu_and_mul: one block per token, the widest vector that
// divides d, at most 256 threads; FusedAddRMSNorm and MergeState: their host functions). The headers
// come from FlashInfer's wheel at bench time (bench/peers.py --flashinfer-include); none are in git.
#include <cuda_runtime.h>

#include <flashinfer/activation.cuh>
#include <flashinfer/attention/cascade.cuh>
#include <flashinfer/norm.cuh>

namespace {

__device__ __forceinline__ float silu(const float &v) { return v / (1.0f + __expf(-v)); }

template <typename T, uint32_t VEC>
cudaError_t launch_act(T *out, const T *x, int64_t tokens, int d, cudaStream_t stream) {
  const auto kernel = flashinfer::activation::act_and_mul_kernel<T, silu, VEC>;
  const unsigned threads = d / VEC < 256 ? d / VEC : 256;
  kernel<<<dim3((unsigned)tokens), dim3(threads), 0, stream>>>(out, x, d);
  return cudaGetLastError();
}

template <typename T>
cudaError_t act(void *out, const void *x, int64_t tokens, int d, cudaStream_t stream) {
  constexpr uint32_t widest = 16 / sizeof(T);
  T *o = static_cast<T *>(out);
  const T *i = static_cast<const T *>(x);
  if (d % widest == 0) return launch_act<T, widest>(o, i, tokens, d, stream);
  if (d % 4 == 0) return launch_act<T, 4>(o, i, tokens, d, stream);
  if (d % 2 == 0) return launch_act<T, 2>(o, i, tokens, d, stream);
  return launch_act<T, 1>(o, i, tokens, d, stream);
}

}  // namespace

// dtype: 0 float16, 1 bfloat16. Each returns a cudaError_t.
extern "C" int fi_silu_and_mul(int dtype, void *out, const void *x, int64_t tokens, int d, void *stream) {
  auto s = static_cast<cudaStream_t>(stream);
  return dtype ? act<__nv_bfloat16>(out, x, tokens, d, s) : act<half>(out, x, tokens, d, s);
}

extern "C" int fi_fused_add_rmsnorm(int dtype, void *input, void *residual, void *weight, int tokens, int h,
                                    float eps, void *stream) {
  auto s = static_cast<cudaStream_t>(stream);
  if (dtype)
    return flashinfer::norm::FusedAddRMSNorm(static_cast<__nv_bfloat16 *>(input), static_cast<__nv_bfloat16 *>(residual),
                                             static_cast<__nv_bfloat16 *>(weight), tokens, h, h, h, eps, false, s);
  return flashinfer::norm::FusedAddRMSNorm(static_cast<half *>(input), static_cast<half *>(residual),
                                           static_cast<half *>(weight), tokens, h, h, h, eps, false, s);
}

// FlashInfer's LSEs are base 2: the caller passes s_a, s_b scaled by log2(e).
extern "C" int fi_merge_state(int dtype, void *v_a, float *s_a, void *v_b, float *s_b, void *v_out, float *s_out,
                              int tokens, int heads, int head_dim, void *stream) {
  auto s = static_cast<cudaStream_t>(stream);
  if (dtype)
    return flashinfer::MergeState(static_cast<__nv_bfloat16 *>(v_a), s_a, static_cast<__nv_bfloat16 *>(v_b), s_b,
                                  static_cast<__nv_bfloat16 *>(v_out), s_out, tokens, heads, head_dim, s);
  return flashinfer::MergeState(static_cast<half *>(v_a), s_a, static_cast<half *>(v_b), s_b,
                                static_cast<half *>(v_out), s_out, tokens, heads, head_dim, s);
}
