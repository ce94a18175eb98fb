/* router/grpc_server.c: see grpc_server.h.
 *
 * Every batch we start carries a tag embedded in its call (or request slot); the completion-queue
 * thread pushes (tag, ok) to `events` and writes the eventfd; rtr_grpc_dispatch, on the owner's
 * thread, pops them and advances the call. A call is freed once its close was reported and no
 * batch of it is outstanding.
 *
 * The health port is a second grpc_server on the same completion queue, with request slots of its
 * own that know they serve grpc.health.v1 only. Which port a call came in on is thus known from
 * its slot, whatever the two ports' credentials.
 */
#include "router/grpc_server.h"

#include <errno.h>
#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/support/log.h>
#include <grpc/slice.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "common/wire_limits.h"
#include "router/auth.h"
#include "router/tls.h"

#define REQUEST_SLOTS 8 /* grpc_server_request_call posted at once on the serving port */
#define HEALTH_SLOTS 2  /* ... and on the health port */
#define NSLOTS (REQUEST_SLOTS + HEALTH_SLOTS)
#define REFUSAL_LOG_S 1.0 /* refused tokens: one log line a second at most */

static const char *const METHOD_PATHS[RTR_METHOD_COUNT] = {
    [RTR_METHOD_GENERATE] = "/metrale.v1.Generation/Generate",
    [RTR_METHOD_GET_MODEL_INFO] = "/metrale.v1.Generation/GetModelInfo",
    [RTR_METHOD_GET_STATS] = "/metrale.v1.Generation/GetStats",
    [RTR_METHOD_HEALTH_CHECK] = "/grpc.health.v1.Health/Check",
    [RTR_METHOD_HEALTH_WATCH] = "/grpc.health.v1.Health/Watch",
    [RTR_METHOD_TOKENIZE] = "/metrale.v1.Generation/Tokenize",
};

const char *rtr_method_path(rtr_method m) {
    return (unsigned)m < RTR_METHOD_COUNT ? METHOD_PATHS[m] : "(unknown)";
}

typedef enum tag_kind { TAG_NEW, TAG_RECV, TAG_SEND, TAG_STATUS, TAG_CLOSE, TAG_SHUTDOWN } tag_kind;

struct request_slot;
typedef struct rtr_tag {
    tag_kind kind;
    rtr_call *call;             /* RECV, SEND, STATUS, CLOSE */
    struct request_slot *slot;  /* NEW */
} rtr_tag;

typedef struct request_slot {
    rtr_tag tag;
    grpc_server *server;      /* the one it is posted on */
    bool health_only;         /* the health port's: only grpc.health.v1 is served */
    grpc_call *call;
    grpc_call_details details;
    grpc_metadata_array md;
    bool armed; /* a request_call is outstanding on it */
} request_slot;

struct rtr_call {
    rtr_grpc *g;
    grpc_call *call;
    int method;               /* rtr_method, or -1 for an unknown path */
    double deadline;          /* mt_now() clock; INFINITY = none */
    uint64_t deadline_unix_ms;
    rtr_tag t_recv, t_send, t_status, t_close;
    int outstanding;          /* batches started, not yet completed */
    int cancelled;            /* written by RECV_CLOSE_ON_SERVER */
    grpc_byte_buffer *recv_buf;
    grpc_byte_buffer *send_buf;   /* of the send in flight */
    grpc_byte_buffer *status_buf; /* last message of the finish batch */
    bool got_request;         /* the one request message arrived (later receives are extras) */
    bool md_sent;             /* initial metadata went out */
    bool send_busy;
    bool finished;            /* rtr_call_finish was called */
    bool status_started;
    bool closed;              /* on_done delivered */
    /* A finish requested while a send was in flight. */
    grpc_status_code pending_code;
    char *pending_details;
    struct rtr_stream *stream;
    struct rtr_health_watch *watch;
    struct rtr_tokenize *tokenize;
};

