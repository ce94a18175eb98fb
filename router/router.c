/* router/router.c: see router.h.
 *
 * A stream is one Generate call. Its life:
 *   QUEUED   validated, waiting in the admission queue (or going straight to a worker);
 *   RUNNING  submitted to `worker`; Tokens accumulate in `pending` until the call can send;
 *            Finished sends the rest with the final message and the OK status, and ends it;
 *            the request is kept until the first Tokens, so that a stream whose worker dies
 *            before then goes back to the queue (QUEUED again) for another worker;
 *            When a drain runs out of time the stream is cut: the worker gets Abort(CANCELLED)
 *            and its Finished gives the final message (CANCELLED, the token counts) and OK; a
 *            worker that does not answer within CUT_GRACE_S gets a final made here from what the
 *            router counted;
 *   ABORTING the client is gone (cancel, disconnect, deadline, shutdown) after submission:
 *            the worker got Abort; the stream waits (without a call) for the worker's Finished,
 *            which frees the worker's slot; a worker that never answers is given up on after
 *            ABORT_GIVE_UP_S.
 * Streams are in an id hash (for the worker's messages) and a list (for scans).
 *
 * Text: a stream's messages carry the text of the Tokens they batch, concatenated (each piece is
 * whole UTF-8 characters), and the echo's prompt logprobs; the final message adds the text the
 * worker held back (Finished.text). A Finished with invalid_argument (the worker refused the
 * text: not UTF-8, too long once tokenized, a template that failed) ends the call
 * INVALID_ARGUMENT instead.
 *
 * A Tokenize call is an rtr_tokenize entry: sent to the least loaded live worker (full or not:
 * it takes no sequence slot) under an id of the streams' id space, answered when its Tokenized
 * comes back, UNAVAILABLE when that worker is lost, DEADLINE_EXCEEDED past the client's deadline
 * or TOKENIZE_TIMEOUT_S; a client that goes away drops the entry.
 */
#include "router/router.h"

#include <errno.h>
#include <math.h>
#include <poll.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/wire.h"
#include "proto/metrale/v1/metrale.pb-c.h"
#include "router/admission.h"
#include "router/grpc_server.h"
#include "router/auth.h"
#include "router/health.h"
#include "router/metrics.h"
#include "router/tls.h"
#include "router/validate.h"
#include "router/workers.h"

#define STREAM_BUCKETS 4096
#define ABORT_GIVE_UP_S 10.0
#define TICK_MS 50            /* timer granularity: deadlines, liveness, heartbeats */
#define DRAIN_TICK_MS 10      /* while draining: how often drain progress is checked */
#define WIRE_BATCH 1024       /* envelopes handled before looking at gRPC again */
#define DEADLINE_SLACK_S 0.1  /* a worker ending a sequence this close to its deadline ended it for the deadline */
#define PROBE_WINDOW_S 0.5    /* after a connection closed: how long the workers are probed */
#define PROBE_MS 10           /* ... and how often (a send to a gone worker fails at once) */
#define TOKENIZE_TIMEOUT_S 10.0 /* a Tokenize call without a nearer deadline is answered by then */
#define CUT_GRACE_S 1.0       /* a drain's cut streams wait this long for their worker's Finished */
#define LOG_PROMPT_BYTES 1024 /* --log-prompts: prompt text logged at most (a record stays a short line) */
#define LOG_PROMPT_IDS 256    /* ... and prompt ids */
#define REQUEUES_MAX 2        /* a stream goes back to the queue at most this often (a request
                                 that kills every worker it reaches must not go round forever) */

typedef enum stream_state { ST_QUEUED, ST_RUNNING, ST_ABORTING } stream_state;

typedef struct rtr_stream {
    uint64_t id;
    stream_state state;
    rtr_call *call;                    /* NULL once the client side is over */
    char *request_id;                  /* owned copy, echoed in responses */
    Metrale__V1__GenerateRequest *req; /* owned until the worker's first Tokens */
    rtr_worker *worker;                /* RUNNING, ABORTING */
    bool got_tokens;                   /* RUNNING: the worker sent Tokens */
    bool cut;                          /* RUNNING: the drain ran out; Abort sent, the call waits
                                          for the worker's Finished */
    uint32_t prompt_ids;               /* the request's prompt_token_ids (0 for text and chat) */
    uint32_t completion_tokens;        /* tokens received from workers for the client */
    double arrived, submitted;         /* mt_now() of its arrival and of its (last) submission */
    double last_tokens;                /* mt_now() of the worker's latest Tokens */
    int requeues;                      /* times it went back to the queue from a lost worker */
    double deadline;                   /* mt_now() clock; INFINITY = none */
    uint64_t deadline_unix_ms;
    double admitted_at;                /* mt_now() of admission, for the records' times */
    double abort_since;
    mt_envelope **pending;             /* owned Tokens envelopes not yet sent, in order */
    size_t npending, cap_pending;
    rtr_qnode qnode;
    struct rtr_stream *hnext;          /* id hash chain */
    struct rtr_stream *prev, *next;    /* all streams */
} rtr_stream;

/* A Tokenize call waiting for a worker's Tokenized. */
typedef struct rtr_tokenize {
    uint64_t id;                       /* TokenizeCall.id, from the streams' id space */
    rtr_call *call;                    /* always set: the entry goes when its call is answered or gone */
    rtr_worker *worker;
    double deadline;                   /* mt_now() clock: the client's, at most TOKENIZE_TIMEOUT_S */
    struct rtr_tokenize *prev, *next;
} rtr_tokenize;

/* RUNNING -> DRAIN_STREAMS (streams finish) -> DRAIN_CUT (the drain timeout passed: the streams
 * left are cut) -> DRAIN_WORKERS (Shutdown sent) -> DRAIN_GRPC -> STOPPED */
typedef enum drain_phase { RUNNING, DRAIN_STREAMS, DRAIN_CUT, DRAIN_WORKERS, DRAIN_GRPC, STOPPED } drain_phase;

struct rtr_router {
    rtr_router_params p;
    rtr_grpc *grpc;
    int port;
    rtr_tls *tls;                      /* NULL: plaintext */
    char *token_file;                  /* NULL: no bearer token */
    mt_wire_sock *wire;
    rtr_workers workers;
    rtr_admission queue;
    rtr_health health;
    rtr_metrics *metrics;
    int metrics_port;                  /* 0: no endpoint */
    rtr_stream *buckets[STREAM_BUCKETS];
    rtr_stream *streams;
    size_t nstreams;
    rtr_tokenize *tokenizes;           /* pending Tokenize calls (few and short: a list) */
    uint64_t next_id;
    uint64_t heartbeat_seq;
    double next_heartbeat;
    double next_tick;
    double probe_until, next_probe; /* probing the workers after a connection closed */
    drain_phase phase;
    double phase_deadline;
    bool worker_gone[MT_WIRE_WORKERS_MAX]; /* DRAIN_WORKERS: index in workers.w[] has left */
    /* counters for GetStats */
    uint32_t running;
    uint64_t requests_total, requests_rejected, streams_requeued;
    double last_unknown_log;
};

rtr_router_params rtr_router_default_params(void) {
    return (rtr_router_params){
        .listen = "127.0.0.1:50051",
        .workers_endpoint = "ipc:///tmp/metrale-router/workers.sock", /* the folder made 0700 */
        .queue_capacity = 1024,
        .drain_timeout_s = 30,
        .dead_after_s = MT_WIRE_WORKER_DEAD_S,
        .workers_exit_s = 3,
        .drain_fd = -1,
        .reload_fd = -1,
    };
}

/* ---- streams ---- */

static size_t bucket_of(uint64_t id) { return (size_t)(id * 0x9E3779B97F4A7C15ull >> 52) % STREAM_BUCKETS; }

static rtr_stream *stream_find(rtr_router *r, uint64_t id) {
    for (rtr_stream *s = r->buckets[bucket_of(id)]; s; s = s->hnext)
        if (s->id == id) return s;
    return NULL;
}

