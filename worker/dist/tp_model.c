/* worker/dist/tp_model.c: see tp_model.h. A call travels as a fixed header broadcast from rank 0,
 * then its payload (token ids and part descriptions) when it has one; then every rank contributes
 * its status to an all-reduce (the count of ranks that failed). */
#include "worker/dist/tp_model.h"

#include <stdlib.h>
#include <string.h>

typedef enum tp_op {
    TP_STOP = 1,               /* the leader is freed: followers return */
    TP_SET_POOLS,              /* a = pages, b = slots */
    TP_ENSURE_POOLS,
    TP_SEQ_NEW,                /* a = max_tokens, id = the new sequence's */
    TP_SEQ_FREE,               /* id */
    TP_SEQ_RESERVE,            /* id, a = n */
    TP_SEQ_COPY_PREFIX,        /* id = dst, a = src */
    TP_FORWARD,                /* a = parts; payload: tp_part[a], then every part's tokens */
    TP_DECODE_AHEAD,           /* a = n, b = 1: the tokens are the last greedy step's (on the
                                * device); payload: n sequence ids, then (b = 0) n tokens */
    TP_DRAFT,                  /* id, a = token */
    TP_SEQ_KEEP,               /* id, a = rows kept */
} tp_op;

typedef struct tp_header {
    int32_t op;
    int32_t id;
    int64_t a, b;
    int64_t payload;           /* bytes that follow */
} tp_header;

/* One part of a forward as it travels. */
typedef struct tp_part {
    int32_t kind, seq, n, layers;
    uint8_t logits, all_logits; /* rank 0 reads logits: every rank computes the head */
} tp_part;

/* ---- the sequence table: a replica's sequences by id, the same ids on every rank ---- */

typedef struct tp_table {
    mt_seq **v;
    int cap;
} tp_table;

static mt_status table_put(tp_table *t, int id, mt_seq *s) {
    if (id >= t->cap) {
        const int cap = id >= 2 * t->cap ? id + 16 : 2 * t->cap;
        mt_seq **g = realloc(t->v, sizeof *g * (size_t)cap);
        if (!g) return MT_ERR_NOMEM;
        memset(g + t->cap, 0, sizeof *g * (size_t)(cap - t->cap));
        t->v = g;
        t->cap = cap;
    }
    t->v[id] = s;
    return MT_OK;
}

static mt_seq *table_get(const tp_table *t, int id) { return id >= 0 && id < t->cap ? t->v[id] : NULL; }

/* ---- applying a call (every rank) ---- */

/* Runs one call on this rank's shard. payload as broadcast; host scratch for the logits a
 * follower computes but does not read. */
