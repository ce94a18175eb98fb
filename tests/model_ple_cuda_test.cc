// tests/model_ple_cuda_test.cc: the tiny_ple fixture (PLE memories on layer 0, KDA, and layer 2,
// DSA with a shared indexer) on the CUDA backend, in the exact numerics mode, against the CPU
// backend and the reference of tests/oracle/make_ple_fixture.py:
//   - each memory alone against the reference (2e-3, the CPU test's bar), in one pass and as a
//     prefill followed by prestaged and hashed decode rows (host gather, table on the device) or
//     hashed rows (the defaults: the table in page-locked host memory);
//   - greedy decode run ahead of the host with bucket graphs (hash and gather on the device)
//     against the host-prestage path and the CPU, token for token, and the run-ahead contract;
//   - teacher-forced logits: at every position max |gpu - cpu| <= 2e-3 x max |cpu|, top-1 agreement
//     >= 99% and cosine >= 0.999 (docs/DESIGN.md "Numerics");
//   - greedy generation of 32 tokens identical to the CPU's, one sequence with decode graphs on
//     (its own graph captured and replayed) and off;
//   - batched decode whose batch changes (members leave, come back, change order) while the
//     bucket graphs replay, each sequence's tokens identical to its CPU greedy run;
//   - the contracts the GPU model tests hold every model to: verify rows equal single decodes
//     (graphs on and off), a mixed step equals its parts run alone;
//   - the engine on the GPU: a prefix hit and preempted, re-prefilled sequences give the tokens of
//     plain greedy runs (the memories' history and conv state move only as aux state);
//   - speculative decoding on a random tiny-ple model with an MTP block: a verify's kept rows
//     continue as a step of them (verify graphs, prestaged rows), and the engine's greedy output
//     with K = 1..3 (free, forced acceptance, forced rejection) is K = 0's, itself the CPU's.
// Skips without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

extern "C" {
#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "worker/engine/engine.h"
#include "worker/loader/glm_config.h"
#include "worker/loader/safetensors.h"
#include "worker/model/glm/glm_model.h"
#include "worker/model/layer.h"
}

#include "tests/cuda_test_util.h"
#include "tests/mixed_check.h"
#include "tests/run_ahead_check.h"
#include "tests/spec_engine_run.h"
#include "tests/teacher_forced.h"
#include "tests/verify_check.h"

