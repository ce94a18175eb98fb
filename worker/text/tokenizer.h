/* worker/text/tokenizer.h: text <-> token ids for Hugging Face `tokenizer.json` files of the kind
 * GLM models ship (byte-level BPE), with the ids and text of the `tokenizers` library.
 *
 * What a load accepts (anything else is refused with MT_ERR_UNSUPPORTED and a message naming the
 * field):
 *   - model: BPE with a vocabulary and ranked merges (either "a b" strings or ["a", "b"] pairs),
 *     ignore_merges on or off; no dropout, unk_token, byte_fallback, continuing_subword_prefix
 *     or end_of_word_suffix;
 *   - normalizer: null;
 *   - pre_tokenizer: ByteLevel (add_prefix_space false; with use_regex true it splits with GPT-2's
 *     pattern), or a Sequence of Split pieces (a regex, behavior Isolated, not inverted) ending
 *     in that ByteLevel; the regexes run with PCRE2 in UTF mode with Unicode properties (UCP),
 *     JIT-compiled when the library has a JIT, with \s read as Unicode White_Space as the
 *     library's engine (Oniguruma) reads it;
 *   - added_tokens with every option (special, single_word, lstrip, rstrip, normalized);
 *   - post_processor: null, ByteLevel, TemplateProcessing (its single-sequence form is used), or
 *     a Sequence of those;
 *   - decoder: ByteLevel;
 *   - truncation and padding: null.
 *
 * Encoding, as the library does it: added tokens are found first (leftmost, longest; those with
 * normalized false in the raw text, then those with normalized true in the pieces between them),
 * each piece between them is split by the pre-tokenizer's regexes, and each split is merged by
 * BPE over its bytes (lowest merge rank first, leftmost among equals). add_special_tokens puts the
 * post-processor's tokens around the result (GLM: `[gMASK]<sop>` before it).
 *
 * Decoding concatenates the raw bytes of each token (id_to_token below) and replaces each invalid
 * UTF-8 sequence with U+FFFD as Rust's String::from_utf8_lossy does (one per maximal invalid
 * prefix), so the text equals the library's `decode`. Ids that name no token are dropped, as
 * the library drops them.
 *
 * Ownership and threads: a tok_tokenizer is immutable after tok_load and may be used by any number
 * of threads at once for everything except encoding. Encoding needs a tok_encoder (the regex
 * match state and a cache of recent words), which one thread uses at a time; make one per
 * thread. An encoder must be freed before its tokenizer. Pointers returned by the tokenizer stay
 * valid until tok_free.
 */
#ifndef TOK_TOKENIZER_H
#define TOK_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/mt.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tok_tokenizer tok_tokenizer;
typedef struct tok_encoder tok_encoder;

/* A growable array of ids, owned by the caller. Zero-initialise it; tok_ids_free releases it. */
typedef struct tok_ids {
    int32_t *ids;
    size_t n;
    size_t cap;
} tok_ids;
void tok_ids_free(tok_ids *v); /* NULL ok; leaves v empty and reusable */

/* A growable byte string, owned by the caller, always followed by a NUL byte (not counted in n)
 * once anything was written. Zero-initialise it; tok_text_free releases it. */
typedef struct tok_text {
    char *s;
    size_t n;
    size_t cap;
} tok_text;
void tok_text_free(tok_text *t); /* NULL ok; leaves t empty and reusable */

/* Loads DIR/tokenizer.json, and when present DIR/tokenizer_config.json (eos_token, bos_token,
 * chat_template) and DIR/generation_config.json (eos_token_id: a number or a list, bos_token_id).
 * On failure *out is untouched and err names the file and field. The caller frees with tok_free. */
mt_status tok_load(const char *dir, tok_tokenizer **out, mt_error *err);
/* Loads one tokenizer.json with no configs (no eos, bos or chat template). */
mt_status tok_load_file(const char *path, tok_tokenizer **out, mt_error *err);
void tok_free(tok_tokenizer *t); /* NULL ok */

