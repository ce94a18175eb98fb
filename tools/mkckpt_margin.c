/* tools/mkckpt_margin.c: margin models (tools/mkckpt_margin.h): router bias tiers, the indexer's
 * selection-keeping search, the certifying runs on the CPU backend, margin.json. */
#include "tools/mkckpt_margin.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "worker/model/glm/glm_model.h"

#define PFX "model.language_model.layers."

ckm_params ckm_default_params(void) {
    return (ckm_params){ .gap = 0, .prompts = 10, .len = 64, .rounds = 6, .seed = 0, .threads = 0 };
}

static inline uint64_t ckm_mix(uint64_t z) {
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* ---------------------------------------------------------------------------------------------- */
/* A growable fp32 array.                                                                          */

typedef struct ckm_buf {
    float *v;
    size_t n, cap;
} ckm_buf;

/* Appends count floats (NULL: zeros); false on OOM. */
static bool buf_push(ckm_buf *b, const float *x, size_t count) {
    if (b->n + count > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->n + count) cap *= 2;
        float *nv = realloc(b->v, cap * sizeof *nv);
        if (!nv) return false;
        b->v = nv;
        b->cap = cap;
    }
    if (x) memcpy(b->v + b->n, x, count * sizeof *x);
    else memset(b->v + b->n, 0, count * sizeof *b->v);
    b->n += count;
    return true;
}

/* ---------------------------------------------------------------------------------------------- */
/* Router: bias tiers.                                                                             */

/* Sets every MoE layer's correction bias (the MTP block's too) in three tiers: the layer's chosen
 * experts 2U, the other experts of its kept groups U, the rest 0, with U = 1 + 1.5 gap. With every
 * sigmoid score s in (0, 1), a chosen expert's s + bias exceeds 2U and a passed-over kept one's is
 * below U + 1 (expert gap > U - 1); a kept group scores above 2U and a dropped one below 2 (group
 * gap > 2(U - 1)). The groups and experts are drawn per layer from the seed; the chosen experts
 * spread over the kept groups in turn. */
static mt_status route_tiers(const glm_config *c, const ckm_params *p, const ckm_ckpt *ck, mt_error *err) {
    const int E = c->n_routed_experts, G = c->n_group, per = E / G, kg = c->topk_group, k = c->num_experts_per_tok;
    const float U = 1.f + 1.5f * (float)p->gap;
    float *bias = malloc(sizeof(float) * (size_t)E);
    int *groups = malloc(sizeof(int) * (size_t)G), *order = malloc(sizeof(int) * (size_t)E);
    mt_status st = MT_OK;
    if (!bias || !groups || !order) { st = mt_errorf(err, MT_ERR_NOMEM, "margin: out of memory"); goto done; }
    for (int l = 0; l < c->num_hidden_layers + c->num_nextn_predict_layers && st == MT_OK; l++) {
        char name[160];
        snprintf(name, sizeof name, PFX "%d.mlp.gate.e_score_correction_bias", l);
        st = ck->read(ck->user, name, bias, (size_t)E, err);
        if (st == MT_ERR_NOT_FOUND) { st = MT_OK; continue; } /* a dense layer */
        if (st != MT_OK) break;
        uint64_t r = ckm_mix(p->seed ^ ((uint64_t)l << 32) ^ 0x7469657273ull);
        for (int g = 0; g < G; g++) groups[g] = g;
        for (int g = G - 1; g > 0; g--) { /* Fisher-Yates: the first kg are kept */
            r = ckm_mix(r);
            const int j = (int)(r % (uint64_t)(g + 1)), t = groups[g];
            groups[g] = groups[j];
            groups[j] = t;
        }
        for (int e = 0; e < E; e++) bias[e] = 0.f;
        for (int i = 0; i < kg; i++)
            for (int e = groups[i] * per; e < (groups[i] + 1) * per; e++) bias[e] = U;
        for (int e = 0; e < E; e++) order[e] = e;
        for (int e = E - 1; e > 0; e--) {
            r = ckm_mix(r);
            const int j = (int)(r % (uint64_t)(e + 1)), t = order[e];
            order[e] = order[j];
            order[j] = t;
        }
        /* Choose k experts, one per kept group in turn, each the next in the shuffled order. */
        for (int i = 0, chosen = 0; chosen < k && i < k * kg + kg; i++) {
            const int g = groups[i % kg];
            for (int j = 0; j < E; j++) {
                const int e = order[j];
                if (e / per == g && bias[e] == U) {
                    bias[e] = 2.f * U;
                    chosen++;
                    break;
                }
            }
        }
        st = ck->replace(ck->user, name, bias, (size_t)E, err);
    }
done:
    free(bias);
    free(groups);
    free(order);
    return st;
}

