/* worker/engine/sampler.c: penalties, temperature, top-k / top-p / min-p and the draw (see
 * sampler.h for the order and the logprob convention). Everything is O(vocab) per call except the
 * sorts, which touch only the top-k, or for top-p the smallest sorted prefix holding the nucleus. */
#include "worker/engine/sampler.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

/* A candidate token: its (penalised, tempered) logit, id, and exp(v - max) once known. */
typedef struct eng_cand {
    float v;
    int32_t id;
    double e;
} eng_cand;

struct eng_sampler {
    int vocab;
    float *work;      /* [vocab] penalised logits */
    eng_cand *cand;   /* [vocab] */
    uint32_t *count;  /* [vocab] generated-token counts; all zero between calls */
    uint8_t *seen;    /* [vocab] repetition marks; all zero between calls */
};

eng_sample_params eng_sample_default_params(void) {
    return (eng_sample_params){ .temperature = 0.0f, .top_k = 0, .top_p = 1.0f, .min_p = 0.0f,
                                .repetition_penalty = 1.0f, .presence_penalty = 0.0f,
                                .frequency_penalty = 0.0f };
}

mt_status eng_sample_params_check(const eng_sample_params *p, mt_error *err) {
    if (!(p->temperature >= 0.0f && p->temperature <= 100.0f))
        return mt_errorf(err, MT_ERR_INVALID, "temperature must be in [0, 100], got %g", p->temperature);
    if (p->top_k < 0) return mt_errorf(err, MT_ERR_INVALID, "top_k must be >= 0, got %d", p->top_k);
    if (!(p->top_p > 0.0f && p->top_p <= 1.0f))
        return mt_errorf(err, MT_ERR_INVALID, "top_p must be in (0, 1], got %g", p->top_p);
    if (!(p->min_p >= 0.0f && p->min_p <= 1.0f))
        return mt_errorf(err, MT_ERR_INVALID, "min_p must be in [0, 1], got %g", p->min_p);
    if (!(p->repetition_penalty > 0.0f && p->repetition_penalty <= 10.0f))
        return mt_errorf(err, MT_ERR_INVALID, "repetition_penalty must be in (0, 10], got %g",
                         p->repetition_penalty);
    if (!(p->presence_penalty >= -2.0f && p->presence_penalty <= 2.0f))
        return mt_errorf(err, MT_ERR_INVALID, "presence_penalty must be in [-2, 2], got %g", p->presence_penalty);
    if (!(p->frequency_penalty >= -2.0f && p->frequency_penalty <= 2.0f))
        return mt_errorf(err, MT_ERR_INVALID, "frequency_penalty must be in [-2, 2], got %g",
                         p->frequency_penalty);
    return MT_OK;
}

/* ---- RNG: xoshiro256** (Blackman, Vigna), seeded through splitmix64 ---- */

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

void eng_rng_seed(eng_rng *r, uint64_t seed) {
    for (int i = 0; i < 4; i++) r->s[i] = splitmix64(&seed);
}

void eng_rng_seed_random(eng_rng *r) {
    uint64_t seed = 0;
    if (getrandom(&seed, sizeof seed, GRND_NONBLOCK) != (ssize_t)sizeof seed) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        seed = (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 30) ^ (uint64_t)(uintptr_t)r;
    }
    eng_rng_seed(r, seed);
}

static inline uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

uint64_t eng_rng_next(eng_rng *r) {
    uint64_t *s = r->s;
    const uint64_t out = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return out;
}

double eng_rng_uniform(eng_rng *r) { return (double)(eng_rng_next(r) >> 11) * 0x1.0p-53; }

/* ---- workspace ---- */

eng_sampler *eng_sampler_new(int vocab) {
    if (vocab < 1) return NULL;
    eng_sampler *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->vocab = vocab;
    s->work = malloc(sizeof(float) * (size_t)vocab);
    s->cand = malloc(sizeof(eng_cand) * (size_t)vocab);
    s->count = calloc((size_t)vocab, sizeof(uint32_t));
    s->seen = calloc((size_t)vocab, 1);
    if (!s->work || !s->cand || !s->count || !s->seen) {
        eng_sampler_free(s);
        return NULL;
    }
    return s;
}

