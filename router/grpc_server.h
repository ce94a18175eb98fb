/* router/grpc_server.h: the router's gRPC server on the gRPC C core API (one completion queue),
 * carrying protobuf-c messages. It owns the calls' lifecycles and batches; what a call means is
 * the handlers' business (router.c).
 *
 * Threads: rtr_grpc_create starts one thread that blocks in grpc_completion_queue_next and only
 * forwards each (tag, ok) to an event queue, waking the owner through rtr_grpc_fd(). Everything
 * else — every function below, every handler, every call object — belongs to the one thread
 * that created the server (the router's event loop). So the calls need no locks.
 *
 * A call's life, as the handlers see it:
 *   on_request(call, method, bytes)  once, with the request message (unary and server-streaming
 *                                    methods alike read exactly one request);
 *   rtr_call_send(call, msg)         any number of times for a stream, one at a time: after a
 *                                    send, wait for on_send_done before the next;
 *   rtr_call_finish(call, code, ...) once, the status (optionally with a last message), allowed
 *                                    while a send is in flight (it goes out after it);
 *   on_done(call, cancelled)         once, last: the call is over (status sent, or the client
 *                                    cancelled, disconnected or its deadline passed). After
 *                                    on_done returns the handle is invalid; drop every pointer.
 * Unknown methods are answered UNIMPLEMENTED here and never reach the handlers, and so are calls
 * that break the request cardinality (no request message, or a second one while the call is
 * open: gRPC's doc/statuscodes.md gives UNIMPLEMENTED for it); for a second message the call is
 * finished here, and the handlers learn of it from on_done.
 *
 * Security (docs/DESIGN.md "Security"): the serving port speaks TLS when params.tls is set
 * (router/tls.h: reloadable certificates, optionally required client certificates), plaintext
 * otherwise. With an auth token (rtr_grpc_set_auth_token) every call but grpc.health.v1's must
 * carry "authorization: Bearer <token>" (router/auth.h) or is answered UNAUTHENTICATED here. The
 * health port (params.health_listen) is plaintext and answers grpc.health.v1 only (any other
 * method: UNIMPLEMENTED), so that probes without a certificate or token reach it.
 */
#ifndef RTR_GRPC_SERVER_H
#define RTR_GRPC_SERVER_H

#include <grpc/status.h>
#include <protobuf-c/protobuf-c.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/mt.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum rtr_method {
    RTR_METHOD_GENERATE = 0,       /* /metrale.v1.Generation/Generate, server-streaming */
    RTR_METHOD_GET_MODEL_INFO = 1, /* /metrale.v1.Generation/GetModelInfo */
    RTR_METHOD_GET_STATS = 2,      /* /metrale.v1.Generation/GetStats */
    RTR_METHOD_HEALTH_CHECK = 3,   /* /grpc.health.v1.Health/Check */
    RTR_METHOD_HEALTH_WATCH = 4,   /* /grpc.health.v1.Health/Watch, server-streaming */
    RTR_METHOD_TOKENIZE = 5,       /* /metrale.v1.Generation/Tokenize */
    RTR_METHOD_COUNT
} rtr_method;

const char *rtr_method_path(rtr_method m);

typedef struct rtr_grpc rtr_grpc;
typedef struct rtr_call rtr_call;

/* What a call is attached to (typed, so nothing travels as void *). */
struct rtr_router;
struct rtr_stream;
struct rtr_health_watch;
struct rtr_tokenize;

typedef struct rtr_grpc_handlers {
    struct rtr_router *router; /* passed back to every handler */
    /* A request arrived; data/len is the serialized request (valid during the call only). */
    void (*on_request)(struct rtr_router *r, rtr_call *call, rtr_method method, const uint8_t *data, size_t len);
    /* The last rtr_call_send completed (ok = false when the call is broken); not after finish. */
    void (*on_send_done)(struct rtr_router *r, rtr_call *call, bool ok);
    /* The call is over. cancelled: the client went away or its deadline passed (or the server
     * shut down) before a status was sent. */
    void (*on_done)(struct rtr_router *r, rtr_call *call, bool cancelled);
} rtr_grpc_handlers;

