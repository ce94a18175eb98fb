/* worker/model/glm_dsa.c: the DSA mixer (MODEL.md "DSA mixer"): MLA without RoPE whose latent c
 * is the KV cache, attending only over the positions its indexer selects. A "full" layer runs
 * its own indexer (keys, gate scores and pool keys cached per sequence) and leaves its selection
 * in the step scratch; the "shared" layer right after it reuses that selection. Rows and states as
 * in glm_kda.c: one sequence's consecutive positions (nst == 1), or one row per sequence. */
#include <math.h>

#include "worker/model/glm_impl.h"

/* Batched decode (nst == n): row i is the next position of sequence sts[i]. Projections run over
 * all rows; the cache writes, pool keys, selection and attention per sequence, at its length. */
static mt_status dsa_forward_multi(const glm_layer *l, glm_layer_state **sts, mt_step *step,
                                   const float *h, float *out, int n) {
    const glm_config *c = l->cfg;
    const glm_dsa_w *w = &l->dsa;
    mt_backend *be = step->be;
    const mt_backend_ops *op = be->ops;
    glm_scratch *scr = step->scr;
    const int kvl = c->kv_lora_rank, id = c->index_head_dim, kp = c->index_kpool, ih = c->index_n_heads;
    const int Hq = c->num_attention_heads, dn = c->qk_nope_head_dim, dv = c->v_head_dim;
    const int max_sel = glm_max_sel(c);
    float **b = scr->buf;
    float *qr = b[0], *q = b[1], *o = b[2], *qi = b[3], *iw = b[4], *lat = b[5], *ki = b[6], *gs = b[7];

    op->matmul(be, qr, h, &w->q_a, n);
    op->rmsnorm(be, qr, qr, w->q_a_norm, n, c->q_lora_rank, c->rms_norm_eps);
    op->matmul(be, q, qr, &w->q_b, n);
    op->matmul(be, lat, h, &w->kv_a, n);
    op->rmsnorm(be, lat, lat, w->kv_a_norm, n, kvl, c->rms_norm_eps);
    for (int i = 0; i < n; i++) {
        MT_ASSERT(sts[i]->len < sts[i]->cap);
        op->copy(be, sts[i]->latent + (size_t)sts[i]->len * kvl, lat + (size_t)i * kvl, sizeof(float) * kvl);
    }
    if (w->has_indexer) {
        op->matmul(be, ki, h, &w->ik, n);
        op->layernorm(be, ki, ki, w->ik_norm_w, w->ik_norm_b, n, id, 1e-6f);
        op->matmul(be, gs, h, &w->igate, n);
        op->matmul(be, qi, qr, &w->iq, n);
        op->matmul(be, iw, h, &w->iw, n);
        const mt_dsa_select_params sp = {
            .ih = ih, .id = id, .kpool = kp, .max_pools = c->index_topk / kp,
            .tail = c->index_kpool_always_select_tail, .max_sel = max_sel,
        };
        for (int i = 0; i < n; i++) {
            glm_layer_state *st = sts[i];
            const int t = st->len;
            op->copy(be, st->ki + (size_t)t * id, ki + (size_t)i * id, sizeof(float) * id);
            op->copy(be, st->gs + (size_t)t * id, gs + (size_t)i * id, sizeof(float) * id);
            if ((t + 1) % kp == 0) op->dsa_pool_keys(be, st->pool, st->ki, st->gs, w->ape, t / kp, t / kp + 1, kp, id);
            op->dsa_select(be, scr->sel + (size_t)i * max_sel, scr->nsel + i, qi + (size_t)i * ih * id,
                           iw + (size_t)i * ih, st->pool, t, 1, &sp);
        }
        scr->sel_t0 = GLM_SEL_MULTI;
        scr->sel_n = n;
    } else {
        MT_ASSERT(scr->sel_n == n && scr->sel_t0 == GLM_SEL_MULTI); /* the full layer just before */
    }
    const mt_mla_params mp = {
        .Hq = Hq, .dn = dn, .dv = dv, .kvl = kvl,
        .scale = 1.f / sqrtf((float)(dn + c->qk_rope_head_dim)),
    };
    for (int i = 0; i < n; i++) {
        glm_layer_state *st = sts[i];
        op->mla_sparse(be, o + (size_t)i * Hq * dv, q + (size_t)i * Hq * dn, st->latent, &w->kv_b,
                       scr->sel + (size_t)i * max_sel, scr->nsel + i, max_sel, st->len, 1, &mp);
        st->len++;
    }
    op->matmul(be, out, o, &w->o, n);
    return MT_OK;
}