/* ---------------------------------------------------------------------------------------------- */
/* Indexer capture: the CPU backend's dsa_select, interposed.                                      */

/* One recorded non-forced selection of one full indexer layer: the raw head weights w [ih]
 * (weights_proj(x), before ih^-0.5), the queries q [ih, id], the candidate pool keys P [n, id];
 * keep of the n pools are selected. Offsets index the layer's buffers. */
typedef struct ckm_query {
    int n, keep;
    size_t w, q, P;
} ckm_query;

typedef struct ckm_layer {
    int layer;                 /* decoder layer index */
    ckm_query *qs;
    int nq, capq;
    ckm_buf w, q, P;
} ckm_layer;

typedef struct ckm_capture {
    mt_backend_ops ops;        /* the CPU table with dsa_select replaced */
    const mt_backend_ops *cpu; /* the CPU backend's own table */
    ckm_layer *layers;         /* [nl]: the full indexer layers in order */
    int nl;
    const float *bases[GLM_MAX_LAYERS]; /* the layers' pool-key caches, in first-call order */
    int nbases;
    bool oom;
} ckm_capture;

/* The op signature carries no user pointer: the interposed table belongs to one model run at a
 * time, made and undone by run_prompts. */
static ckm_capture *g_cap;

static void capture_select(mt_backend *be, int32_t *sel, int32_t *nsel, const float *qi, const float *w,
                           mt_paged pool_keys, const int32_t *bt, int t0, int n, const mt_dsa_select_params *p) {
    ckm_capture *cap = g_cap;
    const int t_first = p->t0_dev ? *p->t0_dev : t0;
    int o = 0;
    while (o < cap->nbases && cap->bases[o] != pool_keys.base) o++;
    if (o == cap->nbases && o < GLM_MAX_LAYERS) cap->bases[cap->nbases++] = pool_keys.base;
    if (o < cap->nl && !cap->oom) {
        ckm_layer *L = &cap->layers[o];
        for (int i = 0; i < n; i++) {
            const int t = t_first + i, ncand = (t + 1) / p->kpool;
            const int keep = ncand < p->max_pools ? ncand : p->max_pools;
            if (keep >= ncand || keep <= 0) continue; /* forced */
            if (L->nq == L->capq) {
                int capq = L->capq ? L->capq * 2 : 256;
                ckm_query *nq = realloc(L->qs, sizeof *nq * (size_t)capq);
                if (!nq) { cap->oom = true; break; }
                L->qs = nq;
                L->capq = capq;
            }
            ckm_query *Q = &L->qs[L->nq];
            *Q = (ckm_query){ ncand, keep, L->w.n, L->q.n, L->P.n };
            bool ok = buf_push(&L->w, w + (size_t)i * p->ih, (size_t)p->ih) &&
                      buf_push(&L->q, qi + (size_t)i * p->ih * p->id, (size_t)p->ih * p->id);
            for (int c = 0; c < ncand && ok; c++) ok = buf_push(&L->P, mt_paged_at(pool_keys, bt, c), (size_t)p->id);
            if (!ok) { cap->oom = true; break; }
            L->nq++;
        }
    }
    cap->cpu->dsa_select(be, sel, nsel, qi, w, pool_keys, bt, t0, n, p);
}

static void capture_clear(ckm_capture *cap) {
    for (int i = 0; i < cap->nl; i++) {
        ckm_layer *L = &cap->layers[i];
        L->nq = 0;
        L->w.n = L->q.n = L->P.n = 0;
    }
    cap->nbases = 0;
    cap->oom = false;
}

/* ---------------------------------------------------------------------------------------------- */
/* Runs.                                                                                           */

/* Loads dir on be and runs every prompt (prefill each, then len greedy tokens, the sequences
 * decoding side by side: glm_decode_multi gives each row what decoding it alone gives) with the
 * gap recorder on, capturing the indexer's selections into cap when cap is set. */
