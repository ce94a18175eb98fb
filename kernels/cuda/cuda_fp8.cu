/* kernels/cuda/cuda_fp8.cu: block-scaled FP8 weights (cuda_ops.h, "Block-scaled FP8 weights"):
 * weight_fp8 keeps a checkpoint's e4m3 weight and its 128 x 128 block scales on the device
 * (weight_fp8_from makes one from a float weight on the device, for benchmarks), and
 * cu_fp8_matmul multiplies by it: decode-sized row counts on the dense GEMV (cuda_dense.cu),
 * which dequantises the weight in registers (half the bytes of bf16, fp32 activations), prefill
 * on Hopper's FP8 tensor cores through cuBLASLt's block scaling (activations quantised here to e4m3 per 1 x 128 block). For the
 * routed experts' prefill (cuda_moe.cu) it quantises rows grouped by expert into per-expert
 * segments (cu_fp8_quant_rows) and runs a GEMM on an already quantised segment (cu_fp8_gemm_q). */
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_lt.h"
#include "kernels/cuda/cuda_ops.h"

enum {
    FP8_BLK = 128,           /* block edge of the weight scales and of the activation scales */
    FP8_Q_THREADS = 256,     /* 8 warps: a warp per (row, 128-block) of the activations */
    FP8_WIDEN_THREADS = 256,
    FP8_PLANS = 256,         /* cached cuBLASLt plans (shape, output type): a model's projections at
                                a few row counts, and the routed experts' padded row classes */
};

/* The largest finite e4m3 value: an activation block's amax maps to it. */
#define FP8_E4M3_MAX 448.0f

/* ================================ weight_fp8 ================================ */

/* out: the rows x cols weight whose padded e4m3 data (dq) and block scales (ds) are on the device,
 * owned by it. */
static void fp8_weight_set(mt_weight *out, void *dq, void *ds, int64_t rows, int64_t cols) {
    out->data = dq;
    out->dtype = MT_F8E4M3;
    out->rows = rows;
    out->cols = cols;
    out->owned = true;
    out->cls = MT_WCLS_OTHER;
    out->row0 = 0;
    out->scale = (const float *)ds;
}

static mt_status cu_weight_fp8(mt_backend *be, const uint8_t *q, const float *scale_inv, int64_t rows, int64_t cols,
                               mt_weight *out) {
    cu_backend *cb = (cu_backend *)be;
    MT_ASSERT(rows >= 0 && cols >= 0 && (q || rows * cols == 0) && scale_inv);
    const int64_t np = cu_fp8_rpad(rows), kp = cu_fp8_kpad(cols), sld = kp / FP8_BLK;
    const int64_t rblk = (rows + FP8_BLK - 1) / FP8_BLK, cblk = (cols + FP8_BLK - 1) / FP8_BLK;
    const size_t qbytes = (size_t)np * (size_t)kp, sbytes = sizeof(float) * (size_t)(np / FP8_BLK) * (size_t)sld;
    mt_status st = MT_ERR_NOMEM;
    void *dq = NULL, *ds = NULL;
    /* the padded layout is built on the host: one upload each, no device kernel at load */
    uint8_t *hq = (uint8_t *)calloc(qbytes ? qbytes : 1, 1);
    float *hs = (float *)malloc(sbytes ? sbytes : sizeof(float));
    if (!hq || !hs) goto fail;
    for (int64_t i = 0; i < rows; i++) memcpy(hq + (size_t)i * kp, q + (size_t)i * cols, (size_t)cols);
    for (size_t i = 0; i < sbytes / sizeof(float); i++) hs[i] = 1.f;
    for (int64_t b = 0; b < rblk; b++) memcpy(hs + (size_t)b * sld, scale_inv + (size_t)b * cblk, sizeof(float) * cblk);
    if (cudaMalloc(&dq, qbytes ? qbytes : 1) != cudaSuccess || cudaMalloc(&ds, sbytes ? sbytes : 1) != cudaSuccess) {
        (void)cudaGetLastError();
        mt_log(MT_LOG_ERROR, "cuda backend: out of device memory for a %lld x %lld F8_E4M3 weight", (long long)rows,
               (long long)cols);
        goto fail;
    }
    if (qbytes) MT_CUDA_CHECK_GOTO(cudaMemcpyAsync(dq, hq, qbytes, cudaMemcpyHostToDevice, cb->stream), st, fail);
    if (sbytes) MT_CUDA_CHECK_GOTO(cudaMemcpyAsync(ds, hs, sbytes, cudaMemcpyHostToDevice, cb->stream), st, fail);
    MT_CUDA_CHECK_GOTO(cu_wait(&cb->base), st, fail);
    free(hq);
    free(hs);
    fp8_weight_set(out, dq, ds, rows, cols);
    return MT_OK;
fail:
    if (dq) MT_CUDA_WARN(cudaFree(dq));
    if (ds) MT_CUDA_WARN(cudaFree(ds));
    free(hq);
    free(hs);
    return st;
}

