/* kernels/cuda/cuda_backend.h: the CUDA backend (issue 3, in progress): every op of
 * kernels/backend.h on one GPU, bf16/fp16/fp32 weights in device memory, fp32 activations at the
 * interface, one stream. Buffers from ->alloc are device memory; ->upload/->download copy and
 * synchronise. Thread-safety: one thread at a time per backend object. */
#ifndef MT_CUDA_BACKEND_H
#define MT_CUDA_BACKEND_H

#include "kernels/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* NULL with err set when no usable device (CI hosts have the toolkit but no GPU) or on OOM. */
mt_backend *mt_cuda_backend_new(int device, mt_error *err);

#ifdef __cplusplus
}
#endif
#endif /* MT_CUDA_BACKEND_H */
