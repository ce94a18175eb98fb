/* kernels/cuda/cuda_moe.cu: the MoE router and the routed experts, the same functions as
 * kernels/cpu/cpu_moe.c.
 *
 * Router: one warp per row (sigmoid, bias, group top-2 sums unless every group is kept, kept
 * groups, top-k by repeated warp argmax over candidates held in registers (up to 512 experts)
 * with the lowest index winning ties, normalisation, scaling).
 *
 * Experts: the kernels need the experts' device weight pointers, which arrive as a host array
 * whose length the op is not told. The backend keeps a device copy of each table it has seen,
 * keyed by the host pointer and revalidated against a host copy on every call, covering experts
 * [0, E) where E is the router's n_experts when idx is the last moe_route output (no read-back),
 * else 1 + the largest index read back from idx.
 *   - Decode batches of mt_cuda_params.moe_grouped_min_rows (5) to moe_grouped_max_rows (64) rows,
 *     and in the exact numerics (moe_exact_grouped) every batch from the minimum: the grouped device kernels of
 *     cuda_moe_grouped.cu (each touched expert streamed once; moe_takes_grouped).
 *   - Fewer rows (decode): two GEMV kernels over the selected experts only,
 *     no host synchronisation: per (row, slot) h = swiglu(gate x, up x), then per row
 *     out += sum_k w_k down_k h_k, slots added in order. 16-byte weight loads, 8-16 of them in
 *     flight per lane; both launched for PDL (cu_launch_pdl, cuda_launch.h), as is the router.
 *   - Many rows (prefill) on an sm_90 device with bf16 experts on the tensor cores (the two-part
 *     split by default, or single rounding; cu_moe_wg_ok, mt_cuda_params.moe_wg false turns it off): the
 *     wgmma kernels of cuda_moe_wg.cu
 *     (moe_experts_wg): the pairs sorted and the tiles planned on the device, x split, gate/up
 *     with swiglu in one persistent launch, down in another, the combine. Indices from the
 *     router are never read back. H200, bench-4L's 4096-token prefill: MoE GEMMs
 *     21.8 -> 19.6 ms, the host sort and staging (0.8 ms) -> a 0.3 ms device plan.
 *   - Many rows (prefill) otherwise: idx is read back, the (row, slot) pairs are sorted by expert, then
 *     bf16/fp16 experts: the sorted x rows are gathered and split into tc_terms 16-bit parts
 *     (cu_split16, interleaved: hi and lo of a pair on adjacent rows, so each expert's rows stay
 *     contiguous), one tensor-core GEMM per expert and matrix (cu_gemm_tc) gives the parts'
 *     gate and up, a kernel sums the parts, applies swiglu in fp32 and splits h again, one GEMM
 *     per expert gives down's parts, which the combine sums. By default (mt_cuda_params.moe_batched)
 *     the per-expert GEMMs become a few batched ones: each expert's rows are padded to one of a
 *     few sizes (moe_pad; padding rows repeat a real row and are never combined) and the experts
 *     of one size share a cublasGemmBatchedEx call (gate and up together, then down), so the
 *     whole GPU streams the experts' weights at once instead of one small GEMM at a time (H200,
 *     real shapes, 512 rows: 3.1 ms against 13.2; 4096 rows: 6.8 ms against 12.1). Some classes
 *     run on a second stream (moe_on_side), beside the others. fp32 experts (or
 *     MT_NUMERICS_FP32): the tiled fp32 GEMM (cu_gemm) runs grouped: gate/up for every
 *     expert's rows in one launch, swiglu, down in one launch.
 *     A combine kernel then adds the slots in order. Rows are processed in chunks that bound the
 *     scratch memory (every chunk reads every expert it routes to once).
 *   - F8E4M3 experts (block-scaled, cuda_ops.h; all of a call's experts): the GEMV kernels (16 e4m3
 *     a 16-byte load, each times its block's scale in fp32) and the grouped kernels as above; many
 *     rows in the default numerics take cuBLASLt's block-scaled FP8 GEMMs an expert at a time
 *     (moe_experts_fp8_lt), in the exact and fp32 modes the grouped kernels (fp32 activations).
 * Every path is deterministic and adds the slots into out in the CPU's order. */
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <cublas_v2.h>
#include <cuda_bf16.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_ops.h"


enum {
    ROUTE_WARPS = 4,
    ROUTE_PER_LANE = 16,      /* router candidates per lane kept in registers: E <= 512 */
    MOE_THREADS = 256,
    MOE_WARPS = MOE_THREADS / 32,
    MOE_GEMV_MAX_ROWS = CU_MOE_GEMV_MAX_ROWS,
    MOE_MAX_TOPK = 64,
    MOE_DN_MAX_THREADS = 512, /* moe_down_kernel: up to 16 warps, one slot each */
    MOE_CACHE_MAX = 1024,     /* expert tables kept; beyond, the oldest slot is reused */
};
/* The grouped device kernels (cu_moe_experts_grouped) take mt_cuda_params.moe_grouped_min_rows
 * (default CU_MOE_GROUPED_MIN_ROWS, 5) to moe_grouped_max_rows (default 64) rows; fewer rows take
 * the per-(row, slot) GEMV kernels. The default minimum, measured on an H200 (real shapes, top-8 of
 * 288, each expert its own weights):
 *   kernels_cuda_dense_test CudaMoe.DecodeTimings (graphs, random routing), us per call, GEMV
 *   kernels against grouped: n = 1 101 / 163, 2 192 / 239, 4 373 / 379, 8 734 / 582;
 *   batch_bench (bench-4L, real routing, graph ms per step): batch 2 2.276 / 2.425, 4 2.891 /
 *   2.953, 8 4.320 / 4.027.
 * The grouped kernels cost ~60 us more a call (4 kernels; gate/up and down grids of a block per
 * (tile, expert) over all 288 experts) and read an expert once however many rows chose it, the
 * GEMV kernels ~12 us per (row, slot) pair: the lines cross between 4 and 8 rows (~4.7 by linear
 * interpolation of the batch_bench gaps), so 5. Batched decode pads to 1, 2, 4, 8, ... rows.
 * Beyond the maximum, the batched GEMMs, faster at 128 rows (3.73 vs 4.36 ms a layer) but they
 * read the routing back, so a step that uses them cannot be a graph. */

/* Whether n rows go to the grouped device kernels (cu_moe_experts_grouped). In the exact numerics
 * (moe_exact_grouped) every row count from the minimum does, unless moe_grouped_max_rows is 0: the
 * tensor-core path sums two-part products, close to but not equal to the grouped kernels' fp32
 * sums, so a row's result would depend on how many rows share its pass (a verify of 17 sequences
 * of 4 rows left the decode steps' greedy tokens where 16 did not, docs/PERF.md). */
static bool moe_takes_grouped(const cu_backend *cb, int n) {
    const mt_cuda_params *p = &cb->params;
    const bool any = p->moe_exact_grouped && p->numerics == MT_NUMERICS_EXACT && p->moe_grouped_max_rows > 0;
    return n >= p->moe_grouped_min_rows && (n <= p->moe_grouped_max_rows || any);
}

/* Grouped-path scratch per chunk (before the batched path's padding). Each chunk rereads the
 * weights of the experts it routes to (all of them at prefill sizes: 14.5 GB per layer at the real
 * shapes), so fewer chunks pay: 2 GB keeps 4096 rows of the real shapes in one chunk. */
static const size_t MOE_CHUNK_BYTES = (size_t)2 << 30;

/* =============================== router =============================== */

typedef struct route_params {
    int32_t *idx;         /* [n, top_k] */
    float *weights;       /* [n, top_k] */
    const float *logits;  /* [n, E] */
    const float *bias;    /* [E] */
    int n, E, G, topk_group, top_k;
    bool norm;
    float scaling;
} route_params;

/* Dynamic shared memory per warp: s[E], c[E], gscore[G], sel_w[top_k] floats, sel_i[top_k] ints,
 * mask[E], gmask[G] bytes. */
static __host__ __device__ size_t route_smem_per_warp(int E, int G, int top_k) {
    return ((sizeof(float) * (2 * (size_t)E + G + top_k) + sizeof(int32_t) * (size_t)top_k + (size_t)E + G) + 15) /
           16 * 16;
}

/* One warp per row. The picks stay in shared memory until the end, where the lanes write the
 * indices and normalised weights together (one row is latency-bound: no global read-back).
 * Launched for PDL (the logits are the previous kernel's output). */
