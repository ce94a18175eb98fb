// The benchmarks' byte accounting (bench/bench_util.h), on the host: the split/replicated
// breakdown must match what a tensor-parallel rank of the model really loads (glm_model_load_bytes
// of the fixture checkpoints, at 2 and 4 ranks), and the per-rank floor at one rank must be,
// to the bit, the floor the benchmarks computed before they knew of ranks.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>

extern "C" {
#include "bench/bench_util.h"
#include "kernels/backend.h"
#include "worker/dist/comm_host.h"
#include "worker/loader/glm_config.h"
#include "worker/model/glm/glm_model.h"
}

namespace {

// The floors as decode_bench and batch_bench wrote them before --tp.
double KdaStateBefore(const glm_config &c) {
    int n_kda = 0;
    for (int l = 0; l < c.num_hidden_layers; l++) n_kda += c.layer_types[l] == GLM_MIXER_KDA;
    return 2.0 * n_kda * c.linear_num_heads * (double)c.linear_head_dim * c.linear_head_dim * 4;
}

double DecodeBenchBefore(const glm_config &c, const bench_weights &bc) {
    int n_moe = 0;
    for (int l = 0; l < c.num_hidden_layers; l++) n_moe += c.mlp_layer_types[l] == GLM_MLP_SPARSE;
    const double weights = bc.dense_bytes + bc.embed_row_bytes + (double)n_moe * c.num_experts_per_tok * bc.expert_bytes;
    return weights + KdaStateBefore(c);
}

double BatchBenchBefore(const glm_config *c, const bench_weights *w, int B, double touched, int len) {
    double kda = 0, dsa = 0;
    const int max_sel = c->index_topk + (c->index_kpool_always_select_tail ? c->index_kpool - 1 : 0);
    for (int l = 0; l < c->num_hidden_layers; l++) {
        if (c->layer_types[l] == GLM_MIXER_KDA) {
            kda += 2.0 * c->linear_num_heads * (double)c->linear_head_dim * c->linear_head_dim * 4;
        } else {
            const int rows = len + 1 < max_sel ? len + 1 : max_sel;
            dsa += (double)rows * c->kv_lora_rank * 4;
            if (c->indexer_types[l] == GLM_INDEXER_FULL)
                dsa += (double)((len + 1) / c->index_kpool) * c->index_head_dim * 4;
        }
    }
    return w->dense_bytes + B * w->embed_row_bytes + touched * w->expert_bytes + B * (kda + dsa);
}

TEST(BenchFloor, OneRankIsTheWholeModelsFloorExactly) {
    for (const char *preset : {"bench-4L", "tiny", "test-wide"}) {
        glm_config c;
        mt_error err{};
        ASSERT_EQ(glm_config_preset(preset, &c, &err), MT_OK) << err.msg;
        bench_weights w;
        bench_count_weights(&c, &w);
        EXPECT_EQ(w.dense_split_bytes + w.dense_repl_bytes, w.dense_bytes) << preset;
        EXPECT_GT(w.dense_split_bytes, 0) << preset;
        EXPECT_GT(w.dense_repl_bytes, 0) << preset;
        EXPECT_EQ(bench_kda_state_bytes(&c), KdaStateBefore(c)) << preset;
        int n_moe = 0;
        for (int l = 0; l < c.num_hidden_layers; l++) n_moe += c.mlp_layer_types[l] == GLM_MLP_SPARSE;
        const double experts = (double)n_moe * c.num_experts_per_tok;
        EXPECT_EQ(bench_rank_step_bytes(&w, 1, 1, experts, bench_kda_state_bytes(&c), 0), DecodeBenchBefore(c, w))
            << preset;
        for (int B : {1, 8, 32, 64, 128})
            for (int len : {0, 100, 307, 5000}) {
                const double touched = 7.0 * B + 3;
                EXPECT_EQ(bench_rank_step_bytes(&w, 1, B, touched, bench_kda_state_bytes(&c), bench_dsa_cache_bytes(&c, len)),
                          BatchBenchBefore(&c, &w, B, touched, len))
                    << preset << " B " << B << " len " << len;
            }
    }
}

// N ranks: the split terms shrink N times, the replicated ones and the DSA cache do not.
TEST(BenchFloor, ARankReadsItsShareOfTheSplitBytes) {
    glm_config c;
    mt_error err{};
    ASSERT_EQ(glm_config_preset("bench-4L", &c, &err), MT_OK) << err.msg;
    bench_weights w;
    bench_count_weights(&c, &w);
    const double kda = bench_kda_state_bytes(&c), dsa = bench_dsa_cache_bytes(&c, 300);
    for (int N : {2, 4, 8}) {
        const double got = bench_rank_step_bytes(&w, N, 16, 100, kda, dsa);
        const double want = w.dense_repl_bytes + 16 * dsa +
                            (w.dense_split_bytes + 16 * w.embed_row_bytes + 100 * w.expert_bytes + 16 * kda) / N;
        EXPECT_NEAR(got, want, 1e-6 * want) << N;
    }
}

// The breakdown against a rank's real load: glm_model_load_bytes counts what the loader split
// and what it kept whole (on more than one rank; one rank splits nothing). The group is one
// process's host communicator made to look like rank 0 of N, as loading makes no collective call.
TEST(BenchWeights, SplitAndReplicatedMatchARanksLoad) {
    for (const char *fixture : {"tiny_a", "tiny_b", "tiny_c"}) {
        for (int N : {2, 4}) {
            mt_error err{};
            const std::string group = "mt_bench_util_" + std::to_string(std::random_device{}());
            mt_comm *comm = mt_comm_host_new(group.c_str(), 0, 1, nullptr, &err);
            ASSERT_NE(comm, nullptr) << err.msg;
            comm->size = N;
            mt_backend *be = mt_cpu_backend_new(1);
            glm_model_params mp = glm_model_default_params();
            mp.comm = comm;
            glm_model *m = nullptr;
            const std::string dir = std::string("tests/fixtures/") + fixture;
            ASSERT_EQ(glm_model_load(dir.c_str(), be, &mp, &m, &err), MT_OK) << fixture << " N " << N << ": " << err.msg;
            size_t split_read = 0, split_total = 0, replicated = 0;
            glm_model_load_bytes(m, &split_read, &split_total, &replicated);
            bench_weights w;
            bench_count_weights(glm_model_config(m), &w);
            EXPECT_EQ((double)split_total, w.split_bytes) << fixture << " N " << N;
            EXPECT_EQ((double)replicated, w.replicated_bytes) << fixture << " N " << N;
            EXPECT_EQ((double)split_read * N, w.split_bytes) << fixture << " N " << N;
            glm_model_free(m);
            comm->size = 1;
            mt_comm_free(comm);
            mt_backend_free(be);
        }
    }
}

TEST(BenchWeights, NamesTheSplitTensors) {
    const char *split[] = {
        "model.language_model.embed_tokens.weight", "lm_head.weight",
        "model.language_model.layers.0.self_attn.q_proj.weight", "model.language_model.layers.0.self_attn.q_conv1d.weight",
        "model.language_model.layers.0.self_attn.b_proj.weight", "model.language_model.layers.0.self_attn.A_log",
        "model.language_model.layers.3.self_attn.q_b_proj.weight", "model.language_model.layers.3.self_attn.kv_b_proj.weight",
        "model.language_model.layers.3.self_attn.o_proj.weight", "model.language_model.layers.1.mlp.experts.7.down_proj.weight",
        "model.language_model.layers.1.mlp.shared_experts.gate_proj.weight",
    };
    const char *whole[] = {
        "model.language_model.norm.weight", "model.language_model.layers.0.hc_attn_fn",
        "model.language_model.layers.0.self_attn.f_a_proj.weight", "model.language_model.layers.0.self_attn.g_a_proj.weight",
        "model.language_model.layers.0.self_attn.o_norm.weight", "model.language_model.layers.3.self_attn.q_a_proj.weight",
        "model.language_model.layers.3.self_attn.kv_a_proj_with_mqa.weight",
        "model.language_model.layers.3.self_attn.indexer.wq_b.weight",
        "model.language_model.layers.3.self_attn.indexer.index_kpool_compress_gate",
        "model.language_model.layers.1.mlp.gate.weight", "model.language_model.layers.1.mlp.gate.e_score_correction_bias",
    };
    for (const char *n : split) EXPECT_TRUE(bench_tensor_is_split(n)) << n;
    for (const char *n : whole) EXPECT_FALSE(bench_tensor_is_split(n)) << n;
}

// decode_bench --fp8's bytes: the tensors glm_weights.c keeps FP8 (the dense projections but kv_b and
// the gates, every MLP's and expert's gate, up, down) at one byte a weight and a 4-byte scale a
// 128 x 128 block; the rest at their dtype.
TEST(BenchWeights, CountsFp8TensorsAtOneBytePlusScales) {
    const char *fp8[] = {
        "model.language_model.layers.0.self_attn.q_proj.weight", "model.language_model.layers.0.self_attn.o_proj.weight",
        "model.language_model.layers.3.self_attn.q_a_proj.weight", "model.language_model.layers.3.self_attn.q_b_proj.weight",
        "model.language_model.layers.3.self_attn.kv_a_proj_with_mqa.weight", "model.language_model.layers.0.mlp.up_proj.weight",
        "model.language_model.layers.1.mlp.experts.7.down_proj.weight",
        "model.language_model.layers.1.mlp.shared_experts.gate_proj.weight",
    };
    const char *other[] = {
        "model.language_model.layers.0.self_attn.f_a_proj.weight", "model.language_model.layers.0.self_attn.b_proj.weight",
        "model.language_model.layers.3.self_attn.kv_b_proj.weight", "model.language_model.layers.3.self_attn.indexer.wq_b.weight",
        "model.language_model.layers.1.mlp.gate.weight", "lm_head.weight", "model.language_model.embed_tokens.weight",
    };
    for (const char *n : fp8) EXPECT_TRUE(bench_tensor_is_fp8(n)) << n;
    for (const char *n : other) EXPECT_FALSE(bench_tensor_is_fp8(n)) << n;
    mt_error err{};
    glm_config c;
    ASSERT_EQ(glm_config_preset("bench-4L", &c, &err), MT_OK) << err.msg;
    bench_weights w16, w8;
    bench_count_weights(&c, &w16);
    bench_count_weights_fp8(&c, &w8);
    const double H = c.hidden_size, I = c.moe_intermediate_size;
    const double blocks = std::ceil(H / 128) * std::ceil(I / 128);
    EXPECT_EQ(w8.expert_bytes, 3 * (H * I + 4 * blocks));
    EXPECT_EQ(w16.expert_bytes, 3 * H * I * 2);
    EXPECT_LT(w8.dense_bytes, w16.dense_bytes);
    EXPECT_GT(w8.dense_bytes, w16.dense_bytes / 2) << "lm_head, kv_b, the gates and the norms stay 16-bit";
    EXPECT_EQ(w8.embed_row_bytes, w16.embed_row_bytes);
    EXPECT_EQ(w8.touched_params, w16.touched_params);
}

}  // namespace

