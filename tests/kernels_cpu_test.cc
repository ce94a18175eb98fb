// The CPU backend's ops on their own: each against a direct (naive) formulation of MODEL.md, and
// the chunked KDA form against the recurrent one over shapes that include the real model's head.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

extern "C" {
#include "kernels/backend.h"
}

namespace {

class CpuOps : public ::testing::Test {
  protected:
    void SetUp() override { be_ = mt_cpu_backend_new(2); }
    void TearDown() override { mt_backend_free(be_); }
    std::vector<float> Rand(size_t n, float scale = 1.f) {
        std::normal_distribution<float> d(0.f, scale);
        std::vector<float> v(n);
        for (auto &x : v) x = d(rng_);
        return v;
    }
    mt_backend *be_ = nullptr;
    std::mt19937 rng_{1234};
};

double MaxDiff(const std::vector<float> &a, const std::vector<float> &b) {
    double m = 0;
    for (size_t i = 0; i < a.size(); i++) m = std::fmax(m, std::fabs((double)a[i] - b[i]));
    return m;
}

TEST_F(CpuOps, MatmulOnEveryWeightDtype) {
    const int n = 3, in = 37, out = 11;
    std::vector<float> x = Rand((size_t)n * in), wf = Rand((size_t)out * in);
    std::vector<uint16_t> wb(wf.size()), wh(wf.size());
    for (size_t i = 0; i < wf.size(); i++) {
        wb[i] = mt_f32_to_bf16(wf[i]);
        wh[i] = mt_f32_to_f16(wf[i]);
    }
    for (mt_dtype dt : {MT_F32, MT_BF16, MT_F16}) {
        const void *data = dt == MT_F32 ? (const void *)wf.data() : dt == MT_BF16 ? (const void *)wb.data() : wh.data();
        mt_weight w;
        ASSERT_EQ(be_->ops->weight(be_, data, dt, out, in, &w), MT_OK);
        std::vector<float> y((size_t)n * out), ref((size_t)n * out);
        be_->ops->matmul(be_, y.data(), x.data(), &w, n);
        for (int i = 0; i < n; i++)
            for (int o = 0; o < out; o++) {
                double a = 0;
                for (int k = 0; k < in; k++) {
                    float wv = dt == MT_F32 ? wf[o * in + k] : dt == MT_BF16 ? mt_bf16_to_f32(wb[o * in + k]) : mt_f16_to_f32(wh[o * in + k]);
                    a += (double)x[i * in + k] * wv;
                }
                ref[i * out + o] = (float)a;
            }
        EXPECT_LE(MaxDiff(y, ref), 1e-4) << mt_dtype_name(dt);
    }
}

TEST_F(CpuOps, KdaChunkedEqualsRecurrent) {
    struct Shape { int n, nh, dk; float gscale; };
    // n not a multiple of the chunk, several chunks, the real head size, strong and weak decay.
    for (Shape s : {Shape{1, 2, 8, 1.f}, Shape{63, 2, 16, 1.f}, Shape{130, 3, 16, 4.f}, Shape{70, 1, 128, 0.2f}}) {
        const size_t T = (size_t)s.n * s.nh * s.dk;
        std::vector<float> q = Rand(T), k = Rand(T), v = Rand(T), g = Rand(T), beta = Rand((size_t)s.n * s.nh);
        for (auto &x : g) x = -std::fabs(x) * s.gscale;  // log-decays are <= 0
        for (auto &x : beta) x = 1.f / (1.f + std::exp(-x));
        be_->ops->l2norm(be_, q.data(), (int64_t)s.n * s.nh, s.dk, 1e-6f, 1.f / std::sqrt((float)s.dk));
        be_->ops->l2norm(be_, k.data(), (int64_t)s.n * s.nh, s.dk, 1e-6f, 1.f);
        std::vector<float> st0 = Rand((size_t)s.nh * s.dk * s.dk, 0.1f), st1 = st0;
        std::vector<float> o0(T), o1(T);
        be_->ops->kda_recurrent(be_, o0.data(), q.data(), k.data(), v.data(), g.data(), beta.data(), st0.data(), s.n, s.nh, s.dk);
        be_->ops->kda_chunked(be_, o1.data(), q.data(), k.data(), v.data(), g.data(), beta.data(), st1.data(), s.n, s.nh, s.dk);
        EXPECT_LE(MaxDiff(o0, o1), 2e-4) << "n=" << s.n << " dk=" << s.dk;
        EXPECT_LE(MaxDiff(st0, st1), 2e-4) << "n=" << s.n << " dk=" << s.dk;
    }
}

TEST_F(CpuOps, ConvStateCarriesAcrossCalls) {
    const int n = 9, C = 5, K = 4;
    std::vector<float> x = Rand((size_t)n * C), w = Rand((size_t)C * K);
    std::vector<float> whole((size_t)n * C), split((size_t)n * C);
    std::vector<float> s0((size_t)C * (K - 1), 0.f), s1 = s0;
    be_->ops->conv1d_silu(be_, whole.data(), x.data(), s0.data(), w.data(), n, C, K);
    be_->ops->conv1d_silu(be_, split.data(), x.data(), s1.data(), w.data(), 4, C, K);
    for (int t = 4; t < n; t++)
        be_->ops->conv1d_silu(be_, split.data() + (size_t)t * C, x.data() + (size_t)t * C, s1.data(), w.data(), 1, C, K);
    EXPECT_LE(MaxDiff(whole, split), 1e-6);
    EXPECT_LE(MaxDiff(s0, s1), 0.0);
    // Direct formula at the last step, channel 2: silu(sum_k w[k] x[t-(K-1)+k]).
    const int t = n - 1, c = 2;
    float a = 0;
    for (int k = 0; k < K; k++) a += w[c * K + k] * x[(size_t)(t - (K - 1) + k) * C + c];
    EXPECT_NEAR(whole[(size_t)t * C + c], a / (1.f + std::exp(-a)), 1e-6);
}

TEST_F(CpuOps, RouterKeepsBestGroupsThenBestExperts) {
    // 8 experts in 4 groups of 2; keep 2 groups, pick 2 experts. Logits chosen so that the best
    // single expert (index 0) sits in a group whose pair-sum loses.
    mt_router_params p = {8, 4, 2, 2, true, 2.5f};
    auto logit = [](float s) { return std::log(s / (1.f - s)); };  // sigmoid^-1
    float sc[8] = {0.95f, 0.05f, 0.6f, 0.6f, 0.7f, 0.6f, 0.1f, 0.1f};
    std::vector<float> logits(8), bias(8, 0.f);
    for (int e = 0; e < 8; e++) logits[e] = logit(sc[e]);
    int32_t idx[2];
    float w[2];
    be_->ops->moe_route(be_, idx, w, logits.data(), bias.data(), &p, 1);
    // group sums: g0 1.0, g1 1.2, g2 1.3, g3 0.2 -> keep g2, g1 -> experts 4 (0.7) then 2 or 3 (0.6, lowest index)
    EXPECT_EQ(idx[0], 4);
    EXPECT_EQ(idx[1], 2);
    EXPECT_NEAR(w[0], 2.5f * 0.7f / 1.3f, 1e-5);
    EXPECT_NEAR(w[1], 2.5f * 0.6f / 1.3f, 1e-5);
    // The correction bias steers the choice but the weights stay the uncorrected scores.
    bias[7] = 2.f;
    be_->ops->moe_route(be_, idx, w, logits.data(), bias.data(), &p, 1);
    EXPECT_EQ(idx[0], 7);
    EXPECT_NEAR(w[0], 2.5f * 0.1f / (0.1f + 0.7f), 1e-5);
}

TEST_F(CpuOps, DsaSelectTakesCompletePoolsAndTail) {
    mt_dsa_select_params p = {};
    p.ih = 1; p.id = 2; p.kpool = 4; p.max_pools = 2; p.tail = true; p.max_sel = 2 * 4 + 3;
    // Pool keys 0..3; head weight 1, q = (1, 0): pool score = relu(P[p][0]) / sqrt(2).
    std::vector<float> pool = {0.1f, 0, 0.9f, 0, 0.5f, 0, -1.f, 0};
    std::vector<float> qi = {1.f, 0.f}, w = {1.f};
    std::vector<int32_t> sel(p.max_sel), nsel(1);
    // t = 14: pools 0,1,2 complete (pool 3 ends at 15), keep best 2 = pools 1, 2; tail 12..14.
    be_->ops->dsa_select(be_, sel.data(), nsel.data(), qi.data(), w.data(), pool.data(), 14, 1, &p);
    ASSERT_EQ(nsel[0], 11);
    std::vector<int32_t> want = {4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14};
    EXPECT_EQ(std::vector<int32_t>(sel.begin(), sel.begin() + 11), want);
    // t = 2 with the tail off: no complete pool, nothing selected.
    p.tail = false;
    be_->ops->dsa_select(be_, sel.data(), nsel.data(), qi.data(), w.data(), pool.data(), 2, 1, &p);
    EXPECT_EQ(nsel[0], 0);
}

TEST_F(CpuOps, HyperConnectionCombIsDoublyStochastic) {
    const int S = 4, H = 8, n = 2, mix = (2 + S) * S;
    std::vector<float> X = Rand((size_t)n * S * H), fn = Rand((size_t)mix * S * H, 0.3f);
    std::vector<float> base = Rand(mix), scale = {1.f, 1.f, 1.f};
    mt_weight w;
    ASSERT_EQ(be_->ops->weight(be_, fn.data(), MT_F32, mix, S * H, &w), MT_OK);
    mt_hc_params p = {S, H, 1e-5f, 1e-6f, 20};
    std::vector<float> y((size_t)n * H), post((size_t)n * S), comb((size_t)n * S * S);
    be_->ops->hc_pre(be_, y.data(), post.data(), comb.data(), X.data(), &w, base.data(), scale.data(), &p, n);
    for (int i = 0; i < n; i++)
        for (int a = 0; a < S; a++) {
            float r = 0, c = 0;
            for (int b = 0; b < S; b++) { r += comb[(i * S + a) * S + b]; c += comb[(i * S + b) * S + a]; }
            EXPECT_NEAR(r, 1.f, 1e-3);
            EXPECT_NEAR(c, 1.f, 1e-4);
        }
    for (float v : post) { EXPECT_GE(v, 0.f); EXPECT_LE(v, 2.f); }
}

TEST_F(CpuOps, SwigluClampsGateAboveAndUpBothWays) {
    std::vector<float> g = {20.f, -3.f, 1.f}, u = {20.f, -20.f, 0.5f}, out(3);
    be_->ops->swiglu(be_, out.data(), g.data(), u.data(), 1, 3, 10.f);
    auto silu = [](float x) { return x / (1.f + std::exp(-x)); };
    EXPECT_NEAR(out[0], silu(10.f) * 10.f, 1e-4);
    EXPECT_NEAR(out[1], silu(-3.f) * -10.f, 1e-5);
    EXPECT_NEAR(out[2], silu(1.f) * 0.5f, 1e-6);
}

}  // namespace
