/* worker/model/glm_model.c: the GLM model runtime: loading, scratch, sequences, and the forward
 * pass (embedding into an S-stream fp32 highway, the decoder layers, the mean-of-streams head). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "worker/model/glm_impl.h"

glm_model_params glm_model_default_params(void) {
    return (glm_model_params){ .prefill_chunk = 256, .decode_graphs = true, .device_positions = false,
                               .graph_max_rows = 64 };
}

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

/* Everything after the config and the weights' source are known: layers, weights, scratch. */
static mt_status model_init(glm_model *m, uint64_t random_seed, bool random, mt_error *err) {
    const glm_config *c = &m->cfg;
    mt_backend *be = m->be;
    m->layers = calloc((size_t)c->num_hidden_layers, sizeof(glm_layer));
    if (!m->layers) return mt_errorf(err, MT_ERR_NOMEM, "out of memory");
    for (int i = 0; i < c->num_hidden_layers; i++) glm_layer_init(&m->layers[i], &m->cfg, be, i);
    mt_status s = random ? glm_weights_random(m, random_seed, err) : glm_weights_bind(m, err);
    if (s != MT_OK) return s;
    const int rows = m->params.prefill_chunk;
    if ((s = scratch_alloc(be, c, rows, &m->scr, err)) != MT_OK) return s;
    const size_t SH = (size_t)c->hc_mult * c->hidden_size;
    m->X = be->ops->alloc(be, sizeof(float) * rows * SH);
    m->z = be->ops->alloc(be, sizeof(float) * rows * (size_t)c->hidden_size);
    m->logits = be->ops->alloc(be, sizeof(float) * rows * (size_t)c->vocab_size);
    m->d_step = be->ops->alloc(be, 2 * sizeof(int32_t));
    if (!m->X || !m->z || !m->logits || !m->d_step)
        return mt_errorf(err, MT_ERR_NOMEM, "out of memory for activations");
    /* rows form of batched decode: one pass takes at most the scratch rows */
    const size_t tab = (size_t)c->num_hidden_layers * GLM_R_KINDS * (size_t)rows;
    m->rcap = rows;
    m->d_rrow = be->ops->alloc(be, sizeof(int32_t) * (size_t)rows * (1 + c->hc_mult));
    m->d_rtab = be->ops->alloc(be, sizeof(void *) * tab);
    m->h_rrow = calloc((size_t)rows * (1 + c->hc_mult), sizeof(int32_t));
    m->h_rtab = calloc(tab, sizeof(void *));
    m->h_tok = calloc((size_t)rows * c->hc_mult, sizeof(int32_t));
    m->ahead.seqs = calloc((size_t)rows, sizeof(glm_seq *));
    if (!m->d_rrow || !m->d_rtab || !m->h_rrow || !m->h_rtab || !m->h_tok || !m->ahead.seqs)
        return mt_errorf(err, MT_ERR_NOMEM, "out of memory for the batched-decode tables");
    for (int i = 0; i < c->num_hidden_layers; i++) {
        m->graph_stale_on_new_sequence |= m->layers[i].base.caps.graph_stale_on_new_sequence;
        m->prestage_needs_token |= m->layers[i].base.caps.decode_prestage_needs_token;
    }
    return MT_OK;
}

