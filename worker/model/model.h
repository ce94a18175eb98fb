/* worker/model/model.h: the model interface, the only part of a model the engine sees.
 *
 * A model is a table of operations (mt_model_ops) over an opaque handle: describe it, size and
 * hold per-sequence state, run a batch plan (prefill chunks and decode rows), run greedy decode
 * ahead of the host, and the drafter's entries. One architecture is one folder under
 * worker/model/ that fills this table (worker/model/glm/ for glm5_next) and one line of the
 * registry (model.c), chosen by config.json's model_type.
 *
 * Ownership: a model owns its weights and its state pools; every mt_seq made from it must be
 * freed before the model. The backend is borrowed and must outlive the model. Thread-safety: one
 * thread at a time per model (the engine thread). A call that fails leaves the model and its
 * sequences as they were, unless its comment says otherwise.
 */
#ifndef MT_MODEL_H
#define MT_MODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/mt.h"
#include "kernels/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct mt_model mt_model;
typedef struct mt_seq mt_seq;
/* A communicator of a tensor-parallel group (worker/dist/comm.h). */
typedef struct mt_comm mt_comm;

/* Options of any model; each architecture reads the ones that apply to it. */
typedef struct mt_model_params {
    int prefill_chunk;     /* rows per prefill pass (bounds scratch memory), default 256 */
    int pool_pages, pool_slots; /* pools made at the first seq_new when set_pools was not called
                                 * (0: the architecture's default) */
    int graph_max_rows;    /* batched decode steps of more rows run eagerly (default 64) */
    bool decode_graphs;    /* decode through captured graphs when the backend can (default true) */
    bool device_positions; /* decode in the graph form (positions read from backend memory) even
                            * without a graph; default false. For tests of the graph form. */
    /* Tensor parallelism: this process is rank comm->rank of comm->size and loads its shard of
     * the weights and state; the layers' partial sums are all-reduced over comm. NULL: the whole
     * model (one rank). Borrowed; it must outlive the model. */
    mt_comm *comm;
    /* The model's drafter (an MTP block), when it has one, follows every sequence so that any
     * step can draft (speculative decoding); default false. */
    bool mtp;
    /* Layered prefill in sites (mt_batch_part.layers counts the attention and the MLP site of a
     * layer as two units, mt_model_info.layered_units = 2 x layers), so that a step beside decode
     * rows carries one site of a prompt: on an MoE model a layer's attention and its experts'
     * reads land in different steps. Default false: whole layers. */
    bool layered_sites;
    /* With layered_sites: the MLP site of a layer counts as this many units, each running a
     * layered prompt's rows through its share of the routed experts (experts [q E / P, (q + 1) E
     * / P) in unit q; a dense MLP runs whole in the first), so that a step beside decode rows
     * reads 1/P of an MoE layer's experts for the prompt. mt_model_info.layered_units is then
     * (1 + P) x layers. Default 0 (or 1): the MLP site is one unit. */
    int layered_expert_parts;
    /* layered_expert_parts as a default rather than a request: a model that cannot split its
     * experts so (no layered_sites, fewer routed experts than parts, a backend that cannot keep a
     * part of them) keeps its MLP site whole instead of refusing to load. Default false. */
    bool layered_expert_parts_soft;
    /* With mtp: the verify parts one forward takes at most (each holds GLM_VERIFY_MAX - 1 more
     * recurrent slots while its rows wait for seq_keep); default 1. */
    int verify_seqs;
    /* FP8 checkpoints: true dequantises every FP8 weight to bf16 at load (--dtype bf16); false
     * (default) keeps the dense projections and the routed experts in FP8 with their block scales
     * where the backend multiplies FP8 (mt_backend_ops.weight_fp8; the CUDA backend), the rest
     * dequantised. */
    bool dequant_fp8;
    /* Random weights (glm_model_new_random, random: presets): the projections an FP8 checkpoint
     * keeps in FP8 are made at their dtype and quantised to FP8 on the backend
     * (mt_backend_ops.weight_fp8_from), as an FP8 checkpoint would load, for benchmarks; default
     * false; ignored on a backend without that slot. */
    bool random_fp8;
    /* Weight loading progress, called on the loading thread after the embedding and head, after
     * each layer and after the drafter, while mt_model_load runs: done of total checkpoint bytes
     * of the tensors to load (a tensor split across ranks counts whole), and read, the bytes
     * this rank read of them. Not called for random weights. NULL (default): none. */
    void (*on_load_progress)(void *user, uint64_t done, uint64_t total, uint64_t read);
    void *load_progress_user;
    /* PLE memories (docs/DESIGN.md "The memory on the GPU"). ple_host_gather: hash and gather
     * every row on the host, as a backend without ple_gather_rows does, even where the backend
     * could from the device's ids (then a decode step's prestage stages the rows); default false.
     * ple_table_device: keep the n-gram tables in backend memory even where the backend reads
     * page-locked host memory (weight_host); default false. */
    bool ple_host_gather;
    bool ple_table_device;
    /* true: each group of projections that share an input is packed into one backend allocation
     * where the backend can (mt_backend_ops.weights_pack), so a batch's rows take the group as one
     * product; false (default: the packing saves a fraction of a percent of a batched decode
     * step, docs/PERF.md) keeps them apart. */
    bool pack_projections;
} mt_model_params;

