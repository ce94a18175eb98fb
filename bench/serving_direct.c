/* bench/serving_direct.c: the reference side of bench/serving_bench.py and
 * bench/openloop_bench.py --direct. Runs requests straight through the engine (worker/engine, no
 * router, no ZeroMQ, no gRPC) and prints one JSON object with the figures the driver compares:
 * tokens/s over the run, time to first token, and the per-token latency (the interval between
 * consecutive tokens of a stream).
 *
 *   serving_direct --model DIR|random:PRESET --streams C [--max-new N] [--prompt-len P]
 *                  [--backend cpu|cuda] [--threads N] [--run-ahead 0|1]
 *   serving_direct --model DIR --prompt-mix A,B,.. --new-mix X,Y,.. --requests N [--seed S]
 *                  [--shared-prefix K] [--max-sequences M] [--backend cpu|cuda] [--threads N]
 * (random:PRESET, e.g. random:bench-4L: glm_config_preset's shapes with random weights made by the
 *  backend; --run-ahead 0: eng_params.run_ahead off, for comparison; 1, the default: AUTO;
 *  --mixed-steps 0|1, --itl-target-ms MS, --prefill-hold-ms MS and --prefill-layers N:
 *  eng_params.mixed_steps, itl_target_ms, prefill_hold_ms and prefill_layers (by default 1
 *  with mixed steps on cuda), --layered-max-waiting N: eng_params.layered_max_waiting,
 *  --prefill-sites 0|1: mt_model_params.layered_sites, --prefill-expert-parts P:
 *  mt_model_params.layered_expert_parts, --fine-units-max-rows N: eng_params.fine_units_max_rows
 *  (by default what metrale-worker picks, wkr_layering_of), as the
 *  worker's options (--mixed-steps 0 is its --separate-steps; by default mixed on cuda, separate
 *  on the CPU, as the worker); --prefill-budget N: eng_params.prefill_budget and --prefill-pass
 *  N: rows of a prefill pass, by default what metrale-worker picks (wkr_prefill_budget and
 *  wkr_prefill_pass);
 *  --pack-projections 1: mt_model_params.pack_projections on (the projection groups packed);
 *  --moe-wide-down 1 and --attend-rows 64 (cuda): mt_cuda_params.moe_wg_wide_down and
 *  mla_attend_rows, the prefill kernels' alternative tiles;
 *  --op-profile 1 (a mix on cuda): every op synchronised and timed, the table printed after the
 *  JSON, so its times are not the run's; --speculative-tokens K and --speculative-max-batch B:
 *  eng_params.spec_tokens and spec_max_batch with the model's drafter (a checkpoint with an MTP
 *  block, or random:PRESET+mtp), the model's verify_seqs as metrale-worker sets it; with
 *  --mixed-steps 1 the verifies join the step's one model call.)
 *
 * Fixed lengths (no --prompt-mix): stream i's prompt is token (i * 7 + k) % vocab for k < P,
 * greedy, ignore_eos, max_new N; all C are submitted at t = 0 with max_sequences = C (the worker
 * runs with --max-sequences C too).
 *
 * A mix (--prompt-mix and --new-mix): the engine's own figure for openloop_bench's mix. Request j
 * draws its prompt length, then its new tokens, uniformly from the lists, in request order, the
 * order openloop_bench draws them; the generator is this file's splitmix64 seeded with S, so the
 * draws are reproducible here but not the ones Python's random draws for the same seed. Its prompt
 * is K shared tokens (k * 17 + 3) % vocab, then openloop_bench's per-request tokens (mix_prompt).
 * All N are submitted at t = 0 with max_sequences = M (default 64; the rest wait in the engine).
 * The JSON adds TTFT and ITL p50/p99 (ITL over every interval between consecutive tokens), the
 * requests that gave all their tokens, the engine's prefix hits (requests that reused a kept
 * prefix; the warm-up's prompt keeps none), and the steps' wall time split between steps that ran
 * prompt chunks (with the prompt tokens they ran) and decode-only steps, with the output tokens of
 * each kind; the steady state (the steps that began with requests waiting: their time, tokens and
 * rate); and on cuda host_wait_s, the time the host spent blocked on the device
 * (mt_cuda_wait_seconds): what is left of the wall time is the host's own work, which sets the
 * pace where the device waits for it; and device_gap_s, the device's idle time between the
 * host's waits and its next ops (mt_cuda_gap_seconds). Both JSON forms give the
 * run's speculative figures: verify steps, drafts, drafts accepted, and the steps whose verifies
 * rode in one model call with decode rows or prompt chunks (spec_mixed_steps).
 *
 * A warm-up request runs first (page faults of the weight mapping, first-touch of buffers).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "worker/engine/engine.h"
#include "worker/loop.h"
#include "worker/model/model.h"

/* The verifies one model call takes at most, as metrale-worker caps them (WKR_VERIFY_SEQS_MAX). */
#define SD_VERIFY_SEQS_MAX 16

