/* kernels/cuda/cuda_backend.h: the CUDA backend: every op of kernels/backend.h on one GPU,
 * bf16/fp16/fp32 weights in device memory, fp32 activations at the interface, one stream. Buffers
 * from ->alloc are device memory; ->upload/->download copy and synchronise. Thread-safety: one
 * thread at a time per backend object.
 *
 * Numerics: matmul and moe_experts on bf16/fp16 weights with more than 8 rows (prefill) run on the
 * tensor cores (cuBLAS or the wgmma kernels) with fp32 accumulation, the activations entering as
 * mt_cuda_params.numerics says; decode-sized calls (at most 8 rows) and F32 weights stay on the
 * fp32 kernels (the bf16 tensor-core GEMV of 3-8 rows splits x into three parts: fp32-grade). */
#ifndef MT_CUDA_BACKEND_H
#define MT_CUDA_BACKEND_H

#include "kernels/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* How the fp32 activations of matmul and moe_experts enter the tensor cores, for bf16/fp16 weights
 * and more than 8 rows (prefill; fewer rows, decode, and F32 weights always take the fp32 kernels). */
typedef enum mt_numerics {
    /* The exact mode: two 16-bit parts of the weight's type, x ~ hi + lo: 16 significant bits for
     * bf16, ~2e-6 relative error against the CPU's fp32 sums (the GPU's logits match the CPU's,
     * near-tied routing included). */
    MT_NUMERICS_EXACT,
    /* The default, as other engines run: x rounded to the weight's type once, half the
     * tensor-core work, ~1.5e-3 relative error for bf16. Enough to flip near-tied router/indexer
     * choices, so the GPU is held to the CPU's logits on models whose routing has margins
     * (mkckpt --margin), and to top-5 agreement elsewhere. */
    MT_NUMERICS_BF16,
    /* No tensor cores: every matmul on the fp32 kernels (slow; within 1e-5 of the CPU). */
    MT_NUMERICS_FP32,
} mt_numerics;

/* "exact", "bf16" or "fp32" (static storage). */
const char *mt_numerics_name(mt_numerics v);
/* The mt_numerics called name (as mt_numerics_name spells it); false when none is. */
bool mt_numerics_parse(const char *name, mt_numerics *out);

/* The kernel that attends in a prefill's sparse MLA (mla_sparse, n >= 64 rows of one sequence;
 * cuda_dsa.cu). */
typedef enum mt_cuda_mla_attend {
    MT_CUDA_MLA_ATTEND_AUTO,   /* kv_lora 512 with heads in 64s on wgmma, other shapes on mma.sync */
    MT_CUDA_MLA_ATTEND_MMA,    /* mma.sync's kernel instead of the wgmma one */
    MT_CUDA_MLA_ATTEND_WIDE,   /* the fp32 kernel (no tensor cores) */
} mt_cuda_mla_attend;

/* Which kernels of the tensor-core kda_chunked run (cuda_kda_chunk.cu): both, or one alone to time
 * it apart, leaving the outputs wrong. */
typedef enum mt_cuda_kda_chunk_kernels {
    MT_CUDA_KDA_CHUNK_BOTH,
    MT_CUDA_KDA_CHUNK_INTRA,   /* kc_intra_kernel only (timing; outputs wrong) */
    MT_CUDA_KDA_CHUNK_STATE,   /* the state kernel only (timing; outputs wrong) */
} mt_cuda_kda_chunk_kernels;

/* The CUDA backend's options: start from mt_cuda_default_params(), which is what the product
 * runs, and change fields. Every field but numerics chooses between paths that compute
 * the same function (to the stated precision), for tests and benchmarks that compare them. */
