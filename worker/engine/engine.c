/* worker/engine/engine.c: the continuous-batching scheduler (see engine.h). Waiting and running
 * sequences live in two arrays kept in arrival order; each sequence is one allocation (its arena:
 * the struct, its prompt-then-generated token history and its stop ids), freed at once. */
#include "worker/engine/engine.h"

#include "worker/engine/sched.h"
#include "worker/runtime/prefix_cache.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct eng_seq {
    uint64_t id;
    uint64_t deadline_ms;        /* 0 = none */
    eng_request req;             /* prompt and stop_ids point into this arena */
    eng_rng rng;
    mt_seq *gs;                 /* model state; NULL while waiting */
    int32_t *tokens;             /* [n_prompt + max_new_tokens]: prompt, then generated */
    int n_gen;
    int prefilled;               /* tokens fed so far; < n_feed while its prefill is spread over
                                  * steps (then it is in running but not decoded) */
    int n_feed;                  /* tokens its prefill feeds: the prompt, or after a preemption
                                  * the prompt and every generated token but the pending one */
    size_t charged;              /* cache_bytes charged at admission (worst case of its length) */
    int snap_at;                 /* prompt position to keep as a prefix snapshot, 0 = none */
    int32_t pending;             /* last sampled token, fed by the next decode */
    int echo_next;               /* prompt_logprobs: the next prompt position to report */
    int k_step;                  /* drafts this step verifies (speculative decoding), 0: none */
    int32_t spec_tok[ENG_SPEC_MAX + 1], spec_top[ENG_SPEC_MAX + 1]; /* its verify's rows, greedy tokens */
    int kept_rows;               /* the verify's rows it keeps (spec_accept, then spec_keep); 0: none */
    int drafted, accepted;       /* draft tokens proposed for it, and accepted */
    int verified;                /* its speculative steps */
    bool done;                   /* ended; removed from its array at the next compaction */
    mt_status st;                /* of the last model call on it */
    mt_error err;
} eng_seq;

/* A chunk of a sequence's prefill: k tokens from s->prefilled; echo: with prompt logprobs; last: it
 * completes the prompt; resumed: after a preemption (its pending token is already sampled). */
struct eng_chunk {
    eng_seq *s;
    int k;
    bool echo, last, resumed;
};

struct eng_engine {
    mt_model *m;
    mt_model_info info;          /* the model, as described at eng_new */
    eng_params p;
    eng_callbacks cb;
    int vocab, eos;
    eng_sampler *sampler;
    eng_seq **waiting;           /* [max_waiting + max_sequences], FIFO (preempted ones at the head) */
    int n_waiting;
    eng_seq **running;           /* [max_sequences] */
    int n_running;
    eng_seq **batch;             /* [max_sequences] scratch: the sequences of one decode */
    mt_seq **gs;                /* [max_sequences] scratch: a decode's model sequences (batch_inputs) */
    mt_batch_part *parts;        /* [max_sequences] scratch: a decode's plan (decode_parts) */
    int32_t *tok;                /* [max_sequences] scratch: their tokens in, or a ticket's out */
    float *logits;               /* [max_sequences, vocab] host */
    float *echo_logits;          /* [ENG_ECHO_CHUNK, vocab] host, made at the first echo prefill */
    /* The step's prompt chunks, run in one model call (with mixed_steps, beside its decode rows). */
    struct eng_chunk *chunks;    /* [max_sequences] */
    int n_chunks;
    float *chunk_logits;         /* [max_sequences, vocab] host: each completing prompt's last row */
    /* Layered prefill (prefill_layers): the chunks above are in flight across steps, having run
     * lp_done of the model's layered units (layers, or sites); no other chunk is planned until
     * they complete. */
    bool lp_active;
    int lp_done;
    uint64_t layered_steps;
    /* A greedy step queued and not yet read (run_ahead; mt_model_decode_ahead): its rows' sequences in
     * order, a row NULL once its sequence is freed (compact), and the ticket of its tokens. */
    eng_seq **ahead;             /* [max_sequences] */
    int n_ahead;                 /* 0: none in flight */
    int64_t ahead_ticket;
    bool ahead_on;               /* run_ahead resolved for this model's backend */
    uint64_t ahead_steps;
    uint64_t mixed_steps;        /* mixed_step calls that ran decode rows and chunks together */
    uint64_t spec_mixed_steps;   /* mixed_step calls whose verifies rode with decode rows or chunks */
    uint64_t held_steps;         /* steps that held their prompt work back (prefill_hold_ms) */
    bool holding;                /* this step holds its prompt work back */
    bool hold_on;                /* a hold has begun and its prompt work has not run since */
    uint64_t hold_since;         /* now_ms when it began */
    sched_pace pace;             /* measured step times (itl_target_ms) */
    int step_rows;               /* decode and verify rows of the step under way */
    int pass_rows;               /* of those, the rows in the model call of the step's chunks */
    uint64_t prefill_tokens;     /* prompt tokens run through the model */
    int step_prompt;             /* prompt tokens the step under way took */
    float *draft_logits;         /* [spec_group, vocab] host: the drafter's logits (spec_tokens > 0) */
    bool draft_rows;             /* the model drafts many sequences in one call (until it says not) */
    int spec_group;              /* sequences verified in one model call (the model's verify_seqs) */
    eng_seq **spec_batch;        /* [max_sequences] the step's speculating sequences */
    float *spec_q;               /* [spec_group, ENG_SPEC_MAX, vocab] the drafts' processed distributions */
    float *spec_p;               /* [vocab] a verify row's processed distribution */
    float *spec_logits;          /* [spec_group, ENG_SPEC_MAX + 1, vocab] the verifies' logits */
    uint64_t spec_steps, drafted, accepted;
    rt_prefix_cache prefixes;    /* kept prompt prefixes, clocked by steps */
    size_t cache_bytes;
    uint64_t finished, aborted, tokens, steps, preemptions;
    uint8_t *page_marks;         /* [n_page_marks] eng_prefix_pages' scratch: pages seen */
    int n_page_marks;
};

static void ahead_collect(eng_engine *e);

/* A sequence about to end at its deadline first gets the token of the step in flight (computed
 * before the deadline passed), as it would have had without running ahead. An abort drops that
 * row instead: nobody waits for the token, and the abort should not wait for the device. */
static void ahead_settle(eng_engine *e, const eng_seq *s) {
    for (int i = 0; i < e->n_ahead; i++)
        if (e->ahead[i] == s) {
            ahead_collect(e);
            return;
        }
}

eng_request eng_default_request(void) {
    return (eng_request){ .sampling = eng_sample_default_params(), .max_new_tokens = 16 };
}

eng_params eng_default_params(void) {
    return (eng_params){ .max_sequences = 16, .max_waiting = 1024, .max_context = 4096,
                         .prefill_budget = 2048, .mixed_steps = false, .prefix_cache_bytes = (size_t)256 << 20,
                         .prefix_block = 64, .preempt = true, .run_ahead = ENG_RUN_AHEAD_AUTO };
}

