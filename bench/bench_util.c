/* bench/bench_util.c: see bench_util.h. */
#include "bench/bench_util.h"

#include "worker/dist/comm_nccl.h"

#include <cuda_runtime_api.h>
#include <string.h>

#include <stdio.h>
#include <stdlib.h>

#include "kernels/backend.h"
#include "worker/loader/glm_manifest.h"
#include "worker/model/glm/glm_model.h"

double bench_copy_bandwidth_gbs(void) {
    const size_t bytes = (size_t)4 << 30;
    void *a = NULL, *b = NULL;
    if (cudaMalloc(&a, bytes) != cudaSuccess || cudaMalloc(&b, bytes) != cudaSuccess) {
        cudaFree(a);
        return 0;
    }
    cudaMemset(a, 1, bytes);
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice); /* warm-up */
    const int reps = 10;
    cudaEventRecord(e0, 0);
    for (int i = 0; i < reps; i++) cudaMemcpy(i & 1 ? a : b, i & 1 ? b : a, bytes, cudaMemcpyDeviceToDevice);
    cudaEventRecord(e1, 0);
    cudaEventSynchronize(e1);
    float ms = 0;
    cudaEventElapsedTime(&ms, e0, e1);
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    cudaFree(a);
    cudaFree(b);
    return 2.0 * bytes * reps / (ms * 1e-3) / 1e9; /* read + write */
}

/* The split tensors by a part of their names (glm_weights.c's bind_layer, bind_mlp, bind_all). */
static const char *const g_split_parts[] = {
    ".self_attn.q_proj.", ".self_attn.k_proj.", ".self_attn.v_proj.", /* KDA: its heads */
    "_conv1d.", ".f_b_proj.", ".g_b_proj.", ".self_attn.b_proj.", ".dt_bias", ".A_log",
    ".q_b_proj.", ".kv_b_proj.",                                         /* MLA: its query heads */
    ".self_attn.o_proj.",                                                /* those heads' columns */
    "gate_proj.", "up_proj.", "down_proj.",                              /* every MLP's intermediate */
    "embed_tokens", "lm_head",                                           /* vocab rows */
};

bool bench_tensor_is_split(const char *name) {
    for (size_t i = 0; i < sizeof g_split_parts / sizeof g_split_parts[0]; i++)
        if (strstr(name, g_split_parts[i])) return true;
    return false;
}

typedef struct count_ctx {
    const glm_config *c;
    bench_weights *w;
} count_ctx;

static void count_tensor(const glm_tensor_spec *s, void *user) {
    count_ctx *x = user;
    double n = 1;
    for (int i = 0; i < s->ndim; i++) n *= (double)s->shape[i];
    const double bytes = n * (double)mt_dtype_size(s->dtype);
    const bool split = bench_tensor_is_split(s->name);
    if (split) x->w->split_bytes += bytes;
    else x->w->replicated_bytes += bytes;
    if (strstr(s->name, ".mlp.experts.")) {
        /* every (layer, expert) is alike: summed here, divided into one expert's bytes below */
        x->w->touched_params += n * x->c->num_experts_per_tok / x->c->n_routed_experts;
        x->w->expert_bytes += bytes;
    } else if (strstr(s->name, "embed_tokens")) {
        x->w->embed_row_bytes = bytes / (double)s->shape[0];
    } else {
        x->w->dense_bytes += bytes;
        if (split) x->w->dense_split_bytes += bytes;
        else x->w->dense_repl_bytes += bytes;
        x->w->touched_params += n;
        if (strstr(s->name, "lm_head")) x->w->head_params += n;
    }
}

void bench_count_weights(const glm_config *c, bench_weights *out) {
    memset(out, 0, sizeof *out);
    count_ctx x = { c, out };
    glm_manifest_foreach(c, count_tensor, &x);
    int moe_layers = 0;
    for (int l = 0; l < c->num_hidden_layers; l++) moe_layers += c->mlp_layer_types[l] == GLM_MLP_SPARSE;
    if (moe_layers > 0) out->expert_bytes /= (double)moe_layers * c->n_routed_experts;
}

double bench_kda_state_bytes(const glm_config *c) {
    double b = 0;
    for (int l = 0; l < c->num_hidden_layers; l++)
        if (c->layer_types[l] == GLM_MIXER_KDA) b += 2.0 * c->linear_num_heads * (double)c->linear_head_dim * c->linear_head_dim * 4;
    return b;
}

double bench_dsa_cache_bytes(const glm_config *c, int len) {
    double b = 0;
    const int max_sel = c->index_topk + (c->index_kpool_always_select_tail ? c->index_kpool - 1 : 0);
    for (int l = 0; l < c->num_hidden_layers; l++) {
        if (c->layer_types[l] == GLM_MIXER_KDA) continue;
        const int rows = len + 1 < max_sel ? len + 1 : max_sel;
        b += (double)rows * c->kv_lora_rank * 4;                                 /* attended latent rows */
        if (c->indexer_types[l] == GLM_INDEXER_FULL)
            b += (double)((len + 1) / c->index_kpool) * c->index_head_dim * 4; /* pool keys scored */
    }
    return b;
}

double bench_rank_step_bytes(const bench_weights *w, int tp, int B, double experts_touched, double kda_row,
                             double dsa_row) {
    const double N = tp;
    return w->dense_repl_bytes + w->dense_split_bytes / N + B * w->embed_row_bytes / N +
           experts_touched * w->expert_bytes / N + B * (kda_row / N + dsa_row);
}

double bench_decode_ahead(mt_backend *be, glm_model *m, glm_seq **s, int32_t *tok, int B, int steps) {
    if (glm_model_ahead_rows(m) < B || steps < 1) return bench_decode_steps(be, m, s, tok, B, steps);
    mt_error err = { "" };
    int64_t prev = -1, next = -1;
    be->ops->sync(be);
    const double a = mt_now();
    mt_status st = glm_decode_greedy(m, s, tok, B, &prev, &err);
    for (int i = 1; i < steps && st == MT_OK; i++) {
        st = glm_decode_greedy(m, s, NULL, B, &next, &err); /* step i on step i - 1's device tokens */
        if (st == MT_OK) st = glm_greedy_tokens(m, prev, tok, B);
        prev = next;
    }
    if (st == MT_OK) st = glm_greedy_tokens(m, prev, tok, B);
    if (st != MT_OK) {
        fprintf(stderr, "bench: %s\n", err.msg[0] ? err.msg : mt_status_str(st));
        exit(1);
    }
    be->ops->sync(be);
    return (mt_now() - a) * 1e3 / steps;
}

double bench_decode_steps(mt_backend *be, glm_model *m, glm_seq **s, int32_t *tok, int B, int steps) {
    mt_error err = { "" };
    be->ops->sync(be);
    const double a = mt_now();
    for (int i = 0; i < steps; i++)
        if (glm_decode_multi(m, s, tok, B, NULL, &err) != MT_OK || glm_last_argmax(m, B, tok) != MT_OK) {
            fprintf(stderr, "bench: %s\n", err.msg);
            exit(1);
        }
    be->ops->sync(be);
    return (mt_now() - a) * 1e3 / steps;
}

struct mt_comm *bench_nccl_one_rank(struct mt_backend *be, mt_error *err) {
    char hex[MT_COMM_NCCL_ID_HEX];
    mt_comm_nccl_id id;
    if (mt_comm_nccl_id_new(hex, sizeof hex, err) != MT_OK || mt_comm_nccl_id_parse(hex, &id, err) != MT_OK) return NULL;
    return mt_comm_nccl_new(&id, 0, 1, be, NULL, err);
}
