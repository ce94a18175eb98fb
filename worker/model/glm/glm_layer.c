/* worker/model/glm/glm_layer.c: the GLM decoder layer behind the layer contract (layer.h): the
 * attention site (hyper-connection, input_layernorm, KDA or DSA mixer) then the MLP site
 * (hyper-connection, post_attention_layernorm, dense MLP or MoE). Also the per-sequence state,
 * the DSA graph hooks and the DSA indexer-cache aux state. */
#include <stdlib.h>
#include <string.h>

#include "worker/model/glm/glm_impl.h"

static const glm_layer *as_glm(const mt_layer *l) { return (const glm_layer *)l; }

int glm_max_sel(const glm_config *c) {
    return c->index_topk + (c->index_kpool_always_select_tail ? c->index_kpool - 1 : 0);
}

int glm_scratch_width(const glm_config *c) {
    const int dims[] = {
        c->linear_num_heads * c->linear_head_dim,
        c->num_attention_heads * c->qk_nope_head_dim,
        c->num_attention_heads * c->v_head_dim,
        c->index_n_heads * c->index_head_dim,
        c->q_lora_rank,
        c->kv_lora_rank,
        c->n_routed_experts,
        c->intermediate_size,
        c->moe_intermediate_size * c->n_shared_experts,
        c->hidden_size,
    };
    int w = 0;
    for (size_t i = 0; i < sizeof dims / sizeof dims[0]; i++)
        if (dims[i] > w) w = dims[i];
    return w;
}

/* ---- state ---- */

/* The state struct only: the memory it points at is the model's pools (glm_model.c maps a KDA
 * slot and the sequence's block table into it when it makes the sequence). */
static void release_state(const mt_layer *ml, mt_layer_state *base) {
    if (!base) return;
    glm_ple_state_free(as_glm(ml), (glm_layer_state *)base);
    free(base);
}

static mt_status alloc_state(const mt_layer *ml, int max_tokens, mt_layer_state **out, mt_error *err) {
    glm_layer_state *st = calloc(1, sizeof *st);
    if (!st) return mt_errorf(err, MT_ERR_NOMEM, "layer %d: out of memory for state", ml->index);
    st->base.layer = ml;
    st->cap = max_tokens;
    if (as_glm(ml)->ple.on) {
        mt_status s = glm_ple_state_alloc(as_glm(ml), st, err);
        if (s != MT_OK) {
            free(st);
            return s;
        }
    }
    *out = &st->base;
    return MT_OK;
}

/* ---- compute ---- */

/* scr->h = rmsnorm(hc_pre's y) * norm_w, fused where the backend offers it. */
static void hc_pre_norm(mt_backend *be, glm_scratch *scr, const float *X, const glm_hc_w *hc, const float *norm_w,
                        const mt_hc_params *hp, int n) {
    if (be->ops->hc_pre_norm) {
        be->ops->hc_pre_norm(be, scr->h, scr->y, scr->post, scr->comb, X, &hc->fn, hc->base, hc->scale, norm_w, hp, n);
        return;
    }
    be->ops->hc_pre(be, scr->y, scr->post, scr->comb, X, &hc->fn, hc->base, hc->scale, hp, n);
    be->ops->rmsnorm(be, scr->h, scr->y, norm_w, n, hp->H, hp->rms_eps);
}

static mt_status mixer_forward(const glm_layer *l, glm_layer_state **sts, int nst, mt_step *step,
                               const float *h, float *out, int n) {
    return l->cfg->layer_types[l->base.index] == GLM_MIXER_KDA ? glm_kda_forward(l, sts, nst, step, h, out, n)
                                                                : glm_dsa_forward(l, sts, nst, step, h, out, n);
}

/* A mixed step's segments [i0, nseg) (rows from r0 of h and out): prompt chunks together through
 * the mixer's chunks form, so that they read its weights once; with a verify among them, or in
 * the graph form, segment by segment. */
