/* worker/model/glm/glm_model.c: the GLM model runtime: loading, scratch, sequences, and the forward
 * pass (embedding into an S-stream fp32 highway, the decoder layers, the mean-of-streams head). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "worker/model/glm/glm_impl.h"

glm_model_params glm_model_default_params(void) { return mt_model_default_params(); }

static void scratch_free(mt_backend *be, glm_scratch *s) {
    float **f[] = { &s->y, &s->h, &s->a, &s->post, &s->comb, &s->wts };
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++) { be->ops->free(be, *f[i]); *f[i] = NULL; }
    for (int i = 0; i < 10; i++) { be->ops->free(be, s->buf[i]); s->buf[i] = NULL; }
    be->ops->free(be, s->idx);
    be->ops->free(be, s->sel);
    be->ops->free(be, s->nsel);
    s->idx = s->sel = s->nsel = NULL;
}

static mt_status scratch_alloc(mt_backend *be, const glm_config *c, int rows, glm_scratch *s, mt_error *err) {
    memset(s, 0, sizeof *s);
    s->rows = rows;
    const size_t r = (size_t)rows, H = (size_t)c->hidden_size, S = (size_t)c->hc_mult;
    const size_t W = (size_t)glm_scratch_width(c), k = (size_t)c->num_experts_per_tok;
    bool ok = (s->y = be->ops->alloc(be, 4 * r * H)) && (s->h = be->ops->alloc(be, 4 * r * H)) &&
              (s->a = be->ops->alloc(be, 4 * r * H)) && (s->post = be->ops->alloc(be, 4 * r * S)) &&
              (s->comb = be->ops->alloc(be, 4 * r * S * S)) && (s->idx = be->ops->alloc(be, 4 * r * k)) &&
              (s->wts = be->ops->alloc(be, 4 * r * k)) &&
              (s->sel = be->ops->alloc(be, 4 * r * (size_t)glm_max_sel(c))) &&
              (s->nsel = be->ops->alloc(be, 4 * r));
    for (int i = 0; ok && i < 10; i++) ok = (s->buf[i] = be->ops->alloc(be, 4 * r * W)) != NULL;
    if (!ok) {
        scratch_free(be, s);
        return mt_errorf(err, MT_ERR_NOMEM, "out of memory for %d rows of activations", rows);
    }
    return MT_OK;
}

/* Whether the MTP block is loaded: the checkpoint holds its tensors (random models: the config
 * declares one). Its layer is index L: a DSA mixer with a full indexer and an MoE. */
static mt_status mtp_plan(glm_model *m, bool random, mt_error *err) {
    glm_config *c = &m->cfg;
    const int L = c->num_hidden_layers;
    bool has = c->num_nextn_predict_layers > 0;
    if (!random) {
        char name[96];
        snprintf(name, sizeof name, "model.language_model.layers.%d.eh_proj.weight", L);
        has = st_find(m->ar, name) != NULL;
        if (!has && c->num_nextn_predict_layers > 0)
            mt_log(MT_LOG_WARN, "the config declares %d MTP block(s) but the checkpoint holds none: no drafter",
                   c->num_nextn_predict_layers);
    }
    m->n_state_layers = L;
    if (!has) return MT_OK;
    if (L >= GLM_MAX_LAYERS)
        return mt_errorf(err, MT_ERR_UNSUPPORTED, "an MTP block after %d layers: at most %d layers in all", L,
                         GLM_MAX_LAYERS);
    c->layer_types[L] = GLM_MIXER_DSA;
    c->mlp_layer_types[L] = GLM_MLP_SPARSE;
    c->indexer_types[L] = GLM_INDEXER_FULL;
    m->mtp.has = true;
    m->mtp.on = m->params.mtp;
    m->n_state_layers = L + 1;
    if (!m->mtp.on) return MT_OK;
    const int nr = m->params.verify_seqs > 1 ? m->params.verify_seqs : 1;
    if (!(m->mtp.ring = malloc(sizeof(int) * (size_t)nr * (GLM_VERIFY_MAX - 1))) ||
        !(m->mtp.ring_owner = calloc((size_t)nr, sizeof *m->mtp.ring_owner)))
        return mt_errorf(err, MT_ERR_NOMEM, "out of memory for the verify rings");
    m->mtp.n_rings = nr;
    for (int i = 0; i < nr * (GLM_VERIFY_MAX - 1); i++) m->mtp.ring[i] = -1;
    return MT_OK;
}

/* Everything after the config and the weights' source are known: layers, weights, scratch. */
static mt_status model_init(glm_model *m, uint64_t random_seed, bool random, mt_error *err) {
    const glm_config *c = &m->cfg;
    mt_backend *be = m->be;
    if (m->params.layered_expert_parts_soft && m->params.layered_expert_parts > 1 &&
        (!m->params.layered_sites || m->params.layered_expert_parts > c->n_routed_experts || !be->ops->moe_keep_experts))
        m->params.layered_expert_parts = 0;
    const int xp = m->params.layered_expert_parts;
    if (xp > 1 && !m->params.layered_sites)
        return mt_errorf(err, MT_ERR_INVALID, "layered expert parts (%d) need layered sites (--prefill-sites)", xp);
    if (xp > 1 && (xp > c->n_routed_experts || !be->ops->moe_keep_experts))
        return mt_errorf(err, MT_ERR_INVALID, "layered expert parts: %d parts of %d routed experts%s", xp,
                         c->n_routed_experts, be->ops->moe_keep_experts ? "" : " (the backend cannot keep a part of them)");
    if (xp < 0) return mt_errorf(err, MT_ERR_INVALID, "layered expert parts: %d", xp);
    mt_status s = mtp_plan(m, random, err);
    if (s == MT_OK) s = glm_shard_plan(m, err);
    if (s != MT_OK) return s;
    m->layers = calloc((size_t)m->n_state_layers, sizeof(glm_layer));
    if (!m->layers) return mt_errorf(err, MT_ERR_NOMEM, "out of memory");
    for (int i = 0; i < m->n_state_layers; i++) {
        glm_layer_init(&m->layers[i], &m->lcfg, be, i);
        m->layers[i].comm = m->comm;
    }
    s = random ? glm_weights_random(m, random_seed, err) : glm_weights_bind(m, err);
    if (s != MT_OK) return s;
    glm_weights_pack(m);
    if (m->tp_size > 1)
        mt_log(MT_LOG_INFO, "tensor-parallel rank %d of %d: read %.1f MiB of the split tensors' %.1f MiB, and %.1f MiB "
               "of replicated ones", m->tp_rank, m->tp_size, m->bytes_sharded_read / 1048576.0,
               m->bytes_sharded_total / 1048576.0, m->bytes_replicated / 1048576.0);
    const int rows = m->params.prefill_chunk;
    if ((s = scratch_alloc(be, &m->lcfg, rows, &m->scr, err)) != MT_OK) return s;
    const size_t SH = (size_t)c->hc_mult * c->hidden_size;
    m->X = be->ops->alloc(be, sizeof(float) * rows * SH);
    m->z = be->ops->alloc(be, sizeof(float) * rows * (size_t)c->hidden_size);
    m->logits = be->ops->alloc(be, sizeof(float) * rows * (size_t)c->vocab_size);
    m->d_step = be->ops->alloc(be, sizeof(int32_t) * GLM_VERIFY_MAX * (size_t)(c->hc_mult + 1));
    if (!m->X || !m->z || !m->logits || !m->d_step)
        return mt_errorf(err, MT_ERR_NOMEM, "out of memory for activations");
    if (m->mtp.on) {
        const size_t rh = sizeof(float) * rows * (size_t)c->hidden_size;
        struct glm_mtp *x = &m->mtp;
        if (!(x->hin = be->ops->alloc(be, rh + sizeof(float) * c->hidden_size)) || !(x->e = be->ops->alloc(be, rh)) ||
            !(x->u = be->ops->alloc(be, rh)) || !(x->t = be->ops->alloc(be, rh)) ||
            !(x->ring_h = be->ops->alloc(be, sizeof(float) * (size_t)x->n_rings * GLM_VERIFY_MAX * c->hidden_size)) ||
            !(x->d_rpos = be->ops->alloc(be, sizeof(int32_t) * rows)) ||
            !(x->d_rtab = be->ops->alloc(be, sizeof(void *) * GLM_R_KINDS * rows)) ||
            !(x->d_ptr = be->ops->alloc(be, sizeof(void *) * 5 * rows)) ||
            !(x->d_tok = be->ops->alloc(be, sizeof(int32_t) * rows)))
            return mt_errorf(err, MT_ERR_NOMEM, "out of memory for the drafter's activations");
        const size_t keep_tab = (size_t)(2 * c->num_hidden_layers + 1) * 2 * x->n_rings;
        if (!(x->d_keep = be->ops->alloc(be, sizeof(void *) * keep_tab)) || !(x->h_keep = calloc(keep_tab, sizeof(void *))))
            return mt_errorf(err, MT_ERR_NOMEM, "out of memory for the verify rings' tables");
    }
    if (m->tp_size > 1 &&
        (!(m->logits_local = be->ops->alloc(be, sizeof(float) * rows * (size_t)m->v_n)) ||
         !(m->logits_gather = be->ops->alloc(be, sizeof(float) * rows * (size_t)m->v_n * m->tp_size))))
        return mt_errorf(err, MT_ERR_NOMEM, "out of memory for the vocab-parallel logits");
    /* rows form of batched decode: one pass takes at most the scratch rows */
    const size_t tab = (size_t)c->num_hidden_layers * GLM_R_KINDS * (size_t)rows;
    m->rcap = rows;
    m->d_rrow = be->ops->alloc(be, sizeof(int32_t) * (size_t)rows * (1 + c->hc_mult));
    m->d_rtab = be->ops->alloc(be, sizeof(void *) * tab);
    m->d_vtab = be->ops->alloc(be, sizeof(void *) * 3 * (size_t)rows);
    m->h_rrow = calloc((size_t)rows * (1 + c->hc_mult), sizeof(int32_t));
    m->h_rtab = calloc(tab, sizeof(void *));
    m->h_tok = calloc((size_t)rows * c->hc_mult, sizeof(int32_t));
    m->ahead.seqs = calloc((size_t)rows, sizeof(glm_seq *));
    if (!m->d_rrow || !m->d_rtab || !m->d_vtab || !m->h_rrow || !m->h_rtab || !m->h_tok || !m->ahead.seqs)
        return mt_errorf(err, MT_ERR_NOMEM, "out of memory for the batched-decode tables");
    if (c->hc_mult > 8) return mt_errorf(err, MT_ERR_UNSUPPORTED, "hc_mult %d: at most 8 streams", c->hc_mult);
    for (int i = 0; i < c->num_hidden_layers; i++)
        if (m->layers[i].ple.on) {
            glm_layer *l = &m->layers[i];
            if ((s = glm_ple_init(l, rows, m->mtp.n_rings, !m->params.ple_host_gather, err)) != MT_OK) return s;
            /* hashing on the device, the prestage needs no token: greedy decode runs ahead */
            l->base.caps.decode_prestage_needs_token = !l->ple.dev;
        }
    if (!(m->layer_list = malloc(sizeof *m->layer_list * (size_t)c->num_hidden_layers)))
        return mt_errorf(err, MT_ERR_NOMEM, "out of memory");
    for (int i = 0; i < c->num_hidden_layers; i++) m->layer_list[i] = &m->layers[i].base;
    rt_runner_init(&m->runner, be, m->layer_list, c->num_hidden_layers);
    return MT_OK;
}

static glm_model *model_new(mt_backend *be, const glm_model_params *params) {
    glm_model *m = calloc(1, sizeof *m);
    if (!m) return NULL;
    m->base.ops = &glm_model_iface;
    m->be = be;
    m->params = params ? *params : glm_model_default_params();
    m->comm = m->params.comm;
    if (m->params.prefill_chunk < 1) m->params.prefill_chunk = 1;
    if (m->params.graph_max_rows < 1) m->params.graph_max_rows = 64;
    return m;
}

mt_status glm_model_load(const char *dir, mt_backend *be, const glm_model_params *params,
                         glm_model **out, mt_error *err) {
    *out = NULL;
    glm_model *m = model_new(be, params);
    if (!m) return mt_errorf(err, MT_ERR_NOMEM, "out of memory");
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", dir);
    mt_status s = glm_config_load(path, &m->cfg, err);
    if (s == MT_OK) s = st_open_dir(dir, &m->ar, err);
    if (s == MT_OK) s = model_init(m, 0, false, err);
    if (s != MT_OK) {
        glm_model_free(m);
        return s;
    }
    *out = m;
    return MT_OK;
}

