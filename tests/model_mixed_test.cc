// The mixed step on the CPU runtime: prompt chunks and decode rows of several sequences in one
// pass give the logits and leave the state of the same work done part by part (tests/mixed_check.h),
// on tiny_a (a shared-indexer DSA layer: the selection of each part's rows must follow it) and on
// the demo model (its drafter follows every part); through mt_model_forward the same batch is
// split into passes when it is longer than one; bad batches are refused before anything moves.
#include <gtest/gtest.h>

#include <string>
#include <tuple>
#include <vector>

extern "C" {
#include "kernels/backend.h"
#include "worker/model/glm/glm_model.h"
#include "worker/model/model.h"
}

#include "tests/mixed_check.h"

namespace {

mt_status Forward(mt_model *m, const mt_batch_part *parts, int n, mt_error *err) {
    const mt_batch b = { parts, n };
    return mt_model_forward(m, &b, err);
}

struct Loaded {
    mt_backend *be = nullptr;
    glm_model *m = nullptr;
    Loaded(const char *dir, int chunk, bool mtp, bool sites = false, int expert_parts = 0) {
        be = mt_cpu_backend_new(1);
        glm_model_params p = glm_model_default_params();
        p.prefill_chunk = chunk;
        p.mtp = mtp;
        p.layered_sites = sites;
        p.layered_expert_parts = expert_parts;
        mt_error err{};
        EXPECT_EQ(glm_model_load(dir, be, &p, &m, &err), MT_OK) << err.msg;
    }
    ~Loaded() {
        glm_model_free(m);
        mt_backend_free(be);
    }
};

TEST(ModelMixed, TinyEqualsPartByPart) {
    Loaded l("tests/fixtures/tiny_a", 64, false);
    ASSERT_NE(l.m, nullptr);
    CheckMixedStep(l.m, "tiny_a (CPU)", 0.0);
    CheckMixedStep(l.m, "tiny_a (CPU)", 0.0, 1);
    CheckMixedStep(l.m, "tiny_a (CPU)", 0.0, 2);
}

// Layered in sites: a call can stop a group between a layer's attention and its MLP, or start it
// there (1 site a call: every boundary; 3: both kinds, and ranges of two layers' parts), alone or
// beside decode rows.
TEST(ModelMixed, TinyInSitesEqualsPartByPart) {
    Loaded l("tests/fixtures/tiny_a", 64, false, true);
    ASSERT_NE(l.m, nullptr);
    EXPECT_EQ(glm_model_layered_units(l.m), 2 * glm_model_n_layers(l.m));
    for (int k = 1; k <= 3; k++) {
        CheckMixedStep(l.m, "tiny_a in sites (CPU)", 0.0, k);
        CheckMixedStep(l.m, "tiny_a in sites (CPU)", 0.0, k, true);
    }
}

// Layered in sites with the MLP site in parts of the routed experts (tiny_a: 16 experts, a dense
// MLP on its first and last layers): calls stop and start a group between parts, ranges of 1-4
// units cross parts, sites and layers. The parts sum a row's experts in another order than the
// whole site (each part's picks in turn), so the logits agree to rounding, not bit for bit.
TEST(ModelMixed, TinyInExpertPartsMatchesPartByPart) {
    for (int parts : { 2, 3 }) {
        Loaded l("tests/fixtures/tiny_a", 64, false, true, parts);
        ASSERT_NE(l.m, nullptr);
        EXPECT_EQ(glm_model_layered_units(l.m), (1 + parts) * glm_model_n_layers(l.m));
        const std::string name = "tiny_a in " + std::to_string(parts) + " expert parts (CPU)";
        for (int k = 1; k <= 4; k++) {
            CheckMixedStep(l.m, name.c_str(), 1e-5, k);
            CheckMixedStep(l.m, name.c_str(), 1e-5, k, true);
        }
    }
}

// Expert parts need sites, at most one part an expert, and a backend that can keep a part.
TEST(ModelMixed, ExpertPartsRefusedWithoutSitesOrExperts) {
    mt_backend *be = mt_cpu_backend_new(1);
    for (auto [sites, parts, want] : { std::tuple{ false, 2, "--prefill-sites" }, std::tuple{ true, 17, "17 parts of 16" } }) {
        glm_model_params p = glm_model_default_params();
        p.layered_sites = sites;
        p.layered_expert_parts = parts;
        glm_model *m = nullptr;
        mt_error err{};
        EXPECT_EQ(glm_model_load("tests/fixtures/tiny_a", be, &p, &m, &err), MT_ERR_INVALID);
        EXPECT_EQ(m, nullptr);
        EXPECT_NE(std::string(err.msg).find(want), std::string::npos) << err.msg;
    }
    mt_backend_free(be);
}

TEST(ModelMixed, DemoWithDrafterEqualsPartByPart) {
    Loaded l("models/glm5-next-demo", 64, true);
    ASSERT_NE(l.m, nullptr);
    ASSERT_TRUE(glm_model_has_drafter(l.m));
    CheckMixedStep(l.m, "demo (CPU)", 0.0);
    CheckMixedStep(l.m, "demo (CPU)", 0.0, 1);
    Loaded s("models/glm5-next-demo", 64, true, true);
    ASSERT_NE(s.m, nullptr);
    CheckMixedStep(s.m, "demo in sites (CPU)", 0.0, 1);
    CheckMixedStep(s.m, "demo in sites (CPU)", 0.0, 1, true);
    Loaded x("models/glm5-next-demo", 64, true, true, 3);
    ASSERT_NE(x.m, nullptr);
    CheckMixedStep(x.m, "demo in 3 expert parts (CPU)", 1e-5, 1);
    CheckMixedStep(x.m, "demo in 3 expert parts (CPU)", 1e-5, 2, true);
}

// Through the model interface with passes of 8 rows: a decode row and two chunks of 13 and 6
// tokens take three passes (one chunk split across them), and give what prefills alone give.
TEST(ModelMixed, BatchSplitsIntoPasses) {
    Loaded l("tests/fixtures/tiny_a", 8, false);
    ASSERT_NE(l.m, nullptr);
    mt_model *mm = nullptr;
    mt_error err{};
    glm_model_params p = glm_model_default_params();
    p.prefill_chunk = 8;
    ASSERT_EQ(mt_model_load("tests/fixtures/tiny_a", l.be, &p, &mm, &err), MT_OK) << err.msg;
    const int V = glm_model_config(l.m)->vocab_size;
    std::vector<int32_t> pa = { 5, 9, 2, 7 }, pb, pc;
    for (int i = 0; i < 13; i++) pb.push_back((i * 7 + 1) % V);
    for (int i = 0; i < 6; i++) pc.push_back((i * 5 + 4) % V);
    mt_seq *a = nullptr, *b = nullptr, *c = nullptr, *rb = nullptr, *rc = nullptr;
    for (mt_seq **s : { &a, &b, &c, &rb, &rc }) ASSERT_EQ(mt_seq_new(mm, 32, s, &err), MT_OK) << err.msg;
    mt_batch_part pre = { MT_PART_PREFILL, a, pa.data(), 4, nullptr, false, nullptr };
    ASSERT_EQ(Forward(mm, &pre, 1, &err), MT_OK) << err.msg;
    const int32_t ta = 3;
    int32_t greedy = -1;
    std::vector<float> lb(V), lc((size_t)6 * V), rlb(V), rlc((size_t)6 * V);
    mt_batch_part parts[3] = {
        { MT_PART_DECODE, a, &ta, 1, nullptr, false, &greedy },
        { MT_PART_PREFILL, b, pb.data(), 13, lb.data(), false, nullptr },
        { MT_PART_PREFILL, c, pc.data(), 6, lc.data(), true, nullptr },
    };
    ASSERT_EQ(Forward(mm, parts, 3, &err), MT_OK) << err.msg;
    EXPECT_EQ(mt_seq_len(a), 5);
    EXPECT_EQ(mt_seq_len(b), 13);
    EXPECT_EQ(mt_seq_len(c), 6);
    EXPECT_GE(greedy, 0);
    mt_batch_part r1 = { MT_PART_PREFILL, rb, pb.data(), 13, rlb.data(), false, nullptr };
    mt_batch_part r2 = { MT_PART_PREFILL, rc, pc.data(), 6, rlc.data(), true, nullptr };
    ASSERT_EQ(Forward(mm, &r1, 1, &err), MT_OK) << err.msg;
    ASSERT_EQ(Forward(mm, &r2, 1, &err), MT_OK) << err.msg;
    // the passes cut b's prompt at 7 + 6 where a prefill alone cuts it at 8 + 5: KDA's chunked
    // form sums in another order, so equal to rounding, not bit for bit
    EXPECT_LE(MixedRelDiff(lb, rlb), 1e-5);
    EXPECT_LE(MixedRelDiff(lc, rlc), 1e-5);

    // refused before anything moves: a sequence twice, a token outside the vocabulary, no room
    const int32_t bad = V;
    mt_batch_part twice[2] = { { MT_PART_DECODE, a, &ta, 1, nullptr, false, nullptr },
                               { MT_PART_PREFILL, a, pc.data(), 2, nullptr, false, nullptr } };
    EXPECT_EQ(Forward(mm, twice, 2, &err), MT_ERR_INVALID);
    EXPECT_NE(std::string(err.msg).find("also part 0"), std::string::npos) << err.msg;
    mt_batch_part badtok[2] = { { MT_PART_DECODE, a, &bad, 1, nullptr, false, nullptr },
                                { MT_PART_PREFILL, c, pc.data(), 2, nullptr, false, nullptr } };
    EXPECT_EQ(Forward(mm, badtok, 2, &err), MT_ERR_INVALID);
    std::vector<int32_t> longp(30, 1);
    mt_batch_part full[2] = { { MT_PART_DECODE, a, &ta, 1, nullptr, false, nullptr },
                              { MT_PART_PREFILL, c, longp.data(), 30, nullptr, false, nullptr } };
    EXPECT_EQ(Forward(mm, full, 2, &err), MT_ERR_FULL);
    EXPECT_EQ(mt_seq_len(a), 5);
    EXPECT_EQ(mt_seq_len(c), 6);
    for (mt_seq *s : { a, b, c, rb, rc }) mt_seq_free(s);
    mt_model_free(mm);
}

// Layered chunks through the model interface: chunks b (13 tokens) and c (6) run one layer a
// call beside a's decode row, four calls on the 4-layer tiny_a; while they are in flight their
// lengths wait and no logits come, and the call that runs the last layer gives what prefills
// alone give (bit for bit: each layer sees the same rows), as a's rows give what decoding alone
// gives. Refused before anything moves: a second group while one is in flight, one chunk of
// another size, a plain prefill of a sequence in flight. Freeing a sequence in flight drops it
// from its group: the rest completes and a new group may start.
TEST(ModelMixed, LayeredChunksEqualWholeSteps) {
    mt_backend *be = mt_cpu_backend_new(1);
    mt_model *mm = nullptr;
    mt_error err{};
    glm_model_params p = glm_model_default_params();
    p.prefill_chunk = 64;
    ASSERT_EQ(mt_model_load("tests/fixtures/tiny_a", be, &p, &mm, &err), MT_OK) << err.msg;
    const mt_model_info info = mt_model_describe(mm);
    ASSERT_TRUE(info.layered_prefill);
    ASSERT_EQ(info.n_layers, 4);
    const int V = info.vocab_size;
    std::vector<int32_t> pa = { 5, 9, 2, 7 }, pb, pc, pd = { 1, 2, 3 };
    for (int i = 0; i < 13; i++) pb.push_back((i * 7 + 1) % V);
    for (int i = 0; i < 6; i++) pc.push_back((i * 5 + 4) % V);
    mt_seq *a, *b, *c, *d, *ra, *rb, *rc;
    for (mt_seq **s : { &a, &b, &c, &d, &ra, &rb, &rc }) ASSERT_EQ(mt_seq_new(mm, 32, s, &err), MT_OK) << err.msg;
    for (mt_seq *s : { a, ra }) {
        mt_batch_part pre = { MT_PART_PREFILL, s, pa.data(), 4, nullptr, false, nullptr };
        ASSERT_EQ(Forward(mm, &pre, 1, &err), MT_OK) << err.msg;
    }
    std::vector<float> la(V), rla(V), lb(V), lc((size_t)6 * V), rlb(V), rlc((size_t)6 * V);
    mt_batch_part r1 = { MT_PART_PREFILL, rb, pb.data(), 13, rlb.data(), false, nullptr };
    mt_batch_part r2 = { MT_PART_PREFILL, rc, pc.data(), 6, rlc.data(), true, nullptr };
    ASSERT_EQ(Forward(mm, &r1, 1, &err), MT_OK) << err.msg;
    ASSERT_EQ(Forward(mm, &r2, 1, &err), MT_OK) << err.msg;
    std::fill(lb.begin(), lb.end(), -1.f);
    int calls = 0;
    for (int call = 0; mt_seq_len(b) == 0; call++) {
        ASSERT_LT(call, 4);
        calls++;
        const int32_t ta = (int32_t)(3 + call);
        mt_batch_part parts[3] = {
            { MT_PART_DECODE, a, &ta, 1, la.data(), false, nullptr },
            { MT_PART_PREFILL, b, pb.data(), 13, lb.data(), false, nullptr, 1 },
            { MT_PART_PREFILL, c, pc.data(), 6, lc.data(), true, nullptr, 1 },
        };
        ASSERT_EQ(Forward(mm, parts, 3, &err), MT_OK) << "call " << call << ": " << err.msg;
        mt_batch_part ref = { MT_PART_DECODE, ra, &ta, 1, rla.data(), false, nullptr };
        ASSERT_EQ(Forward(mm, &ref, 1, &err), MT_OK) << err.msg;
        EXPECT_EQ(MixedRelDiff(la, rla), 0.0) << "call " << call;
        EXPECT_EQ(mt_seq_len(a), 5 + call);
        EXPECT_EQ(mt_seq_len(c), mt_seq_len(b) ? 6 : 0) << "call " << call;
        if (mt_seq_len(b) == 0) {
            EXPECT_EQ(lb[0], -1.f) << "logits before the last layer, call " << call;
        }
        if (call == 1) { /* in flight: refusals change nothing */
            mt_batch_part other[2] = { { MT_PART_DECODE, a, &ta, 1, nullptr, false, nullptr },
                                       { MT_PART_PREFILL, d, pd.data(), 3, nullptr, false, nullptr, 1 } };
            EXPECT_EQ(Forward(mm, other, 2, &err), MT_ERR_INVALID);
            EXPECT_NE(std::string(err.msg).find("in flight"), std::string::npos) << err.msg;
            mt_batch_part resized = { MT_PART_PREFILL, b, pb.data(), 7, nullptr, false, nullptr };
            EXPECT_EQ(Forward(mm, &resized, 1, &err), MT_ERR_INVALID);
            EXPECT_NE(std::string(err.msg).find("in flight has 13"), std::string::npos) << err.msg;
            mt_batch_part after[2] = { { MT_PART_PREFILL, b, pb.data(), 13, nullptr, false, nullptr, 1 },
                                       { MT_PART_PREFILL, d, pd.data(), 3, nullptr, false, nullptr } };
            EXPECT_EQ(Forward(mm, after, 2, &err), MT_ERR_INVALID);
            EXPECT_NE(std::string(err.msg).find("after the layered part"), std::string::npos) << err.msg;
            EXPECT_EQ(mt_seq_len(d), 0);
        }
    }
    // a layer a call, but a shared-indexer DSA layer always with the full layer before it
    int want = 0;
    for (int l = 0; l < 4; l++) {
        const glm_config *cf = glm_model_config((const glm_model *)mm);
        want += !(cf->layer_types[l] == GLM_MIXER_DSA && cf->indexer_types[l] == GLM_INDEXER_SHARED);
    }
    EXPECT_EQ(calls, want);
    EXPECT_LT(want, 4) << "tiny_a has a shared-indexer layer";
    EXPECT_EQ(MixedRelDiff(lb, rlb), 0.0);
    EXPECT_EQ(MixedRelDiff(lc, rlc), 0.0);
    // the states carry on alike
    const int32_t tb = 11;
    mt_batch_part nb = { MT_PART_DECODE, b, &tb, 1, lb.data(), false, nullptr };
    mt_batch_part nrb = { MT_PART_DECODE, rb, &tb, 1, rlb.data(), false, nullptr };
    ASSERT_EQ(Forward(mm, &nb, 1, &err), MT_OK) << err.msg;
    ASSERT_EQ(Forward(mm, &nrb, 1, &err), MT_OK) << err.msg;
    EXPECT_EQ(MixedRelDiff(lb, rlb), 0.0);

    // a sequence freed in flight leaves its group
    mt_seq *e1, *e2, *re;
    for (mt_seq **s : { &e1, &e2, &re }) ASSERT_EQ(mt_seq_new(mm, 32, s, &err), MT_OK) << err.msg;
    std::vector<float> le(V), rle(V);
    mt_batch_part re1 = { MT_PART_PREFILL, re, pc.data(), 6, rle.data(), false, nullptr };
    ASSERT_EQ(Forward(mm, &re1, 1, &err), MT_OK) << err.msg;
    for (int call = 0; call < 2; call++) {
        const int32_t ta = 9;
        mt_batch_part parts[3] = { { MT_PART_DECODE, a, &ta, 1, nullptr, false, nullptr },
                                   { MT_PART_PREFILL, e1, pc.data(), 6, le.data(), false, nullptr, 2 },
                                   { MT_PART_PREFILL, e2, pb.data(), 13, nullptr, false, nullptr, 2 } };
        ASSERT_EQ(Forward(mm, parts, call == 0 ? 3 : 2, &err), MT_OK) << err.msg;
        if (call == 0) {
            EXPECT_TRUE(glm_seq_in_flight((const glm_seq *)e2));
            mt_seq_free(e2);
        }
    }
    EXPECT_EQ(mt_seq_len(e1), 6);
    EXPECT_FALSE(glm_seq_in_flight((const glm_seq *)e1));
    EXPECT_EQ(MixedRelDiff(le, rle), 0.0);
    const int32_t ta = 2;
    mt_batch_part fresh[2] = { { MT_PART_DECODE, a, &ta, 1, nullptr, false, nullptr },
                               { MT_PART_PREFILL, d, pd.data(), 3, nullptr, false, nullptr, 3 } };
    EXPECT_EQ(Forward(mm, fresh, 2, &err), MT_OK) << err.msg;
    for (mt_seq *s : { a, b, c, d, ra, rb, rc, e1, re }) mt_seq_free(s);
    mt_model_free(mm);
    mt_backend_free(be);
}

}  // namespace