void eng_sampler_free(eng_sampler *s) {
    if (!s) return;
    free(s->work);
    free(s->cand);
    free(s->count);
    free(s->seen);
    free(s);
}

/* ---- ordering: higher logit first, then lower id (deterministic) ---- */

static inline bool cand_before(const eng_cand *a, const eng_cand *b) {
    return a->v > b->v || (a->v == b->v && a->id < b->id);
}

static int cand_cmp(const void *pa, const void *pb) {
    const eng_cand *a = pa, *b = pb;
    return cand_before(a, b) ? -1 : cand_before(b, a) ? 1 : 0;
}

static inline void cand_swap(eng_cand *a, eng_cand *b) {
    eng_cand t = *a;
    *a = *b;
    *b = t;
}

/* Rearranges c[0, n) so that its first k entries are the k first in order (unsorted). */
static void cand_select(eng_cand *c, int n, int k) {
    int lo = 0, hi = n - 1;
    while (hi > lo) {
        const int mid = lo + (hi - lo) / 2;
        /* median of three to c[hi] as the pivot */
        if (cand_before(&c[mid], &c[lo])) cand_swap(&c[mid], &c[lo]);
        if (cand_before(&c[hi], &c[lo])) cand_swap(&c[hi], &c[lo]);
        if (cand_before(&c[mid], &c[hi])) cand_swap(&c[mid], &c[hi]);
        const eng_cand pivot = c[hi];
        int store = lo;
        for (int i = lo; i < hi; i++)
            if (cand_before(&c[i], &pivot)) cand_swap(&c[i], &c[store++]);
        cand_swap(&c[store], &c[hi]);
        if (store == k - 1 || store == k) return;
        if (store < k) lo = store + 1;
        else hi = store - 1;
    }
}

/* Sorts the first k of c[0, n) into order, the rest left after them. */
static void cand_top_sorted(eng_cand *c, int n, int k) {
    if (k < n) cand_select(c, n, k);
    qsort(c, (size_t)k, sizeof *c, cand_cmp);
}

/* ---- raw logprobs ---- */

static inline float finite_or_neg_inf(float x) { return isnan(x) ? -INFINITY : x; }

static void raw_logprobs(const float *logits, int V, int32_t token, bool want_logprob, int n_top,
                         eng_sample_result *out) {
    float mx = -INFINITY;
    for (int v = 0; v < V; v++) mx = fmaxf(mx, finite_or_neg_inf(logits[v]));
    double sum = 0.0;
    if (isfinite(mx))
        for (int v = 0; v < V; v++) sum += exp((double)finite_or_neg_inf(logits[v]) - mx);
    const double lse = isfinite(mx) && sum > 0.0 ? mx + log(sum) : 0.0;
    if (want_logprob) out->logprob = (float)((double)finite_or_neg_inf(logits[token]) - lse);
    /* top-n by insertion into a sorted array of at most 20 */
    eng_cand best[ENG_TOP_LOGPROBS_MAX];
    int nb = 0;
    for (int v = 0; v < V && n_top > 0; v++) {
        eng_cand c = { .v = finite_or_neg_inf(logits[v]), .id = v };
        if (nb == n_top && !cand_before(&c, &best[nb - 1])) continue;
        int i = nb < n_top ? nb++ : nb - 1;
        while (i > 0 && cand_before(&c, &best[i - 1])) {
            best[i] = best[i - 1];
            i--;
        }
        best[i] = c;
    }
    out->n_top = nb;
    for (int i = 0; i < nb; i++) {
        out->top_ids[i] = best[i].id;
        out->top_logprobs[i] = (float)((double)best[i].v - lse);
    }
}

/* ---- penalties ---- */