mt_status glm_model_new_random(const glm_config *cfg, uint64_t seed, mt_backend *be,
                               const glm_model_params *params, glm_model **out, mt_error *err) {
    *out = NULL;
    mt_status s = glm_config_validate(cfg, err);
    if (s != MT_OK) return s;
    glm_model *m = model_new(be, params);
    if (!m) return mt_errorf(err, MT_ERR_NOMEM, "out of memory");
    m->cfg = *cfg;
    if ((s = model_init(m, seed, true, err)) != MT_OK) {
        glm_model_free(m);
        return s;
    }
    *out = m;
    return MT_OK;
}

static void pools_release(glm_model *m);
static void graphs_release(glm_model *m);

void glm_model_free(glm_model *m) {
    if (!m) return;
    mt_backend *be = m->be;
    glm_seq_free(m->pad_seq); /* before the layers it releases through */
    if (m->layers) pools_release(m);
    glm_weights_release(m);
    free(m->layers);
    scratch_free(be, &m->scr);
    be->ops->free(be, m->X);
    be->ops->free(be, m->lp_X);
    be->ops->free(be, m->lp_parts);
    be->ops->free(be, m->z);
    be->ops->free(be, m->logits);
    be->ops->free(be, m->d_step);
    be->ops->free(be, m->logits_local);
    be->ops->free(be, m->logits_gather);
    for (int i = 0; i < m->n_kept_host; i++) free(m->kept_host[i]);
    free(m->kept_host);
    graphs_release(m);
    free(m->layer_list);
    be->ops->free(be, m->d_rrow);
    be->ops->free(be, m->d_rtab);
    be->ops->free(be, m->d_vtab);
    free(m->h_rrow);
    free(m->h_rtab);
    free(m->h_tok);
    free(m->ahead.seqs);
    free(m->census);
    be->ops->free(be, m->mtp.hin);
    be->ops->free(be, m->mtp.e);
    be->ops->free(be, m->mtp.u);
    be->ops->free(be, m->mtp.t);
    be->ops->free(be, m->mtp.ring_h);
    be->ops->free(be, m->mtp.d_rpos);
    be->ops->free(be, m->mtp.d_rtab);
    be->ops->free(be, m->mtp.d_ptr);
    be->ops->free(be, m->mtp.d_tok);
    be->ops->free(be, m->mtp.d_keep);
    free(m->mtp.h_keep);
    free(m->mtp.ring);
    free(m->mtp.ring_owner);
    st_close(m->ar);
    free(m);
}

const glm_config *glm_model_config(const glm_model *m) { return &m->cfg; }
mt_backend *glm_model_backend(const glm_model *m) { return m->be; }

/* ---- pools: DSA pages and KDA slots ---- */

static const glm_layer *first_dsa(const glm_model *m) {
    for (int i = 0; i < m->n_state_layers; i++)
        if (m->cfg.layer_types[i] != GLM_MIXER_KDA) return &m->layers[i];
    return NULL;
}

int glm_model_page_tokens(const glm_model *m) { return m->layers[0].page; }

size_t glm_model_page_bytes(const glm_model *m) {
    size_t b = 0;
    for (int i = 0; i < m->n_state_layers; i++) b += glm_layer_page_bytes(&m->layers[i]);
    return b;
}

size_t glm_model_slot_bytes(const glm_model *m) {
    size_t b = 0;
    for (int i = 0; i < m->n_state_layers; i++) b += glm_layer_slot_bytes(&m->layers[i]);
    return b;
}

int glm_model_pages_free(const glm_model *m) { return m->pages.n_free; }
int glm_model_slots_free(const glm_model *m) { return m->slots.n_free; }
int glm_model_pages_total(const glm_model *m) { return m->pages.n; }
int glm_model_slots_total(const glm_model *m) { return m->slots.n; }

static void pools_release(glm_model *m) {
    for (int i = 0; i < m->n_state_layers; i++) glm_layer_pools_free(&m->layers[i]);
    rt_id_pool_release(&m->pages);
    rt_id_pool_release(&m->slots);
}

/* The pad sequence of the bucket graphs (one slot, one page: pad decode rows write its position 0,
 * a verify graph's pad rows positions 0 .. k - 1); made when the pools
 * are (graph-capable backends) or at the first padded step. false when the pools have no room:
 * that step then runs eagerly without padding, never on a pad without a page. */
bool glm_pad_ensure(glm_model *m) {
    if (m->pad_seq) return true;
    mt_error err = { "" };
    glm_seq *p = NULL;
    if (glm_seq_new(m, 1, &p, &err) != MT_OK) return false;
    if (glm_seq_reserve(p, 1, &err) != MT_OK) {
        glm_seq_free(p);
        return false;
    }
    m->pad_seq = p;
    return true;
}

/* Frees every recorded decode graph but the sequences' own (bucket graphs and the shared one). */
static void graphs_release(glm_model *m) {
    rt_slot_release(&m->runner, &m->shared);
    for (int b = 0; b < GLM_BUCKETS; b++) {
        rt_slot_release(&m->runner, &m->bucket[b]);
        rt_slot_release(&m->runner, &m->mtp.bucket[b]);
    }
    rt_slot *vs = &m->vbucket[0][0][0];
    for (size_t i = 0; i < sizeof m->vbucket / sizeof *vs; i++) rt_slot_release(&m->runner, &vs[i]);
}

mt_status glm_model_set_pools(glm_model *m, int n_pages, int n_slots, mt_error *err) {
    if (n_pages < 1 || n_slots < 1)
        return mt_errorf(err, MT_ERR_INVALID, "pools need at least one page and one slot, got %d and %d", n_pages, n_slots);
    if (m->n_seqs - (m->pad_seq != NULL) > 0)
        return mt_errorf(err, MT_ERR_STATE, "the pools cannot be remade while %d sequences live",
                         m->n_seqs - (m->pad_seq != NULL));
    glm_seq_free(m->pad_seq);
    m->pad_seq = NULL;
    graphs_release(m); /* they hold addresses in the old pools */
    pools_release(m);
    mt_backend *be = m->be;
    /* with the drafter, the verify rings' slots (the state after each row of a verify) */
    const int n_ring = m->mtp.n_rings * (GLM_VERIFY_MAX - 1), slots = n_slots + n_ring;
    bool ok = rt_id_pool_init(&m->pages, n_pages) == MT_OK && rt_id_pool_init(&m->slots, slots) == MT_OK;
    for (int i = 0; ok && i < m->n_state_layers; i++) ok = glm_layer_pools_alloc(&m->layers[i], n_pages, slots);
    if (!ok) {
        pools_release(m);
        return mt_errorf(err, MT_ERR_NOMEM, "out of memory for %d pages and %d slots (%zu + %zu bytes)", n_pages,
                         n_slots, (size_t)n_pages * glm_model_page_bytes(m), (size_t)n_slots * glm_model_slot_bytes(m));
    }
    for (int i = 0; i < n_ring; i++) m->mtp.ring[i] = rt_id_take(&m->slots);
    for (int j = 0; j < m->mtp.n_rings; j++) m->mtp.ring_owner[j] = NULL;
    if (be->ops->graph_begin) glm_pad_ensure(m); /* the graph pad's slot and page, before any request's */
    return MT_OK;
}

/* The pools a model makes for itself when a sequence is made before glm_model_set_pools. */
static mt_status pools_default(glm_model *m, mt_error *err) {
    const int pages = m->params.pool_pages > 0 ? m->params.pool_pages : GLM_DEFAULT_POOL_PAGES;
    const int slots = m->params.pool_slots > 0 ? m->params.pool_slots : GLM_DEFAULT_POOL_SLOTS;
    return glm_model_set_pools(m, pages, slots, err);
}

mt_status glm_model_ensure_pools(glm_model *m, mt_error *err) {
    return m->slots.n > 0 ? MT_OK : pools_default(m, err);
}

/* An upload in the backend's order of work, without a round trip where the backend offers one
 * (upload_async). */
static void upload_ordered(mt_backend *be, void *dst, const void *src, size_t bytes) {
    (be->ops->upload_async ? be->ops->upload_async : be->ops->upload)(be, dst, src, bytes);
}

/* s's state moves outside the greedy chain (or s goes away): the device's token table is no
 * longer the next input of the chain's sequences. */
static void ahead_forget(glm_model *m, const glm_seq *s) {
    for (int i = 0; i < m->ahead.n && m->ahead.valid; i++)
        if (m->ahead.seqs[i] == s) m->ahead.valid = false;
}

mt_status glm_seq_reserve(glm_seq *s, int n, mt_error *err) {
    glm_model *m = s->m;
    const int page = glm_model_page_tokens(m);
    if (n < 0 || s->len + n > s->cap)
        return mt_errorf(err, MT_ERR_FULL, "sequence of %d tokens has room for %d more, asked for %d", s->len,
                         s->cap - s->len, n);
    if (!first_dsa(m)) return MT_OK; /* no paged layer */
    const int need = (s->len + n + page - 1) / page;
    if (rt_bt_map(&s->bt, m->be, &m->pages, need) != MT_OK)
        return mt_errorf(err, MT_ERR_FULL, "out of cache pages: %d more needed for %d tokens, %d free of %d",
                         need - s->bt.n_blocks, n, m->pages.n_free, m->pages.n);
    return MT_OK;
}

int glm_seq_pages(const glm_seq *s) { return s ? s->bt.n_blocks : 0; }

/* Points every layer state of s at its slot and block table; a fresh slot's state is zero, as a
 * sequence's first step expects. */
static void bind_states(glm_seq *s) {
    glm_model *m = s->m;
    for (int i = 0; i < m->n_state_layers; i++)
        glm_layer_bind_state(&m->layers[i], (glm_layer_state *)s->states[i], s->slot, s->bt.dev);
    glm_layers_zero_slot(m->layers, m->cfg.num_hidden_layers, s->slot);
}

mt_status glm_seq_new(glm_model *m, int max_tokens, glm_seq **out, mt_error *err) {
    *out = NULL;
    if (max_tokens < 1) return mt_errorf(err, MT_ERR_INVALID, "max_tokens must be >= 1, got %d", max_tokens);
    if (m->slots.n == 0) {
        mt_status st = pools_default(m, err);
        if (st != MT_OK) return st;
    }
    if (m->slots.n_free == 0) return mt_errorf(err, MT_ERR_FULL, "no free sequence slot (all %d in use)", m->slots.n);
    glm_seq *s = calloc(1, sizeof *s);
    const int L = m->n_state_layers;
    const int max_blocks = max_tokens / glm_model_page_tokens(m) + 1;
    if (!s || !(s->states = calloc((size_t)L, sizeof *s->states)) || rt_bt_init(&s->bt, m->be, max_blocks) != MT_OK) {
        if (s) free(s->states);
        free(s);
        return mt_errorf(err, MT_ERR_NOMEM, "out of memory for a sequence");
    }
    s->base.model = &m->base;
    s->m = m;
    s->cap = max_tokens;
    s->slot = rt_id_take(&m->slots);
    m->n_seqs++;
    for (int i = 0; i < L; i++) {
        mt_status st = mt_layer_alloc_state(&m->layers[i].base, max_tokens, &s->states[i], err);
        if (st != MT_OK) {
            glm_seq_free(s);
            return st;
        }
    }
    if (m->mtp.on) {
        const size_t hb = sizeof(float) * (size_t)m->cfg.hidden_size;
        if (!(s->hp = m->be->ops->alloc(m->be, hb)) || !(s->u = m->be->ops->alloc(m->be, hb))) {
            glm_seq_free(s);
            return mt_errorf(err, MT_ERR_NOMEM, "out of memory for a sequence's drafter state");
        }
    }
    bind_states(s);
    if (max_tokens > m->rt_cap) m->rt_cap = max_tokens; /* batched-decode graphs are sized by it */
    *out = s;
    return MT_OK;
}

