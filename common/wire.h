/* common/wire.h: the router <-> worker transport. ZeroMQ sockets wrapped in a typed handle
 * (never a bare void *), carrying one protobuf-c Envelope (proto/metrale/internal/v1/worker.proto)
 * per message. The router binds a ROUTER socket; each worker connects a DEALER whose identity is
 * "w<worker_id>". Endpoints must be ipc:// or tcp://127.0.0.1 (internal only; others are refused).
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

#ifdef __cplusplus
}
#endif
#endif /* MT_WIRE_H */