static void apply_penalties(eng_sampler *s, const eng_sample_params *p, const eng_history *h) {
    const int V = s->vocab;
    float *w = s->work;
    if (!h) return;
    if (p->repetition_penalty != 1.0f) {
        const float rp = p->repetition_penalty;
        for (int part = 0; part < 2; part++) {
            const int32_t *t = part ? h->generated : h->prompt;
            const int n = part ? h->n_generated : h->n_prompt;
            for (int i = 0; i < n; i++) {
                const int32_t id = t[i];
                if (id < 0 || id >= V || s->seen[id]) continue;
                s->seen[id] = 1;
                w[id] = w[id] > 0.0f ? w[id] / rp : w[id] * rp;
            }
        }
        for (int part = 0; part < 2; part++) { /* clear the marks */
            const int32_t *t = part ? h->generated : h->prompt;
            const int n = part ? h->n_generated : h->n_prompt;
            for (int i = 0; i < n; i++)
                if (t[i] >= 0 && t[i] < V) s->seen[t[i]] = 0;
        }
    }
    if (p->presence_penalty != 0.0f || p->frequency_penalty != 0.0f) {
        for (int i = 0; i < h->n_generated; i++) {
            const int32_t id = h->generated[i];
            if (id >= 0 && id < V) s->count[id]++;
        }
        for (int i = 0; i < h->n_generated; i++) { /* apply once per distinct id, then clear */
            const int32_t id = h->generated[i];
            if (id < 0 || id >= V || s->count[id] == 0) continue;
            w[id] -= p->presence_penalty + p->frequency_penalty * (float)s->count[id];
            s->count[id] = 0;
        }
    }
}

int32_t eng_argmax(const float *w, int V) {
    int32_t best = 0;
    for (int v = 1; v < V; v++)
        if (w[v] > w[best]) best = v;
    return best;
}

/* ---- sampling ---- */

static int kept_candidates(eng_sampler *s, const eng_sample_params *p, int *n_out);

static int32_t draw(eng_sampler *s, const eng_sample_params *p, eng_rng *rng) {
    const eng_cand *c = s->cand;
    int n = 0;
    if (kept_candidates(s, p, &n) < 0) return eng_argmax(s->work, s->vocab); /* nothing finite: greedy */
    double kept = 0.0;
    for (int i = 0; i < n; i++) kept += c[i].e;
    const double u = eng_rng_uniform(rng) * kept;
    double acc = 0.0;
    for (int i = 0; i < n; i++) {
        acc += c[i].e;
        if (u < acc) return c[i].id;
    }
    return c[n - 1].id; /* u rounded up to kept */
}

/* The candidates a draw keeps from s->work, with their weights e (relative to the best) in
 * s->cand[0, *n_out): temperature, top-k, top-p, min-p. -1 when nothing is finite. */
static int kept_candidates(eng_sampler *s, const eng_sample_params *p, int *n_out) {
    const int V = s->vocab;
    eng_cand *c = s->cand;
    const float inv_t = 1.0f / p->temperature;
    for (int v = 0; v < V; v++) c[v] = (eng_cand){ .v = s->work[v] * inv_t, .id = v };
    int n = V, sorted = 0;
    if (p->top_k > 0 && p->top_k < n) {
        cand_top_sorted(c, n, p->top_k);
        n = sorted = p->top_k;
    }
    float mx = -INFINITY;
    for (int i = 0; i < n; i++) mx = fmaxf(mx, c[i].v);
    if (!isfinite(mx)) return -1;
    double sum = 0.0;
    for (int i = 0; i < n; i++) sum += (c[i].e = exp((double)c[i].v - mx));
    if (p->top_p < 1.0f) {
        /* The nucleus lies within the smallest sorted prefix whose mass reaches top_p: sort a
         * prefix of m, grow m by 8x until it holds the nucleus (usually one small sort). */
        const double target = (double)p->top_p * sum;
        int keep = 0;
        for (int m = sorted > 0 ? sorted : (n < 64 ? n : 64);; m = m * 8 < n ? m * 8 : n) {
            if (m > sorted) {
                cand_top_sorted(c, n, m);
                sorted = m;
            }
            double cum = 0.0;
            for (keep = 0; keep < m;) {
                cum += c[keep++].e;
                if (cum >= target) break;
            }
            if (cum >= target || m == n) break;
        }
        n = keep > 0 ? keep : 1;
    }
    if (p->min_p > 0.0f) {
        /* e is p / p_max, so the test p >= min_p * p_max is e >= min_p; the top token stays. */
        int k = 0;
        for (int i = 0; i < n; i++)
            if (c[i].e >= (double)p->min_p || c[i].v == mx) c[k++] = c[i];
        n = k;
    }
    *n_out = n;
    return 0;
}