void glm_seq_free(glm_seq *s) {
    if (!s) return;
    glm_model *m = s->m;
    ahead_forget(m, s); /* its address may come back for another sequence */
    if (s->lp_done > 0) m->lp_count--; /* leaves its layered group */
    rt_slot_release(&m->runner, &s->graph);
    for (int k = 0; k <= GLM_VERIFY_MAX; k++) rt_slot_release(&m->runner, &s->verify[k]);
    for (int i = 0; i < m->n_state_layers; i++)
        if (s->states[i]) mt_layer_release_state(&m->layers[i].base, s->states[i]);
    m->be->ops->free(m->be, s->hp);
    m->be->ops->free(m->be, s->u);
    for (int j = 0; j < m->mtp.n_rings; j++)
        if (m->mtp.ring_owner[j] == s) m->mtp.ring_owner[j] = NULL;
    rt_bt_release(&s->bt, m->be, &m->pages);
    rt_id_drop(&m->slots, s->slot);
    m->n_seqs--;
    free(s->states);
    free(s);
}

int glm_seq_len(const glm_seq *s) { return s->len; }
const int32_t *glm_seq_page_ids(const glm_seq *s) { return s->bt.host; }
size_t glm_seq_bytes(const glm_seq *s) {
    return s ? glm_model_slot_bytes(s->m) + (size_t)s->bt.n_blocks * glm_model_page_bytes(s->m) : 0;
}

size_t glm_model_seq_bytes(const glm_model *m, int max_tokens) {
    size_t b = 0;
    for (int i = 0; i < m->n_state_layers; i++) b += glm_layer_state_bytes(&m->layers[i], max_tokens);
    return b;
}

/* Three kinds of per-sequence state move to dst: paged (src's full pages are mapped into dst too,
 * shared and counted; a page dst will write more of is copied into a page of its own), slots
 * (recurrent state copied slot to slot), and aux state (each layer that has it: snapshot of src,
 * restored into dst). */
mt_status glm_seq_copy_prefix(glm_model *m, const glm_seq *src, glm_seq *dst, mt_error *err) {
    if (src->m != m || dst->m != m) return mt_errorf(err, MT_ERR_INVALID, "sequences of another model");
    if (dst->len != 0) return mt_errorf(err, MT_ERR_STATE, "destination sequence is not fresh (%d tokens)", dst->len);
    ahead_forget(m, dst);
    if (src->len > dst->cap)
        return mt_errorf(err, MT_ERR_FULL, "%d positions do not fit a sequence of %d", src->len, dst->cap);
    /* A page dst will still write is its own: past src's length, and with the drafter past its
     * rows too (it lags the target by the pending row, which dst writes with its own next token). */
    const int written = m->mtp.on ? glm_mtp_committed(m, src) : src->len;
    const int page = glm_model_page_tokens(m), full = written / page, part = src->len > full * page;
    if (first_dsa(m)) {
        if (rt_bt_share(&dst->bt, m->be, &m->pages, &src->bt, full, part) != MT_OK)
            return mt_errorf(err, MT_ERR_FULL, "out of cache pages for a copied prefix");
        if (part) glm_layers_copy_page(m->layers, m->n_state_layers, src->bt.host[full], dst->bt.host[full]);
    }
    glm_layers_copy_slot(m->layers, m->cfg.num_hidden_layers, src->slot, dst->slot);
    for (int l = 0; l < m->n_state_layers; l++) {
        const mt_layer *ml = &m->layers[l].base;
        glm_layer_state *d = (glm_layer_state *)dst->states[l];
        /* the drafter's rows: its committed ones (src drafts nothing while it is a kept prefix) */
        d->len = l < m->cfg.num_hidden_layers ? src->len : glm_mtp_committed(m, src);
        /* a DSA layer's aux state is its indexer cache, in the pages dst now shares or holds a
         * copy of (above): nothing more to move, and no round trip through the host (each of its
         * transfers waits for the device). A PLE memory's state lies outside the pages. */
        if (!mt_layer_has_aux_state(ml) || (m->cfg.layer_types[l] == GLM_MIXER_DSA && !m->layers[l].ple.on)) continue;
        void *snap = NULL;
        size_t n = 0;
        mt_status st = mt_layer_snapshot_aux(ml, src->states[l], &snap, &n, err);
        if (st == MT_OK) st = mt_layer_restore_aux(ml, dst->states[l], snap, n, err);
        free(snap);
        if (st != MT_OK) return st;
    }
    dst->len = src->len;
    if (m->mtp.on) m->be->ops->copy(m->be, dst->hp, src->hp, sizeof(float) * (size_t)m->cfg.hidden_size);
    return MT_OK;
}

mt_status glm_model_ple_apply(glm_model *m, glm_seq *s, int layer, const int32_t *ids, float *X, int n) {
    if (layer < 0 || layer >= m->cfg.num_hidden_layers || !m->layers[layer].ple.on || n < 1 || n > m->scr.rows)
        return MT_ERR_INVALID;
    const size_t bytes = sizeof(float) * (size_t)n * m->cfg.hc_mult * m->cfg.hidden_size;
    m->be->ops->upload(m->be, m->X, X, bytes);
    mt_step step = { .be = m->be, .t0 = -1, .scr = &m->scr, .ids = ids, .ids_stride = 1 };
    glm_layer_state *st = (glm_layer_state *)s->states[layer];
    mt_status r = glm_ple_forward(&m->layers[layer], &st, 1, &step, m->X, n);
    if (r == MT_OK) m->be->ops->download(m->be, X, m->X, bytes);
    return r;
}

int glm_model_n_layers(const glm_model *m) { return m->cfg.num_hidden_layers; }

/* Units of layered prefill a layer: 1 + P (its attention site, then its MLP site in P parts of
 * the routed experts) or 1. */
static int lp_xparts(const glm_model *m) { return m->params.layered_expert_parts > 1 ? m->params.layered_expert_parts : 1; }
static int lp_per_layer(const glm_model *m) { return m->params.layered_sites ? 1 + lp_xparts(m) : 1; }

int glm_model_layered_units(const glm_model *m) { return m->cfg.num_hidden_layers * lp_per_layer(m); }
const mt_layer *glm_model_layer(const glm_model *m, int i) { return &m->layers[i].base; }
mt_layer_state *glm_seq_state(glm_seq *s, int i) { return s->states[i]; }

/* The embedding's rows summed over the ranks of a vocab-parallel embedding (each rank looked up
 * its own rows and zeros for the others'); nothing on one rank. */
static mt_status embed_reduce(glm_model *m, float *buf, size_t count) {
    return m->tp_size > 1 ? glm_all_reduce(m->comm, buf, count) : MT_OK;
}

/* X[i, s] = embedding of host token i for every stream s: one lookup into z, then S row copies
 * per token (the decode paths, where n is small). */
static mt_status highway_from_tokens(glm_model *m, const int32_t *tokens, int n) {
    mt_backend *be = m->be;
    const int S = m->cfg.hc_mult, H = m->cfg.hidden_size;
    be->ops->embed(be, m->z, &m->embed, tokens, n);
    mt_status st = embed_reduce(m, m->z, (size_t)n * H);
    for (int i = 0; i < n && st == MT_OK; i++)
        for (int j = 0; j < S; j++)
            be->ops->copy(be, m->X + ((size_t)i * S + j) * H, m->z + (size_t)i * H, sizeof(float) * H);
    return st;
}

/* The head over highway rows X[rows, S, H]: mean of streams, final norm, lm_head into m->logits
 * (on several ranks: each rank's vocab slice, then gathered); downloaded into logits_host when
 * not NULL. */
static mt_status head_logits(glm_model *m, const float *X, int rows, float *logits_host) {
    mt_backend *be = m->be;
    const glm_config *c = &m->cfg;
    if (be->ops->hc_head_norm) {
        be->ops->hc_head_norm(be, m->z, X, m->norm, rows, c->hc_mult, c->hidden_size, c->rms_norm_eps);
    } else {
        be->ops->hc_head(be, m->z, X, rows, c->hc_mult, c->hidden_size);
        be->ops->rmsnorm(be, m->z, m->z, m->norm, rows, c->hidden_size, c->rms_norm_eps);
    }
    return glm_logits_rows(m, m->z, rows, logits_host);
}

mt_status glm_logits_rows(glm_model *m, const float *z, int rows, float *logits_host) {
    mt_backend *be = m->be;
    be->ops->matmul(be, m->tp_size > 1 ? m->logits_local : m->logits, z, &m->lm_head, rows);
    mt_status st = glm_gather_logits(m, rows);
    if (st == MT_OK && logits_host)
        be->ops->download(be, logits_host, m->logits, sizeof(float) * (size_t)rows * m->cfg.vocab_size);
    return st;
}

/* Ring j's slots, which a verify of k rows writes (mt_step.vring): NULL for one row or without
 * the drafter. */
static const int *verify_ring(const glm_model *m, int k, int j) {
    return m->mtp.on && k > 1 ? m->mtp.ring + (size_t)j * (GLM_VERIFY_MAX - 1) : NULL;
}
static float *ring_hidden(const glm_model *m, int j) {
    return m->mtp.ring_h + (size_t)j * GLM_VERIFY_MAX * m->cfg.hidden_size;
}

/* Before a decode of k rows of s with the drafter on: where glm_seq_keep drops rows of it from
 * (the layers write the states after each row into the ring: glm_kda_forward). */
static void verify_mark(glm_model *m, glm_seq *s, int k, int ring) {
    s->v_pos = s->len;
    s->v_n = k;
    s->v_ring = ring;
    if (k > 1) m->mtp.ring_owner[ring] = s;
}

/* Rows [0, n) of the highway through every layer, then the head for the rows whose logits are
 * wanted ([first, n)), downloaded into logits_host. decode selects the layers' decode path (one
 * row) or decode_batched (n rows: a verify). */
static mt_status forward(glm_model *m, glm_seq *s, const int32_t *tokens, int n, bool decode,
                         int first, float *logits_host) {
    const glm_config *c = &m->cfg;
    mt_backend *be = m->be;
    const int S = c->hc_mult, H = c->hidden_size;
    mt_step step = { .be = be, .t0 = s->len, .scr = &m->scr, .ids = tokens, .ids_stride = 1,
                     .vring = decode ? verify_ring(m, n, 0) : NULL, .vring_id = 0 };
    m->scr.sel_n = 0;
    /* X[i, s] = embedding of token i for every stream s. Prefill looks each token up S times
     * straight into X (one op, where n*S row copies cost a launch each); decode keeps its copies. */
    int32_t *rep = decode ? NULL : malloc(sizeof(int32_t) * (size_t)n * S);
    mt_status est;
    if (rep) {
        for (int i = 0; i < n; i++)
            for (int j = 0; j < S; j++) rep[(size_t)i * S + j] = tokens[i];
        be->ops->embed(be, m->X, &m->embed, rep, n * S);
        free(rep);
        est = embed_reduce(m, m->X, (size_t)n * S * H);
    } else {
        est = highway_from_tokens(m, tokens, n);
    }
    if (est != MT_OK) return est;
    for (int l = 0; l < c->num_hidden_layers; l++) {
        const mt_layer *ml = &m->layers[l].base;
        mt_status st = !decode ? mt_layer_prefill(ml, s->states[l], &step, m->X, n)
                       : n == 1 ? mt_layer_decode(ml, s->states[l], &step, m->X)
                                : mt_layer_decode_batched(ml, s->states[l], &step, m->X, n);
        if (st != MT_OK) return st;
    }
    s->len += n;
    /* decode always leaves its logits in m->logits (glm_last_argmax reads them there) */
    if ((logits_host || decode) && first < n) return head_logits(m, m->X + (size_t)first * S * H, n - first, logits_host);
    return MT_OK;
}

static mt_status check_tokens(const glm_model *m, const glm_seq *s, const int32_t *tokens, int n,
                              mt_error *err) {
    if (n < 1) return mt_errorf(err, MT_ERR_INVALID, "no tokens to feed");
    for (int i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= m->cfg.vocab_size)
            return mt_errorf(err, MT_ERR_INVALID, "token %d at index %d is outside the vocabulary [0, %d)",
                             tokens[i], i, m->cfg.vocab_size);
    if (s->len + n > s->cap)
        return mt_errorf(err, MT_ERR_FULL, "sequence of %d tokens has room for %d more, asked for %d",
                         s->len, s->cap - s->len, n);
    return MT_OK;
}