static glm_model *model_new(mt_backend *be, const glm_model_params *params) {
    glm_model *m = calloc(1, sizeof *m);
    if (!m) return NULL;
    m->be = be;
    m->params = params ? *params : glm_model_default_params();
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

void glm_model_free(glm_model *m) {
    if (!m) return;
    mt_backend *be = m->be;
    glm_seq_free(m->pad_seq); /* before the layers it releases through */
    if (m->layers) pools_release(m);
    glm_weights_release(m);
    free(m->layers);
    scratch_free(be, &m->scr);
    be->ops->free(be, m->X);
    be->ops->free(be, m->z);
    be->ops->free(be, m->logits);
    be->ops->free(be, m->d_step);
    if (be->ops->graph_free) {
        be->ops->graph_free(be, m->shared_graph);
        for (int b = 0; b < GLM_BUCKETS; b++) be->ops->graph_free(be, m->bucket_graph[b]);
    }
    be->ops->free(be, m->d_rrow);
    be->ops->free(be, m->d_rtab);
    free(m->h_rrow);
    free(m->h_rtab);
    free(m->h_tok);
    free(m->ahead.seqs);
    free(m->census);
    st_close(m->ar);
    free(m);
}

const glm_config *glm_model_config(const glm_model *m) { return &m->cfg; }
mt_backend *glm_model_backend(const glm_model *m) { return m->be; }

/* ---- pools: DSA pages and KDA slots ---- */

static const glm_layer *first_dsa(const glm_model *m) {
    for (int i = 0; i < m->cfg.num_hidden_layers; i++)
        if (m->cfg.layer_types[i] != GLM_MIXER_KDA) return &m->layers[i];
    return NULL;
}

int glm_model_page_tokens(const glm_model *m) { return m->layers[0].page; }

size_t glm_model_page_bytes(const glm_model *m) {
    size_t b = 0;
    for (int i = 0; i < m->cfg.num_hidden_layers; i++) b += glm_layer_page_bytes(&m->layers[i]);
    return b;
}

size_t glm_model_slot_bytes(const glm_model *m) {
    size_t b = 0;
    for (int i = 0; i < m->cfg.num_hidden_layers; i++) b += glm_layer_slot_bytes(&m->layers[i]);
    return b;
}

int glm_model_pages_free(const glm_model *m) { return m->n_free_pages; }
int glm_model_slots_free(const glm_model *m) { return m->n_free_slots; }
int glm_model_pages_total(const glm_model *m) { return m->n_pages; }
int glm_model_slots_total(const glm_model *m) { return m->n_slots; }

static void pools_release(glm_model *m) {
    mt_backend *be = m->be;
    for (int i = 0; i < m->cfg.num_hidden_layers; i++) {
        glm_layer *l = &m->layers[i];
        float **p[] = { &l->pg_latent, &l->pg_ki, &l->pg_gs, &l->pg_pk, &l->sl_conv, &l->sl_rec };
        for (size_t k = 0; k < sizeof p / sizeof p[0]; k++) {
            be->ops->free(be, *p[k]);
            *p[k] = NULL;
        }
    }
    free(m->page_ref);
    free(m->free_pages);
    free(m->free_slots);
    m->page_ref = m->free_pages = m->free_slots = NULL;
    m->n_pages = m->n_slots = m->n_free_pages = m->n_free_slots = 0;
}

/* The pad sequence of the bucket graphs (one slot, one page at position 0); made when the pools
 * are (graph-capable backends) or at the first padded step. false when the pools have no room:
 * that step then runs eagerly without padding, never on a pad without a page. */
static bool pad_ensure(glm_model *m) {
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
    mt_backend *be = m->be;
    if (!be->ops->graph_free) return;
    be->ops->graph_free(be, m->shared_graph);
    m->shared_graph = NULL;
    for (int b = 0; b < GLM_BUCKETS; b++) {
        be->ops->graph_free(be, m->bucket_graph[b]);
        m->bucket_graph[b] = NULL;
        m->bucket_warm[b] = false;
    }
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
    const glm_config *c = &m->cfg;
    bool ok = (m->page_ref = calloc((size_t)n_pages, sizeof(int32_t))) &&
              (m->free_pages = malloc(sizeof(int32_t) * (size_t)n_pages)) &&
              (m->free_slots = malloc(sizeof(int32_t) * (size_t)n_slots));
    for (int i = 0; ok && i < c->num_hidden_layers; i++) {
        glm_layer *l = &m->layers[i];
        if (c->layer_types[i] == GLM_MIXER_KDA) {
            const size_t rec = (size_t)c->linear_num_heads * c->linear_head_dim * c->linear_head_dim;
            ok = (l->sl_conv = be->ops->alloc(be, sizeof(float) * (size_t)n_slots * 3 * glm_layer_conv_floats(l))) &&
                 (l->sl_rec = be->ops->alloc(be, sizeof(float) * (size_t)n_slots * rec));
        } else {
            const size_t rows = (size_t)n_pages * l->page, id = (size_t)c->index_head_dim;
            ok = (l->pg_latent = be->ops->alloc(be, sizeof(float) * rows * c->kv_lora_rank)) != NULL;
            if (ok && l->dsa.has_indexer)
                ok = (l->pg_ki = be->ops->alloc(be, sizeof(float) * rows * id)) &&
                     (l->pg_gs = be->ops->alloc(be, sizeof(float) * rows * id)) &&
                     (l->pg_pk = be->ops->alloc(be, sizeof(float) * (rows / (size_t)c->index_kpool) * id));
        }
    }
    if (!ok) {
        pools_release(m);
        return mt_errorf(err, MT_ERR_NOMEM, "out of memory for %d pages and %d slots (%zu + %zu bytes)", n_pages,
                         n_slots, (size_t)n_pages * glm_model_page_bytes(m), (size_t)n_slots * glm_model_slot_bytes(m));
    }
    /* stacks popped from the end: pages and slots are handed out in ascending order */
    for (int i = 0; i < n_pages; i++) m->free_pages[i] = n_pages - 1 - i;
    for (int i = 0; i < n_slots; i++) m->free_slots[i] = n_slots - 1 - i;
    m->n_pages = m->n_free_pages = n_pages;
    m->n_slots = m->n_free_slots = n_slots;
    if (be->ops->graph_begin) pad_ensure(m); /* the graph pad's slot and page, before any request's */
    return MT_OK;
}

/* The pools a model makes for itself when a sequence is made before glm_model_set_pools. */
static mt_status pools_default(glm_model *m, mt_error *err) {
    const int pages = m->params.pool_pages > 0 ? m->params.pool_pages : GLM_DEFAULT_POOL_PAGES;
    const int slots = m->params.pool_slots > 0 ? m->params.pool_slots : GLM_DEFAULT_POOL_SLOTS;
    return glm_model_set_pools(m, pages, slots, err);
}

mt_status glm_model_ensure_pools(glm_model *m, mt_error *err) {
    return m->n_slots > 0 ? MT_OK : pools_default(m, err);
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

static void unmap_blocks(glm_seq *s, int from) {
    glm_model *m = s->m;
    for (int b = from; b < s->n_blocks; b++) {
        const int32_t p = s->h_bt[b];
        if (--m->page_ref[p] == 0) m->free_pages[m->n_free_pages++] = p;
    }
    if (from < s->n_blocks) s->n_blocks = from;
}

mt_status glm_seq_reserve(glm_seq *s, int n, mt_error *err) {
    glm_model *m = s->m;
    const int page = glm_model_page_tokens(m);
    if (n < 0 || s->len + n > s->cap)
        return mt_errorf(err, MT_ERR_FULL, "sequence of %d tokens has room for %d more, asked for %d", s->len,
                         s->cap - s->len, n);
    if (!first_dsa(m)) return MT_OK; /* no paged layer */
    const int need = (s->len + n + page - 1) / page;
    if (need <= s->n_blocks) return MT_OK;
    if (need - s->n_blocks > m->n_free_pages)
        return mt_errorf(err, MT_ERR_FULL, "out of cache pages: %d more needed for %d tokens, %d free of %d",
                         need - s->n_blocks, n, m->n_free_pages, m->n_pages);
    const int first = s->n_blocks;
    for (int b = first; b < need; b++) {
        const int32_t p = m->free_pages[--m->n_free_pages];
        m->page_ref[p] = 1;
        s->h_bt[b] = p;
    }
    s->n_blocks = need;
    /* in the backend's order of work: a step in flight reads only the blocks before `first` */
    upload_ordered(m->be, s->d_bt + first, s->h_bt + first, sizeof(int32_t) * (size_t)(need - first));
    return MT_OK;
}

int glm_seq_pages(const glm_seq *s) { return s ? s->n_blocks : 0; }

/* Points every layer state of s at its slot and block table. */
static void bind_states(glm_seq *s) {
    glm_model *m = s->m;
    for (int i = 0; i < m->cfg.num_hidden_layers; i++) {
        const glm_layer *l = &m->layers[i];
        glm_layer_state *st = (glm_layer_state *)s->states[i];
        if (m->cfg.layer_types[i] == GLM_MIXER_KDA) {
            const size_t cf = glm_layer_conv_floats(l);
            const size_t rec = (size_t)m->cfg.linear_num_heads * m->cfg.linear_head_dim * m->cfg.linear_head_dim;
            for (int j = 0; j < 3; j++) st->conv[j] = l->sl_conv + ((size_t)s->slot * 3 + j) * cf;
            st->rec = l->sl_rec + (size_t)s->slot * rec;
        } else {
            st->bt = s->d_bt;
        }
    }
}

/* A fresh slot's state is zero, as a sequence's first step expects. */
static void zero_slot(glm_seq *s) {
    glm_model *m = s->m;
    for (int i = 0; i < m->cfg.num_hidden_layers; i++) {
        const glm_layer *l = &m->layers[i];
        if (m->cfg.layer_types[i] != GLM_MIXER_KDA) continue;
        const glm_layer_state *st = (const glm_layer_state *)s->states[i];
        m->be->ops->zero(m->be, st->conv[0], sizeof(float) * 3 * glm_layer_conv_floats(l));
        m->be->ops->zero(m->be, st->rec, glm_layer_slot_bytes(l) - sizeof(float) * 3 * glm_layer_conv_floats(l));
    }
}

mt_status glm_seq_new(glm_model *m, int max_tokens, glm_seq **out, mt_error *err) {
    *out = NULL;
    if (max_tokens < 1) return mt_errorf(err, MT_ERR_INVALID, "max_tokens must be >= 1, got %d", max_tokens);
    if (m->n_slots == 0) {
        mt_status st = pools_default(m, err);
        if (st != MT_OK) return st;
    }
    if (m->n_free_slots == 0)
        return mt_errorf(err, MT_ERR_FULL, "no free sequence slot (all %d in use)", m->n_slots);
    glm_seq *s = calloc(1, sizeof *s);
    const int L = m->cfg.num_hidden_layers;
    const int max_blocks = max_tokens / glm_model_page_tokens(m) + 1;
    if (!s || !(s->states = calloc((size_t)L, sizeof *s->states)) ||
        !(s->h_bt = calloc((size_t)max_blocks, sizeof(int32_t))) ||
        !(s->d_bt = m->be->ops->alloc(m->be, sizeof(int32_t) * (size_t)max_blocks))) {
        if (s) {
            free(s->states);
            free(s->h_bt);
        }
        free(s);
        return mt_errorf(err, MT_ERR_NOMEM, "out of memory for a sequence");
    }
    s->m = m;
    s->cap = max_tokens;
    s->max_blocks = max_blocks;
    s->slot = m->free_slots[--m->n_free_slots];
    m->n_seqs++;
    for (int i = 0; i < L; i++) {
        mt_status st = mt_layer_alloc_state(&m->layers[i].base, max_tokens, &s->states[i], err);
        if (st != MT_OK) {
            glm_seq_free(s);
            return st;
        }
    }
    bind_states(s);
    zero_slot(s);
    if (max_tokens > m->rt_cap) m->rt_cap = max_tokens; /* batched-decode graphs are sized by it */
    *out = s;
    return MT_OK;
}

void glm_seq_free(glm_seq *s) {
    if (!s) return;
    glm_model *m = s->m;
    mt_backend *be = m->be;
    ahead_forget(m, s); /* its address may come back for another sequence */
    if (be->ops->graph_free) be->ops->graph_free(be, s->graph);
    for (int i = 0; i < m->cfg.num_hidden_layers; i++)
        if (s->states[i]) mt_layer_release_state(&m->layers[i].base, s->states[i]);
    unmap_blocks(s, 0);
    m->free_slots[m->n_free_slots++] = s->slot;
    m->n_seqs--;
    be->ops->free(be, s->d_bt);
    free(s->h_bt);
    free(s->states);
    free(s);
}

int glm_seq_len(const glm_seq *s) { return s->len; }
size_t glm_seq_bytes(const glm_seq *s) {
    return s ? glm_model_slot_bytes(s->m) + (size_t)s->n_blocks * glm_model_page_bytes(s->m) : 0;
}

size_t glm_model_seq_bytes(const glm_model *m, int max_tokens) {
    size_t b = 0;
    for (int i = 0; i < m->cfg.num_hidden_layers; i++) b += glm_layer_state_bytes(&m->layers[i], max_tokens);
    return b;
}

mt_status glm_seq_copy_prefix(glm_model *m, const glm_seq *src, glm_seq *dst, mt_error *err) {
    if (src->m != m || dst->m != m) return mt_errorf(err, MT_ERR_INVALID, "sequences of another model");
    if (dst->len != 0) return mt_errorf(err, MT_ERR_STATE, "destination sequence is not fresh (%d tokens)", dst->len);
    ahead_forget(m, dst);
    if (src->len > dst->cap)
        return mt_errorf(err, MT_ERR_FULL, "%d positions do not fit a sequence of %d", src->len, dst->cap);
    /* DSA caches: src's full pages are mapped into dst too (shared, counted); a partly filled last
     * page is copied into a page of dst's own, since dst will write the rest of it. */
    const int page = glm_model_page_tokens(m), full = src->len / page, part = src->len % page != 0;
    if (first_dsa(m) && part && m->n_free_pages < 1)
        return mt_errorf(err, MT_ERR_FULL, "out of cache pages for a copied prefix");
    unmap_blocks(dst, 0);
    for (int b = 0; b < full && first_dsa(m); b++) {
        dst->h_bt[b] = src->h_bt[b];
        m->page_ref[src->h_bt[b]]++;
    }
    dst->n_blocks = first_dsa(m) ? full : 0;
    if (first_dsa(m) && part) {
        const int32_t p = m->free_pages[--m->n_free_pages], q = src->h_bt[full];
        m->page_ref[p] = 1;
        dst->h_bt[full] = p;
        dst->n_blocks = full + 1;
        for (int l = 0; l < m->cfg.num_hidden_layers; l++) {
            const glm_layer *ly = &m->layers[l];
            if (m->cfg.layer_types[l] == GLM_MIXER_KDA) continue;
            const size_t lat = (size_t)page * m->cfg.kv_lora_rank, idr = (size_t)page * m->cfg.index_head_dim;
            const size_t pk = (size_t)(page / m->cfg.index_kpool) * m->cfg.index_head_dim;
            m->be->ops->copy(m->be, ly->pg_latent + p * lat, ly->pg_latent + q * lat, sizeof(float) * lat);
            if (!ly->dsa.has_indexer) continue;
            m->be->ops->copy(m->be, ly->pg_ki + p * idr, ly->pg_ki + q * idr, sizeof(float) * idr);
            m->be->ops->copy(m->be, ly->pg_gs + p * idr, ly->pg_gs + q * idr, sizeof(float) * idr);
            m->be->ops->copy(m->be, ly->pg_pk + p * pk, ly->pg_pk + q * pk, sizeof(float) * pk);
        }
    }
    if (dst->n_blocks) m->be->ops->upload(m->be, dst->d_bt, dst->h_bt, sizeof(int32_t) * (size_t)dst->n_blocks);
    for (int l = 0; l < m->cfg.num_hidden_layers; l++) {
        glm_layer_state *d = (glm_layer_state *)dst->states[l];
        if (m->cfg.layer_types[l] == GLM_MIXER_KDA) {
            mt_status st = glm_layer_copy_state(&m->layers[l], (const glm_layer_state *)src->states[l], d, src->len, err);
            if (st != MT_OK) return st;
        } else {
            d->len = src->len;
        }
    }
    dst->len = src->len;
    return MT_OK;
}

int glm_model_n_layers(const glm_model *m) { return m->cfg.num_hidden_layers; }
const mt_layer *glm_model_layer(const glm_model *m, int i) { return &m->layers[i].base; }
mt_layer_state *glm_seq_state(glm_seq *s, int i) { return s->states[i]; }

/* X[i, s] = embedding of host token i for every stream s: one lookup into z, then S row copies
 * per token (the decode paths, where n is small). */
static void highway_from_tokens(glm_model *m, const int32_t *tokens, int n) {
    mt_backend *be = m->be;
    const int S = m->cfg.hc_mult, H = m->cfg.hidden_size;
    be->ops->embed(be, m->z, &m->embed, tokens, n);
    for (int i = 0; i < n; i++)
        for (int j = 0; j < S; j++)
            be->ops->copy(be, m->X + ((size_t)i * S + j) * H, m->z + (size_t)i * H, sizeof(float) * H);
}

/* The head over highway rows X[rows, S, H]: mean of streams, final norm, lm_head into m->logits;
 * downloaded into logits_host when not NULL. */
static void head_logits(glm_model *m, const float *X, int rows, float *logits_host) {
    mt_backend *be = m->be;
    const glm_config *c = &m->cfg;
    if (be->ops->hc_head_norm) {
        be->ops->hc_head_norm(be, m->z, X, m->norm, rows, c->hc_mult, c->hidden_size, c->rms_norm_eps);
    } else {
        be->ops->hc_head(be, m->z, X, rows, c->hc_mult, c->hidden_size);
        be->ops->rmsnorm(be, m->z, m->z, m->norm, rows, c->hidden_size, c->rms_norm_eps);
    }
    be->ops->matmul(be, m->logits, m->z, &m->lm_head, rows);
    if (logits_host)
        be->ops->download(be, logits_host, m->logits, sizeof(float) * (size_t)rows * c->vocab_size);
}

/* Rows [0, n) of the highway through every layer, then the head for the rows whose logits are
 * wanted ([first, n)), downloaded into logits_host. decode selects the layers' decode path. */
static mt_status forward(glm_model *m, glm_seq *s, const int32_t *tokens, int n, bool decode,
                         int first, float *logits_host) {
    const glm_config *c = &m->cfg;
    mt_backend *be = m->be;
    const int S = c->hc_mult, H = c->hidden_size;
    mt_step step = { .be = be, .t0 = s->len, .scr = &m->scr };
    m->scr.sel_n = 0;
    /* X[i, s] = embedding of token i for every stream s. Prefill looks each token up S times
     * straight into X (one op, where n*S row copies cost a launch each); decode keeps its copies. */
    int32_t *rep = decode ? NULL : malloc(sizeof(int32_t) * (size_t)n * S);
    if (rep) {
        for (int i = 0; i < n; i++)
            for (int j = 0; j < S; j++) rep[(size_t)i * S + j] = tokens[i];
        be->ops->embed(be, m->X, &m->embed, rep, n * S);
        free(rep);
    } else {
        highway_from_tokens(m, tokens, n);
    }
    for (int l = 0; l < c->num_hidden_layers; l++) {
        const mt_layer *ml = &m->layers[l].base;
        mt_status st = decode ? mt_layer_decode(ml, s->states[l], &step, m->X)
                              : mt_layer_prefill(ml, s->states[l], &step, m->X, n);
        if (st != MT_OK) return st;
    }
    s->len += n;
    /* decode always leaves its logits in m->logits (glm_last_argmax reads them there) */
    if ((logits_host || decode) && first < n) head_logits(m, m->X + (size_t)first * S * H, n - first, logits_host);
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
    ahead_forget(m, s);
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
        if ((st = forward(m, s, tokens + done, k, false, first, dst)) != MT_OK)
            return mt_errorf(err, st, "prefill failed at position %d: %s", s->len, mt_status_str(st));
        done += k;
    }
    return MT_OK;
}

/* The graph form of one decode step: the token and position come from m->d_step (backend
 * memory), so the same recorded ops serve every step. Leaves the logits in m->logits. */
static mt_status decode_body_dev(glm_model *m, glm_seq *s) {
    const glm_config *c = &m->cfg;
    mt_backend *be = m->be;
    const int S = c->hc_mult, H = c->hidden_size;
    mt_step step = { .be = be, .t0 = s->len, .scr = &m->scr, .d_pos = m->d_step + 1 };
    m->scr.sel_n = 0;
    be->ops->embed_dev(be, m->z, &m->embed, m->d_step, 1);
    for (int j = 0; j < S; j++) be->ops->copy(be, m->X + (size_t)j * H, m->z, sizeof(float) * H);
    for (int l = 0; l < c->num_hidden_layers; l++) {
        mt_status st = mt_layer_decode(&m->layers[l].base, s->states[l], &step, m->X);
        if (st != MT_OK) return st;
    }
    head_logits(m, m->X, 1, NULL);
    return MT_OK;
}

/* Records the step into a graph; NULL (and the layers rearmed) when the capture fails. */
/* Records body(m, ctx) into a graph: NULL when the body or the capture fails (the backend is
 * usable again; the caller rearms the layers). Shared by the per-sequence and the bucket graphs. */
static mt_graph *record(glm_model *m, mt_status (*body)(glm_model *m, void *ctx), void *ctx) {
    mt_backend *be = m->be;
    if (be->ops->graph_begin(be) != MT_OK) return NULL;
    mt_status st = body(m, ctx);
    if (m->fail_next_capture) { /* test hook: a host sync is not capturable */
        m->fail_next_capture = false;
        be->ops->sync(be);
    }
    mt_graph *g = NULL;
    mt_status end = be->ops->graph_end(be, &g);
    if (st == MT_OK && end == MT_OK && g) return g;
    if (g) be->ops->graph_free(be, g);
    return NULL;
}

static mt_status decode_body_cb(glm_model *m, void *s) { return decode_body_dev(m, s); }

static mt_graph *capture(glm_model *m, glm_seq *s) {
    mt_graph *g = record(m, decode_body_cb, s);
    if (!g)
        for (int l = 0; l < m->cfg.num_hidden_layers; l++)
            mt_layer_decode_prestage_rearm(&m->layers[l].base, s->states[l]);
    return g;
}

/* The backend's graph epoch: a graph recorded under another value points at replaced scratch. */
static uint64_t graph_epoch(const glm_model *m) {
    return m->be->ops->graph_epoch ? m->be->ops->graph_epoch(m->be) : 0;
}

static mt_status decode_graph(glm_model *m, glm_seq *s, int32_t token, float *logits, mt_error *err) {
    mt_backend *be = m->be;
    const int L = m->cfg.num_hidden_layers, pos = s->len;
    /* prestage: host work while the token is on the host */
    const int32_t host_step[2] = { token, pos };
    be->ops->upload(be, m->d_step, host_step, sizeof host_step);
    for (int l = 0; l < L; l++) {
        mt_status st = mt_layer_decode_prestage(&m->layers[l].base, s->states[l], token);
        if (st != MT_OK) return mt_errorf(err, st, "decode at position %d: layer %d prestage failed", pos, l);
    }
    for (int l = 0; l < L; l++)
        if (mt_layer_check_replay_room(&m->layers[l].base, s->states[l], pos, 1) != MT_OK)
            return mt_errorf(err, MT_ERR_FULL, "decode at position %d: layer %d (%s) has no room to replay the step",
                             pos, l, m->layers[l].base.kind);
    const bool use_graph = m->params.decode_graphs && be->ops->graph_begin &&
                           s->capture_failures < GLM_MAX_CAPTURE_FAILURES;
    mt_graph **slot = m->graph_stale_on_new_sequence ? &s->graph : &m->shared_graph;
    uint64_t *slot_epoch = m->graph_stale_on_new_sequence ? &s->graph_epoch : &m->shared_epoch;
    if (use_graph && *slot && *slot_epoch != graph_epoch(m)) { /* a prefill grew the scratch since */
        be->ops->graph_free(be, *slot);
        *slot = NULL;
    }
    if (use_graph && !*slot && s->graph_warm) {
        *slot_epoch = graph_epoch(m);
        if (!(*slot = capture(m, s))) {
            s->capture_failures++;
            mt_log(MT_LOG_WARN, "decode graph capture failed at position %d (%d of %d); this step runs eagerly",
                   pos, s->capture_failures, GLM_MAX_CAPTURE_FAILURES);
        }
    }
    if (use_graph && *slot) {
        mt_status st = be->ops->graph_launch(be, *slot);
        if (st != MT_OK) return mt_errorf(err, st, "decode at position %d: graph launch failed", pos);
        for (int l = 0; l < L; l++)
            if ((st = mt_layer_sync_replayed_step(&m->layers[l].base, s->states[l], pos, 1)) != MT_OK)
                return mt_errorf(err, st, "decode at position %d: layer %d lost track of its cache", pos, l);
    } else {
        mt_status st = decode_body_dev(m, s);
        if (st != MT_OK) return mt_errorf(err, st, "decode failed at position %d: %s", pos, mt_status_str(st));
        s->graph_warm = true;
    }
    s->len++;
    if (logits) be->ops->download(be, logits, m->logits, sizeof(float) * (size_t)m->cfg.vocab_size);
    return MT_OK;
}

mt_status glm_decode(glm_model *m, glm_seq *s, int32_t token, float *logits, mt_error *err) {
    ahead_forget(m, s);
    if (s->len < s->cap) { /* a full sequence is refused below, by check_tokens or check_replay_room */
        mt_status st = glm_seq_reserve(s, 1, err);
        if (st != MT_OK) return st;
    }
    const bool graph_form = m->params.device_positions || (m->params.decode_graphs && m->be->ops->graph_begin);
    if (graph_form) {
        if (token < 0 || token >= m->cfg.vocab_size)
            return mt_errorf(err, MT_ERR_INVALID, "token %d at index 0 is outside the vocabulary [0, %d)", token,
                             m->cfg.vocab_size);
        return decode_graph(m, s, token, logits, err); /* room: check_replay_room */
    }
    mt_status st = check_tokens(m, s, &token, 1, err);
    if (st != MT_OK) return st;
    if ((st = forward(m, s, &token, 1, true, 0, logits)) != MT_OK)
        return mt_errorf(err, st, "decode failed at position %d: %s", s->len, mt_status_str(st));
    return MT_OK;
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
            void *const ptrs[GLM_R_KINDS] = { st->conv[0], st->conv[1], st->conv[2], st->rec, (void *)s->d_bt };
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

/* One batched step of B rows from the uploaded tables, through every layer's decode_multi_seq
 * and the head; logits stay in m->logits [B, V]. Every op reads its rows from backend memory, so
 * the same body is what a bucket graph records. sts: B layer states (host bookkeeping only). */
static mt_status rows_body(glm_model *m, glm_seq **seqs, int n, int B, mt_layer_state **sts) {
    const glm_config *c = &m->cfg;
    mt_backend *be = m->be;
    const int L = c->num_hidden_layers;
    mt_step step = { .be = be, .t0 = -1, .scr = &m->scr, .rpos = m->d_rrow, .rcap = m->rcap,
                     .rt_cap = m->rt_cap, .census = m->census };
    if (m->census) memset(m->census, 0, (size_t)L * c->n_routed_experts);
    m->scr.sel_n = 0;
    be->ops->embed_dev(be, m->X, &m->embed, m->d_rrow + B, B * c->hc_mult);
    for (int l = 0; l < L; l++) {
        for (int i = 0; i < B; i++) sts[i] = (i < n ? seqs[i] : m->pad_seq)->states[l];
        step.rtab = m->d_rtab + (size_t)l * GLM_R_KINDS * m->rcap;
        mt_status st = mt_layer_decode_multi_seq(&m->layers[l].base, sts, B, &step, m->X);
        if (st != MT_OK) return st;
    }
    head_logits(m, m->X, B, NULL);
    return MT_OK;
}

typedef struct rows_ctx {
    glm_seq **seqs;
    int n, B;
    mt_layer_state **sts;
} rows_ctx;

static mt_status rows_body_cb(glm_model *m, void *ctx) {
    const rows_ctx *r = ctx;
    return rows_body(m, r->seqs, r->n, r->B, r->sts);
}

static int bucket_of(int n) {
    int b = 0;
    while ((1 << b) < n) b++;
    return b;
}

/* The n tokens of ticket t (a greedy step's token table of n rows, S entries a row) into
 * m->h_tok[0, n). */
static mt_status ticket_tokens(glm_model *m, int64_t t, int n) {
    const int S = m->cfg.hc_mult;
    mt_status st = m->be->ops->download_end(m->be, t, m->h_tok, sizeof(int32_t) * (size_t)n * S);
    for (int i = 0; i < n && st == MT_OK; i++) m->h_tok[i] = m->h_tok[(size_t)i * S]; /* i <= i * S */
    return st;
}

/* Rows [0, n), n <= m->rcap: the hooks of every sequence around one step, run through the
 * bucket's graph when graphs are on (captured on the bucket's second use, after an eager step
 * has sized the scratch; recaptured when a longer sequence raised rt_cap), else eagerly.
 * tokens NULL: the inputs are the last greedy step's outputs, left in d_rrow (m->ahead). *B_out:
 * the rows the pass ran (n, or the bucket's size). */
static mt_status decode_rows(glm_model *m, glm_seq **seqs, const int32_t *tokens, int n, float *logits,
                             int *B_out, mt_error *err) {
    const glm_config *c = &m->cfg;
    mt_backend *be = m->be;
    const int L = c->num_hidden_layers, b = bucket_of(n);
    bool use_graph = m->params.decode_graphs && be->ops->graph_begin && !m->census && b < GLM_BUCKETS &&
                     (1 << b) <= m->params.graph_max_rows &&
                     (1 << b) <= m->rcap && m->bucket_failures[b] < GLM_MAX_CAPTURE_FAILURES;
    if (use_graph && (1 << b) > n && !pad_ensure(m)) use_graph = false; /* no room for the pad: eager */
    const int B = use_graph ? 1 << b : n;
    *B_out = B;
    if (!tokens && B != m->ahead.B) { /* the table sits where a pass of ahead.B rows has it: read it */
        mt_status st = ticket_tokens(m, m->ahead.ticket, n);
        if (st != MT_OK) return mt_errorf(err, st, "batched decode: the last step's tokens are lost");
        tokens = m->h_tok;
    }
    m->ahead.valid = false; /* this step's inputs consume (or overwrite) the table */
    for (int i = 0; i < n; i++)
        for (int l = 0; l < L; l++) {
            const mt_layer *ml = &m->layers[l].base;
            /* a token on the device only: -1 (no layer here reads it; see glm_decode_greedy) */
            mt_status st = mt_layer_decode_prestage(ml, seqs[i]->states[l], tokens ? tokens[i] : -1);
            if (st != MT_OK) return mt_errorf(err, st, "batched decode: sequence %d layer %d prestage failed", i, l);
            if (mt_layer_check_replay_room(ml, seqs[i]->states[l], seqs[i]->len, 1) != MT_OK)
                return mt_errorf(err, MT_ERR_FULL, "batched decode: sequence %d layer %d (%s) has no room at %d", i,
                                 l, ml->kind, seqs[i]->len);
        }
    mt_layer_state **sts = malloc(sizeof *sts * (size_t)B);
    if (!sts) return mt_errorf(err, MT_ERR_NOMEM, "out of memory");
    rows_upload(m, seqs, tokens, n, B);
    mt_status st = MT_OK;
    if (use_graph && m->bucket_graph[b] &&
        (m->bucket_tcap[b] != m->rt_cap || m->bucket_epoch[b] != graph_epoch(m))) {
        /* sized for shorter sequences, or recorded over scratch a prefill has since replaced */
        be->ops->graph_free(be, m->bucket_graph[b]);
        m->bucket_graph[b] = NULL;
    }
    if (use_graph && !m->bucket_graph[b] && m->bucket_warm[b]) {
        rows_ctx rc = { seqs, n, B, sts };
        if ((m->bucket_graph[b] = record(m, rows_body_cb, &rc))) {
            m->bucket_tcap[b] = m->rt_cap;
            m->bucket_epoch[b] = graph_epoch(m);
        } else {
            for (int i = 0; i < n; i++)
                for (int l = 0; l < L; l++) mt_layer_decode_prestage_rearm(&m->layers[l].base, seqs[i]->states[l]);
            m->bucket_failures[b]++;
            mt_log(MT_LOG_WARN, "batched decode graph capture for %d rows failed (%d of %d); this step runs eagerly", B,
                   m->bucket_failures[b], GLM_MAX_CAPTURE_FAILURES);
        }
    }
    if (use_graph && m->bucket_graph[b]) {
        st = be->ops->graph_launch(be, m->bucket_graph[b]);
    } else {
        st = rows_body(m, seqs, n, B, sts);
        if (use_graph && st == MT_OK) m->bucket_warm[b] = true;
    }
    free(sts);
    if (st != MT_OK) return mt_errorf(err, st, "batched decode of %d sequences failed: %s", n, mt_status_str(st));
    for (int i = 0; i < n; i++) {
        for (int l = 0; l < L; l++)
            if ((st = mt_layer_sync_replayed_step(&m->layers[l].base, seqs[i]->states[l], seqs[i]->len, 1)) != MT_OK)
                return mt_errorf(err, st, "batched decode: sequence %d layer %d lost track of its cache", i, l);
        seqs[i]->len++;
    }
    if (logits) be->ops->download(be, logits, m->logits, sizeof(float) * (size_t)n * c->vocab_size);
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
    if (!o->argmax_dev || !o->download_begin || !o->download_end || m->prestage_needs_token) return 0;
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
    m->census = on ? calloc((size_t)m->cfg.num_hidden_layers * m->cfg.n_routed_experts, 1) : NULL;
    return on && !m->census ? MT_ERR_NOMEM : MT_OK;
}

int glm_model_expert_census(const glm_model *m) {
    if (!m->census) return -1;
    int touched = 0;
    for (size_t i = 0; i < (size_t)m->cfg.num_hidden_layers * m->cfg.n_routed_experts; i++) touched += m->census[i];
    return touched;
}

bool glm_model_has_bucket_graph(const glm_model *m, int n) {
    const int b = bucket_of(n);
    return b < GLM_BUCKETS && m->bucket_graph[b] != NULL;
}

void glm_model_fail_next_capture(glm_model *m) { m->fail_next_capture = true; }

void glm_model_set_decode_graphs(glm_model *m, bool on) { m->params.decode_graphs = on; }

bool glm_seq_has_graph(const glm_seq *s) {
    return (s->m->graph_stale_on_new_sequence ? s->graph : s->m->shared_graph) != NULL;
}

int32_t glm_argmax(const float *logits, int vocab) {
    int32_t best = 0;
    for (int v = 1; v < vocab; v++)
        if (logits[v] > logits[best]) best = v;
    return best;
}
