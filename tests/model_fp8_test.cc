// FP8 checkpoints (docs/MODEL.md, "FP8 checkpoints") on the fixture fp8_a: tiny_a quantised to
// block-scaled e4m3 with blocks of 16 x 32 by tests/oracle/make_fp8_fixture.py, which also
// dequantised every FP8 tensor on its own numpy path and kept a hash of each one's bf16 bytes.
// The loader's dequantisation must equal that bitwise; the runtime on the FP8 checkpoint must give
// the logits it gives on the bf16 checkpoint built from those tensors; broken FP8 checkpoints are
// refused with a message that names what is wrong.
#include <gtest/gtest.h>
#include <json-c/json.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

extern "C" {
#include "kernels/backend.h"
#include "worker/loader/glm_config.h"
#include "worker/loader/safetensors.h"
#include "worker/model/glm/glm_model.h"
}
#include "tests/loader_test_util.h"

using loader_test::ReadFile;
using loader_test::TempDir;
using loader_test::WriteFile;

namespace {

const char *kDir = "tests/fixtures/fp8_a";

uint64_t Fnv1a64(const void *data, size_t n) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) h = (h ^ ((const uint8_t *)data)[i]) * 0x100000001b3ull;
    return h;
}

bool Contains(const std::string &s, const std::string &needle) { return s.find(needle) != std::string::npos; }

// Every tensor of archive ar, each through edit (which may rename it, change it or drop it by
// returning false), written with config text cfg into dir. FP8 tensors are dequantised to bf16
// when dequant is set (their scales then left out).
struct Tensor {
    std::string name;
    mt_dtype dtype;
    std::vector<int64_t> shape;
    std::vector<uint8_t> bytes;
};
void Rewrite(const st_archive *ar, const glm_quant &q, const std::string &dir, const std::string &cfg, bool dequant,
             const std::function<bool(Tensor *)> &edit = nullptr) {
    st_writer *w = st_writer_new();
    mt_error err{};
    for (size_t i = 0; i < st_count(ar); i++) {
        const st_tensor *t = st_at(ar, i);
        Tensor x{ t->name, t->dtype, std::vector<int64_t>(t->shape, t->shape + t->ndim),
                  std::vector<uint8_t>((const uint8_t *)t->data, (const uint8_t *)t->data + t->nbytes) };
        if (dequant && Contains(x.name, "_scale_inv")) continue;
        if (dequant && t->dtype == MT_F8E4M3) {
            const st_tensor *tw, *sc;
            ASSERT_EQ(st_get_weight(ar, t->name, t->ndim, t->shape, q.block_rows, q.block_cols, &tw, &sc, &err), MT_OK)
                << err.msg;
            x.dtype = MT_BF16;
            x.bytes.resize(t->nbytes * 2);
            ASSERT_EQ(st_dequant_fp8(tw, sc, q.block_rows, q.block_cols, 0, t->shape[0], 0, t->shape[1], MT_BF16,
                                     x.bytes.data(), &err), MT_OK) << err.msg;
        }
        if (edit && !edit(&x)) continue;
        ASSERT_EQ(st_writer_add(w, x.name.c_str(), x.dtype, (int)x.shape.size(), x.shape.data(), x.bytes.data(), &err),
                  MT_OK) << err.msg;
    }
    ASSERT_EQ(st_writer_save(w, dir.c_str(), 0, &err), MT_OK) << err.msg;
    st_writer_free(w);
    WriteFile(dir + "/config.json", cfg);
}

class Fp8 : public ::testing::Test {
  protected:
    void SetUp() override {
        mt_error err{};
        ASSERT_EQ(glm_config_load((std::string(kDir) + "/config.json").c_str(), &cfg_, &err), MT_OK) << err.msg;
        ASSERT_TRUE(cfg_.quant.fp8);
        ASSERT_EQ(st_open_dir(kDir, &ar_, &err), MT_OK) << err.msg;
        config_text_ = ReadFile(std::string(kDir) + "/config.json");
    }
    void TearDown() override { st_close(ar_); }
    glm_config cfg_;
    st_archive *ar_ = nullptr;
    std::string config_text_;
};

