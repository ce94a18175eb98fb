/* kernels/cuda/cuda_ops.h: internal to the CUDA backend: the backend object (cu_backend), the op
 * families' fillers, the helpers the families share, and the device helpers of every kernel file.
 * Each family's files keep their ops static and export a filler for their slots of the table
 * (kernels/backend.h); cuda_backend.cu builds the table from them. Files by family (one
 * cuda_library each in BUILD):
 *   core     cuda_backend.cu   the object, memory, weights, params, the table
 *            cuda_core.cu      launch checks, op timing, PDL launch, scratch, cuBLAS handles
 *            cuda_launch.h     launch and launch-check helpers; cuda_check.h, the check macros
 *   dense    cuda_dense.cu     embed, matmul (GEMV, tensor-core GEMV, cuBLAS and fp32 GEMMs),
 *                              norms, swiglu, sigmoid, l2norm, argmax; kda_gates, hc_head_norm
 *            cuda_gemm16.cu    the 16-bit tensor-core GEMM through cuBLASLt, plans by shape
 *   MoE      cuda_moe.cu       router, experts (GEMV, batched GEMMs); the dispatch
 *            cuda_moe_grouped.cu  decode experts grouped on the device
 *            cuda_moe_wg.cu    prefill experts on wgmma + TMA
 *   KDA      cuda_kda.cu       conv, gate, recurrent delta rule, gated norm
 *            cuda_kda_chunk.cu chunked delta rule (tensor cores)
 *   DSA/MLA  cuda_dsa.cu       pool keys, select, sparse MLA (paged caches)
 *            cuda_dsa_mla_wg.cu  sparse MLA prefill attend on wgmma (2-CTA clusters)
 *            cuda_dsa_mla.h    sparse MLA pass parameters
 *   fp8      cuda_fp8.cu       block-scaled FP8 weights: weight_fp8, their matmul (GEMV and
 *                              cuBLASLt block-scaled GEMM)
 *   hc       cuda_hc.cu        hyper-connections, head mean
 *   PLE      cuda_ple.cu       the PLE memory's injection (gates, value, dilated conv)
 *   rows     cuda_rows.cu      rows-form conv, cache writes, pool keys, row copies (batched decode)
 *            cuda_step.cu      graphs, run-time-position ops (graph form of decode)
 *            cuda_random.cu    random weights
 *   cuda_wgmma.h: sm_90a wgmma/TMA/mbarrier/cluster primitives (MoE, KDA, DSA/MLA)
 * Every launch is followed by a launch check (cuda_launch.h); ops return void per the table, so a
 * failed launch is logged and recorded in the backend's sticky status (cu_backend.sticky). */
#ifndef MT_CUDA_OPS_H
#define MT_CUDA_OPS_H

#include <cuda_runtime_api.h>

#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_launch.h"

