/* worker/engine/sampler.h: picks the next token of a sequence from its logits on the host.
 *
 * Order, as in vLLM's sampler:
 *   1. repetition penalty over every token seen (prompt and generated): a positive logit is
 *      divided by the penalty, a negative one multiplied (CTRL / transformers);
 *   2. presence and frequency penalties over the generated tokens only (OpenAI):
 *      l -= presence * (count > 0) + frequency * count;
 *   3. temperature 0: greedy, the argmax of the penalised logits (ties: lowest id); else
 *   4. l /= temperature, then top-k, top-p (smallest set of most likely tokens whose probability
 *      reaches top_p; always at least one), min-p (drop tokens below min_p * p_max), and a draw
 *      from what remains with the request's RNG.
 * Log-probabilities are those of the raw model: log-softmax of the unmodified logits, before any
 * penalty, temperature or truncation (vLLM's default "raw_logprobs" mode). The sampled token's
 * logprob and the top-n alternatives (most likely first, ties by lowest id) both come from it.
 *
 * Ownership: an eng_sampler is a workspace sized for one vocabulary; one thread uses it at a time
 * (the engine thread). It keeps nothing between calls: a request's state is its eng_rng and its
 * token history, both owned by the caller.
 */
#ifndef ENG_SAMPLER_H
#define ENG_SAMPLER_H

#include <stdbool.h>
#include <stdint.h>

#include "common/mt.h"

#ifdef __cplusplus
extern "C" {
#endif

#define ENG_TOP_LOGPROBS_MAX 20

/* Sampling options of one request, already resolved from the API's "0 = off" encoding. */
typedef struct eng_sample_params {
    float temperature;         /* 0 = greedy; > 0 */
    int top_k;                 /* 0 = off; >= 1 */
    float top_p;               /* 1 = off; (0, 1] */
    float min_p;               /* 0 = off; [0, 1] */
    float repetition_penalty;  /* 1 = off; > 0 */
    float presence_penalty;    /* 0 = off */
    float frequency_penalty;   /* 0 = off */
} eng_sample_params;

/* Greedy, every filter off. */
eng_sample_params eng_sample_default_params(void);

/* MT_ERR_INVALID with a message naming the field when a value is out of range (NaN included). */
mt_status eng_sample_params_check(const eng_sample_params *p, mt_error *err);

/* xoshiro256** per request: reproducible for a given seed on every host. */
typedef struct eng_rng {
    uint64_t s[4];
} eng_rng;

void eng_rng_seed(eng_rng *r, uint64_t seed);
/* Seeds from the OS entropy source (getrandom), falling back to time and address bits. */
void eng_rng_seed_random(eng_rng *r);
uint64_t eng_rng_next(eng_rng *r);
/* Uniform in [0, 1) with 53 random bits. */
double eng_rng_uniform(eng_rng *r);

/* The tokens a request has seen: the prompt, then what it generated so far. Borrowed. */
typedef struct eng_history {
    const int32_t *prompt;
    int n_prompt;
    const int32_t *generated;
    int n_generated;
} eng_history;

typedef struct eng_sample_result {
    int32_t token;
    float logprob;                               /* raw log-softmax of token */
    int n_top;                                   /* <= the n_top asked for */
    int32_t top_ids[ENG_TOP_LOGPROBS_MAX];       /* most likely first */
    float top_logprobs[ENG_TOP_LOGPROBS_MAX];
} eng_sample_result;

typedef struct eng_sampler eng_sampler;

/* A workspace for vocabularies of `vocab` ids. NULL on out of memory or vocab < 1. */
eng_sampler *eng_sampler_new(int vocab);
void eng_sampler_free(eng_sampler *s); /* NULL ok */

/* Samples one token from logits[vocab] (host, not modified). hist may be NULL (no history);
 * token ids in it outside [0, vocab) are ignored. rng is advanced only when a draw happens
 * (temperature > 0). n_top is clamped to [0, ENG_TOP_LOGPROBS_MAX]; logprobs are computed only
 * when want_logprob or n_top > 0 (else out->logprob is 0). p must pass eng_sample_params_check. */
void eng_sample(eng_sampler *s, const eng_sample_params *p, eng_rng *rng, const float *logits,
                const eng_history *hist, bool want_logprob, int n_top, eng_sample_result *out);

/* The raw log-softmax of token under logits[vocab] (host, not modified) and the n_top most likely
 * ids, as eng_sample reports them, without sampling: out->token = token. For prompt logprobs. */
void eng_score(const eng_sampler *s, const float *logits, int32_t token, int n_top, eng_sample_result *out);

/* The greedy token of logits[vocab]: the largest, the lowest id on ties. */
int32_t eng_argmax(const float *logits, int vocab);

/* ---- speculative sampling ----
 * The processed distribution eng_sample draws from (penalties, temperature, top-k, top-p, min-p)
 * as probabilities probs[vocab] (zero outside what is kept; greedy: one-hot on the argmax). */
void eng_sample_probs(eng_sampler *s, const eng_sample_params *p, const float *logits, const eng_history *hist,
                      float *probs);
/* A draw from probs[vocab] (non-negative, any sum > 0) with rng. */
int32_t eng_draw_probs(eng_rng *rng, const float *probs, int vocab);
/* Speculative sampling's verdict on a draft token drawn from q: kept with probability
 * min(1, p[draft] / q[draft]) (*accepted true, returns draft); else a draw from the normalised
 * residual max(0, p - q) (from p where that is all zero). The token that comes out is distributed
 * exactly as p, whatever q is. p, q: [vocab] probabilities. */
int32_t eng_spec_verdict(eng_rng *rng, const float *p, const float *q, int vocab, int32_t draft, bool *accepted);

#ifdef __cplusplus
}
#endif
#endif /* ENG_SAMPLER_H */
