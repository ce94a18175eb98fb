/* kernels/cpu/cpu_kda.c: the KDA (Kimi Delta Attention) mixer's ops: causal depthwise conv with
 * state, the decay gate, the delta rule (recurrent, and chunked for prefill) and the gated
 * output norm. State per head St[dk(k), dk(v)] in fp32; row i of St decays by exp(g[i]). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu_ops.h"

#define KDA_CHUNK 64

static void cpu_conv1d_silu(mt_backend *be, float *out, const float *x, float *state, const float *w, int n,
                            int C, int K) {
    (void)be;
    const int P = K - 1; /* history kept per channel */
    float *h = malloc(sizeof(float) * (size_t)(P + n));
    for (int c = 0; c < C; c++) {
        /* h = state[c] ++ x[:, c]; out[t] = sum_k w[c, k] * h[t + k] */
        memcpy(h, state + (size_t)c * P, sizeof(float) * (size_t)P);
        for (int t = 0; t < n; t++) h[P + t] = x[(size_t)t * C + c];
        const float *wc = w + (size_t)c * K;
        for (int t = 0; t < n; t++) {
            float a = 0;
            for (int k = 0; k < K; k++) a += wc[k] * h[t + k];
            out[(size_t)t * C + c] = cpu_siluf(a);
        }
        memcpy(state + (size_t)c * P, h + n, sizeof(float) * (size_t)P);
    }
    free(h);
}

static void cpu_kda_gate(mt_backend *be, float *g, const float *f, const float *dt_bias, const float *A_log,
                         const mt_kda_gate_params *p, int n) {
    (void)be;
    const int D = p->nh * p->dk;
    for (int t = 0; t < n; t++)
        for (int c = 0; c < D; c++) {
            const float a = expf(A_log[c / p->dk]);
            const float x = f[(size_t)t * D + c] + dt_bias[c];
            float v;
            if (p->has_lower_bound) v = p->lower_bound * cpu_sigmoidf(a * x);
            else v = -a * (x > 20.f ? x : log1pf(expf(x)));
            g[(size_t)t * D + c] = v;
        }
}

static void cpu_kda_recurrent(mt_backend *be, float *o, const float *q, const float *k, const float *v,
                              const float *g, const float *beta, float *state, int n, int nh, int dk) {
#pragma omp parallel for num_threads(be->n_threads) schedule(static) if ((int64_t)n * nh * dk * dk * 4 > CPU_PAR_MIN_WORK)
    for (int h = 0; h < nh; h++) {
        float *S = state + (size_t)h * dk * dk;
        float *u = malloc(sizeof(float) * (size_t)dk);
        for (int t = 0; t < n; t++) {
            const size_t off = ((size_t)t * nh + h) * dk;
            const float *qt = q + off, *kt = k + off, *vt = v + off, *gt = g + off;
            const float b = beta[(size_t)t * nh + h];
            for (int i = 0; i < dk; i++) {
                const float e = expf(gt[i]);
                for (int j = 0; j < dk; j++) S[i * dk + j] *= e;
            }
            for (int j = 0; j < dk; j++) u[j] = 0;
            for (int i = 0; i < dk; i++)
                for (int j = 0; j < dk; j++) u[j] += kt[i] * S[i * dk + j];
            for (int j = 0; j < dk; j++) u[j] = b * (vt[j] - u[j]); /* delta */
            for (int i = 0; i < dk; i++)
                for (int j = 0; j < dk; j++) S[i * dk + j] += kt[i] * u[j];
            float *ot = o + off;
            for (int j = 0; j < dk; j++) ot[j] = 0;
            for (int i = 0; i < dk; i++)
                for (int j = 0; j < dk; j++) ot[j] += qt[i] * S[i * dk + j];
        }
        free(u);
    }
}

/* One chunk of L <= KDA_CHUNK steps of one head, in the closed form of the recurrence:
 *   G_i = cumsum g (per key channel), A_ij = sum_d k_i k_j exp(G_i - G_j) for j < i,
 *   delta_i = beta_i (v_i - (k_i e^{G_i})^T S0 - sum_{j<i} A_ij delta_j)      (forward substitution)
 *   o_i = (q_i e^{G_i})^T S0 + sum_{j<=i} (sum_d q_i k_j e^{G_i - G_j}) delta_j
 *   S  = e^{G_L} S0 + sum_j (k_j e^{G_L - G_j}) delta_j^T
 * Only differences G_i - G_j <= 0 are exponentiated, so nothing overflows. */