typedef struct event {
    rtr_tag *tag;
    bool ok;
} event;

struct rtr_grpc {
    rtr_grpc_handlers h;
    grpc_server *server;
    grpc_server *health_server; /* NULL without a health port */
    int health_port;
    grpc_completion_queue *cq;
    pthread_t thread;
    bool thread_started;
    int efd;
    request_slot slots[NSLOTS]; /* [0, REQUEST_SLOTS) the serving port's, the rest the health port's */
    size_t nslots;
    rtr_tag shutdown_tag;
    bool shutting_down;
    int shutdowns_pending;      /* servers whose shutdown has not been notified yet */
    size_t ncalls;
    char *auth_token;           /* NULL: no token asked for */
    double last_refusal_log;
    /* events: written by the cq thread, read by the owner; guarded by mu */
    pthread_mutex_t mu;
    event *events;
    size_t nevents, cap_events;
    event *spare; /* the owner's swap buffer */
    size_t cap_spare;
};

rtr_grpc_params rtr_grpc_default_params(void) {
    return (rtr_grpc_params){.listen = "127.0.0.1:0", .max_message_bytes = MT_WIRE_REQUEST_BYTES_MAX};
}

/* ---- the completion-queue thread: forwards, nothing else ---- */

static void push_event(rtr_grpc *g, rtr_tag *tag, bool ok) {
    pthread_mutex_lock(&g->mu);
    if (g->nevents == g->cap_events) {
        size_t cap = g->cap_events ? 2 * g->cap_events : 256;
        event *e = realloc(g->events, cap * sizeof *e);
        MT_ASSERT(e != NULL); /* losing a completion would leak a call forever */
        g->events = e;
        g->cap_events = cap;
    }
    g->events[g->nevents++] = (event){tag, ok};
    const bool wake = g->nevents == 1;
    pthread_mutex_unlock(&g->mu);
    if (wake) {
        uint64_t one = 1;
        while (write(g->efd, &one, sizeof one) < 0 && errno == EINTR) {}
    }
}

static void *cq_thread(void *arg) {
    rtr_grpc *g = arg;
    for (;;) {
        grpc_event ev = grpc_completion_queue_next(g->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
        if (ev.type == GRPC_QUEUE_SHUTDOWN) break;
        if (ev.type == GRPC_OP_COMPLETE) push_event(g, ev.tag, ev.success != 0);
    }
    return NULL;
}

/* ---- batches ---- */

static void start_batch(rtr_call *c, const grpc_op *ops, size_t n, rtr_tag *tag) {
    grpc_call_error e = grpc_call_start_batch(c->call, ops, n, tag, NULL);
    /* Our state machine never starts two batches of one kind or one after the status: a failure
     * here is a bug in this file, not bad input. */
    MT_ASSERT(e == GRPC_CALL_OK);
    c->outstanding++;
}

/* Every method takes exactly one request message. A call with none, or with a second one, breaks
 * the request cardinality, which gRPC answers UNIMPLEMENTED: grpc/grpc doc/statuscodes.md, "Request
 * cardinality violation (method requires exactly one request but client sent some other number of
 * requests) | UNIMPLEMENTED | Server". gRPC core leaves the check to the application: after the
 * request, one more receive stays posted while the call is open, and it must end with the
 * client's half-close (on_recv). */
static void start_recv(rtr_call *c) {
    grpc_op op;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_RECV_MESSAGE;
    op.data.recv_message.recv_message = &c->recv_buf;
    start_batch(c, &op, 1, &c->t_recv);
}

static grpc_byte_buffer *pack(const ProtobufCMessage *m) {
    size_t n = protobuf_c_message_get_packed_size(m);
    grpc_slice s = grpc_slice_malloc(n);
    protobuf_c_message_pack(m, GRPC_SLICE_START_PTR(s));
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&s, 1);
    grpc_slice_unref(s);
    return bb;
}