typedef struct stream_rec {
    double first, last;   /* token arrival times */
    double gap_sum;       /* sum of intervals between consecutive tokens */
    int n;
    bool done;
} stream_rec;

typedef struct bench {
    stream_rec *s;        /* [streams] */
    double *gaps;         /* every inter-token interval, for percentiles */
    size_t n_gaps, cap_gaps;
    double t0;
    int finished;
} bench;

static void on_tokens(void *user, uint64_t id, const eng_sample_result *t, int n) {
    (void)t;
    bench *b = user;
    stream_rec *r = &b->s[id];
    const double now = mt_now();
    for (int i = 0; i < n; i++) {
        if (r->n == 0) r->first = now;
        else {
            const double g = now - r->last;
            r->gap_sum += g;
            if (b->n_gaps < b->cap_gaps) b->gaps[b->n_gaps++] = g;
        }
        r->last = now;
        r->n++;
    }
}

static void on_finished(void *user, uint64_t id, const eng_finish_info *f) {
    bench *b = user;
    if (f->reason == ENG_FINISH_ERROR) fprintf(stderr, "serving_direct: stream %llu: %s\n", (unsigned long long)id, f->message);
    b->s[id].done = true;
    b->finished++;
}

static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

#define MIX_MAX 32 /* lengths a mix list may hold */

/* A list of lengths from "16,64,256": n of them into v[MIX_MAX], each >= lo. -1 when malformed. */
static int parse_mix(const char *s, int lo, int *v) {
    int n = 0;
    while (*s) {
        char *end;
        const long x = strtol(s, &end, 10);
        if (end == s || x < lo || x > 1 << 20 || n == MIX_MAX || (*end && *end != ',')) return -1;
        v[n++] = (int)x;
        s = *end ? end + 1 : end;
    }
    return n;
}

