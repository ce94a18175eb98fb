/* worker/model/layer.h: the layer contract of the engine.
 *
 * A model is a list of layers behind this one interface: a table of operations, NULL
 * meaning "use the default" (documented per slot), plus capability flags the model plans with.
 * Per-sequence state is an mt_layer_state (each layer kind embeds it first in its own state
 * struct). All calls run on the engine thread; a layer and its states are not thread-safe.
 *
 * The residual stream X passed to compute calls is the model's fp32 highway for the rows being
 * computed: [n, S, H] in backend memory, updated in place.
 */
#ifndef MT_LAYER_H
#define MT_LAYER_H

#include <stdbool.h>
#include <stddef.h>

#include "common/mt.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct mt_layer mt_layer;
typedef struct mt_layer_state mt_layer_state;
/* The model's per-step context (backend, positions, scratch, the shared DSA selection); defined
 * by the model that owns the layers (worker/model/glm/glm_impl.h for GLM). */
typedef struct mt_step mt_step;

typedef struct mt_layer_caps {
    bool decode_multi_seq_unsupported;   /* no decode_multi_seq: one row per sequence per step */
    bool decode_verify_multi_unsupported;
    bool graph_stale_on_new_sequence;    /* a captured graph belongs to one sequence's state */
    bool uses_ssm_pool;                  /* state lives in a pool of SSM slots */
    bool is_ssm_layer;                   /* recurrent state: no rollback by length alone */
    bool decode_graph_unsupported;
    bool decode_rollback_unsupported;
    bool supports_replay_tail_split;
    /* decode_prestage reads its token argument: the model then never runs a greedy step from a
     * token that is only on the device (glm_decode_greedy), where the prestage gets -1 */
    bool decode_prestage_needs_token;
} mt_layer_caps;

typedef struct mt_layer_ops {
    /* ---- state ---- */
    /* Allocates the state of one sequence of at most max_tokens positions. Required. */
    mt_status (*alloc_state)(const mt_layer *l, int max_tokens, mt_layer_state **out, mt_error *err);
    /* Frees it. Idempotent in effect: the state is cleared even when a free fails. NULL st ok. */
    void (*release_state)(const mt_layer *l, mt_layer_state *st);

    /* ---- compute ---- */
    /* n rows of one sequence at positions step->t0 .. t0+n-1. Required. */
    mt_status (*prefill)(const mt_layer *l, mt_layer_state *st, mt_step *step, float *X, int n);
    /* One row. NULL: prefill with n = 1. */
    mt_status (*decode)(const mt_layer *l, mt_layer_state *st, mt_step *step, float *X);
    /* k rows of one sequence (the speculative verify). NULL: prefill with n = k. */
    mt_status (*decode_batched)(const mt_layer *l, mt_layer_state *st, mt_step *step, float *X, int k);
    /* One row for each of nseq sequences, each with its own length. NULL: unsupported. */
    mt_status (*decode_multi_seq)(const mt_layer *l, mt_layer_state **sts, int nseq, mt_step *step,
                                  float *X);
    /* n rows in nseq segments, segment i being consecutive positions of sequence sts[i] (prompt
     * chunks and decode rows of one step, the mixed batch); the model's step says where each
     * segment starts and how long it is. Token-wise work runs over all n rows at once, the
     * mixer segment by segment. NULL: unsupported. */
    mt_status (*forward_segments)(const mt_layer *l, mt_layer_state **sts, int nseq, mt_step *step,
                                  float *X, int n);

    /* ---- graph hooks (host work around a CUDA-graph decode step); NULL: no-op, ok ---- */
    /* Before capture or replay, with the token id on the host. */
    mt_status (*decode_prestage)(const mt_layer *l, mt_layer_state *st, int32_t token);
    /* After a failed capture: restore what the prestage consumed so the step can run eagerly. */
    void (*decode_prestage_rearm)(const mt_layer *l, mt_layer_state *st);
    /* Before a replay that ends at seq_len + k: MT_ERR_FULL when its writes would land past the
     * end of a host-tracked cache. */
    mt_status (*check_replay_room)(const mt_layer *l, const mt_layer_state *st, int seq_len, int k);
    /* After a replay (the layer's own decode did not run): bring host bookkeeping to seq_len + k. */
    mt_status (*sync_replayed_step)(const mt_layer *l, mt_layer_state *st, int seq_len, int k);

    /* ---- speculative verify: k-row prestage and rollback ----
     * A verify is a step of k > 1 rows of one sequence whose rows are provisional: the runner
     * prestages each of the k rows in order (decode_prestage k times, then the step; a prestage
     * may advance host state as if the row were accepted), or the rows reach decode_batched /
     * forward_segments with their ids. The model's step names a verify ring (the model's
     * scratch for per-row state, e.g. glm's mt_step.vring) where a layer that cannot be rewound
     * by length leaves its state after each row but the last. */
    /* After such a verify, only its first keep rows (1 <= keep <= k) stand: the layer's state
     * becomes what those rows alone would have left, taken from ring `ring` without recomputing.
     * MT_ERR_STATE when the state's last step was not a verify of at least keep rows (nothing
     * changes then). NULL: the model rolls the layer back itself (by length, or from its pooled
     * ring slots). */
    mt_status (*verify_keep)(const mt_layer *l, mt_layer_state *st, int keep, int ring);

    /* ---- aux state (prefix reuse, preemption); NULL: the layer has none ---- */
    bool (*has_aux_state)(const mt_layer *l);
    /* *bytes is malloc'ed, caller frees. */
    mt_status (*snapshot_aux)(const mt_layer *l, const mt_layer_state *st, void **bytes, size_t *len,
                              mt_error *err);
    /* On error the state is unchanged. */
    mt_status (*restore_aux)(const mt_layer *l, mt_layer_state *st, const void *bytes, size_t len,
                             mt_error *err);
} mt_layer_ops;

