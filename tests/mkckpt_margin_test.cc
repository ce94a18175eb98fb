// tools/mkckpt --margin end to end (the real binary, runfiles path tools/mkckpt): the certificate
// in margin.json, an independent CPU run of its prompts (prefill, then one greedy decode at a time)
// with the gap recorder, determinism, and bad input.
#include <gtest/gtest.h>
#include <json-c/json.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <string>
#include <vector>

#include "tests/loader_test_util.h"

extern "C" {
#include "kernels/backend.h"
#include "worker/model/glm/glm_model.h"
}

namespace {

using loader_test::MkckptPath;
using loader_test::ReadFile;
using loader_test::TempDir;

// Runs mkckpt with args; returns its exit status and its stderr in *err_out.
int Mkckpt(const std::string &args, std::string *err_out, const TempDir &dir) {
    const std::string log = dir.file("stderr.txt");
    const std::string cmd = MkckptPath() + " " + args + " >/dev/null 2>" + log;
    const int rc = system(cmd.c_str());
    if (err_out) *err_out = ReadFile(log);
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

struct Certificate {
    double gap = 0;
    bool certified = false;
    double min_gap[MT_GAP_N] = {};
    std::vector<std::vector<int32_t>> prompts;
    int len = 0;
};

bool ReadCertificate(const std::string &path, Certificate *c) {
    json_object *o = json_object_from_file(path.c_str());
    if (!o) return false;
    json_object *v, *mg, *ps;
    bool ok = json_object_object_get_ex(o, "gap", &v) && (c->gap = json_object_get_double(v), true) &&
              json_object_object_get_ex(o, "certified", &v) && (c->certified = json_object_get_boolean(v), true) &&
              json_object_object_get_ex(o, "len", &v) && (c->len = json_object_get_int(v), true) &&
              json_object_object_get_ex(o, "min_gap", &mg) && json_object_object_get_ex(o, "prompts", &ps);
    const char *kinds[MT_GAP_N] = {"group", "expert", "pool"};
    for (int k = 0; ok && k < MT_GAP_N; k++) {
        ok = json_object_object_get_ex(mg, kinds[k], &v);
        c->min_gap[k] = v ? json_object_get_double(v) : INFINITY;
    }
    for (size_t i = 0; ok && i < json_object_array_length(ps); i++) {
        json_object *p = json_object_array_get_idx(ps, i);
        std::vector<int32_t> ids;
        for (size_t j = 0; j < json_object_array_length(p); j++)
            ids.push_back(json_object_get_int(json_object_array_get_idx(p, j)));
        c->prompts.push_back(ids);
    }
    json_object_put(o);
    return ok;
}

// The model in dir on the CPU: each prompt prefilled, then len greedy tokens one decode at a time,
// with the gap recorder on.
void RunGaps(const std::string &dir, const Certificate &c, mt_cpu_gaps *gaps) {
    mt_backend *be = mt_cpu_backend_new(0);
    ASSERT_NE(be, nullptr);
    glm_model *m = nullptr;
    mt_error err = {};
    ASSERT_EQ(glm_model_load(dir.c_str(), be, nullptr, &m, &err), MT_OK) << err.msg;
    const int V = glm_model_config(m)->vocab_size;
    std::vector<float> logits(V);
    mt_cpu_gaps_reset();
    mt_cpu_gaps_record(true);
    for (const auto &p : c.prompts) {
        glm_seq *s = nullptr;
        ASSERT_EQ(glm_seq_new(m, (int)p.size() + c.len, &s, &err), MT_OK) << err.msg;
        ASSERT_EQ(glm_prefill(m, s, p.data(), (int)p.size(), logits.data(), false, &err), MT_OK) << err.msg;
        for (int j = 0; j + 1 < c.len; j++)
            ASSERT_EQ(glm_decode(m, s, glm_argmax(logits.data(), V), logits.data(), &err), MT_OK) << err.msg;
        glm_seq_free(s);
    }
    mt_cpu_gaps_record(false);
    mt_cpu_gaps_get(gaps);
    glm_model_free(m);
    mt_backend_free(be);
}

TEST(MkckptMargin, TinyIsCertifiedAndTheCpuAgrees) {
    if (MkckptPath().empty()) GTEST_SKIP() << "tools/mkckpt not in runfiles";
    TempDir dir;
    const std::string out = dir.file("tiny");
    std::string log;
    ASSERT_EQ(Mkckpt("--preset tiny --seed 3 --out " + out + " --margin 0.05", &log, dir), 0) << log;
    Certificate c;
    ASSERT_TRUE(ReadCertificate(out + "/margin.json", &c)) << ReadFile(out + "/margin.json");
    EXPECT_TRUE(c.certified);
    EXPECT_DOUBLE_EQ(c.gap, 0.05);
    EXPECT_EQ(c.len, 64);
    ASSERT_EQ(c.prompts.size(), 10u);
    // Longer than index_topk (16), so the indexer drops pools within the prompt.
    for (const auto &p : c.prompts) EXPECT_GT(p.size(), 16u);
    for (int k = 0; k < MT_GAP_N; k++) EXPECT_GE(c.min_gap[k], 0.05) << "kind " << k;

    mt_cpu_gaps g;
    RunGaps(out, c, &g);
    for (int k = 0; k < MT_GAP_N; k++) {
        EXPECT_GT(g.count[k], 0) << "kind " << k << ": no choice was made, the check is empty";
        EXPECT_GE(g.min[k], 0.05) << "kind " << k;
    }

    // The same random checkpoint unshaped has near-ties on these prompts: the check can fail.
    const std::string raw = dir.file("raw");
    ASSERT_EQ(Mkckpt("--preset tiny --seed 3 --out " + raw, &log, dir), 0) << log;
    RunGaps(raw, c, &g);
    EXPECT_LT(g.min[MT_GAP_POOL], 0.05);
}

TEST(MkckptMargin, DeterministicForASeed) {
    if (MkckptPath().empty()) GTEST_SKIP() << "tools/mkckpt not in runfiles";
    TempDir dir;
    std::string log;
    for (const char *d : {"a", "b"})
        ASSERT_EQ(Mkckpt(std::string("--preset tiny --seed 5 --margin 0.03 --margin-prompts 4 --margin-len 24 --out ") +
                             dir.file(d),
                         &log, dir),
                  0)
            << log;
    for (const char *f : {"/margin.json", "/model.safetensors", "/config.json"}) {
        const std::string a = ReadFile(dir.file("a") + f), b = ReadFile(dir.file("b") + f);
        EXPECT_FALSE(a.empty()) << f;
        EXPECT_TRUE(a == b) << f << " differs between two runs of one seed";
    }
    Certificate c;
    ASSERT_TRUE(ReadCertificate(dir.file("a") + "/margin.json", &c));
    EXPECT_TRUE(c.certified);
    EXPECT_EQ(c.prompts.size(), 4u);
    EXPECT_EQ(c.len, 24);
}

TEST(MkckptMargin, RejectsBadFlags) {
    if (MkckptPath().empty()) GTEST_SKIP() << "tools/mkckpt not in runfiles";
    TempDir dir;
    const std::string out = " --out " + dir.file("x");
    struct {
        const char *args, *says;
    } cases[] = {
        {"--preset tiny --margin -1", "--margin must be a number in (0, 1)"},
        {"--preset tiny --margin 0", "--margin must be a number in (0, 1)"},
        {"--preset tiny --margin nan", "--margin must be a number in (0, 1)"},
        {"--preset tiny --margin 0.1x", "--margin must be a number in (0, 1)"},
        {"--preset tiny --margin 0.05 --margin-prompts 0", "--margin-prompts must be in 1..1000"},
        {"--preset tiny --margin 0.05 --margin-len -3", "--margin-len must be in 1..4096"},
        {"--preset tiny --margin-len 8", "need --margin"},
        {"--preset bench-4L --margin 0.05", "above its 4 GB limit"},
    };
    for (const auto &k : cases) {
        std::string log;
        EXPECT_EQ(Mkckpt(std::string(k.args) + out, &log, dir), 2) << k.args;
        EXPECT_NE(log.find(k.says), std::string::npos) << k.args << ": " << log;
        EXPECT_NE(access(dir.file("x/model.safetensors").c_str(), F_OK), 0) << k.args << " wrote a checkpoint";
    }
}

}  // namespace