// The loader's dequantisation equals the script's numpy dequantisation, tensor by tensor, bitwise.
TEST_F(Fp8, LoaderDequantEqualsTheScriptsBitwise) {
    json_object *root = json_object_from_file((std::string(kDir) + "/dequant.json").c_str());
    ASSERT_NE(root, nullptr);
    json_object *tensors = nullptr, *bs = nullptr;
    ASSERT_TRUE(json_object_object_get_ex(root, "tensors", &tensors));
    ASSERT_TRUE(json_object_object_get_ex(root, "weight_block_size", &bs));
    EXPECT_EQ(json_object_get_int(json_object_array_get_idx(bs, 0)), cfg_.quant.block_rows);
    EXPECT_EQ(json_object_get_int(json_object_array_get_idx(bs, 1)), cfg_.quant.block_cols);
    int n_fp8 = 0, partial = 0;
    double worst_rel = 0;
    for (size_t i = 0; i < st_count(ar_); i++) {
        const st_tensor *t = st_at(ar_, i);
        if (t->dtype != MT_F8E4M3) continue;
        n_fp8++;
        json_object *e = nullptr, *h = nullptr, *rel = nullptr;
        ASSERT_TRUE(json_object_object_get_ex(tensors, t->name, &e)) << t->name;
        ASSERT_TRUE(json_object_object_get_ex(e, "fnv1a64_bf16", &h));
        ASSERT_TRUE(json_object_object_get_ex(e, "rel_err", &rel));
        worst_rel = std::fmax(worst_rel, json_object_get_double(rel));
        const st_tensor *w, *sc;
        mt_error err{};
        ASSERT_EQ(st_get_weight(ar_, t->name, t->ndim, t->shape, cfg_.quant.block_rows, cfg_.quant.block_cols, &w, &sc,
                                &err), MT_OK) << err.msg;
        partial += t->shape[0] % cfg_.quant.block_rows != 0 || t->shape[1] % cfg_.quant.block_cols != 0;
        std::vector<uint16_t> bf(t->nbytes);
        ASSERT_EQ(st_dequant_fp8(w, sc, cfg_.quant.block_rows, cfg_.quant.block_cols, 0, t->shape[0], 0, t->shape[1],
                                 MT_BF16, bf.data(), &err), MT_OK) << err.msg;
        char hex[24];
        snprintf(hex, sizeof hex, "%016llx", (unsigned long long)Fnv1a64(bf.data(), bf.size() * 2));
        EXPECT_STREQ(hex, json_object_get_string(h)) << t->name;
    }
    EXPECT_EQ(n_fp8, (int)json_object_object_length(tensors));
    EXPECT_GT(n_fp8, 100);
    EXPECT_GE(partial, 10) << "the fixture must exercise partial blocks";
    printf("fp8_a: %d FP8 tensors (%d with partial blocks) dequantised bitwise as numpy does; worst relative "
           "quantisation error against tiny_a %.3e\n", n_fp8, partial, worst_rel);
    json_object_put(root);
}

struct Case {
    std::vector<int32_t> tokens;
    int prompt_len = 0;
    std::vector<float> logits;  // tiny_a's transformers reference [T, V]
};

Case LoadTinyCase(int k) {
    Case c;
    st_archive *ar = nullptr;
    mt_error err{};
    const std::string path = "tests/fixtures/tiny_a/case_" + std::to_string(k) + ".safetensors";
    EXPECT_EQ(st_open_file(path.c_str(), &ar, &err), MT_OK) << err.msg;
    if (!ar) return c;
    const st_tensor *tok = st_find(ar, "tokens"), *pl = st_find(ar, "prompt_len"), *lg = st_find(ar, "logits");
    c.tokens.assign((const int32_t *)tok->data, (const int32_t *)tok->data + tok->shape[0]);
    c.prompt_len = *(const int32_t *)pl->data;
    c.logits.assign((const float *)lg->data, (const float *)lg->data + lg->shape[0] * lg->shape[1]);
    st_close(ar);
    return c;
}