static mt_status run_prompts(const char *dir, mt_backend *be, int32_t *const *prompts, int n_prompts, int plen,
                             int len, ckm_capture *cap, mt_cpu_gaps *gaps, mt_error *err) {
    const mt_backend_ops *saved = be->ops;
    if (cap) {
        capture_clear(cap);
        cap->cpu = saved;
        cap->ops = *saved;
        cap->ops.dsa_select = capture_select;
        g_cap = cap;
        be->ops = &cap->ops;
    }
    glm_model *m = NULL;
    glm_seq **seqs = calloc((size_t)n_prompts, sizeof *seqs);
    int32_t *toks = malloc(sizeof(int32_t) * (size_t)n_prompts);
    float *logits = NULL;
    mt_status st = glm_model_load(dir, be, NULL, &m, err);
    if (st != MT_OK) goto done;
    const int V = glm_model_config(m)->vocab_size;
    if (!seqs || !toks || !(logits = malloc(sizeof(float) * (size_t)V * n_prompts))) {
        st = mt_errorf(err, MT_ERR_NOMEM, "margin: out of memory");
        goto done;
    }
    if ((st = glm_model_set_pools(m, n_prompts * ((plen + len) / glm_model_page_tokens(m) + 2), n_prompts, err)) != MT_OK)
        goto done;
    mt_cpu_gaps_reset();
    mt_cpu_gaps_record(true);
    for (int i = 0; i < n_prompts && st == MT_OK; i++)
        if ((st = glm_seq_new(m, plen + len, &seqs[i], err)) == MT_OK)
            st = glm_prefill(m, seqs[i], prompts[i], plen, logits + (size_t)i * V, false, err);
    for (int j = 0; j + 1 < len && st == MT_OK; j++) {
        for (int i = 0; i < n_prompts; i++) toks[i] = glm_argmax(logits + (size_t)i * V, V);
        st = glm_decode_multi(m, seqs, toks, n_prompts, logits, err);
    }
    mt_cpu_gaps_record(false);
    mt_cpu_gaps_get(gaps);
    if (st == MT_OK && cap && cap->oom) st = mt_errorf(err, MT_ERR_NOMEM, "margin: out of memory recording the indexer");
done:
    for (int i = 0; seqs && i < n_prompts; i++) glm_seq_free(seqs[i]);
    free(seqs);
    free(toks);
    free(logits);
    glm_model_free(m);
    be->ops = saved;
    g_cap = NULL;
    return st;
}

/* ---------------------------------------------------------------------------------------------- */
/* Indexer: the selection-keeping search.                                                          */

/* The shaping of one layer: s_p = ih^-0.5 sum_h (A w)_h relu(id^-0.5 (T_h q_h) . P_p). */
typedef struct ckm_fit {
    int ih, id;
    double *A;     /* [ih, ih] */
    double *T;     /* [ih, id, id] */
    double *wp;    /* [ih] scratch: A w */
    double *qp;    /* [ih, id] scratch: T_h q_h */
    double *a;     /* [ih, n_max] scratch: the heads' dot products */
    double *s;     /* [n_max] scratch: pool scores */
} ckm_fit;

/* Scores of query Q under the fit into f->s (and the scratch the gradient reuses). */
static void fit_scores(ckm_fit *f, const ckm_layer *L, const ckm_query *Q) {
    const int ih = f->ih, id = f->id, n = Q->n;
    const float *w = L->w.v + Q->w, *q = L->q.v + Q->q, *P = L->P.v + Q->P;
    const double cq = 1.0 / sqrt((double)id), cw = 1.0 / sqrt((double)ih);
    for (int h = 0; h < ih; h++) {
        double acc = 0;
        for (int j = 0; j < ih; j++) acc += f->A[h * ih + j] * w[j];
        f->wp[h] = acc;
        const double *T = f->T + (size_t)h * id * id;
        for (int d = 0; d < id; d++) {
            double x = 0;
            for (int e = 0; e < id; e++) x += T[(size_t)d * id + e] * q[(size_t)h * id + e];
            f->qp[(size_t)h * id + d] = x;
        }
    }
    for (int c = 0; c < n; c++) {
        double sc = 0;
        for (int h = 0; h < ih; h++) {
            double x = 0;
            for (int d = 0; d < id; d++) x += f->qp[(size_t)h * id + d] * P[(size_t)c * id + d];
            x *= cq;
            f->a[(size_t)h * n + c] = x;
            sc += f->wp[h] * (x > 0 ? x : 0);
        }
        f->s[c] = sc * cw;
    }
}

