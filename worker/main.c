/* worker/main.c: metrale-worker, one engine behind a ZeroMQ DEALER talking to the router.
 *
 *   metrale-worker --model DIR --router ipc:///PATH --id N [--backend cpu|cuda|auto] [--device N]
 *                  [--max-sequences N] [--max-context N] [--threads N] [--router-timeout S] [--verbose]
 *                  [--numerics exact|bf16]
 *
 * Protocol (proto/metrale/internal/v1/worker.proto): on start, Hello (the model and
 * max_sequences); then Submit / Abort / Shutdown / Heartbeat from the router, and from here one
 * Tokens per sequence per engine step, Finished after a sequence's last Tokens (also after an
 * Abort, so the router knows the state is freed), and a Heartbeat with WorkerStats every 500 ms,
 * busy or not. A Submit the engine refuses is answered at once with Finished(ERROR, why).
 * Malformed or unexpected messages are logged and dropped.
 *
 * Threads: the engine thread runs the loop (receive, eng_step, send tokens); a heartbeat thread
 * sends the Heartbeat every HEARTBEAT_S from a stats snapshot the engine thread refreshes, so the
 * router hears from a worker busy in a long step (a long CPU prefill takes seconds). They share
 * the DEALER under sock_mu (a mutex is the full barrier ZeroMQ asks for when a socket is used by
 * more than one thread). The heartbeat thread stops beating when the engine thread has made no
 * progress for STALL_S, so a hung worker is declared dead.
 *
 * Lifetime: exits 0 on Shutdown, SIGTERM or SIGINT (live sequences end with Finished(CANCELLED)
 * while the router is reachable), and 1 when the router has been silent for --router-timeout
 * (default 10 s: it died) or on a start-up error. When a send to the router fails (no router
 * connected for MT_WIRE_DEALER_SEND_MS), its streams are lost: every live sequence is dropped, and
 * the next successful send is a fresh Hello; the same when a router Heartbeat has hello_wanted
 * (the router restarted and does not know this worker). Only main exits.
 */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/mt.h"
#include "common/wire.h"
#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "worker/engine/engine.h"
#include "worker/loader/glm_config.h"
#include "worker/model/glm_model.h"

#define HEARTBEAT_S 0.5
#define ROUTER_SILENCE_S 10.0   /* default --router-timeout */
#define RECV_BATCH 256          /* envelopes handled per loop iteration at most */
#define IDLE_WAIT_MS 50         /* longest wait for a message when idle (holds sock_mu) */
#define HELLO_RETRY_S 0.5
#define STALL_S 120.0           /* engine-thread silence after which heartbeats stop */
#define HELLO_WANTED_QUIET_S 2.0 /* hello_wanted this soon after a Hello is its in-flight echo */

typedef struct worker_opts {
    const char *model, *router, *backend;
    int id, device, max_sequences, max_context, threads;
    long cache_budget_mb;        /* 0: plan from the backend's free memory */
    int prefill_budget;          /* 0: the engine's default */
    int graph_max_batch;         /* 0: the model's default */
    bool no_preempt;             /* admit only with pages for the whole length instead */
    bool no_run_ahead;           /* greedy batches read each step's tokens before the next */
    mt_numerics numerics;        /* the CUDA backend's prefill GEMM numerics */
    double router_timeout;      /* seconds of router silence before exiting */
    bool verbose;
} worker_opts;

typedef struct worker {
    worker_opts o;
    glm_model *m;
    eng_engine *eng;
    const char *backend_name;   /* "cpu" or "cuda" */
    /* engine thread only */
    bool quiet;                 /* dropping sequences: their callbacks send nothing */
    double last_rx, next_hello, last_hello;
    uint64_t dropped_msgs;
    /* under sock_mu */
    pthread_mutex_t sock_mu;
    mt_wire_sock *wire;
    bool linked;                /* Hello delivered and no send failed since */
    bool link_lost;             /* a send failed; the engine thread drops its sequences */
    uint64_t hb_seq;
    /* under stats_mu: what the heartbeat thread reports */
    pthread_mutex_t stats_mu;
    eng_stats stats;
    double progress_at;         /* mt_now() of the engine thread's last loop iteration */
    bool stop_beating;
} worker;

static volatile sig_atomic_t g_stop;

static void on_signal(int sig) {
    (void)sig;
    g_stop = 1;
}

/* The start-up memory plan (issue 5): what the backend has free after the weights, less a reserve
 * for activations, scratch and graphs, goes to the model's two pools: slots (one per running
 * sequence, per kept prefix, and the graph pad) and pages (the DSA caches), no more pages than every
 * slot at full context could use. --cache-budget-mb gives the pools a fixed size instead. A
 * request waits while the pools are short; a running one that runs out is preempted and resumed,
 * never failed. Logged as one line: the split, and how many tokens and sequences fit. */
