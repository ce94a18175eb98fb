/* router/metrics.c: see metrics.h.
 *
 * The values are plain numbers in one struct (mvals) behind the registry's mutex. A scrape
 * copies the struct (the live part of the workers' array) under the mutex and formats the copy
 * after letting go. Histograms keep a count per bucket (not cumulative: an observation touches
 * one slot) and add them up when rendered.
 */
#define _GNU_SOURCE /* getaddrinfo, struct addrinfo under -std=c11 */
#include "router/metrics.h"

#include <arpa/inet.h>
#include <errno.h>
#include <microhttpd.h>
#include <netdb.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "common/wire_limits.h"

/* ---- what is kept ---- */

#define HIST_MAX 32 /* buckets of the largest histogram, +Inf not counted */

typedef struct hist_def {
    const char *name, *help;
    const double *le; /* upper bounds, ascending */
    int n;
} hist_def;

/* vLLM's buckets (vllm/v1/metrics/loggers.py), with a finer low end where this engine is faster
 * than vLLM's lowest bucket (inter-token latency; the router's queue, usually empty). */
static const double TTFT_LE[] = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1,   0.25,  0.5,   0.75,
                                 1.0,   2.5,   5.0,  7.5,  10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0};
static const double ITL_LE[] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1,  0.15, 0.2, 0.3,
                                0.4,   0.5,    0.75,  1.0,  2.5,   5.0,  7.5,   10.0, 20.0, 40.0, 80.0};
static const double E2E_LE[] = {0.3,  0.5,  0.8,  1.0,  1.5,   2.0,   2.5,   5.0,   10.0,   15.0,  20.0,
                                30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};
static const double QUEUE_LE[] = {0.001, 0.005, 0.01, 0.05,  0.1,   0.3,   0.5,   0.8,   1.0,
                                  1.5,   2.0,   2.5,  5.0,   10.0,  15.0,  20.0,  30.0,  40.0,
                                  50.0,  60.0,  120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};
/* 1-2-5 steps, as vLLM's build_1_2_5_buckets(max_model_len) */
static const double TOKENS_LE[] = {1,     2,     5,     10,     20,     50,     100,    200,     500,    1000,
                                   2000,  5000,  10000, 20000,  50000,  100000, 200000, 500000, 1000000};

#define NLE(a) ((int)(sizeof(a) / sizeof((a)[0])))
_Static_assert(NLE(TTFT_LE) <= HIST_MAX && NLE(ITL_LE) <= HIST_MAX && NLE(E2E_LE) <= HIST_MAX &&
                   NLE(QUEUE_LE) <= HIST_MAX && NLE(TOKENS_LE) <= HIST_MAX,
               "a histogram has more buckets than HIST_MAX");

enum { H_TTFT, H_ITL, H_E2E, H_QUEUE, H_PROMPT, H_GEN, H_COUNT };

static const hist_def HISTS[H_COUNT] = {
    [H_TTFT] = {"metrale_time_to_first_token_seconds",
                "Time from a request's arrival at the router to its first generated tokens.", TTFT_LE, NLE(TTFT_LE)},
    [H_ITL] = {"metrale_inter_token_latency_seconds",
               "Time between two batches of generated tokens of a request, as the router receives them "
               "(a speculative step brings several).",
               ITL_LE, NLE(ITL_LE)},
    [H_E2E] = {"metrale_e2e_request_latency_seconds",
               "Time from a request's arrival to its end, for the requests a worker finished.", E2E_LE, NLE(E2E_LE)},
    [H_QUEUE] = {"metrale_request_queue_time_seconds",
                 "Time a request waited in the router's admission queue for a worker with room, for the "
                 "requests a worker finished.",
                 QUEUE_LE, NLE(QUEUE_LE)},
    [H_PROMPT] = {"metrale_request_prompt_tokens", "Prompt tokens of the requests a worker finished.", TOKENS_LE,
                  NLE(TOKENS_LE)},
    [H_GEN] = {"metrale_request_generation_tokens", "Generated tokens of the requests a worker finished.",
               TOKENS_LE, NLE(TOKENS_LE)},
};

typedef struct hist {
    uint64_t bucket[HIST_MAX + 1]; /* observations in (le[i-1], le[i]]; [n]: above le[n-1] */
    uint64_t count;
    double sum;
} hist;

/* metrale_request_success_total{finished_reason}: vLLM's label values. */
enum { R_STOP, R_LENGTH, R_ABORT, R_ERROR, R_COUNT };
static const char *const REASON_NAMES[R_COUNT] = {"stop", "length", "abort", "error"};

