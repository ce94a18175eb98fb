/* worker/model/glm_layer.c: the GLM decoder layer behind the layer contract (layer.h): the
 * attention site (hyper-connection, input_layernorm, KDA or DSA mixer) then the MLP site
 * (hyper-connection, post_attention_layernorm, dense MLP or MoE). Also the per-sequence state,
 * the DSA graph hooks and the DSA indexer-cache aux state. */
#include <stdlib.h>
#include <string.h>

#include "worker/model/glm_impl.h"

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

static void release_state(const mt_layer *ml, mt_layer_state *base) {
    if (!base) return;
    const glm_layer *l = as_glm(ml);
    mt_backend *be = l->be;
    glm_layer_state *st = (glm_layer_state *)base;
    float **bufs[] = { &st->conv[0], &st->conv[1], &st->conv[2], &st->rec, &st->latent, &st->ki,
                       &st->gs, &st->pool };
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) {
        be->ops->free(be, *bufs[i]);
        *bufs[i] = NULL;
    }
    free(st);
}

/* Bytes of backend memory alloc_state takes for a max_tokens state of layer l (kept beside it so
 * the two agree). */
size_t glm_layer_state_bytes(const glm_layer *l, int max_tokens) {
    const glm_config *c = l->cfg;
    const int i = l->base.index;
    if (c->layer_types[i] == GLM_MIXER_KDA) {
        const size_t D = (size_t)c->linear_num_heads * c->linear_head_dim;
        const size_t P = (size_t)(c->linear_conv_kernel_dim - 1);
        const size_t conv = D * P > 0 ? D * P : 1;
        return sizeof(float) * (3 * conv + (size_t)c->linear_num_heads * c->linear_head_dim * c->linear_head_dim);
    }
    const size_t cap = (size_t)max_tokens, id = (size_t)c->index_head_dim;
    size_t n = cap * (size_t)c->kv_lora_rank;
    if (l->dsa.has_indexer) n += 2 * cap * id + (cap / (size_t)c->index_kpool + 1) * id;
    return sizeof(float) * n;
}

static mt_status alloc_state(const mt_layer *ml, int max_tokens, mt_layer_state **out, mt_error *err) {
    const glm_layer *l = as_glm(ml);
    const glm_config *c = l->cfg;
    mt_backend *be = l->be;
    glm_layer_state *st = calloc(1, sizeof *st);
    if (!st) return mt_errorf(err, MT_ERR_NOMEM, "layer %d: out of memory for state", ml->index);
    st->base.layer = ml;
    st->cap = max_tokens;
    bool ok = true;
    if (c->layer_types[ml->index] == GLM_MIXER_KDA) {
        const size_t D = (size_t)c->linear_num_heads * c->linear_head_dim;
        const size_t P = (size_t)(c->linear_conv_kernel_dim - 1);
        const size_t conv = D * P > 0 ? D * P : 1; /* K = 1 keeps no history */
        for (int j = 0; j < 3; j++) ok &= (st->conv[j] = be->ops->alloc(be, sizeof(float) * conv)) != NULL;
        ok &= (st->rec = be->ops->alloc(be, sizeof(float) * (size_t)c->linear_num_heads *
                                                c->linear_head_dim * c->linear_head_dim)) != NULL;
    } else {
        const size_t cap = (size_t)max_tokens, id = (size_t)c->index_head_dim;
        ok &= (st->latent = be->ops->alloc(be, sizeof(float) * cap * (size_t)c->kv_lora_rank)) != NULL;
        if (l->dsa.has_indexer) {
            ok &= (st->ki = be->ops->alloc(be, sizeof(float) * cap * id)) != NULL;
            ok &= (st->gs = be->ops->alloc(be, sizeof(float) * cap * id)) != NULL;
            ok &= (st->pool = be->ops->alloc(be, sizeof(float) * (cap / (size_t)c->index_kpool + 1) * id)) != NULL;
        }
    }
    if (!ok) {
        release_state(ml, &st->base);
        return mt_errorf(err, MT_ERR_NOMEM, "layer %d: out of memory for a %d-token state", ml->index, max_tokens);
    }
    *out = &st->base;
    return MT_OK;
}

/* ---- compute ---- */

/* n rows through the decoder layer: nst == 1 state for n consecutive positions of one sequence,
 * or nst == n states, one row per sequence (see glm_kda.c). */