mt_model_params mt_model_default_params(void);

/* What the engine plans with. */
typedef struct mt_model_info {
    const char *arch;      /* config.json model_type, e.g. "glm5_next" */
    int vocab_size;
    int eos_token_id;      /* -1: none */
    int n_layers, hidden_size;
    int page_tokens;       /* positions per cache page */
    size_t page_bytes;     /* one page of every paged layer; 0: no paged state */
    size_t slot_bytes;     /* one slot of every recurrent layer */
    int batch_rows;        /* rows one batched decode pass takes; more take several passes */
    int ahead_rows;        /* most rows of a greedy step run ahead (0: the model cannot) */
    bool backend_queues;   /* the backend queues its work (only then does running ahead pay) */
    bool multi_seq;        /* every layer decodes one row for each of many sequences in one pass */
    bool layered_prefill;  /* prefill parts take mt_batch_part.layers */
    int layered_units;     /* what mt_batch_part.layers counts through the model: n_layers, or
                            * (1 + parts) x n_layers with mt_model_params.layered_sites */
    bool rollback;         /* seq_keep drops the rejected rows of a verify */
    bool has_drafter;      /* draft is offered (params.mtp and a drafter in the checkpoint) */
    int verify_seqs;       /* verify parts one forward takes at most, beside one-row decode parts
                            * (each seq_keep'd after it); 0 without a drafter */
    int tp_rank, tp_size;  /* the shard this process holds */
} mt_model_info;

typedef struct mt_pool_stats {
    int pages_free, pages_total;
    int slots_free, slots_total;
} mt_pool_stats;

/* One part of a batch plan: n tokens of one sequence.
 *   MT_PART_PREFILL: a prompt chunk (any n >= 1, run in prefill_chunk passes);
 *   MT_PART_DECODE: k = n >= 1 decode rows (k > 1: a speculative verify of k tokens). The
 *   decode parts of one row each go through the model together in one batched pass when the
 *   model is multi_seq.
 * logits (host) when not NULL: [n, vocab] when all_logits, else the last row's [vocab].
 * argmax (host) when not NULL: the greedy token of each of the n rows, taken where the logits are
 * (decode parts only). */
typedef enum mt_part_kind { MT_PART_PREFILL, MT_PART_DECODE } mt_part_kind;

typedef struct mt_batch_part {
    mt_part_kind kind;
    mt_seq *seq;
    const int32_t *tokens; /* host [n] */
    int n;
    float *logits;
    bool all_logits;
    int32_t *argmax;
    /* MT_PART_PREFILL on a model with layered_prefill: the chunk runs this many more layers (or
     * sites, mt_model_params.layered_sites) in this call (0: all that remain). A chunk that has
     * not reached the last layer is in flight: each later call passes the same part again
     * (tokens, n, logits), after the batch's other parts, until the call that reaches the last
     * layer completes it (its length, logits and drafter follow then); the parts in flight share
     * one range of layers, one group at a time; such a call fits one prefill_chunk pass. Its
     * sequence takes no other part meanwhile, and freeing it drops it from the group. */
    int layers;
} mt_batch_part;

typedef struct mt_batch {
    const mt_batch_part *parts;
    int n_parts;
} mt_batch;

