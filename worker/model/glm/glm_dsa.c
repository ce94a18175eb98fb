/* worker/model/glm/glm_dsa.c: the DSA mixer (docs/MODEL.md, "DSA mixer"): MLA without RoPE whose latent c
 * is the KV cache, attending only over the positions its indexer selects. A "full" layer runs
 * its own indexer (keys, gate scores and pool keys cached per sequence, in the layer's pages that the
 * sequence's block table maps, as the latent is) and leaves its selection
 * in the step scratch; the "shared" layer right after it reuses that selection. Rows and states as
 * in glm_kda.c: one sequence's consecutive positions (nst == 1), or one row per sequence (the rows
 * form, when the step carries pointer tables). */
#include <math.h>

#include "worker/model/glm/glm_impl.h"

/* The layer's paged caches (kernels/backend.h mt_paged), shared by every sequence; a sequence
 * reaches its rows through its block table. */
typedef struct dsa_caches {
    mt_paged latent;           /* [n_pages, page, kvl] */
    mt_paged ki, gs;           /* [n_pages, page, id] (full layers) */
    mt_paged pk;               /* [n_pages, page / kpool, id]: addressed by pool index */
} dsa_caches;

static dsa_caches dsa_caches_of(const glm_layer *l) {
    const glm_config *c = l->cfg;
    const int id = c->index_head_dim, kp = c->index_kpool;
    MT_ASSERT(l->page > 0 && l->page % kp == 0);
    return (dsa_caches){
        .latent = { l->pg_latent, l->page, c->kv_lora_rank },
        .ki = { l->pg_ki, l->page, id },
        .gs = { l->pg_gs, l->page, id },
        .pk = { l->pg_pk, l->page / kp, id },
    };
}

/* The scratch rows of one DSA step, each [n, width]: the q path (qr, q), the attention output
 * o, the indexer's queries and head weights (qi, iw), and this step's cache rows before they are
 * written into the pages (lat, ki, gs). */
typedef struct dsa_bufs {
    float *qr, *q, *o, *qi, *iw, *lat, *ki, *gs;
} dsa_bufs;

static dsa_bufs dsa_bufs_of(const glm_scratch *scr) {
    float *const *b = scr->buf;
    return (dsa_bufs){ b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7] };
}

/* The projections every form shares: the q path and the latent, and for a layer with its own
 * indexer its keys, gate scores, queries and head weights. */
static void dsa_project(const glm_layer *l, mt_backend *be, const float *h, const dsa_bufs *x, int n) {
    const glm_config *c = l->cfg;
    const glm_dsa_w *w = &l->dsa;
    const mt_backend_ops *op = be->ops;
    /* every projection of h together: q_a, kv_a, and the indexer's keys, gate scores and head
     * weights; then the ones of the normed q_a output together: q_b and the indexer's queries */
    const mt_weight *wh[5] = GLM_DSA_IN_GROUP(w);
    float *yh[5] = { x->qr, x->lat, x->ki, x->gs, x->iw };
    glm_matmul_multi(be, yh, h, wh, GLM_DSA_IN_COUNT(w), n, 0u);
    op->rmsnorm(be, x->qr, x->qr, w->q_a_norm, n, c->q_lora_rank, c->rms_norm_eps);
    const mt_weight *wq[2] = GLM_DSA_Q_GROUP(w);
    float *yq[2] = { x->q, x->qi };
    glm_matmul_multi(be, yq, x->qr, wq, GLM_DSA_Q_COUNT(w), n, 0u);
    op->rmsnorm(be, x->lat, x->lat, w->kv_a_norm, n, c->kv_lora_rank, c->rms_norm_eps);
    if (w->has_indexer) op->layernorm(be, x->ki, x->ki, w->ik_norm_w, w->ik_norm_b, n, c->index_head_dim, 1e-6f);
}

/* Selection and sparse-MLA parameters; t0_dev and t_cap as kernels/backend.h says per form. */
static mt_dsa_select_params dsa_select_params(const glm_config *c, const int32_t *t0_dev, int t_cap) {
    return (mt_dsa_select_params){
        .ih = c->index_n_heads, .id = c->index_head_dim, .kpool = c->index_kpool,
        .max_pools = c->index_topk / c->index_kpool, .tail = c->index_kpool_always_select_tail,
        .max_sel = glm_max_sel(c), .t0_dev = t0_dev, .t_cap = t_cap,
    };
}

