/* worker/runtime/graph_runner.h: decode steps through captured graphs, and the layers' graph
 * hooks around every step.
 *
 * A model's decode step is a body of ops that reads its inputs (tokens, positions, pointer tables)
 * from backend memory, so one recording of it serves many steps. The runner keeps each recording
 * in a graph slot (a bucket of rows, one sequence, one verify width: the model decides what a slot
 * stands for), captures the body on a slot's second use (the first runs eagerly and sizes the
 * backend's scratch, so nothing is allocated inside a capture), replays it afterwards, drops a
 * recording whose scratch the backend has since replaced (graph_epoch) or whose sizing changed,
 * and after RT_MAX_CAPTURE_FAILURES failed captures leaves that slot eager.
 *
 * Around every step, eager or replayed, it drives every layer through the contract's four hooks
 * (worker/model/layer.h), for n sequences of k >= 1 rows each (k > 1: a speculative verify):
 * decode_prestage for each row's token, check_replay_room before, decode_prestage_rearm after a
 * failed capture, sync_replayed_step after. The runner plans from the layers' capability flags
 * (rt_plan) and knows no layer kind.
 *
 * Ownership: the runner borrows the backend and the layers (they outlive it); slots belong to
 * their holder, which frees them with rt_slot_release. One thread at a time.
 */
#ifndef RT_GRAPH_RUNNER_H
#define RT_GRAPH_RUNNER_H

#include <stdbool.h>
#include <stdint.h>

#include "common/mt.h"
#include "kernels/backend.h"
#include "worker/model/layer.h"

#ifdef __cplusplus
extern "C" {
#endif

#define RT_MAX_CAPTURE_FAILURES 3

/* What the layers allow, from their capability flags. */
typedef struct rt_plan {
    bool graphs;               /* the backend captures and no layer is decode_graph_unsupported */
    bool per_sequence;         /* a layer is graph_stale_on_new_sequence: a one-sequence graph
                                * holds that sequence's state addresses and serves it alone */
    bool multi_seq;            /* no layer is decode_multi_seq_unsupported */
    bool verify_multi;         /* no layer is decode_verify_multi_unsupported */
    bool rollback;             /* no layer is decode_rollback_unsupported */
    bool prestage_needs_token; /* a layer's prestage reads the token: never run ahead of it */
} rt_plan;

typedef struct rt_runner {
    mt_backend *be;
    const mt_layer *const *layers; /* [n_layers] */
    int n_layers;
    rt_plan plan;
    bool fail_next_capture;    /* test hook: the next capture makes an uncapturable call */
} rt_runner;

/* One recording and its bookkeeping. Zero-initialised is empty. */
typedef struct rt_slot {
    mt_graph *graph;
    uint64_t epoch;            /* backend graph_epoch when recorded */
    int size;                  /* the sizing it was recorded for (e.g. the largest capacity) */
    int failures;
    bool warm;                 /* an eager run of this slot's body has sized the scratch */
} rt_slot;

/* The runner of these layers on be, its plan read from the layers' capabilities. */
void rt_runner_init(rt_runner *r, mt_backend *be, const mt_layer *const *layers, int n_layers);

/* Frees the slot's recording and empties it. */
void rt_slot_release(rt_runner *r, rt_slot *s);

/* The rows of a step: n sequences, sequence i at length seq_len[i] with its layer states
 * states[i][0 .. n_layers), k rows each; tokens (host) [n * k] or NULL when they are only on
 * the device (prestage then gets -1; only when !plan.prestage_needs_token). */
typedef struct rt_rows {
    mt_layer_state *const *const *states;
    const int *seq_len;
    const int32_t *tokens;
    int n, k;
} rt_rows;

/* Before a step: every layer's prestage for each row's token, then check_replay_room. On error
 * err names the sequence and layer. */
mt_status rt_hooks_before(const rt_runner *r, const rt_rows *rows, mt_error *err);
/* After a step that ran (eager or replayed): sync_replayed_step to seq_len + k. */
mt_status rt_hooks_after(const rt_runner *r, const rt_rows *rows, mt_error *err);

/* Runs body(ctx) as one step in slot s: replays s's recording when it is valid for `size` and
 * the backend's epoch; otherwise records it when s is warm (a failed capture rearms the rows'
 * prestages and runs the step eagerly, logging what), or runs it eagerly and marks s warm.
 * use_graph false: eagerly, s untouched. */
mt_status rt_run_step(rt_runner *r, rt_slot *s, bool use_graph, int size, const rt_rows *rows,
                      mt_status (*body)(void *ctx), void *ctx, const char *what);

#ifdef __cplusplus
}
#endif
#endif /* RT_GRAPH_RUNNER_H */