#ifdef __cplusplus
extern "C" {
#endif

struct cu_moe_cache; /* cuda_moe.cu: device copies of the host mt_expert tables */
struct cu_fp8_cache; /* cuda_fp8.cu: cuBLASLt plans of the FP8 GEMMs */
struct cu_gemm16_cache; /* cuda_gemm16.cu: cuBLASLt plans of the 16-bit GEMMs */
struct cublasLtContext; /* cublasLtHandle_t */
struct cublasContext; /* cublasHandle_t, without pulling <cublas_v2.h> into every file */

/* A device buffer grown on demand (cu_scratch). */
typedef struct cu_buf {
    void *p;
    size_t bytes;
} cu_buf;

/* Scratch slots: an op uses its slot only between its first and last launch; ops run in stream
 * order, so later ops may reuse the same slot. */
enum { CU_SCRATCH_DENSE, CU_SCRATCH_ATTN, CU_SCRATCH_GEMM, CU_SCRATCH_N };
/* Most weights weights_pack packs into one group (matmul_multi's most). */
enum { CU_PACK_MAX = 6 };
enum { CU_COUNTERS = 16 };
/* Which of cu_backend.counters each last-block-finishes kernel owns: cuda_hc.cu's
 * hc_pre_split_kernel, cuda_dense.cu's argmax_chunk_kernel. */
enum { CU_COUNTER_HC_PRE = 0, CU_COUNTER_ARGMAX = 1 };

/* moe_experts' row classes (cuda_moe.cu): the per-(row, slot) GEMV kernels take at most
 * CU_MOE_GEMV_MAX_ROWS rows; the grouped kernels' default range (mt_cuda_params) starts where they
 * overtake those (5 rows, measured on an H200, cuda_moe.cu) and ends where the GEMMs, which read the
 * routing back and so cannot be captured, are faster but not yet needed (64: decode batches). */
enum { CU_MOE_GEMV_MAX_ROWS = 8, CU_MOE_GROUPED_MIN_ROWS = 5, CU_MOE_GROUPED_MAX_ROWS = 64 };

/* cuBLAS workspace per handle (NVIDIA's recommendation for Hopper: 32 MiB). */
#define CU_BLAS_WS_BYTES ((size_t)32 << 20)

/* The CUDA backend object: mt_backend first. */
typedef struct cu_backend {
    mt_backend base;
    mt_backend_ops ops;        /* the table base.ops points at (cuda_backend.cu, cu_fill) */
    int device;
    cudaStream_t stream;
    mt_status sticky;          /* first failure seen by an op; MT_OK otherwise */
    int n_sm;                  /* multiprocessors of the device, for grid sizing */
    cu_buf scratch[CU_SCRATCH_N];
    uint64_t scratch_epoch;    /* bumped when a scratch buffer is replaced (graph_epoch) */
    /* The last moe_route output, so moe_experts knows its indices are < route_experts without
     * reading them back. Cleared by upload/copy/zero over it and by alloc/free. */
    const int32_t *route_idx;  /* [route_len] device */
    int64_t route_len;
    int route_experts;
    struct cu_moe_cache *moe;  /* owned; NULL until the first moe_experts */
    /* Tensor-core GEMMs (cu_gemm_tc): one cuBLAS handle bound to `stream` with its own
     * workspace, made in mt_cuda_backend_new, destroyed in destroy. */
    struct cublasContext *blas; /* owned cublasHandle_t */
    void *blas_ws;              /* [CU_BLAS_WS_BYTES] device, owned */
    /* FP8 GEMMs (cuda_fp8.cu): a cuBLASLt handle made in mt_cuda_backend_new (it runs on `stream`
     * with blas_ws, which the two share: both only run in the stream's order), and the plans made
     * so far (NULL until the first; cu_fp8_free releases them). */
    struct cublasLtContext *lt; /* owned cublasLtHandle_t */
    struct cu_fp8_cache *fp8;
    struct cu_gemm16_cache *gemm16; /* cu_gemm_tc's plans (NULL until the first; cu_gemm16_free) */
    mt_cuda_params params;      /* as given at creation (cuda_backend.h) */
    int tc_terms;               /* 16-bit parts of x on the tensor cores (params.numerics): 2 (EXACT),
                                   1 (BF16), 0 (FP32: the fp32 kernels only) */
    bool moe_batched;           /* params.moe_batched, until cuBLAS refuses a batched GEMM (cuda_moe.cu) */
    struct cu_prof *prof;       /* op timing (mt_cuda_profile); NULL when off */
    double wait_s;              /* host seconds blocked on the stream (cu_waited; mt_cuda_wait_seconds) */
    /* mt_cuda_gap_seconds: a wait that leaves the stream empty sets drained_at (mt_now()); the
     * next op's mark adds the time since to gap_s, the device's idle time between them */
    double gap_s, drained_at;
    bool drained;
    /* [CU_COUNTERS] device, zeroed at creation: arrival counters of kernels whose last block
     * finishes the op (CU_COUNTER_*); each such kernel returns its counter to 0 before it exits. */
    unsigned *counters;
    /* download_begin's tickets: ticket t lands in slot t % MT_TICKETS of a page-locked ring
     * (MT_TICKET_BYTES a slot) when event tk_done[slot] completes. Made at creation. */
    unsigned char *tk_ring;
    cudaEvent_t tk_done[MT_TICKETS];
    int64_t tk_next;
} cu_backend;

static inline cudaStream_t cu_stream(mt_backend *be) { return ((cu_backend *)be)->stream; }
/* Multiprocessors for grid sizing (132, an H100/H200's, if the device did not say). */
static inline int cu_sms(const cu_backend *cb) { return cb->n_sm > 0 ? cb->n_sm : 132; }
/* cuda_core.cu: device scratch of at least `bytes` in slot `slot` (CU_SCRATCH_*), valid until the
 * op returns. Growing synchronises the stream first (pending kernels may still read the old
 * buffer). NULL on OOM (logged, recorded in sticky). */
void *cu_scratch(mt_backend *be, int slot, size_t bytes);
/* b rounded up to a multiple of a: the offsets of the pieces an op carves from its scratch. */
static inline size_t cu_align_up(size_t b, size_t a) { return (b + a - 1) / a * a; }
/* cuda_moe.cu: frees the expert-table cache (destroy). */
void cu_moe_cache_free(cu_backend *cb);

/* Tiled fp32 GEMM y = x . w^T on a bf16/fp16/fp32 weight, fp32 accumulation (cuda_dense.cu), for
 * many rows (prefill, grouped MoE). Plain mode: tiles == NULL, weight w [N, K]. Grouped mode:
 * tile t covers output rows [m0, m1) (at most CU_GEMM_TM of them) that all use experts[expert]'s
 * matrix mat[z] (0 gate, 1 up, 2 down) for output y[z], z < nmat. Deterministic. */
enum { CU_GEMM_TM = 64 };
typedef struct cu_gemm_tile {
    int32_t expert;
    int32_t m0, m1;
} cu_gemm_tile;
typedef struct cu_gemm_params {
    float *y[2];               /* [M, N] fp32 each; y[1] only with nmat == 2 */
    const float *x;            /* [*, K] fp32 rows */
    const int32_t *gather;     /* [M] device: x row of output row m; NULL: row m */
    const void *w;             /* [N, K] plain mode */
    const mt_expert *experts;  /* device table, grouped mode */
    const cu_gemm_tile *tiles; /* [ntiles] device, grouped mode; NULL: plain */
    int ntiles;
    int mat[2];                /* grouped: which matrix of the expert feeds y[z] */
    int nmat;                  /* 1 or 2 (grouped); 1 in plain mode */
    int64_t M;
    int N, K;
    mt_dtype dtype;            /* of every weight involved */
} cu_gemm_params;
mt_status cu_gemm(const cu_gemm_params *p, cudaStream_t s);

/* Tensor-core GEMM (cuda_dense.cu, cuda_gemm16.cu), for bf16/fp16 weights and many rows:
 *   cu_split16: x rows (gathered: row m reads x[gather[m]]) as `terms` 16-bit parts of dt (MT_BF16
 *     or MT_F16): hi = round(x), lo = round(x - hi), so hi + lo keeps 16 significant bits (bf16;
 *     22 for fp16, which overflows to inf beyond 65504). terms 1: hi only, row m. terms 2: blocked
 *     ([M] hi rows then [M] lo rows) or interleave (hi of m at row 2m, lo at 2m + 1).
 *   cu_gemm_tc (cuda_gemm16.cu): y[M, N] = x16[M, K] . w[N, K]^T + beta * y through cuBLASLt
 *     with plans cached by shape (cublasGemmEx where it has none) on cb's stream; operands of
 *     dtype dt, fp32 accumulation, fp32 y (rows contiguous, stride N).
 * Deterministic for a given shape (one stream, fixed workspace, no atomics). Both return
 * MT_ERR_BACKEND after logging the failing call. */
/* The 16-bit parts x enters weight w's tensor-core products as: cb->tc_terms (2 exact, 1 bf16,
 * 0 no tensor cores), or 2 for the classes mt_cuda_params.exact_classes names in the bf16 mode. */
int cu_tc_terms(const cu_backend *cb, const mt_weight *w);
mt_status cu_split16(void *out /* [terms * M, K] dt */, const float *x /* [*, K] fp32 */,
                     const int32_t *gather /* [M] device or NULL */, int64_t M, int K, mt_dtype dt,
                     int terms, bool interleave, cudaStream_t s);
mt_status cu_gemm_tc(cu_backend *cb, float *y /* [M, N] */, const void *x16 /* [M, K] dt */,
                     const void *w /* [N, K] dt */, mt_dtype dt, int M, int N, int K, float beta);
void cu_gemm16_free(cu_backend *cb);
/* cuda_core.cu: a cuBLAS handle on `stream` with its own CU_BLAS_WS_BYTES workspace (*ws),
 * host pointer mode (cb->blas; cuda_moe.cu's side stream). On failure (logged) whatever was made
 * is left in *blas, *ws for the caller to free. */
mt_status cu_blas_make(struct cublasContext **blas, void **ws, cudaStream_t stream);

/* Block-scaled FP8 weights (cuda_fp8.cu). A weight of dtype F8E4M3 made by weight_fp8 holds
 *   data  [cu_fp8_rpad(rows), cu_fp8_kpad(cols)] e4m3, row-major; the rows past rows and the
 *         columns past cols are zeros;
 *   scale [cu_fp8_rpad(rows) / 128, cu_fp8_kpad(cols) / 128] fp32, row-major: block (i, j)'s
 *         scale_inv at i * (kpad / 128) + j, the blocks of padding 1.
 * Every block is whole, so cuBLASLt never meets a partial block, and its A operand ([K, N]
 * column-major, transposed) has the scale layout CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F
 * takes: column-major over (K blocks, N blocks) with the K blocks contiguous. K padded to 4
 * blocks (512) makes the leading dimension of that scale tensor a multiple of 4 floats without
 * padding between its columns, the one form both readings of that layout agree on (leading
 * dimension ceil(K / 128), or that rounded up to 4 for 16-byte aligned columns). The GLM
 * model's projections have rows in 128s and columns in 512s: the padding costs them nothing. */
static inline int64_t cu_fp8_rpad(int64_t rows) { return (rows + 127) / 128 * 128; }
static inline int64_t cu_fp8_kpad(int64_t cols) { return (cols + 511) / 512 * 512; }
/* y[n, w.rows] = x[n, w.cols] . w^T for an F8E4M3 weight (cu_matmul's F8E4M3 case): rows up to
 * CU_FP8_GEMV_MAX_N, MT_NUMERICS_FP32 and MT_NUMERICS_EXACT take cu_fp8_gemv (fp32 activations:
 * the exact modes keep their promise), the rest cu_fp8_gemm_lt, and cu_fp8_gemv where cuBLASLt
 * offers no algorithm for the shape (logged once per shape). Failures are recorded (sticky). */
enum { CU_FP8_GEMV_MAX_N = 8 };
void cu_fp8_matmul(mt_backend *be, float *y, const float *x, const mt_weight *w, int n);
/* The two paths of cu_fp8_matmul, for tests and benchmarks:
 *   cu_fp8_gemv: the weights dequantised in registers, fp32 activations and sums, any n (runs of
 *     CU_FP8_GEMV_MAX_N rows, each reading the whole weight).
 *   cu_fp8_gemm_lt: x quantised on the device to e4m3 with one fp32 scale per 1 x 128 block of
 *     each row (amax / 448, CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F), the weight with its
 *     128 x 128 blocks (BLK128x128_32F), fp32 accumulation in cuBLASLt, y fp32 (or bf16 widened to
 *     fp32 where cuBLASLt offers no fp32 output). MT_ERR_UNSUPPORTED, having done nothing, when
 *     cuBLASLt has no algorithm for the shape; MT_ERR_BACKEND after logging a failed call. Uses
 *     CU_SCRATCH_GEMM. */
mt_status cu_fp8_gemv(cu_backend *cb, float *y, const float *x, const mt_weight *w, int n);
/* cu_fp8_gemv's kernel: cuda_dense.cu's GEMV (R weight rows a warp share each x load) over an
 * F8E4M3 weight, n <= CU_FP8_GEMV_MAX_N. */
mt_status cu_gemv_f8(cu_backend *cb, float *y, const float *x, const mt_weight *w, int n);
mt_status cu_fp8_gemm_lt(cu_backend *cb, float *y, const float *x, const mt_weight *w, int n);
/* The routed experts' FP8 GEMMs (cuda_moe.cu, moe_experts_fp8_lt), rows grouped by expert:
 *   cu_fp8_quant_rows: rows [nrows] of e4m3 activations q [nrows, kpad(K)] with 1 x 128 block
 *     scales, as cu_fp8_gemm_lt quantises x, laid out in segments: row r belongs to the segment of
 *     rows[r] (rows [base, base + count), one GEMM's B operand), whose scales are the tensor
 *     [kpad(K) / 128, count] (count contiguous) at s + base * kpad(K) / 128. Row r's values: zeros
 *     when rows[r].src < 0; else x[src, 0 .. K) (u NULL; x [*, ldx]), or swiglu(x[r], u[r])
 *     (silu(min(g, L)) * clamp(u, -L, L), cu_swiglu's formula; x, u [nrows, ldx]).
 *   cu_fp8_gemm_q: y [M, rpad(w.rows)] fp32 (that row stride; the padded rows' outputs are zeros)
 *     = x . w^T for x already quantised as above: xq [M, kpad(w.cols)], xs [kpad / 128, M], M a
 *     multiple of 4, every pointer 16-byte aligned, on stream s with ws (CU_BLAS_WS_BYTES, used by
 *     nothing else on another stream meanwhile: cb->blas_ws on cb's stream). Where cuBLASLt offers
 *     no fp32 output for the shape, a bf16 one into tmp ([M, rpad(w.rows)] bf16, not used by
 *     other streams meanwhile) widened into y's first w.rows columns; tmp NULL: fp32 only.
 *     MT_ERR_UNSUPPORTED, having done nothing, where cuBLASLt offers neither; MT_ERR_BACKEND
 *     after logging a failed call. cu_fp8_quant_rows runs on cb's stream. */
typedef struct cu_fp8_row {
    int32_t src;    /* source row of x, or -1: a padding row (zeros) */
    int32_t base;   /* the row's segment: rows [base, base + count) */
    int32_t count;  /* a multiple of 4 */
    int32_t pad;
} cu_fp8_row;
mt_status cu_fp8_quant_rows(cu_backend *cb, uint8_t *q, float *s, const cu_fp8_row *rows, int nrows, int K,
                            const float *x, const float *u, int64_t ldx, float L);
mt_status cu_fp8_gemm_q(cu_backend *cb, float *y, const uint8_t *xq, const float *xs, int M, const mt_weight *w,
                        cudaStream_t s, void *ws, void *tmp);
/* Makes cb->lt (mt_cuda_backend_new); frees the handle and plans (cu_destroy; fine when none). */
mt_status cu_fp8_init(cu_backend *cb);
void cu_fp8_free(cu_backend *cb);

/* The op families' fillers: each sets its file's slots of the table (the ops themselves are static
 * in their files; kernels/backend.h is the one place an op's signature is written). cuda_backend.cu
 * builds a backend's table from its own slots (memory, lifetime) and these. */
void cu_dense_fill(mt_backend_ops *t);      /* cuda_dense.cu: embed, matmul(_multi), norms, swiglu,
                                               sigmoid, l2norm, argmax(_dev), and the fused kda_gates
                                               and hc_head_norm, which run its GEMV and norm kernels */
void cu_moe_fill(mt_backend_ops *t);        /* cuda_moe.cu: moe_route, moe_experts(_shared) */
void cu_kda_fill(mt_backend_ops *t);        /* cuda_kda.cu: conv1d_silu(_l2norm), kda_gate,
                                               kda_recurrent(_rows), gated_rmsnorm */
void cu_kda_chunk_fill(mt_backend_ops *t);  /* cuda_kda_chunk.cu: kda_chunked */
void cu_dsa_fill(mt_backend_ops *t);        /* cuda_dsa.cu: dsa_pool_keys(_at), dsa_select(_rows),
                                               mla_sparse(_rows) */
void cu_fp8_fill(mt_backend_ops *t);        /* cuda_fp8.cu: weight_fp8, weight_fp8_from */
void cu_hc_fill(mt_backend_ops *t);         /* cuda_hc.cu: hc_pre(_norm), hc_post(_pre_norm), hc_head */
void cu_rows_fill(mt_backend_ops *t);       /* cuda_rows.cu: the rows-form conv, cache writes, pool
                                               keys, copy_rows_from, copy_rows_ptr */
void cu_step_fill(mt_backend_ops *t);       /* cuda_step.cu: graphs, embed_dev, copy_rows_at */
void cu_random_fill(mt_backend_ops *t);     /* cuda_random.cu: weight_random */
void cu_ple_fill(mt_backend_ops *t);        /* cuda_ple.cu: ple_inject */

/* cuda_moe.cu: asserts the experts [0, count) share dtype and shape ([I, H] gate/up, [H, I] down)
 * and have their data; used by both MoE paths. */
void cu_moe_check_experts(const mt_expert *ex, int count, int H, int I);

/* cuda_moe_wg.cu: a prefill's expert GEMMs on wgmma (see there). wide: down's tiles of 256 weight
 * rows against at most 128 token rows (mt_cuda_params.moe_wg_wide_down), in the plan, the tile
 * count and the down launch alike.
 *   cu_moe_wg_ok: whether it takes these experts (cb->moe_wg, tensor cores (tc_terms 1 or 2),
 *     bf16, sm_90, H % 128 == 0, I % 64 == 0).
 *   cu_moe_wg_maps: the TMA maps of experts [0, count) (gate, up, down: boxes of 64 rows) into
 *     *dev (device, allocated for cap >= count experts when NULL, else reused: it holds cap * 3
 *     maps); weights 16-byte aligned; synchronises s.
 *   cu_moe_wg_plan: one launch that sorts P (row, slot) pairs (idx [P] device, experts < E <=
 *     CU_MOE_WG_MAX_E, its one block's threads; rows from r0) by expert into gather/inv [P] and
 *     writes both tile lists over x16's terms rows a pair (tgu, tdn: at most cu_moe_wg_max_tiles
 *     tiles of 4 ints, 16-byte aligned) and their lengths ntiles[2], all on the device.
 *   cu_moe_wg_gemm: one persistent launch (a CTA on each of at most sms multiprocessors) over the
 *     *ntiles (device, <= max_tiles) tiles of `tiles` (expert, n0, row0, rows) of x16 [xrows, K]
 *     bf16 (terms 2: pairs' hi/lo parts interleaved; 1: a row a pair); down == false: gate/up
 *     with swiglu, out = h's parts [xrows, ldo = I] bf16 (as x16's); down: out =
 *     [xrows / terms, ldo = H] fp32, each pair's parts summed. */
enum { CU_MOE_WG_MAX_E = 1024 };
bool cu_moe_wg_ok(const cu_backend *cb, mt_dtype dt, int H, int I);
mt_status cu_moe_wg_maps(const mt_expert *ex, int count, int cap, void **dev, cudaStream_t s);
size_t cu_moe_wg_max_tiles(int P, int E, int cols, bool down, bool wide);
mt_status cu_moe_wg_plan(const int32_t *idx, int P, int top_k, int E, int r0, int H, int I, int terms, bool wide,
                         int32_t *gather, int32_t *inv, int32_t *tgu, int32_t *tdn, int32_t *ntiles, cudaStream_t s);
mt_status cu_moe_wg_gemm(const void *wmaps, const int32_t *tiles, const int32_t *ntiles, int max_tiles, const void *x16,
                         int64_t xrows, int K, void *out, int ldo, bool down, bool wide, int terms, float L, int sms,
                         cudaStream_t s);


#ifdef __cplusplus
}
#endif

