/* worker/model/glm/glm_mtp.c: the MTP block, the model's own drafter (docs/MODEL.md, "MTP
 * block"). Row t of a sequence's drafter takes h, the target's hidden state at position t before
 * the final norm (the mean of the highway's streams), and e, the embedding of token t + 1:
 *
 *   u = eh_proj . [RMSNorm(e, enorm); RMSNorm(h, hnorm)]
 *   u += DSA(RMSNorm(u, input_layernorm));  u += MoE(RMSNorm(u, post_attention_layernorm))
 *   logits = lm_head . RMSNorm(u, shared_head.norm)
 *
 * with a plain residual and the block's own DSA caches (layers[L], paged like the target's DSA
 * layers, row t at position t). Drafting k > 1 tokens feeds the block its own u as h (DeepSeek-V3's
 * sequential MTP); those rows are speculative and the next target step drops them. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "worker/model/glm/glm_impl.h"

/* n drafter rows of s at its next positions: hidden inputs hin [n, H] (backend), tokens [n]
 * (host). Keeps the last row's residual in s->u; logits (host) [vocab] of the last row when not
 * NULL; every row's into glm_model_capture_drafter's buffer when one is set. */
static mt_status mtp_rows(glm_model *m, glm_seq *s, const float *hin, const int32_t *tokens, int n,
                          float *logits) {
    mt_backend *be = m->be;
    const mt_backend_ops *op = be->ops;
    const glm_config *c = &m->cfg;
    const int H = c->hidden_size, L = c->num_hidden_layers;
    const float eps = c->rms_norm_eps;
    const size_t nh = (size_t)n * H;
    struct glm_mtp *x = &m->mtp;
    glm_layer *l = &m->layers[L];
    glm_layer_state *st = (glm_layer_state *)s->states[L];
    mt_status rc;

    op->embed(be, x->e, &m->embed, tokens, n);
    if (m->tp_size > 1 && (rc = glm_all_reduce(m->comm, x->e, nh)) != MT_OK) return rc;
    op->rmsnorm(be, x->e, x->e, x->enorm, n, H, eps);
    op->rmsnorm(be, x->t, hin, x->hnorm, n, H, eps);
    op->matmul(be, x->u, x->e, &x->eh_e, n);
    op->matmul(be, x->e, x->t, &x->eh_h, n);
    op->add(be, x->u, x->e, (int64_t)nh);

    mt_step step = { .be = be, .t0 = st->len, .scr = &m->scr };
    m->scr.sel_n = 0;
    glm_layer_state *sts[1] = { st };
    op->rmsnorm(be, x->t, x->u, l->in_norm, n, H, eps);
    if ((rc = glm_dsa_forward(l, sts, 1, &step, x->t, x->e, n)) != MT_OK) return rc;
    if ((rc = glm_all_reduce(l->comm, x->e, nh)) != MT_OK) return rc;
    op->add(be, x->u, x->e, (int64_t)nh);
    op->rmsnorm(be, x->t, x->u, l->post_norm, n, H, eps);
    glm_mlp_forward(l, &step, x->t, x->e, n);
    if ((rc = glm_all_reduce(l->comm, x->e, nh)) != MT_OK) return rc;
    op->add(be, x->u, x->e, (int64_t)nh);

    const float *last = x->u + (size_t)(n - 1) * H;
    op->copy(be, s->u, last, sizeof(float) * H);
    const int t0 = st->len - n;
    if (x->capture && t0 + n <= x->capture_rows) {
        op->rmsnorm(be, x->t, x->u, x->norm, n, H, eps);
        if ((rc = glm_logits_rows(m, x->t, n, x->capture + (size_t)t0 * c->vocab_size)) != MT_OK) return rc;
    }
    if (!logits) return MT_OK;
    op->rmsnorm(be, x->t, last, x->norm, 1, H, eps);
    return glm_logits_rows(m, x->t, 1, logits);
}