static mt_status plan_memory(worker *w, mt_backend *be, eng_params *ep, mt_error *err) {
    glm_model *m = w->m;
    const size_t page_b = glm_model_page_bytes(m), slot_b = glm_model_slot_bytes(m);
    const int page = glm_model_page_tokens(m);
    const int prefix_slots = ep->prefix_cache_bytes ? (ep->max_sequences + 1) / 2 : 0;
    const int slots = ep->max_sequences + prefix_slots + 1;
    const int full = (w->o.max_context + page - 1) / page; /* pages of one full-context sequence */
    const long long want_pages = (long long)full * slots + 1;
    size_t free_b = 0, total_b = 0, pools;
    const bool gpu = strcmp(be->ops->name, "cpu") != 0;
    size_t reserve = 0;
    if (w->o.cache_budget_mb > 0) {
        pools = (size_t)w->o.cache_budget_mb << 20;
    } else if (be->ops->mem_info && be->ops->mem_info(be, &free_b, &total_b) == MT_OK) {
        /* GPU: keep a tenth (at least 2 GiB) for activations, scratch and graphs; CPU: half */
        reserve = gpu ? (free_b / 10 > ((size_t)2 << 30) ? free_b / 10 : ((size_t)2 << 30)) : free_b / 2;
        pools = free_b > reserve ? free_b - reserve : 0;
    } else {
        pools = (size_t)want_pages * page_b + (size_t)slots * slot_b;
    }
    if (pools < (size_t)slots * slot_b + (page_b ? page_b * (size_t)(full + 1) : 0))
        return mt_errorf(err, MT_ERR_NOMEM,
                         "memory plan: %zu MiB for the pools cannot hold %d slots of %zu KiB and one %d-token sequence",
                         pools >> 20, slots, slot_b >> 10, w->o.max_context);
    long long pages = page_b ? (long long)((pools - (size_t)slots * slot_b) / page_b) : 1;
    if (pages > want_pages) pages = want_pages;
    if (pages > INT32_MAX / 2) pages = INT32_MAX / 2;
    mt_status st = glm_model_set_pools(m, (int)pages, slots, err);
    if (st != MT_OK) return st;
    ep->cache_budget_bytes = 0; /* the pools are the budget */
    mt_log(MT_LOG_INFO,
           "worker %d: memory plan: %zu MiB free of %zu MiB, %zu MiB kept for activations and graphs; pools: "
           "%lld pages of %d tokens (%zu KiB each, %zu MiB) = %lld tokens of DSA cache, %d slots (%zu KiB each, "
           "%zu MiB) = %d running sequences + %d kept prefixes + 1 graph pad; %lld full %d-token sequences fit",
           w->o.id, free_b >> 20, total_b >> 20, reserve >> 20, pages, page, page_b >> 10,
           (size_t)(pages * (long long)page_b) >> 20, pages * page, slots, slot_b >> 10,
           ((size_t)slots * slot_b) >> 20, ep->max_sequences, prefix_slots, page_b ? pages / full : (long long)slots,
           w->o.max_context);
    return MT_OK;
}

static void usage(FILE *f) {
    fprintf(f,
            "usage: metrale-worker --model DIR --router ENDPOINT --id N [--backend cpu|cuda|auto]\n"
            "                      [--device N] [--max-sequences N] [--max-context N] [--threads N]\n"
            "                      [--router-timeout S] [--cache-budget-mb N] [--prefill-budget N]\n"
            "                      [--graph-max-batch N] [--no-preempt] [--no-run-ahead] [--verbose]\n"
            "                      [--numerics exact|bf16]\n"
            "  Serves the checkpoint in DIR to the router at ENDPOINT (ipc:// or tcp://127.0.0.1:) as worker N.\n"
            "  --model: a checkpoint folder, or random:tiny / random:bench-4L (random weights, for benchmarks).\n"
            "  --backend: cpu (default), cuda (GPU --device, default 0), or auto (cuda when a GPU is usable).\n"
            "  --max-sequences: running sequences at once (default 16); --max-context: prompt + new tokens\n"
            "  per request (default 4096); --threads: CPU backend threads (0 = all cores); --router-timeout:\n"
            "  seconds without a message from the router before exiting (default 10); --cache-budget-mb:\n"
            "  the sequence-state pools (default 0: the free memory after the weights, less a reserve for\n"
            "  activations and graphs); --prefill-budget: prompt tokens prefilled per step beside decoding\n"
            "  (the chunk size of a long prompt; default 2048). A request waits while the pools are short,\n"
            "  and a running one that runs out of cache pages is preempted (its state recomputed later);\n"
            "  --graph-max-batch: decode steps of up to N sequences replay CUDA graphs (buckets 1, 2, 4, ...;\n"
            "  default 64), larger ones run eagerly; --no-preempt: admit a request only when pages for its\n"
            "  whole length are free (nothing is ever preempted; fewer run together); --no-run-ahead: a batch\n"
            "  of greedy requests reads each step's tokens before queuing the next (by default the next step\n"
            "  is queued on the device's own tokens first, so the GPU does not wait for the host; the CPU backend\n"
            "  never runs ahead, as it would only delay each token by a step); --numerics (GPU): how prefill\n"
            "  GEMMs take the activations, exact (default: two bf16 parts, the GPU's logits match the CPU's)\n"
            "  or bf16 (rounded once: faster, ~1e-3 relative error, near-tied router choices may flip).\n");
}