/* ================================ weight_fp8_from ================================ */

typedef struct fp8_from_params {
    uint8_t *q;          /* [rpad(rows), kp] e4m3 */
    float *s;            /* [rpad(rows) / 128, kp / 128] fp32 */
    const void *w;       /* [rows, cols] of the source dtype */
    int64_t rows, cols;
    int kp;
} fp8_from_params;

/* A block of FP8_Q_THREADS per 128 x 128 block (blockIdx.y, blockIdx.x) of the padded weight:
 * its amax over the real elements, scale = amax / 448 (1 for none or zeros), then every element
 * of the block, padding as zeros, rounded to nearest even e4m3 (saturating). */
template <mt_dtype DT> static __global__ void __launch_bounds__(FP8_Q_THREADS) fp8_from_kernel(const fp8_from_params p) {
    __shared__ float red[FP8_Q_THREADS / 32];
    const int64_t r0 = (int64_t)blockIdx.y * FP8_BLK, c0 = (int64_t)blockIdx.x * FP8_BLK;
    float amax = 0.f;
    for (int e = threadIdx.x; e < FP8_BLK * FP8_BLK; e += FP8_Q_THREADS) {
        const int64_t r = r0 + e / FP8_BLK, c = c0 + e % FP8_BLK;
        if (r < p.rows && c < p.cols) amax = fmaxf(amax, fabsf(cu_wget<DT>(p.w, r * p.cols + c)));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = amax;
    __syncthreads();
    amax = 0.f;
#pragma unroll
    for (int i = 0; i < FP8_Q_THREADS / 32; i++) amax = fmaxf(amax, red[i]);
    const float sc = amax > 0.f ? amax / FP8_E4M3_MAX : 1.f;
    for (int e = threadIdx.x; e < FP8_BLK * FP8_BLK; e += FP8_Q_THREADS) {
        const int64_t r = r0 + e / FP8_BLK, c = c0 + e % FP8_BLK;
        const float v = r < p.rows && c < p.cols ? cu_wget<DT>(p.w, r * p.cols + c) : 0.f;
        p.q[r * p.kp + c] = (uint8_t)__nv_cvt_float_to_fp8(v / sc, __NV_SATFINITE, __NV_E4M3);
    }
    if (threadIdx.x == 0) p.s[(int64_t)blockIdx.y * (p.kp / FP8_BLK) + blockIdx.x] = sc;
}

static mt_status cu_weight_fp8_from(mt_backend *be, const mt_weight *src, mt_weight *out) {
    cu_backend *cb = (cu_backend *)be;
    MT_ASSERT(src->dtype == MT_F32 || src->dtype == MT_F16 || src->dtype == MT_BF16);
    const int64_t rows = src->rows, cols = src->cols, np = cu_fp8_rpad(rows), kp = cu_fp8_kpad(cols);
    MT_ASSERT(rows >= 0 && cols >= 0 && np / FP8_BLK <= 65535 && kp <= INT32_MAX);
    const size_t qbytes = (size_t)np * (size_t)kp, sbytes = sizeof(float) * (size_t)(np / FP8_BLK) * (size_t)(kp / FP8_BLK);
    void *dq = NULL, *ds = NULL;
    if (cudaMalloc(&dq, qbytes ? qbytes : 1) != cudaSuccess || cudaMalloc(&ds, sbytes ? sbytes : 1) != cudaSuccess) {
        (void)cudaGetLastError();
        if (dq) MT_CUDA_WARN(cudaFree(dq));
        mt_log(MT_LOG_ERROR, "cuda backend: out of device memory for a %lld x %lld F8_E4M3 weight", (long long)rows,
               (long long)cols);
        return MT_ERR_NOMEM;
    }
    mt_status st = MT_OK;
    if (qbytes) {
        fp8_from_params p = {(uint8_t *)dq, (float *)ds, src->data, rows, cols, (int)kp};
        const dim3 grid((unsigned)(kp / FP8_BLK), (unsigned)(np / FP8_BLK));
        if (src->dtype == MT_BF16) fp8_from_kernel<MT_BF16><<<grid, FP8_Q_THREADS, 0, cb->stream>>>(p);
        else if (src->dtype == MT_F16) fp8_from_kernel<MT_F16><<<grid, FP8_Q_THREADS, 0, cb->stream>>>(p);
        else fp8_from_kernel<MT_F32><<<grid, FP8_Q_THREADS, 0, cb->stream>>>(p);
        MT_CUDA_CHECK_GOTO(cudaGetLastError(), st, fail);
        MT_CUDA_CHECK_GOTO(cu_wait(&cb->base), st, fail);
    }
    fp8_weight_set(out, dq, ds, rows, cols);
    return MT_OK;
fail:
    MT_CUDA_WARN(cudaFree(dq));
    MT_CUDA_WARN(cudaFree(ds));
    return st;
}

/* ================================ GEMV (few rows) ================================ */

/* Runs of CU_FP8_GEMV_MAX_N rows on the dense GEMV (cu_gemv_f8), each reading the whole weight. */
extern "C" mt_status cu_fp8_gemv(cu_backend *cb, float *y, const float *x, const mt_weight *w, int n) {
    MT_ASSERT(w->dtype == MT_F8E4M3 && w->scale && n >= 0);
    MT_ASSERT(w->rows <= INT32_MAX && cu_fp8_kpad(w->cols) <= INT32_MAX);
    for (int m0 = 0; m0 < n; m0 += CU_FP8_GEMV_MAX_N) {
        const int k = n - m0 < CU_FP8_GEMV_MAX_N ? n - m0 : CU_FP8_GEMV_MAX_N;
        const mt_status st = cu_gemv_f8(cb, y + (int64_t)m0 * w->rows, x + (int64_t)m0 * w->cols, w, k);
        if (st != MT_OK) return st;
    }
    return MT_OK;
}

/* ================================ activations to e4m3 ================================ */

typedef struct fp8_quant_params {
    uint8_t *q;          /* [M, kp] e4m3; rows >= n and columns >= K are zeros */
    float *s;            /* [kp / 128, M] fp32: the scale of row m's block kb at kb * M + m */
    const float *x;      /* [n, K] fp32 */
    int n, M, K, kp;
} fp8_quant_params;

/* One 128-value block held by a warp, 4 values a lane: the block's amax over the warp, scale =
 * amax / 448 (1 for a block of zeros), and the lane's values x / scale rounded to nearest even
 * e4m3, saturating at 448 (the division may round a hair above it), packed into *packed. Returns
 * the scale. */
static __device__ __forceinline__ float fp8_quant_block(const float v[4], uint32_t *packed) {
    float amax = 0.f;
#pragma unroll
    for (int j = 0; j < 4; j++) amax = fmaxf(amax, fabsf(v[j]));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float sc = amax > 0.f ? amax / FP8_E4M3_MAX : 1.f;
    uint32_t q = 0;
#pragma unroll
    for (int j = 0; j < 4; j++) q |= (uint32_t)__nv_cvt_float_to_fp8(v[j] / sc, __NV_SATFINITE, __NV_E4M3) << (8 * j);
    *packed = q;
    return sc;
}

/* A warp per (row m, block kb): its 128 values (4 a lane), quantised by fp8_quant_block. */
static __global__ void __launch_bounds__(FP8_Q_THREADS) fp8_quant_kernel(const fp8_quant_params p) {
    const int lane = threadIdx.x & 31, kbs = p.kp / FP8_BLK;
    const int64_t g = (int64_t)blockIdx.x * (FP8_Q_THREADS / 32) + (threadIdx.x >> 5);
    if (g >= (int64_t)p.M * kbs) return;
    const int m = (int)(g / kbs), kb = (int)(g % kbs), k = kb * FP8_BLK + lane * 4;
    float v[4];
#pragma unroll
    for (int j = 0; j < 4; j++) v[j] = m < p.n && k + j < p.K ? p.x[(int64_t)m * p.K + k + j] : 0.f;
    uint32_t packed;
    const float sc = fp8_quant_block(v, &packed);
    *(uint32_t *)(p.q + (int64_t)m * p.kp + k) = packed;
    if (lane == 0) p.s[(int64_t)kb * p.M + m] = sc;
}

/* cu_fp8_quant_rows: fp8_quant_kernel's quantisation over a row map (cuda_ops.h, cu_fp8_row). */
typedef struct fp8_qrows_params {
    uint8_t *q;              /* [nrows, kp] e4m3 */
    float *s;                /* segment scales: row r of segment (base, count) block kb at
                                base * kp / 128 + kb * count + r - base */
    const cu_fp8_row *rows;  /* [nrows] */
    const float *x, *u;      /* u NULL: x [*, ldx] read at row src; else x, u [nrows, ldx] read at row r */
    int64_t ldx;
    int nrows, K, kp;
    float L;                 /* swiglu clamp (u set) */
} fp8_qrows_params;

static __global__ void __launch_bounds__(FP8_Q_THREADS) fp8_qrows_kernel(const fp8_qrows_params p) {
    const int lane = threadIdx.x & 31, kbs = p.kp / FP8_BLK;
    const int64_t g = (int64_t)blockIdx.x * (FP8_Q_THREADS / 32) + (threadIdx.x >> 5);
    if (g >= (int64_t)p.nrows * kbs) return;
    const int r = (int)(g / kbs), kb = (int)(g % kbs), k = kb * FP8_BLK + lane * 4;
    const cu_fp8_row ri = p.rows[r];
    float v[4];
#pragma unroll
    for (int j = 0; j < 4; j++) {
        float a = 0.f;
        if (ri.src >= 0 && k + j < p.K) {
            if (!p.u) {
                a = p.x[(int64_t)ri.src * p.ldx + k + j];
            } else {
                const float gv = fminf(p.x[(int64_t)r * p.ldx + k + j], p.L);
                const float uv = fminf(fmaxf(p.u[(int64_t)r * p.ldx + k + j], -p.L), p.L);
                a = gv / (1.f + expf(-gv)) * uv; /* cu_swiglu's formula */
            }
        }
        v[j] = a;
    }
    uint32_t packed;
    const float sc = fp8_quant_block(v, &packed);
    *(uint32_t *)(p.q + (int64_t)r * p.kp + k) = packed;
    if (lane == 0) p.s[(int64_t)ri.base * kbs + (int64_t)kb * ri.count + (r - ri.base)] = sc;
}

/* y[n, N] (row stride ldy) = fp32 of the first N columns of the bf16 d[n, ld] (the bf16-output form
 * of the GEMM). */
static __global__ void fp8_widen_kernel(float *y, int64_t ldy, const __nv_bfloat16 *d, int64_t n, int N, int ld) {
    const int64_t count = n * N;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += (int64_t)gridDim.x * blockDim.x)
        y[i / N * ldy + i % N] = __bfloat162float(d[i / N * ld + i % N]);
}

