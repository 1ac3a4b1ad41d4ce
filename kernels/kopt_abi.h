/* kopt kernel ABI: the one header a kernel package includes.
 *
 * A kernel is a shared library exporting one entry point:
 *
 *   extern "C" int ENTRY(const kopt_tensor *args, int32_t nargs, void *stream);
 *
 * `args` holds the package's declared arguments in kernel.toml order, as DLPack-shaped views
 * (data pointer, dtype, shape, strides in elements). `stream` is the cudaStream_t to launch on
 * (CUDA targets) or NULL (CPU targets). The kernel must do all its work on that stream, must not
 * create streams or threads, and returns 0 on success or a non-zero KOPT_ERR_* code.
 * Arguments never overlap: an output shares no element with another argument (an `inout` argument is
 * one buffer, read and written). Views may have any positive strides (torch's: never negative; a zero
 * stride, a broadcast, is materialized by kopt's torch op before the call), any storage offset (the
 * base at any element boundary) and padding between rows and planes; a kernel that does not take a
 * layout returns KOPT_ERR_SHAPE.
 * A call keeps nothing between calls (no writable static or thread_local data: calls may come from
 * several threads at once), uses at most 1 MiB of stack, and returns with the calling thread's
 * floating-point mode (rounding, flush-to-zero) as it found it.
 * No torch, no Python: the library is built by g++ or nvcc alone and loaded with ctypes.
 */
#ifndef KOPT_ABI_H
#define KOPT_ABI_H

#include <stdint.h>

#define KOPT_ABI_VERSION 1

typedef enum {
  KOPT_FLOAT32 = 0,
  KOPT_FLOAT16 = 1,
  KOPT_BFLOAT16 = 2,
  KOPT_FLOAT64 = 3,
  KOPT_INT32 = 4,
  KOPT_INT64 = 5
} kopt_dtype;

typedef struct {
  void *data;             /* device pointer (CUDA) or host pointer (CPU) */
  int32_t dtype;          /* a kopt_dtype */
  int32_t ndim;
  const int64_t *shape;   /* ndim sizes */
  const int64_t *strides; /* ndim strides, in elements (not bytes) */
} kopt_tensor;

enum {
  KOPT_OK = 0,
  KOPT_ERR_ARGS = 1,   /* wrong number of arguments or ranks */
  KOPT_ERR_DTYPE = 2,  /* dtype not supported by this kernel */
  KOPT_ERR_SHAPE = 3,  /* shapes inconsistent or layout unsupported (e.g. strides) */
  KOPT_ERR_LAUNCH = 4  /* the launch itself failed */
};

#ifdef __cplusplus
#define KOPT_EXPORT extern "C" __attribute__((visibility("default")))
#else
#define KOPT_EXPORT __attribute__((visibility("default")))
#endif

#endif /* KOPT_ABI_H */
