/* worker/text/text_out.c: see text_out.h.
 *
 * held is the decoded text not sent yet: it always ends where a stop string might still begin, so
 * after each push it is searched whole (stop strings are at most a few hundred bytes, and held
 * is at most the longest one plus the last id's text). */
#include "worker/text/text_out.h"

#include <stdlib.h>
#include <string.h>

struct txt_out {
    const tok_tokenizer *t;
    tok_stream st;
    char **stops;
    size_t *stop_len;
    size_t n_stops;
    bool include_stop;
    int matched;                 /* index of the stop string that ended the text, -1 */
    tok_text held;
};

mt_status txt_out_new(const tok_tokenizer *t, const txt_out_params *p, txt_out **out, mt_error *err) {
    *out = NULL;
    const size_t n = p ? p->n_stops : 0;
    for (size_t i = 0; i < n; i++)
        if (!p->stops[i] || !p->stops[i][0]) return mt_errorf(err, MT_ERR_INVALID, "stop string %zu is empty", i);
    txt_out *o = calloc(1, sizeof *o);
    if (!o) goto nomem;
    o->t = t;
    o->matched = -1;
    o->include_stop = p && p->include_stop;
    tok_stream_init(&o->st, p ? p->skip_special_tokens : true);
    if (n) {
        o->stops = calloc(n, sizeof *o->stops);
        o->stop_len = calloc(n, sizeof *o->stop_len);
        if (!o->stops || !o->stop_len) goto nomem;
        o->n_stops = n;
        for (size_t i = 0; i < n; i++) {
            if (!(o->stops[i] = strdup(p->stops[i]))) goto nomem;
            o->stop_len[i] = strlen(p->stops[i]);
        }
    }
    *out = o;
    return MT_OK;
nomem:
    txt_out_free(o);
    return mt_errorf(err, MT_ERR_NOMEM, "out of memory for a sequence's text");
}

void txt_out_free(txt_out *o) {
    if (!o) return;
    for (size_t i = 0; i < o->n_stops; i++) free(o->stops[i]);
    free(o->stops);
    free(o->stop_len);
    tok_text_free(&o->held);
    free(o);
}

static mt_status append(tok_text *out, const char *s, size_t n, mt_error *err) {
    if (n == 0) return MT_OK;
    if (out->n + n + 1 > out->cap) {
        size_t cap = out->cap ? out->cap : 64;
        while (cap < out->n + n + 1) cap *= 2;
        char *p = realloc(out->s, cap);
        if (!p) return mt_errorf(err, MT_ERR_NOMEM, "out of memory for a sequence's text");
        out->s = p;
        out->cap = cap;
    }
    memcpy(out->s + out->n, s, n);
    out->n += n;
    out->s[out->n] = 0;
    return MT_OK;
}

/* Removes held[0, n). */
static void drop_front(tok_text *h, size_t n) {
    memmove(h->s, h->s + n, h->n - n);
    h->n -= n;
    if (h->s) h->s[h->n] = 0;
}

/* The length of the longest tail of h that is a proper prefix of some stop string. */
static size_t stop_prefix_tail(const txt_out *o, const tok_text *h) {
    size_t best = 0;
    for (size_t i = 0; i < o->n_stops; i++) {
        const size_t L = o->stop_len[i];
        for (size_t k = (L - 1 < h->n ? L - 1 : h->n); k > best; k--)
            if (!memcmp(h->s + h->n - k, o->stops[i], k)) {
                best = k;
                break;
            }
    }
    return best;
}

/* The first occurrence of needle[0, m) in h[0, n), or NULL. */
static const char *find_bytes(const char *h, size_t n, const char *needle, size_t m) {
    for (size_t i = 0; m <= n && i <= n - m; i++)
        if (h[i] == needle[0] && !memcmp(h + i, needle, m)) return h + i;
    return NULL;
}

/* The earliest match in h (the longest stop string among those starting there): its index, and
 * its start in *at; -1 when none. */
static int find_stop(const txt_out *o, const tok_text *h, size_t *at) {
    int best = -1;
    for (size_t i = 0; i < o->n_stops; i++) {
        const char *p = find_bytes(h->s, h->n, o->stops[i], o->stop_len[i]);
        if (!p) continue;
        const size_t pos = (size_t)(p - h->s);
        if (best < 0 || pos < *at || (pos == *at && o->stop_len[i] > o->stop_len[best])) {
            best = (int)i;
            *at = pos;
        }
    }
    return best;
}

/* A character boundary at or before n in h (so what is sent stays whole characters). */
static size_t char_floor(const tok_text *h, size_t n) {
    while (n > 0 && n < h->n && ((uint8_t)h->s[n] & 0xc0) == 0x80) n--;
    return n;
}

mt_status txt_out_push(txt_out *o, int32_t id, tok_text *out, int *stop, mt_error *err) {
    *stop = -1;
    if (o->matched >= 0) return MT_OK;
    const size_t before = o->held.n;
    mt_status st = tok_stream_push(o->t, &o->st, id, &o->held, err);
    if (st != MT_OK || o->held.n == before) return st;
    size_t at = 0;
    const int i = o->n_stops ? find_stop(o, &o->held, &at) : -1;
    if (i >= 0) {
        o->matched = i;
        *stop = i;
        st = append(out, o->held.s, at + (o->include_stop ? o->stop_len[i] : 0), err);
        if (st == MT_OK) drop_front(&o->held, o->held.n);
        return st;
    }
    const size_t send = char_floor(&o->held, o->held.n - stop_prefix_tail(o, &o->held));
    st = append(out, o->held.s, send, err);
    if (st == MT_OK) drop_front(&o->held, send);
    return st;
}

mt_status txt_out_finish(txt_out *o, tok_text *out, mt_error *err) {
    if (o->matched >= 0) return MT_OK;
    mt_status st = tok_stream_finish(&o->st, &o->held, err);
    if (st != MT_OK) return st;
    size_t at = 0, n = o->held.n;
    const int i = o->n_stops ? find_stop(o, &o->held, &at) : -1; /* one may end in the final U+FFFD */
    if (i >= 0) {
        o->matched = i;
        n = at + (o->include_stop ? o->stop_len[i] : 0);
    }
    st = append(out, o->held.s, n, err);
    if (st == MT_OK) drop_front(&o->held, o->held.n);
    return st;
}

const char *txt_out_stop_string(const txt_out *o) { return o->matched >= 0 ? o->stops[o->matched] : NULL; }
