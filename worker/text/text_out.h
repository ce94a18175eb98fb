/* worker/text/text_out.h: the text of one generated sequence as it streams, with stop strings.
 *
 * Each generated id goes through txt_out_push, which appends to the caller's buffer the text that
 * may be sent now: whole UTF-8 characters only (tok_stream holds an unfinished character's bytes),
 * and never a tail that could still become a stop string (those characters wait for the next
 * id). A stop string is looked for in the text not yet sent, so a match across token boundaries is
 * found as soon as its last byte arrives; the earliest match (the longest among those starting
 * there) ends the text, just before it, or just after it with include_stop. After a match every
 * push adds nothing. txt_out_finish releases what is held at the end of a sequence that no stop
 * string ended (an unfinished character as U+FFFD, as tok_decode writes it), so the pieces of a
 * stream concatenate to the tokenizer's decode of its ids, cut at the stop string.
 *
 * Ownership: a txt_out borrows its tokenizer (which must outlive it) and copies the stop strings.
 * One thread at a time.
 */
#ifndef TXT_OUT_H
#define TXT_OUT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/mt.h"
#include "worker/text/tokenizer.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct txt_out txt_out;

typedef struct txt_out_params {
    const char *const *stops;    /* [n_stops] stop strings, each non-empty; borrowed for the call */
    size_t n_stops;
    bool include_stop;           /* the text ends after the matched stop string, not before it */
    bool skip_special_tokens;    /* special added tokens add no text */
} txt_out_params;

/* NULL params: no stop strings, special tokens skipped. MT_ERR_INVALID for an empty stop string. */
mt_status txt_out_new(const tok_tokenizer *t, const txt_out_params *p, txt_out **out, mt_error *err);
void txt_out_free(txt_out *o); /* NULL ok */

/* Appends the sendable text that id completes to out. *stop is the index of the stop string that
 * matched with this id, or -1. Only MT_ERR_NOMEM can fail. */
mt_status txt_out_push(txt_out *o, int32_t id, tok_text *out, int *stop, mt_error *err);

/* Appends what is still held (nothing after a match). A stop string that ends in the U+FFFD of
 * an unfinished last character matches here (txt_out_stop_string says so). Only MT_ERR_NOMEM can
 * fail. */
mt_status txt_out_finish(txt_out *o, tok_text *out, mt_error *err);

/* The stop string that matched, or NULL. Owned by o. */
const char *txt_out_stop_string(const txt_out *o);

#ifdef __cplusplus
}
#endif
#endif /* TXT_OUT_H */
