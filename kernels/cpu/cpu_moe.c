/* kernels/cpu/cpu_moe.c: the MoE router (sigmoid, bias correction, group top-k, normalisation,
 * scaling) and the routed experts, computed only for the experts each row selected. */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu_ops.h"

/* Index of the largest v[i] among i with mask[i] set (lowest index on ties); -1 when none. */
static int argmax_masked(const float *v, const unsigned char *mask, int n) {
    int best = -1;
    for (int i = 0; i < n; i++)
        if (mask[i] && (best < 0 || v[i] > v[best])) best = i;
    return best;
}

static void cpu_moe_route(mt_backend *be, int32_t *idx, float *weights, const float *logits,
                          const float *bias, const mt_router_params *p, int n) {
    (void)be;
    const int E = p->n_experts, G = p->n_group, per = E / G;
    float *s = malloc(sizeof(float) * (size_t)E * 2 + sizeof(float) * (size_t)G);
    float *c = s + E, *gscore = c + E;
    unsigned char *mask = malloc((size_t)E + (size_t)G);
    unsigned char *gmask = mask + E;
    for (int i = 0; i < n; i++) {
        for (int e = 0; e < E; e++) {
            s[e] = cpu_sigmoidf(logits[(size_t)i * E + e]);
            c[e] = s[e] + bias[e];
        }
        for (int g = 0; g < G; g++) { /* group score: sum of its two largest c */
            float a = -INFINITY, b = -INFINITY;
            for (int e = g * per; e < (g + 1) * per; e++) {
                if (c[e] > a) { b = a; a = c[e]; }
                else if (c[e] > b) b = c[e];
            }
            gscore[g] = a + b;
        }
        memset(gmask, 1, (size_t)G);
        unsigned char *keep = calloc((size_t)G, 1);
        int glast = -1;
        for (int k = 0; k < p->topk_group; k++) {
            glast = argmax_masked(gscore, gmask, G);
            gmask[glast] = 0;
            keep[glast] = 1;
        }
        if (cpu_gaps_on && glast >= 0) { /* the last kept group against the best dropped one */
            const int gnext = argmax_masked(gscore, gmask, G);
            if (gnext >= 0) mt_cpu_gaps_note(MT_GAP_GROUP, (double)gscore[glast] - gscore[gnext]);
        }
        for (int e = 0; e < E; e++) mask[e] = keep[e / per];
        free(keep);
        float sum = 0;
        int elast = -1;
        for (int k = 0; k < p->top_k; k++) {
            const int e = argmax_masked(c, mask, E);
            MT_ASSERT(e >= 0);
            mask[e] = 0;
            idx[(size_t)i * p->top_k + k] = e;
            weights[(size_t)i * p->top_k + k] = s[e];
            sum += s[e];
            elast = e;
        }
        if (cpu_gaps_on && elast >= 0) { /* the last chosen expert against the best left in kept groups */
            const int enext = argmax_masked(c, mask, E);
            if (enext >= 0) mt_cpu_gaps_note(MT_GAP_EXPERT, (double)c[elast] - c[enext]);
        }
        for (int k = 0; k < p->top_k; k++) {
            float w = weights[(size_t)i * p->top_k + k];
            if (p->norm_topk_prob) w /= sum + 1e-20f;
            weights[(size_t)i * p->top_k + k] = w * p->scaling;
        }
    }
    free(mask);
    free(s);
}

/* u[H] = down(swiglu(gate x, up x)) for one row; row[max(H, I)], g[I] are scratch. */
static void expert_row(const mt_expert *ex, const float *x, float *u, int H, int I, float L,
                       float *row, float *g) {
    for (int j = 0; j < I; j++) {
        float a = 0, b = 0;
        cpu_weight_row(&ex->gate, j, row);
        for (int d = 0; d < H; d++) a += row[d] * x[d];
        cpu_weight_row(&ex->up, j, row);
        for (int d = 0; d < H; d++) b += row[d] * x[d];
        g[j] = cpu_siluf(fminf(a, L)) * fminf(fmaxf(b, -L), L);
    }
    for (int d = 0; d < H; d++) {
        cpu_weight_row(&ex->down, d, row);
        float a = 0;
        for (int j = 0; j < I; j++) a += row[j] * g[j];
        u[d] = a;
    }
}

static void cpu_moe_experts(mt_backend *be, float *out, const float *x, const int32_t *idx,
                            const float *weights, const mt_expert *experts, int n, int top_k, int H, int I,
                            float L) {
    /* Every (row, slot) pair is independent: threads fill tmp, then one pass adds the pairs in
     * slot order, so the sum does not depend on the thread count. */
    const int pairs = n * top_k;
    float *tmp = malloc(sizeof(float) * (size_t)pairs * H);
    MT_ASSERT(tmp);
#pragma omp parallel num_threads(be->n_threads) if ((int64_t)pairs * 3 * H * I > CPU_PAR_MIN_WORK)
    {
        const int wmax = H > I ? H : I;
        float *row = malloc(sizeof(float) * (size_t)wmax);
        float *g = malloc(sizeof(float) * (size_t)I);
#pragma omp for schedule(dynamic)
        for (int pi = 0; pi < pairs; pi++)
            expert_row(&experts[idx[pi]], x + (size_t)(pi / top_k) * H, tmp + (size_t)pi * H, H, I, L,
                       row, g);
        free(row);
        free(g);
    }
    for (int pi = 0; pi < pairs; pi++) {
        float *o = out + (size_t)(pi / top_k) * H;
        const float w = weights[pi];
        for (int d = 0; d < H; d++) o[d] += w * tmp[(size_t)pi * H + d];
    }
    free(tmp);
}

static void cpu_moe_keep_experts(mt_backend *be, int32_t *idx, float *weights, const int32_t *from_idx,
                                 const float *from_weights, int n, int top_k, int lo, int hi) {
    (void)be;
    if (from_idx) {
        memmove(idx, from_idx, sizeof(int32_t) * (size_t)n * top_k);
        memmove(weights, from_weights, sizeof(float) * (size_t)n * top_k);
    }
    for (int i = 0; i < n; i++) mt_keep_experts_row(idx + (size_t)i * top_k, weights + (size_t)i * top_k, top_k, lo, hi);
}

void cpu_moe_fill(mt_backend_ops *t) {
    t->moe_route = cpu_moe_route;
    t->moe_experts = cpu_moe_experts;
    t->moe_keep_experts = cpu_moe_keep_experts;
}