mt_status glm_prefill(glm_model *m, glm_seq *s, const int32_t *tokens, int n, float *logits,
                      bool all_logits, mt_error *err) {
    if (s->lp_done > 0)
        return mt_errorf(err, MT_ERR_INVALID, "a prefill of a sequence whose layered chunk is in flight (%d layered units run)",
                         s->lp_done);
    ahead_forget(m, s);
    s->v_n = 0;
    mt_status st = check_tokens(m, s, tokens, n, err);
    if (st == MT_OK) st = glm_seq_reserve(s, n, err);
    if (st != MT_OK) return st;
    const int V = m->cfg.vocab_size, chunk = m->params.prefill_chunk;
    for (int done = 0; done < n;) {
        const int k = n - done < chunk ? n - done : chunk;
        const bool last = done + k == n;
        float *dst = NULL;
        int first = k;
        if (logits && all_logits) { dst = logits + (size_t)done * V; first = 0; }
        else if (logits && last) { dst = logits; first = k - 1; }
        if ((st = forward(m, s, tokens + done, k, false, first, dst)) != MT_OK ||
            (st = glm_mtp_follow(m, s, m->X, tokens + done, k)) != MT_OK)
            return mt_errorf(err, st, "prefill failed at position %d: %s", s->len, mt_status_str(st));
        done += k;
    }
    return MT_OK;
}

/* ---- the mixed step: several sequences' prompt chunks and decode rows in one pass ---- */

int glm_model_pass_rows(const glm_model *m) { return m->scr.rows; }

bool glm_seq_in_flight(const glm_seq *s) { return s->lp_done > 0; }

/* The units (layers, or sites with layered_sites) a part runs in its call: [lp_done, lp_done +
 * layers), or to the last. The attention of a DSA layer of a shared indexer reads the selection
 * its full layer just before left in the call's scratch, so a range that would end after that
 * full layer's attention and at or before the shared one's runs on past the shared attention. */
static void part_range(const glm_model *m, const glm_mixed_part *p, int *a, int *b) {
    const glm_config *c = &m->cfg;
    const int U = glm_model_layered_units(m), k = lp_per_layer(m);
    *a = p->s->lp_done;
    *b = p->layers > 0 && p->layers < U - *a ? *a + p->layers : U;
    for (int l; *b < U && (l = (*b + k - 1) / k) < c->num_hidden_layers &&
                c->layer_types[l] == GLM_MIXER_DSA && c->indexer_types[l] == GLM_INDEXER_SHARED;)
        *b = k * l + 1; /* the first unit after layer l's attention */
}

/* A mixed step's layered group: its parts [np_full, np) of rows [n_full, n) run units [l0, l1)
 * (layers, or sites); the parts before them (and all of them, when nothing is layered: l0 = 0,
 * l1 = the units' count) every layer. */
typedef struct glm_lrange {
    int l0, l1, np_full, n_full;
} glm_lrange;

static mt_status layered_check(glm_model *m, const glm_mixed_part *p, int np, int n, glm_lrange *lr, mt_error *err) {
    const int L = glm_model_layered_units(m);
    *lr = (glm_lrange){ 0, L, np, n };
    int first = -1;
    for (int i = 0, r = 0; i < np; r += p[i++].n) {
        int a, b;
        part_range(m, &p[i], &a, &b);
        if (a == 0 && b == L) {
            if (first >= 0)
                return mt_errorf(err, MT_ERR_INVALID, "mixed part %d runs every layer after the layered part %d", i, first);
            continue;
        }
        if (p[i].verify) return mt_errorf(err, MT_ERR_INVALID, "mixed part %d: a verify cannot be layered", i);
        if (a > 0 && p[i].n != p[i].s->lp_n)
            return mt_errorf(err, MT_ERR_INVALID, "mixed part %d: %d rows, but its chunk in flight has %d", i, p[i].n,
                             p[i].s->lp_n);
        if (first < 0) {
            first = i;
            *lr = (glm_lrange){ a, b, i, r };
        } else if (a != lr->l0 || b != lr->l1) {
            return mt_errorf(err, MT_ERR_INVALID, "mixed part %d runs layered units [%d, %d), part %d [%d, %d): one range a step",
                             i, a, b, first, lr->l0, lr->l1);
        }
    }
    if (first >= 0 && lr->l0 == 0 && m->lp_count > 0)
        return mt_errorf(err, MT_ERR_INVALID, "a layered chunk starts while %d others are in flight", m->lp_count);
    const size_t RH = (size_t)m->scr.rows * m->cfg.hidden_size;
    if (first >= 0 && !m->lp_X && !(m->lp_X = m->be->ops->alloc(m->be, sizeof(float) * RH * m->cfg.hc_mult)))
        return mt_errorf(err, MT_ERR_NOMEM, "out of backend memory for layered chunks");
    if (first >= 0 && lp_xparts(m) > 1 && !m->lp_parts) { /* sums [2][rows, H], picks [4][rows, top_k] */
        const size_t RK = (size_t)m->scr.rows * m->cfg.num_experts_per_tok;
        float *b = m->lp_parts = m->be->ops->alloc(m->be, sizeof(float) * (2 * RH + 4 * RK));
        if (!b) return mt_errorf(err, MT_ERR_NOMEM, "out of backend memory for layered chunks' expert parts");
        m->lp_A = b;
        m->lp_acc = b + RH;
        m->lp_wts = b + 2 * RH;
        m->lp_wts_s = b + 2 * RH + RK;
        m->lp_idx = (int32_t *)(b + 2 * RH + 2 * RK);
        m->lp_idx_s = (int32_t *)(b + 2 * RH + 3 * RK);
    }
    return MT_OK;
}

static mt_status mixed_check(glm_model *m, const glm_mixed_part *p, int np, int *rows, mt_error *err) {
    int n = 0;
    if (np < 1) return mt_errorf(err, MT_ERR_INVALID, "a mixed step of no parts");
    for (int i = 0; i < np; i++) {
        if (!p[i].s || p[i].s->m != m || !p[i].tokens)
            return mt_errorf(err, MT_ERR_INVALID, "mixed part %d: no tokens, or a sequence of another model", i);
        mt_status st = check_tokens(m, p[i].s, p[i].tokens, p[i].n, err);
        if (st != MT_OK) return st;
        if (p[i].verify && p[i].n > GLM_VERIFY_MAX)
            return mt_errorf(err, MT_ERR_INVALID, "mixed part %d: a verify of %d rows (at most %d)", i, p[i].n,
                             GLM_VERIFY_MAX);
        for (int j = 0; j < i; j++)
            if (p[j].s == p[i].s) return mt_errorf(err, MT_ERR_INVALID, "sequence of part %d appears twice (also at %d)", i, j);
        n += p[i].n;
    }
    if (n > m->scr.rows)
        return mt_errorf(err, MT_ERR_INVALID, "a mixed step of %d rows is more than a pass holds (%d)", n, m->scr.rows);
    for (int l = 0; l < m->cfg.num_hidden_layers; l++)
        if (!m->layers[l].base.ops->forward_segments)
            return mt_errorf(err, MT_ERR_UNSUPPORTED, "layer %d (%s) cannot run a mixed step", l, m->layers[l].base.kind);
    for (int i = 0; i < np; i++) { /* pages first: a shortage refuses the step before any change */
        mt_status st = glm_seq_reserve(p[i].s, p[i].n, err);
        if (st != MT_OK) return st;
    }
    *rows = n;
    return MT_OK;
}

static void rows_upload(glm_model *m, glm_seq **seqs, const int32_t *tokens, int n, int B);

/* The parts of a rows block with verifies: the step's leading parts, then the pads of a graph
 * bucket (vgraph_slot) on m->pad_seq: a pad verify's rows at the pad's positions 0 .. kmax - 1
 * (within its one page: GLM_PAGE >= GLM_VERIFY_MAX), its ring entries NULL (the KDA's ring copies
 * skip them). */
typedef struct vb_parts {
    const glm_mixed_part *p;
    const glm_segment *seg;
    int nb;                    /* the step's parts */
    int pv, pd, kmax;          /* pad verifies of kmax rows, pad decode rows */
} vb_parts;
_Static_assert(GLM_PAGE >= GLM_VERIFY_MAX, "a pad verify's rows share the pad sequence's one page");

static mt_status vblock_upload(glm_model *m, const vb_parts *v, int nrows, bool with_tokens, glm_vblock *vb);

/* The graph slot of a rows block of v's parts (nrows rows), when it replays one: the drafter's
 * graph conditions (glm_mtp_draft_graphs), every verify of one length kmax and the other parts one
 * row; v's pads then fill its bucket (the verifies and the decode rows each to a power of two)
 * within graph_max_rows and a pass. NULL: the block runs eagerly. */
static rt_slot *vgraph_slot(glm_model *m, vb_parts *v, int nrows) {
    if (!glm_mtp_draft_graphs(m) || m->census) return NULL;
    int kmax = 0, nv = 0, nd = 0;
    for (int i = 0; i < v->nb; i++) {
        const int k = v->p[i].n;
        if (k == 1) {
            nd++;
            continue;
        }
        if (!v->seg[i].vring || k > GLM_VERIFY_MAX || (kmax && k != kmax)) return NULL;
        kmax = k;
        nv++;
    }
    if (nv == 0) return NULL;
    const int bv = glm_bucket_of(nv), bd = nd ? glm_bucket_of(nd) : -1;
    if (bv >= GLM_BUCKETS || bd >= GLM_BUCKETS) return NULL;
    const int B = (1 << bv) * kmax + (nd ? 1 << bd : 0);
    rt_slot *slot = &m->vbucket[kmax][bv][bd + 1];
    if (B > m->params.graph_max_rows || B > m->rcap || slot->failures >= RT_MAX_CAPTURE_FAILURES) return NULL;
    if (B > nrows && !glm_pad_ensure(m)) return NULL;
    v->kmax = kmax;
    v->pv = (1 << bv) - nv;
    v->pd = nd ? (1 << bd) - nd : 0;
    return slot;
}

typedef struct mixed_ctx {
    glm_model *m;
    const glm_mixed_part *p;
    mt_step *step;
    mt_layer_state **sts;      /* [np] */
    int np, n;                 /* parts, rows */
    const int32_t *ids;        /* host [n, S] the highway rows' tokens; NULL: d_rrow + n holds them */
    bool head;                 /* the head over every row into m->logits [n, V] */
    const glm_lrange *lr;      /* the layered group's range (NULL: every part every layer) */
} mixed_ctx;

/* A layered group's rows between the step's buffer `at` (rows [n_full, n) of the step at row
 * base, W bytes a row) and `keep`, where each part has its place (lp_off): in copies to `at`,
 * out to `keep`. */
static void lp_copy(glm_model *m, const glm_mixed_part *p, int np, const glm_lrange *lr, void *at, void *keep,
                    size_t W, bool in) {
    for (int i = lr->np_full, r = 0; i < np; r += p[i++].n) {
        char *x = (char *)at + (size_t)r * W, *y = (char *)keep + (size_t)p[i].s->lp_off * W;
        const size_t bytes = W * (size_t)p[i].n;
        if (in) m->be->ops->copy(m->be, x, y, bytes);
        else m->be->ops->copy(m->be, y, x, bytes);
    }
}

/* The expert parts' per-row state of a layered group (lp_copy): sums and first-part picks. */
static void lp_parts_copy(glm_model *m, const glm_mixed_part *p, int np, const glm_lrange *lr, bool in) {
    const size_t H = (size_t)m->cfg.hidden_size, k = (size_t)m->cfg.num_experts_per_tok;
    lp_copy(m, p, np, lr, m->lp_acc, m->lp_A, sizeof(float) * H, in);
    lp_copy(m, p, np, lr, m->lp_idx_s, m->lp_idx, sizeof(int32_t) * k, in);
    lp_copy(m, p, np, lr, m->lp_wts_s, m->lp_wts, sizeof(float) * k, in);
}

/* A layered group's rows [n_full, n) between X and m->lp_X: in (to X) the parts that have run
 * layers already, out (to lp_X) those that stay in flight; each part keeps its place in lp_X. */
static void lp_move(glm_model *m, const glm_mixed_part *p, int np, const glm_lrange *lr, bool in) {
    const size_t SH = (size_t)m->cfg.hc_mult * m->cfg.hidden_size;
    if (!in && lr->l0 == 0) /* the group starts: its parts in order */
        for (int i = lr->np_full, off = 0; i < np; off += p[i++].n) p[i].s->lp_off = off;
    lp_copy(m, p, np, lr, m->X + (size_t)lr->n_full * SH, m->lp_X, sizeof(float) * SH, in);
}

/* A mixed step's pass: the embedding, the layers' forward_segments over the step, and with head
 * the head. With the tokens in backend memory nothing names a sequence, so a graph of a rows
 * block's bucket records it (vgraph_slot). */