#ifdef __CUDACC__
/* Device helpers shared by the backend's .cu files (weights as fp32, warp sums). */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

/* Elements of a weight of dtype DT per 16-byte load. */
template <mt_dtype DT> struct cu_wvec { static constexpr int n = DT == MT_F32 ? 4 : DT == MT_F8E4M3 ? 16 : 8; };

/* Element i of weight data w (dtype DT) as fp32. */
template <mt_dtype DT> __device__ __forceinline__ float cu_wget(const void *w, int64_t i) {
    if constexpr (DT == MT_F32) {
        return __ldg((const float *)w + i);
    } else if constexpr (DT == MT_BF16) {
        return __uint_as_float((uint32_t)__ldg((const unsigned short *)w + i) << 16);
    } else {
        return __half2float(__ushort_as_half(__ldg((const unsigned short *)w + i)));
    }
}

/* out[V] = w[i .. i+V) as fp32. V == cu_wvec<DT>::n: one 16-byte load (w + i 16-byte aligned);
 * V == 1: cu_wget; other V: element loads. */
template <mt_dtype DT, int V> __device__ __forceinline__ void cu_wload(const void *w, int64_t i,
                                                                       float (&out)[V]) {
    if constexpr (V == cu_wvec<DT>::n && DT == MT_F32) {
        const float4 v = __ldg((const float4 *)((const float *)w + i));
        out[0] = v.x; out[1] = v.y; out[2] = v.z; out[3] = v.w;
    } else if constexpr (V == cu_wvec<DT>::n) {
        const uint4 u = __ldg((const uint4 *)((const unsigned short *)w + i));
        const uint32_t q[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int j = 0; j < 4; j++) {
            if constexpr (DT == MT_BF16) {
                out[2 * j] = __uint_as_float(q[j] << 16);
                out[2 * j + 1] = __uint_as_float(q[j] & 0xffff0000u);
            } else {
                out[2 * j] = __half2float(__ushort_as_half((unsigned short)(q[j] & 0xffffu)));
                out[2 * j + 1] = __half2float(__ushort_as_half((unsigned short)(q[j] >> 16)));
            }
        }
    } else {
#pragma unroll
        for (int j = 0; j < V; j++) out[j] = cu_wget<DT>(w, i + j);
    }
}

