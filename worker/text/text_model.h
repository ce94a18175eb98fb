/* worker/text/text_model.h: the text side of a served model: its tokenizer, its chat template and
 * its eos ids, read from the model folder, and the prompts of text and chat requests.
 *
 * A folder without tokenizer.json serves token ids only (txt_model_load gives NULL, no error). A
 * chat template that does not compile does not stop the worker: the reason is logged at load and
 * every chat request is refused with it, so no request ever gets text from a template rendered
 * wrong.
 *
 * Ownership and threads: a txt_model owns its tokenizer, template and one encoder, and belongs to
 * one thread (the worker's engine thread).
 */
#ifndef TXT_MODEL_H
#define TXT_MODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/mt.h"
#include "worker/text/chat_template.h"
#include "worker/text/tokenizer.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct txt_model txt_model;

/* Loads DIR/tokenizer.json with tokenizer_config.json and generation_config.json. *out NULL and
 * MT_OK when DIR has no tokenizer.json (or is not a folder: random:PRESET models). A tokenizer that
 * cannot be loaded is an error naming the file. */
mt_status txt_model_load(const char *dir, txt_model **out, mt_error *err);
void txt_model_free(txt_model *m); /* NULL ok */

const tok_tokenizer *txt_model_tokenizer(const txt_model *m);
/* NULL when the chat template compiled (or is absent: then txt_model_has_chat is false), else why
 * chat requests are refused. */
const char *txt_model_chat_error(const txt_model *m);
bool txt_model_has_chat(const txt_model *m);

/* A prompt given as text or as chat turns (exactly one of text and n_msgs > 0). */
typedef struct txt_prompt {
    const char *text;            /* UTF-8 */
    size_t text_len;
    const chat_message *msgs;
    size_t n_msgs;
    const char *kwargs_json;     /* chat_template_kwargs, a JSON object, or NULL / "" */
    bool add_generation_prompt;  /* chat: end with the template's generation prompt */
    int add_special_tokens;      /* 1 / 0, or -1: the default (text 1, chat 0) */
} txt_prompt;

/* The ids of p, appended to ids (at most max_ids of them, else MT_ERR_INVALID saying how many);
 * rendered (may be NULL) receives the text that was encoded (the chat template's output).
 * MT_ERR_INVALID with the reason for text that is not UTF-8, a template that fails or cannot be
 * used, bad kwargs; MT_ERR_NOMEM. */
mt_status txt_model_encode(txt_model *m, const txt_prompt *p, size_t max_ids, tok_ids *ids, tok_text *rendered,
                           mt_error *err);

#ifdef __cplusplus
}
#endif
#endif /* TXT_MODEL_H */