void eng_sample_probs(eng_sampler *s, const eng_sample_params *p, const float *logits, const eng_history *hist,
                      float *probs) {
    const int V = s->vocab;
    for (int v = 0; v < V; v++) s->work[v] = finite_or_neg_inf(logits[v]);
    apply_penalties(s, p, hist);
    memset(probs, 0, sizeof(float) * (size_t)V);
    int n = 0;
    if (p->temperature <= 0.0f || kept_candidates(s, p, &n) < 0) {
        probs[eng_argmax(s->work, V)] = 1.0f;
        return;
    }
    double kept = 0.0;
    for (int i = 0; i < n; i++) kept += s->cand[i].e;
    for (int i = 0; i < n; i++) probs[s->cand[i].id] = (float)(s->cand[i].e / kept);
}

int32_t eng_draw_probs(eng_rng *rng, const float *probs, int vocab) {
    double sum = 0.0;
    int32_t last = 0;
    for (int v = 0; v < vocab; v++)
        if (probs[v] > 0.0f) {
            sum += probs[v];
            last = v;
        }
    const double u = eng_rng_uniform(rng) * sum;
    double acc = 0.0;
    for (int v = 0; v < vocab; v++) {
        if (probs[v] <= 0.0f) continue;
        acc += probs[v];
        if (u < acc) return v;
    }
    return last; /* u rounded up to sum */
}

int32_t eng_spec_verdict(eng_rng *rng, const float *p, const float *q, int vocab, int32_t draft, bool *accepted) {
    const double pd = p[draft], qd = q[draft];
    *accepted = qd > 0.0 && (pd >= qd || eng_rng_uniform(rng) * qd < pd);
    if (*accepted) return draft;
    double sum = 0.0;
    int32_t last = -1;
    for (int v = 0; v < vocab; v++)
        if (p[v] > q[v]) {
            sum += (double)p[v] - q[v];
            last = v;
        }
    if (last < 0) return eng_draw_probs(rng, p, vocab); /* p == q: no residual (a draft q never gives) */
    const double u = eng_rng_uniform(rng) * sum;
    double acc = 0.0;
    for (int v = 0; v < vocab; v++) {
        if (p[v] <= q[v]) continue;
        acc += (double)p[v] - q[v];
        if (u < acc) return v;
    }
    return last;
}

void eng_sample(eng_sampler *s, const eng_sample_params *p, eng_rng *rng, const float *logits,
                const eng_history *hist, bool want_logprob, int n_top, eng_sample_result *out) {
    const int V = s->vocab;
    if (n_top < 0) n_top = 0;
    if (n_top > ENG_TOP_LOGPROBS_MAX) n_top = ENG_TOP_LOGPROBS_MAX;
    if (n_top > V) n_top = V;
    for (int v = 0; v < V; v++) s->work[v] = finite_or_neg_inf(logits[v]);
    apply_penalties(s, p, hist);
    out->token = p->temperature > 0.0f ? draw(s, p, rng) : eng_argmax(s->work, V);
    out->logprob = 0.0f;
    out->n_top = 0;
    if (want_logprob || n_top > 0) raw_logprobs(logits, V, out->token, want_logprob, n_top, out);
}

void eng_score(const eng_sampler *s, const float *logits, int32_t token, int n_top, eng_sample_result *out) {
    const int V = s->vocab;
    if (n_top < 0) n_top = 0;
    if (n_top > ENG_TOP_LOGPROBS_MAX) n_top = ENG_TOP_LOGPROBS_MAX;
    if (n_top > V) n_top = V;
    out->token = token;
    out->n_top = 0;
    raw_logprobs(logits, V, token, true, n_top, out);
}
