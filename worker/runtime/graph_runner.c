/* worker/runtime/graph_runner.c: see graph_runner.h. */
#include "worker/runtime/graph_runner.h"

void rt_runner_init(rt_runner *r, mt_backend *be, const mt_layer *const *layers, int n_layers) {
    *r = (rt_runner){ .be = be, .layers = layers, .n_layers = n_layers };
    rt_plan p = { .graphs = be->ops->graph_begin != NULL, .multi_seq = true, .verify_multi = true, .rollback = true };
    for (int l = 0; l < n_layers; l++) {
        const mt_layer_caps *c = &layers[l]->caps;
        p.graphs &= !c->decode_graph_unsupported;
        p.per_sequence |= c->graph_stale_on_new_sequence;
        p.multi_seq &= !c->decode_multi_seq_unsupported && layers[l]->ops->decode_multi_seq != NULL;
        p.verify_multi &= !c->decode_verify_multi_unsupported;
        p.rollback &= !c->decode_rollback_unsupported;
        p.prestage_needs_token |= c->decode_prestage_needs_token;
    }
    r->plan = p;
}

void rt_slot_release(rt_runner *r, rt_slot *s) {
    if (s->graph && r->be->ops->graph_free) r->be->ops->graph_free(r->be, s->graph);
    *s = (rt_slot){ 0 };
}

mt_status rt_hooks_before(const rt_runner *r, const rt_rows *rows, mt_error *err) {
    for (int i = 0; i < rows->n; i++)
        for (int l = 0; l < r->n_layers; l++) {
            const mt_layer *ly = r->layers[l];
            mt_layer_state *st = rows->states[i][l];
            for (int j = 0; j < rows->k; j++) {
                const int32_t tok = rows->tokens ? rows->tokens[(size_t)i * rows->k + j] : -1;
                mt_status s = mt_layer_decode_prestage(ly, st, tok);
                if (s != MT_OK)
                    return mt_errorf(err, s, "sequence %d layer %d (%s): prestage failed at position %d", i, l,
                                     ly->kind, rows->seq_len[i] + j);
            }
            if (mt_layer_check_replay_room(ly, st, rows->seq_len[i], rows->k) != MT_OK)
                return mt_errorf(err, MT_ERR_FULL, "sequence %d layer %d (%s) has no room to replay %d rows at %d", i,
                                 l, ly->kind, rows->k, rows->seq_len[i]);
        }
    return MT_OK;
}

mt_status rt_hooks_after(const rt_runner *r, const rt_rows *rows, mt_error *err) {
    for (int i = 0; i < rows->n; i++)
        for (int l = 0; l < r->n_layers; l++) {
            mt_status s = mt_layer_sync_replayed_step(r->layers[l], rows->states[i][l], rows->seq_len[i], rows->k);
            if (s != MT_OK)
                return mt_errorf(err, s, "sequence %d layer %d (%s) lost track of its cache at %d", i, l,
                                 r->layers[l]->kind, rows->seq_len[i]);
        }
    return MT_OK;
}

static void rearm(const rt_runner *r, const rt_rows *rows) {
    for (int i = 0; i < rows->n; i++)
        for (int l = 0; l < r->n_layers; l++) mt_layer_decode_prestage_rearm(r->layers[l], rows->states[i][l]);
}

static uint64_t epoch_of(const rt_runner *r) {
    return r->be->ops->graph_epoch ? r->be->ops->graph_epoch(r->be) : 0;
}

/* body recorded into a graph: NULL when the body or the capture fails (the backend is usable
 * again). */
static mt_graph *record(rt_runner *r, mt_status (*body)(void *ctx), void *ctx) {
    mt_backend *be = r->be;
    if (be->ops->graph_begin(be) != MT_OK) return NULL;
    mt_status st = body(ctx);
    if (r->fail_next_capture) { /* a host sync is not capturable */
        r->fail_next_capture = false;
        be->ops->sync(be);
    }
    mt_graph *g = NULL;
    mt_status end = be->ops->graph_end(be, &g);
    if (st == MT_OK && end == MT_OK && g) return g;
    if (g) be->ops->graph_free(be, g);
    return NULL;
}

mt_status rt_run_step(rt_runner *r, rt_slot *s, bool use_graph, int size, const rt_rows *rows,
                      mt_status (*body)(void *ctx), void *ctx, const char *what) {
    mt_backend *be = r->be;
    use_graph = use_graph && r->plan.graphs && s->failures < RT_MAX_CAPTURE_FAILURES;
    if (!use_graph) return body(ctx);
    if (s->graph && (s->size != size || s->epoch != epoch_of(r))) {
        /* sized for shorter sequences, or recorded over scratch the backend has since replaced */
        be->ops->graph_free(be, s->graph);
        s->graph = NULL;
    }
    if (!s->graph && s->warm) {
        if ((s->graph = record(r, body, ctx))) {
            s->size = size;
            s->epoch = epoch_of(r);
        } else {
            rearm(r, rows);
            s->failures++;
            mt_log(MT_LOG_WARN, "%s: graph capture failed (%d of %d); this step runs eagerly", what, s->failures,
                   RT_MAX_CAPTURE_FAILURES);
        }
    }
    if (s->graph) return be->ops->graph_launch(be, s->graph);
    mt_status st = body(ctx);
    if (st == MT_OK) s->warm = true;
    return st;
}
