/* common/wire.h: the router <-> worker transport. ZeroMQ sockets wrapped in a typed handle
 * (never a bare void *), carrying one protobuf-c Envelope (proto/metrale/internal/v1/worker.proto)
 * per message. The router binds a ROUTER socket; each worker connects a DEALER whose identity is
 * "w<worker_id>" (mt_wire_identity). The limits both sides share are in common/wire_limits.h.
 *
 * Endpoints: ipc://, inproc:// and tcp://127.0.0.1:PORT are internal and always accepted. A
 * ROUTER binds ipc://DIR/NAME only when DIR is private to its user (mode 0700; made so when
 * missing), and replaces a socket file there only when it is stale (common/ipc.h); another
 * router's live socket is refused. Any other tcp:// endpoint (a router reached by worker groups
 * on other hosts, or a loopback one with anything after its port) is accepted only with CURVE
 * (mt_wire_params): the ROUTER is then a CURVE server with its secret key, and a DEALER must hold
 * the router's public key (and a key pair of its own) to complete the handshake. Messages are
 * encrypted, and the workers know they talk to the holder of the router's secret key. With a list
 * of worker public keys (curve_clients) the ROUTER also admits only those workers, through a ZAP
 * handler (ZeroMQ RFC 27) that runs on a thread of its own; without one, any worker that has the
 * router's public key can connect. A connection that fails the handshake (no keys, a wrong key, a
 * key not listed) never delivers a message.
 *
 * Messages are built with the mt_wire_msg builders below, the one place that fills envelopes, on
 * either side; received ones are read as protobuf-c structs.
 *
 * Socket options set here: ZMQ_ROUTER_MANDATORY (sending to a gone peer fails instead of being
 * dropped silently), send/receive high-water marks of MT_WIRE_HWM messages, linger 0, and
 * immediate mode on DEALERs (no queueing to a peer that is not connected).
 *
 * Connection events (ROUTER): a socket monitor reports when a connection closes (its peer exited,
 * was killed, or the network cut it). ZeroMQ does not say which peer it was, so the router probes
 * its peers with a send after each such event: a send to a peer whose connection is gone fails
 * with MT_ERR_NOT_FOUND (ZMQ_ROUTER_MANDATORY), and that is the router's sign of a dead worker.
 *
 * Ownership: a socket belongs to one thread (the ZAP thread owns only its own socket). Envelopes
 * returned by mt_wire_recv are owned by the caller and freed with mt_wire_free. Wire version:
 * every envelope sent carries MT_WIRE_VERSION; mt_wire_recv rejects (MT_ERR_INVALID, message
 * says so) other versions and undecodable frames without closing the socket.
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

/* Characters of a z85-encoded CURVE key (32 bytes); a key buffer holds one more for the NUL. */
#define MT_WIRE_KEY_Z85 40

/* How a socket is opened. Every pointer is borrowed for the call only (keys are copied). */
typedef struct mt_wire_params {
    const char *identity;          /* DEALER: "w<worker_id>", 1..MT_WIRE_PEER_MAX-1 bytes (required) */
    /* CURVE; keys are z85 text of MT_WIRE_KEY_Z85 characters. */
    const char *curve_secret_key;  /* this side's secret key; NULL: no CURVE (the default) */
    const char *curve_server_key;  /* DEALER with CURVE: the router's public key (required) */
    const char *const *curve_clients; /* ROUTER with CURVE: the public keys of the workers it
                                         admits (ZAP); NULL: any worker with the router's key */
    size_t n_curve_clients;
} mt_wire_params;

mt_wire_params mt_wire_default_params(void);

/* ROUTER: binds endpoint. DEALER: connects to endpoint with p->identity. MT_ERR_INVALID for an
 * endpoint that is neither internal nor tcp:// with CURVE, an ipc:// folder that is not private,
 * a missing identity or a malformed key; MT_ERR_STATE when CURVE is asked for and libzmq lacks
 * it, or another process listens on the ipc:// path; MT_ERR_IO when ZeroMQ refuses. */
mt_status mt_wire_open(mt_wire_kind kind, const char *endpoint, const mt_wire_params *p, mt_wire_sock **out,
                       mt_error *err);
void mt_wire_close(mt_wire_sock *s); /* NULL ok */

/* The endpoint as bound or connected, with a wildcard port resolved (tcp://127.0.0.1:* becomes
 * the port the system gave); written to out (NUL-terminated, truncated to len). */
void mt_wire_endpoint(mt_wire_sock *s, char *out, size_t len);

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