static mt_mla_params dsa_mla_params(const glm_config *c, const int32_t *t0_dev, int t_cap) {
    return (mt_mla_params){
        .Hq = c->num_attention_heads, .dn = c->qk_nope_head_dim, .dv = c->v_head_dim, .kvl = c->kv_lora_rank,
        .scale = 1.f / sqrtf((float)(c->qk_nope_head_dim + c->qk_rope_head_dim)), .t0_dev = t0_dev, .t_cap = t_cap,
    };
}

/* Batched decode, the rows form: row i is the next position rpos[i] of its own sequence, whose
 * block table the step's GLM_R_BT table gives (glm_rtab). Projections run over all rows; the cache
 * writes, pool keys, selection and attention are one rows op each, every row at its own position
 * through its own block table. The host-tracked cache lengths are not touched here: the model
 * moves them with the layer's sync_replayed_step hook after the step, eager or replayed alike. */
static mt_status dsa_forward_rows(const glm_layer *l, mt_step *step, const float *h, float *out, int n) {
    const glm_config *c = l->cfg;
    const glm_dsa_w *w = &l->dsa;
    mt_backend *be = step->be;
    const mt_backend_ops *op = be->ops;
    glm_scratch *scr = step->scr;
    const int32_t *pos = step->rpos;
    const int32_t *const *bts = (const int32_t *const *)glm_rtab(step, GLM_R_BT);
    const dsa_caches pc = dsa_caches_of(l);
    const dsa_bufs x = dsa_bufs_of(scr);

    dsa_project(l, be, h, &x, n);
    /* this step's cache rows: the latent, and for a full layer its indexer keys and gate scores */
    const mt_paged cd[3] = { pc.latent, pc.ki, pc.gs };
    const float *cs[3] = { x.lat, x.ki, x.gs };
    const int nc = w->has_indexer ? 3 : 1;
    if (op->copy_rows_to_n) {
        op->copy_rows_to_n(be, cd, cs, nc, bts, pos, n);
    } else {
        for (int j = 0; j < nc; j++) op->copy_rows_to(be, cd[j], bts, pos, cs[j], n);
    }
    if (w->has_indexer) {
        op->dsa_pool_keys_rows(be, pc.pk, pc.ki, pc.gs, bts, w->ape, pos, n, c->index_kpool);
        const mt_dsa_select_params sp = dsa_select_params(c, NULL, step->rt_cap);
        op->dsa_select_rows(be, scr->sel, scr->nsel, x.qi, x.iw, pc.pk, bts, pos, n, &sp);
        scr->sel_t0 = GLM_SEL_MULTI;
        scr->sel_n = n;
    } else {
        MT_ASSERT(scr->sel_n == n && scr->sel_t0 == GLM_SEL_MULTI); /* the full layer just before */
    }
    const mt_mla_params mp = dsa_mla_params(c, NULL, step->rt_cap);
    op->mla_sparse_rows(be, x.o, x.q, pc.latent, bts, &w->kv_b, scr->sel, scr->nsel, glm_max_sel(c), pos, n, &mp);
    op->matmul(be, out, x.o, &w->o, n);
    return MT_OK;
}

/* x's rows from row r on: each buffer advanced by r rows of its own width. */
static dsa_bufs dsa_bufs_at(const glm_layer *l, const dsa_bufs *x, int r) {
    const glm_dsa_w *w = &l->dsa;
    const size_t R = (size_t)r;
    return (dsa_bufs){ x->qr + R * w->q_a.rows, x->q + R * w->q_b.rows, x->o + R * w->o.cols,
                       x->qi + R * w->iq.rows,  x->iw + R * w->iw.rows, x->lat + R * w->kv_a.rows,
                       x->ki + R * w->ik.rows,  x->gs + R * w->igate.rows };
}

