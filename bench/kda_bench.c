/* bench/kda_bench.c: our KDA delta-rule kernels (CUDA backend: kda_chunked, kda_recurrent) on the
 * model's shapes, timed the way bench/kda_fla_bench.py times flash-linear-attention's Triton
 * kernels (bench/kda_bench.sh runs both and prints one table):
 *   - device copy bandwidth (cudaMemcpy D2D, bytes read + written / time), the decode reference;
 *   - prefill: kda_chunked, 64 heads of 128, 4096 tokens, one sequence (for information: its two
 *     tensor-core kernels apart, its single-rounding (MT_NUMERICS_BF16) and fp32 (MT_NUMERICS_FP32)
 *     forms, each on a backend made with those params (the buffers are the first backend's), and
 *     kda_recurrent on the same inputs);
 *   - decode of B sequences, one token each (B = 32, 256): kda_recurrent with n = 1 and
 *     nh = B * 64 heads (heads are independent and their states contiguous, so this is the same
 *     work as B sequences); state bytes per step = B*64*128*128*4 read + the same written.
 * Timing (as triton.testing.do_bench): per rep, a 256 MB memset clears L2, then device events on
 * the backend's stream around one call; warm-up first; the median of the reps. The decode rows are
 * also timed back to back (*_steady: DEC_CHAIN calls between two events, no flush: no dirty L2
 * left by the memset and no gap between calls; our kernel's programmatic launch also lets a call's
 * L2 prefetch overlap the previous call's tail, which cudaMemcpy and fla's graph replays do not get;
 * in the engine the kernel before it is another layer's), and beside them a cudaMemcpy of the same
 * bytes timed both ways (copy_B*: what each way of timing allows a plain copy of that size). A
 * third way (*_clean): a read-only pass over the 256 MB buffer instead of the memset, so L2 is
 * cold but holds no dirty lines whose write-back the timed call would pay for.
 * Checks before timing: chunked (each form) against recurrent on the prefill inputs, decode against
 * a float64 host reference, every output element written (outputs poisoned with NaN first).
 * Inputs: uniform random, q/k l2-normalised on the host (q then scaled by dk^-0.5), g = -softplus(z)
 * with z uniform in [-5, 5) so g in (-5, 0), beta uniform in (0.02, 0.98), initial state non-zero.
 *
 *   kda_bench [--json FILE] [--dump DIR] [--reps N] [--numerics exact|bf16|fp32]
 * --json: one JSON object per line (rows of the table). --dump: a small case (T=300, 4 heads) with
 * its inputs and our outputs as raw fp32 files, for kda_fla_bench.py --check DIR. --numerics: the
 * backend's for every row but the other precisions' (default exact). */
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_ops.h"

#define CK(call)                                                                              \
    do {                                                                                      \
        cudaError_t e_ = (call);                                                              \
        if (e_ != cudaSuccess) {                                                              \
            fprintf(stderr, "kda_bench: %s:%d: %s: %s\n", __FILE__, __LINE__, #call,          \
                    cudaGetErrorString(e_));                                                  \
            exit(1);                                                                          \
        }                                                                                     \
    } while (0)

enum { NH = 64, DK = 128, T_PREFILL = 4096, FLUSH_BYTES = 256 << 20,
       DEC_CHAIN = 20 /* decode calls back to back in a steady-state rep */ };

static mt_backend *g_be;
static mt_numerics g_numerics = MT_NUMERICS_EXACT;
static void *g_flush;   /* L2 flush buffer */
static int g_reps = 30;
static FILE *g_json;

/* Fails on a CUDA error or a failure the backend recorded. */
static void check_backend(const char *what) {
    CK(cudaStreamSynchronize(cu_stream(g_be)));
    CK(cudaGetLastError());
    if (((cu_backend *)g_be)->sticky != MT_OK) {
        fprintf(stderr, "kda_bench: %s: backend error %s\n", what, mt_status_str(((cu_backend *)g_be)->sticky));
        exit(1);
    }
}

