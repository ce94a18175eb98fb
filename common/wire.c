/* common/wire.c: see wire.h. One envelope per ZeroMQ message; a ROUTER message is two frames
 * (peer identity, envelope bytes), a DEALER message one frame. */
#include "common/wire.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

struct mt_wire_sock {
    void *ctx;           /* owned: one context per socket keeps ownership simple */
    void *sock;
    mt_wire_kind kind;
};

static bool endpoint_internal(const char *ep) {
    return !strncmp(ep, "ipc://", 6) || !strncmp(ep, "tcp://127.0.0.1:", 16) ||
           !strncmp(ep, "inproc://", 9);
}

mt_status mt_wire_open(mt_wire_kind kind, const char *endpoint, const char *identity,
                       mt_wire_sock **out, mt_error *err) {
    *out = NULL;
    if (!endpoint || !endpoint_internal(endpoint))
        return mt_errorf(err, MT_ERR_INVALID, "wire: endpoint \"%s\" is not internal (ipc:// or tcp://127.0.0.1:)",
                         endpoint ? endpoint : "(null)");
    if (kind == MT_WIRE_DEALER && (!identity || !*identity || strlen(identity) >= MT_WIRE_PEER_MAX))
        return mt_errorf(err, MT_ERR_INVALID, "wire: a DEALER needs an identity of 1..%d bytes", MT_WIRE_PEER_MAX - 1);
    mt_wire_sock *s = calloc(1, sizeof *s);
    if (!s) return mt_errorf(err, MT_ERR_NOMEM, "wire: out of memory");
    s->kind = kind;
    mt_status st = MT_ERR_IO;
    if (!(s->ctx = zmq_ctx_new())) goto fail;
    if (!(s->sock = zmq_socket(s->ctx, kind == MT_WIRE_ROUTER ? ZMQ_ROUTER : ZMQ_DEALER))) goto fail;
    int hwm = MT_WIRE_HWM, zero = 0, one = 1;
    if (zmq_setsockopt(s->sock, ZMQ_SNDHWM, &hwm, sizeof hwm) || zmq_setsockopt(s->sock, ZMQ_RCVHWM, &hwm, sizeof hwm) ||
        zmq_setsockopt(s->sock, ZMQ_LINGER, &zero, sizeof zero))
        goto fail;
    if (kind == MT_WIRE_ROUTER) {
        if (zmq_setsockopt(s->sock, ZMQ_ROUTER_MANDATORY, &one, sizeof one)) goto fail;
        if (zmq_bind(s->sock, endpoint)) goto fail;
    } else {
        /* A DEALER send waits up to MT_WIRE_DEALER_SEND_MS for the connection (right after
         * connect, or while the router restarts) instead of failing at once. */
        int snd_ms = MT_WIRE_DEALER_SEND_MS;
        if (zmq_setsockopt(s->sock, ZMQ_ROUTING_ID, identity, strlen(identity)) ||
            zmq_setsockopt(s->sock, ZMQ_IMMEDIATE, &one, sizeof one) ||
            zmq_setsockopt(s->sock, ZMQ_SNDTIMEO, &snd_ms, sizeof snd_ms))
            goto fail;
        if (zmq_connect(s->sock, endpoint)) goto fail;
    }
    *out = s;
    return MT_OK;
fail:
    st = mt_errorf(err, st, "wire: %s %s: %s", kind == MT_WIRE_ROUTER ? "bind" : "connect", endpoint,
                   zmq_strerror(zmq_errno()));
    mt_wire_close(s);
    return st;
}

void mt_wire_close(mt_wire_sock *s) {
    if (!s) return;
    if (s->sock) zmq_close(s->sock);
    if (s->ctx) zmq_ctx_term(s->ctx);
    free(s);
}

