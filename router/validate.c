/* router/validate.c: see validate.h. Scalar ranges are rows of one table; list and cross-field
 * checks follow it in the order a reader of the proto meets the fields. */
#include "router/validate.h"

#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

/* Where a scalar lives: the request itself or one of its (optional) sub-messages. An absent
 * sub-message reads as all zeros, which is what proto3 means by it. */
typedef enum { IN_REQUEST, IN_SAMPLING, IN_STOPPING } field_owner;
typedef enum { F32, I32, U32 } field_type;

typedef struct scalar_rule {
    const char *name;  /* as the client spells it */
    field_owner owner;
    size_t offset;     /* of the field inside its owner */
    field_type type;
    double lo, hi;     /* closed range; NaN and infinities never pass */
    const char *allowed; /* the range as the message states it */
} scalar_rule;

#define SAMPLING(f) IN_SAMPLING, offsetof(Metrale__V1__SamplingParams, f)
#define STOPPING(f) IN_STOPPING, offsetof(Metrale__V1__StoppingCriteria, f)
#define REQUEST(f) IN_REQUEST, offsetof(Metrale__V1__GenerateRequest, f)
#define STR_(x) #x
#define STR(x) STR_(x) /* a limit's digits, for the "allowed" text */

static const scalar_rule SCALAR_RULES[] = {
    {"sampling.temperature", SAMPLING(temperature), F32, 0, 100, "0 (greedy) or in (0, 100]"},
    {"sampling.top_p", SAMPLING(top_p), F32, 0, 1, "0 (off) or in (0, 1]"},
    {"sampling.top_k", SAMPLING(top_k), I32, 0, INT32_MAX, "0 (off) or >= 1"},
    {"sampling.min_p", SAMPLING(min_p), F32, 0, 1, "in [0, 1] (0 = off)"},
    {"sampling.repetition_penalty", SAMPLING(repetition_penalty), F32, 0, 10, "0 (off) or in (0, 10]"},
    {"sampling.presence_penalty", SAMPLING(presence_penalty), F32, -2, 2, "in [-2, 2]"},
    {"sampling.frequency_penalty", SAMPLING(frequency_penalty), F32, -2, 2, "in [-2, 2]"},
    {"stopping.max_new_tokens", STOPPING(max_new_tokens), U32, 1, UINT32_MAX, ">= 1 (stopping is required)"},
    {"top_logprobs", REQUEST(top_logprobs), U32, 0, MT_WIRE_TOP_LOGPROBS_MAX, "<= " STR(MT_WIRE_TOP_LOGPROBS_MAX)},
};

static const void *owner_of(const Metrale__V1__GenerateRequest *req, field_owner o) {
    switch (o) {
    case IN_REQUEST: return req;
    case IN_SAMPLING: return req->sampling;
    case IN_STOPPING: return req->stopping;
    }
    return NULL;
}

static mt_status check_scalar(const Metrale__V1__GenerateRequest *req, const scalar_rule *r, mt_error *err) {
    const char *base = owner_of(req, r->owner);
    double v = 0;
    if (base) {
        const char *p = base + r->offset;
        switch (r->type) {
        case F32: { float f; memcpy(&f, p, sizeof f); v = f; break; }
        case I32: { int32_t i; memcpy(&i, p, sizeof i); v = i; break; }
        case U32: { uint32_t u; memcpy(&u, p, sizeof u); v = u; break; }
        }
    }
    if (isfinite(v) && v >= r->lo && v <= r->hi) return MT_OK;
    if (r->type == F32) return mt_errorf(err, MT_ERR_INVALID, "%s = %g: must be %s", r->name, v, r->allowed);
    return mt_errorf(err, MT_ERR_INVALID, "%s = %.0f: must be %s", r->name, v, r->allowed);
}