/* ROUTER: a descriptor that turns readable when connection events wait (edge-triggered, like
 * mt_wire_fd: call mt_wire_take_disconnects after it signals); -1 on a DEALER. */
int mt_wire_event_fd(mt_wire_sock *s);

/* ROUTER: reads every connection event waiting and returns how many connections closed since the
 * last call (0 on a DEALER). Handshakes that failed (a worker without the CURVE keys, with a
 * wrong key, or not among curve_clients) are logged here, at most one line a second. */
int mt_wire_take_disconnects(mt_wire_sock *s);

/* ---- CURVE keys ---- */

/* Whether this libzmq has CURVE (zmq_has("curve")). */
bool mt_wire_has_curve(void);

/* A new key pair, z85, into pub and secret (MT_WIRE_KEY_Z85 + 1 bytes each). MT_ERR_STATE
 * without CURVE. */
mt_status mt_wire_keypair(char *pub, char *secret, mt_error *err);

/* The z85 public key of a z85 secret key, into pub (MT_WIRE_KEY_Z85 + 1 bytes). MT_ERR_INVALID
 * for a malformed key, MT_ERR_STATE without CURVE. */
mt_status mt_wire_key_public(const char *secret, char *pub, mt_error *err);

/* Reads a key file: one z85 key, surrounding whitespace ignored (what metrale-keygen writes),
 * into key (MT_WIRE_KEY_Z85 + 1 bytes). MT_ERR_IO or MT_ERR_INVALID naming the file. */
mt_status mt_wire_key_read(const char *path, char *key, mt_error *err);

/* Reads every file of dir whose name ends in ".pub" (metrale-keygen's public keys), in name
 * order, into a malloc'ed array of *n keys (MT_WIRE_KEY_Z85 + 1 bytes each; free() it).
 * MT_ERR_IO or MT_ERR_INVALID naming the folder or the file; MT_ERR_NOT_FOUND when it holds no
 * key. On failure *keys is NULL. */
mt_status mt_wire_keys_read_dir(const char *dir, char (**keys)[MT_WIRE_KEY_Z85 + 1], size_t *n, mt_error *err);

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
        Metrale__Internal__V1__TokenizeCall tokenize_call;
        Metrale__Internal__V1__Tokenized tokenized;
    } body;
    Metrale__V1__Final final; /* Finished only */
    Metrale__V1__Usage usage; /* Finished only */
    Metrale__V1__Speculation spec; /* Finished only */
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
/* worker -> router: tokens[n] of sequence id, in order, and the text they complete (NULL = none);
 * with echo, the first Tokens of a sequence also carries the prompt's logprobs (n_prompt_lp of
 * them, positions 1 onwards). */
mt_envelope *mt_wire_tokens(mt_wire_msg *m, uint64_t id, Metrale__V1__GeneratedToken **tokens, size_t n,
                            const char *text, Metrale__V1__GeneratedToken **prompt_lp, size_t n_prompt_lp);

/* How a sequence ended, for mt_wire_finished. Strings are borrowed; NULL = none. */
typedef struct mt_wire_end {
    Metrale__V1__FinishReason reason;
    uint32_t prompt_tokens, completion_tokens;
    const char *message;         /* error or cancel reason */
    const char *text;            /* text held back until the end */
    const char *stop_string;     /* STOP by this stop string */
    int64_t stop_token_id;       /* STOP by this token id; -1 = none */
    bool invalid_argument;       /* refused before it started: the client gets INVALID_ARGUMENT */
    uint32_t draft_tokens, accepted_tokens, verify_steps; /* speculative decoding; 0: none */
} mt_wire_end;
/* An end with reason and nothing else set (stop_token_id -1). */
mt_wire_end mt_wire_end_of(Metrale__V1__FinishReason reason);
/* worker -> router: sequence id ended, after its last Tokens. */
mt_envelope *mt_wire_finished(mt_wire_msg *m, uint64_t id, const mt_wire_end *end);
/* router -> worker: tokenize a request under id; the worker answers Tokenized. */
mt_envelope *mt_wire_tokenize_call(mt_wire_msg *m, uint64_t id, Metrale__V1__TokenizeRequest *request);
/* worker -> router: the answer to TokenizeCall id: response, or error (non-NULL, non-empty). */
mt_envelope *mt_wire_tokenized(mt_wire_msg *m, uint64_t id, Metrale__V1__TokenizeResponse *response,
                               const char *error);
/* router -> worker: finish nothing new and exit. */
mt_envelope *mt_wire_shutdown(mt_wire_msg *m);

#ifdef __cplusplus
}
#endif
#endif /* MT_WIRE_H */