static size_t add_initial_md(rtr_call *c, grpc_op *op) {
    if (c->md_sent) return 0;
    memset(op, 0, sizeof *op);
    op->op = GRPC_OP_SEND_INITIAL_METADATA;
    c->md_sent = true;
    return 1;
}

static void start_status(rtr_call *c, grpc_status_code code, const char *details) {
    grpc_op ops[3];
    size_t n = add_initial_md(c, &ops[0]);
    if (c->status_buf) {
        memset(&ops[n], 0, sizeof ops[n]);
        ops[n].op = GRPC_OP_SEND_MESSAGE;
        ops[n].data.send_message.send_message = c->status_buf;
        n++;
    }
    grpc_slice msg = grpc_slice_from_copied_string(details ? details : "");
    memset(&ops[n], 0, sizeof ops[n]);
    ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
    ops[n].data.send_status_from_server.status = code;
    ops[n].data.send_status_from_server.status_details = details && *details ? &msg : NULL;
    n++;
    c->status_started = true;
    start_batch(c, ops, n, &c->t_status);
    grpc_slice_unref(msg); /* not retained past start_batch (grpc_types.h) */
}

mt_status rtr_call_send(rtr_call *c, const ProtobufCMessage *msg) {
    if (c->send_busy || c->finished) return MT_ERR_STATE;
    grpc_op ops[2];
    size_t n = add_initial_md(c, &ops[0]);
    c->send_buf = pack(msg);
    memset(&ops[n], 0, sizeof ops[n]);
    ops[n].op = GRPC_OP_SEND_MESSAGE;
    ops[n].data.send_message.send_message = c->send_buf;
    n++;
    c->send_busy = true;
    start_batch(c, ops, n, &c->t_send);
    return MT_OK;
}

bool rtr_call_send_busy(const rtr_call *c) { return c->send_busy; }
bool rtr_call_finished(const rtr_call *c) { return c->finished; }

mt_status rtr_call_finish(rtr_call *c, grpc_status_code code, const char *details, const ProtobufCMessage *last) {
    if (c->finished) return MT_ERR_STATE;
    c->finished = true;
    if (last) c->status_buf = pack(last);
    if (c->send_busy) {
        c->pending_code = code;
        c->pending_details = details ? strdup(details) : NULL;
        return MT_OK;
    }
    start_status(c, code, details);
    return MT_OK;
}

/* ---- calls ---- */

static double deadline_mono(gpr_timespec d) {
    if (gpr_time_cmp(d, gpr_inf_future(d.clock_type)) == 0) return INFINITY;
    gpr_timespec left = gpr_time_sub(gpr_convert_clock_type(d, GPR_CLOCK_MONOTONIC), gpr_now(GPR_CLOCK_MONOTONIC));
    return mt_now() + (double)left.tv_sec + left.tv_nsec * 1e-9;
}

static uint64_t deadline_unix_ms(gpr_timespec d) {
    if (gpr_time_cmp(d, gpr_inf_future(d.clock_type)) == 0) return 0;
    gpr_timespec r = gpr_convert_clock_type(d, GPR_CLOCK_REALTIME);
    if (r.tv_sec < 0) return 1; /* already past: any non-zero past time */
    return (uint64_t)r.tv_sec * 1000u + (uint64_t)r.tv_nsec / 1000000u;
}

static void maybe_free_call(rtr_call *c) {
    if (!c->closed || c->outstanding > 0) return;
    grpc_call_unref(c->call);
    if (c->recv_buf) grpc_byte_buffer_destroy(c->recv_buf);
    if (c->send_buf) grpc_byte_buffer_destroy(c->send_buf);
    if (c->status_buf) grpc_byte_buffer_destroy(c->status_buf);
    free(c->pending_details);
    c->g->ncalls--;
    free(c);
}