static mt_status apply(mt_model *m, tp_table *t, const tp_header *h, const char *payload, float **scratch,
                       size_t *scratch_cap, mt_error *err) {
    switch (h->op) {
    case TP_SET_POOLS: return mt_model_set_pools(m, (int)h->a, (int)h->b, err);
    case TP_ENSURE_POOLS: return mt_model_ensure_pools(m, err);
    case TP_SEQ_NEW: {
        mt_seq *s = NULL;
        mt_status st = mt_seq_new(m, (int)h->a, &s, err);
        if (st == MT_OK && (st = table_put(t, h->id, s)) != MT_OK) mt_seq_free(s);
        return st;
    }
    case TP_SEQ_FREE:
        mt_seq_free(table_get(t, h->id));
        if (h->id < t->cap) t->v[h->id] = NULL;
        return MT_OK;
    case TP_SEQ_RESERVE: return mt_seq_reserve(table_get(t, h->id), (int)h->a, err);
    case TP_SEQ_COPY_PREFIX: return mt_seq_copy_prefix(m, table_get(t, (int)h->a), table_get(t, h->id), err);
    case TP_FORWARD: {
        const int n = (int)h->a, V = mt_model_describe(m).vocab_size;
        const tp_part *tp = (const tp_part *)payload;
        const int32_t *tok = (const int32_t *)(payload + sizeof(tp_part) * (size_t)n);
        mt_batch_part *parts = calloc((size_t)n, sizeof *parts);
        size_t need = 0;
        for (int i = 0; i < n; i++)
            if (tp[i].logits) need += (size_t)(tp[i].all_logits ? tp[i].n : 1) * (size_t)V;
        if (need > *scratch_cap) {
            float *g = realloc(*scratch, sizeof(float) * need);
            if (g) {
                *scratch = g;
                *scratch_cap = need;
            }
        }
        if (!parts || need > *scratch_cap) {
            free(parts);
            return mt_errorf(err, MT_ERR_NOMEM, "out of memory for a forward of %d parts", n);
        }
        size_t off = 0;
        for (int i = 0; i < n; i++) {
            parts[i] = (mt_batch_part){ .kind = (mt_part_kind)tp[i].kind, .seq = table_get(t, tp[i].seq), .tokens = tok,
                                        .n = tp[i].n, .all_logits = tp[i].all_logits, .layers = tp[i].layers };
            if (tp[i].logits) {
                parts[i].logits = *scratch + off;
                off += (size_t)(tp[i].all_logits ? tp[i].n : 1) * (size_t)V;
            }
            tok += tp[i].n;
        }
        mt_status st = mt_model_forward(m, &(mt_batch){ parts, n }, err);
        free(parts);
        return st;
    }
    case TP_DECODE_AHEAD: {
        const int n = (int)h->a;
        const int32_t *ids = (const int32_t *)payload;
        mt_seq **seqs = malloc(sizeof *seqs * (size_t)n);
        if (!seqs) return mt_errorf(err, MT_ERR_NOMEM, "out of memory for a greedy step of %d rows", n);
        for (int i = 0; i < n; i++) seqs[i] = table_get(t, ids[i]);
        int64_t ticket; /* rank 0 reads the tokens; here they only feed the next step */
        mt_status st = mt_model_decode_ahead(m, seqs, h->b ? NULL : ids + n, n, &ticket, err);
        free(seqs);
        return st;
    }
    case TP_DRAFT: {
        const size_t V = (size_t)mt_model_describe(m).vocab_size;
        if (V > *scratch_cap) {
            float *g = realloc(*scratch, sizeof(float) * V);
            if (!g) return mt_errorf(err, MT_ERR_NOMEM, "out of memory for a draft's logits");
            *scratch = g;
            *scratch_cap = V;
        }
        return mt_model_draft(m, table_get(t, h->id), (int32_t)h->a, *scratch, err);
    }
    case TP_SEQ_KEEP: return mt_seq_keep(m, table_get(t, h->id), (int)h->a, err);
    default: return mt_errorf(err, MT_ERR_INVALID, "tensor-parallel call %d is not known", h->op);
    }
}

/* Every rank's outcome of a call: MT_OK when all succeeded; otherwise MT_ERR_BACKEND (the group
 * is broken) when they disagree, or mine. A failed collective is the group's failure. */
static mt_status agree(mt_comm *ctl, mt_status mine, bool *broken, mt_error *err) {
    float failed = mine != MT_OK ? 1.f : 0.f;
    mt_status st = mt_comm_all_reduce_sum(ctl, &failed, 1);
    if (st != MT_OK) {
        *broken = true;
        return mt_errorf(err, MT_ERR_BACKEND, "tensor-parallel group: %s", ctl->err.msg);
    }
    if (failed == 0.f) return MT_OK;
    if (failed != (float)ctl->size) {
        *broken = true;
        mt_error why = *err; /* err->msg is formatted into itself below */
        return mt_errorf(err, MT_ERR_BACKEND, "tensor-parallel group: a call failed on %d of %d ranks (%s)", (int)failed,
                         ctl->size, mine != MT_OK ? why.msg : "another rank's error");
    }
    return mine;
}

/* What every rank's model must share for the calls to run the same collectives: the units a
 * part's layers count (mt_model_params.layered_sites) and the rows of a pass (prefill_chunk),
 * both set by each rank's own options. Rank 0 sends its own; each rank compares, and the group
 * agrees on the outcome before any call. */