typedef struct mt_model_ops {
    void (*destroy)(mt_model *m);
    void (*describe)(const mt_model *m, mt_model_info *out);

    /* ---- state pools ---- */
    /* Sizes the pools (no sequence may be alive): n_pages cache pages, n_slots recurrent slots. */
    mt_status (*set_pools)(mt_model *m, int n_pages, int n_slots, mt_error *err);
    /* Makes the default pools when none are made yet. */
    mt_status (*ensure_pools)(mt_model *m, mt_error *err);
    void (*pool_stats)(const mt_model *m, mt_pool_stats *out);
    /* Pool memory a sequence of max_tokens positions holds at most. */
    size_t (*seq_bytes_max)(const mt_model *m, int max_tokens);

    /* ---- sequences ---- */
    /* A sequence of at most max_tokens positions: takes a slot (MT_ERR_FULL when none is free). */
    mt_status (*seq_new)(mt_model *m, int max_tokens, mt_seq **out, mt_error *err);
    void (*seq_free)(mt_seq *s); /* NULL ok */
    /* Maps pages for n more positions; MT_ERR_FULL, with nothing changed, when short. */
    mt_status (*seq_reserve)(mt_seq *s, int n, mt_error *err);
    int (*seq_len)(const mt_seq *s);
    size_t (*seq_bytes)(const mt_seq *s); /* pool memory it holds now; 0 for NULL */
    /* The cache pages s maps, in block order: *pages points at the ids (valid until s next
     * changes); returns how many. Shared pages appear in every sequence that maps them. */
    int (*seq_pages)(const mt_seq *s, const int32_t **pages);
    /* dst, fresh, continues exactly where src is (prefix reuse). On error dst must be freed. */
    mt_status (*seq_copy_prefix)(mt_model *m, const mt_seq *src, mt_seq *dst, mt_error *err);

    /* ---- compute ---- */
    /* Runs every part of the plan: the one-row decode parts together, then the verify parts,
     * then the prefill parts (a model may run them all in one pass). A part refused for its
     * input (a bad token, no room, a sequence twice among the decode rows) leaves the parts not
     * yet run unchanged, so a plan of one kind of part is refused whole; the error names the
     * part. A plan of more than one verify (at most info.verify_seqs) that the model cannot run
     * in one pass is refused whole (MT_ERR_UNSUPPORTED): the caller verifies one at a time. */
    mt_status (*forward)(mt_model *m, const mt_batch *b, mt_error *err);
    /* Greedy decode that runs ahead of the host: one token for each of n sequences, the argmax
     * left on the device as the next step's input; tokens NULL takes the last greedy step's
     * outputs as inputs (the same sequences, in order, untouched since). *ticket reads the
     * tokens back with ahead_tokens, waiting for that step only. n <= info.ahead_rows. */
    mt_status (*decode_ahead)(mt_model *m, mt_seq **seqs, const int32_t *tokens, int n, int64_t *ticket,
                              mt_error *err);
    mt_status (*ahead_tokens)(mt_model *m, int64_t ticket, int32_t *out, int n);

    /* ---- speculative decoding (info.has_drafter, info.rollback) ---- */
    /* One token through the drafter: the first call after a target step on s takes the token
     * that follows the step's last row; each further call takes the token drafted from the last
     * call's logits (the drafter's own state stands in for the target's). logits (host) [vocab]. */
    mt_status (*draft)(mt_model *m, mt_seq *s, int32_t token, float *logits, mt_error *err);
    /* Optional (NULL: draft one at a time): draft for n distinct sequences in one pass, row i
     * seqs[i] from tokens[i], logits (host) [n, vocab], or with logits NULL only each row's
     * greedy token into argmax (host) [n] (taken where the logits are). n <= info.batch_rows.
     * Refused (nothing changed) when any row would be. */
    mt_status (*draft_rows)(mt_model *m, mt_seq **seqs, const int32_t *tokens, int n, float *logits,
                            int32_t *argmax, mt_error *err);
    /* After a decode part of k rows of s (a verify), keeps its first keep rows (1 <= keep <= k):
     * the others leave no trace in any layer's state or the drafter's. */
    mt_status (*seq_keep)(mt_model *m, mt_seq *s, int keep, mt_error *err);
    /* Optional (NULL: seq_keep one at a time): seq_keep for n distinct sequences, in order, at
     * once. *done of them kept; on an error the first *done are kept and seqs[*done] is
     * unchanged. */
    mt_status (*seq_keep_rows)(mt_model *m, mt_seq **seqs, const int *keeps, int n, int *done, mt_error *err);
} mt_model_ops;

/* The first member of every architecture's model and sequence structs. */
struct mt_model {
    const mt_model_ops *ops;
};
struct mt_seq {
    mt_model *model;
};