mt_status glm_mtp_follow(glm_model *m, glm_seq *s, const float *X, const int32_t *tokens, int n) {
    if (!m->mtp.on) return MT_OK;
    mt_backend *be = m->be;
    const glm_config *c = &m->cfg;
    const int H = c->hidden_size, a = s->len - n;
    glm_layer_state *st = (glm_layer_state *)s->states[c->num_hidden_layers];
    st->len -= s->n_spec;
    s->n_spec = 0;
    float *hin = m->mtp.hin;
    be->ops->hc_head(be, hin + H, X, n, c->hc_mult, H); /* rows 1 .. n: this pass's hidden states */
    mt_status rc = MT_OK;
    if (st->len == a - 1) { /* the pending row, then rows 0 .. n - 2 */
        be->ops->copy(be, hin, s->hp, sizeof(float) * H);
        rc = mtp_rows(m, s, hin, tokens, n, NULL);
    } else if (st->len == a) { /* the pending row was drafted already (or this is position 0) */
        if (n > 1) rc = mtp_rows(m, s, hin + H, tokens + 1, n - 1, NULL);
    } else {
        return MT_ERR_STATE;
    }
    if (rc == MT_OK) be->ops->copy(be, s->hp, hin + (size_t)n * H, sizeof(float) * H);
    return rc;
}

mt_status glm_mtp_draft(glm_model *m, glm_seq *s, int32_t token, float *logits, mt_error *err) {
    if (!m->mtp.on) return mt_errorf(err, MT_ERR_UNSUPPORTED, "the model has no drafter turned on");
    const glm_config *c = &m->cfg;
    if (token < 0 || token >= c->vocab_size)
        return mt_errorf(err, MT_ERR_INVALID, "draft token %d is outside the vocabulary [0, %d)", token, c->vocab_size);
    glm_layer_state *st = (glm_layer_state *)s->states[c->num_hidden_layers];
    const int committed = glm_mtp_committed(m, s);
    const float *h;
    if (s->n_spec == 0 && committed == s->len - 1) {
        h = s->hp;                 /* the target's last row and the token that follows it */
    } else if (committed == s->len) {
        h = s->u;                  /* a speculative row on the drafter's own residual */
        if (st->len + 1 > st->cap)
            return mt_errorf(err, MT_ERR_FULL, "no room to draft past position %d (capacity %d)", st->len, st->cap);
        mt_status rc = glm_seq_reserve(s, st->len + 1 - s->len, err);
        if (rc != MT_OK) return rc;
    } else {
        return mt_errorf(err, MT_ERR_STATE, "the drafter holds %d rows for a sequence of %d", committed, s->len);
    }
    m->be->ops->copy(m->be, m->mtp.hin, h, sizeof(float) * c->hidden_size);
    mt_status rc = mtp_rows(m, s, m->mtp.hin, &token, 1, logits);
    if (rc != MT_OK) return mt_errorf(err, rc, "draft at position %d failed: %s", st->len - 1, mt_status_str(rc));
    if (h == s->u) s->n_spec++;
    return MT_OK;
}

/* The rows form's tables for n drafter rows: row i at position pos[i] of seqs[i] (its block
 * table), queued behind the work already on the backend's stream (an earlier pass may still read
 * the tables). */
static void mtp_rows_tables(glm_model *m, glm_seq *const *seqs, const int32_t *pos, void **bt, int n) {
    mt_backend *be = m->be;
    struct glm_mtp *x = &m->mtp;
    void (*up)(mt_backend *, void *, const void *, size_t) = be->ops->upload_async ? be->ops->upload_async
                                                                                  : be->ops->upload;
    for (int i = 0; i < n; i++) bt[i] = (void *)seqs[i]->bt.dev;
    up(be, x->d_rpos, pos, sizeof(int32_t) * (size_t)n);
    up(be, x->d_rtab + (size_t)GLM_R_BT * m->rcap, bt, sizeof(void *) * (size_t)n);
}

/* The block over n rows in the rows form, each row at its own position of its own sequence (the
 * tables mtp_rows_tables uploaded; rows of one sequence at consecutive positions may share a
 * pass: the cache rows are all written before any row attends): hidden inputs x->hin [n, H],
 * tokens [n] on the host, or d_tokens in backend memory (the graph form). Leaves every row's residual in x->u. The host-tracked drafter lengths are
 * the caller's to move. */