/* gRPC status codes 0..16, named as grpc-status-codes are. */
#define CODES 17
static const char *const CODE_NAMES[CODES] = {
    "OK",           "CANCELLED",         "UNKNOWN",  "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
    "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED",
    "OUT_OF_RANGE", "UNIMPLEMENTED",     "INTERNAL", "UNAVAILABLE",      "DATA_LOSS",         "UNAUTHENTICATED"};
/* The codes a Generate call can end with; always rendered, so rate() sees them from zero. */
static const int CODES_SHOWN[] = {GRPC_STATUS_OK,
                                  GRPC_STATUS_CANCELLED,
                                  GRPC_STATUS_INVALID_ARGUMENT,
                                  GRPC_STATUS_DEADLINE_EXCEEDED,
                                  GRPC_STATUS_RESOURCE_EXHAUSTED,
                                  GRPC_STATUS_UNAVAILABLE};

/* The counters a worker keeps from its start (WorkerStats), summed over workers by increase. */
enum { WC_PREFIX_HITS, WC_PREFIX_MISSES, WC_PREEMPTIONS, WC_SPEC_STEPS, WC_DRAFTS, WC_ACCEPTED, WC_COUNT };

/* A live worker's latest heartbeat, as rendered. */
typedef struct mworker {
    uint32_t id;
    bool alive;
    uint32_t sequences;                      /* live_sequences: running and waiting in the worker */
    uint64_t bytes_sequences, bytes_prefixes; /* state held by running sequences, by kept prefixes */
    uint32_t pages_free, pages_total;        /* the DSA cache page pool */
    uint32_t slots_free, slots_total;        /* the per-sequence state slot pool */
} mworker;

typedef struct mvals {
    uint64_t codes[CODES];
    uint64_t reasons[R_COUNT];
    uint64_t prompt_tokens, generation_tokens;
    hist h[H_COUNT];
    uint32_t waiting, running, workers_live;
    uint64_t restarts, requeued;
    uint64_t wc[WC_COUNT];
    size_t nworkers;
    mworker w[MT_WIRE_WORKERS_MAX]; /* last member: a scrape copies the first nworkers only */
} mvals;

struct rtr_metrics {
    pthread_mutex_t mu;
    mvals v; /* under mu */
    /* the event-loop thread's own: each worker's counters at the last publish, and the registry's
     * Hello count they belong to (a new Hello: a new process, counting from zero) */
    uint64_t prev[MT_WIRE_WORKERS_MAX][WC_COUNT];
    uint64_t prev_hellos[MT_WIRE_WORKERS_MAX];
    char version[64];
    struct MHD_Daemon *http;
};

rtr_metrics *rtr_metrics_create(const char *version, mt_error *err) {
    rtr_metrics *m = calloc(1, sizeof *m);
    if (!m) {
        mt_errorf(err, MT_ERR_NOMEM, "metrics: out of memory");
        return NULL;
    }
    if (pthread_mutex_init(&m->mu, NULL)) {
        free(m);
        mt_errorf(err, MT_ERR_NOMEM, "metrics: cannot make a mutex");
        return NULL;
    }
    snprintf(m->version, sizeof m->version, "%s", version ? version : "");
    return m;
}

void rtr_metrics_free(rtr_metrics *m) {
    if (!m) return;
    if (m->http) MHD_stop_daemon(m->http);
    pthread_mutex_destroy(&m->mu);
    free(m);
}

/* ---- recording ---- */

static void hist_observe(hist *h, const hist_def *d, double x) {
    if (!(x >= 0)) x = 0; /* a clock step or NaN: never a negative sum */
    int i = 0;
    while (i < d->n && x > d->le[i]) i++;
    h->bucket[i]++;
    h->count++;
    h->sum += x;
}

void rtr_metrics_request_ended(rtr_metrics *m, grpc_status_code code) {
    pthread_mutex_lock(&m->mu);
    m->v.codes[(unsigned)code < CODES ? (int)code : GRPC_STATUS_UNKNOWN]++;
    pthread_mutex_unlock(&m->mu);
}

void rtr_metrics_tokens(rtr_metrics *m, uint32_t n, bool first, double since_s) {
    pthread_mutex_lock(&m->mu);
    m->v.generation_tokens += n;
    if (since_s >= 0) {
        const int h = first ? H_TTFT : H_ITL;
        hist_observe(&m->v.h[h], &HISTS[h], since_s);
    }
    pthread_mutex_unlock(&m->mu);
}