/* Loads the checkpoint in dir (config.json and safetensors) with the architecture its model_type
 * names (the registry in model.c), or, for dir "random:PRESET" ("random:PRESET+mtp": with an MTP
 * block), a model of that preset's shapes with random weights made on the backend (benchmarks).
 * On error *out is NULL and err says why. */
mt_status mt_model_load(const char *dir, mt_backend *be, const mt_model_params *params, mt_model **out,
                        mt_error *err);

static inline void mt_model_free(mt_model *m) {
    if (m) m->ops->destroy(m);
}
static inline mt_model_info mt_model_describe(const mt_model *m) {
    mt_model_info i;
    m->ops->describe(m, &i);
    return i;
}
static inline mt_pool_stats mt_model_pool_stats(const mt_model *m) {
    mt_pool_stats p;
    m->ops->pool_stats(m, &p);
    return p;
}
static inline mt_status mt_model_set_pools(mt_model *m, int n_pages, int n_slots, mt_error *err) {
    return m->ops->set_pools(m, n_pages, n_slots, err);
}
static inline mt_status mt_model_ensure_pools(mt_model *m, mt_error *err) { return m->ops->ensure_pools(m, err); }
static inline size_t mt_model_seq_bytes_max(const mt_model *m, int max_tokens) {
    return m->ops->seq_bytes_max(m, max_tokens);
}
static inline mt_status mt_seq_new(mt_model *m, int max_tokens, mt_seq **out, mt_error *err) {
    return m->ops->seq_new(m, max_tokens, out, err);
}
static inline void mt_seq_free(mt_seq *s) {
    if (s) s->model->ops->seq_free(s);
}
static inline mt_status mt_seq_reserve(mt_seq *s, int n, mt_error *err) { return s->model->ops->seq_reserve(s, n, err); }
static inline int mt_seq_len(const mt_seq *s) { return s->model->ops->seq_len(s); }
static inline size_t mt_seq_bytes(const mt_seq *s) { return s ? s->model->ops->seq_bytes(s) : 0; }
static inline int mt_seq_pages(const mt_seq *s, const int32_t **pages) { return s->model->ops->seq_pages(s, pages); }
static inline mt_status mt_seq_copy_prefix(mt_model *m, const mt_seq *src, mt_seq *dst, mt_error *err) {
    return m->ops->seq_copy_prefix(m, src, dst, err);
}
static inline mt_status mt_model_forward(mt_model *m, const mt_batch *b, mt_error *err) {
    return m->ops->forward(m, b, err);
}
static inline mt_status mt_model_decode_ahead(mt_model *m, mt_seq **seqs, const int32_t *tokens, int n,
                                              int64_t *ticket, mt_error *err) {
    return m->ops->decode_ahead(m, seqs, tokens, n, ticket, err);
}
static inline mt_status mt_model_ahead_tokens(mt_model *m, int64_t ticket, int32_t *out, int n) {
    return m->ops->ahead_tokens(m, ticket, out, n);
}
static inline mt_status mt_model_draft(mt_model *m, mt_seq *s, int32_t token, float *logits, mt_error *err) {
    return m->ops->draft(m, s, token, logits, err);
}
static inline mt_status mt_model_draft_rows(mt_model *m, mt_seq **seqs, const int32_t *tokens, int n, float *logits,
                                            int32_t *argmax, mt_error *err) {
    if (!m->ops->draft_rows) return mt_errorf(err, MT_ERR_UNSUPPORTED, "the model drafts one sequence at a time");
    return m->ops->draft_rows(m, seqs, tokens, n, logits, argmax, err);
}
static inline mt_status mt_seq_keep(mt_model *m, mt_seq *s, int keep, mt_error *err) {
    return m->ops->seq_keep(m, s, keep, err);
}
static inline mt_status mt_seq_keep_rows(mt_model *m, mt_seq **seqs, const int *keeps, int n, int *done,
                                         mt_error *err) {
    *done = 0;
    if (m->ops->seq_keep_rows) return m->ops->seq_keep_rows(m, seqs, keeps, n, done, err);
    for (; *done < n; (*done)++) {
        mt_status st = m->ops->seq_keep(m, seqs[*done], keeps[*done], err);
        if (st != MT_OK) return st;
    }
    return MT_OK;
}

#ifdef __cplusplus
}
#endif
#endif /* MT_MODEL_H */
