/* worker/transport.c: see transport.h. */
#include "worker/transport.h"

#include <poll.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define RECV_BATCH 256     /* messages handled per wkr_transport_receive at most */
#define HELLO_RETRY_S 0.5  /* between Hellos that could not be sent */
#define STALL_S 120.0      /* engine-thread silence after which heartbeats stop */
#define BEAT_POLL_MS 20    /* how often the heartbeat thread looks at the clock */
#define WAIT_SLICE_MS 5    /* longest wait on the socket's descriptor before looking again */

struct wkr_transport {
    wkr_transport_params p;
    /* engine thread only */
    double last_rx, next_hello, last_hello;
    uint64_t dropped;
    int fd;                   /* the socket's ZMQ_FD: waited on outside sock_mu */
    /* under sock_mu */
    pthread_mutex_t sock_mu;
    mt_wire_sock *wire;
    bool linked;              /* Hello sent and no send failed since */
    bool link_lost;           /* unlinked since the last wkr_transport_take_link_lost */
    uint64_t hb_seq;
    /* under stats_mu: what the heartbeat thread reports */
    pthread_mutex_t stats_mu;
    Metrale__V1__WorkerStats stats;
    double progress_at;       /* mt_now() of the engine thread's last publish */
    bool stop_beating;
    /* engine thread only */
    pthread_t beat_thread;
    bool beating;             /* beat_thread runs and has not been joined */
};

mt_status wkr_transport_new(const wkr_transport_params *p, wkr_transport **out, mt_error *err) {
    *out = NULL;
    wkr_transport *t = calloc(1, sizeof *t);
    if (!t) return mt_errorf(err, MT_ERR_NOMEM, "out of memory for the router link");
    t->p = *p;
    pthread_mutex_init(&t->sock_mu, NULL);
    pthread_mutex_init(&t->stats_mu, NULL);
    metrale__v1__worker_stats__init(&t->stats);
    char identity[MT_WIRE_PEER_MAX];
    mt_wire_identity(p->worker_id, identity);
    mt_wire_params wp = mt_wire_default_params();
    wp.identity = identity;
    wp.curve_server_key = p->curve_server_key;
    wp.curve_secret_key = p->curve_secret_key;
    mt_status st = mt_wire_open(MT_WIRE_DEALER, p->router, &wp, &t->wire, err);
    if (st != MT_OK) goto fail;
    t->fd = mt_wire_fd(t->wire);
    t->last_rx = t->next_hello = t->progress_at = mt_now();
    *out = t;
    return MT_OK;
fail:
    wkr_transport_free(t);
    return st;
}

void wkr_transport_free(wkr_transport *t) {
    if (!t) return;
    wkr_transport_stop_heartbeats(t);
    mt_wire_close(t->wire);
    pthread_mutex_destroy(&t->sock_mu);
    pthread_mutex_destroy(&t->stats_mu);
    free(t);
}

/* ---- sending ---- */

/* Sends env while linked; a failure (no router connected for MT_WIRE_DEALER_SEND_MS) unlinks.
 * Any thread. */
static void send_env(wkr_transport *t, mt_envelope *env) {
    mt_error err;
    pthread_mutex_lock(&t->sock_mu);
    if (t->linked && mt_wire_send(t->wire, NULL, env, &err) != MT_OK) {
        t->linked = false;
        t->link_lost = true;
        mt_log(MT_LOG_WARN, "worker %u: router unreachable (%s)", t->p.worker_id, err.msg);
    }
    pthread_mutex_unlock(&t->sock_mu);
}

void wkr_transport_send_tokens(wkr_transport *t, uint64_t id, Metrale__V1__GeneratedToken **tokens, size_t n,
                               const char *text, Metrale__V1__GeneratedToken **prompt_lp, size_t n_prompt_lp) {
    mt_wire_msg m;
    send_env(t, mt_wire_tokens(&m, id, tokens, n, text, prompt_lp, n_prompt_lp));
}

void wkr_transport_send_finished(wkr_transport *t, uint64_t id, const mt_wire_end *end) {
    mt_wire_msg m;
    send_env(t, mt_wire_finished(&m, id, end));
}

void wkr_transport_send_tokenized(wkr_transport *t, uint64_t id, Metrale__V1__TokenizeResponse *response,
                                  const char *error) {
    mt_wire_msg m;
    send_env(t, mt_wire_tokenized(&m, id, response, error));
}

