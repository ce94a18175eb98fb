/* kernels/cuda/cuda_check.h: the one macro family that checks every CUDA runtime, cuBLAS and NCCL
 * call. On failure each macro logs one line naming the call (its source text), the
 * library's error string, file and line, then returns or jumps with MT_ERR_BACKEND:
 *
 *   MT_CUDA_CHECK(cudaMemsetAsync(p, 0, n, s));       // return MT_ERR_BACKEND from the caller
 *   MT_CUDA_CHECK_LAUNCH();                           // after every <<<...>>> launch
 *   MT_CUDA_CHECK_GOTO(cudaMalloc(&p, n), st, fail);  // st = MT_ERR_BACKEND; goto fail;
 *   MT_CUDA_WARN(cudaFree(p));                        // cleanup paths: log and carry on
 *   MT_CUBLAS_CHECK(cublasGemmEx(...));               // needs <cublas_v2.h> (//third_party:cublas)
 *   MT_CUBLAS_WARN(cublasDestroy(h));                 // cleanup paths: log and carry on
 *   MT_NCCL_CHECK(ncclAllReduce(...));                // needs <nccl.h>      (//third_party:nccl)
 *
 * The CHECK forms must be used in functions returning mt_status. Usable from C and CUDA C++; the
 * cuBLAS/NCCL forms only expand where used, so this header does not pull those libraries in.
 * Thread-safe (logging is one write per line).
 */
#ifndef MT_CUDA_CHECK_H
#define MT_CUDA_CHECK_H

#include <cuda_runtime_api.h>

#include "common/mt.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Logs "<lib> error: <call> failed: <what> (<file>:<line>)" and returns MT_ERR_BACKEND. */
static inline mt_status mt_backend_fail(const char *lib, const char *call, const char *what,
                                        const char *file, int line) {
    mt_log(MT_LOG_ERROR, "%s error: %s failed: %s (%s:%d)", lib, call, what, file, line);
    return MT_ERR_BACKEND;
}

#ifdef __cplusplus
}
#endif

/* Internal: evaluate `call` once into a status of type T; on failure, run `on_fail` with the
 * logged mt_status in mt_st_. `text` is #call taken by the public macro, before expansion (so
 * the log says cublasCreate, not cublasCreate_v2). */
#define MT_BACKEND_CHECK_(T, ok, errstr, lib, call, text, on_fail)                          \
    do {                                                                                    \
        T mt_rc_ = (call);                                                                  \
        if (mt_rc_ != (ok)) {                                                               \
            mt_status mt_st_ = mt_backend_fail(lib, text, errstr(mt_rc_), __FILE__, __LINE__); \
            on_fail;                                                                        \
        }                                                                                   \
    } while (0)

#define MT_CUDA_(call, text, on_fail) \
    MT_BACKEND_CHECK_(cudaError_t, cudaSuccess, cudaGetErrorString, "CUDA", call, text, on_fail)
#define MT_CUBLAS_(call, text, on_fail)                                                       \
    MT_BACKEND_CHECK_(cublasStatus_t, CUBLAS_STATUS_SUCCESS, cublasGetStatusString, "cuBLAS", \
                      call, text, on_fail)
#define MT_NCCL_(call, text, on_fail) \
    MT_BACKEND_CHECK_(ncclResult_t, ncclSuccess, ncclGetErrorString, "NCCL", call, text, on_fail)

#define MT_CUDA_CHECK(call) MT_CUDA_(call, #call, return mt_st_)
#define MT_CUDA_CHECK_GOTO(call, st, label) MT_CUDA_(call, #call, { (st) = mt_st_; goto label; })
#define MT_CUDA_WARN(call) MT_CUDA_(call, #call, (void)mt_st_)

/* A launch reports configuration errors (bad grid, too much shared memory) only through
 * cudaGetLastError; asynchronous faults surface at the next checked synchronizing call. */
#define MT_CUDA_CHECK_LAUNCH() \
    MT_CUDA_(cudaGetLastError(), "kernel launch (cudaGetLastError)", return mt_st_)

#define MT_CUBLAS_CHECK(call) MT_CUBLAS_(call, #call, return mt_st_)
#define MT_CUBLAS_CHECK_GOTO(call, st, label) \
    MT_CUBLAS_(call, #call, { (st) = mt_st_; goto label; })
#define MT_CUBLAS_WARN(call) MT_CUBLAS_(call, #call, (void)mt_st_)

#define MT_NCCL_CHECK(call) MT_NCCL_(call, #call, return mt_st_)
#define MT_NCCL_CHECK_GOTO(call, st, label) MT_NCCL_(call, #call, { (st) = mt_st_; goto label; })
#define MT_NCCL_WARN(call) MT_NCCL_(call, #call, (void)mt_st_)

#endif /* MT_CUDA_CHECK_H */
