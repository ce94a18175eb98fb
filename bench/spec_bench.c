/* bench/spec_bench.c: speculative decoding through the engine beside plain decoding, same run.
 *
 *   spec_bench --model DIR|random:PRESET+mtp [--backend cpu|cuda] [--batches 1,32] [--ks 1,2,3]
 *              [--accept 0,0.5,0.8,1|real] [--temperature T] [--max-new N] [--prompt-len P]
 *              [--stream FILE] [--threads N] [--numerics bf16|exact] [--mixed-steps 0|1]
 *              [--verify-seqs N] [--top5 0|1] [--moe-grouped-max N] [--op-profile 0|1]
 *
 * For each batch B, B streams (prompt i: P tokens, from --stream's "stream_ids" (a heldout_ppl.json)
 * at offset i * P, else (i * 7 + k) % vocab) decode N tokens with ignore_eos, first with K = 0
 * (the reference), then with each K of --ks. --accept rates force the drafter (the engine's test
 * hook): with probability a a draft is the reference's own next token, else another token (a
 * seeded coin per draft), so the acceptance rate is a by construction and the output must be the
 * reference's (the run fails otherwise). --accept real leaves the drafter alone: its acceptance
 * rate is the model's. --temperature T > 0 samples (seeded; real acceptance only, and no equality
 * to check). Printed per run: ms a generated token (wall from submission to the last token,
 * divided by the tokens), the speed-up over K = 0, drafts accepted, tokens a verify step, and ms
 * a step (engine steps: a plain step of B rows for K = 0; K drafts and a verify per stream
 * otherwise). At the end, one table of every batch (up to 16 batch sizes): ms a token and ms a
 * step with K = 0 beside each K and acceptance rate, and the speed-up, the figures that place
 * --speculative-max-batch (the batch above which speculation stops paying).
 * --mixed-steps 1: eng_params.mixed_steps, as the worker's option (the verifies join the step's
 * one model call with any plain decode rows and prompt chunks). --verify-seqs N: the verifies one
 * model call takes (the model's verify_seqs); by default the largest batch, so every batch
 * verifies in one call; metrale-worker takes at most 16 (WKR_VERIFY_SEQS_MAX), so 16 gives the
 * worker's steps above batch 16.
 *
 * --numerics (cuda; default bf16, the worker's): with bf16, a verify of K + 1 rows rounds its
 * activations where a one-row decode does not (prefill-sized GEMMs), so a near tie can go the
 * other way and the output leave K = 0's; that is reported ("differs") but fails only with exact,
 * where the outputs must be equal. Forced acceptance follows K = 0's tokens, so once an output
 * leaves them its acceptance falls: take forced rates with --numerics exact.
 * --top5 1: every run also returns each token's 5 most likely ids (the target's, logprobs on:
 * the host samples from logits, no device argmax), and a stream that leaves K = 0's output
 * must do so within top-5 both ways at its first difference (the same context in both runs up
 * to there): K's token among K = 0's top 5 there and K = 0's among K's. The run fails otherwise,
 * with any numerics (the GPU bar for models without routing margins). A greedy request with
 * logprobs takes the sampling verdict, which expects each draft drawn from the drafter's
 * distribution: forced drafts then read lower acceptance than --accept asks for.
 * --op-profile 1 (cuda): after each batch's timed runs, K = 0 and the first K at the first --accept
 * rate run once more with every op synchronised and timed, each followed by its op table (where a
 * speculative step's time goes; those runs' own times are not the table's).
 * --moe-grouped-max N (cuda): the MoE's grouped kernels (fp32 activations) take batches of up to N
 * rows (mt_cuda_params.moe_grouped_max_rows; default 64, above which the tensor-core path runs in
 * the bf16 numerics; the exact numerics take them at every row count).
 */
#include <json-c/json.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "worker/engine/engine.h"
#include "worker/model/model.h"

typedef struct run {
    int32_t **tokens;    /* [streams][max_new] */
    int32_t **top;       /* [streams][max_new * 5] each token's 5 most likely ids (--top5), else NULL */
    int *n;              /* [streams] */
    int32_t **ref;       /* the reference's tokens (forcing), NULL: none */
    double accept;       /* forced acceptance rate; < 0: the drafter's own */
    uint64_t coin;       /* splitmix state of the forcing coin */
    int vocab;
    bool failed;
} run;

