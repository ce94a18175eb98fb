/* bench/decode_bench.c: batch-1 decode and prefill. In one run on one GPU it measures the device
 * copy bandwidth (the reference ceiling), then the bench-4L model (docs/PERF.md: GLM-5.3-Flash's
 * real per-layer shapes, 4 layers, random bf16 weights made on the GPU from a seed) at batch 1:
 *   - decode: ms per token, the bytes a step must read (weights it touches + recurrent state),
 *     and the fraction of the bandwidth floor (bytes / measured copy bandwidth) reached, for the
 *     engine itself (eng_step, one greedy request, with its bucket graph and running ahead: the
 *     goal's row; and with run_ahead off), for the model calls under it (glm_decode_multi then
 *     glm_last_argmax; the same replays with no token read back: the GPU's time a step), and
 *     for glm_decode (one sequence's own path, logits to the host) eager and with its graph;
 *   - prefill of 512 and 4096 tokens: tokens/s and the fraction of the bf16 tensor peak reached
 *     (FLOPs: the model's for the prefill as glm_prefill runs it, prefill_flops: lm_head for the
 *     last position only, as glm_prefill computes it); beside each, its roofline (max of its FLOPs
 *     at the peak and the weights it touches at the measured copy bandwidth: at 512 tokens nearly
 *     every expert) and cuBLAS alone on the same GEMM shapes (bench_cublas_prefill_ms; one GPU), and
 *     beside it cuBLASLt's block-scaled FP8 GEMM on those shapes (bench_cublaslt_fp8_prefill_ms),
 *     the rate FP8 checkpoints' projections can reach.
 * When the 4096-token prefill misses its goal (50% of the peak), one more prefill of 4096 tokens
 * runs with every op synchronised and timed (mt_cuda_profile_take), and the table is followed by
 * the time the goal allows and the ops that take the most: which kernels hold it back, by how much.
 * Prints one table and writes it as JSON (--json FILE).
 *
 * --tp N: the model tensor-parallel over N GPUs (bench_run_ranks: N processes, rank r on GPU r,
 * an NCCL communicator; --nccl is --tp 1, the group's path on one GPU). Every rank runs the same
 * calls; rank 0 times, prints and writes the JSON. Then the floor is per rank (the bytes one rank
 * must read: 1/N of the split weights a step touches and of the KDA state, the replicated weights
 * whole; bench_rank_step_bytes, equal to the whole model's at N = 1) over rank 0's copy bandwidth;
 * prefill is against N times the peak (the whole model's FLOPs over the group's time); and the
 * step's collectives are timed alone (bench_comm_step_ms: the same calls, replayed in a CUDA
 * graph of their own) and given as a share of the step's GPU time.
 *
 *   decode_bench [--steps N] [--context N] [--json FILE] [--bf16-peak-tflops 790] [--op-profile 1]
 *                [--profile N] [--numerics exact|bf16|fp32] [--tp N | --nccl] [--fp8]
 *                [--moe-wide-down 0|1] [--attend-rows 32|64]
 * (--numerics: the CUDA backend's mt_numerics (default bf16).
 *  --moe-wide-down, --attend-rows: mt_cuda_params.moe_wg_wide_down and mla_attend_rows, the
 *  prefill kernels' alternative tiles (default 0 and 32).
 *  --fp8: the weights an FP8 checkpoint keeps FP8 on the GPU (KDA and DSA projections, dense MLPs,
 *  shared and routed experts) made bf16 and quantised on the GPU to block-scaled e4m3
 *  (mt_model_params.random_fp8), so decode and prefill run the FP8 paths. The decode floor and
 *  the prefill roofline then count those weights at the bytes the FP8 kernels read (one a weight
 *  and a 4-byte scale a 128 x 128 block, bench_count_weights_fp8), and each prefill is also given
 *  as a fraction of cuBLASLt's block-scaled FP8 GEMM rate measured on its shapes in the same run.
 *  --op-profile 1: per-op times of one more prefill of each length, after the table's runs.
 *  --profile N: only N engine-path decode steps between cudaProfilerStart/Stop, for
 *  `ncu --profile-from-start off ...`; lab/ncu_summary.py sums the kernels.)
 */
#include <cuda_profiler_api.h>
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/bench_util.h"
#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "worker/engine/engine.h"
#include "worker/loader/glm_config.h"
#include "worker/model/glm/glm_model.h"

/* Times the token callbacks of one engine request: from token `warm` to token warm + steps. */
typedef struct engine_clock {
    int count, warm, steps;
    double t0, t1;
} engine_clock;

