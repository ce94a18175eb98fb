/* worker/model/glm/glm_ple.c: the PLE memory of a decoder layer (docs/MODEL.md "PLE layer"), an
 * Engram-style table of hashed n-gram rows injected into the highway before the layer's mixer.
 * Rows whose ids are on the host (prefill, verifies through forward, mixed steps) are hashed
 * there from the sequence's last tokens and their table rows gathered with embed; the decode
 * forms that read their ids from backend memory (the rows form, one sequence's graph form) hash
 * and gather on the device (ple_gather_rows, from a history kept there too) when the backend can
 * (glm_ple_w.dev), else a prestage gathers each row ahead on the host and the forward consumes
 * it. The backend's ple_inject then gates the rows against each stream and runs the dilated conv.
 * Per sequence the memory keeps its last N-1 tokens (on the host; with dev also on the device,
 * the host's copy following) and the conv state. The decode forms a backend may capture read
 * only per-sequence device memory or the step's tables: one sequence's step its own staged rows,
 * history and conv tables, the rows form all three through the rows tables (GLM_R_PLE_*), so a
 * graph replayed for other sequences reads theirs.
 * A verify's rows are provisional: each step notes the history before it and its tokens, and a
 * verify with a ring injects row by row, leaving the conv state after each row but the last in
 * the ring, so glm_ple_keep can rewind both to any kept row without recomputing. */
#include <stdlib.h>
#include <string.h>

#include "worker/model/glm/glm_impl.h"

/* splitmix64's output function. */
static uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static int stride(const glm_config *c) { return c->hc_mult * c->hidden_size; }

static size_t conv_bytes(const glm_layer *l) { return sizeof(float) * (size_t)l->ple.P * stride(l->cfg); }

/* Ring j's slot r: the conv state after row r of the verify in ring j. */
static float *ring_slot(const glm_ple_w *p, const glm_config *c, int j, int r) {
    return p->ring + ((size_t)j * (GLM_VERIFY_MAX - 1) + (size_t)r) * (size_t)p->P * stride(c);
}

_Static_assert(GLM_PLE_MAX_ORDER == MT_PLE_MAX_ORDER && GLM_PLE_MAX_TABLES == MT_PLE_MAX_TABLES,
               "the backend's hash holds every memory's tables");

mt_status glm_ple_init(glm_layer *l, int rows, int n_rings, bool dev, mt_error *err) {
    const glm_config *c = l->cfg;
    glm_ple_w *p = &l->ple;
    mt_backend *be = l->be;
    const int i = l->base.index;
    if (!be->ops->ple_inject || !be->ops->copy_rows_from)
        return mt_errorf(err, MT_ERR_UNSUPPORTED, "layer %d carries a PLE memory, which this backend does not run", i);
    p->ntab = glm_ple_primes(c, i, p->prime);
    p->E = p->ntab * c->ple_head_dim;
    p->P = (c->ple_conv_kernel - 1) * c->ple_max_ngram;
    for (int t = 0, off = 0; t < p->ntab; off += (int)p->prime[t], t++) p->off[t] = off;
    for (int k = 0; k < c->ple_max_ngram; k++)
        p->mult[k] = mix64((uint64_t)(uint32_t)c->ple_seed * 0x9e3779b97f4a7c15ull + (uint64_t)i * 0xd1b54a32d192ed03ull +
                           (uint64_t)k + 1) | 1u;
    p->rows = rows;
    const size_t r = (size_t)rows;
    if (!(p->emb = be->ops->alloc(be, sizeof(float) * r * p->E)) ||
        !(p->keys = be->ops->alloc(be, sizeof(float) * r * stride(c))) ||
        !(p->vals = be->ops->alloc(be, sizeof(float) * r * c->hidden_size)) ||
        !(p->tab = be->ops->alloc(be, sizeof(float *) * r)) || !(p->h_tab = calloc(r, sizeof(float *))) ||
        !(p->idx = calloc((size_t)p->ntab, sizeof(int32_t))))
        return mt_errorf(err, MT_ERR_NOMEM, "layer %d: out of memory for the PLE memory's scratch", i);
    if (n_rings > 0 && p->P > 0) {
        if (!(p->ring = be->ops->alloc(be, conv_bytes(l) * (size_t)n_rings * (GLM_VERIFY_MAX - 1))))
            return mt_errorf(err, MT_ERR_NOMEM, "layer %d: out of memory for the PLE memory's verify rings", i);
        p->n_rings = n_rings;
    }
    p->dev = dev && be->ops->ple_gather_rows;
    if (p->dev) {
        mt_ple_hash *h = calloc(1, sizeof *h);
        if (!h || !(p->d_hash = be->ops->alloc(be, sizeof *h))) {
            free(h);
            return mt_errorf(err, MT_ERR_NOMEM, "layer %d: out of memory for the PLE memory's hash", i);
        }
        h->N = c->ple_max_ngram;
        h->heads = c->ple_heads;
        h->pad = (uint32_t)c->ple_pad_id;
        memcpy(h->mult, p->mult, sizeof p->mult);
        memcpy(h->prime, p->prime, sizeof(int64_t) * (size_t)p->ntab);
        memcpy(h->off, p->off, sizeof(int64_t) * (size_t)p->ntab);
        be->ops->upload(be, p->d_hash, h, sizeof *h);
        free(h);
    }
    return MT_OK;
}

