// The FP8 path of the whole model on the GPU (docs/DESIGN.md "FP8 weights on the GPU"): the fixture
// fp8_a re-blocked to 128 x 128 (the blocks GLM's FP8 checkpoints have, so the loader keeps the
// checkpoint's e4m3 bytes and scales as they are), loaded twice on the CUDA backend: as it comes
// (the dense projections and routed experts kept FP8, multiplied by cu_fp8_matmul and moe_experts'
// FP8 kernels) and with --dtype bf16
// (mt_model_params.dequant_fp8: every weight dequantised to bf16 at load, today's path). The two
// runs' logits are compared teacher-forced on tiny_a's cases. Skips without a GPU.
//
// What separates the two runs, and the bars that follow (model_fp8_test's GpuFp8NumericsEmulated
// replays both comparisons on the CPU with this GPU path's numerics and measures them):
//   Decode only (every token through glm_decode, one row a step: both runs on their GEMVs, fp32
//   activations). The FP8 run multiplies by e4m3 * scale exactly; the bf16 run by that product
//   rounded to bf16 (at most 2^-9 relative, RMS about 0.1% a weight), which moves each projection's
//   output by about as much. This random tiny model amplifies small changes (its routing flips):
//   emulated, 0.0062 and 0.0057 relative (||a - b|| / ||b|| over a case). Bar: 0.025.
//   Prefill only (every token of a case in one glm_prefill: more than 8 rows, so the FP8 run's
//   projections take cuBLASLt with activations quantised to e4m3 per 1 x 128 block). e4m3 rounds to
//   3 mantissa bits: a value in [2^e, 2^(e+1)) moves by up to 2^(e-4), uniformly, a relative RMS
//   of 2^-4 / sqrt(3) * sqrt(E[(2^e / x)^2]) = 2^-4 / sqrt(3) * sqrt(1/2) = 2.6% for values spread
//   over their octave, and each projection's output moves about that much; amplified alike:
//   emulated, 0.20 and 0.23. The GPU adds its own small differences (bf16 activations in the
//   other GEMMs, tensor-core summation order, which move some values across e4m3 rounding
//   boundaries). Bar: 0.45. A scale error measures 0.8 or more (model_fp8_test).
// The routed experts are FP8 in the FP8 run too (moe_experts on F8E4M3 experts): decode rows on the
// GEMV kernels (the shared expert fused as a slot, moe_experts_shared), case 0's 33 prefill rows on
// the grouped kernels (fp32 activations), case 1's 65 on cuBLASLt's FP8 GEMMs (x and h quantised
// per 1 x 128 block); emulated, the measures above become 0.0068 and 0.0060 (decode) and 0.20 and
// 0.24 (prefill), within the same bars.
// The runs are also checked to have taken their paths: the FP8 run placed FP8 weights
// (weight_fp8), multiplied by them on both paths (GEMV rows, cuBLASLt rows) and handed FP8 routed
// experts to moe_experts(_shared) at decode, decode-batch and prefill row counts; the bf16 run
// placed none and handed none.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

extern "C" {
#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "worker/loader/glm_config.h"
#include "worker/loader/safetensors.h"
#include "worker/model/glm/glm_model.h"
}
#include "tests/cuda_test_util.h"
#include "tests/fp8_reblock.h"
#include "tests/loader_test_util.h"

using loader_test::TempDir;

