/* worker/text/tok_encode.c: text -> ids. The stages, each feeding the pieces it leaves to the
 * next: added tokens (raw, then normalized), the pre-tokenizer's regexes, BPE over each split's
 * bytes (through the encoder's word cache). */
#include "worker/text/tokenizer_impl.h"

#include <stdlib.h>
#include <string.h>

tok_encoder *tok_encoder_new(const tok_tokenizer *t) {
    tok_encoder *e = calloc(1, sizeof *e);
    if (!e) goto fail;
    e->t = t;
    e->md = pcre2_match_data_create(1, NULL); /* only the whole match is read */
    e->mctx = pcre2_match_context_create(NULL);
    e->jit_stack = pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, NULL);
    e->cache = calloc(TOK_CACHE_SLOTS, sizeof *e->cache);
    if (!e->md || !e->mctx || !e->jit_stack || !e->cache) goto fail;
    pcre2_jit_stack_assign(e->mctx, NULL, e->jit_stack);
    return e;
fail:
    tok_encoder_free(e);
    return NULL;
}

void tok_encoder_free(tok_encoder *e) {
    if (!e) return;
    pcre2_match_data_free(e->md);
    pcre2_match_context_free(e->mctx);
    pcre2_jit_stack_free(e->jit_stack);
    free(e->cache);
    free(e->syms);
    free(e->heap);
    free(e);
}

