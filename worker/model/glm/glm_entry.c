/* worker/model/glm/glm_entry.c: glm5_next behind the model interface (worker/model/model.h): the
 * engine's calls mapped onto glm_model.h. A batch plan with a prompt chunk or a verify beside
 * other parts runs as mixed passes (glm_forward_mixed: every part's rows through one pass over
 * the weights); any other runs its parts one after the other: the decode parts of one row
 * together through the batched decode (a pass of at most batch_rows rows at a time), then every
 * verify part (k rows of one sequence), then every prefill part. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "worker/model/glm/glm_impl.h"

static glm_model *as_glm(mt_model *m) { return (glm_model *)m; }
static const glm_model *as_cglm(const mt_model *m) { return (const glm_model *)m; }
static glm_seq *seq_of(mt_seq *s) { return (glm_seq *)s; }
static const glm_seq *cseq_of(const mt_seq *s) { return (const glm_seq *)s; }

mt_model *glm_model_as_model(glm_model *m) { return &m->base; }

static mt_status iface_draft(mt_model *m, mt_seq *s, int32_t token, float *logits, mt_error *err) {
    return glm_mtp_draft(as_glm(m), seq_of(s), token, logits, err);
}
static mt_status iface_draft_rows(mt_model *m, mt_seq **seqs, const int32_t *tokens, int n, float *logits,
                                  int32_t *argmax, mt_error *err) {
    /* glm_seq begins with its mt_seq, so the array of one is the array of the other */
    return glm_mtp_draft_rows(as_glm(m), (glm_seq **)seqs, tokens, n, logits, argmax, err);
}
static mt_status iface_seq_keep(mt_model *m, mt_seq *s, int keep, mt_error *err) {
    return glm_seq_keep(as_glm(m), seq_of(s), keep, err);
}

static mt_status iface_seq_keep_rows(mt_model *m, mt_seq **seqs, const int *keeps, int n, int *done,
                                     mt_error *err) {
    return glm_seq_keep_rows(as_glm(m), (glm_seq **)seqs, keeps, n, done, err);
}

static void iface_destroy(mt_model *m) { glm_model_free(as_glm(m)); }

/* Whether every layer runs mixed steps (forward_segments), which layered chunks go through. */
static bool mixed_layers(const glm_model *m) {
    for (int l = 0; l < m->cfg.num_hidden_layers; l++)
        if (!m->layers[l].base.ops->forward_segments) return false;
    return true;
}

/* Whether part p is a layered chunk: its layers set, or its sequence's chunk in flight. */
static bool layered_part(const mt_batch_part *p) {
    return p->kind == MT_PART_PREFILL && (p->layers > 0 || glm_seq_in_flight((const glm_seq *)p->seq));
}

static void iface_describe(const mt_model *mm, mt_model_info *out) {
    const glm_model *m = as_cglm(mm);
    const glm_config *c = &m->cfg;
    *out = (mt_model_info){
        .arch = "glm5_next",
        .vocab_size = c->vocab_size,
        .eos_token_id = c->eos_token_id,
        .n_layers = c->num_hidden_layers,
        .hidden_size = c->hidden_size,
        .page_tokens = glm_model_page_tokens(m),
        .page_bytes = glm_model_page_bytes(m),
        .slot_bytes = glm_model_slot_bytes(m),
        .batch_rows = glm_model_batch_rows(m),
        .ahead_rows = glm_model_ahead_rows(m),
        .backend_queues = glm_model_backend_queues(m),
        .multi_seq = m->runner.plan.multi_seq,
        .layered_prefill = mixed_layers(m),
        .layered_units = glm_model_layered_units(m),
        .rollback = m->mtp.on,
        .has_drafter = m->mtp.on,
        .verify_seqs = m->mtp.on ? m->mtp.n_rings : 0,
        .tp_rank = m->tp_rank,
        .tp_size = m->tp_size,
    };
}

static mt_status iface_set_pools(mt_model *m, int n_pages, int n_slots, mt_error *err) {
    return glm_model_set_pools(as_glm(m), n_pages, n_slots, err);
}
static mt_status iface_ensure_pools(mt_model *m, mt_error *err) { return glm_model_ensure_pools(as_glm(m), err); }
static void iface_pool_stats(const mt_model *mm, mt_pool_stats *out) {
    const glm_model *m = as_cglm(mm);
    *out = (mt_pool_stats){ glm_model_pages_free(m), glm_model_pages_total(m), glm_model_slots_free(m),
                            glm_model_slots_total(m) };
}
static size_t iface_seq_bytes_max(const mt_model *m, int max_tokens) { return glm_model_seq_bytes(as_cglm(m), max_tokens); }

