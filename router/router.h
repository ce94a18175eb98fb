/* router/router.h: the router process's core. It serves metrale.v1.Generation and
 * grpc.health.v1.Health (grpc_server.h), validates (validate.h) and admits (admission.h) Generate
 * requests, submits them to the least loaded live worker over ZeroMQ (common/wire.h, workers.h)
 * and streams each worker's tokens back to its client.
 *
 * Service behaviour (proto/metrale/v1/metrale.proto states the codes):
 *   - a malformed request: INVALID_ARGUMENT naming the field (bytes that are not the method's
 *     request message too, GetModelInfo and GetStats included); no request message, or a second
 *     one: UNIMPLEMENTED (grpc_server.h); a full admission queue:
 *     RESOURCE_EXHAUSTED; draining or no live worker: UNAVAILABLE;
 *   - a passed deadline: DEADLINE_EXCEEDED, and the worker gets Abort; a client that cancels or
 *     disconnects: the worker gets Abort (it frees the sequence and still answers Finished);
 *   - a worker is dead when its connection closes (it exited or was killed: noticed within
 *     milliseconds, common/wire.h) or when it is silent for dead_after_s (a hang). Its streams
 *     that have had no token yet go back to the front of the queue for another live worker (at
 *     most REQUEUES_MAX times each, router.c); the others end UNAVAILABLE; the other workers'
 *     streams go on. A worker that speaks again (Hello or Heartbeat) is live again and counts as
 *     a restart;
 *     an unknown worker's Heartbeat (it outlived a router restart) is answered with a Heartbeat
 *     whose hello_wanted is set;
 *   - Tokenize is answered by a worker (the least loaded live one): OK, INVALID_ARGUMENT with
 *     the worker's reason, UNAVAILABLE when it is lost first, DEADLINE_EXCEEDED past the
 *     client's deadline or 10 s; requests_total and requests_rejected count Generate calls
 *     only (a Generate the worker refuses as invalid counts as rejected);
 *   - rtr_router_drain (SIGTERM in main): health NOT_SERVING, new requests UNAVAILABLE, admitted
 *     streams run up to drain_timeout_s; then the ones still running are cut: their worker ends
 *     them and they get a final message with FINISH_REASON_CANCELLED and their token counts, and
 *     OK (the ones still queued end UNAVAILABLE); workers get Shutdown, the server stops and
 *     rtr_router_run returns MT_OK.
 *
 *   - security (grpc_server.h): TLS on the serving port, a bearer token on every call but
 *     health's (UNAUTHENTICATED without it), a plaintext health-only port; rtr_router_reload
 *     (SIGHUP in main) reads the TLS files and the token file again, and new connections and
 *     calls use what it read; files that fail their checks leave the current ones in place.
 *   - with params.metrics_listen, the Prometheus metrics (router/metrics.h) are served over HTTP
 *     until rtr_router_free, through the drain too.
 *
 * Logs (common/mt.h records, with the request id): each Generate's life, admitted (how it came:
 * prompt size, max_new_tokens, queued or the worker it went to; the prompt itself only with
 * log_prompts), first_token (time to it), requeued (its worker died before it), and finished
 * (the gRPC status, the finish reason, prompt and completion tokens, the time it took); and
 * rejected for one refused before admission.
 *
 * Threads: the thread that calls rtr_router_create must make every other call; it runs the event
 * loop in rtr_router_run. (grpc_server.c adds one thread that only forwards completions;
 * metrics.c one that answers scrapes from a copy of the metrics.)
 */
#ifndef RTR_ROUTER_H
#define RTR_ROUTER_H

#include <stdbool.h>
#include <stddef.h>

#include "common/mt.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct rtr_router rtr_router;

typedef struct rtr_router_params {
    const char *listen;           /* gRPC address, "127.0.0.1:50051" (port 0: any free port) */
    const char *workers_endpoint; /* ZeroMQ endpoint the workers connect to, "ipc:///tmp/dir/w.sock"
                                     (the folder private: common/wire.h) */
    size_t queue_capacity;        /* admitted requests waiting for a worker; default 1024 */
    double drain_timeout_s;       /* how long running streams may finish after drain; default 30 */
    double dead_after_s;          /* worker silence that makes it dead; default MT_WIRE_WORKER_DEAD_S */
    double workers_exit_s;        /* how long to wait for workers to leave after Shutdown; default 3 */
    int drain_fd;                 /* readable => begin draining (a signalfd or pipe); -1 = none.
                                     The router reads it (up to 512 bytes) but does not close it. */
    int reload_fd;                /* readable => rtr_router_reload (a signalfd for SIGHUP); -1 =
                                     none. Read and kept open like drain_fd. */
    /* The gRPC port's security (docs/DESIGN.md "Security"); paths are copied. */
    const char *tls_cert_file;      /* PEM chain: with tls_key_file, TLS on the serving port */
    const char *tls_key_file;       /* PEM private key of the certificate */
    const char *tls_client_ca_file; /* with TLS: clients must present a certificate it signed */
    const char *auth_token_file;    /* first line: the bearer token every call but health's needs */
    const char *health_listen;      /* a plaintext grpc.health.v1-only address; NULL = none */
    /* CURVE on the workers' endpoint (common/wire.h); z85 keys, borrowed until create returns.
     * Required for a tcp:// endpoint other than 127.0.0.1. */
    const char *curve_secret_key;      /* the router's secret key; NULL = no CURVE */
    const char *const *curve_clients;  /* the workers' public keys it admits; NULL = any worker
                                          that has the router's public key */
    size_t n_curve_clients;
    bool log_prompts;             /* the admitted records carry the prompt (text, or ids); default
                                     false: prompts are never logged */
    /* "HOST:PORT" where GET /metrics serves the Prometheus metrics (router/metrics.h; port 0:
     * any free port); NULL = no endpoint. Borrowed until create returns. */
    const char *metrics_listen;
} rtr_router_params;

rtr_router_params rtr_router_default_params(void);

/* Binds the gRPC port and the workers' endpoint. NULL + err on failure (nothing left open). */
rtr_router *rtr_router_create(const rtr_router_params *params, mt_error *err);

/* The bound gRPC port; the bound health port (0 without one). */
int rtr_router_port(const rtr_router *r);
int rtr_router_health_port(const rtr_router *r);

/* Reads the TLS files and the token file again (what reload_fd does); logs what changed, or why
 * nothing did. */
void rtr_router_reload(rtr_router *r);

/* The bound metrics port; 0 without params.metrics_listen. */
int rtr_router_metrics_port(const rtr_router *r);

/* The workers' endpoint as bound (a wildcard port resolved), into out (truncated to len). */
void rtr_router_workers_endpoint(const rtr_router *r, char *out, size_t len);

/* Runs until a drain completes. MT_OK after a clean drain; an error only when the event loop
 * itself fails (poll). */
mt_status rtr_router_run(rtr_router *r, mt_error *err);

/* Begins draining (as the drain_fd would). Idempotent. */
void rtr_router_drain(rtr_router *r);

/* Closes everything. NULL ok. */
void rtr_router_free(rtr_router *r);

#ifdef __cplusplus
}
#endif
#endif /* RTR_ROUTER_H */
