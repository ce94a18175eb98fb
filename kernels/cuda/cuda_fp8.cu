/* kernels/cuda/cuda_fp8.cu: the low part of a two-part prefill GEMM in fp8 (owner: this file).
 *
 * Prefill matmuls split x = hi + lo (cuda_dense.cu matmul_tc) because one bf16 rounding of x
 * flips router and indexer choices of the random fixtures (docs/DESIGN.md "Numerics"); two bf16
 * GEMMs cost twice one. Here the low product runs on the fp8 tensor cores at twice the bf16 rate:
 *   y  = W . hi^T                        bf16 GEMM (cuBLAS), hi = bf16(x)
 *   y += (sw sx^T) o (W8 . lo8^T)        e4m3 GEMM (cuBLASLt, beta = 1, fp32 out)
 * with lo8[m] = e4m3((x[m] - hi[m]) / sx[m]), sx[m] = max |x[m] - hi[m]| / 448 (a scale per row of
 * x), and W8[r] = e4m3(W[r] / sw[r]), sw[r] = max |W[r]| / 448 (a scale per weight row, made once
 * by cu_weight_lowp). cuBLASLt applies the scales as outer vectors
 * (CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F). H200, M = 4096 (tools/dev/fp8_probe, docs/bench/
 * 2026-11-29-h200-session7.md): 0.78-0.91x the time of two bf16 GEMMs, error ~3e-6 of |x||W| where
 * two bf16 parts give ~1e-6 and one ~1e-4; the CPU probe (tools/dev/precision_probe --fp8lo) keeps
 * the whole-model comparison's bar with it.
 *
 * Shapes: K and N multiples of 16 (fp8 leading dimensions); other weights keep two bf16 parts. */
#include <cublasLt.h>
#include <limits.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_ops.h"

enum {
    FP8_THREADS = 256,
    FP8_ALGOS = 32, /* cached cuBLASLt choices, by (M, N, K) */
};
#define FP8_MAX 448.f /* largest finite e4m3 */

/* cuBLASLt state of one backend (cu_backend.fp8): the handle and the algorithms found so far. */
struct cu_fp8 {
    cublasLtHandle_t lt;
    struct {
        int M, N, K;
        cublasLtMatmulAlgo_t algo;
    } algos[FP8_ALGOS];
    int n_algos, next;
};

extern "C" void cu_fp8_free(cu_backend *cb) {
    if (!cb->fp8) return;
    if (cb->fp8->lt) MT_CUBLAS_WARN(cublasLtDestroy(cb->fp8->lt));
    free(cb->fp8);
    cb->fp8 = NULL;
}

/* Block-wide max and sum of per-thread values (every thread gets both). */
static __device__ void block_max_sum(float &mx, float &ss) {
    __shared__ float red[2][FP8_THREADS / 32];
#pragma unroll
    for (int o = 16; o; o >>= 1) {
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        ss += __shfl_xor_sync(0xffffffffu, ss, o);
    }
    if ((threadIdx.x & 31) == 0) {
        red[0][threadIdx.x >> 5] = mx;
        red[1][threadIdx.x >> 5] = ss;
    }
    __syncthreads();
    mx = red[0][0];
    ss = red[1][0];
    for (int w = 1; w < FP8_THREADS / 32; w++) { /* same order in every thread */
        mx = fmaxf(mx, red[0][w]);
        ss += red[1][w];
    }
}

/* Block = one weight row: w8[r] = e4m3(w[r] / s[r]), s[r] = max |w[r]| / 448 (1 for a zero row). */
static __global__ void __launch_bounds__(FP8_THREADS) weight_e4m3_kernel(__nv_fp8_e4m3 *w8, float *s,
                                                                        const __nv_bfloat16 *w, int K) {
    const size_t r = blockIdx.x;
    float mx = 0.f, unused = 0.f;
    for (int j = threadIdx.x; j < K; j += FP8_THREADS) mx = fmaxf(mx, fabsf(__bfloat162float(w[r * K + j])));
    block_max_sum(mx, unused);
    const float sc = mx > 0.f ? mx / FP8_MAX : 1.f;
    if (threadIdx.x == 0) s[r] = sc;
    for (int j = threadIdx.x; j < K; j += FP8_THREADS)
        w8[r * K + j] = __nv_fp8_e4m3(__bfloat162float(w[r * K + j]) / sc);
}

/* Block = one row of x [M, K] (K % 4 == 0, 16-byte aligned): hi = bf16(x), lo8 = e4m3((x - hi) /
 * s), s = max |x - hi| / 448. Two passes over the row (the second from L2). */
