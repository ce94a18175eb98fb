// The tensor-parallel path on one GPU: the glm5_next model with a one-rank NCCL communicator, so
// every mixer's and MLP's partial sums go through ncclAllReduce on the backend's stream, eagerly
// and captured in the decode graphs. It must match the CPU backend as the plain GPU model does,
// give the plain GPU model's logits (a one-rank all-reduce is the identity) through one-sequence
// graphs, bucket graphs and the greedy chain run ahead, and pass the verify contract. Skips
// without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

extern "C" {
#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "worker/dist/comm_nccl.h"
#include "worker/model/glm/glm_model.h"
}

#include "tests/run_ahead_check.h"
#include "tests/verify_check.h"

namespace {

// The exact numerics mode (x in two 16-bit parts): these checks hold the GPU to the CPU's fp32 at
// the strict bar on random models, whose near-tied routing the default mode's rounding can flip.
mt_cuda_params ExactNumerics() {
    mt_cuda_params p = mt_cuda_default_params();
    p.numerics = MT_NUMERICS_EXACT;
    return p;
}
const mt_cuda_params kExact = ExactNumerics();

class TpOneGpu : public ::testing::TestWithParam<const char *> {
  protected:
    void SetUp() override {
        mt_error err{};
        gpu_ = mt_cuda_backend_new(0, &kExact, &err);
        if (!gpu_) GTEST_SKIP() << "no CUDA GPU on this host (" << err.msg << "); skipping";
        char hex[MT_COMM_NCCL_ID_HEX];
        mt_comm_nccl_id id;
        ASSERT_EQ(mt_comm_nccl_id_new(hex, sizeof hex, &err), MT_OK) << err.msg;
        ASSERT_EQ(mt_comm_nccl_id_parse(hex, &id, &err), MT_OK) << err.msg;
        comm_ = mt_comm_nccl_new(&id, 0, 1, gpu_, nullptr, &err);
        ASSERT_NE(comm_, nullptr) << err.msg;
        cpu_ = mt_cpu_backend_new(0);
    }
    void TearDown() override {
        mt_comm_free(comm_);
        mt_backend_free(gpu_);
        mt_backend_free(cpu_);
    }
    glm_model *Load(mt_backend *be, bool with_comm) {
        glm_model_params mp = glm_model_default_params();
        if (with_comm) mp.comm = comm_;
        glm_model *m = nullptr;
        mt_error err{};
        const std::string dir = std::string("tests/fixtures/") + GetParam();
        EXPECT_EQ(glm_model_load(dir.c_str(), be, &mp, &m, &err), MT_OK) << err.msg;
        return m;
    }
    mt_backend *gpu_ = nullptr, *cpu_ = nullptr;
    mt_comm *comm_ = nullptr;
};

// Prefill, then decode through the one-sequence graph, then batched steps of 1..5 sequences
// through the bucket graphs: logits of the model with the communicator, the plain GPU model and
// the CPU model side by side.
TEST_P(TpOneGpu, MatchesThePlainModelAndTheCpu) {
    glm_model *mt = Load(gpu_, true), *mg = Load(gpu_, false), *mc = Load(cpu_, false);
    ASSERT_TRUE(mt && mg && mc);
    const int V = glm_model_config(mt)->vocab_size, nq = 5;
    mt_error err{};
    glm_seq *st[nq], *sg[nq], *sc[nq];
    double worst_plain = 0, worst_cos = 1;
    size_t agree = 0, rows = 0;
    auto compare = [&](const std::vector<float> &a, const std::vector<float> &b, const std::vector<float> &c) {
        for (size_t r = 0; r < a.size() / V; r++) {
            double ab = 0, aa = 0, cc = 0;
            int ia = 0, ic = 0;
            for (int v = 0; v < V; v++) {
                const size_t k = r * V + v;
                worst_plain = std::fmax(worst_plain, std::fabs(a[k] - b[k]));
                ab += (double)a[k] * c[k];
                aa += (double)a[k] * a[k];
                cc += (double)c[k] * c[k];
                if (a[k] > a[r * V + ia]) ia = v;
                if (c[k] > c[r * V + ic]) ic = v;
            }
            worst_cos = std::fmin(worst_cos, ab / std::sqrt(aa * cc));
            agree += ia == ic;
            rows++;
        }
    };
    for (int q = 0; q < nq; q++) {
        std::vector<int32_t> p;
        for (int i = 0; i < 6 + 5 * q; i++) p.push_back((i * 31 + q * 7 + 3) % V);
        std::vector<float> lt(V), lg(V), lc(V);
        ASSERT_EQ(glm_seq_new(mt, 64, &st[q], &err), MT_OK);
        ASSERT_EQ(glm_seq_new(mg, 64, &sg[q], &err), MT_OK);
        ASSERT_EQ(glm_seq_new(mc, 64, &sc[q], &err), MT_OK);
        ASSERT_EQ(glm_prefill(mt, st[q], p.data(), (int)p.size(), lt.data(), false, &err), MT_OK) << err.msg;
        ASSERT_EQ(glm_prefill(mg, sg[q], p.data(), (int)p.size(), lg.data(), false, &err), MT_OK);
        ASSERT_EQ(glm_prefill(mc, sc[q], p.data(), (int)p.size(), lc.data(), false, &err), MT_OK);
        compare(lt, lg, lc);
        for (int t = 0; t < 4; t++) {  // the sequence's own graph: eager, captured, replayed
            const int32_t tok = glm_argmax(lc.data(), V);
            ASSERT_EQ(glm_decode(mt, st[q], tok, lt.data(), &err), MT_OK) << err.msg;
            ASSERT_EQ(glm_decode(mg, sg[q], tok, lg.data(), &err), MT_OK);
            ASSERT_EQ(glm_decode(mc, sc[q], tok, lc.data(), &err), MT_OK);
            compare(lt, lg, lc);
        }
    }
    for (int step = 0; step < 12; step++) {  // bucket graphs of 1, 2, 4, 8 rows
        const int n = 1 + step % nq;
        std::vector<int32_t> toks(n);
        for (int i = 0; i < n; i++) toks[i] = (step * 13 + i * 7) % V;
        std::vector<float> lt((size_t)n * V), lg((size_t)n * V), lc((size_t)n * V);
        ASSERT_EQ(glm_decode_multi(mt, st, toks.data(), n, lt.data(), &err), MT_OK) << err.msg;
        ASSERT_EQ(glm_decode_multi(mg, sg, toks.data(), n, lg.data(), &err), MT_OK);
        ASSERT_EQ(glm_decode_multi(mc, sc, toks.data(), n, lc.data(), &err), MT_OK);
        compare(lt, lg, lc);
    }
    EXPECT_TRUE(glm_model_has_bucket_graph(mt, 4)) << "the communicator's collectives must be captured";
    for (int q = 0; q < nq; q++) {
        glm_seq_free(st[q]);
        glm_seq_free(sg[q]);
        glm_seq_free(sc[q]);
    }
    printf("%s, one-rank NCCL: %zu rows, worst |diff| vs the plain GPU model %.2e, vs the CPU top-1 %.2f%%, worst "
           "cosine %.6f\n", GetParam(), rows, worst_plain, 100.0 * agree / rows, worst_cos);
    EXPECT_EQ(worst_plain, 0.0) << "a one-rank all-reduce must not change a value";
    EXPECT_GE((double)agree / rows, 0.99);
    EXPECT_GE(worst_cos, 0.999);
    glm_model_free(mt);
    glm_model_free(mg);
    glm_model_free(mc);
}

TEST_P(TpOneGpu, GreedyRunAheadAndVerify) {
    glm_model *m = Load(gpu_, true);
    ASSERT_NE(m, nullptr);
    CheckRunAhead(m, (std::string(GetParam()) + " (one-rank NCCL)").c_str(), true);
    CheckVerifyEqualsSingles(m, (std::string(GetParam()) + " (one-rank NCCL)").c_str(), 1e-3);
    glm_model_free(m);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, TpOneGpu, ::testing::Values("tiny_a", "tiny_b", "tiny_c"));

}  // namespace