void glm_ple_release(glm_layer *l) {
    glm_ple_w *p = &l->ple;
    mt_backend *be = l->be;
    be->ops->weight_free(be, &p->table);
    free(p->host_mem); /* after the backend let go of it */
    p->host_mem = NULL;
    be->ops->weight_free(be, &p->key);
    be->ops->weight_free(be, &p->value);
    float *v[] = { p->key_norm, p->query_norm, p->conv_norm, p->conv, p->emb, p->keys, p->vals };
    for (size_t k = 0; k < sizeof v / sizeof v[0]; k++) be->ops->free(be, v[k]);
    be->ops->free(be, p->tab);
    be->ops->free(be, p->ring);
    be->ops->free(be, p->d_hash);
    p->d_hash = NULL;
    free(p->h_tab);
    free(p->idx);
    p->key_norm = p->query_norm = p->conv_norm = p->conv = p->emb = p->keys = p->vals = NULL;
    p->tab = p->h_tab = NULL;
    p->idx = NULL;
    p->ring = NULL;
    p->n_rings = 0;
}

size_t glm_ple_state_bytes(const glm_layer *l) {
    const glm_ple_w *p = &l->ple;
    if (!p->on) return 0;
    return sizeof(glm_ple_state) + sizeof(float) * ((size_t)p->P * stride(l->cfg) + (size_t)GLM_VERIFY_MAX * p->E) +
           sizeof(float *) * GLM_VERIFY_MAX * (p->dev ? 2 : 1) + (p->dev ? sizeof(uint32_t) * MT_PLE_MAX_ORDER : 0);
}

mt_status glm_ple_state_alloc(const glm_layer *l, glm_layer_state *st, mt_error *err) {
    const glm_ple_w *p = &l->ple;
    mt_backend *be = l->be;
    glm_ple_state *s = calloc(1, sizeof *s);
    const size_t cb = sizeof(float) * (size_t)(p->P > 0 ? p->P : 1) * stride(l->cfg);
    /* backend memory comes zeroed: an empty device history */
    if (!s || !(s->conv = be->ops->alloc(be, cb)) || !(s->tab = be->ops->alloc(be, sizeof(float *) * GLM_VERIFY_MAX)) ||
        !(s->staged = be->ops->alloc(be, sizeof(float) * (size_t)GLM_VERIFY_MAX * p->E)) ||
        (p->dev && (!(s->d_hist = be->ops->alloc(be, sizeof(uint32_t) * MT_PLE_MAX_ORDER)) ||
                    !(s->htab = be->ops->alloc(be, sizeof(uint32_t *) * GLM_VERIFY_MAX))))) {
        if (s) {
            st->ple = s;
            glm_ple_state_free(l, st);
        }
        return mt_errorf(err, MT_ERR_NOMEM, "layer %d: out of memory for a PLE state", l->base.index);
    }
    float *h[GLM_VERIFY_MAX];
    for (int k = 0; k < GLM_VERIFY_MAX; k++) h[k] = s->conv;
    be->ops->upload(be, s->tab, h, sizeof h);
    if (p->dev) {
        uint32_t *d[GLM_VERIFY_MAX];
        for (int k = 0; k < GLM_VERIFY_MAX; k++) d[k] = s->d_hist;
        be->ops->upload(be, s->htab, d, sizeof d);
    }
    st->ple = s;
    return MT_OK;
}