// The experts a prefill touches (the roofline's bytes): top_k for one token, all but a sliver of
// bench-4L's 288 at 512 tokens, never more than there are.
TEST(BenchWeights, ExpertsTouchedGrowToAll) {
    glm_config c;
    mt_error err{};
    ASSERT_EQ(glm_config_preset("bench-4L", &c, &err), MT_OK) << err.msg;
    EXPECT_NEAR(bench_experts_touched(&c, 1), c.num_experts_per_tok, 1e-9);
    EXPECT_GT(bench_experts_touched(&c, 512), c.n_routed_experts - 0.01);
    EXPECT_LE(bench_experts_touched(&c, 4096), (double)c.n_routed_experts);
    EXPECT_LT(bench_experts_touched(&c, 16), 16.0 * c.num_experts_per_tok);
}

// The benches' list options: each comma-separated item, at most max of them.
TEST(BenchArgs, ParsesIntLists) {
    int v[4] = { 0 };
    EXPECT_EQ(bench_parse_ints("1,8,64", v, 4), 3);
    EXPECT_EQ(v[0], 1);
    EXPECT_EQ(v[1], 8);
    EXPECT_EQ(v[2], 64);
    EXPECT_EQ(bench_parse_ints("1,2,3,4,5,6", v, 4), 4);
    EXPECT_EQ(v[3], 4);
    EXPECT_EQ(bench_parse_ints("", v, 4), 0);
}
