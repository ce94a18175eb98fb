/* worker/model/layer.c: dispatch of the layer contract with its defaults (see layer.h). */
#include "worker/model/layer.h"

#include <stdlib.h>

mt_status mt_layer_alloc_state(const mt_layer *l, int max_tokens, mt_layer_state **out, mt_error *err) {
    return l->ops->alloc_state(l, max_tokens, out, err);
}

void mt_layer_release_state(const mt_layer *l, mt_layer_state *st) {
    if (st) l->ops->release_state(l, st);
}

mt_status mt_layer_prefill(const mt_layer *l, mt_layer_state *st, mt_step *step, float *X, int n) {
    return l->ops->prefill(l, st, step, X, n);
}

mt_status mt_layer_decode(const mt_layer *l, mt_layer_state *st, mt_step *step, float *X) {
    return l->ops->decode ? l->ops->decode(l, st, step, X) : l->ops->prefill(l, st, step, X, 1);
}

mt_status mt_layer_decode_batched(const mt_layer *l, mt_layer_state *st, mt_step *step, float *X, int k) {
    return l->ops->decode_batched ? l->ops->decode_batched(l, st, step, X, k)
                                  : l->ops->prefill(l, st, step, X, k);
}

mt_status mt_layer_decode_multi_seq(const mt_layer *l, mt_layer_state **sts, int nseq, mt_step *step,
                                    float *X) {
    if (!l->ops->decode_multi_seq) return MT_ERR_UNSUPPORTED;
    return l->ops->decode_multi_seq(l, sts, nseq, step, X);
}

mt_status mt_layer_forward_segments(const mt_layer *l, mt_layer_state **sts, int nseq, mt_step *step,
                                    float *X, int n) {
    if (!l->ops->forward_segments) return MT_ERR_UNSUPPORTED;
    return l->ops->forward_segments(l, sts, nseq, step, X, n);
}

mt_status mt_layer_decode_prestage(const mt_layer *l, mt_layer_state *st, int32_t token) {
    return l->ops->decode_prestage ? l->ops->decode_prestage(l, st, token) : MT_OK;
}

void mt_layer_decode_prestage_rearm(const mt_layer *l, mt_layer_state *st) {
    if (l->ops->decode_prestage_rearm) l->ops->decode_prestage_rearm(l, st);
}

mt_status mt_layer_check_replay_room(const mt_layer *l, const mt_layer_state *st, int seq_len, int k) {
    return l->ops->check_replay_room ? l->ops->check_replay_room(l, st, seq_len, k) : MT_OK;
}

mt_status mt_layer_sync_replayed_step(const mt_layer *l, mt_layer_state *st, int seq_len, int k) {
    return l->ops->sync_replayed_step ? l->ops->sync_replayed_step(l, st, seq_len, k) : MT_OK;
}

mt_status mt_layer_verify_keep(const mt_layer *l, mt_layer_state *st, int keep, int ring) {
    return l->ops->verify_keep ? l->ops->verify_keep(l, st, keep, ring) : MT_OK;
}

bool mt_layer_has_aux_state(const mt_layer *l) {
    return l->ops->has_aux_state && l->ops->has_aux_state(l);
}

mt_status mt_layer_snapshot_aux(const mt_layer *l, const mt_layer_state *st, void **bytes, size_t *len,
                                mt_error *err) {
    if (!mt_layer_has_aux_state(l) || !l->ops->snapshot_aux) {
        *bytes = NULL;
        *len = 0;
        return MT_OK;
    }
    return l->ops->snapshot_aux(l, st, bytes, len, err);
}

mt_status mt_layer_restore_aux(const mt_layer *l, mt_layer_state *st, const void *bytes, size_t len,
                               mt_error *err) {
    if (!mt_layer_has_aux_state(l) || !l->ops->restore_aux)
        return len == 0 ? MT_OK : mt_errorf(err, MT_ERR_INVALID, "layer %d (%s) has no aux state", l->index, l->kind);
    return l->ops->restore_aux(l, st, bytes, len, err);
}