static mt_status agree_shape(mt_model *local, mt_comm *ctl, bool *broken, mt_error *err) {
    const mt_model_info info = mt_model_describe(local);
    int32_t lead[2] = { info.layered_units, info.batch_rows };
    if (mt_comm_broadcast(ctl, lead, sizeof lead, 0) != MT_OK) {
        *broken = true;
        return mt_errorf(err, MT_ERR_BACKEND, "tensor-parallel group: %s", ctl->err.msg);
    }
    mt_status mine = MT_OK;
    if (lead[0] != info.layered_units || lead[1] != info.batch_rows)
        mine = mt_errorf(err, MT_ERR_INVALID,
                         "rank %d's model runs %d layered units and passes of %d rows, rank 0's %d and %d "
                         "(--prefill-sites, --prefill-expert-parts and --prefill-pass must be the same on every rank)",
                         ctl->rank, info.layered_units, info.batch_rows, lead[0], lead[1]);
    const mt_status st = agree(ctl, mine, broken, err);
    if (st != MT_OK && mine == MT_OK)
        return mt_errorf(err, MT_ERR_INVALID, "tensor-parallel group: another rank's model differs from rank 0's in "
                                              "layered units or pass rows (--prefill-sites, --prefill-expert-parts, "
                                              "--prefill-pass)");
    return st;
}

/* ---- the leader ---- */

typedef struct tp_seq {
    mt_seq base;
    mt_seq *local;
    int id;
} tp_seq;

typedef struct tp_leader {
    mt_model base;
    mt_model *local;
    mt_comm *ctl;
    int32_t *free_ids;         /* ids of freed sequences, reused */
    int n_free, cap_free, next_id;
    bool broken;
    char *buf;                 /* payload scratch */
    size_t buf_cap;
} tp_leader;

static tp_leader *as_leader(mt_model *m) { return (tp_leader *)m; }
static const tp_leader *as_cleader(const mt_model *m) { return (const tp_leader *)m; }
static tp_seq *as_tseq(mt_seq *s) { return (tp_seq *)s; }
static const tp_seq *as_ctseq(const mt_seq *s) { return (const tp_seq *)s; }

/* Puts a call (and its payload) on the group's control communicator. */
static mt_status send_call(tp_leader *l, tp_header h, const void *payload, mt_error *err) {
    if (l->broken) return mt_errorf(err, MT_ERR_STATE, "tensor-parallel group is broken; the worker must restart");
    mt_status st = mt_comm_broadcast(l->ctl, &h, sizeof h, 0);
    if (st == MT_OK && h.payload) st = mt_comm_broadcast(l->ctl, (void *)payload, (size_t)h.payload, 0);
    if (st != MT_OK) {
        l->broken = true;
        return mt_errorf(err, MT_ERR_BACKEND, "tensor-parallel group: %s", l->ctl->err.msg);
    }
    return MT_OK;
}

/* The outcome of a call put on the group and run here (mine), agreed by every rank. */
static mt_status call(tp_leader *l, mt_status mine, mt_error *err) { return agree(l->ctl, mine, &l->broken, err); }

static void leader_destroy(mt_model *m) {
    tp_leader *l = as_leader(m);
    mt_error err = { "" };
    if (!l->broken) send_call(l, (tp_header){ .op = TP_STOP }, NULL, &err);
    mt_model_free(l->local);
    free(l->free_ids);
    free(l->buf);
    free(l);
}

static void leader_describe(const mt_model *m, mt_model_info *out) { as_cleader(m)->local->ops->describe(as_cleader(m)->local, out); }
static void leader_pool_stats(const mt_model *m, mt_pool_stats *out) { as_cleader(m)->local->ops->pool_stats(as_cleader(m)->local, out); }
static size_t leader_seq_bytes_max(const mt_model *m, int max_tokens) {
    return mt_model_seq_bytes_max(as_cleader(m)->local, max_tokens);
}

static mt_status leader_set_pools(mt_model *m, int n_pages, int n_slots, mt_error *err) {
    tp_leader *l = as_leader(m);
    tp_header h = { .op = TP_SET_POOLS, .a = n_pages, .b = n_slots };
    mt_status st = send_call(l, h, NULL, err);
    if (st != MT_OK) return st;
    return call(l, mt_model_set_pools(l->local, n_pages, n_slots, err), err);
}