static __global__ void route_kernel(const route_params p) {
    extern __shared__ __align__(16) unsigned char route_smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int E = p.E, G = p.G, per = E / G;
    /* E <= 32 ROUTE_PER_LANE: the bias (no kernel writes it) before the PDL wait, then every logit
     * load at once: one round trip each (a loop of 4 in flight took three) */
    const bool regs = E <= 32 * ROUTE_PER_LANE;
    float bb[ROUTE_PER_LANE];
#pragma unroll
    for (int j = 0; j < ROUTE_PER_LANE; j++) bb[j] = regs && lane + 32 * j < E ? __ldg(p.bias + lane + 32 * j) : 0.f;
    cu_pdl_wait();
    cu_pdl_trigger();
    const int i = blockIdx.x * ROUTE_WARPS + warp;
    if (i >= p.n) return;
    unsigned char *base = route_smem + route_smem_per_warp(E, G, p.top_k) * warp;
    float *s = (float *)base, *c = s + E, *gscore = c + E, *sel_w = gscore + G;
    int32_t *sel_i = (int32_t *)(sel_w + p.top_k);
    unsigned char *mask = (unsigned char *)(sel_i + p.top_k), *gmask = mask + E;
    const float *l = p.logits + (int64_t)i * E;

    if (regs) {
        float lv[ROUTE_PER_LANE];
#pragma unroll
        for (int j = 0; j < ROUTE_PER_LANE; j++) lv[j] = lane + 32 * j < E ? l[lane + 32 * j] : 0.f;
#pragma unroll
        for (int j = 0; j < ROUTE_PER_LANE; j++) {
            const int e = lane + 32 * j;
            if (e < E) {
                s[e] = cu_sigmoidf(lv[j]);
                c[e] = s[e] + bb[j];
            }
        }
    } else {
#pragma unroll 4
        for (int e = lane; e < E; e += 32) {
            s[e] = cu_sigmoidf(l[e]);
            c[e] = s[e] + p.bias[e];
        }
    }
    __syncwarp();
    if (p.topk_group < G) {
        if (G >= 32 || per < 64) {
            for (int g = lane; g < G; g += 32) { /* group score: sum of its two largest c */
                float a = -INFINITY, b = -INFINITY;
                for (int e = g * per; e < (g + 1) * per; e++) {
                    if (c[e] > a) { b = a; a = c[e]; }
                    else if (c[e] > b) b = c[e];
                }
                gscore[g] = a + b;
                gmask[g] = 0;
            }
        } else {
            /* Few large groups: the warp finds each group's two largest together, each lane over
             * a strided part, then a shuffle merge. The pair of values is the same whichever lane
             * finds it, so the sum equals the serial one. */
            for (int g = 0; g < G; g++) {
                float a = -INFINITY, b = -INFINITY;
                for (int e = g * per + lane; e < (g + 1) * per; e += 32) {
                    if (c[e] > a) { b = a; a = c[e]; }
                    else if (c[e] > b) b = c[e];
                }
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) {
                    const float oa = __shfl_xor_sync(0xffffffffu, a, o), ob = __shfl_xor_sync(0xffffffffu, b, o);
                    const float hi = fmaxf(a, oa), lo = fmaxf(fminf(a, oa), fmaxf(b, ob));
                    a = hi;
                    b = lo;
                }
                if (lane == 0) {
                    gscore[g] = a + b;
                    gmask[g] = 0;
                }
            }
        }
        __syncwarp();
        if (lane == 0)
            for (int k = 0; k < p.topk_group; k++) { /* best free group, lowest index on ties */
                int best = -1;
                for (int g = 0; g < G; g++)
                    if (!gmask[g] && (best < 0 || gscore[g] > gscore[best])) best = g;
                gmask[best] = 1;
            }
        __syncwarp();
        for (int e = lane; e < E; e += 32) mask[e] = gmask[e / per];
    } else {
        /* every group is kept (the real model: one group): the scores cannot matter */
        for (int e = lane; e < E; e += 32) mask[e] = 1;
    }
    __syncwarp();

    float sum = 0; /* lane 0: the picks' s in pick order, the CPU's */
    if (E <= 32 * ROUTE_PER_LANE) {
        /* Lane l's candidates c[l + 32 j] sit in registers, bit j of `live` set while eligible:
         * each pick is the lane's best (strict >, ascending j: its lowest index on ties), the
         * warp merge below, and the winner clearing its bit, with no shared memory in between. */
        float cv[ROUTE_PER_LANE], sv[ROUTE_PER_LANE];
        unsigned live = 0;
#pragma unroll
        for (int j = 0; j < ROUTE_PER_LANE; j++) {
            const int e = lane + 32 * j;
            cv[j] = e < E ? c[e] : 0.f;
            sv[j] = e < E ? s[e] : 0.f;
            if (e < E && mask[e]) live |= 1u << j;
        }
        /* Each pick: the lane's best live candidate by a tree over j (larger value, lower j on
         * ties), then the warp's largest value by one __reduce_max_sync over an order-preserving
         * integer key and its lowest index among equal keys by one __reduce_min_sync: the CPU's
         * choice (largest, lowest index on ties) in two warp instructions instead of a five-step
         * shuffle butterfly of (value, index) pairs (the route kernel was ~10 us a call). */
        for (int k = 0; k < p.top_k; k++) {
            float bv[ROUTE_PER_LANE];
            int bj[ROUTE_PER_LANE];
#pragma unroll
            for (int j = 0; j < ROUTE_PER_LANE; j++) {
                bv[j] = cv[j];
                bj[j] = (live >> j & 1u) ? j : -1;
            }
#pragma unroll
            for (int w = 1; w < ROUTE_PER_LANE; w *= 2)
#pragma unroll
                for (int j = 0; j + w < ROUTE_PER_LANE; j += 2 * w) {
                    const bool take = bj[j + w] >= 0 && (bj[j] < 0 || bv[j + w] > bv[j]);
                    if (take) { bv[j] = bv[j + w]; bj[j] = bj[j + w]; }
                }
            const bool has = bj[0] >= 0;
            const float v = bv[0] == 0.f ? 0.f : bv[0]; /* -0 keys as +0: they compare equal */
            const uint32_t u = __float_as_uint(v);
            const uint32_t key = has ? ((u & 0x80000000u) ? ~u : (u | 0x80000000u)) : 0u;
            const uint32_t top = __reduce_max_sync(0xffffffffu, key);
            const uint32_t mine = has && key == top ? (uint32_t)(lane + 32 * bj[0]) : 0xffffffffu;
            const uint32_t bi = __reduce_min_sync(0xffffffffu, mine);
            if (bi == 0xffffffffu) __trap(); /* the host checked top_k <= topk_group * per */
            if ((int)(bi & 31) == lane) live &= ~(1u << (bi >> 5));
            /* the winner's s, from its lane (every lane takes part in the shuffle) */
            float sw = 0.f;
#pragma unroll
            for (int j = 0; j < ROUTE_PER_LANE; j++)
                if (j == (int)(bi >> 5)) sw = sv[j];
            sw = __shfl_sync(0xffffffffu, sw, (int)(bi & 31));
            if (lane == 0) {
                sel_i[k] = (int32_t)bi;
                sel_w[k] = sw;
                sum += sw;
            }
        }
        __syncwarp();
    } else {
        for (int k = 0; k < p.top_k; k++) {
            float bv = 0;
            int bi = -1;
            for (int e = lane; e < E; e += 32) /* ascending, strict: lowest index of this lane's max */
                if (mask[e] && (bi < 0 || c[e] > bv)) { bv = c[e]; bi = e; }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
                const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
                if (oi >= 0 && (bi < 0 || ov > bv || (ov == bv && oi < bi))) { bv = ov; bi = oi; }
            }
            if (bi < 0) __trap(); /* the host checked top_k <= topk_group * per */
            if (lane == 0) {
                mask[bi] = 0;
                sel_i[k] = bi;
                sel_w[k] = s[bi];
                sum += s[bi];
            }
            __syncwarp();
        }
    }
    sum = __shfl_sync(0xffffffffu, sum, 0);
    for (int k = lane; k < p.top_k; k += 32) {
        float w = sel_w[k];
        if (p.norm) w /= sum + 1e-20f;
        p.idx[(int64_t)i * p.top_k + k] = sel_i[k];
        p.weights[(int64_t)i * p.top_k + k] = w * p.scaling;
    }
}

static mt_status route_launch(route_params *p, cudaStream_t s) {
    const size_t smem = route_smem_per_warp(p->E, p->G, p->top_k) * ROUTE_WARPS;
    if (smem > 48 * 1024)
        MT_CUDA_CHECK(cudaFuncSetAttribute(route_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           (int)smem));
    const dim3 g((unsigned)((p->n + ROUTE_WARPS - 1) / ROUTE_WARPS));
    MT_CUDA_CHECK(cu_launch_pdl((const void *)route_kernel, g, dim3(ROUTE_WARPS * 32), smem, s, p));
    return MT_OK;
}

static void cu_moe_route(mt_backend *be, int32_t *idx, float *weights, const float *logits,
                         const float *bias, const mt_router_params *p, int n) {
    const int E = p->n_experts, G = p->n_group;
    MT_ASSERT(E > 0 && G > 0 && E % G == 0 && E / G >= 2);
    MT_ASSERT(p->topk_group >= 1 && p->topk_group <= G);
    MT_ASSERT(p->top_k >= 1 && p->top_k <= p->topk_group * (E / G));
    MT_ASSERT(n >= 0);
    cu_backend *cb = (cu_backend *)be;
    if (n == 0) return;
    route_params q = {idx, weights, logits, bias, n, E, G, p->topk_group, p->top_k,
                      p->norm_topk_prob, p->scaling};
    mt_status st = route_launch(&q, cu_stream(be));
    cu_op_status(be, "moe_route", st);
    if (st == MT_OK) {
        cb->route_idx = idx;
        cb->route_len = (int64_t)n * p->top_k;
        cb->route_experts = E;
    }
}

/* moe_keep_experts: one thread a row of top_k picks. The indices stay below the router's expert
 * count (from_idx holds a router's earlier picks), so the route record (route_idx) still holds
 * for moe_experts. */
static __global__ void keep_experts_kernel(int32_t *idx, float *w, const int32_t *from_idx, const float *from_w,
                                           int n, int top_k, int lo, int hi) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    int32_t *x = idx + (size_t)i * top_k;
    float *wi = w + (size_t)i * top_k;
    if (from_idx)
        for (int j = 0; j < top_k; j++) {
            x[j] = from_idx[(size_t)i * top_k + j];
            wi[j] = from_w[(size_t)i * top_k + j];
        }
    mt_keep_experts_row(x, wi, top_k, lo, hi);
}

static mt_status keep_experts_launch(int32_t *idx, float *w, const int32_t *fi, const float *fw, int n, int top_k,
                                     int lo, int hi, cudaStream_t s) {
    keep_experts_kernel<<<(unsigned)((n + 127) / 128), 128, 0, s>>>(idx, w, fi, fw, n, top_k, lo, hi);
    MT_CUDA_CHECK_LAUNCH();
    return MT_OK;
}

static void cu_moe_keep_experts(mt_backend *be, int32_t *idx, float *weights, const int32_t *from_idx,
                                const float *from_weights, int n, int top_k, int lo, int hi) {
    MT_ASSERT(n >= 0 && top_k >= 1 && 0 <= lo && lo < hi);
    if (n == 0) return;
    cu_op_status(be, "moe_keep_experts", keep_experts_launch(idx, weights, from_idx, from_weights, n, top_k, lo, hi, cu_stream(be)));
}

/* ======================= expert tables on the device ======================= */

typedef struct moe_table {
    const mt_expert *host;  /* key: the caller's array */
    int count;              /* entries copied */
    int cap;                /* entries dev/copy can hold */
    mt_expert *copy;        /* [cap] host copy of host[0, count), to revalidate */
    mt_expert *dev;         /* [cap] device copy */
    bool vec_ok;            /* every weight base 16-byte aligned */
    void *wg_maps;          /* [cap][3] device TMA maps of the wgmma path (cu_moe_wg_maps) */
    int wg_state;           /* wg_maps: 0 not made for this content, 1 made, -1 making them failed
                               (the batched path takes this table until it changes) */
} moe_table;

struct cu_moe_cache {
    moe_table t[MOE_CACHE_MAX];
    int n;                  /* used entries */
    int next;               /* entry reused when full */
    /* Page-locked (cudaHostAlloc), so the read-back and the staging copies are plain DMA rather
     * than a driver copy through its own bounce buffer; both are waited for before reuse. */
    int32_t *host_idx;      /* [host_cap] read-back indices and grouped-path staging */
    size_t host_cap;
    unsigned char *stage;   /* [stage_cap] batched-path staging (moe_grouped_chunk_batched) */
    size_t stage_cap;
    /* The batched path's second stream (moe_side_get): a cuBLAS handle of its own with its own
     * workspace on a high-priority stream, and the events that fork it from and join it to the
     * backend's stream. side_state: 0 not made yet, 1 ready, -1 off (making it failed). */
    int side_state;
    cudaStream_t side;
    cublasHandle_t side_blas;
    void *side_ws;
    cudaEvent_t side_fork, side_join;
};

extern "C" void cu_moe_cache_free(cu_backend *cb) {
    struct cu_moe_cache *mc = cb->moe;
    if (!mc) return;
    for (int k = 0; k < mc->n; k++) {
        if (mc->t[k].dev) MT_CUDA_WARN(cudaFree(mc->t[k].dev));
        if (mc->t[k].wg_maps) MT_CUDA_WARN(cudaFree(mc->t[k].wg_maps));
        free(mc->t[k].copy);
    }
    if (mc->side_blas) MT_CUBLAS_WARN(cublasDestroy(mc->side_blas));
    if (mc->side_ws) MT_CUDA_WARN(cudaFree(mc->side_ws));
    if (mc->side_fork) MT_CUDA_WARN(cudaEventDestroy(mc->side_fork));
    if (mc->side_join) MT_CUDA_WARN(cudaEventDestroy(mc->side_join));
    if (mc->side) MT_CUDA_WARN(cudaStreamDestroy(mc->side));
    if (mc->host_idx) MT_CUDA_WARN(cudaFreeHost(mc->host_idx));
    if (mc->stage) MT_CUDA_WARN(cudaFreeHost(mc->stage));
    free(mc);
    cb->moe = NULL;
}

/* Checks the experts [0, count) agree on dtype and shape and have their data (a bug otherwise).
 * Also the grouped kernels' check (cuda_moe_grouped.cu). */
extern "C" void cu_moe_check_experts(const mt_expert *ex, int count, int H, int I) {
    const mt_dtype dt = ex[0].gate.dtype;
    MT_ASSERT(dt == MT_F32 || dt == MT_F16 || dt == MT_BF16 || dt == MT_F8E4M3);
    for (int e = 0; e < count; e++) {
        MT_ASSERT(ex[e].gate.dtype == dt && ex[e].up.dtype == dt && ex[e].down.dtype == dt);
        if (dt == MT_F8E4M3) MT_ASSERT(ex[e].gate.scale && ex[e].up.scale && ex[e].down.scale);
        MT_ASSERT(ex[e].gate.rows == I && ex[e].gate.cols == H);
        MT_ASSERT(ex[e].up.rows == I && ex[e].up.cols == H);
        MT_ASSERT(ex[e].down.rows == H && ex[e].down.cols == I);
        MT_ASSERT(ex[e].gate.data && ex[e].up.data && ex[e].down.data);
    }
}

