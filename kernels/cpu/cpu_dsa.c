/* kernels/cpu/cpu_dsa.c: the DSA ops: pooled indexer keys, head-weighted ReLU pool scores with
 * pool top-k plus the tail, and sparse MLA attention computed in the latent space (weight
 * absorption: q is folded through W_k into kv_lora dims, the output leaves through W_v). The caches
 * are paged (kernels/backend.h mt_paged): every row is found through the block table. */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu_ops.h"

/* The members of pool p are positions [p*kpool, (p+1)*kpool): consecutive rows of one page, since
 * page is a multiple of kpool. */
static void cpu_dsa_pool_keys(mt_backend *be, mt_paged pool_keys, mt_paged ki, mt_paged gs, const int32_t *bt,
                              const float *ape, int p0, int p1, int kpool) {
    (void)be;
    const int id = (int)ki.row;
    MT_ASSERT(p0 >= 0 && p1 >= p0 && kpool > 0 && id > 0 && gs.row == id && pool_keys.row == id);
    MT_ASSERT(ki.page == gs.page && ki.page == pool_keys.page * kpool);
    float *wj = malloc(sizeof(float) * (size_t)kpool);
    for (int p = p0; p < p1; p++) {
        const int64_t t = (int64_t)p * kpool;
        const float *k = mt_paged_at(ki, bt, t), *g = mt_paged_at(gs, bt, t);
        float *out = mt_paged_at(pool_keys, bt, p);
        for (int d = 0; d < id; d++) {
            float m = -INFINITY, sum = 0;
            for (int j = 0; j < kpool; j++) {
                wj[j] = g[(size_t)j * id + d] + ape[(size_t)j * id + d];
                if (wj[j] > m) m = wj[j];
            }
            for (int j = 0; j < kpool; j++) sum += (wj[j] = expf(wj[j] - m));
            float acc = 0;
            for (int j = 0; j < kpool; j++) acc += wj[j] / sum * k[(size_t)j * id + d];
            out[d] = acc;
        }
    }
    free(wj);
}

typedef struct scored {
    float score;
    int pool;
} scored;

/* Descending score, then ascending pool index, so ties resolve the same way every run. */
static int scored_cmp(const void *a, const void *b) {
    const scored *x = a, *y = b;
    if (x->score != y->score) return x->score > y->score ? -1 : 1;
    return x->pool - y->pool;
}

static void cpu_dsa_pool_keys_at(mt_backend *be, mt_paged pool_keys, mt_paged ki, mt_paged gs, const int32_t *bt,
                                 const float *ape, const int32_t *pos, int kpool) {
    const int t = *pos;
    if ((t + 1) % kpool == 0) cpu_dsa_pool_keys(be, pool_keys, ki, gs, bt, ape, t / kpool, t / kpool + 1, kpool);
}

static void cpu_dsa_select(mt_backend *be, int32_t *sel, int32_t *nsel, const float *qi, const float *w,
                           mt_paged pool_keys, const int32_t *bt, int t0, int n, const mt_dsa_select_params *p) {
    if (p->t0_dev) t0 = *p->t0_dev; /* host memory on this backend */
    MT_ASSERT(pool_keys.row == p->id && pool_keys.page > 0);
    const float qscale = 1.f / sqrtf((float)p->id), wscale = 1.f / sqrtf((float)p->ih);
    const int64_t work = (int64_t)n * ((t0 + n) / p->kpool + 1) * p->ih * p->id;
#pragma omp parallel num_threads(be->n_threads) if (work > CPU_PAR_MIN_WORK)
    {
        const int max_cand = (t0 + n) / p->kpool;
        scored *cand = malloc(sizeof(scored) * (size_t)(max_cand > 0 ? max_cand : 1));
#pragma omp for schedule(dynamic)
        for (int i = 0; i < n; i++) {
            const int t = t0 + i, ncand = (t + 1) / p->kpool; /* complete pools ending <= t */
            const float *q = qi + (size_t)i * p->ih * p->id, *wi = w + (size_t)i * p->ih;
            for (int c = 0; c < ncand; c++) {
                const float *P = mt_paged_at(pool_keys, bt, c);
                float s = 0;
                for (int h = 0; h < p->ih; h++) {
                    float d = 0;
                    for (int j = 0; j < p->id; j++) d += q[(size_t)h * p->id + j] * P[j];
                    d *= qscale;
                    s += wi[h] * wscale * (d > 0 ? d : 0);
                }
                cand[c] = (scored){ s, c };
            }
            const int keep = ncand < p->max_pools ? ncand : p->max_pools;
            if (keep < ncand) {
                qsort(cand, (size_t)ncand, sizeof(scored), scored_cmp);
                if (cpu_gaps_on && keep > 0) { /* k-th against (k+1)-th, relative to the largest |score| */
                    const float top = fmaxf(fabsf(cand[0].score), fabsf(cand[ncand - 1].score));
                    const double gap = (double)cand[keep - 1].score - cand[keep].score;
                    mt_cpu_gaps_note(MT_GAP_POOL, top > 0 ? gap / top : 0.0);
                }
            }
            int32_t *row = sel + (size_t)i * p->max_sel;
            int m = 0;
            for (int c = 0; c < keep; c++)
                for (int j = 0; j < p->kpool; j++) row[m++] = cand[c].pool * p->kpool + j;
            if (p->tail)
                for (int pos = t + 1 - (t + 1) % p->kpool; pos <= t; pos++) row[m++] = pos;
            nsel[i] = m;
        }
        free(cand);
    }
}