static rtr_stream *stream_new(rtr_router *r, Metrale__V1__GenerateRequest *req, rtr_call *call) {
    rtr_stream *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    if (!(s->request_id = strdup(req->request_id))) {
        free(s);
        return NULL;
    }
    s->id = r->next_id++;
    s->state = ST_QUEUED;
    s->call = call;
    s->req = req;
    s->prompt_ids = (uint32_t)req->n_prompt_token_ids;
    s->deadline = rtr_call_deadline(call);
    s->deadline_unix_ms = rtr_call_deadline_unix_ms(call);
    s->admitted_at = s->arrived = mt_now();
    size_t b = bucket_of(s->id);
    s->hnext = r->buckets[b];
    r->buckets[b] = s;
    s->next = r->streams;
    if (r->streams) r->streams->prev = s;
    r->streams = s;
    r->nstreams++;
    rtr_call_set_stream(call, s);
    return s;
}

static void stream_drop_pending(rtr_stream *s) {
    for (size_t i = 0; i < s->npending; i++) mt_wire_free(s->pending[i]);
    s->npending = 0;
}

/* Detaches the call (if any), leaves every index and frees the stream. */
static void stream_free(rtr_router *r, rtr_stream *s) {
    if (s->call) rtr_call_set_stream(s->call, NULL);
    rtr_admission_remove(&r->queue, &s->qnode);
    if (s->state == ST_RUNNING) r->running--;
    rtr_stream **pp = &r->buckets[bucket_of(s->id)];
    while (*pp != s) pp = &(*pp)->hnext;
    *pp = s->hnext;
    if (s->prev) s->prev->next = s->next;
    else r->streams = s->next;
    if (s->next) s->next->prev = s->prev;
    r->nstreams--;
    stream_drop_pending(s);
    free(s->pending);
    if (s->req) metrale__v1__generate_request__free_unpacked(s->req, NULL);
    free(s->request_id);
    free(s);
}

static rtr_stream *stream_of_qnode(rtr_qnode *n) {
    return (rtr_stream *)((char *)n - offsetof(rtr_stream, qnode));
}

/* ---- records (router.h: "Logs") ---- */

static const char *status_name(grpc_status_code c) {
    static const char *const names[] = {
        "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
        "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE",
        "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED",
    };
    return (unsigned)c < sizeof names / sizeof names[0] ? names[c] : "UNKNOWN";
}

static const char *finish_name(Metrale__V1__FinishReason r) {
    switch (r) {
    case METRALE__V1__FINISH_REASON__FINISH_REASON_LENGTH: return "length";
    case METRALE__V1__FINISH_REASON__FINISH_REASON_STOP: return "stop";
    case METRALE__V1__FINISH_REASON__FINISH_REASON_CANCELLED: return "cancelled";
    case METRALE__V1__FINISH_REASON__FINISH_REASON_ERROR: return "error";
    default: return "unspecified";
    }
}

static double ms_since(double t) { return (mt_now() - t) * 1e3; }

/* The "finished" record of a stream whose client side ends now with code (details: why, for an
 * error; fin: the final message sent, for OK). */
static void log_finished(const rtr_stream *s, grpc_status_code code, const char *details,
                         const Metrale__V1__Final *fin) {
    const Metrale__V1__Usage *u = fin ? fin->usage : NULL;
    const mt_log_field f[] = {
        mt_logf_str("status", status_name(code)),
        mt_logf_str("finish_reason", fin ? finish_name(fin->finish_reason) : NULL),
        mt_logf_uint("prompt_tokens", u ? u->prompt_tokens : s->prompt_ids),
        mt_logf_uint("completion_tokens", u ? u->completion_tokens : s->completion_tokens),
        mt_logf_double("duration_ms", ms_since(s->admitted_at)),
        mt_logf_str("worker", s->worker ? s->worker->peer : NULL),
        mt_logf_int("requeues", s->requeues),
        mt_logf_str("details", code == GRPC_STATUS_OK ? NULL : details),
    };
    mt_log_event(code == GRPC_STATUS_OK || code == GRPC_STATUS_CANCELLED ? MT_LOG_INFO : MT_LOG_WARN, "finished",
                 s->request_id, f, sizeof f / sizeof f[0]);
}

/* The first byte of a valid cut of text at most max bytes long (not inside a UTF-8 character). */
static size_t utf8_cut(const char *text, size_t max) {
    size_t n = strlen(text);
    if (n <= max) return n;
    while (max > 0 && ((unsigned char)text[max] & 0xc0) == 0x80) max--;
    return max;
}

/* The prompt of req for an admitted record (--log-prompts): its ids as a JSON array, its text, or
 * its messages as a JSON array of {"role", "content"}, each cut to LOG_PROMPT_IDS ids or
 * LOG_PROMPT_BYTES bytes (*cut says so). A malloc'ed string (JSON for ids and messages), NULL
 * when out of memory. */
static char *prompt_for_log(const Metrale__V1__GenerateRequest *req, bool *json, bool *cut) {
    *cut = false;
    *json = true;
    char *out = NULL;
    if (req->n_prompt_token_ids) {
        const size_t n = req->n_prompt_token_ids < LOG_PROMPT_IDS ? req->n_prompt_token_ids : LOG_PROMPT_IDS;
        *cut = n < req->n_prompt_token_ids;
        if (!(out = malloc(12 * n + 3))) return NULL;
        size_t k = 0;
        out[k++] = '[';
        for (size_t i = 0; i < n; i++) k += (size_t)sprintf(out + k, i ? ",%u" : "%u", req->prompt_token_ids[i]);
        out[k++] = ']';
        out[k] = '\0';
        return out;
    }
    if (!req->n_messages) {
        *json = false;
        const char *t = req->prompt_text ? req->prompt_text : "";
        const size_t n = utf8_cut(t, LOG_PROMPT_BYTES);
        *cut = t[n] != '\0';
        if ((out = malloc(n + 1))) {
            memcpy(out, t, n);
            out[n] = '\0';
        }
        return out;
    }
    size_t len = 2, cap = 256, left = LOG_PROMPT_BYTES;
    if (!(out = malloc(cap))) return NULL;
    strcpy(out, "[");
    for (size_t i = 0; i < req->n_messages && left > 0; i++) {
        const Metrale__V1__ChatMessage *m = req->messages[i];
        const char *content = m->content ? m->content : "";
        const size_t keep = utf8_cut(content, left);
        *cut = *cut || content[keep] != '\0';
        left -= keep;
        char *piece = malloc(keep + 1);
        char *role = mt_json_quote(m->role ? m->role : ""), *text = NULL;
        if (piece) {
            memcpy(piece, content, keep);
            piece[keep] = '\0';
            text = mt_json_quote(piece);
        }
        const size_t need = (role ? strlen(role) : 0) + (text ? strlen(text) : 0) + 32;
        char *grown = len + need > cap ? realloc(out, cap = 2 * (len + need)) : out;
        const bool ok = piece && role && text && grown;
        if (ok) len += (size_t)sprintf(grown + len - 1, "%s{\"role\":%s,\"content\":%s}", i ? "," : "", role, text);
        free(piece);
        free(role);
        free(text);
        if (!ok) {
            free(grown ? grown : out);
            return NULL;
        }
        out = grown;
    }
    *cut = *cut || left == 0;
    strcpy(out + len - 1, "]");
    return out;
}

/* The "admitted" record: how the request came, and where it went (queued, or the worker). */
static void log_admitted(const rtr_router *r, const rtr_stream *s, const Metrale__V1__GenerateRequest *req) {
    bool json = false, cut = false;
    char *prompt = r->p.log_prompts ? prompt_for_log(req, &json, &cut) : NULL;
    const char *form = req->n_prompt_token_ids ? "ids" : req->n_messages ? "messages" : "text";
    const mt_log_field f[] = {
        mt_logf_uint("stream", s->id),
        mt_logf_str("prompt_form", form),
        mt_logf_uint("prompt_tokens", s->prompt_ids),
        mt_logf_uint("prompt_bytes", req->prompt_text ? strlen(req->prompt_text) : 0),
        mt_logf_uint("messages", req->n_messages),
        mt_logf_uint("max_new_tokens", req->stopping ? req->stopping->max_new_tokens : 0),
        isfinite(s->deadline) ? mt_logf_double("deadline_ms", (s->deadline - mt_now()) * 1e3)
                              : mt_logf_json("deadline_ms", NULL), /* none: left out */
        mt_logf_bool("queued", s->state == ST_QUEUED),
        mt_logf_str("worker", s->worker ? s->worker->peer : NULL),
        json ? mt_logf_json(req->n_prompt_token_ids ? "prompt_token_ids" : "prompt_messages", prompt)
             : mt_logf_str("prompt_text", prompt),
        mt_logf_json("prompt_truncated", prompt && cut ? "true" : NULL),
    };
    mt_log_event(MT_LOG_INFO, "admitted", s->request_id, f, sizeof f / sizeof f[0]);
    free(prompt);
}