/* The boundary of query Q under the fit, with sel[c] marking the kept pools: the weakest kept
 * pool *lo, the strongest dropped one *hi, the largest |score| *top (pool *mx, sign *sg). Returns
 * the relative gap (s_lo - s_hi) / |s_top|. */
static double fit_boundary(const ckm_fit *f, const ckm_query *Q, const unsigned char *sel, int *lo, int *hi,
                           int *mx, double *sg) {
    *lo = *hi = *mx = -1;
    for (int c = 0; c < Q->n; c++) {
        if (sel[c]) { if (*lo < 0 || f->s[c] < f->s[*lo]) *lo = c; }
        else if (*hi < 0 || f->s[c] > f->s[*hi]) *hi = c;
        if (*mx < 0 || fabs(f->s[c]) > fabs(f->s[*mx])) *mx = c;
    }
    const double top = fabs(f->s[*mx]);
    *sg = f->s[*mx] >= 0 ? 1.0 : -1.0;
    return top > 0 ? (f->s[*lo] - f->s[*hi]) / top : 0.0;
}

/* Adds coef * d s_c / d(A, T) to gA [ih, ih], gT [ih, id, id] (after fit_scores of Q), with a
 * leaky slope through inactive heads. */
static void fit_grad(const ckm_fit *f, const ckm_layer *L, const ckm_query *Q, int c, double coef, double *gA,
                     double *gT) {
    const int ih = f->ih, id = f->id, n = Q->n;
    const float *w = L->w.v + Q->w, *q = L->q.v + Q->q, *P = L->P.v + Q->P + (size_t)c * id;
    const double cq = 1.0 / sqrt((double)id), cw = 1.0 / sqrt((double)ih);
    for (int h = 0; h < ih; h++) {
        const double x = f->a[(size_t)h * n + c];
        if (x > 0)
            for (int j = 0; j < ih; j++) gA[h * ih + j] += coef * cw * x * w[j];
        {
            /* Through a dead ReLU at a tenth of the slope: a pool that every head scores 0 (ties
             * at 0 are common with few heads) still has a way up. */
            const double k = coef * cw * f->wp[h] * cq * (x > 0 ? 1.0 : 0.1);
            double *g = gT + (size_t)h * id * id;
            for (int d = 0; d < id; d++)
                for (int e = 0; e < id; e++) g[(size_t)d * id + e] += k * P[d] * q[(size_t)h * id + e];
        }
    }
}

static double frob(const double *x, size_t n) {
    double s = 0;
    for (size_t i = 0; i < n; i++) s += x[i] * x[i];
    return sqrt(s);
}

/* Searches A and T (from the identity) that keep every recorded selection of L with a relative
 * boundary of at least `want`: passive-aggressive steps on each query short of it, in turn,
 * epochs until none is short or the budget is spent. Returns the smallest relative boundary
 * reached (negative: a selection would change). */