void glm_ple_state_free(const glm_layer *l, glm_layer_state *st) {
    if (!st->ple) return;
    l->be->ops->free(l->be, st->ple->conv);
    l->be->ops->free(l->be, st->ple->tab);
    l->be->ops->free(l->be, st->ple->staged);
    l->be->ops->free(l->be, st->ple->d_hist);
    l->be->ops->free(l->be, st->ple->htab);
    free(st->ple);
    st->ple = NULL;
}

/* A sequence's first step: the conv looks back at zeros. */
static void reset_if_fresh(const glm_layer *l, glm_ple_state *s) {
    if (s->hist_len == 0 && l->ple.P > 0) l->be->ops->zero(l->be, s->conv, conv_bytes(l));
}

/* token joins the history (the last N-1 tokens, oldest first). */
static void hist_push(const glm_config *c, glm_ple_state *s, uint32_t token) {
    const int N = c->ple_max_ngram;
    if (s->hist_len == N - 1) {
        memmove(s->hist, s->hist + 1, sizeof(uint32_t) * (size_t)(N - 2));
        s->hist[N - 2] = token;
    } else {
        s->hist[s->hist_len++] = token;
    }
}

/* dev: the device history into the host's mirror, when a step ran ahead of the host. */
static void hist_pull(const glm_layer *l, glm_ple_state *s) {
    if (!s->dev_ahead) return;
    uint32_t h[MT_PLE_MAX_ORDER];
    l->be->ops->download(l->be, h, s->d_hist, sizeof h);
    MT_ASSERT(h[0] <= (uint32_t)(l->cfg->ple_max_ngram - 1));
    s->hist_len = (int)h[0];
    memcpy(s->hist, h + 1, sizeof s->hist);
    s->dev_ahead = false;
}

/* dev: the host's history onto the device, in the backend's order of work. */
static void hist_put(const glm_layer *l, glm_ple_state *s) {
    if (!l->ple.dev) return;
    uint32_t h[MT_PLE_MAX_ORDER] = { (uint32_t)s->hist_len };
    memcpy(h + 1, s->hist, sizeof(uint32_t) * (size_t)s->hist_len);
    mt_backend *be = l->be;
    (be->ops->upload_async ? be->ops->upload_async : be->ops->upload)(be, s->d_hist, h, sizeof h);
    s->dev_ahead = false;
}

/* A step of s begins: its rows stay provisional until the next step (glm_ple_keep). */
static void step_begin(glm_ple_state *s) {
    s->v_hist_len = s->hist_len;
    memcpy(s->v_hist, s->hist, sizeof s->hist);
    s->v_n = 0;
}

/* The table rows of the n-grams ending at token (orders 2..N, heads in order) into p->idx, then
 * token joins the history and the step's tokens. */
static void hash_row(const glm_layer *l, glm_ple_state *s, uint32_t token) {
    const glm_config *c = l->cfg;
    const glm_ple_w *p = &l->ple;
    const int N = c->ple_max_ngram;
    uint64_t x[GLM_PLE_MAX_ORDER]; /* x[k]: the token k positions back, the pad id before the start */
    x[0] = token;
    for (int k = 1; k < N; k++) x[k] = k <= s->hist_len ? s->hist[s->hist_len - k] : (uint64_t)(uint32_t)c->ple_pad_id;
    for (int o = 2, t = 0; o <= N; o++) {
        uint64_t h = x[0] * p->mult[0];
        for (int k = 1; k < o; k++) h ^= x[k] * p->mult[k];
        for (int j = 0; j < c->ple_heads; j++, t++) p->idx[t] = (int32_t)(p->off[t] + (int64_t)(h % (uint64_t)p->prime[t]));
    }
    hist_push(c, s, token);
    if (s->v_n < GLM_VERIFY_MAX) s->v_tok[s->v_n] = token;
    s->v_n++;
}

/* Hashes token for s and gathers its rows into dst [E]. */
static void gather(const glm_layer *l, glm_ple_state *s, uint32_t token, float *dst) {
    reset_if_fresh(l, s);
    hash_row(l, s, token);
    /* the table's row ids fit int32: the manifest's shape bounds them */
    l->be->ops->embed(l->be, dst, &l->ple.table, l->ple.idx, l->ple.ntab);
}