/* The device copy of experts[0, need); NULL on failure (logged, *st set). */
static const moe_table *moe_table_get(cu_backend *cb, const mt_expert *experts, int need, int H,
                                      int I, mt_status *st) {
    if (!cb->moe) {
        cb->moe = (struct cu_moe_cache *)calloc(1, sizeof *cb->moe);
        if (!cb->moe) { *st = MT_ERR_NOMEM; return NULL; }
    }
    struct cu_moe_cache *mc = cb->moe;
    moe_table *t = NULL;
    for (int k = 0; k < mc->n; k++)
        if (mc->t[k].host == experts) { t = &mc->t[k]; break; }
    if (t && t->count >= need && memcmp(t->copy, experts, sizeof(mt_expert) * (size_t)need) == 0)
        return t;
    if (!t) {
        if (mc->n < MOE_CACHE_MAX) {
            t = &mc->t[mc->n++];
        } else {
            t = &mc->t[mc->next];
            mc->next = (mc->next + 1) % MOE_CACHE_MAX;
        }
        if (t->host) t->count = 0; /* reused slot: keep its buffers, drop its contents */
        t->host = experts;
    }
    cu_moe_check_experts(experts, need, H, I);
    if (need > t->cap) {
        MT_CUDA_(cu_wait(&cb->base), "cudaStreamSynchronize(moe table)", *st = mt_st_; return NULL);
        if (t->dev) MT_CUDA_WARN(cudaFree(t->dev));
        if (t->wg_maps) MT_CUDA_WARN(cudaFree(t->wg_maps));
        free(t->copy);
        t->wg_maps = NULL;
        t->dev = NULL;
        t->copy = NULL;
        t->cap = t->count = 0;
        t->copy = (mt_expert *)malloc(sizeof(mt_expert) * (size_t)need);
        if (!t->copy || cudaMalloc(&t->dev, sizeof(mt_expert) * (size_t)need) != cudaSuccess) {
            (void)cudaGetLastError();
            free(t->copy);
            t->copy = NULL;
            t->dev = NULL;
            t->host = NULL; /* never matches again */
            *st = MT_ERR_NOMEM;
            return NULL;
        }
        t->cap = need;
    }
    memcpy(t->copy, experts, sizeof(mt_expert) * (size_t)need);
    t->count = 0;
    t->wg_state = 0;
    /* Stream-ordered after every queued kernel that reads the old table. */
    MT_CUDA_(cudaMemcpyAsync(t->dev, t->copy, sizeof(mt_expert) * (size_t)need, cudaMemcpyHostToDevice,
                             cb->stream),
             "cudaMemcpyAsync(moe table)", *st = mt_st_; return NULL);
    /* The copy must stay untouched until the transfer has read it. */
    MT_CUDA_(cu_wait(&cb->base), "cudaStreamSynchronize(moe table)", *st = mt_st_; return NULL);
    t->count = need;
    t->vec_ok = true;
    for (int e = 0; e < need; e++)
        if (!cu_aligned16(experts[e].gate.data) || !cu_aligned16(experts[e].up.data) ||
            !cu_aligned16(experts[e].down.data))
            t->vec_ok = false;
    return t;
}

/* Page-locked host scratch of at least `bytes` in *buf (capacity *cap), grown without keeping
 * the old contents (every user fills it afresh; its copies were waited for); NULL on failure. */
static void *moe_host_grow(void **buf, size_t *cap, size_t bytes) {
    if (*cap >= bytes) return *buf;
    if (*buf) MT_CUDA_WARN(cudaFreeHost(*buf));
    *buf = NULL;
    *cap = 0;
    if (cudaHostAlloc(buf, bytes, cudaHostAllocDefault) != cudaSuccess) {
        (void)cudaGetLastError();
        *buf = NULL;
        mt_log(MT_LOG_ERROR, "cuda backend: moe_experts: cudaHostAlloc of %zu bytes failed", bytes);
        return NULL;
    }
    *cap = bytes;
    return *buf;
}

/* Host int32 scratch of at least `count` entries; NULL on OOM. */
static int32_t *moe_host_ints(struct cu_moe_cache *mc, size_t count) {
    void *b = mc->host_idx;
    size_t cap = mc->host_cap * sizeof(int32_t);
    int32_t *p = (int32_t *)moe_host_grow(&b, &cap, sizeof(int32_t) * count);
    mc->host_idx = (int32_t *)b;
    mc->host_cap = cap / sizeof(int32_t);
    return p;
}

/* Host bytes of at least `bytes` (page-aligned); NULL on OOM. */
static unsigned char *moe_host_bytes(struct cu_moe_cache *mc, size_t bytes) {
    void *b = mc->stage;
    unsigned char *p = (unsigned char *)moe_host_grow(&b, &mc->stage_cap, bytes);
    mc->stage = (unsigned char *)b;
    return p;
}

/* ============================ experts: GEMV path ============================ */

typedef struct moe_gemv_params {
    float *out;               /* [n, H] accumulated */
    float *h;                 /* [n * top_k, I] swiglu(gate x, up x) of each (row, slot) */
    const float *x;           /* [n, H] */
    const int32_t *idx;       /* [n, top_k] */
    const float *wts;         /* [n, top_k] */
    const mt_expert *experts; /* [n_experts] device table */
    int n_experts;
    int n, top_k, H, I;
    float L;
    /* The shared expert as slot top_k of every row (cu_moe_experts_shared), or NULL: its gate, up,
     * down data, [I, H], [I, H], [H, I] like an expert's. slots = top_k + (sd != NULL); h has
     * n * slots rows, pair i * slots + k. */
    const void *sg, *su, *sd;
    int slots;
    /* Row strides of gate/up and of down (elements): H and I, or for F8E4M3 experts the padded
     * column counts cu_fp8_kpad(H) and cu_fp8_kpad(I); and the shared expert's block scales
     * (F8E4M3 only; an expert's own come with its table entry). */
    int64_t ldgu, lddn;
    const float *sgs, *sus, *sds;
} moe_gemv_params;

static __device__ __forceinline__ const mt_expert *moe_expert(const moe_gemv_params &p, int pair) {
    const int e = p.idx[pair];
    if ((unsigned)e >= (unsigned)p.n_experts) __trap(); /* index beyond the table: a bug */
    return &p.experts[e];
}


/* Rows per block and chunks per step: gate/up 4 rows x 2 matrices x 2 chunks, down 2 rows x 4
 * chunks: 16 and 8 loads of 16 bytes per lane in flight before the first use. */
enum { MOE_GU_R = 4, MOE_GU_U = 2, MOE_DN_R = 2, MOE_DN_U = 4 };

/* Grid (ceil(I / R), n * slots): rows [R*blockIdx.x, +R) of h for one (row, slot) pair per
 * blockIdx.y, a row's shared-expert slot first. A row is a list of chunks of 32 load units (lane
 * l takes unit 32c + l: 512 contiguous bytes per warp load for bf16); warp w takes chunks w, w + 8,
 * ..., U of them per step for gate and up of all R rows. The per-lane running sums go through a
 * butterfly, then thread r adds the 8 warps' in order and applies swiglu. Launched for PDL (idx
 * is the router's output). The shared expert's blocks depend on no router output (x is older than
 * the router: its kernels waited for x's before they let this one launch), so they stream their
 * weights while the router finishes; they wait before exiting all the same, so that this grid's
 * end implies the router's whatever the routed blocks do (top_k >= 1 makes it so today). A row's
 * shared-expert blocks come first among its blocks: row 0's are in the first wave. */
template <mt_dtype DT, bool VEC>
static __global__ void __launch_bounds__(MOE_THREADS) moe_gateup_kernel(const moe_gemv_params p) {
    constexpr int R = MOE_GU_R, U = MOE_GU_U, V = cu_wstream<DT, VEC>::V;
    const int i = blockIdx.y / p.slots, ks = blockIdx.y % p.slots;
    const int k = p.sd ? (ks == 0 ? p.top_k : ks - 1) : ks; /* slot top_k (shared) first */
    const int pair = i * p.slots + k, row0 = blockIdx.x * R;
    const bool early = k >= p.top_k;
    if (!early) cu_pdl_wait();
    cu_pdl_trigger();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const void *wg = p.sg, *wu = p.su;
    const float *sg = p.sgs, *su = p.sus;
    if (k < p.top_k) {
        const mt_expert *ex = moe_expert(p, i * p.top_k + k);
        wg = ex->gate.data;
        wu = ex->up.data;
        sg = ex->gate.scale;
        su = ex->up.scale;
    }
    const float *x = p.x + (int64_t)i * p.H;
    const int nv = p.H / V, nch = (nv + 31) >> 5;
    float ag[R], au[R];
#pragma unroll
    for (int r = 0; r < R; r++) ag[r] = au[r] = 0.f;
    for (int c0 = warp; c0 < nch; c0 += U * MOE_WARPS) {
        cu_wstream<DT, VEC> g[U][R], u[U][R];
#pragma unroll
        for (int k = 0; k < U; k++) {
            const int v = (c0 + k * MOE_WARPS) * 32 + lane;
#pragma unroll
            for (int r = 0; r < R; r++) {
                if (v < nv && row0 + r < p.I) {
                    cu_wstream_at(g[k][r], wg, sg, row0 + r, p.ldgu, (int64_t)v * V);
                    cu_wstream_at(u[k][r], wu, su, row0 + r, p.ldgu, (int64_t)v * V);
                } else {
                    g[k][r].zero();
                    u[k][r].zero();
                }
            }
        }
#pragma unroll
        for (int k = 0; k < U; k++) {
            const int v = (c0 + k * MOE_WARPS) * 32 + lane;
            if (v >= nv) break;
            float xv[V];
            cu_xload_ro<V>(x + (int64_t)v * V, xv);
#pragma unroll
            for (int r = 0; r < R; r++) {
                float gf[V], uf[V];
                g[k][r].get(gf);
                u[k][r].get(uf);
#pragma unroll
                for (int j = 0; j < V; j++) {
                    ag[r] = fmaf(gf[j], xv[j], ag[r]);
                    au[r] = fmaf(uf[j], xv[j], au[r]);
                }
            }
        }
    }
    __shared__ float red[MOE_WARPS][2 * R];
#pragma unroll
    for (int r = 0; r < R; r++) {
        const float a = cu_warp_sum(ag[r]), b = cu_warp_sum(au[r]);
        if (lane == 0) { red[warp][2 * r] = a; red[warp][2 * r + 1] = b; }
    }
    __syncthreads();
    if (threadIdx.x < R && row0 + (int)threadIdx.x < p.I) {
        const int r = threadIdx.x;
        float a = 0.f, b = 0.f;
        for (int w = 0; w < MOE_WARPS; w++) { a += red[w][2 * r]; b += red[w][2 * r + 1]; }
        const float g = fminf(a, p.L), u = fminf(fmaxf(b, -p.L), p.L);
        p.h[(int64_t)pair * p.I + row0 + r] = g / (1.f + expf(-g)) * u;
    }
    if (early) cu_pdl_wait();
}

/* Grid (ceil(H / R), n): out rows [R*blockIdx.x, +R) of row blockIdx.y. Warp w takes the slots
 * k = w, w + warps, ... (top-8, + the shared expert: one each, all in flight together; the launch
 * gives a warp per slot up to 16), each over the whole of I: lane l
 * the units 32c + l, U chunks x R rows of loads per step; a butterfly gives the slot's dot, and
 * thread r adds the slots into out in order (the CPU's; with the shared expert, its row starts the sum
 * instead of out's old value). Dynamic shared memory: red[slots][R].
 * Launched for PDL (h is moe_gateup_kernel's output). */