void rtr_metrics_request_finished(rtr_metrics *m, const rtr_metrics_finish *f) {
    int r;
    switch (f->reason) {
    case METRALE__V1__FINISH_REASON__FINISH_REASON_STOP: r = R_STOP; break;
    case METRALE__V1__FINISH_REASON__FINISH_REASON_LENGTH: r = R_LENGTH; break;
    case METRALE__V1__FINISH_REASON__FINISH_REASON_CANCELLED: r = R_ABORT; break;
    default: r = R_ERROR; /* ERROR, and a Finished without a reason */
    }
    pthread_mutex_lock(&m->mu);
    mvals *v = &m->v;
    v->reasons[r]++;
    v->prompt_tokens += f->prompt_tokens;
    hist_observe(&v->h[H_PROMPT], &HISTS[H_PROMPT], f->prompt_tokens);
    hist_observe(&v->h[H_GEN], &HISTS[H_GEN], f->generation_tokens);
    hist_observe(&v->h[H_QUEUE], &HISTS[H_QUEUE], f->queue_s);
    hist_observe(&v->h[H_E2E], &HISTS[H_E2E], f->e2e_s);
    pthread_mutex_unlock(&m->mu);
}

void rtr_metrics_publish(rtr_metrics *m, const rtr_metrics_load *load, const rtr_workers *reg) {
    pthread_mutex_lock(&m->mu);
    mvals *v = &m->v;
    v->waiting = load->waiting;
    v->running = load->running;
    v->requeued = load->requeued;
    v->restarts = reg->restarts;
    v->workers_live = (uint32_t)rtr_workers_live(reg);
    v->nworkers = reg->n;
    for (size_t i = 0; i < reg->n; i++) {
        const rtr_worker *w = reg->w[i];
        const Metrale__V1__WorkerStats *s = &w->stats;
        /* rtr_workers_hello zeroes the stats: a new process counts from zero again */
        if (w->hellos != m->prev_hellos[i]) {
            memset(m->prev[i], 0, sizeof m->prev[i]);
            m->prev_hellos[i] = w->hellos;
        }
        const uint64_t now[WC_COUNT] = {
            [WC_PREFIX_HITS] = s->prefix_hits,  [WC_PREFIX_MISSES] = s->prefix_misses,
            [WC_PREEMPTIONS] = s->preemptions,  [WC_SPEC_STEPS] = s->speculative_steps,
            [WC_DRAFTS] = s->draft_tokens,      [WC_ACCEPTED] = s->accepted_tokens,
        };
        for (int k = 0; k < WC_COUNT; k++) {
            v->wc[k] += now[k] >= m->prev[i][k] ? now[k] - m->prev[i][k] : now[k];
            m->prev[i][k] = now[k];
        }
        v->w[i] = (mworker){
            .id = w->id,
            .alive = w->alive,
            .sequences = s->live_sequences,
            .bytes_sequences = s->cache_bytes_in_use,
            .bytes_prefixes = s->prefix_cache_bytes,
            .pages_free = s->cache_pages_free,
            .pages_total = s->cache_pages_total,
            .slots_free = s->slots_free,
            .slots_total = s->slots_total,
        };
    }
    pthread_mutex_unlock(&m->mu);
}

/* ---- rendering ---- */

typedef struct sbuf {
    char *s;
    size_t len, cap;
    bool oom;
} sbuf;

static void sb_printf(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_printf(sbuf *b, const char *fmt, ...) {
    if (b->oom) return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(b->s + b->len, b->cap - b->len, fmt, ap);
        va_end(ap);
        if (n < 0) {
            b->oom = true;
            return;
        }
        if ((size_t)n < b->cap - b->len) {
            b->len += (size_t)n;
            return;
        }
        size_t cap = b->cap * 2 > b->len + (size_t)n + 1 ? b->cap * 2 : b->len + (size_t)n + 1;
        char *s = realloc(b->s, cap);
        if (!s) {
            b->oom = true;
            return;
        }
        b->s = s;
        b->cap = cap;
    }
}

/* A label value with \, " and newline escaped, as the text format wants. */
static void sb_label_value(sbuf *b, const char *s) {
    for (; *s; s++) {
        if (*s == '\\') sb_printf(b, "\\\\");
        else if (*s == '"') sb_printf(b, "\\\"");
        else if (*s == '\n') sb_printf(b, "\\n");
        else sb_printf(b, "%c", *s);
    }
}