/* ---- sending ---- */

/* Sends env while linked; a failure (no router connected for MT_WIRE_DEALER_SEND_MS) unlinks.
 * Any thread. */
static void send_env(worker *w, mt_envelope *env) {
    mt_error err;
    pthread_mutex_lock(&w->sock_mu);
    if (w->linked && mt_wire_send(w->wire, NULL, env, &err) != MT_OK) {
        w->linked = false;
        w->link_lost = true;
        mt_log(MT_LOG_WARN, "worker %d: router unreachable (%s)", w->o.id, err.msg);
    }
    pthread_mutex_unlock(&w->sock_mu);
}

/* Engine thread: after a failed send the router's streams are gone, so drop every live sequence
 * without sending, and say Hello again. */
static void check_link(worker *w) {
    pthread_mutex_lock(&w->sock_mu);
    const bool lost = w->link_lost;
    w->link_lost = false;
    pthread_mutex_unlock(&w->sock_mu);
    if (!lost) return;
    eng_stats st;
    eng_get_stats(w->eng, &st);
    if (st.live_sequences) mt_log(MT_LOG_WARN, "worker %d: dropping %d sequences", w->o.id, st.live_sequences);
    w->quiet = true;
    eng_abort_all(w->eng, ENG_FINISH_CANCELLED, "router unreachable");
    w->quiet = false;
    w->next_hello = mt_now();
}

/* Engine thread. */
static void send_hello(worker *w) {
    const glm_config *c = glm_model_config(w->m);
    Metrale__V1__ModelInfo mi = METRALE__V1__MODEL_INFO__INIT;
    mi.model_type = "glm5_next";
    mi.vocab_size = (uint32_t)c->vocab_size;
    mi.max_context = (uint32_t)w->o.max_context;
    mi.num_layers = (uint32_t)c->num_hidden_layers;
    mi.hidden_size = (uint32_t)c->hidden_size;
    mi.eos_token_id = c->eos_token_id;
    mi.backend = (char *)w->backend_name;
    Metrale__Internal__V1__Hello h = METRALE__INTERNAL__V1__HELLO__INIT;
    h.worker_id = (uint32_t)w->o.id;
    h.model = &mi;
    h.max_sequences = (uint32_t)w->o.max_sequences;
    mt_envelope env = METRALE__INTERNAL__V1__ENVELOPE__INIT;
    env.body_case = METRALE__INTERNAL__V1__ENVELOPE__BODY_HELLO;
    env.hello = &h;
    mt_error err;
    pthread_mutex_lock(&w->sock_mu);
    const mt_status st = mt_wire_send(w->wire, NULL, &env, &err);
    if (st == MT_OK) w->linked = true;
    pthread_mutex_unlock(&w->sock_mu);
    if (st == MT_OK) {
        w->last_hello = mt_now();
        mt_log(MT_LOG_INFO, "worker %d: hello sent to %s (%s, vocab %d, context %d, %d sequences)", w->o.id,
               w->o.router, w->backend_name, c->vocab_size, w->o.max_context, w->o.max_sequences);
    } else {
        w->next_hello = mt_now() + HELLO_RETRY_S;
        mt_log(MT_LOG_DEBUG, "worker %d: hello not sent: %s", w->o.id, err.msg);
    }
}

/* Engine thread: publishes the counters for the heartbeat thread and marks progress. */
static void publish_stats(worker *w) {
    eng_stats st;
    eng_get_stats(w->eng, &st);
    pthread_mutex_lock(&w->stats_mu);
    w->stats = st;
    w->progress_at = mt_now();
    pthread_mutex_unlock(&w->stats_mu);
}