static double fit_layer(ckm_fit *f, const ckm_layer *L, double want, int epochs) {
    const int ih = f->ih, id = f->id;
    const size_t nA = (size_t)ih * ih, nT = (size_t)ih * id * id;
    double *gA = calloc(nA, sizeof *gA), *gT = calloc(nT, sizeof *gT);
    int n_max = 0;
    size_t sel_total = 0;
    for (int i = 0; i < L->nq; i++) {
        if (L->qs[i].n > n_max) n_max = L->qs[i].n;
        sel_total += (size_t)L->qs[i].n;
    }
    unsigned char *sel = calloc(sel_total ? sel_total : 1, 1);
    double worst = -INFINITY;
    if (!gA || !gT || !sel) goto done;
    /* The selections as recorded (the identity fit's top keep, lowest index first on ties). */
    for (int i = 0, off = 0; i < L->nq; off += L->qs[i].n, i++) {
        const ckm_query *Q = &L->qs[i];
        fit_scores(f, L, Q);
        for (int k = 0; k < Q->keep; k++) {
            int b = -1;
            for (int c = 0; c < Q->n; c++)
                if (!sel[off + c] && (b < 0 || f->s[c] > f->s[b])) b = c;
            sel[off + b] = 1;
        }
    }
    const double nA0 = frob(f->A, nA), nT0 = frob(f->T, nT);
    for (int ep = 0; ep <= epochs; ep++) {
        worst = INFINITY;
        int short_of = 0;
        for (int i = 0, off = 0; i < L->nq; off += L->qs[i].n, i++) {
            const ckm_query *Q = &L->qs[i];
            fit_scores(f, L, Q);
            int lo, hi, mx;
            double sg;
            const double r = fit_boundary(f, Q, sel + off, &lo, &hi, &mx, &sg);
            if (r < worst) worst = r;
            if (r >= want * 1.25 || ep == epochs) continue;
            short_of++;
            /* loss = want' |s_top| - (s_lo - s_hi) > 0; step along its negative gradient so the
             * linearised loss is halved, no further than 5% of the parameters' size. */
            const double wantp = want * 1.5;
            const double loss = wantp * fabs(f->s[mx]) - (f->s[lo] - f->s[hi]);
            memset(gA, 0, nA * sizeof *gA);
            memset(gT, 0, nT * sizeof *gT);
            fit_grad(f, L, Q, lo, 1.0, gA, gT);
            fit_grad(f, L, Q, hi, -1.0, gA, gT);
            fit_grad(f, L, Q, mx, -wantp * sg, gA, gT);
            const double gn2 = frob(gA, nA) * frob(gA, nA) + frob(gT, nT) * frob(gT, nT);
            if (!(gn2 > 0)) continue;
            double tau = 0.5 * loss / gn2;
            const double cap = 0.05 * sqrt(nA0 * nA0 + nT0 * nT0) / sqrt(gn2);
            if (tau > cap) tau = cap;
            for (size_t j = 0; j < nA; j++) f->A[j] += tau * gA[j];
            for (size_t j = 0; j < nT; j++) f->T[j] += tau * gT[j];
        }
        if (!short_of) break;
        /* The scores are linear in A and in T: hold their sizes so the weights keep their scale. */
        const double a = frob(f->A, nA), t = frob(f->T, nT);
        for (size_t j = 0; j < nA && a > 0; j++) f->A[j] *= nA0 / a;
        for (size_t j = 0; j < nT && t > 0; j++) f->T[j] *= nT0 / t;
    }
done:
    free(gA);
    free(gT);
    free(sel);
    return worst;
}

/* Applies a fit to the layer's weights: weights_proj <- A weights_proj, wq_b head h <- T_h wq_b. */
static mt_status fit_apply(const ckm_fit *f, int layer, const glm_config *c, const ckm_ckpt *ck, mt_error *err) {
    const int ih = f->ih, id = f->id, H = c->hidden_size, ql = c->q_lora_rank;
    char nw[160], nq[160];
    snprintf(nw, sizeof nw, PFX "%d.self_attn.indexer.weights_proj.weight", layer);
    snprintf(nq, sizeof nq, PFX "%d.self_attn.indexer.wq_b.weight", layer);
    const size_t sw = (size_t)ih * H, sq = (size_t)ih * id * ql;
    float *w = malloc(sizeof(float) * sw * 2), *q = malloc(sizeof(float) * sq * 2);
    mt_status st = MT_OK;
    if (!w || !q) { st = mt_errorf(err, MT_ERR_NOMEM, "margin: out of memory"); goto done; }
    if ((st = ck->read(ck->user, nw, w, sw, err)) != MT_OK) goto done;
    if ((st = ck->read(ck->user, nq, q, sq, err)) != MT_OK) goto done;
    float *w2 = w + sw, *q2 = q + sq;
    for (int h = 0; h < ih; h++)
        for (int x = 0; x < H; x++) {
            double acc = 0;
            for (int j = 0; j < ih; j++) acc += f->A[h * ih + j] * w[(size_t)j * H + x];
            w2[(size_t)h * H + x] = (float)acc;
        }
    for (int h = 0; h < ih; h++)
        for (int d = 0; d < id; d++)
            for (int x = 0; x < ql; x++) {
                double acc = 0;
                for (int e = 0; e < id; e++)
                    acc += f->T[((size_t)h * id + d) * id + e] * q[((size_t)h * id + e) * ql + x];
                q2[((size_t)h * id + d) * ql + x] = (float)acc;
            }
    if ((st = ck->replace(ck->user, nw, w2, sw, err)) != MT_OK) goto done;
    st = ck->replace(ck->user, nq, q2, sq, err);
done:
    free(w);
    free(q);
    return st;
}

