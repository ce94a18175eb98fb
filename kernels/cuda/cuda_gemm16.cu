/* kernels/cuda/cuda_gemm16.cu: cu_gemm_tc, the 16-bit tensor-core GEMM of the dense and expert
 * paths, y[M, N] (fp32) = x16[M, K] . w[N, K]^T + beta * y (cuda_ops.h), through cuBLASLt with
 * a plan per shape. cublasGemmEx chooses its algorithm again on every call, host time that a
 * step's GEMMs spend while the device, drained at the step's mid-step syncs, waits for them. A
 * plan keeps the descriptors and the heuristic's algorithm of (dtype, N, K, row bucket, the
 * operands' alignments): row counts share a plan within a bucket (each count up to 64, then
 * multiples of 64 up to 512, of 256 up to 4096 and of 1024 beyond), its algorithm the
 * heuristic's for the bucket's largest count, run with the call's own count. A shape that
 * cuBLASLt offers no algorithm for, or whose bucket's algorithm it refuses at a call, goes
 * through cublasGemmEx. */
#include <cublasLt.h>
#include <cublas_v2.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_lt.h"
#include "kernels/cuda/cuda_ops.h"

enum { G16_SLOTS = 4096 }; /* open addressing; at 3/4 full the cache starts over */

typedef struct g16_key {
    int N, K, Mb;
    uint8_t dt, al_a, al_b, al_c; /* MT_BF16 or MT_F16; log2 of each operand's alignment (<= 256) */
} g16_key;

typedef struct g16_plan {
    bool used, ok;             /* ok: cuBLASLt offered an algorithm */
    g16_key key;
    cublasLtMatrixLayout_t la, lb, lc;
    cublasLtMatmulAlgo_t algo;
} g16_plan;

struct cu_gemm16_cache {
    cublasLtMatmulDesc_t op;   /* shared: fp32 compute and scale, A transposed */
    int n;
    g16_plan slot[G16_SLOTS];
};

static int row_bucket(int M) {
    if (M <= 64) return M;
    if (M <= 512) return (M + 63) / 64 * 64;
    if (M <= 4096) return (M + 255) / 256 * 256;
    return (int)(((int64_t)M + 1023) / 1024 * 1024);
}

static uint8_t align_log2(const void *p) {
    const uintptr_t a = (uintptr_t)p;
    uint8_t k = 0;
    while (k < 8 && !(a >> k & 1u)) k++;
    return k;
}

static bool key_eq(const g16_key *a, const g16_key *b) {
    return a->N == b->N && a->K == b->K && a->Mb == b->Mb && a->dt == b->dt && a->al_a == b->al_a &&
           a->al_b == b->al_b && a->al_c == b->al_c;
}

static unsigned key_hash(const g16_key *k) {
    uint64_t h = 1469598103934665603ull;
    const uint64_t v[4] = { (uint64_t)k->N, (uint64_t)k->K, (uint64_t)k->Mb,
                            (uint64_t)k->dt | (uint64_t)k->al_a << 8 | (uint64_t)k->al_b << 16 | (uint64_t)k->al_c << 24 };
    for (int i = 0; i < 4; i++) h = (h ^ v[i]) * 1099511628211ull;
    return (unsigned)(h ^ h >> 32);
}

static void plan_release(g16_plan *p) {
    if (p->la) MT_CUBLAS_WARN(cublasLtMatrixLayoutDestroy(p->la));
    if (p->lb) MT_CUBLAS_WARN(cublasLtMatrixLayoutDestroy(p->lb));
    if (p->lc) MT_CUBLAS_WARN(cublasLtMatrixLayoutDestroy(p->lc));
    memset(p, 0, sizeof *p);
}

/* cuBLAS is column-major: row-major y[M, N] is y^T [N, M] (ld N), w[N, K] is [K, N] (ld K) taken
 * transposed, x16[M, K] is [K, M] (ld K): y^T = w . x16^T. The layouts are made at the bucket's
 * row count (the heuristic's question) and set to the call's before each run. */
static mt_status plan_make(cu_backend *cb, struct cu_gemm16_cache *c, g16_plan *p) {
    const g16_key *k = &p->key;
    const cudaDataType_t t = k->dt == MT_BF16 ? CUDA_R_16BF : CUDA_R_16F;
    const uint32_t al[4] = { 1u << k->al_a, 1u << k->al_b, 1u << k->al_c, 1u << k->al_c };
    MT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->la, t, k->K, k->N, k->K));
    MT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->lb, t, k->K, k->Mb, k->K));
    MT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->lc, CUDA_R_32F, k->N, k->Mb, k->N));
    return cu_lt_algo(cb, c->op, p->la, p->lb, p->lc, al, &p->algo, &p->ok);
}