/* Heartbeat thread: one Heartbeat every HEARTBEAT_S while linked and the engine thread lives. */
static void *heartbeat_main(void *arg) {
    worker *w = arg;
    double next = mt_now();
    for (;;) {
        pthread_mutex_lock(&w->stats_mu);
        const bool stop = w->stop_beating;
        const eng_stats st = w->stats;
        const double progress_at = w->progress_at;
        pthread_mutex_unlock(&w->stats_mu);
        if (stop) return NULL;
        const double now = mt_now();
        if (now >= next) {
            next = now + HEARTBEAT_S;
            if (now - progress_at > STALL_S) {
                mt_log(MT_LOG_ERROR, "worker %d: engine thread stuck for %.0f s; heartbeats stop", w->o.id,
                       now - progress_at);
                next = now + 10.0; /* log again later, beat again if it recovers */
                continue;
            }
            Metrale__V1__WorkerStats ws = METRALE__V1__WORKER_STATS__INIT;
            ws.worker_id = (uint32_t)w->o.id;
            ws.alive = true;
            ws.live_sequences = (uint32_t)st.live_sequences;
            ws.cache_bytes_in_use = st.cache_bytes_in_use;
            ws.cache_bytes_baseline = 0; /* only per-sequence state is counted; none with no sequence */
            ws.sequences_finished = st.sequences_finished;
            ws.sequences_aborted = st.sequences_aborted;
            ws.prefix_hits = st.prefix_hits;
            ws.prefix_misses = st.prefix_misses;
            ws.prefix_cache_bytes = st.prefix_cache_bytes;
            ws.preemptions = st.preemptions;
            ws.cache_pages_free = (uint32_t)st.pages_free;
            ws.cache_pages_total = (uint32_t)st.pages_total;
            ws.slots_free = (uint32_t)st.slots_free;
            ws.slots_total = (uint32_t)st.slots_total;
            Metrale__Internal__V1__Heartbeat hb = METRALE__INTERNAL__V1__HEARTBEAT__INIT;
            hb.stats = &ws;
            mt_envelope env = METRALE__INTERNAL__V1__ENVELOPE__INIT;
            env.body_case = METRALE__INTERNAL__V1__ENVELOPE__BODY_HEARTBEAT;
            env.heartbeat = &hb;
            pthread_mutex_lock(&w->sock_mu);
            hb.seq = ++w->hb_seq;
            pthread_mutex_unlock(&w->sock_mu);
            send_env(w, &env);
        }
        struct timespec ts = { 0, 20 * 1000 * 1000 };
        nanosleep(&ts, NULL);
    }
}

/* Finished for id with usage; message may be NULL. */
static void send_finished(worker *w, uint64_t id, eng_finish reason, int prompt_tokens, int completion_tokens,
                          const char *message) {
    Metrale__V1__Usage u = METRALE__V1__USAGE__INIT;
    u.prompt_tokens = (uint32_t)prompt_tokens;
    u.completion_tokens = (uint32_t)completion_tokens;
    Metrale__V1__Final fin = METRALE__V1__FINAL__INIT;
    fin.finish_reason = (Metrale__V1__FinishReason)reason;
    fin.usage = &u;
    fin.error_message = (char *)(message ? message : "");
    Metrale__Internal__V1__Finished f = METRALE__INTERNAL__V1__FINISHED__INIT;
    f.id = id;
    f.final = &fin;
    mt_envelope env = METRALE__INTERNAL__V1__ENVELOPE__INIT;
    env.body_case = METRALE__INTERNAL__V1__ENVELOPE__BODY_FINISHED;
    env.finished = &f;
    send_env(w, &env);
}

/* ---- engine callbacks ---- */

static void on_tokens(void *user, uint64_t id, const eng_sample_result *toks, int n) {
    worker *w = user;
    if (w->quiet) return;
    Metrale__V1__GeneratedToken gt[n];
    Metrale__V1__GeneratedToken *gtp[n];
    Metrale__V1__TokenLogprob lp[n][ENG_TOP_LOGPROBS_MAX];
    Metrale__V1__TokenLogprob *lpp[n][ENG_TOP_LOGPROBS_MAX];
    for (int i = 0; i < n; i++) {
        gt[i] = (Metrale__V1__GeneratedToken)METRALE__V1__GENERATED_TOKEN__INIT;
        gt[i].token_id = (uint32_t)toks[i].token;
        gt[i].logprob = toks[i].logprob; /* 0 (not serialised) unless asked for */
        for (int k = 0; k < toks[i].n_top; k++) {
            lp[i][k] = (Metrale__V1__TokenLogprob)METRALE__V1__TOKEN_LOGPROB__INIT;
            lp[i][k].token_id = (uint32_t)toks[i].top_ids[k];
            lp[i][k].logprob = toks[i].top_logprobs[k];
            lpp[i][k] = &lp[i][k];
        }
        gt[i].n_top_logprobs = (size_t)toks[i].n_top;
        gt[i].top_logprobs = toks[i].n_top ? lpp[i] : NULL;
        gtp[i] = &gt[i];
    }
    Metrale__Internal__V1__Tokens t = METRALE__INTERNAL__V1__TOKENS__INIT;
    t.id = id;
    t.n_tokens = (size_t)n;
    t.tokens = gtp;
    mt_envelope env = METRALE__INTERNAL__V1__ENVELOPE__INIT;
    env.body_case = METRALE__INTERNAL__V1__ENVELOPE__BODY_TOKENS;
    env.tokens = &t;
    send_env(w, &env);
}