static mt_status leader_ensure_pools(mt_model *m, mt_error *err) {
    tp_leader *l = as_leader(m);
    tp_header h = { .op = TP_ENSURE_POOLS };
    mt_status st = send_call(l, h, NULL, err);
    if (st != MT_OK) return st;
    return call(l, mt_model_ensure_pools(l->local, err), err);
}

static int take_id(tp_leader *l) { return l->n_free ? l->free_ids[--l->n_free] : l->next_id++; }

static void give_id(tp_leader *l, int id) {
    if (l->n_free == l->cap_free) {
        const int cap = l->cap_free ? 2 * l->cap_free : 64;
        int32_t *g = realloc(l->free_ids, sizeof *g * (size_t)cap);
        if (!g) return; /* the id is not reused */
        l->free_ids = g;
        l->cap_free = cap;
    }
    l->free_ids[l->n_free++] = id;
}

static mt_status leader_seq_new(mt_model *m, int max_tokens, mt_seq **out, mt_error *err) {
    tp_leader *l = as_leader(m);
    *out = NULL;
    tp_seq *s = calloc(1, sizeof *s);
    if (!s) return mt_errorf(err, MT_ERR_NOMEM, "out of memory for a sequence");
    s->base.model = m;
    s->id = take_id(l);
    tp_header h = { .op = TP_SEQ_NEW, .id = s->id, .a = max_tokens };
    mt_status st = send_call(l, h, NULL, err);
    if (st == MT_OK) st = call(l, mt_seq_new(l->local, max_tokens, &s->local, err), err);
    if (st != MT_OK) {
        if (s->local) { /* made here but not everywhere: the group is broken anyway */
            mt_seq_free(s->local);
        }
        give_id(l, s->id);
        free(s);
        return st;
    }
    *out = &s->base;
    return MT_OK;
}

static void leader_seq_free(mt_seq *seq) {
    tp_seq *s = as_tseq(seq);
    tp_leader *l = as_leader(seq->model);
    mt_error err = { "" };
    tp_header h = { .op = TP_SEQ_FREE, .id = s->id };
    if (send_call(l, h, NULL, &err) == MT_OK) {
        mt_seq_free(s->local);
        call(l, MT_OK, &err);
    } else {
        mt_seq_free(s->local);
    }
    give_id(l, s->id);
    free(s);
}

static mt_status leader_seq_reserve(mt_seq *seq, int n, mt_error *err) {
    tp_seq *s = as_tseq(seq);
    tp_leader *l = as_leader(seq->model);
    tp_header h = { .op = TP_SEQ_RESERVE, .id = s->id, .a = n };
    mt_status st = send_call(l, h, NULL, err);
    if (st != MT_OK) return st;
    return call(l, mt_seq_reserve(s->local, n, err), err);
}

static int leader_seq_len(const mt_seq *s) { return mt_seq_len(as_ctseq(s)->local); }
static size_t leader_seq_bytes(const mt_seq *s) { return mt_seq_bytes(as_ctseq(s)->local); }
static int leader_seq_pages(const mt_seq *s, const int32_t **pages) { return mt_seq_pages(as_ctseq(s)->local, pages); }

static mt_status leader_seq_copy_prefix(mt_model *m, const mt_seq *src, mt_seq *dst, mt_error *err) {
    tp_leader *l = as_leader(m);
    tp_header h = { .op = TP_SEQ_COPY_PREFIX, .id = as_tseq(dst)->id, .a = as_ctseq(src)->id };
    mt_status st = send_call(l, h, NULL, err);
    if (st != MT_OK) return st;
    return call(l, mt_seq_copy_prefix(l->local, as_ctseq(src)->local, as_tseq(dst)->local, err), err);
}