/* Ends the client side with a status (no-op when it is already over). */
static void stream_end_call(rtr_router *r, rtr_stream *s, grpc_status_code code, const char *details) {
    if (!s->call) return;
    log_finished(s, code, details, NULL);
    rtr_metrics_request_ended(r->metrics, code);
    rtr_call_finish(s->call, code, details, NULL);
    rtr_call_set_stream(s->call, NULL);
    s->call = NULL;
}

/* ---- wire ---- */

/* A send that finds no connection (MT_ERR_NOT_FOUND) marks the worker gone; the event loop
 * declares it dead (reap_gone) outside whatever scan made the send. */
static mt_status send_env(rtr_router *r, rtr_worker *w, mt_envelope *env) {
    mt_error err;
    mt_status st = mt_wire_send(r->wire, w->peer, env, &err);
    if (st) {
        if (w->reachable && w->alive) mt_log(MT_LOG_WARN, "router: %s", err.msg);
        w->reachable = false; /* picked again once it is heard from */
        if (st == MT_ERR_NOT_FOUND) w->gone = true;
    }
    return st;
}

static void send_abort(rtr_router *r, rtr_stream *s, Metrale__V1__FinishReason reason) {
    mt_wire_msg m;
    send_env(r, s->worker, mt_wire_abort(&m, s->id, reason));
}

/* The client side of a submitted stream is over: tell the worker, wait for its Finished. */
static void stream_abort(rtr_router *r, rtr_stream *s, double now) {
    MT_ASSERT(s->state == ST_RUNNING);
    send_abort(r, s, METRALE__V1__FINISH_REASON__FINISH_REASON_CANCELLED);
    s->state = ST_ABORTING;
    s->abort_since = now;
    r->running--;
    stream_drop_pending(s);
}

/* The client side is over (on_done, deadline, drain): abort or forget the stream. A call still
 * attached lost its client without a status: cancelled, or its deadline passed. */
static void stream_client_gone(rtr_router *r, rtr_stream *s, double now) {
    if (s->call) {
        log_finished(s, GRPC_STATUS_CANCELLED, "the client went away", NULL);
        rtr_metrics_request_ended(r->metrics,
                                  now >= s->deadline ? GRPC_STATUS_DEADLINE_EXCEEDED : GRPC_STATUS_CANCELLED);
        rtr_call_set_stream(s->call, NULL);
        s->call = NULL;
    }
    if (s->state == ST_RUNNING) stream_abort(r, s, now);
    else if (s->state == ST_QUEUED) stream_free(r, s);
}

static mt_status stream_submit(rtr_router *r, rtr_stream *s, rtr_worker *w) {
    mt_wire_msg m;
    mt_status st = send_env(r, w, mt_wire_submit(&m, s->id, s->req, s->deadline_unix_ms));
    if (st) return st;
    s->got_tokens = false;
    s->submitted = mt_now();
    s->worker = w;
    s->state = ST_RUNNING;
    w->in_flight++;
    r->running++;
    return MT_OK;
}

/* Submits s to the least loaded worker with room; false when none takes it. */
static bool submit_now(rtr_router *r, rtr_stream *s) {
    rtr_worker *w;
    while ((w = rtr_workers_pick(&r->workers)))
        if (stream_submit(r, s, w) == MT_OK) return true;
    return false;
}

static void dispatch_queue(rtr_router *r) {
    while (rtr_admission_len(&r->queue) > 0) {
        rtr_qnode *n = rtr_admission_pop(&r->queue);
        rtr_stream *s = stream_of_qnode(n);
        if (!submit_now(r, s)) {
            rtr_admission_push_front(&r->queue, n);
            return;
        }
    }
}

/* Sends what the stream holds: pending tokens, their text and prompt logprobs; and when fin is
 * set, the final message (with tail, the text the worker held back until the end, after the
 * pending text) and the OK status, which ends the stream. Each piece of text is whole UTF-8
 * characters (the worker's promise), so their concatenation is valid UTF-8 too. */
static void stream_flush(rtr_router *r, rtr_stream *s, const Metrale__V1__Final *fin, const char *tail) {
    if (!s->call) return;
    if (!fin && (s->npending == 0 || rtr_call_send_busy(s->call))) return;
    size_t ntok = 0, nplp = 0, ntext = tail ? strlen(tail) : 0;
    for (size_t i = 0; i < s->npending; i++) {
        const Metrale__Internal__V1__Tokens *t = s->pending[i]->tokens;
        ntok += t->n_tokens;
        nplp += t->n_prompt_logprobs;
        ntext += t->text ? strlen(t->text) : 0;
    }
    /* Small messages (the common case: one envelope of a few tokens) need no allocation. */
    Metrale__V1__GeneratedToken *one[16];
    char small[256];
    Metrale__V1__GeneratedToken **toks = ntok + nplp <= 16 ? one : malloc((ntok + nplp) * sizeof *toks);
    char *text = ntext < sizeof small ? small : malloc(ntext + 1);
    if (!toks || !text) {
        if (toks != one) free(toks);
        if (text != small) free(text);
        /* Keep the tokens; the next flush (send done or Finished) tries again. At the end,
         * rather than a final message that skips tokens, an error. */
        if (fin) {
            stream_end_call(r, s, GRPC_STATUS_RESOURCE_EXHAUSTED, "router out of memory");
            stream_drop_pending(s);
        }
        return;
    }
    Metrale__V1__GeneratedToken **plp = toks + ntok;
    size_t k = 0, kp = 0, kt = 0;
    for (size_t i = 0; i < s->npending; i++) {
        const Metrale__Internal__V1__Tokens *t = s->pending[i]->tokens;
        for (size_t j = 0; j < t->n_tokens; j++) toks[k++] = t->tokens[j];
        for (size_t j = 0; j < t->n_prompt_logprobs; j++) plp[kp++] = t->prompt_logprobs[j];
        size_t n = t->text ? strlen(t->text) : 0;
        if (n) memcpy(text + kt, t->text, n);
        kt += n;
    }
    if (tail) {
        memcpy(text + kt, tail, strlen(tail));
        kt += strlen(tail);
    }
    text[kt] = '\0';
    Metrale__V1__GenerateResponse resp = METRALE__V1__GENERATE_RESPONSE__INIT;
    resp.request_id = s->request_id;
    resp.n_tokens = k;
    resp.tokens = toks;
    resp.n_prompt_logprobs = kp;
    resp.prompt_logprobs = plp;
    resp.text = text;
    resp.final = (Metrale__V1__Final *)fin;
    if (fin) {
        log_finished(s, GRPC_STATUS_OK, NULL, fin);
        rtr_metrics_request_ended(r->metrics, GRPC_STATUS_OK);
        rtr_call_finish(s->call, GRPC_STATUS_OK, NULL, &resp.base);
        rtr_call_set_stream(s->call, NULL);
        s->call = NULL;
    } else {
        rtr_call_send(s->call, &resp.base);
    }
    if (toks != one) free(toks);
    if (text != small) free(text);
    stream_drop_pending(s);
}

/* Ends a cut stream's call with a final message made here, for a worker that did not answer its
 * Abort: the tokens it holds, then FINISH_REASON_CANCELLED with the tokens the router passed on
 * (the prompt's are known here only for an id prompt) and the OK status. */