// Prefill the prompt (all logits), then decode the rest of the tokens one at a time.
std::vector<float> TeacherForced(glm_model *m, const Case &c, int V) {
    std::vector<float> out(c.tokens.size() * V);
    glm_seq *s = nullptr;
    mt_error err{};
    EXPECT_EQ(glm_seq_new(m, (int)c.tokens.size(), &s, &err), MT_OK) << err.msg;
    EXPECT_EQ(glm_prefill(m, s, c.tokens.data(), c.prompt_len, out.data(), true, &err), MT_OK) << err.msg;
    for (size_t t = c.prompt_len; t < c.tokens.size(); t++)
        EXPECT_EQ(glm_decode(m, s, c.tokens[t], out.data() + t * V, &err), MT_OK) << err.msg;
    glm_seq_free(s);
    return out;
}

// The FP8 checkpoint gives the logits of its bf16 copy (made from the bitwise-checked tensors).
TEST_F(Fp8, LogitsEqualThoseOfTheDequantisedCheckpoint) {
    TempDir dir;
    glm_config plain = cfg_;
    plain.quant = glm_quant{};
    mt_error err{};
    const std::string cfg_path = dir.file("plain.json");
    ASSERT_EQ(glm_config_save(&plain, cfg_path.c_str(), &err), MT_OK) << err.msg;
    const std::string bf16_dir = dir.file("bf16");
    Rewrite(ar_, cfg_.quant, bf16_dir, ReadFile(cfg_path), true);
    mt_backend *be = mt_cpu_backend_new(0);
    glm_model *fp8 = nullptr, *bf16 = nullptr;
    ASSERT_EQ(glm_model_load(kDir, be, nullptr, &fp8, &err), MT_OK) << err.msg;
    ASSERT_EQ(glm_model_load(bf16_dir.c_str(), be, nullptr, &bf16, &err), MT_OK) << err.msg;
    const int V = glm_model_config(fp8)->vocab_size;
    for (int k = 0; k < 2; k++) {
        const Case c = LoadTinyCase(k);
        ASSERT_FALSE(c.tokens.empty());
        const std::vector<float> a = TeacherForced(fp8, c, V), b = TeacherForced(bf16, c, V);
        double worst = 0, cos_sum = 0, cos_min = 1;
        for (size_t i = 0; i < a.size(); i++) {
            ASSERT_TRUE(std::isfinite(a[i])) << i;
            worst = std::fmax(worst, std::fabs(a[i] - b[i]));
        }
        for (size_t t = 0; t < c.tokens.size(); t++) {
            double ab = 0, aa = 0, bb = 0;
            for (int v = 0; v < V; v++) {
                const double x = a[t * V + v], y = c.logits[t * V + v];
                ab += x * y, aa += x * x, bb += y * y;
            }
            const double cs = ab / std::sqrt(aa * bb);
            cos_sum += cs;
            cos_min = std::fmin(cos_min, cs);
        }
        EXPECT_LE(worst, 1e-6) << "case " << k;
        // Against tiny_a's unquantised transformers reference the quantisation error is left,
        // which a random tiny model amplifies (routing flips): a loose bound on the mean cosine
        // that catches a wrong scale or block, not a numerics check.
        const double cos_mean = cos_sum / c.tokens.size();
        EXPECT_GE(cos_mean, 0.9) << "case " << k;
        printf("fp8_a case %d: %zu positions, worst |logit diff| FP8 vs its bf16 copy %.2e; logit cosine vs tiny_a's "
               "unquantised reference mean %.4f, min %.4f\n", k, c.tokens.size(), worst, cos_mean, cos_min);
    }
    glm_model_free(fp8);
    glm_model_free(bf16);
    mt_backend_free(be);
}