static void engine_on_tokens(void *user, uint64_t id, const eng_sample_result *t, int n) {
    (void)id;
    (void)t;
    engine_clock *k = user;
    for (int i = 0; i < n; i++) {
        k->count++;
        if (k->count == k->warm) k->t0 = mt_now();
        if (k->count == k->warm + k->steps) k->t1 = mt_now();
    }
}

/* ms a token of one plain greedy request (a 64-token prompt) through eng_step, run_ahead on or
 * off, after 8 warm-up tokens (the bucket graph's eager step and capture among them). */
static double engine_ms(const bench_rank *br, glm_model *m, bool run_ahead, const int32_t *prompt, int steps,
                        uint64_t *ahead_steps) {
    mt_error err = { "" };
    bench_sync(br); /* the ranks start together (their steps' collectives then keep them in step) */
    eng_params p = eng_default_params();
    p.run_ahead = run_ahead ? ENG_RUN_AHEAD_ALWAYS : ENG_RUN_AHEAD_OFF;
    p.max_context = 64 + steps + 16;
    engine_clock k = { 0, 8, steps, 0, 0 };
    eng_callbacks cb = { .user = &k, .on_tokens = engine_on_tokens };
    eng_engine *e = NULL;
    if (eng_new(glm_model_as_model(m), &p, &cb, &e, &err) != MT_OK) { fprintf(stderr, "decode_bench: %s\n", err.msg); exit(1); }
    eng_request r = eng_default_request();
    r.prompt = prompt;
    r.n_prompt = 64;
    r.max_new_tokens = k.warm + steps + 1;
    r.ignore_eos = true;
    if (eng_submit(e, 1, &r, 0, &err) != MT_OK) { fprintf(stderr, "decode_bench: %s\n", err.msg); exit(1); }
    while (eng_has_work(e))
        if (eng_step(e, NULL) != MT_OK) { fprintf(stderr, "decode_bench: engine step failed\n"); exit(1); }
    eng_stats st;
    eng_get_stats(e, &st);
    if (ahead_steps) *ahead_steps = st.ahead_steps;
    eng_free(e);
    if (k.count < k.warm + steps) { fprintf(stderr, "decode_bench: the engine gave %d tokens\n", k.count); exit(1); }
    return (k.t1 - k.t0) * 1e3 / steps;
}

/* One more prefill of n tokens on a fresh sequence with every op synchronised and timed
 * (mt_cuda_profile): the table printed under `title` when rows is NULL, else the max costliest
 * ops into rows (returns how many; *total_ms: the sum over every op). Exits on failure, as main's
 * other runs do. */
static int profiled_prefill(glm_model *m, mt_backend *be, const int32_t *toks, int n, float *logits,
                            const char *title, mt_cuda_op_time *rows, int max, double *total_ms) {
    mt_error err = { "" };
    glm_seq *s = NULL;
    if (glm_seq_new(m, n + 1, &s, &err) != MT_OK) { fprintf(stderr, "%s\n", err.msg); exit(1); }
    mt_cuda_profile(be, true, title);
    if (glm_prefill(m, s, toks, n, logits, false, &err) != MT_OK) { fprintf(stderr, "%s\n", err.msg); exit(1); }
    int got = 0;
    if (rows) got = mt_cuda_profile_take(be, rows, max, total_ms);
    else mt_cuda_profile(be, false, title);
    glm_seq_free(s);
    return got;
}

enum { PF_OPS = 8 };                /* ops named when the prefill misses its goal */
static const double PF_GOAL = 0.50; /* the goal: prefill >= 50% of bf16 peak at 4096 tokens */

/* The model's FLOPs for a prefill of n tokens as glm_prefill runs it (the last position's logits
 * only): 2 per parameter each token touches, lm_head for one row; plus each DSA layer's attention
 * in the model's form (docs/MODEL.md: q_h . k_h over qk_nope, p v_h over v_head: 2 (qk_nope +
 * v_head) per head) for every position a query attends under the indexer's selection
 * (min(index_topk / kpool, complete pools) pools of kpool, plus the tail when
 * index_kpool_always_select_tail). The absorbed form the kernels run does 4 kv_lora per head and
 * position there, twice this at bench-4L: the count is the model's, the smaller. Not counted: the
 * indexer's scores, the KDA state products (6 dk^2 a head a token in the recurrent form: ~0.7% at
 * bench-4L's 4096), and queries that select nothing (tail off, t < kpool - 1), which attend every
 * earlier position. */