/* out[V] = x[0 .. V) of fp32 activations; V % 4 == 0 uses 16-byte loads (x 16-byte aligned). */
template <int V> __device__ __forceinline__ void cu_xload(const float *x, float (&out)[V]) {
    if constexpr (V % 4 == 0) {
#pragma unroll
        for (int j = 0; j < V; j += 4) {
            const float4 v = *(const float4 *)(x + j);
            out[j] = v.x; out[j + 1] = v.y; out[j + 2] = v.z; out[j + 3] = v.w;
        }
    } else {
#pragma unroll
        for (int j = 0; j < V; j++) out[j] = x[j];
    }
}

/* Whether this block is the last of the grid's `total` blocks to arrive at *count, for a kernel
 * whose last block finishes the op from the others' partial results (each writer fences its
 * writes before calling). Every thread of the block calls it; the last block then sees every
 * block's fenced writes, and returns *count to 0 once it has read what it needs (the counters of
 * cu_backend.counters are 0 between calls). */
static __device__ __forceinline__ bool cu_arrives_last(unsigned *count, unsigned total) {
    __shared__ bool last;
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(count, 1u) == total - 1;
    __syncthreads();
    if (last) __threadfence();
    return last;
}

/* The logistic sigmoid, the CPU's formula (cpu_sigmoidf): every kernel's sigmoid. */
static __device__ __forceinline__ float cu_sigmoidf(float x) { return 1.f / (1.f + expf(-x)); }

