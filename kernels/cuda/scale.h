/* kernels/cuda/scale.h: y = a * x over fp32 device arrays. The smallest CUDA op; it exists to
 * prove the nvcc build path end to end and to be copied when writing a new op (three tiers:
 * kernel, launcher, exported op). */
#ifndef MT_CUDA_SCALE_H
#define MT_CUDA_SCALE_H

#include <stddef.h>

#include <cuda_runtime_api.h>

#include "common/mt.h"

#ifdef __cplusplus
extern "C" {
#endif

/* y[i] = a * x[i] for i < n, enqueued on stream s (asynchronous: the caller synchronizes).
 *   y: [n] fp32, device memory, written; may equal x (in place).
 *   x: [n] fp32, device memory, read.
 * n == 0 is a no-op. Returns MT_ERR_INVALID if n > 0 and x or y is NULL, MT_ERR_BACKEND if the
 * launch fails (logged; y untouched). Any host thread may call it; the caller owns both buffers. */
mt_status mt_cuda_scale(float *y, const float *x, float a, size_t n, cudaStream_t s);

#ifdef __cplusplus
}
#endif
#endif /* MT_CUDA_SCALE_H */
