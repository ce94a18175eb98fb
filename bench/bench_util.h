/* bench/bench_util.h: what the GPU benchmarks share: the device copy bandwidth (the reference
 * ceiling every floor is measured against), the bytes of the model's weights by kind and by how a
 * tensor-parallel group splits them, and the bytes one rank must read a decode step. */
#ifndef MT_BENCH_UTIL_H
#define MT_BENCH_UTIL_H

#include <stdbool.h>
#include <stdint.h>

#include "common/mt.h"

#include "worker/loader/glm_config.h"

/* cudaMemcpy device-to-device of 4 GiB, 10 times after a warm-up: (read + write) GB/s; 0 when the
 * buffers cannot be allocated. */
double bench_copy_bandwidth_gbs(void);

/* Bytes and parameters of the manifest of c, by kind, and by how a tensor-parallel group of N
 * ranks holds them (worker/model/glm/glm_shard.c, bound in glm_weights.c):
 *   split (each rank holds and reads 1/N): KDA q/k/v projections and convolutions, f_b, g_b, b,
 *     dt_bias, A_log (its heads); MLA q_b and kv_b (its query heads); every o_proj (those heads'
 *     input columns); gate/up/down of the dense MLP, the shared expert and every routed expert
 *     (the intermediate); the embedding and lm_head (vocab rows);
 *   replicated (every rank holds them whole): hyper-connections (hc_*), every norm, KDA f_a, g_a
 *     and o_norm, MLA q_a and kv_a (the latent projections), the DSA indexer, the MoE router and
 *     its bias.
 * All figures are sums of whole bytes (exact in a double). */
typedef struct bench_weights {
    double dense_bytes;       /* every tensor but the routed experts and the embedding */
    double dense_split_bytes; /* of dense_bytes: the split ones (lm_head among them) */
    double dense_repl_bytes;  /* of dense_bytes: the replicated ones */
    double expert_bytes;      /* one routed expert of one layer (gate + up + down; split) */
    double embed_row_bytes;   /* one embedding row (split by rows) */
    double split_bytes;       /* the whole manifest's split tensors, experts and embedding included */
    double replicated_bytes;  /* the whole manifest's replicated tensors */
    double touched_params;    /* parameters one token touches (top_k experts, no embedding): FLOPs / 2 */
    double head_params;       /* lm_head's parameters (within touched_params; 0 when tied) */
} bench_weights;

void bench_count_weights(const glm_config *c, bench_weights *out);

/* Whether the manifest tensor `name` is split across a tensor-parallel group (the list above). */
bool bench_tensor_is_split(const char *name);

/* One sequence's KDA recurrent state over every KDA layer, read and written ([nh, dk, dk] fp32 a
 * layer, twice): what a decode step moves for it. */
double bench_kda_state_bytes(const glm_config *c);

/* The DSA cache one decode row at length len reads over every DSA layer: the latent rows it
 * attends (the indexer's selection, at most index_topk plus the tail) and, where the layer has
 * its own indexer, the pool keys it scores. */
double bench_dsa_cache_bytes(const glm_config *c, int len);

/* The bytes one rank of a group of tp must read for one decode step of B rows: its 1/tp of the
 * split weights the step touches (the dense ones, B embedding rows, the experts_touched (layer,
 * expert) pairs), the replicated weights whole, 1/tp of each row's KDA state (kda_row: whole, as
 * bench_kda_state_bytes; a rank keeps its heads' state) and each row's DSA cache reads whole
 * (dsa_row, as bench_dsa_cache_bytes; the latent and indexer caches are replicated). tp 1 gives
 * the whole model's bytes, the same double as the sum of those terms taken whole. */
double bench_rank_step_bytes(const bench_weights *w, int tp, int B, double experts_touched, double kda_row,
                             double dsa_row);

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
