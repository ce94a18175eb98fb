/* bench/batch_bench.c: the batched decode-throughput benchmark. In one run on one GPU: the device
 * copy bandwidth (the reference), then bench-4L (real per-layer shapes, random bf16 weights made
 * on the GPU) decoding B sequences at once through glm_decode_multi, for each batch size B:
 *   - tokens/s with the bucket graphs, and eagerly, greedy on the device and run ahead as the
 *     engine runs greedy batches (glm_decode_greedy: step k + 1 queued before token k is read);
 *   - the bytes a step must read: every dense weight, B embedding rows, the routed experts the
 *     batch touches (counted from the routing of a census step, glm_model_set_expert_census),
 *     each sequence's KDA state (read and written) and the DSA cache rows it attends or scores;
 *   - the floor (bytes / copy bandwidth) and the fraction of it reached;
 *   - from the census step's routing, the (row, slot) pairs per touched expert and the passes the
 *     grouped decode experts make beyond each expert's first (each reads its weights again).
 * Prints the tables and writes the first as JSON (--json FILE).
 *
 * --tp N: the model tensor-parallel over N GPUs (bench_run_ranks: N processes, rank r on GPU r,
 * an NCCL communicator; --nccl is --tp 1, the group's path on one GPU). Every rank runs the same
 * calls; rank 0 times, prints and writes the JSON. The bytes and the floor are then one rank's
 * (bench_rank_step_bytes: 1/N of the split weights, of the touched experts' slices and of the KDA
 * state, the replicated weights and the DSA cache reads whole; the whole model's at N = 1) over
 * rank 0's copy bandwidth, and each batch's step has its collectives timed alone
 * (bench_comm_step_ms: the same calls, same sizes, replayed in a CUDA graph of their own) and given
 * as a share of the graph step's time. Every rank runs its greedy steps ahead, as rank 0 does.
 *
 *   batch_bench [--batches 1,8,32,64,128] [--prompt 256] [--steps 16] [--json FILE] [--op-profile 1]
 *               [--tp N | --nccl]
 *               [--graph-max-rows N]  (bucket graphs up to N rows; the model's default is 64)
 *               [--pack-projections 1] (the projections that share an input packed: weights_pack)
 *               [--moe-grouped-max N] (the grouped MoE decode kernels up to N rows, beyond which
 *                                      the MoE reads the routing back and a step is no graph;
 *                                      mt_cuda_params.moe_grouped_max_rows, default 64)
 *               [--numerics exact|bf16|fp32] (the CUDA backend's; default bf16)
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
#define MAX_PASSES 64 /* glm_decode_multi passes a step counted for its collectives */
/* Pairs one pass of the grouped decode experts takes over a warp's weight rows
 * (cuda_moe_grouped.cu's MOEG_PASS_MAX): an expert chosen by more pairs is read again from L2. */
#define GROUPED_PASS_PAIRS 4

typedef struct batch_result {
    int B;
    double touched;        /* (layer, expert) pairs the census step touched */
    long pairs;            /* (row, slot) pairs the census step routed, all MoE layers */
    int max_pairs;         /* the most of them one touched expert took */
    int later_passes;      /* passes of GROUPED_PASS_PAIRS beyond each touched expert's first */
    double bytes;          /* one rank's (bench_rank_step_bytes); the whole model's at tp 1 */
    double model_bytes;    /* the whole model's */
    double floor_ms, graph_ms, eager_ms;
    double comm_ms;        /* the step's collectives alone (bench_comm_step_ms); -1: none */
    int comm_calls;
    int graphed;
} batch_result;

/* The options of a run, the same on every rank. */
typedef struct batch_opts {
    int batches[MAX_BATCHES], nb, prompt, steps, op_profile, graph_max, tp;
    bool pack;             /* --pack-projections 1 */
    const char *json;
    mt_cuda_params cp;
} batch_opts;