static mt_status check_request_id(const char *id, mt_error *err) {
    size_t n = id ? strlen(id) : 0;
    if (n == 0) return mt_errorf(err, MT_ERR_INVALID, "request_id is empty: must be 1..%d printable characters",
                                 MT_WIRE_REQUEST_ID_MAX);
    if (n > MT_WIRE_REQUEST_ID_MAX)
        return mt_errorf(err, MT_ERR_INVALID, "request_id has %zu characters: must be 1..%d", n,
                         MT_WIRE_REQUEST_ID_MAX);
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)id[i];
        if (c < 0x20 || c > 0x7e)
            return mt_errorf(err, MT_ERR_INVALID,
                             "request_id byte %zu is 0x%02x: must be printable ASCII (0x20..0x7e)", i, c);
    }
    return MT_OK;
}

/* Every id below vocab (when the model is known). */
static mt_status check_tokens(const char *name, const uint32_t *ids, size_t n, const rtr_model_limits *lim,
                              mt_error *err) {
    if (!lim) return MT_OK;
    for (size_t i = 0; i < n; i++)
        if (ids[i] >= lim->vocab_size)
            return mt_errorf(err, MT_ERR_INVALID, "%s[%zu] = %u: must be < vocab_size %u", name, i, ids[i],
                             lim->vocab_size);
    return MT_OK;
}

size_t rtr_utf8_invalid_at(const char *str, size_t len) {
    const unsigned char *s = (const unsigned char *)str;
    size_t i = 0;
    while (i < len) {
        unsigned c = s[i];
        if (c < 0x80) { i++; continue; }
        size_t n;
        unsigned lo = 0x80, hi = 0xbf; /* allowed range of the second byte */
        if (c >= 0xc2 && c <= 0xdf) n = 2;
        else if (c >= 0xe0 && c <= 0xef) {
            n = 3;
            if (c == 0xe0) lo = 0xa0;      /* no overlong forms */
            else if (c == 0xed) hi = 0x9f; /* no surrogates */
        } else if (c >= 0xf0 && c <= 0xf4) {
            n = 4;
            if (c == 0xf0) lo = 0x90;      /* no overlong forms */
            else if (c == 0xf4) hi = 0x8f; /* nothing past U+10FFFF */
        } else {
            return i;
        }
        if (len - i < n || s[i + 1] < lo || s[i + 1] > hi) return i;
        for (size_t k = 2; k < n; k++)
            if ((s[i + k] & 0xc0) != 0x80) return i;
        i += n;
    }
    return len;
}

/* A string field as UTF-8 of at most max bytes (0 = no limit) and at least min. */
static mt_status check_text(const char *name, const char *s, size_t min, size_t max, mt_error *err) {
    size_t n = s ? strlen(s) : 0;
    if (n < min) return mt_errorf(err, MT_ERR_INVALID, "%s is empty: must be %zu..%zu bytes", name, min, max);
    if (max && n > max) return mt_errorf(err, MT_ERR_INVALID, "%s has %zu bytes: at most %zu", name, n, max);
    size_t at = rtr_utf8_invalid_at(s, n);
    if (at < n)
        return mt_errorf(err, MT_ERR_INVALID, "%s is not valid UTF-8 (byte %zu is 0x%02x)", name, at,
                         (unsigned)(unsigned char)s[at]);
    return MT_OK;
}

static mt_status need_tokenizer(const char *name, const rtr_model_limits *lim, mt_error *err) {
    if (lim && !lim->has_tokenizer)
        return mt_errorf(err, MT_ERR_INVALID, "%s: the model has no tokenizer: send prompt_token_ids", name);
    return MT_OK;
}