static void arm_slot(rtr_grpc *g, request_slot *s) {
    if (g->shutting_down) return;
    s->call = NULL;
    grpc_call_details_init(&s->details);
    grpc_metadata_array_init(&s->md);
    grpc_call_error e = grpc_server_request_call(s->server, &s->call, &s->details, &s->md, g->cq, g->cq, &s->tag);
    if (e != GRPC_CALL_OK) {
        mt_log(MT_LOG_ERROR, "router: grpc_server_request_call failed (%d)", (int)e);
        grpc_call_details_destroy(&s->details);
        grpc_metadata_array_destroy(&s->md);
        return;
    }
    s->armed = true;
}

static bool is_health(int method) {
    return method == RTR_METHOD_HEALTH_CHECK || method == RTR_METHOD_HEALTH_WATCH;
}

/* The status a call gets before it reaches the handlers (GRPC_STATUS_OK: none): the health
 * port's calls other than health, and calls without the token (health calls never need it). */
static grpc_status_code refusal(rtr_grpc *g, const request_slot *s, int method, const char **why) {
    if (s->health_only && !is_health(method)) {
        *why = "this port serves grpc.health.v1 only";
        return GRPC_STATUS_UNIMPLEMENTED;
    }
    if (g->auth_token && !is_health(method) && !rtr_auth_metadata_ok(g->auth_token, &s->md)) {
        *why = "missing or wrong bearer token (authorization: Bearer <token>)";
        if (mt_now() - g->last_refusal_log >= REFUSAL_LOG_S) {
            char *peer = grpc_call_get_peer(s->call);
            mt_log(MT_LOG_WARN, "router: refused a call from %s: no valid bearer token", peer ? peer : "?");
            gpr_free(peer);
            g->last_refusal_log = mt_now();
        }
        return GRPC_STATUS_UNAUTHENTICATED;
    }
    return GRPC_STATUS_OK;
}

static void on_new_call(rtr_grpc *g, request_slot *s, bool ok) {
    s->armed = false;
    grpc_call *call = s->call;
    int method = -1;
    for (int m = 0; m < RTR_METHOD_COUNT; m++)
        if (ok && grpc_slice_str_cmp(s->details.method, METHOD_PATHS[m]) == 0) method = m;
    const char *why = NULL;
    const grpc_status_code refused = ok ? refusal(g, s, method, &why) : GRPC_STATUS_OK;
    double dl = ok ? deadline_mono(s->details.deadline) : INFINITY;
    uint64_t dl_ms = ok ? deadline_unix_ms(s->details.deadline) : 0;
    grpc_call_details_destroy(&s->details);
    grpc_metadata_array_destroy(&s->md);
    arm_slot(g, s);
    if (!ok) return; /* the server is shutting down */

    rtr_call *c = calloc(1, sizeof *c);
    if (!c) {
        /* Cannot track it: cancel and drop our reference; gRPC frees the rest. */
        grpc_call_cancel_with_status(call, GRPC_STATUS_RESOURCE_EXHAUSTED, "router out of memory", NULL);
        grpc_call_unref(call);
        return;
    }
    c->g = g;
    c->call = call;
    c->method = method;
    c->deadline = dl;
    c->deadline_unix_ms = dl_ms;
    c->t_recv = (rtr_tag){TAG_RECV, c, NULL};
    c->t_send = (rtr_tag){TAG_SEND, c, NULL};
    c->t_status = (rtr_tag){TAG_STATUS, c, NULL};
    c->t_close = (rtr_tag){TAG_CLOSE, c, NULL};
    g->ncalls++;

    grpc_op op;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_RECV_CLOSE_ON_SERVER;
    op.data.recv_close_on_server.cancelled = &c->cancelled;
    start_batch(c, &op, 1, &c->t_close);

    if (refused != GRPC_STATUS_OK) {
        c->finished = true;
        start_status(c, refused, why);
        return;
    }
    if (method < 0) {
        c->finished = true;
        start_status(c, GRPC_STATUS_UNIMPLEMENTED, "unknown method");
        return;
    }
    start_recv(c);
}

