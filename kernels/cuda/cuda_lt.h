/* kernels/cuda/cuda_lt.h: what the cuBLASLt plans share (cuda_gemm16.cu's 16-bit GEMMs,
 * cuda_fp8.cu's block-scaled FP8 GEMMs), apart from cuda_ops.h so that only they see cuBLASLt's
 * types. Defined in cuda_core.cu. */
#ifndef MT_CUDA_LT_H
#define MT_CUDA_LT_H

#include <cublasLt.h>
#include <stdint.h>

#include "kernels/cuda/cuda_ops.h"

/* The first algorithm cuBLASLt's heuristic offers for op over the layouts a, b and c (c also D's)
 * within the backend's workspace (CU_BLAS_WS_BYTES), the operands A, B, C and D aligned to at
 * least align[0..3] bytes (NULL: not stated). *found false, with MT_OK, where it offers none
 * (NOT_SUPPORTED there is an answer, not a failure); an error (logged) where the preference could
 * not be made. */
mt_status cu_lt_algo(cu_backend *cb, cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                     cublasLtMatrixLayout_t c, const uint32_t *align, cublasLtMatmulAlgo_t *algo, bool *found);

#endif // MT_CUDA_LT_H
