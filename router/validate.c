/* router/validate.c: see validate.h. Scalar ranges are rows of one table; list and cross-field
 * checks follow it in the order a reader of the proto meets the fields. */
#include "router/validate.h"

#include <math.h>
#include <stdbool.h>
#include <stddef.h>
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

mt_status rtr_validate_generate(const Metrale__V1__GenerateRequest *req, const rtr_model_limits *lim,
                                mt_error *err) {
    mt_status st;
    if (!req) return mt_errorf(err, MT_ERR_INVALID, "request is missing");
    if ((st = check_request_id(req->request_id, err))) return st;

    if (req->n_prompt_token_ids == 0)
        return mt_errorf(err, MT_ERR_INVALID, "prompt_token_ids is empty: need at least one token");
    if (lim && req->n_prompt_token_ids > lim->max_context)
        return mt_errorf(err, MT_ERR_INVALID, "prompt_token_ids has %zu tokens: must be <= max_context %u",
                         req->n_prompt_token_ids, lim->max_context);
    if ((st = check_tokens("prompt_token_ids", req->prompt_token_ids, req->n_prompt_token_ids, lim, err)))
        return st;
    if (req->prompt_text && req->prompt_text[0])
        return mt_errorf(err, MT_ERR_INVALID, "prompt_text is not supported yet (no tokenizer): send prompt_token_ids");

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
    if (lim && (uint64_t)req->n_prompt_token_ids + stop->max_new_tokens > lim->max_context)
        return mt_errorf(err, MT_ERR_INVALID,
                         "prompt_token_ids (%zu) + stopping.max_new_tokens (%u) = %llu: must be <= max_context %u",
                         req->n_prompt_token_ids, stop->max_new_tokens,
                         (unsigned long long)req->n_prompt_token_ids + stop->max_new_tokens, lim->max_context);

    if (req->top_logprobs > 0 && !req->logprobs)
        return mt_errorf(err, MT_ERR_INVALID, "top_logprobs = %u needs logprobs = true", req->top_logprobs);
    return MT_OK;
}