static void on_recv(rtr_grpc *g, rtr_call *c, bool ok) {
    grpc_byte_buffer *msg = c->recv_buf; /* NULL: the client half-closed */
    c->recv_buf = NULL;
    const bool live = ok && !c->closed && !c->finished; /* else the call broke or ended; its close follows */
    if (!live || c->got_request) {
        if (msg) grpc_byte_buffer_destroy(msg);
        if (live && msg)
            rtr_call_finish(c, GRPC_STATUS_UNIMPLEMENTED,
                            "more than one request message on a call that takes exactly one (cardinality)", NULL);
        return; /* a half-close after the request: as it should be */
    }
    if (!msg) {
        rtr_call_finish(c, GRPC_STATUS_UNIMPLEMENTED,
                        "no request message on a call that takes exactly one (cardinality)", NULL);
        return;
    }
    c->got_request = true;
    grpc_byte_buffer_reader r;
    if (!grpc_byte_buffer_reader_init(&r, msg)) {
        grpc_byte_buffer_destroy(msg);
        rtr_call_finish(c, GRPC_STATUS_INVALID_ARGUMENT, "request message could not be decompressed", NULL);
        return;
    }
    grpc_slice s = grpc_byte_buffer_reader_readall(&r);
    grpc_byte_buffer_reader_destroy(&r);
    grpc_byte_buffer_destroy(msg);
    g->h.on_request(g->h.router, c, (rtr_method)c->method, GRPC_SLICE_START_PTR(s), GRPC_SLICE_LENGTH(s));
    grpc_slice_unref(s);
    if (!c->finished) start_recv(c); /* a stream, or an answer that waits: watch for a second request */
}

static void on_send(rtr_grpc *g, rtr_call *c, bool ok) {
    c->send_busy = false;
    grpc_byte_buffer_destroy(c->send_buf);
    c->send_buf = NULL;
    if (c->closed) return;
    if (c->finished) {
        if (!c->status_started) start_status(c, c->pending_code, c->pending_details);
        return;
    }
    g->h.on_send_done(g->h.router, c, ok);
}

static void on_close(rtr_grpc *g, rtr_call *c, bool ok) {
    if (c->closed) return;
    c->closed = true;
    g->h.on_done(g->h.router, c, c->cancelled != 0 || !ok);
}

static void handle_event(rtr_grpc *g, rtr_tag *t, bool ok) {
    if (t->kind == TAG_SHUTDOWN) {
        g->shutdowns_pending--;
        return;
    }
    if (t->kind == TAG_NEW) {
        on_new_call(g, t->slot, ok);
        return;
    }
    rtr_call *c = t->call;
    c->outstanding--;
    switch (t->kind) {
    case TAG_RECV: on_recv(g, c, ok); break;
    case TAG_SEND: on_send(g, c, ok); break;
    case TAG_STATUS: break;
    case TAG_CLOSE: on_close(g, c, ok); break;
    default: MT_ASSERT(!"unknown tag kind");
    }
    maybe_free_call(c);
}

void rtr_grpc_dispatch(rtr_grpc *g) {
    uint64_t v;
    while (read(g->efd, &v, sizeof v) < 0 && errno == EINTR) {}
    for (;;) {
        pthread_mutex_lock(&g->mu);
        event *batch = g->events;
        size_t n = g->nevents, cap = g->cap_events;
        g->events = g->spare;
        g->cap_events = g->cap_spare;
        g->nevents = 0;
        pthread_mutex_unlock(&g->mu);
        g->spare = batch;
        g->cap_spare = cap;
        if (n == 0) return;
        for (size_t i = 0; i < n; i++) handle_event(g, batch[i].tag, batch[i].ok);
    }
}

int rtr_grpc_fd(const rtr_grpc *g) { return g->efd; }

/* ---- server ---- */