mt_status mt_wire_send(mt_wire_sock *s, const char *peer, mt_envelope *env, mt_error *err) {
    env->version = MT_WIRE_VERSION;
    size_t n = metrale__internal__v1__envelope__get_packed_size(env);
    uint8_t stackbuf[4096], *buf = n <= sizeof stackbuf ? stackbuf : malloc(n);
    if (!buf) return mt_errorf(err, MT_ERR_NOMEM, "wire: out of memory for a %zu-byte message", n);
    metrale__internal__v1__envelope__pack(env, buf);
    mt_status st = MT_OK;
    if (s->kind == MT_WIRE_ROUTER) {
        if (!peer || zmq_send(s->sock, peer, strlen(peer), ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0) {
            const int e = peer ? zmq_errno() : EHOSTUNREACH;
            st = mt_errorf(err, e == EAGAIN ? MT_ERR_FULL : MT_ERR_NOT_FOUND, "wire: send to %s: %s",
                           peer ? peer : "(no peer)", zmq_strerror(e));
            goto done;
        }
    }
    /* The router never blocks; a worker's DEALER waits up to its send timeout. */
    if (zmq_send(s->sock, buf, n, s->kind == MT_WIRE_ROUTER ? ZMQ_DONTWAIT : 0) < 0) {
        const int e = zmq_errno();
        st = mt_errorf(err, e == EAGAIN ? MT_ERR_FULL : MT_ERR_IO, "wire: send: %s", zmq_strerror(e));
    }
done:
    if (buf != stackbuf) free(buf);
    return st;
}

/* Receives one frame into msg; returns bytes or -1 (errno in zmq_errno). */
static int recv_frame(void *sock, zmq_msg_t *msg, int flags) {
    zmq_msg_init(msg);
    int n = zmq_msg_recv(msg, sock, flags);
    if (n < 0) zmq_msg_close(msg);
    return n;
}

static void drain_more(void *sock) {
    int more = 0;
    size_t len = sizeof more;
    while (!zmq_getsockopt(sock, ZMQ_RCVMORE, &more, &len) && more) {
        zmq_msg_t m;
        if (recv_frame(sock, &m, 0) < 0) return;
        zmq_msg_close(&m);
    }
}

mt_status mt_wire_recv(mt_wire_sock *s, int timeout_ms, char *peer, mt_envelope **env, mt_error *err) {
    *env = NULL;
    zmq_pollitem_t it = { s->sock, 0, ZMQ_POLLIN, 0 };
    int rc = zmq_poll(&it, 1, timeout_ms);
    if (rc < 0) return zmq_errno() == EINTR ? MT_ERR_NOT_FOUND : mt_errorf(err, MT_ERR_IO, "wire: poll: %s", zmq_strerror(zmq_errno()));
    if (rc == 0) return MT_ERR_NOT_FOUND;
    zmq_msg_t m;
    if (s->kind == MT_WIRE_ROUTER) {
        int n = recv_frame(s->sock, &m, ZMQ_DONTWAIT);
        if (n < 0) return zmq_errno() == EAGAIN ? MT_ERR_NOT_FOUND : mt_errorf(err, MT_ERR_IO, "wire: recv: %s", zmq_strerror(zmq_errno()));
        size_t k = (size_t)n < MT_WIRE_PEER_MAX - 1 ? (size_t)n : MT_WIRE_PEER_MAX - 1;
        if (peer) {
            memcpy(peer, zmq_msg_data(&m), k);
            peer[k] = 0;
        }
        zmq_msg_close(&m);
    }
    int n = recv_frame(s->sock, &m, s->kind == MT_WIRE_ROUTER ? 0 : ZMQ_DONTWAIT);
    if (n < 0) return zmq_errno() == EAGAIN ? MT_ERR_NOT_FOUND : mt_errorf(err, MT_ERR_IO, "wire: recv: %s", zmq_strerror(zmq_errno()));
    drain_more(s->sock); /* a peer sending extra frames must not desynchronise us */
    mt_envelope *e = metrale__internal__v1__envelope__unpack(NULL, (size_t)n, zmq_msg_data(&m));
    zmq_msg_close(&m);
    if (!e) return mt_errorf(err, MT_ERR_INVALID, "wire: undecodable %d-byte message from %s", n, peer && *peer ? peer : "peer");
    if (e->version != MT_WIRE_VERSION) {
        mt_status st = mt_errorf(err, MT_ERR_INVALID, "wire: message of version %u from %s, this side speaks %d",
                                 e->version, peer && *peer ? peer : "peer", MT_WIRE_VERSION);
        mt_wire_free(e);
        return st;
    }
    *env = e;
    return MT_OK;
}

void mt_wire_free(mt_envelope *env) {
    if (env) metrale__internal__v1__envelope__free_unpacked(env, NULL);
}

int mt_wire_fd(mt_wire_sock *s) {
    int fd = -1;
    size_t len = sizeof fd;
    zmq_getsockopt(s->sock, ZMQ_FD, &fd, &len);
    return fd;
}

void mt_wire_identity(uint32_t worker_id, char out[MT_WIRE_PEER_MAX]) {
    snprintf(out, MT_WIRE_PEER_MAX, "w%u", worker_id);
}

/* ---- building messages ---- */

/* Starts m as an envelope of the given body, pointing at m->body's member for it. */
static mt_envelope *wrap(mt_wire_msg *m, Metrale__Internal__V1__Envelope__BodyCase body) {
    m->env = (mt_envelope)METRALE__INTERNAL__V1__ENVELOPE__INIT;
    m->env.body_case = body;
    switch (body) {
    case METRALE__INTERNAL__V1__ENVELOPE__BODY_HELLO: m->env.hello = &m->body.hello; break;
    case METRALE__INTERNAL__V1__ENVELOPE__BODY_HEARTBEAT: m->env.heartbeat = &m->body.heartbeat; break;
    case METRALE__INTERNAL__V1__ENVELOPE__BODY_SUBMIT: m->env.submit = &m->body.submit; break;
    case METRALE__INTERNAL__V1__ENVELOPE__BODY_ABORT: m->env.abort = &m->body.abort; break;
    case METRALE__INTERNAL__V1__ENVELOPE__BODY_TOKENS: m->env.tokens = &m->body.tokens; break;
    case METRALE__INTERNAL__V1__ENVELOPE__BODY_FINISHED: m->env.finished = &m->body.finished; break;
    case METRALE__INTERNAL__V1__ENVELOPE__BODY_SHUTDOWN: m->env.shutdown = &m->body.shutdown; break;
    default: MT_ASSERT(!"an envelope body this side does not know");
    }
    return &m->env;
}

mt_envelope *mt_wire_hello(mt_wire_msg *m, uint32_t worker_id, uint32_t max_sequences,
                           Metrale__V1__ModelInfo *model) {
    Metrale__Internal__V1__Hello *h = &m->body.hello;
    *h = (Metrale__Internal__V1__Hello)METRALE__INTERNAL__V1__HELLO__INIT;
    h->worker_id = worker_id;
    h->model = model;
    h->max_sequences = max_sequences;
    return wrap(m, METRALE__INTERNAL__V1__ENVELOPE__BODY_HELLO);
}

mt_envelope *mt_wire_heartbeat(mt_wire_msg *m, uint64_t seq, Metrale__V1__WorkerStats *stats, bool hello_wanted) {
    Metrale__Internal__V1__Heartbeat *hb = &m->body.heartbeat;
    *hb = (Metrale__Internal__V1__Heartbeat)METRALE__INTERNAL__V1__HEARTBEAT__INIT;
    hb->seq = seq;
    hb->stats = stats;
    hb->hello_wanted = hello_wanted;
    return wrap(m, METRALE__INTERNAL__V1__ENVELOPE__BODY_HEARTBEAT);
}

mt_envelope *mt_wire_submit(mt_wire_msg *m, uint64_t id, Metrale__V1__GenerateRequest *request,
                            uint64_t deadline_unix_ms) {
    Metrale__Internal__V1__Submit *s = &m->body.submit;
    *s = (Metrale__Internal__V1__Submit)METRALE__INTERNAL__V1__SUBMIT__INIT;
    s->id = id;
    s->request = request;
    s->deadline_unix_ms = deadline_unix_ms;
    return wrap(m, METRALE__INTERNAL__V1__ENVELOPE__BODY_SUBMIT);
}

mt_envelope *mt_wire_abort(mt_wire_msg *m, uint64_t id, Metrale__V1__FinishReason reason) {
    Metrale__Internal__V1__Abort *a = &m->body.abort;
    *a = (Metrale__Internal__V1__Abort)METRALE__INTERNAL__V1__ABORT__INIT;
    a->id = id;
    a->reason = reason;
    return wrap(m, METRALE__INTERNAL__V1__ENVELOPE__BODY_ABORT);
}

mt_envelope *mt_wire_tokens(mt_wire_msg *m, uint64_t id, Metrale__V1__GeneratedToken **tokens, size_t n) {
    Metrale__Internal__V1__Tokens *t = &m->body.tokens;
    *t = (Metrale__Internal__V1__Tokens)METRALE__INTERNAL__V1__TOKENS__INIT;
    t->id = id;
    t->n_tokens = n;
    t->tokens = tokens;
    return wrap(m, METRALE__INTERNAL__V1__ENVELOPE__BODY_TOKENS);
}

mt_envelope *mt_wire_finished(mt_wire_msg *m, uint64_t id, Metrale__V1__FinishReason reason, uint32_t prompt_tokens,
                              uint32_t completion_tokens, const char *message) {
    m->usage = (Metrale__V1__Usage)METRALE__V1__USAGE__INIT;
    m->usage.prompt_tokens = prompt_tokens;
    m->usage.completion_tokens = completion_tokens;
    m->final = (Metrale__V1__Final)METRALE__V1__FINAL__INIT;
    m->final.finish_reason = reason;
    m->final.usage = &m->usage;
    m->final.error_message = (char *)(message ? message : ""); /* protobuf-c's char *; only read */
    Metrale__Internal__V1__Finished *f = &m->body.finished;
    *f = (Metrale__Internal__V1__Finished)METRALE__INTERNAL__V1__FINISHED__INIT;
    f->id = id;
    f->final = &m->final;
    return wrap(m, METRALE__INTERNAL__V1__ENVELOPE__BODY_FINISHED);
}

mt_envelope *mt_wire_shutdown(mt_wire_msg *m) {
    m->body.shutdown = (Metrale__Internal__V1__Shutdown)METRALE__INTERNAL__V1__SHUTDOWN__INIT;
    return wrap(m, METRALE__INTERNAL__V1__ENVELOPE__BODY_SHUTDOWN);
}
