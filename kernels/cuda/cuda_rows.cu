/* kernels/cuda/cuda_rows.cu: the "rows" form of the per-sequence ops that need no kernel of their
 * own family (kernels/backend.h, batched decode): a conv step, a cache write, a pool key and a
 * copy from the row's own buffer per row, each row on its own sequence's memory through a pointer table in device memory (for the
 * paged DSA caches, a table of block tables), at its own position. One launch covers every row, and the tables are read at run time, so a graph recorded
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

/* One channel's conv step: silu(w . (st ++ xv)) with st [K-1] oldest first, then st shifted (the
 * oldest dropped, xv appended). Shared by conv_rows_kernel and conv3_rows_kernel. */
static __device__ __forceinline__ float conv_step(float *st, float xv, const float *wc, int K) {
    const int P = K - 1;
    float hist[ROWS_MAX_K];
    float a = 0.f;
#pragma unroll
    for (int k = 0; k < ROWS_MAX_K - 1; k++)
        if (k < P) {
            hist[k] = st[k];
            a += wc[k] * hist[k];
        }
    a += wc[P] * xv;
#pragma unroll
    for (int k = 0; k < ROWS_MAX_K - 1; k++)
        if (k < P) st[k] = k + 1 < P ? hist[k + 1] : xv;
    return a / (1.f + expf(-a));
}

static __global__ void conv_rows_kernel(conv_rows_params p) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x, i = blockIdx.y;
    if (c >= p.C) return;
    p.out[(size_t)i * p.C + c] = conv_step(p.states[i] + (size_t)c * (p.K - 1), p.x[(size_t)i * p.C + c],
                                           p.w + (size_t)c * p.K, p.K);
}

static void cu_conv1d_silu_rows(mt_backend *be, float *out, const float *x, float *const *states,
                                const float *w, int n, int C, int K) {
    MT_ASSERT(n >= 0 && C > 0 && K >= 1 && K <= ROWS_MAX_K);
    if (n == 0) return;
    const conv_rows_params p = { out, x, states, w, n, C, K };
    conv_rows_kernel<<<dim3((C + ROWS_BLOCK - 1) / ROWS_BLOCK, n), ROWS_BLOCK, 0, cu_stream(be)>>>(p);
    cu_check_launch(be, "conv1d_silu_rows");
}

/* ---- kda_conv3_rows: conv_rows of q, k, v in one launch, with the q and k l2norms ----
 * Block = (head h, projection j, row i), a thread per channel of the head: the conv step as
 * conv_rows_kernel, then for q and k the head's sum of squares (float, a warp butterfly and the
 * warps in order; the CPU's l2norm sums in float too) and the scaling. One launch for what was
 * three conv and two norm kernels per KDA layer (~2.5 us of latency each at decode). */
typedef struct conv3_params {
    mt_kda_conv3 c;
    int n, C, K, dk;
    float eps, q_scale;
} conv3_params;

static __global__ void __launch_bounds__(1024) conv3_rows_kernel(const conv3_params p) {
    __shared__ float red[32];
    const int h = blockIdx.x, j = blockIdx.y, i = blockIdx.z, t = threadIdx.x, c = h * p.dk + t;
    const bool own = t < p.dk; /* the block is dk rounded up to whole warps */
    /* the channel's conv state (last written by the previous step) and weights into L2 while the
     * kernel before runs (launched for PDL, cu_launch_pdl_k; the pointer tables are uploaded
     * before the step) */
    if (own) {
        asm volatile("prefetch.global.L2 [%0];" ::"l"(p.c.states[j][i] + (size_t)c * (p.K - 1)));
        asm volatile("prefetch.global.L2 [%0];" ::"l"(p.c.w[j] + (size_t)c * p.K));
    }
    cu_pdl_wait();
    cu_pdl_trigger();
    float y = 0.f;
    if (own)
        y = conv_step(p.c.states[j][i] + (size_t)c * (p.K - 1), p.c.x[j][(size_t)i * p.C + c],
                      p.c.w[j] + (size_t)c * p.K, p.K);
    if (j < 2) { /* block-uniform */
        const float ss = cu_block_sum(y * y, red);
        y *= (j == 0 ? p.q_scale : 1.f) / sqrtf(ss + p.eps);
    }
    if (own) p.c.out[j][(size_t)i * p.C + c] = y;
}