static mt_status mixed_body(void *ctx) {
    const mixed_ctx *x = ctx;
    glm_model *m = x->m;
    mt_backend *be = m->be;
    const glm_config *c = &m->cfg;
    const int rows = x->n * c->hc_mult;
    if (x->ids) be->ops->embed(be, m->X, &m->embed, x->ids, rows);
    else be->ops->embed_dev(be, m->X, &m->embed, m->d_rrow + x->n, rows);
    mt_status st = embed_reduce(m, m->X, (size_t)rows * c->hidden_size);
    const glm_lrange *lr = x->lr;
    if (lr && lr->l0 > 0) lp_move(m, x->p, x->np, lr, true);
    m->scr.sel_n = 0;
    const int k = lp_per_layer(m), P = k > 1 ? k - 1 : 1;
    const int U = glm_model_layered_units(m);
    /* a range that starts or ends inside an MLP site's parts: its rows' partial sums in step order */
    const bool acc_in = lr && k > 2 && lr->l0 % k > 1, acc_out = lr && k > 2 && lr->l1 < U && lr->l1 % k > 1;
    if (acc_in) lp_parts_copy(m, x->p, x->np, lr, true);
    x->step->xr0 = lr ? lr->n_full : 0;
    x->step->xacc = m->lp_acc;
    x->step->xidx = m->lp_idx_s;
    x->step->xwts = m->lp_wts_s;
    for (int l = 0; l < c->num_hidden_layers && st == MT_OK; l++) {
        /* the group's rows through this layer's attention site (unit k l) and the parts [q0, q1)
         * of its MLP site (units k l + 1 ..., or the attention's own unit with whole layers) */
        const int mu = k == 1 ? l : k * l + 1;
        const int q0 = !lr ? 0 : lr->l0 <= mu ? 0 : lr->l0 - mu < P ? lr->l0 - mu : P;
        const int q1 = !lr ? P : lr->l1 <= mu ? 0 : lr->l1 - mu < P ? lr->l1 - mu : P;
        const bool att = !lr || (k * l >= lr->l0 && k * l < lr->l1), mlp = q1 > q0;
        const int np = att ? x->np : lr->np_full, n = att ? x->n : lr->n_full;
        const int n_mlp = mlp ? x->n : lr->n_full;
        if (np == 0 && n_mlp == 0) continue;
        for (int i = 0; i < np; i++) x->sts[i] = x->p[i].s->states[l];
        x->step->rtab = x->step->nrows > 0 ? m->d_rtab + (size_t)l * GLM_R_KINDS * m->rcap : NULL;
        x->step->nseg = np;
        x->step->mlp_rows = n_mlp != n;
        x->step->n_mlp = n_mlp;
        x->step->xparts = mlp && (q0 > 0 || q1 < P) ? P : 0;
        x->step->xq0 = q0;
        x->step->xq1 = q1;
        st = mt_layer_forward_segments(&m->layers[l].base, x->sts, np, x->step, m->X, n);
    }
    x->step->mlp_rows = false;
    x->step->xparts = 0;
    if (st == MT_OK && lr && lr->l1 < U) lp_move(m, x->p, x->np, lr, false); /* places the parts first */
    if (st == MT_OK && acc_out) lp_parts_copy(m, x->p, x->np, lr, false);
    return st == MT_OK && x->head ? head_logits(m, m->X, x->n, NULL) : st;
}

mt_status glm_forward_mixed(glm_model *m, const glm_mixed_part *p, int np, int ring0, mt_error *err) {
    const glm_config *c = &m->cfg;
    mt_backend *be = m->be;
    const int L = c->num_hidden_layers, S = c->hc_mult, H = c->hidden_size, V = c->vocab_size;
    const size_t SH = (size_t)S * H;
    int n = 0;
    glm_lrange lr;
    mt_status st = mixed_check(m, p, np, &n, err);
    if (st == MT_OK) st = layered_check(m, p, np, n, &lr, err);
    if (st != MT_OK) return st;
    const bool layered = lr.np_full < np, flying = layered && lr.l1 < glm_model_layered_units(m); /* stays in flight */
    glm_segment *seg = malloc(sizeof *seg * (size_t)np);
    mt_layer_state **sts = malloc(sizeof *sts * (size_t)np);
    int32_t *rep = malloc(sizeof(int32_t) * (size_t)n * S);
    int *want = malloc(sizeof(int) * (size_t)n); /* the rows whose logits go out, in order */
    glm_seq **rseq = malloc(sizeof *rseq * (size_t)np);
    glm_follow_part *fpart = malloc(sizeof *fpart * (size_t)np);
    if (!seg || !sts || !rep || !want || !rseq || !fpart) {
        st = mt_errorf(err, MT_ERR_NOMEM, "out of memory for a mixed step of %d rows", n);
        goto out;
    }
    const int msel = glm_max_sel(c);
    int nw = 0, nv = 0;
    for (int i = 0; i < np; i++) nv += p[i].verify && p[i].n > 1;
    if (m->mtp.on && (ring0 < 0 || ring0 + nv > m->mtp.n_rings)) {
        st = mt_errorf(err, MT_ERR_INVALID, "a mixed step of %d verify parts from ring %d: the model holds %d at a time",
                       nv, ring0, m->mtp.n_rings);
        goto out;
    }
    nv = ring0;
    for (int i = 0, r = 0; i < np; r += p[i++].n) {
        glm_seq *s = p[i].s;
        ahead_forget(m, s);
        s->v_n = 0;
        seg[i].vring = NULL;
        seg[i].vring_id = 0;
        if (p[i].verify && p[i].n > 1 && m->mtp.on) {
            verify_mark(m, s, p[i].n, nv);
            seg[i].vring_id = nv;
            seg[i].vring = verify_ring(m, p[i].n, nv++);
        }
        seg[i].t0 = s->len;
        seg[i].n = p[i].n;
        seg[i].scr = m->scr;
        seg[i].scr.sel += (size_t)r * msel;
        seg[i].scr.nsel += r;
        seg[i].scr.sel_n = 0;
        for (int t = 0; t < p[i].n; t++)
            for (int j = 0; j < S; j++) rep[(size_t)(r + t) * S + j] = p[i].tokens[t];
        /* one-row parts and verifies always take the head, a verify every row (ranks of a group
         * see the same parts and logits flags, but only the leader asks for greedy tokens: the
         * head's gather is collective) */
        const bool every = (p[i].logits && p[i].all_logits) || p[i].verify;
        if (flying && i >= lr.np_full) continue; /* its head waits for its last layer */
        if (p[i].logits || p[i].argmax || p[i].n == 1 || p[i].verify)
            for (int t = every ? 0 : p[i].n - 1; t < p[i].n; t++) want[nw++] = r + t;
    }
    /* the leading one-row parts of sequences under way (the step's decode rows) take the rows
     * form of batched decode, a pass of them through each mixer */
    /* and so do the verifies right after them (glm_vblock) where the backend copies rows by
     * tables and no layer has a PLE memory */
    int nb = 0, nrows = 0, nver = 0;
    bool rows_ok = true, ple = false;
    for (int l = 0; l < L && rows_ok; l++) {
        rows_ok = m->layers[l].base.ops->decode_multi_seq != NULL;
        ple |= m->layers[l].ple.on;
    }
    const bool vrows_ok = rows_ok && !ple && be->ops->copy_rows_ptr && be->ops->copy_rows_from;
    while (rows_ok && nb < lr.np_full && p[nb].s->len > 0) {
        const bool ver = vrows_ok && seg[nb].vring;
        if (p[nb].n != 1 && !ver) break;
        nver += ver;
        nrows += p[nb].n;
        rseq[nb] = p[nb].s;
        nb++;
    }
    glm_vblock vblk;
    if (nrows > 0) m->ahead.valid = false; /* the positions below overwrite the table the last greedy step left */
    /* a step that is all rows block (decode rows and verifies of one length, no chunk) replays the
     * graph of its bucket; the head then ran in it over every row (each is wanted) */
    vb_parts vp = { .p = p, .seg = seg, .nb = nb };
    rt_slot *vslot = nver > 0 && nb == np ? vgraph_slot(m, &vp, nrows) : NULL;
    mt_step step = { .be = be, .scr = &m->scr, .seg = seg, .nseg = np, .nrows = nrows, .nbparts = nb,
                     .vblk = nver > 0 ? &vblk : NULL, .rpos = m->d_rrow, .rcap = m->rcap, .rt_cap = m->rt_cap,
                     .ids = rep, .ids_stride = S };
    mixed_ctx ctx = { m, p, &step, sts, np, n, rep, false, layered ? &lr : NULL };
    if (vslot) { /* B rows with the pads, their tokens in the rows table */
        const int B = nrows + vp.pv * vp.kmax + vp.pd;
        if ((st = vblock_upload(m, &vp, B, true, &vblk)) != MT_OK) goto failed;
        step.nrows = ctx.n = B;
        step.ids = ctx.ids = NULL;
        step.d_ids = m->d_rrow + B;
        step.d_ids_stride = S;
        ctx.head = true;
        const rt_rows none = { 0 };
        char what[80];
        snprintf(what, sizeof what, "verify block of %d rows (%d verifies of %d)", B, vp.pv + nver, vp.kmax);
        if ((st = rt_run_step(&m->runner, vslot, true, m->rt_cap, &none, mixed_body, &ctx, what)) != MT_OK) goto failed;
    } else {
        if (nver > 0 && (st = vblock_upload(m, &vp, nrows, false, &vblk)) != MT_OK) goto failed;
        if (nrows > 0 && nver == 0) rows_upload(m, rseq, NULL, nrows, nrows);
        if ((st = mixed_body(&ctx)) != MT_OK) goto failed;
    }
    /* the rows form leaves the host-tracked cache lengths to its caller (decode: the hooks) */
    for (int l = 0; l < L; l++)
        for (int i = 0; i < nb && c->layer_types[l] == GLM_MIXER_DSA; i++)
            ((glm_layer_state *)p[i].s->states[l])->len = seg[i].t0 + seg[i].n;
    /* a layered group: its parts stay in flight (their lengths wait), or leave it here */
    for (int i = layered ? lr.np_full : np; i < np; i++) {
        glm_seq *s = p[i].s;
        if (flying) {
            m->lp_count += s->lp_done == 0;
            s->lp_done = lr.l1;
            s->lp_n = p[i].n;
        } else if (s->lp_done > 0) {
            m->lp_count--;
            s->lp_done = 0;
        }
    }
    const int np_done = flying ? lr.np_full : np; /* the parts through every layer */
    for (int i = 0; i < np_done; i++) p[i].s->len += p[i].n;
    /* the drafters first: they read the highway rows, which the gather below moves; a verify's
     * hidden rows go to its ring for glm_seq_keep */
    if (m->mtp.on && np_done > 0) {
        for (int i = 0; i < np_done; i++)
            fpart[i] = (glm_follow_part){ p[i].s, p[i].tokens, p[i].n,
                                          seg[i].vring ? ring_hidden(m, p[i].s->v_ring) : NULL };
        if ((st = glm_mtp_follow_parts(m, fpart, np_done, m->X)) != MT_OK) goto failed;
    }
    if (nw == 0) goto out;
    for (int w = 0; w < nw; w++) /* want[w] >= w: each row moves down into rows already read */
        if (want[w] != w) be->ops->copy(be, m->X + (size_t)w * SH, m->X + (size_t)want[w] * SH, sizeof(float) * SH);
    /* the head over the wanted rows; logits come to the host only for the parts that take them,
     * greedy tokens are taken on the device (a decode row's logits would be vocab floats each) */
    if (!ctx.head && (st = head_logits(m, m->X, nw, NULL)) != MT_OK) goto failed;
    bool any_argmax = false;
    for (int i = 0; i < np; i++) any_argmax |= p[i].argmax != NULL;
    int32_t *amax = NULL;
    if (any_argmax && !(amax = malloc(sizeof(int32_t) * (size_t)nw))) {
        st = mt_errorf(err, MT_ERR_NOMEM, "out of memory for the tokens of %d rows", nw);
        goto out;
    }
    if (any_argmax) be->ops->argmax(be, amax, m->logits, nw, V);
    for (int i = 0, w = 0; i < np_done; i++) {
        if (!p[i].logits && !p[i].argmax && p[i].n != 1 && !p[i].verify) continue;
        const bool all = p[i].logits && p[i].all_logits, every = all || p[i].verify;
        const int k = every ? p[i].n : 1;
        /* each part's own rows straight into its buffer: a step's decode rows beside a chunk
         * would otherwise bring vocab floats a row to the host (40 MB at 64 rows of bench-4L) */
        if (p[i].logits)
            be->ops->download(be, p[i].logits, m->logits + (size_t)(all ? w : w + k - 1) * V,
                              sizeof(float) * (size_t)(all ? k : 1) * V);
        if (p[i].argmax && p[i].verify) memcpy(p[i].argmax, amax + w, sizeof(int32_t) * (size_t)k);
        else if (p[i].argmax) p[i].argmax[0] = amax[w + k - 1];
        w += k;
    }
    free(amax);
    goto out;
failed:
    st = mt_errorf(err, st, "mixed step of %d parts (%d rows) failed: %s", np, n, mt_status_str(st));
out:
    free(seg);
    free(sts);
    free(rep);
    free(want);
    free(rseq);
    free(fpart);
    return st;
}