static mt_status layer_forward(const mt_layer *ml, glm_layer_state **sts, int nst, mt_step *step,
                               float *X, int n) {
    const glm_layer *l = as_glm(ml);
    const glm_config *c = l->cfg;
    mt_backend *be = step->be;
    glm_scratch *scr = step->scr;
    MT_ASSERT(n <= scr->rows);
    const mt_hc_params hp = { c->hc_mult, c->hidden_size, c->rms_norm_eps, c->hc_eps, c->hc_sinkhorn_iters };
    const int H = c->hidden_size;

    be->ops->hc_pre(be, scr->y, scr->post, scr->comb, X, &l->hc[0].fn, l->hc[0].base, l->hc[0].scale, &hp, n);
    be->ops->rmsnorm(be, scr->h, scr->y, l->in_norm, n, H, c->rms_norm_eps);
    mt_status s = c->layer_types[ml->index] == GLM_MIXER_KDA
                      ? glm_kda_forward(l, sts, nst, step, scr->h, scr->a, n)
                      : glm_dsa_forward(l, sts, nst, step, scr->h, scr->a, n);
    if (s != MT_OK) return s;
    be->ops->hc_post(be, X, scr->a, scr->post, scr->comb, &hp, n);

    be->ops->hc_pre(be, scr->y, scr->post, scr->comb, X, &l->hc[1].fn, l->hc[1].base, l->hc[1].scale, &hp, n);
    be->ops->rmsnorm(be, scr->h, scr->y, l->post_norm, n, H, c->rms_norm_eps);
    glm_mlp_forward(l, step, scr->h, scr->a, n);
    be->ops->hc_post(be, X, scr->a, scr->post, scr->comb, &hp, n);
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

/* ---- DSA aux state: the indexer cache (keys, gate scores, pool keys) and its length ---- */

static bool dsa_has_aux(const mt_layer *ml) { return as_glm(ml)->dsa.has_indexer; }

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
    char *p = malloc(total);
    if (!p) return mt_errorf(err, MT_ERR_NOMEM, "layer %d: out of memory for an aux snapshot", ml->index);
    aux_header hd = { AUX_MAGIC, st->len, id, kp };
    memcpy(p, &hd, sizeof hd);
    be->ops->download(be, p + sizeof hd, st->ki, kb);
    be->ops->download(be, p + sizeof hd + kb, st->gs, kb);
    be->ops->download(be, p + sizeof hd + 2 * kb, st->pool, pb);
    *bytes = p;
    *len = total;
    return MT_OK;
}

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
    const char *p = (const char *)bytes + sizeof hd;
    be->ops->upload(be, st->ki, p, kb);
    be->ops->upload(be, st->gs, p + kb, kb);
    be->ops->upload(be, st->pool, p + 2 * kb, pb);
    st->len = hd.len;
    return MT_OK;
}

/* Makes dst (a fresh state) hold src's first len positions: KDA conv and recurrent state (src
 * must be exactly at len: they are not positional), the MLA latent rows, and the DSA indexer
 * cache through the layer's own aux snapshot/restore. */
mt_status glm_layer_copy_state(const glm_layer *l, const glm_layer_state *src, glm_layer_state *dst,
                               int len, mt_error *err) {
    const glm_config *c = l->cfg;
    mt_backend *be = l->be;
    const mt_layer *ml = &l->base;
    if (len > dst->cap) return mt_errorf(err, MT_ERR_FULL, "layer %d: %d positions exceed capacity %d", ml->index, len, dst->cap);
    if (c->layer_types[ml->index] == GLM_MIXER_KDA) {
        const size_t D = (size_t)c->linear_num_heads * c->linear_head_dim;
        const size_t P = (size_t)(c->linear_conv_kernel_dim - 1);
        for (int j = 0; j < 3; j++) be->ops->copy(be, dst->conv[j], src->conv[j], sizeof(float) * D * P);
        be->ops->copy(be, dst->rec, src->rec,
                      sizeof(float) * (size_t)c->linear_num_heads * c->linear_head_dim * c->linear_head_dim);
        return MT_OK;
    }
    if (src->len != len) return mt_errorf(err, MT_ERR_STATE, "layer %d: source at %d positions, not %d", ml->index, src->len, len);
    be->ops->copy(be, dst->latent, src->latent, sizeof(float) * (size_t)len * c->kv_lora_rank);
    if (mt_layer_has_aux_state(ml)) {
        void *bytes = NULL;
        size_t n = 0;
        mt_status st = mt_layer_snapshot_aux(ml, &src->base, &bytes, &n, err);
        if (st == MT_OK) st = mt_layer_restore_aux(ml, &dst->base, bytes, n, err);
        free(bytes);
        if (st != MT_OK) return st;
    }
    dst->len = len;
    return MT_OK;
}

static const mt_layer_ops kda_layer_ops = {
    .alloc_state = alloc_state,
    .release_state = release_state,
    .prefill = layer_prefill,
    .decode_multi_seq = layer_decode_multi,
};

static const mt_layer_ops dsa_layer_ops = {
    .alloc_state = alloc_state,
    .release_state = release_state,
    .prefill = layer_prefill,
    .decode_multi_seq = layer_decode_multi,
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
    if (cfg->layer_types[i] == GLM_MIXER_KDA) {
        l->base.ops = &kda_layer_ops;
        l->base.kind = "glm.kda";
        /* Recurrent state cannot be rewound by length; the state is per-sequence memory, so a
         * captured graph (issue 3) belongs to one sequence. */
        l->base.caps = (mt_layer_caps){ .is_ssm_layer = true, .decode_rollback_unsupported = true,
                                        .graph_stale_on_new_sequence = true,
                                        .decode_verify_multi_unsupported = true };
    } else {
        l->base.ops = &dsa_layer_ops;
        l->base.kind = "glm.dsa";
        l->base.caps = (mt_layer_caps){ .graph_stale_on_new_sequence = true,
                                        .decode_verify_multi_unsupported = true };
    }
}