static void stream_end_cut(rtr_router *r, rtr_stream *s) {
    Metrale__V1__Usage usage = METRALE__V1__USAGE__INIT;
    usage.prompt_tokens = s->prompt_ids;
    usage.completion_tokens = s->completion_tokens;
    Metrale__V1__Final fin = METRALE__V1__FINAL__INIT;
    fin.finish_reason = METRALE__V1__FINISH_REASON__FINISH_REASON_CANCELLED;
    fin.usage = &usage;
    fin.error_message = "server shut down: the drain timeout ran out";
    stream_flush(r, s, &fin, NULL);
}

/* ---- tokenize calls ---- */

/* Detaches the call and frees the entry; a late Tokenized for it finds nothing. Alone: the
 * client is gone (cancel, disconnect, shutdown). */
static void tokenize_forget(rtr_router *r, rtr_tokenize *t) {
    rtr_call_set_tokenize(t->call, NULL);
    if (t->prev) t->prev->next = t->next;
    else r->tokenizes = t->next;
    if (t->next) t->next->prev = t->prev;
    free(t);
}

/* Answers the call (code, details, and the response when OK) and frees the entry. */
static void tokenize_end(rtr_router *r, rtr_tokenize *t, grpc_status_code code, const char *details,
                         const ProtobufCMessage *resp) {
    rtr_call_finish(t->call, code, details, resp);
    tokenize_forget(r, t);
}

static void on_tokenized(rtr_router *r, rtr_worker *w, const Metrale__Internal__V1__Tokenized *tz) {
    rtr_tokenize *t = r->tokenizes;
    while (t && t->id != tz->id) t = t->next;
    if (!t || t->worker != w) return; /* answered already (deadline, cancel) */
    if (tz->error && tz->error[0]) {
        tokenize_end(r, t, GRPC_STATUS_INVALID_ARGUMENT, tz->error, NULL);
        return;
    }
    Metrale__V1__TokenizeResponse empty = METRALE__V1__TOKENIZE_RESPONSE__INIT;
    tokenize_end(r, t, GRPC_STATUS_OK, NULL, tz->response ? &tz->response->base : &empty.base);
}

/* ---- worker messages ---- */

static void publish_metrics(rtr_router *r) {
    const rtr_metrics_load load = {
        .waiting = (uint32_t)rtr_admission_len(&r->queue),
        .running = r->running,
        .requeued = r->streams_requeued,
    };
    rtr_metrics_publish(r->metrics, &load, &r->workers);
}

/* After a worker's liveness changed (and on the way: its metrics, at once). */
static void update_health(rtr_router *r) {
    rtr_health_set_serving(&r->health, r->phase == RUNNING && rtr_workers_live(&r->workers) > 0);
    publish_metrics(r);
}

/* w is dead (gone, silent) or restarted, and its sequences with it: declares it dead, and gives
 * each of its streams that has had no Tokens yet back to the queue (at its front, oldest first)
 * while a live worker can take it (or w itself is coming back: back); every other stream of w
 * ends UNAVAILABLE. tell_worker: w may still run (a hang), so it gets Abort for each sequence. */
static void worker_lost(rtr_router *r, rtr_worker *w, const char *why, bool tell_worker, bool back) {
    if (!back) rtr_workers_mark_dead(w);
    const bool others = back || rtr_workers_live(&r->workers) > 0;
    char msg[160];
    snprintf(msg, sizeof msg, "worker %s %s", w->peer, why);
    int requeued = 0, failed = 0;
    rtr_stream *next;
    for (rtr_stream *s = r->streams; s; s = next) { /* newest first */
        next = s->next;
        if (s->worker != w || s->state == ST_QUEUED) continue;
        /* A worker that is only frozen frees the sequence when it wakes up. */
        if (tell_worker && s->state == ST_RUNNING)
            send_abort(r, s, METRALE__V1__FINISH_REASON__FINISH_REASON_ERROR);
        if (s->state == ST_RUNNING && s->call && !s->got_tokens && s->req && !s->cut && others &&
            s->requeues < REQUEUES_MAX) {
            const mt_log_field f[] = { mt_logf_str("worker", w->peer), mt_logf_str("why", why),
                                       mt_logf_int("requeues", s->requeues + 1) };
            mt_log_event(MT_LOG_INFO, "requeued", s->request_id, f, sizeof f / sizeof f[0]);
            s->state = ST_QUEUED;
            s->worker = NULL;
            s->requeues++;
            r->running--;
            r->streams_requeued++;
            rtr_admission_push_front(&r->queue, &s->qnode);
            requeued++;
            continue;
        }
        if (s->cut && s->call) stream_end_cut(r, s); /* the drain ended it, not the death */
        failed += s->call != NULL;
        stream_end_call(r, s, GRPC_STATUS_UNAVAILABLE, msg);
        stream_free(r, s);
    }
    rtr_tokenize *tnext;
    for (rtr_tokenize *t = r->tokenizes; t; t = tnext) {
        tnext = t->next;
        if (t->worker == w) tokenize_end(r, t, GRPC_STATUS_UNAVAILABLE, msg, NULL);
    }
    if (requeued || failed)
        mt_log(MT_LOG_WARN, "router: worker %s %s: %d streams back in the queue, %d ended UNAVAILABLE", w->peer,
               why, requeued, failed);
    if (!back) update_health(r);
}

/* Declares dead the live workers that a send found gone (their connection closed). */
static void reap_gone(rtr_router *r) {
    for (size_t i = 0; i < r->workers.n; i++) {
        rtr_worker *w = r->workers.w[i];
        if (!w->alive || !w->gone) continue;
        /* after Shutdown (draining) the workers are expected to leave */
        mt_log(r->phase < DRAIN_WORKERS ? MT_LOG_WARN : MT_LOG_INFO,
               "router: worker %s: its connection closed: dead", w->peer);
        worker_lost(r, w, "died", false, false);
    }
}

static void on_hello(rtr_router *r, const char *peer, const Metrale__Internal__V1__Hello *h, double now) {
    rtr_worker *w = rtr_workers_find(&r->workers, peer);
    if (w && w->alive) worker_lost(r, w, "restarted", false, true);
    mt_error err;
    if (rtr_workers_hello(&r->workers, peer, h, now, &w, &err)) {
        mt_log(MT_LOG_WARN, "router: %s", err.msg);
        return;
    }
    mt_log(MT_LOG_INFO, "router: worker %s live (%s, vocab %u, context %u, %u sequences)%s", peer, w->backend,
           w->model.vocab_size, w->model.max_context, w->max_sequences, w->hellos > 1 ? ", restarted" : "");
    update_health(r);
}

static void on_tokens(rtr_router *r, rtr_worker *w, mt_envelope *env) {
    rtr_stream *s = stream_find(r, env->tokens->id);
    const Metrale__Internal__V1__Tokens *t = env->tokens;
    const bool empty = t->n_tokens == 0 && t->n_prompt_logprobs == 0 && !(t->text && t->text[0]);
    if (s && s->worker == w && s->state != ST_QUEUED && t->n_tokens > 0) {
        /* Counted whether or not the client is still there (an aborted stream's last tokens);
         * the latencies only while it is. */
        const double now = mt_now();
        const bool first = s->last_tokens == 0;
        const bool client = s->state == ST_RUNNING && s->call;
        rtr_metrics_tokens(r->metrics, (uint32_t)t->n_tokens, first,
                           client ? now - (first ? s->arrived : s->last_tokens) : -1);
        s->last_tokens = now;
    }
    if (!s || s->worker != w || s->state != ST_RUNNING || !s->call || empty) {
        mt_wire_free(env);
        return;
    }
    s->completion_tokens += (uint32_t)t->n_tokens;
    if (!s->got_tokens) { /* from here on the stream cannot move to another worker */
        const mt_log_field f[] = {
            mt_logf_double("ttft_ms", ms_since(s->admitted_at)),
            mt_logf_str("worker", w->peer),
            mt_logf_int("requeues", s->requeues),
        };
        mt_log_event(MT_LOG_INFO, "first_token", s->request_id, f, sizeof f / sizeof f[0]);
        s->got_tokens = true;
        metrale__v1__generate_request__free_unpacked(s->req, NULL);
        s->req = NULL;
    }
    if (s->npending == s->cap_pending) {
        size_t cap = s->cap_pending ? 2 * s->cap_pending : 8;
        mt_envelope **p = realloc(s->pending, cap * sizeof *p);
        if (!p) {
            mt_wire_free(env);
            stream_end_call(r, s, GRPC_STATUS_RESOURCE_EXHAUSTED, "router out of memory");
            stream_abort(r, s, mt_now());
            return;
        }
        s->pending = p;
        s->cap_pending = cap;
    }
    s->pending[s->npending++] = env;
    stream_flush(r, s, NULL, NULL);
}