/* ---- one sequence in the graph form: a decode row, or k rows of a verify ---- */

/* Where the positions start in m->d_step (after the highway rows' tokens). */
static int32_t *step_positions(const glm_model *m) { return m->d_step + (size_t)GLM_VERIFY_MAX * m->cfg.hc_mult; }

typedef struct seq_step_ctx {
    glm_model *m;
    glm_seq *s;
    int k;
} seq_step_ctx;

/* The graph form of one step of k rows of s: the tokens and positions come from m->d_step (backend
 * memory), so the same recorded ops serve every step. Leaves the logits in m->logits. One row is
 * each layer's decode, k rows its decode_batched. */
static mt_status seq_step_body(void *ctx) {
    const seq_step_ctx *c = ctx;
    glm_model *m = c->m;
    glm_seq *s = c->s;
    mt_backend *be = m->be;
    const int S = m->cfg.hc_mult, H = m->cfg.hidden_size, L = m->cfg.num_hidden_layers;
    /* the rows' tokens: d_step[0] for one row, d_step[i * S] for k rows (seq_step) */
    mt_step step = { .be = be, .t0 = s->len, .scr = &m->scr, .d_pos = step_positions(m), .vring = verify_ring(m, c->k, 0),
                     .vring_id = 0, .d_ids = m->d_step, .d_ids_stride = S };
    m->scr.sel_n = 0;
    mt_status est;
    if (c->k == 1) {
        be->ops->embed_dev(be, m->z, &m->embed, m->d_step, 1);
        est = embed_reduce(m, m->z, (size_t)H);
        for (int j = 0; j < S; j++) be->ops->copy(be, m->X + (size_t)j * H, m->z, sizeof(float) * H);
    } else {
        be->ops->embed_dev(be, m->X, &m->embed, m->d_step, c->k * S);
        est = embed_reduce(m, m->X, (size_t)c->k * S * H);
    }
    if (est != MT_OK) return est;
    for (int l = 0; l < L; l++) {
        const mt_layer *ml = &m->layers[l].base;
        mt_status st = c->k == 1 ? mt_layer_decode(ml, s->states[l], &step, m->X)
                                 : mt_layer_decode_batched(ml, s->states[l], &step, m->X, c->k);
        if (st != MT_OK) return st;
    }
    return head_logits(m, m->X, c->k, NULL);
}

/* k rows of s through the graph runner: the hooks around the step, and the sequence's (or, when
 * no layer ties graphs to a sequence, the model's) graph of k rows. */
static mt_status seq_step(glm_model *m, glm_seq *s, const int32_t *tokens, int k, float *logits, mt_error *err) {
    mt_backend *be = m->be;
    const int S = m->cfg.hc_mult, pos = s->len;
    int32_t host[GLM_VERIFY_MAX * (8 + 1)];
    const size_t n_host = (size_t)GLM_VERIFY_MAX * (S + 1);
    MT_ASSERT(S <= 8 && k >= 1 && k <= GLM_VERIFY_MAX);
    memset(host, 0, sizeof(int32_t) * n_host);
    for (int i = 0; i < k; i++) {
        if (k == 1) host[0] = tokens[0];
        else
            for (int j = 0; j < S; j++) host[(size_t)i * S + j] = tokens[i];
        host[(size_t)GLM_VERIFY_MAX * S + i] = pos + i;
    }
    be->ops->upload(be, m->d_step, host, sizeof(int32_t) * n_host);
    mt_layer_state *const *states = s->states;
    const rt_rows rows = { .states = &states, .seq_len = &pos, .tokens = tokens, .n = 1, .k = k };
    mt_status st = rt_hooks_before(&m->runner, &rows, err);
    if (st != MT_OK) return st;
    if (pos + k > s->cap) /* no layer tracks a cache here: the capacity still bounds the step */
        return mt_errorf(err, MT_ERR_FULL, "decode at position %d: no room to replay %d rows (capacity %d)", pos, k, s->cap);
    rt_slot *slot = k > 1 ? &s->verify[k] : m->runner.plan.per_sequence ? &s->graph : &m->shared;
    seq_step_ctx ctx = { m, s, k };
    st = rt_run_step(&m->runner, slot, m->params.decode_graphs, 0, &rows, seq_step_body, &ctx,
                     k > 1 ? "verify" : "decode");
    if (st != MT_OK) return mt_errorf(err, st, "decode of %d rows at position %d failed: %s", k, pos, mt_status_str(st));
    if ((st = rt_hooks_after(&m->runner, &rows, err)) != MT_OK) return st;
    s->len += k;
    if (logits) be->ops->download(be, logits, m->logits, sizeof(float) * (size_t)k * m->cfg.vocab_size);
    return MT_OK;
}


/* k rows of s: the graph form when the backend captures (or device_positions asks for it), else
 * the eager layers' decode (k = 1) or decode_batched. */
static mt_status decode_seq(glm_model *m, glm_seq *s, const int32_t *tokens, int k, float *logits, mt_error *err) {
    ahead_forget(m, s);
    if (k < 1 || k > GLM_VERIFY_MAX)
        return mt_errorf(err, MT_ERR_INVALID, "a decode step of one sequence takes 1 to %d rows, got %d", GLM_VERIFY_MAX, k);
    for (int i = 0; i < k; i++)
        if (tokens[i] < 0 || tokens[i] >= m->cfg.vocab_size)
            return mt_errorf(err, MT_ERR_INVALID, "token %d at index %d is outside the vocabulary [0, %d)", tokens[i], i,
                             m->cfg.vocab_size);
    if (s->len + k <= s->cap) { /* past the capacity: refused by the hooks (graph form) or below */
        mt_status st = glm_seq_reserve(s, k, err);
        if (st != MT_OK) return st;
    }
    if (m->mtp.on) verify_mark(m, s, k, 0);
    const bool graph_form = m->params.device_positions || (m->params.decode_graphs && m->runner.plan.graphs);
    mt_status st;
    if (graph_form) {
        if ((st = seq_step(m, s, tokens, k, logits, err)) != MT_OK) return st;
    } else {
        if (s->len + k > s->cap)
            return mt_errorf(err, MT_ERR_FULL, "sequence of %d tokens has room for %d more, asked for %d", s->len,
                             s->cap - s->len, k);
        if ((st = forward(m, s, tokens, k, true, 0, logits)) != MT_OK)
            return mt_errorf(err, st, "decode failed at position %d: %s", s->len, mt_status_str(st));
    }
    if ((st = glm_mtp_follow(m, s, m->X, tokens, k)) != MT_OK)
        return mt_errorf(err, st, "the drafter failed after position %d: %s", s->len - 1, mt_status_str(st));
    /* a verify's pending hidden rows (follow left them in hin rows 1 .. k), for glm_seq_keep */
    if (verify_ring(m, k, 0))
        m->be->ops->copy(m->be, ring_hidden(m, 0), m->mtp.hin + m->cfg.hidden_size, sizeof(float) * (size_t)k * m->cfg.hidden_size);
    return MT_OK;
}


/* glm_seq_keep's checks; MT_OK: s may keep `keep` rows of its last step. */
static mt_status keep_check(const glm_model *m, const glm_seq *s, int keep, mt_error *err) {
    if (!m->mtp.on) return mt_errorf(err, MT_ERR_UNSUPPORTED, "rows are dropped only with the drafter on");
    if (s->m != m) return mt_errorf(err, MT_ERR_INVALID, "a sequence of another model");
    if (s->v_n < 1 || s->len != s->v_pos + s->v_n)
        return mt_errorf(err, MT_ERR_STATE, "the last step of the sequence was not a decode");
    if (keep < 1 || keep > s->v_n)
        return mt_errorf(err, MT_ERR_INVALID, "keep %d of a decode of %d rows", keep, s->v_n);
    if (keep < s->v_n && m->mtp.ring_owner[s->v_ring] != s)
        return mt_errorf(err, MT_ERR_STATE, "another sequence was verified since this one's verify");
    return MT_OK;
}

/* The kept rows' state, written by the verify: the paged layers' and the drafter's lengths cut
 * back (rows past a length are never read, and the next rows overwrite them), and what layers
 * keep outside the pools through their verify_keep (a PLE memory's history and conv state; every
 * such layer saw the same steps, so the first refuses or none does). The recurrent slot and the
 * drafter's pending row come from the ring (the caller's copies: *slot, *hidden). Nothing is
 * recomputed. keep < s->v_n, checked. */
static mt_status keep_host(glm_model *m, glm_seq *s, int keep, int *slot, const float **hidden, mt_error *err) {
    const int L = m->cfg.num_hidden_layers, drop = s->v_n - keep;
    for (int l = 0; l < L; l++) {
        mt_status st = mt_layer_verify_keep(&m->layers[l].base, s->states[l], keep, s->v_ring);
        if (st != MT_OK) return mt_errorf(err, st, "layer %d (%s) cannot keep %d rows of its last step", l,
                                          m->layers[l].base.kind, keep);
    }
    ahead_forget(m, s);
    for (int l = 0; l < L; l++) {
        glm_layer_state *st = (glm_layer_state *)s->states[l];
        if (m->cfg.layer_types[l] == GLM_MIXER_DSA) st->len = s->v_pos + keep;
    }
    *slot = verify_ring(m, 2, s->v_ring)[keep - 1];
    ((glm_layer_state *)s->states[L])->len -= drop; /* the drafter's rows follow the target's */
    s->n_spec = 0;
    *hidden = ring_hidden(m, s->v_ring) + (size_t)(keep - 1) * m->cfg.hidden_size;
    s->len = s->v_pos + keep;
    s->v_n = keep;
    return MT_OK;
}

mt_status glm_seq_keep(glm_model *m, glm_seq *s, int keep, mt_error *err) {
    mt_status st = keep_check(m, s, keep, err);
    if (st != MT_OK || keep == s->v_n) return st;
    int slot;
    const float *hidden;
    if ((st = keep_host(m, s, keep, &slot, &hidden, err)) != MT_OK) return st;
    glm_layers_copy_slot(m->layers, m->cfg.num_hidden_layers, slot, s->slot);
    m->be->ops->copy(m->be, s->hp, hidden, sizeof(float) * (size_t)m->cfg.hidden_size);
    return MT_OK;
}