/* Chat turns and the template's extra variables (GenerateRequest and TokenizeRequest alike). */
static mt_status check_messages(Metrale__V1__ChatMessage *const *msgs, size_t n, const char *kwargs,
                                const rtr_model_limits *lim, mt_error *err) {
    mt_status st;
    if (n > MT_WIRE_MESSAGES_MAX)
        return mt_errorf(err, MT_ERR_INVALID, "messages has %zu entries: at most %d", n, MT_WIRE_MESSAGES_MAX);
    for (size_t i = 0; i < n; i++) {
        char name[48];
        if (!msgs[i]) return mt_errorf(err, MT_ERR_INVALID, "messages[%zu] is missing", i);
        snprintf(name, sizeof name, "messages[%zu].role", i);
        if ((st = check_text(name, msgs[i]->role, 1, MT_WIRE_ROLE_BYTES_MAX, err))) return st;
        snprintf(name, sizeof name, "messages[%zu].content", i);
        if ((st = check_text(name, msgs[i]->content, 0, 0, err))) return st;
    }
    if ((st = check_text("chat_template_kwargs", kwargs, 0, MT_WIRE_KWARGS_BYTES_MAX, err))) return st;
    if ((st = need_tokenizer("messages", lim, err))) return st;
    if (lim && !lim->has_chat_template)
        return mt_errorf(err, MT_ERR_INVALID,
                         "messages: the model has no chat template: send prompt_text or prompt_token_ids");
    return MT_OK;
}

/* "a and b" of the prompt fields set, for the message when more than one is. */
static void name_set(char *out, size_t cap, const char *const *names, const bool *set, size_t n) {
    size_t k = 0, len = 0;
    out[0] = '\0';
    for (size_t i = 0; i < n; i++) {
        if (!set[i]) continue;
        int w = snprintf(out + len, cap - len, "%s%s", k ? " and " : "", names[i]);
        if (w < 0 || (size_t)w >= cap - len) return;
        len += (size_t)w;
        k++;
    }
}

static mt_status check_stop_strings(const Metrale__V1__StoppingCriteria *stop, const rtr_model_limits *lim,
                                    mt_error *err) {
    mt_status st;
    if (stop->n_stop == 0) return MT_OK;
    if (stop->n_stop > MT_WIRE_STOP_STRINGS_MAX)
        return mt_errorf(err, MT_ERR_INVALID, "stopping.stop has %zu strings: at most %d", stop->n_stop,
                         MT_WIRE_STOP_STRINGS_MAX);
    for (size_t i = 0; i < stop->n_stop; i++) {
        char name[48];
        snprintf(name, sizeof name, "stopping.stop[%zu]", i);
        if ((st = check_text(name, stop->stop[i], 1, MT_WIRE_STOP_STRING_BYTES_MAX, err))) return st;
    }
    return need_tokenizer("stopping.stop", lim, err);
}