static mt_status iface_seq_new(mt_model *m, int max_tokens, mt_seq **out, mt_error *err) {
    glm_seq *s = NULL;
    mt_status st = glm_seq_new(as_glm(m), max_tokens, &s, err);
    *out = s ? &s->base : NULL;
    return st;
}
static void iface_seq_free(mt_seq *s) { glm_seq_free(seq_of(s)); }
static mt_status iface_seq_reserve(mt_seq *s, int n, mt_error *err) { return glm_seq_reserve(seq_of(s), n, err); }
static int iface_seq_len(const mt_seq *s) { return glm_seq_len(cseq_of(s)); }
static size_t iface_seq_bytes(const mt_seq *s) { return glm_seq_bytes(cseq_of(s)); }
static int iface_seq_pages(const mt_seq *s, const int32_t **pages) {
    *pages = glm_seq_page_ids(cseq_of(s));
    return glm_seq_pages(cseq_of(s));
}
static mt_status iface_seq_copy_prefix(mt_model *m, const mt_seq *src, mt_seq *dst, mt_error *err) {
    return glm_seq_copy_prefix(as_glm(m), cseq_of(src), seq_of(dst), err);
}

/* The one-row decode parts [0, n) of a plan (parts[idx[i]]), in passes of at most batch_rows rows;
 * logits and greedy tokens go to each part's own buffers. */
static mt_status forward_rows(glm_model *m, const mt_batch_part *parts, const int *idx, int n, mt_error *err) {
    const int rows = glm_model_batch_rows(m), V = m->cfg.vocab_size;
    glm_seq **seqs = malloc(sizeof *seqs * (size_t)n);
    int32_t *tok = malloc(sizeof *tok * (size_t)n), *greedy = malloc(sizeof *greedy * (size_t)rows);
    float *logits = NULL;
    bool want_logits = false;
    for (int i = 0; i < n; i++) want_logits |= parts[idx[i]].logits != NULL;
    if (want_logits) logits = malloc(sizeof(float) * (size_t)rows * V);
    mt_status st = MT_OK;
    if (!seqs || !tok || !greedy || (want_logits && !logits)) st = mt_errorf(err, MT_ERR_NOMEM, "out of memory");
    for (int i = 0; i < n && st == MT_OK; i++) {
        seqs[i] = seq_of(parts[idx[i]].seq);
        tok[i] = parts[idx[i]].tokens[0];
    }
    for (int c0 = 0; c0 < n && st == MT_OK; c0 += rows) {
        const int k = n - c0 < rows ? n - c0 : rows;
        /* the parts' logits side by side in one buffer (the engine's batch): written in place */
        float *base = parts[idx[c0]].logits;
        bool in_place = base != NULL;
        for (int i = 1; i < k && in_place; i++) in_place = parts[idx[c0 + i]].logits == base + (size_t)i * V;
        st = glm_decode_multi(m, seqs + c0, tok + c0, k, in_place ? base : logits, err);
        bool want_greedy = false;
        for (int i = 0; i < k; i++) want_greedy |= parts[idx[c0 + i]].argmax != NULL;
        if (st == MT_OK && want_greedy) st = glm_last_argmax(m, k, greedy);
        for (int i = 0; i < k && st == MT_OK; i++) {
            const mt_batch_part *p = &parts[idx[c0 + i]];
            if (p->logits && !in_place) memcpy(p->logits, logits + (size_t)i * V, sizeof(float) * V);
            if (p->argmax) p->argmax[0] = greedy[i];
        }
    }
    free(seqs);
    free(tok);
    free(greedy);
    free(logits);
    return st;
}

/* A verify part: k rows of one sequence; logits of the last row only unless all_logits. */
static mt_status forward_verify(glm_model *m, const mt_batch_part *p, mt_error *err) {
    const int V = m->cfg.vocab_size;
    float *all = malloc(sizeof(float) * (size_t)p->n * V);
    if (!all) return mt_errorf(err, MT_ERR_NOMEM, "out of memory");
    mt_status st = glm_decode_verify(m, seq_of(p->seq), p->tokens, p->n, all, err);
    if (st == MT_OK && p->logits)
        memcpy(p->logits, p->all_logits ? all : all + (size_t)(p->n - 1) * V,
               sizeof(float) * (size_t)(p->all_logits ? p->n : 1) * V);
    for (int i = 0; i < p->n && st == MT_OK && p->argmax; i++) p->argmax[i] = glm_argmax(all + (size_t)i * V, V);
    free(all);
    return st;
}

/* A batch of two parts or more with a prompt chunk or a verify (a decode part of k > 1 rows), at
 * most the model's verify_seqs verifies, as mixed steps: the parts in order, packed into passes
 * of at most glm_model_pass_rows rows, a chunk that does not fit split across passes (a verify
 * never is: it starts the next pass, and the verifies take rings 0, 1, ... in order across the
 * passes). Every part is checked before the first pass. */