/* ---- random inputs (splitmix64) ---- */
static uint64_t g_rng = 0x9e3779b97f4a7c15ull;
static double urand(void) {
    uint64_t z = (g_rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return (double)(z >> 11) * (1.0 / 9007199254740992.0); /* [0, 1) */
}

typedef struct kda_host {
    int n, nh;
    float *q, *k, *v, *g, *beta, *state; /* [n, nh, DK] x4, [n, nh], [nh, DK, DK] */
} kda_host;

static float *xmalloc(size_t count) {
    float *p = malloc(count * sizeof(float));
    if (!p) { fprintf(stderr, "kda_bench: out of host memory\n"); exit(1); }
    return p;
}

static void host_make(kda_host *h, int n, int nh) {
    const size_t cnt = (size_t)n * nh * DK, sc = (size_t)nh * DK * DK;
    h->n = n;
    h->nh = nh;
    h->q = xmalloc(cnt); h->k = xmalloc(cnt); h->v = xmalloc(cnt); h->g = xmalloc(cnt);
    h->beta = xmalloc((size_t)n * nh);
    h->state = xmalloc(sc);
    const float qscale = 1.f / sqrtf((float)DK);
    for (size_t r = 0; r < (size_t)n * nh; r++) {
        float *q = h->q + r * DK, *k = h->k + r * DK;
        double sq = 0, sk = 0;
        for (int d = 0; d < DK; d++) {
            q[d] = (float)(2 * urand() - 1);
            k[d] = (float)(2 * urand() - 1);
            sq += (double)q[d] * q[d];
            sk += (double)k[d] * k[d];
        }
        const float rq = (float)(1 / sqrt(sq + 1e-6)) * qscale, rk = (float)(1 / sqrt(sk + 1e-6));
        for (int d = 0; d < DK; d++) { q[d] *= rq; k[d] *= rk; }
        h->beta[r] = (float)(0.02 + 0.96 * urand());
    }
    for (size_t i = 0; i < cnt; i++) {
        h->v[i] = (float)(2 * urand() - 1);
        const double z = 10 * urand() - 5;
        h->g[i] = (float)-log1p(exp(z)); /* -softplus: (-5.007, -0.0067) */
    }
    for (size_t i = 0; i < sc; i++) h->state[i] = (float)(0.2 * urand() - 0.1);
}

static void host_free(kda_host *h) {
    free(h->q); free(h->k); free(h->v); free(h->g); free(h->beta); free(h->state);
}

typedef struct kda_dev {
    float *q, *k, *v, *g, *beta, *state, *o;
} kda_dev;

static void *dalloc(size_t bytes) {
    void *p = g_be->ops->alloc(g_be, bytes);
    if (!p) { fprintf(stderr, "kda_bench: device out of memory (%zu bytes)\n", bytes); exit(1); }
    return p;
}

static void dev_make(kda_dev *d, const kda_host *h) {
    const size_t cnt = (size_t)h->n * h->nh * DK, sc = (size_t)h->nh * DK * DK;
    d->q = dalloc(cnt * 4); d->k = dalloc(cnt * 4); d->v = dalloc(cnt * 4); d->g = dalloc(cnt * 4);
    d->o = dalloc(cnt * 4);
    d->beta = dalloc((size_t)h->n * h->nh * 4);
    d->state = dalloc(sc * 4);
    g_be->ops->upload(g_be, d->q, h->q, cnt * 4);
    g_be->ops->upload(g_be, d->k, h->k, cnt * 4);
    g_be->ops->upload(g_be, d->v, h->v, cnt * 4);
    g_be->ops->upload(g_be, d->g, h->g, cnt * 4);
    g_be->ops->upload(g_be, d->beta, h->beta, (size_t)h->n * h->nh * 4);
    g_be->ops->upload(g_be, d->state, h->state, sc * 4);
}

static void dev_free(kda_dev *d) {
    float *p[] = {d->q, d->k, d->v, d->g, d->beta, d->state, d->o};
    for (int i = 0; i < 7; i++) g_be->ops->free(g_be, p[i]);
}

static void poison(float *dptr, size_t count) { /* 0xFF bytes: NaN */
    CK(cudaMemsetAsync(dptr, 0xFF, count * 4, cu_stream(g_be)));
}

typedef void (*kda_fn)(mt_backend *, float *, const float *, const float *, const float *,
                       const float *, const float *, float *, int, int, int);

static void run(kda_fn fn, const kda_dev *d, int n, int nh) {
    fn(g_be, d->o, d->q, d->k, d->v, d->g, d->beta, d->state, n, nh, DK);
}

static int cmp_float(const void *a, const void *b) {
    const float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

/* One timed call: a kernel of ours (fn), or, with fn NULL, a cudaMemcpy of `bytes` from src to dst
 * (the same bytes a decode step moves, timed the same way: the harness's own reference). */
typedef struct timed_call {
    kda_fn fn;
    const kda_dev *d;
    int n, nh;
    void *dst;
    const void *src;
    size_t bytes;
} timed_call;

static void call_once(const timed_call *c) {
    if (c->fn) run(c->fn, c->d, c->n, c->nh);
    else CK(cudaMemcpyAsync(c->dst, c->src, c->bytes, cudaMemcpyDeviceToDevice, cu_stream(g_be)));
}

static double median_of(float *ms, int reps) {
    qsort(ms, reps, sizeof(float), cmp_float);
    return reps & 1 ? ms[reps / 2] : 0.5 * (ms[reps / 2 - 1] + ms[reps / 2]);
}

/* Median ms of one call. chain == 0: do_bench style, per rep a 256 MB memset clears L2, then
 * events around one call. chain > 0: `chain` calls back to back between two events (no flush;
 * what a call leaves in L2 is what the next one meets), per-call ms of each rep. chain == CLEAN:
 * per rep a read-only pass over the flush buffer (an argmax of it, one int written per row)
 * clears L2 and leaves it clean, then events around one call: the call finds none of its bytes
 * in L2 and no one else's dirty lines to write back (the memset leaves up to the L2's size of
 * them, and their write-back lands in the timed call). */
enum { CLEAN = -1, CLEAN_ROWS = 256 };
static int32_t *g_clean_out; /* [CLEAN_ROWS] device */
static double time_call(const timed_call *c, int reps, int chain) {
    cudaStream_t s = cu_stream(g_be);
    for (int i = 0; i < 3; i++) call_once(c);
    check_backend("warm-up");
    cudaEvent_t *ev = malloc(sizeof(cudaEvent_t) * 2 * reps);
    float *ms = malloc(sizeof(float) * reps);
    for (int i = 0; i < 2 * reps; i++) CK(cudaEventCreate(&ev[i]));
    for (int r = 0; r < reps; r++) {
        if (chain == 0) CK(cudaMemsetAsync(g_flush, r & 0xff, FLUSH_BYTES, s));
        if (chain == CLEAN)
            g_be->ops->argmax_dev(g_be, g_clean_out, 1, g_flush, CLEAN_ROWS, FLUSH_BYTES / 4 / CLEAN_ROWS);
        CK(cudaEventRecord(ev[2 * r], s));
        for (int i = 0; i < (chain > 0 ? chain : 1); i++) call_once(c);
        CK(cudaEventRecord(ev[2 * r + 1], s));
    }
    check_backend("timing");
    for (int r = 0; r < reps; r++) {
        CK(cudaEventElapsedTime(&ms[r], ev[2 * r], ev[2 * r + 1]));
        if (chain > 0) ms[r] /= (float)chain;
    }
    const double med = median_of(ms, reps);
    for (int i = 0; i < 2 * reps; i++) cudaEventDestroy(ev[i]);
    free(ev);
    free(ms);
    return med;
}

static double time_ms(kda_fn fn, const kda_dev *d, int n, int nh, int reps) {
    const timed_call c = {fn, d, n, nh, NULL, NULL, 0};
    return time_call(&c, reps, 0);
}

static double copy_bandwidth_gbs(void) {
    const size_t bytes = (size_t)2 << 30;
    void *a = dalloc(bytes), *b = dalloc(bytes);
    cudaStream_t s = cu_stream(g_be);
    CK(cudaMemsetAsync(a, 1, bytes, s));
    const int reps = 20;
    float ms[20];
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    for (int r = -2; r < reps; r++) {
        CK(cudaEventRecord(e0, s));
        CK(cudaMemcpyAsync(r & 1 ? a : b, r & 1 ? b : a, bytes, cudaMemcpyDeviceToDevice, s));
        CK(cudaEventRecord(e1, s));
        CK(cudaEventSynchronize(e1));
        if (r >= 0) CK(cudaEventElapsedTime(&ms[r], e0, e1));
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    g_be->ops->free(g_be, a);
    g_be->ops->free(g_be, b);
    return 2.0 * (double)bytes / (median_of(ms, reps) * 1e-3) / 1e9;
}

/* ---- checks ---- */
static double rel_err(const float *x, const float *ref, size_t count, size_t *bad) {
    double num = 0, den = 0;
    *bad = 0;
    for (size_t i = 0; i < count; i++) {
        if (!isfinite(x[i])) { (*bad)++; continue; }
        const double e = (double)x[i] - ref[i];
        num += e * e;
        den += (double)ref[i] * ref[i];
    }
    return sqrt(num / (den > 0 ? den : 1));
}

/* One decode step in float64 for heads [h0, h1): o_ref, s_ref (rows of the updated state). */
static void host_step(const kda_host *h, int h0, int h1, float *o_ref, float *s_ref) {
    double *s = malloc(sizeof(double) * DK * DK);
    for (int hh = h0; hh < h1; hh++) {
        const float *q = h->q + (size_t)hh * DK, *k = h->k + (size_t)hh * DK;
        const float *v = h->v + (size_t)hh * DK, *g = h->g + (size_t)hh * DK;
        const float *S = h->state + (size_t)hh * DK * DK;
        for (int i = 0; i < DK; i++) {
            const double e = exp((double)g[i]);
            for (int j = 0; j < DK; j++) s[i * DK + j] = S[i * DK + j] * e;
        }
        for (int j = 0; j < DK; j++) {
            double u = 0;
            for (int i = 0; i < DK; i++) u += k[i] * s[i * DK + j];
            const double delta = h->beta[hh] * (v[j] - u);
            double o = 0;
            for (int i = 0; i < DK; i++) {
                s[i * DK + j] += k[i] * delta;
                o += q[i] * s[i * DK + j];
            }
            o_ref[(size_t)(hh - h0) * DK + j] = (float)o;
        }
        for (int i = 0; i < DK * DK; i++) s_ref[(size_t)(hh - h0) * DK * DK + i] = (float)s[i];
    }
    free(s);
}

static size_t count_bad(const float *x, size_t count) {
    size_t bad = 0;
    for (size_t i = 0; i < count; i++) bad += !isfinite(x[i]);
    return bad;
}

static int g_fail;

static void report_check(const char *name, double err, size_t bad, double tol) {
    const int ok = bad == 0 && err < tol;
    printf("  check %-40s rel err %.2e (tol %.0e)%s %s\n", name, err, tol, bad ? " NON-FINITE/UNWRITTEN" : "",
           ok ? "ok" : "FAIL");
    if (g_json)
        fprintf(g_json, "{\"impl\": \"ours\", \"kind\": \"check\", \"name\": \"%s\", \"rel_err\": %.3e, "
                        "\"bad\": %zu, \"tol\": %.0e, \"ok\": %s}\n", name, err, bad, tol, ok ? "true" : "false");
    g_fail |= !ok;
}

/* ---- the small case for the cross-check with fla ---- */
static void write_raw(const char *dir, const char *name, const float *p, size_t count) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s.f32", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(p, 4, count, f) != count) { fprintf(stderr, "kda_bench: cannot write %s\n", path); exit(1); }
    fclose(f);
}

static void dump_small(const char *dir) {
    const int n = 300, nh = 4;
    kda_host h;
    host_make(&h, n, nh);
    kda_dev d;
    dev_make(&d, &h);
    const size_t cnt = (size_t)n * nh * DK, sc = (size_t)nh * DK * DK;
    float *o = xmalloc(cnt), *st = xmalloc(sc);
    mkdir(dir, 0755);
    poison(d.o, cnt);
    run(g_be->ops->kda_chunked, &d, n, nh);
    check_backend("dump chunked");
    g_be->ops->download(g_be, o, d.o, cnt * 4);
    g_be->ops->download(g_be, st, d.state, sc * 4);
    write_raw(dir, "q", h.q, cnt);
    write_raw(dir, "k", h.k, cnt);
    write_raw(dir, "v", h.v, cnt);
    write_raw(dir, "g", h.g, cnt);
    write_raw(dir, "beta", h.beta, (size_t)n * nh);
    write_raw(dir, "state0", h.state, sc);
    write_raw(dir, "o_chunked", o, cnt);
    write_raw(dir, "state_chunked", st, sc);
    char path[1024];
    snprintf(path, sizeof path, "%s/meta.json", dir);
    FILE *f = fopen(path, "w");
    if (!f) { fprintf(stderr, "kda_bench: cannot write %s\n", path); exit(1); }
    fprintf(f, "{\"T\": %d, \"H\": %d, \"K\": %d, \"q_prescaled\": true}\n", n, nh, DK);
    fclose(f);
    printf("  dumped a T=%d H=%d case to %s (for kda_fla_bench.py --check)\n", n, nh, dir);
    free(o);
    free(st);
    dev_free(&d);
    host_free(&h);
}

static void emit(const char *row, const char *op, int B, int T, int H, double ms, double state_bytes,
                 double bw) {
    const double gbs = state_bytes > 0 ? state_bytes / (ms * 1e-3) / 1e9 : 0;
    printf("  %-22s %-16s B=%-4d T=%-5d H=%-5d %9.4f ms", row, op, B, T, H, ms);
    if (state_bytes > 0) printf("   state %7.0f GB/s = %5.1f%% of copy", gbs, 100 * gbs / bw);
    printf("\n");
    if (g_json)
        fprintf(g_json, "{\"impl\": \"ours\", \"kind\": \"time\", \"row\": \"%s\", \"op\": \"%s\", \"B\": %d, "
                        "\"T\": %d, \"H\": %d, \"K\": %d, \"dtype\": \"%s\", "
                        "\"ms\": %.5f, \"state_bytes\": %.0f, \"state_gbs\": %.1f, \"copy_gbs\": %.1f}\n",
                row, op, B, T, H, DK, strcmp(op, "cudaMemcpy") ? "fp32 q/k/v/g/beta, fp32 state" : "-", ms,
                state_bytes, gbs, bw);
}

/* A CUDA backend on device 0 with g_numerics' params changed to numerics v and kernels k; exits on
 * failure. */
static mt_backend *backend_with(mt_numerics v, mt_cuda_kda_chunk_kernels k) {
    mt_cuda_params p = mt_cuda_default_params();
    p.numerics = v;
    p.kda_chunk_exact = false; /* MT_NUMERICS_BF16 here is the single-rounding kernel */
    p.kda_chunk_kernels = k;
    mt_error err = {""};
    mt_backend *be = mt_cuda_backend_new(0, &p, &err);
    if (!be) {
        fprintf(stderr, "kda_bench: %s\n", err.msg);
        exit(1);
    }
    return be;
}

/* time_ms of kda_chunked on a backend made with numerics v and kernels k in g_be's place, beside it
 * on the same device (g_be's buffers serve it). */
static double time_chunked_with(mt_numerics v, mt_cuda_kda_chunk_kernels k, const kda_dev *d) {
    mt_backend *const be0 = g_be;
    g_be = backend_with(v, k);
    const double ms = time_ms(g_be->ops->kda_chunked, d, T_PREFILL, NH, g_reps);
    mt_backend_free(g_be);
    g_be = be0;
    return ms;
}

int main(int argc, char **argv) {
    const char *json = NULL, *dump = NULL;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--json")) json = argv[i + 1];
        else if (!strcmp(argv[i], "--dump")) dump = argv[i + 1];
        else if (!strcmp(argv[i], "--reps")) g_reps = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--numerics")) {
            if (!mt_numerics_parse(argv[i + 1], &g_numerics)) {
                fprintf(stderr, "kda_bench: --numerics must be exact, bf16 or fp32, got %s\n", argv[i + 1]);
                return 2;
            }
        }
        else { fprintf(stderr, "kda_bench: unknown option %s\n", argv[i]); return 2; }
    }
    if (g_reps < 20) g_reps = 20;
    g_be = backend_with(g_numerics, MT_CUDA_KDA_CHUNK_BOTH);
    if (json && !(g_json = fopen(json, "w"))) { fprintf(stderr, "kda_bench: cannot write %s\n", json); return 1; }
    struct cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("kda_bench (ours, CUDA backend) on %s, %d reps per shape, median\n", prop.name, g_reps);
    g_flush = dalloc(FLUSH_BYTES);
    CK(cudaMemsetAsync(g_flush, 0, FLUSH_BYTES, cu_stream(g_be)));
    g_clean_out = dalloc(sizeof(int32_t) * CLEAN_ROWS);

    const double bw = copy_bandwidth_gbs();
    printf("  device copy bandwidth %.0f GB/s (cudaMemcpy D2D 2 GiB, read + write)\n", bw);
    if (g_json) fprintf(g_json, "{\"impl\": \"ours\", \"kind\": \"copy\", \"copy_gbs\": %.1f, \"device\": \"%s\"}\n", bw, prop.name);

    if (dump) dump_small(dump);

    /* prefill: chunked vs recurrent on the same inputs, then timings */
    {
        kda_host h;
        host_make(&h, T_PREFILL, NH);
        kda_dev d;
        dev_make(&d, &h);
        const size_t cnt = (size_t)T_PREFILL * NH * DK, sc = (size_t)NH * DK * DK;
        float *o_c = xmalloc(cnt), *o_r = xmalloc(cnt), *s_c = xmalloc(sc), *s_r = xmalloc(sc);
        poison(d.o, cnt);
        run(g_be->ops->kda_chunked, &d, T_PREFILL, NH);
        check_backend("prefill chunked");
        g_be->ops->download(g_be, o_c, d.o, cnt * 4);
        g_be->ops->download(g_be, s_c, d.state, sc * 4);
        g_be->ops->upload(g_be, d.state, h.state, sc * 4);
        poison(d.o, cnt);
        run(g_be->ops->kda_recurrent, &d, T_PREFILL, NH);
        check_backend("prefill recurrent");
        g_be->ops->download(g_be, o_r, d.o, cnt * 4);
        g_be->ops->download(g_be, s_r, d.state, sc * 4);
        size_t bad, unused;
        const size_t bad_o = count_bad(o_c, cnt) + count_bad(o_r, cnt);
        const size_t bad_s = count_bad(s_c, sc) + count_bad(s_r, sc);
        report_check("prefill o: chunked vs recurrent", rel_err(o_c, o_r, cnt, &unused), bad_o, 1e-3);
        report_check("prefill state: chunked vs recurrent", rel_err(s_c, s_r, sc, &bad), bad_s, 1e-3);

        /* kda_chunked's other precisions (cuda_kda_chunk.cu), each on a backend made with that
         * numerics in g_be's place: t 1 = MT_NUMERICS_BF16 (single bf16 rounding on the tensor
         * cores), 0 = MT_NUMERICS_FP32 (the fp32 kernel). Each against the same recurrent run,
         * then timed. */
        mt_backend *const be0 = g_be;
        double ms_mode[2] = {0, 0};
        for (int t = 1; t >= 0; t--) {
            g_be = backend_with(t ? MT_NUMERICS_BF16 : MT_NUMERICS_FP32, MT_CUDA_KDA_CHUNK_BOTH);
            g_be->ops->upload(g_be, d.state, h.state, sc * 4);
            poison(d.o, cnt);
            run(g_be->ops->kda_chunked, &d, T_PREFILL, NH);
            check_backend(t ? "prefill chunked (1 term)" : "prefill chunked (fp32)");
            g_be->ops->download(g_be, o_c, d.o, cnt * 4);
            g_be->ops->download(g_be, s_c, d.state, sc * 4);
            const double tol = t ? 2e-2 : 1e-3;
            char name[64];
            snprintf(name, sizeof name, "prefill o: chunked %s vs recurrent", t ? "1-term" : "fp32");
            report_check(name, rel_err(o_c, o_r, cnt, &unused), count_bad(o_c, cnt), tol);
            snprintf(name, sizeof name, "prefill state: chunked %s vs recurrent", t ? "1-term" : "fp32");
            report_check(name, rel_err(s_c, s_r, sc, &bad), count_bad(s_c, sc), tol);
            ms_mode[t] = time_ms(g_be->ops->kda_chunked, &d, T_PREFILL, NH, g_reps);
            mt_backend_free(g_be);
            g_be = be0;
        }
        free(o_c); free(o_r); free(s_c); free(s_r);

        const double ms_c = time_ms(g_be->ops->kda_chunked, &d, T_PREFILL, NH, g_reps);
        emit("prefill_chunked", "kda_chunked", 1, T_PREFILL, NH, ms_c, 0, bw);
        printf("  %-22s %.1f us per 64-token chunk (numerics %s)\n", "", ms_c * 1e3 / (T_PREFILL / 64),
               mt_numerics_name(g_numerics));
        /* the tensor-core form's two kernels apart (mt_cuda_params.kda_chunk_kernels: outputs wrong) */
        if (g_numerics != MT_NUMERICS_FP32) {
            emit("prefill_chunked_intra", "kda_chunked intra", 1, T_PREFILL, NH,
                 time_chunked_with(g_numerics, MT_CUDA_KDA_CHUNK_INTRA, &d), 0, bw);
            emit("prefill_chunked_state", "kda_chunked state", 1, T_PREFILL, NH,
                 time_chunked_with(g_numerics, MT_CUDA_KDA_CHUNK_STATE, &d), 0, bw);
        }
        emit("prefill_chunked_1term", "kda_chunked 1-term", 1, T_PREFILL, NH, ms_mode[1], 0, bw);
        emit("prefill_chunked_fp32", "kda_chunked fp32", 1, T_PREFILL, NH, ms_mode[0], 0, bw);
        const double ms_r = time_ms(g_be->ops->kda_recurrent, &d, T_PREFILL, NH, g_reps);
        emit("prefill_recurrent", "kda_recurrent", 1, T_PREFILL, NH, ms_r, 0, bw);
        dev_free(&d);
        host_free(&h);
    }

    /* decode: B sequences x 64 heads, one token */
    const int batches[2] = {32, 256};
    for (int bi = 0; bi < 2; bi++) {
        const int B = batches[bi], nh = B * NH;
        kda_host h;
        host_make(&h, 1, nh);
        kda_dev d;
        dev_make(&d, &h);
        const size_t cnt = (size_t)nh * DK, sc = (size_t)nh * DK * DK;
        /* check heads [0, 256) and the last 256 (all of them would be 1e9+ host FLOPs at B=256) */
        const int hc = 256;
        float *o = xmalloc(cnt), *st = xmalloc(sc);
        float *o_ref = xmalloc((size_t)2 * hc * DK), *s_ref = xmalloc((size_t)2 * hc * DK * DK);
        poison(d.o, cnt);
        run(g_be->ops->kda_recurrent, &d, 1, nh);
        check_backend("decode");
        g_be->ops->download(g_be, o, d.o, cnt * 4);
        g_be->ops->download(g_be, st, d.state, sc * 4);
        host_step(&h, 0, hc, o_ref, s_ref);
        host_step(&h, nh - hc, nh, o_ref + (size_t)hc * DK, s_ref + (size_t)hc * DK * DK);
        size_t b1, b2;
        const size_t bad_o = count_bad(o, cnt), bad_s = count_bad(st, sc);
        double e1 = rel_err(o, o_ref, (size_t)hc * DK, &b1);
        double e2 = rel_err(o + cnt - (size_t)hc * DK, o_ref + (size_t)hc * DK, (size_t)hc * DK, &b2);
        char name[64];
        snprintf(name, sizeof name, "decode B=%d o vs float64 host", B);
        report_check(name, e1 > e2 ? e1 : e2, bad_o, 1e-4);
        e1 = rel_err(st, s_ref, (size_t)hc * DK * DK, &b1);
        e2 = rel_err(st + sc - (size_t)hc * DK * DK, s_ref + (size_t)hc * DK * DK, (size_t)hc * DK * DK, &b2);
        snprintf(name, sizeof name, "decode B=%d state vs float64 host", B);
        report_check(name, e1 > e2 ? e1 : e2, bad_s, 1e-4);
        free(o); free(st); free(o_ref); free(s_ref);

        const timed_call kc = {g_be->ops->kda_recurrent, &d, 1, nh, NULL, NULL, 0};
        const double ms = time_call(&kc, g_reps * 4, 0), ms_steady = time_call(&kc, g_reps, DEC_CHAIN);
        const double ms_clean = time_call(&kc, g_reps * 4, CLEAN);
        /* the same bytes through cudaMemcpy, timed both ways: what the harness itself allows */
        void *dst = dalloc(sc * 4);
        const timed_call cc = {NULL, NULL, 0, 0, dst, d.state, sc * 4};
        const double ms_copy = time_call(&cc, g_reps * 4, 0), ms_copy_steady = time_call(&cc, g_reps, DEC_CHAIN);
        const double ms_copy_clean = time_call(&cc, g_reps * 4, CLEAN);
        g_be->ops->free(g_be, dst);
        const struct { const char *kind, *suffix, *op; double ms; } rows[] = {
            {"decode", "", "kda_recurrent", ms},       {"decode", "_steady", "kda_recurrent", ms_steady},
            {"decode", "_clean", "kda_recurrent", ms_clean}, {"copy", "", "cudaMemcpy", ms_copy},
            {"copy", "_steady", "cudaMemcpy", ms_copy_steady}, {"copy", "_clean", "cudaMemcpy", ms_copy_clean},
        };
        for (size_t r = 0; r < sizeof rows / sizeof rows[0]; r++) {
            char row[48];
            snprintf(row, sizeof row, "%s_B%d%s", rows[r].kind, B, rows[r].suffix);
            emit(row, rows[r].op, B, 1, NH, rows[r].ms, 2.0 * (double)sc * 4, bw);
        }
        dev_free(&d);
        host_free(&h);
    }
    g_be->ops->free(g_be, g_flush);
    g_be->ops->free(g_be, g_clean_out);
    if (g_json) fclose(g_json);
    mt_backend_free(g_be);
    if (g_fail) fprintf(stderr, "kda_bench: a check FAILED\n");
    return g_fail ? 1 : 0;
}
