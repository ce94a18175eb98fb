// The CPU backend's ops on their own: each against a direct (naive) formulation of docs/MODEL.md,
// and the chunked KDA form against the recurrent one over shapes that include the real model's
// head.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <utility>
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

// A ticket is what src held at download_begin, readable until MT_TICKETS more begins.
TEST_F(CpuOps, DownloadTicketsKeepTheirBytes) {
    int32_t src[3];
    std::vector<int64_t> t;
    for (int k = 0; k < MT_TICKETS + 1; k++) {
        src[0] = k, src[1] = 10 * k, src[2] = 100 * k;
        t.push_back(be_->ops->download_begin(be_, src, sizeof src));
    }
    int32_t got[3];
    EXPECT_EQ(be_->ops->download_end(be_, t[0], got, sizeof got), MT_ERR_STATE);
    for (int k = 1; k <= MT_TICKETS; k++) {
        ASSERT_EQ(be_->ops->download_end(be_, t[k], got, sizeof got), MT_OK);
        EXPECT_EQ(got[0], k);
        EXPECT_EQ(got[2], 100 * k);
    }
    float logits[2 * 5] = { 0, 3, 1, 3, 2, /* tie: the lowest index */ 9, 0, 0, 0, 10 };
    int32_t table[2 * 4];
    be_->ops->argmax_dev(be_, table, 4, logits, 2, 5);
    for (int j = 0; j < 4; j++) {
        EXPECT_EQ(table[j], 1);
        EXPECT_EQ(table[4 + j], 4);
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

// moe_keep_experts: picks outside [lo, hi) get weight 0 and the row's first kept expert (lo when
// it keeps none); kept picks are untouched.
TEST_F(CpuOps, KeepExpertsZeroesPicksOutsideThePart) {
    int32_t idx[9] = {5, 1, 6, /* */ 0, 1, 2, /* */ 7, 4, 3};
    float w[9] = {.1f, .2f, .3f, .4f, .5f, .6f, .7f, .8f, .9f};
    const std::vector<int32_t> idx0(idx, idx + 9);
    const std::vector<float> w0(w, w + 9);
    be_->ops->moe_keep_experts(be_, idx, w, nullptr, nullptr, 3, 3, 4, 8);
    EXPECT_EQ(std::vector<int32_t>(idx, idx + 9), (std::vector<int32_t>{5, 5, 6, 4, 4, 4, 7, 4, 7}));
    EXPECT_EQ(std::vector<float>(w, w + 9), (std::vector<float>{.1f, 0.f, .3f, 0.f, 0.f, 0.f, .7f, .8f, 0.f}));
    // from earlier picks: the other part of the same picks
    be_->ops->moe_keep_experts(be_, idx, w, idx0.data(), w0.data(), 3, 3, 0, 4);
    EXPECT_EQ(std::vector<int32_t>(idx, idx + 9), (std::vector<int32_t>{1, 1, 1, 0, 1, 2, 3, 3, 3}));
    EXPECT_EQ(std::vector<float>(w, w + 9), (std::vector<float>{0.f, .2f, 0.f, .4f, .5f, .6f, 0.f, 0.f, .9f}));
}

TEST_F(CpuOps, DsaSelectTakesCompletePoolsAndTail) {
    mt_dsa_select_params p = {};
    p.ih = 1; p.id = 2; p.kpool = 4; p.max_pools = 2; p.tail = true; p.max_sel = 2 * 4 + 3;
    // Pool keys 0..3; head weight 1, q = (1, 0): pool score = relu(P[p][0]) / sqrt(2). Paged two
    // pools a page (page = 8 positions), the blocks on pages 1 and 0 in that order: pool c is row
    // c % 2 of page bt[c / 2].
    const std::vector<float> keys = {0.1f, 0, 0.9f, 0, 0.5f, 0, -1.f, 0};
    const std::vector<int32_t> bt = {1, 0};
    std::vector<float> pool(keys.size());
    const mt_paged pk = {pool.data(), 2, 2};
    for (int c = 0; c < 4; c++)
        for (int j = 0; j < 2; j++) mt_paged_at(pk, bt.data(), c)[j] = keys[(size_t)c * 2 + j];
    std::vector<float> qi = {1.f, 0.f}, w = {1.f};
    std::vector<int32_t> sel(p.max_sel), nsel(1);
    // t = 14: pools 0,1,2 complete (pool 3 ends at 15), keep best 2 = pools 1, 2; tail 12..14.
    be_->ops->dsa_select(be_, sel.data(), nsel.data(), qi.data(), w.data(), pk, bt.data(), 14, 1, &p);
    ASSERT_EQ(nsel[0], 11);
    std::vector<int32_t> want = {4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14};
    EXPECT_EQ(std::vector<int32_t>(sel.begin(), sel.begin() + 11), want);
    // t = 2 with the tail off: no complete pool, nothing selected.
    p.tail = false;
    be_->ops->dsa_select(be_, sel.data(), nsel.data(), qi.data(), w.data(), pk, bt.data(), 2, 1, &p);
    EXPECT_EQ(nsel[0], 0);
}

// The gap recorder: the router's group and expert gaps and the indexer's pool gap, each on a
// hand-built case whose gap is known, and nothing noted for forced choices or while off.
TEST_F(CpuOps, GapRecorderNotesTheSmallestGapPerKind) {
    mt_cpu_gaps_record(true);
    mt_cpu_gaps_reset();
    mt_cpu_gaps g;
    // The router case above: group sums g2 1.3, g1 1.2 kept, g0 1.0 the best dropped (gap 0.2);
    // among g1 and g2, s 0.7 0.6 chosen, 0.6 left (gap 0).
    mt_router_params p = {8, 4, 2, 2, true, 2.5f};
    auto logit = [](float s) { return std::log(s / (1.f - s)); };
    float sc[8] = {0.95f, 0.05f, 0.6f, 0.6f, 0.7f, 0.6f, 0.1f, 0.1f};
    std::vector<float> logits(8), bias(8, 0.f);
    for (int e = 0; e < 8; e++) logits[e] = logit(sc[e]);
    int32_t idx[4];
    float w[4];
    be_->ops->moe_route(be_, idx, w, logits.data(), bias.data(), &p, 1);
    mt_cpu_gaps_get(&g);
    EXPECT_EQ(g.count[MT_GAP_GROUP], 1);
    EXPECT_EQ(g.count[MT_GAP_EXPERT], 1);
    EXPECT_NEAR(g.min[MT_GAP_GROUP], 0.2, 1e-5);
    EXPECT_NEAR(g.min[MT_GAP_EXPERT], 0.0, 1e-6);
    // Bias 0.25 on expert 3 (group 1): g1 scores 0.85 + 0.6 = 1.45, g2 1.3, g0 1.0 (gap 0.3);
    // experts 3 (0.85), 4 (0.7) chosen, 2 and 5 (0.6) left (gap 0.1). The minimum stays.
    bias[3] = 0.25f;
    mt_cpu_gaps_reset();
    be_->ops->moe_route(be_, idx, w, logits.data(), bias.data(), &p, 1);
    mt_cpu_gaps_get(&g);
    EXPECT_NEAR(g.min[MT_GAP_GROUP], 0.3, 1e-5);
    EXPECT_NEAR(g.min[MT_GAP_EXPERT], 0.1, 1e-5);
    be_->ops->moe_route(be_, idx, w, logits.data(), std::vector<float>(8, 0.f).data(), &p, 1);
    mt_cpu_gaps_get(&g);
    EXPECT_EQ(g.count[MT_GAP_EXPERT], 2);
    EXPECT_NEAR(g.min[MT_GAP_EXPERT], 0.0, 1e-6);
    // Forced: every group kept and as many experts as places: nothing noted.
    mt_cpu_gaps_reset();
    mt_router_params all = {8, 4, 4, 8, true, 1.f};
    int32_t idx8[8];
    float w8[8];
    be_->ops->moe_route(be_, idx8, w8, logits.data(), bias.data(), &all, 1);
    mt_cpu_gaps_get(&g);
    EXPECT_EQ(g.count[MT_GAP_GROUP] + g.count[MT_GAP_EXPERT], 0);
    EXPECT_TRUE(std::isinf(g.min[MT_GAP_GROUP]));

    // Indexer: pool scores relu(P[c][0]) / sqrt(2) = (0.1, 0.9, 0.5, 0) / sqrt(2); at t = 14 pools
    // 0..2 are candidates, 2 kept: (0.5 - 0.1) / 0.9 relative to the largest. At t = 6 only pool 0
    // is complete (forced); the tail is never a candidate.
    mt_dsa_select_params sp = {};
    sp.ih = 1; sp.id = 2; sp.kpool = 4; sp.max_pools = 2; sp.tail = true; sp.max_sel = 2 * 4 + 3;
    const std::vector<float> keys = {0.1f, 0, 0.9f, 0, 0.5f, 0, -1.f, 0};
    const std::vector<int32_t> bt = {0, 1};
    std::vector<float> pool(keys);
    const mt_paged pk = {pool.data(), 2, 2};
    std::vector<float> qi = {1.f, 0.f}, hw = {1.f};
    std::vector<int32_t> sel(sp.max_sel), nsel(1);
    mt_cpu_gaps_reset();
    be_->ops->dsa_select(be_, sel.data(), nsel.data(), qi.data(), hw.data(), pk, bt.data(), 6, 1, &sp);
    mt_cpu_gaps_get(&g);
    EXPECT_EQ(g.count[MT_GAP_POOL], 0);
    be_->ops->dsa_select(be_, sel.data(), nsel.data(), qi.data(), hw.data(), pk, bt.data(), 14, 1, &sp);
    mt_cpu_gaps_get(&g);
    EXPECT_EQ(g.count[MT_GAP_POOL], 1);
    EXPECT_NEAR(g.min[MT_GAP_POOL], 0.4 / 0.9, 1e-5);
    // The rows form notes through the same op.
    const int32_t pos = 14;
    const int32_t *bts[1] = {bt.data()};
    be_->ops->dsa_select_rows(be_, sel.data(), nsel.data(), qi.data(), hw.data(), pk, bts, &pos, 1, &sp);
    mt_cpu_gaps_get(&g);
    EXPECT_EQ(g.count[MT_GAP_POOL], 2);

    // Off: nothing noted, what was seen stays.
    mt_cpu_gaps_record(false);
    be_->ops->moe_route(be_, idx, w, logits.data(), bias.data(), &p, 1);
    mt_cpu_gaps_get(&g);
    EXPECT_EQ(g.count[MT_GAP_EXPERT], 0);
    EXPECT_EQ(g.count[MT_GAP_POOL], 2);
    mt_cpu_gaps_reset();
}

// ---- paged DSA caches ----

// Positions [0, count) of a paged cache gathered into a contiguous [count, row].
std::vector<float> Gather(mt_paged c, const std::vector<int32_t> &bt, int64_t count) {
    std::vector<float> out((size_t)(count * c.row));
    for (int64_t t = 0; t < count; t++)
        std::copy(mt_paged_at(c, bt.data(), t), mt_paged_at(c, bt.data(), t) + c.row, out.begin() + t * c.row);
    return out;
}

// Two sequences over shuffled pages: A (blocks on pages perm[0..nA)), and B sharing A's first
// `shared` blocks (a common prompt prefix) and then its own pages. Every cache starts NaN, so an
// op that reads a row it was not meant to shows it in its output.
struct PagedPair {
    static constexpr int kPage = 64;
    int kpool, id, kvl, n_pages;
    std::vector<float> lat, ki, gs, pk;     // the pools
    std::vector<int32_t> bt_a, bt_b;
    mt_paged Lat() { return {lat.data(), kPage, kvl}; }
    mt_paged Ki() { return {ki.data(), kPage, id}; }
    mt_paged Gs() { return {gs.data(), kPage, id}; }
    mt_paged Pk() { return {pk.data(), kPage / kpool, id}; }
    PagedPair(int kpool_, int id_, int kvl_, int blocks_a, int shared, int blocks_b, std::mt19937 &rng)
        : kpool(kpool_), id(id_), kvl(kvl_), n_pages(blocks_a + blocks_b - shared + 5) {
        const float nan = std::nanf("");
        lat.assign((size_t)n_pages * kPage * kvl, nan);
        ki.assign((size_t)n_pages * kPage * id, nan);
        gs = ki;
        pk.assign((size_t)n_pages * (kPage / kpool) * id, nan);
        std::vector<int32_t> perm(n_pages);
        std::iota(perm.begin(), perm.end(), 0);
        std::shuffle(perm.begin(), perm.end(), rng);
        bt_a.assign(perm.begin(), perm.begin() + blocks_a);
        bt_b.assign(perm.begin(), perm.begin() + shared);
        bt_b.insert(bt_b.end(), perm.begin() + blocks_a, perm.begin() + blocks_a + blocks_b - shared);
    }
};

// A contiguous cache of `count` rows viewed as paged with the identity block table: the unpaged
// reference the paged results must equal bit for bit (the ops do the same arithmetic).
struct Contiguous {
    std::vector<float> data;
    std::vector<int32_t> bt;
    mt_paged c;
    Contiguous(const std::vector<float> &rows, int page, int64_t row) {
        const int64_t count = (int64_t)rows.size() / row, blocks = count / page + 1;
        data.assign((size_t)(blocks * page * row), std::nanf(""));
        std::copy(rows.begin(), rows.end(), data.begin());
        bt.resize((size_t)blocks);
        std::iota(bt.begin(), bt.end(), 0);
        c = {data.data(), page, row};
    }
};

bool SameBits(const std::vector<float> &a, const std::vector<float> &b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Every paged DSA op against the same op on a contiguous copy with the identity block table, on
// two sequences over shuffled pages that share a two-block prefix: cache writes (eager across
// pages, at a run-time position, and the rows form), pool keys (a range, at a position, rows),
// selection and sparse MLA (one sequence and the rows form).
TEST_F(CpuOps, DsaPagedOpsMatchContiguous) {
    const int id = 16, kvl = 24, ih = 3, Hq = 2, dn = 8, dv = 8, page = PagedPair::kPage;
    // A: blocks 0..4; B: 0..3, its blocks 0, 1 on A's pages. The rows form then writes A's position
    // 303, which completes a pool for every kpool, and B's 250, which completes none.
    const int TA = 303, TB = 250, shared = 2;
    for (int kp : {4, 8, 16}) {
        SCOPED_TRACE("kpool " + std::to_string(kp));
        PagedPair pp(kp, id, kvl, TA / page + 1, shared, TB / page + 1, rng_);
        // Contents: B's first shared*page positions are A's.
        std::vector<float> latA = Rand((size_t)TA * kvl), kiA = Rand((size_t)TA * id), gsA = Rand((size_t)TA * id, 2.f);
        std::vector<float> latB = Rand((size_t)TB * kvl), kiB = Rand((size_t)TB * id), gsB = Rand((size_t)TB * id, 2.f);
        const size_t P = (size_t)shared * page;
        std::copy(latA.begin(), latA.begin() + P * kvl, latB.begin());
        std::copy(kiA.begin(), kiA.begin() + P * id, kiB.begin());
        std::copy(gsA.begin(), gsA.begin() + P * id, gsB.begin());

        // Writes: A whole (eager, across pages); B past the shared prefix, the last row at a
        // run-time position (the graph form).
        for (auto [c, src] : {std::pair{pp.Lat(), &latA}, {pp.Ki(), &kiA}, {pp.Gs(), &gsA}})
            be_->ops->copy_rows_at(be_, c, pp.bt_a.data(), 0, nullptr, src->data(), TA);
        const int32_t last = TB - 1;
        for (auto [c, src] : {std::pair{pp.Lat(), &latB}, {pp.Ki(), &kiB}, {pp.Gs(), &gsB}}) {
            be_->ops->copy_rows_at(be_, c, pp.bt_b.data(), (int)P, nullptr, src->data() + P * c.row, TB - 1 - (int)P);
            be_->ops->copy_rows_at(be_, c, pp.bt_b.data(), 0, &last, src->data() + (size_t)last * c.row, 1);
        }
        EXPECT_TRUE(SameBits(Gather(pp.Lat(), pp.bt_a, TA), latA));
        EXPECT_TRUE(SameBits(Gather(pp.Ki(), pp.bt_a, TA), kiA));
        EXPECT_TRUE(SameBits(Gather(pp.Lat(), pp.bt_b, TB), latB));
        EXPECT_TRUE(SameBits(Gather(pp.Gs(), pp.bt_b, TB), gsB));

        // Pool keys: A in two ranges; B only past the prefix (its first pools are A's), the last at
        // a position. Reference: each sequence's pools from its contiguous copy.
        const std::vector<float> ape = Rand((size_t)kp * id);
        const int npA = TA / kp, npB = TB / kp, pB0 = (int)P / kp;
        be_->ops->dsa_pool_keys(be_, pp.Pk(), pp.Ki(), pp.Gs(), pp.bt_a.data(), ape.data(), 0, 7, kp);
        be_->ops->dsa_pool_keys(be_, pp.Pk(), pp.Ki(), pp.Gs(), pp.bt_a.data(), ape.data(), 7, npA, kp);
        be_->ops->dsa_pool_keys(be_, pp.Pk(), pp.Ki(), pp.Gs(), pp.bt_b.data(), ape.data(), pB0, npB - 1, kp);
        const int32_t done = npB * kp - 1; // completes pool npB - 1
        be_->ops->dsa_pool_keys_at(be_, pp.Pk(), pp.Ki(), pp.Gs(), pp.bt_b.data(), ape.data(), &done, kp);
        Contiguous kiAc(kiA, page, id), gsAc(gsA, page, id), kiBc(kiB, page, id), gsBc(gsB, page, id);
        Contiguous pkAc(std::vector<float>((size_t)npA * id), page / kp, id), pkBc(std::vector<float>((size_t)npB * id), page / kp, id);
        be_->ops->dsa_pool_keys(be_, pkAc.c, kiAc.c, gsAc.c, kiAc.bt.data(), ape.data(), 0, npA, kp);
        be_->ops->dsa_pool_keys(be_, pkBc.c, kiBc.c, gsBc.c, kiBc.bt.data(), ape.data(), 0, npB, kp);
        const std::vector<float> pkA = Gather(pp.Pk(), pp.bt_a, npA), pkB = Gather(pp.Pk(), pp.bt_b, npB);
        EXPECT_TRUE(SameBits(pkA, std::vector<float>(pkAc.data.begin(), pkAc.data.begin() + (size_t)npA * id)));
        EXPECT_TRUE(SameBits(pkB, std::vector<float>(pkBc.data.begin(), pkBc.data.begin() + (size_t)npB * id)));

        // Selection and sparse MLA for the last 20 positions of B (top-k active: more pools
        // complete than max_pools).
        mt_dsa_select_params sp = {};
        sp.ih = ih; sp.id = id; sp.kpool = kp; sp.max_pools = 5; sp.tail = true;
        sp.max_sel = sp.max_pools * kp + kp - 1;
        const int n = 20, t0 = TB - n;
        const std::vector<float> qi = Rand((size_t)n * ih * id), w = Rand((size_t)n * ih);
        std::vector<int32_t> sel((size_t)n * sp.max_sel, -1), nsel(n, -1), sel_c = sel, nsel_c = nsel;
        be_->ops->dsa_select(be_, sel.data(), nsel.data(), qi.data(), w.data(), pp.Pk(), pp.bt_b.data(), t0, n, &sp);
        be_->ops->dsa_select(be_, sel_c.data(), nsel_c.data(), qi.data(), w.data(), pkBc.c, pkBc.bt.data(), t0, n, &sp);
        EXPECT_EQ(sel, sel_c);
        EXPECT_EQ(nsel, nsel_c);
        EXPECT_EQ(nsel[n - 1], sp.max_pools * kp + TB % kp);

        const int64_t rows = (int64_t)Hq * (dn + dv);
        const std::vector<float> wkv = Rand((size_t)rows * kvl, 0.2f), q = Rand((size_t)n * Hq * dn);
        mt_weight kv_b;
        ASSERT_EQ(be_->ops->weight(be_, wkv.data(), MT_F32, rows, kvl, &kv_b), MT_OK);
        mt_mla_params mp = {Hq, dn, dv, kvl, 1.f / std::sqrt((float)dn)};
        nsel[3] = 0; // one row attends to every position <= t with equal weights
        std::vector<float> o((size_t)n * Hq * dv), o_c(o.size());
        Contiguous latBc(latB, page, kvl);
        be_->ops->mla_sparse(be_, o.data(), q.data(), pp.Lat(), pp.bt_b.data(), &kv_b, sel.data(), nsel.data(),
                             sp.max_sel, t0, n, &mp);
        be_->ops->mla_sparse(be_, o_c.data(), q.data(), latBc.c, latBc.bt.data(), &kv_b, sel.data(), nsel.data(),
                             sp.max_sel, t0, n, &mp);
        EXPECT_TRUE(SameBits(o, o_c));
        for (float v : o) ASSERT_TRUE(std::isfinite(v));

        // The rows form: one row for each sequence at its next position (A at TA, B at TB),
        // against the single-sequence ops on the contiguous copies extended by that row.
        const std::vector<int32_t> pos = {TA, TB};
        const std::vector<const int32_t *> bts = {pp.bt_a.data(), pp.bt_b.data()};
        const std::vector<float> lat_r = Rand((size_t)2 * kvl), ki_r = Rand((size_t)2 * id), gs_r = Rand((size_t)2 * id);
        be_->ops->copy_rows_to(be_, pp.Lat(), bts.data(), pos.data(), lat_r.data(), 2);
        be_->ops->copy_rows_to(be_, pp.Ki(), bts.data(), pos.data(), ki_r.data(), 2);
        be_->ops->copy_rows_to(be_, pp.Gs(), bts.data(), pos.data(), gs_r.data(), 2);
        be_->ops->dsa_pool_keys_rows(be_, pp.Pk(), pp.Ki(), pp.Gs(), bts.data(), ape.data(), pos.data(), 2, kp);
        for (int r = 0; r < 2; r++) {
            std::vector<float> &lat = r ? latB : latA, &kis = r ? kiB : kiA, &gss = r ? gsB : gsA;
            lat.insert(lat.end(), lat_r.begin() + (size_t)r * kvl, lat_r.begin() + (size_t)(r + 1) * kvl);
            kis.insert(kis.end(), ki_r.begin() + (size_t)r * id, ki_r.begin() + (size_t)(r + 1) * id);
            gss.insert(gss.end(), gs_r.begin() + (size_t)r * id, gs_r.begin() + (size_t)(r + 1) * id);
        }
        EXPECT_TRUE(SameBits(Gather(pp.Lat(), pp.bt_a, TA + 1), latA));
        EXPECT_TRUE(SameBits(Gather(pp.Ki(), pp.bt_b, TB + 1), kiB));
        EXPECT_TRUE(SameBits(Gather(pp.Gs(), pp.bt_a, TA + 1), gsA));
        const std::vector<float> qi_r = Rand((size_t)2 * ih * id), w_r = Rand((size_t)2 * ih), q_r = Rand((size_t)2 * Hq * dn);
        sp.t_cap = TA + 1;
        std::vector<int32_t> sel_r((size_t)2 * sp.max_sel, -1), nsel_r(2, -1);
        be_->ops->dsa_select_rows(be_, sel_r.data(), nsel_r.data(), qi_r.data(), w_r.data(), pp.Pk(), bts.data(),
                                  pos.data(), 2, &sp);
        std::vector<float> o_r((size_t)2 * Hq * dv);
        mp.t_cap = TA + 1;
        be_->ops->mla_sparse_rows(be_, o_r.data(), q_r.data(), pp.Lat(), bts.data(), &kv_b, sel_r.data(),
                                  nsel_r.data(), sp.max_sel, pos.data(), 2, &mp);
        sp.t_cap = mp.t_cap = 0;
        for (int r = 0; r < 2; r++) {
            SCOPED_TRACE(r ? "row B" : "row A");
            const int T = pos[r] + 1, np = T / kp;
            Contiguous kic(r ? kiB : kiA, page, id), gsc(r ? gsB : gsA, page, id), latc(r ? latB : latA, page, kvl);
            Contiguous pkc(std::vector<float>((size_t)np * id), page / kp, id);
            be_->ops->dsa_pool_keys(be_, pkc.c, kic.c, gsc.c, kic.bt.data(), ape.data(), 0, np, kp);
            EXPECT_TRUE(SameBits(Gather(pp.Pk(), r ? pp.bt_b : pp.bt_a, np),
                                 std::vector<float>(pkc.data.begin(), pkc.data.begin() + (size_t)np * id)));
            std::vector<int32_t> s1(sp.max_sel, -1), n1(1, -1);
            be_->ops->dsa_select(be_, s1.data(), n1.data(), qi_r.data() + (size_t)r * ih * id, w_r.data() + (size_t)r * ih,
                                 pkc.c, pkc.bt.data(), pos[r], 1, &sp);
            EXPECT_EQ(n1[0], nsel_r[r]);
            EXPECT_EQ(s1, std::vector<int32_t>(sel_r.begin() + (size_t)r * sp.max_sel, sel_r.begin() + (size_t)(r + 1) * sp.max_sel));
            std::vector<float> o1((size_t)Hq * dv);
            be_->ops->mla_sparse(be_, o1.data(), q_r.data() + (size_t)r * Hq * dn, latc.c, latc.bt.data(), &kv_b,
                                 sel_r.data() + (size_t)r * sp.max_sel, nsel_r.data() + r, sp.max_sel, pos[r], 1, &mp);
            EXPECT_TRUE(SameBits(o1, std::vector<float>(o_r.begin() + (size_t)r * Hq * dv, o_r.begin() + (size_t)(r + 1) * Hq * dv)));
        }
        be_->ops->weight_free(be_, &kv_b);
    }
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