static void family(sbuf *b, const char *name, const char *type, const char *help) {
    sb_printf(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

static void scalar(sbuf *b, const char *name, const char *type, const char *help, uint64_t x) {
    family(b, name, type, help);
    sb_printf(b, "%s %llu\n", name, (unsigned long long)x);
}

static void render_hist(sbuf *b, const hist *h, const hist_def *d) {
    family(b, d->name, "histogram", d->help);
    uint64_t cum = 0;
    for (int i = 0; i < d->n; i++) {
        cum += h->bucket[i];
        sb_printf(b, "%s_bucket{le=\"%g\"} %llu\n", d->name, d->le[i], (unsigned long long)cum);
    }
    sb_printf(b, "%s_bucket{le=\"+Inf\"} %llu\n", d->name, (unsigned long long)h->count);
    sb_printf(b, "%s_sum %.17g\n", d->name, h->sum);
    sb_printf(b, "%s_count %llu\n", d->name, (unsigned long long)h->count);
}

/* One gauge per live worker: get(w) for each, as worker="<id>". */
typedef double (*worker_get)(const mworker *w);
static void per_worker(sbuf *b, const mvals *v, const char *name, const char *help, worker_get get) {
    family(b, name, "gauge", help);
    for (size_t i = 0; i < v->nworkers; i++)
        if (v->w[i].alive) sb_printf(b, "%s{worker=\"%u\"} %.17g\n", name, v->w[i].id, get(&v->w[i]));
}

static double used(uint32_t free, uint32_t total) { return free < total ? total - free : 0; }
static double w_sequences(const mworker *w) { return w->sequences; }
static double w_pages_used(const mworker *w) { return used(w->pages_free, w->pages_total); }
static double w_pages_total(const mworker *w) { return w->pages_total; }
static double w_pages_perc(const mworker *w) { return w->pages_total ? w_pages_used(w) / w->pages_total : 0; }
static double w_slots_used(const mworker *w) { return used(w->slots_free, w->slots_total); }
static double w_slots_total(const mworker *w) { return w->slots_total; }

static void render(sbuf *b, const mvals *v, const char *version) {
    family(b, "metrale_build_info", "gauge", "The router's version (always 1).");
    sb_printf(b, "metrale_build_info{version=\"");
    sb_label_value(b, version);
    sb_printf(b, "\"} 1\n");

    scalar(b, "metrale_num_requests_waiting", "gauge",
           "Requests in the router's admission queue, waiting for a worker with room.", v->waiting);
    scalar(b, "metrale_num_requests_running", "gauge", "Requests submitted to a worker and streaming.", v->running);
    scalar(b, "metrale_num_workers_live", "gauge", "Workers (rank 0 of each group) connected and heartbeating.",
           v->workers_live);
    scalar(b, "metrale_worker_restarts_total", "counter", "Workers that came back after being declared dead.",
           v->restarts);
    scalar(b, "metrale_requests_requeued_total", "counter",
           "Requests moved to another worker because theirs died before their first token.", v->requeued);

    family(b, "metrale_requests_total", "counter", "Generate calls by their final gRPC status code.");
    bool shown[CODES] = {false};
    for (size_t i = 0; i < sizeof CODES_SHOWN / sizeof CODES_SHOWN[0]; i++) shown[CODES_SHOWN[i]] = true;
    for (int c = 0; c < CODES; c++)
        if (shown[c] || v->codes[c])
            sb_printf(b, "metrale_requests_total{code=\"%s\"} %llu\n", CODE_NAMES[c], (unsigned long long)v->codes[c]);

    family(b, "metrale_request_success_total", "counter",
           "Requests a worker finished, by finish reason (abort: the client went away or the server shut down).");
    for (int r = 0; r < R_COUNT; r++)
        sb_printf(b, "metrale_request_success_total{finished_reason=\"%s\"} %llu\n", REASON_NAMES[r],
                  (unsigned long long)v->reasons[r]);

    scalar(b, "metrale_prompt_tokens_total", "counter", "Prompt tokens of the requests a worker finished.",
           v->prompt_tokens);
    scalar(b, "metrale_generation_tokens_total", "counter",
           "Tokens the workers generated and sent for requests (streamed, or dropped after the client left).",
           v->generation_tokens);
    for (int h = 0; h < H_COUNT; h++) render_hist(b, &v->h[h], &HISTS[h]);

    scalar(b, "metrale_prefix_cache_queries_total", "counter",
           "Requests that looked for a kept prompt prefix when admitted (counted in requests, not tokens).",
           v->wc[WC_PREFIX_HITS] + v->wc[WC_PREFIX_MISSES]);
    scalar(b, "metrale_prefix_cache_hits_total", "counter", "Requests admitted that reused a kept prompt prefix.",
           v->wc[WC_PREFIX_HITS]);
    scalar(b, "metrale_num_preemptions_total", "counter",
           "Running sequences sent back to wait for cache room (recomputed later).", v->wc[WC_PREEMPTIONS]);
    scalar(b, "metrale_spec_decode_num_drafts_total", "counter", "Speculative decoding: verify steps.",
           v->wc[WC_SPEC_STEPS]);
    scalar(b, "metrale_spec_decode_num_draft_tokens_total", "counter", "Speculative decoding: draft tokens proposed.",
           v->wc[WC_DRAFTS]);
    scalar(b, "metrale_spec_decode_num_accepted_tokens_total", "counter",
           "Speculative decoding: draft tokens the model accepted.", v->wc[WC_ACCEPTED]);

    per_worker(b, v, "metrale_worker_num_sequences", "Sequences a live worker holds, running or waiting.",
               w_sequences);
    family(b, "metrale_cache_bytes", "gauge",
           "Per-sequence state memory a live worker's pools hold, by holder: running sequences or kept prefixes.");
    for (size_t i = 0; i < v->nworkers; i++) {
        const mworker *w = &v->w[i];
        if (!w->alive) continue;
        sb_printf(b, "metrale_cache_bytes{worker=\"%u\",holder=\"sequences\"} %llu\n", w->id,
                  (unsigned long long)w->bytes_sequences);
        sb_printf(b, "metrale_cache_bytes{worker=\"%u\",holder=\"prefixes\"} %llu\n", w->id,
                  (unsigned long long)w->bytes_prefixes);
    }
    per_worker(b, v, "metrale_kv_cache_usage_perc",
               "Fraction of a live worker's cache pages in use (running sequences and kept prefixes), 0 to 1.",
               w_pages_perc);
    per_worker(b, v, "metrale_cache_pages_used", "Cache pages in use (running sequences and kept prefixes).",
               w_pages_used);
    per_worker(b, v, "metrale_cache_pages_capacity", "Cache pages in a live worker's pool.", w_pages_total);
    per_worker(b, v, "metrale_state_slots_used",
               "Per-sequence state slots in use (running sequences, kept prefixes, the graph pad).", w_slots_used);
    per_worker(b, v, "metrale_state_slots_capacity", "Per-sequence state slots in a live worker's pool.",
               w_slots_total);
}

char *rtr_metrics_render(rtr_metrics *m, size_t *len) {
    mvals *v = malloc(sizeof *v);
    if (!v) return NULL;
    pthread_mutex_lock(&m->mu);
    memcpy(v, &m->v, offsetof(mvals, w) + m->v.nworkers * sizeof(mworker));
    pthread_mutex_unlock(&m->mu);
    sbuf b = {.s = malloc(16384), .cap = 16384};
    if (!b.s) {
        free(v);
        return NULL;
    }
    b.s[0] = '\0';
    render(&b, v, m->version);
    free(v);
    if (b.oom) {
        free(b.s);
        return NULL;
    }
    if (len) *len = b.len;
    return b.s;
}

/* ---- the endpoint ---- */

static void http_log(void *cls, const char *fmt, va_list ap) {
    (void)cls;
    char msg[512];
    vsnprintf(msg, sizeof msg, fmt, ap);
    size_t n = strlen(msg);
    while (n && (msg[n - 1] == '\n' || msg[n - 1] == '\r')) msg[--n] = '\0';
    mt_log(MT_LOG_WARN, "router: metrics endpoint: %s", msg);
}

static enum MHD_Result reply_text(struct MHD_Connection *c, unsigned code, const char *text) {
    struct MHD_Response *r = MHD_create_response_from_buffer(strlen(text), (void *)text, MHD_RESPMEM_PERSISTENT);
    if (!r) return MHD_NO;
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, "text/plain; charset=utf-8");
    if (code == MHD_HTTP_METHOD_NOT_ALLOWED) MHD_add_response_header(r, MHD_HTTP_HEADER_ALLOW, "GET, HEAD");
    enum MHD_Result ret = MHD_queue_response(c, code, r);
    MHD_destroy_response(r);
    return ret;
}

/* libmicrohttpd's thread: every request, answered at its first call (a request body, if any,
 * is not read). */
static enum MHD_Result on_http(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                               const char *version, const char *upload_data, size_t *upload_data_size,
                               void **req_cls) {
    (void)version, (void)upload_data, (void)upload_data_size, (void)req_cls;
    rtr_metrics *m = cls;
    if (strcmp(method, MHD_HTTP_METHOD_GET) && strcmp(method, MHD_HTTP_METHOD_HEAD))
        return reply_text(c, MHD_HTTP_METHOD_NOT_ALLOWED, "only GET and HEAD\n");
    if (strcmp(url, "/metrics")) return reply_text(c, MHD_HTTP_NOT_FOUND, "not found: the metrics are at /metrics\n");
    size_t len;
    char *text = rtr_metrics_render(m, &len);
    if (!text) return reply_text(c, MHD_HTTP_INTERNAL_SERVER_ERROR, "out of memory\n");
    struct MHD_Response *r = MHD_create_response_from_buffer(len, text, MHD_RESPMEM_MUST_FREE);
    if (!r) {
        free(text);
        return MHD_NO;
    }
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8");
    enum MHD_Result ret = MHD_queue_response(c, MHD_HTTP_OK, r);
    MHD_destroy_response(r);
    return ret;
}

/* "HOST:PORT" or "[IPv6]:PORT" to a socket address. */
static mt_status parse_listen(const char *listen, struct sockaddr_storage *out, mt_error *err) {
    char host[256];
    const char *port;
    if (listen[0] == '[') {
        const char *close = strchr(listen, ']');
        if (!close || close[1] != ':' || (size_t)(close - listen - 1) >= sizeof host) goto bad;
        memcpy(host, listen + 1, (size_t)(close - listen - 1));
        host[close - listen - 1] = '\0';
        port = close + 2;
    } else {
        const char *colon = strrchr(listen, ':');
        const size_t n = colon ? (size_t)(colon - listen) : 0;
        if (n == 0 || n >= sizeof host || memchr(listen, ':', n)) goto bad; /* a bare IPv6 address needs [] */
        memcpy(host, listen, n);
        host[n] = '\0';
        port = colon + 1;
    }
    char *end;
    errno = 0;
    long p = strtol(port, &end, 10);
    if (!*port || *end || errno || p < 0 || p > 65535) goto bad;
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_NUMERICSERV};
    struct addrinfo *res = NULL;
    int rc = getaddrinfo(host, port, &hints, &res);
    if (rc || !res)
        return mt_errorf(err, MT_ERR_INVALID, "metrics: %s: cannot resolve %s: %s", listen, host, gai_strerror(rc));
    memset(out, 0, sizeof *out);
    memcpy(out, res->ai_addr, res->ai_addrlen);
    freeaddrinfo(res);
    return MT_OK;
bad:
    return mt_errorf(err, MT_ERR_INVALID, "metrics: \"%s\" is not HOST:PORT (e.g. 0.0.0.0:8000; port 0..65535)",
                     listen);
}

