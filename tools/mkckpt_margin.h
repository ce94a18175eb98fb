/* tools/mkckpt_margin.h: margin models (mkckpt --margin). Shapes a freshly written random
 * checkpoint so that every top-k choice of the router and the DSA indexer, on a set of
 * deterministic prompts run on the CPU backend (prefill, then greedy decode), has its k-th and
 * (k+1)-th candidates at least a stated gap apart, then certifies it with the CPU backend's gap
 * recorder (kernels/backend.h, mt_cpu_gaps_*) and writes DIR/margin.json.
 *
 * How (docs/DESIGN.md, "Margin models"):
 *   - router: the correction bias is set in three tiers per MoE layer (chosen experts, the rest
 *     of the kept groups, the other groups) spaced by more than 1 + gap, so that no sigmoid score
 *     (in (0, 1)) can bring two tiers within the gap: every token of every prompt takes the same
 *     groups and experts, by at least the gap, whatever the input. The gate weights are kept, so
 *     the mixing weights still follow the token.
 *   - indexer: its weights act on the model only through the pools it selects. Each round runs the
 *     prompts, records every non-forced selection (queries, head weights, candidate pool keys),
 *     and searches for a head mix A [ih, ih] on weights_proj and a per-head query map T_h [id, id]
 *     on wq_b that keep each recorded selection while widening its boundary to the gap; the
 *     outputs, and so the greedy tokens, stay as they were unless a selection moved. The next run
 *     certifies or starts another round.
 *
 * Owner: the mkckpt tool; single-threaded use (the CPU backend threads inside). */
#ifndef MT_MKCKPT_MARGIN_H
#define MT_MKCKPT_MARGIN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/mt.h"
#include "kernels/backend.h"
#include "worker/loader/glm_config.h"

typedef struct ckm_params {
    double gap;       /* smallest k-th minus (k+1)-th gap wanted: router scores in absolute terms,
                         indexer pool scores relative to the query's largest |score|; > 0 */
    int prompts;      /* deterministic prompts (default 10) */
    int len;          /* greedy tokens generated after each prompt (default 64) */
    int rounds;       /* indexer shaping rounds before giving up (default 6) */
    uint64_t seed;    /* prompts and tiers derive from it */
    int threads;      /* CPU backend threads; <= 0: all cores */
} ckm_params;

ckm_params ckm_default_params(void);

/* The checkpoint being written, as the shaping sees it. read: the current values of tensor name
 * (as stored, widened to fp32) into out[n]; MT_ERR_NOT_FOUND when the checkpoint has no such
 * tensor. replace: new values for it (rounded to its stored dtype when saved). save: rewrites the
 * checkpoint files with every replacement so far. */
typedef struct ckm_ckpt {
    void *user;
    mt_status (*read)(void *user, const char *name, float *out, size_t n, mt_error *err);
    mt_status (*replace)(void *user, const char *name, const float *vals, size_t n, mt_error *err);
    mt_status (*save)(void *user, mt_error *err);
} ckm_ckpt;

typedef struct ckm_result {
    bool certified;     /* every recorded gap >= gap on the last run */
    mt_cpu_gaps gaps;   /* the last run's smallest gaps (INFINITY: no such choice was made) */
    int runs;           /* model runs made */
    int prompt_len;     /* tokens in each prompt */
} ckm_result;

/* Shapes the checkpoint in dir (whose config is cfg) through ck, runs and certifies it, and writes
 * dir/margin.json (also when not certified). MT_OK with res->certified false when the rounds ran
 * out; an error status (err says why) when the model cannot be loaded or run or a file written. */
mt_status ckm_shape(const char *dir, const glm_config *cfg, const ckm_params *p, const ckm_ckpt *ck,
                    ckm_result *res, mt_error *err);

#endif /* MT_MKCKPT_MARGIN_H */