static __global__ void __launch_bounds__(FP8_THREADS) split_e4m3_kernel(__nv_bfloat16 *hi, __nv_fp8_e4m3 *lo8,
                                                                       float *s, const float *x, int K) {
    const size_t r = blockIdx.x;
    const float4 *x4 = reinterpret_cast<const float4 *>(x + r * K);
    __nv_bfloat162 *h2 = reinterpret_cast<__nv_bfloat162 *>(hi + r * K);
    const int K4 = K / 4;
    float mx = 0.f, unused = 0.f;
    for (int j = threadIdx.x; j < K4; j += FP8_THREADS) {
        const float4 v = x4[j];
        const __nv_bfloat162 a = __floats2bfloat162_rn(v.x, v.y), b = __floats2bfloat162_rn(v.z, v.w);
        h2[2 * j] = a;
        h2[2 * j + 1] = b;
        const float2 af = __bfloat1622float2(a), bf = __bfloat1622float2(b);
        mx = fmaxf(fmaxf(fabsf(v.x - af.x), fabsf(v.y - af.y)), fmaxf(fmaxf(fabsf(v.z - bf.x), fabsf(v.w - bf.y)), mx));
    }
    block_max_sum(mx, unused);
    const float sc = mx > 0.f ? mx / FP8_MAX : 1.f, inv = 1.f / sc;
    if (threadIdx.x == 0) s[r] = sc;
    __nv_fp8x4_e4m3 *l4 = reinterpret_cast<__nv_fp8x4_e4m3 *>(lo8 + r * K);
    for (int j = threadIdx.x; j < K4; j += FP8_THREADS) {
        const float4 v = x4[j];
        const float2 af = __bfloat1622float2(h2[2 * j]), bf = __bfloat1622float2(h2[2 * j + 1]);
        l4[j] = __nv_fp8x4_e4m3(make_float4((v.x - af.x) * inv, (v.y - af.y) * inv, (v.z - bf.x) * inv,
                                            (v.w - bf.y) * inv));
    }
}

extern "C" bool cu_fp8_shape_ok(const mt_weight *w) {
    return w->dtype == MT_BF16 && w->rows % 16 == 0 && w->cols % 16 == 0 && w->rows > 0 && w->cols > 0 &&
           w->rows <= INT_MAX && w->cols <= INT_MAX;
}

extern "C" mt_status cu_weight_lowp(mt_backend *be, mt_weight *w) {
    cu_backend *cb = (cu_backend *)be;
    if (w->lo8 || !cb->fp8lo || cb->tc_terms != 2 || !cu_fp8_shape_ok(w)) return MT_OK; /* nothing to add */
    void *w8 = NULL, *s = NULL;
    if (cudaMalloc(&w8, (size_t)w->rows * w->cols) != cudaSuccess ||
        cudaMalloc(&s, sizeof(float) * (size_t)w->rows) != cudaSuccess) {
        (void)cudaGetLastError();
        cudaFree(w8);
        mt_log(MT_LOG_ERROR, "cuda backend: out of device memory for the e4m3 copy of a %lld x %lld weight",
               (long long)w->rows, (long long)w->cols);
        return MT_ERR_NOMEM;
    }
    weight_e4m3_kernel<<<(unsigned)w->rows, FP8_THREADS, 0, cb->stream>>>(
        (__nv_fp8_e4m3 *)w8, (float *)s, (const __nv_bfloat16 *)w->data, (int)w->cols);
    MT_CUDA_CHECK_LAUNCH();
    w->lo8 = w8;
    w->lo8_scale = (const float *)s;
    return MT_OK;
}

