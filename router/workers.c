/* router/workers.c: see workers.h. A small array: a deployment has a handful of workers, so
 * linear scans are the simple and fast choice. */
#include "router/workers.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

rtr_workers_params rtr_workers_default_params(void) {
    return (rtr_workers_params){.dead_after_s = MT_WIRE_WORKER_DEAD_S};
}

void rtr_workers_init(rtr_workers *reg, rtr_workers_params params) {
    memset(reg, 0, sizeof *reg);
    reg->params = params;
}

void rtr_workers_free(rtr_workers *reg) {
    if (!reg) return;
    for (size_t i = 0; i < reg->n; i++) {
        free(reg->w[i]->eos_ids);
        free(reg->w[i]);
    }
    reg->n = 0;
}

rtr_worker *rtr_workers_find(rtr_workers *reg, const char *peer) {
    for (size_t i = 0; i < reg->n; i++)
        if (!strcmp(reg->w[i]->peer, peer)) return reg->w[i];
    return NULL;
}

static void copy_str(char *dst, size_t cap, const char *src) {
    snprintf(dst, cap, "%s", src ? src : "");
}

mt_status rtr_workers_hello(rtr_workers *reg, const char *peer, const Metrale__Internal__V1__Hello *hello,
                            double now, rtr_worker **out, mt_error *err) {
    const Metrale__V1__ModelInfo *m = hello->model;
    if (!m) return mt_errorf(err, MT_ERR_INVALID, "Hello from %s has no model", peer);
    if (m->vocab_size == 0 || m->max_context == 0)
        return mt_errorf(err, MT_ERR_INVALID, "Hello from %s: vocab_size %u, max_context %u must be > 0", peer,
                         m->vocab_size, m->max_context);
    char want[MT_WIRE_PEER_MAX];
    mt_wire_identity(hello->worker_id, want);
    if (strcmp(want, peer))
        return mt_errorf(err, MT_ERR_INVALID, "Hello with worker_id %u from identity \"%s\" (expected \"%s\")",
                         hello->worker_id, peer, want);
    /* The eos list first: past it nothing fails, so a failed Hello leaves the registry as it was. */
    uint32_t *eos = NULL;
    if (m->n_eos_token_ids > 0) {
        if (!(eos = malloc(m->n_eos_token_ids * sizeof *eos)))
            return mt_errorf(err, MT_ERR_NOMEM, "out of memory for worker %s", peer);
        memcpy(eos, m->eos_token_ids, m->n_eos_token_ids * sizeof *eos);
    }
    rtr_worker *w = rtr_workers_find(reg, peer);
    if (!w) {
        if (reg->n == MT_WIRE_WORKERS_MAX) {
            free(eos);
            return mt_errorf(err, MT_ERR_FULL, "Hello from %s: already %d workers", peer, MT_WIRE_WORKERS_MAX);
        }
        if (!(w = calloc(1, sizeof *w))) {
            free(eos);
            return mt_errorf(err, MT_ERR_NOMEM, "out of memory for worker %s", peer);
        }
        copy_str(w->peer, sizeof w->peer, peer);
        reg->w[reg->n++] = w;
    } else {
        reg->restarts++;
    }
    w->id = hello->worker_id;
    w->alive = true;
    w->reachable = true;
    w->gone = false;
    w->last_heard = now;
    w->max_sequences = hello->max_sequences ? hello->max_sequences : 1;
    w->in_flight = 0;
    w->hellos++;
    metrale__v1__model_info__init(&w->model);
    w->model.vocab_size = m->vocab_size;
    w->model.max_context = m->max_context;
    w->model.num_layers = m->num_layers;
    w->model.hidden_size = m->hidden_size;
    w->model.eos_token_id = m->eos_token_id;
    free(w->eos_ids);
    w->eos_ids = eos;
    w->model.n_eos_token_ids = eos ? m->n_eos_token_ids : 0;
    w->model.eos_token_ids = eos;
    w->model.has_tokenizer = m->has_tokenizer;
    w->model.has_chat_template = m->has_chat_template;
    copy_str(w->model_type, sizeof w->model_type, m->model_type);
    copy_str(w->backend, sizeof w->backend, m->backend);
    w->model.model_type = w->model_type;
    w->model.backend = w->backend;
    metrale__v1__worker_stats__init(&w->stats);
    w->stats.worker_id = w->id;
    reg->last_limits = (rtr_model_limits){.vocab_size = m->vocab_size,
                                          .max_context = m->max_context,
                                          .has_tokenizer = m->has_tokenizer,
                                          .has_chat_template = m->has_tokenizer && m->has_chat_template};
    reg->have_limits = true;
    *out = w;
    return MT_OK;
}

