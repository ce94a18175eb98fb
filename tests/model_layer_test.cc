// The GLM model behind the layer contract: capabilities, DSA graph hooks, DSA aux state, and bad
// input at the model boundary (token ids, capacity, broken checkpoints), each a distinct error that
// leaves the model and the sequence as they were.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

extern "C" {
#include "kernels/backend.h"
#include "worker/loader/glm_config.h"
#include "worker/loader/safetensors.h"
#include "worker/model/glm/glm_model.h"
#include "worker/model/layer.h"
}

#include "tests/run_ahead_check.h"
#include "tests/verify_check.h"

namespace {

const char *kDir = "tests/fixtures/tiny_a";  // layers: KDA, DSA full, DSA shared, KDA

class ModelLayer : public ::testing::Test {
  protected:
    void SetUp() override {
        be_ = mt_cpu_backend_new(0);
        mt_error err{};
        ASSERT_EQ(glm_model_load(kDir, be_, nullptr, &m_, &err), MT_OK) << err.msg;
        V_ = glm_model_config(m_)->vocab_size;
    }
    void TearDown() override {
        glm_model_free(m_);
        mt_backend_free(be_);
    }
    mt_backend *be_ = nullptr;
    glm_model *m_ = nullptr;
    int V_ = 0;
};

TEST_F(ModelLayer, GreedyRunAheadEqualsReadingEachStep) { CheckRunAhead(m_, "tiny_a (CPU)"); }

TEST_F(ModelLayer, CapabilitiesByKind) {
    ASSERT_EQ(glm_model_n_layers(m_), 4);
    const mt_layer *kda = glm_model_layer(m_, 0), *full = glm_model_layer(m_, 1), *shared = glm_model_layer(m_, 2);
    EXPECT_STREQ(kda->kind, "glm.kda");
    EXPECT_TRUE(kda->caps.is_ssm_layer);
    EXPECT_TRUE(kda->caps.decode_rollback_unsupported);
    EXPECT_STREQ(full->kind, "glm.dsa");
    EXPECT_FALSE(full->caps.is_ssm_layer);
    EXPECT_FALSE(mt_layer_has_aux_state(kda));
    EXPECT_TRUE(mt_layer_has_aux_state(full));
    EXPECT_FALSE(mt_layer_has_aux_state(shared));  // no indexer of its own
    EXPECT_FALSE(kda->caps.decode_multi_seq_unsupported);
    EXPECT_FALSE(full->caps.decode_multi_seq_unsupported);
    // Unfilled slots fall back to their defaults.
    EXPECT_EQ(mt_layer_decode_prestage(kda, nullptr, 5), MT_OK);
    EXPECT_EQ(mt_layer_check_replay_room(kda, nullptr, 1 << 30, 1), MT_OK);
    static const mt_layer_ops bare_ops = {};  // a layer that fills no optional slot
    mt_layer bare = {&bare_ops, {}, "bare", 0};
    EXPECT_EQ(mt_layer_decode_multi_seq(&bare, nullptr, 0, nullptr, nullptr), MT_ERR_UNSUPPORTED);
    EXPECT_FALSE(mt_layer_has_aux_state(&bare));
    EXPECT_EQ(mt_layer_sync_replayed_step(&bare, nullptr, 3, 1), MT_OK);
}

TEST_F(ModelLayer, DsaReplayHooksTrackTheIndexerLength) {
    glm_seq *s = nullptr;
    mt_error err{};
    ASSERT_EQ(glm_seq_new(m_, 8, &s, &err), MT_OK);
    const int32_t toks[5] = {1, 2, 3, 4, 5};
    ASSERT_EQ(glm_prefill(m_, s, toks, 5, nullptr, false, &err), MT_OK);
    const mt_layer *full = glm_model_layer(m_, 1);
    mt_layer_state *st = glm_seq_state(s, 1);
    EXPECT_EQ(mt_layer_check_replay_room(full, st, 5, 3), MT_OK);      // ends at 8 = capacity
    EXPECT_EQ(mt_layer_check_replay_room(full, st, 5, 4), MT_ERR_FULL);  // would write position 8
    EXPECT_EQ(mt_layer_sync_replayed_step(full, st, 6, 1), MT_ERR_STATE);  // cache behind seq_len
    EXPECT_EQ(mt_layer_sync_replayed_step(full, st, 5, 1), MT_OK);         // advance by k
    EXPECT_EQ(mt_layer_sync_replayed_step(full, st, 5, 1), MT_OK);         // ahead: rewind, advance
    EXPECT_EQ(mt_layer_sync_replayed_step(full, st, 5, 4), MT_ERR_FULL);
    glm_seq_free(s);
}

TEST_F(ModelLayer, DsaAuxSnapshotRestoresTheIndexerCache) {
    glm_seq *a = nullptr, *b = nullptr;
    mt_error err{};
    ASSERT_EQ(glm_seq_new(m_, 64, &a, &err), MT_OK);
    ASSERT_EQ(glm_seq_new(m_, 64, &b, &err), MT_OK);
    std::vector<int32_t> toks(21);
    for (int i = 0; i < 21; i++) toks[i] = (i * 37 + 11) % V_;
    ASSERT_EQ(glm_prefill(m_, a, toks.data(), 21, nullptr, false, &err), MT_OK);
    const mt_layer *full = glm_model_layer(m_, 1);
    void *snap = nullptr;
    size_t len = 0;
    ASSERT_EQ(mt_layer_snapshot_aux(full, glm_seq_state(a, 1), &snap, &len, &err), MT_OK) << err.msg;
    ASSERT_GT(len, 21u * 16 * 4 * 2);  // keys and gate scores of 21 positions at least

    // Restored into another sequence, a snapshot of it is byte-identical.
    ASSERT_EQ(mt_layer_restore_aux(full, glm_seq_state(b, 1), snap, len, &err), MT_OK) << err.msg;
    void *snap2 = nullptr;
    size_t len2 = 0;
    ASSERT_EQ(mt_layer_snapshot_aux(full, glm_seq_state(b, 1), &snap2, &len2, &err), MT_OK);
    ASSERT_EQ(len, len2);
    EXPECT_EQ(memcmp(snap, snap2, len), 0);
    free(snap2);

    // A corrupt or foreign snapshot is refused and leaves the state untouched.
    std::vector<char> bad((char *)snap, (char *)snap + len);
    bad[0] ^= 1;
    EXPECT_EQ(mt_layer_restore_aux(full, glm_seq_state(b, 1), bad.data(), bad.size(), &err), MT_ERR_INVALID);
    EXPECT_NE(std::string(err.msg).find("not this layer's"), std::string::npos) << err.msg;
    EXPECT_EQ(mt_layer_restore_aux(full, glm_seq_state(b, 1), snap, len - 4, &err), MT_ERR_INVALID);
    EXPECT_NE(std::string(err.msg).find("size"), std::string::npos) << err.msg;
    EXPECT_EQ(mt_layer_snapshot_aux(full, glm_seq_state(b, 1), &snap2, &len2, &err), MT_OK);
    EXPECT_EQ(len, len2);
    EXPECT_EQ(memcmp(snap, snap2, len), 0);
    free(snap2);
    // Too long for a small sequence.
    glm_seq *tiny = nullptr;
    ASSERT_EQ(glm_seq_new(m_, 8, &tiny, &err), MT_OK);
    EXPECT_EQ(mt_layer_restore_aux(full, glm_seq_state(tiny, 1), snap, len, &err), MT_ERR_FULL);
    glm_seq_free(tiny);
    free(snap);
    glm_seq_free(a);
    glm_seq_free(b);
}

TEST_F(ModelLayer, BadTokensAndFullSequencesAreRefusedWithoutHarm) {
    glm_seq *s = nullptr, *ref = nullptr;
    mt_error err{};
    ASSERT_EQ(glm_seq_new(m_, 6, &s, &err), MT_OK);
    ASSERT_EQ(glm_seq_new(m_, 6, &ref, &err), MT_OK);
    const int32_t good[3] = {7, 8, 9};
    std::vector<float> l1(V_), l2(V_);
    ASSERT_EQ(glm_prefill(m_, s, good, 2, nullptr, false, &err), MT_OK);
    const int32_t bad[2] = {3, V_};
    EXPECT_EQ(glm_prefill(m_, s, bad, 2, nullptr, false, &err), MT_ERR_INVALID);
    EXPECT_NE(std::string(err.msg).find("outside the vocabulary"), std::string::npos) << err.msg;
    EXPECT_EQ(glm_decode(m_, s, -1, l1.data(), &err), MT_ERR_INVALID);
    EXPECT_EQ(glm_prefill(m_, s, good, 0, nullptr, false, &err), MT_ERR_INVALID);
    EXPECT_EQ(glm_seq_len(s), 2);
    const int32_t many[5] = {1, 2, 3, 4, 5};
    EXPECT_EQ(glm_prefill(m_, s, many, 5, nullptr, false, &err), MT_ERR_FULL);
    EXPECT_NE(std::string(err.msg).find("room"), std::string::npos) << err.msg;
    EXPECT_EQ(glm_seq_len(s), 2);
    // The refused calls changed nothing: the next token's logits equal a clean run's.
    ASSERT_EQ(glm_decode(m_, s, good[2], l1.data(), &err), MT_OK);
    ASSERT_EQ(glm_prefill(m_, ref, good, 3, l2.data(), false, &err), MT_OK);
    for (int v = 0; v < V_; v++) ASSERT_NEAR(l1[v], l2[v], 1e-4) << v;
    EXPECT_EQ(glm_seq_new(m_, 0, &ref, &err), MT_ERR_INVALID);
    glm_seq_free(s);
    glm_seq_free(ref);
}

// Rewrites the fixture checkpoint into a temp dir with one tensor dropped or reshaped, or with
// every BF16 tensor converted to as_dtype (F32 or F16).
std::string BrokenCopy(const char *drop, const char *reshape, mt_dtype as_dtype = MT_BF16) {
    char tmpl[] = "/tmp/mt_model_XXXXXX";
    std::string dir = mkdtemp(tmpl);
    st_archive *ar = nullptr;
    mt_error err{};
    EXPECT_EQ(st_open_dir(kDir, &ar, &err), MT_OK) << err.msg;
    st_writer *w = st_writer_new();
    for (size_t i = 0; i < st_count(ar); i++) {
        const st_tensor *t = st_at(ar, i);
        if (drop && !strcmp(t->name, drop)) continue;
        int64_t shape[ST_MAX_DIMS];
        memcpy(shape, t->shape, sizeof shape);
        if (reshape && !strcmp(t->name, reshape)) std::swap(shape[0], shape[1]);
        if (t->dtype == MT_BF16 && as_dtype != MT_BF16) {
            const size_t n = t->nbytes / 2;
            std::vector<float> f(n);
            mt_to_f32(f.data(), t->data, MT_BF16, n);
            std::vector<uint16_t> h(n);
            for (size_t k = 0; k < n; k++) h[k] = mt_f32_to_f16(f[k]);
            const void *data = as_dtype == MT_F32 ? (const void *)f.data() : (const void *)h.data();
            EXPECT_EQ(st_writer_add(w, t->name, as_dtype, t->ndim, shape, data, &err), MT_OK) << err.msg;
            continue;
        }
        EXPECT_EQ(st_writer_add(w, t->name, t->dtype, t->ndim, shape, t->data, &err), MT_OK) << err.msg;
    }
    EXPECT_EQ(st_writer_save(w, dir.c_str(), 0, &err), MT_OK) << err.msg;
    st_writer_free(w);
    st_close(ar);
    std::string cmd = std::string("cp ") + kDir + "/config.json " + dir + "/";
    EXPECT_EQ(system(cmd.c_str()), 0);
    return dir;
}

TEST_F(ModelLayer, BrokenCheckpointsNameTheTensor) {
    mt_error err{};
    glm_model *m = nullptr;
    const char *name = "model.language_model.layers.2.self_attn.kv_b_proj.weight";
    std::string d1 = BrokenCopy(name, nullptr);
    EXPECT_EQ(glm_model_load(d1.c_str(), be_, nullptr, &m, &err), MT_ERR_NOT_FOUND);
    EXPECT_EQ(m, nullptr);
    EXPECT_NE(std::string(err.msg).find(name), std::string::npos) << err.msg;
    std::string d2 = BrokenCopy(nullptr, "model.language_model.layers.0.self_attn.f_b_proj.weight");
    EXPECT_EQ(glm_model_load(d2.c_str(), be_, nullptr, &m, &err), MT_ERR_INVALID);
    EXPECT_NE(std::string(err.msg).find("f_b_proj"), std::string::npos) << err.msg;
    EXPECT_EQ(glm_model_load("/nonexistent/dir", be_, nullptr, &m, &err), MT_ERR_IO);
    EXPECT_NE(std::string(err.msg).find("/nonexistent/dir"), std::string::npos) << err.msg;
    std::string cmd = "rm -rf " + d1 + " " + d2;
    EXPECT_EQ(system(cmd.c_str()), 0);
}

// The same weights stored as F32 (exactly the bf16 values) and F16 (rounded) give the same logits.
TEST_F(ModelLayer, Fp32AndFp16CheckpointsLoad) {
    std::vector<int32_t> toks = {5, 17, 99, 3, 250, 42, 7, 8, 9, 10, 11};
    auto run = [&](glm_model *m) {
        glm_seq *s = nullptr;
        mt_error err{};
        std::vector<float> l(toks.size() * V_);
        EXPECT_EQ(glm_seq_new(m, (int)toks.size(), &s, &err), MT_OK);
        EXPECT_EQ(glm_prefill(m, s, toks.data(), (int)toks.size(), l.data(), true, &err), MT_OK) << err.msg;
        glm_seq_free(s);
        return l;
    };
    std::vector<float> ref = run(m_);
    for (mt_dtype dt : {MT_F32, MT_F16}) {
        std::string d = BrokenCopy(nullptr, nullptr, dt);
        glm_model *m = nullptr;
        mt_error err{};
        ASSERT_EQ(glm_model_load(d.c_str(), be_, nullptr, &m, &err), MT_OK) << err.msg;
        std::vector<float> l = run(m);
        glm_model_free(m);
        double worst = 0;
        for (size_t i = 0; i < l.size(); i++) worst = std::fmax(worst, std::fabs(l[i] - ref[i]));
        EXPECT_LE(worst, dt == MT_F32 ? 1e-5 : 5e-2) << mt_dtype_name(dt);
        EXPECT_GT(worst, dt == MT_F32 ? -1.0 : 0.0) << "f16 rounding should show";
        std::string cmd = "rm -rf " + d;
        EXPECT_EQ(system(cmd.c_str()), 0);
    }
}

}  // namespace

