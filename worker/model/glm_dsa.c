/* worker/model/glm_dsa.c: the DSA mixer (MODEL.md "DSA mixer"): MLA without RoPE whose latent c
 * is the KV cache, attending only over the positions its indexer selects. A "full" layer runs
 * its own indexer (keys, gate scores and pool keys cached per sequence) and leaves its selection
 * in the step scratch; the "shared" layer right after it reuses that selection. Rows and states as
 * in glm_kda.c: one sequence's consecutive positions (nst == 1), or one row per sequence (the rows
 * form, when the step carries pointer tables). */
#include <math.h>

#include "worker/model/glm_impl.h"

/* Batched decode, the rows form: row i is the next position rpos[i] of its own sequence, whose
 * caches the step's pointer tables give (glm_rtab). Projections run over all rows; the cache
 * writes, pool keys, selection and attention are one rows op each, every row at its own position.
 * The host-tracked cache lengths are not touched here: the model moves them with the layer's
 * sync_replayed_step hook after the step, eager or replayed alike. */
static mt_status dsa_forward_rows(const glm_layer *l, mt_step *step, const float *h, float *out, int n) {
    const glm_config *c = l->cfg;
    const glm_dsa_w *w = &l->dsa;
    mt_backend *be = step->be;
    const mt_backend_ops *op = be->ops;
    glm_scratch *scr = step->scr;
    const int kvl = c->kv_lora_rank, id = c->index_head_dim, kp = c->index_kpool, ih = c->index_n_heads;
    const int Hq = c->num_attention_heads, dn = c->qk_nope_head_dim, dv = c->v_head_dim;
    const int max_sel = glm_max_sel(c);
    const int32_t *pos = step->rpos;
    float **b = scr->buf;
    float *qr = b[0], *q = b[1], *o = b[2], *qi = b[3], *iw = b[4], *lat = b[5], *ki = b[6], *gs = b[7];

    op->matmul(be, qr, h, &w->q_a, n);
    op->rmsnorm(be, qr, qr, w->q_a_norm, n, c->q_lora_rank, c->rms_norm_eps);
    op->matmul(be, q, qr, &w->q_b, n);
    op->matmul(be, lat, h, &w->kv_a, n);
    op->rmsnorm(be, lat, lat, w->kv_a_norm, n, kvl, c->rms_norm_eps);
    op->copy_rows_to(be, glm_rtab(step, GLM_R_LATENT), kvl, pos, lat, n);
    if (w->has_indexer) {
        op->matmul(be, ki, h, &w->ik, n);
        op->layernorm(be, ki, ki, w->ik_norm_w, w->ik_norm_b, n, id, 1e-6f);
        op->matmul(be, gs, h, &w->igate, n);
        op->matmul(be, qi, qr, &w->iq, n);
        op->matmul(be, iw, h, &w->iw, n);
        op->copy_rows_to(be, glm_rtab(step, GLM_R_KI), id, pos, ki, n);
        op->copy_rows_to(be, glm_rtab(step, GLM_R_GS), id, pos, gs, n);
        op->dsa_pool_keys_rows(be, glm_rtab(step, GLM_R_POOL), (const float *const *)glm_rtab(step, GLM_R_KI),
                               (const float *const *)glm_rtab(step, GLM_R_GS), w->ape, pos, n, kp, id);
        const mt_dsa_select_params sp = {
            .ih = ih, .id = id, .kpool = kp, .max_pools = c->index_topk / kp,
            .tail = c->index_kpool_always_select_tail, .max_sel = max_sel, .t_cap = step->rt_cap,
        };
        op->dsa_select_rows(be, scr->sel, scr->nsel, qi, iw, (const float *const *)glm_rtab(step, GLM_R_POOL), pos,
                            n, &sp);
        scr->sel_t0 = GLM_SEL_MULTI;
        scr->sel_n = n;
    } else {
        MT_ASSERT(scr->sel_n == n && scr->sel_t0 == GLM_SEL_MULTI); /* the full layer just before */
    }
    const mt_mla_params mp = {
        .Hq = Hq, .dn = dn, .dv = dv, .kvl = kvl,
        .scale = 1.f / sqrtf((float)(dn + c->qk_rope_head_dim)), .t_cap = step->rt_cap,
    };
    op->mla_sparse_rows(be, o, q, (const float *const *)glm_rtab(step, GLM_R_LATENT), &w->kv_b, scr->sel,
                        scr->nsel, max_sel, pos, n, &mp);
    op->matmul(be, out, o, &w->o, n);
    return MT_OK;
}

mt_status glm_dsa_forward(const glm_layer *l, glm_layer_state **sts, int nst, mt_step *step,
                          const float *h, float *out, int n) {
    if (step->rtab) {
        MT_ASSERT(nst == n);
        return dsa_forward_rows(l, step, h, out, n);
    }
    MT_ASSERT(nst == 1);
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
