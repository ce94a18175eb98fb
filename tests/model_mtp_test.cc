// The MTP block (worker/model/glm/glm_mtp.c) on the CPU against our PyTorch reference of it
// (tools/train/mtp.py) and transformers' target, through tests/fixtures/mtp_a (made by
// tests/oracle/make_mtp_fixtures.py: tiny_a plus an MTP block). Checked, every logit within 2e-3:
//   - the drafter's row t (the target's hidden state at t and token t + 1) at every t, both when
//     the target decodes token by token and when it prefills a prompt at once;
//   - chains of three drafts fed the block's own residual (DeepSeek-V3's sequential MTP);
//   - the target's own logits with the drafter following it.
// And write-on-accept: after a verify of k rows of which keep are kept, the sequence continues
// exactly (bitwise on the CPU) as one that decoded only those rows, drafter included. On the
// trained demo model, the drafter's held-out NLL equals the reference's (heldout_ppl.json "mtp",
// tools/train/eval_ppl.py) within 0.5%.
#include <gtest/gtest.h>
#include <json-c/json.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "tests/mtp_fixture.h"

extern "C" {
#include "kernels/backend.h"
#include "worker/loader/safetensors.h"
#include "worker/model/glm/glm_model.h"
}

namespace {

const char kDir[] = "tests/fixtures/mtp_a";
const float kTol = 2e-3f;

struct Case {
    int T = 0, V = 0, C = 0;
    std::vector<int32_t> tokens, chain_t, chain_tokens;
    std::vector<float> logits, chain_logits, target_logits;
};

bool LoadCase(int k, Case *c) {
    const std::string path = std::string(kDir) + "/mtp_case_" + std::to_string(k) + ".safetensors";
    st_archive *ar = nullptr;
    mt_error err{};
    if (st_open_file(path.c_str(), &ar, &err) != MT_OK) {
        ADD_FAILURE() << err.msg;
        return false;
    }
    c->tokens = TakeTensor<int32_t>(ar, "tokens");
    c->chain_t = TakeTensor<int32_t>(ar, "chain_t");
    c->chain_tokens = TakeTensor<int32_t>(ar, "chain_tokens");
    c->logits = TakeTensor<float>(ar, "logits");
    c->chain_logits = TakeTensor<float>(ar, "chain_logits");
    c->target_logits = TakeTensor<float>(ar, "target_logits");
    st_close(ar);
    c->T = (int)c->tokens.size();
    c->C = (int)c->chain_t.size();
    c->V = c->T ? (int)(c->target_logits.size() / c->T) : 0;
    return c->T > 2 && c->C > 0 && c->V > 0 && c->logits.size() == (size_t)(c->T - 1) * c->V &&
           c->chain_logits.size() == (size_t)c->C * 3 * c->V && c->chain_tokens.size() == (size_t)c->C * 3;
}

class Mtp : public ::testing::TestWithParam<int> {
  protected:
    void SetUp() override {
        be_ = mt_cpu_backend_new(0);
        ASSERT_NE(be_, nullptr);
        glm_model_params p = glm_model_default_params();
        p.mtp = true;
        p.verify_seqs = 3;
        mt_error err{};
        ASSERT_EQ(glm_model_load(kDir, be_, &p, &m_, &err), MT_OK) << err.msg;
        ASSERT_TRUE(glm_model_has_mtp(m_));
        ASSERT_TRUE(glm_model_has_drafter(m_));
        ASSERT_TRUE(LoadCase(GetParam(), &c_));
        ASSERT_EQ(c_.V, glm_model_config(m_)->vocab_size);
    }
    void TearDown() override {
        glm_model_free(m_);
        if (be_) be_->ops->destroy(be_);
    }
    glm_seq *NewSeq() {
        glm_seq *s = nullptr;
        mt_error err{};
        EXPECT_EQ(glm_seq_new(m_, c_.T + 8, &s, &err), MT_OK) << err.msg;
        return s;
    }
    std::vector<float> Draft(glm_seq *s, int32_t token) {
        std::vector<float> l(c_.V);
        mt_error err{};
        EXPECT_EQ(glm_model_draft(m_, s, token, l.data(), &err), MT_OK) << err.msg;
        return l;
    }
    mt_backend *be_ = nullptr;
    glm_model *m_ = nullptr;
    Case c_;
};

// Token by token: after the target decodes position t, the drafter's row t with token t + 1.
TEST_P(Mtp, EveryRowWhileDecoding) {
    glm_seq *s = NewSeq();
    ASSERT_NE(s, nullptr);
    const int V = c_.V;
    std::vector<float> tl(V);
    mt_error err{};
    float worst = 0, worst_target = 0;
    ASSERT_EQ(glm_prefill(m_, s, c_.tokens.data(), 1, tl.data(), false, &err), MT_OK) << err.msg;
    worst_target = MaxAbsDiff(tl.data(), &c_.target_logits[0], V);
    for (int t = 0; t + 1 < c_.T; t++) {
        std::vector<float> l = Draft(s, c_.tokens[t + 1]);
        worst = std::max(worst, MaxAbsDiff(l.data(), &c_.logits[(size_t)t * V], V));
        ASSERT_EQ(glm_decode(m_, s, c_.tokens[t + 1], tl.data(), &err), MT_OK) << err.msg;
        worst_target = std::max(worst_target, MaxAbsDiff(tl.data(), &c_.target_logits[(size_t)(t + 1) * V], V));
    }
    printf("case %d: %d drafter rows, worst |diff| %.2e; target worst %.2e\n", GetParam(), c_.T - 1, worst,
           worst_target);
    EXPECT_LT(worst, kTol);
    EXPECT_LT(worst_target, kTol);
    glm_seq_free(s);
}

// A prompt prefilled at once (the drafter takes its rows in the same pass), then the chain of three
// drafts from each chain's start row.
TEST_P(Mtp, ChainsAfterAPrefill) {
    const int V = c_.V;
    for (int ci = 0; ci < c_.C; ci++) {
        const int t0 = c_.chain_t[ci];
        glm_seq *s = NewSeq();
        ASSERT_NE(s, nullptr);
        mt_error err{};
        ASSERT_EQ(glm_prefill(m_, s, c_.tokens.data(), t0 + 1, nullptr, false, &err), MT_OK) << err.msg;
        int32_t tok = c_.tokens[t0 + 1];
        for (int j = 0; j < 3; j++) {
            std::vector<float> l = Draft(s, tok);
            const float d = MaxAbsDiff(l.data(), &c_.chain_logits[((size_t)ci * 3 + j) * V], V);
            EXPECT_LT(d, kTol) << "chain " << ci << " (row " << t0 << ") step " << j + 1;
            tok = glm_argmax(l.data(), V);
            EXPECT_EQ(tok, c_.chain_tokens[ci * 3 + j]) << "chain " << ci << " step " << j + 1;
        }
        glm_seq_free(s);
    }
}

// Write-on-accept: a verify of k = 4 rows keeping 1..4, then two more decode steps with a draft
// before each, against a sequence that decoded only the kept rows (in one step of keep rows, the
// same arithmetic): the same logits, bit for bit.
TEST_P(Mtp, KeptRowsContinueExactly) {
    const int V = c_.V, t0 = c_.T / 2, k = 4;
    ASSERT_LT(t0 + k + 3, c_.T);
    const int32_t *tok = &c_.tokens[t0 + 1];  // verify rows: tokens t0 + 1 .. t0 + 4
    for (int keep = 1; keep <= k; keep++) {
        glm_seq *a = NewSeq(), *b = NewSeq();
        ASSERT_TRUE(a && b);
        mt_error err{};
        ASSERT_EQ(glm_prefill(m_, a, c_.tokens.data(), t0 + 1, nullptr, false, &err), MT_OK) << err.msg;
        ASSERT_EQ(glm_prefill(m_, b, c_.tokens.data(), t0 + 1, nullptr, false, &err), MT_OK) << err.msg;
        // a: drafts (speculative rows of the drafter), a verify of k rows, keep
        Draft(a, tok[0]);
        Draft(a, 7);
        Draft(a, 11);
        ASSERT_EQ(glm_decode_verify(m_, a, tok, k, nullptr, &err), MT_OK) << err.msg;
        ASSERT_EQ(glm_seq_keep(m_, a, keep, &err), MT_OK) << err.msg;
        // b: the kept rows alone, in one step as well (so the same arithmetic)
        ASSERT_EQ(glm_decode_verify(m_, b, tok, keep, nullptr, &err), MT_OK) << err.msg;
        ASSERT_EQ(glm_seq_len(a), glm_seq_len(b));
        for (int step = 0; step < 2; step++) {
            const int32_t next = c_.tokens[t0 + 1 + keep + step];
            std::vector<float> da = Draft(a, next), db = Draft(b, next);
            EXPECT_EQ(MaxAbsDiff(da.data(), db.data(), V), 0.f) << "keep " << keep << " draft " << step;
            std::vector<float> la(V), lb(V);
            ASSERT_EQ(glm_decode(m_, a, next, la.data(), &err), MT_OK) << err.msg;
            ASSERT_EQ(glm_decode(m_, b, next, lb.data(), &err), MT_OK) << err.msg;
            EXPECT_EQ(MaxAbsDiff(la.data(), lb.data(), V), 0.f) << "keep " << keep << " decode " << step;
        }
        glm_seq_free(a);
        glm_seq_free(b);
    }
}

// Keep is refused where it has no meaning, and changes nothing.
TEST_P(Mtp, KeepIsRefusedOutsideAVerify) {
    glm_seq *s = NewSeq();
    ASSERT_NE(s, nullptr);
    mt_error err{};
    ASSERT_EQ(glm_prefill(m_, s, c_.tokens.data(), 5, nullptr, false, &err), MT_OK) << err.msg;
    EXPECT_EQ(glm_seq_keep(m_, s, 1, &err), MT_ERR_STATE);
    ASSERT_EQ(glm_decode_verify(m_, s, &c_.tokens[5], 3, nullptr, &err), MT_OK) << err.msg;
    EXPECT_EQ(glm_seq_keep(m_, s, 0, &err), MT_ERR_INVALID);
    EXPECT_EQ(glm_seq_keep(m_, s, 4, &err), MT_ERR_INVALID);
    EXPECT_EQ(glm_seq_len(s), 8);
    EXPECT_EQ(glm_seq_keep(m_, s, 3, &err), MT_OK) << err.msg;
    EXPECT_EQ(glm_seq_len(s), 8);
    // the states after each row wait in one ring: another sequence's verify takes it over
    glm_seq *t = NewSeq();
    ASSERT_NE(t, nullptr);
    ASSERT_EQ(glm_prefill(m_, t, c_.tokens.data(), 5, nullptr, false, &err), MT_OK) << err.msg;
    ASSERT_EQ(glm_decode_verify(m_, s, &c_.tokens[8], 3, nullptr, &err), MT_OK) << err.msg;
    ASSERT_EQ(glm_decode_verify(m_, t, &c_.tokens[5], 2, nullptr, &err), MT_OK) << err.msg;
    EXPECT_EQ(glm_seq_keep(m_, s, 1, &err), MT_ERR_STATE);
    EXPECT_EQ(glm_seq_len(s), 11);
    EXPECT_EQ(glm_seq_keep(m_, t, 1, &err), MT_OK) << err.msg;
    EXPECT_EQ(glm_seq_len(t), 6);
    glm_seq_free(t);
    glm_seq_free(s);
}

// Three sequences' verifies in one pass beside another sequence's decode row (glm_forward_mixed,
// a ring each), then each keeps some rows, all in one call (glm_seq_keep_rows): the rows' logits
// are those of each verify alone, and each sequence then continues as its twin that verified
// alone and kept as many. A verify longer than a ring and a sequence kept twice are refused.
TEST_P(Mtp, VerifiesOfSeveralSequencesShareOnePass) {
    const int V = c_.V, kv[3] = { 4, 3, 2 }, keep[3] = { 2, 3, 1 };
    mt_error err{};
    glm_seq *a[3], *b[3], *d = NewSeq();
    ASSERT_NE(d, nullptr);
    ASSERT_EQ(glm_prefill(m_, d, c_.tokens.data(), 4, nullptr, false, &err), MT_OK) << err.msg;
    std::vector<float> la[3], lb[3];
    std::vector<int32_t> top[3];
    glm_mixed_part parts[4];
    int32_t dtop = -1;
    parts[0] = glm_mixed_part{ d, &c_.tokens[4], 1, nullptr, false, &dtop, false };
    for (int i = 0; i < 3; i++) {
        const int t0 = c_.T / 2 - 2 * i;
        ASSERT_GT(t0, 0);
        ASSERT_LT(t0 + kv[i] + 3, c_.T);
        a[i] = NewSeq();
        b[i] = NewSeq();
        ASSERT_TRUE(a[i] && b[i]);
        for (glm_seq *s : { a[i], b[i] }) {
            ASSERT_EQ(glm_prefill(m_, s, c_.tokens.data(), t0 + 1, nullptr, false, &err), MT_OK) << err.msg;
            Draft(s, c_.tokens[t0 + 1]);
            Draft(s, 5);
        }
        la[i].resize((size_t)kv[i] * V);
        lb[i].resize((size_t)kv[i] * V);
        top[i].assign(kv[i], -1);
        parts[i + 1] = glm_mixed_part{ a[i], &c_.tokens[t0 + 1], kv[i], la[i].data(), true, top[i].data(), true };
    }
    std::vector<int32_t> too_many(GLM_VERIFY_MAX + 1, 3);
    const glm_mixed_part too_long[2] = {
        parts[0], glm_mixed_part{ a[0], too_many.data(), GLM_VERIFY_MAX + 1, nullptr, false, nullptr, true }
    };
    const int len0 = glm_seq_len(a[0]), lend = glm_seq_len(d);
    EXPECT_EQ(glm_forward_mixed(m_, too_long, 2, 0, &err), MT_ERR_INVALID);
    EXPECT_EQ(glm_seq_len(a[0]), len0);
    EXPECT_EQ(glm_seq_len(d), lend);
    ASSERT_EQ(glm_forward_mixed(m_, parts, 4, 0, &err), MT_OK) << err.msg;
    int done = -1;
    ASSERT_EQ(glm_seq_keep_rows(m_, a, keep, 3, &done, &err), MT_OK) << err.msg;
    EXPECT_EQ(done, 3);
    glm_seq *twice[2] = { a[1], a[1] };
    const int keep_twice[2] = { keep[1], keep[1] };
    EXPECT_EQ(glm_seq_keep_rows(m_, twice, keep_twice, 2, &done, &err), MT_ERR_INVALID);
    EXPECT_EQ(done, 1);
    // each b alone (ring 0, kept before the next verifies)
    for (int i = 0; i < 3; i++) {
        const int t0 = c_.T / 2 - 2 * i;
        ASSERT_EQ(glm_decode_verify(m_, b[i], &c_.tokens[t0 + 1], kv[i], lb[i].data(), &err), MT_OK) << err.msg;
        ASSERT_EQ(glm_seq_keep(m_, b[i], keep[i], &err), MT_OK) << err.msg;
        EXPECT_LT(MaxAbsDiff(la[i].data(), lb[i].data(), kv[i] * V), 1e-4f) << "sequence " << i;
        for (int r = 0; r < kv[i]; r++) {
            const float *row = &la[i][(size_t)r * V];
            EXPECT_EQ(top[i][r], (int32_t)(std::max_element(row, row + V) - row)) << "sequence " << i << " row " << r;
        }
    }
    for (int i = 0; i < 3; i++) {
        ASSERT_EQ(glm_seq_len(a[i]), glm_seq_len(b[i]));
        const int32_t next = c_.tokens[c_.T / 2 - 2 * i + 1 + keep[i]];
        std::vector<float> da = Draft(a[i], next), db = Draft(b[i], next);
        EXPECT_LT(MaxAbsDiff(da.data(), db.data(), V), 1e-4f) << "sequence " << i;
        std::vector<float> ya(V), yb(V);
        ASSERT_EQ(glm_decode(m_, a[i], next, ya.data(), &err), MT_OK) << err.msg;
        ASSERT_EQ(glm_decode(m_, b[i], next, yb.data(), &err), MT_OK) << err.msg;
        EXPECT_LT(MaxAbsDiff(ya.data(), yb.data(), V), 1e-4f) << "sequence " << i;
    }
    for (int i = 0; i < 3; i++) {
        glm_seq_free(a[i]);
        glm_seq_free(b[i]);
    }
    glm_seq_free(d);
}

// Three verifies in one forward whose rows do not fit one pass (passes of 8 rows: a prompt chunk,
// then two verifies, then the third in a pass of its own): each verify keeps its own ring across
// the passes, so each sequence keeps some rows and continues as its twin that verified alone.
TEST_P(Mtp, VerifiesOfOneForwardKeepTheirRingsAcrossPasses) {
    glm_model *m = nullptr;
    glm_model_params mp = glm_model_default_params();
    mp.mtp = true;
    mp.verify_seqs = 3;
    mp.prefill_chunk = 8;
    mt_error err{};
    ASSERT_EQ(glm_model_load(kDir, be_, &mp, &m, &err), MT_OK) << err.msg;
    ASSERT_EQ(glm_model_pass_rows(m), 8);
    mt_model *mm = glm_model_as_model(m);
    // a glm_seq begins with its mt_seq (the interface's sequence)
    auto seq = [](glm_seq *s) { return reinterpret_cast<mt_seq *>(s); };
    const int V = c_.V, kv[3] = { 4, 3, 2 }, keep[3] = { 2, 3, 1 };
    glm_seq *a[3], *b[3], *c = nullptr;
    ASSERT_EQ(glm_seq_new(m, c_.T + 8, &c, &err), MT_OK) << err.msg;
    std::vector<float> la[3], lb[3];
    std::vector<int32_t> top[3];
    mt_batch_part parts[4];
    parts[0] = mt_batch_part{ MT_PART_PREFILL, seq(c), c_.tokens.data(), 6, nullptr, false, nullptr };
    for (int i = 0; i < 3; i++) {
        const int t0 = c_.T / 2 - 2 * i;
        ASSERT_GT(t0, 0);
        ASSERT_LT(t0 + kv[i] + 3, c_.T);
        ASSERT_EQ(glm_seq_new(m, c_.T + 8, &a[i], &err), MT_OK) << err.msg;
        ASSERT_EQ(glm_seq_new(m, c_.T + 8, &b[i], &err), MT_OK) << err.msg;
        for (glm_seq *s : { a[i], b[i] }) {
            ASSERT_EQ(glm_prefill(m, s, c_.tokens.data(), t0 + 1, nullptr, false, &err), MT_OK) << err.msg;
            std::vector<float> l(V);
            ASSERT_EQ(glm_model_draft(m, s, c_.tokens[t0 + 1], l.data(), &err), MT_OK) << err.msg;
        }
        la[i].resize((size_t)kv[i] * V);
        lb[i].resize((size_t)kv[i] * V);
        top[i].assign(kv[i], -1);
        parts[i + 1] = mt_batch_part{ MT_PART_DECODE, seq(a[i]), &c_.tokens[t0 + 1], kv[i], la[i].data(), true,
                                      top[i].data() };
    }
    const mt_batch batch = { parts, 4 };
    ASSERT_EQ(mt_model_forward(mm, &batch, &err), MT_OK) << err.msg;
    for (int i = 0; i < 3; i++) ASSERT_EQ(glm_seq_keep(m, a[i], keep[i], &err), MT_OK) << "sequence " << i << ": " << err.msg;
    for (int i = 0; i < 3; i++) {
        const int t0 = c_.T / 2 - 2 * i;
        ASSERT_EQ(glm_decode_verify(m, b[i], &c_.tokens[t0 + 1], kv[i], lb[i].data(), &err), MT_OK) << err.msg;
        ASSERT_EQ(glm_seq_keep(m, b[i], keep[i], &err), MT_OK) << err.msg;
        EXPECT_LT(MaxAbsDiff(la[i].data(), lb[i].data(), kv[i] * V), 1e-4f) << "sequence " << i;
        for (int r = 0; r < kv[i]; r++) {
            const float *row = &la[i][(size_t)r * V];
            EXPECT_EQ(top[i][r], (int32_t)(std::max_element(row, row + V) - row)) << "sequence " << i << " row " << r;
        }
        ASSERT_EQ(glm_seq_len(a[i]), glm_seq_len(b[i]));
        const int32_t next = c_.tokens[t0 + 1 + keep[i]];
        std::vector<float> ya(V), yb(V);
        ASSERT_EQ(glm_decode(m, a[i], next, ya.data(), &err), MT_OK) << err.msg;
        ASSERT_EQ(glm_decode(m, b[i], next, yb.data(), &err), MT_OK) << err.msg;
        EXPECT_LT(MaxAbsDiff(ya.data(), yb.data(), V), 1e-4f) << "sequence " << i;
    }
    EXPECT_EQ(glm_seq_len(c), 6);
    // verifies that cannot share mixed passes (more than verify_seqs) are refused whole
    mt_batch_part four[4];
    for (int i = 0; i < 3; i++) four[i] = mt_batch_part{ MT_PART_DECODE, seq(a[i]), c_.tokens.data(), 2, nullptr, false, nullptr };
    four[3] = mt_batch_part{ MT_PART_DECODE, seq(b[0]), c_.tokens.data(), 2, nullptr, false, nullptr };
    int len[3];
    for (int i = 0; i < 3; i++) len[i] = glm_seq_len(a[i]);
    const mt_batch batch4 = { four, 4 };
    EXPECT_EQ(mt_model_forward(mm, &batch4, &err), MT_ERR_UNSUPPORTED) << err.msg;
    for (int i = 0; i < 3; i++) EXPECT_EQ(glm_seq_len(a[i]), len[i]);
    for (int i = 0; i < 3; i++) {
        glm_seq_free(a[i]);
        glm_seq_free(b[i]);
    }
    glm_seq_free(c);
    glm_model_free(m);
}

// Drafts of three sequences in one pass (glm_mtp_draft_rows: the block's DSA in the rows form),
// twice in a chain (the second taking only each row's greedy token), against their twins
// drafting one at a time: the same logits and tokens, and after a verify and a keep each
// continues as its twin.
TEST_P(Mtp, DraftsOfSeveralSequencesShareOnePass) {
    const int V = c_.V;
    mt_error err{};
    glm_seq *a[3], *b[3];
    int t0[3];
    for (int i = 0; i < 3; i++) {
        t0[i] = c_.T / 2 - 3 * i;
        ASSERT_GT(t0[i], 0);
        a[i] = NewSeq();
        b[i] = NewSeq();
        ASSERT_TRUE(a[i] && b[i]);
        for (glm_seq *s : { a[i], b[i] })
            ASSERT_EQ(glm_prefill(m_, s, c_.tokens.data(), t0[i] + 1, nullptr, false, &err), MT_OK) << err.msg;
    }
    int32_t tok[3][3];
    for (int j = 0; j < 2; j++) {
        for (int i = 0; i < 3; i++) tok[i][j] = j == 0 ? c_.tokens[t0[i] + 1] : 3 + i;
        std::vector<float> la((size_t)3 * V);
        const int32_t row_tok[3] = { tok[0][j], tok[1][j], tok[2][j] };
        int32_t top[3] = { -1, -1, -1 }; // the second draft takes only the greedy tokens
        ASSERT_EQ(glm_mtp_draft_rows(m_, a, row_tok, 3, j == 0 ? la.data() : nullptr, top, &err), MT_OK) << err.msg;
        for (int i = 0; i < 3; i++) {
            std::vector<float> lb = Draft(b[i], tok[i][j]);
            if (j == 0) EXPECT_LT(MaxAbsDiff(&la[(size_t)i * V], lb.data(), V), 1e-4f) << "sequence " << i << " draft " << j;
            else EXPECT_EQ(top[i], glm_argmax(lb.data(), V)) << "sequence " << i;
        }
    }
    // the verify of the pending token and the two drafts, keeping 2 rows
    for (int i = 0; i < 3; i++) {
        tok[i][2] = c_.tokens[t0[i] + 3];
        const int32_t rows[3] = { tok[i][0], tok[i][1], tok[i][2] };
        for (glm_seq *s : { a[i], b[i] }) {
            ASSERT_EQ(glm_decode_verify(m_, s, rows, 3, nullptr, &err), MT_OK) << err.msg;
            ASSERT_EQ(glm_seq_keep(m_, s, 2, &err), MT_OK) << err.msg;
        }
        const int32_t next = c_.tokens[t0[i] + 4];
        std::vector<float> da = Draft(a[i], next), db = Draft(b[i], next);
        EXPECT_LT(MaxAbsDiff(da.data(), db.data(), V), 1e-4f) << "sequence " << i;
        std::vector<float> ya(V), yb(V);
        ASSERT_EQ(glm_decode(m_, a[i], next, ya.data(), &err), MT_OK) << err.msg;
        ASSERT_EQ(glm_decode(m_, b[i], next, yb.data(), &err), MT_OK) << err.msg;
        EXPECT_LT(MaxAbsDiff(ya.data(), yb.data(), V), 1e-4f) << "sequence " << i;
    }
    // refused whole, nothing changed: a sequence twice
    glm_seq *twice[2] = { a[0], a[0] };
    const int32_t two[2] = { 1, 2 };
    std::vector<float> l2((size_t)2 * V);
    const int len = glm_seq_len(a[0]);
    EXPECT_EQ(glm_mtp_draft_rows(m_, twice, two, 2, l2.data(), nullptr, &err), MT_ERR_INVALID);
    EXPECT_EQ(glm_seq_len(a[0]), len);
    for (int i = 0; i < 3; i++) {
        glm_seq_free(a[i]);
        glm_seq_free(b[i]);
    }
}

// A batched decode of three sequences feeds their drafters in one pass of the block
// (glm_mtp_follow_parts), one of them after drafts the step drops: each drafts as its twin that
// decoded alone, twice in a row.
TEST_P(Mtp, BatchedDecodeFeedsEveryDrafterInOnePass) {
    const int V = c_.V;
    mt_error err{};
    glm_seq *a[3], *b[3];
    int t0[3];
    for (int i = 0; i < 3; i++) {
        t0[i] = c_.T / 2 - 3 * i;
        ASSERT_GT(t0[i], 0);
        ASSERT_LT(t0[i] + 4, c_.T);
        a[i] = NewSeq();
        b[i] = NewSeq();
        ASSERT_TRUE(a[i] && b[i]);
        for (glm_seq *s : { a[i], b[i] })
            ASSERT_EQ(glm_prefill(m_, s, c_.tokens.data(), t0[i] + 1, nullptr, false, &err), MT_OK) << err.msg;
    }
    for (glm_seq *s : { a[1], b[1] }) { // drafts that the next decode drops
        Draft(s, c_.tokens[t0[1] + 1]);
        Draft(s, 7);
    }
    for (int j = 1; j <= 2; j++) {
        const int32_t tok[3] = { c_.tokens[t0[0] + j], c_.tokens[t0[1] + j], c_.tokens[t0[2] + j] };
        ASSERT_EQ(glm_decode_multi(m_, a, tok, 3, nullptr, &err), MT_OK) << err.msg;
        for (int i = 0; i < 3; i++) {
            ASSERT_EQ(glm_decode(m_, b[i], tok[i], nullptr, &err), MT_OK) << err.msg;
            const int32_t next = c_.tokens[t0[i] + j + 1];
            std::vector<float> da = Draft(a[i], next), db = Draft(b[i], next);
            EXPECT_LT(MaxAbsDiff(da.data(), db.data(), V), 1e-4f) << "sequence " << i << " step " << j;
        }
    }
    for (int i = 0; i < 3; i++) {
        glm_seq_free(a[i]);
        glm_seq_free(b[i]);
    }
}

INSTANTIATE_TEST_SUITE_P(Cases, Mtp, ::testing::Values(0, 1));

// Without params.mtp the block is loaded but no sequence carries drafter state.
TEST(MtpOff, LoadedButNotDrafting) {
    mt_backend *be = mt_cpu_backend_new(0);
    ASSERT_NE(be, nullptr);
    glm_model *m = nullptr;
    mt_error err{};
    glm_model_params p = glm_model_default_params();
    ASSERT_EQ(glm_model_load(kDir, be, &p, &m, &err), MT_OK) << err.msg;
    EXPECT_TRUE(glm_model_has_mtp(m));
    EXPECT_FALSE(glm_model_has_drafter(m));
    glm_model_free(m);
    // a checkpoint without the block: none
    ASSERT_EQ(glm_model_load("tests/fixtures/tiny_a", be, &p, &m, &err), MT_OK) << err.msg;
    EXPECT_FALSE(glm_model_has_mtp(m));
    glm_model_free(m);
    be->ops->destroy(be);
}

// The demo model's drafter over the held-out windows of heldout_ppl.json (each window prefilled
// at once; the drafter takes rows 0 .. len - 2 in the same passes), scored as eval_ppl.py scores
// it: rows t = 1 .. len - 3 predict window[t + 2].
TEST(MtpDemo, HeldoutNllEqualsTheReference) {
    const char dir[] = "models/glm5-next-demo";
    json_object *ref = json_object_from_file("models/glm5-next-demo/heldout_ppl.json");
    ASSERT_NE(ref, nullptr);
    json_object *mtp, *win, *ids, *v;
    ASSERT_TRUE(json_object_object_get_ex(ref, "mtp", &mtp));
    ASSERT_TRUE(json_object_object_get_ex(ref, "windows", &win));
    ASSERT_TRUE(json_object_object_get_ex(ref, "stream_ids", &ids));
    ASSERT_TRUE(json_object_object_get_ex(mtp, "mean_nll_nats", &v));
    const double ref_nll = json_object_get_double(v);
    ASSERT_TRUE(json_object_object_get_ex(mtp, "scored_tokens", &v));
    const long ref_n = json_object_get_int64(v);
    ASSERT_TRUE(json_object_object_get_ex(win, "seq", &v));
    const int seq = json_object_get_int(v);
    ASSERT_TRUE(json_object_object_get_ex(win, "prefix_ids", &v));
    std::vector<int32_t> prefix;
    for (size_t i = 0; i < json_object_array_length(v); i++)
        prefix.push_back(json_object_get_int(json_object_array_get_idx(v, i)));
    std::vector<int32_t> stream;
    for (size_t i = 0; i < json_object_array_length(ids); i++)
        stream.push_back(json_object_get_int(json_object_array_get_idx(ids, i)));
    json_object_put(ref);

    mt_backend *be = mt_cpu_backend_new(0);
    ASSERT_NE(be, nullptr);
    glm_model_params p = glm_model_default_params();
    p.mtp = true;
    glm_model *m = nullptr;
    mt_error err{};
    ASSERT_EQ(glm_model_load(dir, be, &p, &m, &err), MT_OK) << err.msg;
    const int V = glm_model_config(m)->vocab_size;
    std::vector<float> cap((size_t)seq * V);
    double nll = 0;
    long n = 0;
    const size_t piece = (size_t)seq - prefix.size();
    for (size_t at = 0; at < stream.size(); at += piece) {
        std::vector<int32_t> w = prefix;
        w.insert(w.end(), stream.begin() + at, stream.begin() + std::min(stream.size(), at + piece));
        const int len = (int)w.size();
        glm_seq *s = nullptr;
        ASSERT_EQ(glm_seq_new(m, len, &s, &err), MT_OK) << err.msg;
        glm_model_capture_drafter(m, cap.data(), seq);
        ASSERT_EQ(glm_prefill(m, s, w.data(), len, nullptr, false, &err), MT_OK) << err.msg;
        glm_model_capture_drafter(m, nullptr, 0);
        for (int t = 1; t <= len - 3; t++) {
            const float *l = &cap[(size_t)t * V];
            double mx = -INFINITY, sum = 0;
            for (int j = 0; j < V; j++) mx = std::max(mx, (double)l[j]);
            for (int j = 0; j < V; j++) sum += std::exp((double)l[j] - mx);
            nll += mx + std::log(sum) - l[w[t + 2]];
            n++;
        }
        glm_seq_free(s);
    }
    glm_model_free(m);
    be->ops->destroy(be);
    EXPECT_EQ(n, ref_n);
    const double mean = nll / (double)n;
    printf("demo drafter held-out: mean NLL %.6f here, %.6f in heldout_ppl.json (perplexity %.3f / %.3f), %ld rows\n",
           mean, ref_nll, std::exp(mean), std::exp(ref_nll), n);
    EXPECT_LT(std::fabs(std::exp(mean) - std::exp(ref_nll)) / std::exp(ref_nll), 0.005);
}

}  // namespace
