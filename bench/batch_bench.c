/* bench/batch_bench.c: the batched decode-throughput benchmark. In one run on one GPU: the device
 * copy bandwidth (the reference), then bench-4L (real per-layer shapes, random bf16 weights made
 * on the GPU) decoding B sequences at once through glm_decode_multi, for each batch size B:
 *   - tokens/s with the bucket graphs, and eagerly, greedy on the device and run ahead as the
 *     engine runs greedy batches (glm_decode_greedy: step k + 1 queued before token k is read);
 *   - the bytes a step must read: every dense weight, B embedding rows, the routed experts the
 *     batch touches (counted from the routing of a census step, glm_model_set_expert_census),
 *     each sequence's KDA state (read and written) and the DSA cache rows it attends or scores;
 *   - the floor (bytes / copy bandwidth) and the fraction of it reached.
 * Prints one table and writes it as JSON (--json FILE).
 *
 *   batch_bench [--batches 1,8,32,64,128] [--prompt 256] [--steps 16] [--json FILE] [--op-profile 1]
 *               [--graph-max-rows N]  (bucket graphs up to N rows; the model's default is 64)
 *               [--moe-grouped-max N] (the grouped MoE decode kernels up to N rows, beyond which
 *                                      the MoE reads the routing back and a step is no graph;
 *                                      mt_cuda_params.moe_grouped_max_rows, default 64)
 *               [--numerics exact|bf16|fp32] (the CUDA backend's; default exact)
 * (--op-profile 1: per-op times of one more eager step of each batch, every op synchronised.)
 */
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/bench_util.h"
#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "worker/loader/glm_config.h"
#include "worker/model/glm/glm_model.h"

#define MAX_BATCHES 16

typedef struct batch_result {
    int B;
    double touched;        /* (layer, expert) pairs the census step touched */
    double bytes, floor_ms, graph_ms, eager_ms;
    int graphed;
} batch_result;

static int parse_list(const char *s, int *out, int max) {
    int n = 0;
    while (*s && n < max) {
        out[n++] = atoi(s);
        const char *c = strchr(s, ',');
        if (!c) break;
        s = c + 1;
    }
    return n;
}

/* Bytes one decode step of B sequences at length len must read (see the header). */
static double step_bytes(const glm_config *c, const bench_weights *w, int B, double touched, int len) {
    double kda = 0, dsa = 0;
    const int max_sel = c->index_topk + (c->index_kpool_always_select_tail ? c->index_kpool - 1 : 0);
    for (int l = 0; l < c->num_hidden_layers; l++) {
        if (c->layer_types[l] == GLM_MIXER_KDA) {
            kda += 2.0 * c->linear_num_heads * (double)c->linear_head_dim * c->linear_head_dim * 4;
        } else {
            const int rows = len + 1 < max_sel ? len + 1 : max_sel;
            dsa += (double)rows * c->kv_lora_rank * 4;                             /* attended latent rows */
            if (c->indexer_types[l] == GLM_INDEXER_FULL)
                dsa += (double)((len + 1) / c->index_kpool) * c->index_head_dim * 4; /* pool keys scored */
        }
    }
    return w->dense_bytes + B * w->embed_row_bytes + touched * w->expert_bytes + B * (kda + dsa);
}


