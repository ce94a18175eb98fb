/* router/workers.h: the worker registry. One entry per worker the router has heard a Hello from,
 * keyed by its ZeroMQ identity ("w<id>"); entries are never removed, so a worker that comes back
 * after being declared dead reuses its entry (and counts as a restart).
 *
 * Liveness: every message from a worker refreshes it; a worker silent for longer than
 * params.dead_after_s is declared dead by rtr_workers_expire (a worker that hangs). A worker whose
 * connection closed (it exited or was killed) is marked `gone` by the router when a send to it
 * finds no connection, and declared dead with rtr_workers_mark_dead at once. The router sends its
 * own heartbeats (worker.proto Heartbeat) every MT_WIRE_HEARTBEAT_S; this module only keeps the
 * book.
 *
 * Load: in_flight counts the sequences the router has submitted to a worker and not yet seen
 * Finished for (aborted ones included, since the worker holds them until it says Finished).
 * rtr_workers_pick returns the live worker with the lowest in_flight / max_sequences.
 *
 * Ownership: the registry owns its entries; an rtr_worker pointer stays valid until
 * rtr_workers_free. Not thread-safe: the router's event-loop thread owns it.
 */
#ifndef RTR_WORKERS_H
#define RTR_WORKERS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/mt.h"
#include "common/wire.h"
#include "router/validate.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct rtr_worker {
    char peer[MT_WIRE_PEER_MAX]; /* ZeroMQ identity, "w<id>" */
    uint32_t id;                 /* Hello.worker_id */
    bool alive;
    bool reachable;              /* false after a send to it failed, until it is heard from again */
    bool gone;                   /* a send found its connection closed; cleared by its next Hello */
    double last_heard;           /* mt_now() of its last message */
    uint32_t max_sequences;      /* from Hello; at least 1 */
    uint32_t in_flight;          /* submitted, Finished not yet seen */
    uint64_t last_pick;          /* tie-break for pick: least recently picked first */
    uint64_t hellos;
    /* The model it serves, from Hello (strings copied, truncated to the buffers; eos_token_ids
     * copied into eos_ids, owned by the entry). */
    Metrale__V1__ModelInfo model;
    char model_type[64];
    char backend[16];
    uint32_t *eos_ids;           /* owned; model.eos_token_ids points here */
    /* Its latest Heartbeat stats (scalars copied). */
    Metrale__V1__WorkerStats stats;
} rtr_worker;

typedef struct rtr_workers_params {
    double dead_after_s; /* silence that makes a worker dead; default MT_WIRE_WORKER_DEAD_S */
} rtr_workers_params;

rtr_workers_params rtr_workers_default_params(void);

typedef struct rtr_workers {
    rtr_workers_params params;
    rtr_worker *w[MT_WIRE_WORKERS_MAX]; /* owned */
    size_t n;
    uint64_t picks;
    uint32_t restarts;              /* Hellos from a worker already known */
    rtr_model_limits last_limits;   /* of the latest Hello, for when none is live */
    bool have_limits;
} rtr_workers;

void rtr_workers_init(rtr_workers *reg, rtr_workers_params params);
void rtr_workers_free(rtr_workers *reg); /* the entries; reg itself is the caller's */

/* The entry for peer, or NULL. */
rtr_worker *rtr_workers_find(rtr_workers *reg, const char *peer);

/* Records a Hello from peer at time now: creates the entry or revives it (in_flight reset to 0,
 * restarts counted when the entry existed). The caller must first end the streams it had on
 * that worker. MT_ERR_INVALID (registry unchanged) for a Hello without a model, with a zero
 * vocab or context, or from an identity that is not "w<worker_id>"; MT_ERR_FULL when
 * MT_WIRE_WORKERS_MAX entries exist; MT_ERR_NOMEM. The Hello is only read: the entry keeps
 * copies of what it needs, so the caller may free the Hello after. */
mt_status rtr_workers_hello(rtr_workers *reg, const char *peer, const Metrale__Internal__V1__Hello *hello,
                            double now, rtr_worker **out, mt_error *err);

/* A message from peer arrived: refreshes liveness of a live worker and marks it reachable.
 * Returns the entry if the worker is alive, NULL if unknown or dead (it must say Hello first). */
rtr_worker *rtr_workers_heard(rtr_workers *reg, const char *peer, double now);

/* Copies the scalars of a Heartbeat's stats. */
void rtr_workers_set_stats(rtr_worker *w, const Metrale__V1__WorkerStats *stats);

/* The live, reachable worker with room and the lowest load, or NULL. Marks it picked. */
rtr_worker *rtr_workers_pick(rtr_workers *reg);

/* The same for work that takes no sequence slot (a Tokenize call): the live, reachable worker
 * with the lowest load, room or not, or NULL. Marks it picked. */
rtr_worker *rtr_workers_pick_any(rtr_workers *reg);

/* Declares w dead: not alive, in_flight and its live_sequences reset to 0. */
void rtr_workers_mark_dead(rtr_worker *w);

/* Declares dead every live worker silent for longer than dead_after_s at time now. Writes the
 * newly dead ones to dead[] (up to cap) and returns how many. Their in_flight is reset to 0. */
size_t rtr_workers_expire(rtr_workers *reg, double now, rtr_worker **dead, size_t cap);

size_t rtr_workers_live(const rtr_workers *reg);

/* The tightest limits over the live workers (text served only when every one has a tokenizer,
 * messages when every one has a chat template); over the last Hello when none is live. false
 * when no Hello was ever received. */
bool rtr_workers_limits(const rtr_workers *reg, rtr_model_limits *out);

/* A live worker's entry whose model describes the service (the first live one), or NULL. */
const rtr_worker *rtr_workers_any_live(const rtr_workers *reg);

#ifdef __cplusplus
}
#endif
#endif /* RTR_WORKERS_H */