mt_status rtr_validate_generate(const Metrale__V1__GenerateRequest *req, const rtr_model_limits *lim,
                                mt_error *err) {
    mt_status st;
    if (!req) return mt_errorf(err, MT_ERR_INVALID, "request is missing");
    if ((st = check_request_id(req->request_id, err))) return st;

    static const char *const PROMPTS[] = {"prompt_token_ids", "prompt_text", "messages"};
    const bool set[] = {req->n_prompt_token_ids > 0, req->prompt_text && req->prompt_text[0], req->n_messages > 0};
    const int nset = set[0] + set[1] + set[2];
    if (nset == 0)
        return mt_errorf(err, MT_ERR_INVALID,
                         "the prompt is empty: set one of prompt_token_ids, prompt_text and messages");
    if (nset > 1) {
        char which[64];
        name_set(which, sizeof which, PROMPTS, set, 3);
        return mt_errorf(err, MT_ERR_INVALID,
                         "%s are set: the prompt is exactly one of prompt_token_ids, prompt_text and messages",
                         which);
    }
    if (set[0]) {
        if (lim && req->n_prompt_token_ids > lim->max_context)
            return mt_errorf(err, MT_ERR_INVALID, "prompt_token_ids has %zu tokens: must be <= max_context %u",
                             req->n_prompt_token_ids, lim->max_context);
        if ((st = check_tokens("prompt_token_ids", req->prompt_token_ids, req->n_prompt_token_ids, lim, err)))
            return st;
    } else if (set[1]) {
        if ((st = check_text("prompt_text", req->prompt_text, 1, 0, err))) return st;
        if ((st = need_tokenizer("prompt_text", lim, err))) return st;
    } else {
        if ((st = check_messages(req->messages, req->n_messages, req->chat_template_kwargs, lim, err))) return st;
    }
    if (!set[2] && (st = check_text("chat_template_kwargs", req->chat_template_kwargs, 0, MT_WIRE_KWARGS_BYTES_MAX,
                                    err)))
        return st; /* unused without messages, but relayed to the worker */
    if (req->add_special_tokens && !req->has_add_special_tokens)
        return mt_errorf(err, MT_ERR_INVALID,
                         "add_special_tokens = true but has_add_special_tokens is false: set has_add_special_tokens");

    for (size_t i = 0; i < sizeof SCALAR_RULES / sizeof SCALAR_RULES[0]; i++)
        if ((st = check_scalar(req, &SCALAR_RULES[i], err))) return st;

    const Metrale__V1__SamplingParams *s = req->sampling;
    if (s && !s->has_seed && s->seed != 0)
        return mt_errorf(err, MT_ERR_INVALID, "sampling.seed = %llu but sampling.has_seed is false: set has_seed",
                         (unsigned long long)s->seed);

    const Metrale__V1__StoppingCriteria *stop = req->stopping; /* non-NULL: max_new_tokens >= 1 passed */
    if (stop->n_stop_token_ids > MT_WIRE_STOP_TOKENS_MAX)
        return mt_errorf(err, MT_ERR_INVALID, "stopping.stop_token_ids has %zu entries: at most %d",
                         stop->n_stop_token_ids, MT_WIRE_STOP_TOKENS_MAX);
    if ((st = check_tokens("stopping.stop_token_ids", stop->stop_token_ids, stop->n_stop_token_ids, lim, err)))
        return st;
    if ((st = check_stop_strings(stop, lim, err))) return st;
    /* A text prompt's length is known only once the worker has tokenized it (it checks then);
     * here it counts as at least one token. */
    if (lim && set[0] && (uint64_t)req->n_prompt_token_ids + stop->max_new_tokens > lim->max_context)
        return mt_errorf(err, MT_ERR_INVALID,
                         "prompt_token_ids (%zu) + stopping.max_new_tokens (%u) = %llu: must be <= max_context %u",
                         req->n_prompt_token_ids, stop->max_new_tokens,
                         (unsigned long long)req->n_prompt_token_ids + stop->max_new_tokens, lim->max_context);
    if (lim && !set[0] && stop->max_new_tokens >= lim->max_context)
        return mt_errorf(err, MT_ERR_INVALID,
                         "stopping.max_new_tokens = %u: must be < max_context %u (the prompt takes at least one)",
                         stop->max_new_tokens, lim->max_context);

    if (req->top_logprobs > 0 && !req->logprobs && !req->echo)
        return mt_errorf(err, MT_ERR_INVALID, "top_logprobs = %u needs logprobs = true (or echo)", req->top_logprobs);
    return MT_OK;
}

mt_status rtr_validate_tokenize(const Metrale__V1__TokenizeRequest *req, const rtr_model_limits *lim,
                                mt_error *err) {
    mt_status st;
    if (!req) return mt_errorf(err, MT_ERR_INVALID, "request is missing");
    const bool text = req->text && req->text[0], msgs = req->n_messages > 0;
    if (text == msgs)
        return mt_errorf(err, MT_ERR_INVALID, "%s: set exactly one of text and messages",
                         text ? "text and messages are both set" : "neither text nor messages is set");
    if (text) {
        if ((st = check_text("text", req->text, 1, 0, err))) return st;
        if ((st = need_tokenizer("text", lim, err))) return st;
        if ((st = check_text("chat_template_kwargs", req->chat_template_kwargs, 0, MT_WIRE_KWARGS_BYTES_MAX, err)))
            return st;
    } else if ((st = check_messages(req->messages, req->n_messages, req->chat_template_kwargs, lim, err))) {
        return st;
    }
    if (req->add_special_tokens && !req->has_add_special_tokens)
        return mt_errorf(err, MT_ERR_INVALID,
                         "add_special_tokens = true but has_add_special_tokens is false: set has_add_special_tokens");
    return MT_OK;
}