namespace {

const char *kDir = "tests/fixtures/tiny_ple";
const int kPle[2] = { 0, 2 };
const mt_cuda_params kExact = ExactParams();

std::vector<float> Floats(st_archive *ar, const std::string &name) {
    const st_tensor *t = st_find(ar, name.c_str());
    EXPECT_NE(t, nullptr) << name;
    if (!t) return {};
    const float *p = static_cast<const float *>(t->data);
    return std::vector<float>(p, p + t->nbytes / sizeof(float));
}

// tiny_ple's vocabulary is 256.
std::vector<int32_t> Prompt(int n, int salt) {
    std::vector<int32_t> p;
    for (int i = 0; i < n; i++) p.push_back((i * 37 + salt * 101 + 7) % 256);
    return p;
}

// The margin of a greedy choice: the gap between the largest two logits over the largest |logit|.
// Runs compared token for token with the CPU's need the CPU's margins well above the GPU's error
// (~1e-5 of the scale in the exact mode): prompts whose CPU run has a near tie are not used.
constexpr double kMinMargin = 1e-4;

double Margin(const float *l, int V) {
    float a = -INFINITY, b = -INFINITY, scale = 0;
    for (int v = 0; v < V; v++) {
        if (l[v] > a) {
            b = a;
            a = l[v];
        } else if (l[v] > b) {
            b = l[v];
        }
        scale = std::max(scale, std::fabs(l[v]));
    }
    return (a - b) / scale;
}

// Prefill, then n greedy tokens decoded one at a time (the sequence's own graph form when the
// backend captures and graphs are on). *graphs: whether the last step replayed a graph;
// *margin: the smallest margin of the n choices.
std::vector<int32_t> Greedy(glm_model *m, const std::vector<int32_t> &prompt, int n, bool *graphs = nullptr,
                            double *margin = nullptr) {
    const int V = glm_model_config(m)->vocab_size;
    glm_seq *s = nullptr;
    mt_error err{};
    EXPECT_EQ(glm_seq_new(m, (int)prompt.size() + n, &s, &err), MT_OK) << err.msg;
    if (!s) return {};
    std::vector<float> l(V);
    EXPECT_EQ(glm_prefill(m, s, prompt.data(), (int)prompt.size(), l.data(), false, &err), MT_OK) << err.msg;
    std::vector<int32_t> out;
    if (margin) *margin = INFINITY;
    for (int i = 0; i < n; i++) {
        out.push_back(glm_argmax(l.data(), V));
        if (margin) *margin = std::min(*margin, Margin(l.data(), V));
        if (i + 1 < n) {
            EXPECT_EQ(glm_decode(m, s, out.back(), l.data(), &err), MT_OK) << err.msg;
        }
    }
    if (graphs) *graphs = glm_seq_has_graph(s);
    glm_seq_free(s);
    return out;
}

class PleCuda : public ::testing::Test {
  protected:
    void SetUp() override {
        std::string why = NoGpuReason();
        if (!why.empty()) GTEST_SKIP() << "no CUDA GPU on this host (" << why << "); skipping";
        mt_error err{};
        gpu_ = mt_cuda_backend_new(0, &kExact, &err);
        ASSERT_NE(gpu_, nullptr) << "mt_cuda_backend_new: " << err.msg;
        cpu_ = mt_cpu_backend_new(0);
        ASSERT_EQ(glm_model_load(kDir, gpu_, nullptr, &mg_, &err), MT_OK) << err.msg;
        glm_model_params hp = glm_model_default_params();  // the host path: hashed on the host, table on the device
        hp.ple_host_gather = true;
        hp.ple_table_device = true;
        ASSERT_EQ(glm_model_load(kDir, gpu_, &hp, &mh_, &err), MT_OK) << err.msg;
        ASSERT_EQ(glm_model_load(kDir, cpu_, nullptr, &mc_, &err), MT_OK) << err.msg;
        V_ = glm_model_config(mc_)->vocab_size;
        SH_ = glm_model_config(mc_)->hc_mult * glm_model_config(mc_)->hidden_size;
    }
    void TearDown() override {
        glm_model_free(mg_);
        glm_model_free(mh_);
        glm_model_free(mc_);
        mt_backend_free(gpu_);
        mt_backend_free(cpu_);
    }
    mt_backend *gpu_ = nullptr, *cpu_ = nullptr;
    // mg_: the defaults (tables in page-locked host memory, decode rows hashed on the device);
    // mh_: tables on the device, every row hashed on the host (the prestage path)
    glm_model *mg_ = nullptr, *mh_ = nullptr, *mc_ = nullptr;
    int V_ = 0, SH_ = 0;
};

TEST_F(PleCuda, MemoryMatchesReference) {
    st_archive *ar = nullptr;
    mt_error err{};
    ASSERT_EQ(st_open_file((std::string(kDir) + "/ple_case.safetensors").c_str(), &ar, &err), MT_OK) << err.msg;
    const st_tensor *t = st_find(ar, "tokens");
    ASSERT_NE(t, nullptr);
    const int32_t *tp = static_cast<const int32_t *>(t->data);
    const std::vector<int32_t> tokens(tp, tp + t->shape[0]);
    const int T = (int)tokens.size();
    for (int i = 0; i < 4; i++) {
        // the host-gathering model with prestaged rows, then the default one (host-mapped table)
        glm_model *m = i < 2 ? mh_ : mg_;
        const int li = kPle[i % 2];
        const std::vector<float> x = Floats(ar, "x_" + std::to_string(li)), want = Floats(ar, "out_" + std::to_string(li));
        const mt_layer *l = glm_model_layer(m, li);
        // rows [t0, t0 + n) through s; staged: the rows prestaged for them
        auto rows = [&](glm_seq *s, int t0, int n, bool staged) {
            std::vector<float> X(x.begin() + (size_t)t0 * SH_, x.begin() + (size_t)(t0 + n) * SH_);
            EXPECT_EQ(glm_model_ple_apply(m, s, li, staged ? nullptr : &tokens[t0], X.data(), n), MT_OK);
            double worst = 0;
            for (size_t k = 0; k < X.size(); k++) worst = std::max(worst, (double)std::fabs(X[k] - want[(size_t)t0 * SH_ + k]));
            return worst;
        };
        glm_seq *one = nullptr, *split = nullptr;
        ASSERT_EQ(glm_seq_new(m, 96, &one, &err), MT_OK) << err.msg;
        ASSERT_EQ(glm_seq_new(m, 96, &split, &err), MT_OK) << err.msg;
        const double w_one = rows(one, 0, T, false);
        double w_split = rows(split, 0, 7, false);
        for (int tt = 7; tt < T; tt++) {
            const bool staged = m == mh_ && tt % 2 == 1;
            if (staged) {
                EXPECT_EQ(mt_layer_decode_prestage(l, glm_seq_state(split, li), tokens[tt]), MT_OK);
            }
            w_split = std::max(w_split, rows(split, tt, 1, staged));
        }
        printf("layer %d (%s): worst |gpu - reference| %.2e in one pass, %.2e split\n", li,
               m == mh_ ? "host gather" : "host-mapped table", w_one, w_split);
        EXPECT_LE(w_one, 2e-3) << "layer " << li;
        EXPECT_LE(w_split, 2e-3) << "layer " << li;
        glm_seq_free(one);
        glm_seq_free(split);
    }
    st_close(ar);
}

TEST_F(PleCuda, TeacherForcedLogitsMatchCpu) {
    std::vector<int32_t> toks = Prompt(90, 3);
    const std::vector<float> g = TeacherForced(mg_, toks), c = TeacherForced(mc_, toks);
    ASSERT_EQ(g.size(), c.size());
    const size_t T = toks.size();
    size_t agree = 0;
    double worst_rel = 0, worst_cos = 1;
    for (size_t t = 0; t < T; t++) {
        const float *a = g.data() + t * V_, *b = c.data() + t * V_;
        double diff = 0, scale = 0, ab = 0, aa = 0, bb = 0;
        for (int v = 0; v < V_; v++) {
            diff = std::max(diff, (double)std::fabs(a[v] - b[v]));
            scale = std::max(scale, (double)std::fabs(b[v]));
            ab += (double)a[v] * b[v];
            aa += (double)a[v] * a[v];
            bb += (double)b[v] * b[v];
        }
        worst_rel = std::max(worst_rel, diff / scale);
        worst_cos = std::min(worst_cos, ab / std::sqrt(aa * bb));
        agree += glm_argmax(a, V_) == glm_argmax(b, V_);
    }
    printf("tiny_ple teacher-forced, %zu positions: worst max|diff| / max|cpu| %.2e, top-1 %.2f%%, worst cosine %.6f\n", T,
           worst_rel, 100.0 * agree / T, worst_cos);
    EXPECT_LE(worst_rel, 2e-3);
    EXPECT_GE((double)agree / T, 0.99);
    EXPECT_GE(worst_cos, 0.999);
}

TEST_F(PleCuda, GreedyMatchesCpuWithGraphsOnAndOff) {
    for (int salt : { 1, 3 }) {
        const std::vector<int32_t> prompt = Prompt(20 + 13 * salt, salt);
        double margin = 0;
        const std::vector<int32_t> want = Greedy(mc_, prompt, 32, nullptr, &margin);
        ASSERT_GE(margin, kMinMargin) << "prompt " << salt << ": a near tie on the CPU";
        bool graphs = false;
        glm_model_set_decode_graphs(mg_, true);
        EXPECT_EQ(Greedy(mg_, prompt, 32, &graphs), want) << "graphs on, prompt " << salt;
        EXPECT_TRUE(graphs) << "the sequence's decode graph was captured and replayed";
        glm_model_set_decode_graphs(mg_, false);
        EXPECT_EQ(Greedy(mg_, prompt, 32, &graphs), want) << "graphs off, prompt " << salt;
        EXPECT_FALSE(graphs);
    }
}

// Four sequences decoded in batched steps whose members change: all four (bucket 4), then three
// in another order (bucket 4 with a pad row), then two (bucket 2), then all four again. Each
// sequence's tokens equal its CPU greedy run, and the bucket graphs were replayed.
TEST_F(PleCuda, BatchedDecodeWithChangingMembersMatchesCpu) {
    const int n = 4, phase = 8;
    const std::vector<std::vector<int>> order = { { 0, 1, 2, 3 }, { 3, 0, 2 }, { 1, 3 }, { 2, 1, 0, 3 } };
    std::vector<int> steps(n, 0);
    for (const auto &o : order)
        for (int i : o) steps[i] += phase;
    std::vector<std::vector<int32_t>> prompts, want;
    for (int i = 0; i < n; i++) {
        prompts.push_back(Prompt(9 + 7 * i, 10 + i));
        double margin = 0;
        want.push_back(Greedy(mc_, prompts[i], steps[i] + 1, nullptr, &margin));
        ASSERT_GE(margin, kMinMargin) << "sequence " << i << ": a near tie on the CPU";
    }
    glm_model_set_decode_graphs(mg_, true);
    glm_seq *seq[n];
    std::vector<std::vector<int32_t>> got(n);
    mt_error err{};
    std::vector<float> l((size_t)n * V_);
    for (int i = 0; i < n; i++) {
        ASSERT_EQ(glm_seq_new(mg_, (int)prompts[i].size() + steps[i] + 1, &seq[i], &err), MT_OK) << err.msg;
        ASSERT_EQ(glm_prefill(mg_, seq[i], prompts[i].data(), (int)prompts[i].size(), l.data(), false, &err), MT_OK)
            << err.msg;
        got[i].push_back(glm_argmax(l.data(), V_));
    }
    bool replayed = false;
    for (const auto &o : order) {
        for (int k = 0; k < phase; k++) {
            replayed = replayed || glm_model_has_bucket_graph(mg_, (int)o.size());
            std::vector<glm_seq *> b;
            std::vector<int32_t> tok;
            for (int i : o) {
                b.push_back(seq[i]);
                tok.push_back(got[i].back());
            }
            ASSERT_EQ(glm_decode_multi(mg_, b.data(), tok.data(), (int)o.size(), l.data(), &err), MT_OK) << err.msg;
            for (size_t r = 0; r < o.size(); r++) got[o[r]].push_back(glm_argmax(l.data() + r * V_, V_));
        }
    }
    for (int i = 0; i < n; i++) {
        EXPECT_EQ(got[i], want[i]) << "sequence " << i;
        glm_seq_free(seq[i]);
    }
    EXPECT_TRUE(replayed) << "no bucket graph was replayed";
}

// Greedy decode runs ahead of the host with the bucket graphs (each step's ids only on the
// device, hashed and gathered there from the host-mapped table): the run-ahead contract, then
// three sequences for 24 steps against the host path (every row prestaged on the host, bucket
// graphs) and the CPU's greedy runs, token for token.
TEST_F(PleCuda, RunAheadWithGraphsMatchesHostPathAndCpu) {
    glm_model_set_decode_graphs(mg_, true);
    glm_model_set_decode_graphs(mh_, true);
    ASSERT_GE(glm_model_ahead_rows(mg_), 3);
    EXPECT_EQ(glm_model_ahead_rows(mh_), 0);
    CheckRunAhead(mg_, "tiny_ple (GPU, device gather, graphs)", true);
    const int n = 3, steps = 24;
    std::vector<std::vector<int32_t>> prompts, want(n), got_g(n), got_h(n);
    for (int i = 0; i < n; i++) {
        prompts.push_back(Prompt(11 + 9 * i, 20 + i));
        double margin = 0;
        want[i] = Greedy(mc_, prompts[i], steps + 1, nullptr, &margin);
        ASSERT_GE(margin, kMinMargin) << "sequence " << i << ": a near tie on the CPU";
    }
    mt_error err{};
    glm_seq *sg[n], *sh[n];
    std::vector<float> l((size_t)n * V_);
    std::vector<int32_t> tg(n), th(n);
    for (int i = 0; i < n; i++) {
        const int cap = (int)prompts[i].size() + steps + 1;
        ASSERT_EQ(glm_seq_new(mg_, cap, &sg[i], &err), MT_OK) << err.msg;
        ASSERT_EQ(glm_seq_new(mh_, cap, &sh[i], &err), MT_OK) << err.msg;
        ASSERT_EQ(glm_prefill(mg_, sg[i], prompts[i].data(), (int)prompts[i].size(), l.data(), false, &err), MT_OK);
        got_g[i].push_back(tg[i] = glm_argmax(l.data(), V_));
        ASSERT_EQ(glm_prefill(mh_, sh[i], prompts[i].data(), (int)prompts[i].size(), l.data(), false, &err), MT_OK);
        got_h[i].push_back(th[i] = glm_argmax(l.data(), V_));
    }
    int64_t prev = -1;
    for (int t = 0; t < steps; t++) {
        int64_t ticket = -1;
        ASSERT_EQ(glm_decode_greedy(mg_, sg, t == 0 ? tg.data() : nullptr, n, &ticket, &err), MT_OK) << err.msg;
        if (t > 0) {  // step t - 1's tokens, read after step t was queued
            ASSERT_EQ(glm_greedy_tokens(mg_, prev, tg.data(), n), MT_OK);
            for (int i = 0; i < n; i++) got_g[i].push_back(tg[i]);
        }
        prev = ticket;
        ASSERT_EQ(glm_decode_multi(mh_, sh, th.data(), n, l.data(), &err), MT_OK) << err.msg;
        for (int i = 0; i < n; i++) got_h[i].push_back(th[i] = glm_argmax(l.data() + (size_t)i * V_, V_));
    }
    ASSERT_EQ(glm_greedy_tokens(mg_, prev, tg.data(), n), MT_OK);
    for (int i = 0; i < n; i++) got_g[i].push_back(tg[i]);
    EXPECT_TRUE(glm_model_has_bucket_graph(mg_, n)) << "the run-ahead steps replayed no bucket graph";
    EXPECT_TRUE(glm_model_has_bucket_graph(mh_, n)) << "the host path replayed no bucket graph";
    for (int i = 0; i < n; i++) {
        EXPECT_EQ(got_g[i], want[i]) << "run ahead, sequence " << i;
        EXPECT_EQ(got_h[i], want[i]) << "host path, sequence " << i;
        glm_seq_free(sg[i]);
        glm_seq_free(sh[i]);
    }
}

// k rows of one sequence through the verify entry (a graph per width, replayed on its third use)
// equal k single decodes, graphs on and off.
TEST_F(PleCuda, VerifyRowsEqualKSingleDecodes) {
    for (bool graphs : { true, false }) {
        glm_model_set_decode_graphs(mg_, graphs);
        CheckVerifyEqualsSingles(mg_, graphs ? "tiny_ple (GPU, graphs)" : "tiny_ple (GPU, eager)", 1e-3);
    }
}

// The decode row of a mixed step hashes its id and goes through the rows form's mixers beside the
// prompt chunks; the same work part by part gives the same logits.
TEST_F(PleCuda, MixedStepEqualsPartByPart) { CheckMixedStep(mg_, "tiny_ple (GPU, exact)", 1e-3); }

// A prefix copied into a fresh sequence on the GPU decodes as the sequence it came from.
TEST_F(PleCuda, CopiedPrefixDecodesAsTheOriginal) {
    const std::vector<int32_t> prompt = Prompt(70, 5);
    glm_seq *a = nullptr, *b = nullptr;
    mt_error err{};
    ASSERT_EQ(glm_seq_new(mg_, 96, &a, &err), MT_OK) << err.msg;
    ASSERT_EQ(glm_seq_new(mg_, 96, &b, &err), MT_OK) << err.msg;
    std::vector<float> la(V_), lb(V_);
    ASSERT_EQ(glm_prefill(mg_, a, prompt.data(), (int)prompt.size(), la.data(), false, &err), MT_OK) << err.msg;
    ASSERT_EQ(glm_seq_copy_prefix(mg_, a, b, &err), MT_OK) << err.msg;
    for (int i = 0; i < 12; i++) {
        const int32_t tok = glm_argmax(la.data(), V_);
        ASSERT_EQ(glm_decode(mg_, a, tok, la.data(), &err), MT_OK) << err.msg;
        ASSERT_EQ(glm_decode(mg_, b, tok, lb.data(), &err), MT_OK) << err.msg;
        double worst = 0;
        for (int v = 0; v < V_; v++) worst = std::max(worst, (double)std::fabs(la[v] - lb[v]));
        EXPECT_LE(worst, 1e-5) << "step " << i;
    }
    glm_seq_free(a);
    glm_seq_free(b);
}

// The engine over the GPU model: each request's tokens by id.
struct EngineRun {
    std::map<uint64_t, std::vector<int32_t>> out;
    eng_stats st = {};
};

EngineRun RunEngine(glm_model *m, const eng_params &p, const std::vector<std::vector<int32_t>> &prompts, int new_tokens,
                    bool one_by_one) {
    EngineRun r;
    eng_callbacks cb = {};
    cb.user = &r;
    cb.on_tokens = [](void *u, uint64_t id, const eng_sample_result *t, int n) {
        for (int i = 0; i < n; i++) static_cast<EngineRun *>(u)->out[id].push_back(t[i].token);
    };
    eng_engine *e = nullptr;
    mt_error err{};
    EXPECT_EQ(eng_new(glm_model_as_model(m), &p, &cb, &e, &err), MT_OK) << err.msg;
    if (!e) return r;
    for (size_t i = 0; i < prompts.size(); i++) {
        eng_request q = eng_default_request();
        q.prompt = prompts[i].data();
        q.n_prompt = (int)prompts[i].size();
        q.max_new_tokens = new_tokens;
        q.ignore_eos = true;
        EXPECT_EQ(eng_submit(e, i + 1, &q, 0, &err), MT_OK) << err.msg;
        for (int steps = 0; one_by_one && eng_has_work(e) && steps < 5000; steps++) EXPECT_EQ(eng_step(e, nullptr), MT_OK);
    }
    for (int steps = 0; eng_has_work(e) && steps < 5000; steps++) EXPECT_EQ(eng_step(e, nullptr), MT_OK);
    EXPECT_FALSE(eng_has_work(e));
    eng_get_stats(e, &r.st);
    eng_free(e);
    return r;
}

TEST_F(PleCuda, EnginePrefixReuseAndPreemptionMatchCpu) {
    // a prefix hit: b shares a's first 100 tokens (a kept prefix at 64)
    std::vector<int32_t> a = Prompt(100, 42), b = a;
    for (int i = 0; i < 10; i++) a.push_back((i * 13 + 1) % 250);
    for (int i = 0; i < 7; i++) b.push_back((i * 29 + 5) % 250);
    {
        const EngineRun r = RunEngine(mg_, eng_default_params(), { a, b }, 12, true);
        EXPECT_EQ(r.st.prefix_hits, 1u);
        double ma = 0, mb = 0;
        EXPECT_EQ(r.out.at(1), Greedy(mc_, a, 12, nullptr, &ma));
        EXPECT_EQ(r.out.at(2), Greedy(mc_, b, 12, nullptr, &mb));
        EXPECT_GE(std::min(ma, mb), kMinMargin) << "a near tie on the CPU";
    }
    // preemption: 6 requests of 40 + 60 tokens over 4 running in 5 pages of 64 positions (the
    // graph pad holds one), re-prefilled from their prompt and generated tokens
    const int n_req = 6, new_tokens = 60;
    std::vector<std::vector<int32_t>> prompts;
    for (int id = 1; id <= n_req; id++) prompts.push_back(Prompt(40, id));
    mt_error err{};
    ASSERT_EQ(glm_model_set_pools(mg_, 5, 8, &err), MT_OK) << err.msg;
    eng_params p = eng_default_params();
    p.prefix_cache_bytes = 0;
    p.max_sequences = 4;
    const EngineRun r = RunEngine(mg_, p, prompts, new_tokens, false);
    for (int id = 1; id <= n_req; id++) {
        double margin = 0;
        EXPECT_EQ(r.out.at(id), Greedy(mc_, prompts[id - 1], new_tokens, nullptr, &margin)) << "request " << id;
        EXPECT_GE(margin, kMinMargin) << "request " << id << ": a near tie on the CPU";
    }
    EXPECT_GT(r.st.preemptions, 0u);
    printf("engine on the GPU: %llu preemptions\n", (unsigned long long)r.st.preemptions);
}

// ---- speculative decoding with memories on the GPU ----

// A random tiny-ple model (vocabulary 300) with an MTP block, the same weights on both backends
// (random weights are drawn from the seed and the tensor's name), its drafter on.
class PleSpecCuda : public ::testing::Test {
  protected:
    void SetUp() override {
        std::string why = NoGpuReason();
        if (!why.empty()) GTEST_SKIP() << "no CUDA GPU on this host (" << why << "); skipping";
        mt_error err{};
        gpu_ = mt_cuda_backend_new(0, &kExact, &err);
        ASSERT_NE(gpu_, nullptr) << "mt_cuda_backend_new: " << err.msg;
        cpu_ = mt_cpu_backend_new(0);
        glm_config c;
        ASSERT_EQ(glm_config_preset("tiny-ple", &c, &err), MT_OK) << err.msg;
        c.vocab_size = V_;
        c.num_nextn_predict_layers = 1;
        glm_model_params p = glm_model_default_params();
        p.mtp = true;
        p.verify_seqs = 3;
        ASSERT_EQ(glm_model_new_random(&c, 5, gpu_, &p, &mg_, &err), MT_OK) << err.msg;
        ASSERT_EQ(glm_model_new_random(&c, 5, cpu_, &p, &mc_, &err), MT_OK) << err.msg;
    }
    void TearDown() override {
        glm_model_free(mg_);
        glm_model_free(mc_);
        mt_backend_free(gpu_);
        mt_backend_free(cpu_);
    }
    static constexpr int V_ = 300;
    mt_backend *gpu_ = nullptr, *cpu_ = nullptr;
    glm_model *mg_ = nullptr, *mc_ = nullptr;
};

// A verify of 4 rows (its graph captured on the second use, each row prestaged) keeping 1..4,
// twice, against a twin that decoded only the kept rows: the next steps agree within 1e-4.
TEST_F(PleSpecCuda, KeptRowsContinueAsAStepOfThem) {
    std::vector<int32_t> prompt;
    for (int i = 0; i < 40; i++) prompt.push_back((i * 37 + 5) % V_);
    const int32_t tok[4] = { 11, 22, 33, 44 };
    for (int round = 0; round < 2; round++) {
        for (int keep = 1; keep <= 4; keep++) {
            glm_seq *a = nullptr, *b = nullptr;
            mt_error err{};
            ASSERT_EQ(glm_seq_new(mg_, 64, &a, &err), MT_OK) << err.msg;
            ASSERT_EQ(glm_seq_new(mg_, 64, &b, &err), MT_OK) << err.msg;
            ASSERT_EQ(glm_prefill(mg_, a, prompt.data(), 30 + keep, nullptr, false, &err), MT_OK) << err.msg;
            ASSERT_EQ(glm_prefill(mg_, b, prompt.data(), 30 + keep, nullptr, false, &err), MT_OK) << err.msg;
            std::vector<float> la(V_), lb(V_);
            ASSERT_EQ(glm_model_draft(mg_, a, tok[0], la.data(), &err), MT_OK) << err.msg;
            ASSERT_EQ(glm_decode_verify(mg_, a, tok, 4, nullptr, &err), MT_OK) << err.msg;
            ASSERT_EQ(glm_seq_keep(mg_, a, keep, &err), MT_OK) << err.msg;
            ASSERT_EQ(glm_decode_verify(mg_, b, tok, keep, nullptr, &err), MT_OK) << err.msg;
            for (int step = 0; step < 3; step++) {
                const int32_t next = (step * 13 + keep) % V_;
                ASSERT_EQ(glm_decode(mg_, a, next, la.data(), &err), MT_OK) << err.msg;
                ASSERT_EQ(glm_decode(mg_, b, next, lb.data(), &err), MT_OK) << err.msg;
                float d = 0, mx = 0;
                for (int v = 0; v < V_; v++) {
                    d = std::max(d, std::fabs(la[v] - lb[v]));
                    mx = std::max(mx, std::fabs(lb[v]));
                }
                EXPECT_LE(d, 1e-4f * mx) << "round " << round << " keep " << keep << " step " << step;
            }
            glm_seq_free(a);
            glm_seq_free(b);
        }
    }
}

std::vector<int32_t> SpecPrompt(int r) {
    std::vector<int32_t> pr;
    for (int i = 0; i < 8 + 5 * r; i++) pr.push_back((r * 101 + i * 13 + 7) % 300);
    return pr;
}

SpecRun GenerateSpec(glm_model *m, int k, int batch, Force force, const SpecRun *ref, int new_tokens) {
    eng_params p = eng_default_params();
    p.max_sequences = batch;
    std::vector<SpecRequest> reqs;
    for (int r = 0; r < batch; r++) {
        SpecRequest q;
        q.prompt = SpecPrompt(r);
        q.max_new = new_tokens;
        reqs.push_back(q);
    }
    return RunSpec(m, p, k, reqs, force, ref);
}

// The engine on the GPU (verify graphs, the verifies of several sequences in one mixed pass):
// greedy with K = 1..3, drafts as they come, all accepted or all rejected, gives K = 0's tokens,
// and those are the CPU's greedy run's; requests whose CPU run has a near tie (where the verify's
// and a single row's last-bit differences may choose otherwise) are left out.
TEST_F(PleSpecCuda, EngineGreedyEqualsNoSpeculationAndCpu) {
    const int new_tokens = 48;
    std::map<uint64_t, std::vector<int32_t>> cpu;  // the requests with margins, by id
    for (int r = 0; r < 6; r++) {
        double margin = 0;
        std::vector<int32_t> t = Greedy(mc_, SpecPrompt(r), new_tokens, nullptr, &margin);
        if (margin >= kMinMargin) cpu[(uint64_t)r + 1] = t;
    }
    ASSERT_GE(cpu.size(), 3u) << "too few prompts without near ties on the CPU";
    for (int batch : { 1, 6 }) {
        const SpecRun ref = GenerateSpec(mg_, 0, batch, Force::kNone, nullptr, new_tokens);
        for (const auto &[id, t] : ref.out) {
            if (cpu.count(id)) {
                EXPECT_EQ(t.tokens, cpu.at(id)) << "K 0 against the CPU, batch " << batch << " id " << id;
            }
        }
        for (int k = 1; k <= 3; k++)
            for (Force force : { Force::kNone, Force::kAccept, Force::kReject }) {
                const SpecRun g = GenerateSpec(mg_, k, batch, force, &ref, new_tokens);
                const std::string what = "batch " + std::to_string(batch) + " K " + std::to_string(k) + " force " +
                                         std::to_string((int)force);
                for (const auto &[id, t] : ref.out) {
                    if (cpu.count(id)) {
                        EXPECT_EQ(g.out.at(id).tokens, t.tokens) << what << " id " << id;
                    }
                }
                ExpectSpecCounts(g, force, what);
            }
    }
}

}  // namespace