static uint64_t realtime_ms(void *user) {
    (void)user;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

mt_status eng_new(mt_model *m, const eng_params *params, const eng_callbacks *cb, eng_engine **out,
                  mt_error *err) {
    *out = NULL;
    eng_params p = params ? *params : eng_default_params();
    if (p.prefix_block < 1) p.prefix_block = 64;
    if (p.max_sequences < 1 || p.max_waiting < 0 || p.max_context < 2 || p.prefill_budget < 0)
        return mt_errorf(err, MT_ERR_INVALID,
                         "engine params: max_sequences %d (>= 1), max_waiting %d (>= 0), max_context %d "
                         "(>= 2), prefill_budget %d (>= 0)",
                         p.max_sequences, p.max_waiting, p.max_context, p.prefill_budget);
    if (!(p.itl_target_ms >= 0))
        return mt_errorf(err, MT_ERR_INVALID, "engine params: itl_target_ms %g (>= 0)", p.itl_target_ms);
    if (!(p.prefill_hold_ms >= 0))
        return mt_errorf(err, MT_ERR_INVALID, "engine params: prefill_hold_ms %g (>= 0)", p.prefill_hold_ms);
    if (!p.now_ms) p.now_ms = realtime_ms;
    if (p.spec_tokens < 0 || p.spec_tokens > ENG_SPEC_MAX || p.spec_max_batch < 0)
        return mt_errorf(err, MT_ERR_INVALID, "engine params: spec_tokens %d (0 .. %d), spec_max_batch %d (>= 0)",
                         p.spec_tokens, ENG_SPEC_MAX, p.spec_max_batch);
    if (p.spec_tokens > 0 && !(mt_model_describe(m).has_drafter && mt_model_describe(m).rollback)) {
        mt_log(MT_LOG_WARN, "engine: speculative decoding is off: the model has no drafter");
        p.spec_tokens = 0;
    }
    mt_status pst = mt_model_ensure_pools(m, err); /* admission counts free slots and pages */
    if (pst != MT_OK) return pst;
    eng_engine *e = calloc(1, sizeof *e);
    if (!e) goto fail;
    e->m = m;
    e->info = mt_model_describe(m);
    e->draft_rows = true;
    e->spec_group = e->info.verify_seqs < 1 ? 1 : e->info.verify_seqs > ENG_SPEC_GROUP_MAX ? ENG_SPEC_GROUP_MAX
                                                                                          : e->info.verify_seqs;
    rt_prefix_cache_init(&e->prefixes, m, p.prefix_cache_bytes);
    e->p = p;
    sched_pace_init(&e->pace);
    e->ahead_on = p.run_ahead == ENG_RUN_AHEAD_ALWAYS || (p.run_ahead == ENG_RUN_AHEAD_AUTO && e->info.backend_queues);
    if (cb) e->cb = *cb;
    e->vocab = e->info.vocab_size;
    e->eos = e->info.eos_token_id;
    e->sampler = eng_sampler_new(e->vocab);
    /* room for the preempted running sequences too, which go back to the head of the queue */
    e->waiting = malloc(sizeof(eng_seq *) * (size_t)(p.max_waiting + p.max_sequences + 1));
    e->running = malloc(sizeof(eng_seq *) * (size_t)p.max_sequences);
    e->batch = malloc(sizeof(eng_seq *) * (size_t)p.max_sequences);
    e->logits = malloc(sizeof(float) * (size_t)p.max_sequences * (size_t)e->vocab);
    e->ahead = malloc(sizeof(eng_seq *) * (size_t)p.max_sequences);
    e->tok = malloc(sizeof(int32_t) * (size_t)p.max_sequences);
    e->gs = malloc(sizeof(mt_seq *) * (size_t)p.max_sequences);
    e->parts = malloc(sizeof(mt_batch_part) * (size_t)p.max_sequences);
    if (!(e->chunks = malloc(sizeof *e->chunks * (size_t)p.max_sequences)) ||
        !(e->spec_batch = malloc(sizeof(eng_seq *) * (size_t)p.max_sequences)) ||
        !(e->chunk_logits = malloc(sizeof(float) * (size_t)p.max_sequences * (size_t)e->vocab)))
        goto fail;
    if (p.spec_tokens > 0 &&
        (!(e->draft_logits = malloc(sizeof(float) * (size_t)e->spec_group * e->vocab)) ||
         !(e->spec_q = malloc(sizeof(float) * (size_t)e->spec_group * ENG_SPEC_MAX * e->vocab)) ||
         !(e->spec_p = malloc(sizeof(float) * (size_t)e->vocab)) ||
         !(e->spec_logits = malloc(sizeof(float) * (size_t)e->spec_group * (ENG_SPEC_MAX + 1) * e->vocab))))
        goto fail;
    if (!e->sampler || !e->waiting || !e->running || !e->batch || !e->logits || !e->ahead || !e->tok || !e->gs || !e->parts)
        goto fail;
    *out = e;
    return MT_OK;
fail:
    eng_free(e);
    return mt_errorf(err, MT_ERR_NOMEM, "out of memory for an engine of %d sequences", p.max_sequences);
}

/* Gives s's model state back to the pools (and its charge back to the budget). */
static void seq_release(eng_engine *e, eng_seq *s) {
    if (!s->gs) return;
    e->cache_bytes -= s->charged;
    s->charged = 0;
    mt_seq_free(s->gs);
    s->gs = NULL;
}

static void seq_destroy(eng_engine *e, eng_seq *s) {
    seq_release(e, s);
    free(s);
}

void eng_free(eng_engine *e) {
    if (!e) return;
    rt_prefix_cache_release(&e->prefixes);
    for (int i = 0; i < e->n_waiting; i++) seq_destroy(e, e->waiting[i]);
    for (int i = 0; i < e->n_running; i++) seq_destroy(e, e->running[i]);
    eng_sampler_free(e->sampler);
    free(e->waiting);
    free(e->running);
    free(e->batch);
    free(e->logits);
    free(e->echo_logits);
    free(e->chunks);
    free(e->chunk_logits);
    free(e->ahead);
    free(e->tok);
    free(e->gs);
    free(e->parts);
    free(e->draft_logits);
    free(e->spec_q);
    free(e->spec_p);
    free(e->spec_logits);
    free(e->spec_batch);
    free(e->page_marks);
    free(e);
}

/* ---- submission ---- */

static mt_status check_request(const eng_engine *e, const eng_request *r, mt_error *err) {
    if (!r->prompt || r->n_prompt < 1) return mt_errorf(err, MT_ERR_INVALID, "prompt is empty");
    if (r->max_new_tokens < 1)
        return mt_errorf(err, MT_ERR_INVALID, "max_new_tokens must be >= 1, got %d", r->max_new_tokens);
    if ((int64_t)r->n_prompt + r->max_new_tokens > e->p.max_context)
        return mt_errorf(err, MT_ERR_INVALID, "prompt (%d) + max_new_tokens (%d) exceeds the context limit %d",
                         r->n_prompt, r->max_new_tokens, e->p.max_context);
    for (int i = 0; i < r->n_prompt; i++)
        if (r->prompt[i] < 0 || r->prompt[i] >= e->vocab)
            return mt_errorf(err, MT_ERR_INVALID, "prompt token %d at index %d is outside the vocabulary [0, %d)",
                             r->prompt[i], i, e->vocab);
    if (r->n_stop < 0 || (r->n_stop > 0 && !r->stop_ids))
        return mt_errorf(err, MT_ERR_INVALID, "stop_token_ids: bad count %d", r->n_stop);
    for (int i = 0; i < r->n_stop; i++)
        if (r->stop_ids[i] < 0 || r->stop_ids[i] >= e->vocab)
            return mt_errorf(err, MT_ERR_INVALID, "stop token %d at index %d is outside the vocabulary [0, %d)",
                             r->stop_ids[i], i, e->vocab);
    if (r->top_logprobs < 0 || r->top_logprobs > ENG_TOP_LOGPROBS_MAX)
        return mt_errorf(err, MT_ERR_INVALID, "top_logprobs must be in [0, %d], got %d", ENG_TOP_LOGPROBS_MAX,
                         r->top_logprobs);
    const int len = r->n_prompt + r->max_new_tokens, page = e->info.page_tokens;
    const int pages_total = mt_model_pool_stats(e->m).pages_total;
    if (e->info.page_bytes > 0 && pages_total > 0 && (len + page - 1) / page > pages_total - 1)
        return mt_errorf(err, MT_ERR_FULL, "a sequence of %d tokens needs %d cache pages, more than the %d there are",
                         len, (len + page - 1) / page, pages_total - 1);
    const size_t need = mt_model_seq_bytes_max(e->m, r->n_prompt + r->max_new_tokens);
    if (e->p.cache_budget_bytes && need > e->p.cache_budget_bytes)
        return mt_errorf(err, MT_ERR_FULL, "a sequence of %d tokens needs %zu bytes of state, over the cache budget of %zu",
                         r->n_prompt + r->max_new_tokens, need, e->p.cache_budget_bytes);
    return eng_sample_params_check(&r->sampling, err);
}

static eng_seq *find_live(const eng_engine *e, uint64_t id, bool *waiting, int *index) {
    for (int i = 0; i < e->n_waiting; i++)
        if (!e->waiting[i]->done && e->waiting[i]->id == id) {
            *waiting = true;
            *index = i;
            return e->waiting[i];
        }
    for (int i = 0; i < e->n_running; i++)
        if (!e->running[i]->done && e->running[i]->id == id) {
            *waiting = false;
            *index = i;
            return e->running[i];
        }
    return NULL;
}

mt_status eng_submit(eng_engine *e, uint64_t id, const eng_request *req, uint64_t deadline_unix_ms,
                     mt_error *err) {
    mt_status st = check_request(e, req, err);
    if (st != MT_OK) return st;
    bool w;
    int at;
    if (find_live(e, id, &w, &at)) return mt_errorf(err, MT_ERR_INVALID, "sequence id %llu is already live",
                                                    (unsigned long long)id);
    if (e->n_waiting >= e->p.max_waiting)
        return mt_errorf(err, MT_ERR_FULL, "waiting queue is full (%d sequences)", e->p.max_waiting);
    const size_t n_tok = (size_t)req->n_prompt + (size_t)req->max_new_tokens;
    eng_seq *s = calloc(1, sizeof *s + sizeof(int32_t) * (n_tok + (size_t)req->n_stop));
    if (!s) return mt_errorf(err, MT_ERR_NOMEM, "out of memory for a sequence of %zu tokens", n_tok);
    s->id = id;
    s->deadline_ms = deadline_unix_ms;
    s->req = *req;
    s->tokens = (int32_t *)(s + 1);
    memcpy(s->tokens, req->prompt, sizeof(int32_t) * (size_t)req->n_prompt);
    s->req.prompt = s->tokens;
    s->n_feed = req->n_prompt;
    s->echo_next = 1;
    int32_t *stop = s->tokens + n_tok;
    if (req->n_stop) memcpy(stop, req->stop_ids, sizeof(int32_t) * (size_t)req->n_stop);
    s->req.stop_ids = req->n_stop ? stop : NULL;
    if (req->has_seed) eng_rng_seed(&s->rng, req->seed);
    else eng_rng_seed_random(&s->rng);
    e->waiting[e->n_waiting++] = s;
    return MT_OK;
}

/* ---- ending sequences ---- */

/* s leaves the layered chunks in flight (it ended or gave its state back); the model drops it
 * from its group when its sequence is freed. */
static void lp_drop(eng_engine *e, const eng_seq *s) {
    if (!e->lp_active) return;
    int k = 0;
    for (int j = 0; j < e->n_chunks; j++)
        if (e->chunks[j].s != s) e->chunks[k++] = e->chunks[j];
    e->n_chunks = k;
    e->lp_active = k > 0;
}

/* Frees the model state, counts, reports. The struct stays until compaction (or the caller frees). */
static void seq_end(eng_engine *e, eng_seq *s, eng_finish reason, const char *message) {
    MT_ASSERT(!s->done);
    lp_drop(e, s);
    s->done = true;
    seq_release(e, s);
    if (reason == ENG_FINISH_LENGTH || reason == ENG_FINISH_STOP) e->finished++;
    else e->aborted++;
    if (e->cb.on_finished) {
        eng_finish_info fin = { .reason = reason, .prompt_tokens = s->req.n_prompt,
                                .completion_tokens = s->n_gen, .message = message ? message : "",
                                .draft_tokens = s->drafted, .accepted_tokens = s->accepted,
                                .verify_steps = s->verified };
        e->cb.on_finished(e->cb.user, s->id, &fin);
    }
}

/* Drops ended sequences from arr[0, *n), keeping the order of the rest (and a queued step's row
 * of a dropped one: its token goes nowhere). */
static void compact(eng_engine *e, eng_seq **arr, int *n) {
    int k = 0;
    for (int i = 0; i < *n; i++) {
        if (!arr[i]->done) {
            arr[k++] = arr[i];
            continue;
        }
        for (int j = 0; j < e->n_ahead; j++)
            if (e->ahead[j] == arr[i]) e->ahead[j] = NULL;
        seq_destroy(e, arr[i]);
    }
    *n = k;
}

mt_status eng_abort(eng_engine *e, uint64_t id, eng_finish reason, const char *message) {
    bool waiting;
    int at;
    eng_seq *s = find_live(e, id, &waiting, &at);
    if (!s) return MT_ERR_NOT_FOUND;
    seq_end(e, s, reason, message); /* its row of a step in flight goes at the compaction */
    if (waiting) compact(e, e->waiting, &e->n_waiting);
    else compact(e, e->running, &e->n_running);
    return MT_OK;
}

void eng_abort_all(eng_engine *e, eng_finish reason, const char *message) {
    for (int i = 0; i < e->n_waiting; i++)
        if (!e->waiting[i]->done) seq_end(e, e->waiting[i], reason, message);
    for (int i = 0; i < e->n_running; i++)
        if (!e->running[i]->done) seq_end(e, e->running[i], reason, message);
    compact(e, e->waiting, &e->n_waiting);
    compact(e, e->running, &e->n_running);
}

/* ---- the step ---- */

static bool is_stop(const eng_engine *e, const eng_seq *s, int32_t t) {
    if (!s->req.ignore_eos && e->eos >= 0 && t == e->eos) return true;
    for (int i = 0; i < s->req.n_stop; i++)
        if (s->req.stop_ids[i] == t) return true;
    return false;
}

/* Reports s's next token r, and ends s when it stops. */
static void emit(eng_engine *e, eng_seq *s, const eng_sample_result *rp) {
    const eng_sample_result r = *rp;
    s->tokens[s->req.n_prompt + s->n_gen++] = r.token;
    s->pending = r.token;
    e->tokens++;
    if (e->cb.on_tokens) e->cb.on_tokens(e->cb.user, s->id, &r, 1);
    if (is_stop(e, s, r.token)) seq_end(e, s, ENG_FINISH_STOP, NULL);
    else if (s->n_gen >= s->req.max_new_tokens) seq_end(e, s, ENG_FINISH_LENGTH, NULL);
}

/* Samples s's next token from logits (host), then emit. */
static void sample_emit(eng_engine *e, eng_seq *s, const float *logits) {
    const eng_history h = { .prompt = s->tokens, .n_prompt = s->req.n_prompt,
                            .generated = s->tokens + s->req.n_prompt, .n_generated = s->n_gen };
    eng_sample_result r;
    eng_sample(e->sampler, &s->req.sampling, &s->rng, logits, &h, s->req.logprobs, s->req.top_logprobs, &r);
    emit(e, s, &r);
}

/* Plain greedy (no temperature, no filter or penalty that can move the argmax, no logprobs): the
 * token is the argmax of the raw logits, which the backend takes where they are. */
static bool plain_greedy(const eng_seq *s) {
    const eng_sample_params *p = &s->req.sampling;
    return p->temperature == 0.f && p->repetition_penalty == 1.f && p->presence_penalty == 0.f &&
           p->frequency_penalty == 0.f && !s->req.logprobs && s->req.top_logprobs == 0;
}

static void expire(eng_engine *e) {
    const uint64_t now = e->p.now_ms(e->p.clock_user);
    bool any = false;
    for (int i = 0; i < e->n_waiting + e->n_running; i++) {
        eng_seq *s = i < e->n_waiting ? e->waiting[i] : e->running[i - e->n_waiting];
        if (s->deadline_ms && now >= s->deadline_ms && !s->done) {
            ahead_settle(e, s);
            if (!s->done) seq_end(e, s, ENG_FINISH_CANCELLED, "deadline exceeded");
            any = true;
        }
    }
    if (!any) return;
    compact(e, e->waiting, &e->n_waiting);
    compact(e, e->running, &e->n_running);
}

/* ---- room in the pools: prefix eviction, then preemption ---- */


/* Recompute preemption: s gives its model state back and will be prefilled again from the start
 * (its prompt and every token it generated but the pending one), then decode on from its pending
 * token; the caller moves it to the head of the waiting queue. Its stream sees nothing of this. */
static void preempt(eng_engine *e, eng_seq *s) {
    lp_drop(e, s);
    seq_release(e, s);
    s->n_feed = s->req.n_prompt + (s->n_gen > 0 ? s->n_gen - 1 : 0);
    s->prefilled = 0;
    s->snap_at = 0;
    e->preemptions++;
}

/* Moves the preempted (state-less, not done) running sequences to the head of the waiting queue,
 * keeping their order. */
static void requeue_preempted(eng_engine *e) {
    int np = 0, k = 0;
    eng_seq *moved[e->p.max_sequences > 0 ? e->p.max_sequences : 1];
    for (int i = 0; i < e->n_running; i++) {
        eng_seq *s = e->running[i];
        if (!s->done && !s->gs) moved[np++] = s;
        else e->running[k++] = s;
    }
    e->n_running = k;
    if (!np) return;
    memmove(e->waiting + np, e->waiting, sizeof(eng_seq *) * (size_t)e->n_waiting);
    memcpy(e->waiting, moved, sizeof(eng_seq *) * (size_t)np);
    e->n_waiting += np;
}

/* Maps pages for n more tokens of s. When the pools are short, kept prefixes go first (least
 * recently used), then running sequences admitted after s, the newest first, are preempted; an
 * older sequence is never preempted for a newer one. false: even that was not enough, so s itself
 * must give way (the caller preempts it). */
static bool make_room(eng_engine *e, eng_seq *s, int n) {
    mt_error err = { "" };
    int self = -1;
    for (int i = 0; i < e->n_running; i++)
        if (e->running[i] == s) self = i;
    while (mt_seq_reserve(s->gs, n, &err) != MT_OK) {
        if (rt_prefix_evict_one(&e->prefixes)) continue;
        bool holds[e->n_running > 0 ? e->n_running : 1];
        for (int i = 0; i < e->n_running; i++) holds[i] = !e->running[i]->done && e->running[i]->gs;
        const int victim = sched_victim(holds, e->n_running, self);
        if (victim < 0 || !e->p.preempt) return false;
        preempt(e, e->running[victim]);
    }
    return true;
}

/* Reports the prompt logprobs that the k rows of echo_logits just fed from s->prefilled give: row j
 * predicts position s->prefilled + j + 1. */
static void echo_report(eng_engine *e, eng_seq *s, int k) {
    eng_sample_result r[ENG_ECHO_CHUNK];
    const int first = s->echo_next;
    int n = 0;
    for (int j = 0; j < k; j++) {
        const int pos = s->prefilled + j + 1;
        if (pos != s->echo_next || pos >= s->req.n_prompt) continue;
        eng_score(e->sampler, e->echo_logits + (size_t)j * e->vocab, s->tokens[pos], s->req.top_logprobs, &r[n++]);
        s->echo_next++;
    }
    if (n && e->cb.on_prompt_logprobs) e->cb.on_prompt_logprobs(e->cb.user, s->id, first, r, n);
}

/* Feeds up to *budget more tokens of s's prefill; when it is complete, samples its first token
 * (a sequence resuming after a preemption already has its pending token). An allocation or
 * prefill failure ends it with ERROR (freed at the next compaction); a shortage of pages that
 * preempting newer sequences cannot cure preempts s itself. */
/* Prompt logprobs: every row's logits, for positions whose next prompt token is unreported. */
static bool wants_echo(const eng_seq *s) { return s->req.prompt_logprobs && s->echo_next < s->req.n_prompt; }

/* The next chunk of s's prefill within budget tokens (with prompt logprobs at most ENG_ECHO_CHUNK,
 * whose rows go to echo_logits, made here). False when s ended instead (no memory for them). */
static bool chunk_next(eng_engine *e, eng_seq *s, int budget, struct eng_chunk *c) {
    const int rem = s->n_feed - s->prefilled;
    int k = sched_prefill_chunk(s->n_feed, s->prefilled, budget, s->snap_at);
    const bool echo = wants_echo(s);
    if (echo) {
        if (k > ENG_ECHO_CHUNK) k = ENG_ECHO_CHUNK;
        if (!e->echo_logits && !(e->echo_logits = malloc(sizeof(float) * ENG_ECHO_CHUNK * (size_t)e->vocab))) {
            seq_end(e, s, ENG_FINISH_ERROR, "engine: out of memory for prompt logprobs");
            return false;
        }
    }
    *c = (struct eng_chunk){ s, k, echo, k == rem, s->n_gen > 0 };
    return true;
}

/* The chunk's model part: every row's logits into echo_logits, or a completing (not resumed)
 * prompt's last row into logits [vocab]. */
static mt_batch_part chunk_part(const eng_engine *e, const struct eng_chunk *c, float *logits) {
    return (mt_batch_part){ .kind = MT_PART_PREFILL, .seq = c->s->gs, .tokens = c->s->tokens + c->s->prefilled,
                            .n = c->k, .logits = c->echo ? e->echo_logits : c->last && !c->resumed ? logits : NULL,
                            .all_logits = c->echo };
}

/* After the chunk's model call: its prompt logprobs, its progress, its prefix snapshot, and a
 * completed prompt's first token from logits (a resumed one decodes its pending token next). */
static void chunk_done(eng_engine *e, const struct eng_chunk *c, float *logits) {
    eng_seq *s = c->s;
    if (c->echo) echo_report(e, s, c->k);
    if (c->echo && c->last) memcpy(logits, e->echo_logits + (size_t)(c->k - 1) * e->vocab, sizeof(float) * (size_t)e->vocab);
    s->prefilled += c->k;
    e->prefill_tokens += (uint64_t)c->k;
    if (s->snap_at > 0 && s->prefilled == s->snap_at) rt_prefix_keep(&e->prefixes, s->gs, s->tokens, s->snap_at, e->steps);
    if (c->last && !c->resumed) sample_emit(e, s, logits);
}

static void prefill_some(eng_engine *e, eng_seq *s, int *budget) {
    struct eng_chunk c;
    if (!chunk_next(e, s, *budget, &c)) return;
    if (!make_room(e, s, c.k)) {
        preempt(e, s);
        return;
    }
    const mt_batch_part part = chunk_part(e, &c, e->logits); /* row 0: the step's decode has used these rows */
    s->st = mt_model_forward(e->m, &(mt_batch){ &part, 1 }, &s->err);
    if (s->st != MT_OK) {
        seq_end(e, s, ENG_FINISH_ERROR, s->err.msg);
        return;
    }
    *budget -= c.k;
    chunk_done(e, &c, e->logits);
    if (!c.last && *budget > 0) prefill_some(e, s, budget); /* stopped at the snapshot: go on */
}

/* A new sequence's start: the longest kept prefix of its prompt is copied in (a hit), and the
 * boundary to keep from this prompt is chosen. */
static void prefix_start(eng_engine *e, eng_seq *s) {
    if (!e->p.prefix_cache_bytes || s->req.prompt_logprobs) return;
    const int i = rt_prefix_find(&e->prefixes, s->tokens, s->req.n_prompt);
    mt_error err = { "" };
    s->prefilled = rt_prefix_restore(&e->prefixes, i, s->gs, e->steps, &err);
    if (i >= 0 && s->prefilled == 0) mt_log(MT_LOG_WARN, "engine: prefix reuse failed (%s); prefilling in full", err.msg);
    s->snap_at = sched_prefix_boundary(s->req.n_prompt, e->p.prefix_block, s->prefilled, s->n_gen);
}

/* Prefill work of one step, at most prefill_budget prompt tokens (at least one): first the
 * sequences whose prefill is already under way, in order, then waiting sequences admitted in
 * order while there is room. A long prompt is thus spread over steps, in chunks no larger than
 * the budget, and the running sequences decode between its chunks instead of waiting for all of
 * it. A sequence whose allocation fails ends with ERROR and is freed here. */
/* Whether s's prompt starts with the prefix that a chunk planned for this step's mixed batch keeps
 * as a snapshot: s then waits a step, to copy that snapshot instead of prefilling the same tokens
 * beside it (a chunk ends at its sequence's snapshot boundary). */
static bool awaits_snapshot(const eng_engine *e, const eng_seq *s) {
    for (int j = 0; j < e->n_chunks; j++) {
        const eng_seq *q = e->chunks[j].s;
        if (q->snap_at > 0 && q->prefilled + e->chunks[j].k == q->snap_at && s->req.n_prompt > q->snap_at &&
            !memcmp(s->tokens, q->tokens, sizeof(int32_t) * (size_t)q->snap_at))
            return true;
    }
    return false;
}

typedef bool (*eng_feed)(eng_engine *e, eng_seq *s, int *budget);

static bool feed_now(eng_engine *e, eng_seq *s, int *budget) {
    prefill_some(e, s, budget);
    return true;
}

/* feed: the prefill of a chunk now (prefill_some), or its plan for the step's mixed batch
 * (plan_chunk); false stops the step's prefill work there. */
static bool plan_chunk(eng_engine *e, eng_seq *s, int *budget);

/* What prefill_layers counts through the model: its layered units (layers, or sites). */
static int lp_units(const eng_engine *e) { return e->info.layered_units > 0 ? e->info.layered_units : e->info.n_layers; }

/* Whether the step's chunks run layered beside `rows` decode and verify rows (decided before the
 * step admits; its chunks and those rows then fit one pass), and the units
 * (mt_batch_part.layers) they run (after it admits; 0: all):
 * prefill_layers units when rows ride along and the model takes layered chunks and the
 * backlog is under layered_max_waiting, else 0 (all). On a model in finer units than layers
 * (sites, expert parts), prefill_layers x (units a layer) units while a request waits, whether
 * for the group (a group in flight admits nobody, so the request would pay every unit of the
 * group before its own) or for a place (under a backlog the group's places, which do not decode
 * while it flies, and the waiting requests' TTFT count for more than the spread), and while more
 * than fine_units_max_rows rows ride along; the fine units lower what a step beside decode rows
 * carries while nothing else is pending and few rows decode. */
static bool lp_on(const eng_engine *e, int rows) {
    const int k = e->p.prefill_layers;
    if (e->p.layered_max_waiting > 0 && e->n_waiting >= e->p.layered_max_waiting) return false;
    return rows > 0 && k > 0 && k < lp_units(e) && e->info.layered_prefill;
}

static int lp_layers(const eng_engine *e, bool on) {
    if (!on) return 0;
    const int k = e->p.prefill_layers, U = lp_units(e);
    const int per = e->info.n_layers > 0 && U > e->info.n_layers ? U / e->info.n_layers : 1;
    const int fmax = e->p.fine_units_max_rows;
    const int u = e->n_waiting > 0 || (fmax > 0 && e->pass_rows > fmax) ? k * per : k;
    return u < U ? u : 0;
}

static void admit_with(eng_engine *e, eng_feed feed) {
    if (e->holding) {
        requeue_preempted(e);
        return;
    }
    const int cap = e->p.prefill_budget > 0 ? e->p.prefill_budget : 1;
    int budget0 = sched_pace_budget(&e->pace, e->p.itl_target_ms, e->step_rows, ENG_PACE_FLOOR, cap);
    /* layered chunks and the rows beside them fit one pass */
    if (feed == plan_chunk && lp_on(e, e->pass_rows))
        budget0 = budget0 < e->info.batch_rows - e->pass_rows ? budget0 : e->info.batch_rows - e->pass_rows;
    else if (feed == plan_chunk)
        budget0 = sched_mixed_budget(budget0, e->pass_rows, e->info.batch_rows, ENG_PACE_FLOOR);
    int budget = budget0, taken = 0;
    bool stop = false;
    for (int i = 0; i < e->n_running && budget > 0 && !stop; i++) {
        eng_seq *s = e->running[i];
        if (!s->done && s->gs && s->prefilled < s->n_feed) stop = !feed(e, s, &budget);
    }
    requeue_preempted(e);
    while (!stop && budget > 0 && taken < e->n_waiting && e->n_running < e->p.max_sequences) {
        eng_seq *s = e->waiting[taken];
        if (e->p.prefix_cache_bytes && awaits_snapshot(e, s)) break;
        if (s->deadline_ms) { /* a prefill that would end past the deadline is not begun */
            const uint64_t now = e->p.now_ms(e->p.clock_user);
            const double left = now < s->deadline_ms ? (double)(s->deadline_ms - now) : 0.0;
            int todo = s->n_feed - s->prefilled; /* less what a kept prefix would restore */
            if (e->p.prefix_cache_bytes && !s->req.prompt_logprobs && s->prefilled == 0) {
                const int i = rt_prefix_find(&e->prefixes, s->tokens, s->req.n_prompt);
                if (i >= 0) todo -= e->prefixes.entries[i].len;
            }
            if (sched_deadline_hopeless(&e->pace, todo, left)) {
                char msg[160];
                snprintf(msg, sizeof msg, "deadline exceeded: its prefill of %d tokens takes about %.0f ms, %.0f ms were left",
                         todo, e->pace.chunk_ms + todo * e->pace.per_token_ms, left);
                taken++;
                seq_end(e, s, ENG_FINISH_CANCELLED, msg);
                seq_destroy(e, s);
                continue;
            }
        }
        const int cap = s->req.n_prompt + s->req.max_new_tokens;
        const sched_req r = { s->n_feed, s->req.n_prompt, s->req.max_new_tokens, mt_model_seq_bytes_max(e->m, cap) };
        sched_verdict v;
        for (;;) { /* kept prefixes hold slots and pages, and give them up for a request */
            const mt_pool_stats ps = mt_model_pool_stats(e->m);
            const sched_room room = { e->cache_bytes, e->p.cache_budget_bytes, ps.slots_free, ps.pages_free,
                                      e->info.page_tokens, e->info.page_bytes > 0, e->n_running };
            v = sched_admit(&room, &r, e->p.preempt, e->prefixes.n > 0);
            if (v != SCHED_EVICT) break;
            rt_prefix_evict_one(&e->prefixes);
        }
        if (v != SCHED_ADMIT) break;
        taken++;
        if ((s->st = mt_seq_new(e->m, cap, &s->gs, &s->err)) != MT_OK) {
            seq_end(e, s, ENG_FINISH_ERROR, s->err.msg);
            seq_destroy(e, s);
            continue;
        }
        s->charged = mt_model_seq_bytes_max(e->m, cap);
        e->cache_bytes += s->charged;
        e->running[e->n_running++] = s;
        prefix_start(e, s);
        if (!e->p.preempt && mt_seq_reserve(s->gs, cap - mt_seq_len(s->gs), &s->err) != MT_OK) {
            preempt(e, s); /* its whole length does not fit after all: back to the queue */
            break;
        }
        stop = !feed(e, s, &budget);
        if (!s->gs && !s->done) break; /* it gave way at once: the pools are full, the rest waits too */
    }
    memmove(e->waiting, e->waiting + taken, sizeof(eng_seq *) * (size_t)(e->n_waiting - taken));
    e->n_waiting -= taken;
    requeue_preempted(e);
    e->step_prompt += budget0 - (budget > 0 ? budget : 0);
}

static void admit(eng_engine *e) { admit_with(e, feed_now); }

/* The model's inputs for b[0, k) (k <= max_sequences): their sequences in e->gs, their pending
 * tokens in e->tok. */
static void batch_inputs(eng_engine *e, eng_seq **b, int k) {
    for (int i = 0; i < k; i++) {
        e->gs[i] = b[i]->gs;
        e->tok[i] = b[i]->pending;
    }
}

/* Batches of at most this many plain greedy sequences take their tokens back from the model
 * instead of their logits. */
#define ENG_GREEDY_MAX 1024

/* The decode parts of b[0, k), one row each: the pending token, and either the logits (row i of
 * logits) or the greedy token (greedy[i]) taken where the logits are. */
static void decode_parts(eng_engine *e, eng_seq **b, int k, float *logits, int32_t *greedy) {
    for (int i = 0; i < k; i++)
        e->parts[i] = (mt_batch_part){ .kind = MT_PART_DECODE, .seq = b[i]->gs, .tokens = &b[i]->pending, .n = 1,
                                       .logits = logits ? logits + (size_t)i * e->vocab : NULL,
                                       .argmax = greedy ? greedy + i : NULL };
}

/* One token for every running sequence, all through the model's batched decode (one pass over
 * the weights for all of them, batch_rows at a time; replayed from the bucket graph of that many
 * rows where the backend has graphs: a single sequence is a bucket of 1). If the batch is refused
 * (a bad token or a full sequence, which admission should make impossible), each sequence
 * decodes alone so only the bad one fails. */
static void decode_running(eng_engine *e, eng_seq **batch, int n, float *logits, int32_t *greedy) {
    if (greedy) logits = NULL; /* the tokens come back instead of the logits */
    const int rows = e->info.batch_rows;
    for (int c0 = 0; c0 < n; c0 += rows) {
        const int k = n - c0 < rows ? n - c0 : rows;
        eng_seq **b = batch + c0;
        mt_error err = { "" };
        decode_parts(e, b, k, logits ? logits + (size_t)c0 * e->vocab : NULL, greedy ? greedy + c0 : NULL);
        mt_status st = mt_model_forward(e->m, &(mt_batch){ e->parts, k }, &err);
        if (st == MT_OK) {
            for (int i = 0; i < k; i++) b[i]->st = MT_OK;
            continue;
        }
        if (k == 1) { /* nothing to split: the error is this sequence's */
            b[0]->st = st;
            b[0]->err = err;
            continue;
        }
        /* refused before any sequence moved (the model checks every row of a pass first): each
         * decodes alone, so only the bad one fails */
        mt_log(MT_LOG_WARN, "engine: batched decode of %d sequences refused (%s); decoding them one by one",
               k, err.msg[0] ? err.msg : mt_status_str(st));
        for (int i = 0; i < k; i++) {
            decode_parts(e, b + i, 1, logits ? logits + (size_t)(c0 + i) * e->vocab : NULL,
                         greedy ? greedy + c0 + i : NULL);
            b[i]->st = mt_model_forward(e->m, &(mt_batch){ e->parts, 1 }, &b[i]->err);
        }
    }
}

/* ---- running ahead (eng_params.run_ahead) ---- */

/* Reads the tokens of a queued greedy step of rows e->ahead[0, n) (waiting for that step only)
 * and reports each to its sequence; rows whose sequence ended since are dropped. A failed read
 * ends the step's sequences. */
static void ahead_report(eng_engine *e, int n, int64_t ticket) {
    const mt_status st = mt_model_ahead_tokens(e->m, ticket, e->tok, n);
    for (int i = 0; i < n; i++) {
        eng_seq *s = e->ahead[i];
        if (!s || s->done) continue;
        if (st != MT_OK) seq_end(e, s, ENG_FINISH_ERROR, "reading a decode step's tokens back failed");
        else emit(e, s, &(eng_sample_result){ .token = e->tok[i] });
    }
}

/* The step in flight's tokens, reported; none is in flight after. */
static void ahead_collect(eng_engine *e) {
    const int n = e->n_ahead;
    if (n == 0) return;
    e->n_ahead = 0;
    ahead_report(e, n, e->ahead_ticket);
}

/* Nobody can be admitted before a running sequence ends: none waits, or every running place is
 * taken (admission also stops there). */
static bool admission_idle(const eng_engine *e) {
    return e->n_waiting == 0 || e->n_running >= e->p.max_sequences;
}

/* A batch may leave its tokens on the device when nothing else wants the step's boundary: every
 * running sequence is in it (none is part way through its prefill), all plain greedy, nobody can
 * be admitted, and the model can (one pass of at most info.ahead_rows). */
static bool ahead_start_ok(eng_engine *e, int n) {
    if (!e->ahead_on || n != e->n_running || !admission_idle(e) || n > e->info.ahead_rows) return false;
    for (int i = 0; i < n; i++)
        if (!plain_greedy(e->batch[i])) return false;
    return true;
}

/* Step k + 1 may be queued on step k's device tokens (before they are read) when the batch goes
 * on unchanged: the same sequences in the same order, none ended, none reaching max_new_tokens
 * with token k, nobody who could be admitted, and each has its page for the next token without
 * evicting or preempting anything (that work waits for a step boundary). */
static bool ahead_next_ok(eng_engine *e) {
    if (!e->ahead_on || !admission_idle(e) || e->n_ahead != e->n_running) return false;
    for (int i = 0; i < e->n_running; i++) {
        const eng_seq *s = e->running[i];
        if (e->ahead[i] != s || s->done || !s->gs || s->prefilled != s->n_feed || !plain_greedy(s) ||
            s->n_gen + 1 >= s->req.max_new_tokens)
            return false;
    }
    mt_error err = { "" };
    for (int i = 0; i < e->n_running; i++)
        if (mt_seq_reserve(e->running[i]->gs, 1, &err) != MT_OK) return false;
    return true;
}

/* Queues one greedy step of e->batch[0, n) (tokens: their pending tokens; NULL: the device's
 * tokens of the step in flight) and records it as the step in flight. */
static mt_status ahead_queue(eng_engine *e, eng_seq **batch, int n, bool from_device) {
    batch_inputs(e, batch, n);
    mt_error err = { "" };
    int64_t ticket = -1;
    const mt_status st = mt_model_decode_ahead(e->m, e->gs, from_device ? NULL : e->tok, n, &ticket, &err);
    if (st != MT_OK) {
        mt_log(MT_LOG_WARN, "engine: greedy step of %d sequences not run ahead (%s)", n, err.msg);
        return st;
    }
    if (from_device) e->ahead_steps++;
    memmove(e->ahead, batch, sizeof(eng_seq *) * (size_t)n);
    e->n_ahead = n;
    e->ahead_ticket = ticket;
    return MT_OK;
}

/* Running sequences whose prompt is complete (they decode this step). */
static int decode_ready(const eng_engine *e) {
    int n = 0;
    for (int i = 0; i < e->n_running; i++) {
        const eng_seq *s = e->running[i];
        n += !s->done && s->gs && s->prefilled == s->n_feed;
    }
    return n;
}

/* Whether a running sequence's prompt is part way through its prefill. */
static bool prompt_under_way(const eng_engine *e) {
    for (int i = 0; i < e->n_running; i++) {
        const eng_seq *s = e->running[i];
        if (!s->done && s->gs && s->prefilled < s->n_feed) return true;
    }
    return false;
}

/* ---- speculative decoding (eng_params.spec_tokens) ---- */

/* Drafts s verifies this step: spec_tokens (greedy or sampled) unless it opted out, while at
 * most spec_max_batch decode (n_ready), fewer near max_new_tokens (a step gives at most k + 1). */
static int spec_k(const eng_engine *e, const eng_seq *s, int n_ready) {
    if (e->p.spec_tokens <= 0 || s->req.no_speculation) return 0;
    if (e->p.spec_max_batch > 0 && n_ready > e->p.spec_max_batch) return 0;
    const int left = s->req.max_new_tokens - s->n_gen - 1;
    return e->p.spec_tokens < left ? e->p.spec_tokens : left > 0 ? left : 0;
}

/* Draft j of row g (sequence s) from its drafter logits: greedy's argmax (logits NULL: the
 * model's, top), or a draw from the processed distribution (kept at e->spec_q for the verdict),
 * then the test hook. */
static int32_t spec_choose(eng_engine *e, eng_seq *s, int g, int j, const float *logits, int32_t top) {
    const int V = e->vocab;
    int32_t *gen = s->tokens + s->req.n_prompt; /* drafts go after the generated tokens (room:
                                                 * k < max_new_tokens - n_gen) as their history */
    int32_t d;
    if (plain_greedy(s)) {
        d = logits ? eng_argmax(logits, V) : top;
    } else {
        const eng_history h = { s->tokens, s->req.n_prompt, gen, s->n_gen + j - 1 };
        float *q = e->spec_q + ((size_t)g * ENG_SPEC_MAX + (size_t)(j - 1)) * V;
        eng_sample_probs(e->sampler, &s->req.sampling, logits, &h, q);
        d = eng_draw_probs(&s->rng, q, V);
    }
    if (e->p.spec_draft_hook) d = e->p.spec_draft_hook(e->p.spec_hook_user, s->id, s->n_gen - 1 + j, d);
    gen[s->n_gen + j - 1] = d;
    return d;
}

/* The drafts of grp[0, n) (group rows; row g drafts grp[g]->k_step tokens into spec_tok[1 ..],
 * spec_tok[0] being its pending token): draft j of every row that has one in one model call
 * (draft_rows), else one row at a time. A row whose drafter fails ends. */
static void spec_draft_group(eng_engine *e, eng_seq **grp, int n) {
    const int V = e->vocab;
    int kmax = 0;
    for (int g = 0; g < n; g++) {
        grp[g]->spec_tok[0] = grp[g]->pending;
        kmax = grp[g]->k_step > kmax ? grp[g]->k_step : kmax;
    }
    int idx[ENG_SPEC_GROUP_MAX];
    mt_seq *seqs[ENG_SPEC_GROUP_MAX];
    int32_t tok[ENG_SPEC_GROUP_MAX];
    for (int j = 1; j <= kmax; j++) {
        int r = 0;
        for (int g = 0; g < n; g++) {
            eng_seq *s = grp[g];
            if (s->done || s->k_step < j) continue;
            idx[r] = g;
            seqs[r] = s->gs;
            tok[r++] = s->spec_tok[j - 1];
        }
        if (r == 0) break;
        mt_error err = { "" };
        mt_status st = MT_ERR_UNSUPPORTED;
        /* plain greedy rows need only the argmax: the model takes it where the logits are */
        bool greedy = true;
        for (int q = 0; q < r && greedy; q++) greedy = plain_greedy(grp[idx[q]]);
        int32_t top[ENG_SPEC_GROUP_MAX] = { 0 };
        if (r > 1 && e->draft_rows) {
            st = mt_model_draft_rows(e->m, seqs, tok, r, greedy ? NULL : e->draft_logits, top, &err);
            if (st == MT_ERR_UNSUPPORTED) e->draft_rows = false;
            else if (st != MT_OK)
                mt_log(MT_LOG_WARN, "engine: a draft of %d sequences was refused (%s); drafting them apart", r, err.msg);
        }
        for (int q = 0; q < r; q++) {
            eng_seq *s = grp[idx[q]];
            const float *lg = e->draft_logits + (size_t)q * V;
            if (st != MT_OK && mt_model_draft(e->m, s->gs, tok[q], e->draft_logits + (size_t)q * V, &err) != MT_OK) {
                seq_end(e, s, ENG_FINISH_ERROR, err.msg);
                continue;
            }
            s->spec_tok[j] = spec_choose(e, s, idx[q], j, st == MT_OK && greedy ? NULL : lg, top[q]);
        }
    }
}

/* s's verify part: the pending token and the drafts; greedy tokens of every row, or (sampling)
 * every row's logits at e->spec_logits row g. */
static mt_batch_part spec_part(eng_engine *e, eng_seq *s, int g) {
    const bool greedy = plain_greedy(s);
    return (mt_batch_part){ .kind = MT_PART_DECODE, .seq = s->gs, .tokens = s->spec_tok, .n = s->k_step + 1,
                            .logits = greedy ? NULL : e->spec_logits + (size_t)g * (ENG_SPEC_MAX + 1) * e->vocab,
                            .all_logits = !greedy, .argmax = greedy ? s->spec_top : NULL };
}

/* After s's verify: the target's tokens up to and including the first that replaces its draft
 * (see spec_group); the rows after it are then dropped (spec_keep). */
static void spec_accept(eng_engine *e, eng_seq *s, int g) {
    const int k = s->k_step, V = e->vocab;
    const bool greedy = plain_greedy(s);
    const int32_t *tok = s->spec_tok, *top = s->spec_top;
    const float *logits = e->spec_logits + (size_t)g * (ENG_SPEC_MAX + 1) * V;
    const float *q0 = e->spec_q + (size_t)g * ENG_SPEC_MAX * V;
    int32_t *gen = s->tokens + s->req.n_prompt;
    e->spec_steps++;
    s->verified++;
    s->drafted += k;
    e->drafted += (uint64_t)k;
    int i = 0;
    for (;; i++) { /* row i's token follows tok[0 .. i]; draft i + 1 stands if it is kept */
        bool kept;
        eng_sample_result r = { 0 };
        if (greedy) {
            r.token = top[i];
            kept = i < k && top[i] == tok[i + 1];
        } else {
            const float *row = logits + (size_t)i * V;
            const eng_history h = { s->tokens, s->req.n_prompt, gen, s->n_gen };
            eng_sample_probs(e->sampler, &s->req.sampling, row, &h, e->spec_p);
            kept = false;
            r.token = i < k ? eng_spec_verdict(&s->rng, e->spec_p, q0 + (size_t)i * V, V, tok[i + 1], &kept)
                            : eng_draw_probs(&s->rng, e->spec_p, V);
            if (s->req.logprobs || s->req.top_logprobs > 0) eng_score(e->sampler, row, r.token, s->req.top_logprobs, &r);
        }
        emit(e, s, &r);
        if (s->done || !kept) break;
        s->accepted++;
        e->accepted++;
    }
    s->kept_rows = s->done ? 0 : i + 1;
}

/* The rows v[lv[j]] (j < nl) keep of their verifies (spec_accept), the model's seq_keep of all
 * of them at once; one that fails ends its sequence and the others keep one at a time. */
static void spec_keep(eng_engine *e, eng_seq **v, const int *lv, int nl) {
    mt_seq *seqs[ENG_SPEC_GROUP_MAX];
    eng_seq *who[ENG_SPEC_GROUP_MAX];
    int keeps[ENG_SPEC_GROUP_MAX], n = 0, done = 0;
    for (int j = 0; j < nl; j++) {
        eng_seq *s = v[lv[j]];
        if (s->done || s->kept_rows < 1) continue;
        who[n] = s;
        seqs[n] = s->gs;
        keeps[n++] = s->kept_rows;
        s->kept_rows = 0;
    }
    mt_error err = { "" };
    if (n > 0 && mt_seq_keep_rows(e->m, seqs, keeps, n, &done, &err) == MT_OK) return;
    for (int q = done; q < n; q++) {
        if (q > done) err.msg[0] = '\0';
        if (q > done && mt_seq_keep(e->m, seqs[q], keeps[q], &err) == MT_OK) continue;
        seq_end(e, who[q], ENG_FINISH_ERROR, err.msg);
    }
}


/* The rows of grp[0, m) still live after their drafts (a failed draft ends its sequence), by
 * group index (spec_q's row), into lv; returns how many. */
static int spec_live(eng_seq **grp, int m, int *lv) {
    int nl = 0;
    for (int g = 0; g < m; g++)
        if (!grp[g]->done) lv[nl++] = g;
    return nl;
}

/* The verifies of grp[lv[j]], j < nl (drafted), in one model call, then each accepts and keeps;
 * a group the model refuses verifies one sequence at a time. */
static void spec_verify(eng_engine *e, eng_seq **grp, const int *lv, int nl) {
    for (int j = 0; j < nl; j++) e->parts[j] = spec_part(e, grp[lv[j]], lv[j]);
    mt_error err = { "" };
    if (nl > 1 && mt_model_forward(e->m, &(mt_batch){ e->parts, nl }, &err) == MT_OK) {
        for (int j = 0; j < nl; j++) spec_accept(e, grp[lv[j]], lv[j]);
        spec_keep(e, grp, lv, nl);
        return;
    }
    if (nl > 1)
        mt_log(MT_LOG_WARN, "engine: a verify of %d sequences was refused (%s); verifying them apart", nl,
               err.msg[0] ? err.msg : "?");
    for (int j = 0; j < nl; j++) {
        if (mt_model_forward(e->m, &(mt_batch){ &e->parts[j], 1 }, &err) != MT_OK) {
            seq_end(e, grp[lv[j]], ENG_FINISH_ERROR, err.msg);
            continue;
        }
        spec_accept(e, grp[lv[j]], lv[j]);
        spec_keep(e, grp, &lv[j], 1);
    }
}

/* The speculative steps of b[0, n) (each with s->k_step > 0 drafts, pages for k + 1 rows mapped),
 * in groups of the model's verify_seqs: every sequence of a group drafts, then the group's
 * verifies (each the pending token and the drafts) go through one model call, then each keeps
 * the target's tokens up to and including the first that replaces its draft; the rows after it
 * are dropped. Plain greedy sequences take the verify's argmax where the logits are and keep a
 * draft equal to it. Others sample: draft j is drawn from the drafter's processed distribution
 * q_j (the request's temperature, filters and penalties, the drafts before it counted as
 * generated), row i of the verify gives the target's p_i the same way, and eng_spec_verdict
 * keeps draft i + 1 or replaces it with a draw from the residual, so each token is distributed
 * as the target's; after k kept drafts the last row's token is drawn from p_k. Reported logprobs
 * are the target's. (With mixed_steps, one group's verifies join the step's model call
 * instead: mixed_step.) */
static void spec_group(eng_engine *e, eng_seq **b, int n) {
    const int G = e->spec_group;
    for (int g0 = 0; g0 < n; g0 += G) {
        eng_seq *grp[ENG_SPEC_GROUP_MAX];
        int m = 0, lv[ENG_SPEC_GROUP_MAX];
        for (int i = g0; i < n && i < g0 + G; i++) grp[m++] = b[i];
        spec_draft_group(e, grp, m);
        const int nl = spec_live(grp, m, lv);
        if (nl > 0) spec_verify(e, grp, lv, nl);
    }
}

/* ---- mixed steps (eng_params.mixed_steps) ---- */

/* Whether this step has prefill work: a prompt under way, or a request that could be admitted
 * (none while the step holds its prompt work back). */
static bool prefill_pending(const eng_engine *e) {
    return !e->holding && (!admission_idle(e) || prompt_under_way(e));
}

/* Whether this step holds back the admission of new prompts (eng_params.prefill_hold_ms,
 * sched_hold_prefill), given `rows` sequences that decode in it. Only admissions wait: a prompt
 * under way goes on (holding its tail would add the hold to its TTFT at every chunk), and while
 * one does nothing is held. The ready tokens are those of the waiting requests that fit the free
 * places. The hold's clock starts at the first step that could admit, and runs until a step runs
 * prompt work (eng_step) or nobody can be admitted: a release that admits nothing (the pools are
 * short) does not start another hold. */
static void hold_decide(eng_engine *e, int rows) {
    e->holding = false;
    if (!(e->p.prefill_hold_ms > 0)) return;
    const int places = e->p.max_sequences - e->n_running;
    if (places <= 0 || e->n_waiting == 0) {
        e->hold_on = false;
        return;
    }
    if (prompt_under_way(e)) return;
    long ready = 0;
    for (int i = 0; i < e->n_waiting && i < places; i++) ready += e->waiting[i]->n_feed - e->waiting[i]->prefilled;
    const uint64_t now = e->p.now_ms(e->p.clock_user);
    if (!e->hold_on) {
        e->hold_on = true;
        e->hold_since = now;
    }
    const int budget = e->p.prefill_budget > 0 ? e->p.prefill_budget : 1;
    const double held = now > e->hold_since ? (double)(now - e->hold_since) : 0.0;
    e->holding = sched_hold_prefill(e->p.prefill_hold_ms, held, rows, e->n_waiting, places,
                                    ready > INT32_MAX ? INT32_MAX : (int)ready, budget);
    e->held_steps += e->holding;
}

/* Plans the next chunk of s's prefill (at most *budget tokens) into the step's batch; one chunk
 * with prompt logprobs a step (they share echo_logits). Its pages are mapped here without evicting
 * or preempting anything: false when they cannot be, which ends the step's planning (a step that
 * plans no chunk falls back to admit, which makes room). */
static bool plan_chunk(eng_engine *e, eng_seq *s, int *budget) {
    if (wants_echo(s))
        for (int j = 0; j < e->n_chunks; j++)
            if (e->chunks[j].echo) return false;
    struct eng_chunk c;
    if (!chunk_next(e, s, *budget, &c)) return true;
    mt_error err = { "" };
    if (mt_seq_reserve(s->gs, c.k, &err) != MT_OK) return false;
    e->chunks[e->n_chunks++] = c;
    *budget -= c.k;
    return true;
}

/* What a step did with prompt chunks (mixed_step): none ran; they ran and completed (finish_chunks
 * follows); they ran some layers and stay in flight (layered prefill). */
typedef enum { CHUNKS_NONE, CHUNKS_DONE, CHUNKS_FLYING } chunks_ran;

/* The step's decode rows b[0, n) (as decode_running), the verifies of the speculating sequences
 * v[0, nv) (nv <= spec_group; drafted here, as spec_group does) and the chunks
 * admit_with(plan_chunk) plans (or the layered chunks in flight), in one model call, parts in that
 * order (the model runs the leading one-row parts in the batched decode's rows form); then each
 * verify accepts and keeps. The chunks stop where the rows of the call fill whole passes (layered:
 * one pass). CHUNKS_NONE when no chunk ran: then the decode rows and verifies still share one call
 * when both are there, else each runs as it would alone, and the caller admits as usual. A refused
 * call (checked before anything moves) runs its kinds apart: the verifies (spec_verify), the
 * decode rows, each chunk (through every remaining layer). */
static chunks_ran mixed_step(eng_engine *e, eng_seq **b, int n, eng_seq **v, int nv, float *logits, int32_t *greedy) {
    int lv[ENG_SPEC_GROUP_MAX], nl = 0, vrows = 0;
    if (nv > 0) {
        spec_draft_group(e, v, nv);
        nl = spec_live(v, nv, lv);
        for (int j = 0; j < nl; j++) vrows += v[lv[j]]->k_step + 1;
    }
    e->pass_rows = n + vrows;
    const bool on = lp_on(e, n + vrows); /* as admit_with sees it */
    if (!e->lp_active) {
        e->n_chunks = 0;
        admit_with(e, plan_chunk);
    }
    const int layers = lp_layers(e, on); /* after admission: who still waits */
    const bool join = e->n_chunks > 0 || (n > 0 && nl > 0);
    if (!join) {
        if (nl > 0) spec_verify(e, v, lv, nl);
        if (n > 0) decode_running(e, b, n, logits, greedy);
        return CHUNKS_NONE;
    }
    if (greedy) logits = NULL;
    decode_parts(e, b, n, logits, greedy);
    for (int j = 0; j < nl; j++) e->parts[n + j] = spec_part(e, v[lv[j]], lv[j]);
    for (int j = 0; j < e->n_chunks; j++) {
        mt_batch_part *q = &e->parts[n + nl + j];
        *q = chunk_part(e, &e->chunks[j], e->chunk_logits + (size_t)j * e->vocab);
        q->layers = layers;
    }
    mt_error err = { "" };
    const mt_status st = mt_model_forward(e->m, &(mt_batch){ e->parts, n + nl + e->n_chunks }, &err);
    if (st == MT_OK) {
        for (int i = 0; i < n; i++) b[i]->st = MT_OK;
        for (int j = 0; j < e->n_chunks; j++) e->chunks[j].s->st = MT_OK;
        e->mixed_steps += n > 0 && e->n_chunks > 0;
        e->spec_mixed_steps += nl > 0;
        for (int j = 0; j < nl; j++) spec_accept(e, v[lv[j]], lv[j]);
        spec_keep(e, v, lv, nl);
        if (e->n_chunks == 0) return CHUNKS_NONE;
        /* the chunks completed when their sequences' lengths moved (the model may run a layer
         * more than asked: a range does not end before a layer that leans on the one before) */
        const struct eng_chunk *c0 = &e->chunks[0];
        const bool done = mt_seq_len(c0->s->gs) == c0->s->prefilled + c0->k;
        const int L = lp_units(e), before = e->lp_active ? e->lp_done : 0;
        const int after = done ? L : before + layers < L ? before + layers : L - 1;
        e->layered_steps += !(before == 0 && done);
        /* the pacing sees the step's share of its chunks' prompt work (counted whole at planning) */
        int tokens = 0;
        for (int j = 0; j < e->n_chunks; j++) tokens += e->chunks[j].k;
        e->step_prompt += (int)((long)tokens * (after - before) / L) - (e->lp_active ? 0 : tokens);
        e->lp_done = after;
        e->lp_active = !done;
        return done ? CHUNKS_DONE : CHUNKS_FLYING;
    }
    mt_log(MT_LOG_WARN, "engine: mixed step of %d rows, %d verifies and %d chunks refused (%s); running them apart", n,
           nl, e->n_chunks, err.msg[0] ? err.msg : mt_status_str(st));
    e->lp_active = false;
    if (nl > 0) spec_verify(e, v, lv, nl);
    if (n > 0) decode_running(e, b, n, logits, greedy);
    for (int j = 0; j < e->n_chunks; j++) {
        eng_seq *s = e->chunks[j].s;
        const mt_batch_part part = chunk_part(e, &e->chunks[j], e->chunk_logits + (size_t)j * e->vocab);
        s->st = mt_model_forward(e->m, &(mt_batch){ &part, 1 }, &s->err);
    }
    return e->n_chunks > 0 ? CHUNKS_DONE : CHUNKS_NONE;
}

/* After the step's decode rows are reported: each planned chunk's prompt logprobs, its progress,
 * its prefix snapshot, and a completed prompt's first token. */
static void finish_chunks(eng_engine *e) {
    for (int j = 0; j < e->n_chunks; j++) {
        const struct eng_chunk *c = &e->chunks[j];
        eng_seq *s = c->s;
        if (s->done) continue;
        if (s->st != MT_OK) {
            seq_end(e, s, ENG_FINISH_ERROR, s->err.msg);
            continue;
        }
        chunk_done(e, c, e->chunk_logits + (size_t)j * e->vocab);
    }
    e->n_chunks = 0;
    requeue_preempted(e);
}

static mt_status step_body(eng_engine *e, int *n_tokens);

/* One step, timed for the pacing of the next ones (sched_pace: its prompt tokens and decode rows). */
mt_status eng_step(eng_engine *e, int *n_tokens) {
    const double t0 = mt_now();
    e->step_rows = 0;
    e->step_prompt = 0;
    const mt_status st = step_body(e, n_tokens);
    sched_pace_note(&e->pace, (mt_now() - t0) * 1e3, e->step_prompt, e->step_rows);
    if (e->step_prompt > 0) e->hold_on = false; /* the prompt work ran: a later hold starts afresh */
    return st;
}

static mt_status step_body(eng_engine *e, int *n_tokens) {
    const uint64_t tokens0 = e->tokens;
    if (n_tokens) *n_tokens = 0;
    e->holding = false;
    if (!eng_has_work(e)) {
        e->hold_on = false;
        return MT_OK;
    }
    e->steps++;
    expire(e);
    if (e->n_ahead > 0) {
        /* the last step's tokens are still on the device: while the batch goes on unchanged, the
         * next step is queued on them before the host reads them (then reports them) */
        const int n = e->n_ahead;
        const int64_t prev = e->ahead_ticket;
        /* timed as a decode step: reading the last step's tokens waits for the device, so in a
         * steady run this step lasts what a device step does */
        e->step_rows = n;
        if (ahead_next_ok(e) && ahead_queue(e, e->running, n, true) == MT_OK) {
            ahead_report(e, n, prev); /* step k's tokens; step k + 1 is in flight for the same rows */
            compact(e, e->running, &e->n_running); /* rows of sequences that ended at k are dropped */
            if (n_tokens) *n_tokens = (int)(e->tokens - tokens0);
            return MT_OK;
        }
        /* the batch changes here (or must meet a step boundary): step k's tokens are read and
         * reported, then the step goes on as usual from the host's tokens, so the rows that go on
         * get two tokens in this step and the device's queue stays one step ahead */
        ahead_collect(e);
        compact(e, e->running, &e->n_running);
    }
    /* the sequences whose prompt was complete before this step decode; the prefill work comes
     * after (a sequence whose prompt completes this step got its first token from the prefill) */
    /* each needs a page for its next token when it crosses into a new one; oldest first, so a
     * shortage preempts the newest */
    const int n_ready = decode_ready(e);
    for (int i = 0; i < e->n_running; i++) {
        eng_seq *s = e->running[i];
        if (s->done || !s->gs || s->prefilled != s->n_feed) continue;
        /* speculation takes the pages of its extra rows only where they are free */
        mt_error err = { "" };
        s->k_step = spec_k(e, s, n_ready);
        if (s->k_step > 0 && mt_seq_reserve(s->gs, s->k_step + 1, &err) != MT_OK) s->k_step = 0;
        if (s->k_step == 0 && !make_room(e, s, 1)) preempt(e, s);
    }
    requeue_preempted(e);
    hold_decide(e, decode_ready(e)); /* counted after any preemption above */
    /* with prefill work this step, its chunks join the decode rows' model call */
    const bool mixed = e->p.mixed_steps && prefill_pending(e);
    chunks_ran ran = CHUNKS_NONE;
    int n = 0, nv = 0, vrows = 0;
    for (int i = 0; i < e->n_running; i++) {
        eng_seq *s = e->running[i];
        if (s->prefilled != s->n_feed) continue;
        if (s->k_step > 0 && !s->done) {
            e->spec_batch[nv++] = s;
            vrows += s->k_step + 1;
        } else {
            e->batch[n++] = s;
        }
    }
    /* with mixed steps, one group of verifies joins that call too (when there is one beside
     * them); the other groups verify in calls of their own first */
    const int nj = e->p.mixed_steps && nv > 0 && (n > 0 || mixed) ? (nv < e->spec_group ? nv : e->spec_group) : 0;
    if (nv > nj) spec_group(e, e->spec_batch + nj, nv - nj);
    e->step_rows = n + vrows; /* the rows beside this step's prompt chunks */
    if (n > 0) {
        /* a batch of plain greedy requests takes its tokens on the device: no logits move */
        bool greedy = n <= ENG_GREEDY_MAX;
        for (int i = 0; i < n && greedy; i++) greedy = plain_greedy(e->batch[i]);
        int32_t tok[ENG_GREEDY_MAX];
        if (greedy && ahead_start_ok(e, n) && ahead_queue(e, e->batch, n, false) == MT_OK) {
            /* its tokens are read (and reported) at the next step, after that step is queued;
             * nobody can be admitted (ahead_start_ok) */
            if (n_tokens) *n_tokens = (int)(e->tokens - tokens0);
            return MT_OK;
        }
        if (mixed || nj > 0) ran = mixed_step(e, e->batch, n, e->spec_batch, nj, e->logits, greedy ? tok : NULL);
        else decode_running(e, e->batch, n, e->logits, greedy ? tok : NULL);
        for (int i = 0; i < n; i++) {
            eng_seq *s = e->batch[i];
            if (s->st != MT_OK) seq_end(e, s, ENG_FINISH_ERROR, s->err.msg);
            else if (greedy) emit(e, s, &(eng_sample_result){ .token = tok[i] });
            else sample_emit(e, s, e->logits + (size_t)i * e->vocab);
        }
    } else if (nj > 0) { /* no decode rows: the verifies ride with the prompt chunks */
        ran = mixed_step(e, NULL, 0, e->spec_batch, nj, NULL, NULL);
    }
    /* the step's prompt chunks (all of them, when the decode ran apart) go in one model call:
     * each pass reads the weights its rows touch, so many short prompts take one read, not one
     * each */
    if (ran == CHUNKS_NONE && prefill_pending(e)) ran = mixed_step(e, NULL, 0, NULL, 0, NULL, NULL);
    if (ran == CHUNKS_DONE) finish_chunks(e);
    else if (ran == CHUNKS_NONE) admit(e);
    compact(e, e->running, &e->n_running);
    if (n_tokens) *n_tokens = (int)(e->tokens - tokens0);
    return MT_OK;
}

mt_status eng_warmup(eng_engine *e, int n_prompt, int n_new, mt_error *err) {
    if (eng_has_work(e)) return mt_errorf(err, MT_ERR_INVALID, "warm-up on a busy engine");
    if (n_prompt < 1 || n_new < 1) return mt_errorf(err, MT_ERR_INVALID, "warm-up of %d + %d tokens", n_prompt, n_new);
    if (n_prompt + n_new > e->p.max_context) n_prompt = e->p.max_context - n_new;
    if (n_prompt < 1) return mt_errorf(err, MT_ERR_INVALID, "warm-up does not fit a context of %d", e->p.max_context);
    int32_t *prompt = malloc(sizeof(int32_t) * (size_t)n_prompt);
    if (!prompt) return mt_errorf(err, MT_ERR_NOMEM, "out of memory for a warm-up prompt");
    for (int i = 0; i < n_prompt; i++) prompt[i] = i % e->vocab;
    eng_request r = eng_default_request();
    r.prompt = prompt;
    r.n_prompt = n_prompt;
    r.max_new_tokens = n_new;
    r.ignore_eos = true;
    r.has_seed = true;
    const eng_callbacks cb = e->cb;
    const size_t keep = e->p.prefix_cache_bytes;
    e->cb = (eng_callbacks){ 0 };
    e->p.prefix_cache_bytes = 0;
    mt_status st = eng_submit(e, UINT64_MAX, &r, 0, err);
    while (st == MT_OK && eng_has_work(e)) st = eng_step(e, NULL);
    if (st != MT_OK) eng_abort_all(e, ENG_FINISH_ERROR, "warm-up failed");
    const bool failed = e->aborted > 0;
    e->cb = cb;
    e->p.prefix_cache_bytes = keep;
    free(prompt);
    /* the warm-up is not traffic: counters and step timings start from zero */
    e->finished = e->aborted = e->tokens = e->steps = e->preemptions = 0;
    e->ahead_steps = e->mixed_steps = e->layered_steps = e->prefill_tokens = e->held_steps = 0;
    e->spec_steps = e->spec_mixed_steps = e->drafted = e->accepted = 0;
    sched_pace_init(&e->pace);
    if (st != MT_OK) return st;
    if (failed) return mt_errorf(err, MT_ERR_BACKEND, "warm-up request failed");
    return MT_OK;
}

bool eng_has_work(const eng_engine *e) { return e->n_waiting + e->n_running > 0; }

/* Marks the pages s maps in e->page_marks; returns how many were not marked yet. */
static int mark_pages(eng_engine *e, const mt_seq *s) {
    const int32_t *ids;
    const int n = mt_seq_pages(s, &ids);
    int fresh = 0;
    for (int i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= e->n_page_marks || e->page_marks[ids[i]]) continue;
        e->page_marks[ids[i]] = 1;
        fresh++;
    }
    return fresh;
}