static void on_finished(rtr_router *r, rtr_worker *w, const Metrale__Internal__V1__Finished *f) {
    rtr_stream *s = stream_find(r, f->id);
    if (!s || s->worker != w || s->state == ST_QUEUED) return;
    if (w->in_flight > 0) w->in_flight--;
    if (!f->invalid_argument) { /* recorded before the client hears of it */
        const Metrale__V1__Final *fin = f->final;
        const Metrale__V1__Usage *u = fin ? fin->usage : NULL;
        const rtr_metrics_finish mf = {
            .reason = fin ? fin->finish_reason : METRALE__V1__FINISH_REASON__FINISH_REASON_UNSPECIFIED,
            .prompt_tokens = u ? u->prompt_tokens : 0,
            .generation_tokens = u ? u->completion_tokens : 0,
            .queue_s = s->submitted - s->arrived,
            .e2e_s = mt_now() - s->arrived,
        };
        rtr_metrics_request_finished(r->metrics, &mf);
    }
    if (s->state == ST_RUNNING && s->call) {
        /* The worker also knows the deadline and ends the sequence itself (CANCELLED), which may
         * beat our own check by a tick; the client must still see DEADLINE_EXCEEDED. The slack
         * covers the wall-clock to monotonic conversion. */
        if (f->final && f->final->finish_reason == METRALE__V1__FINISH_REASON__FINISH_REASON_CANCELLED &&
            mt_now() >= s->deadline - DEADLINE_SLACK_S) {
            stream_end_call(r, s, GRPC_STATUS_DEADLINE_EXCEEDED, "deadline exceeded");
        } else if (f->invalid_argument) {
            /* Refused before it started (text not UTF-8, too long once tokenized, a template
             * that failed, no tokenizer): a bad request, like one the router refuses. */
            const char *why = f->final && f->final->error_message && f->final->error_message[0]
                                  ? f->final->error_message
                                  : "the worker refused the request";
            stream_drop_pending(s);
            stream_end_call(r, s, GRPC_STATUS_INVALID_ARGUMENT, why);
            r->requests_rejected++;
        } else {
            Metrale__V1__Final fallback = METRALE__V1__FINAL__INIT;
            stream_flush(r, s, f->final ? f->final : &fallback, f->text);
        }
    }
    stream_free(r, s);
}

static void on_envelope(rtr_router *r, const char *peer, mt_envelope *env, double now) {
    if (env->body_case == METRALE__INTERNAL__V1__ENVELOPE__BODY_HELLO) {
        on_hello(r, peer, env->hello, now);
        mt_wire_free(env);
        return;
    }
    rtr_worker *w = rtr_workers_heard(&r->workers, peer, now);
    if (!w) {
        rtr_worker *known = rtr_workers_find(&r->workers, peer);
        mt_wire_msg probe;
        if (known && env->body_case == METRALE__INTERNAL__V1__ENVELOPE__BODY_HEARTBEAT &&
            mt_wire_send(r->wire, peer, mt_wire_heartbeat(&probe, ++r->heartbeat_seq, NULL, false), NULL) == MT_OK) {
            /* Declared dead, yet alive (it was frozen or cut off) and connected (a Heartbeat
             * that a worker sent before it died finds no connection to answer): live again,
             * with the model of its last Hello. Its old sequences were aborted when it was
             * declared dead. */
            known->alive = true;
            known->gone = false;
            known->reachable = true;
            known->last_heard = now;
            known->in_flight = 0;
            r->workers.restarts++;
            mt_log(MT_LOG_INFO, "router: worker %s is back", peer);
            update_health(r);
            w = known;
        } else {
            if (!known && now - r->last_unknown_log > 5) {
                mt_log(MT_LOG_WARN, "router: message from %s, which has not said Hello; asking for one", peer);
                r->last_unknown_log = now;
            }
            /* A worker that outlived a router restart keeps sending heartbeats (one per
             * MT_WIRE_HEARTBEAT_S, which bounds these replies) without a Hello: ask for one. */
            if (!known && env->body_case == METRALE__INTERNAL__V1__ENVELOPE__BODY_HEARTBEAT) {
                mt_wire_msg reply;
                mt_wire_send(r->wire, peer, mt_wire_heartbeat(&reply, ++r->heartbeat_seq, NULL, true), NULL);
            }
            mt_wire_free(env);
            return;
        }
    }
    switch (env->body_case) {
    case METRALE__INTERNAL__V1__ENVELOPE__BODY_HEARTBEAT:
        if (env->heartbeat->stats) {
            rtr_workers_set_stats(w, env->heartbeat->stats);
            publish_metrics(r);
        }
        break;
    case METRALE__INTERNAL__V1__ENVELOPE__BODY_TOKENS:
        on_tokens(r, w, env);
        return; /* on_tokens took env */
    case METRALE__INTERNAL__V1__ENVELOPE__BODY_FINISHED:
        on_finished(r, w, env->finished);
        break;
    case METRALE__INTERNAL__V1__ENVELOPE__BODY_TOKENIZED:
        on_tokenized(r, w, env->tokenized);
        break;
    default:
        mt_log(MT_LOG_WARN, "router: unexpected message (body %d) from %s", (int)env->body_case, peer);
    }
    mt_wire_free(env);
}

/* Handles up to WIRE_BATCH envelopes; true when more may wait. */
static bool drain_wire(rtr_router *r) {
    for (int i = 0; i < WIRE_BATCH; i++) {
        char peer[MT_WIRE_PEER_MAX];
        mt_envelope *env;
        mt_error err;
        mt_status st = mt_wire_recv(r->wire, 0, peer, &env, &err);
        if (st == MT_ERR_NOT_FOUND) return false;
        if (st) {
            mt_log(MT_LOG_WARN, "router: %s", err.msg);
            continue;
        }
        on_envelope(r, peer, env, mt_now());
    }
    return true;
}

/* ---- timers ---- */

static void send_heartbeats(rtr_router *r) {
    mt_wire_msg m;
    mt_envelope *env = mt_wire_heartbeat(&m, ++r->heartbeat_seq, NULL, false);
    for (size_t i = 0; i < r->workers.n; i++)
        if (r->workers.w[i]->alive) send_env(r, r->workers.w[i], env);
}

static void tick(rtr_router *r, double now) {
    if (now >= r->next_heartbeat) {
        send_heartbeats(r);
        r->next_heartbeat = now + MT_WIRE_HEARTBEAT_S;
    }
    rtr_worker *dead[MT_WIRE_WORKERS_MAX];
    size_t ndead = rtr_workers_expire(&r->workers, now, dead, MT_WIRE_WORKERS_MAX);
    for (size_t i = 0; i < ndead; i++) {
        mt_log(MT_LOG_WARN, "router: worker %s silent for %.1f s: dead", dead[i]->peer, now - dead[i]->last_heard);
        worker_lost(r, dead[i], "died", true, false);
    }

    rtr_stream *next;
    for (rtr_stream *s = r->streams; s; s = next) {
        next = s->next;
        if (s->call && now >= s->deadline) {
            stream_end_call(r, s, GRPC_STATUS_DEADLINE_EXCEEDED, "deadline exceeded");
            stream_client_gone(r, s, now);
        } else if (s->state == ST_ABORTING && now - s->abort_since > ABORT_GIVE_UP_S) {
            mt_log(MT_LOG_WARN, "router: worker %s never finished aborted sequence %llu; giving up on it",
                   s->worker->peer, (unsigned long long)s->id);
            if (s->worker->in_flight > 0) s->worker->in_flight--;
            stream_free(r, s);
        }
    }
    publish_metrics(r);
    rtr_tokenize *tnext;
    for (rtr_tokenize *t = r->tokenizes; t; t = tnext) {
        tnext = t->next;
        if (now >= t->deadline)
            tokenize_end(r, t, GRPC_STATUS_DEADLINE_EXCEEDED,
                         now >= rtr_call_deadline(t->call) ? "deadline exceeded" : "the worker did not answer in time",
                         NULL);
    }
}