template <typename T> __device__ __forceinline__ T cu_warp_sum(T v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* Sum of v over the block (blockDim.x a multiple of 32, <= 1024), returned to every thread.
 * red: __shared__ T[32]. Ends with a barrier, so red may be reused by the next call. */
template <typename T> __device__ __forceinline__ T cu_block_sum(T v, T *red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = cu_warp_sum(v);
    if (lane == 0) red[warp] = v;
    __syncthreads();
    T s = 0;
    for (int w = 0; w < nw; w++) s += red[w]; /* same order in every thread: deterministic */
    __syncthreads();
    return s;
}

/* cp.async of 16 bytes, global to shared, through L2 only (.cg); both ends 16-byte aligned. The
 * copies a thread issued since its last commit form a group; wait<N> returns once at most N of its
 * groups are still in flight (their data then visible to this thread only: a barrier shares it). */
static __device__ __forceinline__ void cu_cp_async16(void *smem, const void *gmem) {
    const uint32_t s = (uint32_t)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
static __device__ __forceinline__ void cu_cp_async_commit(void) {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N> static __device__ __forceinline__ void cu_cp_async_wait(void) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

/* ldmatrix x4 of 16-bit elements: lane l gives the shared-memory address of one 16-byte row (a
 * generic pointer p, or a shared-window address a); the four 8x8 matrices, from lanes 0-7, 8-15, 16-23 and 24-31, land in
 * r[0..3]. The _t form (.trans) hands each thread the transposed pairs. */
static __device__ __forceinline__ void cu_ldsm4(uint32_t *r, uint32_t a) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}
static __device__ __forceinline__ void cu_ldsm4(uint32_t *r, const void *p) {
    cu_ldsm4(r, (uint32_t)__cvta_generic_to_shared(p));
}
static __device__ __forceinline__ void cu_ldsm4_t(uint32_t *r, const void *p) {
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

/* c[16x8] += a[16x16] b[16x8] for one mma.sync m16n8k16 tile, bf16 operands, fp32 accumulators.
 * PTX fragments (lane = 4 g + q): a[0] (row g, k 2q..2q+1), a[1] (row g+8), a[2] (row g, k +8),
 * a[3] (row g+8, k +8); b0 (k 2q..2q+1, column g), b1 (k +8); c[0..1] (row g, columns 2q..2q+1),
 * c[2..3] (row g+8). */
static __device__ __forceinline__ void cu_mma_bf16(float *c, const uint32_t *a, uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* (a, b) as bf16 pairs hi = round(a, b) and lo = round((a, b) - hi), a in the low half (the lower
 * k index of an mma fragment register): the two-part split of the hand-written tensor-core
 * kernels (cuda_dsa.cu, cuda_hc.cu, cuda_kda_chunk.cu). */
static __device__ __forceinline__ void cu_split_bf16x2(float a, float b, uint32_t *hi, uint32_t *lo) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    const float2 hf = __bfloat1622float2(h);
    const __nv_bfloat162 l = __floats2bfloat162_rn(a - hf.x, b - hf.y);
    *hi = *reinterpret_cast<const uint32_t *>(&h);
    *lo = *reinterpret_cast<const uint32_t *>(&l);
}

/* v rounded to the 16-bit type DT (BF16 or F16) and back, and its 16-bit pattern: the two-part
 * split x = hi + lo of the tensor-core GEMM paths (cuda_dense.cu, cuda_moe.cu). */
template <mt_dtype DT> static __device__ __forceinline__ float cu_round16(float v) {
    if constexpr (DT == MT_BF16) return __bfloat162float(__float2bfloat16_rn(v));
    else return __half2float(__float2half_rn(v));
}
template <mt_dtype DT> static __device__ __forceinline__ uint16_t cu_bits16(float v) {
    if constexpr (DT == MT_BF16) return __bfloat16_as_ushort(__float2bfloat16_rn(v));
    else return __half_as_ushort(__float2half_rn(v));
}

/* One weight load of the streaming GEMV kernels (cuda_dense.cu, cuda_moe.cu), kept in registers
 * between its load and its use: VEC, 16 bytes (cu_wvec<DT>::n elements) through the read-only
 * path without allocating in L1 (each weight byte is read once; L1 keeps x, which every warp
 * rereads); else one element. Zero when out of range. */
template <mt_dtype DT, bool VEC> struct cu_wstream;
template <mt_dtype DT> struct cu_wstream<DT, true> {
    static constexpr int V = cu_wvec<DT>::n, W = V; /* W: the elements get_piece gives (all V) */
    uint4 u;
    __device__ __forceinline__ void load(const void *w, int64_t i) {
        const char *a = (const char *)w + i * (DT == MT_F32 ? 4 : 2);
        asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(u.x), "=r"(u.y), "=r"(u.z), "=r"(u.w)
                     : "l"(a));
    }
    __device__ __forceinline__ void zero() { u = make_uint4(0u, 0u, 0u, 0u); }
    __device__ __forceinline__ void get_piece(int, float (&f)[W]) const { get(f); }
    __device__ __forceinline__ void get(float (&f)[V]) const {
        const uint32_t q[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int j = 0; j < 4; j++) {
            if constexpr (DT == MT_F32) {
                f[j] = __uint_as_float(q[j]);
            } else if constexpr (DT == MT_BF16) {
                f[2 * j] = __uint_as_float(q[j] << 16);
                f[2 * j + 1] = __uint_as_float(q[j] & 0xffff0000u);
            } else {
                f[2 * j] = __half2float(__ushort_as_half((unsigned short)(q[j] & 0xffffu)));
                f[2 * j + 1] = __half2float(__ushort_as_half((unsigned short)(q[j] >> 16)));
            }
        }
    }
};
template <mt_dtype DT> struct cu_wstream<DT, false> {
    static constexpr int V = 1, W = 1;
    float v;
    __device__ __forceinline__ void load(const void *w, int64_t i) { v = cu_wget<DT>(w, i); }
    __device__ __forceinline__ void zero() { v = 0.f; }
    __device__ __forceinline__ void get(float (&f)[1]) const { f[0] = v; }
    __device__ __forceinline__ void get_piece(int, float (&f)[1]) const { f[0] = v; }
};

/* e4m3 weights (F8E4M3, the block-scaled layout above): 16 e4m3 codes a 16-byte load (VEC; i a
 * multiple of 16, so all 16 lie in one 128-column block) or one code, each returned as e4m3 times
 * its block's scale *sp in fp32, not rounded (cu_fp8_gemv's product). The load takes the scale's
 * address beside the weights': cu_wstream_at. */
static __device__ __forceinline__ void cu_f8x4_f32(uint32_t q, float s, float *f) {
    const __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(q & 0xffffu), __NV_E4M3);
    const __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(q >> 16), __NV_E4M3);
    const float2 a = __half22float2(*reinterpret_cast<const __half2 *>(&lo));
    const float2 b = __half22float2(*reinterpret_cast<const __half2 *>(&hi));
    f[0] = a.x * s; f[1] = a.y * s; f[2] = b.x * s; f[3] = b.y * s;
}
template <> struct cu_wstream<MT_F8E4M3, true> {
    static constexpr int V = 16, W = 4; /* get_piece: 4 codes at a time */
    uint4 u;
    float s;
    __device__ __forceinline__ void load(const void *w, int64_t i, const float *sp) {
        const char *a = (const char *)w + i;
        asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(u.x), "=r"(u.y), "=r"(u.z), "=r"(u.w)
                     : "l"(a));
        s = __ldg(sp);
    }
    __device__ __forceinline__ void zero() { u = make_uint4(0u, 0u, 0u, 0u); s = 0.f; }
    /* codes 4q .. 4q + 3 */
    __device__ __forceinline__ void get_piece(int q, float (&f)[W]) const {
        cu_f8x4_f32(q == 0 ? u.x : q == 1 ? u.y : q == 2 ? u.z : u.w, s, f);
    }
    __device__ __forceinline__ void get(float (&f)[V]) const {
        cu_f8x4_f32(u.x, s, f);
        cu_f8x4_f32(u.y, s, f + 4);
        cu_f8x4_f32(u.z, s, f + 8);
        cu_f8x4_f32(u.w, s, f + 12);
    }
};
template <> struct cu_wstream<MT_F8E4M3, false> {
    static constexpr int V = 1, W = 1;
    float v;
    __device__ __forceinline__ void load(const void *w, int64_t i, const float *sp) {
        __nv_fp8_e4m3 b;
        b.__x = (__nv_fp8_storage_t)__ldg((const unsigned char *)w + i);
        v = (float)b * __ldg(sp);
    }
    __device__ __forceinline__ void zero() { v = 0.f; }
    __device__ __forceinline__ void get(float (&f)[1]) const { f[0] = v; }
    __device__ __forceinline__ void get_piece(int, float (&f)[1]) const { f[0] = v; }
};

