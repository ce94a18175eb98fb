// The PLE memory (docs/MODEL.md "PLE layer") on the CPU: each memory of the tiny_ple fixture
// against the reference of tests/oracle/make_ple_fixture.py (every value within 2e-3), in one
// pass, split into a prefill and prestaged or hashed decode rows, and across a snapshot restored
// into a fresh sequence; then the whole model: prefill equals token-by-token decode, batched
// decode equals single decodes, the verify contract, a mixed step equals its parts run alone, a
// copied prefix decodes as the original, and bad aux snapshots are refused. With a drafter (a
// random tiny-ple model with an MTP block), a verify's kept rows continue exactly as a twin that
// decoded only them, eagerly, in the graph form (prestaged rows) and in a mixed pass.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

extern "C" {
#include "kernels/backend.h"
#include "worker/engine/engine.h"
#include "worker/loader/glm_config.h"
#include "worker/loader/safetensors.h"
#include "worker/model/glm/glm_model.h"
#include "worker/model/layer.h"
}

#include "tests/mixed_check.h"
#include "tests/run_ahead_check.h"
#include "tests/verify_check.h"

namespace {

const char *kDir = "tests/fixtures/tiny_ple";  // PLE memories on layer 0 (KDA) and 2 (DSA, shared indexer)
const int kPle[2] = { 0, 2 };

struct PleCase {
    std::vector<int32_t> tokens;
    std::vector<float> x[2], out[2];  // [T, S*H] per memory
};

std::vector<float> Floats(st_archive *ar, const std::string &name) {
    const st_tensor *t = st_find(ar, name.c_str());
    EXPECT_NE(t, nullptr) << name;
    if (!t) return {};
    const float *p = static_cast<const float *>(t->data);
    return std::vector<float>(p, p + t->nbytes / sizeof(float));
}

// Param: the decode forms that read their ids from backend memory hash and gather there
// (ple_gather_rows, the device history), or every row is hashed on the host.
class Ple : public ::testing::TestWithParam<bool> {
  protected:
    void SetUp() override {
        be_ = mt_cpu_backend_new(0);
        mt_error err{};
        glm_model_params p = glm_model_default_params();
        p.ple_host_gather = !GetParam();
        ASSERT_EQ(glm_model_load(kDir, be_, &p, &m_, &err), MT_OK) << err.msg;
        const glm_config *c = glm_model_config(m_);
        V_ = c->vocab_size;
        SH_ = c->hc_mult * c->hidden_size;
        st_archive *ar = nullptr;
        ASSERT_EQ(st_open_file((std::string(kDir) + "/ple_case.safetensors").c_str(), &ar, &err), MT_OK) << err.msg;
        const st_tensor *t = st_find(ar, "tokens");
        ASSERT_NE(t, nullptr);
        const int32_t *tp = static_cast<const int32_t *>(t->data);
        c_.tokens.assign(tp, tp + t->shape[0]);
        for (int i = 0; i < 2; i++) {
            c_.x[i] = Floats(ar, "x_" + std::to_string(kPle[i]));
            c_.out[i] = Floats(ar, "out_" + std::to_string(kPle[i]));
        }
        st_close(ar);
    }
    void TearDown() override {
        glm_model_free(m_);
        mt_backend_free(be_);
    }
    glm_seq *NewSeq(int cap = 96) {
        glm_seq *s = nullptr;
        mt_error err{};
        EXPECT_EQ(glm_seq_new(m_, cap, &s, &err), MT_OK) << err.msg;
        return s;
    }
    // Rows [t0, t0 + n) of memory i through s (ids from the case, or NULL: the prestaged rows),
    // checked against the reference; returns the worst difference.
    double Rows(glm_seq *s, int i, int t0, int n, bool staged) {
        std::vector<float> X(c_.x[i].begin() + (size_t)t0 * SH_, c_.x[i].begin() + (size_t)(t0 + n) * SH_);
        EXPECT_EQ(glm_model_ple_apply(m_, s, kPle[i], staged ? nullptr : &c_.tokens[t0], X.data(), n), MT_OK);
        double worst = 0;
        for (size_t k = 0; k < X.size(); k++)
            worst = std::max(worst, (double)std::fabs(X[k] - c_.out[i][(size_t)t0 * SH_ + k]));
        return worst;
    }
    mt_backend *be_ = nullptr;
    glm_model *m_ = nullptr;
    PleCase c_;
    int V_ = 0, SH_ = 0;
};

TEST_P(Ple, CapabilitiesAndKinds) {
    const mt_layer *a = glm_model_layer(m_, 0), *b = glm_model_layer(m_, 2), *plain = glm_model_layer(m_, 1);
    EXPECT_STREQ(a->kind, "glm.kda+ple");
    EXPECT_STREQ(b->kind, "glm.dsa+ple");
    EXPECT_STREQ(plain->kind, "glm.dsa");
    EXPECT_TRUE(mt_layer_has_aux_state(a));
    EXPECT_TRUE(mt_layer_has_aux_state(b));  // shared indexer: the memory's state only
    EXPECT_EQ(a->caps.decode_prestage_needs_token, !GetParam());
    EXPECT_TRUE(b->caps.decode_rollback_unsupported);
    EXPECT_NE(a->ops->verify_keep, nullptr);
    EXPECT_EQ(glm_model_ahead_rows(m_) > 0, GetParam());  // greedy decode runs ahead only then
}

TEST_P(Ple, MemoryMatchesReferenceInOnePass) {
    const int T = (int)c_.tokens.size();
    for (int i = 0; i < 2; i++) {
        glm_seq *s = NewSeq();
        EXPECT_LE(Rows(s, i, 0, T, false), 2e-3) << "layer " << kPle[i];
        glm_seq_free(s);
    }
}

// The host prestage contract (a host-gathering model): a prefill of 7 rows, then rows one at a
// time, alternately prestaged and hashed from their ids; halfway, the state moves into a fresh
// sequence through its aux snapshot.
class PleHost : public Ple {};

TEST_P(PleHost, MemoryMatchesReferenceAcrossDecodeAndSnapshot) {
    const int T = (int)c_.tokens.size();
    for (int i = 0; i < 2; i++) {
        const mt_layer *l = glm_model_layer(m_, kPle[i]);
        glm_seq *s = NewSeq();
        double worst = Rows(s, i, 0, 7, false);
        for (int t = 7; t < T; t++) {
            if (t == 14) {  // snapshot, restore into a fresh sequence, go on there
                glm_seq *d = NewSeq();
                void *snap = nullptr;
                size_t n = 0;
                mt_error err{};
                ASSERT_EQ(mt_layer_snapshot_aux(l, glm_seq_state(s, kPle[i]), &snap, &n, &err), MT_OK) << err.msg;
                ASSERT_EQ(mt_layer_restore_aux(l, glm_seq_state(d, kPle[i]), snap, n, &err), MT_OK) << err.msg;
                EXPECT_NE(mt_layer_restore_aux(l, glm_seq_state(d, kPle[i]), snap, n - 1, &err), MT_OK);
                free(snap);
                glm_seq_free(s);
                s = d;
            }
            const bool staged = t % 2 == 1;
            if (staged) {
                ASSERT_EQ(mt_layer_decode_prestage(l, glm_seq_state(s, kPle[i]), c_.tokens[t]), MT_OK);
                // a rearm without a consumed row leaves the staged row as it is
                if (t == 9) mt_layer_decode_prestage_rearm(l, glm_seq_state(s, kPle[i]));
            }
            worst = std::max(worst, Rows(s, i, t, 1, staged));
        }
        EXPECT_LE(worst, 2e-3) << "layer " << kPle[i];
        glm_seq_free(s);
    }
}

TEST_P(Ple, PrefillEqualsTokenByTokenAndBatchedDecode) {
    const int T = (int)c_.tokens.size();
    glm_seq *a = NewSeq(), *b = NewSeq(), *c = NewSeq();
    mt_error err{};
    std::vector<float> la((size_t)T * V_), lb(V_), lc(V_);
    ASSERT_EQ(glm_prefill(m_, a, c_.tokens.data(), T, la.data(), true, &err), MT_OK) << err.msg;
    ASSERT_EQ(glm_prefill(m_, b, c_.tokens.data(), 1, lb.data(), false, &err), MT_OK) << err.msg;
    ASSERT_EQ(glm_prefill(m_, c, c_.tokens.data(), 1, lc.data(), false, &err), MT_OK) << err.msg;
    double worst = 0;
    for (int t = 1; t < T; t++) {
        ASSERT_EQ(glm_decode(m_, b, c_.tokens[t], lb.data(), &err), MT_OK) << err.msg;
        glm_seq *one[1] = { c };
        ASSERT_EQ(glm_decode_multi(m_, one, &c_.tokens[t], 1, lc.data(), &err), MT_OK) << err.msg;
        for (int v = 0; v < V_; v++) {
            worst = std::max(worst, (double)std::fabs(lb[v] - la[(size_t)t * V_ + v]));
            worst = std::max(worst, (double)std::fabs(lc[v] - la[(size_t)t * V_ + v]));
        }
    }
    EXPECT_LE(worst, 1e-4);
    glm_seq_free(a);
    glm_seq_free(b);
    glm_seq_free(c);
}

TEST_P(Ple, VerifyEqualsSingles) { CheckVerifyEqualsSingles(m_, "tiny_ple (CPU)", 1e-4); }

// The decode row of a mixed step hashes its id (no prestage), the prompt chunks theirs.
TEST_P(Ple, MixedStepEqualsPartByPart) { CheckMixedStep(m_, "tiny_ple (CPU)", 0.0); }

// A prefix copied into a fresh sequence (pages, slot, and every layer's aux state: the PLE
// history and conv state) decodes exactly as the sequence it came from.
TEST_P(Ple, CopiedPrefixDecodesAsTheOriginal) {
    const int T = (int)c_.tokens.size();
    glm_seq *a = NewSeq(), *b = NewSeq();
    mt_error err{};
    std::vector<float> la(V_), lb(V_);
    ASSERT_EQ(glm_prefill(m_, a, c_.tokens.data(), T, la.data(), false, &err), MT_OK) << err.msg;
    ASSERT_EQ(glm_seq_copy_prefix(m_, a, b, &err), MT_OK) << err.msg;
    for (int i = 0; i < 8; i++) {
        const int32_t tok = glm_argmax(la.data(), V_);
        ASSERT_EQ(glm_decode(m_, a, tok, la.data(), &err), MT_OK) << err.msg;
        ASSERT_EQ(glm_decode(m_, b, tok, lb.data(), &err), MT_OK) << err.msg;
        for (int v = 0; v < V_; v++) ASSERT_EQ(la[v], lb[v]) << "step " << i;
    }
    glm_seq_free(a);
    glm_seq_free(b);
}

// Greedy steps run ahead of the host (the ids only on the device, hashed and gathered there)
// give the plain path's tokens (tests/run_ahead_check.h).
TEST_P(Ple, GreedyRunAheadEqualsReadingEachStep) {
    if (!GetParam()) GTEST_SKIP() << "a host-gathering model does not run ahead";
    CheckRunAhead(m_, "tiny_ple (CPU, device gather)");
}

// After steps run ahead, the host's copy of the history is stale: a snapshot (prefix copy) reads
// the device's, and the host form (a single decode) reads it back first; both continue as a
// twin decoded from the host's tokens.
TEST_P(Ple, StateAfterRunAheadMovesExactly) {
    if (!GetParam()) GTEST_SKIP() << "a host-gathering model does not run ahead";
    const int T = 12;
    glm_seq *a = nullptr, *b = nullptr, *c = nullptr;
    mt_error err{};
    ASSERT_EQ(glm_seq_new(m_, 96, &a, &err), MT_OK) << err.msg;
    ASSERT_EQ(glm_seq_new(m_, 96, &b, &err), MT_OK) << err.msg;
    ASSERT_EQ(glm_seq_new(m_, 96, &c, &err), MT_OK) << err.msg;
    std::vector<float> la(V_), lb(V_), lc(V_);
    ASSERT_EQ(glm_prefill(m_, a, c_.tokens.data(), T, lb.data(), false, &err), MT_OK) << err.msg;
    ASSERT_EQ(glm_prefill(m_, b, c_.tokens.data(), T, lb.data(), false, &err), MT_OK) << err.msg;
    int32_t tok = glm_argmax(lb.data(), V_);
    std::vector<int32_t> chain;
    int64_t ticket = -1;
    for (int t = 0; t < 5; t++) {  // a: from the device's tokens after the first
        glm_seq *one[1] = { a };
        ASSERT_EQ(glm_decode_greedy(m_, one, t == 0 ? &tok : nullptr, 1, &ticket, &err), MT_OK) << err.msg;
    }
    int32_t last = -1;
    ASSERT_EQ(glm_greedy_tokens(m_, ticket, &last, 1), MT_OK);
    for (int t = 0; t < 5; t++) {  // b: the same steps from the host's tokens
        glm_seq *one[1] = { b };
        ASSERT_EQ(glm_decode_multi(m_, one, &tok, 1, lb.data(), &err), MT_OK) << err.msg;
        tok = glm_argmax(lb.data(), V_);
    }
    ASSERT_EQ(tok, last);
    ASSERT_EQ(glm_seq_copy_prefix(m_, a, c, &err), MT_OK) << err.msg;
    for (int t = 0; t < 4; t++) {
        ASSERT_EQ(glm_decode(m_, a, tok, la.data(), &err), MT_OK) << err.msg;
        ASSERT_EQ(glm_decode(m_, b, tok, lb.data(), &err), MT_OK) << err.msg;
        ASSERT_EQ(glm_decode(m_, c, tok, lc.data(), &err), MT_OK) << err.msg;
        for (int v = 0; v < V_; v++) {
            ASSERT_EQ(la[v], lb[v]) << "step " << t;
            ASSERT_EQ(lc[v], lb[v]) << "step " << t;
        }
        tok = glm_argmax(lb.data(), V_);
    }
    glm_seq_free(a);
    glm_seq_free(b);
    glm_seq_free(c);
}

TEST_P(Ple, BadSnapshotRefusedAndStateKept) {
    const mt_layer *l = glm_model_layer(m_, 0);
    glm_seq *s = NewSeq();
    mt_error err{};
    uint32_t junk[2] = { 99, 0 };  // a history longer than N-1
    EXPECT_EQ(mt_layer_restore_aux(l, glm_seq_state(s, 0), junk, sizeof junk, &err), MT_ERR_INVALID);
    EXPECT_EQ(mt_layer_restore_aux(l, glm_seq_state(s, 0), junk, 2, &err), MT_ERR_INVALID);
    glm_seq_free(s);
}

// The engine over tiny_ple: greedy requests (some sharing a prefix) in pools small enough to
// preempt, run ahead of the host (device gather: the histories advance on the device, snapshots
// and re-prefills read them back), give the tokens of the host-gathering model without run-ahead.
struct EngineOut {
    std::map<uint64_t, std::vector<int32_t>> tokens;
    eng_stats st = {};
};

EngineOut RunEngine(bool device, eng_run_ahead ahead) {
    EngineOut out;
    mt_backend *be = mt_cpu_backend_new(1);
    glm_model_params mp = glm_model_default_params();
    mp.ple_host_gather = !device;
    glm_model *m = nullptr;
    mt_error err{};
    EXPECT_EQ(glm_model_load(kDir, be, &mp, &m, &err), MT_OK) << err.msg;
    if (!m) return out;
    EXPECT_EQ(glm_model_set_pools(m, 12, 16, &err), MT_OK) << err.msg;
    eng_params p = eng_default_params();
    p.max_sequences = 6;
    p.prefix_block = 16;
    p.run_ahead = ahead;
    eng_callbacks cb = {};
    cb.user = &out;
    cb.on_tokens = [](void *u, uint64_t id, const eng_sample_result *t, int n) {
        for (int i = 0; i < n; i++) static_cast<EngineOut *>(u)->tokens[id].push_back(t[i].token);
    };
    eng_engine *e = nullptr;
    EXPECT_EQ(eng_new(glm_model_as_model(m), &p, &cb, &e, &err), MT_OK) << err.msg;
    std::vector<int32_t> common;
    for (int i = 0; i < 40; i++) common.push_back((i * 37 + 11) % 256);
    std::vector<std::vector<int32_t>> prompts;
    for (int r = 0; r < 8; r++) {
        std::vector<int32_t> q = r % 2 == 0 ? common : std::vector<int32_t>{};
        for (int i = 0; i < 6 + 5 * r; i++) q.push_back((r * 101 + i * 13 + 7) % 256);
        prompts.push_back(q);
    }
    for (size_t i = 0; e && i < prompts.size(); i++) {
        eng_request q = eng_default_request();
        q.prompt = prompts[i].data();
        q.n_prompt = (int)prompts[i].size();
        q.max_new_tokens = 80;
        q.ignore_eos = true;
        EXPECT_EQ(eng_submit(e, i + 1, &q, 0, &err), MT_OK) << err.msg;
    }
    for (int guard = 0; e && eng_has_work(e) && guard < 100000; guard++) EXPECT_EQ(eng_step(e, nullptr), MT_OK);
    if (e) eng_get_stats(e, &out.st);
    eng_free(e);
    glm_model_free(m);
    mt_backend_free(be);
    return out;
}

TEST(PleEngine, RunAheadWithPrefixReuseAndPreemptionMatchesHostGather) {
    const EngineOut ref = RunEngine(false, ENG_RUN_AHEAD_OFF);
    const EngineOut dev = RunEngine(true, ENG_RUN_AHEAD_ALWAYS);
    ASSERT_EQ(ref.tokens.size(), 8u);
    for (const auto &[id, t] : ref.tokens) {
        EXPECT_EQ(t.size(), 80u) << "id " << id;
        EXPECT_EQ(dev.tokens.at(id), t) << "id " << id;
    }
    EXPECT_GT(dev.st.ahead_steps, 0u);
    EXPECT_GT(dev.st.preemptions, 0u);
    EXPECT_GT(dev.st.prefix_hits, 0u);
    printf("engine on tiny_ple: %llu steps ahead, %llu preemptions, %llu prefix hits\n",
           (unsigned long long)dev.st.ahead_steps, (unsigned long long)dev.st.preemptions,
           (unsigned long long)dev.st.prefix_hits);
}

INSTANTIATE_TEST_SUITE_P(HostAndDeviceGather, Ple, ::testing::Values(false, true));
INSTANTIATE_TEST_SUITE_P(HostGather, PleHost, ::testing::Values(false));

// ---- speculative decoding: a verify's rows are provisional ----

// A random tiny-ple model (vocabulary 300) with an MTP block, its drafter on: the verify rings
// hold the PLE conv state after each row, and glm_seq_keep rewinds the history and conv state.
class PleSpec : public ::testing::TestWithParam<bool> {
  protected:
    void SetUp() override {
        be_ = mt_cpu_backend_new(0);
        mt_error err{};
        glm_config c;
        ASSERT_EQ(glm_config_preset("tiny-ple", &c, &err), MT_OK) << err.msg;
        c.vocab_size = V_;
        c.num_nextn_predict_layers = 1;
        glm_model_params p = glm_model_default_params();
        p.mtp = true;
        p.verify_seqs = 3;
        p.device_positions = GetParam();  // the graph form: each row of a verify prestaged
        ASSERT_EQ(glm_model_new_random(&c, 17, be_, &p, &m_, &err), MT_OK) << err.msg;
        ASSERT_TRUE(glm_model_has_drafter(m_));
        for (int i = 0; i < 40; i++) tokens_.push_back((i * 53 + 19) % V_);
    }
    void TearDown() override {
        glm_model_free(m_);
        mt_backend_free(be_);
    }
    glm_seq *NewSeq() {
        glm_seq *s = nullptr;
        mt_error err{};
        EXPECT_EQ(glm_seq_new(m_, 64, &s, &err), MT_OK) << err.msg;
        return s;
    }
    std::vector<float> Draft(glm_seq *s, int32_t token) {
        std::vector<float> l(V_);
        mt_error err{};
        EXPECT_EQ(glm_model_draft(m_, s, token, l.data(), &err), MT_OK) << err.msg;
        return l;
    }
    // Three decode steps of a and b with a draft before each, from tokens_[t]: equal logits.
    void ExpectSameFuture(glm_seq *a, glm_seq *b, int t, const char *what, float tol) {
        mt_error err{};
        ASSERT_EQ(glm_seq_len(a), glm_seq_len(b)) << what;
        for (int step = 0; step < 3; step++) {
            const int32_t next = tokens_[t + step];
            std::vector<float> da = Draft(a, next), db = Draft(b, next);
            std::vector<float> la(V_), lb(V_);
            ASSERT_EQ(glm_decode(m_, a, next, la.data(), &err), MT_OK) << err.msg;
            ASSERT_EQ(glm_decode(m_, b, next, lb.data(), &err), MT_OK) << err.msg;
            float d = 0, dd = 0;
            for (int v = 0; v < V_; v++) {
                d = std::max(d, std::fabs(la[v] - lb[v]));
                dd = std::max(dd, std::fabs(da[v] - db[v]));
            }
            EXPECT_LE(d, tol) << what << " decode " << step;
            EXPECT_LE(dd, tol) << what << " draft " << step;
        }
    }
    static constexpr int V_ = 300;
    mt_backend *be_ = nullptr;
    glm_model *m_ = nullptr;
    std::vector<int32_t> tokens_;
};

// A verify of k rows keeping 1..k, against a twin that decoded only the kept rows (in one step
// of keep rows, the same arithmetic): the same logits after, bit for bit. Row 0's history and
// conv state come from the ring's first slot, the others' from later ones; keeping every row
// leaves the verify's own state.
TEST_P(PleSpec, KeptRowsContinueExactly) {
    mt_error err{};
    for (int k : { 2, 4, GLM_VERIFY_MAX }) {
        for (int keep = 1; keep <= k; keep++) {
            const int t0 = 6 + keep;  // prompts of different lengths: the history wraps differently
            glm_seq *a = NewSeq(), *b = NewSeq();
            ASSERT_TRUE(a && b);
            ASSERT_EQ(glm_prefill(m_, a, tokens_.data(), t0, nullptr, false, &err), MT_OK) << err.msg;
            ASSERT_EQ(glm_prefill(m_, b, tokens_.data(), t0, nullptr, false, &err), MT_OK) << err.msg;
            Draft(a, tokens_[t0]);
            Draft(a, 7);
            ASSERT_EQ(glm_decode_verify(m_, a, &tokens_[t0], k, nullptr, &err), MT_OK) << err.msg;
            ASSERT_EQ(glm_seq_keep(m_, a, keep, &err), MT_OK) << err.msg;
            ASSERT_EQ(glm_decode_verify(m_, b, &tokens_[t0], keep, nullptr, &err), MT_OK) << err.msg;
            char what[48];
            snprintf(what, sizeof what, "k %d keep %d", k, keep);
            ExpectSameFuture(a, b, t0 + keep, what, 0.f);
            glm_seq_free(a);
            glm_seq_free(b);
        }
    }
}

// A kept verify, then its sequence's snapshot through every layer's aux state (prefix reuse)
// decodes as the original; keep is refused after a step that was not a verify of that many rows.
TEST_P(PleSpec, KeptStateSnapshotsAndKeepIsChecked) {
    mt_error err{};
    glm_seq *a = NewSeq(), *b = NewSeq();
    ASSERT_TRUE(a && b);
    ASSERT_EQ(glm_prefill(m_, a, tokens_.data(), 9, nullptr, false, &err), MT_OK) << err.msg;
    EXPECT_EQ(glm_seq_keep(m_, a, 1, &err), MT_ERR_STATE);
    ASSERT_EQ(glm_decode_verify(m_, a, &tokens_[9], 5, nullptr, &err), MT_OK) << err.msg;
    EXPECT_EQ(glm_seq_keep(m_, a, 6, &err), MT_ERR_INVALID);
    ASSERT_EQ(glm_seq_keep(m_, a, 2, &err), MT_OK) << err.msg;
    EXPECT_EQ(glm_seq_len(a), 11);
    ASSERT_EQ(glm_seq_copy_prefix(m_, a, b, &err), MT_OK) << err.msg;
    ExpectSameFuture(a, b, 11, "copied after a keep", 0.f);
    glm_seq_free(a);
    glm_seq_free(b);
}

// Three sequences' verifies in one mixed pass beside a decode row (a ring each: the PLE conv
// states after each row land in ring 0, 1, 2), each keeping some rows, against twins that
// verified alone and kept as many.
TEST_P(PleSpec, VerifiesOfSeveralSequencesShareOnePass) {
    const int kv[3] = { 4, 3, 5 }, keep[3] = { 2, 3, 1 };
    mt_error err{};
    glm_seq *a[3], *b[3], *d = NewSeq();
    ASSERT_NE(d, nullptr);
    ASSERT_EQ(glm_prefill(m_, d, tokens_.data(), 4, nullptr, false, &err), MT_OK) << err.msg;
    glm_mixed_part parts[4];
    int32_t dtop = -1;
    parts[0] = glm_mixed_part{ d, &tokens_[4], 1, nullptr, false, &dtop, false };
    std::vector<int32_t> top[3];
    for (int i = 0; i < 3; i++) {
        const int t0 = 10 + 3 * i;
        a[i] = NewSeq();
        b[i] = NewSeq();
        ASSERT_TRUE(a[i] && b[i]);
        for (glm_seq *s : { a[i], b[i] }) {
            ASSERT_EQ(glm_prefill(m_, s, tokens_.data(), t0, nullptr, false, &err), MT_OK) << err.msg;
            Draft(s, tokens_[t0]);
        }
        top[i].assign(kv[i], -1);
        parts[i + 1] = glm_mixed_part{ a[i], &tokens_[t0], kv[i], nullptr, false, top[i].data(), true };
    }
    ASSERT_EQ(glm_forward_mixed(m_, parts, 4, 0, &err), MT_OK) << err.msg;
    for (int i = 0; i < 3; i++) ASSERT_EQ(glm_seq_keep(m_, a[i], keep[i], &err), MT_OK) << err.msg;
    for (int i = 0; i < 3; i++) {
        const int t0 = 10 + 3 * i;
        ASSERT_EQ(glm_decode_verify(m_, b[i], &tokens_[t0], kv[i], nullptr, &err), MT_OK) << err.msg;
        ASSERT_EQ(glm_seq_keep(m_, b[i], keep[i], &err), MT_OK) << err.msg;
    }
    for (int i = 0; i < 3; i++) {
        char what[32];
        snprintf(what, sizeof what, "sequence %d", i);
        ExpectSameFuture(a[i], b[i], 10 + 3 * i + keep[i], what, 1e-4f);
        glm_seq_free(a[i]);
        glm_seq_free(b[i]);
    }
    glm_seq_free(d);
}

INSTANTIATE_TEST_SUITE_P(EagerAndGraphForm, PleSpec, ::testing::Values(false, true));

}  // namespace
