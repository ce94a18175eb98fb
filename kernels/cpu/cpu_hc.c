/* kernels/cpu/cpu_hc.c: manifold-constrained hyper-connections. hc_pre turns the S-stream fp32
 * highway into the sublayer input and the post/comb mixing weights (projection, sigmoids, softmax,
 * Sinkhorn); hc_post writes the sublayer output back into the highway. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu_ops.h"

static void cpu_hc_pre(mt_backend *be, float *y, float *post, float *comb, const float *X,
                       const mt_weight *fn, const float *base, const float *scale, const mt_hc_params *p,
                       int n) {
    const int S = p->S, H = p->H, SH = S * H, mix = (2 + S) * S;
    MT_ASSERT(fn->rows == mix && fn->cols == SH);
    float *fnf = malloc(sizeof(float) * (size_t)mix * SH); /* fn as fp32, shared by all rows */
    for (int r = 0; r < mix; r++) cpu_weight_row(fn, r, fnf + (size_t)r * SH);
#pragma omp parallel for num_threads(be->n_threads) schedule(static) if (n > 1 && (int64_t)n * mix * SH > CPU_PAR_MIN_WORK)
    for (int i = 0; i < n; i++) {
        const float *x = X + (size_t)i * SH;
        double ss = 0;
        for (int j = 0; j < SH; j++) ss += (double)x[j] * x[j];
        const float r = 1.f / sqrtf((float)(ss / SH) + p->rms_eps);
        float m[(2 + 16) * 16];
        MT_ASSERT(S <= 16);
        for (int k = 0; k < mix; k++) {
            const float *f = fnf + (size_t)k * SH;
            float a = 0;
            for (int j = 0; j < SH; j++) a += f[j] * x[j];
            m[k] = a * r;
        }
        float pre[16];
        for (int s = 0; s < S; s++) {
            pre[s] = cpu_sigmoidf(m[s] * scale[0] + base[s]) + p->hc_eps;
            post[(size_t)i * S + s] = 2.f * cpu_sigmoidf(m[S + s] * scale[1] + base[S + s]);
        }
        float *C = comb + (size_t)i * S * S; /* C[r][s]: row r = source stream */
        for (int a = 0; a < S; a++) {
            float mx = -INFINITY, sum = 0;
            for (int b = 0; b < S; b++) {
                C[a * S + b] = m[2 * S + a * S + b] * scale[2] + base[2 * S + a * S + b];
                if (C[a * S + b] > mx) mx = C[a * S + b];
            }
            for (int b = 0; b < S; b++) sum += (C[a * S + b] = expf(C[a * S + b] - mx));
            for (int b = 0; b < S; b++) C[a * S + b] = C[a * S + b] / sum + p->hc_eps;
        }
        for (int it = 0; it < p->sinkhorn_iters; it++) {
            if (it > 0)
                for (int a = 0; a < S; a++) { /* rows */
                    float sum = 0;
                    for (int b = 0; b < S; b++) sum += C[a * S + b];
                    for (int b = 0; b < S; b++) C[a * S + b] /= sum + p->hc_eps;
                }
            for (int b = 0; b < S; b++) { /* columns */
                float sum = 0;
                for (int a = 0; a < S; a++) sum += C[a * S + b];
                for (int a = 0; a < S; a++) C[a * S + b] /= sum + p->hc_eps;
            }
        }
        float *yi = y + (size_t)i * H;
        for (int d = 0; d < H; d++) {
            float a = 0;
            for (int s = 0; s < S; s++) a += pre[s] * x[(size_t)s * H + d];
            yi[d] = a;
        }
    }
    free(fnf);
}

static void cpu_hc_post(mt_backend *be, float *X, const float *a, const float *post, const float *comb,
                        const mt_hc_params *p, int n) {
    (void)be;
    const int S = p->S, H = p->H;
    float *col = malloc(sizeof(float) * (size_t)S);
    for (int i = 0; i < n; i++) {
        float *x = X + (size_t)i * S * H;
        const float *C = comb + (size_t)i * S * S, *ai = a + (size_t)i * H, *po = post + (size_t)i * S;
        for (int d = 0; d < H; d++) {
            for (int r = 0; r < S; r++) col[r] = x[(size_t)r * H + d];
            for (int s = 0; s < S; s++) {
                float v = po[s] * ai[d];
                for (int r = 0; r < S; r++) v += C[r * S + s] * col[r];
                x[(size_t)s * H + d] = v;
            }
        }
    }
    free(col);
}

static void cpu_hc_head(mt_backend *be, float *z, const float *X, int n, int S, int H) {
    (void)be;
    for (int i = 0; i < n; i++)
        for (int d = 0; d < H; d++) {
            float a = 0;
            for (int s = 0; s < S; s++) a += X[((size_t)i * S + s) * H + d];
            z[(size_t)i * H + d] = a / (float)S;
        }
}

void cpu_hc_fill(mt_backend_ops *t) {
    t->hc_pre = cpu_hc_pre;
    t->hc_post = cpu_hc_post;
    t->hc_head = cpu_hc_head;
}