/* ================================ cuBLASLt plans ================================ */

/* One GEMM shape's descriptors and algorithm. cuBLASLt is column-major: row-major y[M, N] is
 * column-major D [N, M] (ld N); the weight, row-major [N, kp], is column-major [kp, N] (ld kp) and
 * enters transposed (op(A) = A^T, [N, K]); the activations, row-major [M, kp], are column-major
 * [kp, M] (ld kp), not transposed. So D = A^T B with TRANSA = T, TRANSB = N: the "TN" form, the
 * only one Hopper's FP8 GEMMs take. The scale modes go with the operands: A (the weight) 128 x 128
 * blocks, its scales column-major over (K blocks, N blocks), ld kp / 128 (cuda_ops.h); B (the
 * activations) 1 x 128 along K, its scale tensor [kp / 128, M] column-major with the outer
 * dimension M contiguous (ld M, M a multiple of 4 here: see cu_fp8_gemm_lt). N of the plan is the
 * weight's padded row count. */
typedef struct fp8_plan {
    int M, N, K;
    cudaDataType_t d;          /* CUDA_R_32F or CUDA_R_16BF */
    bool ok;                   /* cuBLASLt offered an algorithm */
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t la, lb, ld;
    cublasLtMatmulAlgo_t algo;
} fp8_plan;

