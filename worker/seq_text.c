/* worker/seq_text.c: see seq_text.h. A chained hash of 1024 buckets; a worker runs at most a few
 * thousand live sequences. */
#include "worker/seq_text.h"

#include <stdlib.h>
#include <string.h>

#define BUCKETS 1024

struct wkr_texts {
    const tok_tokenizer *t;
    wkr_seq_text *b[BUCKETS];
    uint64_t *stopped;           /* [n_stopped] ids queued by wkr_texts_mark_stopped */
    size_t n_stopped, cap_stopped;
};

static size_t bucket(uint64_t id) { return (size_t)(id * 0x9E3779B97F4A7C15ull >> 54) % BUCKETS; }

wkr_texts *wkr_texts_new(const tok_tokenizer *t) {
    wkr_texts *x = calloc(1, sizeof *x);
    if (x) x->t = t;
    return x;
}

static void entry_free(wkr_seq_text *s) {
    txt_out_free(s->out);
    free(s->echo);
    free(s);
}

void wkr_texts_free(wkr_texts *x) {
    if (!x) return;
    for (size_t i = 0; i < BUCKETS; i++)
        for (wkr_seq_text *s = x->b[i], *n; s; s = n) {
            n = s->next;
            entry_free(s);
        }
    free(x->stopped);
    free(x);
}

mt_status wkr_texts_add(wkr_texts *x, uint64_t id, const txt_out_params *p, bool bytes, wkr_seq_text **out,
                        mt_error *err) {
    *out = NULL;
    wkr_seq_text *s = calloc(1, sizeof *s);
    if (!s) return mt_errorf(err, MT_ERR_NOMEM, "worker: out of memory for a sequence");
    s->id = id;
    s->bytes = bytes && x->t;
    s->last_token = -1;
    if (x->t) {
        mt_status st = txt_out_new(x->t, p, &s->out, err);
        if (st != MT_OK) {
            free(s);
            return st;
        }
    }
    const size_t k = bucket(id);
    s->next = x->b[k];
    x->b[k] = s;
    *out = s;
    return MT_OK;
}

wkr_seq_text *wkr_texts_find(wkr_texts *x, uint64_t id) {
    for (wkr_seq_text *s = x->b[bucket(id)]; s; s = s->next)
        if (s->id == id) return s;
    return NULL;
}

void wkr_texts_remove(wkr_texts *x, uint64_t id) {
    for (wkr_seq_text **p = &x->b[bucket(id)]; *p; p = &(*p)->next)
        if ((*p)->id == id) {
            wkr_seq_text *s = *p;
            *p = s->next;
            entry_free(s);
            return;
        }
}

mt_status wkr_seq_text_echo(wkr_seq_text *s, const eng_sample_result *r, int n, mt_error *err) {
    if (s->n_echo + n > s->cap_echo) {
        int cap = s->cap_echo ? s->cap_echo : 64;
        while (cap < s->n_echo + n) cap *= 2;
        eng_sample_result *p = realloc(s->echo, sizeof *p * (size_t)cap);
        if (!p) return mt_errorf(err, MT_ERR_NOMEM, "worker: out of memory for prompt logprobs");
        s->echo = p;
        s->cap_echo = cap;
    }
    memcpy(s->echo + s->n_echo, r, sizeof *r * (size_t)n);
    s->n_echo += n;
    return MT_OK;
}

void wkr_texts_mark_stopped(wkr_texts *x, wkr_seq_text *s) {
    s->stopped = true;
    if (x->n_stopped == x->cap_stopped) {
        size_t cap = x->cap_stopped ? 2 * x->cap_stopped : 16;
        uint64_t *p = realloc(x->stopped, sizeof *p * cap);
        if (!p) return; /* the sequence then runs to its own end; no token of it goes out */
        x->stopped = p;
        x->cap_stopped = cap;
    }
    x->stopped[x->n_stopped++] = s->id;
}

size_t wkr_texts_take_stopped(wkr_texts *x, uint64_t *ids, size_t cap) {
    const size_t n = x->n_stopped < cap ? x->n_stopped : cap;
    memcpy(ids, x->stopped, sizeof *ids * n);
    memmove(x->stopped, x->stopped + n, sizeof *ids * (x->n_stopped - n));
    x->n_stopped -= n;
    return n;
}