static double prefill_flops(const glm_config *c, const bench_weights *bc, int n) {
    double f = 2.0 * (bc->touched_params - bc->head_params) * n + 2.0 * c->vocab_size * (double)c->hidden_size;
    int n_dsa = 0;
    for (int l = 0; l < c->num_hidden_layers; l++) n_dsa += c->layer_types[l] == GLM_MIXER_DSA;
    const int kp = c->index_kpool, cap = c->index_topk / c->index_kpool;
    double keys = 0;
    for (int t = 0; t < n; t++) {
        const int pools = (t + 1) / kp < cap ? (t + 1) / kp : cap;
        keys += (double)pools * kp + (c->index_kpool_always_select_tail ? (t + 1) % kp : 0);
    }
    return f + n_dsa * keys * c->num_attention_heads * 2.0 * (c->qk_nope_head_dim + c->v_head_dim);
}

/* The options of a run, the same on every rank. */
typedef struct decode_opts {
    int steps, context, profile, op_profile, tp;
    /* The bf16 peak the prefill is measured against: what cuBLAS reaches on a large bf16 GEMM on
     * the H200 (773 TFLOP/s at 4096 x 12288 x 4096, lab/fp8_probe, docs/PERF.md), not the
     * datasheet's 989 (dense, at the top boost clock); against that one the fractions are 0.8x.
     * A group of tp ranks is measured against tp times it. */
    double peak_tflops;
    const char *json;
    mt_cuda_params cp;
    bool fp8;              /* --fp8: the projections an FP8 checkpoint keeps FP8 quantised on the GPU */
} decode_opts;