static void cu_kda_conv3_rows(mt_backend *be, const mt_kda_conv3 *c, int n, int C, int K, int dk, float eps,
                              float q_scale) {
    MT_ASSERT(n >= 0 && C > 0 && K >= 1 && K <= ROWS_MAX_K && dk >= 1 && dk <= 1024 && C % dk == 0);
    if (n == 0) return;
    const conv3_params p = { *c, n, C, K, dk, eps, q_scale };
    cu_launch_pdl_k(conv3_rows_kernel, dim3((unsigned)(C / dk), 3, (unsigned)n), dim3((unsigned)((dk + 31) / 32 * 32)), 0,
                    cu_stream(be), p);
    cu_check_launch(be, "kda_conv3_rows");
}

/* ---- copy_rows_to: src[i] becomes position pos[i] of the paged cache dst through bts[i] ---- */

enum { COPY_TO_MAX = 4 };

typedef struct copy_to_params {
    mt_paged dst[COPY_TO_MAX];           /* [n_pages, page, row] each */
    const float *src[COPY_TO_MAX];       /* [n, dst[j].row] */
    bool vec4[COPY_TO_MAX];              /* row % 4 == 0, dst.base and src 16-byte aligned */
    const int32_t *const *bts;           /* [n] block tables */
    const int32_t *pos;                  /* [n] */
} copy_to_params;

/* Block = (a stretch of columns, row i, cache j); the row's page is looked up once. */
static __global__ void copy_rows_to_kernel(copy_to_params p) {
    cu_pdl_wait(); /* launched for PDL (cu_launch_pdl_k) */
    cu_pdl_trigger();
    const int i = blockIdx.y, j = blockIdx.z;
    const mt_paged d = p.dst[j];
    cu_copy_row_x(mt_paged_at(d, p.bts[i], p.pos[i]), p.src[j] + (int64_t)i * d.row, d.row, p.vec4[j]);
}

static void cu_copy_rows_to_n(mt_backend *be, const mt_paged *dst, const float *const *src, int count,
                              const int32_t *const *bts, const int32_t *pos, int n) {
    MT_ASSERT(count >= 0 && count <= COPY_TO_MAX && n <= 65535);
    if (n <= 0 || count == 0) return;
    copy_to_params p = {};
    p.bts = bts;
    p.pos = pos;
    int64_t bx = 1;
    for (int j = 0; j < count; j++) {
        MT_ASSERT(dst[j].page > 0 && dst[j].row > 0);
        p.dst[j] = dst[j];
        p.src[j] = src[j];
        p.vec4[j] = dst[j].row % 4 == 0 && cu_aligned16(dst[j].base) && cu_aligned16(src[j]);
        const int64_t per = p.vec4[j] ? dst[j].row / 4 : dst[j].row, b = (per + ROWS_BLOCK - 1) / ROWS_BLOCK;
        if (b > bx) bx = b;
    }
    cu_launch_pdl_k(copy_rows_to_kernel, dim3((unsigned)(bx < 64 ? bx : 64), n, count), dim3(ROWS_BLOCK), 0,
                    cu_stream(be), p);
    cu_check_launch(be, "copy_rows_to");
}

static void cu_copy_rows_to(mt_backend *be, mt_paged dst, const int32_t *const *bts, const int32_t *pos,
                            const float *src, int n) {
    cu_copy_rows_to_n(be, &dst, &src, 1, bts, pos, n);
}

/* ---- copy_rows_from: out[i] = srcs[i][0 .. w), each row's source from a table ---- */

typedef struct copy_from_params {
    float *out;                  /* [n, w] */
    const float *const *srcs;    /* [n] -> [w] */
    int64_t w;
} copy_from_params;

/* Block = (a stretch of columns, row i); float4 copies where the row's source is aligned (known
 * only here: the table is device memory). */
static __global__ void copy_rows_from_kernel(copy_from_params p) {
    const int i = blockIdx.y;
    float *dst = p.out + (int64_t)i * p.w;
    const float *src = p.srcs[i];
    cu_copy_row_x(dst, src, p.w, p.w % 4 == 0 && cu_aligned16(dst) && cu_aligned16(src));
}

static void cu_copy_rows_from(mt_backend *be, float *out, const float *const *srcs, int n, int64_t w) {
    MT_ASSERT(n >= 0 && n <= 65535 && w >= 0);
    if (n == 0 || w == 0) return;
    const copy_from_params p = { out, srcs, w };
    const int64_t bx = (w / 4 + ROWS_BLOCK - 1) / ROWS_BLOCK;
    copy_rows_from_kernel<<<dim3((unsigned)(bx < 1 ? 1 : bx < 64 ? bx : 64), (unsigned)n), ROWS_BLOCK, 0,
                            cu_stream(be)>>>(p);
    cu_check_launch(be, "copy_rows_from");
}