/* One rank's run (every rank makes the same calls in the same order; rank 0 reports). */
static int batch_rank(bench_rank *r, void *user) {
    const batch_opts *o = user;
    const int *batches = o->batches, nb = o->nb, prompt = o->prompt, steps = o->steps, tp = r->size;
    mt_backend *be = r->be;
    mt_error err = { "" };
    const double bw = bench_copy_bandwidth_gbs(); /* each rank its own GPU's; rank 0's is reported */
    glm_config c;
    if (glm_config_preset("bench-4L", &c, &err) != MT_OK) { fprintf(stderr, "%s\n", err.msg); return 1; }
    bench_weights w;
    bench_count_weights(&c, &w);
    glm_model_params mp = glm_model_default_params(); /* 256 scratch rows: batches up to 256 */
    mp.comm = r->comm;
    if (o->graph_max > 0) mp.graph_max_rows = o->graph_max;
    mp.pack_projections = o->pack;
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
            tok[b] = glm_argmax(logits, V); /* the logits are gathered: every rank takes the same */
        }
        /* census step (eager), then eager timing, then graphs: one eager step sizes the bucket, the
         * next captures it. The router is replicated, so every rank counts the same experts. */
        glm_model_set_decode_graphs(m, false);
        glm_model_set_expert_census(m, true);
        bench_decode_steps(r, m, s, tok, B, 1);
        res[k].touched = glm_model_expert_census(m);
        const int32_t *pairs = glm_model_expert_census_pairs(m);
        for (int e = 0; pairs && e < c.num_hidden_layers * c.n_routed_experts; e++) {
            res[k].pairs += pairs[e];
            if (pairs[e] > res[k].max_pairs) res[k].max_pairs = pairs[e];
            if (pairs[e] > 0) res[k].later_passes += (pairs[e] + GROUPED_PASS_PAIRS - 1) / GROUPED_PASS_PAIRS - 1;
        }
        glm_model_set_expert_census(m, false);
        res[k].eager_ms = bench_decode_ahead(r, m, s, tok, B, steps);
        glm_model_set_decode_graphs(m, true);
        bench_decode_steps(r, m, s, tok, B, 2);
        res[k].graphed = glm_model_has_bucket_graph(m, B);
        res[k].graph_ms = bench_decode_ahead(r, m, s, tok, B, steps);
        res[k].B = B;
        if (o->op_profile) {
            char title[64];
            snprintf(title, sizeof title, "eager decode step of %d sequences", B);
            glm_model_set_decode_graphs(m, false);
            mt_cuda_profile(be, true, title);
            bench_decode_steps(r, m, s, tok, B, 1);
            mt_cuda_profile(be, false, title);
        }
        const int len = prompt + steps + 3;
        res[k].bytes = bench_rank_step_bytes(&w, tp, B, res[k].touched, bench_kda_state_bytes(&c), bench_dsa_cache_bytes(&c, len));
        res[k].model_bytes = bench_rank_step_bytes(&w, 1, B, res[k].touched, bench_kda_state_bytes(&c), bench_dsa_cache_bytes(&c, len));
        res[k].floor_ms = res[k].bytes / (bw * 1e9) * 1e3;
        /* the collectives of a graphed step alone: the passes glm_decode_multi makes of at most
         * its scratch rows, each of its bucket's rows when that bucket replays a graph */
        int rows[MAX_PASSES] = { 0 }, n_pass = 0;
        const int cap = glm_model_batch_rows(m);
        for (int done = 0; done < B && n_pass < MAX_PASSES; done += cap) {
            const int n = B - done < cap ? B - done : cap;
            int bucket = 1;
            while (bucket < n) bucket *= 2;
            rows[n_pass++] = glm_model_has_bucket_graph(m, n) ? bucket : n;
        }
        /* rank 0's passes: a capture that failed on one rank only must not give the ranks
         * collectives of different sizes */
        bench_agree(r, &n_pass, sizeof n_pass);
        bench_agree(r, rows, sizeof rows);
        res[k].comm_ms = bench_comm_step_ms(r, &c, rows, n_pass, &res[k].comm_calls);
        for (int b = 0; b < B; b++) glm_seq_free(s[b]);
        free(s);
        free(tok);
        free(ptoks);
        free(logits);
    }
    glm_model_free(m);
    if (r->rank != 0) return 0;

    printf("metrale batch_bench: bench-4L batched decode (glm_decode_greedy, %s), prompts of %d tokens, CUDA backend\n",
           "run ahead", prompt);
    printf("device copy bandwidth %.0f GB/s (cudaMemcpy D2D, read + write%s), same run\n", bw, tp > 1 ? ", rank 0's GPU" : "");
    if (r->comm)
        printf("tensor parallel over %d rank%s (NCCL, one process a GPU), times of rank 0; bytes and floor are per rank: 1/%d of\n"
               "the split weights, touched expert slices and KDA state, the replicated weights and DSA cache reads whole.\n"
               "comm: the step's %s alone, same sizes, replayed in a CUDA graph of their own\n"
               "(median of 5 rounds of 20 replays); share: of the graph step's time.\n",
               tp, tp > 1 ? "s" : "", tp,
               tp > 1 ? "collectives (embedding all-reduce, two all-reduces a layer, head all-gather)" : "collectives (two all-reduces a layer)");
    printf("| batch | experts touched | bytes/step | floor ms | graph ms | tok/s (graph) | of floor | eager ms | tok/s (eager) | comm ms | comm share |\n");
    printf("|------:|----------------:|-----------:|---------:|---------:|--------------:|---------:|---------:|--------------:|--------:|-----------:|\n");
    for (int k = 0; k < nb; k++) {
        const batch_result *q = &res[k];
        char comm[2][24];
        if (q->comm_ms >= 0) {
            snprintf(comm[0], sizeof comm[0], "%.3f", q->comm_ms);
            snprintf(comm[1], sizeof comm[1], "%.1f%%", 100 * q->comm_ms / q->graph_ms);
        } else {
            snprintf(comm[0], sizeof comm[0], "n/a");
            snprintf(comm[1], sizeof comm[1], "n/a");
        }
        printf("| %5d | %15.0f | %7.2f GB | %8.3f | %7.3f%s | %13.0f | %7.1f%% | %8.3f | %13.0f | %7s | %10s |\n", q->B,
               q->touched, q->bytes / 1e9, q->floor_ms, q->graph_ms, q->graphed ? " " : "*", q->B * 1e3 / q->graph_ms,
               100 * q->floor_ms / q->graph_ms, q->eager_ms, q->B * 1e3 / q->eager_ms, comm[0], comm[1]);
    }
    printf("(* no bucket graph was captured for this batch: the graph column ran eagerly)\n");
    printf("routing of the census step: (row, slot) pairs per touched expert, and the grouped decode kernel's passes\n"
           "of %d pairs beyond each expert's first (each reads the expert's weights again, from L2)\n", GROUPED_PASS_PAIRS);
    printf("| batch | pairs per touched expert, mean | most | passes beyond the first | of touched experts |\n");
    printf("|------:|-------------------------------:|-----:|------------------------:|-------------------:|\n");
    for (int k = 0; k < nb; k++) {
        const batch_result *q = &res[k];
        printf("| %5d | %30.2f | %4d | %23d | %17.1f%% |\n", q->B, q->touched > 0 ? q->pairs / q->touched : 0.0,
               q->max_pairs, q->later_passes, q->touched > 0 ? 100 * q->later_passes / q->touched : 0.0);
    }
    if (!r->comm) printf("(comm: n/a, no communicator; --tp N or --nccl)\n");
    if (o->json) {
        FILE *f = fopen(o->json, "w");
        if (f) {
            fprintf(f, "{\"copy_bandwidth_gbs\": %.1f, \"prompt\": %d, \"steps\": %d, \"tp\": %d, \"communicator\": \"%s\", "
                       "\"batches\": [", bw, prompt, steps, tp, r->comm ? "nccl" : "none");
            for (int k = 0; k < nb; k++) {
                const batch_result *q = &res[k];
                fprintf(f, "%s{\"batch\": %d, \"experts_touched\": %.0f, \"step_bytes\": %.0f, \"floor_ms\": %.4f, "
                           "\"graph_ms\": %.4f, \"graphed\": %s, \"graph_tok_s\": %.1f, \"graph_fraction_of_floor\": %.4f, "
                           "\"eager_ms\": %.4f, \"eager_tok_s\": %.1f, \"model_step_bytes\": %.0f, \"rank_step_bytes\": %.0f, "
                           "\"rank_floor_ms\": %.4f, ",
                        k ? ", " : "", q->B, q->touched, q->bytes, q->floor_ms, q->graph_ms, q->graphed ? "true" : "false",
                        q->B * 1e3 / q->graph_ms, q->floor_ms / q->graph_ms, q->eager_ms, q->B * 1e3 / q->eager_ms,
                        q->model_bytes, q->bytes, q->floor_ms);
                if (q->comm_ms >= 0)
                    fprintf(f, "\"comm_calls\": %d, \"comm_step_ms\": %.4f, \"comm_share_of_graph_step\": %.4f}", q->comm_calls,
                            q->comm_ms, q->comm_ms / q->graph_ms);
                else
                    fprintf(f, "\"comm_calls\": null, \"comm_step_ms\": null, \"comm_share_of_graph_step\": null}");
            }
            fprintf(f, "]}\n");
            fclose(f);
        } else {
            fprintf(stderr, "batch_bench: cannot write %s\n", o->json);
        }
    }
    return 0;
}