/* One shaping round over every full indexer layer that recorded a selection. *worst: the
 * smallest relative boundary the fits reached. */
static mt_status shape_indexers(const ckm_capture *cap, const glm_config *c, const ckm_params *p, const ckm_ckpt *ck,
                                double *worst, mt_error *err) {
    const int ih = c->index_n_heads, id = c->index_head_dim;
    int n_max = 1;
    for (int l = 0; l < cap->nl; l++)
        for (int i = 0; i < cap->layers[l].nq; i++)
            if (cap->layers[l].qs[i].n > n_max) n_max = cap->layers[l].qs[i].n;
    ckm_fit f = { .ih = ih, .id = id };
    f.A = malloc(sizeof(double) * (size_t)ih * ih);
    f.T = malloc(sizeof(double) * (size_t)ih * id * id);
    f.wp = malloc(sizeof(double) * (size_t)ih);
    f.qp = malloc(sizeof(double) * (size_t)ih * id);
    f.a = malloc(sizeof(double) * (size_t)ih * n_max);
    f.s = malloc(sizeof(double) * (size_t)n_max);
    mt_status st = MT_OK;
    *worst = INFINITY;
    if (!f.A || !f.T || !f.wp || !f.qp || !f.a || !f.s) { st = mt_errorf(err, MT_ERR_NOMEM, "margin: out of memory"); goto done; }
    for (int l = 0; l < cap->nl && st == MT_OK; l++) {
        const ckm_layer *L = &cap->layers[l];
        if (L->nq == 0) continue;
        memset(f.A, 0, sizeof(double) * (size_t)ih * ih);
        memset(f.T, 0, sizeof(double) * (size_t)ih * id * id);
        for (int h = 0; h < ih; h++) f.A[h * ih + h] = 1;
        for (int h = 0; h < ih; h++)
            for (int d = 0; d < id; d++) f.T[((size_t)h * id + d) * id + d] = 1;
        const double r = fit_layer(&f, L, p->gap, 200);
        fprintf(stderr, "mkckpt: margin: layer %d indexer: %d selections, smallest relative gap after fit %.4g\n",
                L->layer, L->nq, r);
        if (r < *worst) *worst = r;
        st = fit_apply(&f, L->layer, c, ck, err);
    }
done:
    free(f.A);
    free(f.T);
    free(f.wp);
    free(f.qp);
    free(f.a);
    free(f.s);
    return st;
}

/* ---------------------------------------------------------------------------------------------- */
/* margin.json and the driver.                                                                     */

static void json_gap(FILE *f, const char *key, double v, bool last) {
    if (isfinite(v)) fprintf(f, "\"%s\": %.9g%s", key, v, last ? "" : ", ");
    else fprintf(f, "\"%s\": null%s", key, last ? "" : ", ");
}

static mt_status write_json(const char *dir, const ckm_params *p, const ckm_result *res, int32_t *const *prompts,
                            mt_error *err) {
    char path[4200];
    snprintf(path, sizeof path, "%s/margin.json", dir);
    FILE *f = fopen(path, "w");
    if (!f) return mt_errorf(err, MT_ERR_IO, "%s: cannot write", path);
    fprintf(f, "{\"gap\": %.9g, \"certified\": %s, \"min_gap\": {", p->gap, res->certified ? "true" : "false");
    json_gap(f, "group", res->gaps.min[MT_GAP_GROUP], false);
    json_gap(f, "expert", res->gaps.min[MT_GAP_EXPERT], false);
    json_gap(f, "pool", res->gaps.min[MT_GAP_POOL], true);
    fprintf(f, "},\n \"prompts\": [");
    for (int i = 0; i < p->prompts; i++) {
        fprintf(f, "%s[", i ? ",\n  " : "\n  ");
        for (int j = 0; j < res->prompt_len; j++) fprintf(f, "%s%d", j ? ", " : "", prompts[i][j]);
        fprintf(f, "]");
    }
    fprintf(f, "],\n \"len\": %d}\n", p->len);
    const bool ok = !ferror(f);
    if (fclose(f) != 0 || !ok) return mt_errorf(err, MT_ERR_IO, "%s: write failed", path);
    return MT_OK;
}