/* ple_inject over rows [r0, r0 + n) of the pass, tab holding an entry a row of the pass. */
static void inject(const glm_layer *l, mt_backend *be, float *X, float *const *tab, int r0, int n) {
    const glm_config *c = l->cfg;
    const glm_ple_w *p = &l->ple;
    const size_t C = (size_t)stride(c), o = (size_t)r0;
    const mt_ple_params pp = { c->hc_mult, c->hidden_size, c->ple_conv_kernel, c->ple_max_ngram, c->ple_norm_eps };
    be->ops->ple_inject(be, X + o * C, p->keys + o * C, p->vals + o * c->hidden_size, tab + r0, p->key_norm,
                        p->query_norm, p->conv_norm, p->conv, n, &pp);
}

/* A verify's rows [r0, r0 + n) of s, one at a time (the arithmetic of n single rows), the conv
 * state after each row but the last into ring j. */
static void inject_verify(const glm_layer *l, mt_backend *be, float *X, float *const *tab, int r0, int n,
                          const glm_ple_state *s, int j) {
    MT_ASSERT(j >= 0 && j < l->ple.n_rings && n <= GLM_VERIFY_MAX);
    for (int i = 0; i < n; i++) {
        inject(l, be, X, tab, r0 + i, 1);
        if (i < n - 1) be->ops->copy(be, ring_slot(&l->ple, l->cfg, j, i), s->conv, conv_bytes(l));
    }
}

static mt_status project_inject(const glm_layer *l, glm_layer_state **sts, int nst, const mt_step *step, float *X,
                                float *const *tab, bool rows, int n);

/* The device form: the step's ids in backend memory (the rows form's token table, one row a
 * sequence, or one sequence's graph-form rows), hashed and gathered by the backend from each
 * sequence's device history, which it advances. The prestages (one a row, when the host had the
 * token) moved the host's mirror alike; a row without one (a pad row, a step whose tokens only
 * the device had) leaves the mirror stale. */
static mt_status forward_dev(const glm_layer *l, glm_layer_state **sts, int nst, mt_step *step, float *X, int n) {
    const glm_ple_w *p = &l->ple;
    const bool rows = step->rtab != NULL;
    MT_ASSERT(rows ? nst == n : nst == 1 && n <= GLM_VERIFY_MAX);
    for (int r = 0; r < n; r++) {
        glm_ple_state *s = sts[rows ? r : 0]->ple;
        if (s->n_staged > 0) {
            s->n_staged--;
        } else {
            s->dev_ahead = true;
            s->v_n = GLM_VERIFY_MAX + 1; /* nothing of it can be kept */
        }
    }
    uint32_t *const *hist = rows ? (uint32_t *const *)(const void *)glm_rtab(step, GLM_R_PLE_HIST) : sts[0]->ple->htab;
    step->be->ops->ple_gather_rows(step->be, p->emb, &p->table, step->d_ids, step->d_ids_stride, hist, p->d_hash,
                                   l->cfg->ple_max_ngram, p->ntab, n);
    return project_inject(l, sts, nst, step, X, rows ? glm_rtab(step, GLM_R_PLE_CONV) : sts[0]->ple->tab, rows, n);
}