static void on_finished(void *user, uint64_t id, const eng_finish_info *f) {
    worker *w = user;
    if (f->reason == ENG_FINISH_ERROR)
        mt_log(MT_LOG_WARN, "worker %d: sequence %llu failed: %s", w->o.id, (unsigned long long)id, f->message);
    if (w->quiet) return;
    send_finished(w, id, f->reason, f->prompt_tokens, f->completion_tokens, f->message);
}

/* ---- receiving ---- */

/* Builds the engine's request from a Submit's GenerateRequest; ids and stop ids are copied into
 * the caller's buffers (n entries each). MT_ERR_INVALID with a message on what the engine cannot
 * express (ids above INT32_MAX, top_logprobs above the limit, prompt text). */
static mt_status request_from_proto(const Metrale__V1__GenerateRequest *g, int32_t *prompt, int32_t *stops,
                                    eng_request *r, mt_error *err) {
    *r = eng_default_request();
    if (g->prompt_text && g->prompt_text[0])
        return mt_errorf(err, MT_ERR_INVALID, "prompt_text is not supported (no tokenizer yet)");
    for (size_t i = 0; i < g->n_prompt_token_ids; i++) {
        if (g->prompt_token_ids[i] > INT32_MAX)
            return mt_errorf(err, MT_ERR_INVALID, "prompt token %u at index %zu is outside the vocabulary",
                             g->prompt_token_ids[i], i);
        prompt[i] = (int32_t)g->prompt_token_ids[i];
    }
    r->prompt = prompt;
    r->n_prompt = (int)g->n_prompt_token_ids;
    if (g->top_logprobs > ENG_TOP_LOGPROBS_MAX)
        return mt_errorf(err, MT_ERR_INVALID, "top_logprobs must be <= %d, got %u", ENG_TOP_LOGPROBS_MAX,
                         g->top_logprobs);
    r->logprobs = g->logprobs;
    r->top_logprobs = (int)g->top_logprobs;
    const Metrale__V1__SamplingParams *s = g->sampling;
    if (s) { /* the API's "0 = off" encoding */
        r->sampling.temperature = s->temperature;
        r->sampling.top_k = s->top_k;
        r->sampling.top_p = s->top_p == 0.0f ? 1.0f : s->top_p;
        r->sampling.min_p = s->min_p;
        r->sampling.repetition_penalty = s->repetition_penalty == 0.0f ? 1.0f : s->repetition_penalty;
        r->sampling.presence_penalty = s->presence_penalty;
        r->sampling.frequency_penalty = s->frequency_penalty;
        r->has_seed = s->has_seed;
        r->seed = s->seed;
    }
    const Metrale__V1__StoppingCriteria *st = g->stopping;
    r->max_new_tokens = 0; /* required: the engine says so when missing */
    if (st) {
        r->max_new_tokens = st->max_new_tokens > INT32_MAX ? INT32_MAX : (int)st->max_new_tokens;
        for (size_t i = 0; i < st->n_stop_token_ids; i++) {
            if (st->stop_token_ids[i] > INT32_MAX)
                return mt_errorf(err, MT_ERR_INVALID, "stop token %u at index %zu is outside the vocabulary",
                                 st->stop_token_ids[i], i);
            stops[i] = (int32_t)st->stop_token_ids[i];
        }
        r->stop_ids = stops;
        r->n_stop = (int)st->n_stop_token_ids;
        r->ignore_eos = st->ignore_eos;
    }
    return MT_OK;
}