struct mt_layer {
    const mt_layer_ops *ops;
    mt_layer_caps caps;
    const char *kind;  /* "glm.kda", "glm.dsa", ... for logs */
    int index;         /* position in the model */
};

struct mt_layer_state {
    const mt_layer *layer;
};

/* Dispatch with the defaults above applied. */
mt_status mt_layer_alloc_state(const mt_layer *l, int max_tokens, mt_layer_state **out, mt_error *err);
void mt_layer_release_state(const mt_layer *l, mt_layer_state *st);
mt_status mt_layer_prefill(const mt_layer *l, mt_layer_state *st, mt_step *step, float *X, int n);
mt_status mt_layer_decode(const mt_layer *l, mt_layer_state *st, mt_step *step, float *X);
mt_status mt_layer_decode_batched(const mt_layer *l, mt_layer_state *st, mt_step *step, float *X, int k);
mt_status mt_layer_decode_multi_seq(const mt_layer *l, mt_layer_state **sts, int nseq, mt_step *step,
                                    float *X);
mt_status mt_layer_forward_segments(const mt_layer *l, mt_layer_state **sts, int nseq, mt_step *step,
                                    float *X, int n);
mt_status mt_layer_decode_prestage(const mt_layer *l, mt_layer_state *st, int32_t token);
void mt_layer_decode_prestage_rearm(const mt_layer *l, mt_layer_state *st);
mt_status mt_layer_check_replay_room(const mt_layer *l, const mt_layer_state *st, int seq_len, int k);
mt_status mt_layer_sync_replayed_step(const mt_layer *l, mt_layer_state *st, int seq_len, int k);
mt_status mt_layer_verify_keep(const mt_layer *l, mt_layer_state *st, int keep, int ring); /* NULL: MT_OK */
bool mt_layer_has_aux_state(const mt_layer *l);
mt_status mt_layer_snapshot_aux(const mt_layer *l, const mt_layer_state *st, void **bytes, size_t *len,
                                mt_error *err);
mt_status mt_layer_restore_aux(const mt_layer *l, mt_layer_state *st, const void *bytes, size_t len,
                               mt_error *err);

#ifdef __cplusplus
}
#endif
#endif /* MT_LAYER_H */