static void kda_chunk_head(float *S, const float *q, const float *k, const float *v, const float *g,
                           const float *beta, float *o, int L, int nh, int dk, float *G, float *delta,
                           float *tmp) {
    const size_t st = (size_t)nh * dk; /* time stride of q/k/v/g/o for one head */
    for (int i = 0; i < L; i++)
        for (int d = 0; d < dk; d++) G[i * dk + d] = g[i * st + d] + (i ? G[(i - 1) * dk + d] : 0.f);
    for (int i = 0; i < L; i++) {
        const float *ki = k + i * st, *qi = q + i * st, *Gi = G + i * dk;
        /* tmp = (k_i e^{G_i})^T S0 and o_i = (q_i e^{G_i})^T S0 */
        float *oi = o + i * st;
        for (int e = 0; e < dk; e++) { tmp[e] = 0; oi[e] = 0; }
        for (int d = 0; d < dk; d++) {
            const float eg = expf(Gi[d]), kd = ki[d] * eg, qd = qi[d] * eg;
            const float *Sd = S + (size_t)d * dk;
            for (int e = 0; e < dk; e++) { tmp[e] += kd * Sd[e]; oi[e] += qd * Sd[e]; }
        }
        float *di = delta + i * dk;
        for (int e = 0; e < dk; e++) di[e] = v[i * st + e] - tmp[e];
        for (int j = 0; j < i; j++) {
            const float *kj = k + j * st, *Gj = G + j * dk;
            float a = 0;
            for (int d = 0; d < dk; d++) a += ki[d] * kj[d] * expf(Gi[d] - Gj[d]);
            const float *dj = delta + j * dk;
            for (int e = 0; e < dk; e++) di[e] -= a * dj[e];
        }
        const float b = beta[(size_t)i * nh];
        for (int e = 0; e < dk; e++) di[e] *= b;
        for (int j = 0; j <= i; j++) {
            const float *kj = k + j * st, *Gj = G + j * dk;
            float a = 0;
            for (int d = 0; d < dk; d++) a += qi[d] * kj[d] * expf(Gi[d] - Gj[d]);
            const float *dj = delta + j * dk;
            for (int e = 0; e < dk; e++) oi[e] += a * dj[e];
        }
    }
    const float *GL = G + (L - 1) * dk;
    for (int d = 0; d < dk; d++) {
        float *Sd = S + (size_t)d * dk;
        const float eL = expf(GL[d]);
        for (int e = 0; e < dk; e++) Sd[e] *= eL;
        for (int j = 0; j < L; j++) {
            const float c = k[j * st + d] * expf(GL[d] - G[j * dk + d]);
            const float *dj = delta + j * dk;
            for (int e = 0; e < dk; e++) Sd[e] += c * dj[e];
        }
    }
}

static void cpu_kda_chunked(mt_backend *be, float *o, const float *q, const float *k, const float *v,
                            const float *g, const float *beta, float *state, int n, int nh, int dk) {
#pragma omp parallel for num_threads(be->n_threads) schedule(static) if ((int64_t)n * nh * dk * (KDA_CHUNK + dk) * 2 > CPU_PAR_MIN_WORK)
    for (int h = 0; h < nh; h++) {
        float *G = malloc(sizeof(float) * (size_t)KDA_CHUNK * dk * 2 + sizeof(float) * (size_t)dk);
        float *delta = G + (size_t)KDA_CHUNK * dk, *tmp = delta + (size_t)KDA_CHUNK * dk;
        for (int t0 = 0; t0 < n; t0 += KDA_CHUNK) {
            const int L = n - t0 < KDA_CHUNK ? n - t0 : KDA_CHUNK;
            const size_t off = ((size_t)t0 * nh + h) * dk;
            kda_chunk_head(state + (size_t)h * dk * dk, q + off, k + off, v + off, g + off,
                           beta + (size_t)t0 * nh + h, o + off, L, nh, dk, G, delta, tmp);
        }
        free(G);
    }
}

static void cpu_gated_rmsnorm(mt_backend *be, float *out, const float *o, const float *gate, const float *w,
                              int64_t rows, int d, float eps) {
    (void)be;
    for (int64_t r = 0; r < rows; r++) {
        const float *x = o + (size_t)r * d, *gt = gate + (size_t)r * d;
        float ss = 0;
        for (int j = 0; j < d; j++) ss += x[j] * x[j];
        const float rs = 1.f / sqrtf(ss / (float)d + eps);
        for (int j = 0; j < d; j++) out[(size_t)r * d + j] = w[j] * (x[j] * rs) * cpu_sigmoidf(gt[j]);
    }
}

void cpu_kda_fill(mt_backend_ops *t) {
    t->conv1d_silu = cpu_conv1d_silu;
    t->kda_gate = cpu_kda_gate;
    t->kda_recurrent = cpu_kda_recurrent;
    t->kda_chunked = cpu_kda_chunked;
    t->gated_rmsnorm = cpu_gated_rmsnorm;
}