static mt_status mtp_pass_rows(glm_model *m, const int32_t *tokens, const int32_t *d_tokens, int n) {
    mt_backend *be = m->be;
    const mt_backend_ops *op = be->ops;
    const glm_config *c = &m->cfg;
    const int H = c->hidden_size, L = c->num_hidden_layers;
    const float eps = c->rms_norm_eps;
    const size_t nh = (size_t)n * H;
    struct glm_mtp *x = &m->mtp;
    glm_layer *l = &m->layers[L];
    mt_status rc;
    if (d_tokens) op->embed_dev(be, x->e, &m->embed, d_tokens, n);
    else op->embed(be, x->e, &m->embed, tokens, n);
    if (m->tp_size > 1 && (rc = glm_all_reduce(m->comm, x->e, nh)) != MT_OK) return rc;
    op->rmsnorm(be, x->e, x->e, x->enorm, n, H, eps);
    op->rmsnorm(be, x->t, x->hin, x->hnorm, n, H, eps);
    op->matmul(be, x->u, x->e, &x->eh_e, n);
    op->matmul(be, x->e, x->t, &x->eh_h, n);
    op->add(be, x->u, x->e, (int64_t)nh);
    mt_step step = { .be = be, .t0 = -1, .scr = &m->scr, .rpos = x->d_rpos, .rtab = (void *const *)x->d_rtab,
                     .rcap = m->rcap, .rt_cap = m->rt_cap };
    m->scr.sel_n = 0;
    op->rmsnorm(be, x->t, x->u, l->in_norm, n, H, eps);
    if ((rc = glm_dsa_forward(l, NULL, n, &step, x->t, x->e, n)) != MT_OK) return rc;
    if ((rc = glm_all_reduce(l->comm, x->e, nh)) != MT_OK) return rc;
    op->add(be, x->u, x->e, (int64_t)nh);
    op->rmsnorm(be, x->t, x->u, l->post_norm, n, H, eps);
    glm_mlp_forward(l, &step, x->t, x->e, n);
    if ((rc = glm_all_reduce(l->comm, x->e, nh)) != MT_OK) return rc;
    op->add(be, x->u, x->e, (int64_t)nh);
    return MT_OK;
}

