// Whole-model check of the CPU runtime against transformers' glm5_next (tests/oracle/
// make_fixtures.py, docs/MODEL.md): every logit of every position within 2e-3 of the reference and
// the same 24 greedy tokens, for three tiny configs that cover every branch of the model.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

extern "C" {
#include "kernels/backend.h"
#include "worker/loader/safetensors.h"
#include "worker/model/glm/glm_model.h"
}

namespace {

struct Case {
    std::vector<int32_t> tokens, gen;
    int prompt_len = 0;
    std::vector<float> logits;  // [T, V]
    float pool_gap = 0, router_gap = 0;
};

const st_tensor *Need(st_archive *ar, const char *name) {
    const st_tensor *t = st_find(ar, name);
    EXPECT_NE(t, nullptr) << name;
    return t;
}

bool LoadCase(const std::string &path, Case *c) {
    st_archive *ar = nullptr;
    mt_error err{};
    if (st_open_file(path.c_str(), &ar, &err) != MT_OK) {
        ADD_FAILURE() << err.msg;
        return false;
    }
    const st_tensor *tok = Need(ar, "tokens"), *gen = Need(ar, "gen"), *pl = Need(ar, "prompt_len");
    const st_tensor *lg = Need(ar, "logits"), *pg = Need(ar, "pool_gap"), *rg = Need(ar, "router_gap");
    if (!tok || !gen || !pl || !lg || !pg || !rg) {
        st_close(ar);
        return false;
    }
    const int32_t *tp = static_cast<const int32_t *>(tok->data);
    c->tokens.assign(tp, tp + tok->shape[0]);
    const int32_t *gp = static_cast<const int32_t *>(gen->data);
    c->gen.assign(gp, gp + gen->shape[0]);
    c->prompt_len = *static_cast<const int32_t *>(pl->data);
    const float *lp = static_cast<const float *>(lg->data);
    c->logits.assign(lp, lp + lg->shape[0] * lg->shape[1]);
    c->pool_gap = *static_cast<const float *>(pg->data);
    c->router_gap = *static_cast<const float *>(rg->data);
    st_close(ar);
    return true;
}

class Oracle : public ::testing::TestWithParam<const char *> {
  protected:
    void SetUp() override {
        be_ = mt_cpu_backend_new(0);
        ASSERT_NE(be_, nullptr);
        dir_ = std::string("tests/fixtures/") + GetParam();
        mt_error err{};
        ASSERT_EQ(glm_model_load(dir_.c_str(), be_, nullptr, &m_, &err), MT_OK) << err.msg;
        V_ = glm_model_config(m_)->vocab_size;
    }
    void TearDown() override {
        glm_model_free(m_);
        mt_backend_free(be_);
    }
    // Prefill the prompt (all logits), then decode the reference's tokens one at a time.
    std::vector<float> TeacherForced(const Case &c) {
        std::vector<float> out(c.tokens.size() * V_);
        glm_seq *s = nullptr;
        mt_error err{};
        EXPECT_EQ(glm_seq_new(m_, (int)c.tokens.size(), &s, &err), MT_OK) << err.msg;
        EXPECT_EQ(glm_prefill(m_, s, c.tokens.data(), c.prompt_len, out.data(), true, &err), MT_OK) << err.msg;
        for (size_t t = c.prompt_len; t < c.tokens.size(); t++)
            EXPECT_EQ(glm_decode(m_, s, c.tokens[t], out.data() + t * V_, &err), MT_OK) << err.msg;
        glm_seq_free(s);
        return out;
    }
    mt_backend *be_ = nullptr;
    glm_model *m_ = nullptr;
    std::string dir_;
    int V_ = 0;
};

TEST_P(Oracle, EveryLogitWithinToleranceAndSameGreedyTokens) {
    for (int k = 0; k < 2; k++) {
        Case c;
        ASSERT_TRUE(LoadCase(dir_ + "/case_" + std::to_string(k) + ".safetensors", &c));
        ASSERT_EQ(c.logits.size(), c.tokens.size() * V_);
        ASSERT_GE(c.pool_gap, 1e-4f) << "fixture has a near-tie in the indexer top-k";
        std::vector<float> ours = TeacherForced(c);
        double worst = 0;
        size_t worst_at = 0;
        for (size_t i = 0; i < ours.size(); i++) {
            ASSERT_TRUE(std::isfinite(ours[i])) << "position " << i / V_;
            double d = std::fabs((double)ours[i] - c.logits[i]);
            if (d > worst) { worst = d; worst_at = i; }
        }
        EXPECT_LE(worst, 2e-3) << GetParam() << " case " << k << ": worst |diff| at position "
                               << worst_at / V_ << " token " << worst_at % V_;
        // Free-running greedy generation from our own argmax must equal the reference's.
        glm_seq *s = nullptr;
        mt_error err{};
        ASSERT_EQ(glm_seq_new(m_, (int)c.tokens.size(), &s, &err), MT_OK);
        std::vector<float> l(V_);
        ASSERT_EQ(glm_prefill(m_, s, c.tokens.data(), c.prompt_len, l.data(), false, &err), MT_OK) << err.msg;
        std::vector<int32_t> gen;
        for (size_t i = 0; i < c.gen.size(); i++) {
            gen.push_back(glm_argmax(l.data(), V_));
            if (i + 1 < c.gen.size()) {
                ASSERT_EQ(glm_decode(m_, s, gen.back(), l.data(), &err), MT_OK) << err.msg;
            }
        }
        glm_seq_free(s);
        EXPECT_EQ(gen, c.gen) << GetParam() << " case " << k;
        printf("%s case %d: %zu positions, worst |logit diff| %.2e, pool gap %.2e\n", GetParam(), k,
               c.tokens.size(), worst, c.pool_gap);
    }
}

// Prefill + decode equals feeding the same tokens one at a time through decode, and prefill in
// small chunks equals prefill in one pass.
TEST_P(Oracle, PrefillDecodeMatchesTokenByToken) {
    Case c;
    ASSERT_TRUE(LoadCase(dir_ + "/case_1.safetensors", &c));
    std::vector<float> a = TeacherForced(c);
    std::vector<float> b(a.size());
    glm_seq *s = nullptr;
    mt_error err{};
    ASSERT_EQ(glm_seq_new(m_, (int)c.tokens.size(), &s, &err), MT_OK);
    for (size_t t = 0; t < c.tokens.size(); t++)
        ASSERT_EQ(glm_decode(m_, s, c.tokens[t], b.data() + t * V_, &err), MT_OK) << err.msg;
    glm_seq_free(s);
    double worst = 0;
    for (size_t i = 0; i < a.size(); i++) worst = std::fmax(worst, std::fabs(a[i] - b[i]));
    EXPECT_LE(worst, 1e-4);

    glm_model *small = nullptr;
    glm_model_params p = glm_model_default_params();
    p.prefill_chunk = 5;  // chunks that split pools, KDA chunks and the prompt unevenly
    ASSERT_EQ(glm_model_load(dir_.c_str(), be_, &p, &small, &err), MT_OK) << err.msg;
    std::vector<float> d(a.size());
    ASSERT_EQ(glm_seq_new(small, (int)c.tokens.size(), &s, &err), MT_OK);
    ASSERT_EQ(glm_prefill(small, s, c.tokens.data(), (int)c.tokens.size(), d.data(), true, &err), MT_OK);
    glm_seq_free(s);
    glm_model_free(small);
    worst = 0;
    for (size_t i = 0; i < a.size(); i++) worst = std::fmax(worst, std::fabs(a[i] - d[i]));
    EXPECT_LE(worst, 1e-4);
}

// The graph form of decode (positions and the token read from backend memory, cache rows written
// at a run-time position) computes what the eager form computes. On the CPU it runs without a
// graph; on the GPU tests/model_cuda_test.cc checks it through captured graphs.
TEST_P(Oracle, GraphFormDecodeMatchesEager) {
    Case c;
    ASSERT_TRUE(LoadCase(dir_ + "/case_1.safetensors", &c));
    std::vector<float> a = TeacherForced(c);
    glm_model *gm = nullptr;
    glm_model_params p = glm_model_default_params();
    p.device_positions = true;
    mt_error err{};
    ASSERT_EQ(glm_model_load(dir_.c_str(), be_, &p, &gm, &err), MT_OK) << err.msg;
    std::swap(m_, gm);
    std::vector<float> b = TeacherForced(c);
    std::swap(m_, gm);
    glm_model_free(gm);
    double worst = 0;
    for (size_t i = 0; i < a.size(); i++) worst = std::fmax(worst, std::fabs(a[i] - b[i]));
    EXPECT_LE(worst, 1e-6);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, Oracle, ::testing::Values("tiny_a", "tiny_b", "tiny_c"));

}  // namespace