// Batched decode (one row per sequence through decode_multi_seq) gives each sequence the logits
// and greedy tokens it gets decoding alone, with sequences of different lengths (across pool and
// tail boundaries) joining and leaving between steps. Tokens must be identical; logits agree to
// rounding (the same ops run over more rows).
class BatchedDecode : public ::testing::TestWithParam<const char *> {};

TEST_P(BatchedDecode, EqualsEachSequenceAlone) {
    mt_backend *be = mt_cpu_backend_new(0);
    glm_model *m = nullptr;
    mt_error err{};
    const std::string dir = std::string("tests/fixtures/") + GetParam();
    ASSERT_EQ(glm_model_load(dir.c_str(), be, nullptr, &m, &err), MT_OK) << err.msg;
    const int V = glm_model_config(m)->vocab_size, steps = 12;
    // prompt lengths, the step each sequence joins at and the step it leaves after
    const int plen[5] = {3, 10, 17, 30, 5}, join[5] = {0, 0, 2, 0, 5}, leave[5] = {12, 6, 12, 9, 12};
    std::vector<std::vector<int32_t>> prompt(5), alone_tok(5);
    std::vector<std::vector<float>> alone_logits(5);
    for (int q = 0; q < 5; q++) {
        for (int i = 0; i < plen[q]; i++) prompt[q].push_back((q * 31 + i * 17 + 3) % V);
        glm_seq *s = nullptr;
        ASSERT_EQ(glm_seq_new(m, plen[q] + steps + 1, &s, &err), MT_OK);
        std::vector<float> l(V);
        ASSERT_EQ(glm_prefill(m, s, prompt[q].data(), plen[q], l.data(), false, &err), MT_OK) << err.msg;
        for (int t = join[q]; t < leave[q]; t++) {
            alone_tok[q].push_back(glm_argmax(l.data(), V));
            ASSERT_EQ(glm_decode(m, s, alone_tok[q].back(), l.data(), &err), MT_OK) << err.msg;
            alone_logits[q].insert(alone_logits[q].end(), l.begin(), l.end());
        }
        glm_seq_free(s);
    }
    glm_seq *seq[5] = {};
    std::vector<float> last[5];
    std::vector<std::vector<int32_t>> got_tok(5);
    double worst = 0;
    for (int t = 0; t < steps; t++) {
        std::vector<glm_seq *> batch;
        std::vector<int32_t> toks;
        std::vector<int> who;
        for (int q = 0; q < 5; q++) {
            if (t == join[q]) {  // joins: prefill now, decode from this step on
                ASSERT_EQ(glm_seq_new(m, plen[q] + steps + 1, &seq[q], &err), MT_OK);
                last[q].resize(V);
                ASSERT_EQ(glm_prefill(m, seq[q], prompt[q].data(), plen[q], last[q].data(), false, &err), MT_OK);
            }
            if (t >= join[q] && t < leave[q]) {
                got_tok[q].push_back(glm_argmax(last[q].data(), V));
                batch.push_back(seq[q]);
                toks.push_back(got_tok[q].back());
                who.push_back(q);
            }
        }
        std::vector<float> l(batch.size() * V);
        ASSERT_EQ(glm_decode_multi(m, batch.data(), toks.data(), (int)batch.size(), l.data(), &err), MT_OK) << err.msg;
        for (size_t r = 0; r < who.size(); r++) {
            const int q = who[r], k = t - join[q];
            last[q].assign(l.begin() + (long)r * V, l.begin() + (long)(r + 1) * V);
            for (int v = 0; v < V; v++)
                worst = std::fmax(worst, std::fabs(last[q][v] - alone_logits[q][(size_t)k * V + v]));
        }
        for (int q = 0; q < 5; q++)
            if (t + 1 == leave[q]) { glm_seq_free(seq[q]); seq[q] = nullptr; }
    }
    for (int q = 0; q < 5; q++) EXPECT_EQ(got_tok[q], alone_tok[q]) << GetParam() << " sequence " << q;
    EXPECT_LE(worst, 1e-5) << GetParam();
    printf("%s: 5 sequences joining and leaving over %d batched steps, worst |logit diff| vs alone %.2e\n",
           GetParam(), steps, worst);
    // Bad batches are refused whole.
    glm_seq *a = nullptr;
    ASSERT_EQ(glm_seq_new(m, 8, &a, &err), MT_OK);
    glm_seq *twice[2] = {a, a};
    const int32_t two[2] = {1, 2};
    EXPECT_EQ(glm_decode_multi(m, twice, two, 2, nullptr, &err), MT_ERR_INVALID);
    EXPECT_NE(std::string(err.msg).find("twice"), std::string::npos) << err.msg;
    const int32_t bad[1] = {V};
    EXPECT_EQ(glm_decode_multi(m, &a, bad, 1, nullptr, &err), MT_ERR_INVALID);
    EXPECT_EQ(glm_seq_len(a), 0);
    glm_seq_free(a);
    glm_model_free(m);
    mt_backend_free(be);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, BatchedDecode, ::testing::Values("tiny_a", "tiny_b", "tiny_c"));