mt_status rtr_metrics_serve(rtr_metrics *m, const char *listen, int *port, mt_error *err) {
    if (m->http) return mt_errorf(err, MT_ERR_STATE, "metrics: already serving");
    struct sockaddr_storage addr;
    mt_status st = parse_listen(listen, &addr, err);
    if (st) return st;
    unsigned flags = MHD_USE_AUTO_INTERNAL_THREAD | MHD_USE_ERROR_LOG;
    if (addr.ss_family == AF_INET6) flags |= MHD_USE_IPv6;
    errno = 0;
    /* Scrapes are rare and small: a few connections, each dropped after 10 s of silence. */
    /* the port is taken from addr; MHD's own messages name this one */
    const uint16_t want = ntohs(addr.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&addr)->sin6_port
                                                           : ((struct sockaddr_in *)&addr)->sin_port);
    m->http = MHD_start_daemon(flags, want, NULL, NULL, on_http, m, MHD_OPTION_EXTERNAL_LOGGER, http_log, NULL,
                               MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&addr, MHD_OPTION_CONNECTION_LIMIT,
                               (unsigned)16, MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)10, MHD_OPTION_END);
    if (!m->http)
        return mt_errorf(err, MT_ERR_IO, "metrics: cannot serve on %s%s%s", listen, errno ? ": " : "",
                         errno ? strerror(errno) : "");
    const union MHD_DaemonInfo *info = MHD_get_daemon_info(m->http, MHD_DAEMON_INFO_BIND_PORT);
    *port = info ? info->port : 0;
    return MT_OK;
}