size_t tok_utf8_check(const uint8_t *s, size_t len) {
    size_t i = 0;
    while (i < len) {
        uint8_t c = s[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        int n;
        uint8_t lo = 0x80, hi = 0xbf;
        if (c >= 0xc2 && c <= 0xdf) n = 1;
        else if (c == 0xe0) n = 2, lo = 0xa0;
        else if (c == 0xed) n = 2, hi = 0x9f;
        else if (c >= 0xe1 && c <= 0xef) n = 2;
        else if (c == 0xf0) n = 3, lo = 0x90;
        else if (c == 0xf4) n = 3, hi = 0x8f;
        else if (c >= 0xf1 && c <= 0xf3) n = 3;
        else return i;
        if (i + (size_t)n >= len) return i; /* cut short */
        if (s[i + 1] < lo || s[i + 1] > hi) return i;
        for (int k = 2; k <= n; k++)
            if ((s[i + k] & 0xc0) != 0x80) return i;
        i += (size_t)n + 1;
    }
    return len;
}

/* ---- output ------------------------------------------------------------------------------- */

static mt_status push_ids(tok_ids *out, const int32_t *ids, size_t n) {
    if (out->n + n > out->cap && tok_ids_reserve(out, out->n + n) != MT_OK) return MT_ERR_NOMEM;
    memcpy(out->ids + out->n, ids, sizeof *ids * n);
    out->n += n;
    return MT_OK;
}

static mt_status push_id(tok_ids *out, int32_t id) {
    if (out->n == out->cap && tok_ids_reserve(out, out->n + 1) != MT_OK) return MT_ERR_NOMEM;
    out->ids[out->n++] = id;
    return MT_OK;
}

/* ---- BPE over one split ------------------------------------------------------------------- */

static bool cand_less(const tok_cand *a, const tok_cand *b) {
    return a->rank != b->rank ? a->rank < b->rank : a->pos < b->pos;
}

static void heap_push(tok_cand *h, int *n, tok_cand c) {
    int i = (*n)++;
    while (i > 0) {
        int p = (i - 1) / 2;
        if (!cand_less(&c, &h[p])) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = c;
}

static tok_cand heap_pop(tok_cand *h, int *n) {
    tok_cand top = h[0], last = h[--(*n)];
    int i = 0;
    for (;;) {
        int c = 2 * i + 1;
        if (c >= *n) break;
        if (c + 1 < *n && cand_less(&h[c + 1], &h[c])) c++;
        if (!cand_less(&h[c], &last)) break;
        h[i] = h[c];
        i = c;
    }
    h[i] = last;
    return top;
}

static mt_status ensure_workspace(tok_encoder *e, size_t n) {
    if (n <= e->ws_cap) return MT_OK;
    size_t cap = e->ws_cap ? e->ws_cap : 64;
    while (cap < n) cap *= 2;
    /* Each merge pushes at most two candidates, on top of the n - 1 initial ones. */
    tok_sym *s = realloc(e->syms, sizeof *s * cap);
    if (!s) return MT_ERR_NOMEM;
    e->syms = s;
    tok_cand *h = realloc(e->heap, sizeof *h * cap * 3);
    if (!h) return MT_ERR_NOMEM;
    e->heap = h;
    e->ws_cap = cap;
    return MT_OK;
}

/* Merges w[0..n) from single bytes: the lowest-ranked adjacent pair first, the leftmost among
 * equal ranks. A heap entry stays valid while the pair at its position still merges into the
 * token it was pushed for (the library's rule, kept exactly). Returns the symbol count. */
static int bpe_merge(tok_encoder *e, const uint8_t *w, size_t n) {
    const tok_tokenizer *t = e->t;
    tok_sym *sy = e->syms;
    tok_cand *heap = e->heap;
    int ns = 0, nh = 0;
    for (size_t i = 0; i < n; i++) {
        int32_t id = t->byte_id[w[i]];
        if (id < 0) continue; /* no token for this byte and no unk: dropped, as the library does */
        sy[ns] = (tok_sym){.id = id, .prev = ns - 1, .next = -1, .len = 1};
        if (ns > 0) sy[ns - 1].next = ns;
        ns++;
    }
    for (int i = 0; i + 1 < ns; i++) {
        const tok_merge *m = tok_merge_find(t, sy[i].id, sy[i + 1].id);
        if (m) heap_push(heap, &nh, (tok_cand){.rank = m->rank, .pos = i, .id = m->id});
    }
    while (nh > 0) {
        tok_cand c = heap_pop(heap, &nh);
        tok_sym *cur = &sy[c.pos];
        if (cur->len == 0 || cur->next < 0) continue;
        tok_sym *right = &sy[cur->next];
        const tok_merge *m = tok_merge_find(t, cur->id, right->id);
        if (!m || m->id != c.id) continue;
        cur->id = c.id;
        cur->len += right->len;
        right->len = 0;
        cur->next = right->next;
        if (cur->next >= 0) sy[cur->next].prev = c.pos;
        if (cur->prev >= 0) {
            m = tok_merge_find(t, sy[cur->prev].id, cur->id);
            if (m) heap_push(heap, &nh, (tok_cand){.rank = m->rank, .pos = cur->prev, .id = m->id});
        }
        if (cur->next >= 0) {
            m = tok_merge_find(t, cur->id, sy[cur->next].id);
            if (m) heap_push(heap, &nh, (tok_cand){.rank = m->rank, .pos = c.pos, .id = m->id});
        }
    }
    return ns;
}

static uint64_t hash_word(const uint8_t *p, size_t n) {
    uint64_t h = 0x9e3779b97f4a7c15ull ^ n;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t v;
        memcpy(&v, p + i, 8);
        h = tok_hash_u64(h ^ v);
    }
    uint64_t v = 0;
    memcpy(&v, p + i, n - i);
    return tok_hash_u64(h ^ v);
}

static mt_status bpe_word(tok_encoder *e, const uint8_t *w, size_t n, tok_ids *out) {
    const tok_tokenizer *t = e->t;
    if (n == 1) return t->byte_id[w[0]] >= 0 ? push_id(out, t->byte_id[w[0]]) : MT_OK;
    if (t->ignore_merges) {
        int32_t id = tok_vocab_find(t, w, n);
        if (id >= 0) return push_id(out, id);
    }
    tok_cache_slot *slot = NULL;
    if (n <= TOK_CACHE_WORD) {
        slot = &e->cache[hash_word(w, n) & (TOK_CACHE_SLOTS - 1)];
        if (slot->len == n && memcmp(slot->word, w, n) == 0) return push_ids(out, slot->ids, slot->n_ids);
    }
    if (ensure_workspace(e, n) != MT_OK) return MT_ERR_NOMEM;
    int ns = bpe_merge(e, w, n);
    size_t first = out->n;
    for (int i = 0; i >= 0 && i < ns; i = e->syms[i].next)
        if (push_id(out, e->syms[i].id) != MT_OK) return MT_ERR_NOMEM;
    size_t got = out->n - first;
    if (slot && got <= TOK_CACHE_IDS) {
        memcpy(slot->word, w, n);
        slot->len = (uint8_t)n;
        slot->n_ids = (uint8_t)got;
        memcpy(slot->ids, out->ids + first, sizeof(int32_t) * got);
    }
    return MT_OK;
}

/* ---- the pre-tokenizer's regexes ---------------------------------------------------------- */

static mt_status regex_error(int rc, mt_error *err) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(rc, msg, sizeof msg);
    return mt_errorf(err, MT_ERR_INVALID, "pre-tokenizer regex failed on the text: %s",
                     (const char *)msg);
}