mt_status glm_mtp_follow_parts(glm_model *m, const glm_follow_part *p, int np, const float *X) {
    if (!m->mtp.on || np < 1) return MT_OK;
    mt_backend *be = m->be;
    const mt_backend_ops *op = be->ops;
    const glm_config *c = &m->cfg;
    const int H = c->hidden_size, L = c->num_hidden_layers;
    const size_t SH = (size_t)c->hc_mult * H;
    struct glm_mtp *x = &m->mtp;
    int R = 0;
    for (int i = 0; i < np; i++) R += p[i].n;
    if (np == 1 || x->capture || !op->copy_rows_from || !op->copy_rows_ptr || R > m->rcap) {
        for (int i = 0, r = 0; i < np; r += p[i++].n) { /* one part at a time */
            mt_status rc = glm_mtp_follow(m, p[i].s, X + (size_t)r * SH, p[i].tokens, p[i].n);
            if (rc != MT_OK) return rc;
            if (p[i].ring_h) op->copy(be, p[i].ring_h, x->hin + H, sizeof(float) * (size_t)p[i].n * H);
        }
        return MT_OK;
    }
    /* host tables: the drafter rows (hidden source, token, position, sequence), then the copies
     * out of this pass's hidden rows (each part's last into its pending row, a verify's all into
     * its ring) */
    const float **hsrc = malloc(sizeof *hsrc * (size_t)R);
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)R), *pos = malloc(sizeof(int32_t) * (size_t)R);
    glm_seq **rs = malloc(sizeof *rs * (size_t)R);
    void **bt = malloc(sizeof(void *) * (size_t)R);
    const float **csrc = malloc(sizeof *csrc * (size_t)(np + R));
    float **cdst = malloc(sizeof *cdst * (size_t)(np + R));
    mt_status rc = MT_OK;
    if (!hsrc || !tok || !pos || !rs || !bt || !csrc || !cdst) {
        rc = MT_ERR_NOMEM;
        goto out;
    }
    int nr = 0, nc = 0;
    for (int i = 0, r = 0; i < np; r += p[i++].n) {
        glm_seq *s = p[i].s;
        glm_layer_state *st = (glm_layer_state *)s->states[L];
        const int n = p[i].n, a = s->len - n;
        st->len -= s->n_spec;
        s->n_spec = 0;
        /* the pending row with token 0 when the drafter has not taken it (as glm_mtp_follow) */
        int j0;
        if (st->len == a - 1) j0 = 0;
        else if (st->len == a) j0 = 1;
        else {
            rc = MT_ERR_STATE;
            goto out;
        }
        for (int j = j0; j < n; j++) {
            hsrc[nr] = j == 0 ? s->hp : x->u + (size_t)(r + j - 1) * H;
            tok[nr] = p[i].tokens[j];
            pos[nr] = a - 1 + j;
            rs[nr++] = s;
        }
        st->len = a - 1 + n;
        for (int j = p[i].ring_h ? 0 : n - 1; j < n; j++) {
            csrc[nc] = x->u + (size_t)(r + j) * H;
            cdst[nc++] = j == n - 1 && !p[i].ring_h ? s->hp : p[i].ring_h + (size_t)j * H;
        }
        if (p[i].ring_h) {
            csrc[nc] = x->u + (size_t)(r + n - 1) * H;
            cdst[nc++] = s->hp;
        }
    }
    /* every pass row's hidden state, then the drafter's inputs gathered from it and the pending
     * rows (read before the copies below replace them); the pass then reuses x->u */
    op->hc_head(be, x->u, X, R, c->hc_mult, H);
    void **d = x->d_ptr;
    void (*up)(mt_backend *, void *, const void *, size_t) = op->upload_async ? op->upload_async : op->upload;
    up(be, d, hsrc, sizeof(void *) * (size_t)nr);
    up(be, d + m->rcap, cdst, sizeof(void *) * (size_t)nc);
    up(be, d + 3 * (size_t)m->rcap, csrc, sizeof(void *) * (size_t)nc);
    op->copy_rows_from(be, x->hin, (const float *const *)d, nr, H);
    op->copy_rows_ptr(be, (float *const *)(d + m->rcap), (const float *const *)(d + 3 * (size_t)m->rcap), nc, H);
    if (nr > 0) {
        mtp_rows_tables(m, rs, pos, bt, nr);
        rc = mtp_pass_rows(m, tok, NULL, nr);
    }
out:
    free(hsrc);
    free(tok);
    free(pos);
    free(rs);
    free(bt);
    free(csrc);
    free(cdst);
    return rc;
}

bool glm_mtp_draft_graphs(const glm_model *m) {
    return m->mtp.on && !m->mtp.capture && m->tp_size == 1 && m->params.decode_graphs && m->runner.plan.graphs &&
           m->be->ops->embed_dev && m->be->ops->copy_rows_from && m->be->ops->copy_rows_ptr;
}

typedef struct draft_ctx {
    glm_model *m;
    int B;
} draft_ctx;

/* A batched draft of B rows from the tables in backend memory (glm_mtp_draft_rows uploads them):
 * the rows' hidden inputs gathered through x->d_ptr [0, B), the block over them (tokens x->d_tok),
 * each row's residual out to its sequence's u through x->d_ptr's copy tables, and the logits in
 * m->logits [B, V]. Nothing names a sequence, so a bucket graph records it. */