// Broken FP8 checkpoints: refused at load, with the reason, and nothing left behind.
TEST_F(Fp8, BrokenCheckpointsAreRefused) {
    const std::string q = "model.language_model.layers.0.self_attn.q_proj.weight";
    std::string fp8_quant = "\"quant_method\": \"fp8\"";
    ASSERT_TRUE(Contains(config_text_, fp8_quant)) << config_text_;
    auto replaced = [&](const std::string &from, const std::string &to) {
        std::string s = config_text_;
        size_t at = s.find(from);
        EXPECT_NE(at, std::string::npos) << from;
        if (at != std::string::npos) s.replace(at, from.size(), to);
        return s;
    };
    const size_t qc = config_text_.find("\"quantization_config\"");
    const size_t qe = config_text_.find('}', qc);
    ASSERT_NE(qe, std::string::npos);
    std::string no_quant = config_text_;
    no_quant.erase(qc, qe + 2 - qc);  // the object and its comma
    struct {
        const char *what;
        std::string cfg;
        std::function<bool(Tensor *)> edit;
        mt_status st;
        std::string says;
    } cases[] = {
        { "missing scale", config_text_, [&](Tensor *t) { return t->name != q + "_scale_inv"; }, MT_ERR_NOT_FOUND,
          "tensor " + q + " is F8_E4M3 but its block scales " + q + "_scale_inv are missing" },
        { "scale of the wrong shape", config_text_,
          [&](Tensor *t) {
              if (t->name == q + "_scale_inv") t->shape = { 2, 4 }, t->bytes.resize(32);
              return true;
          },
          MT_ERR_INVALID, q + "_scale_inv has shape [2, 4], but " + q + " [64, 64] in blocks of 16 x 32" },
        { "unknown quant_method", replaced(fp8_quant, "\"quant_method\": \"awq\""), nullptr, MT_ERR_UNSUPPORTED,
          "quant_method \"awq\" is not supported" },
        { "block size that does not cover the scales", replaced("\"weight_block_size\": [\n      16,",
                                                                "\"weight_block_size\": [\n      32,"),
          nullptr, MT_ERR_INVALID, "in blocks of 32 x 32 (quantization_config.weight_block_size) needs" },
        { "no quantization_config", no_quant, nullptr, MT_ERR_INVALID,
          "is F8_E4M3 but config.json has no FP8 quantization_config" },
        { "FP8 in modules_to_not_convert", replaced("\"mlp.gate\"", "\"mlp.gate\", \"lm_head\""), nullptr,
          MT_ERR_INVALID, "tensor lm_head.weight is F8_E4M3 but config.json's modules_to_not_convert lists its module" },
        { "FP8 norm", config_text_,
          [&](Tensor *t) {
              if (t->name == "model.language_model.norm.weight") t->dtype = MT_F8E4M3, t->bytes.resize(64);
              return true;
          },
          MT_ERR_INVALID, "has dtype F8_E4M3, expected F32, F16 or BF16 (only linear weights may be FP8)" },
    };
    mt_backend *be = mt_cpu_backend_new(1);
    for (const auto &c : cases) {
        TempDir dir;
        Rewrite(ar_, cfg_.quant, dir.path(), c.cfg, false, c.edit);
        glm_model *m = (glm_model *)0x1;
        mt_error err{};
        EXPECT_EQ(glm_model_load(dir.path().c_str(), be, nullptr, &m, &err), c.st) << c.what << ": " << err.msg;
        EXPECT_EQ(m, nullptr) << c.what;
        EXPECT_TRUE(Contains(err.msg, c.says)) << c.what << ": " << err.msg;
        printf("%s: %s\n", c.what, err.msg);
    }
    mt_backend_free(be);
}

}  // namespace
