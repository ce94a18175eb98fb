/* worker/text/text_model.c: see text_model.h. */
#include "worker/text/text_model.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

struct txt_model {
    tok_tokenizer *tok;
    tok_encoder *enc;
    chat_template *chat;         /* NULL: no template, or chat_error says why not */
    char chat_error[sizeof(mt_error) + 64];
    chat_vars vars;              /* bos and eos token text for the template, in bos/eos */
    char bos[256], eos[256];
};

/* Appends s[0, n) to t. */
static mt_status append(tok_text *t, const char *s, size_t n) {
    if (t->n + n + 1 > t->cap) {
        size_t cap = t->cap ? t->cap : 64;
        while (cap < t->n + n + 1) cap *= 2;
        char *p = realloc(t->s, cap);
        if (!p) return MT_ERR_NOMEM;
        t->s = p;
        t->cap = cap;
    }
    memcpy(t->s + t->n, s, n);
    t->n += n;
    t->s[t->n] = 0;
    return MT_OK;
}

/* The text of special token id into buf (NUL-terminated); NULL when it has none or is too long. */
static const char *token_text(const tok_tokenizer *t, int32_t id, char *buf, size_t cap) {
    size_t len;
    const uint8_t *b = id >= 0 ? tok_id_to_bytes(t, id, &len) : NULL;
    if (!b || len >= cap) return NULL;
    memcpy(buf, b, len);
    buf[len] = 0;
    return buf;
}

mt_status txt_model_load(const char *dir, txt_model **out, mt_error *err) {
    *out = NULL;
    char path[4096];
    struct stat sb;
    if (snprintf(path, sizeof path, "%s/tokenizer.json", dir) >= (int)sizeof path || stat(path, &sb) != 0)
        return MT_OK; /* ids only */
    txt_model *m = calloc(1, sizeof *m);
    if (!m) return mt_errorf(err, MT_ERR_NOMEM, "out of memory for the tokenizer");
    mt_status st = tok_load(dir, &m->tok, err);
    if (st != MT_OK) goto fail;
    if (!(m->enc = tok_encoder_new(m->tok))) {
        st = mt_errorf(err, MT_ERR_NOMEM, "out of memory for the tokenizer's encoder");
        goto fail;
    }
    const tok_special_ids sp = tok_special(m->tok);
    m->vars.bos_token = token_text(m->tok, sp.bos, m->bos, sizeof m->bos);
    m->vars.eos_token = sp.n_eos > 0 ? token_text(m->tok, sp.eos[0], m->eos, sizeof m->eos) : NULL;
    const char *src = tok_chat_template(m->tok);
    if (src) {
        mt_error cerr = { "" };
        if (chat_compile(src, &m->chat, &cerr) != MT_OK) {
            snprintf(m->chat_error, sizeof m->chat_error, "the model's chat template cannot be used: %s", cerr.msg);
            mt_log(MT_LOG_WARN, "%s/tokenizer_config.json: %s; chat requests will be refused", dir, m->chat_error);
        }
    }
    *out = m;
    return MT_OK;
fail:
    txt_model_free(m);
    return st;
}

void txt_model_free(txt_model *m) {
    if (!m) return;
    chat_free(m->chat);
    tok_encoder_free(m->enc);
    tok_free(m->tok);
    free(m);
}

const tok_tokenizer *txt_model_tokenizer(const txt_model *m) { return m->tok; }
const char *txt_model_chat_error(const txt_model *m) { return m->chat_error[0] ? m->chat_error : NULL; }
bool txt_model_has_chat(const txt_model *m) { return m->chat != NULL; }

mt_status txt_model_encode(txt_model *m, const txt_prompt *p, size_t max_ids, tok_ids *ids, tok_text *rendered,
                           mt_error *err) {
    const bool chat = p->n_msgs > 0;
    const char *text = p->text;
    size_t len = p->text_len;
    tok_text own = { 0 };
    tok_text *r = rendered ? rendered : &own;
    mt_status st = MT_OK;
    if (chat) {
        if (!m->chat) {
            st = mt_errorf(err, MT_ERR_INVALID, "%s",
                           m->chat_error[0] ? m->chat_error : "the model has no chat template: send prompt_text");
            goto out;
        }
        const size_t r0 = r->n;
        st = chat_render(m->chat, p->msgs, p->n_msgs, p->add_generation_prompt,
                         p->kwargs_json && p->kwargs_json[0] ? p->kwargs_json : NULL, &m->vars, r, err);
        if (st != MT_OK) {
            if (st != MT_ERR_NOMEM) {
                mt_error why = *err; /* mt_errorf must not read what it writes */
                st = mt_errorf(err, MT_ERR_INVALID, "%s", why.msg);
            }
            goto out;
        }
        text = r->s + r0;
        len = r->n - r0;
    } else if (rendered) {
        /* the text as given */
        if (append(rendered, p->text, p->text_len) != MT_OK) {
            st = mt_errorf(err, MT_ERR_NOMEM, "out of memory");
            goto out;
        }
    }
    const bool special = p->add_special_tokens < 0 ? !chat : p->add_special_tokens != 0;
    const size_t n0 = ids->n;
    if ((st = tok_encode(m->enc, text ? text : "", len, special, ids, err)) != MT_OK) goto out;
    if (ids->n - n0 > max_ids) {
        st = mt_errorf(err, MT_ERR_INVALID, "the prompt is %zu tokens once tokenized; at most %zu fit", ids->n - n0,
                       max_ids);
        ids->n = n0;
    } else if (ids->n == n0) {
        st = mt_errorf(err, MT_ERR_INVALID, "the prompt is empty once tokenized");
    }
out:
    tok_text_free(&own);
    return st;
}