/* One rank's run (every rank makes the same calls in the same order; rank 0 reports). */
static int decode_rank(bench_rank *r, void *user) {
    const decode_opts *o = user;
    const int steps = o->steps, context = o->context, profile = o->profile, op_profile = o->op_profile;
    const int tp = r->size;
    const double peak_tflops = o->peak_tflops, group_peak = peak_tflops * tp;
    const bool lead = r->rank == 0;
    mt_backend *be = r->be;
    mt_error err = { "" };
    const double bw = bench_copy_bandwidth_gbs(); /* each rank its own GPU's; rank 0's is reported */
    glm_config c;
    if (glm_config_preset("bench-4L", &c, &err) != MT_OK) { fprintf(stderr, "%s\n", err.msg); return 1; }
    bench_weights bc;
    if (o->fp8) bench_count_weights_fp8(&c, &bc);
    else bench_count_weights(&c, &bc);
    int n_moe = 0;
    for (int l = 0; l < c.num_hidden_layers; l++) n_moe += c.mlp_layer_types[l] == GLM_MLP_SPARSE;
    /* batch 1 reads every dense weight, one embedding row, top_k experts per MoE layer and the KDA
     * state (the DSA cache rows of its short context are not counted); one rank of tp its 1/tp of
     * the split ones and of the state, the replicated weights whole */
    const double experts = (double)n_moe * c.num_experts_per_tok, kda = bench_kda_state_bytes(&c);
    const double step_bytes = bench_rank_step_bytes(&bc, tp, 1, experts, kda, 0);
    const double model_bytes = bench_rank_step_bytes(&bc, 1, 1, experts, kda, 0);

    glm_model_params mp = glm_model_default_params();
    mp.prefill_chunk = 4096;
    mp.comm = r->comm;
    mp.random_fp8 = o->fp8;
    glm_model *m = NULL;
    double t0 = mt_now();
    if (glm_model_new_random(&c, 1, be, &mp, &m, &err) != MT_OK) { fprintf(stderr, "%s\n", err.msg); return 1; }
    bench_sync(r);
    const double t_make = mt_now() - t0;

    int32_t *toks = malloc(sizeof(int32_t) * (size_t)context);
    for (int i = 0; i < context; i++) toks[i] = (int32_t)((i * 7919u + 13u) % (unsigned)c.vocab_size);
    float *logits = malloc(sizeof(float) * (size_t)c.vocab_size);
    glm_seq *s = NULL;

    /* --profile N: N decode steps of the engine's path (bucket-1 graph replayed, argmax on the
     * device) inside cudaProfilerStart/Stop, for ncu --profile-from-start off (which profiles each
     * graph node as its own kernel); nothing else timed. */
    if (profile > 0) {
        if (glm_seq_new(m, 256, &s, &err) != MT_OK) { fprintf(stderr, "%s\n", err.msg); return 1; }
        glm_model_set_decode_graphs(m, true);
        glm_prefill(m, s, toks, 64, logits, false, &err);
        int32_t tok = glm_argmax(logits, c.vocab_size);
        bench_decode_steps(r, m, &s, &tok, 1, 4); /* eager (sizes the bucket), capture, replays */
        cudaProfilerStart();
        bench_decode_steps(r, m, &s, &tok, 1, profile);
        cudaProfilerStop();
        glm_seq_free(s);
        glm_model_free(m);
        free(toks);
        free(logits);
        return 0;
    }

    /* prefill 512 and 4096 tokens, each on a fresh sequence, after a warm-up; the FLOPs are the
     * whole model's, the time the group's (rank 0's clock from bench_sync to its drain, which the
     * head's gather holds until every rank is done) */
    const int plens[2] = { 512, 4096 };
    double pf_tps[2] = { 0, 0 }, pf_frac[2] = { 0, 0 }, pf_flops[2] = { 0, 0 };
    for (int k = 0; k < 2; k++) {
        for (int rep = 0; rep < 2; rep++) {
            if (glm_seq_new(m, plens[k] + 1, &s, &err) != MT_OK) { fprintf(stderr, "%s\n", err.msg); return 1; }
            bench_sync(r);
            double a = mt_now();
            if (glm_prefill(m, s, toks, plens[k], logits, false, &err) != MT_OK) { fprintf(stderr, "%s\n", err.msg); return 1; }
            be->ops->sync(be);
            double dt = mt_now() - a;
            glm_seq_free(s);
            pf_tps[k] = plens[k] / dt;
        }
    }
    bench_agree(r, pf_tps, sizeof pf_tps); /* rank 0's times: the decision below is the group's */
    /* the references beside each prefill (one GPU): cuBLAS alone on the prefill's GEMM shapes, and
     * the roofline, max(FLOPs at the peak, the weights the prefill touches at the copy bandwidth) */
    double pf_cublas_ms[2] = { -1, -1 }, pf_cublas_flops[2] = { 0, 0 }, pf_roof_ms[2] = { 0, 0 };
    double pf_fp8_ms[2] = { -1, -1 }, pf_fp8_flops[2] = { 0, 0 };
    double pf_fp8_frac[2] = { -1, -1 }; /* --fp8: the prefill's FLOP rate over cuBLASLt's FP8 rate on its shapes */
    int moe_layers = 0;
    for (int l = 0; l < c.num_hidden_layers; l++) moe_layers += c.mlp_layer_types[l] == GLM_MLP_SPARSE;
    for (int k = 0; k < 2; k++) {
        pf_flops[k] = prefill_flops(&c, &bc, plens[k]);
        pf_frac[k] = pf_tps[k] / plens[k] * pf_flops[k] / (group_peak * 1e12);
        const double bytes = bc.dense_bytes + moe_layers * bench_experts_touched(&c, plens[k]) * bc.expert_bytes;
        const double t_flop = pf_flops[k] / (group_peak * 1e12) * 1e3, t_bytes = bytes / (tp * bw * 1e9) * 1e3;
        pf_roof_ms[k] = t_flop > t_bytes ? t_flop : t_bytes;
        if (tp == 1 && lead) pf_cublas_ms[k] = bench_cublas_prefill_ms(&c, plens[k], &pf_cublas_flops[k]);
        if (tp == 1 && lead) pf_fp8_ms[k] = bench_cublaslt_fp8_prefill_ms(&c, plens[k], &pf_fp8_flops[k]);
        if (o->fp8 && pf_fp8_ms[k] > 0)
            pf_fp8_frac[k] = pf_tps[k] / plens[k] * pf_flops[k] / (pf_fp8_flops[k] / (pf_fp8_ms[k] * 1e-3));
    }
    /* The 4096-token prefill under its goal: one more, every op synchronised and timed, for the
     * ops that hold it back (the sum runs above the timed run's wall time: each op waits for the
     * GPU to drain before the next is queued). */
    mt_cuda_op_time pf_ops[PF_OPS];
    int pf_nops = 0;
    double pf_ops_total = 0;
    const double pf_ms = plens[1] / pf_tps[1] * 1e3, pf_goal_ms = pf_flops[1] / (PF_GOAL * group_peak * 1e12) * 1e3;
    if (pf_frac[1] < PF_GOAL) pf_nops = profiled_prefill(m, be, toks, plens[1], logits, NULL, pf_ops, PF_OPS, &pf_ops_total);
    /* --op-profile 1: one more prefill of each length with every op synchronised and timed
     * (mt_cuda_profile), after the timed runs. */
    for (int k = 0; op_profile && k < 2; k++) {
        char title[64];
        snprintf(title, sizeof title, "prefill %d tokens", plens[k]);
        profiled_prefill(m, be, toks, plens[k], logits, title, NULL, 0, NULL);
    }

    /* decode: prefill 64 tokens, warm up 4 steps, then time steps (the logits are gathered, so
     * every rank takes the same greedy tokens) */
    if (glm_seq_new(m, context, &s, &err) != MT_OK) { fprintf(stderr, "%s\n", err.msg); return 1; }
    if (glm_prefill(m, s, toks, 64, logits, false, &err) != MT_OK) { fprintf(stderr, "%s\n", err.msg); return 1; }
    int32_t tok = glm_argmax(logits, c.vocab_size);
    for (int i = 0; i < 4; i++) {
        glm_decode(m, s, tok, logits, &err);
        tok = glm_argmax(logits, c.vocab_size);
    }
    /* eager, then graphs (the first graph step captures: one more warm-up) */
    double ms_mode[2];
    for (int g = 0; g < 2; g++) {
        glm_model_set_decode_graphs(m, g == 1);
        for (int w = 0; g == 1 && w < 2; w++) { /* graph form: one eager step, one capture */
            glm_decode(m, s, tok, logits, &err);
            tok = glm_argmax(logits, c.vocab_size);
        }
        bench_sync(r);
        double a = mt_now();
        for (int i = 0; i < steps; i++) {
            if (glm_decode(m, s, tok, logits, &err) != MT_OK) { fprintf(stderr, "%s\n", err.msg); return 1; }
            tok = glm_argmax(logits, c.vocab_size);
        }
        be->ops->sync(be);
        ms_mode[g] = (mt_now() - a) * 1e3 / steps;
    }
    const int graphed = glm_seq_has_graph(s);
    const double ms_tok = ms_mode[0], ms_graph = ms_mode[1];
    /* The model's batched path: the same sequence through glm_decode_multi (its bucket-1 graph)
     * with the greedy token taken on the device and read back before the next step. */
    glm_model_set_decode_graphs(m, true);
    bench_decode_steps(r, m, &s, &tok, 1, 3); /* eager (sizes the bucket), capture, replay */
    const double ms_readback = bench_decode_steps(r, m, &s, &tok, 1, steps);
    const int engine_graphed = glm_model_has_bucket_graph(m, 1);
    /* The same replays with no token read back between them (the token is held): the host queues
     * step after step and the GPU runs them back to back, so this is the step's time on the GPU
     * alone; the engine path's excess over it is the per-token round trip to the host. */
    bench_sync(r);
    double a_gpu = mt_now();
    for (int i = 0; i < steps; i++)
        if (glm_decode_multi(m, &s, &tok, 1, NULL, &err) != MT_OK) { fprintf(stderr, "%s\n", err.msg); return 1; }
    be->ops->sync(be);
    const double ms_engine_gpu = (mt_now() - a_gpu) * 1e3 / steps;
    const double floor_ms = step_bytes / (bw * 1e9) * 1e3;
    glm_seq_free(s);
    /* The collectives of that step alone (a pass of one row, its bucket), against its GPU time. */
    const int one_row = 1;
    int comm_calls = 0;
    const double comm_ms = bench_comm_step_ms(r, &c, &one_row, 1, &comm_calls);
    /* The engine itself (eng_step, one greedy request): running ahead (its default) and not */
    uint64_t ahead_steps = 0;
    const double ms_engine = engine_ms(r, m, true, toks, steps, &ahead_steps);
    const double ms_engine_plain = engine_ms(r, m, false, toks, steps, NULL);
    free(toks);
    free(logits);
    glm_model_free(m);
    if (!lead) return 0;

    char pf_ref[48];
    if (tp > 1) snprintf(pf_ref, sizeof pf_ref, "%d x %.0f TFLOP/s bf16", tp, peak_tflops);
    else snprintf(pf_ref, sizeof pf_ref, "%.0f TFLOP/s bf16", peak_tflops);
    printf("metrale decode_bench: bench-4L (4 layers: 3 KDA + 1 DSA, 1 dense + 3 MoE), batch 1, CUDA backend");
    if (r->comm) printf(", tensor parallel over %d rank%s", tp, tp > 1 ? "s" : "");
    printf("\n  random weights made on the GPU in %.2f s\n", t_make);
    if (o->fp8)
        printf("(--fp8: the dense projections and the routed experts are block-scaled FP8 (kernels/cuda/cuda_fp8.cu,\n"
               " cuda_moe.cu), the rest bf16; the decode floor and the roofline count the FP8 weights at one byte\n"
               " a weight and a 4-byte scale a 128 x 128 block, what the FP8 kernels read.)\n");
    printf("| measure                         | value        | reference                      |\n");
    printf("|---------------------------------|--------------|--------------------------------|\n");
    printf("| device copy bandwidth           | %7.0f GB/s | (read + write, cudaMemcpy D2D%s) |\n", bw, tp > 1 ? ", rank 0's GPU" : "");
    if (tp > 1) {
        printf("| bytes a decode step must read, whole model | %8.3f GB  | weights touched + KDA state    |\n", model_bytes / 1e9);
        printf("| bytes a decode step must read, per rank | %8.3f GB  | 1/%d of the split weights touched and of the KDA state, the replicated weights whole |\n",
               step_bytes / 1e9, tp);
        printf("| bandwidth floor per token, per rank | %8.3f ms  | per-rank bytes / copy bandwidth |\n", floor_ms);
    } else {
        printf("| bytes a decode step must read   | %8.3f GB  | weights touched + KDA state    |\n", step_bytes / 1e9);
        printf("| bandwidth floor per token       | %8.3f ms  | bytes / copy bandwidth         |\n", floor_ms);
    }
    printf("| glm_decode, eager (logits to the host) | %8.3f ms  | %5.1f%% of the floor |\n", ms_tok, 100 * floor_ms / ms_tok);
    printf("| glm_decode, its own CUDA graph%s (logits to the host) | %8.3f ms  | %5.1f%% of the floor |\n", graphed ? "" : " (NOT captured)",
           ms_graph, 100 * floor_ms / ms_graph);
    printf("| decode, engine (eng_step: bucket graph%s, argmax on the GPU, %s) | %8.3f ms | %5.1f%% of the floor (goal 80%%) |\n",
           engine_graphed ? "" : " NOT captured", "run ahead", ms_engine,
           100 * floor_ms / ms_engine);
    printf("| decode, engine with run_ahead off (token read back before the next step) | %8.3f ms | %5.1f%% of the floor |\n",
           ms_engine_plain, 100 * floor_ms / ms_engine_plain);
    printf("| glm_decode_multi + glm_last_argmax a step (token read back each step) | %8.3f ms | %5.1f%% of the floor |\n",
           ms_readback, 100 * floor_ms / ms_readback);
    printf("| the same replays, no token read back between them (GPU time a step) | %8.3f ms | %5.1f%% of the floor |\n",
           ms_engine_gpu, 100 * floor_ms / ms_engine_gpu);
    if (comm_ms >= 0)
        printf("| that step's %d collectives alone, replayed in a CUDA graph of their own | %8.3f ms | %5.1f%% of the step's GPU time (row above) |\n",
               comm_calls, comm_ms, 100 * comm_ms / ms_engine_gpu);
    else if (r->comm)
        printf("| that step's collectives alone | n/a | their graph could not be captured on some rank |\n");
    for (int k = 0; k < 2; k++) {
        const double ms = 1e3 * plens[k] / pf_tps[k];
        printf("| prefill %4d tokens (%.1f TFLOP) | %8.0f tok/s | %5.2f%% of %s    |\n", plens[k],
               pf_flops[k] / 1e12, pf_tps[k], 100 * pf_frac[k], pf_ref);
        printf("| prefill %4d tokens: roofline, max(FLOPs at the peak, touched weights at copy bandwidth) | %8.3f ms | "
               "%5.1f%% of it (ours %.3f ms) |\n", plens[k], pf_roof_ms[k], 100 * pf_roof_ms[k] / ms, ms);
        if (pf_cublas_ms[k] > 0)
            printf("| prefill %4d tokens: cuBLAS alone on its GEMM shapes (%.1f TFLOP) | %8.3f ms | %5.1f TFLOP/s |\n",
                   plens[k], pf_cublas_flops[k] / 1e12, pf_cublas_ms[k], pf_cublas_flops[k] / (pf_cublas_ms[k] * 1e9));
        if (pf_fp8_ms[k] > 0)
            printf("| prefill %4d tokens: cuBLASLt block-scaled FP8 on the same shapes (%.1f TFLOP) | %8.3f ms | "
                   "%5.1f TFLOP/s |\n", plens[k], pf_fp8_flops[k] / 1e12, pf_fp8_ms[k],
                   pf_fp8_flops[k] / (pf_fp8_ms[k] * 1e9));
        if (pf_fp8_frac[k] > 0)
            printf("| prefill %4d tokens (FP8 weights) against that FP8 rate | %5.1f TFLOP/s | %5.2f%% of %.1f TFLOP/s |\n",
                   plens[k], pf_tps[k] / plens[k] * pf_flops[k] / 1e12, 100 * pf_fp8_frac[k],
                   pf_fp8_flops[k] / (pf_fp8_ms[k] * 1e9));
        else if (tp == 1 && !(pf_fp8_ms[k] > 0))
            printf("| prefill %4d tokens: cuBLASLt block-scaled FP8 on the same shapes | n/a | no algorithm or a "
                   "failed call |\n", plens[k]);
    }
    if (comm_ms >= 0)
        printf("(collectives: the same calls as one decode step of the model (%s), with the same sizes, captured\n"
               " alone into a CUDA graph on the backend's stream and replayed back to back: the median of 5 rounds of\n"
               " 20 replays, on rank 0's clock. It leaves out the waits on slower ranks a real step's collectives absorb.)\n",
               tp > 1 ? "the embedding's all-reduce, two all-reduces a layer, the head's all-gather" : "two all-reduces a layer");
    if (pf_nops > 0) {
        printf("prefill %d tokens: %.2f ms; at the goal (%.0f%% of %s) it would take %.2f ms. The ops that take\n"
               "the most (one more prefill, every op synchronised%s: %.2f ms):\n",
               plens[1], pf_ms, 100 * PF_GOAL, pf_ref, pf_goal_ms, tp > 1 ? ", rank 0's" : "", pf_ops_total);
        printf("| op | ms | share | of the goal's %.2f ms | calls |\n|---|---:|---:|---:|---:|\n", pf_goal_ms);
        for (int i = 0; i < pf_nops; i++)
            printf("| %s | %.3f | %.1f%% | %.0f%% | %ld |\n", pf_ops[i].name, pf_ops[i].ms,
                   pf_ops_total > 0 ? 100 * pf_ops[i].ms / pf_ops_total : 0., 100 * pf_ops[i].ms / pf_goal_ms,
                   pf_ops[i].calls);
    }
    if (o->json) {
        FILE *f = fopen(o->json, "w");
        if (f) {
            fprintf(f, "{\"copy_bandwidth_gbs\": %.1f, \"decode_step_bytes\": %.0f, \"floor_ms\": %.4f, "
                       "\"decode_eager_ms\": %.4f, \"decode_eager_fraction_of_floor\": %.4f, "
                       "\"decode_graph_ms\": %.4f, \"decode_graph_fraction_of_floor\": %.4f, "
                       "\"decode_engine_path_ms\": %.4f, \"decode_engine_path_fraction_of_floor\": %.4f, "
                       "\"decode_engine_no_run_ahead_ms\": %.4f, \"decode_multi_readback_ms\": %.4f, "
                       "\"engine_ahead_steps\": %llu, \"decode_replays_no_readback_ms\": %.4f, \"prefill_512_tok_s\": %.1f, \"prefill_512_fraction_of_peak\": %.5f, "
                       "\"prefill_4096_tok_s\": %.1f, \"prefill_4096_fraction_of_peak\": %.5f, \"prefill_512_flops\": %.4g, "
                       "\"prefill_4096_flops\": %.4g, \"steps\": %d, \"prefill_4096_ms\": %.3f, "
                       "\"prefill_goal_fraction\": %.2f, \"prefill_4096_goal_ms\": %.3f, \"prefill_4096_ops_total_ms\": %.3f, ",
                    bw, step_bytes, floor_ms, ms_tok, floor_ms / ms_tok, ms_graph, floor_ms / ms_graph, ms_engine,
                    floor_ms / ms_engine, ms_engine_plain, ms_readback, (unsigned long long)ahead_steps,
                    ms_engine_gpu, pf_tps[0], pf_frac[0], pf_tps[1], pf_frac[1], pf_flops[0], pf_flops[1], steps,
                    pf_ms, PF_GOAL, pf_goal_ms, pf_ops_total);
            for (int k = 0; k < 2; k++)
                fprintf(f, "\"prefill_%d_roofline_ms\": %.4f, \"prefill_%d_cublas_ms\": %.4f, \"prefill_%d_cublas_flops\": %.4g, "
                           "\"prefill_%d_cublaslt_fp8_ms\": %.4f, \"prefill_%d_cublaslt_fp8_flops\": %.4g, "
                           "\"prefill_%d_fraction_of_fp8_rate\": %.5f, ",
                        plens[k], pf_roof_ms[k], plens[k], pf_cublas_ms[k], plens[k], pf_cublas_flops[k], plens[k],
                        pf_fp8_ms[k], plens[k], pf_fp8_flops[k], plens[k], pf_fp8_frac[k]);
            fprintf(f, "\"fp8\": %s, ", o->fp8 ? "true" : "false");
            fprintf(f, "\"tp\": %d, \"communicator\": \"%s\", \"model_step_bytes\": %.0f, \"rank_step_bytes\": %.0f, "
                       "\"rank_floor_ms\": %.4f, \"peak_tflops\": %.1f, \"group_peak_tflops\": %.1f, ",
                    tp, r->comm ? "nccl" : "none", model_bytes, step_bytes, floor_ms, peak_tflops, group_peak);
            if (comm_ms >= 0)
                fprintf(f, "\"comm_calls\": %d, \"comm_step_ms\": %.4f, \"comm_share_of_gpu_step\": %.4f, ", comm_calls, comm_ms,
                        comm_ms / ms_engine_gpu);
            else
                fprintf(f, "\"comm_calls\": null, \"comm_step_ms\": null, \"comm_share_of_gpu_step\": null, ");
            fprintf(f, "\"prefill_4096_ops\": [");
            for (int i = 0; i < pf_nops; i++)
                fprintf(f, "%s{\"op\": \"%s\", \"ms\": %.3f, \"calls\": %ld}", i ? ", " : "", pf_ops[i].name,
                        pf_ops[i].ms, pf_ops[i].calls);
            fprintf(f, "]}\n");
            fclose(f);
        } else {
            fprintf(stderr, "decode_bench: cannot write %s\n", o->json);
        }
    }
    return 0;
}

