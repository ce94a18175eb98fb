/* bench/serving_direct.c: the reference side of bench/serving_bench.py. Runs C concurrent
 * streams straight through the engine (worker/engine, no router, no ZeroMQ, no gRPC), the same
 * requests the driver sends through the service, and prints one JSON object with the figures
 * the driver compares: tokens/s over the run, time to first token, and the per-token latency
 * (the interval between consecutive tokens of a stream).
 *
 *   serving_direct --model DIR|random:PRESET --streams C [--max-new N] [--prompt-len P]
 *                  [--backend cpu|cuda] [--threads N] [--run-ahead 0|1]
 * (random:PRESET, e.g. random:bench-4L: glm_config_preset's shapes with random weights made by the
 *  backend; --run-ahead 0: eng_params.run_ahead off, for comparison; 1, the default: AUTO.)
 *
 * Stream i's prompt is token (i * 7 + k) % vocab for k < P, greedy, ignore_eos, max_new N; all C
 * are submitted at t = 0 with max_sequences = C (the worker runs with --max-sequences C too).
 * A warm-up request runs first (page faults of the weight mapping, first-touch of buffers).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "worker/engine/engine.h"
#include "worker/model/model.h"

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

int main(int argc, char **argv) {
    const char *model = NULL, *backend = "cpu";
    int streams = 1, max_new = 32, plen = 16, threads = 0, run_ahead = 1;
    for (int i = 1; i + 1 < argc; i += 2) {
        const char *a = argv[i], *v = argv[i + 1];
        if (!strcmp(a, "--model")) model = v;
        else if (!strcmp(a, "--backend")) backend = v;
        else if (!strcmp(a, "--streams")) streams = atoi(v);
        else if (!strcmp(a, "--max-new")) max_new = atoi(v);
        else if (!strcmp(a, "--prompt-len")) plen = atoi(v);
        else if (!strcmp(a, "--threads")) threads = atoi(v);
        else if (!strcmp(a, "--run-ahead")) run_ahead = atoi(v);
        else { fprintf(stderr, "serving_direct: unknown option %s\n", a); return 2; }
    }
    if (!model || streams < 1 || max_new < 2 || plen < 1) {
        fprintf(stderr, "usage: serving_direct --model DIR --streams C [--max-new N>=2] [--prompt-len P] "
                        "[--backend cpu|cuda] [--threads N]\n");
        return 2;
    }
    mt_error err = { "" };
    mt_backend *be = !strcmp(backend, "cuda") ? mt_cuda_backend_new(0, NULL, &err) : mt_cpu_backend_new(threads);
    mt_model *m = NULL;
    eng_engine *e = NULL;
    int32_t *prompt = malloc(sizeof(int32_t) * (size_t)plen);
    bench b = { .s = calloc((size_t)streams + 1, sizeof(stream_rec)) };
    b.cap_gaps = (size_t)streams * (size_t)max_new;
    b.gaps = malloc(sizeof(double) * b.cap_gaps);
    int rc = 1;
    if (!be || !prompt || !b.s || !b.gaps) { fprintf(stderr, "serving_direct: %s\n", err.msg[0] ? err.msg : "out of memory"); goto done; }
    if (mt_model_load(model, be, NULL, &m, &err) != MT_OK) {
        fprintf(stderr, "serving_direct: %s\n", err.msg);
        goto done;
    }
    const int V = mt_model_describe(m).vocab_size;
    eng_params ep = eng_default_params();
    ep.max_sequences = streams;
    ep.max_context = plen + max_new;
    ep.run_ahead = run_ahead ? ENG_RUN_AHEAD_AUTO : ENG_RUN_AHEAD_OFF;
    eng_callbacks cb = { .user = &b, .on_tokens = on_tokens, .on_finished = on_finished };
    if (eng_new(m, &ep, &cb, &e, &err) != MT_OK) { fprintf(stderr, "serving_direct: %s\n", err.msg); goto done; }

    eng_request r = eng_default_request();
    r.prompt = prompt;
    r.n_prompt = plen;
    r.ignore_eos = true;
    /* warm-up: one short stream, id `streams` (its own record slot) */
    for (int k = 0; k < plen; k++) prompt[k] = (int32_t)(k % V);
    r.max_new_tokens = 2;
    if (eng_submit(e, (uint64_t)streams, &r, 0, &err) != MT_OK) { fprintf(stderr, "serving_direct: %s\n", err.msg); goto done; }
    while (eng_has_work(e)) eng_step(e, NULL);
    memset(b.s, 0, sizeof(stream_rec) * (size_t)streams);
    b.finished = 0;
    b.n_gaps = 0;

    r.max_new_tokens = max_new;
    b.t0 = mt_now();
    for (int i = 0; i < streams; i++) {
        for (int k = 0; k < plen; k++) prompt[k] = (int32_t)(((int64_t)i * 7 + k) % V);
        if (eng_submit(e, (uint64_t)i, &r, 0, &err) != MT_OK) { fprintf(stderr, "serving_direct: %s\n", err.msg); goto done; }
    }
    while (eng_has_work(e)) eng_step(e, NULL);
    const double wall = mt_now() - b.t0;

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
           "\"itl_ms\": %.3f, \"itl_p50_ms\": %.3f, \"itl_p99_ms\": %.3f, \"backend\": \"%s\", \"run_ahead\": %d}\n",
           streams, tokens, wall, tokens / wall, 1e3 * ttft / streams, 1e3 * itl / streams, 1e3 * p50, 1e3 * p99,
           backend, run_ahead != 0);
    rc = tokens == (long)streams * max_new ? 0 : 1;
    if (rc) fprintf(stderr, "serving_direct: %ld tokens, expected %ld\n", tokens, (long)streams * max_new);
done:
    eng_free(e);
    mt_model_free(m);
    mt_backend_free(be);
    free(prompt);
    free(b.s);
    free(b.gaps);
    return rc;
}