static mt_status mixer_segments(const glm_layer *l, glm_layer_state **sts, mt_step *step, int i0, int r0,
                                const float *h, float *out) {
    const size_t H = (size_t)l->cfg->hidden_size;
    bool together = !step->d_pos;
    int rows = 0;
    for (int i = i0; i < step->nseg; i++) {
        together = together && !step->seg[i].vring;
        rows += step->seg[i].n;
    }
    if (together && l->cfg->layer_types[l->base.index] == GLM_MIXER_KDA)
        return glm_kda_forward_chunks(l, sts + i0, step->seg + i0, step->nseg - i0, step, h + r0 * H, out + r0 * H,
                                      rows);
    if (together)
        return glm_dsa_forward_chunks(l, sts + i0, step->seg + i0, step->nseg - i0, step, h + r0 * H, out + r0 * H,
                                      rows);
    mt_status s = MT_OK;
    for (int i = i0, r = r0; i < step->nseg && s == MT_OK; r += step->seg[i++].n) {
        mt_step one = *step;
        one.t0 = step->seg[i].t0;
        one.scr = &step->seg[i].scr;
        one.seg = NULL;
        one.rpos = NULL;
        one.rtab = NULL;
        one.vring = step->seg[i].vring;
        one.vring_id = step->seg[i].vring_id;
        s = mixer_forward(l, &sts[i], 1, &one, h + r * H, out + r * H, step->seg[i].n);
    }
    return s;
}

/* n rows through the decoder layer: nst == 1 state for n consecutive positions of one sequence,
 * nst == n states, one row per sequence (see glm_kda.c), or, with step->seg, nst segments of
 * consecutive rows of one sequence each (the mixed step). With step->mlp_rows (layered sites) the
 * MLP site takes n_mlp rows instead: fewer (a group's rows stop after the attention site) or
 * more (rows [n, n_mlp) start at the MLP site, their highway rows past the attention site). */