static bool mixable(const glm_model *m, const mt_batch *b) {
    bool some = false;
    int nv = 0;
    for (int i = 0; i < b->n_parts; i++)
        if (layered_part(&b->parts[i])) return true;
    for (int i = 0; i < b->n_parts; i++) {
        const mt_batch_part *p = &b->parts[i];
        if (p->kind == MT_PART_DECODE && p->n > 1 && p->n > glm_model_pass_rows(m)) return false;
        nv += p->kind == MT_PART_DECODE && p->n > 1;
        some |= p->kind == MT_PART_PREFILL || p->n > 1;
    }
    return some && b->n_parts > 1 && (nv == 0 || (m->mtp.on && nv <= m->mtp.n_rings));
}

static mt_status forward_mixed(glm_model *m, const mt_batch *b, mt_error *err) {
    const int rows = glm_model_pass_rows(m), V = m->cfg.vocab_size;
    for (int i = 0; i < b->n_parts; i++) {
        const mt_batch_part *p = &b->parts[i];
        const glm_seq *s = cseq_of(p->seq);
        for (int t = 0; t < p->n; t++)
            if (p->tokens[t] < 0 || p->tokens[t] >= V)
                return mt_errorf(err, MT_ERR_INVALID, "batch part %d: token %d at index %d is outside the vocabulary [0, %d)",
                                 i, p->tokens[t], t, V);
        if (glm_seq_len(s) + p->n > s->cap)
            return mt_errorf(err, MT_ERR_FULL, "batch part %d: a sequence of %d tokens has room for %d more, asked for %d", i,
                             glm_seq_len(s), s->cap - glm_seq_len(s), p->n);
        for (int j = 0; j < i; j++)
            if (b->parts[j].seq == p->seq) return mt_errorf(err, MT_ERR_INVALID, "batch part %d: its sequence is also part %d", i, j);
    }
    int total = 0;
    bool layered = false;
    for (int i = 0; i < b->n_parts; i++) {
        total += b->parts[i].n;
        layered |= layered_part(&b->parts[i]);
    }
    if (layered && total > rows)
        return mt_errorf(err, MT_ERR_INVALID, "a step with layered chunks has %d rows, more than one pass (%d)", total,
                         rows);
    glm_mixed_part *pass = malloc(sizeof *pass * (size_t)b->n_parts);
    if (!pass) return mt_errorf(err, MT_ERR_NOMEM, "out of memory");
    mt_status st = MT_OK;
    int np = 0, used = 0;
    int ring = 0, ring_next = 0; /* the ring of the pass's first verify; of the next verify */
    for (int i = 0; i < b->n_parts && st == MT_OK; i++) {
        const mt_batch_part *p = &b->parts[i];
        const bool verify = p->kind == MT_PART_DECODE && p->n > 1;
        if (verify && used > 0 && used + p->n > rows) { /* whole, in the next pass */
            st = glm_forward_mixed(m, pass, np, ring, err);
            np = used = 0;
            ring = ring_next;
            if (st != MT_OK) break;
        }
        ring_next += verify;
        for (int done = 0; done < p->n && st == MT_OK;) {
            const int k = p->n - done < rows - used ? p->n - done : rows - used;
            const bool last = done + k == p->n;
            glm_mixed_part q = { .s = seq_of(p->seq), .tokens = p->tokens + done, .n = k, .verify = verify,
                                 .layers = p->kind == MT_PART_PREFILL ? p->layers : 0 };
            if (p->logits && p->all_logits) { q.logits = p->logits + (size_t)done * V; q.all_logits = true; }
            else if (last) q.logits = p->logits;
            if (last || verify) q.argmax = p->argmax;
            pass[np++] = q;
            used += k;
            done += k;
            if (used == rows || (i == b->n_parts - 1 && last)) {
                st = glm_forward_mixed(m, pass, np, ring, err);
                np = used = 0;
                ring = ring_next;
            }
        }
    }
    free(pass);
    return st;
}

