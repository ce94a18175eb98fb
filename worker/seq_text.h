/* worker/seq_text.h: the text side of the worker's live sequences, keyed by sequence id: each
 * one's streamed text and stop strings (worker/text/text_out.h), whether its logprobs carry token
 * bytes, its prompt logprobs until the first token goes out, and how it ended when a stop string
 * ended it. worker/loop.c adds an entry at Submit and removes it at Finished.
 *
 * Ownership and threads: the table owns its entries; it borrows the tokenizer (NULL: a model that
 * serves ids only, and no entry has text). One thread (the engine thread).
 */
#ifndef WKR_SEQ_TEXT_H
#define WKR_SEQ_TEXT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/mt.h"
#include "worker/engine/sampler.h"
#include "worker/text/text_out.h"
#include "worker/text/tokenizer.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct wkr_seq_text {
    uint64_t id;
    txt_out *out;                /* NULL without a tokenizer */
    bool bytes;                  /* logprobs or echo: tokens carry their bytes */
    bool stopped;                /* a stop string matched: no more tokens go out */
    int n_sent;                  /* tokens sent */
    int32_t last_token;          /* -1 before the first */
    eng_sample_result *echo;     /* [n_echo] prompt logprobs not sent yet */
    int n_echo, cap_echo;
    struct wkr_seq_text *next;   /* the table's chain */
} wkr_seq_text;

typedef struct wkr_texts wkr_texts;

wkr_texts *wkr_texts_new(const tok_tokenizer *t); /* NULL on out of memory; t may be NULL */
void wkr_texts_free(wkr_texts *x);                /* NULL ok */

/* A new entry for id (replacing none: the caller checks find first). p: the stop strings and
 * options of the text (ignored without a tokenizer). MT_ERR_INVALID for a bad stop string. */
mt_status wkr_texts_add(wkr_texts *x, uint64_t id, const txt_out_params *p, bool bytes, wkr_seq_text **out,
                        mt_error *err);
wkr_seq_text *wkr_texts_find(wkr_texts *x, uint64_t id);
void wkr_texts_remove(wkr_texts *x, uint64_t id); /* no entry: nothing */

/* Keeps n prompt logprobs for the first Tokens. MT_ERR_NOMEM. */
mt_status wkr_seq_text_echo(wkr_seq_text *s, const eng_sample_result *r, int n, mt_error *err);

/* Ids of entries whose stop string matched and that the engine has not ended yet, for the loop
 * to end after the step: written to ids (at most cap), their count returned; each is reported once. */
size_t wkr_texts_take_stopped(wkr_texts *x, uint64_t *ids, size_t cap);
/* Marks s as stopped by a stop string and queues it for wkr_texts_take_stopped. */
void wkr_texts_mark_stopped(wkr_texts *x, wkr_seq_text *s);

#ifdef __cplusplus
}
#endif
#endif /* WKR_SEQ_TEXT_H */