static mt_status layer_forward(const mt_layer *ml, glm_layer_state **sts, int nst, mt_step *step,
                               float *X, int n) {
    const glm_layer *l = as_glm(ml);
    const glm_config *c = l->cfg;
    mt_backend *be = step->be;
    glm_scratch *scr = step->scr;
    const int nm = step->mlp_rows ? step->n_mlp : n; /* rows through the MLP site */
    MT_ASSERT(n <= scr->rows && nm <= scr->rows);
    const mt_hc_params hp = { c->hc_mult, c->hidden_size, c->rms_norm_eps, c->hc_eps, c->hc_sinkhorn_iters };
    mt_status s = MT_OK;
    if (n > 0) { /* the attention site (none for a layered group's rows alone at their MLP site) */
        if (l->ple.on && (s = glm_ple_forward(l, sts, nst, step, X, n)) != MT_OK)
            return s; /* into the highway first */
        hc_pre_norm(be, scr, X, &l->hc[0], l->in_norm, &hp, n);
        if (step->seg) {
            /* a mixed step: its decode rows through the batched decode's mixer at once (one launch
             * for all of them, not one a row), then each prompt chunk's rows with its own state */
            if (step->nrows > 0) {
                mt_step rows = *step;
                rows.seg = NULL;
                rows.t0 = -1;
                const glm_vblock *vb = step->vblk;
                if (vb && c->layer_types[l->base.index] == GLM_MIXER_KDA) {
                    /* the KDA's row order (glm_vblock): gathered into y, its output back from h */
                    be->ops->copy_rows_from(be, scr->y, vb->gather, step->nrows, c->hidden_size);
                    s = mixer_forward(l, sts, step->nrows, &rows, scr->y, scr->h, step->nrows);
                    be->ops->copy_rows_ptr(be, vb->scatter_dst, vb->scatter_src, step->nrows, c->hidden_size);
                } else {
                    s = mixer_forward(l, sts, step->nrows, &rows, scr->h, scr->a, step->nrows);
                }
            }
            const int nb = step->vblk ? step->nbparts : step->nrows;
            if (s == MT_OK && nb < step->nseg) s = mixer_segments(l, sts, step, nb, step->nrows, scr->h, scr->a);
        } else {
            s = mixer_forward(l, sts, nst, step, scr->h, scr->a, n);
        }
        if (s == MT_OK) s = glm_all_reduce(l->comm, scr->a, (size_t)n * c->hidden_size); /* heads' partial sums */
        if (s != MT_OK) return s;
        /* the mixer's hc_post and the MLP site's hc_pre, fused where the backend offers it (the
         * MLP site's hc_pre only for its rows: a group stopping here leaves its rows at hc_post) */
        if (be->ops->hc_post_pre_norm && nm >= n) {
            be->ops->hc_post_pre_norm(be, X, scr->a, scr->h, scr->y, scr->post, scr->comb, &l->hc[1].fn,
                                      l->hc[1].base, l->hc[1].scale, l->post_norm, &hp, n);
        } else {
            be->ops->hc_post(be, X, scr->a, scr->post, scr->comb, &hp, n);
            if (nm > 0) hc_pre_norm(be, scr, X, &l->hc[1], l->post_norm, &hp, nm < n ? nm : n);
        }
    }
    if (nm > n) { /* a layered group's rows that ran this attention site in an earlier step */
        const size_t H = (size_t)c->hidden_size, S = (size_t)c->hc_mult;
        glm_scratch g = *scr;
        g.h += n * H;
        g.y += n * H;
        g.post += n * S;
        g.comb += n * S * S;
        hc_pre_norm(be, &g, X + n * S * H, &l->hc[1], l->post_norm, &hp, nm - n);
    }
    if (nm == 0) return MT_OK; /* a layered group's rows alone, stopping after the attention site */
    int done = nm; /* rows that leave the MLP site complete */
    if (step->xparts > 0 && nm > step->xr0) { /* a layered group's rows through parts of the experts */
        glm_mlp_forward_parts(l, step, scr->h, scr->a, nm);
        if (step->xq1 < step->xparts) done = step->xr0;
    } else {
        glm_mlp_forward(l, step, scr->h, scr->a, nm);
    }
    if ((s = glm_all_reduce(l->comm, scr->a, (size_t)nm * c->hidden_size)) != MT_OK) return s; /* intermediate's */
    if (done > 0) be->ops->hc_post(be, X, scr->a, scr->post, scr->comb, &hp, done);
    return MT_OK;
}

static mt_status layer_prefill(const mt_layer *ml, mt_layer_state *base, mt_step *step, float *X, int n) {
    glm_layer_state *st = (glm_layer_state *)base;
    return layer_forward(ml, &st, 1, step, X, n);
}

/* One row per sequence; every state is this layer's (mt_layer_state is the first member). */
static mt_status layer_decode_multi(const mt_layer *ml, mt_layer_state **sts, int nseq, mt_step *step,
                                    float *X) {
    return layer_forward(ml, (glm_layer_state **)sts, nseq, step, X, nseq);
}

/* A mixed step: segment i of step->seg is rows of sts[i]. */
static mt_status layer_forward_segments(const mt_layer *ml, mt_layer_state **sts, int nseq, mt_step *step,
                                        float *X, int n) {
    MT_ASSERT(step->seg && step->nseg == nseq);
    return layer_forward(ml, (glm_layer_state **)sts, nseq, step, X, n);
}

/* ---- DSA graph hooks: the host-tracked cache length must follow replayed steps ---- */

static mt_status dsa_check_replay_room(const mt_layer *ml, const mt_layer_state *base, int seq_len, int k) {
    (void)ml;
    const glm_layer_state *st = (const glm_layer_state *)base;
    return seq_len + k <= st->cap ? MT_OK : MT_ERR_FULL;
}

static mt_status dsa_sync_replayed_step(const mt_layer *ml, mt_layer_state *base, int seq_len, int k) {
    (void)ml;
    glm_layer_state *st = (glm_layer_state *)base;
    if (st->len < seq_len) return MT_ERR_STATE; /* behind: a step was lost */
    if (seq_len + k > st->cap) return MT_ERR_FULL;
    st->len = seq_len + k;                       /* rewinds when ahead, then advances by k */
    return MT_OK;
}