static void on_submit(worker *w, const Metrale__Internal__V1__Submit *s) {
    if (!s->request) {
        mt_log(MT_LOG_WARN, "worker %d: submit %llu without a request", w->o.id, (unsigned long long)s->id);
        send_finished(w, s->id, ENG_FINISH_ERROR, 0, 0, "worker: submit without a request");
        return;
    }
    const Metrale__V1__GenerateRequest *g = s->request;
    const size_t n_stop = g->stopping ? g->stopping->n_stop_token_ids : 0;
    int32_t *buf = malloc(sizeof(int32_t) * (g->n_prompt_token_ids + n_stop + 1));
    mt_error err = { "" };
    eng_request r;
    mt_status st = !buf ? mt_errorf(&err, MT_ERR_NOMEM, "worker: out of memory for a request")
                        : request_from_proto(g, buf, buf + g->n_prompt_token_ids, &r, &err);
    if (st == MT_OK) st = eng_submit(w->eng, s->id, &r, s->deadline_unix_ms, &err);
    free(buf);
    if (st == MT_OK) {
        mt_log(MT_LOG_DEBUG, "worker %d: submit %llu: %zu prompt tokens", w->o.id, (unsigned long long)s->id,
               g->n_prompt_token_ids);
        return;
    }
    mt_log(MT_LOG_WARN, "worker %d: submit %llu refused: %s", w->o.id, (unsigned long long)s->id, err.msg);
    if (strstr(err.msg, "already live")) return; /* answering would end the live one's stream */
    send_finished(w, s->id, ENG_FINISH_ERROR, (int)g->n_prompt_token_ids, 0, err.msg);
}

static eng_finish finish_from_proto(Metrale__V1__FinishReason r) {
    switch (r) {
    case METRALE__V1__FINISH_REASON__FINISH_REASON_LENGTH: return ENG_FINISH_LENGTH;
    case METRALE__V1__FINISH_REASON__FINISH_REASON_STOP: return ENG_FINISH_STOP;
    case METRALE__V1__FINISH_REASON__FINISH_REASON_ERROR: return ENG_FINISH_ERROR;
    default: return ENG_FINISH_CANCELLED;
    }
}

/* Handles one envelope; true on Shutdown. */
static bool on_envelope(worker *w, mt_envelope *env) {
    switch (env->body_case) {
    case METRALE__INTERNAL__V1__ENVELOPE__BODY_SUBMIT:
        on_submit(w, env->submit);
        return false;
    case METRALE__INTERNAL__V1__ENVELOPE__BODY_ABORT:
        if (eng_abort(w->eng, env->abort->id, finish_from_proto(env->abort->reason), "aborted by the router") != MT_OK)
            mt_log(MT_LOG_DEBUG, "worker %d: abort of %llu, which is not live", w->o.id,
                   (unsigned long long)env->abort->id);
        return false;
    case METRALE__INTERNAL__V1__ENVELOPE__BODY_HEARTBEAT:
        /* The router does not know us (it restarted): our streams are gone; Hello again. */
        if (env->heartbeat->hello_wanted && mt_now() - w->last_hello > HELLO_WANTED_QUIET_S) {
            pthread_mutex_lock(&w->sock_mu);
            const bool was_linked = w->linked; /* else a Hello is on its way already */
            if (was_linked) {
                w->linked = false;
                w->link_lost = true;
            }
            pthread_mutex_unlock(&w->sock_mu);
            if (was_linked) mt_log(MT_LOG_WARN, "worker %d: the router asks for a Hello (it restarted)", w->o.id);
        }
        return false;
    case METRALE__INTERNAL__V1__ENVELOPE__BODY_SHUTDOWN:
        mt_log(MT_LOG_INFO, "worker %d: shutdown from the router", w->o.id);
        return true;
    default:
        w->dropped_msgs++;
        mt_log(MT_LOG_WARN, "worker %d: unexpected message (body %d) from the router; dropped", w->o.id,
               (int)env->body_case);
        return false;
    }
}

/* Waits up to timeout_ms for the first envelope, then takes what is queued, RECV_BATCH at most.
 * Returns true on Shutdown. */
static bool receive(worker *w, int timeout_ms) {
    for (int i = 0; i < RECV_BATCH; i++) {
        mt_envelope *env = NULL;
        mt_error err;
        pthread_mutex_lock(&w->sock_mu);
        mt_status st = mt_wire_recv(w->wire, i == 0 ? timeout_ms : 0, NULL, &env, &err);
        pthread_mutex_unlock(&w->sock_mu);
        if (st == MT_ERR_NOT_FOUND) return false;
        w->last_rx = mt_now();
        if (st != MT_OK) {
            w->dropped_msgs++;
            mt_log(MT_LOG_WARN, "worker %d: %s; dropped", w->o.id, err.msg);
            continue;
        }
        const bool shutdown = on_envelope(w, env);
        mt_wire_free(env);
        if (shutdown) return true;
    }
    return false;
}

/* ---- main ---- */

static int parse_int(const char *flag, const char *v, int lo, int *out) {
    char *end;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (errno || end == v || *end || x < lo || x > INT32_MAX) {
        fprintf(stderr, "error: %s must be an integer >= %d, got \"%s\"\n", flag, lo, v);
        return -1;
    }
    *out = (int)x;
    return 0;
}

