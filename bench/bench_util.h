/* bench/bench_util.h: what the GPU benchmarks share: the device copy bandwidth (the reference
 * ceiling every floor is measured against), the bytes of the model's weights by kind and by how a
 * tensor-parallel group splits them, the bytes one rank must read a decode step, and the
 * tensor-parallel group of a run (--tp N: one process per GPU, every rank running the same
 * benchmark code) with the collectives of a step timed alone. */
#ifndef MT_BENCH_UTIL_H
#define MT_BENCH_UTIL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/mt.h"

#include "kernels/cuda/cuda_backend.h"
#include "worker/loader/glm_config.h"

/* cudaMemcpy device-to-device of 4 GiB on the calling thread's current GPU, 10 times after a
 * warm-up: (read + write) GB/s; 0 when the buffers cannot be allocated. */
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
/* The same for the model as an FP8 checkpoint runs on the GPU (decode_bench --fp8): the tensors it
 * keeps in FP8 (bench_tensor_is_fp8) at one byte a weight plus a 4-byte scale a 128 x 128 block,
 * the bytes the FP8 kernels read of them; the rest at their dtype. Parameters as above. */
void bench_count_weights_fp8(const glm_config *c, bench_weights *out);
/* Whether the manifest tensor `name` stays FP8 on the GPU when its checkpoint is FP8 (the KDA and
 * DSA projections but kv_b and the gates, every MLP's and expert's gate, up and down). */
bool bench_tensor_is_fp8(const char *name);

/* Routed experts of one MoE layer that n tokens touch, expected under uniform routing:
 * E (1 - (1 - top_k / E)^n). */
double bench_experts_touched(const glm_config *c, int n);

/* The reference for a prefill of n tokens: cuBLAS alone (cublasGemmEx, bf16 in, fp32 out and
 * accumulation) on the GEMMs the prefill's linear weights make, each at its own shape: [n, in] x
 * [in, out] for every dense weight, lm_head for one row, and each routed expert of each MoE layer
 * at ceil(n top_k / E) rows (its share under uniform routing). Weights are cycled through copies
 * larger than L2 together, so each GEMM reads its weight from HBM as the model's do. Returns the
 * summed GEMM time in ms on the current GPU and sets *flops to their FLOPs; < 0 when cuBLAS fails.
 * Weights that are not bf16 are left out. */
double bench_cublas_prefill_ms(const glm_config *c, int n, double *flops);
/* The same shapes on cuBLASLt's block-scaled FP8 GEMM as the CUDA backend calls it for FP8 weights
 * (kernels/cuda/cuda_fp8.cu: e4m3 weight with 128 x 128 block scales, e4m3 x with 1 x 128 scales,
 * fp32 accumulation; dimensions padded as the backend pads them), zero data and unit scales; the
 * activations' quantisation is not counted. FLOPs counted on the unpadded shapes. < 0 when
 * cuBLASLt has no algorithm for a shape or fails. */
double bench_cublaslt_fp8_prefill_ms(const glm_config *c, int n, double *flops);

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

/* ---- the tensor-parallel group of a run ---- */

struct mt_comm;
struct mt_backend;

/* One rank of a run. Without a group (no --tp): rank 0 of 1, host and comm NULL. */
typedef struct bench_rank {
    int rank, size;           /* this process and the ranks of its group */
    struct mt_backend *be;    /* the CUDA backend on GPU `rank` */
    struct mt_comm *host;     /* the ranks' host communicator (barriers, rank 0's decisions) */
    struct mt_comm *comm;     /* the NCCL communicator, for glm_model_params.comm */
} bench_rank;

typedef int (*bench_rank_fn)(bench_rank *r, void *user);