static int utf8_len(uint8_t c) { return c < 0x80 ? 1 : c < 0xe0 ? 2 : c < 0xf0 ? 3 : 4; }

/* Splits s[0..n) by regex `level` (matches and the gaps between them, each its own piece), and
 * passes each piece to the next regex, or to BPE after the last. */
static mt_status split_run(tok_encoder *e, const uint8_t *s, size_t n, int level, tok_ids *out,
                           mt_error *err) {
    const tok_tokenizer *t = e->t;
    if (n == 0) return MT_OK;
    if (level == t->n_split) {
        mt_status rc = bpe_word(e, s, n, out);
        return rc == MT_OK ? rc : mt_errorf(err, rc, "out of memory");
    }
    const pcre2_code *re = t->split[level];
    size_t pos = 0, last = 0;
    PCRE2_SIZE *ov = pcre2_get_ovector_pointer(e->md);
    while (pos <= n) {
        int rc = t->split_jit ? pcre2_jit_match(re, s, n, pos, 0, e->md, e->mctx)
                              : pcre2_match(re, s, n, pos, PCRE2_NO_UTF_CHECK, e->md, e->mctx);
        if (rc == PCRE2_ERROR_NOMATCH) break;
        if (rc < 0) return regex_error(rc, err);
        size_t ms = ov[0], me = ov[1];
        mt_status st;
        if (ms > last && (st = split_run(e, s + last, ms - last, level + 1, out, err)) != MT_OK) return st;
        if (me > ms && (st = split_run(e, s + ms, me - ms, level + 1, out, err)) != MT_OK) return st;
        last = me;
        if (me > ms) pos = me;
        else if (me < n) pos = me + (size_t)utf8_len(s[me]); /* an empty match: step one character */
        else break;
    }
    return last < n ? split_run(e, s + last, n - last, level + 1, out, err) : MT_OK;
}

/* ---- added tokens ------------------------------------------------------------------------- */

/* Unicode White_Space (Rust's \s, which the library's lstrip and rstrip strip). */
static bool is_white_space(uint32_t c) {
    return (c >= 0x09 && c <= 0x0d) || c == 0x20 || c == 0x85 || c == 0xa0 || c == 0x1680 ||
           (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 || c == 0x202f ||
           c == 0x205f || c == 0x3000;
}

static uint32_t decode_at(const uint8_t *s, int len) {
    if (len == 1) return s[0];
    uint32_t c = s[0] & (0x7f >> len);
    for (int i = 1; i < len; i++) c = (c << 6) | (s[i] & 0x3f);
    return c;
}

/* Start of the character that ends at s[end) (s valid UTF-8, end > 0). */
static size_t char_before(const uint8_t *s, size_t end) {
    size_t i = end - 1;
    while (i > 0 && (s[i] & 0xc0) == 0x80) i--;
    return i;
}

static bool is_word_char(tok_encoder *e, const uint8_t *c, size_t len) {
    int rc = pcre2_match(e->t->word_char, c, len, 0, PCRE2_NO_UTF_CHECK, e->md, NULL);
    return rc >= 0;
}

/* Where the trailing White_Space of s[0..end) begins. */
static size_t white_start(const uint8_t *s, size_t end) {
    while (end > 0) {
        size_t b = char_before(s, end);
        if (!is_white_space(decode_at(s + b, (int)(end - b)))) break;
        end = b;
    }
    return end;
}

/* The length of the leading White_Space of s[0..n). */
static size_t white_len(const uint8_t *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        int l = utf8_len(s[i]);
        if (!is_white_space(decode_at(s + i, l))) break;
        i += (size_t)l;
    }
    return i;
}

