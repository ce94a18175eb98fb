/* router/validate.h: checks every field of a metrale.v1.GenerateRequest before admission.
 *
 * The checks are a table (validate.c): each row names the field as the client spells it
 * ("sampling.top_p") and the allowed range, so the message a client gets says which field is wrong,
 * what was sent and what is allowed. The ranges are those documented in proto/metrale/v1/metrale.proto;
 * the size limits (request_id, top_logprobs, stop_token_ids, stop strings, messages, roles,
 * chat_template_kwargs) are common/wire_limits.h's.
 *
 * Text (prompt_text, message roles and contents, chat_template_kwargs, stop strings) must be
 * valid UTF-8: protobuf-c does not check it. The worker checks what only it can: a text prompt's
 * length once tokenized, and whether chat_template_kwargs is a JSON object the template accepts.
 *
 * Pure functions: no allocation, no global state; any thread.
 */
#ifndef RTR_VALIDATE_H
#define RTR_VALIDATE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/mt.h"
#include "common/wire_limits.h"
#include "proto/metrale/v1/metrale.pb-c.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The served model's limits, from the workers' Hello (see workers.h). */
typedef struct rtr_model_limits {
    uint32_t vocab_size;  /* token ids must be < vocab_size */
    uint32_t max_context; /* prompt + max_new_tokens <= max_context */
    bool has_tokenizer;   /* prompt_text, messages, stop strings and Tokenize are served */
    bool has_chat_template; /* messages are served */
} rtr_model_limits;

/* Checks req. lim may be NULL (no worker has said Hello yet): then only the checks that do not
 * depend on the model run. Returns MT_OK, or MT_ERR_INVALID with a one-line message in err that
 * names the first bad field, e.g. "sampling.top_p = 1.5: must be 0 (off) or in (0, 1]". */
mt_status rtr_validate_generate(const Metrale__V1__GenerateRequest *req, const rtr_model_limits *lim,
                                mt_error *err);

/* Checks a TokenizeRequest the same way: exactly one of text and messages, the same limits, and
 * a model with a tokenizer (and a chat template for messages) when lim is known. */
mt_status rtr_validate_tokenize(const Metrale__V1__TokenizeRequest *req, const rtr_model_limits *lim,
                                mt_error *err);

/* The offset of the first byte of s[0..len) that does not start a valid UTF-8 character (strict:
 * no overlong forms, no surrogates, nothing past U+10FFFF, no truncated sequence), or len when
 * all of it is valid. */
size_t rtr_utf8_invalid_at(const char *s, size_t len);

#ifdef __cplusplus
}
#endif
#endif /* RTR_VALIDATE_H */