int main(int argc, char **argv) {
    batch_opts o = { .batches = { 1, 8, 32, 64, 128 }, .nb = 5, .prompt = 256, .steps = 16, .cp = mt_cuda_default_params() };
    bool nccl = false, tp_given = false; /* --nccl (no value): --tp 1 */
    nccl = bench_take_flag(&argc, argv, "--nccl");
    for (int i = 1; i < argc; i += 2) {
        if (i + 1 >= argc) { fprintf(stderr, "batch_bench: %s needs a value\n", argv[i]); return 2; }
        if (!strcmp(argv[i], "--batches")) o.nb = bench_parse_ints(argv[i + 1], o.batches, MAX_BATCHES);
        else if (!strcmp(argv[i], "--prompt")) o.prompt = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--steps")) o.steps = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--json")) o.json = argv[i + 1];
        else if (!strcmp(argv[i], "--op-profile")) o.op_profile = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--graph-max-rows")) o.graph_max = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--pack-projections")) o.pack = atoi(argv[i + 1]) != 0;
        else if (!strcmp(argv[i], "--moe-grouped-max")) o.cp.moe_grouped_max_rows = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--tp")) o.tp = atoi(argv[i + 1]), tp_given = true;
        else if (!strcmp(argv[i], "--numerics")) {
            if (!mt_numerics_parse(argv[i + 1], &o.cp.numerics)) {
                fprintf(stderr, "batch_bench: --numerics must be exact, bf16 or fp32, got %s\n", argv[i + 1]);
                return 2;
            }
        }
        else { fprintf(stderr, "batch_bench: unknown option %s\n", argv[i]); return 2; }
    }
    if (nccl && o.tp > 1) { fprintf(stderr, "batch_bench: --nccl is --tp 1; give one of them\n"); return 2; }
    if (nccl) o.tp = 1;
    bool ok = o.nb >= 1 && o.prompt >= 1 && o.steps >= 1 && o.tp >= 0 && !(tp_given && o.tp < 1);
    for (int k = 0; k < o.nb; k++) ok = ok && o.batches[k] >= 1;
    if (!ok) {
        fprintf(stderr, "batch_bench: bad options (--batches: 1 or more each, --prompt and --steps: 1 or more, --tp: 1 or more)\n");
        return 2;
    }
    return bench_run_ranks("batch_bench", o.tp, &o.cp, batch_rank, &o);
}
