/* worker/transport.h: the worker's end of the router link (proto/metrale/internal/v1/worker.proto).
 * It owns the DEALER socket (common/wire.h), keeps the link state, builds and sends every message
 * to the router, reads the router's messages and runs the heartbeat thread. It knows nothing of
 * the engine: what it sends and what it hands over are protobuf-c messages.
 *
 * Link: the transport is linked once its Hello has been sent. A send that fails (no router
 * connected for MT_WIRE_DEALER_SEND_MS) unlinks it, and so does a router Heartbeat with
 * hello_wanted (the router restarted and does not know this worker), unless it comes within
 * MT_WIRE_HELLO_WANTED_QUIET_S of the Hello (then it answers a Heartbeat sent before the Hello
 * arrived). Unlinked, the router's streams are gone: nothing but the Hello is sent, the engine
 * thread learns of it from wkr_transport_take_link_lost and drops its sequences, and
 * wkr_transport_hello_if_due says Hello again (every HELLO_RETRY_S until one is sent).
 *
 * Heartbeats: the heartbeat thread sends one every MT_WIRE_HEARTBEAT_S while linked, busy or not,
 * carrying the latest stats the engine thread published, so the router hears from a worker busy
 * in a long step (a long CPU prefill takes seconds). When the engine thread has published nothing
 * for STALL_S (transport.c) the heartbeats stop, so the router declares a hung worker dead.
 *
 * Threads: the engine thread creates and frees the transport and makes every call not marked
 * "any thread"; the heartbeat thread only sends. They share the socket under one mutex (the full
 * barrier ZeroMQ asks for when a socket is used by more than one thread); a receive that waits
 * holds it, so keep receive timeouts short.
 */
#ifndef WKR_TRANSPORT_H
#define WKR_TRANSPORT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/mt.h"
#include "common/wire.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct wkr_transport wkr_transport;

typedef struct wkr_transport_params {
    const char *router;            /* endpoint: ipc://, tcp://127.0.0.1:, or with CURVE any tcp://;
                                      borrowed, like model */
    uint32_t worker_id;            /* identity "w<worker_id>"; in the Hello and every log line */
    uint32_t max_sequences;        /* in the Hello */
    Metrale__V1__ModelInfo *model; /* in the Hello; borrowed: must outlive the transport */
    /* CURVE (common/wire.h), z85 keys, both or neither; read when the socket opens */
    const char *curve_server_key;  /* the router's public key */
    const char *curve_secret_key;  /* this worker's secret key */
} wkr_transport_params;

/* The router's requests, as the engine thread acts on them. Called from wkr_transport_receive,
 * on the engine thread; the pointers are valid during the call only. */
typedef struct wkr_handlers {
    void *user;
    /* Submit: start sequence id (deadline_unix_ms 0 = none). A Submit without a request is
     * answered Finished(ERROR) by the transport and never reaches here. */
    void (*on_submit)(void *user, uint64_t id, const Metrale__V1__GenerateRequest *request,
                      uint64_t deadline_unix_ms);
    /* Abort: end sequence id for reason (it still gets its Finished). */
    void (*on_abort)(void *user, uint64_t id, Metrale__V1__FinishReason reason);
    /* TokenizeCall: answer with wkr_transport_send_tokenized (a call without a request is
     * answered by the transport). */
    void (*on_tokenize)(void *user, uint64_t id, const Metrale__V1__TokenizeRequest *request);
} wkr_handlers;

/* Connects the DEALER (unlinked: the first wkr_transport_hello_if_due says Hello). The router
 * counts as heard from now. NULL *out and err on failure. */
mt_status wkr_transport_new(const wkr_transport_params *p, wkr_transport **out, mt_error *err);

/* Stops the heartbeat thread if it runs, then closes the socket. NULL ok. */
void wkr_transport_free(wkr_transport *t);

/* Starts the heartbeat thread; publish stats first, or the first heartbeats carry zeros.
 * MT_ERR_IO when the thread cannot start (nothing started). */
mt_status wkr_transport_start_heartbeats(wkr_transport *t, mt_error *err);

/* Stops the heartbeat thread and waits for it. Idempotent. */
void wkr_transport_stop_heartbeats(wkr_transport *t);

/* The stats the next heartbeats carry (scalars copied; worker_id and alive are set here), and a
 * mark that the engine thread made progress. */
void wkr_transport_publish(wkr_transport *t, const Metrale__V1__WorkerStats *stats);

/* True once after the link was lost: the router's streams are gone, so the caller drops every
 * live sequence without sending anything for them. The next Hello is due at once. */
bool wkr_transport_take_link_lost(wkr_transport *t);

/* Sends the Hello when unlinked and one is due; a Hello that cannot be sent is tried again after
 * HELLO_RETRY_S. */
void wkr_transport_hello_if_due(wkr_transport *t);

/* Waits up to timeout_ms (0 = poll) for the first message, then takes what is queued, up to
 * RECV_BATCH messages: Submit and Abort go to h, Heartbeats are handled here, malformed and
 * unexpected messages are counted, logged and dropped. Returns true on Shutdown (what follows it
 * stays queued). */
bool wkr_transport_receive(wkr_transport *t, int timeout_ms, const wkr_handlers *h);

/* True when nothing (not even a malformed message) came from the router for more than
 * timeout_s. */
bool wkr_transport_router_silent(const wkr_transport *t, double timeout_s);
/* Restarts the silence clock: the caller was not listening (a long step), so the time since the
 * last message is not the router's silence. Engine thread. */
void wkr_transport_restart_silence(wkr_transport *t);

/* Malformed or unexpected messages dropped so far. */
uint64_t wkr_transport_dropped(const wkr_transport *t);

/* Any thread, while linked (unlinked, nothing is sent): tokens[n] of sequence id, in order, the
 * text they complete (NULL = none) and the prompt's logprobs (echo; n_prompt_lp 0 = none). */
void wkr_transport_send_tokens(wkr_transport *t, uint64_t id, Metrale__V1__GeneratedToken **tokens, size_t n,
                               const char *text, Metrale__V1__GeneratedToken **prompt_lp, size_t n_prompt_lp);

/* Any thread, while linked: sequence id ended, after its last Tokens (common/wire.h). */
void wkr_transport_send_finished(wkr_transport *t, uint64_t id, const mt_wire_end *end);

/* Any thread, while linked: the answer to TokenizeCall id, response or error. */
void wkr_transport_send_tokenized(wkr_transport *t, uint64_t id, Metrale__V1__TokenizeResponse *response,
                                  const char *error);

#ifdef __cplusplus
}
#endif
#endif /* WKR_TRANSPORT_H */