/* ---- draining ---- */

void rtr_router_drain(rtr_router *r) {
    if (r->phase != RUNNING) return;
    mt_log(MT_LOG_INFO, "router: draining: %zu streams, up to %.1f s", r->nstreams, r->p.drain_timeout_s);
    r->phase = DRAIN_STREAMS;
    r->phase_deadline = mt_now() + r->p.drain_timeout_s;
    update_health(r);
}

static size_t client_streams(const rtr_router *r) {
    size_t k = 0;
    for (const rtr_stream *s = r->streams; s; s = s->next) k += s->call != NULL;
    return k;
}

/* The drain timeout passed: every stream still running is cut (Abort(CANCELLED); its worker's
 * Finished ends it with a final message, see the top of this file); streams still queued and
 * Tokenize calls end UNAVAILABLE (nothing was done for them: a client may retry elsewhere). */
static void cut_streams(rtr_router *r, double now) {
    size_t cut = 0;
    rtr_stream *next;
    for (rtr_stream *s = r->streams; s; s = next) {
        next = s->next;
        if (!s->call) continue;
        if (s->state == ST_RUNNING) {
            send_abort(r, s, METRALE__V1__FINISH_REASON__FINISH_REASON_CANCELLED);
            s->cut = true;
            cut++;
        } else {
            stream_end_call(r, s, GRPC_STATUS_UNAVAILABLE, "server shut down before the stream started");
            stream_client_gone(r, s, now);
        }
    }
    while (r->tokenizes)
        tokenize_end(r, r->tokenizes, GRPC_STATUS_UNAVAILABLE, "server shut down before the call was answered", NULL);
    mt_log(MT_LOG_WARN, "router: drain timeout (%.1f s) ran out: %zu streams cut", r->p.drain_timeout_s, cut);
}

static void drain_step(rtr_router *r, double now) {
    const bool idle = client_streams(r) == 0 && !r->tokenizes;
    if (r->phase == DRAIN_STREAMS && !idle && now >= r->phase_deadline) {
        cut_streams(r, now);
        r->phase = DRAIN_CUT;
        r->phase_deadline = now + CUT_GRACE_S;
    }
    if ((r->phase == DRAIN_STREAMS && idle) ||
        (r->phase == DRAIN_CUT && (client_streams(r) == 0 || now >= r->phase_deadline))) {
        rtr_stream *next;
        for (rtr_stream *s = r->streams; s; s = next) {
            next = s->next;
            if (s->cut && s->call) stream_end_cut(r, s); /* its worker did not answer the Abort */
            stream_end_call(r, s, GRPC_STATUS_UNAVAILABLE, "server shut down before the stream finished");
            stream_client_gone(r, s, now);
        }
        while (r->tokenizes)
            tokenize_end(r, r->tokenizes, GRPC_STATUS_UNAVAILABLE, "server shut down before the call was answered",
                         NULL);
        mt_wire_msg m;
        mt_envelope *env = mt_wire_shutdown(&m);
        for (size_t i = 0; i < r->workers.n; i++) {
            rtr_worker *w = r->workers.w[i];
            r->worker_gone[i] = !w->alive || send_env(r, w, env) != MT_OK;
        }
        mt_log(MT_LOG_INFO, "router: workers told to shut down");
        r->phase = DRAIN_WORKERS;
        r->phase_deadline = now + r->p.workers_exit_s;
    }
    if (r->phase == DRAIN_WORKERS) {
        /* A worker has left once a send to it fails (ZMQ_ROUTER_MANDATORY: its pipe is gone). */
        bool all_gone = true;
        for (size_t i = 0; i < r->workers.n; i++) {
            if (r->worker_gone[i]) continue;
            mt_wire_msg m;
            mt_envelope *env = mt_wire_heartbeat(&m, ++r->heartbeat_seq, NULL, false);
            if (mt_wire_send(r->wire, r->workers.w[i]->peer, env, NULL) != MT_OK) r->worker_gone[i] = true;
            else all_gone = false;
        }
        if (all_gone || now >= r->phase_deadline) {
            if (!all_gone) mt_log(MT_LOG_WARN, "router: some workers did not exit in %.1f s", r->p.workers_exit_s);
            r->phase = DRAIN_GRPC;
            rtr_grpc_shutdown(r->grpc);
        }
    }
    if (r->phase == DRAIN_GRPC && rtr_grpc_shutdown_done(r->grpc)) r->phase = STOPPED;
}

/* ---- gRPC handlers ---- */

/* Refuses a Generate before admission; request_id is NULL when the request did not parse. */
static void finish_rejected(rtr_router *r, rtr_call *call, grpc_status_code code, const char *msg,
                            const char *request_id) {
    r->requests_rejected++;
    const mt_log_field f[] = { mt_logf_str("status", status_name(code)), mt_logf_str("details", msg) };
    mt_log_event(MT_LOG_INFO, "rejected", request_id, f, sizeof f / sizeof f[0]);
    rtr_metrics_request_ended(r->metrics, code);
    rtr_call_finish(call, code, msg, NULL);
}

static void on_generate(rtr_router *r, rtr_call *call, const uint8_t *data, size_t len) {
    r->requests_total++;
    if (r->phase != RUNNING) {
        finish_rejected(r, call, GRPC_STATUS_UNAVAILABLE, "server is shutting down", NULL);
        return;
    }
    Metrale__V1__GenerateRequest *req = metrale__v1__generate_request__unpack(NULL, len, data);
    if (!req) {
        finish_rejected(r, call, GRPC_STATUS_INVALID_ARGUMENT, "request is not a valid metrale.v1.GenerateRequest",
                        NULL);
        return;
    }
    rtr_model_limits lim;
    const bool have_lim = rtr_workers_limits(&r->workers, &lim);
    mt_error err;
    grpc_status_code code = GRPC_STATUS_OK;
    const char *msg = NULL;
    if (rtr_validate_generate(req, have_lim ? &lim : NULL, &err)) {
        code = GRPC_STATUS_INVALID_ARGUMENT;
        msg = err.msg;
    } else if (rtr_workers_live(&r->workers) == 0) {
        code = GRPC_STATUS_UNAVAILABLE;
        msg = "no live worker";
    } else if (mt_now() >= rtr_call_deadline(call)) {
        code = GRPC_STATUS_DEADLINE_EXCEEDED;
        msg = "deadline exceeded before admission";
    }
    /* the record escapes the id; a refused one may be anything, so only a short one is named */
    const char *rid = req->request_id && strlen(req->request_id) <= MT_WIRE_REQUEST_ID_MAX ? req->request_id : NULL;
    if (code != GRPC_STATUS_OK) {
        finish_rejected(r, call, code, msg, rid);
        metrale__v1__generate_request__free_unpacked(req, NULL);
        return;
    }
    rtr_stream *s = stream_new(r, req, call);
    if (!s) {
        finish_rejected(r, call, GRPC_STATUS_RESOURCE_EXHAUSTED, "router out of memory", rid);
        metrale__v1__generate_request__free_unpacked(req, NULL);
        return;
    }
    if (!(rtr_admission_len(&r->queue) == 0 && submit_now(r, s)) &&
        rtr_admission_push(&r->queue, &s->qnode) == MT_ERR_FULL) {
        char m[96];
        snprintf(m, sizeof m, "admission queue full (%zu waiting)", rtr_admission_len(&r->queue));
        rtr_call_set_stream(call, NULL);
        s->call = NULL;
        finish_rejected(r, call, GRPC_STATUS_RESOURCE_EXHAUSTED, m, s->request_id);
        stream_free(r, s);
        return;
    }
    log_admitted(r, s, req);
}