template <mt_dtype DT, bool VEC>
static __global__ void __launch_bounds__(MOE_DN_MAX_THREADS) moe_down_kernel(const moe_gemv_params p) {
    constexpr int R = MOE_DN_R, U = MOE_DN_U, V = cu_wstream<DT, VEC>::V;
    extern __shared__ float moe_red[];
    const int i = blockIdx.y, row0 = blockIdx.x * R;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nv = p.I / V, nch = (nv + 31) >> 5;
    cu_wstream<DT, VEC> d[U][R];
    auto load = [&](const void *wd, const float *sd, int c0) {
#pragma unroll
        for (int q = 0; q < U; q++) {
            const int v = (c0 + q) * 32 + lane;
#pragma unroll
            for (int r = 0; r < R; r++) {
                if (v < nv && row0 + r < p.H) cu_wstream_at(d[q][r], wd, sd, row0 + r, p.lddn, (int64_t)v * V);
                else d[q][r].zero();
            }
        }
    };
    auto slot_weight = [&](int k) {
        return k < p.top_k ? moe_expert(p, i * p.top_k + k)->down.data : p.sd;
    };
    auto slot_scale = [&](int k) {
        return k < p.top_k ? moe_expert(p, i * p.top_k + k)->down.scale : p.sds;
    };
    /* The first slot's first step before the wait: the weights depend only on idx, which the
     * router wrote before moe_gateup_kernel (which waited for it) let this kernel launch; h is
     * what the wait is for. */
    if (warp < p.slots) load(slot_weight(warp), slot_scale(warp), 0);
    cu_pdl_wait();
    cu_pdl_trigger();
    for (int k = warp; k < p.slots; k += (int)(blockDim.x >> 5)) {
        const int pair = i * p.slots + k;
        const void *wd = slot_weight(k);
        const float *sd = slot_scale(k);
        const float *h = p.h + (int64_t)pair * p.I;
        float acc[R];
#pragma unroll
        for (int r = 0; r < R; r++) acc[r] = 0.f;
        for (int c0 = 0; c0 < nch; c0 += U) {
            if (c0 > 0 || k != warp) load(wd, sd, c0);
#pragma unroll
            for (int q = 0; q < U; q++) {
                const int v = (c0 + q) * 32 + lane;
                if (v >= nv) break;
                float hv[V];
                cu_xload_ro<V>(h + (int64_t)v * V, hv);
#pragma unroll
                for (int r = 0; r < R; r++) {
                    float df[V];
                    d[q][r].get(df);
#pragma unroll
                    for (int j = 0; j < V; j++) acc[r] = fmaf(df[j], hv[j], acc[r]);
                }
            }
        }
#pragma unroll
        for (int r = 0; r < R; r++) {
            const float sum = cu_warp_sum(acc[r]);
            if (lane == 0) moe_red[k * R + r] = sum;
        }
    }
    __syncthreads();
    if (threadIdx.x < R && row0 + (int)threadIdx.x < p.H) {
        const int r = threadIdx.x;
        float *o = p.out + (int64_t)i * p.H + row0 + r;
        float v = p.sd ? moe_red[p.top_k * R + r] : *o; /* the shared expert's row, then the routed */
        for (int k = 0; k < p.top_k; k++)
            v = __fadd_rn(v, __fmul_rn(p.wts[i * p.top_k + k], moe_red[k * R + r]));
        *o = v;
    }
}

template <mt_dtype DT, bool VEC> static mt_status moe_gemv_launch_v(moe_gemv_params *p, cudaStream_t s) {
    const unsigned pairs = (unsigned)(p->n * p->slots);
    const dim3 ggu((unsigned)((p->I + MOE_GU_R - 1) / MOE_GU_R), pairs);
    const dim3 gdn((unsigned)((p->H + MOE_DN_R - 1) / MOE_DN_R), (unsigned)p->n);
    const size_t smem = sizeof(float) * (size_t)p->slots * MOE_DN_R;
    /* down: a warp per slot up to MOE_DN_MAX_THREADS (top-8 + shared: 9 warps, none doing two) */
    const int dn_warps = p->slots < MOE_WARPS ? MOE_WARPS : p->slots < MOE_DN_MAX_THREADS / 32 ? p->slots
                                                                                                : MOE_DN_MAX_THREADS / 32;
    MT_CUDA_CHECK(cu_launch_pdl((const void *)moe_gateup_kernel<DT, VEC>, ggu, dim3(MOE_THREADS), 0, s, p));
    MT_CUDA_CHECK(cu_launch_pdl((const void *)moe_down_kernel<DT, VEC>, gdn, dim3(32 * dn_warps), smem, s, p));
    return MT_OK;
}

template <mt_dtype DT> static mt_status moe_gemv_launch_dt(moe_gemv_params *p, bool vec, cudaStream_t s) {
    return vec ? moe_gemv_launch_v<DT, true>(p, s) : moe_gemv_launch_v<DT, false>(p, s);
}

static mt_status moe_gemv_launch(moe_gemv_params *p, mt_dtype dt, bool vec, cudaStream_t s) {
    switch (dt) {
    case MT_F32: return moe_gemv_launch_dt<MT_F32>(p, vec, s);
    case MT_F16: return moe_gemv_launch_dt<MT_F16>(p, vec, s);
    case MT_F8E4M3: return moe_gemv_launch_dt<MT_F8E4M3>(p, vec, s);
    default: return moe_gemv_launch_dt<MT_BF16>(p, vec, s);
    }
}

/* ========================== experts: grouped path ========================== */

typedef struct moe_combine_params {
    float *out;           /* [rows, H] this chunk's rows of out */
    const float *D;       /* [rows * top_k * terms, H] down outputs in sorted order; terms > 1:
                             the parts of sorted position q on rows terms*q + [0, terms) */
    const int32_t *inv;   /* [rows * top_k] sorted position of each (row, slot) */
    const float *wts;     /* [rows, top_k] */
    int64_t rows;
    int top_k, H;
    int terms;            /* 1 or 2 */
    int64_t ld;           /* floats from sorted position q's first row to q + 1's; 0: terms * H */
} moe_combine_params;

/* The model's form (top_k 8, H % 4 == 0, 16-byte aligned out and D): a thread takes 4 columns of a
 * row and issues its 8 pairs' float4 loads together (the general loop below leaves one pair's load
 * in flight at a time); the same sums in the same order. */
enum { MOE_COMBINE_K = 8 };
template <int T> static __global__ void moe_combine8_kernel(const moe_combine_params p) {
    const int64_t stride = (int64_t)gridDim.x * blockDim.x, H4 = p.H / 4;
    const int32_t *__restrict__ inv = p.inv;
    const float *__restrict__ D = p.D, *__restrict__ wts = p.wts;
    float4 *__restrict__ out = reinterpret_cast<float4 *>(p.out);
    for (int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; t < p.rows * H4; t += stride) {
        const int64_t i = t / H4, d4 = t - i * H4;
        float4 dt[MOE_COMBINE_K][T];
        float w[MOE_COMBINE_K];
#pragma unroll
        for (int k = 0; k < MOE_COMBINE_K; k++) {
            const int64_t pair = i * MOE_COMBINE_K + k;
            const float4 *dr = reinterpret_cast<const float4 *>(D + (int64_t)__ldg(inv + pair) * p.ld) + d4;
#pragma unroll
            for (int u = 0; u < T; u++) dt[k][u] = dr[u * H4];
            w[k] = __ldg(wts + pair);
        }
        float4 v = out[t];
#pragma unroll
        for (int k = 0; k < MOE_COMBINE_K; k++) {
            float4 dot = dt[k][0];
            if constexpr (T == 2) {
                dot.x = __fadd_rn(dot.x, dt[k][T - 1].x);
                dot.y = __fadd_rn(dot.y, dt[k][T - 1].y);
                dot.z = __fadd_rn(dot.z, dt[k][T - 1].z);
                dot.w = __fadd_rn(dot.w, dt[k][T - 1].w);
            }
            v.x = __fadd_rn(v.x, __fmul_rn(w[k], dot.x));
            v.y = __fadd_rn(v.y, __fmul_rn(w[k], dot.y));
            v.z = __fadd_rn(v.z, __fmul_rn(w[k], dot.z));
            v.w = __fadd_rn(v.w, __fmul_rn(w[k], dot.w));
        }
        out[t] = v;
    }
}

static __global__ void moe_combine_kernel(const moe_combine_params p) {
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; t < p.rows * p.H; t += stride) {
        const int64_t i = t / p.H;
        const int d = (int)(t % p.H);
        float v = p.out[t];
        for (int k = 0; k < p.top_k; k++) {
            const int64_t pair = i * p.top_k + k;
            const float *dr = p.D + (int64_t)p.inv[pair] * p.ld + d;
            const float dot = p.terms == 2 ? __fadd_rn(dr[0], dr[p.H]) : dr[0];
            v = __fadd_rn(v, __fmul_rn(p.wts[pair], dot));
        }
        p.out[t] = v;
    }
}

/* Tensor-core path between gate/up and down: h = swiglu(sum of gate parts, sum of up parts) in
 * fp32 (the formula of cu_swiglu), split into T 16-bit parts for down. */
typedef struct moe_swiglu_split_params {
    void *h;              /* [P * T, I] dt, parts of pair q on rows T*q + [0, T) */
    const float *g, *u;   /* [P * T, I] fp32 parts of gate x and up x, same rows */
    int64_t P;
    int I;
    float L;
} moe_swiglu_split_params;

template <mt_dtype DT, int T>
static __global__ void moe_swiglu_split_kernel(const moe_swiglu_split_params p) {
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; t < p.P * p.I; t += stride) {
        const int64_t q = t / p.I;
        const int i = (int)(t - q * p.I);
        const int64_t r = q * T * p.I + i; /* first part's element */
        const float a = T == 2 ? __fadd_rn(p.g[r], p.g[r + p.I]) : p.g[r];
        const float b = T == 2 ? __fadd_rn(p.u[r], p.u[r + p.I]) : p.u[r];
        const float g = fminf(a, p.L), u = fminf(fmaxf(b, -p.L), p.L);
        const float h = g / (1.f + expf(-g)) * u;
        uint16_t *o = (uint16_t *)p.h + r;
        o[0] = cu_bits16<DT>(h);
        if constexpr (T == 2) o[p.I] = cu_bits16<DT>(h - cu_round16<DT>(h));
    }
}

static mt_status moe_swiglu_split_launch(const moe_swiglu_split_params *p, mt_dtype dt, int T,
                                         cudaStream_t s) {
    const int64_t blocks = (p->P * p->I + 255) / 256;
    const unsigned g = (unsigned)(blocks < 65536 ? blocks : 65536);
    if (dt == MT_BF16) {
        if (T == 2) moe_swiglu_split_kernel<MT_BF16, 2><<<g, 256, 0, s>>>(*p);
        else moe_swiglu_split_kernel<MT_BF16, 1><<<g, 256, 0, s>>>(*p);
    } else {
        if (T == 2) moe_swiglu_split_kernel<MT_F16, 2><<<g, 256, 0, s>>>(*p);
        else moe_swiglu_split_kernel<MT_F16, 1><<<g, 256, 0, s>>>(*p);
    }
    MT_CUDA_CHECK_LAUNCH();
    return MT_OK;
}

static mt_status moe_combine_launch(const moe_combine_params *in, cudaStream_t s) {
    moe_combine_params p = *in;
    if (!p.ld) p.ld = (int64_t)p.terms * p.H;
    if (p.top_k == MOE_COMBINE_K && p.H % 4 == 0 && p.ld % 4 == 0 && cu_aligned16(p.out) && cu_aligned16(p.D) &&
        (p.terms == 1 || p.terms == 2)) {
        const int64_t blocks = (p.rows * (p.H / 4) + 255) / 256;
        const unsigned g = (unsigned)(blocks < 65536 ? blocks : 65536);
        if (p.terms == 2) moe_combine8_kernel<2><<<g, 256, 0, s>>>(p);
        else moe_combine8_kernel<1><<<g, 256, 0, s>>>(p);
    } else {
        const int64_t blocks = (p.rows * p.H + 255) / 256;
        moe_combine_kernel<<<(unsigned)(blocks < 65536 ? blocks : 65536), 256, 0, s>>>(p);
    }
    MT_CUDA_CHECK_LAUNCH();
    return MT_OK;
}