// Random models: the same seed gives the same logits, another seed different ones, and a bad
// config is refused before anything is allocated.
TEST(ModelRandom, SeededAndValidated) {
    mt_backend *be = mt_cpu_backend_new(0);
    glm_config c;
    mt_error err{};
    ASSERT_EQ(glm_config_preset("tiny", &c, &err), MT_OK) << err.msg;
    auto logits = [&](uint64_t seed) {
        glm_model *m = nullptr;
        glm_seq *s = nullptr;
        mt_error e{};
        std::vector<float> l(c.vocab_size);
        EXPECT_EQ(glm_model_new_random(&c, seed, be, nullptr, &m, &e), MT_OK) << e.msg;
        EXPECT_EQ(glm_seq_new(m, 8, &s, &e), MT_OK);
        const int32_t toks[5] = {1, 2, 3, 4, 5};
        EXPECT_EQ(glm_prefill(m, s, toks, 5, l.data(), false, &e), MT_OK) << e.msg;
        glm_seq_free(s);
        glm_model_free(m);
        return l;
    };
    std::vector<float> a = logits(1), b = logits(1), d = logits(2);
    EXPECT_EQ(a, b);
    EXPECT_NE(a, d);
    for (float v : a) ASSERT_TRUE(std::isfinite(v));
    c.index_topk = 7;  // not a multiple of index_kpool
    glm_model *m = nullptr;
    EXPECT_EQ(glm_model_new_random(&c, 1, be, nullptr, &m, &err), MT_ERR_INVALID);
    EXPECT_NE(std::string(err.msg).find("index_topk"), std::string::npos) << err.msg;
    EXPECT_EQ(m, nullptr);
    mt_backend_free(be);
}

