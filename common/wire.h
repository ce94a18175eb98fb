/* common/wire.h: the router <-> worker transport. ZeroMQ sockets wrapped in a typed handle
 * (never a bare void *), carrying one protobuf-c Envelope (proto/metrale/internal/v1/worker.proto)
 * per message. The router binds a ROUTER socket; each worker connects a DEALER whose identity is
 * "w<worker_id>" (mt_wire_identity). Endpoints must be ipc:// or tcp://127.0.0.1 (internal only;
 * others are refused). The limits both sides share are in common/wire_limits.h.
 *
 * Messages are built with the mt_wire_msg builders below, the one place that fills envelopes, on
 * either side; received ones are read as protobuf-c structs.
 *
 * Socket options set here: ZMQ_ROUTER_MANDATORY (sending to a gone peer fails instead of being
 * dropped silently), send/receive high-water marks of MT_WIRE_HWM messages, linger 0, and
 * immediate mode on DEALERs (no queueing to a peer that is not connected).
 *
 * Ownership: a socket belongs to one thread. Envelopes returned by mt_wire_recv are owned by the
 * caller and freed with mt_wire_free. Wire version: every envelope sent carries
 * MT_WIRE_VERSION; mt_wire_recv rejects (MT_ERR_INVALID, message says so) other versions and
 * undecodable frames without closing the socket.
 */
#ifndef MT_WIRE_H
#define MT_WIRE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/mt.h"
#include "common/wire_limits.h"
#include "proto/metrale/internal/v1/worker.pb-c.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef Metrale__Internal__V1__Envelope mt_envelope;

typedef enum mt_wire_kind { MT_WIRE_ROUTER = 0, MT_WIRE_DEALER = 1 } mt_wire_kind;

typedef struct mt_wire_sock mt_wire_sock;

/* ROUTER: binds endpoint. DEALER: connects to endpoint with the given identity (required). */
mt_status mt_wire_open(mt_wire_kind kind, const char *endpoint, const char *identity,
                       mt_wire_sock **out, mt_error *err);
void mt_wire_close(mt_wire_sock *s); /* NULL ok */

/* Sends env (its version field is set here). On a ROUTER, peer names the destination identity;
 * an unknown or disconnected peer gives MT_ERR_NOT_FOUND and a full queue MT_ERR_FULL, at once.
 * On a DEALER the call waits up to MT_WIRE_DEALER_SEND_MS for a connected router, then gives
 * MT_ERR_FULL. */
mt_status mt_wire_send(mt_wire_sock *s, const char *peer, mt_envelope *env, mt_error *err);

/* Waits up to timeout_ms (0 = poll, -1 = forever) for one envelope. MT_ERR_NOT_FOUND on timeout
 * (nothing received). On a ROUTER, peer (MT_WIRE_PEER_MAX bytes) receives the sender identity. */
mt_status mt_wire_recv(mt_wire_sock *s, int timeout_ms, char *peer, mt_envelope **env, mt_error *err);
void mt_wire_free(mt_envelope *env); /* NULL ok */

/* The socket's ZMQ_FD, for a poll loop beside other descriptors (edge-triggered: after it
 * signals, call mt_wire_recv with timeout 0 until MT_ERR_NOT_FOUND). */
int mt_wire_fd(mt_wire_sock *s);

/* Writes worker_id's ZeroMQ identity, "w<worker_id>", to out. The worker connects with it and the
 * router checks a Hello's worker_id against it. */
void mt_wire_identity(uint32_t worker_id, char out[MT_WIRE_PEER_MAX]);

/* ---- building messages ----
 *
 * An mt_wire_msg holds an envelope and the body it carries; a builder fills both and returns the
 * envelope, ready for mt_wire_send. Nothing is allocated: the message lives where the caller put
 * it (usually its stack), and the pointers a builder takes (model, stats, request, tokens,
 * message) are borrowed, so they must stay valid until the send returns. The envelope points into
 * its own mt_wire_msg, so a built message is used in place, never copied. Any thread; a message
 * belongs to the thread that built it. */
typedef struct mt_wire_msg {
    mt_envelope env;
    union {
        Metrale__Internal__V1__Hello hello;
        Metrale__Internal__V1__Heartbeat heartbeat;
        Metrale__Internal__V1__Submit submit;
        Metrale__Internal__V1__Abort abort;
        Metrale__Internal__V1__Tokens tokens;
        Metrale__Internal__V1__Finished finished;
        Metrale__Internal__V1__Shutdown shutdown;
    } body;
    Metrale__V1__Final final; /* Finished only */
    Metrale__V1__Usage usage; /* Finished only */
} mt_wire_msg;

/* worker -> router: the first message, and again whenever the link was lost. */
mt_envelope *mt_wire_hello(mt_wire_msg *m, uint32_t worker_id, uint32_t max_sequences,
                           Metrale__V1__ModelInfo *model);
/* Both ways: stats is the worker's (NULL from the router); hello_wanted only from the router. */
mt_envelope *mt_wire_heartbeat(mt_wire_msg *m, uint64_t seq, Metrale__V1__WorkerStats *stats, bool hello_wanted);
/* router -> worker: start sequence id. deadline_unix_ms 0 = none. */
mt_envelope *mt_wire_submit(mt_wire_msg *m, uint64_t id, Metrale__V1__GenerateRequest *request,
                            uint64_t deadline_unix_ms);
/* router -> worker: end sequence id; the worker still answers Finished. */
mt_envelope *mt_wire_abort(mt_wire_msg *m, uint64_t id, Metrale__V1__FinishReason reason);
/* worker -> router: tokens[n] of sequence id, in order. */
mt_envelope *mt_wire_tokens(mt_wire_msg *m, uint64_t id, Metrale__V1__GeneratedToken **tokens, size_t n);
/* worker -> router: sequence id ended, after its last Tokens; message NULL = none. */
mt_envelope *mt_wire_finished(mt_wire_msg *m, uint64_t id, Metrale__V1__FinishReason reason, uint32_t prompt_tokens,
                              uint32_t completion_tokens, const char *message);
/* router -> worker: finish nothing new and exit. */
mt_envelope *mt_wire_shutdown(mt_wire_msg *m);

#ifdef __cplusplus
}
#endif
#endif /* MT_WIRE_H */