struct rtr_tls;

typedef struct rtr_grpc_params {
    const char *listen;        /* "127.0.0.1:50051"; port 0 picks a free one */
    size_t max_message_bytes;  /* largest request accepted; default MT_WIRE_REQUEST_BYTES_MAX */
    struct rtr_tls *tls;       /* TLS on the serving port (borrowed; must outlive the server, see
                                  router/tls.h); NULL: plaintext */
    const char *health_listen; /* a plaintext grpc.health.v1-only port; NULL: none */
} rtr_grpc_params;

rtr_grpc_params rtr_grpc_default_params(void);

/* Initialises gRPC, binds (the serving port and the health port, if any), starts serving and the
 * completion-queue thread. NULL + err on failure (nothing left running). *port receives the
 * serving port as bound. */
rtr_grpc *rtr_grpc_create(const rtr_grpc_params *params, const rtr_grpc_handlers *handlers, int *port,
                          mt_error *err);

/* The health port as bound; 0 without one. */
int rtr_grpc_health_port(const rtr_grpc *g);

/* Asks every later call except grpc.health.v1's for "authorization: Bearer <token>" (copied);
 * NULL asks for none. Calls already admitted are not affected. MT_ERR_NOMEM leaves the old one. */
mt_status rtr_grpc_set_auth_token(rtr_grpc *g, const char *token);

/* A descriptor that turns readable when events wait; then call rtr_grpc_dispatch. */
int rtr_grpc_fd(const rtr_grpc *g);

/* Runs the handlers for every event waiting now. Never blocks. */
void rtr_grpc_dispatch(rtr_grpc *g);

/* Begins shutdown: no new calls; every call still open is cancelled (on_done(cancelled) follows
 * through rtr_grpc_dispatch). Idempotent. */
void rtr_grpc_shutdown(rtr_grpc *g);

/* After rtr_grpc_shutdown: true once the server has stopped and every call is gone. */
bool rtr_grpc_shutdown_done(const rtr_grpc *g);

/* Stops the thread and frees everything. Requires rtr_grpc_shutdown_done (or NULL). */
void rtr_grpc_free(rtr_grpc *g);

/* Calls: see the life above. */
rtr_method rtr_call_method(const rtr_call *c);
/* The client's deadline on mt_now()'s clock, INFINITY when none; and as Unix milliseconds, 0 when none. */
double rtr_call_deadline(const rtr_call *c);
uint64_t rtr_call_deadline_unix_ms(const rtr_call *c);

/* Sends one message. MT_ERR_STATE (nothing sent) while a send is in flight or after finish. */
mt_status rtr_call_send(rtr_call *c, const ProtobufCMessage *msg);
bool rtr_call_send_busy(const rtr_call *c);

/* Sends the status, after `last` (may be NULL) and after a send in flight. details may be NULL.
 * MT_ERR_STATE if already finished. */
mt_status rtr_call_finish(rtr_call *c, grpc_status_code code, const char *details, const ProtobufCMessage *last);
bool rtr_call_finished(const rtr_call *c);

void rtr_call_set_stream(rtr_call *c, struct rtr_stream *s);
struct rtr_stream *rtr_call_stream(const rtr_call *c);
void rtr_call_set_watch(rtr_call *c, struct rtr_health_watch *w);
struct rtr_health_watch *rtr_call_watch(const rtr_call *c);
void rtr_call_set_tokenize(rtr_call *c, struct rtr_tokenize *t);
struct rtr_tokenize *rtr_call_tokenize(const rtr_call *c);

#ifdef __cplusplus
}
#endif
#endif /* RTR_GRPC_SERVER_H */