bool wkr_transport_take_link_lost(wkr_transport *t) {
    pthread_mutex_lock(&t->sock_mu);
    const bool lost = t->link_lost;
    t->link_lost = false;
    pthread_mutex_unlock(&t->sock_mu);
    if (lost) t->next_hello = mt_now();
    return lost;
}

void wkr_transport_hello_if_due(wkr_transport *t) {
    pthread_mutex_lock(&t->sock_mu);
    const bool linked = t->linked;
    pthread_mutex_unlock(&t->sock_mu);
    if (linked || mt_now() < t->next_hello) return;
    const Metrale__V1__ModelInfo *mi = t->p.model;
    mt_wire_msg m;
    mt_envelope *env = mt_wire_hello(&m, t->p.worker_id, t->p.max_sequences, t->p.model);
    mt_error err;
    pthread_mutex_lock(&t->sock_mu);
    const mt_status st = mt_wire_send(t->wire, NULL, env, &err);
    if (st == MT_OK) t->linked = true;
    pthread_mutex_unlock(&t->sock_mu);
    if (st == MT_OK) {
        t->last_hello = mt_now();
        mt_log(MT_LOG_INFO, "worker %u: hello sent to %s (%s, vocab %u, context %u, %u sequences)", t->p.worker_id,
               t->p.router, mi->backend, mi->vocab_size, mi->max_context, t->p.max_sequences);
    } else {
        t->next_hello = mt_now() + HELLO_RETRY_S;
        mt_log(MT_LOG_DEBUG, "worker %u: hello not sent: %s", t->p.worker_id, err.msg);
    }
}

/* ---- heartbeats ---- */

void wkr_transport_publish(wkr_transport *t, const Metrale__V1__WorkerStats *stats) {
    pthread_mutex_lock(&t->stats_mu);
    t->stats = *stats;
    t->stats.worker_id = t->p.worker_id;
    t->stats.alive = true;
    t->progress_at = mt_now();
    pthread_mutex_unlock(&t->stats_mu);
}

/* Heartbeat thread: one Heartbeat every MT_WIRE_HEARTBEAT_S while linked and the engine thread
 * makes progress. */
static void *beat_main(void *arg) {
    wkr_transport *t = arg;
    double next = mt_now();
    for (;;) {
        pthread_mutex_lock(&t->stats_mu);
        const bool stop = t->stop_beating;
        Metrale__V1__WorkerStats ws = t->stats;
        const double progress_at = t->progress_at;
        pthread_mutex_unlock(&t->stats_mu);
        if (stop) return NULL;
        const double now = mt_now();
        if (now >= next) {
            next = now + MT_WIRE_HEARTBEAT_S;
            if (now - progress_at > STALL_S) {
                mt_log(MT_LOG_ERROR, "worker %u: engine thread stuck for %.0f s; heartbeats stop", t->p.worker_id,
                       now - progress_at);
                next = now + 10.0; /* log again later, beat again if it recovers */
                continue;
            }
            pthread_mutex_lock(&t->sock_mu);
            const uint64_t seq = ++t->hb_seq;
            pthread_mutex_unlock(&t->sock_mu);
            mt_wire_msg m;
            send_env(t, mt_wire_heartbeat(&m, seq, &ws, false));
        }
        struct timespec ts = { 0, BEAT_POLL_MS * 1000 * 1000 };
        nanosleep(&ts, NULL);
    }
}

mt_status wkr_transport_start_heartbeats(wkr_transport *t, mt_error *err) {
    if (t->beating) return MT_OK;
    pthread_mutex_lock(&t->stats_mu);
    t->stop_beating = false;
    pthread_mutex_unlock(&t->stats_mu);
    if (pthread_create(&t->beat_thread, NULL, beat_main, t) != 0)
        return mt_errorf(err, MT_ERR_IO, "cannot start the heartbeat thread");
    t->beating = true;
    return MT_OK;
}

void wkr_transport_stop_heartbeats(wkr_transport *t) {
    if (!t->beating) return;
    pthread_mutex_lock(&t->stats_mu);
    t->stop_beating = true;
    pthread_mutex_unlock(&t->stats_mu);
    pthread_join(t->beat_thread, NULL);
    t->beating = false;
}

/* ---- receiving ---- */

/* A router Heartbeat: hello_wanted means the router does not know us (it restarted), so our
 * streams are gone; unlink, and the engine thread says Hello again. */