/* The cuBLASLt algorithm for (M, N, K), found once; NULL when cuBLASLt has none (logged). */
static const cublasLtMatmulAlgo_t *fp8_algo(cu_backend *cb, cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t la,
                                            cublasLtMatrixLayout_t lb, cublasLtMatrixLayout_t lc, int M, int N, int K) {
    struct cu_fp8 *f = cb->fp8;
    for (int i = 0; i < f->n_algos; i++)
        if (f->algos[i].M == M && f->algos[i].N == N && f->algos[i].K == K) return &f->algos[i].algo;
    cublasLtMatmulPreference_t pref = NULL;
    const size_t ws = CU_BLAS_WS_BYTES;
    cublasLtMatmulHeuristicResult_t r;
    memset(&r, 0, sizeof r);
    int found = 0;
    MT_CUBLAS_(cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate", return NULL);
    MT_CUBLAS_WARN(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
    MT_CUBLAS_WARN(cublasLtMatmulAlgoGetHeuristic(f->lt, op, la, lb, lc, lc, pref, 1, &r, &found));
    cublasLtMatmulPreferenceDestroy(pref);
    if (found < 1) {
        mt_log(MT_LOG_ERROR, "cuda backend: cuBLASLt has no e4m3 algorithm for %d x %d x %d", M, N, K);
        return NULL;
    }
    const int i = f->n_algos < FP8_ALGOS ? f->n_algos++ : (f->next++ % FP8_ALGOS);
    f->algos[i].M = M;
    f->algos[i].N = N;
    f->algos[i].K = K;
    f->algos[i].algo = r.algo;
    return &f->algos[i].algo;
}

/* y[M, N] += diag(sx) (lo8[M, K] . W8[N, K]^T) diag(sw), in cuBLAS's column-major view y^T =
 * W8 . lo8^T (TN, the layout fp8 needs). */
static mt_status gemm_e4m3(cu_backend *cb, float *y, const void *lo8, const float *sx, const mt_weight *w, int M) {
    const int N = (int)w->rows, K = (int)w->cols;
    if (!cb->fp8) {
        cb->fp8 = (struct cu_fp8 *)calloc(1, sizeof *cb->fp8);
        if (!cb->fp8) return MT_ERR_NOMEM;
        MT_CUBLAS_(cublasLtCreate(&cb->fp8->lt), "cublasLtCreate", {
            free(cb->fp8);
            cb->fp8 = NULL;
            return mt_st_;
        });
    }
    cublasLtMatmulDesc_t op = NULL;
    cublasLtMatrixLayout_t la = NULL, lb = NULL, lc = NULL;
    mt_status st = MT_OK;
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    const int32_t mode = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
    const float *sw = w->lo8_scale;
    const float one = 1.f;
    const cublasLtMatmulAlgo_t *algo;
    MT_CUBLAS_CHECK_GOTO(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F), st, done);
    MT_CUBLAS_CHECK_GOTO(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta), st, done);
    MT_CUBLAS_CHECK_GOTO(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb), st, done);
    MT_CUBLAS_CHECK_GOTO(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode, sizeof mode), st, done);
    MT_CUBLAS_CHECK_GOTO(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode, sizeof mode), st, done);
    MT_CUBLAS_CHECK_GOTO(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sw, sizeof sw), st, done);
    MT_CUBLAS_CHECK_GOTO(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sx, sizeof sx), st, done);
    MT_CUBLAS_CHECK_GOTO(cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, K, N, K), st, done);
    MT_CUBLAS_CHECK_GOTO(cublasLtMatrixLayoutCreate(&lb, CUDA_R_8F_E4M3, K, M, K), st, done);
    MT_CUBLAS_CHECK_GOTO(cublasLtMatrixLayoutCreate(&lc, CUDA_R_32F, N, M, N), st, done);
    algo = fp8_algo(cb, op, la, lb, lc, M, N, K);
    if (!algo) {
        st = MT_ERR_UNSUPPORTED;
        goto done;
    }
    MT_CUBLAS_CHECK_GOTO(cublasLtMatmul(cb->fp8->lt, op, &one, w->lo8, la, lo8, lb, &one, y, lc, y, lc, algo,
                                        cb->blas_ws, CU_BLAS_WS_BYTES, cb->stream),
                         st, done);
done:
    if (lc) cublasLtMatrixLayoutDestroy(lc);
    if (lb) cublasLtMatrixLayoutDestroy(lb);
    if (la) cublasLtMatrixLayoutDestroy(la);
    if (op) cublasLtMatmulDescDestroy(op);
    return st;
}

extern "C" mt_status cu_matmul_lowp(cu_backend *cb, float *y, const float *x, const mt_weight *w, int n) {
    const int K = (int)w->cols;
    MT_ASSERT(w->lo8 && w->lo8_scale && n > 0 && K % 16 == 0 && cu_aligned16(x));
    const size_t hi_bytes = 2 * (size_t)n * K, lo_bytes = (size_t)n * K;
    char *scr = (char *)cu_scratch(&cb->base, CU_SCRATCH_GEMM, hi_bytes + lo_bytes + sizeof(float) * (size_t)n);
    if (!scr) return MT_ERR_NOMEM; /* logged */
    __nv_bfloat16 *hi = (__nv_bfloat16 *)scr;
    __nv_fp8_e4m3 *lo8 = (__nv_fp8_e4m3 *)(scr + hi_bytes);
    float *sx = (float *)(scr + hi_bytes + lo_bytes); /* 16-byte aligned: K % 16 == 0 */
    split_e4m3_kernel<<<(unsigned)n, FP8_THREADS, 0, cb->stream>>>(hi, lo8, sx, x, K);
    MT_CUDA_CHECK_LAUNCH();
    mt_status st = cu_gemm_tc(cb, y, hi, w->data, MT_BF16, n, (int)w->rows, K, 0.f);
    if (st == MT_OK) st = gemm_e4m3(cb, y, lo8, sx, w, n);
    return st;
}