/* The host-side length a captured step advances while it records; a failed capture rewinds it. */
static mt_status dsa_decode_prestage(const mt_layer *ml, mt_layer_state *base, int32_t token) {
    (void)ml;
    (void)token;
    glm_layer_state *st = (glm_layer_state *)base;
    st->prestage_len = st->len;
    return MT_OK;
}

static void dsa_decode_prestage_rearm(const mt_layer *ml, mt_layer_state *base) {
    (void)ml;
    glm_layer_state *st = (glm_layer_state *)base;
    st->len = st->prestage_len;
}

/* ---- DSA paged caches from the host side (aux state, state copies) ---- */

/* Blocks [0, nb) of st's block table, downloaded into *out (host memory the caller frees; NULL when
 * nb == 0). */
static mt_status dsa_bt_download(const glm_layer *l, const glm_layer_state *st, int nb, int32_t **out,
                                 mt_error *err) {
    *out = NULL;
    if (nb == 0) return MT_OK;
    MT_ASSERT(st->bt && nb <= st->cap / l->page + 1);
    int32_t *bt = malloc(sizeof(int32_t) * (size_t)nb);
    if (!bt) return mt_errorf(err, MT_ERR_NOMEM, "layer %d: out of memory for a block table", l->base.index);
    l->be->ops->download(l->be, bt, st->bt, sizeof(int32_t) * (size_t)nb);
    *out = bt;
    return MT_OK;
}

/* Blocks b, b+1, ... that sit on consecutive pages (bt[b+k] == bt[b] + k): the rows of such a run
 * are one stretch of memory. Returns the run's length in blocks (>= 1), up to nb - b. */
static int dsa_run(const int32_t *bt, int b, int nb) {
    int k = 1;
    while (b + k < nb && bt[b + k] == bt[b] + k) k++;
    return k;
}

/* Rows [0, count) of the paged cache c (block table bt, host copy) into to_host, or from from_host
 * (the other NULL), host [count, c.row] fp32 at any byte alignment; one transfer per run of
 * consecutive pages. */
static void dsa_paged_transfer(mt_backend *be, mt_paged c, const int32_t *bt, int64_t count, char *to_host,
                               const char *from_host) {
    const int nb = (int)((count + c.page - 1) / c.page);
    const size_t rb = sizeof(float) * (size_t)c.row;
    for (int b = 0; b < nb;) {
        const int k = dsa_run(bt, b, nb);
        const int64_t r0 = (int64_t)b * c.page, r1 = (int64_t)(b + k) * c.page < count ? (int64_t)(b + k) * c.page : count;
        float *dev = mt_paged_at(c, bt, r0);
        if (to_host) be->ops->download(be, to_host + (size_t)r0 * rb, dev, (size_t)(r1 - r0) * rb);
        else be->ops->upload(be, dev, from_host + (size_t)r0 * rb, (size_t)(r1 - r0) * rb);
        b += k;
    }
}

/* The indexer caches of a full layer: keys and gate scores by position, pool keys by pool. */
static void dsa_index_caches(const glm_layer *l, mt_paged *ki, mt_paged *gs, mt_paged *pk) {
    const int id = l->cfg->index_head_dim, kp = l->cfg->index_kpool;
    MT_ASSERT(l->page > 0 && l->page % kp == 0);
    *ki = (mt_paged){ l->pg_ki, l->page, id };
    *gs = (mt_paged){ l->pg_gs, l->page, id };
    *pk = (mt_paged){ l->pg_pk, l->page / kp, id };
}

/* ---- DSA aux state: the indexer cache (keys, gate scores, pool keys) and its length ---- */

static bool dsa_has_aux(const mt_layer *ml) { return as_glm(ml)->dsa.has_indexer; }