struct cu_fp8_cache {
    fp8_plan plan[FP8_PLANS];
    int n;
};

static void plan_release(fp8_plan *p) {
    if (p->op) MT_CUBLAS_WARN(cublasLtMatmulDescDestroy(p->op));
    if (p->la) MT_CUBLAS_WARN(cublasLtMatrixLayoutDestroy(p->la));
    if (p->lb) MT_CUBLAS_WARN(cublasLtMatrixLayoutDestroy(p->lb));
    if (p->ld) MT_CUBLAS_WARN(cublasLtMatrixLayoutDestroy(p->ld));
    memset(p, 0, sizeof *p);
}

/* The descriptors of p (its key set), and whether cuBLASLt has an algorithm for them: p->ok.
 * MT_OK with p->ok false is "no algorithm" (NOT_SUPPORTED from the heuristic, or none returned);
 * a failure to make a descriptor is MT_ERR_BACKEND, logged. Scale pointers are set per call. */
static mt_status plan_make(cu_backend *cb, fp8_plan *p, const void *ascale, const void *bscale) {
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    const int32_t amode = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F, bmode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    MT_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    MT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    MT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    MT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &amode, sizeof amode));
    MT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &bmode, sizeof bmode));
    MT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &ascale, sizeof ascale));
    MT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &bscale, sizeof bscale));
    MT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->la, CUDA_R_8F_E4M3, p->K, p->N, p->K));
    MT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->lb, CUDA_R_8F_E4M3, p->K, p->M, p->K));
    MT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->ld, p->d, p->N, p->M, p->N));
    return cu_lt_algo(cb, p->op, p->la, p->lb, p->ld, NULL, &p->algo, &p->ok);
}