/* Bytes of grouped-path scratch per (row, slot) pair: T > 0 tensor-core parts, 0 fp32. */
static size_t moe_pair_bytes(int H, int I, int T) {
    if (T == 0) return sizeof(float) * (2 * (size_t)I + H) + 2 * sizeof(int32_t) + 16;
    const size_t f = (size_t)(2 * I > H ? 2 * I : H), h = (size_t)(H > I ? H : I);
    return (size_t)T * (sizeof(float) * f + sizeof(uint16_t) * h) + 2 * sizeof(int32_t) + 16;
}

/* The tensor-core form of a chunk (see the file comment). Scratch: F, fp32 [P * T, max(2I, H)]
 * holding the gate and up parts, later down's; S, 16-bit [P * T, max(H, I)] holding x's parts,
 * later h's; then gather and inv (host staging at `gather`, nI bytes). start: host [E + 1]. */
static mt_status moe_grouped_chunk_tc(mt_backend *be, const moe_table *t, float *out, const float *x,
                                      const int32_t *gather, size_t nI, const int32_t *start,
                                      const float *weights, int r0, int r1, int top_k, int H, int I,
                                      float L, mt_dtype dt, int T) {
    cu_backend *cb = (cu_backend *)be;
    const int P = (r1 - r0) * top_k, E = t->count;
    const size_t fw = (size_t)(2 * I > H ? 2 * I : H), sw = (size_t)(H > I ? H : I);
    const size_t bF = cu_align_up(sizeof(float) * (size_t)P * T * fw, 16);
    const size_t bS = cu_align_up(sizeof(uint16_t) * (size_t)P * T * sw, 16);
    char *scr = (char *)cu_scratch(be, CU_SCRATCH_DENSE, bF + bS + cu_align_up(nI, 16));
    if (!scr) return MT_ERR_NOMEM;
    float *G = (float *)scr, *U = G + (size_t)P * T * I, *D = G;   /* D after G, U are spent */
    uint16_t *X16 = (uint16_t *)(scr + bF), *H16 = X16;             /* H after X is spent */
    int32_t *dgather = (int32_t *)(scr + bF + bS), *dinv = dgather + P;
    MT_CUDA_CHECK(cudaMemcpyAsync(dgather, gather, nI, cudaMemcpyHostToDevice, cb->stream));
    MT_CUDA_CHECK(cu_wait(&cb->base)); /* the staging is reused by the next chunk */

    /* Expert e owns sorted positions [start[e], start[e + 1]): rows T*start[e] on of every part
     * buffer. t->copy holds the host copy of the weight pointers. */
    mt_status st = cu_split16(X16, x, dgather, P, H, dt, T, true, cb->stream);
    for (int e = 0; e < E && st == MT_OK; e++) {
        const int64_t m = (int64_t)T * start[e];
        const int rows = T * (start[e + 1] - start[e]);
        if (rows == 0) continue;
        st = cu_gemm_tc(cb, G + m * I, X16 + m * H, t->copy[e].gate.data, dt, rows, I, H, 0.f);
        if (st == MT_OK) st = cu_gemm_tc(cb, U + m * I, X16 + m * H, t->copy[e].up.data, dt, rows, I, H, 0.f);
    }
    if (st != MT_OK) return st;
    moe_swiglu_split_params sp = {H16, G, U, P, I, L};
    if ((st = moe_swiglu_split_launch(&sp, dt, T, cb->stream)) != MT_OK) return st;
    for (int e = 0; e < E && st == MT_OK; e++) {
        const int64_t m = (int64_t)T * start[e];
        const int rows = T * (start[e + 1] - start[e]);
        if (rows == 0) continue;
        st = cu_gemm_tc(cb, D + m * H, H16 + m * I, t->copy[e].down.data, dt, rows, H, I, 0.f);
    }
    if (st != MT_OK) return st;
    moe_combine_params cp = {out + (int64_t)r0 * H, D, dinv, weights + (int64_t)r0 * top_k,
                             r1 - r0, top_k, H, T};
    return moe_combine_launch(&cp, cb->stream);
}

/* Padded pair count of an expert with c > 0 pairs: few distinct sizes, so that experts share
 * batched GEMMs; multiples of 8, at most a quarter above c beyond 32 pairs. */
static int moe_pad(int c) {
    if (c <= 8) return 8;
    int step = 8;
    while (step * 8 < c) step *= 2;
    return (c + step - 1) / step * step;
}

/* The batched path's side stream, handle, workspace and events (freed by cu_moe_cache_free, also
 * after a partial failure here). */
static mt_status moe_side_make(struct cu_moe_cache *mc) {
    int least = 0, greatest = 0;
    MT_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    MT_CUDA_CHECK(cudaStreamCreateWithPriority(&mc->side, cudaStreamNonBlocking, greatest));
    MT_CUDA_CHECK(cudaEventCreateWithFlags(&mc->side_fork, cudaEventDisableTiming));
    MT_CUDA_CHECK(cudaEventCreateWithFlags(&mc->side_join, cudaEventDisableTiming));
    return cu_blas_make(&mc->side_blas, &mc->side_ws, mc->side);
}

/* The side stream starts after what the backend's stream has queued. */
static mt_status moe_side_fork(cu_backend *cb) {
    MT_CUDA_CHECK(cudaEventRecord(cb->moe->side_fork, cb->stream));
    MT_CUDA_CHECK(cudaStreamWaitEvent(cb->moe->side, cb->moe->side_fork, 0));
    return MT_OK;
}

/* The backend's stream waits for the side stream's work. Called even after a failure: nothing may
 * run past the side's writes, so a join that cannot be queued is made by hand (MT_ERR_BACKEND). */
static mt_status moe_side_join(cu_backend *cb) {
    struct cu_moe_cache *mc = cb->moe;
    if (cudaEventRecord(mc->side_join, mc->side) == cudaSuccess &&
        cudaStreamWaitEvent(cb->stream, mc->side_join, 0) == cudaSuccess)
        return MT_OK;
    (void)cudaGetLastError();
    MT_CUDA_CHECK(cudaStreamSynchronize(mc->side)); /* the join by hand */
    mt_log(MT_LOG_ERROR, "cuda backend: moe_experts: joining the side stream failed");
    return MT_ERR_BACKEND;
}

/* Whether the side stream is there, made on first use; false when it is off (logged once if
 * making it failed: the batched GEMMs then all run on the backend's stream, as before). */
static bool moe_side_get(cu_backend *cb) {
    struct cu_moe_cache *mc = cb->moe;
    if (mc->side_state == 0) {
        if (moe_side_make(mc) != MT_OK) { /* logged at the failing call */
            (void)cudaGetLastError();
            mt_log(MT_LOG_WARN, "cuda backend: moe_experts: no second stream; the batched GEMMs run on one");
            mc->side_state = -1;
        } else {
            mc->side_state = 1;
        }
    }
    return mc->side_state > 0;
}

/* Which padded size classes of a call run on the side stream: SIDE_PE (128) padded pairs an
 * expert or fewer, while the largest class is bigger: the small classes stream their experts'
 * weights (bandwidth-bound) beside the large ones' arithmetic. When every class is that small (a
 * 512-token prefill), every other class instead: two streams of weight reads fill each other's
 * last waves. Measured on the H200 (the gate/up and down GEMMs of bench-4L's three MoE layers):
 * 4096 tokens 22.26 -> 21.24 ms, 512
 * tokens 10.42 -> 10.05 ms. */
enum { SIDE_PE = 128 };
static bool moe_on_side(int pe, int max_pe, int cls) { return max_pe > SIDE_PE ? pe <= SIDE_PE : (cls & 1) != 0; }

/* One cublasGemmBatchedEx on `blas` (the backend's handle or the side stream's) over `count`
 * problems y_j[rows, N] = x16_j[rows, K] . w_j[N, K]^T (the layout of cu_gemm_tc); dA/dB/dC: device
 * pointer arrays. On a cuBLAS refusal (logged once) the problems run one by one on the backend's
 * stream from the host copies hA/hB/hC, and later chunks take the per-expert path. */
static mt_status moe_gemm_batched(cu_backend *cb, cublasHandle_t blas, const void *const *dA,
                                  const void *const *dB, void *const *dC, const void *const *hA,
                                  const void *const *hB, const void *const *hC, int count, int rows, int N, int K,
                                  mt_dtype dt) {
    const cudaDataType ty = dt == MT_BF16 ? CUDA_R_16BF : CUDA_R_16F;
    const float one = 1.f, zero = 0.f;
    if (cb->moe_batched) {
        const cublasStatus_t rc =
            cublasGemmBatchedEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, N, rows, K, &one, dA, ty, K, dB, ty, K,
                                &zero, dC, CUDA_R_32F, N, count, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
        if (rc == CUBLAS_STATUS_SUCCESS) return MT_OK;
        mt_log(MT_LOG_WARN, "cuda backend: moe_experts: cublasGemmBatchedEx failed (%s); "
               "one GEMM per expert from now on", cublasGetStatusString(rc));
        cb->moe_batched = false;
    }
    mt_status st = MT_OK;
    for (int j = 0; j < count && st == MT_OK; j++)
        st = cu_gemm_tc(cb, (float *)hC[j], hB[j], hA[j], dt, rows, N, K, 0.f);
    return st;
}

/* The tensor-core form of a chunk with batched GEMMs (see the file comment). ci: the chunk's
 * [P] expert indices; start: host [E + 1], expert e owns the unpadded sorted positions
 * [start[e], start[e + 1]). Expert e's padded slots are [ps[e], ps[e + 1]), its rows T*ps[e] on of
 * every part buffer. Scratch as moe_grouped_chunk_tc over Ppad slots, then the device copy of the
 * staging: pointer arrays, gather[Ppad], inv[P]. */