/* The snapshot is position-ordered and page-free: header, ki [len, id], gs [len, id], pool keys
 * [len / kpool, id], gathered from the pages through the sequence's block table. */
typedef struct aux_header {
    uint32_t magic;            /* 'DSAX' */
    int32_t len, id, kpool;
} aux_header;
#define AUX_MAGIC 0x58415344u

static mt_status dsa_snapshot_aux(const mt_layer *ml, const mt_layer_state *base, void **bytes,
                                  size_t *len, mt_error *err) {
    const glm_layer *l = as_glm(ml);
    const glm_layer_state *st = (const glm_layer_state *)base;
    mt_backend *be = l->be;
    const int id = l->cfg->index_head_dim, kp = l->cfg->index_kpool, np = st->len / kp;
    const size_t kb = sizeof(float) * (size_t)st->len * id, pb = sizeof(float) * (size_t)np * id;
    const size_t total = sizeof(aux_header) + 2 * kb + pb;
    int32_t *bt = NULL;
    mt_status s = dsa_bt_download(l, st, (st->len + l->page - 1) / l->page, &bt, err);
    if (s != MT_OK) return s;
    char *p = malloc(total);
    if (!p) {
        free(bt);
        return mt_errorf(err, MT_ERR_NOMEM, "layer %d: out of memory for an aux snapshot", ml->index);
    }
    aux_header hd = { AUX_MAGIC, st->len, id, kp };
    memcpy(p, &hd, sizeof hd);
    mt_paged ki, gs, pk;
    dsa_index_caches(l, &ki, &gs, &pk);
    char *h = p + sizeof hd;
    dsa_paged_transfer(be, ki, bt, st->len, h, NULL);
    dsa_paged_transfer(be, gs, bt, st->len, h + kb, NULL);
    dsa_paged_transfer(be, pk, bt, np, h + 2 * kb, NULL);
    free(bt);
    *bytes = p;
    *len = total;
    return MT_OK;
}

/* Scatters a snapshot into the pages of st's block table, which must map the blocks of positions
 * [0, len) already (the model maps them before restoring). */
static mt_status dsa_restore_aux(const mt_layer *ml, mt_layer_state *base, const void *bytes, size_t len,
                                 mt_error *err) {
    const glm_layer *l = as_glm(ml);
    glm_layer_state *st = (glm_layer_state *)base;
    mt_backend *be = l->be;
    aux_header hd;
    if (len < sizeof hd) return mt_errorf(err, MT_ERR_INVALID, "layer %d: aux snapshot too short", ml->index);
    memcpy(&hd, bytes, sizeof hd);
    const int id = l->cfg->index_head_dim, kp = l->cfg->index_kpool;
    if (hd.magic != AUX_MAGIC || hd.id != id || hd.kpool != kp || hd.len < 0)
        return mt_errorf(err, MT_ERR_INVALID, "layer %d: aux snapshot is not this layer's indexer cache", ml->index);
    if (hd.len > st->cap)
        return mt_errorf(err, MT_ERR_FULL, "layer %d: aux snapshot of %d positions exceeds capacity %d",
                         ml->index, hd.len, st->cap);
    const size_t kb = sizeof(float) * (size_t)hd.len * id, pb = sizeof(float) * (size_t)(hd.len / kp) * id;
    if (len != sizeof hd + 2 * kb + pb)
        return mt_errorf(err, MT_ERR_INVALID, "layer %d: aux snapshot size %zu, expected %zu", ml->index, len,
                         sizeof hd + 2 * kb + pb);
    int32_t *bt = NULL;
    mt_status s = dsa_bt_download(l, st, (hd.len + l->page - 1) / l->page, &bt, err);
    if (s != MT_OK) return s;
    const char *h = (const char *)bytes + sizeof hd;
    mt_paged ki, gs, pk;
    dsa_index_caches(l, &ki, &gs, &pk);
    dsa_paged_transfer(be, ki, bt, hd.len, NULL, h);
    dsa_paged_transfer(be, gs, bt, hd.len, NULL, h + kb);
    dsa_paged_transfer(be, pk, bt, hd.len / kp, NULL, h + 2 * kb);
    free(bt);
    st->len = hd.len;
    return MT_OK;
}