mt_status glm_ple_forward(const glm_layer *l, glm_layer_state **sts, int nst, mt_step *step, float *X, int n) {
    const glm_ple_w *p = &l->ple;
    mt_backend *be = step->be;
    const int E = p->E;
    MT_ASSERT(n <= p->rows);
    /* The rows form (batched decode; a bucket graph replays it for other sequences): each row's
     * gathered row is its sequence's staged row 0 and its conv state, read through the tables. */
    const bool rows = step->rtab && !step->seg;
    if (p->dev && step->d_ids && !step->seg && (rows || nst == 1)) return forward_dev(l, sts, nst, step, X, n);
    /* row r's sequence: one for all (nst == 1), one a row, or segment by segment */
    int seg = 0, left = step->seg ? step->seg[0].n : n;
    const glm_ple_state *prev = NULL;
    glm_ple_state *open = NULL; /* the state whose rows this pass hashes (its device history follows after) */
    for (int r = 0; r < n; r++) {
        if (step->seg) {
            while (left == 0) left = step->seg[++seg].n;
            left--;
        } else {
            seg = nst == 1 ? 0 : r;
        }
        glm_ple_state *s = sts[seg]->ple;
        p->h_tab[r] = s->conv;
        const bool first = s != prev; /* the state's first row of the pass (its rows are consecutive) */
        prev = s;
        if (first && open) hist_put(l, open);
        if (first) open = NULL;
        const int32_t id = step->ids ? step->ids[(size_t)r * step->ids_stride] : -1;
        if (s->n_staged > 0) { /* a prestaged step: its rows are gathered, the history moved on */
            if (p->dev) { /* the prestage only moved the history: a device form was to follow */
                mt_log(MT_LOG_ERROR, "layer %d: a prestaged PLE row reached the host form", l->base.index);
                return MT_ERR_STATE;
            }
            const int j = s->n_prestaged - s->n_staged;
            if (id >= 0 && id != s->staged_tok[j]) {
                mt_log(MT_LOG_ERROR, "layer %d: PLE row staged for token %d, fed %d", l->base.index, s->staged_tok[j], id);
                return MT_ERR_STATE;
            }
            if (rows) MT_ASSERT(j == 0); /* one row a sequence: the table names staged row 0 */
            else be->ops->copy(be, p->emb + (size_t)r * E, s->staged + (size_t)j * E, sizeof(float) * E);
            s->n_staged--;
            continue;
        }
        if (id < 0) return MT_ERR_STATE; /* nothing staged and no id on the host */
        if (first) {
            hist_pull(l, s);
            step_begin(s);
            open = s;
        }
        gather(l, s, (uint32_t)id, rows ? s->staged : p->emb + (size_t)r * E);
    }
    if (open) hist_put(l, open);
    float *const *tab = p->tab;
    if (rows) {
        be->ops->copy_rows_from(be, p->emb, (const float *const *)glm_rtab(step, GLM_R_PLE_STAGED), n, E);
        tab = glm_rtab(step, GLM_R_PLE_CONV);
    } else if (nst == 1 && n <= GLM_VERIFY_MAX) {
        tab = sts[0]->ple->tab;
    } else { /* eager forms only (prefill, mixed steps): the table goes up in the order of work */
        (be->ops->upload_async ? be->ops->upload_async : be->ops->upload)(be, p->tab, p->h_tab, sizeof(float *) * (size_t)n);
    }
    return project_inject(l, sts, nst, step, X, tab, rows, n);
}

/* The keys, values and injection of rows whose gathered rows are in p->emb: verifies with a ring
 * row by row, the other rows in as few launches as their order allows. */
static mt_status project_inject(const glm_layer *l, glm_layer_state **sts, int nst, const mt_step *step, float *X,
                                float *const *tab, bool rows, int n) {
    const glm_ple_w *p = &l->ple;
    mt_backend *be = step->be;
    be->ops->matmul(be, p->keys, p->emb, &p->key, n);
    be->ops->matmul(be, p->vals, p->emb, &p->value, n);
    /* verifies with a ring row by row, the other rows in as few launches as their order allows */
    if (rows || !p->ring) {
        inject(l, be, X, tab, 0, n);
    } else if (!step->seg) {
        if (nst == 1 && n > 1 && step->vring) inject_verify(l, be, X, tab, 0, n, sts[0]->ple, step->vring_id);
        else inject(l, be, X, tab, 0, n);
    } else {
        int done = 0, r = 0;
        for (int i = 0; i < step->nseg; r += step->seg[i++].n) {
            if (!step->seg[i].vring || step->seg[i].n < 2) continue;
            if (r > done) inject(l, be, X, tab, done, r - done);
            inject_verify(l, be, X, tab, r, step->seg[i].n, sts[i]->ple, step->seg[i].vring_id);
            done = r + step->seg[i].n;
        }
        if (n > done) inject(l, be, X, tab, done, n - done);
    }
    return MT_OK;
}

mt_status glm_ple_prestage(const glm_layer *l, glm_layer_state *st, int32_t token) {
    glm_ple_state *s = st->ple;
    if (l->ple.dev) { /* the step hashes on the device: only the host's mirror follows */
        if (s->n_staged == 0) {
            s->n_prestaged = 0;
            step_begin(s);
        }
        if (s->n_prestaged >= GLM_VERIFY_MAX) return MT_ERR_INVALID;
        if (token >= 0 && !s->dev_ahead) {
            hist_push(l->cfg, s, (uint32_t)token);
            if (s->v_n < GLM_VERIFY_MAX) s->v_tok[s->v_n] = (uint32_t)token;
            s->v_n++;
        } else { /* a token only the device has: the mirror waits for a read back */
            s->dev_ahead = true;
            s->v_n = GLM_VERIFY_MAX + 1;
        }
        s->staged_tok[s->n_prestaged++] = token;
        s->n_staged++;
        return MT_OK;
    }
    if (token < 0) return MT_ERR_STATE; /* the model never runs ahead of a host-hashing PLE layer (caps) */
    if (s->n_staged == 0) { /* a new step */
        s->n_prestaged = 0;
        step_begin(s);
    }
    if (s->n_prestaged >= GLM_VERIFY_MAX) return MT_ERR_INVALID;
    gather(l, s, (uint32_t)token, s->staged + (size_t)s->n_prestaged * l->ple.E);
    s->staged_tok[s->n_prestaged++] = token;
    s->n_staged++;
    return MT_OK;
}