static void on_heartbeat(wkr_transport *t, const Metrale__Internal__V1__Heartbeat *hb) {
    if (!hb->hello_wanted || mt_now() - t->last_hello <= MT_WIRE_HELLO_WANTED_QUIET_S) return;
    pthread_mutex_lock(&t->sock_mu);
    const bool was_linked = t->linked; /* else a Hello is on its way already */
    if (was_linked) {
        t->linked = false;
        t->link_lost = true;
    }
    pthread_mutex_unlock(&t->sock_mu);
    if (was_linked) mt_log(MT_LOG_WARN, "worker %u: the router asks for a Hello (it restarted)", t->p.worker_id);
}

/* Handles one envelope; true on Shutdown. */
static bool on_envelope(wkr_transport *t, const mt_envelope *env, const wkr_handlers *h) {
    switch (env->body_case) {
    case METRALE__INTERNAL__V1__ENVELOPE__BODY_SUBMIT: {
        const Metrale__Internal__V1__Submit *s = env->submit;
        if (!s->request) {
            mt_log(MT_LOG_WARN, "worker %u: submit %llu without a request", t->p.worker_id, (unsigned long long)s->id);
            mt_wire_end end = mt_wire_end_of(METRALE__V1__FINISH_REASON__FINISH_REASON_ERROR);
            end.message = "worker: submit without a request";
            wkr_transport_send_finished(t, s->id, &end);
            return false;
        }
        h->on_submit(h->user, s->id, s->request, s->deadline_unix_ms);
        return false;
    }
    case METRALE__INTERNAL__V1__ENVELOPE__BODY_ABORT:
        h->on_abort(h->user, env->abort->id, env->abort->reason);
        return false;
    case METRALE__INTERNAL__V1__ENVELOPE__BODY_TOKENIZE_CALL: {
        const Metrale__Internal__V1__TokenizeCall *c = env->tokenize_call;
        if (!c->request) {
            wkr_transport_send_tokenized(t, c->id, NULL, "worker: tokenize call without a request");
            return false;
        }
        h->on_tokenize(h->user, c->id, c->request);
        return false;
    }
    case METRALE__INTERNAL__V1__ENVELOPE__BODY_HEARTBEAT:
        on_heartbeat(t, env->heartbeat);
        return false;
    case METRALE__INTERNAL__V1__ENVELOPE__BODY_SHUTDOWN:
        mt_log(MT_LOG_INFO, "worker %u: shutdown from the router", t->p.worker_id);
        return true;
    default:
        t->dropped++;
        mt_log(MT_LOG_WARN, "worker %u: unexpected message (body %d) from the router; dropped", t->p.worker_id,
               (int)env->body_case);
        return false;
    }
}

/* The socket is only touched under sock_mu, and only without blocking: an idle engine thread
 * that waited inside the lock and took it again at once would starve the heartbeat thread (on a
 * many-core host it did, for as long as no request came, and the router wrote the idle worker
 * off after 2.5 s without a heartbeat). The wait is on the socket's
 * descriptor, outside the lock, in slices: the descriptor is edge-triggered and a send from the
 * heartbeat thread can take the edge of a message that arrives meanwhile, so no wait is long. */
bool wkr_transport_receive(wkr_transport *t, int timeout_ms, const wkr_handlers *h) {
    const double end = mt_now() + (timeout_ms > 0 ? timeout_ms : 0) / 1e3;
    for (int i = 0; i < RECV_BATCH;) {
        mt_envelope *env = NULL;
        mt_error err;
        pthread_mutex_lock(&t->sock_mu);
        mt_status st = mt_wire_recv(t->wire, 0, NULL, &env, &err);
        pthread_mutex_unlock(&t->sock_mu);
        if (st == MT_ERR_NOT_FOUND) {
            const double left_ms = (end - mt_now()) * 1e3;
            if (i > 0 || left_ms <= 0 || t->fd < 0) return false;
            struct pollfd pf = { .fd = t->fd, .events = POLLIN };
            (void)poll(&pf, 1, left_ms < WAIT_SLICE_MS ? (int)left_ms + 1 : WAIT_SLICE_MS);
            continue;
        }
        i++;
        t->last_rx = mt_now();
        if (st != MT_OK) {
            t->dropped++;
            mt_log(MT_LOG_WARN, "worker %u: %s; dropped", t->p.worker_id, err.msg);
            continue;
        }
        const bool shutdown = on_envelope(t, env, h);
        mt_wire_free(env);
        if (shutdown) return true;
    }
    return false;
}

void wkr_transport_restart_silence(wkr_transport *t) { t->last_rx = mt_now(); }

bool wkr_transport_router_silent(const wkr_transport *t, double timeout_s) {
    return mt_now() - t->last_rx > timeout_s;
}

uint64_t wkr_transport_dropped(const wkr_transport *t) { return t->dropped; }