/* Loads a weight's elements from (row, col) on into st: data w with row stride ld (elements); for an
 * F8E4M3 weight also its block scale from s ([rows / 128, ld / 128], cuda_ops.h's layout, ld the
 * padded column count). Float weights ignore s. */
template <mt_dtype DT, bool VEC>
__device__ __forceinline__ void cu_wstream_at(cu_wstream<DT, VEC> &st, const void *w, const float *s, int64_t row,
                                              int64_t ld, int64_t col) {
    if constexpr (DT == MT_F8E4M3) st.load(w, row * ld + col, s + (row >> 7) * (ld >> 7) + (col >> 7));
    else st.load(w, row * ld + col);
}

/* x[0 .. V) through the read-only path (V % 4 == 0: 16-byte loads, x 16-byte aligned). */
template <int V> __device__ __forceinline__ void cu_xload_ro(const float *x, float (&out)[V]) {
    if constexpr (V % 4 == 0) {
#pragma unroll
        for (int j = 0; j < V; j += 4) {
            const float4 v = __ldg((const float4 *)(x + j));
            out[j] = v.x; out[j + 1] = v.y; out[j + 2] = v.z; out[j + 3] = v.w;
        }
    } else {
#pragma unroll
        for (int j = 0; j < V; j++) out[j] = __ldg(x + j);
    }
}