/* The leftmost, then longest, token of tr in s[from..n): its index, *start and *end; or -1. */
static int trie_find(const tok_trie *tr, const uint8_t *s, size_t from, size_t n, size_t *start,
                     size_t *end) {
    for (size_t p = from; p < n; p++) {
        if (!tr->first[s[p]]) continue;
        int node = 0, best = -1;
        for (size_t q = p; q < n; q++) {
            node = tr->next[node][s[q]];
            if (!node) break;
            if (tr->added[node] >= 0) {
                best = tr->added[node];
                *end = q + 1;
            }
        }
        if (best >= 0) {
            *start = p;
            return best;
        }
    }
    return -1;
}

static mt_status gap_next(tok_encoder *e, const uint8_t *s, size_t n, bool raw_stage, tok_ids *out,
                          mt_error *err);

/* Finds the tokens of tr in s[0..n) with the library's options (single_word, lstrip, rstrip);
 * the pieces between go on to the next stage. */
static mt_status split_added(tok_encoder *e, const tok_trie *tr, bool raw_stage, const uint8_t *s,
                             size_t n, tok_ids *out, mt_error *err) {
    const tok_tokenizer *t = e->t;
    size_t done = 0, from = 0, start = 0, stop = 0;
    int ix;
    mt_status rc;
    while ((ix = trie_find(tr, s, from, n, &start, &stop)) >= 0) {
        const tok_added *a = &t->added[ix];
        from = stop;
        if (a->single_word) {
            bool word_before = start > 0 && is_word_char(e, s + char_before(s, start),
                                                         start - char_before(s, start));
            bool word_after = stop < n && is_word_char(e, s + stop, (size_t)utf8_len(s[stop]));
            if (word_before || word_after) continue;
        }
        if (a->lstrip) {
            size_t ws = white_start(s, start);
            start = ws > done ? ws : done;
        }
        if (a->rstrip) stop += white_len(s + stop, n - stop);
        if (done < start && (rc = gap_next(e, s + done, start - done, raw_stage, out, err)) != MT_OK)
            return rc;
        if ((rc = push_id(out, a->id)) != MT_OK) return mt_errorf(err, rc, "out of memory");
        done = stop;
    }
    return done < n ? gap_next(e, s + done, n - done, raw_stage, out, err) : MT_OK;
}

static mt_status gap_next(tok_encoder *e, const uint8_t *s, size_t n, bool raw_stage, tok_ids *out,
                          mt_error *err) {
    const tok_tokenizer *t = e->t;
    if (raw_stage && t->trie_norm.n_nodes > 1)
        return split_added(e, &t->trie_norm, false, s, n, out, err);
    return split_run(e, s, n, 0, out, err);
}

mt_status tok_encode(tok_encoder *e, const char *text, size_t len, bool add_special_tokens,
                     tok_ids *out, mt_error *err) {
    const tok_tokenizer *t = e->t;
    const uint8_t *s = (const uint8_t *)text;
    size_t bad = tok_utf8_check(s, len);
    if (bad != len) return mt_errorf(err, MT_ERR_INVALID, "text is not valid UTF-8 at byte %zu", bad);
    size_t n0 = out->n;
    mt_status rc = MT_OK;
    if (add_special_tokens && t->post.n_before)
        rc = push_ids(out, t->post.ids, (size_t)t->post.n_before);
    if (rc == MT_OK) {
        rc = t->trie_raw.n_nodes > 1 ? split_added(e, &t->trie_raw, true, s, len, out, err)
                                     : gap_next(e, s, len, true, out, err);
    }
    if (rc == MT_OK && add_special_tokens && t->post.n_after)
        rc = push_ids(out, t->post.ids + t->post.n_before, (size_t)t->post.n_after);
    if (rc != MT_OK) {
        out->n = n0;
        if (rc == MT_ERR_NOMEM) mt_errorf(err, rc, "out of memory encoding %zu bytes", len);
    }
    return rc;
}