static mt_status leader_forward(mt_model *m, const mt_batch *b, mt_error *err) {
    tp_leader *l = as_leader(m);
    size_t tokens = 0;
    for (int i = 0; i < b->n_parts; i++) tokens += (size_t)(b->parts[i].n > 0 ? b->parts[i].n : 0);
    const size_t bytes = sizeof(tp_part) * (size_t)b->n_parts + sizeof(int32_t) * tokens;
    if (bytes > l->buf_cap) {
        char *g = realloc(l->buf, bytes);
        if (!g) return mt_errorf(err, MT_ERR_NOMEM, "out of memory for a forward's call");
        l->buf = g;
        l->buf_cap = bytes;
    }
    mt_batch_part *local = calloc((size_t)(b->n_parts > 0 ? b->n_parts : 1), sizeof *local);
    if (!local) return mt_errorf(err, MT_ERR_NOMEM, "out of memory for a forward's call");
    tp_part *tp = (tp_part *)l->buf;
    int32_t *tok = (int32_t *)(l->buf + sizeof(tp_part) * (size_t)b->n_parts);
    for (int i = 0; i < b->n_parts; i++) {
        const mt_batch_part *p = &b->parts[i];
        if (!p->seq || p->seq->model != m || p->n < 1 || !p->tokens) {
            free(local);
            return mt_errorf(err, MT_ERR_INVALID, "batch part %d: no tokens, or a sequence of another model", i);
        }
        tp[i] = (tp_part){ .kind = p->kind, .seq = as_ctseq(p->seq)->id, .n = p->n, .layers = p->layers,
                           .logits = p->logits != NULL, .all_logits = p->all_logits };
        memcpy(tok, p->tokens, sizeof(int32_t) * (size_t)p->n);
        tok += p->n;
        local[i] = *p;
        local[i].seq = as_tseq(p->seq)->local;
    }
    tp_header h = { .op = TP_FORWARD, .a = b->n_parts, .payload = (int64_t)bytes };
    mt_status st = send_call(l, h, l->buf, err);
    if (st == MT_OK) st = call(l, mt_model_forward(l->local, &(mt_batch){ local, b->n_parts }, err), err);
    free(local);
    return st;
}

static mt_status leader_decode_ahead(mt_model *m, mt_seq **seqs, const int32_t *tokens, int n, int64_t *ticket,
                                     mt_error *err) {
    tp_leader *l = as_leader(m);
    if (n < 1) return mt_errorf(err, MT_ERR_INVALID, "a greedy step of %d rows", n);
    const size_t bytes = sizeof(int32_t) * (size_t)n * (tokens ? 2 : 1);
    if (bytes > l->buf_cap) {
        char *g = realloc(l->buf, bytes);
        if (!g) return mt_errorf(err, MT_ERR_NOMEM, "out of memory for a greedy step's call");
        l->buf = g;
        l->buf_cap = bytes;
    }
    mt_seq **local = malloc(sizeof *local * (size_t)n);
    if (!local) return mt_errorf(err, MT_ERR_NOMEM, "out of memory for a greedy step's call");
    int32_t *ids = (int32_t *)l->buf;
    for (int i = 0; i < n; i++) {
        if (!seqs[i] || seqs[i]->model != m) {
            free(local);
            return mt_errorf(err, MT_ERR_INVALID, "sequence %d belongs to another model", i);
        }
        ids[i] = as_tseq(seqs[i])->id;
        local[i] = as_tseq(seqs[i])->local;
    }
    if (tokens) memcpy(ids + n, tokens, sizeof(int32_t) * (size_t)n);
    tp_header h = { .op = TP_DECODE_AHEAD, .a = n, .b = tokens == NULL, .payload = (int64_t)bytes };
    mt_status st = send_call(l, h, l->buf, err);
    if (st == MT_OK) st = call(l, mt_model_decode_ahead(l->local, local, tokens, n, ticket, err), err);
    free(local);
    return st;
}

/* Rank 0 reads the tokens of its own step: the followers' are the same and stay where they are. */
static mt_status leader_ahead_tokens(mt_model *m, int64_t ticket, int32_t *out, int n) {
    return mt_model_ahead_tokens(as_leader(m)->local, ticket, out, n);
}