static void cpu_mla_sparse(mt_backend *be, float *out, const float *q, mt_paged latent, const int32_t *bt,
                           const mt_weight *kv_b, const int32_t *sel, const int32_t *nsel, int max_sel,
                           int t0, int n, const mt_mla_params *p) {
    if (p->t0_dev) t0 = *p->t0_dev;
    const int dn = p->dn, dv = p->dv, kvl = p->kvl;
    MT_ASSERT(latent.row == kvl && latent.page > 0);
    const int64_t work = (int64_t)n * p->Hq * kvl * (dn + dv + (max_sel > t0 + n ? max_sel : t0 + n));
#pragma omp parallel num_threads(be->n_threads) if (work > CPU_PAR_MIN_WORK)
    {
        float *wrow = malloc(sizeof(float) * (size_t)kvl);
        float *qa = malloc(sizeof(float) * (size_t)kvl);
        float *ol = malloc(sizeof(float) * (size_t)kvl);
        float *sc = malloc(sizeof(float) * (size_t)(t0 + n > max_sel ? t0 + n : max_sel));
#pragma omp for collapse(2) schedule(dynamic)
        for (int i = 0; i < n; i++)
            for (int h = 0; h < p->Hq; h++) {
                const float *qh = q + ((size_t)i * p->Hq + h) * dn;
                const int64_t wk0 = (int64_t)h * (dn + dv);
                /* qa = W_k[h]^T q_h  (kv_b rows wk0 .. wk0+dn are head h's key rows) */
                for (int c = 0; c < kvl; c++) qa[c] = 0;
                for (int d = 0; d < dn; d++) {
                    cpu_weight_row(kv_b, wk0 + d, wrow);
                    for (int c = 0; c < kvl; c++) qa[c] += qh[d] * wrow[c];
                }
                const int t = t0 + i, m = nsel[i];
                const int cnt = m > 0 ? m : t + 1;
                const int32_t *row = sel + (size_t)i * max_sel;
                float mx = -INFINITY;
                for (int s = 0; s < cnt; s++) {
                    const float *cj = mt_paged_at(latent, bt, m > 0 ? row[s] : s);
                    float a = 0;
                    for (int c = 0; c < kvl; c++) a += qa[c] * cj[c];
                    /* Empty selection: the reference attends to every position <= t equally. */
                    sc[s] = m > 0 ? a * p->scale : 0.f;
                    if (sc[s] > mx) mx = sc[s];
                }
                float sum = 0;
                for (int s = 0; s < cnt; s++) sum += (sc[s] = expf(sc[s] - mx));
                for (int c = 0; c < kvl; c++) ol[c] = 0;
                for (int s = 0; s < cnt; s++) {
                    const float *cj = mt_paged_at(latent, bt, m > 0 ? row[s] : s);
                    const float pj = sc[s] / sum;
                    for (int c = 0; c < kvl; c++) ol[c] += pj * cj[c];
                }
                float *oh = out + ((size_t)i * p->Hq + h) * dv;
                for (int e = 0; e < dv; e++) {
                    cpu_weight_row(kv_b, wk0 + dn + e, wrow);
                    float a = 0;
                    for (int c = 0; c < kvl; c++) a += wrow[c] * ol[c];
                    oh[e] = a;
                }
            }
        free(wrow);
        free(qa);
        free(ol);
        free(sc);
    }
}

void cpu_dsa_fill(mt_backend_ops *t) {
    t->dsa_pool_keys = cpu_dsa_pool_keys;
    t->dsa_pool_keys_at = cpu_dsa_pool_keys_at;
    t->dsa_select = cpu_dsa_select;
    t->mla_sparse = cpu_mla_sparse;
}