/* ---- layers with a PLE memory: its hooks beside the mixer's, its snapshot after the DSA one ---- */

static bool is_dsa(const glm_layer *l) { return l->cfg->layer_types[l->base.index] == GLM_MIXER_DSA; }

static mt_status ple_decode_prestage(const mt_layer *ml, mt_layer_state *base, int32_t token) {
    if (is_dsa(as_glm(ml))) dsa_decode_prestage(ml, base, token);
    return glm_ple_prestage(as_glm(ml), (glm_layer_state *)base, token);
}

static void ple_decode_prestage_rearm(const mt_layer *ml, mt_layer_state *base) {
    if (is_dsa(as_glm(ml))) dsa_decode_prestage_rearm(ml, base);
    glm_ple_rearm((glm_layer_state *)base);
}

static mt_status ple_check_replay_room(const mt_layer *ml, const mt_layer_state *base, int seq_len, int k) {
    return is_dsa(as_glm(ml)) ? dsa_check_replay_room(ml, base, seq_len, k) : MT_OK;
}

static mt_status ple_sync_replayed_step(const mt_layer *ml, mt_layer_state *base, int seq_len, int k) {
    glm_ple_sync((glm_layer_state *)base);
    return is_dsa(as_glm(ml)) ? dsa_sync_replayed_step(ml, base, seq_len, k) : MT_OK;
}

/* The memory's part of a verify's rollback; the mixer's (DSA lengths, KDA slots) is the model's. */
static mt_status ple_verify_keep(const mt_layer *ml, mt_layer_state *base, int keep, int ring) {
    return glm_ple_keep(as_glm(ml), (glm_layer_state *)base, keep, ring);
}

static bool ple_has_aux(const mt_layer *ml) { (void)ml; return true; }

/* The mixer's aux part (the DSA indexer cache, when the layer has one), then the memory's. */
static mt_status ple_snapshot_aux(const mt_layer *ml, const mt_layer_state *base, void **bytes, size_t *len,
                                  mt_error *err) {
    const glm_layer *l = as_glm(ml);
    void *a = NULL, *b = NULL;
    size_t na = 0, nb = 0;
    mt_status s = dsa_has_aux(ml) ? dsa_snapshot_aux(ml, base, &a, &na, err) : MT_OK;
    if (s == MT_OK) s = glm_ple_snapshot(l, (const glm_layer_state *)base, &b, &nb, err);
    char *p = s == MT_OK ? malloc(na + nb) : NULL;
    if (s == MT_OK && !p) s = mt_errorf(err, MT_ERR_NOMEM, "layer %d: out of memory for an aux snapshot", ml->index);
    if (p) {
        if (na) memcpy(p, a, na);
        memcpy(p + na, b, nb);
        *bytes = p;
        *len = na + nb;
    }
    free(a);
    free(b);
    return s;
}

/* The DSA part's size from its header (0 when it is not one). */
static size_t dsa_aux_bytes(const glm_layer *l, const void *bytes, size_t len) {
    aux_header hd;
    if (len < sizeof hd) return 0;
    memcpy(&hd, bytes, sizeof hd);
    const int id = l->cfg->index_head_dim, kp = l->cfg->index_kpool;
    if (hd.magic != AUX_MAGIC || hd.id != id || hd.kpool != kp || hd.len < 0) return 0;
    return sizeof hd + 2 * sizeof(float) * (size_t)hd.len * id + sizeof(float) * (size_t)(hd.len / kp) * id;
}

