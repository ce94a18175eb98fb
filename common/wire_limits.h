/* common/wire_limits.h: the numbers the router, the workers and the launcher must agree on, in
 * one place: the router <-> worker protocol (common/wire.h), its timings, and the request limits
 * that the router checks and a worker relies on (proto/metrale/v1/metrale.proto states them to
 * clients). Constants only: no code, no dependencies, usable from C and C++.
 *
 * Changing one is a protocol change: both sides build from this header, so they change together;
 * MT_WIRE_VERSION goes up when an older peer would misread the new value.
 */
#ifndef MT_WIRE_LIMITS_H
#define MT_WIRE_LIMITS_H

/* ---- the transport ---- */

#define MT_WIRE_VERSION 1          /* Envelope.version; a peer drops envelopes of another version */
#define MT_WIRE_HWM 10000          /* messages queued per socket and direction before sends fail */
#define MT_WIRE_PEER_MAX 64        /* bytes of a ZeroMQ identity, "w<worker_id>", with its NUL */
#define MT_WIRE_DEALER_SEND_MS 500 /* a worker's send waits this long for a connected router */

/* ---- timings, in seconds ---- */

/* Both sides send a Heartbeat this often, busy or not (a worker's comes from its own thread, so a
 * long engine step does not silence it). */
#define MT_WIRE_HEARTBEAT_S 0.5
/* The router declares a worker dead after this much silence (five heartbeat periods); the
 * default of rtr_router_params.dead_after_s. */
#define MT_WIRE_WORKER_DEAD_S (5 * MT_WIRE_HEARTBEAT_S)
/* A worker exits after this much silence from the router (it died); the default of
 * metrale-worker --router-timeout. */
#define MT_WIRE_ROUTER_SILENCE_S 10.0
/* A Heartbeat with hello_wanted that reaches a worker this soon after its Hello is the router's
 * answer to a Heartbeat sent before that Hello arrived: the worker ignores it instead of saying
 * Hello again. */
#define MT_WIRE_HELLO_WANTED_QUIET_S 2.0

/* ---- processes ---- */

/* metrale-worker's exit status when it cannot start (the model does not load, the group's size
 * does not divide it, the group cannot form, the backend is missing): a launcher that sees it
 * does not restart the worker's group without end (launcher/serve.c). */
#define MT_WIRE_EXIT_STARTUP 3

/* ---- sizes ---- */

/* Workers one router serves at once (its registry); a launcher starts no more. */
#define MT_WIRE_WORKERS_MAX 256
/* Largest GenerateRequest the router accepts (gRPC's receive limit); a Submit carries one. */
#define MT_WIRE_REQUEST_BYTES_MAX (16u << 20)
/* Largest max_context a worker serves (Hello.model.max_context): token and page arithmetic stays
 * in int. */
#define MT_WIRE_CONTEXT_MAX (1 << 24)

/* ---- GenerateRequest fields (checked by the router, relied on by the workers) ---- */

#define MT_WIRE_REQUEST_ID_MAX 128   /* request_id: 1..128 printable ASCII characters */
#define MT_WIRE_TOP_LOGPROBS_MAX 20  /* top_logprobs: at most 20 alternatives per token */
#define MT_WIRE_STOP_TOKENS_MAX 64   /* stopping.stop_token_ids: at most 64 entries */
#define MT_WIRE_STOP_STRINGS_MAX 16   /* stopping.stop: at most 16 strings */
#define MT_WIRE_STOP_STRING_BYTES_MAX 256 /* each 1..256 bytes of UTF-8 */
#define MT_WIRE_MESSAGES_MAX 4096     /* messages: at most 4096 chat turns */
#define MT_WIRE_ROLE_BYTES_MAX 64     /* ChatMessage.role: 1..64 bytes */
#define MT_WIRE_KWARGS_BYTES_MAX 65536 /* chat_template_kwargs: a JSON object of at most 64 KiB */

#endif /* MT_WIRE_LIMITS_H */
