/* bench/bench_util.h: what the GPU benchmarks share: the device copy bandwidth (the reference
 * ceiling every floor is measured against) and the bytes of the model's weights by kind. */
#ifndef MT_BENCH_UTIL_H
#define MT_BENCH_UTIL_H

#include <stdint.h>

#include "common/mt.h"

#include "worker/loader/glm_config.h"

/* cudaMemcpy device-to-device of 4 GiB, 10 times after a warm-up: (read + write) GB/s; 0 when the
 * buffers cannot be allocated. */
double bench_copy_bandwidth_gbs(void);

/* Bytes and parameters of the manifest of c, by kind. */
typedef struct bench_weights {
    double dense_bytes;    /* every tensor but the routed experts and the embedding */
    double expert_bytes;   /* one routed expert of one layer (gate + up + down) */
    double embed_row_bytes;/* one embedding row */
    double touched_params; /* parameters one token touches (top_k experts, no embedding): FLOPs / 2 */
    double head_params;    /* lm_head's parameters (within touched_params; 0 when tied) */
} bench_weights;

void bench_count_weights(const glm_config *c, bench_weights *out);

/* steps batched decode steps of the B sequences s, greedy on the device as the engine does for
 * plain greedy requests (glm_decode_multi, then glm_last_argmax; tok[B] carries the tokens); ms
 * per step, the backend synchronised before and after. Exits the program on an error. */
struct glm_model;
struct glm_seq;
struct mt_backend;
double bench_decode_steps(struct mt_backend *be, struct glm_model *m, struct glm_seq **s, int32_t *tok, int B,
                          int steps);
/* The same steps run ahead, as the engine runs greedy batches (glm_decode_greedy: step k + 1 is
 * queued on step k's device tokens before the host reads them); bench_decode_steps where the
 * model cannot (more rows than glm_model_ahead_rows). */
double bench_decode_ahead(struct mt_backend *be, struct glm_model *m, struct glm_seq **s, int32_t *tok, int B,
                          int steps);

/* A one-rank NCCL communicator on be (a CUDA backend): the tensor-parallel path of a group of
 * one, for --nccl. NULL on failure (err says why). */
struct mt_comm *bench_nccl_one_rank(struct mt_backend *be, mt_error *err);

#endif /* MT_BENCH_UTIL_H */