/* The plan of (M, N, K, d), made on first use; NULL (logged) when it cannot be made. A full cache
 * starts over (shapes are few: a model's projections at a few row counts). */
static fp8_plan *plan_get(cu_backend *cb, int M, int N, int K, cudaDataType_t d, const void *ascale,
                          const void *bscale) {
    if (!cb->fp8 && !(cb->fp8 = (struct cu_fp8_cache *)calloc(1, sizeof *cb->fp8))) return NULL;
    struct cu_fp8_cache *c = cb->fp8;
    for (int i = 0; i < c->n; i++) {
        fp8_plan *p = &c->plan[i];
        if (p->M == M && p->N == N && p->K == K && p->d == d) return p;
    }
    if (c->n == FP8_PLANS) {
        for (int i = 0; i < c->n; i++) plan_release(&c->plan[i]);
        c->n = 0;
    }
    fp8_plan *p = &c->plan[c->n];
    memset(p, 0, sizeof *p);
    p->M = M;
    p->N = N;
    p->K = K;
    p->d = d;
    if (plan_make(cb, p, ascale, bscale) != MT_OK) {
        plan_release(p);
        return NULL;
    }
    if (!p->ok)
        mt_log(MT_LOG_WARN, "cuda backend: cuBLASLt has no block-scaled FP8 GEMM for M %d, N %d, K %d with %s output",
               M, N, K, d == CUDA_R_32F ? "fp32" : "bf16");
    c->n++;
    return p;
}

extern "C" mt_status cu_fp8_init(cu_backend *cb) {
    cublasLtHandle_t h = NULL;
    MT_CUBLAS_CHECK(cublasLtCreate(&h));
    cb->lt = (struct cublasLtContext *)h;
    return MT_OK;
}

extern "C" void cu_fp8_free(cu_backend *cb) {
    if (cb->fp8) {
        for (int i = 0; i < cb->fp8->n; i++) plan_release(&cb->fp8->plan[i]);
        free(cb->fp8);
        cb->fp8 = NULL;
    }
    if (cb->lt) MT_CUBLAS_WARN(cublasLtDestroy((cublasLtHandle_t)cb->lt));
    cb->lt = NULL;
}

/* ================================ the GEMM ================================ */