static mt_status draft_body(void *ctx) {
    const draft_ctx *d = ctx;
    glm_model *m = d->m;
    mt_backend *be = m->be;
    const mt_backend_ops *op = be->ops;
    struct glm_mtp *x = &m->mtp;
    const int H = m->cfg.hidden_size, B = d->B;
    const size_t cap = (size_t)m->rcap;
    op->copy_rows_from(be, x->hin, (const float *const *)x->d_ptr, B, H);
    mt_status rc = mtp_pass_rows(m, NULL, x->d_tok, B);
    if (rc != MT_OK) return rc;
    op->copy_rows_ptr(be, (float *const *)(x->d_ptr + cap), (const float *const *)(x->d_ptr + 3 * cap), B, H);
    op->rmsnorm(be, x->t, x->u, x->norm, B, H, m->cfg.rms_norm_eps);
    return glm_logits_rows(m, x->t, B, NULL);
}

mt_status glm_mtp_draft_rows(glm_model *m, glm_seq **seqs, const int32_t *tokens, int n, float *logits,
                             int32_t *argmax, mt_error *err) {
    if (!m->mtp.on) return mt_errorf(err, MT_ERR_UNSUPPORTED, "the model has no drafter turned on");
    if (!logits && !argmax) return mt_errorf(err, MT_ERR_INVALID, "a batched draft with no output");
    const glm_config *c = &m->cfg;
    const int H = c->hidden_size, L = c->num_hidden_layers, V = c->vocab_size, cap = m->rcap;
    if (n < 1 || n > cap) return mt_errorf(err, MT_ERR_INVALID, "a batched draft of %d rows (1 to %d)", n, cap);
    const bool graphs = glm_mtp_draft_graphs(m);
    /* the capture's rows are per sequence: one at a time; so is a lone row, whose own form reads
     * only its length where the rows form sizes its attention by the longest sequence (rt_cap) */
    if (m->mtp.capture || n == 1) {
        float *one = logits ? NULL : malloc(sizeof(float) * (size_t)V);
        if (!logits && !one) return mt_errorf(err, MT_ERR_NOMEM, "out of memory for a draft's logits");
        mt_status rc = MT_OK;
        for (int i = 0; i < n && rc == MT_OK; i++) {
            rc = glm_mtp_draft(m, seqs[i], tokens[i], logits ? logits + (size_t)i * V : one, err);
            if (rc == MT_OK && !logits) argmax[i] = glm_argmax(one, V);
        }
        free(one);
        return rc;
    }
    /* every row checked and its pages mapped before anything is computed */
    for (int i = 0; i < n; i++) {
        glm_seq *s = seqs[i];
        if (!s || s->m != m) return mt_errorf(err, MT_ERR_INVALID, "draft row %d: a sequence of another model", i);
        if (tokens[i] < 0 || tokens[i] >= V)
            return mt_errorf(err, MT_ERR_INVALID, "draft row %d: token %d is outside the vocabulary [0, %d)", i, tokens[i], V);
        for (int j = 0; j < i; j++)
            if (seqs[j] == s) return mt_errorf(err, MT_ERR_INVALID, "draft row %d: its sequence is also row %d", i, j);
        const glm_layer_state *st = (const glm_layer_state *)s->states[L];
        const int committed = glm_mtp_committed(m, s);
        if (s->n_spec == 0 && committed == s->len - 1) continue;
        if (committed != s->len)
            return mt_errorf(err, MT_ERR_STATE, "draft row %d: the drafter holds %d rows for a sequence of %d", i,
                             committed, s->len);
        if (st->len + 1 > st->cap)
            return mt_errorf(err, MT_ERR_FULL, "draft row %d: no room to draft past position %d (capacity %d)", i,
                             st->len, st->cap);
        mt_status rc = glm_seq_reserve(s, st->len + 1 - s->len, err);
        if (rc != MT_OK) return rc;
    }
    /* a bucket graph of B rows when graphs are on (the rows past n run on the pad sequence at its
     * position 0, their outputs dropped), else n rows eagerly */
    struct glm_mtp *x = &m->mtp;
    const int b = glm_bucket_of(n);
    bool use_graph = graphs && b < GLM_BUCKETS && (1 << b) <= m->params.graph_max_rows && (1 << b) <= cap &&
                     x->bucket[b].failures < RT_MAX_CAPTURE_FAILURES;
    if (use_graph && (1 << b) > n && !glm_pad_ensure(m)) use_graph = false;
    const int B = use_graph ? 1 << b : n;
    mt_backend *be = m->be;
    const mt_backend_ops *op = be->ops;
    int32_t *pos = malloc(sizeof(int32_t) * (size_t)B), *tok = malloc(sizeof(int32_t) * (size_t)B);
    void **bt = malloc(sizeof(void *) * (size_t)B);
    glm_seq **rs = malloc(sizeof *rs * (size_t)B);
    const float **hsrc = malloc(sizeof *hsrc * (size_t)B), **usrc = malloc(sizeof *usrc * (size_t)B);
    float **udst = malloc(sizeof *udst * (size_t)B);
    bool *spec = malloc(sizeof(bool) * (size_t)n);
    mt_status rc = MT_OK;
    if (!pos || !tok || !bt || !rs || !hsrc || !usrc || !udst || !spec) {
        rc = mt_errorf(err, MT_ERR_NOMEM, "out of memory for a batched draft of %d rows", n);
        goto out;
    }
    /* row i: the target's last row (hp) or the last draft's residual (u), at its own drafter
     * position; its residual goes back to its u */
    for (int i = 0; i < B; i++) {
        glm_seq *s = i < n ? seqs[i] : m->pad_seq;
        if (i < n) spec[i] = !(s->n_spec == 0 && glm_mtp_committed(m, s) == s->len - 1);
        rs[i] = s;
        hsrc[i] = i < n && spec[i] ? s->u : s->hp;
        pos[i] = i < n ? ((const glm_layer_state *)s->states[L])->len : 0;
        tok[i] = i < n ? tokens[i] : 0;
        udst[i] = s->u;
        usrc[i] = x->u + (size_t)i * H;
    }
    void (*up)(mt_backend *, void *, const void *, size_t) = op->upload_async ? op->upload_async : op->upload;
    mtp_rows_tables(m, rs, pos, bt, B);
    if (!graphs) { /* one rank's eager pass (the tables above serve its DSA) */
        for (int i = 0; i < n; i++) op->copy(be, x->hin + (size_t)i * H, hsrc[i], sizeof(float) * H);
        if ((rc = mtp_pass_rows(m, tokens, NULL, n)) != MT_OK) goto failed;
        for (int i = 0; i < n; i++) op->copy(be, udst[i], usrc[i], sizeof(float) * H);
        op->rmsnorm(be, x->t, x->u, x->norm, n, H, c->rms_norm_eps);
        if ((rc = glm_logits_rows(m, x->t, n, NULL)) != MT_OK) goto failed;
    } else {
        up(be, x->d_tok, tok, sizeof(int32_t) * (size_t)B);
        up(be, x->d_ptr, hsrc, sizeof(void *) * (size_t)B);
        up(be, x->d_ptr + cap, udst, sizeof(void *) * (size_t)B);
        up(be, x->d_ptr + 3 * (size_t)cap, usrc, sizeof(void *) * (size_t)B);
        draft_ctx ctx = { m, B };
        const rt_rows none = { 0 };
        char what[64];
        snprintf(what, sizeof what, "batched draft of %d rows", B);
        if ((rc = rt_run_step(&m->runner, &x->bucket[b], use_graph, m->rt_cap, &none, draft_body, &ctx, what)) != MT_OK)
            goto failed;
    }
    for (int i = 0; i < n; i++) {
        ((glm_layer_state *)seqs[i]->states[L])->len++;
        if (spec[i]) seqs[i]->n_spec++;
    }
    if (logits) be->ops->download(be, logits, m->logits, sizeof(float) * (size_t)n * V);
    else be->ops->argmax(be, argmax, m->logits, n, V);
    goto out;
failed:
    rc = mt_errorf(err, rc, "a batched draft of %d rows failed: %s", n, mt_status_str(rc));
out:
    free(pos);
    free(tok);
    free(bt);
    free(rs);
    free(hsrc);
    free(usrc);
    free(udst);
    free(spec);
    return rc;
}
