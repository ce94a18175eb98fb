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

/* NULL with err set when no usable device (CI hosts have the toolkit but no GPU) or on OOM.
 *
 * Numerics: matmul and moe_experts on bf16/fp16 weights with more than 8 rows (prefill) run on
 * the tensor cores through cuBLAS, with fp32 accumulation. The fp32 activations enter as two
 * 16-bit parts of the weight's type, x ~ hi + lo (16 significant bits for bf16; ~2e-6 relative
 * error against the CPU's fp32 sums). The environment variable MT_CUDA_TC_TERMS, read here,
 * trades that: 2 (default) as described; 1 rounds x once (half the tensor-core work, ~1.5e-3
 * relative error for bf16: enough to flip router/indexer choices and fail the whole-model
 * comparison); 0 keeps every matmul on the fp32 kernels (slow, within 1e-5 of the CPU). matmul
 * stays fp32 for F32 weights, for n <= 8 (decode) and for outputs narrower than 512 rows
 * (router, mHC mix, per-head gates; MT_CUDA_TC_MIN_ROWS=N moves that bound, for measuring). A
 * value other than 0, 1, 2 fails with MT_ERR_INVALID. MT_CUDA_MOE_BATCHED=0 and MT_CUDA_NARROW=0
 * turn off two prefill paths (cuda_ops.h) for comparison. */
mt_backend *mt_cuda_backend_new(int device, mt_error *err);

/* The backend's stream (a cudaStream_t, declared here without the CUDA headers), for code that
 * queues its own work in the backend's order (communicators, benchmarks). Owned by the backend;
 * valid until it is destroyed. */
struct CUstream_st *mt_cuda_backend_stream(mt_backend *be);

/* Per-op wall time, for finding prefill costs without a profiler. on: starts (or restarts) the
 * count; every op then synchronises the stream when it ends and is charged the time since the
 * previous op ended (so host work between ops lands on the next op). off: prints the table, most
 * expensive first, under `title` to stdout and stops. Not for timed runs. */
void mt_cuda_profile(mt_backend *be, bool on, const char *title);

/* One op's row of that table: its name (static storage), total ms and calls. */
typedef struct mt_cuda_op_time {
    const char *name;
    double ms;
    long calls;
} mt_cuda_op_time;

/* mt_cuda_profile(be, false, ..) that fills rows instead of printing: up to max of them, most
 * expensive first. Returns how many rows it filled (0 when the profile was not on); *total_ms
 * (may be NULL) gets the sum over every op timed, filled or not. */
int mt_cuda_profile_take(mt_backend *be, mt_cuda_op_time *rows, int max, double *total_ms);

#ifdef __cplusplus
}
#endif
#endif /* MT_CUDA_BACKEND_H */