static mt_status moe_grouped_chunk_batched(mt_backend *be, const moe_table *t, float *out, const float *x,
                                           const int32_t *ci, const int32_t *start, const float *weights,
                                           int r0, int r1, int top_k, int H, int I, float L, mt_dtype dt,
                                           int T) {
    cu_backend *cb = (cu_backend *)be;
    const int P = (r1 - r0) * top_k, E = t->count;
    int nact = 0;
    int64_t Ppad = 0;
    for (int e = 0; e < E; e++) {
        const int c = start[e + 1] - start[e];
        if (c > 0) {
            nact++;
            Ppad += moe_pad(c);
        }
    }
    MT_ASSERT(nact > 0 && Ppad * T <= INT_MAX / 2);
    /* Host staging: [9 nact] pointers, gather[Ppad], inv[P] (copied to the device as one), then
     * host-only ps[E + 1], order[E], pos[E]. */
    const size_t bP = sizeof(void *) * 9 * (size_t)nact;
    const size_t nI = bP + sizeof(int32_t) * ((size_t)Ppad + (size_t)P);
    unsigned char *hb = moe_host_bytes(cb->moe, nI + sizeof(int32_t) * (3 * (size_t)E + 1));
    if (!hb) return MT_ERR_NOMEM;
    const void **hp = (const void **)hb;
    int32_t *gather = (int32_t *)(hb + bP), *inv = gather + Ppad;
    int32_t *ps = inv + P, *order = ps + E + 1, *pos = order + E;
    ps[0] = 0;
    for (int e = 0; e < E; e++) {
        const int c = start[e + 1] - start[e];
        ps[e + 1] = ps[e] + (c > 0 ? moe_pad(c) : 0);
    }
    MT_ASSERT(ps[E] == Ppad);
    /* Active experts by padded size, then index (stable insertion sort). */
    int m = 0;
    for (int e = 0; e < E; e++)
        if (start[e + 1] > start[e]) order[m++] = e;
    for (int a = 1; a < m; a++) {
        const int e = order[a], pe = ps[e + 1] - ps[e];
        int b = a;
        while (b > 0 && ps[order[b - 1] + 1] - ps[order[b - 1]] > pe) {
            order[b] = order[b - 1];
            b--;
        }
        order[b] = e;
    }
    for (int e = 0; e < E; e++) pos[e] = ps[e];
    for (int q = 0; q < P; q++) { /* stable: pairs of one expert keep their order */
        const int at = pos[ci[q]]++;
        gather[at] = r0 + q / top_k;
        inv[q] = at;
    }
    for (int e = 0; e < E; e++) /* padding slots: the expert's first row again (finite, unused) */
        for (int sl = pos[e]; sl < ps[e + 1]; sl++) gather[sl] = gather[ps[e]];

    const size_t fw = (size_t)(2 * I > H ? 2 * I : H), sw = (size_t)(H > I ? H : I);
    const size_t bF = cu_align_up(sizeof(float) * (size_t)Ppad * T * fw, 16);
    const size_t bS = cu_align_up(sizeof(uint16_t) * (size_t)Ppad * T * sw, 16);
    char *scr = (char *)cu_scratch(be, CU_SCRATCH_DENSE, bF + bS + cu_align_up(nI, 16));
    if (!scr) return MT_ERR_NOMEM;
    float *G = (float *)scr, *U = G + (size_t)Ppad * T * I, *D = G;   /* D after G, U are spent */
    uint16_t *X16 = (uint16_t *)(scr + bF), *H16 = X16;               /* H after X is spent */
    unsigned char *dstage = (unsigned char *)(scr + bF + bS);
    void **dp = (void **)dstage;
    int32_t *dgather = (int32_t *)(dstage + bP), *dinv = dgather + Ppad;

    /* Pointer arrays, per size group (order[a, b)): gate/up problems at [2a, 2a + 2(b - a)) of
     * the first three arrays (gates, then ups), down problems at [a, b) of the last three. */
    const void **Agu = hp, **Bgu = hp + 2 * nact, **Cgu = hp + 4 * nact;
    const void **Ad = hp + 6 * nact, **Bd = hp + 7 * nact, **Cd = hp + 8 * nact;
    for (int a = 0; a < nact;) {
        const int pe = ps[order[a] + 1] - ps[order[a]];
        int b = a;
        while (b < nact && ps[order[b] + 1] - ps[order[b]] == pe) b++;
        const int g = b - a;
        for (int j = 0; j < g; j++) {
            const int e = order[a + j];
            const int64_t row = (int64_t)T * ps[e];
            Agu[2 * a + j] = t->copy[e].gate.data;
            Agu[2 * a + g + j] = t->copy[e].up.data;
            Bgu[2 * a + j] = Bgu[2 * a + g + j] = X16 + row * H;
            Cgu[2 * a + j] = G + row * I;
            Cgu[2 * a + g + j] = U + row * I;
            Ad[a + j] = t->copy[e].down.data;
            Bd[a + j] = H16 + row * I;
            Cd[a + j] = D + row * H;
        }
        a = b;
    }
    MT_CUDA_CHECK(cudaMemcpyAsync(dstage, hb, nI, cudaMemcpyHostToDevice, cb->stream));
    MT_CUDA_CHECK(cu_wait(&cb->base)); /* the staging is reused by the next chunk */
    cu_prof_mark(be, "moe_experts (sort, staging)");

    mt_status st = cu_split16(X16, x, dgather, Ppad, H, dt, T, true, cb->stream);
    const void *const *dAgu = (const void *const *)dp, *const *dBgu = dAgu + 2 * nact;
    void *const *dCgu = dp + 4 * nact;
    const void *const *dAd = dAgu + 6 * nact, *const *dBd = dAgu + 7 * nact;
    void *const *dCd = dp + 8 * nact;
    /* Each matrix's classes, ascending, on the two streams (moe_on_side); the side stream starts
     * after what the backend's stream has queued and the backend's stream waits for it after. */
    const bool side = nact > 1 && moe_side_get(cb);
    struct cu_moe_cache *mc = cb->moe;
    const int max_pe = ps[order[nact - 1] + 1] - ps[order[nact - 1]];
    for (int mat = 0; mat < 2 && st == MT_OK; mat++) {
        if (mat == 1) {
            cu_prof_mark(be, "moe_experts (gate/up GEMMs)");
            moe_swiglu_split_params sp = {H16, G, U, Ppad, I, L};
            if ((st = moe_swiglu_split_launch(&sp, dt, T, cb->stream)) != MT_OK) return st;
        }
        if (side && (st = moe_side_fork(cb)) != MT_OK) return st;
        for (int a = 0, cls = 0; a < nact && st == MT_OK; cls++) {
            const int pe = ps[order[a] + 1] - ps[order[a]];
            int b = a;
            while (b < nact && ps[order[b] + 1] - ps[order[b]] == pe) b++;
            cublasHandle_t h = side && moe_on_side(pe, max_pe, cls) ? mc->side_blas : cb->blas;
            if (mat == 0)
                st = moe_gemm_batched(cb, h, dAgu + 2 * a, dBgu + 2 * a, dCgu + 2 * a, Agu + 2 * a, Bgu + 2 * a,
                                      Cgu + 2 * a, 2 * (b - a), T * pe, I, H, dt);
            else
                st = moe_gemm_batched(cb, h, dAd + a, dBd + a, dCd + a, Ad + a, Bd + a, Cd + a, b - a, T * pe, H,
                                      I, dt);
            a = b;
        }
        if (side) { /* joined even after a failure */
            const mt_status js = moe_side_join(cb);
            if (js != MT_OK) return js;
        }
    }
    if (st != MT_OK) return st;
    cu_prof_mark(be, "moe_experts (down GEMMs)");
    moe_combine_params cp = {out + (int64_t)r0 * H, D, dinv, weights + (int64_t)r0 * top_k,
                             r1 - r0, top_k, H, T};
    return moe_combine_launch(&cp, cb->stream);
}

/* Rows [r0, r1) of the grouped path; hidx = all of idx on the host; T: tensor-core parts of x
 * (cu_backend.tc_terms), 0 for the fp32 kernel. */
static mt_status moe_grouped_chunk(mt_backend *be, const moe_table *t, float *out, const float *x,
                                   const int32_t *hidx, const float *weights, int r0, int r1,
                                   int top_k, int H, int I, float L, mt_dtype dt, int T) {
    cu_backend *cb = (cu_backend *)be;
    const int P = (r1 - r0) * top_k, E = t->count;
    const int max_tiles = P / CU_GEMM_TM + E + 1;
    /* Host staging: pos[E], start[E + 1], then gather[P], inv[P], tiles[max_tiles] (3 ints
     * each), the last three contiguous as on the device. */
    const size_t n_ints = 2 * (size_t)E + 1 + 2 * (size_t)P + 3 * (size_t)max_tiles;
    int32_t *hs = moe_host_ints(cb->moe, n_ints);
    if (!hs) return MT_ERR_NOMEM;
    int32_t *pos = hs;                 /* [E] next free sorted position of each expert */
    int32_t *start = hs + E;           /* [E + 1] first sorted position of each expert */
    int32_t *gather = start + E + 1, *inv = gather + P;
    cu_gemm_tile *tiles = (cu_gemm_tile *)(inv + P);
    memset(start, 0, sizeof(int32_t) * (size_t)(E + 1));
    const int32_t *ci = hidx + (int64_t)r0 * top_k;
    for (int q = 0; q < P; q++) start[ci[q] + 1]++;
    for (int e = 0; e < E; e++) start[e + 1] += start[e];
    if (T > 0 && cb->moe_batched)
        return moe_grouped_chunk_batched(be, t, out, x, ci, start, weights, r0, r1, top_k, H, I, L, dt, T);
    int ntiles = 0;
    for (int e = 0; e < E; e++)
        for (int m = start[e]; m < start[e + 1]; m += CU_GEMM_TM) {
            tiles[ntiles].expert = e;
            tiles[ntiles].m0 = m;
            tiles[ntiles].m1 = m + CU_GEMM_TM < start[e + 1] ? m + CU_GEMM_TM : start[e + 1];
            ntiles++;
        }
    MT_ASSERT(ntiles <= max_tiles);
    for (int e = 0; e < E; e++) pos[e] = start[e];
    for (int q = 0; q < P; q++) { /* stable: pairs of one expert keep their order */
        const int at = pos[ci[q]]++;
        gather[at] = r0 + q / top_k;
        inv[q] = at;
    }

    const size_t nI = sizeof(int32_t) * (2 * (size_t)P + 3 * (size_t)ntiles), bI = cu_align_up(nI, 16);
    if (T > 0)
        return moe_grouped_chunk_tc(be, t, out, x, gather, nI, start, weights, r0, r1, top_k, H, I, L, dt, T);

    const size_t bG = cu_align_up(sizeof(float) * (size_t)P * I, 16);
    const size_t bD = cu_align_up(sizeof(float) * (size_t)P * H, 16);
    char *scr = (char *)cu_scratch(be, CU_SCRATCH_DENSE, 2 * bG + bD + bI);
    if (!scr) return MT_ERR_NOMEM;
    float *G = (float *)scr, *U = (float *)(scr + bG), *D = (float *)(scr + 2 * bG);
    int32_t *dgather = (int32_t *)(scr + 2 * bG + bD), *dinv = dgather + P;
    cu_gemm_tile *dtiles = (cu_gemm_tile *)(dinv + P);
    /* gather, inv and tiles are contiguous on both sides. */
    MT_CUDA_CHECK(cudaMemcpyAsync(dgather, gather, nI, cudaMemcpyHostToDevice, cb->stream));
    MT_CUDA_CHECK(cu_wait(&cb->base)); /* the staging is reused by the next chunk */
    moe_combine_params cp = {out + (int64_t)r0 * H, D, dinv, weights + (int64_t)r0 * top_k,
                             r1 - r0, top_k, H, 1};

    cu_gemm_params gp = {};
    gp.y[0] = G;
    gp.y[1] = U;
    gp.x = x;
    gp.gather = dgather;
    gp.experts = t->dev;
    gp.tiles = dtiles;
    gp.ntiles = ntiles;
    gp.mat[0] = 0;
    gp.mat[1] = 1;
    gp.nmat = 2;
    gp.M = P;
    gp.N = I;
    gp.K = H;
    gp.dtype = dt;
    mt_status st = cu_gemm(&gp, cb->stream);
    if (st != MT_OK) return st;
    be->ops->swiglu(be, G, G, U, P, I, L);
    gp.y[0] = D;
    gp.y[1] = NULL;
    gp.x = G;
    gp.gather = NULL;
    gp.mat[0] = 2;
    gp.nmat = 1;
    gp.N = H;
    gp.K = I;
    if ((st = cu_gemm(&gp, cb->stream)) != MT_OK) return st;
    return moe_combine_launch(&cp, cb->stream);
}

/* Whether the wgmma form can take table t: its weights 16-byte aligned, at most CU_MOE_WG_MAX_E
 * experts, and its TMA maps made (now, when stale). A failure to make them is logged once and
 * leaves the table to the batched path until it changes. */
static bool moe_wg_ready(cu_backend *cb, const moe_table *tc) {
    moe_table *t = (moe_table *)tc; /* its map cache is the table's own state */
    if (!t->vec_ok || t->count > CU_MOE_WG_MAX_E) return false;
    if (t->wg_state == 0) {
        if (cu_moe_wg_maps(t->copy, t->count, t->cap, &t->wg_maps, cb->stream) != MT_OK) {
            (void)cudaGetLastError();
            mt_log(MT_LOG_WARN, "cuda backend: moe_experts: no TMA maps for these experts; batched GEMMs instead");
            t->wg_state = -1;
        } else {
            t->wg_state = 1;
        }
    }
    return t->wg_state > 0;
}

