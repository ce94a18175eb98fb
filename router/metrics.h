/* router/metrics.h: the router's Prometheus metrics, and the HTTP endpoint that serves them
 * (GET /metrics, text exposition format 0.0.4, libmicrohttpd). Names and shapes follow vLLM's
 * (vllm:x becomes metrale_x); docs/DESIGN.md "Metrics" lists them.
 *
 * What is recorded where:
 *   - events, as they happen (the event-loop thread): a Generate call's final gRPC status
 *     (rtr_metrics_request_ended), each batch of tokens a worker sends (rtr_metrics_tokens), a
 *     request a worker finished (rtr_metrics_request_finished). The router records an event
 *     before it sends the client the message that follows from it, so a client that has its
 *     final message finds it counted;
 *   - state (rtr_metrics_publish), on the router's timer (every 50 ms) and when a worker's
 *     liveness or heartbeat stats change: waiting and running requests, live workers,
 *     restarts, and each worker's latest heartbeat stats. Counters the
 *     workers keep (prefix-cache queries, preemptions, speculative drafts) grow by the increase
 *     between two heartbeats, counted from zero again after a worker's Hello (a new process), so
 *     they stay monotonic when workers restart; what a worker did after its last heartbeat
 *     before it died is lost.
 *
 * Threads and ownership: the router's event-loop thread creates the registry, calls every
 * rtr_metrics_* recording function, and frees it. rtr_metrics_serve starts libmicrohttpd's own
 * thread, which answers scrapes. The recorded values live behind one mutex: each recording
 * call holds it for a few additions, and a scrape only for a copy of the values (it formats the
 * text after letting go), so neither side waits on the other for long and a scrape sees one
 * consistent moment. rtr_metrics_render may be called from any thread.
 */
#ifndef RTR_METRICS_H
#define RTR_METRICS_H

#include <grpc/status.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/mt.h"
#include "proto/metrale/v1/metrale.pb-c.h"
#include "router/workers.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct rtr_metrics rtr_metrics;

/* A registry with every value at zero; version labels metrale_build_info (copied). NULL + err
 * when out of memory. */
rtr_metrics *rtr_metrics_create(const char *version, mt_error *err);

/* Serves GET /metrics on listen ("HOST:PORT", "[IPv6]:PORT"; port 0: any free port) from a
 * thread of its own, until rtr_metrics_free. *port receives the bound port. MT_ERR_INVALID for
 * an address that does not parse or resolve, MT_ERR_IO when it cannot be bound (nothing
 * started); MT_ERR_STATE when already serving. */
mt_status rtr_metrics_serve(rtr_metrics *m, const char *listen, int *port, mt_error *err);

/* Stops the endpoint (waits for its thread) and frees the registry. NULL ok. */
void rtr_metrics_free(rtr_metrics *m);

/* ---- recording: the event-loop thread only ---- */

/* A Generate call ended with code (counted in metrale_requests_total{code}): sent, refused, or
 * left by its client (CANCELLED, or DEADLINE_EXCEEDED when its deadline had passed). */
void rtr_metrics_request_ended(rtr_metrics *m, grpc_status_code code);

/* A worker sent n generated tokens for a request (metrale_generation_tokens_total, streamed to
 * the client or not). With a client still there: first (the request's first tokens) observes
 * since_s as the time to first token (since arrival), else as an inter-token latency (since the
 * previous tokens). since_s < 0: count the tokens only (the client is gone). */
void rtr_metrics_tokens(rtr_metrics *m, uint32_t n, bool first, double since_s);

/* A request a worker ran has ended (its Finished): by reason, with the worker's usage. */
typedef struct rtr_metrics_finish {
    Metrale__V1__FinishReason reason; /* STOP, LENGTH, CANCELLED (label "abort"), ERROR */
    uint32_t prompt_tokens, generation_tokens;
    double queue_s; /* arrival to its (last) submission to a worker */
    double e2e_s;   /* arrival to the end */
} rtr_metrics_finish;
void rtr_metrics_request_finished(rtr_metrics *m, const rtr_metrics_finish *f);

/* The router's state now: published on its timer, and when a worker's liveness or stats change. */
typedef struct rtr_metrics_load {
    uint32_t waiting;          /* in the admission queue */
    uint32_t running;          /* submitted to a worker, client still there */
    uint64_t requeued;         /* streams moved to another worker (cumulative) */
} rtr_metrics_load;
void rtr_metrics_publish(rtr_metrics *m, const rtr_metrics_load *load, const rtr_workers *reg);

/* ---- reading: any thread ---- */

/* The exposition text now, NUL-terminated, malloc'd (the caller frees); *len its length. NULL
 * when out of memory. */
char *rtr_metrics_render(rtr_metrics *m, size_t *len);

#ifdef __cplusplus
}
#endif
#endif /* RTR_METRICS_H */