static mt_status leader_draft(mt_model *m, mt_seq *seq, int32_t token, float *logits, mt_error *err) {
    tp_leader *l = as_leader(m);
    tp_header h = { .op = TP_DRAFT, .id = as_tseq(seq)->id, .a = token };
    mt_status st = send_call(l, h, NULL, err);
    if (st != MT_OK) return st;
    return call(l, mt_model_draft(l->local, as_tseq(seq)->local, token, logits, err), err);
}

static mt_status leader_seq_keep(mt_model *m, mt_seq *seq, int keep, mt_error *err) {
    tp_leader *l = as_leader(m);
    tp_header h = { .op = TP_SEQ_KEEP, .id = as_tseq(seq)->id, .a = keep };
    mt_status st = send_call(l, h, NULL, err);
    if (st != MT_OK) return st;
    return call(l, mt_seq_keep(l->local, as_tseq(seq)->local, keep, err), err);
}

static const mt_model_ops leader_ops = {
    .destroy = leader_destroy,
    .describe = leader_describe,
    .set_pools = leader_set_pools,
    .ensure_pools = leader_ensure_pools,
    .pool_stats = leader_pool_stats,
    .seq_bytes_max = leader_seq_bytes_max,
    .seq_new = leader_seq_new,
    .seq_free = leader_seq_free,
    .seq_reserve = leader_seq_reserve,
    .seq_len = leader_seq_len,
    .seq_bytes = leader_seq_bytes,
    .seq_pages = leader_seq_pages,
    .seq_copy_prefix = leader_seq_copy_prefix,
    .forward = leader_forward,
    .decode_ahead = leader_decode_ahead,
    .ahead_tokens = leader_ahead_tokens,
    .draft = leader_draft,
    .seq_keep = leader_seq_keep,
};

mt_status mt_tp_leader_new(mt_model *local, mt_comm *ctl, mt_model **out, mt_error *err) {
    *out = NULL;
    tp_leader *l = calloc(1, sizeof *l);
    if (!l) {
        mt_model_free(local);
        return mt_errorf(err, MT_ERR_NOMEM, "out of memory for the group's model");
    }
    l->base.ops = &leader_ops;
    l->local = local;
    l->ctl = ctl;
    const mt_status st = agree_shape(local, ctl, &l->broken, err);
    if (st != MT_OK) {
        mt_model_free(local);
        free(l);
        return st;
    }
    *out = &l->base;
    return MT_OK;
}

/* ---- followers ---- */

mt_status mt_tp_follow(mt_model *local, mt_comm *ctl, mt_error *err) {
    tp_table t = { 0 };
    char *payload = NULL;
    size_t cap = 0, scratch_cap = 0;
    float *scratch = NULL;
    bool broken = false;
    mt_status st = agree_shape(local, ctl, &broken, err);
    for (; st == MT_OK;) {
        tp_header h;
        if ((st = mt_comm_broadcast(ctl, &h, sizeof h, 0)) != MT_OK) {
            st = mt_errorf(err, MT_ERR_BACKEND, "tensor-parallel group: %s", ctl->err.msg);
            break;
        }
        if (h.op == TP_STOP) break;
        if (h.payload > 0 && (size_t)h.payload > cap) {
            char *g = realloc(payload, (size_t)h.payload);
            if (!g) {
                st = mt_errorf(err, MT_ERR_NOMEM, "out of memory for a call of %lld bytes", (long long)h.payload);
                break;
            }
            payload = g;
            cap = (size_t)h.payload;
        }
        if (h.payload > 0 && (st = mt_comm_broadcast(ctl, payload, (size_t)h.payload, 0)) != MT_OK) {
            st = mt_errorf(err, MT_ERR_BACKEND, "tensor-parallel group: %s", ctl->err.msg);
            break;
        }
        mt_error call_err = { "" };
        const mt_status mine = apply(local, &t, &h, payload, &scratch, &scratch_cap, &call_err);
        if (agree(ctl, mine, &broken, &call_err) != MT_OK && broken) {
            st = mt_errorf(err, MT_ERR_BACKEND, "%s", call_err.msg);
            break;
        }
    }
    for (int i = 0; i < t.cap; i++) mt_seq_free(t.v[i]);
    free(t.v);
    free(payload);
    free(scratch);
    return st;
}