int main(int argc, char **argv) {
    decode_opts o = { .steps = 32, .context = 4096 + 64, .peak_tflops = 790, .cp = mt_cuda_default_params() };
    bool nccl = false, tp_given = false; /* --nccl (no value): --tp 1 */
    nccl = bench_take_flag(&argc, argv, "--nccl");
    o.fp8 = bench_take_flag(&argc, argv, "--fp8");
    for (int i = 1; i < argc; i += 2) {
        if (i + 1 >= argc) { fprintf(stderr, "decode_bench: %s needs a value\n", argv[i]); return 2; }
        if (!strcmp(argv[i], "--steps")) o.steps = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--context")) o.context = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--json")) o.json = argv[i + 1];
        else if (!strcmp(argv[i], "--bf16-peak-tflops")) o.peak_tflops = atof(argv[i + 1]);
        else if (!strcmp(argv[i], "--profile")) o.profile = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--op-profile")) o.op_profile = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--tp")) o.tp = atoi(argv[i + 1]), tp_given = true;
        else if (!strcmp(argv[i], "--moe-wide-down")) o.cp.moe_wg_wide_down = atoi(argv[i + 1]) != 0;
        else if (!strcmp(argv[i], "--attend-rows")) o.cp.mla_attend_rows = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--numerics")) {
            if (!mt_numerics_parse(argv[i + 1], &o.cp.numerics)) {
                fprintf(stderr, "decode_bench: --numerics must be exact, bf16 or fp32, got %s\n", argv[i + 1]);
                return 2;
            }
        }
        else { fprintf(stderr, "decode_bench: unknown option %s\n", argv[i]); return 2; }
    }
    if (nccl && o.tp > 1) { fprintf(stderr, "decode_bench: --nccl is --tp 1; give one of them\n"); return 2; }
    if (nccl) o.tp = 1;
    if (o.tp < 0 || (tp_given && o.tp < 1) || o.steps < 1 || o.context < 4096 || o.peak_tflops <= 0) {
        fprintf(stderr, "decode_bench: bad options (--tp %d: 1 or more, --steps %d: 1 or more, --context %d: 4096 "
                        "or more, --bf16-peak-tflops %g: above 0)\n", o.tp, o.steps, o.context, o.peak_tflops);
        return 2;
    }
    return bench_run_ranks("decode_bench", o.tp, &o.cp, decode_rank, &o);
}