namespace {

// The CUDA backend with two slots wrapped to count what the model asks of it.
struct Counts {
    int fp8_weights = 0;       // weight_fp8 calls
    long fp8_few = 0;          // matmuls on an FP8 weight of at most 8 rows (the GEMV)
    long fp8_many = 0;         // ... of more rows (cuBLASLt)
    long moe_fp8_few = 0;      // moe_experts(_shared) calls on F8E4M3 experts, at most 4 rows (GEMV)
    long moe_fp8_mid = 0;      // ... 5 to 64 rows (grouped kernels)
    long moe_fp8_many = 0;     // ... more rows (cuBLASLt in the default numerics)
};
Counts g_counts;
mt_backend_ops g_inner;        // the backend's own table

mt_status CountWeightFp8(mt_backend *be, const uint8_t *q, const float *s, int64_t rows, int64_t cols, mt_weight *out) {
    g_counts.fp8_weights++;
    return g_inner.weight_fp8(be, q, s, rows, cols, out);
}
void CountMatmul(mt_backend *be, float *y, const float *x, const mt_weight *w, int n) {
    if (w->dtype == MT_F8E4M3) (n <= 8 ? g_counts.fp8_few : g_counts.fp8_many)++;
    g_inner.matmul(be, y, x, w, n);
}
void CountMatmulMulti(mt_backend *be, float *const *y, const float *x, const mt_weight *const *w, int count, int n,
                      unsigned mask) {
    for (int j = 0; j < count; j++)
        if (w[j]->dtype == MT_F8E4M3) (n <= 8 ? g_counts.fp8_few : g_counts.fp8_many)++;
    g_inner.matmul_multi(be, y, x, w, count, n, mask);
}

void CountMoe(const mt_expert *ex, int n) {
    if (ex[0].gate.dtype != MT_F8E4M3) return;
    (n <= 4 ? g_counts.moe_fp8_few : n <= 64 ? g_counts.moe_fp8_mid : g_counts.moe_fp8_many)++;
}
void CountMoeExperts(mt_backend *be, float *out, const float *x, const int32_t *idx, const float *w,
                     const mt_expert *ex, int n, int k, int H, int I, float L) {
    CountMoe(ex, n);
    g_inner.moe_experts(be, out, x, idx, w, ex, n, k, H, I, L);
}
bool CountMoeShared(mt_backend *be, float *out, const float *x, const int32_t *idx, const float *w,
                    const mt_expert *ex, const mt_expert *sh, int n, int k, int H, int I, float L) {
    const bool done = g_inner.moe_experts_shared(be, out, x, idx, w, ex, sh, n, k, H, I, L);
    if (done) CountMoe(ex, n); /* declined: the model calls moe_experts next, counted there */
    return done;
}

std::vector<int32_t> CaseTokens(int k) {
    st_archive *ar = nullptr;
    mt_error err{};
    const std::string path = "tests/fixtures/tiny_a/case_" + std::to_string(k) + ".safetensors";
    EXPECT_EQ(st_open_file(path.c_str(), &ar, &err), MT_OK) << err.msg;
    if (!ar) return {};
    const st_tensor *tok = st_find(ar, "tokens");
    std::vector<int32_t> t((const int32_t *)tok->data, (const int32_t *)tok->data + tok->shape[0]);
    st_close(ar);
    return t;
}

// Every token through glm_decode (the first through a one-row prefill): logits [T, V].
std::vector<float> DecodeOnly(glm_model *m, const std::vector<int32_t> &toks) {
    const int V = glm_model_config(m)->vocab_size, T = (int)toks.size();
    std::vector<float> out((size_t)T * V);
    glm_seq *s = nullptr;
    mt_error err{};
    EXPECT_EQ(glm_seq_new(m, T, &s, &err), MT_OK) << err.msg;
    EXPECT_EQ(glm_prefill(m, s, toks.data(), 1, out.data(), true, &err), MT_OK) << err.msg;
    for (int t = 1; t < T; t++) EXPECT_EQ(glm_decode(m, s, toks[t], out.data() + (size_t)t * V, &err), MT_OK) << err.msg;
    glm_seq_free(s);
    return out;
}

// Every token in one glm_prefill: logits [T, V].
std::vector<float> PrefillOnly(glm_model *m, const std::vector<int32_t> &toks) {
    const int V = glm_model_config(m)->vocab_size, T = (int)toks.size();
    std::vector<float> out((size_t)T * V);
    glm_seq *s = nullptr;
    mt_error err{};
    EXPECT_EQ(glm_seq_new(m, T, &s, &err), MT_OK) << err.msg;
    EXPECT_EQ(glm_prefill(m, s, toks.data(), T, out.data(), true, &err), MT_OK) << err.msg;
    glm_seq_free(s);
    return out;
}

// Relative error and the share of positions whose top-1 agrees, for the log.
void Report(const char *what, int k, const std::vector<float> &a, const std::vector<float> &b, int V, double err) {
    const size_t T = b.size() / V;
    size_t agree = 0;
    for (size_t t = 0; t < T; t++) {
        int ia = 0, ib = 0;
        for (int v = 0; v < V; v++) {
            if (a[t * V + v] > a[t * V + ia]) ia = v;
            if (b[t * V + v] > b[t * V + ib]) ib = v;
        }
        agree += ia == ib;
    }
    printf("[ metric   ] case %d %s: FP8 vs bf16 logits rel err %.4f, top-1 agreement %zu/%zu\n", k, what, err, agree, T);
}

TEST(ModelFp8Cuda, Fp8WeightsAgainstDequantisedBf16) {
    const std::string why = NoGpuReason();
    if (!why.empty()) GTEST_SKIP() << "no CUDA device: " << why;
    TempDir dir;
    const std::string ck = dir.file("fp8_128");
    fp8_test::Reblock128("tests/fixtures/fp8_a", ck);
    if (HasFatalFailure()) return;

    mt_error err{};
    mt_backend *be = mt_cuda_backend_new(0, nullptr, &err);
    ASSERT_NE(be, nullptr) << err.msg;
    ASSERT_NE(be->ops->weight_fp8, nullptr) << "the CUDA backend offers weight_fp8";
    g_inner = *be->ops;
    mt_backend_ops counting = g_inner;
    counting.weight_fp8 = CountWeightFp8;
    counting.matmul = CountMatmul;
    counting.matmul_multi = CountMatmulMulti;
    counting.moe_experts = CountMoeExperts;
    counting.moe_experts_shared = CountMoeShared;
    be->ops = &counting;

    glm_model_params fp8p = glm_model_default_params(), bf16p = glm_model_default_params();
    bf16p.dequant_fp8 = true;
    glm_model *fp8 = nullptr, *bf16 = nullptr;
    ASSERT_EQ(glm_model_load(ck.c_str(), be, &bf16p, &bf16, &err), MT_OK) << err.msg;
    EXPECT_EQ(g_counts.fp8_weights, 0) << "--dtype bf16 places no FP8 weight";
    ASSERT_EQ(glm_model_load(ck.c_str(), be, &fp8p, &fp8, &err), MT_OK) << err.msg;
    // KDA q, k, v, o and DSA q_a, q_b, kv_a, o in each of 4 layers, the dense MLPs' and the shared
    // experts' gate, up, down: 28; the routed experts' gate, up, down: 2 MoE layers of 16, 96 (kv_b,
    // the routers, lm_head stay bf16)
    EXPECT_EQ(g_counts.fp8_weights, 28 + 96);
    printf("[ metric   ] FP8 weights placed: %d\n", g_counts.fp8_weights);

    const int V = glm_model_config(fp8)->vocab_size;
    for (int k = 0; k < 2; k++) {
        const std::vector<int32_t> toks = CaseTokens(k);
        ASSERT_GT(toks.size(), 8u) << "prefill must exceed the GEMV's 8 rows";

        g_counts = Counts{g_counts.fp8_weights};
        const std::vector<float> a = DecodeOnly(fp8, toks);
        EXPECT_GT(g_counts.fp8_few, 0) << "the FP8 run's decode multiplies FP8 weights";
        EXPECT_GT(g_counts.moe_fp8_few, 0) << "the FP8 run's decode reads FP8 routed experts";
        const long moe_before = g_counts.moe_fp8_few + g_counts.moe_fp8_mid + g_counts.moe_fp8_many;
        const std::vector<float> b = DecodeOnly(bf16, toks);
        EXPECT_EQ(g_counts.moe_fp8_few + g_counts.moe_fp8_mid + g_counts.moe_fp8_many, moe_before)
            << "the bf16 run's experts are bf16";
        for (float v : a) ASSERT_TRUE(std::isfinite(v));
        const double e_dec = RelErr(a, b);
        Report("decode", k, a, b, V, e_dec);
        EXPECT_LE(e_dec, 0.025) << "case " << k << ", decode rows (GEMVs)";

        g_counts = Counts{g_counts.fp8_weights};
        const std::vector<float> c = PrefillOnly(fp8, toks);
        EXPECT_GT(g_counts.fp8_many, 0) << "the FP8 run's prefill multiplies FP8 weights on many rows";
        if (toks.size() > 64) EXPECT_GT(g_counts.moe_fp8_many, 0) << "case " << k << ": FP8 experts on cuBLASLt rows";
        else EXPECT_GT(g_counts.moe_fp8_mid, 0) << "case " << k << ": FP8 experts on the grouped kernels";
        const std::vector<float> d = PrefillOnly(bf16, toks);
        for (float v : c) ASSERT_TRUE(std::isfinite(v));
        const double e_pre = RelErr(c, d);
        Report("prefill", k, c, d, V, e_pre);
        EXPECT_LE(e_pre, 0.45) << "case " << k << ", prefill rows (cuBLASLt, e4m3 activations)";
    }
    glm_model_free(fp8);
    glm_model_free(bf16);
    be->ops = &g_inner; /* destroy through the backend's own table */
    mt_backend_free(be);
}

}  // namespace