static void on_tokenize(rtr_router *r, rtr_call *call, const uint8_t *data, size_t len) {
    if (r->phase != RUNNING) {
        rtr_call_finish(call, GRPC_STATUS_UNAVAILABLE, "server is shutting down", NULL);
        return;
    }
    Metrale__V1__TokenizeRequest *req = metrale__v1__tokenize_request__unpack(NULL, len, data);
    if (!req) {
        rtr_call_finish(call, GRPC_STATUS_INVALID_ARGUMENT, "request is not a valid metrale.v1.TokenizeRequest", NULL);
        return;
    }
    rtr_model_limits lim;
    const bool have_lim = rtr_workers_limits(&r->workers, &lim);
    mt_error err;
    const double now = mt_now();
    rtr_tokenize *t = NULL;
    if (rtr_validate_tokenize(req, have_lim ? &lim : NULL, &err)) {
        rtr_call_finish(call, GRPC_STATUS_INVALID_ARGUMENT, err.msg, NULL);
    } else if (rtr_workers_live(&r->workers) == 0) {
        rtr_call_finish(call, GRPC_STATUS_UNAVAILABLE, "no live worker", NULL);
    } else if (now >= rtr_call_deadline(call)) {
        rtr_call_finish(call, GRPC_STATUS_DEADLINE_EXCEEDED, "deadline exceeded before admission", NULL);
    } else if (!(t = calloc(1, sizeof *t))) {
        rtr_call_finish(call, GRPC_STATUS_RESOURCE_EXHAUSTED, "router out of memory", NULL);
    } else {
        t->id = r->next_id++;
        t->call = call;
        t->deadline = fmin(rtr_call_deadline(call), now + TOKENIZE_TIMEOUT_S);
        rtr_worker *w;
        mt_wire_msg m;
        mt_envelope *env = mt_wire_tokenize_call(&m, t->id, req);
        while ((w = rtr_workers_pick_any(&r->workers)) && send_env(r, w, env) != MT_OK) {}
        if (!w) {
            free(t);
            rtr_call_finish(call, GRPC_STATUS_UNAVAILABLE, "no live worker took the call", NULL);
        } else {
            t->worker = w;
            t->next = r->tokenizes;
            if (r->tokenizes) r->tokenizes->prev = t;
            r->tokenizes = t;
            rtr_call_set_tokenize(call, t);
        }
    }
    metrale__v1__tokenize_request__free_unpacked(req, NULL);
}

/* A request that must parse as type desc (an empty message: ModelInfoRequest, StatsRequest);
 * false after answering INVALID_ARGUMENT when it does not. */
static bool parses_as(rtr_call *call, const ProtobufCMessageDescriptor *desc, const uint8_t *data, size_t len) {
    ProtobufCMessage *m = protobuf_c_message_unpack(desc, NULL, len, data);
    if (m) {
        protobuf_c_message_free_unpacked(m, NULL);
        return true;
    }
    char msg[128];
    snprintf(msg, sizeof msg, "request is not a valid %s", desc->name);
    rtr_call_finish(call, GRPC_STATUS_INVALID_ARGUMENT, msg, NULL);
    return false;
}

static void on_get_model_info(rtr_router *r, rtr_call *call, const uint8_t *data, size_t len) {
    if (!parses_as(call, &metrale__v1__model_info_request__descriptor, data, len)) return;
    const rtr_worker *w = rtr_workers_any_live(&r->workers);
    if (!w) {
        rtr_call_finish(call, GRPC_STATUS_UNAVAILABLE, "no live worker", NULL);
        return;
    }
    Metrale__V1__ModelInfo info = w->model;
    info.workers = (uint32_t)rtr_workers_live(&r->workers);
    info.version = (char *)MT_VERSION;
    rtr_call_finish(call, GRPC_STATUS_OK, NULL, &info.base);
}

static void on_get_stats(rtr_router *r, rtr_call *call, const uint8_t *data, size_t len) {
    if (!parses_as(call, &metrale__v1__stats_request__descriptor, data, len)) return;
    Metrale__V1__Stats st = METRALE__V1__STATS__INIT;
    Metrale__V1__WorkerStats ws[MT_WIRE_WORKERS_MAX], *wp[MT_WIRE_WORKERS_MAX];
    st.queued = (uint32_t)rtr_admission_len(&r->queue);
    st.active_streams = r->running;
    st.requests_total = r->requests_total;
    st.requests_rejected = r->requests_rejected;
    st.worker_restarts = r->workers.restarts;
    st.streams_requeued = r->streams_requeued;
    for (size_t i = 0; i < r->workers.n; i++) {
        ws[i] = r->workers.w[i]->stats;
        ws[i].worker_id = r->workers.w[i]->id;
        ws[i].alive = r->workers.w[i]->alive;
        wp[i] = &ws[i];
    }
    st.n_workers = r->workers.n;
    st.workers = wp;
    rtr_call_finish(call, GRPC_STATUS_OK, NULL, &st.base);
}

static void h_on_request(rtr_router *r, rtr_call *call, rtr_method m, const uint8_t *data, size_t len) {
    switch (m) {
    case RTR_METHOD_GENERATE: on_generate(r, call, data, len); break;
    case RTR_METHOD_GET_MODEL_INFO: on_get_model_info(r, call, data, len); break;
    case RTR_METHOD_GET_STATS: on_get_stats(r, call, data, len); break;
    case RTR_METHOD_TOKENIZE: on_tokenize(r, call, data, len); break;
    case RTR_METHOD_HEALTH_CHECK: rtr_health_check(&r->health, call, data, len); break;
    case RTR_METHOD_HEALTH_WATCH: rtr_health_watch_start(&r->health, call, data, len); break;
    default: rtr_call_finish(call, GRPC_STATUS_UNIMPLEMENTED, "unknown method", NULL);
    }
}

static void h_on_send_done(rtr_router *r, rtr_call *call, bool ok) {
    rtr_stream *s = rtr_call_stream(call);
    if (s) {
        if (ok) stream_flush(r, s, NULL, NULL);
        return;
    }
    if (rtr_call_watch(call)) rtr_health_on_send_done(&r->health, call, ok);
}

static void h_on_done(rtr_router *r, rtr_call *call, bool cancelled) {
    (void)cancelled; /* a stream still attached here lost its client either way */
    rtr_stream *s = rtr_call_stream(call);
    if (s) stream_client_gone(r, s, mt_now());
    rtr_tokenize *t = rtr_call_tokenize(call);
    if (t) tokenize_forget(r, t);
    if (rtr_call_watch(call)) rtr_health_on_done(&r->health, call);
}

/* ---- life ---- */

/* Shuts the gRPC servers down (cancelling what is left), waits for that, and frees them. */
static void grpc_close(rtr_router *r) {
    if (!r->grpc) return;
    rtr_grpc_shutdown(r->grpc);
    while (!rtr_grpc_shutdown_done(r->grpc)) {
        struct pollfd pfd = {.fd = rtr_grpc_fd(r->grpc), .events = POLLIN};
        poll(&pfd, 1, 100);
        rtr_grpc_dispatch(r->grpc);
    }
    rtr_grpc_free(r->grpc);
    r->grpc = NULL;
}