mt_status glm_dsa_forward(const glm_layer *l, glm_layer_state **sts, int nst, mt_step *step,
                          const float *h, float *out, int n) {
    MT_ASSERT(nst == 1 || nst == n);
    if (nst > 1) return dsa_forward_multi(l, sts, step, h, out, n);
    glm_layer_state *st = sts[0];
    const glm_config *c = l->cfg;
    const glm_dsa_w *w = &l->dsa;
    mt_backend *be = step->be;
    const mt_backend_ops *op = be->ops;
    glm_scratch *scr = step->scr;
    const int t0 = step->t0, kvl = c->kv_lora_rank, id = c->index_head_dim, kp = c->index_kpool;
    float **b = scr->buf;
    float *qr = b[0], *q = b[1], *o = b[2], *qi = b[3], *iw = b[4];

    /* Graph form: cache rows are written at the run-time position through a scratch row, since
     * a captured graph keeps the pointers it was captured with. */
    const int32_t *dp = step->d_pos;
    MT_ASSERT(st->len == t0 && t0 + n <= st->cap);
    op->matmul(be, qr, h, &w->q_a, n);
    op->rmsnorm(be, qr, qr, w->q_a_norm, n, c->q_lora_rank, c->rms_norm_eps);
    op->matmul(be, q, qr, &w->q_b, n);
    float *lat = dp ? b[5] : st->latent + (size_t)t0 * kvl;
    op->matmul(be, lat, h, &w->kv_a, n);
    op->rmsnorm(be, lat, lat, w->kv_a_norm, n, kvl, c->rms_norm_eps);
    if (dp) op->copy_rows_at(be, st->latent, kvl, dp, lat, n);

    if (w->has_indexer) {
        float *ki = dp ? b[6] : st->ki + (size_t)t0 * id, *gs = dp ? b[7] : st->gs + (size_t)t0 * id;
        op->matmul(be, ki, h, &w->ik, n);
        op->layernorm(be, ki, ki, w->ik_norm_w, w->ik_norm_b, n, id, 1e-6f);
        op->matmul(be, gs, h, &w->igate, n);
        if (dp) {
            MT_ASSERT(n == 1);
            op->copy_rows_at(be, st->ki, id, dp, ki, 1);
            op->copy_rows_at(be, st->gs, id, dp, gs, 1);
            op->dsa_pool_keys_at(be, st->pool, st->ki, st->gs, w->ape, dp, kp, id);
        } else {
            const int p0 = t0 / kp, p1 = (t0 + n) / kp; /* pools completed by these rows */
            if (p1 > p0) op->dsa_pool_keys(be, st->pool, st->ki, st->gs, w->ape, p0, p1, kp, id);
        }
        op->matmul(be, qi, qr, &w->iq, n);
        op->matmul(be, iw, h, &w->iw, n);
        mt_dsa_select_params sp = {
            .ih = c->index_n_heads, .id = id, .kpool = kp, .max_pools = c->index_topk / kp,
            .tail = c->index_kpool_always_select_tail, .max_sel = glm_max_sel(c),
            .t0_dev = dp, .t_cap = st->cap,
        };
        op->dsa_select(be, scr->sel, scr->nsel, qi, iw, st->pool, t0, n, &sp);
        scr->sel_t0 = t0;
        scr->sel_n = n;
    } else {
        /* Shared: the previous layer (validated at load to be a full DSA layer) selected for
         * exactly these rows in this step. */
        MT_ASSERT(scr->sel_n == n && scr->sel_t0 == t0);
    }
    st->len = t0 + n;

    mt_mla_params mp = {
        .Hq = c->num_attention_heads, .dn = c->qk_nope_head_dim, .dv = c->v_head_dim, .kvl = kvl,
        .scale = 1.f / sqrtf((float)(c->qk_nope_head_dim + c->qk_rope_head_dim)),
        .t0_dev = dp, .t_cap = st->cap,
    };
    op->mla_sparse(be, o, q, st->latent, &w->kv_b, scr->sel, scr->nsel, glm_max_sel(c), t0, n, &mp);
    op->matmul(be, out, o, &w->o, n);
    return MT_OK;
}