static uint64_t splitmix(uint64_t *x) {
    uint64_t z = (*x += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static void on_tokens(void *user, uint64_t id, const eng_sample_result *t, int n) {
    run *r = user;
    for (int i = 0; i < n; i++) {
        if (r->top)
            for (int j = 0; j < 5; j++) r->top[id][(size_t)r->n[id] * 5 + j] = j < t[i].n_top ? t[i].top_ids[j] : -1;
        r->tokens[id][r->n[id]++] = t[i].token;
    }
}

static bool in_top5(const int32_t *top, int32_t tok) {
    for (int j = 0; j < 5; j++)
        if (top[j] == tok) return true;
    return false;
}

static void on_finished(void *user, uint64_t id, const eng_finish_info *f) {
    run *r = user;
    if (f->reason == ENG_FINISH_ERROR) {
        fprintf(stderr, "spec_bench: stream %llu: %s\n", (unsigned long long)id, f->message);
        r->failed = true;
    }
}

static int32_t force(void *user, uint64_t id, int gen_index, int32_t drafted) {
    run *r = user;
    if (!r->ref || r->accept < 0) return drafted;
    const int32_t want = r->ref[id][gen_index];
    const double u = (double)(splitmix(&r->coin) >> 11) * 0x1.0p-53;
    return u < r->accept ? want : (want + 1) % r->vocab;
}

typedef struct result {
    double wall, ms_token, ms_step;
    long tokens;
    eng_stats st;
} result;

/* One run of B streams with k drafts a step; fills r->tokens. false on an engine error. */
static bool run_once(mt_model *m, int B, int k, int max_new, int plen, const int32_t *stream, int n_stream,
                     float temperature, bool mixed_steps, run *r, result *out) {
    const int V = mt_model_describe(m).vocab_size;
    eng_params ep = eng_default_params();
    ep.max_sequences = B;
    ep.max_context = plen + max_new;
    ep.spec_tokens = k;
    ep.mixed_steps = mixed_steps;
    ep.spec_draft_hook = force;
    ep.spec_hook_user = r;
    eng_callbacks cb = { .user = r, .on_tokens = on_tokens, .on_finished = on_finished };
    eng_engine *e = NULL;
    mt_error err = { "" };
    if (eng_new(m, &ep, &cb, &e, &err) != MT_OK) {
        fprintf(stderr, "spec_bench: %s\n", err.msg);
        return false;
    }
    int32_t *prompt = malloc(sizeof(int32_t) * (size_t)plen);
    eng_request q = eng_default_request();
    q.prompt = prompt;
    q.n_prompt = plen;
    q.max_new_tokens = max_new;
    q.ignore_eos = true;
    if (r->top) {
        q.logprobs = true;
        q.top_logprobs = 5;
    }
    if (temperature > 0) {
        q.sampling.temperature = temperature;
        q.has_seed = true;
    }
    for (int i = 0; i < B; i++) r->n[i] = 0;
    r->coin = 0x5EEDull;
    r->failed = false;
    const double t0 = mt_now();
    for (int i = 0; i < B; i++) {
        for (int j = 0; j < plen; j++)
            prompt[j] = stream && n_stream > 0 ? stream[((size_t)i * plen + j) % (size_t)n_stream]
                                               : (int32_t)(((int64_t)i * 7 + j) % V);
        q.seed = 77 + (uint64_t)i;
        if (eng_submit(e, (uint64_t)i, &q, 0, &err) != MT_OK) {
            fprintf(stderr, "spec_bench: %s\n", err.msg);
            r->failed = true;
            break;
        }
    }
    while (!r->failed && eng_has_work(e)) eng_step(e, NULL);
    out->wall = mt_now() - t0;
    eng_get_stats(e, &out->st);
    eng_free(e);
    free(prompt);
    out->tokens = 0;
    for (int i = 0; i < B; i++) out->tokens += r->n[i];
    out->ms_token = 1e3 * out->wall / (double)(out->tokens ? out->tokens : 1);
    out->ms_step = 1e3 * out->wall / (double)(out->st.steps ? out->st.steps : 1);
    return !r->failed && out->tokens == (long)B * max_new;
}

/* Most values a list option (--batches, --ks, --accept) takes. */
#define SB_LIST_MAX 16

/* A list "1,2,4" into v[cap]; -1 when malformed or longer than cap. */
static int parse_list(const char *s, double *v, int cap) {
    int n = 0;
    for (const char *p = s; *p;) {
        char *end;
        if (n == cap) return -1;
        v[n++] = strtod(p, &end);
        if (end == p) return -1;
        p = *end == ',' ? end + 1 : end;
    }
    return n;
}

/* "stream_ids" of a heldout_ppl.json. */
static int32_t *read_stream(const char *path, int *n) {
    json_object *o = json_object_from_file(path), *a = NULL;
    if (!o || !json_object_object_get_ex(o, "stream_ids", &a) || !json_object_is_type(a, json_type_array)) {
        if (o) json_object_put(o);
        return NULL;
    }
    *n = (int)json_object_array_length(a);
    int32_t *v = malloc(sizeof(int32_t) * (size_t)(*n > 0 ? *n : 1));
    for (int i = 0; v && i < *n; i++) v[i] = json_object_get_int(json_object_array_get_idx(a, (size_t)i));
    json_object_put(o);
    return v;
}

int main(int argc, char **argv) {
    const char *model = NULL, *backend = "cpu", *stream_path = NULL, *accept_s = "0,0.5,0.8,1", *numerics = "bf16";
    double batches[SB_LIST_MAX] = { 1, 32 }, ks[SB_LIST_MAX] = { 1, 2, 3 }, accepts[SB_LIST_MAX];
    int n_batches = 2, n_ks = 3, max_new = 128, plen = 32, threads = 0, mixed_steps = 0, verify_seqs = 0, top5 = 0;
    int moe_grouped_max = 0, op_profile = 0;
    float temperature = 0;
    for (int i = 1; i + 1 < argc; i += 2) {
        const char *a = argv[i], *v = argv[i + 1];
        if (!strcmp(a, "--model")) model = v;
        else if (!strcmp(a, "--backend")) backend = v;
        else if (!strcmp(a, "--batches")) n_batches = parse_list(v, batches, SB_LIST_MAX);
        else if (!strcmp(a, "--ks")) n_ks = parse_list(v, ks, SB_LIST_MAX);
        else if (!strcmp(a, "--accept")) accept_s = v;
        else if (!strcmp(a, "--temperature")) temperature = (float)atof(v);
        else if (!strcmp(a, "--max-new")) max_new = atoi(v);
        else if (!strcmp(a, "--prompt-len")) plen = atoi(v);
        else if (!strcmp(a, "--stream")) stream_path = v;
        else if (!strcmp(a, "--threads")) threads = atoi(v);
        else if (!strcmp(a, "--numerics")) numerics = v;
        else if (!strcmp(a, "--mixed-steps")) mixed_steps = atoi(v);
        else if (!strcmp(a, "--verify-seqs")) verify_seqs = atoi(v);
        else if (!strcmp(a, "--top5")) top5 = atoi(v);
        else if (!strcmp(a, "--moe-grouped-max")) moe_grouped_max = atoi(v);
        else if (!strcmp(a, "--op-profile")) op_profile = atoi(v);
        else { fprintf(stderr, "spec_bench: unknown option %s\n", a); return 2; }
    }
    const bool real = !strcmp(accept_s, "real");
    const int n_acc = real ? 1 : parse_list(accept_s, accepts, SB_LIST_MAX);
    if (real) accepts[0] = -1;
    if (!model || n_batches < 1 || n_ks < 1 || n_acc < 1 || max_new < 2 || plen < 1 || (temperature > 0 && !real) ||
        verify_seqs < 0 || verify_seqs > ENG_SPEC_GROUP_MAX) {
        fprintf(stderr, "usage: spec_bench --model DIR|random:PRESET+mtp [--backend cpu|cuda] [--batches 1,32] "
                        "[--ks 1,2,3] [--accept 0,0.5,0.8,1|real] [--temperature T (with real)] [--max-new N] "
                        "[--prompt-len P] [--stream heldout_ppl.json] [--threads N] [--numerics bf16|exact] "
                        "[--mixed-steps 0|1] [--verify-seqs N (1 .. 64)] [--top5 0|1] [--moe-grouped-max N] [--op-profile 0|1]\n");
        return 2;
    }
    int n_stream = 0;
    int32_t *stream = stream_path ? read_stream(stream_path, &n_stream) : NULL;
    if (stream_path && !stream) {
        fprintf(stderr, "spec_bench: %s: no stream_ids\n", stream_path);
        return 2;
    }
    mt_error err = { "" };
    const bool cuda = !strcmp(backend, "cuda");
    mt_cuda_params cp = mt_cuda_default_params();
    if (!mt_numerics_parse(numerics, &cp.numerics) || cp.numerics == MT_NUMERICS_FP32) {
        fprintf(stderr, "spec_bench: --numerics must be bf16 or exact, got \"%s\"\n", numerics);
        return 2;
    }
    if (moe_grouped_max > 0) cp.moe_grouped_max_rows = moe_grouped_max;
    const bool must_equal = !cuda || cp.numerics == MT_NUMERICS_EXACT;
    mt_backend *be = cuda ? mt_cuda_backend_new(0, &cp, &err) : mt_cpu_backend_new(threads);
    mt_model_params mp = mt_model_default_params();
    mp.mtp = true;
    mt_model *m = NULL;
    for (int i = 0; i < n_batches; i++) /* every batch's verifies in one model call */
        mp.verify_seqs = (int)batches[i] > mp.verify_seqs ? (int)batches[i] : mp.verify_seqs;
    if (mp.verify_seqs > ENG_SPEC_GROUP_MAX) mp.verify_seqs = ENG_SPEC_GROUP_MAX;
    if (verify_seqs > 0) mp.verify_seqs = verify_seqs;
    if (!be || mt_model_load(model, be, &mp, &m, &err) != MT_OK) {
        fprintf(stderr, "spec_bench: %s\n", err.msg);
        return 1;
    }
    const mt_model_info info = mt_model_describe(m);
    if (!info.has_drafter) {
        fprintf(stderr, "spec_bench: %s has no MTP block\n", model);
        return 1;
    }
    int rc = 0, bmax = 1;
    for (int i = 0; i < n_batches; i++) bmax = (int)batches[i] > bmax ? (int)batches[i] : bmax;
    run r = { .vocab = info.vocab_size };
    r.tokens = calloc((size_t)bmax, sizeof *r.tokens);
    r.n = calloc((size_t)bmax, sizeof *r.n);
    int32_t **ref = calloc((size_t)bmax, sizeof *ref), **ref_top = NULL;
    for (int i = 0; i < bmax; i++) {
        r.tokens[i] = malloc(sizeof(int32_t) * (size_t)max_new);
        ref[i] = malloc(sizeof(int32_t) * (size_t)max_new);
    }
    if (top5 && temperature <= 0) {
        r.top = calloc((size_t)bmax, sizeof *r.top);
        ref_top = calloc((size_t)bmax, sizeof *ref_top);
        for (int i = 0; i < bmax; i++) {
            r.top[i] = malloc(sizeof(int32_t) * (size_t)max_new * 5);
            ref_top[i] = malloc(sizeof(int32_t) * (size_t)max_new * 5);
        }
    }
    printf("model %s, backend %s, %d new tokens a stream after %d prompt tokens%s%s, %s%s, verifies of up to %d "
           "sequences a model call\n", model, backend, max_new, plen, stream_path ? " from " : "",
           stream_path ? stream_path : "", temperature > 0 ? "sampled" : "greedy", mixed_steps ? ", mixed steps" : "",
           mp.verify_seqs);
    if (temperature > 0) printf("temperature %.2f\n", temperature);
    { /* warm-up: weights touched, graphs captured */
        result w;
        run_once(m, 1, 0, 8, plen, stream, n_stream, 0, mixed_steps, &r, &w);
        run_once(m, 1, (int)ks[0], 8, plen, stream, n_stream, 0, mixed_steps, &r, &w);
    }
    /* every run's figures, for the table across batches: [batch][1 + ki * n_acc + ai], 0 = K = 0 */
    const int n_cols = 1 + n_ks * n_acc;
    result *all = calloc((size_t)n_batches * (size_t)n_cols, sizeof *all);
    bool *ran = calloc((size_t)n_batches * (size_t)n_cols, sizeof *ran);
    for (int bi = 0; bi < n_batches; bi++) {
        const int B = (int)batches[bi];
        result base;
        r.ref = NULL;
        if (!run_once(m, B, 0, max_new, plen, stream, n_stream, temperature, mixed_steps, &r, &base)) { rc = 1; break; }
        all[(size_t)bi * n_cols] = base;
        ran[(size_t)bi * n_cols] = true;
        for (int i = 0; i < B; i++) memcpy(ref[i], r.tokens[i], sizeof(int32_t) * (size_t)max_new);
        for (int i = 0; i < B && ref_top; i++) memcpy(ref_top[i], r.top[i], sizeof(int32_t) * (size_t)max_new * 5);
        printf("\nbatch %d\n| K | acceptance | ms a token | speed-up | drafts accepted | tokens a verify step | ms a step |\n"
               "|---:|---:|---:|---:|---:|---:|---:|\n", B);
        printf("| 0 | - | %.4f | 1.00 | - | - | %.4f |\n", base.ms_token, base.ms_step);
        for (int ki = 0; ki < n_ks; ki++)
            for (int ai = 0; ai < n_acc; ai++) {
                const int k = (int)ks[ki];
                result x;
                r.ref = real ? NULL : ref;
                r.accept = accepts[ai];
                if (!run_once(m, B, k, max_new, plen, stream, n_stream, temperature, mixed_steps, &r, &x)) { rc = 1; break; }
                all[(size_t)bi * n_cols + 1 + (size_t)ki * n_acc + ai] = x;
                ran[(size_t)bi * n_cols + 1 + (size_t)ki * n_acc + ai] = true;
                /* streams that left K = 0's output, and where the earliest left it */
                int left = 0, first = max_new, beyond = 0;
                for (int i = 0; i < B && temperature <= 0; i++) {
                    int t = 0;
                    while (t < max_new && r.tokens[i][t] == ref[i][t]) t++;
                    left += t < max_new;
                    first = t < first ? t : first;
                    if (t < max_new && ref_top)
                        beyond += !in_top5(ref_top[i] + (size_t)t * 5, r.tokens[i][t]) ||
                                  !in_top5(r.top[i] + (size_t)t * 5, ref[i][t]);
                }
                char note[160] = "";
                if (left && must_equal) snprintf(note, sizeof note, " OUTPUT DIFFERS");
                else if (left) snprintf(note, sizeof note, " (bf16: %d of %d streams leave K = 0's output, first at token %d)",
                                        left, B, first);
                if (left && ref_top) {
                    const size_t u = strlen(note);
                    if (beyond) snprintf(note + u, sizeof note - u, " %d BEYOND THE OTHER'S TOP 5", beyond);
                    else snprintf(note + u, sizeof note - u, " (each within the other's top 5)");
                }
                if (beyond) rc = 1;
                const double acc = x.st.draft_tokens ? (double)x.st.accepted_tokens / x.st.draft_tokens : 0;
                const double per = x.st.spec_steps ? (double)(x.st.accepted_tokens + x.st.spec_steps) / x.st.spec_steps : 0;
                char want[32];
                snprintf(want, sizeof want, real ? "real" : "%.0f%%", 100 * accepts[ai]);
                printf("| %d | %s | %.4f | %.2f | %.3f | %.3f | %.4f |%s\n", k, want, x.ms_token,
                       base.ms_token / x.ms_token, acc, per, x.ms_step, note);
                if (left && must_equal) rc = 1;
            }
        if (op_profile && cuda && rc == 0) {
            result px;
            char title[160];
            for (int pass = 0; pass < 2; pass++) {
                const int k = pass ? (int)ks[0] : 0;
                r.ref = pass && !real ? ref : NULL;
                r.accept = accepts[0];
                mt_cuda_profile(be, true, "spec_bench");
                const bool ok = run_once(m, B, k, max_new, plen, stream, n_stream, temperature, mixed_steps, &r, &px);
                snprintf(title, sizeof title, "spec_bench: batch %d, K = %d, every op synchronised (graph replays as one)",
                         B, k);
                mt_cuda_profile(be, false, title);
                if (!ok) rc = 1;
            }
        }
        fflush(stdout);
    }
    /* across batches: where speculation stops paying */
    printf("\nms a token (ms a step) by batch; speed-up over K = 0 in brackets\n| batch | K = 0 |");
    for (int ki = 0; ki < n_ks; ki++)
        for (int ai = 0; ai < n_acc; ai++) {
            if (real) printf(" K = %d |", (int)ks[ki]);
            else printf(" K = %d, %.0f%% |", (int)ks[ki], 100 * accepts[ai]);
        }
    printf("\n|---:|---:|");
    for (int c = 1; c < n_cols; c++) printf("---:|");
    printf("\n");
    for (int bi = 0; bi < n_batches; bi++) {
        const result *row = all + (size_t)bi * n_cols;
        const bool *got = ran + (size_t)bi * n_cols;
        if (!got[0]) continue;
        printf("| %d | %.4f (%.4f) |", (int)batches[bi], row[0].ms_token, row[0].ms_step);
        for (int c = 1; c < n_cols; c++) {
            if (got[c]) printf(" %.4f (%.4f) [%.2f] |", row[c].ms_token, row[c].ms_step, row[0].ms_token / row[c].ms_token);
            else printf(" - |");
        }
        printf("\n");
    }
    free(all);
    free(ran);
    if (rc) fprintf(stderr, "spec_bench: a run failed or its greedy output differs from K = 0\n");
    mt_model_free(m);
    mt_backend_free(be);
    return rc;
}