/* Runs fn once in every rank of a run and returns 0 when every rank succeeded, else the exit
 * status of the first rank that failed.
 *   tp 0: no group: fn runs in this process on a CUDA backend of GPU 0, with no communicator.
 *   tp >= 1: a group of tp ranks, rank r on GPU r: tp 1 runs in this process (so profilers see
 *     one), more are forked, one process each, before any CUDA call (a CUDA context does not
 *     survive a fork: the caller must not have made one). Each rank joins a host communicator
 *     (worker/dist/comm_host.h, a random group name), refuses tp above the visible GPUs (counted
 *     first by the launcher in a child of its own, then by each rank), takes the
 *     NCCL id rank 0 makes and hands out over it, makes its CUDA backend (params cp) and its NCCL
 *     communicator, runs fn, and after fn succeeds waits for every rank before freeing them.
 *     Ranks above 0 write nothing to stdout (it is /dev/null) and log warnings and errors only.
 *     When a rank fails the others are ended (SIGTERM), so a group does not hang on a dead peer.
 * fn must free every model and graph it made before it returns (they hold the communicator's
 * resources). prog names the program in messages. */
int bench_run_ranks(const char *prog, int tp, const mt_cuda_params *cp, bench_rank_fn fn, void *user);

/* The start of a timed region: drains this rank's stream, then waits for every rank, so all the
 * ranks enter it together and rank 0's clock times the group. (Its end needs nothing more: rank 0
 * drains its stream, whose last collective completes only once every rank has reached it.)
 * Without a group: the drain only. Exits the program when the group fails. */
void bench_sync(const bench_rank *r);

/* Gives every rank rank 0's bytes of buf: for host decisions taken from timings (which differ by
 * rank), so every rank makes the same calls. Nothing without a group. Exits when the group fails. */
void bench_agree(const bench_rank *r, void *buf, size_t bytes);

/* The collectives of one batched decode step (glm_decode_multi, the rows form) timed alone: the
 * calls the model makes for a pass of rows rows, with the same sizes and in the same order,
 * for each of n_pass passes (rows[n_pass]: rows a pass runs, the bucket's on a graph replay):
 * with tp > 1 the embedding's all-reduce (rows x hc_mult x hidden, glm_model.c embed_reduce), then
 * two all-reduces a layer (rows x hidden: the mixer's and the MLP's, glm_layer.c), then the
 * head's all-gather (rows x vocab / tp a rank, glm_gather_logits); with one rank only the layers'.
 * They are run eagerly twice (NCCL sets up its connections outside a capture), captured into a
 * CUDA graph of their own on the backend's stream, and replayed: ms a replay, the median of 5
 * rounds of 20 replays back to back between two events on rank 0. Not included: the waits on
 * other ranks' compute that the collectives of a real step also absorb, and the head's
 * re-layout copies. *calls: the collectives a step makes. -1 without a communicator, or when the
 * capture failed on some rank. Exits when the group fails. */
double bench_comm_step_ms(const bench_rank *r, const glm_config *c, const int *rows, int n_pass, int *calls);

/* steps batched decode steps of the B sequences s, greedy on the device as the engine does for
 * plain greedy requests (glm_decode_multi, then glm_last_argmax; tok[B] carries the tokens); ms
 * per step, rank 0's, from bench_sync to the stream drained after the last. Exits the program on
 * an error. */
struct glm_model;
struct glm_seq;
double bench_decode_steps(const bench_rank *r, struct glm_model *m, struct glm_seq **s, int32_t *tok, int B,
                          int steps);
/* The same steps run ahead, as the engine runs greedy batches (glm_decode_greedy: step k + 1 is
 * queued on step k's device tokens before the host reads them); bench_decode_steps where the
 * model cannot (more rows than glm_model_ahead_rows, which is 0 on more than one rank). */
double bench_decode_ahead(const bench_rank *r, struct glm_model *m, struct glm_seq **s, int32_t *tok, int B,
                          int steps);

/* Whether argv holds the flag `name` (no value); every occurrence is taken out of argv and *argc. */
bool bench_take_flag(int *argc, char **argv, const char *name);

/* "1,8,64" into out[max] (atoi of each item; items past max are dropped); returns how many. */
int bench_parse_ints(const char *s, int *out, int max);

#endif /* MT_BENCH_UTIL_H */