static mt_status iface_forward(mt_model *mm, const mt_batch *b, mt_error *err) {
    glm_model *m = as_glm(mm);
    for (int i = 0; i < b->n_parts; i++) {
        const mt_batch_part *p = &b->parts[i];
        if (!p->seq || p->seq->model != mm || p->n < 1 || !p->tokens)
            return mt_errorf(err, MT_ERR_INVALID, "batch part %d: no tokens, or a sequence of another model", i);
        if (p->kind == MT_PART_PREFILL && p->argmax)
            return mt_errorf(err, MT_ERR_INVALID, "batch part %d: greedy tokens are for decode parts", i);
    }
    if (mixable(m, b)) return forward_mixed(m, b, err);
    /* one after the other, every verify would write ring 0: the first ones' seq_keep would find
     * it taken */
    int nv = 0;
    for (int i = 0; i < b->n_parts; i++) nv += b->parts[i].kind == MT_PART_DECODE && b->parts[i].n > 1;
    if (m->mtp.on && nv > 1)
        return mt_errorf(err, MT_ERR_UNSUPPORTED,
                         "%d verify parts share a forward only as mixed passes (at most %d, of at most %d rows each)", nv,
                         m->mtp.n_rings, glm_model_pass_rows(m));
    int *rows = malloc(sizeof(int) * (size_t)(b->n_parts > 0 ? b->n_parts : 1));
    if (!rows) return mt_errorf(err, MT_ERR_NOMEM, "out of memory");
    int n_rows = 0;
    mt_status st = MT_OK;
    for (int i = 0; i < b->n_parts && st == MT_OK; i++) {
        const mt_batch_part *p = &b->parts[i];
        if (!p->seq || p->seq->model != mm || p->n < 1 || !p->tokens)
            st = mt_errorf(err, MT_ERR_INVALID, "batch part %d: no tokens, or a sequence of another model", i);
        else if (p->kind == MT_PART_PREFILL && p->argmax)
            st = mt_errorf(err, MT_ERR_INVALID, "batch part %d: greedy tokens are for decode parts", i);
        else if (p->kind == MT_PART_DECODE && p->n == 1)
            rows[n_rows++] = i;
    }
    if (st == MT_OK && n_rows > 0) st = forward_rows(m, b->parts, rows, n_rows, err);
    free(rows);
    for (int i = 0; i < b->n_parts && st == MT_OK; i++) {
        const mt_batch_part *p = &b->parts[i];
        if (p->kind == MT_PART_DECODE && p->n > 1) st = forward_verify(m, p, err);
    }
    for (int i = 0; i < b->n_parts && st == MT_OK; i++) {
        const mt_batch_part *p = &b->parts[i];
        if (p->kind == MT_PART_PREFILL)
            st = glm_prefill(m, seq_of(p->seq), p->tokens, p->n, p->logits, p->all_logits, err);
    }
    return st;
}

static mt_status iface_decode_ahead(mt_model *m, mt_seq **seqs, const int32_t *tokens, int n, int64_t *ticket,
                                    mt_error *err) {
    /* glm_seq begins with its mt_seq, so the array of one is the array of the other */
    return glm_decode_greedy(as_glm(m), (glm_seq **)seqs, tokens, n, ticket, err);
}

static mt_status iface_ahead_tokens(mt_model *m, int64_t ticket, int32_t *out, int n) {
    return glm_greedy_tokens(as_glm(m), ticket, out, n);
}

const mt_model_ops glm_model_iface = {
    .destroy = iface_destroy,
    .describe = iface_describe,
    .set_pools = iface_set_pools,
    .ensure_pools = iface_ensure_pools,
    .pool_stats = iface_pool_stats,
    .seq_bytes_max = iface_seq_bytes_max,
    .seq_new = iface_seq_new,
    .seq_free = iface_seq_free,
    .seq_reserve = iface_seq_reserve,
    .seq_len = iface_seq_len,
    .seq_bytes = iface_seq_bytes,
    .seq_pages = iface_seq_pages,
    .seq_copy_prefix = iface_seq_copy_prefix,
    .forward = iface_forward,
    .decode_ahead = iface_decode_ahead,
    .ahead_tokens = iface_ahead_tokens,
    .draft = iface_draft,
    .draft_rows = iface_draft_rows,
    .seq_keep = iface_seq_keep,
    .seq_keep_rows = iface_seq_keep_rows,
};

mt_status glm_model_open(const char *dir, mt_backend *be, const mt_model_params *params, mt_model **out,
                         mt_error *err) {
    glm_model *m = NULL;
    mt_status st = glm_model_load(dir, be, params, &m, err);
    *out = m ? &m->base : NULL;
    return st;
}

mt_status glm_model_open_random(const char *preset, mt_backend *be, const mt_model_params *params, mt_model **out,
                                mt_error *err) {
    *out = NULL;
    glm_config cfg;
    /* PRESET+mtp: the preset with an MTP block (random weights too) */
    char name[64];
    snprintf(name, sizeof name, "%s", preset);
    const size_t n = strlen(name);
    const bool mtp = n > 4 && !strcmp(name + n - 4, "+mtp");
    if (mtp) name[n - 4] = 0;
    mt_status st = glm_config_preset(name, &cfg, err);
    if (mtp) cfg.num_nextn_predict_layers = 1;
    glm_model *m = NULL;
    if (st == MT_OK) st = glm_model_new_random(&cfg, 1, be, params, &m, err);
    *out = m ? &m->base : NULL;
    return st;
}