/* The GEMM runs over the weight's padded rows, np = rpad(N), and M = n rounded up to a multiple
 * of 4 rows: the activation scales' leading dimension is M, and a multiple of 4 keeps their
 * columns 16-byte aligned (the same two readings of the layout as the weight's agree there). The
 * extra rows of x are zeros. When np > N or M > n the GEMM writes a scratch [M, np] and y takes
 * its first n rows' first N columns. */
extern "C" mt_status cu_fp8_gemm_lt(cu_backend *cb, float *y, const float *x, const mt_weight *w, int n) {
    MT_ASSERT(w->dtype == MT_F8E4M3 && w->scale && n >= 0);
    MT_ASSERT(cu_fp8_rpad(w->rows) <= INT32_MAX && cu_fp8_kpad(w->cols) <= INT32_MAX);
    if (n == 0 || w->rows == 0) return MT_OK;
    if (!cb->lt) return MT_ERR_UNSUPPORTED;
    const int N = (int)w->rows, K = (int)w->cols, np = (int)cu_fp8_rpad(w->rows), kp = (int)cu_fp8_kpad(w->cols);
    const int M = (n + 3) / 4 * 4;
    const size_t qb = cu_align_up((size_t)M * kp, 256), sb = cu_align_up(sizeof(float) * (size_t)(kp / FP8_BLK) * M, 256);
    const size_t db = sizeof(float) * (size_t)M * np;
    char *buf = (char *)cu_scratch(&cb->base, CU_SCRATCH_GEMM, qb + sb + db);
    if (!buf) return MT_ERR_NOMEM; /* logged */
    uint8_t *xq = (uint8_t *)buf;
    float *xs = (float *)(buf + qb);
    void *dtmp = buf + qb + sb;

    fp8_plan *p = plan_get(cb, M, np, kp, CUDA_R_32F, w->scale, xs);
    if (p && !p->ok) p = plan_get(cb, M, np, kp, CUDA_R_16BF, w->scale, xs);
    if (!p) return MT_ERR_BACKEND;
    if (!p->ok) return MT_ERR_UNSUPPORTED;

    fp8_quant_params qp = {xq, xs, x, n, M, K, kp};
    const int64_t warps = (int64_t)M * (kp / FP8_BLK);
    fp8_quant_kernel<<<(unsigned)((warps + FP8_Q_THREADS / 32 - 1) / (FP8_Q_THREADS / 32)), FP8_Q_THREADS, 0,
                       cb->stream>>>(qp);
    MT_CUDA_CHECK_LAUNCH();

    const void *as = w->scale, *bs = xs;
    MT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &as, sizeof as));
    MT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &bs, sizeof bs));
    const bool direct = p->d == CUDA_R_32F && M == n && np == N;
    void *d = direct ? (void *)y : dtmp;
    const float one = 1.f, zero = 0.f;
    MT_CUBLAS_CHECK(cublasLtMatmul((cublasLtHandle_t)cb->lt, p->op, &one, w->data, p->la, xq, p->lb, &zero, d, p->ld, d,
                                   p->ld, &p->algo, cb->blas_ws, CU_BLAS_WS_BYTES, cb->stream));
    if (direct) return MT_OK;
    if (p->d == CUDA_R_32F) {
        MT_CUDA_CHECK(cudaMemcpy2DAsync(y, sizeof(float) * (size_t)N, dtmp, sizeof(float) * (size_t)np,
                                        sizeof(float) * (size_t)N, (size_t)n, cudaMemcpyDeviceToDevice, cb->stream));
        return MT_OK;
    }
    const int64_t want = ((int64_t)n * N + FP8_WIDEN_THREADS - 1) / FP8_WIDEN_THREADS;
    fp8_widen_kernel<<<(unsigned)(want < 4096 ? want : 4096), FP8_WIDEN_THREADS, 0, cb->stream>>>(
        y, N, (const __nv_bfloat16 *)dtmp, n, N, np);
    MT_CUDA_CHECK_LAUNCH();
    return MT_OK;
}

