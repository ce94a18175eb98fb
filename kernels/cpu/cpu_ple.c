/* kernels/cpu/cpu_ple.c: the injection of a PLE memory (kernels/backend.h ple_inject,
 * docs/MODEL.md "PLE layer"): the gate of each highway stream against the gathered n-gram rows,
 * the value, and the dilated causal depthwise conv with its per-sequence state. Row by row: rows
 * of one sequence share a state and must run in order. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu_ops.h"

/* 1 / sqrt(mean(x^2) + eps) over d values. */
static float inv_rms(const float *x, int d, float eps) {
    double ss = 0;
    for (int c = 0; c < d; c++) ss += (double)x[c] * x[c];
    return 1.f / sqrtf((float)(ss / d) + eps);
}

static void cpu_ple_inject(mt_backend *be, float *X, const float *keys, const float *vals, float *const *states,
                           const float *key_norm, const float *query_norm, const float *conv_norm,
                           const float *conv_w, int n, const mt_ple_params *p) {
    (void)be;
    const int S = p->S, H = p->H, K = p->K, C = S * H, P = (p->K - 1) * p->dil;
    float *val = malloc(sizeof(float) * (size_t)C * 2);
    MT_ASSERT(val);
    float *vn = val + C;
    for (int i = 0; i < n; i++) {
        float *x = X + (size_t)i * C;
        const float *key = keys + (size_t)i * C, *v = vals + (size_t)i * H;
        for (int s = 0; s < S; s++) {
            const float *ks = key + (size_t)s * H, *xs = x + (size_t)s * H;
            const float *kw = key_norm + (size_t)s * H, *qw = query_norm + (size_t)s * H;
            const float rk = inv_rms(ks, H, p->eps), rq = inv_rms(xs, H, p->eps);
            double dot = 0;
            for (int c = 0; c < H; c++) dot += (double)(ks[c] * rk * kw[c]) * (xs[c] * rq * qw[c]);
            const float g = (float)(dot / sqrt((double)H));
            const float gs = sqrtf(fmaxf(fabsf(g), 1e-6f)) * (g > 0.f ? 1.f : g < 0.f ? -1.f : 0.f);
            const float gate = cpu_sigmoidf(gs);
            float *vs = val + (size_t)s * H;
            for (int c = 0; c < H; c++) vs[c] = gate * v[c];
            const float rv = inv_rms(vs, H, p->eps);
            const float *cw = conv_norm + (size_t)s * H;
            for (int c = 0; c < H; c++) vn[(size_t)s * H + c] = vs[c] * rv * cw[c];
        }
        float *st = P > 0 ? states[i] : NULL;
        for (int ch = 0; ch < C; ch++) {
            const float *w = conv_w + (size_t)ch * K;
            float acc = w[K - 1] * vn[ch];
            for (int j = 0; j < K - 1; j++) acc += w[j] * st[(size_t)j * p->dil * C + ch];
            x[ch] += val[ch] + cpu_siluf(acc);
        }
        if (P > 0) { /* drop the oldest row, append this one */
            memmove(st, st + C, sizeof(float) * (size_t)(P - 1) * C);
            memcpy(st + (size_t)(P - 1) * C, vn, sizeof(float) * C);
        }
    }
    free(val);
}

/* Row by row; row i's history is its sequence's state (read before the run's last row writes it)
 * followed by the run's earlier rows. */
static void cpu_ple_gather_rows(mt_backend *be, float *emb, const mt_weight *table, const int32_t *ids,
                                int ids_stride, uint32_t *const *hist, const mt_ple_hash *hp, int N, int ntab,
                                int n) {
    (void)be;
    MT_ASSERT(N >= 2 && N <= MT_PLE_MAX_ORDER && ntab == (N - 1) * hp->heads && hp->N == N);
    const int64_t d = table->cols;
    for (int i = 0, r0 = 0; i < n; i++) {
        if (i > 0 && hist[i] != hist[i - 1]) r0 = i; /* a new sequence's run */
        const uint32_t *h = hist[i];
        const int len = (int)h[0];
        MT_ASSERT(len <= N - 1);
        uint64_t x[MT_PLE_MAX_ORDER];
        for (int k = 0; k < N; k++) {
            const int back = k - (i - r0); /* > 0: before the run, back positions into the history */
            x[k] = back <= 0 ? (uint32_t)ids[(size_t)(i - k) * ids_stride]
                   : back <= len ? h[1 + len - back] : hp->pad;
        }
        for (int o = 2, t = 0; o <= N; o++) {
            uint64_t hs = x[0] * hp->mult[0];
            for (int k = 1; k < o; k++) hs ^= x[k] * hp->mult[k];
            for (int j = 0; j < hp->heads; j++, t++)
                cpu_weight_row(table, hp->off[t] + (int64_t)(hs % (uint64_t)hp->prime[t]), emb + ((size_t)i * ntab + t) * d);
        }
        if (i + 1 < n && hist[i + 1] == hist[i]) continue;
        /* the run's last row: its ids join the history */
        uint32_t *w = hist[i];
        for (int r = r0; r <= i; r++) {
            const uint32_t id = (uint32_t)ids[(size_t)r * ids_stride];
            if ((int)w[0] == N - 1) {
                memmove(w + 1, w + 2, sizeof(uint32_t) * (size_t)(N - 2));
                w[N - 1] = id;
            } else {
                w[1 + w[0]++] = id;
            }
        }
    }
}

void cpu_ple_fill(mt_backend_ops *t) {
    t->ple_inject = cpu_ple_inject;
    t->ple_gather_rows = cpu_ple_gather_rows;
}