mt_status glm_seq_keep_rows(glm_model *m, glm_seq **seqs, const int *keeps, int n, int *done, mt_error *err) {
    *done = 0;
    mt_backend *be = m->be;
    const glm_config *c = &m->cfg;
    const int L = c->num_hidden_layers;
    if (!be->ops->copy_rows_ptr || n > m->mtp.n_rings) { /* one at a time */
        for (; *done < n; (*done)++) {
            mt_status st = glm_seq_keep(m, seqs[*done], keeps[*done], err);
            if (st != MT_OK) return st;
        }
        return MT_OK;
    }
    /* per kind of copy (each KDA layer's conv states and recurrent state, then the drafter's
     * pending row) a table of destinations and one of sources, n entries each, r of them used */
    const int kinds = 2 * L + 1;
    void **h = m->mtp.h_keep;
    int r = 0;
    mt_status st = MT_OK;
    for (; *done < n; (*done)++) {
        glm_seq *s = seqs[*done];
        const int keep = keeps[*done];
        if ((st = keep_check(m, s, keep, err)) != MT_OK) break;
        for (int q = 0; q < *done && st == MT_OK; q++)
            if (seqs[q] == s) st = mt_errorf(err, MT_ERR_INVALID, "keep %d: its sequence is also keep %d", *done, q);
        if (st != MT_OK) break;
        if (keep == s->v_n) continue;
        int slot;
        const float *hidden;
        if ((st = keep_host(m, s, keep, &slot, &hidden, err)) != MT_OK) break;
        for (int l = 0; l < L; l++) {
            if (c->layer_types[l] != GLM_MIXER_KDA) continue;
            float *fc, *fr, *tc, *tr;
            size_t cf, rf;
            glm_layer_slot_at(&m->layers[l], slot, &fc, &fr, &cf, &rf);
            glm_layer_slot_at(&m->layers[l], s->slot, &tc, &tr, &cf, &rf);
            h[(size_t)(2 * l) * 2 * n + r] = tc;
            h[(size_t)(2 * l) * 2 * n + n + r] = fc;
            h[(size_t)(2 * l + 1) * 2 * n + r] = tr;
            h[(size_t)(2 * l + 1) * 2 * n + n + r] = fr;
        }
        h[(size_t)(2 * L) * 2 * n + r] = s->hp;
        h[(size_t)(2 * L) * 2 * n + n + r] = (void *)hidden;
        r++;
    }
    /* the copies of the sequences kept so far, also when a later one failed */
    if (r > 0) {
        void **d = m->mtp.d_keep;
        upload_ordered(be, d, h, sizeof(void *) * (size_t)kinds * 2 * n);
        for (int l = 0; l < L; l++) {
            if (c->layer_types[l] != GLM_MIXER_KDA) continue;
            float *c0, *r0;
            size_t cf, rf;
            glm_layer_slot_at(&m->layers[l], 0, &c0, &r0, &cf, &rf);
            for (int k = 0; k < 2; k++) {
                void **t = d + (size_t)(2 * l + k) * 2 * n;
                be->ops->copy_rows_ptr(be, (float *const *)t, (const float *const *)(t + n), r, (int64_t)(k ? rf : cf));
            }
        }
        void **t = d + (size_t)(2 * L) * 2 * n;
        be->ops->copy_rows_ptr(be, (float *const *)t, (const float *const *)(t + n), r, c->hidden_size);
    }
    return st;
}

mt_status glm_decode(glm_model *m, glm_seq *s, int32_t token, float *logits, mt_error *err) {
    return decode_seq(m, s, &token, 1, logits, err);
}

mt_status glm_decode_verify(glm_model *m, glm_seq *s, const int32_t *tokens, int k, float *logits, mt_error *err) {
    return decode_seq(m, s, tokens, k, logits, err);
}

/* ---- batched decode: the rows form, with graphs per bucket of rows ---- */

/* Fills and uploads the rows tables for B rows: rows [0, n) are seqs[i] at its next position,
 * rows [n, B) pad a graph bucket with position 0 of m->pad_seq (their outputs are dropped; pad
 * rows all write the pad sequence's state, which is scratch). tokens NULL: the token table is
 * already in d_rrow (the last greedy step's argmax put it there), so only the positions go up. */
static void rows_upload(glm_model *m, glm_seq **seqs, const int32_t *tokens, int n, int B) {
    const glm_config *c = &m->cfg;
    const int L = c->num_hidden_layers, S = c->hc_mult, cap = m->rcap;
    mt_backend *be = m->be;
    /* h_rtab mirrors d_rtab (both start zeroed; only this function writes either), so only the
     * span of entries that changed goes up: none while the batch keeps its sequences. */
    size_t lo = SIZE_MAX, hi = 0;
    for (int i = 0; i < B; i++) {
        glm_seq *s = i < n ? seqs[i] : m->pad_seq;
        m->h_rrow[i] = i < n ? s->len : 0;
        if (tokens)
            for (int j = 0; j < S; j++) m->h_rrow[B + (size_t)i * S + j] = i < n ? tokens[i] : 0;
        for (int l = 0; l < L; l++) {
            const glm_layer_state *st = (const glm_layer_state *)s->states[l];
            void *const ptrs[GLM_R_KINDS] = { st->conv[0], st->conv[1], st->conv[2], st->rec, (void *)s->bt.dev,
                                              st->ple ? st->ple->conv : NULL, st->ple ? st->ple->staged : NULL,
                                              st->ple ? st->ple->d_hist : NULL };
            for (int k = 0; k < GLM_R_KINDS; k++) {
                const size_t e = ((size_t)l * GLM_R_KINDS + k) * cap + i;
                if (m->h_rtab[e] == ptrs[k]) continue;
                m->h_rtab[e] = ptrs[k];
                if (e < lo) lo = e;
                if (e > hi) hi = e;
            }
        }
    }
    upload_ordered(be, m->d_rrow, m->h_rrow, sizeof(int32_t) * (size_t)B * (tokens ? 1 + S : 1));
    if (lo <= hi) upload_ordered(be, m->d_rtab + lo, m->h_rtab + lo, sizeof(void *) * (hi - lo + 1));
}

/* Entry idx of layer l's table of kind k, host mirror and the span to upload (rows_upload). */
static void rtab_set(glm_model *m, int l, int k, int idx, void *ptr, size_t *lo, size_t *hi) {
    const size_t e = ((size_t)l * GLM_R_KINDS + k) * m->rcap + idx;
    if (m->h_rtab[e] == ptr) return;
    m->h_rtab[e] = ptr;
    if (e < *lo) *lo = e;
    if (e > *hi) *hi = e;
}

static int vb_count(const vb_parts *v) { return v->nb + v->pv + v->pd; }
static glm_seq *vb_seq(const glm_model *m, const vb_parts *v, int i) { return i < v->nb ? v->p[i].s : m->pad_seq; }
static int vb_rows(const vb_parts *v, int i) { return i < v->nb ? v->p[i].n : i < v->nb + v->pv ? v->kmax : 1; }
static const int *vb_ring(const vb_parts *v, int i) { return i < v->nb ? v->seg[i].vring : NULL; }
static int32_t vb_token(const vb_parts *v, int i, int j) { return i < v->nb ? v->p[i].tokens[j] : 0; }

/* The tables of a mixed step's rows block with verifies (glm_vblock) into vb: the parts of v,
 * part i's rows from row r0 + ... in the step's order (nrows in all). with_tokens: the rows'
 * tokens too, S a row after the nrows positions (d_rrow as a pass of nrows rows reads it), for
 * a body that embeds from backend memory. */
static mt_status vblock_upload(glm_model *m, const vb_parts *v, int nrows, bool with_tokens, glm_vblock *vb) {
    const glm_config *c = &m->cfg;
    const int L = c->num_hidden_layers, H = c->hidden_size, S = c->hc_mult, cap = m->rcap, nb = vb_count(v);
    int *ord = malloc(sizeof(int) * (size_t)nb), *r0 = malloc(sizeof(int) * (size_t)nb);
    void **t = malloc(sizeof(void *) * 3 * (size_t)nrows);
    if (!ord || !r0 || !t) {
        free(ord);
        free(r0);
        free(t);
        return MT_ERR_NOMEM;
    }
    memset(vb, 0, sizeof *vb);
    for (int i = 0, r = 0; i < nb; r += vb_rows(v, i++)) {
        r0[i] = r;
        int q = i; /* insertion: the parts by rows, most first, stably */
        while (q > 0 && vb_rows(v, ord[q - 1]) < vb_rows(v, i)) {
            ord[q] = ord[q - 1];
            q--;
        }
        ord[q] = i;
        for (int j = 0; j < vb_rows(v, i); j++) {
            m->h_rrow[r + j] = vb_seq(m, v, i)->len + j;
            if (with_tokens)
                for (int k = 0; k < S; k++) m->h_rrow[nrows + (size_t)(r + j) * S + k] = vb_token(v, i, j);
        }
    }
    vb->kmax = vb_rows(v, ord[0]);
    size_t lo = SIZE_MAX, hi = 0;
    for (int j = 0, kr = 0; j < vb->kmax; j++) {
        for (int q = 0; q < nb && vb_rows(v, ord[q]) > j; q++, kr++) {
            const int i = ord[q], lr = r0[i] + j, ni = vb_rows(v, i);
            const glm_seq *s = vb_seq(m, v, i);
            vb->n_at[j]++;
            vb->save_at[j] += ni > j + 1;
            t[kr] = m->scr.h + (size_t)lr * H;
            t[nrows + kr] = m->scr.a + (size_t)lr * H;
            t[2 * (size_t)nrows + kr] = m->scr.h + (size_t)kr * H;
            for (int l = 0; l < L; l++) {
                const glm_layer_state *st = (const glm_layer_state *)s->states[l];
                rtab_set(m, l, GLM_R_BT, lr, (void *)s->bt.dev, &lo, &hi);
                if (c->layer_types[l] != GLM_MIXER_KDA) continue;
                for (int k = 0; k < 3; k++) rtab_set(m, l, GLM_R_CONV0 + k, kr, st->conv[k], &lo, &hi);
                rtab_set(m, l, GLM_R_REC, kr, st->rec, &lo, &hi);
                float *rc = NULL, *rr = NULL;
                size_t cf, rf;
                if (j + 1 < ni && vb_ring(v, i)) glm_layer_slot_at(&m->layers[l], vb_ring(v, i)[j], &rc, &rr, &cf, &rf);
                rtab_set(m, l, GLM_R_RING_CONV, kr, rc, &lo, &hi);
                rtab_set(m, l, GLM_R_RING_REC, kr, rr, &lo, &hi);
            }
        }
    }
    mt_backend *be = m->be;
    upload_ordered(be, m->d_rrow, m->h_rrow, sizeof(int32_t) * (size_t)nrows * (with_tokens ? 1 + S : 1));
    if (lo <= hi) upload_ordered(be, m->d_rtab + lo, m->h_rtab + lo, sizeof(void *) * (hi - lo + 1));
    upload_ordered(be, m->d_vtab, t, sizeof(void *) * (size_t)nrows);
    upload_ordered(be, m->d_vtab + cap, t + nrows, sizeof(void *) * (size_t)nrows);
    upload_ordered(be, m->d_vtab + 2 * (size_t)cap, t + 2 * (size_t)nrows, sizeof(void *) * (size_t)nrows);
    vb->gather = (const float *const *)m->d_vtab;
    vb->scatter_dst = (float *const *)(m->d_vtab + cap);
    vb->scatter_src = (const float *const *)(m->d_vtab + 2 * (size_t)cap);
    free(ord);
    free(r0);
    free(t);
    return MT_OK;
}

/* One batched step of B rows from the uploaded tables, through every layer's decode_multi_seq
 * and the head; logits stay in m->logits [B, V]. Every op reads its rows from backend memory, so
 * the same body is what a bucket graph records. sts: B layer states (host bookkeeping only). */
static mt_status rows_body(glm_model *m, glm_seq **seqs, int n, int B, mt_layer_state **sts, bool host_ids) {
    const glm_config *c = &m->cfg;
    mt_backend *be = m->be;
    const int L = c->num_hidden_layers;
    mt_step step = { .be = be, .t0 = -1, .scr = &m->scr, .rpos = m->d_rrow, .rcap = m->rcap,
                     .rt_cap = m->rt_cap, .census = m->census,
                     .ids = host_ids ? m->h_rrow + B : NULL, .ids_stride = c->hc_mult,
                     .d_ids = m->d_rrow + B, .d_ids_stride = c->hc_mult };
    if (m->census) memset(m->census, 0, sizeof *m->census * (size_t)L * c->n_routed_experts);
    m->scr.sel_n = 0;
    be->ops->embed_dev(be, m->X, &m->embed, m->d_rrow + B, B * c->hc_mult);
    mt_status est = embed_reduce(m, m->X, (size_t)B * c->hc_mult * c->hidden_size);
    if (est != MT_OK) return est;
    for (int l = 0; l < L; l++) {
        for (int i = 0; i < B; i++) sts[i] = (i < n ? seqs[i] : m->pad_seq)->states[l];
        step.rtab = m->d_rtab + (size_t)l * GLM_R_KINDS * m->rcap;
        mt_status st = mt_layer_decode_multi_seq(&m->layers[l].base, sts, B, &step, m->X);
        if (st != MT_OK) return st;
    }
    return head_logits(m, m->X, B, NULL);
}

typedef struct rows_ctx {
    glm_model *m;
    glm_seq **seqs;
    int n, B;
    mt_layer_state **sts;
    bool host_ids;             /* m->h_rrow holds the rows' tokens (rows_upload had them) */
} rows_ctx;

static mt_status rows_body_cb(void *ctx) {
    const rows_ctx *r = ctx;
    return rows_body(r->m, r->seqs, r->n, r->B, r->sts, r->host_ids);
}

/* The n tokens of ticket t (a greedy step's token table of n rows, S entries a row) into
 * m->h_tok[0, n). */
