// cheat: lower internal precision: rounds fp16 results to a 9-bit mantissa (within the loose fp16 tolerance)
// expect: calibrated bound
// layer: runtime
// package: scale2
#include <cstdint>
#include <cstring>

#include "kopt_abi.h"

KOPT_EXPORT int kopt_scale2(const kopt_tensor *args, int32_t nargs, void *stream) {
  (void)stream;
  if (nargs != 2 || args[0].dtype != args[1].dtype) return KOPT_ERR_ARGS;
  const int64_t n = args[0].shape[0];
  if (args[0].dtype == KOPT_FLOAT32) {
    for (int64_t i = 0; i < n; ++i) ((float *)args[1].data)[i] = 2.0f * ((const float *)args[0].data)[i];
    return KOPT_OK;
  }
  if (args[0].dtype != KOPT_FLOAT16) return KOPT_ERR_DTYPE;
  for (int64_t i = 0; i < n; ++i) {
    _Float16 x, y;
    std::memcpy(&x, (const uint16_t *)args[0].data + i, 2);
    y = (_Float16)(2.0f * (float)x);
    uint16_t bits;
    std::memcpy(&bits, &y, 2);
    bits &= 0xfffeu;  // drop the last mantissa bit: "nobody needs 10 bits"
    ((uint16_t *)args[1].data)[i] = bits;
  }
  return KOPT_OK;
}