/* The KDA decay gate of one element (docs/MODEL.md "KDA mixer"): f the projection, bias its dt_bias,
 * a_log its head's A_log. kda_gate_kernel (cuda_kda.cu) and the short-row GEMV's epilogue
 * (cu_kda_gates, cuda_dense.cu) both take it from here. */
static __device__ __forceinline__ float cu_kda_gate_value(float f, float bias, float a_log, bool has_lower_bound,
                                                          float lower_bound) {
    const float a = expf(a_log), x = f + bias;
    return has_lower_bound ? lower_bound * cu_sigmoidf(a * x) : -a * (x > 20.f ? x : log1pf(expf(x)));
}

static inline __host__ __device__ bool cu_aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

/* Pool key `pool`, channel d (docs/MODEL.md, the DSA indexer): the softmax over the pool's kpool members
 * of gs + ape, weighting their ki, in cpu_dsa.c's order, written through bt. The members are
 * consecutive rows of one page (page is a multiple of kpool). dsa_pool_keys_kernel (cuda_dsa.cu)
 * and pool_keys_rows_kernel (cuda_rows.cu) both run it. */
static __device__ __forceinline__ void cu_pool_key(mt_paged pool_keys, mt_paged ki, mt_paged gs, const int32_t *bt,
                                                   const float *ape, int pool, int d, int kpool) {
    const int64_t id = ki.row, t0 = (int64_t)pool * kpool;
    const float *g = mt_paged_at(gs, bt, t0) + d, *k = mt_paged_at(ki, bt, t0) + d, *a = ape + d;
    float m = -INFINITY, sum = 0.f, acc = 0.f;
    for (int j = 0; j < kpool; j++) {
        const float v = g[j * id] + a[j * id];
        if (v > m) m = v;
    }
    for (int j = 0; j < kpool; j++) sum += expf(g[j * id] + a[j * id] - m);
    for (int j = 0; j < kpool; j++) acc += expf(g[j * id] + a[j * id] - m) / sum * k[j * id];
    mt_paged_at(pool_keys, bt, pool)[d] = acc;
}

