// tests/loader_config_test.cc: glm_config (worker/loader/glm_config.h) against transformers'
// Glm5NextTextConfig rules, with real files in a temp directory.
#include <string.h>

#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/loader_test_util.h"
#include "worker/loader/glm_config.h"

using loader_test::TempDir;
using loader_test::WriteFile;

namespace {

// Writes json to dir/name and loads it.
mt_status LoadText(const TempDir &dir, const std::string &json, glm_config *cfg, mt_error *err,
                   const std::string &name = "config.json") {
    std::string path = dir.file(name);
    WriteFile(path, json);
    return glm_config_load(path.c_str(), cfg, err);
}

glm_config MustLoad(const std::string &json) {
    TempDir dir;
    glm_config cfg;
    mt_error err = {};
    mt_status st = LoadText(dir, json, &cfg, &err);
    EXPECT_EQ(st, MT_OK) << err.msg << "\n" << json;
    return cfg;
}

bool SameConfig(const glm_config &a, const glm_config &b) { return memcmp(&a, &b, sizeof a) == 0; }

// The text fields of a small valid config, without braces.
const char *kTextFields =
    "\"vocab_size\": 512, \"hidden_size\": 128, \"intermediate_size\": 256,"
    "\"moe_intermediate_size\": 64, \"num_hidden_layers\": 4, \"num_attention_heads\": 8,"
    "\"num_key_value_heads\": 8, \"n_routed_experts\": 32, \"n_group\": 4, \"topk_group\": 2,"
    "\"num_experts_per_tok\": 6, \"kv_lora_rank\": 64, \"q_lora_rank\": 96,"
    "\"qk_nope_head_dim\": 32, \"v_head_dim\": 32, \"index_topk\": 64, \"index_kpool\": 8,"
    "\"rms_norm_eps\": 1e-6, \"routed_scaling_factor\": 1.5, \"eos_token_id\": [7, 9],"
    "\"pad_token_id\": 3, \"linear_lower_bound\": null,"
    "\"layer_types\": [\"linear_attention\", \"full_attention\", \"deepseek_sparse_attention\","
    " \"linear_attention\"],"
    "\"mlp_layer_types\": [\"dense\", \"sparse\", \"dense\", \"sparse\"],"
    "\"index_topk_pattern\": \"FFSF\"";

TEST(GlmConfig, EmptyObjectGivesTransformersDefaults) {
    glm_config cfg = MustLoad("{}");
    glm_config def;
    glm_config_default(&def);
    EXPECT_TRUE(SameConfig(cfg, def));
    EXPECT_EQ(cfg.vocab_size, 154880);
    EXPECT_EQ(cfg.hidden_size, 4096);
    EXPECT_EQ(cfg.num_hidden_layers, 45);
    EXPECT_EQ(cfg.num_key_value_heads, 64);
    EXPECT_EQ(cfg.n_routed_experts, 288);
    EXPECT_FLOAT_EQ(cfg.routed_scaling_factor, 2.5f);
    EXPECT_EQ(cfg.qk_rope_head_dim, 0);
    EXPECT_FLOAT_EQ(cfg.rms_norm_eps, 1e-5f);
    EXPECT_EQ(cfg.index_topk, 2048);
    EXPECT_EQ(cfg.index_kpool, 16);
    EXPECT_TRUE(cfg.index_kpool_always_select_tail);
    EXPECT_TRUE(cfg.has_linear_lower_bound);
    EXPECT_FLOAT_EQ(cfg.linear_lower_bound, -5.f);
    EXPECT_FLOAT_EQ(cfg.hc_eps, 1e-6f);
    EXPECT_EQ(cfg.hc_sinkhorn_iters, 20);
    EXPECT_EQ(cfg.pad_token_id, 154820);
    EXPECT_EQ(cfg.eos_token_id, -1);
    EXPECT_FALSE(cfg.tie_word_embeddings);
    EXPECT_TRUE(cfg.norm_topk_prob);
    for (int i = 0; i < 45; i++) {
        EXPECT_EQ(cfg.layer_types[i], i % 4 == 3 ? GLM_MIXER_DSA : GLM_MIXER_KDA) << i;
        EXPECT_EQ(cfg.mlp_layer_types[i], i < 3 ? GLM_MLP_DENSE : GLM_MLP_SPARSE) << i;
        EXPECT_EQ(cfg.indexer_types[i], GLM_INDEXER_FULL) << i;
    }
}

TEST(GlmConfig, DefaultListsFor8Layers) {
    glm_config cfg = MustLoad("{\"num_hidden_layers\": 8}");
    const glm_mixer lt[8] = { GLM_MIXER_KDA, GLM_MIXER_KDA, GLM_MIXER_KDA, GLM_MIXER_DSA,
                              GLM_MIXER_KDA, GLM_MIXER_KDA, GLM_MIXER_KDA, GLM_MIXER_DSA };
    for (int i = 0; i < 8; i++) {
        EXPECT_EQ(cfg.layer_types[i], lt[i]) << i;
        EXPECT_EQ(cfg.mlp_layer_types[i], i < 3 ? GLM_MLP_DENSE : GLM_MLP_SPARSE) << i;
        EXPECT_EQ(cfg.indexer_types[i], GLM_INDEXER_FULL) << i;
    }
    // Fewer layers than the dense prefix: every MLP dense.
    glm_config two = MustLoad("{\"num_hidden_layers\": 2}");
    EXPECT_EQ(two.mlp_layer_types[0], GLM_MLP_DENSE);
    EXPECT_EQ(two.mlp_layer_types[1], GLM_MLP_DENSE);
    EXPECT_EQ(two.layer_types[1], GLM_MIXER_KDA);
}

TEST(GlmConfig, FullAttentionIsDsa) {
    glm_config cfg = MustLoad(
        "{\"num_hidden_layers\": 2, \"layer_types\": [\"full_attention\", \"linear_attention\"]}");
    EXPECT_EQ(cfg.layer_types[0], GLM_MIXER_DSA);
    EXPECT_EQ(cfg.layer_types[1], GLM_MIXER_KDA);
}

TEST(GlmConfig, IndexerTypesFromPatternString) {
    glm_config cfg = MustLoad(
        "{\"num_hidden_layers\": 4, \"layer_types\": [\"deepseek_sparse_attention\","
        " \"deepseek_sparse_attention\", \"deepseek_sparse_attention\", \"deepseek_sparse_attention\"],"
        " \"index_topk_pattern\": \"FSFS\"}");
    const glm_indexer want[4] = { GLM_INDEXER_FULL, GLM_INDEXER_SHARED, GLM_INDEXER_FULL,
                                  GLM_INDEXER_SHARED };
    for (int i = 0; i < 4; i++) EXPECT_EQ(cfg.indexer_types[i], want[i]) << i;
}

TEST(GlmConfig, IndexerTypesFromPatternList) {
    glm_config cfg = MustLoad(
        "{\"num_hidden_layers\": 3, \"layer_types\": [\"deepseek_sparse_attention\","
        " \"deepseek_sparse_attention\", \"linear_attention\"],"
        " \"index_topk_pattern\": [\"full\", \"shared\", \"shared\"]}");
    EXPECT_EQ(cfg.indexer_types[0], GLM_INDEXER_FULL);
    EXPECT_EQ(cfg.indexer_types[1], GLM_INDEXER_SHARED);
    EXPECT_EQ(cfg.indexer_types[2], GLM_INDEXER_SHARED);  // a KDA layer: not checked
}

TEST(GlmConfig, IndexerTypesFromFreqAndOffset) {
    // "full" where max(i - offset + 1, 0) % freq == 0: freq 2, offset 2 -> F F S F S F S F.
    glm_config cfg = MustLoad(
        "{\"num_hidden_layers\": 8, \"index_topk_freq\": 2, \"index_skip_topk_offset\": 2}");
    const char *want = "FFSFSFSF";
    for (int i = 0; i < 8; i++)
        EXPECT_EQ(cfg.indexer_types[i], want[i] == 'F' ? GLM_INDEXER_FULL : GLM_INDEXER_SHARED) << i;
    // freq 0 counts as 1 (max(freq, 1)): every layer full.
    glm_config f0 = MustLoad("{\"num_hidden_layers\": 8, \"index_topk_freq\": 0}");
    for (int i = 0; i < 8; i++) EXPECT_EQ(f0.indexer_types[i], GLM_INDEXER_FULL) << i;
}

TEST(GlmConfig, IndexerTypesPrecedence) {
    // indexer_types beats index_topk_pattern, which beats index_topk_freq.
    glm_config a = MustLoad(
        "{\"num_hidden_layers\": 4, \"indexer_types\": [\"full\", \"full\", \"full\", \"full\"],"
        " \"index_topk_pattern\": \"SSSS\"}");
    for (int i = 0; i < 4; i++) EXPECT_EQ(a.indexer_types[i], GLM_INDEXER_FULL);
    // freq 3 alone would make layer 3 (DSA, after a KDA layer) "shared", which is rejected.
    glm_config b = MustLoad(
        "{\"num_hidden_layers\": 4, \"index_topk_pattern\": \"FFSF\", \"index_topk_freq\": 3}");
    EXPECT_EQ(b.indexer_types[2], GLM_INDEXER_SHARED);
    EXPECT_EQ(b.indexer_types[3], GLM_INDEXER_FULL);
}

TEST(GlmConfig, LinearAttnConfigOverrides) {
    glm_config cfg = MustLoad(
        "{\"linear_head_dim\": 16, \"linear_attn_config\": {\"head_dim\": 64, \"num_heads\": 32,"
        " \"short_conv_kernel_size\": 3, \"gate_lower_bound\": -3.5}}");
    EXPECT_EQ(cfg.linear_head_dim, 64);
    EXPECT_EQ(cfg.linear_num_heads, 32);
    EXPECT_EQ(cfg.linear_conv_kernel_dim, 3);
    EXPECT_TRUE(cfg.has_linear_lower_bound);
    EXPECT_FLOAT_EQ(cfg.linear_lower_bound, -3.5f);

    // Keys absent from the dict keep the top-level values.
    glm_config keep = MustLoad("{\"linear_num_heads\": 16, \"linear_attn_config\": {\"head_dim\": 32}}");
    EXPECT_EQ(keep.linear_num_heads, 16);
    EXPECT_EQ(keep.linear_head_dim, 32);
}

TEST(GlmConfig, LinearLowerBoundNullAndSafeGate) {
    glm_config none = MustLoad("{\"linear_lower_bound\": null}");
    EXPECT_FALSE(none.has_linear_lower_bound);
    // safe_gate (default true) restores -5 when the bound is None after the dict.
    glm_config safe = MustLoad("{\"linear_lower_bound\": null, \"linear_attn_config\": {}}");
    EXPECT_TRUE(safe.has_linear_lower_bound);
    EXPECT_FLOAT_EQ(safe.linear_lower_bound, -5.f);
    glm_config safe2 = MustLoad("{\"linear_attn_config\": {\"gate_lower_bound\": null}}");
    EXPECT_TRUE(safe2.has_linear_lower_bound);
    EXPECT_FLOAT_EQ(safe2.linear_lower_bound, -5.f);
    glm_config unsafe = MustLoad(
        "{\"linear_attn_config\": {\"gate_lower_bound\": null, \"safe_gate\": false}}");
    EXPECT_FALSE(unsafe.has_linear_lower_bound);
    glm_config other = MustLoad("{\"linear_lower_bound\": -2}");
    EXPECT_TRUE(other.has_linear_lower_bound);
    EXPECT_FLOAT_EQ(other.linear_lower_bound, -2.f);
}

TEST(GlmConfig, NullableFields) {
    glm_config kv = MustLoad("{\"num_attention_heads\": 32, \"num_key_value_heads\": null}");
    EXPECT_EQ(kv.num_key_value_heads, 32);
    glm_config pad = MustLoad("{\"pad_token_id\": null, \"eos_token_id\": 5}");
    EXPECT_EQ(pad.pad_token_id, -1);
    EXPECT_EQ(pad.eos_token_id, 5);
    EXPECT_EQ(MustLoad("{\"eos_token_id\": [11, 12]}").eos_token_id, 11);
    EXPECT_EQ(MustLoad("{\"eos_token_id\": []}").eos_token_id, -1);
    EXPECT_EQ(MustLoad("{\"eos_token_id\": null}").eos_token_id, -1);
    EXPECT_EQ(MustLoad("{\"num_local_experts\": 64}").n_routed_experts, 64);
}

TEST(GlmConfig, NestedAndFlatLoadIdentically) {
    std::string flat = std::string("{\"model_type\": \"glm5_next_text\", ") + kTextFields + "}";
    std::string nested = std::string(
                             "{\"model_type\": \"glm5_next\", \"architectures\": "
                             "[\"Glm5NextForConditionalGeneration\"], \"image_token_id\": 154854,"
                             " \"vision_config\": {\"depth\": 24, \"hidden_size\": 1024},"
                             " \"text_config\": {") +
                         kTextFields + "}}";
    glm_config a = MustLoad(flat), b = MustLoad(nested);
    EXPECT_TRUE(SameConfig(a, b));
    EXPECT_EQ(a.vocab_size, 512);
    EXPECT_EQ(a.num_experts_per_tok, 6);
    EXPECT_FLOAT_EQ(a.rms_norm_eps, 1e-6f);
    EXPECT_EQ(a.eos_token_id, 7);
    EXPECT_EQ(a.pad_token_id, 3);
    EXPECT_FALSE(a.has_linear_lower_bound);
    EXPECT_EQ(a.layer_types[1], GLM_MIXER_DSA);
    EXPECT_EQ(a.mlp_layer_types[2], GLM_MLP_DENSE);
    EXPECT_EQ(a.indexer_types[2], GLM_INDEXER_SHARED);
    // A null text_config means the flat form.
    glm_config c = MustLoad(std::string("{\"text_config\": null, ") + kTextFields + "}");
    EXPECT_TRUE(SameConfig(a, c));
}

TEST(GlmConfig, NestedTopLevelTieAndEos) {
    glm_config a = MustLoad(
        "{\"model_type\": \"glm5_next\", \"tie_word_embeddings\": true, \"eos_token_id\": [4, 5],"
        " \"text_config\": {\"num_hidden_layers\": 4}}");
    EXPECT_TRUE(a.tie_word_embeddings);
    EXPECT_EQ(a.eos_token_id, 4);
    EXPECT_EQ(a.num_hidden_layers, 4);
    // text_config's own eos wins over the top-level one.
    glm_config b = MustLoad(
        "{\"eos_token_id\": 4, \"text_config\": {\"eos_token_id\": 9, \"tie_word_embeddings\": true}}");
    EXPECT_EQ(b.eos_token_id, 9);
    EXPECT_TRUE(b.tie_word_embeddings);
    // Text fields at the top level of the nested form are not text fields.
    glm_config c = MustLoad("{\"hidden_size\": 32, \"text_config\": {}}");
    EXPECT_EQ(c.hidden_size, 4096);
}

TEST(GlmConfig, PresetTiny) {
    glm_config c;
    mt_error err = {};
    ASSERT_EQ(glm_config_preset("tiny", &c, &err), MT_OK) << err.msg;
    EXPECT_EQ(c.vocab_size, 256);
    EXPECT_EQ(c.hidden_size, 64);
    EXPECT_EQ(c.intermediate_size, 128);
    EXPECT_EQ(c.moe_intermediate_size, 32);
    EXPECT_EQ(c.num_hidden_layers, 4);
    EXPECT_EQ(c.num_attention_heads, 4);
    EXPECT_EQ(c.qk_nope_head_dim, 16);
    EXPECT_EQ(c.v_head_dim, 16);
    EXPECT_EQ(c.kv_lora_rank, 32);
    EXPECT_EQ(c.q_lora_rank, 48);
    EXPECT_EQ(c.n_routed_experts, 16);
    EXPECT_EQ(c.n_group, 4);
    EXPECT_EQ(c.topk_group, 2);
    EXPECT_EQ(c.num_experts_per_tok, 4);
    EXPECT_EQ(c.n_shared_experts, 1);
    EXPECT_EQ(c.index_topk, 16);
    EXPECT_EQ(c.index_kpool, 4);
    EXPECT_EQ(c.index_head_dim, 16);
    EXPECT_EQ(c.index_n_heads, 16);
    EXPECT_EQ(c.linear_num_heads, 4);
    EXPECT_EQ(c.linear_head_dim, 16);
    EXPECT_EQ(c.linear_conv_kernel_dim, 4);
    EXPECT_EQ(c.hc_mult, 4);
    EXPECT_EQ(c.hc_sinkhorn_iters, 20);
    EXPECT_TRUE(c.has_linear_lower_bound);
    EXPECT_FLOAT_EQ(c.linear_lower_bound, -5.f);
    EXPECT_TRUE(c.index_kpool_always_select_tail);
    const glm_mixer lt[4] = { GLM_MIXER_KDA, GLM_MIXER_DSA, GLM_MIXER_DSA, GLM_MIXER_KDA };
    const glm_mlp mt[4] = { GLM_MLP_DENSE, GLM_MLP_SPARSE, GLM_MLP_SPARSE, GLM_MLP_SPARSE };
    for (int i = 0; i < 4; i++) {
        EXPECT_EQ(c.layer_types[i], lt[i]);
        EXPECT_EQ(c.mlp_layer_types[i], mt[i]);
    }
    EXPECT_EQ(c.indexer_types[1], GLM_INDEXER_FULL);
    EXPECT_EQ(c.indexer_types[2], GLM_INDEXER_SHARED);
}

TEST(GlmConfig, PresetBench4L) {
    glm_config c;
    mt_error err = {};
    ASSERT_EQ(glm_config_preset("bench-4L", &c, &err), MT_OK) << err.msg;
    EXPECT_EQ(c.hidden_size, 4096);
    EXPECT_EQ(c.intermediate_size, 12288);
    EXPECT_EQ(c.moe_intermediate_size, 2048);
    EXPECT_EQ(c.vocab_size, 154880);
    EXPECT_EQ(c.num_attention_heads, 64);
    EXPECT_EQ(c.qk_nope_head_dim, 256);
    EXPECT_EQ(c.v_head_dim, 256);
    EXPECT_EQ(c.kv_lora_rank, 512);
    EXPECT_EQ(c.q_lora_rank, 1536);
    EXPECT_EQ(c.linear_num_heads, 64);
    EXPECT_EQ(c.linear_head_dim, 128);
    EXPECT_EQ(c.n_routed_experts, 288);
    EXPECT_EQ(c.num_experts_per_tok, 8);
    EXPECT_EQ(c.n_shared_experts, 1);
    EXPECT_EQ(c.n_group, 1);
    EXPECT_EQ(c.topk_group, 1);
    EXPECT_EQ(c.index_topk, 2048);
    EXPECT_EQ(c.index_kpool, 16);
    EXPECT_EQ(c.index_head_dim, 128);
    EXPECT_EQ(c.index_n_heads, 32);
    EXPECT_EQ(c.hc_mult, 4);
    EXPECT_EQ(c.num_hidden_layers, 4);
    const glm_mixer lt[4] = { GLM_MIXER_KDA, GLM_MIXER_KDA, GLM_MIXER_KDA, GLM_MIXER_DSA };
    const glm_mlp mt[4] = { GLM_MLP_DENSE, GLM_MLP_SPARSE, GLM_MLP_SPARSE, GLM_MLP_SPARSE };
    for (int i = 0; i < 4; i++) {
        EXPECT_EQ(c.layer_types[i], lt[i]);
        EXPECT_EQ(c.mlp_layer_types[i], mt[i]);
        EXPECT_EQ(c.indexer_types[i], GLM_INDEXER_FULL);
    }
}

// The GPU model test's wider random model: real head sizes at hidden 512, validated.
TEST(GlmConfig, PresetTestWide) {
    glm_config c;
    mt_error err = {};
    ASSERT_EQ(glm_config_preset("test-wide", &c, &err), MT_OK) << err.msg;
    EXPECT_EQ(c.hidden_size, 512);
    EXPECT_EQ(c.vocab_size, 2048);
    EXPECT_EQ(c.linear_head_dim, 128);
    EXPECT_EQ(c.qk_nope_head_dim, 256);
    EXPECT_EQ(c.v_head_dim, 256);
    EXPECT_EQ(c.kv_lora_rank, 512);
    EXPECT_EQ(c.index_head_dim, 128);
    EXPECT_EQ(c.n_routed_experts, 64);
    EXPECT_EQ(c.num_experts_per_tok, 8);
    EXPECT_EQ(c.index_topk, 128);
    EXPECT_EQ(c.layer_types[1], GLM_MIXER_DSA);
    EXPECT_EQ(c.layer_types[2], GLM_MIXER_DSA);
    EXPECT_EQ(c.indexer_types[2], GLM_INDEXER_SHARED);
    EXPECT_EQ(c.mlp_layer_types[1], GLM_MLP_SPARSE);
}

TEST(GlmConfig, UnknownPreset) {
    glm_config c;
    memset(&c, 0x5a, sizeof c);
    glm_config before = c;
    mt_error err = {};
    EXPECT_EQ(glm_config_preset("huge", &c, &err), MT_ERR_NOT_FOUND);
    EXPECT_NE(std::string(err.msg).find("huge"), std::string::npos) << err.msg;
    EXPECT_TRUE(SameConfig(c, before));
}

TEST(GlmConfig, SaveRoundTrips) {
    TempDir dir;
    std::vector<glm_config> cfgs;
    glm_config c;
    mt_error err = {};
    ASSERT_EQ(glm_config_preset("tiny", &c, &err), MT_OK);
    cfgs.push_back(c);
    ASSERT_EQ(glm_config_preset("bench-4L", &c, &err), MT_OK);
    cfgs.push_back(c);
    glm_config_default(&c);
    cfgs.push_back(c);
    c.has_linear_lower_bound = false;
    c.pad_token_id = -1;
    c.eos_token_id = 154827;
    c.tie_word_embeddings = true;
    c.rms_norm_eps = 1e-6f;
    c.hc_eps = 3.3e-7f;
    c.routed_scaling_factor = 0.1f;
    c.index_kpool_always_select_tail = false;
    cfgs.push_back(c);
    for (size_t i = 0; i < cfgs.size(); i++) {
        std::string path = dir.file("saved" + std::to_string(i) + ".json");
        ASSERT_EQ(glm_config_save(&cfgs[i], path.c_str(), &err), MT_OK) << err.msg;
        glm_config back;
        ASSERT_EQ(glm_config_load(path.c_str(), &back, &err), MT_OK) << err.msg;
        EXPECT_TRUE(SameConfig(back, cfgs[i])) << "config " << i;
        // The flat form: no text_config, model_type glm5_next_text.
        std::string text = loader_test::ReadFile(path);
        EXPECT_EQ(text.find("text_config"), std::string::npos);
        EXPECT_NE(text.find("\"glm5_next_text\""), std::string::npos);
    }
}

TEST(GlmConfig, SaveRejectsInvalidAndUnwritable) {
    TempDir dir;
    glm_config c;
    mt_error err = {};
    ASSERT_EQ(glm_config_preset("tiny", &c, &err), MT_OK);
    std::string bad = dir.file("no/such/dir/config.json");
    EXPECT_EQ(glm_config_save(&c, bad.c_str(), &err), MT_ERR_IO);
    EXPECT_NE(std::string(err.msg).find(bad), std::string::npos) << err.msg;
    c.hc_mult = 0;
    std::string path = dir.file("config.json");
    EXPECT_EQ(glm_config_save(&c, path.c_str(), &err), MT_ERR_INVALID);
    EXPECT_NE(std::string(err.msg).find("hc_mult"), std::string::npos) << err.msg;
    EXPECT_FALSE(loader_test::Exists(path));
}

TEST(GlmConfig, ValidateNamesTheField) {
    glm_config c;
    mt_error err = {};
    ASSERT_EQ(glm_config_preset("tiny", &c, &err), MT_OK);
    ASSERT_EQ(glm_config_validate(&c, &err), MT_OK);
    glm_config d = c;
    d.layer_types[2] = (glm_mixer)7;
    EXPECT_EQ(glm_config_validate(&d, &err), MT_ERR_INVALID);
    EXPECT_NE(std::string(err.msg).find("layer_types[2]"), std::string::npos) << err.msg;
    d = c;
    d.layer_types[1] = GLM_MIXER_KDA;  // layer 2 shares the indexer of a KDA layer
    EXPECT_EQ(glm_config_validate(&d, &err), MT_ERR_INVALID);
    EXPECT_NE(std::string(err.msg).find("indexer_types[2]"), std::string::npos) << err.msg;
    d = c;
    d.num_hidden_layers = GLM_MAX_LAYERS + 1;
    EXPECT_EQ(glm_config_validate(&d, &err), MT_ERR_INVALID);
    EXPECT_NE(std::string(err.msg).find("num_hidden_layers"), std::string::npos) << err.msg;
}

struct BadCase {
    const char *json;
    const char *needle;  // must appear in the message
};

// Each input is rejected with a message naming the field; no two messages are the same.
TEST(GlmConfig, RejectsBadConfigs) {
    const BadCase cases[] = {
        { "{\"num_hidden_layers\": 2, \"layer_types\": [\"linear_attention\", \"mamba\"]}",
          "layer_types[1] has unknown value \"mamba\"" },
        { "{\"num_hidden_layers\": 2, \"mlp_layer_types\": [\"moe\", \"dense\"]}",
          "mlp_layer_types[0] has unknown value \"moe\"" },
        { "{\"num_hidden_layers\": 2, \"indexer_types\": [\"full\", \"half\"]}",
          "indexer_types[1] has unknown value \"half\"" },
        { "{\"num_hidden_layers\": 2, \"index_topk_pattern\": \"FX\"}", "index_topk_pattern[1]" },
        { "{\"num_hidden_layers\": 2, \"layer_types\": [\"linear_attention\"]}",
          "layer_types has 1 entries but num_hidden_layers is 2" },
        { "{\"num_hidden_layers\": 2, \"mlp_layer_types\": [\"dense\", \"dense\", \"dense\"]}",
          "mlp_layer_types has 3 entries" },
        { "{\"num_hidden_layers\": 2, \"indexer_types\": [\"full\"]}", "indexer_types has 1 entries" },
        { "{\"num_hidden_layers\": 3, \"index_topk_pattern\": \"FFFF\"}",
          "index_topk_pattern has 4 entries" },
        { "{\"num_hidden_layers\": 0}", "num_hidden_layers is 0" },
        { "{\"num_hidden_layers\": 257}", "num_hidden_layers is 257" },
        { "{\"index_topk\": 100, \"index_kpool\": 16}", "index_topk (100) must be divisible by index_kpool" },
        { "{\"index_kpool\": 0}", "index_kpool is 0" },
        { "{\"qk_rope_head_dim\": 64}", "qk_rope_head_dim is 64" },
        { "{\"num_attention_heads\": 32}", "num_key_value_heads (64) must equal num_attention_heads (32)" },
        { "{\"num_hidden_layers\": 2, \"layer_types\": [\"linear_attention\", \"deepseek_sparse_attention\"],"
          " \"indexer_types\": [\"full\", \"shared\"]}",
          "indexer_types[1] is \"shared\" but layer 0" },
        { "{\"num_hidden_layers\": 3, \"layer_types\": [\"deepseek_sparse_attention\","
          " \"deepseek_sparse_attention\", \"deepseek_sparse_attention\"],"
          " \"index_topk_pattern\": \"FSS\"}",
          "indexer_types[2] is \"shared\" but layer 1" },
        { "{\"num_hidden_layers\": 1, \"layer_types\": [\"deepseek_sparse_attention\"],"
          " \"indexer_types\": [\"shared\"]}",
          "indexer_types[0] is \"shared\"" },
        { "{\"hidden_size\": 0}", "hidden_size is 0, must be > 0" },
        { "{\"vocab_size\": -5}", "vocab_size is -5" },
        { "{\"moe_intermediate_size\": 0}", "moe_intermediate_size is 0" },
        { "{\"linear_conv_kernel_dim\": 0}", "linear_conv_kernel_dim is 0" },
        { "{\"n_shared_experts\": 0}", "n_shared_experts is 0" },
        { "{\"n_routed_experts\": 30, \"n_group\": 4}", "n_routed_experts (30) must be divisible by n_group (4)" },
        { "{\"n_routed_experts\": 32, \"n_group\": 4, \"topk_group\": 5}", "topk_group (5) must be <= n_group (4)" },
        { "{\"n_routed_experts\": 32, \"n_group\": 4, \"topk_group\": 2, \"num_experts_per_tok\": 17}",
          "num_experts_per_tok (17) exceeds the 16 experts" },
        { "{\"n_routed_experts\": 8, \"n_group\": 8, \"topk_group\": 8, \"num_experts_per_tok\": 4}",
          "n_routed_experts / n_group is 1" },
        { "{\"hc_mult\": 0}", "hc_mult is 0" },
        { "{\"hc_sinkhorn_iters\": 0}", "hc_sinkhorn_iters is 0" },
        { "{\"hidden_size\": \"4096\"}", "hidden_size must be an integer, got a string" },
        { "{\"intermediate_size\": 12288.5}", "intermediate_size must be an integer, got a float" },
        { "{\"vocab_size\": null}", "vocab_size must be an integer, got null" },
        { "{\"q_lora_rank\": null}", "q_lora_rank must be an integer, got null" },
        { "{\"num_hidden_layers\": 99999999999}", "num_hidden_layers is out of range" },
        { "{\"rms_norm_eps\": \"1e-5\"}", "rms_norm_eps must be a number, got a string" },
        { "{\"rms_norm_eps\": 0}", "rms_norm_eps must be > 0" },
        { "{\"norm_topk_prob\": 1}", "norm_topk_prob must be true or false, got an integer" },
        { "{\"layer_types\": \"linear_attention\"}", "layer_types must be a list of strings, got a string" },
        { "{\"num_hidden_layers\": 1, \"mlp_layer_types\": [3]}", "mlp_layer_types[0] must be a string" },
        { "{\"eos_token_id\": \"</s>\"}", "eos_token_id must be an integer, got a string" },
        { "{\"eos_token_id\": [1, \"x\"]}", "eos_token_id[1] must be an integer" },
        { "{\"pad_token_id\": 1.5}", "pad_token_id must be an integer, got a float" },
        { "{\"num_key_value_heads\": \"64\"}", "num_key_value_heads must be an integer" },
        { "{\"linear_lower_bound\": \"low\"}", "linear_lower_bound must be a number" },
        { "{\"linear_attn_config\": 3}", "linear_attn_config must be an object, got an integer" },
        { "{\"linear_attn_config\": {\"num_heads\": \"8\"}}", "linear_attn_config.num_heads must be an integer" },
        { "{\"linear_attn_config\": {\"safe_gate\": \"yes\"}}", "linear_attn_config.safe_gate must be true or false" },
        { "{\"linear_attn_config\": {\"head_dim\": 0}}", "linear_head_dim is 0" },
        { "{\"index_topk_freq\": \"2\"}", "index_topk_freq must be an integer" },
        { "{\"text_config\": [1]}", "text_config must be an object, got a list" },
        { "{\"text_config\": {\"hidden_size\": true}}", "hidden_size must be an integer, got a boolean" },
        { "{\"tie_word_embeddings\": \"no\", \"text_config\": {}}", "tie_word_embeddings must be true or false" },
        { "{\"model_type\": \"llama\"}", "model_type is \"llama\"" },
        { "[1, 2]", "the config must be a JSON object, got a list" },
        { "{\"hidden_size\": 64,", "not valid JSON" },
        { "{\"hidden_size\": 64} trailing", "not valid JSON (trailing data" },
        { "", "not valid JSON" },
    };
    TempDir dir;
    std::set<std::string> messages;
    int i = 0;
    for (const BadCase &bc : cases) {
        glm_config cfg;
        memset(&cfg, 0x5a, sizeof cfg);
        glm_config before = cfg;
        mt_error err = {};
        std::string name = "bad" + std::to_string(i++) + ".json";
        mt_status st = LoadText(dir, bc.json, &cfg, &err, name);
        EXPECT_EQ(st, MT_ERR_INVALID) << bc.json;
        std::string msg = err.msg;
        EXPECT_NE(msg.find(bc.needle), std::string::npos) << "input: " << bc.json << "\nmessage: " << msg;
        EXPECT_NE(msg.find(name), std::string::npos) << "message does not name the file: " << msg;
        EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
        EXPECT_TRUE(SameConfig(cfg, before)) << "failed load changed the output: " << bc.json;
        EXPECT_TRUE(messages.insert(msg.substr(msg.find(name) + name.size())).second)
            << "duplicate message: " << msg;
    }
}

TEST(GlmConfig, MissingFileIsIoErrorNamingPath) {
    TempDir dir;
    glm_config cfg;
    mt_error err = {};
    std::string path = dir.file("absent.json");
    EXPECT_EQ(glm_config_load(path.c_str(), &cfg, &err), MT_ERR_IO);
    EXPECT_NE(std::string(err.msg).find(path), std::string::npos) << err.msg;
}

TEST(GlmConfig, NotJsonNamesThePath) {
    TempDir dir;
    glm_config cfg;
    mt_error err = {};
    std::string path = dir.file("config.json");
    WriteFile(path, std::string("\x89PNG\r\n\x1a\n", 8));
    EXPECT_EQ(glm_config_load(path.c_str(), &cfg, &err), MT_ERR_INVALID);
    EXPECT_NE(std::string(err.msg).find(path + ": not valid JSON"), std::string::npos) << err.msg;
    WriteFile(path, std::string("{\"a\": 1}\0\0", 10));
    EXPECT_EQ(glm_config_load(path.c_str(), &cfg, &err), MT_ERR_INVALID);
    EXPECT_NE(std::string(err.msg).find("not valid JSON"), std::string::npos) << err.msg;
}

TEST(GlmConfig, ParseFromTextNamesTheSource) {
    glm_config cfg;
    mt_error err = {};
    EXPECT_EQ(glm_config_parse("{\"hc_mult\": -1}", "inline", &cfg, &err), MT_ERR_INVALID);
    EXPECT_EQ(std::string(err.msg).rfind("inline: ", 0), 0u) << err.msg;
    EXPECT_NE(std::string(err.msg).find("hc_mult"), std::string::npos) << err.msg;
    ASSERT_EQ(glm_config_parse("{\"num_hidden_layers\": 4}", "inline", &cfg, &err), MT_OK) << err.msg;
    EXPECT_EQ(cfg.num_hidden_layers, 4);
}

// quantization_config (docs/MODEL.md, "FP8 checkpoints"): under text_config or at the top level,
// text_config's winning; the block size and modules_to_not_convert are kept.
const char *kFp8 =
    "{\"quant_method\": \"fp8\", \"fmt\": \"e4m3\", \"activation_scheme\": \"dynamic\","
    " \"weight_block_size\": [128, 64], \"modules_to_not_convert\": [\"lm_head\", \"mlp.gate\"]}";

std::vector<std::string> SkipList(const glm_quant &q) {
    std::vector<std::string> out;
    const char *e = q.skip;
    for (int i = 0; i < q.n_skip; i++, e += strlen(e) + 1) out.push_back(e);
    return out;
}

TEST(GlmConfig, QuantizationConfigNestedOrTopLevel) {
    const glm_config none = MustLoad("{}");
    EXPECT_FALSE(none.quant.fp8);
    const std::string top = std::string("{\"model_type\": \"glm5_next\", \"quantization_config\": ") + kFp8 +
                            ", \"text_config\": {" + kTextFields + "}}";
    const std::string nested = std::string("{\"model_type\": \"glm5_next\", \"text_config\": {") + kTextFields +
                               ", \"quantization_config\": " + kFp8 + "}}";
    const std::string flat = std::string("{") + kTextFields + ", \"quantization_config\": " + kFp8 + "}";
    for (const std::string &json : { top, nested, flat }) {
        glm_config c = MustLoad(json);
        EXPECT_TRUE(c.quant.fp8) << json;
        EXPECT_EQ(c.quant.block_rows, 128);
        EXPECT_EQ(c.quant.block_cols, 64);
        EXPECT_EQ(SkipList(c.quant), (std::vector<std::string>{ "lm_head", "mlp.gate" }));
    }
    // both: text_config's wins
    glm_config c = MustLoad(std::string("{\"quantization_config\": {\"quant_method\": \"nvfp4\"}, \"text_config\": {") +
                            kTextFields + ", \"quantization_config\": {\"quant_method\": \"fp8\", "
                            "\"weight_block_size\": [16, 32]}}}");
    EXPECT_TRUE(c.quant.fp8);
    EXPECT_EQ(c.quant.block_rows, 16);
    EXPECT_EQ(c.quant.n_skip, 0);
    EXPECT_FALSE(MustLoad("{\"quantization_config\": null}").quant.fp8);
}

TEST(GlmConfig, QuantizationConfigRefusedWithTheReason) {
    const struct { const char *q; mt_status st; const char *says; } bad[] = {
        { "{\"quant_method\": \"awq\", \"bits\": 4}", MT_ERR_UNSUPPORTED, "quant_method \"awq\" is not supported" },
        { "{\"quant_method\": \"compressed-tensors\"}", MT_ERR_UNSUPPORTED, "\"compressed-tensors\" is not supported" },
        { "{\"weight_block_size\": [128, 128]}", MT_ERR_INVALID, "has no quant_method" },
        { "{\"quant_method\": 8}", MT_ERR_INVALID, "quant_method must be a string" },
        { "{\"quant_method\": \"fp8\"}", MT_ERR_UNSUPPORTED, "no weight_block_size" },
        { "{\"quant_method\": \"fp8\", \"fmt\": \"e5m2\", \"weight_block_size\": [128, 128]}", MT_ERR_UNSUPPORTED,
          "fmt \"e5m2\"" },
        { "{\"quant_method\": \"fp8\", \"activation_scheme\": \"static\", \"weight_block_size\": [128, 128]}",
          MT_ERR_UNSUPPORTED, "activation_scheme \"static\"" },
        { "{\"quant_method\": \"fp8\", \"weight_block_size\": [128]}", MT_ERR_INVALID, "list of two integers" },
        { "{\"quant_method\": \"fp8\", \"weight_block_size\": [0, 128]}", MT_ERR_INVALID,
          "weight_block_size[0] is 0, must be > 0" },
        { "{\"quant_method\": \"fp8\", \"weight_block_size\": [128, 1.5]}", MT_ERR_INVALID,
          "weight_block_size[1] must be an integer" },
        { "{\"quant_method\": \"fp8\", \"weight_block_size\": [128, 128], \"modules_to_not_convert\": \"lm_head\"}",
          MT_ERR_INVALID, "modules_to_not_convert must be a list" },
        { "{\"quant_method\": \"fp8\", \"weight_block_size\": [128, 128], \"modules_to_not_convert\": [1]}",
          MT_ERR_INVALID, "modules_to_not_convert[0] must be a non-empty string" },
        { "[\"fp8\"]", MT_ERR_INVALID, "quantization_config must be an object" },
    };
    for (const auto &b : bad) {
        TempDir dir;
        glm_config c;
        memset(&c, 0x5a, sizeof c);
        const glm_config before = c;
        mt_error err = {};
        const std::string json = std::string("{\"model_type\": \"glm5_next\", \"quantization_config\": ") + b.q +
                                 ", \"text_config\": {" + kTextFields + "}}";
        EXPECT_EQ(LoadText(dir, json, &c, &err), b.st) << b.q << ": " << err.msg;
        EXPECT_NE(std::string(err.msg).find(b.says), std::string::npos) << err.msg;
        EXPECT_NE(std::string(err.msg).find("config.json"), std::string::npos) << err.msg;
        EXPECT_TRUE(SameConfig(c, before)) << b.q;
    }
}

TEST(GlmConfig, QuantizationConfigSurvivesSave) {
    TempDir dir;
    glm_config c = MustLoad(std::string("{") + kTextFields + ", \"quantization_config\": " + kFp8 + "}");
    mt_error err = {};
    const std::string path = dir.file("saved.json");
    ASSERT_EQ(glm_config_save(&c, path.c_str(), &err), MT_OK) << err.msg;
    glm_config back;
    ASSERT_EQ(glm_config_load(path.c_str(), &back, &err), MT_OK) << err.msg;
    EXPECT_TRUE(SameConfig(back, c));
    EXPECT_NE(loader_test::ReadFile(path).find("\"modules_to_not_convert\""), std::string::npos);
    c.quant.n_skip = 0;
    memset(c.quant.skip, 0, sizeof c.quant.skip);
    ASSERT_EQ(glm_config_save(&c, path.c_str(), &err), MT_OK) << err.msg;
    ASSERT_EQ(glm_config_load(path.c_str(), &back, &err), MT_OK) << err.msg;
    EXPECT_TRUE(SameConfig(back, c));
    // a config without one writes none
    glm_config plain;
    ASSERT_EQ(glm_config_preset("tiny", &plain, &err), MT_OK);
    ASSERT_EQ(glm_config_save(&plain, path.c_str(), &err), MT_OK) << err.msg;
    EXPECT_EQ(loader_test::ReadFile(path).find("quantization_config"), std::string::npos);
}

TEST(GlmConfig, ModulesToNotConvertMatchWholeModuleNames) {
    glm_config c = MustLoad(
        "{\"quantization_config\": {\"quant_method\": \"fp8\", \"weight_block_size\": [128, 128], "
        "\"modules_to_not_convert\": [\"lm_head\", \"mlp.gate\", \"model.language_model.layers.3\"]}}");
    const glm_quant *q = &c.quant;
    EXPECT_TRUE(glm_quant_skips(q, "lm_head.weight"));
    EXPECT_TRUE(glm_quant_skips(q, "model.language_model.layers.1.mlp.gate.weight"));
    EXPECT_FALSE(glm_quant_skips(q, "model.language_model.layers.1.mlp.gate_proj.weight"));
    EXPECT_FALSE(glm_quant_skips(q, "model.language_model.layers.1.mlp.experts.0.gate_proj.weight"));
    EXPECT_TRUE(glm_quant_skips(q, "model.language_model.layers.3.self_attn.q_proj.weight"));
    EXPECT_FALSE(glm_quant_skips(q, "model.language_model.layers.30.self_attn.q_proj.weight"));
    EXPECT_FALSE(glm_quant_skips(q, "model.language_model.layers.2.self_attn.q_proj.weight"));
    const glm_config none = MustLoad("{}");
    EXPECT_FALSE(glm_quant_skips(&none.quant, "lm_head.weight"));
}

}  // namespace