/* gRPC's own log lines go through mt_log, so that they take the process's format. */
static void grpc_log(gpr_log_func_args *a) {
    const mt_log_level lvl = a->severity == GPR_LOG_SEVERITY_ERROR  ? MT_LOG_ERROR
                             : a->severity == GPR_LOG_SEVERITY_INFO ? MT_LOG_INFO
                                                                    : MT_LOG_DEBUG;
    mt_log(lvl, "router: grpc: %s (%s:%d)", a->message, a->file, a->line);
}

/* A server on one address with the given credentials (released here); NULL + err if it cannot
 * bind. Not started. */
static grpc_server *make_server(rtr_grpc *g, const grpc_channel_args *args, const char *addr,
                                grpc_server_credentials *creds, const char *what, int *bound, mt_error *err) {
    grpc_server *srv = grpc_server_create(args, NULL);
    grpc_server_register_completion_queue(srv, g->cq, NULL);
    *bound = creds ? grpc_server_add_http2_port(srv, addr, creds) : 0;
    if (creds) grpc_server_credentials_release(creds);
    if (*bound <= 0) {
        mt_errorf(err, MT_ERR_IO, "router: cannot listen on %s (%s)%s", addr, what,
                  creds ? "" : ": its credentials could not be made");
        grpc_server_destroy(srv); /* never started: no shutdown needed */
        return NULL;
    }
    return srv;
}

/* Shuts down and cancels every server; returns once the queue drained their notifications (the
 * completion-queue thread is not running). */