static mt_status ple_restore_aux(const mt_layer *ml, mt_layer_state *base, const void *bytes, size_t len,
                                 mt_error *err) {
    const glm_layer *l = as_glm(ml);
    size_t na = 0;
    if (dsa_has_aux(ml) && ((na = dsa_aux_bytes(l, bytes, len)) == 0 || na > len))
        return mt_errorf(err, MT_ERR_INVALID, "layer %d: aux snapshot does not start with this layer's indexer cache",
                         ml->index);
    const char *pb = (const char *)bytes + na;
    const size_t nb = len - na, want = glm_ple_aux_bytes(l, pb, nb);
    if (want == 0 || want != nb)
        return mt_errorf(err, MT_ERR_INVALID, "layer %d: PLE snapshot of %zu bytes, expected %zu", ml->index, nb, want);
    if (na) {
        mt_status s = dsa_restore_aux(ml, base, bytes, na, err);
        if (s != MT_OK) return s;
    }
    glm_ple_restore(l, (glm_layer_state *)base, pb, nb);
    return MT_OK;
}

static const mt_layer_ops ple_layer_ops = {
    .alloc_state = alloc_state,
    .release_state = release_state,
    .prefill = layer_prefill,
    .decode_multi_seq = layer_decode_multi,
    .forward_segments = layer_forward_segments,
    .decode_prestage = ple_decode_prestage,
    .decode_prestage_rearm = ple_decode_prestage_rearm,
    .check_replay_room = ple_check_replay_room,
    .sync_replayed_step = ple_sync_replayed_step,
    .verify_keep = ple_verify_keep,
    .has_aux_state = ple_has_aux,
    .snapshot_aux = ple_snapshot_aux,
    .restore_aux = ple_restore_aux,
};

static const mt_layer_ops kda_layer_ops = {
    .alloc_state = alloc_state,
    .release_state = release_state,
    .prefill = layer_prefill,
    .decode_multi_seq = layer_decode_multi,
    .forward_segments = layer_forward_segments,
};

static const mt_layer_ops dsa_layer_ops = {
    .alloc_state = alloc_state,
    .release_state = release_state,
    .prefill = layer_prefill,
    .decode_multi_seq = layer_decode_multi,
    .forward_segments = layer_forward_segments,
    .decode_prestage = dsa_decode_prestage,
    .decode_prestage_rearm = dsa_decode_prestage_rearm,
    .check_replay_room = dsa_check_replay_room,
    .sync_replayed_step = dsa_sync_replayed_step,
    .has_aux_state = dsa_has_aux,
    .snapshot_aux = dsa_snapshot_aux,
    .restore_aux = dsa_restore_aux,
};

void glm_layer_init(glm_layer *l, const glm_config *cfg, mt_backend *be, int i) {
    l->cfg = cfg;
    l->be = be;
    l->base.index = i;
    const int kp = cfg->index_kpool > 0 ? cfg->index_kpool : 1;
    l->page = (GLM_PAGE + kp - 1) / kp * kp; /* whole pools per page */
    if (cfg->layer_types[i] == GLM_MIXER_KDA) {
        l->base.ops = &kda_layer_ops;
        l->base.kind = "glm.kda";
        /* Recurrent state cannot be rewound by length; the state is per-sequence memory, so a
         * captured graph belongs to one sequence. */
        l->base.caps = (mt_layer_caps){ .is_ssm_layer = true, .decode_rollback_unsupported = true,
                                        .graph_stale_on_new_sequence = true,
                                        .decode_verify_multi_unsupported = true };
    } else {
        l->base.ops = &dsa_layer_ops;
        l->base.kind = "glm.dsa";
        l->base.caps = (mt_layer_caps){ .graph_stale_on_new_sequence = true,
                                        .decode_verify_multi_unsupported = true };
    }
    if (i < cfg->num_hidden_layers && cfg->ple_layer[i]) {
        /* The memory's history cannot be rewound by length (a verify's rows are kept through
         * verify_keep), and its prestage hashes the token. */
        l->ple.on = true;
        l->base.ops = &ple_layer_ops;
        l->base.kind = cfg->layer_types[i] == GLM_MIXER_KDA ? "glm.kda+ple" : "glm.dsa+ple";
        l->base.caps.decode_rollback_unsupported = true;
        l->base.caps.decode_prestage_needs_token = true;
    }
}