/* One sequence's n consecutive rows from position t0 after dsa_project (x): their cache rows into
 * the pages through the block table with one paged write each (copy_rows_at), at host position
 * t0 (prefill, eager decode), or, in the graph form, at the run-time position dp (a captured
 * graph keeps the arguments it was captured with; the block table is read at run time, so blocks
 * mapped later are found); the pool keys they complete, the selection (into scr, or the full
 * layer's there for a shared one) and the sparse attention into x->o. */
static void dsa_attend_seq(const glm_layer *l, mt_backend *be, glm_layer_state *st, glm_scratch *scr,
                           const dsa_bufs *xp, int t0, const int32_t *dp, int n) {
    const glm_config *c = l->cfg;
    const glm_dsa_w *w = &l->dsa;
    const mt_backend_ops *op = be->ops;
    const int kp = c->index_kpool;
    const dsa_caches pc = dsa_caches_of(l);
    const int32_t *bt = st->bt;
    const dsa_bufs x = *xp;
    MT_ASSERT(st->len == t0 && t0 + n <= st->cap && bt);
    op->copy_rows_at(be, pc.latent, bt, t0, dp, x.lat, n);
    if (w->has_indexer) {
        op->copy_rows_at(be, pc.ki, bt, t0, dp, x.ki, n);
        op->copy_rows_at(be, pc.gs, bt, t0, dp, x.gs, n);
        if (dp) { /* the graph form: row i at position dp[i] (consecutive positions) */
            for (int i = 0; i < n; i++) op->dsa_pool_keys_at(be, pc.pk, pc.ki, pc.gs, bt, w->ape, dp + i, kp);
        } else {
            const int p0 = t0 / kp, p1 = (t0 + n) / kp; /* pools completed by these rows */
            if (p1 > p0) op->dsa_pool_keys(be, pc.pk, pc.ki, pc.gs, bt, w->ape, p0, p1, kp);
        }
        const mt_dsa_select_params sp = dsa_select_params(c, dp, st->cap);
        op->dsa_select(be, scr->sel, scr->nsel, x.qi, x.iw, pc.pk, bt, t0, n, &sp);
        scr->sel_t0 = t0;
        scr->sel_n = n;
    } else {
        /* Shared: the previous layer (validated at load to be a full DSA layer) selected for
         * exactly these rows in this step. */
        MT_ASSERT(scr->sel_n == n && scr->sel_t0 == t0);
    }
    st->len = t0 + n;

    const mt_mla_params mp = dsa_mla_params(c, dp, st->cap);
    op->mla_sparse(be, x.o, x.q, pc.latent, bt, &w->kv_b, scr->sel, scr->nsel, glm_max_sel(c), t0, n, &mp);
}

mt_status glm_dsa_forward(const glm_layer *l, glm_layer_state **sts, int nst, mt_step *step,
                          const float *h, float *out, int n) {
    if (step->rtab) {
        MT_ASSERT(nst == n);
        return dsa_forward_rows(l, step, h, out, n);
    }
    MT_ASSERT(nst == 1);
    const dsa_bufs x = dsa_bufs_of(step->scr);
    dsa_project(l, step->be, h, &x, n);
    dsa_attend_seq(l, step->be, sts[0], step->scr, &x, step->t0, step->d_pos, n);
    step->be->ops->matmul(step->be, out, x.o, &l->dsa.o, n);
    return MT_OK;
}

mt_status glm_dsa_forward_chunks(const glm_layer *l, glm_layer_state **sts, glm_segment *seg, int ns,
                                 mt_step *step, const float *h, float *out, int n) {
    const dsa_bufs x = dsa_bufs_of(step->scr);
    dsa_project(l, step->be, h, &x, n);
    int r = 0;
    for (int i = 0; i < ns; r += seg[i++].n) {
        const dsa_bufs xi = dsa_bufs_at(l, &x, r);
        dsa_attend_seq(l, step->be, sts[i], &seg[i].scr, &xi, seg[i].t0, NULL, seg[i].n);
    }
    MT_ASSERT(r == n);
    step->be->ops->matmul(step->be, out, x.o, &l->dsa.o, n);
    return MT_OK;
}