/* ---- copy_rows_ptr: dsts[i] = srcs[i][0 .. w), both from tables ---- */

typedef struct copy_ptr_params {
    float *const *dsts;          /* [n] -> [w] */
    const float *const *srcs;    /* [n] -> [w] */
    int64_t w;
} copy_ptr_params;

static __global__ void copy_rows_ptr_kernel(copy_ptr_params p) {
    const int i = blockIdx.y;
    float *dst = p.dsts[i];
    if (!dst) return; /* a skipped row */
    const float *src = p.srcs[i];
    cu_copy_row_x(dst, src, p.w, p.w % 4 == 0 && cu_aligned16(dst) && cu_aligned16(src));
}

static void cu_copy_rows_ptr(mt_backend *be, float *const *dsts, const float *const *srcs, int n, int64_t w) {
    MT_ASSERT(n >= 0 && n <= 65535 && w >= 0);
    if (n == 0 || w == 0) return;
    const copy_ptr_params p = { dsts, srcs, w };
    const int64_t bx = (w / 4 + ROWS_BLOCK - 1) / ROWS_BLOCK;
    copy_rows_ptr_kernel<<<dim3((unsigned)(bx < 1 ? 1 : bx < 64 ? bx : 64), (unsigned)n), ROWS_BLOCK, 0,
                           cu_stream(be)>>>(p);
    cu_check_launch(be, "copy_rows_ptr");
}

/* ---- dsa_pool_keys_rows: thread = (row i, channel d); the pool pos[i] completes, if any ---- */

typedef struct pool_rows_params {
    mt_paged pool_keys;          /* [n_pages, page / kpool, id] */
    mt_paged ki, gs;             /* [n_pages, page, id] */
    const int32_t *const *bts;   /* [n] block tables */
    const float *ape;            /* [kpool, id] */
    const int32_t *pos;          /* [n] */
    int kpool, id;
} pool_rows_params;

/* Row i's position pos[i] completes a pool when (pos + 1) % kpool == 0: its key (cu_pool_key). */
static __global__ void pool_keys_rows_kernel(pool_rows_params p) {
    cu_pdl_wait(); /* launched for PDL (cu_launch_pdl_k) */
    cu_pdl_trigger();
    const int d = blockIdx.x * blockDim.x + threadIdx.x, i = blockIdx.y;
    const int t = p.pos[i];
    if (d >= p.id || (t + 1) % p.kpool != 0) return;
    cu_pool_key(p.pool_keys, p.ki, p.gs, p.bts[i], p.ape, t / p.kpool, d, p.kpool);
}

static void cu_dsa_pool_keys_rows(mt_backend *be, mt_paged pool_keys, mt_paged ki, mt_paged gs,
                                  const int32_t *const *bts, const float *ape, const int32_t *pos, int n,
                                  int kpool) {
    const int id = (int)ki.row;
    MT_ASSERT(kpool > 0 && id > 0 && gs.row == id && pool_keys.row == id && n <= 65535);
    MT_ASSERT(ki.page == gs.page && pool_keys.page > 0 && ki.page == pool_keys.page * kpool);
    if (n <= 0) return;
    const pool_rows_params p = { pool_keys, ki, gs, bts, ape, pos, kpool, id };
    cu_launch_pdl_k(pool_keys_rows_kernel, dim3(dim3((id + ROWS_BLOCK - 1) / ROWS_BLOCK, n)), dim3(ROWS_BLOCK), 0, cu_stream(be), p);
    cu_check_launch(be, "dsa_pool_keys_rows");
}

extern "C" void cu_rows_fill(mt_backend_ops *t) {
    t->conv1d_silu_rows = cu_conv1d_silu_rows;
    t->kda_conv3_rows = cu_kda_conv3_rows;
    t->copy_rows_to_n = cu_copy_rows_to_n;
    t->copy_rows_to = cu_copy_rows_to;
    t->copy_rows_from = cu_copy_rows_from;
    t->copy_rows_ptr = cu_copy_rows_ptr;
    t->dsa_pool_keys_rows = cu_dsa_pool_keys_rows;
}