static int parse_args(int argc, char **argv, worker_opts *o) {
    *o = (worker_opts){ .backend = "cpu", .id = -1, .max_sequences = 16, .max_context = 4096,
                        .router_timeout = ROUTER_SILENCE_S, .numerics = MT_NUMERICS_EXACT };
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) { usage(stdout); return 1; }
        if (!strcmp(a, "--verbose")) { o->verbose = true; continue; }
        if (!strcmp(a, "--no-preempt")) { o->no_preempt = true; continue; }
        if (!strcmp(a, "--no-run-ahead")) { o->no_run_ahead = true; continue; }
        if (!v) { fprintf(stderr, "error: %s needs a value\n", a); usage(stderr); return -1; }
        int rc = 0;
        if (!strcmp(a, "--model")) o->model = v;
        else if (!strcmp(a, "--router")) o->router = v;
        else if (!strcmp(a, "--backend")) o->backend = v;
        else if (!strcmp(a, "--id")) rc = parse_int(a, v, 0, &o->id);
        else if (!strcmp(a, "--device")) rc = parse_int(a, v, 0, &o->device);
        else if (!strcmp(a, "--max-sequences")) rc = parse_int(a, v, 1, &o->max_sequences);
        else if (!strcmp(a, "--max-context")) {
            rc = parse_int(a, v, 2, &o->max_context);
            if (!rc && o->max_context > (1 << 24)) { /* page and token arithmetic stays in int */
                fprintf(stderr, "error: --max-context must be at most %d, got %d\n", 1 << 24, o->max_context);
                rc = -1;
            }
        }
        else if (!strcmp(a, "--cache-budget-mb")) {
            int mb = 0;
            rc = parse_int(a, v, 0, &mb);
            o->cache_budget_mb = mb;
        }
        else if (!strcmp(a, "--threads")) rc = parse_int(a, v, 0, &o->threads);
        else if (!strcmp(a, "--prefill-budget")) rc = parse_int(a, v, 1, &o->prefill_budget);
        else if (!strcmp(a, "--graph-max-batch")) rc = parse_int(a, v, 1, &o->graph_max_batch);
        else if (!strcmp(a, "--numerics")) {
            if (!mt_numerics_parse(v, &o->numerics) || o->numerics == MT_NUMERICS_FP32) {
                fprintf(stderr, "error: --numerics must be exact or bf16, got \"%s\"\n", v);
                return -1;
            }
        }
        else if (!strcmp(a, "--router-timeout")) {
            char *end;
            o->router_timeout = strtod(v, &end);
            if (end == v || *end || !(o->router_timeout > 0 && o->router_timeout <= 86400)) {
                fprintf(stderr, "error: --router-timeout must be seconds in (0, 86400], got \"%s\"\n", v);
                return -1;
            }
        }
        else { fprintf(stderr, "error: unknown option %s\n", a); usage(stderr); return -1; }
        if (rc) return -1;
        i++;
    }
    if (!o->model || !o->router || o->id < 0) {
        fprintf(stderr, "error: --model, --router and --id are required\n");
        usage(stderr);
        return -1;
    }
    if (strcmp(o->backend, "cpu") && strcmp(o->backend, "cuda") && strcmp(o->backend, "auto")) {
        fprintf(stderr, "error: --backend must be cpu, cuda or auto, got %s\n", o->backend);
        return -1;
    }
    return 0;
}

/* The backend named by the options; "auto" falls back to the CPU when no GPU is usable. */
static mt_backend *open_backend(worker *w, mt_error *err) {
    const worker_opts *o = &w->o;
    if (strcmp(o->backend, "cpu")) {
        mt_cuda_params cp = mt_cuda_default_params();
        cp.numerics = o->numerics;
        mt_backend *be = mt_cuda_backend_new(o->device, &cp, err);
        if (be) {
            w->backend_name = "cuda";
            return be;
        }
        if (!strcmp(o->backend, "cuda")) return NULL;
        mt_log(MT_LOG_INFO, "worker %d: no usable GPU (%s); using the CPU backend", o->id, err->msg);
    }
    w->backend_name = "cpu";
    mt_backend *be = mt_cpu_backend_new(o->threads);
    if (!be) mt_errorf(err, MT_ERR_NOMEM, "out of memory for the CPU backend");
    return be;
}