/* The wgmma form (cu_moe_wg_ok; cuda_moe_wg.cu), planned on the device, so that indices from the
 * router never cross to the host. Per chunk of rows: cu_moe_wg_plan sorts the pairs by expert and
 * writes the tiles (an expert's rows in tiles of at most 128 for gate/up and 256 for down, as even
 * as possible, each against every 128 columns of gate/up or down (wide down: 128 rows against 256
 * columns), in order of expert, then
 * columns, then rows, so a weight tile's readers run together); x's rows gathered in sorted
 * order and split (X16 [T P, H], T = tc_terms parts interleaved); one launch gives h's parts
 * (H16 [T P, I]) with swiglu applied, one gives down's sum per pair (D [P, H], in X16's place:
 * its bytes are sized for two parts), and the combine reads one row a pair. */
static mt_status moe_experts_wg(mt_backend *be, const moe_table *t, float *out, const float *x, const int32_t *idx,
                                const float *weights, int n, int top_k, int H, int I, float L) {
    cu_backend *cb = (cu_backend *)be;
    mt_status st = MT_OK;
    const int E = t->count, T = cb->tc_terms; /* 1 or 2: cu_moe_wg_ok */
    const bool wide = cb->params.moe_wg_wide_down;
    /* X16 (D in its place) and H16, gather and inv; the tile lists are small beside them */
    const size_t per_pair = sizeof(uint16_t) * 2 * ((size_t)H + I) + 2 * sizeof(int32_t);
    const size_t fit = MOE_CHUNK_BYTES / (per_pair * (size_t)top_k);
    const int rows = fit < 1 ? 1 : fit > (size_t)n ? n : (int)fit;
    for (int r0 = 0; r0 < n && st == MT_OK; r0 += rows) {
        const int r1 = r0 + rows < n ? r0 + rows : n, P = (r1 - r0) * top_k;
        const size_t tg = cu_moe_wg_max_tiles(P, E, I, false, wide), td = cu_moe_wg_max_tiles(P, E, H, true, wide);
        MT_ASSERT(tg + td <= (size_t)INT_MAX / 4 && (int64_t)2 * P * H <= INT_MAX);
        const size_t bX = cu_align_up(sizeof(uint16_t) * 2 * (size_t)P * H, 16);
        const size_t bH = cu_align_up(sizeof(uint16_t) * 2 * (size_t)P * I, 16);
        const size_t bG = cu_align_up(sizeof(int32_t) * (size_t)P, 16), bT = 4 * sizeof(int32_t) * (tg + td);
        char *scr = (char *)cu_scratch(be, CU_SCRATCH_DENSE, bX + bH + 2 * bG + bT + 16);
        if (!scr) return MT_ERR_NOMEM;
        uint16_t *X16 = (uint16_t *)scr, *H16 = (uint16_t *)(scr + bX);
        float *D = (float *)scr; /* [P, H] fp32: X16's bytes, spent by then */
        int32_t *gather = (int32_t *)(scr + bX + bH), *inv = (int32_t *)(scr + bX + bH + bG);
        int32_t *tgu = (int32_t *)(scr + bX + bH + 2 * bG), *tdn = tgu + 4 * tg, *nt = tdn + 4 * td;
        st = cu_moe_wg_plan(idx + (size_t)r0 * top_k, P, top_k, E, r0, H, I, T, wide, gather, inv, tgu, tdn, nt,
                            cb->stream);
        cu_prof_mark(be, "moe_experts (plan)");
        if (st == MT_OK) st = cu_split16(X16, x, gather, P, H, MT_BF16, T, true, cb->stream);
        if (st == MT_OK)
            st = cu_moe_wg_gemm(t->wg_maps, tgu, nt, (int)tg, X16, (int64_t)T * P, H, H16, I, false, false, T, L,
                                cb->n_sm, cb->stream);
        cu_prof_mark(be, "moe_experts (gate/up GEMMs)");
        if (st == MT_OK)
            st = cu_moe_wg_gemm(t->wg_maps, tdn, nt + 1, (int)td, H16, (int64_t)T * P, I, D, H, true, wide, T, L,
                                cb->n_sm, cb->stream);
        cu_prof_mark(be, "moe_experts (down GEMMs)");
        moe_combine_params cp = {out + (int64_t)r0 * H, D, inv, weights + (int64_t)r0 * top_k, r1 - r0, top_k, H, 1};
        if (st == MT_OK) st = moe_combine_launch(&cp, cb->stream);
    }
    return st;
}

/* F8E4M3 experts over many rows in the default numerics (tc_terms 1): cuBLASLt's block-scaled FP8
 * GEMMs an expert at a time, the pairs sorted by expert on the host (hidx: all of idx, read back).
 * Per chunk of rows: each expert's c pairs padded to moe_pad(c) rows (a multiple of 8; the
 * padded sizes are few, so are the cuBLASLt plans, which cuda_fp8.cu caches), one row map
 * (cu_fp8_row: the source row, or -1 for a padding row, and the expert's segment) staged;
 * x's rows gathered and quantised to e4m3 per 1 x 128 block into each expert's segment
 * (cu_fp8_quant_rows, XQ [Ppad, kpad(H)] with its scales), gate and up a GEMM each per expert
 * into G, U [Ppad, rpad(I)] fp32, h = swiglu(G, U) quantised alike (HQ in XQ's place), down per
 * expert into D [Ppad, rpad(H)], then the combine (slots in order). Weights are read once a chunk
 * per touched expert, at one byte a weight. A GEMM whose shape has no fp32-output algorithm writes
 * bf16 into the expert's rows of T16 and is widened. MT_ERR_UNSUPPORTED when cuBLASLt has no
 * algorithm for a shape: *done then says how many rows are in out (whole chunks, each written
 * only by its combine), and the caller takes the grouped kernels for the rest. */
static mt_status moe_experts_fp8_lt(mt_backend *be, const moe_table *t, float *out, const float *x,
                                    const int32_t *hidx, const float *weights, int n, int top_k, int H, int I,
                                    float L, int *done) {
    cu_backend *cb = (cu_backend *)be;
    const int E = t->count;
    const int64_t kpH = cu_fp8_kpad(H), kpI = cu_fp8_kpad(I), npH = cu_fp8_rpad(H), npI = cu_fp8_rpad(I);
    const int64_t kq = kpH > kpI ? kpH : kpI, nq = npH > npI ? npH : npI;
    /* bytes a padded row: its e4m3 row and scales (x's, then h's), its G, U and D rows, its row of
       a GEMM's bf16 output where cuBLASLt offers no fp32 one (cu_fp8_gemm_q) */
    const size_t per_row = (size_t)kq + sizeof(float) * ((size_t)kq / 128 + 2 * (size_t)npI + (size_t)npH) +
                           sizeof(uint16_t) * (size_t)nq + sizeof(cu_fp8_row) + sizeof(int32_t);
    /* a chunk's padded rows stay below P + 8 E (moe_pad adds under 8 a pair to small experts, a
       quarter to large ones): sized for 2 P + 8 E */
    const size_t fit = MOE_CHUNK_BYTES / (per_row * 2 * (size_t)top_k);
    const int rows = fit < 1 ? 1 : fit > (size_t)n ? n : (int)fit;
    mt_status st = MT_OK;
    *done = 0;
    for (int r0 = 0; r0 < n && st == MT_OK; r0 += rows) {
        const int r1 = r0 + rows < n ? r0 + rows : n, P = (r1 - r0) * top_k;
        const int32_t *ci = hidx + (int64_t)r0 * top_k;
        /* host staging: rmap[Ppad], inv[P] (uploaded together), then host-only start[E + 1],
           ps[E + 1], pos[E]; Ppad <= P + 8 E + P / 4 + 8 */
        const size_t cap = (size_t)P + (size_t)P / 4 + 8 * (size_t)E + 8;
        unsigned char *hb = moe_host_bytes(cb->moe, sizeof(cu_fp8_row) * cap + sizeof(int32_t) * ((size_t)P + 3 * (size_t)E + 2));
        if (!hb) return MT_ERR_NOMEM;
        cu_fp8_row *rmap = (cu_fp8_row *)hb;
        int32_t *start = (int32_t *)(rmap + cap), *ps = start + E + 1, *pos = ps + E + 1, *inv = pos + E;
        memset(start, 0, sizeof(int32_t) * (size_t)(E + 1));
        for (int q = 0; q < P; q++) {
            MT_ASSERT(ci[q] >= 0 && ci[q] < E);
            start[ci[q] + 1]++;
        }
        ps[0] = 0;
        for (int e = 0; e < E; e++) {
            const int c = start[e + 1];
            ps[e + 1] = ps[e] + (c > 0 ? moe_pad(c) : 0);
        }
        const int Ppad = ps[E];
        MT_ASSERT((size_t)Ppad <= cap);
        for (int e = 0; e < E; e++) {
            for (int r = ps[e]; r < ps[e + 1]; r++) rmap[r] = cu_fp8_row{-1, ps[e], ps[e + 1] - ps[e], 0};
            pos[e] = ps[e];
        }
        for (int q = 0; q < P; q++) { /* stable: pairs of one expert keep their order */
            const int at = pos[ci[q]]++;
            rmap[at].src = r0 + q / top_k;
            inv[q] = at;
        }
        /* device scratch: XQ (HQ in its place), its scales, G, U, D, the row map and inv */
        const size_t bQ = cu_align_up((size_t)Ppad * (size_t)kq, 256);
        const size_t bS = cu_align_up(sizeof(float) * (size_t)Ppad * (size_t)(kq / 128), 256);
        const size_t bG = cu_align_up(sizeof(float) * (size_t)Ppad * (size_t)npI, 256);
        const size_t bD = cu_align_up(sizeof(float) * (size_t)Ppad * (size_t)npH, 256);
        const size_t bT = cu_align_up(sizeof(uint16_t) * (size_t)Ppad * (size_t)nq, 256);
        const size_t bM = sizeof(cu_fp8_row) * (size_t)Ppad, bI = sizeof(int32_t) * (size_t)P;
        char *scr = (char *)cu_scratch(be, CU_SCRATCH_DENSE, bQ + bS + 2 * bG + bD + bT + bM + bI);
        if (!scr) return MT_ERR_NOMEM;
        uint8_t *XQ = (uint8_t *)scr;
        float *XS = (float *)(scr + bQ), *G = (float *)(scr + bQ + bS), *U = (float *)(scr + bQ + bS + bG);
        float *D = (float *)(scr + bQ + bS + 2 * bG);
        uint16_t *T16 = (uint16_t *)(scr + bQ + bS + 2 * bG + bD); /* [Ppad, nq]: each expert its own rows */
        cu_fp8_row *drmap = (cu_fp8_row *)(scr + bQ + bS + 2 * bG + bD + bT);
        int32_t *dinv = (int32_t *)(drmap + Ppad);
        MT_CUDA_CHECK(cudaMemcpyAsync(drmap, rmap, bM, cudaMemcpyHostToDevice, cb->stream));
        MT_CUDA_CHECK(cudaMemcpyAsync(dinv, inv, bI, cudaMemcpyHostToDevice, cb->stream));
        MT_CUDA_CHECK(cu_wait(&cb->base)); /* the staging is reused by the next chunk */
        cu_prof_mark(be, "moe_experts FP8 (sort, staging)");

        /* The experts' GEMMs alternate between the backend's stream and the side stream (each with
         * its own workspace), so that small experts' GEMMs run beside each other; the side stream
         * starts after the quantisation and the backend's stream waits for it before h's. */
        const bool side = moe_side_get(cb);
        struct cu_moe_cache *mc = cb->moe;
        st = cu_fp8_quant_rows(cb, XQ, XS, drmap, Ppad, H, x, NULL, H, L);
        for (int mat = 0; mat < 2 && st == MT_OK; mat++) {
            if (mat == 1) {
                cu_prof_mark(be, "moe_experts FP8 (gate/up GEMMs)");
                if ((st = cu_fp8_quant_rows(cb, XQ, XS, drmap, Ppad, I, G, U, npI, L)) != MT_OK) break;
            }
            if (side && (st = moe_side_fork(cb)) != MT_OK) return st;
            for (int e = 0, j = 0; e < E && st == MT_OK; e++) {
                const int m = ps[e + 1] - ps[e];
                if (m == 0) continue;
                const bool on_side = side && (j++ & 1);
                cudaStream_t s = on_side ? mc->side : cb->stream;
                void *ws = on_side ? mc->side_ws : cb->blas_ws;
                uint16_t *tmp = T16 + (size_t)ps[e] * nq; /* gate's then up's, in s's order */
                if (mat == 0) {
                    const uint8_t *xq = XQ + (size_t)ps[e] * kpH;
                    const float *xs = XS + (size_t)ps[e] * (kpH / 128);
                    st = cu_fp8_gemm_q(cb, G + (size_t)ps[e] * npI, xq, xs, m, &t->copy[e].gate, s, ws, tmp);
                    if (st == MT_OK)
                        st = cu_fp8_gemm_q(cb, U + (size_t)ps[e] * npI, xq, xs, m, &t->copy[e].up, s, ws, tmp);
                } else {
                    st = cu_fp8_gemm_q(cb, D + (size_t)ps[e] * npH, XQ + (size_t)ps[e] * kpI,
                                       XS + (size_t)ps[e] * (kpI / 128), m, &t->copy[e].down, s, ws, tmp);
                }
            }
            if (side) { /* joined even after a failure */
                const mt_status js = moe_side_join(cb);
                if (js != MT_OK) return js;
            }
        }
        cu_prof_mark(be, "moe_experts FP8 (down GEMMs)");
        if (st != MT_OK) return st;
        moe_combine_params cp = {out + (int64_t)r0 * H, D, dinv, weights + (int64_t)r0 * top_k, r1 - r0, top_k, H, 1, npH};
        if ((st = moe_combine_launch(&cp, cb->stream)) == MT_OK) *done = r1;
    }
    return st;
}