// The expert census (benchmarks' floors and routing figures): a batched step counts every (row,
// slot) pair of every MoE layer once, the touched count is the experts with a pair, and off it
// reports nothing.
TEST(ModelRandom, ExpertCensusCountsEveryPair) {
    mt_backend *be = mt_cpu_backend_new(0);
    glm_config c;
    mt_error err{};
    ASSERT_EQ(glm_config_preset("tiny", &c, &err), MT_OK) << err.msg;
    glm_model *m = nullptr;
    ASSERT_EQ(glm_model_new_random(&c, 3, be, nullptr, &m, &err), MT_OK) << err.msg;
    int moe_layers = 0;
    for (int l = 0; l < c.num_hidden_layers; l++) moe_layers += c.mlp_layer_types[l] == GLM_MLP_SPARSE;
    ASSERT_GT(moe_layers, 0);
    const int B = 5;
    glm_seq *s[B] = {};
    int32_t toks[B];
    for (int b = 0; b < B; b++) {
        const int32_t prompt[4] = {1 + b, 7 + 3 * b, 11, 2 + 5 * b};
        ASSERT_EQ(glm_seq_new(m, 16, &s[b], &err), MT_OK);
        ASSERT_EQ(glm_prefill(m, s[b], prompt, 4, nullptr, false, &err), MT_OK) << err.msg;
        toks[b] = (int32_t)(b * 13 + 1);
    }
    EXPECT_EQ(glm_model_expert_census(m), -1);
    EXPECT_EQ(glm_model_expert_census_pairs(m), nullptr);
    ASSERT_EQ(glm_model_set_expert_census(m, true), MT_OK);
    ASSERT_EQ(glm_decode_multi(m, s, toks, B, nullptr, &err), MT_OK) << err.msg;
    const int32_t *pairs = glm_model_expert_census_pairs(m);
    ASSERT_NE(pairs, nullptr);
    long sum = 0;
    int touched = 0;
    for (int l = 0; l < c.num_hidden_layers; l++)
        for (int e = 0; e < c.n_routed_experts; e++) {
            const int32_t v = pairs[(size_t)l * c.n_routed_experts + e];
            if (c.mlp_layer_types[l] != GLM_MLP_SPARSE) {
                EXPECT_EQ(v, 0) << "dense layer " << l;
            }
            EXPECT_LE(v, B) << "a row picks an expert once";  // distinct picks a row
            sum += v;
            touched += v > 0;
        }
    EXPECT_EQ(sum, (long)B * c.num_experts_per_tok * moe_layers);
    EXPECT_EQ(glm_model_expert_census(m), touched);
    EXPECT_GE(touched, c.num_experts_per_tok * moe_layers);
    // a second step counts afresh
    ASSERT_EQ(glm_decode_multi(m, s, toks, 2, nullptr, &err), MT_OK) << err.msg;
    sum = 0;
    for (int i = 0; i < c.num_hidden_layers * c.n_routed_experts; i++) sum += glm_model_expert_census_pairs(m)[i];
    EXPECT_EQ(sum, 2L * c.num_experts_per_tok * moe_layers);
    ASSERT_EQ(glm_model_set_expert_census(m, false), MT_OK);
    EXPECT_EQ(glm_model_expert_census(m), -1);
    for (glm_seq *q : s) glm_seq_free(q);
    glm_model_free(m);
    mt_backend_free(be);
}

// k rows of one sequence through the verify entry equal k single decodes, eagerly and in the graph
// form (positions read from backend memory, the path a captured graph takes, through the graph
// runner and its hooks).
class VerifyRows : public ::testing::TestWithParam<std::tuple<const char *, bool>> {};

TEST_P(VerifyRows, EqualKSingleDecodes) {
    const char *fixture = std::get<0>(GetParam());
    const bool device_positions = std::get<1>(GetParam());
    mt_backend *be = mt_cpu_backend_new(0);
    glm_model_params mp = glm_model_default_params();
    mp.device_positions = device_positions;
    glm_model *m = nullptr;
    mt_error err{};
    const std::string dir = std::string("tests/fixtures/") + fixture;
    ASSERT_EQ(glm_model_load(dir.c_str(), be, &mp, &m, &err), MT_OK) << err.msg;
    CheckVerifyEqualsSingles(m, (std::string(fixture) + (device_positions ? " (graph form)" : " (eager)")).c_str(), 1e-5);
    glm_model_free(m);
    mt_backend_free(be);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, VerifyRows,
                         ::testing::Combine(::testing::Values("tiny_a", "tiny_b", "tiny_c"), ::testing::Bool()));