int main(int argc, char **argv) {
    int batches[MAX_BATCHES] = { 1, 8, 32, 64, 128 }, nb = 5, prompt = 256, steps = 16, op_profile = 0, graph_max = 0;
    const char *json = NULL;
    mt_cuda_params cp = mt_cuda_default_params();
    bool nccl = false; /* --nccl (no value): the layers' all-reduces through a one-rank NCCL communicator */
    for (int i = 1, k = 1; i <= argc; i++) { /* takes --nccl out of argv */
        if (i < argc && !strcmp(argv[i], "--nccl")) nccl = true;
        else argv[k++] = argv[i];
        if (i == argc) argc = k - 1;
    }
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--batches")) nb = parse_list(argv[i + 1], batches, MAX_BATCHES);
        else if (!strcmp(argv[i], "--prompt")) prompt = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--steps")) steps = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--json")) json = argv[i + 1];
        else if (!strcmp(argv[i], "--op-profile")) op_profile = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--graph-max-rows")) graph_max = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--moe-grouped-max")) cp.moe_grouped_max_rows = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--numerics")) {
            if (!mt_numerics_parse(argv[i + 1], &cp.numerics)) {
                fprintf(stderr, "batch_bench: --numerics must be exact, bf16 or fp32, got %s\n", argv[i + 1]);
                return 2;
            }
        }
        else { fprintf(stderr, "batch_bench: unknown option %s\n", argv[i]); return 2; }
    }
    mt_error err = { "" };
    mt_backend *be = mt_cuda_backend_new(0, &cp, &err);
    if (!be) { fprintf(stderr, "batch_bench: %s\n", err.msg); return 1; }
    const double bw = bench_copy_bandwidth_gbs();
    glm_config c;
    if (glm_config_preset("bench-4L", &c, &err) != MT_OK) { fprintf(stderr, "%s\n", err.msg); return 1; }
    bench_weights w;
    bench_count_weights(&c, &w);
    glm_model_params mp = glm_model_default_params(); /* 256 scratch rows: batches up to 256 */
    if (nccl && !(mp.comm = bench_nccl_one_rank(be, &err))) { fprintf(stderr, "batch_bench: %s\n", err.msg); return 1; }
    if (nccl) printf("the layers' partial sums go through a one-rank NCCL communicator (--nccl)\n");
    if (graph_max > 0) mp.graph_max_rows = graph_max;
    glm_model *m = NULL;
    if (glm_model_new_random(&c, 1, be, &mp, &m, &err) != MT_OK) { fprintf(stderr, "%s\n", err.msg); return 1; }
    const int V = c.vocab_size;
    int bmax = 1;
    for (int k = 0; k < nb; k++) bmax = batches[k] > bmax ? batches[k] : bmax;
    { /* pools for the largest batch at its full length, and the graph pad */
        const int page = glm_model_page_tokens(m), len = prompt + 3 * steps + 16;
        if (glm_model_set_pools(m, (bmax + 1) * ((len + page - 1) / page) + 1, bmax + 2, &err) != MT_OK) {
            fprintf(stderr, "batch_bench: %s\n", err.msg);
            return 1;
        }
    }

    batch_result res[MAX_BATCHES];
    for (int k = 0; k < nb; k++) {
        const int B = batches[k];
        glm_seq **s = calloc((size_t)B, sizeof *s);
        int32_t *tok = malloc(sizeof(int32_t) * (size_t)B), *ptoks = malloc(sizeof(int32_t) * (size_t)prompt);
        float *logits = malloc(sizeof(float) * (size_t)B * V);
        if (!s || !tok || !ptoks || !logits) { fprintf(stderr, "batch_bench: out of memory\n"); return 1; }
        for (int b = 0; b < B; b++) { /* distinct prompts, so the rows route differently */
            for (int i = 0; i < prompt; i++) ptoks[i] = (int32_t)(((unsigned)(i + 1) * 7919u + (unsigned)b * 104729u) % (unsigned)V);
            if (glm_seq_new(m, prompt + 3 * steps + 16, &s[b], &err) != MT_OK ||
                glm_prefill(m, s[b], ptoks, prompt, logits, false, &err) != MT_OK) {
                fprintf(stderr, "batch_bench: %s\n", err.msg);
                return 1;
            }
            tok[b] = glm_argmax(logits, V);
        }
        /* census step (eager), then eager timing, then graphs: one eager step sizes the bucket, the
         * next captures it */
        glm_model_set_decode_graphs(m, false);
        glm_model_set_expert_census(m, true);
        bench_decode_steps(be, m, s, tok, B, 1);
        res[k].touched = glm_model_expert_census(m);
        glm_model_set_expert_census(m, false);
        res[k].eager_ms = bench_decode_ahead(be, m, s, tok, B, steps);
        glm_model_set_decode_graphs(m, true);
        bench_decode_steps(be, m, s, tok, B, 2);
        res[k].graphed = glm_model_has_bucket_graph(m, B);
        res[k].graph_ms = bench_decode_ahead(be, m, s, tok, B, steps);
        res[k].B = B;
        if (op_profile) {
            char title[64];
            snprintf(title, sizeof title, "eager decode step of %d sequences", B);
            glm_model_set_decode_graphs(m, false);
            mt_cuda_profile(be, true, title);
            bench_decode_steps(be, m, s, tok, B, 1);
            mt_cuda_profile(be, false, title);
        }
        res[k].bytes = step_bytes(&c, &w, B, res[k].touched, prompt + steps + 3);
        res[k].floor_ms = res[k].bytes / (bw * 1e9) * 1e3;
        for (int b = 0; b < B; b++) glm_seq_free(s[b]);
        free(s);
        free(tok);
        free(ptoks);
        free(logits);
    }

    printf("metrale batch_bench: bench-4L batched decode (glm_decode_greedy, run ahead), prompts of %d tokens, CUDA backend\n", prompt);
    printf("device copy bandwidth %.0f GB/s (cudaMemcpy D2D, read + write), same run\n", bw);
    printf("| batch | experts touched | bytes/step | floor ms | graph ms | tok/s (graph) | of floor | eager ms | tok/s (eager) |\n");
    printf("|------:|----------------:|-----------:|---------:|---------:|--------------:|---------:|---------:|--------------:|\n");
    for (int k = 0; k < nb; k++) {
        const batch_result *r = &res[k];
        printf("| %5d | %15.0f | %7.2f GB | %8.3f | %7.3f%s | %13.0f | %7.1f%% | %8.3f | %13.0f |\n", r->B, r->touched,
               r->bytes / 1e9, r->floor_ms, r->graph_ms, r->graphed ? " " : "*", r->B * 1e3 / r->graph_ms,
               100 * r->floor_ms / r->graph_ms, r->eager_ms, r->B * 1e3 / r->eager_ms);
    }
    printf("(* no bucket graph was captured for this batch: the graph column ran eagerly)\n");
    if (json) {
        FILE *f = fopen(json, "w");
        if (f) {
            fprintf(f, "{\"copy_bandwidth_gbs\": %.1f, \"prompt\": %d, \"steps\": %d, \"batches\": [", bw, prompt, steps);
            for (int k = 0; k < nb; k++) {
                const batch_result *r = &res[k];
                fprintf(f, "%s{\"batch\": %d, \"experts_touched\": %.0f, \"step_bytes\": %.0f, \"floor_ms\": %.4f, "
                           "\"graph_ms\": %.4f, \"graphed\": %s, \"graph_tok_s\": %.1f, \"graph_fraction_of_floor\": %.4f, "
                           "\"eager_ms\": %.4f, \"eager_tok_s\": %.1f}",
                        k ? ", " : "", r->B, r->touched, r->bytes, r->floor_ms, r->graph_ms, r->graphed ? "true" : "false",
                        r->B * 1e3 / r->graph_ms, r->floor_ms / r->graph_ms, r->eager_ms, r->B * 1e3 / r->eager_ms);
            }
            fprintf(f, "]}\n");
            fclose(f);
        }
    }
    glm_model_free(m);
    mt_backend_free(be);
    return 0;
}