extern "C" mt_status cu_fp8_quant_rows(cu_backend *cb, uint8_t *q, float *s, const cu_fp8_row *rows, int nrows, int K,
                                      const float *x, const float *u, int64_t ldx, float L) {
    MT_ASSERT(nrows >= 0 && K >= 0 && cu_fp8_kpad(K) <= INT32_MAX);
    const int kp = (int)cu_fp8_kpad(K);
    if (nrows == 0 || kp == 0) return MT_OK;
    const fp8_qrows_params p = {q, s, rows, x, u, ldx, nrows, K, kp, L};
    const int64_t warps = (int64_t)nrows * (kp / FP8_BLK);
    fp8_qrows_kernel<<<(unsigned)((warps + FP8_Q_THREADS / 32 - 1) / (FP8_Q_THREADS / 32)), FP8_Q_THREADS, 0,
                       cb->stream>>>(p);
    MT_CUDA_CHECK_LAUNCH();
    return MT_OK;
}

extern "C" mt_status cu_fp8_gemm_q(cu_backend *cb, float *y, const uint8_t *xq, const float *xs, int M,
                                   const mt_weight *w, cudaStream_t s, void *ws, void *tmp) {
    MT_ASSERT(w->dtype == MT_F8E4M3 && w->scale && M >= 0 && M % 4 == 0);
    MT_ASSERT(cu_fp8_rpad(w->rows) <= INT32_MAX && cu_fp8_kpad(w->cols) <= INT32_MAX);
    MT_ASSERT(cu_aligned16(y) && cu_aligned16(xq) && cu_aligned16(xs) && cu_aligned16(tmp));
    if (M == 0 || w->rows == 0) return MT_OK;
    if (!cb->lt) return MT_ERR_UNSUPPORTED;
    const int N = (int)w->rows, np = (int)cu_fp8_rpad(w->rows), kp = (int)cu_fp8_kpad(w->cols);
    fp8_plan *p = plan_get(cb, M, np, kp, CUDA_R_32F, w->scale, xs);
    if (p && !p->ok && tmp) p = plan_get(cb, M, np, kp, CUDA_R_16BF, w->scale, xs);
    if (!p) return MT_ERR_BACKEND;
    if (!p->ok) return MT_ERR_UNSUPPORTED;
    const void *as = w->scale, *bs = xs;
    MT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &as, sizeof as));
    MT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &bs, sizeof bs));
    const float one = 1.f, zero = 0.f;
    void *d = p->d == CUDA_R_32F ? (void *)y : tmp;
    MT_CUBLAS_CHECK(cublasLtMatmul((cublasLtHandle_t)cb->lt, p->op, &one, w->data, p->la, xq, p->lb, &zero, d, p->ld, d,
                                   p->ld, &p->algo, ws, CU_BLAS_WS_BYTES, s));
    if (p->d == CUDA_R_32F) return MT_OK;
    const int64_t want = ((int64_t)M * N + FP8_WIDEN_THREADS - 1) / FP8_WIDEN_THREADS;
    fp8_widen_kernel<<<(unsigned)(want < 4096 ? want : 4096), FP8_WIDEN_THREADS, 0, s>>>(
        y, np, (const __nv_bfloat16 *)tmp, M, N, np);
    MT_CUDA_CHECK_LAUNCH();
    return MT_OK;
}

extern "C" void cu_fp8_matmul(mt_backend *be, float *y, const float *x, const mt_weight *w, int n) {
    cu_backend *cb = (cu_backend *)be;
    mt_status st;
    if (n <= CU_FP8_GEMV_MAX_N || cb->params.numerics != MT_NUMERICS_BF16) {
        st = cu_fp8_gemv(cb, y, x, w, n);
        cu_prof_mark(be, "matmul (FP8 GEMV)");
    } else if ((st = cu_fp8_gemm_lt(cb, y, x, w, n)) == MT_ERR_UNSUPPORTED) {
        st = cu_fp8_gemv(cb, y, x, w, n); /* slow (the weight read once per 8 rows) but right */
        cu_prof_mark(be, "matmul (FP8 GEMV, no cuBLASLt GEMM)");
    } else {
        cu_prof_mark(be, "matmul (FP8 tensor cores)");
    }
    cu_op_status(be, "matmul", st);
}

extern "C" void cu_fp8_fill(mt_backend_ops *t) {
    t->weight_fp8 = cu_weight_fp8;
    t->weight_fp8_from = cu_weight_fp8_from;
}