/* Encoder workspace for t: the word cache (1.2 MiB) and the regex stack as it grows (at most
 * 8 MiB). NULL on out of memory. */
tok_encoder *tok_encoder_new(const tok_tokenizer *t);
void tok_encoder_free(tok_encoder *e); /* NULL ok */

/* Appends the ids of text[0..len) to out; with add_special_tokens the post-processor's tokens go
 * around them. MT_ERR_INVALID when text is not valid UTF-8, MT_ERR_NOMEM, or MT_ERR_INVALID when
 * the regex engine gives up (its match limit). On failure out->n is as it was. */
mt_status tok_encode(tok_encoder *e, const char *text, size_t len, bool add_special_tokens,
                     tok_ids *out, mt_error *err);

/* Appends the text of ids to out (see the top for the rules); with skip_special_tokens the added
 * tokens marked special contribute nothing. Only MT_ERR_NOMEM can fail (out->n as it was). */
mt_status tok_decode(const tok_tokenizer *t, const int32_t *ids, size_t n,
                     bool skip_special_tokens, tok_text *out, mt_error *err);

/* Incremental decoding for streaming and stop strings. tok_stream_push appends to out the text that
 * the new id completes: whole UTF-8 characters only, the bytes of an unfinished character held
 * back until a later id completes it (or shows it never will: then U+FFFD, as tok_decode writes).
 * tok_stream_finish appends U+FFFD for bytes still held. For any ids, the pushes of every id and
 * then the finish write exactly tok_decode's text. The state is a plain value: copy it to fork. */
typedef struct tok_stream {
    uint8_t held[4];         /* bytes of an unfinished character, a valid prefix of one */
    uint8_t n_held;          /* 0..3 */
    bool skip_special_tokens;
} tok_stream;
void tok_stream_init(tok_stream *s, bool skip_special_tokens);
/* The state after ids[0..n) were pushed, rebuilt from their last bytes (for a caller that keeps
 * only the ids): tok_stream_resume(prev) then tok_stream_push(new) gives the text the new id adds. */
void tok_stream_resume(const tok_tokenizer *t, tok_stream *s, const int32_t *ids, size_t n,
                       bool skip_special_tokens);
/* Only MT_ERR_NOMEM can fail; then s and out->n are as they were. */
mt_status tok_stream_push(const tok_tokenizer *t, tok_stream *s, int32_t id, tok_text *out,
                          mt_error *err);
mt_status tok_stream_finish(tok_stream *s, tok_text *out, mt_error *err);

/* Ids are in [0, tok_vocab_size): the largest id of the vocabulary or the added tokens, plus one.
 * An id inside that range may still name no token (a gap). */
int32_t tok_vocab_size(const tok_tokenizer *t);
/* The raw bytes a token stands for (what decode writes for it, before the U+FFFD pass), e.g. for
 * logprobs: *len bytes, not NUL-terminated. NULL when id names no token. */
const uint8_t *tok_id_to_bytes(const tok_tokenizer *t, int32_t id, size_t *len);
/* The id of an added token's content, or else of a vocabulary entry as tokenizer.json spells it
 * (byte-level form, e.g. "Ġthe"); -1 when there is none. */
int32_t tok_token_to_id(const tok_tokenizer *t, const char *token);
/* True for the added tokens marked special (skipped by skip_special_tokens). */
bool tok_is_special(const tok_tokenizer *t, int32_t id);

/* Special ids from the configs. eos: generation_config's eos_token_id (every one, in its order),
 * then tokenizer_config's eos_token when it is not among them. -1 / 0 when absent. */
typedef struct tok_special_ids {
    int32_t bos;             /* -1: none */
    const int32_t *eos;      /* [n_eos], owned by the tokenizer */
    int n_eos;
    int32_t pad;             /* -1: none */
} tok_special_ids;
tok_special_ids tok_special(const tok_tokenizer *t);
/* tokenizer_config's chat_template (the Jinja source, unrendered), or NULL. */
const char *tok_chat_template(const tok_tokenizer *t);

#ifdef __cplusplus
}
#endif
#endif /* TOK_TOKENIZER_H */
