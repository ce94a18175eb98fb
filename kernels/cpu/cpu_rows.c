/* kernels/cpu/cpu_rows.c: the "rows" form of the per-sequence ops (kernels/backend.h, batched
 * decode): row i runs the single-sequence op at its own position on its own state. On this backend
 * the tables and positions are host memory, so each row is one call of the op it stands for
 * (through the backend's table), and the rows form computes exactly what decoding each sequence
 * alone computes. The DSA caches are paged: every row shares the pools and brings its own block
 * table. */
#include "kernels/cpu/cpu_ops.h"

static void cpu_conv1d_silu_rows(mt_backend *be, float *out, const float *x, float *const *states,
                                 const float *w, int n, int C, int K) {
    for (int i = 0; i < n; i++)
        be->ops->conv1d_silu(be, out + (size_t)i * C, x + (size_t)i * C, states[i], w, 1, C, K);
}

static void cpu_kda_recurrent_rows(mt_backend *be, float *o, const float *q, const float *k, const float *v,
                                   const float *g, const float *beta, float *const *states, int n, int nh,
                                   int dk) {
    const size_t D = (size_t)nh * dk;
    for (int i = 0; i < n; i++)
        be->ops->kda_recurrent(be, o + i * D, q + i * D, k + i * D, v + i * D, g + i * D, beta + (size_t)i * nh,
                               states[i], 1, nh, dk);
}

static void cpu_copy_rows_to(mt_backend *be, mt_paged dst, const int32_t *const *bts, const int32_t *pos,
                             const float *src, int n) {
    for (int i = 0; i < n; i++)
        be->ops->copy_rows_at(be, dst, bts[i], 0, pos + i, src + (size_t)i * (size_t)dst.row, 1);
}

static void cpu_copy_rows_from(mt_backend *be, float *out, const float *const *srcs, int n, int64_t w) {
    for (int i = 0; i < n; i++) be->ops->copy(be, out + (size_t)i * (size_t)w, srcs[i], sizeof(float) * (size_t)w);
}

static void cpu_copy_rows_ptr(mt_backend *be, float *const *dsts, const float *const *srcs, int n, int64_t w) {
    for (int i = 0; i < n; i++)
        if (dsts[i]) be->ops->copy(be, dsts[i], srcs[i], sizeof(float) * (size_t)w);
}

static void cpu_dsa_pool_keys_rows(mt_backend *be, mt_paged pool_keys, mt_paged ki, mt_paged gs,
                                   const int32_t *const *bts, const float *ape, const int32_t *pos, int n,
                                   int kpool) {
    for (int i = 0; i < n; i++) be->ops->dsa_pool_keys_at(be, pool_keys, ki, gs, bts[i], ape, pos + i, kpool);
}

static void cpu_dsa_select_rows(mt_backend *be, int32_t *sel, int32_t *nsel, const float *qi, const float *w,
                                mt_paged pool_keys, const int32_t *const *bts, const int32_t *pos, int n,
                                const mt_dsa_select_params *p) {
    mt_dsa_select_params one = *p;
    one.t0_dev = NULL;
    for (int i = 0; i < n; i++)
        be->ops->dsa_select(be, sel + (size_t)i * p->max_sel, nsel + i, qi + (size_t)i * p->ih * p->id,
                            w + (size_t)i * p->ih, pool_keys, bts[i], pos[i], 1, &one);
}

static void cpu_mla_sparse_rows(mt_backend *be, float *out, const float *q, mt_paged latent,
                                const int32_t *const *bts, const mt_weight *kv_b, const int32_t *sel,
                                const int32_t *nsel, int max_sel, const int32_t *pos, int n,
                                const mt_mla_params *p) {
    mt_mla_params one = *p;
    one.t0_dev = NULL;
    for (int i = 0; i < n; i++)
        be->ops->mla_sparse(be, out + (size_t)i * p->Hq * p->dv, q + (size_t)i * p->Hq * p->dn, latent, bts[i],
                            kv_b, sel + (size_t)i * max_sel, nsel + i, max_sel, pos[i], 1, &one);
}

void cpu_rows_fill(mt_backend_ops *t) {
    t->conv1d_silu_rows = cpu_conv1d_silu_rows;
    t->kda_recurrent_rows = cpu_kda_recurrent_rows;
    t->copy_rows_to = cpu_copy_rows_to;
    t->copy_rows_from = cpu_copy_rows_from;
    t->copy_rows_ptr = cpu_copy_rows_ptr;
    t->dsa_pool_keys_rows = cpu_dsa_pool_keys_rows;
    t->dsa_select_rows = cpu_dsa_select_rows;
    t->mla_sparse_rows = cpu_mla_sparse_rows;
}