rtr_worker *rtr_workers_heard(rtr_workers *reg, const char *peer, double now) {
    rtr_worker *w = rtr_workers_find(reg, peer);
    if (!w || !w->alive) return NULL;
    w->last_heard = now;
    w->reachable = true;
    return w;
}

void rtr_workers_set_stats(rtr_worker *w, const Metrale__V1__WorkerStats *s) {
    metrale__v1__worker_stats__init(&w->stats);
    w->stats.worker_id = w->id;
    w->stats.live_sequences = s->live_sequences;
    w->stats.cache_bytes_in_use = s->cache_bytes_in_use;
    w->stats.cache_bytes_baseline = s->cache_bytes_baseline;
    w->stats.sequences_finished = s->sequences_finished;
    w->stats.sequences_aborted = s->sequences_aborted;
    w->stats.prefix_hits = s->prefix_hits;
    w->stats.prefix_misses = s->prefix_misses;
    w->stats.prefix_cache_bytes = s->prefix_cache_bytes;
    w->stats.preemptions = s->preemptions;
    w->stats.speculative_steps = s->speculative_steps;
    w->stats.draft_tokens = s->draft_tokens;
    w->stats.accepted_tokens = s->accepted_tokens;
    w->stats.cache_pages_free = s->cache_pages_free;
    w->stats.cache_pages_total = s->cache_pages_total;
    w->stats.slots_free = s->slots_free;
    w->stats.slots_total = s->slots_total;
    w->stats.slots_prefix = s->slots_prefix;
    w->stats.pages_prefix = s->pages_prefix;
}

static rtr_worker *pick(rtr_workers *reg, bool need_room) {
    rtr_worker *best = NULL;
    for (size_t i = 0; i < reg->n; i++) {
        rtr_worker *w = reg->w[i];
        if (!w->alive || !w->reachable || (need_room && w->in_flight >= w->max_sequences)) continue;
        if (!best) { best = w; continue; }
        /* load = in_flight / max_sequences, compared without division */
        uint64_t a = (uint64_t)w->in_flight * best->max_sequences;
        uint64_t b = (uint64_t)best->in_flight * w->max_sequences;
        if (a < b || (a == b && w->last_pick < best->last_pick)) best = w;
    }
    if (best) best->last_pick = ++reg->picks;
    return best;
}

rtr_worker *rtr_workers_pick(rtr_workers *reg) { return pick(reg, true); }

rtr_worker *rtr_workers_pick_any(rtr_workers *reg) { return pick(reg, false); }

void rtr_workers_mark_dead(rtr_worker *w) {
    w->alive = false;
    w->in_flight = 0;
    w->stats.live_sequences = 0;
}

size_t rtr_workers_expire(rtr_workers *reg, double now, rtr_worker **dead, size_t cap) {
    size_t k = 0;
    for (size_t i = 0; i < reg->n; i++) {
        rtr_worker *w = reg->w[i];
        if (!w->alive || now - w->last_heard <= reg->params.dead_after_s) continue;
        rtr_workers_mark_dead(w);
        if (k < cap) dead[k++] = w;
    }
    return k;
}

size_t rtr_workers_live(const rtr_workers *reg) {
    size_t k = 0;
    for (size_t i = 0; i < reg->n; i++) k += reg->w[i]->alive;
    return k;
}

bool rtr_workers_limits(const rtr_workers *reg, rtr_model_limits *out) {
    bool any = false;
    rtr_model_limits lim = {0, 0, true, true};
    for (size_t i = 0; i < reg->n; i++) {
        const rtr_worker *w = reg->w[i];
        if (!w->alive) continue;
        if (!any || w->model.vocab_size < lim.vocab_size) lim.vocab_size = w->model.vocab_size;
        if (!any || w->model.max_context < lim.max_context) lim.max_context = w->model.max_context;
        lim.has_tokenizer = lim.has_tokenizer && w->model.has_tokenizer;
        lim.has_chat_template = lim.has_chat_template && w->model.has_tokenizer && w->model.has_chat_template;
        any = true;
    }
    if (!any) {
        if (!reg->have_limits) return false;
        lim = reg->last_limits;
    }
    *out = lim;
    return true;
}

const rtr_worker *rtr_workers_any_live(const rtr_workers *reg) {
    for (size_t i = 0; i < reg->n; i++)
        if (reg->w[i]->alive) return reg->w[i];
    return NULL;
}