/* This block's share of dst[0, row) = src: threads strided over the grid's x, float4 accesses when
 * vec4 (row % 4 == 0, both 16-byte aligned). The paged cache writes (copy_rows_at, copy_rows_to). */
static __device__ __forceinline__ void cu_copy_row_x(float *dst, const float *src, int64_t row, bool vec4) {
    const int64_t stride = (int64_t)gridDim.x * blockDim.x, e0 = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (vec4) {
        for (int64_t e = e0; e < row / 4; e += stride) ((float4 *)dst)[e] = ((const float4 *)src)[e];
    } else {
        for (int64_t e = e0; e < row; e += stride) dst[e] = src[e];
    }
}
#endif /* __CUDACC__ */

/* cuda_moe_grouped.cu: moe_experts (same contract as cu_moe_experts) grouped by expert on the
 * device: no host synchronisation and no allocation once warm (graph-capturable), for decode-sized
 * batches (8 < n <= 256). The first call for an experts array builds its device table and may
 * synchronise; a call captured before any eager call fails (logged). Details in the file.
 * cu_moe_grouped_free releases cb's tables (for cu_destroy; fine for a backend without any). */
#ifdef __cplusplus
extern "C" {
#endif
void cu_moe_experts_grouped(mt_backend *be, float *out, const float *x, const int32_t *idx,
                            const float *weights, const mt_expert *experts, int n, int top_k, int H,
                            int I, float L);
void cu_moe_grouped_free(cu_backend *cb);
#ifdef __cplusplus
}
#endif
#endif /* MT_CUDA_OPS_H */