/* splitmix64: the mix's draws, reproducible from the seed (not Python's Mersenne Twister). */
static uint64_t mix_next(uint64_t *state) {
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Request j's prompt, as openloop_bench.py makes it: `shared` tokens common to every request, then
 * plen of its own, the first two spelling j in base vocab so that no two requests share more. */
static void mix_prompt(int32_t *out, int shared, int plen, int64_t j, int V) {
    for (int k = 0; k < shared; k++) out[k] = (int32_t)(((int64_t)k * 17 + 3) % V);
    for (int k = 0; k < plen; k++) {
        const int64_t t = k == 0 ? j % V : k == 1 ? (j / V) % V : (j * 131 + (int64_t)k * 7 + 1) % V;
        out[shared + k] = (int32_t)t;
    }
}

/* The speculative figures of the run (st less the warm-up's st0), as JSON members after a comma. */
static void print_spec(const eng_stats *st, const eng_stats *st0, int spec_tokens) {
    printf(", \"speculative_tokens\": %d, \"spec_steps\": %llu, \"draft_tokens\": %llu, \"accepted_tokens\": %llu, "
           "\"spec_mixed_steps\": %llu",
           spec_tokens, (unsigned long long)(st->spec_steps - st0->spec_steps),
           (unsigned long long)(st->draft_tokens - st0->draft_tokens),
           (unsigned long long)(st->accepted_tokens - st0->accepted_tokens),
           (unsigned long long)(st->spec_mixed_steps - st0->spec_mixed_steps));
}

static double pct_sorted(const double *x, size_t n, double q) {
    return n ? x[(size_t)(q * (double)(n - 1))] : 0;
}

/* The mix: n requests of the drawn shapes, all submitted now; prints the JSON. 0 when every
 * request gave its tokens. */
static int run_mix(eng_engine *e, mt_backend *be, bench *b, int V, int n, const int *plens, const int *news, int shared,
                   int max_sequences, const char *backend, int32_t *prompt, int spec_tokens) {
    mt_error err = { "" };
    eng_request r = eng_default_request();
    r.prompt = prompt;
    r.ignore_eos = true;
    long want = 0;
    b->t0 = mt_now();
    for (int j = 0; j < n; j++) {
        mix_prompt(prompt, shared, plens[j], j, V);
        r.n_prompt = shared + plens[j];
        r.max_new_tokens = news[j];
        want += news[j];
        if (eng_submit(e, (uint64_t)j, &r, 0, &err) != MT_OK) {
            fprintf(stderr, "serving_direct: request %d: %s\n", j, err.msg);
            return 1;
        }
    }
    /* where the time goes: steps that ran prompt work against decode-only steps (a run-ahead
     * step's time is the device step it waits for). A step ran prompt work when it completed
     * chunks (prefill_tokens counts them then) or carried a layered group some layers on. */
    /* and the steady state: the steps that began with requests waiting (every place taken or
     * about to be), apart from the first requests' ramp and the last ones' drain */
    double chunk_ms = 0, decode_ms = 0, backlog_ms = 0;
    long chunk_steps = 0, decode_steps = 0, chunk_tokens = 0, decode_tokens = 0, backlog_tokens = 0;
    eng_stats st, st0;
    eng_get_stats(e, &st);
    st0 = st;
    uint64_t pt0 = st.prefill_tokens, ls0 = st.layered_steps, tok0 = st.tokens_generated;
    const uint64_t prompt0 = pt0;
    const bool gpu = !strcmp(backend, "cuda");
    const double wait0 = gpu ? mt_cuda_wait_seconds(be) : 0, gap0 = gpu ? mt_cuda_gap_seconds(be) : 0;
    while (eng_has_work(e)) {
        const bool backlog = st.waiting > 0;
        const double t = mt_now();
        eng_step(e, NULL);
        const double ms = (mt_now() - t) * 1e3;
        eng_get_stats(e, &st);
        const long got = (long)(st.tokens_generated - tok0);
        if (st.prefill_tokens != pt0 || st.layered_steps != ls0) chunk_ms += ms, chunk_steps++, chunk_tokens += got;
        else decode_ms += ms, decode_steps++, decode_tokens += got;
        if (backlog) backlog_ms += ms, backlog_tokens += got;
        pt0 = st.prefill_tokens;
        ls0 = st.layered_steps;
        tok0 = st.tokens_generated;
    }
    const double wall = mt_now() - b->t0;
    const double wait = gpu ? mt_cuda_wait_seconds(be) - wait0 : 0, gap = gpu ? mt_cuda_gap_seconds(be) - gap0 : 0;

    double *ttft = malloc(sizeof(double) * (size_t)n);
    if (!ttft) { fprintf(stderr, "serving_direct: out of memory\n"); return 1; }
    long tokens = 0;
    int done = 0;
    for (int j = 0; j < n; j++) {
        tokens += b->s[j].n;
        done += b->s[j].done && b->s[j].n == news[j];
        ttft[j] = b->s[j].n ? b->s[j].first - b->t0 : wall;
    }
    qsort(ttft, (size_t)n, sizeof(double), cmp_double);
    qsort(b->gaps, b->n_gaps, sizeof(double), cmp_double);
    printf("{\"mode\": \"mix\", \"requests\": %d, \"requests_done\": %d, \"tokens\": %ld, \"tokens_expected\": %ld, "
           "\"wall_s\": %.6f, \"tok_per_s\": %.3f, \"ttft_p50_ms\": %.3f, \"ttft_p99_ms\": %.3f, "
           "\"itl_p50_ms\": %.3f, \"itl_p99_ms\": %.3f, \"shared_prefix\": %d, \"prefix_hits\": %llu, "
           "\"max_sequences\": %d, \"steps\": %llu, \"mixed_steps\": %llu, \"ahead_steps\": %llu, "
           "\"held_steps\": %llu, \"layered_steps\": %llu, "
           "\"ms_per_step\": %.3f, \"chunk_steps\": %ld, \"chunk_steps_ms\": %.1f, \"prompt_tokens\": %llu, "
           "\"decode_steps\": %ld, \"decode_steps_ms\": %.1f, \"chunk_steps_tokens\": %ld, \"decode_steps_tokens\": %ld, "
           "\"backlog_s\": %.3f, \"backlog_tokens\": %ld, \"backlog_tok_per_s\": %.1f, \"host_wait_s\": %.3f, "
           "\"device_gap_s\": %.3f, \"backend\": \"%s\"",
           n, done, tokens, want, wall, tokens / wall, 1e3 * pct_sorted(ttft, (size_t)n, 0.5),
           1e3 * pct_sorted(ttft, (size_t)n, 0.99), 1e3 * pct_sorted(b->gaps, b->n_gaps, 0.5),
           1e3 * pct_sorted(b->gaps, b->n_gaps, 0.99), shared,
           (unsigned long long)st.prefix_hits, max_sequences, (unsigned long long)st.steps,
           (unsigned long long)st.mixed_steps, (unsigned long long)st.ahead_steps,
           (unsigned long long)st.held_steps, (unsigned long long)st.layered_steps, st.steps ? 1e3 * wall / (double)st.steps : 0.0, chunk_steps, chunk_ms,
           (unsigned long long)(st.prefill_tokens - prompt0), decode_steps, decode_ms, chunk_tokens, decode_tokens,
           backlog_ms / 1e3, backlog_tokens, backlog_ms > 0 ? backlog_tokens / (backlog_ms / 1e3) : 0.0, wait, gap, backend);
    print_spec(&st, &st0, spec_tokens);
    printf("}\n");
    free(ttft);
    if (done != n) fprintf(stderr, "serving_direct: %d of %d requests gave their tokens\n", done, n);
    return done == n ? 0 : 1;
}

int main(int argc, char **argv) {
    const char *model = NULL, *backend = "cpu", *prompt_mix = NULL, *new_mix = NULL;
    int streams = 1, max_new = 32, plen = 16, threads = 0, run_ahead = 1, mixed_steps = -1;
    double itl_target_ms = 0, prefill_hold_ms = 0;
    int prefill_layers = -1, layered_max_waiting = 0, prefill_sites = -1, expert_parts = -1, fine_rows = -1;
    int prefill_pass = 0, prefill_budget = 0, op_profile = 0, pack = 0;
    mt_cuda_params cp = mt_cuda_default_params();
    int requests = 0, shared = 0, max_sequences = 64, spec_tokens = 0, spec_max_batch = 0;
    uint64_t seed = 1;
    for (int i = 1; i + 1 < argc; i += 2) {
        const char *a = argv[i], *v = argv[i + 1];
        if (!strcmp(a, "--model")) model = v;
        else if (!strcmp(a, "--backend")) backend = v;
        else if (!strcmp(a, "--streams")) streams = atoi(v);
        else if (!strcmp(a, "--max-new")) max_new = atoi(v);
        else if (!strcmp(a, "--prompt-len")) plen = atoi(v);
        else if (!strcmp(a, "--threads")) threads = atoi(v);
        else if (!strcmp(a, "--run-ahead")) run_ahead = atoi(v);
        else if (!strcmp(a, "--mixed-steps")) mixed_steps = atoi(v);
        else if (!strcmp(a, "--itl-target-ms")) itl_target_ms = atof(v);
        else if (!strcmp(a, "--prefill-hold-ms")) prefill_hold_ms = atof(v);
        else if (!strcmp(a, "--prefill-layers")) prefill_layers = atoi(v);
        else if (!strcmp(a, "--layered-max-waiting")) layered_max_waiting = atoi(v);
        else if (!strcmp(a, "--prefill-sites")) prefill_sites = atoi(v);
        else if (!strcmp(a, "--prefill-expert-parts")) expert_parts = atoi(v);
        else if (!strcmp(a, "--fine-units-max-rows")) fine_rows = atoi(v);
        else if (!strcmp(a, "--prefill-pass")) prefill_pass = atoi(v);
        else if (!strcmp(a, "--prefill-budget")) prefill_budget = atoi(v);
        else if (!strcmp(a, "--op-profile")) op_profile = atoi(v);
        else if (!strcmp(a, "--pack-projections")) pack = atoi(v);
        else if (!strcmp(a, "--moe-wide-down")) cp.moe_wg_wide_down = atoi(v) != 0;
        else if (!strcmp(a, "--attend-rows")) cp.mla_attend_rows = atoi(v);
        else if (!strcmp(a, "--prompt-mix")) prompt_mix = v;
        else if (!strcmp(a, "--new-mix")) new_mix = v;
        else if (!strcmp(a, "--requests")) requests = atoi(v);
        else if (!strcmp(a, "--seed")) seed = strtoull(v, NULL, 10);
        else if (!strcmp(a, "--shared-prefix")) shared = atoi(v);
        else if (!strcmp(a, "--max-sequences")) max_sequences = atoi(v);
        else if (!strcmp(a, "--speculative-tokens")) spec_tokens = atoi(v);
        else if (!strcmp(a, "--speculative-max-batch")) spec_max_batch = atoi(v);
        else { fprintf(stderr, "serving_direct: unknown option %s\n", a); return 2; }
    }
    const bool mix = prompt_mix || new_mix;
    int pm[MIX_MAX], nm[MIX_MAX], n_pm = 0, n_nm = 0;
    if (mix) {
        n_pm = prompt_mix ? parse_mix(prompt_mix, 1, pm) : -1;
        n_nm = new_mix ? parse_mix(new_mix, 1, nm) : -1;
    }
    if (!model || spec_tokens < 0 || spec_tokens > ENG_SPEC_MAX || spec_max_batch < 0 ||
        (!mix && (streams < 1 || max_new < 2 || plen < 1)) ||
        (mix && (n_pm < 1 || n_nm < 1 || requests < 1 || shared < 0 || max_sequences < 1))) {
        fprintf(stderr, "usage: serving_direct --model DIR --streams C [--max-new N>=2] [--prompt-len P] "
                        "[--backend cpu|cuda] [--threads N]\n"
                        "       serving_direct --model DIR --prompt-mix A,B,.. --new-mix X,Y,.. --requests N "
                        "[--seed S] [--shared-prefix K] [--max-sequences M] [--backend cpu|cuda] [--threads N]\n"
                        "  either form: [--mixed-steps 0|1] [--speculative-tokens K (0 .. 4)] [--speculative-max-batch B]\n"
                        "  (a mix's draws are reproducible from S, but not those Python's random makes from S)\n");
        return 2;
    }
    int *plens = NULL, *news = NULL;
    if (mix) { /* the draws, before anything else, in openloop_bench's order: prompt, then new */
        uint64_t st = seed;
        plens = malloc(sizeof(int) * (size_t)requests);
        news = malloc(sizeof(int) * (size_t)requests);
        if (!plens || !news) { fprintf(stderr, "serving_direct: out of memory\n"); free(plens); free(news); return 1; }
        plen = max_new = 0;
        for (int j = 0; j < requests; j++) {
            plens[j] = pm[mix_next(&st) % (uint64_t)n_pm];
            news[j] = nm[mix_next(&st) % (uint64_t)n_nm];
        }
        for (int k = 0; k < n_pm; k++) plen = pm[k] > plen ? pm[k] : plen;
        for (int k = 0; k < n_nm; k++) max_new = nm[k] > max_new ? nm[k] : max_new;
        plen += shared;
        streams = requests; /* record slots: one per request, the warm-up's after them */
    }
    const bool gpu = !strcmp(backend, "cuda");
    mt_error err = { "" };
    mt_backend *be = gpu ? mt_cuda_backend_new(0, &cp, &err) : mt_cpu_backend_new(threads);
    mt_model *m = NULL;
    eng_engine *e = NULL;
    int32_t *prompt = malloc(sizeof(int32_t) * (size_t)plen);
    bench b = { .s = calloc((size_t)streams + 1, sizeof(stream_rec)) };
    b.cap_gaps = (size_t)streams * (size_t)max_new;
    b.gaps = malloc(sizeof(double) * b.cap_gaps);
    int rc = 1;
    if (!be || !prompt || !b.s || !b.gaps) { fprintf(stderr, "serving_direct: %s\n", err.msg[0] ? err.msg : "out of memory"); goto done; }
    mt_model_params mp = mt_model_default_params();
    mp.pack_projections = pack != 0;
    /* the prompt budget and the pass rows as metrale-worker picks them */
    wkr_params wp = wkr_default_params();
    wp.prefill_budget = prefill_budget;
    wp.prefill_pass = prefill_pass;
    wp.max_sequences = mix ? max_sequences : streams;
    mp.prefill_chunk = wkr_prefill_pass(&wp, gpu);
    mp.mtp = spec_tokens > 0;
    wp.prefill_sites = prefill_sites;
    wp.prefill_expert_parts = expert_parts;
    wp.fine_units_max_rows = fine_rows;
    const wkr_layering ly = wkr_layering_of(&wp, gpu);
    mp.layered_sites = ly.sites;
    mp.layered_expert_parts = ly.expert_parts;
    mp.layered_expert_parts_soft = ly.parts_soft;
    { /* the verifies of a step of up to spec_max_batch sequences in one call, as the worker */
        const int vs = spec_max_batch > 0 ? spec_max_batch : wp.max_sequences;
        mp.verify_seqs = vs < SD_VERIFY_SEQS_MAX ? vs : SD_VERIFY_SEQS_MAX;
    }
    if (mt_model_load(model, be, &mp, &m, &err) != MT_OK) {
        fprintf(stderr, "serving_direct: %s\n", err.msg);
        goto done;
    }
    if (spec_tokens > 0 && !mt_model_describe(m).has_drafter) {
        fprintf(stderr, "serving_direct: %s has no MTP block for --speculative-tokens\n", model);
        goto done;
    }
    const int V = mt_model_describe(m).vocab_size;
    eng_params ep = eng_default_params();
    ep.max_sequences = wp.max_sequences;
    ep.max_context = plen + max_new;
    if (mix && ep.max_waiting < requests) ep.max_waiting = requests;
    ep.run_ahead = run_ahead ? ENG_RUN_AHEAD_AUTO : ENG_RUN_AHEAD_OFF;
    ep.mixed_steps = mixed_steps >= 0 ? mixed_steps != 0 : gpu;
    ep.prefill_budget = wkr_prefill_budget(&wp, gpu);
    ep.itl_target_ms = itl_target_ms;
    ep.prefill_hold_ms = prefill_hold_ms;
    ep.prefill_layers = prefill_layers >= 0 ? prefill_layers : ep.mixed_steps && gpu ? 1 : 0;
    ep.layered_max_waiting = layered_max_waiting;
    ep.fine_units_max_rows = ly.fine_rows;
    ep.spec_tokens = spec_tokens;
    ep.spec_max_batch = spec_max_batch;
    eng_callbacks cb = { .user = &b, .on_tokens = on_tokens, .on_finished = on_finished };
    if (eng_new(m, &ep, &cb, &e, &err) != MT_OK) { fprintf(stderr, "serving_direct: %s\n", err.msg); goto done; }

    eng_request r = eng_default_request();
    r.prompt = prompt;
    r.n_prompt = mix ? (plen < 16 ? plen : 16) : plen;
    r.ignore_eos = true;
    /* warm-up: one short stream, id `streams` (its own record slot) */
    for (int k = 0; k < r.n_prompt; k++) prompt[k] = (int32_t)(k % V);
    r.max_new_tokens = 2;
    if (eng_submit(e, (uint64_t)streams, &r, 0, &err) != MT_OK) { fprintf(stderr, "serving_direct: %s\n", err.msg); goto done; }
    while (eng_has_work(e)) eng_step(e, NULL);
    memset(b.s, 0, sizeof(stream_rec) * (size_t)streams);
    b.finished = 0;
    b.n_gaps = 0;

    if (mix) {
        const bool prof = op_profile && gpu;
        if (prof) mt_cuda_profile(be, true, "serving_direct");
        rc = run_mix(e, be, &b, V, requests, plens, news, shared, max_sequences, backend, prompt, spec_tokens);
        if (prof) mt_cuda_profile(be, false, "serving_direct: the mix's ops, each synchronised (graph replays as one)");
        goto done;
    }
    r.n_prompt = plen;
    r.max_new_tokens = max_new;
    eng_stats st0, st;
    eng_get_stats(e, &st0);
    b.t0 = mt_now();
    for (int i = 0; i < streams; i++) {
        for (int k = 0; k < plen; k++) prompt[k] = (int32_t)(((int64_t)i * 7 + k) % V);
        if (eng_submit(e, (uint64_t)i, &r, 0, &err) != MT_OK) { fprintf(stderr, "serving_direct: %s\n", err.msg); goto done; }
    }
    while (eng_has_work(e)) eng_step(e, NULL);
    const double wall = mt_now() - b.t0;
    eng_get_stats(e, &st);

    long tokens = 0;
    double ttft = 0, itl = 0;
    for (int i = 0; i < streams; i++) {
        tokens += b.s[i].n;
        ttft += b.s[i].first - b.t0;
        itl += b.s[i].n > 1 ? b.s[i].gap_sum / (b.s[i].n - 1) : 0;
    }
    qsort(b.gaps, b.n_gaps, sizeof(double), cmp_double);
    const double p50 = b.n_gaps ? b.gaps[b.n_gaps / 2] : 0, p99 = b.n_gaps ? b.gaps[(size_t)(0.99 * (b.n_gaps - 1))] : 0;
    printf("{\"streams\": %d, \"tokens\": %ld, \"wall_s\": %.6f, \"tok_per_s\": %.3f, \"ttft_ms\": %.3f, "
           "\"itl_ms\": %.3f, \"itl_p50_ms\": %.3f, \"itl_p99_ms\": %.3f, \"backend\": \"%s\", \"run_ahead\": %d, "
           "\"steps\": %llu, \"ms_per_step\": %.4f",
           streams, tokens, wall, tokens / wall, 1e3 * ttft / streams, 1e3 * itl / streams, 1e3 * p50, 1e3 * p99,
           backend, run_ahead != 0, (unsigned long long)(st.steps - st0.steps),
           st.steps > st0.steps ? 1e3 * wall / (double)(st.steps - st0.steps) : 0.0);
    print_spec(&st, &st0, spec_tokens);
    printf("}\n");
    rc = tokens == (long)streams * max_new ? 0 : 1;
    if (rc) fprintf(stderr, "serving_direct: %ld tokens, expected %ld\n", tokens, (long)streams * max_new);
done:
    eng_free(e);
    mt_model_free(m);
    mt_backend_free(be);
    free(prompt);
    free(b.s);
    free(b.gaps);
    free(plens);
    free(news);
    return rc;
}
