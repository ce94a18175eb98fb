/* kernels/cuda/cuda_rows.cu: the "rows" form of the per-sequence ops that need no kernel of their
 * own family (kernels/backend.h, batched decode): a conv step, a cache write and a pool key per
 * row, each row on its own sequence's memory through a pointer table in device memory, at its own
 * position. One launch covers every row, and the tables are read at run time, so a graph recorded
 * over these launches serves any batch. The delta rule, selection and sparse MLA in the rows form
 * live beside their single-sequence kernels (cuda_kda.cu, cuda_dsa.cu). */
#include <math.h>
#include <stdint.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_ops.h"

enum { ROWS_BLOCK = 256, ROWS_MAX_K = 8 };

/* ---- conv1d_silu_rows: thread = (row i, channel c); one step on states[i][c] [K-1] ---- */

typedef struct conv_rows_params {
    float *out;             /* [n, C] */
    const float *x;         /* [n, C] */
    float *const *states;   /* [n] -> [C, K-1], oldest first */
    const float *w;         /* [C, K] */
    int n, C, K;
} conv_rows_params;

static __global__ void conv_rows_kernel(conv_rows_params p) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x, i = blockIdx.y;
    if (c >= p.C) return;
    const int P = p.K - 1;
    float *st = p.states[i] + (size_t)c * P;
    const float xv = p.x[(size_t)i * p.C + c];
    const float *wc = p.w + (size_t)c * p.K;
    float hist[ROWS_MAX_K];
    float a = 0.f;
#pragma unroll
    for (int k = 0; k < ROWS_MAX_K - 1; k++)
        if (k < P) {
            hist[k] = st[k];
            a += wc[k] * hist[k];
        }
    a += wc[P] * xv;
    p.out[(size_t)i * p.C + c] = a / (1.f + expf(-a));
#pragma unroll
    for (int k = 0; k < ROWS_MAX_K - 1; k++) /* shift: drop the oldest, append x */
        if (k < P) st[k] = k + 1 < P ? hist[k + 1] : xv;
}

extern "C" void cu_conv1d_silu_rows(mt_backend *be, float *out, const float *x, float *const *states,
                                    const float *w, int n, int C, int K) {
    MT_ASSERT(n >= 0 && C > 0 && K >= 1 && K <= ROWS_MAX_K);
    if (n == 0) return;
    const conv_rows_params p = { out, x, states, w, n, C, K };
    conv_rows_kernel<<<dim3((C + ROWS_BLOCK - 1) / ROWS_BLOCK, n), ROWS_BLOCK, 0, cu_stream(be)>>>(p);
    cu_check_launch(be, "conv1d_silu_rows");
}

/* ---- copy_rows_to: bases[i][pos[i] * row + j] = src[i * row + j] ---- */

typedef struct copy_to_params {
    float *const *bases;    /* [n] */
    const int32_t *pos;     /* [n] */
    const float *src;       /* [n, row] */
    int64_t row;
} copy_to_params;

static __global__ void copy_rows_to_kernel(copy_to_params p) {
    const int i = blockIdx.y;
    float *dst = p.bases[i] + (int64_t)p.pos[i] * p.row;
    const float *src = p.src + (int64_t)i * p.row;
    for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < p.row; e += (int64_t)gridDim.x * blockDim.x)
        dst[e] = src[e];
}

extern "C" void cu_copy_rows_to(mt_backend *be, float *const *bases, int64_t row, const int32_t *pos,
                                const float *src, int n) {
    if (n <= 0 || row <= 0) return;
    const copy_to_params p = { bases, pos, src, row };
    const int64_t bx = (row + ROWS_BLOCK - 1) / ROWS_BLOCK;
    copy_rows_to_kernel<<<dim3((unsigned)(bx < 64 ? bx : 64), n), ROWS_BLOCK, 0, cu_stream(be)>>>(p);
    cu_check_launch(be, "copy_rows_to");
}

/* ---- dsa_pool_keys_rows: thread = (row i, channel d); the pool pos[i] completes, if any ---- */

typedef struct pool_rows_params {
    float *const *pool_keys;       /* [n] -> [pools, id] */
    const float *const *ki, *const *gs; /* [n] -> [positions, id] */
    const float *ape;              /* [kpool, id] */
    const int32_t *pos;            /* [n] */
    int kpool, id;
} pool_rows_params;

/* The same softmax-weighted sum as cuda_dsa.cu's pool key, in the CPU's order. */
static __global__ void pool_keys_rows_kernel(pool_rows_params p) {
    const int d = blockIdx.x * blockDim.x + threadIdx.x, i = blockIdx.y;
    const int t = p.pos[i];
    if (d >= p.id || (t + 1) % p.kpool != 0) return;
    const int pool = t / p.kpool;
    const size_t base = (size_t)pool * p.kpool;
    const float *gs = p.gs[i], *ki = p.ki[i];
    float m = -INFINITY, sum = 0.f, acc = 0.f;
    for (int j = 0; j < p.kpool; j++) m = fmaxf(m, gs[(base + j) * p.id + d] + p.ape[(size_t)j * p.id + d]);
    for (int j = 0; j < p.kpool; j++) sum += expf(gs[(base + j) * p.id + d] + p.ape[(size_t)j * p.id + d] - m);
    for (int j = 0; j < p.kpool; j++) {
        const float wj = expf(gs[(base + j) * p.id + d] + p.ape[(size_t)j * p.id + d] - m);
        acc += wj / sum * ki[(base + j) * p.id + d];
    }
    p.pool_keys[i][(size_t)pool * p.id + d] = acc;
}

extern "C" void cu_dsa_pool_keys_rows(mt_backend *be, float *const *pool_keys, const float *const *ki,
                                      const float *const *gs, const float *ape, const int32_t *pos, int n,
                                      int kpool, int id) {
    MT_ASSERT(kpool > 0 && id > 0);
    if (n <= 0) return;
    const pool_rows_params p = { pool_keys, ki, gs, ape, pos, kpool, id };
    pool_keys_rows_kernel<<<dim3((id + ROWS_BLOCK - 1) / ROWS_BLOCK, n), ROWS_BLOCK, 0, cu_stream(be)>>>(p);
    cu_check_launch(be, "dsa_pool_keys_rows");
}