int main(int argc, char **argv) {
    worker w = { .sock_mu = PTHREAD_MUTEX_INITIALIZER, .stats_mu = PTHREAD_MUTEX_INITIALIZER };
    int rc = parse_args(argc, argv, &w.o);
    if (rc) return rc > 0 ? 0 : 2;
    if (w.o.verbose) mt_log_set_level(MT_LOG_DEBUG);

    struct sigaction sa = { 0 };
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);

    mt_error err = { "" };
    mt_backend *be = NULL;
    rc = 1;
    const double t0 = mt_now();
    if (!(be = open_backend(&w, &err))) {
        mt_log(MT_LOG_ERROR, "worker %d: %s backend: %s", w.o.id, w.o.backend, err.msg);
        goto done;
    }
    /* --model random:PRESET (tiny, bench-4L): random weights made on the backend from a fixed seed,
     * for benchmarks of the real shapes without a checkpoint file */
    glm_model_params mp = glm_model_default_params();
    if (w.o.graph_max_batch > 0) mp.graph_max_rows = w.o.graph_max_batch;
    if (!strncmp(w.o.model, "random:", 7)) {
        glm_config cfg;
        if (glm_config_preset(w.o.model + 7, &cfg, &err) != MT_OK ||
            glm_model_new_random(&cfg, 1, be, &mp, &w.m, &err) != MT_OK) {
            mt_log(MT_LOG_ERROR, "worker %d: %s", w.o.id, err.msg);
            goto done;
        }
    } else if (glm_model_load(w.o.model, be, &mp, &w.m, &err) != MT_OK) {
        mt_log(MT_LOG_ERROR, "worker %d: %s", w.o.id, err.msg);
        goto done;
    }
    eng_params ep = eng_default_params();
    ep.max_sequences = w.o.max_sequences;
    ep.max_context = w.o.max_context;
    if (w.o.prefill_budget > 0) ep.prefill_budget = w.o.prefill_budget;
    ep.preempt = !w.o.no_preempt;
    ep.run_ahead = w.o.no_run_ahead ? ENG_RUN_AHEAD_OFF : ENG_RUN_AHEAD_AUTO;
    if (plan_memory(&w, be, &ep, &err) != MT_OK) {
        mt_log(MT_LOG_ERROR, "worker %d: %s", w.o.id, err.msg);
        goto done;
    }
    eng_callbacks cb = { .user = &w, .on_tokens = on_tokens, .on_finished = on_finished };
    if (eng_new(w.m, &ep, &cb, &w.eng, &err) != MT_OK) {
        mt_log(MT_LOG_ERROR, "worker %d: %s", w.o.id, err.msg);
        goto done;
    }
    char identity[MT_WIRE_PEER_MAX];
    snprintf(identity, sizeof identity, "w%d", w.o.id);
    if (mt_wire_open(MT_WIRE_DEALER, w.o.router, identity, &w.wire, &err) != MT_OK) {
        mt_log(MT_LOG_ERROR, "worker %d: %s", w.o.id, err.msg);
        goto done;
    }
    const glm_config *c = glm_model_config(w.m);
    mt_log(MT_LOG_INFO, "worker %d: loaded %s (%d layers, hidden %d, vocab %d) on %s in %.2f s", w.o.id, w.o.model,
           c->num_hidden_layers, c->hidden_size, c->vocab_size, w.backend_name, mt_now() - t0);

    w.last_rx = w.next_hello = mt_now();
    publish_stats(&w);
    pthread_t hb;
    if (pthread_create(&hb, NULL, heartbeat_main, &w) != 0) {
        mt_log(MT_LOG_ERROR, "worker %d: cannot start the heartbeat thread", w.o.id);
        goto done;
    }
    bool shutdown = false, silent = false;
    while (!g_stop && !shutdown) {
        check_link(&w);
        pthread_mutex_lock(&w.sock_mu);
        const bool linked = w.linked;
        pthread_mutex_unlock(&w.sock_mu);
        if (!linked && mt_now() >= w.next_hello) send_hello(&w);
        shutdown = receive(&w, eng_has_work(w.eng) ? 0 : IDLE_WAIT_MS);
        if (shutdown || g_stop) break;
        /* checked right after draining the socket, so a long step cannot look like silence */
        if (mt_now() - w.last_rx > w.o.router_timeout) {
            silent = true;
            break;
        }
        if (eng_has_work(w.eng)) eng_step(w.eng, NULL);
        publish_stats(&w);
    }
    pthread_mutex_lock(&w.stats_mu);
    w.stop_beating = true;
    pthread_mutex_unlock(&w.stats_mu);
    pthread_join(hb, NULL);
    if (silent) {
        mt_log(MT_LOG_ERROR, "worker %d: nothing from the router for %.1f s; exiting", w.o.id, w.o.router_timeout);
        goto done;
    }
    mt_log(MT_LOG_INFO, "worker %d: exiting (%s; %llu malformed or unexpected messages dropped)", w.o.id,
           shutdown ? "shutdown" : "signal", (unsigned long long)w.dropped_msgs);
    rc = 0;
done:
    if (w.eng) /* Finished(CANCELLED) for each live sequence while the router is reachable */
        eng_abort_all(w.eng, ENG_FINISH_CANCELLED, "worker shutting down");
    eng_free(w.eng);
    mt_wire_close(w.wire);
    glm_model_free(w.m);
    mt_backend_free(be);
    return rc;
}