/* idx [P] read back into the host scratch (*hidx); *mx: its largest entry (each asserted >= 0). */
static mt_status moe_read_idx(cu_backend *cb, const int32_t *idx, int P, int32_t **hidx, int *mx) {
    if (!(*hidx = moe_host_ints(cb->moe, (size_t)P))) return MT_ERR_NOMEM;
    MT_CUDA_(cu_copy_to_host(&cb->base, *hidx, idx, sizeof(int32_t) * (size_t)P), "cudaMemcpyAsync(idx)",
             return mt_st_);
    *mx = -1;
    for (int q = 0; q < P; q++) {
        MT_ASSERT((*hidx)[q] >= 0);
        if ((*hidx)[q] > *mx) *mx = (*hidx)[q];
    }
    return MT_OK;
}

/* cu_moe_experts, with the shared expert as one more slot of the GEMV kernels when `shared` is
 * not NULL (cu_moe_experts_shared has checked that this shape takes the GEMV path). */
static void moe_experts_run(mt_backend *be, float *out, const float *x, const int32_t *idx, const float *weights,
                            const mt_expert *experts, const mt_expert *shared, int n, int top_k, int H, int I,
                            float L) {
    cu_backend *cb = (cu_backend *)be;
    MT_ASSERT(n >= 0 && top_k >= 1 && top_k <= MOE_MAX_TOPK && H > 0 && I > 0);
    if (n == 0) return;
    MT_ASSERT((int64_t)n * top_k <= INT_MAX / 2);
    /* Decode batches of moe_grouped_min_rows..moe_grouped_max_rows rows: grouped on the device
     * (cuda_moe_grouped.cu), each touched expert streamed once at 91-100% of copy bandwidth and
     * no host sync, so the step can be a graph. Fewer rows take the per-(row, slot) GEMV kernels
     * below, which reread an expert that several rows chose but launch 2 kernels instead of 4
     * (the grouped gate/up and down grids also have a block per (tile, expert) of all E experts,
     * most of which exit at once at a few rows). Larger batches (prefill) keep the tensor-core
     * GEMMs, which were faster at 128 rows (3.73 vs 4.36 ms, kernels_cuda_moe_grouped_test on an
     * H200), except in the exact numerics (moe_takes_grouped). */
    if (!shared && moe_takes_grouped(cb, n)) {
        cu_moe_experts_grouped(be, out, x, idx, weights, experts, n, top_k, H, I, L);
        return;
    }
    const int P = n * top_k;
    const bool grouped = n > MOE_GEMV_MAX_ROWS;
    mt_status st = MT_OK;
    if (!cb->moe && !(cb->moe = (struct cu_moe_cache *)calloc(1, sizeof *cb->moe)))
        return cu_op_status(be, "moe_experts", MT_ERR_NOMEM);

    /* How many table entries the indices can reach; read idx back when the router did not say, or
     * for the host-sorted paths (not the wgmma one, which sorts on the device). */
    const bool routed = cb->route_idx == idx && cb->route_len >= P;
    const mt_dtype dt = experts[0].gate.dtype;
    const bool wg = grouped && cu_moe_wg_ok(cb, dt, H, I);
    int32_t *hidx = NULL;
    int need = routed ? cb->route_experts : 0, mx = -1;
    if (!routed || (grouped && !wg)) {
        if ((st = moe_read_idx(cb, idx, P, &hidx, &mx)) != MT_OK) return cu_op_status(be, "moe_experts", st);
        if (!routed) need = mx + 1;
        MT_ASSERT(mx < need);
    }
    const moe_table *t = moe_table_get(cb, experts, need, H, I, &st);
    if (!t) return cu_op_status(be, "moe_experts", st);
    if (wg && moe_wg_ready(cb, t))
        return cu_op_status(be, "moe_experts", moe_experts_wg(be, t, out, x, idx, weights, n, top_k, H, I, L));
    if (grouped && dt == MT_F8E4M3) {
        /* FP8 experts, many rows: cuBLASLt's FP8 GEMMs in the default numerics; the grouped kernels
         * (fp32 activations, any row count) in the exact and fp32 modes and for what cuBLASLt
         * declines */
        int done = 0;
        st = cb->tc_terms == 1 ? moe_experts_fp8_lt(be, t, out, x, hidx, weights, n, top_k, H, I, L, &done)
                               : MT_ERR_UNSUPPORTED;
        if (st != MT_ERR_UNSUPPORTED || done == n) return cu_op_status(be, "moe_experts", st);
        cu_moe_experts_grouped(be, out + (int64_t)done * H, x + (int64_t)done * H, idx + (int64_t)done * top_k,
                               weights + (int64_t)done * top_k, experts, n - done, top_k, H, I, L);
        return;
    }
    if (grouped && !hidx) { /* routed, but the wgmma form declined: the host sort needs idx */
        if ((st = moe_read_idx(cb, idx, P, &hidx, &mx)) != MT_OK) return cu_op_status(be, "moe_experts", st);
        MT_ASSERT(mx < need);
    }

    if (!grouped) {
        const int slots = top_k + (shared != NULL);
        float *h = (float *)cu_scratch(be, CU_SCRATCH_DENSE, sizeof(float) * (size_t)n * slots * I);
        if (!h) return;
        const bool fp8 = dt == MT_F8E4M3;
        const int vn = dt == MT_F32 ? 4 : fp8 ? 16 : 8;
        const bool vec = t->vec_ok && H % vn == 0 && I % vn == 0 && cu_aligned16(x) &&
                         (!shared || (cu_aligned16(shared->gate.data) && cu_aligned16(shared->up.data) &&
                                      cu_aligned16(shared->down.data)));
        moe_gemv_params p = {out, h, x, idx, weights, t->dev, t->count, n, top_k, H, I, L,
                             shared ? shared->gate.data : NULL, shared ? shared->up.data : NULL,
                             shared ? shared->down.data : NULL, slots};
        p.ldgu = fp8 ? cu_fp8_kpad(H) : H;
        p.lddn = fp8 ? cu_fp8_kpad(I) : I;
        if (shared) {
            p.sgs = shared->gate.scale;
            p.sus = shared->up.scale;
            p.sds = shared->down.scale;
        }
        return cu_op_status(be, "moe_experts", moe_gemv_launch(&p, dt, vec, cb->stream));
    }
    MT_ASSERT(!shared);

    /* hidx lives in the host scratch that the chunks also stage into: keep a private copy. */
    int32_t *all = (int32_t *)malloc(sizeof(int32_t) * (size_t)P);
    if (!all) return cu_op_status(be, "moe_experts", MT_ERR_NOMEM);
    memcpy(all, hidx, sizeof(int32_t) * (size_t)P);
    const int T = dt == MT_F32 ? 0 : cb->tc_terms;
    const size_t per_row = (size_t)top_k * moe_pair_bytes(H, I, T);
    const size_t fit = MOE_CHUNK_BYTES / per_row;
    const int rows = fit < 1 ? 1 : fit > (size_t)n ? n : (int)fit;
    for (int r0 = 0; r0 < n && st == MT_OK; r0 += rows) {
        const int r1 = r0 + rows < n ? r0 + rows : n;
        st = moe_grouped_chunk(be, t, out, x, all, weights, r0, r1, top_k, H, I, L, dt, T);
    }
    free(all);
    cu_op_status(be, "moe_experts", st);
}

static void cu_moe_experts(mt_backend *be, float *out, const float *x, const int32_t *idx,
                           const float *weights, const mt_expert *experts, int n, int top_k,
                           int H, int I, float L) {
    moe_experts_run(be, out, x, idx, weights, experts, NULL, n, top_k, H, I, L);
}

/* Few rows (the GEMV path): the shared expert rides as slot top_k of the routed experts' two
 * kernels, so an MoE layer's decode is 2 launches instead of 6 (shared gate, up, swiglu, down on
 * their own: ~30 us of a bench-4L step's layer at 1.5-1.9 TB/s; as a ninth expert it streams at
 * the routed kernels' rate). Its output row starts each row's sum, then the routed slots in
 * order: the CPU's order (out = shared, then += each slot). Declines (false, nothing done) for
 * the grouped and batched paths and for a shared expert not shaped like a routed one. */
static bool cu_moe_experts_shared(mt_backend *be, float *out, const float *x, const int32_t *idx,
                                  const float *weights, const mt_expert *experts, const mt_expert *shared,
                                  int n, int top_k, int H, int I, float L) {
    cu_backend *cb = (cu_backend *)be;
    if (n < 1 || n > MOE_GEMV_MAX_ROWS || top_k + 1 > MOE_DN_MAX_THREADS / 32) return false;
    if (moe_takes_grouped(cb, n)) return false;
    const mt_dtype dt = experts[0].gate.dtype;
    const mt_weight *g = &shared->gate, *u = &shared->up, *d = &shared->down;
    /* a shared expert of another dtype than the routed ones (FP8 beside bf16) runs as matmuls */
    if (g->dtype != dt || u->dtype != dt || d->dtype != dt || !g->data || !u->data || !d->data) return false;
    if (g->rows != I || g->cols != H || u->rows != I || u->cols != H || d->rows != H || d->cols != I) return false;
    moe_experts_run(be, out, x, idx, weights, experts, shared, n, top_k, H, I, L);
    return true;
}

extern "C" void cu_moe_fill(mt_backend_ops *t) {
    t->moe_route = cu_moe_route;
    t->moe_experts = cu_moe_experts;
    t->moe_experts_shared = cu_moe_experts_shared;
    t->moe_keep_experts = cu_moe_keep_experts;
}
