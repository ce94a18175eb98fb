/* worker/model/glm/glm_state.c: the memory behind the runtime's pools, per layer. The runtime
 * (worker/runtime/id_pool.h) hands out page and slot ids; here each layer keeps, for every id,
 * its rows: a DSA layer per page the MLA latent of `page` positions and, with an indexer of its
 * own, their indexer keys, gate scores and pool keys; a KDA layer per slot the conv state of q, k,
 * v and the recurrent state. */
#include "worker/model/glm/glm_impl.h"

static bool is_kda(const glm_layer *l) { return l->cfg->layer_types[l->base.index] == GLM_MIXER_KDA; }

/* Floats of one conv state (q, k or v) of a KDA layer: [D, K-1], at least 1 (K = 1 keeps no history). */
static size_t conv_floats(const glm_layer *l) {
    const glm_config *c = l->cfg;
    const size_t D = (size_t)c->linear_num_heads * c->linear_head_dim;
    const size_t P = (size_t)(c->linear_conv_kernel_dim - 1);
    return D * P > 0 ? D * P : 1;
}

static size_t rec_floats(const glm_layer *l) {
    const glm_config *c = l->cfg;
    return (size_t)c->linear_num_heads * c->linear_head_dim * c->linear_head_dim;
}

size_t glm_layer_slot_bytes(const glm_layer *l) {
    return is_kda(l) ? sizeof(float) * (3 * conv_floats(l) + rec_floats(l)) : 0;
}

/* One page's floats of each paged buffer of a DSA layer: latent, keys, gate scores, pool keys. */
static void page_floats(const glm_layer *l, size_t out[4]) {
    const glm_config *c = l->cfg;
    const size_t pg = (size_t)l->page, id = (size_t)c->index_head_dim;
    const bool ix = l->dsa.has_indexer;
    out[0] = pg * (size_t)c->kv_lora_rank;
    out[1] = out[2] = ix ? pg * id : 0;
    out[3] = ix ? pg / (size_t)c->index_kpool * id : 0;
}

size_t glm_layer_page_bytes(const glm_layer *l) {
    if (is_kda(l)) return 0;
    size_t f[4];
    page_floats(l, f);
    return sizeof(float) * (f[0] + f[1] + f[2] + f[3]);
}

size_t glm_layer_state_bytes(const glm_layer *l, int max_tokens) {
    if (is_kda(l)) return glm_layer_slot_bytes(l) + glm_ple_state_bytes(l);
    const size_t blocks = ((size_t)max_tokens + (size_t)l->page - 1) / (size_t)l->page;
    return blocks * glm_layer_page_bytes(l) + glm_ple_state_bytes(l);
}

bool glm_layer_pools_alloc(glm_layer *l, int n_pages, int n_slots) {
    mt_backend *be = l->be;
    if (is_kda(l))
        return (l->sl_conv = be->ops->alloc(be, sizeof(float) * (size_t)n_slots * 3 * conv_floats(l))) &&
               (l->sl_rec = be->ops->alloc(be, sizeof(float) * (size_t)n_slots * rec_floats(l)));
    size_t f[4];
    page_floats(l, f);
    float **bufs[4] = { &l->pg_latent, &l->pg_ki, &l->pg_gs, &l->pg_pk };
    for (int j = 0; j < 4; j++)
        if (f[j] && !(*bufs[j] = be->ops->alloc(be, sizeof(float) * (size_t)n_pages * f[j]))) return false;
    return true;
}

void glm_layer_pools_free(glm_layer *l) {
    mt_backend *be = l->be;
    float **p[] = { &l->pg_latent, &l->pg_ki, &l->pg_gs, &l->pg_pk, &l->sl_conv, &l->sl_rec };
    for (size_t k = 0; k < sizeof p / sizeof p[0]; k++) {
        be->ops->free(be, *p[k]);
        *p[k] = NULL;
    }
}

void glm_layer_bind_state(const glm_layer *l, glm_layer_state *st, int slot, const int32_t *bt) {
    if (!is_kda(l)) {
        st->bt = bt;
        return;
    }
    const size_t cf = conv_floats(l);
    for (int j = 0; j < 3; j++) st->conv[j] = l->sl_conv + ((size_t)slot * 3 + j) * cf;
    st->rec = l->sl_rec + (size_t)slot * rec_floats(l);
}

void glm_layer_slot_at(const glm_layer *l, int slot, float **conv, float **rec, size_t *conv_n, size_t *rec_n) {
    const size_t cf = conv_floats(l), rf = rec_floats(l);
    *conv = l->sl_conv + (size_t)slot * 3 * cf;
    *rec = l->sl_rec + (size_t)slot * rf;
    *conv_n = 3 * cf;
    *rec_n = rf;
}

void glm_layers_copy_page(const glm_layer *ls, int n, int32_t from, int32_t to) {
    for (int i = 0; i < n; i++) {
        const glm_layer *l = &ls[i];
        if (is_kda(l)) continue;
        size_t f[4];
        page_floats(l, f);
        float *const bufs[4] = { l->pg_latent, l->pg_ki, l->pg_gs, l->pg_pk };
        for (int j = 0; j < 4; j++)
            if (f[j]) l->be->ops->copy(l->be, bufs[j] + (size_t)to * f[j], bufs[j] + (size_t)from * f[j], sizeof(float) * f[j]);
    }
}

void glm_layers_copy_slot(const glm_layer *ls, int n, int from, int to) {
    for (int i = 0; i < n; i++) {
        const glm_layer *l = &ls[i];
        if (!is_kda(l)) continue;
        const size_t cf = 3 * conv_floats(l), rf = rec_floats(l);
        l->be->ops->copy(l->be, l->sl_conv + (size_t)to * cf, l->sl_conv + (size_t)from * cf, sizeof(float) * cf);
        l->be->ops->copy(l->be, l->sl_rec + (size_t)to * rf, l->sl_rec + (size_t)from * rf, sizeof(float) * rf);
    }
}

void glm_layer_save_slot(const glm_layer *l, const glm_layer_state *st, int slot, bool conv, bool rec) {
    const size_t cf = conv_floats(l), rf = rec_floats(l);
    mt_backend *be = l->be;
    for (int j = 0; j < 3 && conv; j++)
        be->ops->copy(be, l->sl_conv + ((size_t)slot * 3 + j) * cf, st->conv[j], sizeof(float) * cf);
    if (rec) be->ops->copy(be, l->sl_rec + (size_t)slot * rf, st->rec, sizeof(float) * rf);
}

void glm_layers_zero_slot(const glm_layer *ls, int n, int slot) {
    for (int i = 0; i < n; i++) {
        const glm_layer *l = &ls[i];
        if (!is_kda(l)) continue;
        const size_t cf = 3 * conv_floats(l), rf = rec_floats(l);
        l->be->ops->zero(l->be, l->sl_conv + (size_t)slot * cf, sizeof(float) * cf);
        l->be->ops->zero(l->be, l->sl_rec + (size_t)slot * rf, sizeof(float) * rf);
    }
}