rtr_router *rtr_router_create(const rtr_router_params *params, mt_error *err) {
    rtr_router *r = calloc(1, sizeof *r);
    if (!r) {
        mt_errorf(err, MT_ERR_NOMEM, "router: out of memory");
        return NULL;
    }
    r->p = *params;
    r->p.tls_cert_file = r->p.tls_key_file = r->p.tls_client_ca_file = r->p.auth_token_file = NULL; /* not kept */
    r->p.health_listen = NULL;
    r->next_id = 1;
    char *token = NULL;
    rtr_workers_params wp = rtr_workers_default_params();
    wp.dead_after_s = params->dead_after_s;
    rtr_workers_init(&r->workers, wp);
    rtr_admission_init(&r->queue, params->queue_capacity);
    rtr_health_init(&r->health);
    /* The security files first: a bad one stops the start before anything is bound. */
    if (!params->tls_cert_file != !params->tls_key_file || (params->tls_client_ca_file && !params->tls_cert_file)) {
        mt_errorf(err, MT_ERR_INVALID, "router: TLS needs a certificate and a key file (and a client CA only with them)");
        goto fail;
    }
    if (params->tls_cert_file) {
        rtr_tls_params tp = rtr_tls_default_params();
        tp.cert_file = params->tls_cert_file;
        tp.key_file = params->tls_key_file;
        tp.client_ca_file = params->tls_client_ca_file;
        if (!(r->tls = rtr_tls_create(&tp, err))) goto fail;
    }
    if (params->auth_token_file) {
        if (!(r->token_file = strdup(params->auth_token_file))) {
            mt_errorf(err, MT_ERR_NOMEM, "router: out of memory");
            goto fail;
        }
        if (rtr_auth_token_read(r->token_file, &token, err)) goto fail;
    }
    if (!(r->metrics = rtr_metrics_create(MT_VERSION, err))) goto fail;
    if (params->metrics_listen && rtr_metrics_serve(r->metrics, params->metrics_listen, &r->metrics_port, err))
        goto fail;
    mt_wire_params wire = mt_wire_default_params();
    wire.curve_secret_key = params->curve_secret_key;
    wire.curve_clients = params->curve_clients;
    wire.n_curve_clients = params->n_curve_clients;
    if (mt_wire_open(MT_WIRE_ROUTER, params->workers_endpoint, &wire, &r->wire, err)) goto fail;
    rtr_grpc_params gp = rtr_grpc_default_params();
    gp.listen = params->listen;
    gp.tls = r->tls;
    gp.health_listen = params->health_listen;
    rtr_grpc_handlers h = {
        .router = r,
        .on_request = h_on_request,
        .on_send_done = h_on_send_done,
        .on_done = h_on_done,
    };
    if (!(r->grpc = rtr_grpc_create(&gp, &h, &r->port, err))) goto fail;
    if (token && rtr_grpc_set_auth_token(r->grpc, token)) {
        mt_errorf(err, MT_ERR_NOMEM, "router: out of memory");
        goto fail;
    }
    rtr_auth_token_free(token);
    if (r->tls) {
        char d[600];
        rtr_tls_describe(r->tls, d, sizeof d);
        mt_log(MT_LOG_INFO, "router: TLS on the serving port: %s", d);
    }
    if (r->token_file)
        mt_log(MT_LOG_INFO, "router: calls other than health need the bearer token of %s%s", r->token_file,
               r->tls ? "" : " (without TLS it crosses the network in clear text)");
    return r;
fail:
    rtr_auth_token_free(token);
    grpc_close(r); /* nothing was served yet: shut down at once */
    mt_wire_close(r->wire);
    rtr_metrics_free(r->metrics);
    rtr_workers_free(&r->workers);
    rtr_tls_free(r->tls);
    free(r->token_file);
    free(r);
    return NULL;
}

int rtr_router_port(const rtr_router *r) { return r->port; }
int rtr_router_health_port(const rtr_router *r) { return rtr_grpc_health_port(r->grpc); }

void rtr_router_reload(rtr_router *r) {
    mt_error err;
    if (r->tls) {
        if (rtr_tls_reload(r->tls, &err)) {
            mt_log(MT_LOG_WARN, "router: TLS files not reloaded, the current certificate stays: %s", err.msg);
        } else {
            char d[600];
            rtr_tls_describe(r->tls, d, sizeof d);
            mt_log(MT_LOG_INFO, "router: TLS files reloaded; new connections get %s", d);
        }
    }
    if (r->token_file) {
        char *token = NULL;
        if (rtr_auth_token_read(r->token_file, &token, &err))
            mt_log(MT_LOG_WARN, "router: token not reloaded, the current one stays: %s", err.msg);
        else if (rtr_grpc_set_auth_token(r->grpc, token))
            mt_log(MT_LOG_WARN, "router: token not reloaded (out of memory), the current one stays");
        else
            mt_log(MT_LOG_INFO, "router: bearer token reloaded from %s", r->token_file);
        rtr_auth_token_free(token);
    }
    if (!r->tls && !r->token_file) mt_log(MT_LOG_INFO, "router: reload asked for; no TLS files or token to reload");
}

int rtr_router_metrics_port(const rtr_router *r) { return r->metrics_port; }

void rtr_router_workers_endpoint(const rtr_router *r, char *out, size_t len) { mt_wire_endpoint(r->wire, out, len); }

mt_status rtr_router_run(rtr_router *r, mt_error *err) {
    bool more_wire = false;
    while (r->phase != STOPPED) {
        struct pollfd fds[5] = {
            /* poll skips the negative descriptors (no drain or reload descriptor) */
            {.fd = rtr_grpc_fd(r->grpc), .events = POLLIN},
            {.fd = mt_wire_fd(r->wire), .events = POLLIN},
            {.fd = mt_wire_event_fd(r->wire), .events = POLLIN},
            {.fd = r->p.drain_fd, .events = POLLIN},
            {.fd = r->p.reload_fd, .events = POLLIN},
        };
        int timeout = more_wire ? 0 : r->phase == RUNNING ? TICK_MS : DRAIN_TICK_MS;
        if (mt_now() < r->probe_until && timeout > PROBE_MS) timeout = PROBE_MS;
        if (poll(fds, 5, timeout) < 0 && errno != EINTR)
            return mt_errorf(err, MT_ERR_IO, "router: poll: %s", strerror(errno));
        if (r->p.reload_fd >= 0 && (fds[4].revents & POLLIN)) {
            char buf[512];
            if (read(r->p.reload_fd, buf, sizeof buf) < 0 && errno != EAGAIN && errno != EINTR)
                mt_log(MT_LOG_WARN, "router: reading the reload descriptor: %s", strerror(errno));
            rtr_router_reload(r);
        }
        if (r->p.drain_fd >= 0 && (fds[3].revents & POLLIN)) {
            char buf[512];
            if (read(r->p.drain_fd, buf, sizeof buf) < 0 && errno != EAGAIN && errno != EINTR)
                mt_log(MT_LOG_WARN, "router: reading the drain descriptor: %s", strerror(errno));
            rtr_router_drain(r);
        }
        rtr_grpc_dispatch(r->grpc);
        drain_wire(r);
        double now = mt_now();
        /* A connection closed: some worker exited or was killed. Its last messages (a stream that
         * finished just before) are read first, then every worker is probed with a Heartbeat
         * until the closed one's send fails; a send fails as soon as ZeroMQ has dropped the
         * connection's pipe, which follows the event by well under PROBE_MS. */
        if (mt_wire_take_disconnects(r->wire) > 0) {
            r->probe_until = now + PROBE_WINDOW_S;
            r->next_probe = now;
        }
        if (now < r->probe_until && now >= r->next_probe) {
            drain_wire(r);
            send_heartbeats(r);
            r->next_probe = now + PROBE_MS * 1e-3;
        }
        reap_gone(r);
        if (now >= r->next_tick) { /* scans every stream: on a timer, not on every wake-up */
            tick(r, now);
            if (r->phase != RUNNING) drain_step(r, now);
            r->next_tick = now + (r->phase == RUNNING ? TICK_MS : DRAIN_TICK_MS) * 1e-3;
        }
        reap_gone(r); /* a send in tick found one gone */
        if (r->phase != STOPPED) dispatch_queue(r);
        /* Last: a receive that finds nothing re-arms the edge-triggered ZMQ_FD. */
        more_wire = drain_wire(r);
    }
    return MT_OK;
}

void rtr_router_free(rtr_router *r) {
    if (!r) return;
    while (r->streams) stream_free(r, r->streams);
    while (r->tokenizes) tokenize_forget(r, r->tokenizes);
    grpc_close(r);
    rtr_health_free(&r->health);
    rtr_metrics_free(r->metrics);
    mt_wire_close(r->wire);
    rtr_workers_free(&r->workers);
    rtr_tls_free(r->tls); /* after rtr_grpc_free: gRPC no longer calls its fetcher */
    free(r->token_file);
    free(r);
}