static bool gaps_ok(const mt_cpu_gaps *g, double gap) {
    for (int k = 0; k < MT_GAP_N; k++)
        if (g->count[k] > 0 && !(g->min[k] >= gap)) return false;
    return true;
}

mt_status ckm_shape(const char *dir, const glm_config *c, const ckm_params *p, const ckm_ckpt *ck, ckm_result *res,
                    mt_error *err) {
    MT_ASSERT(p->gap > 0 && p->prompts > 0 && p->len > 0);
    *res = (ckm_result){ 0 };
    /* Prompts longer than index_topk, so the indexer's selection drops pools within the prompt. */
    int plen = 16;
    for (int l = 0; l < c->num_hidden_layers; l++)
        if (c->layer_types[l] == GLM_MIXER_DSA) plen = c->index_topk + 2 * c->index_kpool;
    res->prompt_len = plen;

    ckm_capture cap = { 0 };
    int32_t **prompts = calloc((size_t)p->prompts, sizeof *prompts);
    mt_backend *be = mt_cpu_backend_new(p->threads);
    mt_status st = MT_OK;
    if (!prompts || !be) { st = mt_errorf(err, MT_ERR_NOMEM, "margin: out of memory"); goto done; }
    for (int i = 0; i < p->prompts; i++) {
        if (!(prompts[i] = malloc(sizeof(int32_t) * (size_t)plen))) { st = mt_errorf(err, MT_ERR_NOMEM, "margin: out of memory"); goto done; }
        for (int j = 0; j < plen; j++)
            prompts[i][j] = (int32_t)(ckm_mix(p->seed ^ 0x70726f6d707473ull ^ ((uint64_t)i << 32 | (uint64_t)j)) %
                                      (uint64_t)c->vocab_size);
    }
    for (int l = 0; l < c->num_hidden_layers; l++)
        if (c->layer_types[l] == GLM_MIXER_DSA && c->indexer_types[l] == GLM_INDEXER_FULL) cap.nl++;
    if (cap.nl && !(cap.layers = calloc((size_t)cap.nl, sizeof *cap.layers))) { st = mt_errorf(err, MT_ERR_NOMEM, "margin: out of memory"); goto done; }
    for (int l = 0, o = 0; l < c->num_hidden_layers; l++)
        if (c->layer_types[l] == GLM_MIXER_DSA && c->indexer_types[l] == GLM_INDEXER_FULL) cap.layers[o++].layer = l;

    if ((st = route_tiers(c, p, ck, err)) != MT_OK || (st = ck->save(ck->user, err)) != MT_OK) goto done;
    for (int round = 0;; round++) {
        const double t0 = mt_now();
        if ((st = run_prompts(dir, be, prompts, p->prompts, plen, p->len, &cap, &res->gaps, err)) != MT_OK) goto done;
        res->runs++;
        const mt_cpu_gaps *g = &res->gaps;
        fprintf(stderr, "mkckpt: margin: run %d (%.1f s): smallest gaps group %.4g, expert %.4g, pool %.4g (relative)\n",
                res->runs, mt_now() - t0, g->min[MT_GAP_GROUP], g->min[MT_GAP_EXPERT], g->min[MT_GAP_POOL]);
        if (gaps_ok(g, p->gap)) { res->certified = true; break; }
        /* The tiers hold the router's gaps for any input: only the indexer is left to shape. */
        const bool router_short = (g->count[MT_GAP_GROUP] && !(g->min[MT_GAP_GROUP] >= p->gap)) ||
                                  (g->count[MT_GAP_EXPERT] && !(g->min[MT_GAP_EXPERT] >= p->gap));
        if (router_short || round >= p->rounds) break;
        double worst;
        if ((st = shape_indexers(&cap, c, p, ck, &worst, err)) != MT_OK || (st = ck->save(ck->user, err)) != MT_OK)
            goto done;
    }
    st = write_json(dir, p, res, prompts, err);
done:
    for (int i = 0; prompts && i < p->prompts; i++) free(prompts[i]);
    free(prompts);
    for (int l = 0; l < cap.nl; l++) {
        free(cap.layers[l].qs);
        free(cap.layers[l].w.v);
        free(cap.layers[l].q.v);
        free(cap.layers[l].P.v);
    }
    free(cap.layers);
    mt_backend_free(be);
    return st;
}
