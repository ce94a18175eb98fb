// worker/engine/sampler: greedy and penalties against hand-computed values, the filters against a
// brute-force reference (full sort, same RNG draws), empirical frequencies against the softmax,
// seeded reproducibility, and raw logprobs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "worker/engine/sampler.h"

namespace {

struct Sampler {
    explicit Sampler(int vocab) : s(eng_sampler_new(vocab)) {}
    ~Sampler() { eng_sampler_free(s); }
    eng_sampler *s;
};

eng_sample_result Sample(eng_sampler *s, const eng_sample_params &p, eng_rng *rng, const std::vector<float> &l,
                         const eng_history *h = nullptr, bool lp = false, int top = 0) {
    eng_sample_result r;
    eng_sample(s, &p, rng, l.data(), h, lp, top, &r);
    return r;
}

std::vector<double> Softmax(const std::vector<float> &l, double t) {
    double mx = -INFINITY, sum = 0;
    for (float x : l) mx = std::max(mx, (double)x / t);
    std::vector<double> p(l.size());
    for (size_t i = 0; i < l.size(); i++) sum += (p[i] = std::exp((double)l[i] / t - mx));
    for (double &x : p) x /= sum;
    return p;
}

// The definition, written the slow way: penalties, temperature, full sort, top-k, top-p, min-p,
// then the same draw over the same order (sorted when top-k or top-p is on, else by id).
int32_t Reference(const eng_sample_params &p, eng_rng *rng, std::vector<float> w, const eng_history *h) {
    const int V = (int)w.size();
    if (h) {
        if (p.repetition_penalty != 1.0f) {
            std::vector<bool> seen(V);
            for (int i = 0; i < h->n_prompt; i++) seen[h->prompt[i]] = true;
            for (int i = 0; i < h->n_generated; i++) seen[h->generated[i]] = true;
            for (int v = 0; v < V; v++)
                if (seen[v]) w[v] = w[v] > 0 ? w[v] / p.repetition_penalty : w[v] * p.repetition_penalty;
        }
        std::map<int, int> cnt;
        for (int i = 0; i < h->n_generated; i++) cnt[h->generated[i]]++;
        for (auto &kv : cnt) w[kv.first] -= p.presence_penalty + p.frequency_penalty * (float)kv.second;
    }
    if (p.temperature == 0.0f) return (int32_t)(std::max_element(w.begin(), w.end()) - w.begin());
    struct C { float v; int id; double e; };
    std::vector<C> c;
    for (int v = 0; v < V; v++) c.push_back({ w[v] * (1.0f / p.temperature), v, 0 });
    auto by_logit = [](const C &a, const C &b) { return a.v > b.v || (a.v == b.v && a.id < b.id); };
    if (p.top_k > 0 && p.top_k < V) {
        std::sort(c.begin(), c.end(), by_logit);
        c.resize(p.top_k);
    }
    float mx = -INFINITY;
    for (auto &x : c) mx = std::max(mx, x.v);
    double sum = 0;  // summed in the order the sampler sums: by id, or sorted after top-k
    for (auto &x : c) sum += (x.e = std::exp((double)x.v - mx));
    if (p.top_p < 1.0f) {
        std::sort(c.begin(), c.end(), by_logit);
        double cum = 0;
        size_t keep = 0;
        while (keep < c.size()) {
            cum += c[keep++].e;
            if (cum >= (double)p.top_p * sum) break;
        }
        c.resize(std::max<size_t>(keep, 1));
    }
    if (p.min_p > 0.0f) {
        std::vector<C> k;
        for (auto &x : c)
            if (x.e >= (double)p.min_p || x.v == mx) k.push_back(x);
        c = k;
    }
    double kept = 0;
    for (auto &x : c) kept += x.e;
    const double u = eng_rng_uniform(rng) * kept;
    double acc = 0;
    for (auto &x : c) {
        acc += x.e;
        if (u < acc) return x.id;
    }
    return c.back().id;
}

TEST(EngineSampler, GreedyIsArgmaxLowestIdOnTies) {
    Sampler s(5);
    eng_rng rng;
    eng_rng_seed(&rng, 1);
    eng_sample_params p = eng_sample_default_params();
    EXPECT_EQ(Sample(s.s, p, &rng, { 0.f, 3.f, 1.f, 3.f, -2.f }).token, 1);
    EXPECT_EQ(Sample(s.s, p, &rng, { -5.f, -4.f, -1.f, -3.f, -2.f }).token, 2);
}

TEST(EngineSampler, GreedyDoesNotAdvanceTheRng) {
    Sampler s(3);
    eng_rng a, b;
    eng_rng_seed(&a, 7);
    eng_rng_seed(&b, 7);
    Sample(s.s, eng_sample_default_params(), &a, { 1.f, 2.f, 3.f });
    EXPECT_EQ(eng_rng_next(&a), eng_rng_next(&b));
}

TEST(EngineSampler, RepetitionPenaltyDividesPositiveMultipliesNegative) {
    Sampler s(3);
    eng_rng rng;
    eng_rng_seed(&rng, 1);
    eng_sample_params p = eng_sample_default_params();
    p.repetition_penalty = 2.0f;
    // token 0 seen in the prompt: 3.0 -> 1.5 < 2.0, so 1 wins
    const int32_t prompt[] = { 0 };
    eng_history h = { prompt, 1, nullptr, 0 };
    EXPECT_EQ(Sample(s.s, p, &rng, { 3.f, 2.f, -1.f }, &h).token, 1);
    // negative: -1 seen (generated) -> -2, -1.5 unseen wins over it
    const int32_t gen[] = { 1, 1 };
    eng_history h2 = { nullptr, 0, gen, 2 };
    EXPECT_EQ(Sample(s.s, p, &rng, { -1.5f, -1.0f, -3.f }, &h2).token, 0);
    // a token seen twice is penalised once
    EXPECT_EQ(Sample(s.s, p, &rng, { -2.1f, -1.0f, -3.f }, &h2).token, 1);  // -2 > -2.1
}

TEST(EngineSampler, PresenceAndFrequencyCountGeneratedOnly) {
    Sampler s(3);
    eng_rng rng;
    eng_rng_seed(&rng, 1);
    eng_sample_params p = eng_sample_default_params();
    p.frequency_penalty = 0.5f;
    p.presence_penalty = 0.25f;
    const int32_t prompt[] = { 2, 2, 2, 2 };
    const int32_t gen[] = { 0, 0, 1 };
    eng_history h = { prompt, 4, gen, 3 };
    // 0: 3 - 0.25 - 1.0 = 1.75; 1: 2.5 - 0.25 - 0.5 = 1.75 (tie -> 0); 2: 1.7 (prompt not counted)
    EXPECT_EQ(Sample(s.s, p, &rng, { 3.f, 2.5f, 1.7f }, &h).token, 0);
    EXPECT_EQ(Sample(s.s, p, &rng, { 3.f, 2.51f, 1.7f }, &h).token, 1);
    EXPECT_EQ(Sample(s.s, p, &rng, { 3.f, 2.5f, 1.76f }, &h).token, 2);
}

TEST(EngineSampler, WorkspaceIsCleanBetweenCalls) {
    // penalty marks and counts from one call must not leak into the next
    Sampler s(3);
    eng_rng rng;
    eng_rng_seed(&rng, 1);
    eng_sample_params p = eng_sample_default_params();
    p.repetition_penalty = 4.0f;
    p.frequency_penalty = 1.0f;
    const int32_t gen[] = { 0, 0 };
    eng_history h = { gen, 2, gen, 2 };
    EXPECT_EQ(Sample(s.s, p, &rng, { 3.f, 1.f, 0.f }, &h).token, 1);
    eng_history none = { nullptr, 0, nullptr, 0 };
    EXPECT_EQ(Sample(s.s, p, &rng, { 3.f, 1.f, 0.f }, &none).token, 0);
}

TEST(EngineSampler, FiltersMatchBruteForceReference) {
    const int V = 5000;
    std::mt19937 gen(123);
    std::normal_distribution<float> nd(0.f, 3.f);
    std::vector<float> l(V);
    for (float &x : l) x = nd(gen);
    l[17] = l[42];  // a tie
    std::vector<int32_t> prompt = { 1, 2, 3, 17 }, hist = { 5, 5, 42, 9 };
    eng_history h = { prompt.data(), (int)prompt.size(), hist.data(), (int)hist.size() };
    struct Case { float t; int k; float p, minp, rep, pres, freq; };
    const Case cases[] = {
        { 1.0f, 0, 1.0f, 0.0f, 1.0f, 0.0f, 0.0f },  { 0.7f, 50, 1.0f, 0.0f, 1.0f, 0.0f, 0.0f },
        { 1.3f, 0, 0.9f, 0.0f, 1.0f, 0.0f, 0.0f },  { 1.0f, 0, 0.999f, 0.0f, 1.0f, 0.0f, 0.0f },
        { 0.5f, 0, 1.0f, 0.05f, 1.0f, 0.0f, 0.0f }, { 1.0f, 100, 0.8f, 0.1f, 1.2f, 0.5f, 0.3f },
        { 2.0f, 1, 1.0f, 0.0f, 1.0f, 0.0f, 0.0f },  { 1.0f, 0, 0.01f, 0.0f, 1.0f, 0.0f, 0.0f },
        { 0.0f, 0, 1.0f, 0.0f, 1.5f, 1.0f, 1.0f },  { 1.0f, V, 1.0f, 1.0f, 1.0f, 0.0f, 0.0f },
    };
    Sampler s(V);
    for (const Case &c : cases) {
        eng_sample_params p = { c.t, c.k, c.p, c.minp, c.rep, c.pres, c.freq };
        ASSERT_EQ(eng_sample_params_check(&p, nullptr), MT_OK);
        for (uint64_t seed = 0; seed < 200; seed++) {
            eng_rng a, b;
            eng_rng_seed(&a, seed);
            eng_rng_seed(&b, seed);
            const int32_t got = Sample(s.s, p, &a, l, &h).token;
            const int32_t want = Reference(p, &b, l, &h);
            ASSERT_EQ(got, want) << "t=" << c.t << " k=" << c.k << " p=" << c.p << " min_p=" << c.minp
                                 << " seed=" << seed;
        }
    }
}

TEST(EngineSampler, FrequenciesFollowTheSoftmax) {
    const std::vector<float> l = { 1.0f, 0.5f, 0.0f, -0.5f, -1.0f, 2.0f };
    for (float t : { 1.0f, 0.5f }) {
        eng_sample_params p = eng_sample_default_params();
        p.temperature = t;
        Sampler s((int)l.size());
        eng_rng rng;
        eng_rng_seed(&rng, 99);
        const int N = 200000;
        std::vector<int> n(l.size());
        for (int i = 0; i < N; i++) n[Sample(s.s, p, &rng, l).token]++;
        const std::vector<double> want = Softmax(l, t);
        for (size_t v = 0; v < l.size(); v++) {
            const double sd = std::sqrt(want[v] * (1 - want[v]) / N);
            EXPECT_NEAR((double)n[v] / N, want[v], 5 * sd + 1e-4) << "t=" << t << " token " << v;
        }
    }
}

TEST(EngineSampler, TopPAndMinPTruncate) {
    // probabilities 0.5, 0.3, 0.2 at t = 1
    const std::vector<float> l = { std::log(0.5f), std::log(0.3f), std::log(0.2f) };
    Sampler s(3);
    eng_rng rng;
    eng_rng_seed(&rng, 5);
    eng_sample_params p = eng_sample_default_params();
    p.temperature = 1.0f;
    p.top_p = 0.6f;  // {0, 1}, renormalised 0.625 / 0.375
    std::vector<int> n(3);
    const int N = 100000;
    for (int i = 0; i < N; i++) n[Sample(s.s, p, &rng, l).token]++;
    EXPECT_EQ(n[2], 0);
    EXPECT_NEAR(n[0] / (double)N, 0.625, 0.01);
    p.top_p = 1.0f;
    p.min_p = 0.5f;  // keeps p >= 0.25: {0, 1}
    n.assign(3, 0);
    for (int i = 0; i < N; i++) n[Sample(s.s, p, &rng, l).token]++;
    EXPECT_EQ(n[2], 0);
    EXPECT_NEAR(n[1] / (double)N, 0.375, 0.01);
    p.min_p = 1.0f;  // only the top token
    for (int i = 0; i < 1000; i++) ASSERT_EQ(Sample(s.s, p, &rng, l).token, 0);
    p.min_p = 0.0f;
    p.top_k = 1;
    for (int i = 0; i < 1000; i++) ASSERT_EQ(Sample(s.s, p, &rng, l).token, 0);
}

TEST(EngineSampler, SeededDrawsAreReproducible) {
    const int V = 1000;
    std::vector<float> l(V);
    for (int v = 0; v < V; v++) l[v] = std::sin(v * 0.37f) * 2;
    eng_sample_params p = eng_sample_default_params();
    p.temperature = 1.0f;
    p.top_p = 0.95f;
    Sampler s(V);
    auto run = [&](uint64_t seed) {
        eng_rng rng;
        eng_rng_seed(&rng, seed);
        std::vector<int32_t> out;
        for (int i = 0; i < 64; i++) out.push_back(Sample(s.s, p, &rng, l).token);
        return out;
    };
    EXPECT_EQ(run(42), run(42));
    EXPECT_NE(run(42), run(43));
    eng_rng a, b;  // random seeding: two requests differ
    eng_rng_seed_random(&a);
    eng_rng_seed_random(&b);
    EXPECT_NE(eng_rng_next(&a), eng_rng_next(&b));
    eng_rng r;  // the uniform stays in [0, 1)
    eng_rng_seed(&r, 0);
    for (int i = 0; i < 10000; i++) {
        const double u = eng_rng_uniform(&r);
        ASSERT_GE(u, 0.0);
        ASSERT_LT(u, 1.0);
    }
}

TEST(EngineSampler, LogprobsAreRawLogSoftmax) {
    const std::vector<float> l = { 1.0f, 3.0f, 2.0f, 3.0f, -1.0f };
    const std::vector<double> p = Softmax(l, 1.0);
    Sampler s(5);
    eng_rng rng;
    eng_rng_seed(&rng, 3);
    eng_sample_params sp = eng_sample_default_params();
    sp.temperature = 0.3f;  // neither temperature nor penalties change the reported logprobs
    sp.repetition_penalty = 3.0f;
    const int32_t gen[] = { 1 };
    eng_history h = { nullptr, 0, gen, 1 };
    eng_sample_result r = Sample(s.s, sp, &rng, l, &h, true, 3);
    EXPECT_NEAR(r.logprob, std::log(p[r.token]), 1e-5);
    ASSERT_EQ(r.n_top, 3);
    EXPECT_EQ(r.top_ids[0], 1);  // tie 1 / 3: lowest id first
    EXPECT_EQ(r.top_ids[1], 3);
    EXPECT_EQ(r.top_ids[2], 2);
    for (int i = 0; i < 3; i++) EXPECT_NEAR(r.top_logprobs[i], std::log(p[r.top_ids[i]]), 1e-5);
    r = Sample(s.s, sp, &rng, l, &h, false, 50);  // clamped to the vocabulary
    EXPECT_EQ(r.n_top, 5);
    EXPECT_EQ(r.top_ids[4], 4);
    EXPECT_EQ(r.logprob, 0.0f);
    r = Sample(s.s, sp, &rng, l, &h, false, 0);
    EXPECT_EQ(r.n_top, 0);
}

TEST(EngineSampler, NanLogitsAreNeverPicked) {
    Sampler s(4);
    eng_rng rng;
    eng_rng_seed(&rng, 1);
    eng_sample_params p = eng_sample_default_params();
    const std::vector<float> l = { NAN, 0.5f, NAN, 0.1f };
    EXPECT_EQ(Sample(s.s, p, &rng, l).token, 1);
    p.temperature = 1.0f;
    for (int i = 0; i < 1000; i++) {
        const int32_t t = Sample(s.s, p, &rng, l, nullptr, true, 2).token;
        ASSERT_TRUE(t == 1 || t == 3);
    }
}

TEST(EngineSampler, ParamsCheckNamesTheField) {
    struct Bad { eng_sample_params p; const char *field; };
    eng_sample_params d = eng_sample_default_params();
    std::vector<Bad> bad;
    auto with = [&](auto f, const char *field) { eng_sample_params p = d; f(p); bad.push_back({ p, field }); };
    with([](eng_sample_params &p) { p.temperature = -1; }, "temperature");
    with([](eng_sample_params &p) { p.temperature = NAN; }, "temperature");
    with([](eng_sample_params &p) { p.temperature = 101; }, "temperature");
    with([](eng_sample_params &p) { p.top_k = -1; }, "top_k");
    with([](eng_sample_params &p) { p.top_p = 0; }, "top_p");
    with([](eng_sample_params &p) { p.top_p = 1.5f; }, "top_p");
    with([](eng_sample_params &p) { p.min_p = -0.1f; }, "min_p");
    with([](eng_sample_params &p) { p.repetition_penalty = 0; }, "repetition_penalty");
    with([](eng_sample_params &p) { p.presence_penalty = 3; }, "presence_penalty");
    with([](eng_sample_params &p) { p.frequency_penalty = -2.5f; }, "frequency_penalty");
    for (const Bad &b : bad) {
        mt_error err = { "" };
        EXPECT_EQ(eng_sample_params_check(&b.p, &err), MT_ERR_INVALID) << b.field;
        EXPECT_NE(std::string(err.msg).find(b.field), std::string::npos) << err.msg;
    }
    EXPECT_EQ(eng_sample_params_check(&d, nullptr), MT_OK);
    EXPECT_EQ(eng_sampler_new(0), nullptr);
}



// ---- speculative sampling ----

// Chi-square statistic of counts against probabilities (bins with p > 0), and the critical value
// of its distribution at p = 0.001 for df degrees of freedom (Wilson-Hilferty; z = 3.0902).
double ChiSquare(const std::vector<long> &n, const std::vector<float> &p, long N, int *df) {
    double x = 0;
    *df = -1;
    for (size_t v = 0; v < p.size(); v++) {
        if (p[v] <= 0) {
            EXPECT_EQ(n[v], 0) << "token " << v << " has no probability but came out";
            continue;
        }
        const double e = (double)N * p[v];
        x += (n[v] - e) * (n[v] - e) / e;
        (*df)++;
    }
    return x;
}

double Critical001(int df) {
    const double a = 2.0 / (9.0 * df);
    return df * std::pow(1 - a + 3.0902 * std::sqrt(a), 3);
}

// eng_sample_probs is the distribution eng_sample draws from.
TEST(EngineSpec, ProbsAreTheSamplersDistribution) {
    const std::vector<float> l = { 1.0f, 0.5f, 0.0f, -0.5f, -1.0f, 2.0f, 1.5f, -2.0f };
    eng_sample_params p = eng_sample_default_params();
    p.temperature = 0.8f;
    p.top_k = 6;
    p.top_p = 0.9f;
    const std::vector<int32_t> prompt = { 0, 5 }, gen = { 5, 6 };
    const eng_history h = { prompt.data(), 2, gen.data(), 2 };
    p.repetition_penalty = 1.2f;
    p.presence_penalty = 0.3f;
    Sampler s((int)l.size());
    std::vector<float> probs(l.size());
    eng_sample_probs(s.s, &p, l.data(), &h, probs.data());
    eng_rng rng;
    eng_rng_seed(&rng, 5);
    const long N = 200000;
    std::vector<long> n(l.size());
    for (long i = 0; i < N; i++) n[Sample(s.s, p, &rng, l, &h).token]++;
    int df;
    const double x = ChiSquare(n, probs, N, &df);
    EXPECT_LT(x, Critical001(df)) << "df " << df;
    // greedy: one-hot on the penalised argmax
    p.temperature = 0;
    eng_sample_probs(s.s, &p, l.data(), &h, probs.data());
    const int32_t g = Sample(s.s, p, &rng, l, &h).token;
    for (size_t v = 0; v < l.size(); v++) EXPECT_EQ(probs[v], v == (size_t)g ? 1.0f : 0.0f);
}

// Draft from q, then eng_spec_verdict against p: the tokens that come out follow p (chi-square at
// p > 0.001, fixed seed, 400,000 draws) for drafters near and far from the target, including one
// that puts mass where p has none and one that misses tokens p has; the acceptance rate is
// sum(min(p, q)).
TEST(EngineSpec, VerdictOutputFollowsTheTarget) {
    const std::vector<float> p = { 0.30f, 0.25f, 0.15f, 0.10f, 0.10f, 0.05f, 0.05f, 0.0f };
    const std::vector<std::vector<float>> qs = {
        { 0.30f, 0.25f, 0.15f, 0.10f, 0.10f, 0.05f, 0.05f, 0.0f },  // the target itself
        { 0.10f, 0.10f, 0.10f, 0.10f, 0.10f, 0.10f, 0.10f, 0.30f },  // mass where p has none
        { 0.0f, 0.0f, 0.5f, 0.5f, 0.0f, 0.0f, 0.0f, 0.0f },          // misses most of p
        { 0.60f, 0.05f, 0.05f, 0.05f, 0.05f, 0.10f, 0.10f, 0.0f },
    };
    const int V = (int)p.size();
    for (size_t qi = 0; qi < qs.size(); qi++) {
        const std::vector<float> &q = qs[qi];
        eng_rng rng;
        eng_rng_seed(&rng, 1234 + qi);
        const long N = 400000;
        std::vector<long> n(V);
        long accepted = 0;
        for (long i = 0; i < N; i++) {
            const int32_t d = eng_draw_probs(&rng, q.data(), V);
            bool acc = false;
            n[eng_spec_verdict(&rng, p.data(), q.data(), V, d, &acc)]++;
            accepted += acc;
        }
        int df;
        const double x = ChiSquare(n, p, N, &df);
        EXPECT_LT(x, Critical001(df)) << "drafter " << qi << ", df " << df;
        double overlap = 0;
        for (int v = 0; v < V; v++) overlap += std::min(p[v], q[v]);
        overlap = std::min(overlap, 1.0);
        const double rate = (double)accepted / N, sd = std::sqrt(overlap * (1 - overlap) / N);
        EXPECT_NEAR(rate, overlap, 5 * sd + 1e-4) << "drafter " << qi;
    }
}

}  // namespace