int eng_prefix_pages(eng_engine *e) {
    const int total = mt_model_pool_stats(e->m).pages_total;
    if (e->prefixes.n == 0 || total <= 0) return 0;
    if (e->n_page_marks < total) {
        uint8_t *m = realloc(e->page_marks, (size_t)total);
        if (!m) return -1;
        e->page_marks = m;
        e->n_page_marks = total;
    }
    memset(e->page_marks, 0, (size_t)e->n_page_marks);
    for (int i = 0; i < e->n_running; i++)
        if (e->running[i]->gs) mark_pages(e, e->running[i]->gs);
    for (int i = 0; i < e->n_waiting; i++)
        if (e->waiting[i]->gs) mark_pages(e, e->waiting[i]->gs);
    int only = 0;
    for (int i = 0; i < e->prefixes.n; i++) only += mark_pages(e, e->prefixes.entries[i].snap);
    return only;
}

void eng_get_stats(const eng_engine *e, eng_stats *out) {
    size_t held = 0; /* pool memory the running sequences hold now */
    for (int i = 0; i < e->n_running; i++) held += mt_seq_bytes(e->running[i]->gs);
    *out = (eng_stats){ .running = e->n_running, .waiting = e->n_waiting,
                        .live_sequences = e->n_running + e->n_waiting, .cache_bytes_in_use = held,
                        .sequences_finished = e->finished, .sequences_aborted = e->aborted,
                        .tokens_generated = e->tokens, .steps = e->steps, .ahead_steps = e->ahead_steps,
                        .mixed_steps = e->mixed_steps, .layered_steps = e->layered_steps,
                        .spec_mixed_steps = e->spec_mixed_steps,
                        .held_steps = e->held_steps,
                        .prefill_tokens = e->prefill_tokens,
                        .prefix_hits = e->prefixes.hits, .prefix_misses = e->prefixes.misses,
                        .prefix_cache_bytes = e->prefixes.bytes, .prefix_entries = e->prefixes.n,
                        .preemptions = e->preemptions, .spec_steps = e->spec_steps,
                        .draft_tokens = e->drafted, .accepted_tokens = e->accepted,
                        .pages_free = mt_model_pool_stats(e->m).pages_free, .pages_total = mt_model_pool_stats(e->m).pages_total,
                        .slots_free = mt_model_pool_stats(e->m).slots_free, .slots_total = mt_model_pool_stats(e->m).slots_total };
}