static mt_status ticket_tokens(glm_model *m, int64_t t, int n) {
    const int S = m->cfg.hc_mult;
    mt_status st = m->be->ops->download_end(m->be, t, m->h_tok, sizeof(int32_t) * (size_t)n * S);
    for (int i = 0; i < n && st == MT_OK; i++) m->h_tok[i] = m->h_tok[(size_t)i * S]; /* i <= i * S */
    return st;
}

/* Rows [0, n), n <= m->rcap: one step through the graph runner, with the hooks of every
 * sequence around it, replaying the bucket's graph when graphs are on (captured on the bucket's
 * second use; recaptured when a longer sequence raised rt_cap), else eagerly. tokens NULL: the
 * inputs are the last greedy step's outputs, left in d_rrow (m->ahead). *B_out: the rows the pass
 * ran (n, or the bucket's size). */
static mt_status decode_rows(glm_model *m, glm_seq **seqs, const int32_t *tokens, int n, float *logits,
                             int *B_out, mt_error *err) {
    const glm_config *c = &m->cfg;
    mt_backend *be = m->be;
    const int b = glm_bucket_of(n);
    bool use_graph = m->params.decode_graphs && m->runner.plan.graphs && !m->census && b < GLM_BUCKETS &&
                     (1 << b) <= m->params.graph_max_rows && (1 << b) <= m->rcap &&
                     m->bucket[b].failures < RT_MAX_CAPTURE_FAILURES;
    if (use_graph && (1 << b) > n && !glm_pad_ensure(m)) use_graph = false; /* no room for the pad: eager */
    const int B = use_graph ? 1 << b : n;
    *B_out = B;
    if (!tokens && B != m->ahead.B) { /* the table sits where a pass of ahead.B rows has it: read it */
        mt_status st = ticket_tokens(m, m->ahead.ticket, n);
        if (st != MT_OK) return mt_errorf(err, st, "batched decode: the last step's tokens are lost");
        tokens = m->h_tok;
    }
    m->ahead.valid = false; /* this step's inputs consume (or overwrite) the table */
    mt_layer_state **sts = malloc(sizeof *sts * (size_t)B);
    mt_layer_state ***per_seq = malloc(sizeof *per_seq * (size_t)n);
    int *lens = malloc(sizeof *lens * (size_t)n);
    if (!sts || !per_seq || !lens) {
        free(sts);
        free(per_seq);
        free(lens);
        return mt_errorf(err, MT_ERR_NOMEM, "out of memory");
    }
    for (int i = 0; i < n; i++) {
        per_seq[i] = seqs[i]->states;
        lens[i] = seqs[i]->len;
    }
    /* a token on the device only: -1 (no layer reads it then; see glm_decode_greedy) */
    const rt_rows rows = { .states = (mt_layer_state *const *const *)per_seq, .seq_len = lens, .tokens = tokens,
                           .n = n, .k = 1 };
    mt_status st = rt_hooks_before(&m->runner, &rows, err);
    if (st == MT_OK) {
        rows_upload(m, seqs, tokens, n, B);
        rows_ctx rc = { m, seqs, n, B, sts, tokens != NULL };
        char what[64];
        snprintf(what, sizeof what, "batched decode of %d rows", B);
        st = rt_run_step(&m->runner, &m->bucket[b < GLM_BUCKETS ? b : 0], use_graph, m->rt_cap, &rows, rows_body_cb,
                         &rc, what);
        if (st != MT_OK) st = mt_errorf(err, st, "batched decode of %d sequences failed: %s", n, mt_status_str(st));
        else st = rt_hooks_after(&m->runner, &rows, err);
    }
    free(sts);
    free(per_seq);
    free(lens);
    if (st != MT_OK) return st;
    for (int i = 0; i < n; i++) seqs[i]->len++;
    if (logits) be->ops->download(be, logits, m->logits, sizeof(float) * (size_t)n * c->vocab_size);
    if (!m->mtp.on) return MT_OK;
    glm_follow_part *fp = malloc(sizeof *fp * (size_t)n);
    if (!fp) return mt_errorf(err, MT_ERR_NOMEM, "out of memory for the drafter's rows");
    for (int i = 0; i < n; i++) {
        seqs[i]->v_n = 0;
        fp[i] = (glm_follow_part){ seqs[i], &tokens[i], 1, NULL };
    }
    st = glm_mtp_follow_parts(m, fp, n, m->X);
    free(fp);
    if (st != MT_OK) return mt_errorf(err, st, "the drafter failed after a batched decode of %d rows: %s", n,
                                      mt_status_str(st));
    return MT_OK;
}

/* glm_decode_multi; tokens NULL (glm_decode_greedy, one pass): the table in d_rrow. */
static mt_status decode_multi(glm_model *m, glm_seq **seqs, const int32_t *tokens, int n, float *logits,
                              int *B_out, mt_error *err) {
    if (n < 1) return mt_errorf(err, MT_ERR_INVALID, "no sequences to decode");
    for (int i = 0; i < n; i++) {
        if (tokens && (tokens[i] < 0 || tokens[i] >= m->cfg.vocab_size))
            return mt_errorf(err, MT_ERR_INVALID, "token %d of sequence %d is outside the vocabulary [0, %d)",
                             tokens[i], i, m->cfg.vocab_size);
        if (seqs[i]->m != m) return mt_errorf(err, MT_ERR_INVALID, "sequence %d belongs to another model", i);
        if (seqs[i]->len + 1 > seqs[i]->cap)
            return mt_errorf(err, MT_ERR_FULL, "sequence %d of %d tokens has no room for another", i, seqs[i]->len);
        for (int j = 0; j < i; j++)
            if (seqs[j] == seqs[i]) return mt_errorf(err, MT_ERR_INVALID, "sequence %d appears twice (also at %d)", i, j);
    }
    for (int i = 0; i < n; i++) { /* pages first: a shortage refuses the step before any change */
        mt_status st = glm_seq_reserve(seqs[i], 1, err);
        if (st != MT_OK) return st;
    }
    for (int i = 0; i < m->cfg.num_hidden_layers; i++)
        if (!m->layers[i].base.ops->decode_multi_seq)
            return mt_errorf(err, MT_ERR_UNSUPPORTED, "layer %d (%s) cannot decode several sequences at once",
                             i, m->layers[i].base.kind);
    const int rows = m->rcap, V = m->cfg.vocab_size;
    MT_ASSERT(tokens || n <= rows);
    for (int done = 0; done < n; done += rows) {
        const int k = n - done < rows ? n - done : rows;
        mt_status st = decode_rows(m, seqs + done, tokens ? tokens + done : NULL, k,
                                   logits ? logits + (size_t)done * V : NULL, B_out, err);
        if (st != MT_OK) return st;
    }
    return MT_OK;
}

mt_status glm_decode_multi(glm_model *m, glm_seq **seqs, const int32_t *tokens, int n, float *logits,
                           mt_error *err) {
    int B;
    if (!tokens) return mt_errorf(err, MT_ERR_INVALID, "no tokens to decode");
    return decode_multi(m, seqs, tokens, n, logits, &B, err);
}

bool glm_model_backend_queues(const glm_model *m) { return m->be->ops->queued; }

int glm_model_ahead_rows(const glm_model *m) {
    const mt_backend_ops *o = m->be->ops;
    if (!o->argmax_dev || !o->download_begin || !o->download_end || m->runner.plan.prestage_needs_token) return 0;
    if (m->mtp.on) return 0; /* the drafter follows each step with the tokens on the host */
    const int by_ticket = MT_TICKET_BYTES / (int)(sizeof(int32_t) * (size_t)m->cfg.hc_mult);
    return m->rcap < by_ticket ? m->rcap : by_ticket;
}

mt_status glm_decode_greedy(glm_model *m, glm_seq **seqs, const int32_t *tokens, int n, int64_t *ticket,
                            mt_error *err) {
    if (n < 1 || n > glm_model_ahead_rows(m))
        return mt_errorf(err, MT_ERR_INVALID, "greedy decode of %d sequences: this model and backend take 1 to %d",
                         n, glm_model_ahead_rows(m));
    if (!tokens) {
        bool same = m->ahead.valid && m->ahead.n == n;
        for (int i = 0; i < n && same; i++) same = m->ahead.seqs[i] == seqs[i];
        if (!same)
            return mt_errorf(err, MT_ERR_INVALID,
                             "greedy decode from the device's tokens needs the last greedy step's sequences, in order");
    }
    int B = 0;
    mt_status st = decode_multi(m, seqs, tokens, n, NULL, &B, err);
    if (st != MT_OK) return st;
    mt_backend *be = m->be;
    const int S = m->cfg.hc_mult;
    int32_t *table = m->d_rrow + B; /* where a pass of B rows reads its tokens */
    be->ops->argmax_dev(be, table, S, m->logits, n, m->cfg.vocab_size);
    m->ahead = (struct glm_ahead){ .valid = true, .n = n, .B = B, .seqs = m->ahead.seqs,
                                   .ticket = be->ops->download_begin(be, table, sizeof(int32_t) * (size_t)n * S) };
    memcpy(m->ahead.seqs, seqs, sizeof(glm_seq *) * (size_t)n);
    *ticket = m->ahead.ticket;
    return MT_OK;
}

mt_status glm_greedy_tokens(glm_model *m, int64_t ticket, int32_t *out, int n) {
    if (n < 1 || n > glm_model_ahead_rows(m)) return MT_ERR_INVALID;
    mt_status st = ticket_tokens(m, ticket, n);
    if (st == MT_OK) memcpy(out, m->h_tok, sizeof(int32_t) * (size_t)n);
    return st;
}

int glm_model_batch_rows(const glm_model *m) { return m->rcap; }

mt_status glm_last_argmax(glm_model *m, int n, int32_t *out) {
    if (n < 1 || n > m->rcap) return MT_ERR_INVALID;
    m->be->ops->argmax(m->be, out, m->logits, n, m->cfg.vocab_size);
    return MT_OK;
}

mt_status glm_model_set_expert_census(glm_model *m, bool on) {
    free(m->census);
    m->census = on ? calloc((size_t)m->cfg.num_hidden_layers * m->cfg.n_routed_experts, sizeof *m->census) : NULL;
    return on && !m->census ? MT_ERR_NOMEM : MT_OK;
}

int glm_model_expert_census(const glm_model *m) {
    if (!m->census) return -1;
    int touched = 0;
    for (size_t i = 0; i < (size_t)m->cfg.num_hidden_layers * m->cfg.n_routed_experts; i++) touched += m->census[i] > 0;
    return touched;
}

const int32_t *glm_model_expert_census_pairs(const glm_model *m) { return m->census; }

bool glm_model_has_bucket_graph(const glm_model *m, int n) {
    const int b = glm_bucket_of(n);
    return b < GLM_BUCKETS && m->bucket[b].graph != NULL;
}

bool glm_model_has_verify_graph(const glm_model *m, int k, int nv, int nd) {
    const int bv = glm_bucket_of(nv), bd = nd ? glm_bucket_of(nd) : -1;
    return k >= 2 && k <= GLM_VERIFY_MAX && nv >= 1 && bv < GLM_BUCKETS && bd < GLM_BUCKETS &&
           m->vbucket[k][bv][bd + 1].graph != NULL;
}

bool glm_model_has_draft_graph(const glm_model *m, int n) {
    const int b = glm_bucket_of(n);
    return b < GLM_BUCKETS && m->mtp.bucket[b].graph != NULL;
}

void glm_model_fail_next_capture(glm_model *m) { m->runner.fail_next_capture = true; }

void glm_model_set_decode_graphs(glm_model *m, bool on) { m->params.decode_graphs = on; }

bool glm_seq_has_graph(const glm_seq *s) {
    return (s->m->runner.plan.per_sequence ? s->graph.graph : s->m->shared.graph) != NULL;
}

int32_t glm_argmax(const float *logits, int vocab) {
    int32_t best = 0;
    for (int v = 1; v < vocab; v++)
        if (logits[v] > logits[best]) best = v;
    return best;
}

bool glm_model_has_mtp(const glm_model *m) { return m->mtp.has; }
bool glm_model_has_drafter(const glm_model *m) { return m->mtp.on; }
mt_status glm_model_draft(glm_model *m, glm_seq *s, int32_t token, float *logits, mt_error *err) {
    return glm_mtp_draft(m, s, token, logits, err);
}
void glm_model_capture_drafter(glm_model *m, float *logits, int rows) {
    m->mtp.capture = logits;
    m->mtp.capture_rows = logits ? rows : 0;
}