typedef struct mt_cuda_params {
    mt_numerics numerics;      /* default MT_NUMERICS_BF16 */
    /* With MT_NUMERICS_BF16: the weight classes (bit 1 << mt_wcls) whose tensor-core matmuls keep
     * the exact mode's two 16-bit parts of x. Default MT_CUDA_EXACT_CLASSES: the products that
     * feed discrete choices and multiplicative gates (router, indexer, KDA decay/beta/output
     * gates), which the reference computes from fp32 inputs (MODEL.md: the router in fp32) and
     * where one rounding flips near-tied top-k choices; a few percent of a prefill's FLOPs. */
    unsigned exact_classes;
    /* With MT_NUMERICS_BF16: true (default) the KDA chunked delta rule keeps its two-part
     * products as in the exact mode (a decay or delta error compounds along the sequence; with
     * one rounding there the random fixtures' top tokens leave the CPU's top 5); false: one. */
    bool kda_chunk_exact;
    /* Matmuls of at most 32 output rows that stay on the fp32 kernels (MT_NUMERICS_FP32, F32
     * weights): true (default) the narrow kernel, a warp owning whole input rows; false the tiled
     * fp32 GEMM. */
    bool narrow;
    /* Tensor-core MoE (more than 8 rows, the cuBLAS form): true (default) a few batched GEMMs over
     * experts padded to a common row count; false one GEMM per expert. */
    bool moe_batched;
    /* true (default): a prefill's experts on the wgmma kernel (cuda_moe_wg.cu) where it applies
     * (sm_90, bf16, H % 128 == 0, I % 64 == 0, not MT_NUMERICS_FP32); false: the cuBLAS form. */
    bool moe_wg;
    /* The wgmma kernel's down tiles: false (default) 128 weight rows against up to 256 token rows;
     * true 256 weight rows (two accumulators a warpgroup, gate/up's shape) against up to 128,
     * which reads each token row of h half as often (cuda_moe_wg.cu). */
    bool moe_wg_wide_down;
    /* moe_experts of n rows with min <= n <= max runs grouped by expert on the device
     * (cuda_moe_grouped.cu; graph-capturable, each chosen expert read once); fewer rows take the
     * per-(row, slot) GEMV kernels, more the tensor-core GEMMs (the wgmma kernels or cuBLAS).
     * min 2..9 (default 5), max 0 (never grouped) or 9..INT_MAX (default 64). */
    int moe_grouped_min_rows, moe_grouped_max_rows;
    /* With MT_NUMERICS_EXACT: true (default) every n >= min runs grouped (unless max is 0), so a
     * row's expert sums do not depend on how many rows from 5 up share its pass (the tensor-core
     * GEMMs' two-part sums differ from the grouped kernels' fp32 ones); false: the row classes
     * above (tests of the tensor-core paths in the exact mode). */
    bool moe_exact_grouped;
    mt_cuda_mla_attend mla_attend;            /* default MT_CUDA_MLA_ATTEND_AUTO */
    /* Selected rows a tile of the wgmma attend with one part (MT_NUMERICS_BF16): 32 (default) or
     * 64, the second 32 in each stage's unused lo rows: half the score exchanges, softmax passes
     * and tensor-core turns for the same products (cuda_dsa_mla_wg.cu). Two parts keep 32. */
    int mla_attend_rows;
    mt_cuda_kda_chunk_kernels kda_chunk_kernels; /* default MT_CUDA_KDA_CHUNK_BOTH */
} mt_cuda_params;

mt_cuda_params mt_cuda_default_params(void);
#define MT_CUDA_EXACT_CLASSES \
    (1u << MT_WCLS_ROUTER | 1u << MT_WCLS_INDEXER | 1u << MT_WCLS_KDA_GATE)

/* A CUDA backend on device `device` with options params (NULL: mt_cuda_default_params()), copied.
 * NULL with err set when no usable device (CI hosts have the toolkit but no GPU), on OOM, or for
 * params out of range (MT_ERR_INVALID, naming the field). The caller frees it with
 * mt_backend_free; one thread at a time may use it. */
mt_backend *mt_cuda_backend_new(int device, const mt_cuda_params *params, mt_error *err);

/* The backend's stream (a cudaStream_t, declared here without the CUDA headers), for code that
 * queues its own work in the backend's order (communicators, benchmarks). Owned by the backend;
 * valid until it is destroyed. */
struct CUstream_st *mt_cuda_backend_stream(mt_backend *be);

/* Per-op wall time, for finding prefill costs without a profiler. on: starts (or restarts) the
 * count; every op then synchronises the stream when it ends and is charged the time since the
 * previous op ended (so host work between ops lands on the next op), and apart the host's own
 * part of it. off: prints the table, most expensive first, under `title` to stdout and stops.
 * Not for timed runs. */
void mt_cuda_profile(mt_backend *be, bool on, const char *title);

/* Seconds the host has spent blocked on the backend's device work since creation: every wait of
 * an op or transfer for the backend's stream (cu_wait; a copy to the host, which blocks until
 * the stream has run it, with its wait: cu_copy_to_host) and download_end's wait for its ticket;
 * not the op profile's own waits, nor the join of the batched expert GEMMs' second stream. Beside
 * a run's wall time it says how much of it the host spent ahead of the device: near 0, the
 * host's own work sets the pace. */
double mt_cuda_wait_seconds(mt_backend *be);

/* Seconds the device has sat idle between a wait that left the stream empty and the next op the
 * host issued since creation: the host's own work between a read-back and the next step's first
 * op (or an op's read-back and the op after it), which running ahead would hide. A lower bound of
 * the device's idle time: gaps while the host issues ops more slowly than the device runs them
 * are not in it. */
double mt_cuda_gap_seconds(mt_backend *be);

/* One op's row of that table: its name (static storage), total ms and calls, and of the ms the
 * host's own time (its issue, and host work since the previous op; not the waits for the device
 * inside the op, such as a read-back's): the rest is the device's run of the op, those waits and
 * the profile's own wait's latency. */
typedef struct mt_cuda_op_time {
    const char *name;
    double ms;
    long calls;
    double host_ms;
} mt_cuda_op_time;

/* mt_cuda_profile(be, false, ..) that fills rows instead of printing: up to max of them, most
 * expensive first. Returns how many rows it filled (0 when the profile was not on); *total_ms
 * (may be NULL) gets the sum over every op timed, filled or not. */
int mt_cuda_profile_take(mt_backend *be, mt_cuda_op_time *rows, int max, double *total_ms);

#ifdef __cplusplus
}
#endif
#endif /* MT_CUDA_BACKEND_H */