static mt_status cache_make(struct cu_gemm16_cache **out) {
    struct cu_gemm16_cache *c = (struct cu_gemm16_cache *)calloc(1, sizeof *c);
    if (!c) return MT_ERR_NOMEM;
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    mt_status st = MT_OK;
    MT_CUBLAS_CHECK_GOTO(cublasLtMatmulDescCreate(&c->op, CUBLAS_COMPUTE_32F, CUDA_R_32F), st, fail);
    MT_CUBLAS_CHECK_GOTO(cublasLtMatmulDescSetAttribute(c->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta), st, fail);
    MT_CUBLAS_CHECK_GOTO(cublasLtMatmulDescSetAttribute(c->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb), st, fail);
    *out = c;
    return MT_OK;
fail:
    if (c->op) MT_CUBLAS_WARN(cublasLtMatmulDescDestroy(c->op));
    free(c);
    return st;
}

extern "C" void cu_gemm16_free(cu_backend *cb) {
    struct cu_gemm16_cache *c = cb->gemm16;
    if (!c) return;
    for (int i = 0; i < G16_SLOTS; i++)
        if (c->slot[i].used) plan_release(&c->slot[i]);
    if (c->op) MT_CUBLAS_WARN(cublasLtMatmulDescDestroy(c->op));
    free(c);
    cb->gemm16 = NULL;
}

/* The plan of key k, made on first use; NULL when it cannot be made (logged). */
static g16_plan *plan_get(cu_backend *cb, const g16_key *k) {
    if (!cb->gemm16 && cache_make(&cb->gemm16) != MT_OK) return NULL;
    struct cu_gemm16_cache *c = cb->gemm16;
    unsigned i = key_hash(k) % G16_SLOTS;
    for (; c->slot[i].used; i = (i + 1) % G16_SLOTS)
        if (key_eq(&c->slot[i].key, k)) return &c->slot[i];
    if (c->n >= G16_SLOTS / 4 * 3) { /* full: start over */
        for (int j = 0; j < G16_SLOTS; j++)
            if (c->slot[j].used) plan_release(&c->slot[j]);
        c->n = 0;
        i = key_hash(k) % G16_SLOTS;
    }
    g16_plan *p = &c->slot[i];
    p->used = true;
    p->key = *k;
    c->n++;
    if (plan_make(cb, c, p) != MT_OK) {
        plan_release(p);
        p->used = true; /* a plan without an algorithm: the shape goes through cublasGemmEx */
        p->key = *k;
    }
    return p;
}

static mt_status gemm_ex(cu_backend *cb, float *y, const void *x16, const void *w, mt_dtype dt, int M, int N, int K,
                         float beta) {
    const cudaDataType t = dt == MT_BF16 ? CUDA_R_16BF : CUDA_R_16F;
    const float one = 1.f;
    MT_CUBLAS_CHECK(cublasGemmEx(cb->blas, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &one, w, t, K, x16, t, K, &beta, y,
                                 CUDA_R_32F, N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    return MT_OK;
}

extern "C" mt_status cu_gemm_tc(cu_backend *cb, float *y, const void *x16, const void *w, mt_dtype dt, int M, int N,
                                int K, float beta) {
    MT_ASSERT(dt == MT_BF16 || dt == MT_F16);
    MT_ASSERT(M >= 0 && N >= 0 && K > 0 && cb->blas);
    if (M == 0 || N == 0) return MT_OK;
    if (!cb->lt) return gemm_ex(cb, y, x16, w, dt, M, N, K, beta);
    const g16_key k = { N, K, row_bucket(M), (uint8_t)dt, align_log2(w), align_log2(x16), align_log2(y) };
    g16_plan *p = plan_get(cb, &k);
    if (!p || !p->ok) return gemm_ex(cb, y, x16, w, dt, M, N, K, beta);
    const uint64_t cols = (uint64_t)M;
    MT_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(p->lb, CUBLASLT_MATRIX_LAYOUT_COLS, &cols, sizeof cols));
    MT_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(p->lc, CUBLASLT_MATRIX_LAYOUT_COLS, &cols, sizeof cols));
    const float one = 1.f;
    const cublasStatus_t s = cublasLtMatmul((cublasLtHandle_t)cb->lt, cb->gemm16->op, &one, w, p->la, x16, p->lb,
                                            &beta, y, p->lc, y, p->lc, &p->algo, cb->blas_ws, CU_BLAS_WS_BYTES,
                                            cb->stream);
    if (s == CUBLAS_STATUS_SUCCESS) return MT_OK;
    /* the bucket's algorithm refused this count (NOT_SUPPORTED, or INVALID_VALUE for a
     * configuration it cannot run): the bucket goes through cublasGemmEx from now on, which
     * reports a failure of its own */
    mt_log(MT_LOG_WARN, "cuda backend: cuBLASLt refused a %d x %d x %d GEMM (%s); cublasGemmEx takes its shape", M, N, K,
           cublasGetStatusString(s));
    p->ok = false;
    return gemm_ex(cb, y, x16, w, dt, M, N, K, beta);
}