static void shutdown_unthreaded(rtr_grpc *g) {
    grpc_server *servers[2] = {g->server, g->health_server};
    for (int i = 0; i < 2; i++) {
        if (!servers[i]) continue;
        grpc_server_shutdown_and_notify(servers[i], g->cq, &g->shutdown_tag);
        grpc_server_cancel_all_calls(servers[i]);
        grpc_event ev;
        do ev = grpc_completion_queue_next(g->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
        while (!(ev.type == GRPC_OP_COMPLETE && ev.tag == &g->shutdown_tag));
    }
}

rtr_grpc *rtr_grpc_create(const rtr_grpc_params *params, const rtr_grpc_handlers *handlers, int *port,
                          mt_error *err) {
    gpr_set_log_function(grpc_log);
    rtr_grpc *g = calloc(1, sizeof *g);
    if (!g) {
        mt_errorf(err, MT_ERR_NOMEM, "router: out of memory");
        return NULL;
    }
    g->h = *handlers;
    g->efd = -1;
    pthread_mutex_init(&g->mu, NULL);
    grpc_init();
    g->shutdown_tag.kind = TAG_SHUTDOWN;
    bool started = false;

    if ((g->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) < 0) {
        mt_errorf(err, MT_ERR_IO, "router: eventfd: %s", strerror(errno));
        goto fail;
    }
    grpc_arg args[] = {
        {.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH,
         .value.integer = (int)params->max_message_bytes},
    };
    grpc_channel_args ch_args = {.num_args = sizeof args / sizeof args[0], .args = args};
    g->cq = grpc_completion_queue_create_for_next(NULL);
    grpc_server_credentials *creds =
        params->tls ? rtr_tls_server_credentials(params->tls) : grpc_insecure_server_credentials_create();
    if (!(g->server = make_server(g, &ch_args, params->listen, creds, params->tls ? "TLS" : "plaintext", port, err)))
        goto fail;
    if (params->health_listen) {
        /* health requests are small: the default receive limit is plenty */
        g->health_server = make_server(g, NULL, params->health_listen, grpc_insecure_server_credentials_create(),
                                       "health, plaintext", &g->health_port, err);
        if (!g->health_server) goto fail;
    }
    g->nslots = REQUEST_SLOTS + (g->health_server ? HEALTH_SLOTS : 0);
    for (size_t i = 0; i < g->nslots; i++) {
        request_slot *s = &g->slots[i];
        s->tag = (rtr_tag){TAG_NEW, NULL, s};
        s->health_only = i >= REQUEST_SLOTS;
        s->server = s->health_only ? g->health_server : g->server;
    }
    grpc_server_start(g->server);
    if (g->health_server) grpc_server_start(g->health_server);
    started = true;
    if (pthread_create(&g->thread, NULL, cq_thread, g)) {
        mt_errorf(err, MT_ERR_IO, "router: cannot start the completion-queue thread");
        goto fail;
    }
    g->thread_started = true;
    for (size_t i = 0; i < g->nslots; i++) arm_slot(g, &g->slots[i]);
    return g;
fail:
    if (started) shutdown_unthreaded(g); /* drains the queue on this thread */
    if (g->server) grpc_server_destroy(g->server);
    if (g->health_server) grpc_server_destroy(g->health_server);
    if (g->cq) {
        grpc_completion_queue_shutdown(g->cq);
        while (grpc_completion_queue_next(g->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type != GRPC_QUEUE_SHUTDOWN) {}
        grpc_completion_queue_destroy(g->cq);
    }
    if (g->efd >= 0) close(g->efd);
    pthread_mutex_destroy(&g->mu);
    free(g);
    grpc_shutdown();
    return NULL;
}

int rtr_grpc_health_port(const rtr_grpc *g) { return g->health_port; }

mt_status rtr_grpc_set_auth_token(rtr_grpc *g, const char *token) {
    char *copy = NULL;
    if (token && !(copy = strdup(token))) return MT_ERR_NOMEM;
    rtr_auth_token_free(g->auth_token);
    g->auth_token = copy;
    return MT_OK;
}

void rtr_grpc_shutdown(rtr_grpc *g) {
    if (g->shutting_down) return;
    g->shutting_down = true;
    g->shutdowns_pending = 1 + (g->health_server != NULL);
    grpc_server_shutdown_and_notify(g->server, g->cq, &g->shutdown_tag);
    grpc_server_cancel_all_calls(g->server);
    if (g->health_server) {
        grpc_server_shutdown_and_notify(g->health_server, g->cq, &g->shutdown_tag);
        grpc_server_cancel_all_calls(g->health_server);
    }
}

bool rtr_grpc_shutdown_done(const rtr_grpc *g) {
    if (!g->shutting_down || g->shutdowns_pending > 0 || g->ncalls) return false;
    for (size_t i = 0; i < g->nslots; i++)
        if (g->slots[i].armed) return false;
    return true;
}

void rtr_grpc_free(rtr_grpc *g) {
    if (!g) return;
    MT_ASSERT(rtr_grpc_shutdown_done(g));
    grpc_server_destroy(g->server);
    if (g->health_server) grpc_server_destroy(g->health_server);
    grpc_completion_queue_shutdown(g->cq);
    pthread_join(g->thread, NULL);
    grpc_completion_queue_destroy(g->cq);
    close(g->efd);
    pthread_mutex_destroy(&g->mu);
    free(g->events);
    free(g->spare);
    rtr_auth_token_free(g->auth_token);
    free(g);
    grpc_shutdown();
}

/* ---- accessors ---- */

rtr_method rtr_call_method(const rtr_call *c) { return (rtr_method)c->method; }
double rtr_call_deadline(const rtr_call *c) { return c->deadline; }
uint64_t rtr_call_deadline_unix_ms(const rtr_call *c) { return c->deadline_unix_ms; }
void rtr_call_set_stream(rtr_call *c, struct rtr_stream *s) { c->stream = s; }
struct rtr_stream *rtr_call_stream(const rtr_call *c) { return c->stream; }
void rtr_call_set_watch(rtr_call *c, struct rtr_health_watch *w) { c->watch = w; }
struct rtr_health_watch *rtr_call_watch(const rtr_call *c) { return c->watch; }
void rtr_call_set_tokenize(rtr_call *c, struct rtr_tokenize *t) { c->tokenize = t; }
struct rtr_tokenize *rtr_call_tokenize(const rtr_call *c) { return c->tokenize; }