void glm_ple_rearm(glm_layer_state *st) { st->ple->n_staged = st->ple->n_prestaged; }

void glm_ple_sync(glm_layer_state *st) { st->ple->n_staged = 0; }

mt_status glm_ple_keep(const glm_layer *l, glm_layer_state *st, int keep, int ring) {
    glm_ple_state *s = st->ple;
    const glm_ple_w *p = &l->ple;
    if (keep < 1 || keep > s->v_n || s->v_n > GLM_VERIFY_MAX) return MT_ERR_STATE;
    if (keep == s->v_n) return MT_OK;
    if (p->P > 0 && (ring < 0 || ring >= p->n_rings)) return MT_ERR_STATE; /* the verify kept no ring */
    s->hist_len = s->v_hist_len;
    memcpy(s->hist, s->v_hist, sizeof s->hist);
    for (int i = 0; i < keep; i++) hist_push(l->cfg, s, s->v_tok[i]);
    if (p->P > 0) l->be->ops->copy(l->be, s->conv, ring_slot(p, l->cfg, ring, keep - 1), conv_bytes(l));
    hist_put(l, s);
    s->v_n = keep;
    s->n_staged = s->n_prestaged = 0;
    return MT_OK;
}

/* The snapshot: hist_len (u32), the history (u32 each), the conv state's f32 bytes; little-endian
 * (the hosts this runs on). A state that has seen nothing snapshots zeros for its conv. */
size_t glm_ple_aux_bytes(const glm_layer *l, const void *bytes, size_t len) {
    uint32_t h;
    if (len < sizeof h) return 0;
    memcpy(&h, bytes, sizeof h);
    if (h > (uint32_t)(l->cfg->ple_max_ngram - 1)) return 0;
    return sizeof h * (1 + (size_t)h) + conv_bytes(l);
}

mt_status glm_ple_snapshot(const glm_layer *l, const glm_layer_state *st, void **bytes, size_t *len, mt_error *err) {
    const glm_ple_state *s = st->ple;
    uint32_t hist[MT_PLE_MAX_ORDER] = { (uint32_t)s->hist_len }; /* length, then the ids */
    memcpy(hist + 1, s->hist, sizeof s->hist);
    if (s->dev_ahead) l->be->ops->download(l->be, hist, s->d_hist, sizeof hist); /* the device's is the history */
    const uint32_t h = hist[0];
    MT_ASSERT(h <= (uint32_t)(l->cfg->ple_max_ngram - 1));
    const size_t hb = sizeof h * (1 + (size_t)h), total = hb + conv_bytes(l);
    char *b = malloc(total ? total : 1);
    if (!b) return mt_errorf(err, MT_ERR_NOMEM, "layer %d: out of memory for a PLE snapshot", l->base.index);
    memcpy(b, hist, sizeof h * (1 + (size_t)h));
    if (h == 0) memset(b + hb, 0, conv_bytes(l));
    else if (conv_bytes(l)) l->be->ops->download(l->be, b + hb, s->conv, conv_bytes(l));
    *bytes = b;
    *len = total;
    return MT_OK;
}

void glm_ple_restore(const glm_layer *l, glm_layer_state *st, const void *bytes, size_t len) {
    glm_ple_state *s = st->ple;
    MT_ASSERT(glm_ple_aux_bytes(l, bytes, len) == len && len > 0);
    uint32_t h;
    memcpy(&h, bytes, sizeof h);
    s->hist_len = (int)h;
    memcpy(s->hist, (const char *)bytes + sizeof h, sizeof(uint32_t) * h);
    if (conv_bytes(l)) l->be->ops->upload(l->be, s->conv, (const char *)bytes + sizeof h * (1 + (size_t)h), conv_bytes(l));
    s->n_staged = s->n_prestaged = 0;
    s->v_n = 0; /* nothing of the restored state is provisional */
    hist_put(l, s);
}
