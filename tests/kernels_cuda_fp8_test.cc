// tests/kernels_cuda_fp8_test.cc: block-scaled FP8 weights on the CUDA backend
// (kernels/cuda/cuda_fp8.cu): weight_fp8, weight_fp8_from and the matmul of such weights, on
// random e4m3 weights with a different random scale per 128 x 128 block (so a scale read from the
// wrong block, or a transposed scale layout, moves results by up to 1000x), rows and columns that
// are and are not multiples of 128 (partial blocks), and M = 1, 7, 64, 300, 4096 rows; then
// moe_experts on FP8 experts (see the section below) and its timings at the real shapes against
// bf16 experts. Skips when no CUDA device is usable (CI and dev hosts have the toolkit but no GPU).
//
// References, computed on the host in double from the dequantised weight W = e4m3(q) * scale:
//   exact:    y = x . W^T with the fp32 activations;
//   emulated: the same with x replaced by its device quantisation, replayed on the host: per 1 x 128
//             block of a row, s = amax / 448 (1 for zeros), x ~ e4m3(x / s) * s, rounded to
//             nearest even and saturated at 448 (mt_f32_to_f8e4m3, the rounding of
//             __nv_cvt_float_to_fp8(..., __NV_SATFINITE, __NV_E4M3)).
// Bars, per element, in terms of a(m, n) = sum_k |x[m,k] W[n,k]| (the scale of the rounding errors
// any order of summation makes):
//   the GEMV (cu_fp8_gemv; fp32 sums of the same fp32 products): 2e-5 a against exact (fp32
//     accumulation over K <= 4096 in another order, ~sqrt(K) * 6e-8 typical);
//   cuBLASLt (cu_fp8_gemm_lt) against emulated: 1e-3 a + 4e-3 |y| (the tensor cores' FP8 products
//     are exact, their partial sums are promoted to fp32 at every 128-block, about 2^-14 relative
//     before; 4e-3 |y| covers a bf16 output should cuBLASLt offer no fp32 one);
//   the matmul op against exact, whichever path it takes: the bound e4m3 activation rounding can
//     reach, 2^-4 a (round to nearest with 3 mantissa bits: at most half a unit, 1/16 of a value's
//     power of two) plus sum_k |W[n,k]| * 2^-10 s(m, k) (the absolute step of the subnormals, for
//     values below 2^-6 s), plus the tensor-core slack above.
#include <gtest/gtest.h>

#include "tests/cuda_test_util.h"

#include <cuda_runtime_api.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "common/mt.h"
#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_ops.h"

namespace {

constexpr int kB = 128;

// A random FP8 weight [N, K]: e4m3 codes of N(0,1)-ish values (never NaN) and one scale a block,
// uniform in [2^-10, 2^0) on a log scale.
struct HostFp8 {
    int N, K;
    std::vector<uint8_t> q;     // [N, K]
    std::vector<float> scale;   // [ceil(N / 128), ceil(K / 128)]
    std::vector<double> w;      // [N, K] dequantised
};

HostFp8 MakeWeight(int N, int K, uint64_t seed) {
    Rng r(seed);
    HostFp8 h{N, K, std::vector<uint8_t>((size_t)N * K), {}, std::vector<double>((size_t)N * K)};
    const int rb = (N + kB - 1) / kB, cb = (K + kB - 1) / kB;
    h.scale.resize((size_t)rb * cb);
    for (float &s : h.scale) s = std::ldexp(1.f, -10) * std::pow(2.f, r.Uniform(0.f, 10.f));
    for (int i = 0; i < N; i++)
        for (int k = 0; k < K; k++) {
            const float v = r.Uniform(-1.f, 1.f) * r.Uniform(0.f, 300.f);
            const uint8_t b = mt_f32_to_f8e4m3(v);
            h.q[(size_t)i * K + k] = b;
            h.w[(size_t)i * K + k] = (double)mt_f8e4m3_to_f32(b) * h.scale[(size_t)(i / kB) * cb + k / kB];
        }
    return h;
}

// Activations [M, K]: uniform [-1, 1), each 128-block of a row scaled by its own factor in
// [1e-3, 10], so the per-block activation scales differ.
std::vector<float> MakeX(int M, int K, uint64_t seed) {
    Rng r(seed);
    std::vector<float> x((size_t)M * K);
    for (int m = 0; m < M; m++)
        for (int kb = 0; kb * kB < K; kb++) {
            const float f = std::pow(10.f, r.Uniform(-3.f, 1.f));
            for (int k = kb * kB; k < K && k < (kb + 1) * kB; k++) x[(size_t)m * K + k] = r.Uniform(-1.f, 1.f) * f;
        }
    return x;
}

// The device's quantisation of x (cuda_fp8.cu, fp8_quant_kernel) replayed: the dequantised values,
// and each element's block scale s.
void QuantiseX(const std::vector<float> &x, int M, int K, std::vector<double> *xq, std::vector<float> *s) {
    xq->assign((size_t)M * K, 0.0);
    s->assign((size_t)M * K, 0.f);
    for (int m = 0; m < M; m++)
        for (int k0 = 0; k0 < K; k0 += kB) {
            const int k1 = k0 + kB < K ? k0 + kB : K;
            float amax = 0.f;
            for (int k = k0; k < k1; k++) amax = std::fmax(amax, std::fabs(x[(size_t)m * K + k]));
            const float sc = amax > 0.f ? amax / 448.f : 1.f;
            for (int k = k0; k < k1; k++) {
                const uint8_t b = mt_f32_to_f8e4m3(x[(size_t)m * K + k] / sc);
                (*xq)[(size_t)m * K + k] = (double)mt_f8e4m3_to_f32(b) * sc;
                (*s)[(size_t)m * K + k] = sc;
            }
        }
}

struct Refs {
    std::vector<double> exact, emul, abs_sum, sub_slack;  // [M, N] each
};

Refs Reference(const HostFp8 &w, const std::vector<float> &x, int M) {
    const int N = w.N, K = w.K;
    std::vector<double> xq;
    std::vector<float> s;
    QuantiseX(x, M, K, &xq, &s);
    Refs r{std::vector<double>((size_t)M * N), std::vector<double>((size_t)M * N), std::vector<double>((size_t)M * N),
           std::vector<double>((size_t)M * N)};
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            double e = 0, q = 0, a = 0, sub = 0;
            const double *wr = &w.w[(size_t)n * K];
            const float *xr = &x[(size_t)m * K];
            for (int k = 0; k < K; k++) {
                e += (double)xr[k] * wr[k];
                q += xq[(size_t)m * K + k] * wr[k];
                a += std::fabs((double)xr[k] * wr[k]);
                sub += std::fabs(wr[k]) * std::ldexp((double)s[(size_t)m * K + k], -10);
            }
            const size_t i = (size_t)m * N + n;
            r.exact[i] = e;
            r.emul[i] = q;
            r.abs_sum[i] = a;
            r.sub_slack[i] = sub;
        }
    return r;
}

class CudaFp8 : public ::testing::Test {
  protected:
    static void SetUpTestSuite() {
        if (!NoGpuReason().empty()) return;
        mt_error err{};
        gpu_ = mt_cuda_backend_new(0, nullptr, &err); /* the default numerics: prefill on cuBLASLt */
        if (!gpu_) gpu_err_ = err.msg;
    }
    static void TearDownTestSuite() {
        mt_backend_free(gpu_);
        gpu_ = nullptr;
    }
    void SetUp() override {
        const std::string why = NoGpuReason();
        if (!why.empty()) GTEST_SKIP() << "no CUDA device: " << why;
        ASSERT_NE(gpu_, nullptr) << gpu_err_;
    }

    mt_weight Upload(const HostFp8 &h) {
        mt_weight w{};
        EXPECT_EQ(gpu_->ops->weight_fp8(gpu_, h.q.data(), h.scale.data(), h.N, h.K, &w), MT_OK);
        EXPECT_EQ(w.dtype, MT_F8E4M3);
        EXPECT_NE(w.scale, nullptr);
        return w;
    }
    float *Dev(const std::vector<float> &v) {
        float *p = (float *)gpu_->ops->alloc(gpu_, sizeof(float) * (v.empty() ? 1 : v.size()));
        gpu_->ops->upload(gpu_, p, v.data(), sizeof(float) * v.size());
        return p;
    }
    std::vector<float> Host(const float *p, size_t n) {
        std::vector<float> v(n);
        gpu_->ops->download(gpu_, v.data(), p, sizeof(float) * n);
        return v;
    }

    static mt_backend *gpu_;
    static std::string gpu_err_;
};
mt_backend *CudaFp8::gpu_ = nullptr;
std::string CudaFp8::gpu_err_;

// (N, K): whole blocks; partial blocks both ways; K below one block; N not a multiple of 4 (the
// weight's rows are padded to whole blocks on the device, so cuBLASLt takes every shape).
const int kShapes[][2] = {{256, 512}, {200, 300}, {136, 1000}, {64, 96}, {130, 256}};
const int kRows[] = {1, 7, 64, 300, 4096};

TEST_F(CudaFp8, GemvMatchesDequantisedProduct) {
    Worst worst{"fp8 gemv"};
    uint64_t seed = 11;
    for (const auto &sh : kShapes) {
        const int N = sh[0], K = sh[1];
        const HostFp8 h = MakeWeight(N, K, seed++);
        mt_weight w = Upload(h);
        for (int M : kRows) {
            const std::string where = Shape({{"N", N}, {"K", K}, {"M", M}});
            const std::vector<float> x = MakeX(M, K, seed++);
            const Refs r = Reference(h, x, M);
            float *dx = Dev(x), *dy = Dev(std::vector<float>((size_t)M * N, NAN));
            ASSERT_EQ(cu_fp8_gemv((cu_backend *)gpu_, dy, dx, &w, M), MT_OK) << where;
            const std::vector<float> y = Host(dy, (size_t)M * N);
            size_t bad = 0;
            double worst_rel = 0;
            for (size_t i = 0; i < y.size(); i++) {
                const double d = std::fabs((double)y[i] - r.exact[i]), bar = 2e-5 * r.abs_sum[i] + 1e-30;
                if (!(d <= bar) && bad++ < 3) ADD_FAILURE() << where << " at " << i << ": " << y[i] << " vs " << r.exact[i];
                worst_rel = std::fmax(worst_rel, d / (r.abs_sum[i] + 1e-30));
            }
            EXPECT_EQ(bad, 0u) << where;
            worst.See(worst_rel, where);
            gpu_->ops->free(gpu_, dx);
            gpu_->ops->free(gpu_, dy);
        }
        gpu_->ops->weight_free(gpu_, &w);
    }
}

TEST_F(CudaFp8, CublasLtMatchesEmulatedQuantisation) {
    Worst worst{"fp8 cublaslt"};
    uint64_t seed = 101;
    for (const auto &sh : kShapes) {
        const int N = sh[0], K = sh[1];
        const HostFp8 h = MakeWeight(N, K, seed++);
        mt_weight w = Upload(h);
        for (int M : kRows) {
            const std::string where = Shape({{"N", N}, {"K", K}, {"M", M}});
            const std::vector<float> x = MakeX(M, K, seed++);
            float *dx = Dev(x), *dy = Dev(std::vector<float>((size_t)M * N, NAN));
            const mt_status st = cu_fp8_gemm_lt((cu_backend *)gpu_, dy, dx, &w, M);
            // No algorithm here is a finding (the layout this backend builds is refused), not a skip.
            ASSERT_EQ(st, MT_OK) << where << ": cuBLASLt refused the block-scaled FP8 GEMM (see the log)";
            const Refs r = Reference(h, x, M);
            const std::vector<float> y = Host(dy, (size_t)M * N);
            size_t bad = 0;
            double worst_rel = 0;
            for (size_t i = 0; i < y.size(); i++) {
                const double d = std::fabs((double)y[i] - r.emul[i]);
                const double bar = 1e-3 * r.abs_sum[i] + 4e-3 * std::fabs(r.emul[i]) + 1e-30;
                if (!(d <= bar) && bad++ < 3)
                    ADD_FAILURE() << where << " at (" << i / N << ", " << i % N << "): " << y[i] << " vs emulated "
                                  << r.emul[i] << " (exact " << r.exact[i] << ")";
                worst_rel = std::fmax(worst_rel, d / (r.abs_sum[i] + 1e-30));
            }
            EXPECT_EQ(bad, 0u) << where;
            worst.See(worst_rel, where);
            gpu_->ops->free(gpu_, dx);
            gpu_->ops->free(gpu_, dy);
        }
        gpu_->ops->weight_free(gpu_, &w);
    }
}

// The backend's matmul on an F8E4M3 weight, whichever path it picks (GEMV up to 8 rows, cuBLASLt
// above), within what e4m3 activation rounding can reach of the exact product.
TEST_F(CudaFp8, MatmulWithinActivationRoundingOfExact) {
    Worst worst{"fp8 matmul"};
    uint64_t seed = 1001;
    for (const auto &sh : kShapes) {
        const int N = sh[0], K = sh[1];
        const HostFp8 h = MakeWeight(N, K, seed++);
        mt_weight w = Upload(h);
        for (int M : kRows) {
            const std::string where = Shape({{"N", N}, {"K", K}, {"M", M}});
            const std::vector<float> x = MakeX(M, K, seed++);
            const Refs r = Reference(h, x, M);
            float *dx = Dev(x), *dy = Dev(std::vector<float>((size_t)M * N, NAN));
            gpu_->ops->matmul(gpu_, dy, dx, &w, M);
            const std::vector<float> y = Host(dy, (size_t)M * N);
            size_t bad = 0;
            for (size_t i = 0; i < y.size(); i++) {
                const double d = std::fabs((double)y[i] - r.exact[i]);
                const double bar = (0.0625 + 1e-3) * r.abs_sum[i] + r.sub_slack[i] + 4e-3 * std::fabs(r.exact[i]) + 1e-30;
                if (!(d <= bar) && bad++ < 3) ADD_FAILURE() << where << " at " << i << ": " << y[i] << " vs " << r.exact[i];
            }
            EXPECT_EQ(bad, 0u) << where;
            worst.See(RelErr(y, std::vector<float>(r.exact.begin(), r.exact.end())), where);
            gpu_->ops->free(gpu_, dx);
            gpu_->ops->free(gpu_, dy);
        }
        gpu_->ops->weight_free(gpu_, &w);
    }
}

// matmul_multi over FP8 and bf16 weights of the same columns, with a sigmoid on one: each output as
// its own matmul (and sigmoid) gives, bit for bit (the same kernels run either way).
TEST_F(CudaFp8, MatmulMultiMixesFp8AndBf16) {
    const int K = 192, N0 = 128, N1 = 96;
    const HostFp8 h = MakeWeight(N0, K, 7);
    mt_weight w8 = Upload(h);
    Rng r(8);
    std::vector<uint16_t> wb((size_t)N1 * K);
    for (uint16_t &b : wb) b = mt_f32_to_bf16(r.Uniform(-0.1f, 0.1f));
    mt_weight w16{};
    ASSERT_EQ(gpu_->ops->weight(gpu_, wb.data(), MT_BF16, N1, K, &w16), MT_OK);
    for (int M : {3, 64}) {
        const std::string where = Shape({{"M", M}});
        const std::vector<float> x = MakeX(M, K, 9 + M);
        float *dx = Dev(x);
        float *y[2] = {Dev(std::vector<float>((size_t)M * N0)), Dev(std::vector<float>((size_t)M * N1))};
        float *z[2] = {Dev(std::vector<float>((size_t)M * N0)), Dev(std::vector<float>((size_t)M * N1))};
        const mt_weight *ws[2] = {&w8, &w16};
        gpu_->ops->matmul_multi(gpu_, y, dx, ws, 2, M, 1u << 1);
        gpu_->ops->matmul(gpu_, z[0], dx, &w8, M);
        gpu_->ops->matmul(gpu_, z[1], dx, &w16, M);
        gpu_->ops->sigmoid(gpu_, z[1], (int64_t)M * N1);
        for (int j = 0; j < 2; j++) {
            const size_t n = (size_t)M * (j ? N1 : N0);
            EXPECT_EQ(Host(y[j], n), Host(z[j], n)) << where << " output " << j;
            gpu_->ops->free(gpu_, y[j]);
            gpu_->ops->free(gpu_, z[j]);
        }
        gpu_->ops->free(gpu_, dx);
    }
    gpu_->ops->weight_free(gpu_, &w8);
    gpu_->ops->weight_free(gpu_, &w16);
}

// weight_fp8_from (the benchmarks' FP8 models): a bf16 weight quantised on the device equals the
// host's quantisation of the same values, code for code and scale for scale (amax / 448 per
// 128 x 128 block, nearest-even e4m3: exact operations both sides), in the padded layout
// (cuda_ops.h): zeros and unit scales in the padding.
TEST_F(CudaFp8, WeightFromBf16MatchesHostQuantisation) {
    for (const auto &sh : {std::pair<int, int>{200, 300}, {130, 1000}, {256, 512}}) {
        const int N = sh.first, K = sh.second;
        const std::string where = Shape({{"N", N}, {"K", K}});
        Rng r((uint64_t)N * 7 + K);
        std::vector<uint16_t> wb((size_t)N * K);
        for (uint16_t &b : wb) b = mt_f32_to_bf16(r.Uniform(-1.f, 1.f) * r.Uniform(0.f, 3.f));
        mt_weight src{}, w{};
        ASSERT_EQ(gpu_->ops->weight(gpu_, wb.data(), MT_BF16, N, K, &src), MT_OK);
        ASSERT_EQ(gpu_->ops->weight_fp8_from(gpu_, &src, &w), MT_OK) << where;
        ASSERT_EQ(w.dtype, MT_F8E4M3);
        const int64_t np = cu_fp8_rpad(N), kp = cu_fp8_kpad(K), sld = kp / kB;
        std::vector<uint8_t> q((size_t)(np * kp));
        std::vector<float> sc((size_t)(np / kB * sld));
        gpu_->ops->download(gpu_, q.data(), w.data, q.size());
        gpu_->ops->download(gpu_, sc.data(), w.scale, sizeof(float) * sc.size());
        size_t bad = 0;
        for (int64_t bi = 0; bi < np / kB; bi++)
            for (int64_t bj = 0; bj < sld; bj++) {
                float amax = 0.f;
                for (int64_t i = bi * kB; i < (bi + 1) * kB && i < N; i++)
                    for (int64_t k = bj * kB; k < (bj + 1) * kB && k < K; k++)
                        amax = std::fmax(amax, std::fabs(mt_bf16_to_f32(wb[(size_t)(i * K + k)])));
                const float want_s = amax > 0.f ? amax / 448.f : 1.f;
                if (sc[(size_t)(bi * sld + bj)] != want_s && bad++ < 3)
                    ADD_FAILURE() << where << " scale of block (" << bi << ", " << bj << "): "
                                  << sc[(size_t)(bi * sld + bj)] << " vs " << want_s;
                for (int64_t i = bi * kB; i < (bi + 1) * kB; i++)
                    for (int64_t k = bj * kB; k < (bj + 1) * kB; k++) {
                        const uint8_t want = i < N && k < K ? mt_f32_to_f8e4m3(mt_bf16_to_f32(wb[(size_t)(i * K + k)]) / want_s) : 0;
                        if (q[(size_t)(i * kp + k)] != want && bad++ < 3)
                            ADD_FAILURE() << where << " code at (" << i << ", " << k << "): " << (int)q[(size_t)(i * kp + k)]
                                          << " vs " << (int)want;
                    }
            }
        EXPECT_EQ(bad, 0u) << where;
        gpu_->ops->weight_free(gpu_, &w);
        gpu_->ops->weight_free(gpu_, &src);
    }
}

// ---- moe_experts on F8E4M3 experts (kernels/cuda/cuda_moe.cu, cuda_moe_grouped.cu) ----
//
// Random FP8 experts whose block scales are powers of two (2^-4 .. 2^-9, a different one a block,
// so a scale read from the wrong block or the wrong stride moves results by up to 32x): e4m3 times
// such a scale has at most 4 significant bits and is exact in bf16, so the same experts dequantised
// to bf16 are the same matrices, and the bf16 path on them is a reference with nothing rounded
// differently in the weights. Three references:
//   the bf16 path (moe_experts on the dequantised bf16 experts) on the GPU;
//   exact: the host in double (x and h as fp32 values, no activation rounding);
//   emulated: the host with x and h = swiglu(gate x, up x) quantised to e4m3 per 1 x 128 block
//     (QuantiseX's replay of the device quantisation), the FP8 prefill path's numerics.
// Bars (||got - want|| / ||want|| over the output):
//   few rows and decode batches (the GEMV and grouped kernels, fp32 activations; and every row
//     count in the exact mode): 1e-5 against exact and against the bf16 path (fp32 sums of the same
//     products in another order, K <= 256), 5e-5 against the bf16 path's many rows in the exact
//     mode (its tensor cores take x and h in two bf16 parts: 16 significant bits, ~2e-6 relative
//     each, DESIGN.md "Numerics");
//   many rows in the default mode (cuBLASLt's FP8 GEMMs): 1e-2 against emulated (the GEMMs' own
//     rounding, ~2^-14 relative before each 128-block's promotion to fp32, puts about one value
//     of h in 2^11 on the other side of an e4m3 rounding boundary from the host's, moving it by up
//     to 1/16: ~1e-3 over the output on these sizes), and 0.12 against the bf16 path (x and h each
//     rounded to 3 mantissa bits, ~2.6% RMS each (model_fp8_cuda_test's derivation), through two
//     products: ~3.7% RMS expected, the bf16 path's own rounding of x 0.2%; a scale or segment
//     error measures 0.5 and more).
struct HostExperts {
    int E, H, I;
    std::vector<HostFp8> w;  // [3 E]: gate, up, down of expert e at 3e + 0, 1, 2
};

HostFp8 MakePow2Weight(int N, int K, uint64_t seed) {
    Rng r(seed);
    HostFp8 h{N, K, std::vector<uint8_t>((size_t)N * K), {}, std::vector<double>((size_t)N * K)};
    const int rb = (N + kB - 1) / kB, cb = (K + kB - 1) / kB;
    h.scale.resize((size_t)rb * cb);
    for (float &s : h.scale) s = std::ldexp(1.f, -4 - (int)(r.Next() % 6));
    for (int i = 0; i < N; i++)
        for (int k = 0; k < K; k++) {
            const uint8_t b = mt_f32_to_f8e4m3(r.Uniform(-1.f, 1.f) * 64.f / std::sqrt((float)K));
            h.q[(size_t)i * K + k] = b;
            h.w[(size_t)i * K + k] = (double)mt_f8e4m3_to_f32(b) * h.scale[(size_t)(i / kB) * cb + k / kB];
        }
    return h;
}

HostExperts MakeHostExperts(int E, int H, int I, uint64_t seed) {
    HostExperts ex{E, H, I, {}};
    for (int e = 0; e < E; e++) {
        ex.w.push_back(MakePow2Weight(I, H, seed + 3 * e));
        ex.w.push_back(MakePow2Weight(I, H, seed + 3 * e + 1));
        ex.w.push_back(MakePow2Weight(H, I, seed + 3 * e + 2));
    }
    return ex;
}

// x . W^T of one row, in double.
std::vector<double> RowProduct(const HostFp8 &w, const double *x) {
    std::vector<double> y((size_t)w.N);
    for (int n = 0; n < w.N; n++) {
        double s = 0;
        for (int k = 0; k < w.K; k++) s += w.w[(size_t)n * w.K + k] * x[k];
        y[(size_t)n] = s;
    }
    return y;
}

// out0 + sum_k wts * expert(x) per row (and the shared expert first when given), on the host; emulate:
// x and h quantised as the FP8 prefill path quantises them.
std::vector<float> MoeReference(const HostExperts &ex, const HostExperts *shared, const std::vector<float> &out0,
                                const std::vector<float> &x, const std::vector<int32_t> &idx,
                                const std::vector<float> &wts, int n, int k, float L, bool emulate) {
    const int H = ex.H, I = ex.I;
    std::vector<double> xd((size_t)n * H);
    if (emulate) {
        std::vector<float> s;
        QuantiseX(x, n, H, &xd, &s);
    } else {
        for (size_t i = 0; i < xd.size(); i++) xd[i] = x[i];
    }
    std::vector<float> out(out0);
    for (int i = 0; i < n; i++) {
        std::vector<double> sum((size_t)H, 0.0);
        auto expert = [&](const HostFp8 *m, double wt) {
            const std::vector<double> g = RowProduct(m[0], &xd[(size_t)i * H]), u = RowProduct(m[1], &xd[(size_t)i * H]);
            std::vector<float> hf((size_t)I);
            for (int j = 0; j < I; j++) {
                const float gv = std::fmin((float)g[(size_t)j], L), uv = std::fmin(std::fmax((float)u[(size_t)j], -L), L);
                hf[(size_t)j] = gv / (1.f + std::exp(-gv)) * uv;
            }
            std::vector<double> hd((size_t)I);
            if (emulate) {
                std::vector<float> s;
                QuantiseX(hf, 1, I, &hd, &s);
            } else {
                for (int j = 0; j < I; j++) hd[(size_t)j] = hf[(size_t)j];
            }
            const std::vector<double> d = RowProduct(m[2], hd.data());
            for (int c = 0; c < H; c++) sum[(size_t)c] += wt * d[(size_t)c];
        };
        if (shared) expert(&shared->w[0], 1.0);
        for (int j = 0; j < k; j++) expert(&ex.w[(size_t)3 * idx[(size_t)i * k + j]], wts[(size_t)i * k + j]);
        for (int c = 0; c < H; c++) out[(size_t)i * H + c] = (float)(out0[(size_t)i * H + c] + sum[(size_t)c]);
    }
    return out;
}

// The experts on a backend twice: F8E4M3 (weight_fp8) and their bf16 dequantisation (exact, see above).
struct DevExperts {
    mt_backend *be;
    std::vector<mt_weight> w8, w16;
    std::vector<mt_expert> fp8, bf16;
    DevExperts(mt_backend *b, const HostExperts &h) : be(b) {
        for (const HostFp8 &m : h.w) {
            mt_weight a{}, c{};
            EXPECT_EQ(be->ops->weight_fp8(be, m.q.data(), m.scale.data(), m.N, m.K, &a), MT_OK);
            std::vector<uint16_t> b16(m.w.size());
            for (size_t i = 0; i < b16.size(); i++) {
                b16[i] = mt_f32_to_bf16((float)m.w[i]);
                EXPECT_EQ((double)mt_bf16_to_f32(b16[i]), m.w[i]) << "a power-of-two scale keeps e4m3 exact in bf16";
            }
            EXPECT_EQ(be->ops->weight(be, b16.data(), MT_BF16, m.N, m.K, &c), MT_OK);
            w8.push_back(a);
            w16.push_back(c);
        }
        for (size_t e = 0; e + 2 < w8.size(); e += 3) {
            fp8.push_back({w8[e], w8[e + 1], w8[e + 2]});
            bf16.push_back({w16[e], w16[e + 1], w16[e + 2]});
        }
    }
    ~DevExperts() {
        for (mt_weight &w : w8) be->ops->weight_free(be, &w);
        for (mt_weight &w : w16) be->ops->weight_free(be, &w);
    }
};

class CudaMoeFp8 : public CudaFp8 {
  protected:
    // moe_experts (or moe_experts_shared when shared) on be over the given experts; out starts at out0.
    std::vector<float> Run(mt_backend *be, const std::vector<mt_expert> &ex, const mt_expert *shared,
                           const std::vector<float> &out0, const std::vector<float> &x, const std::vector<int32_t> &idx,
                           const std::vector<float> &wts, int n, int k, int H, int I, float L) {
        auto put = [&](const void *h, size_t bytes) {
            void *p = be->ops->alloc(be, bytes);
            be->ops->upload(be, p, h, bytes);
            return p;
        };
        float *dout = (float *)put(out0.data(), sizeof(float) * out0.size());
        float *dx = (float *)put(x.data(), sizeof(float) * x.size());
        float *dw = (float *)put(wts.data(), sizeof(float) * wts.size());
        int32_t *di = (int32_t *)put(idx.data(), sizeof(int32_t) * idx.size());
        if (shared)
            EXPECT_TRUE(be->ops->moe_experts_shared(be, dout, dx, di, dw, ex.data(), shared, n, k, H, I, L))
                << "FP8 routed and shared experts of one shape fuse on the GEMV path";
        else
            be->ops->moe_experts(be, dout, dx, di, dw, ex.data(), n, k, H, I, L);
        std::vector<float> out(out0.size());
        be->ops->download(be, out.data(), dout, sizeof(float) * out.size());
        for (void *p : {(void *)dout, (void *)dx, (void *)dw, (void *)di}) be->ops->free(be, p);
        EXPECT_EQ(((cu_backend *)be)->sticky, MT_OK) << "a CUDA op failed (see the log)";
        return out;
    }
};

struct MoeShape {
    int E, k, H, I;
};
// The fixture's shape (fp8_a: 16 experts of 32, hidden 64, top-4); whole 128-blocks; partial
// blocks with H and I off the 16-element loads (the element-wise kernels).
const MoeShape kMoeShapes[] = {{16, 4, 64, 32}, {16, 4, 256, 128}, {8, 2, 200, 72}};

// Few rows (GEMV kernels, 1-4), decode batches (grouped, 5-64), many rows (cuBLASLt) in the default
// numerics; every row count in the exact numerics (the fp32-activation kernels throughout).
TEST_F(CudaMoeFp8, ExpertsMatchBf16PathAndHost) {
    mt_error err{};
    const mt_cuda_params ex_params = ExactParams();
    mt_backend *exact = mt_cuda_backend_new(0, &ex_params, &err);
    ASSERT_NE(exact, nullptr) << err.msg;
    Worst w_fp32{"fp8 moe fp32-x"}, w_lt{"fp8 moe lt"}, w_lt_bf16{"fp8 moe lt/bf16"};
    uint64_t seed = 5000;
    for (const MoeShape &s : kMoeShapes) {
        const HostExperts hx = MakeHostExperts(s.E, s.H, s.I, seed);
        seed += 100;
        DevExperts dflt(gpu_, hx), ex(exact, hx);
        for (int n : {1, 3, 8, 33, 100, 300}) {
            const float L = n % 2 ? 10.f : 0.75f;
            const std::string where = Shape({{"E", s.E}, {"k", s.k}, {"H", s.H}, {"I", s.I}, {"n", n}});
            const std::vector<float> x = MakeX(n, s.H, seed++), out0 = MakeX(n, s.H, seed++);
            const std::vector<int32_t> idx = DistinctIdx(seed++, n, s.k, s.E);
            std::vector<float> wts((size_t)n * s.k);
            Rng r(seed++);
            for (float &v : wts) v = r.Uniform(0.05f, 1.f);
            const std::vector<float> exact_ref = MoeReference(hx, nullptr, out0, x, idx, wts, n, s.k, L, false);
            // the exact mode: fp32 activations at every row count
            const std::vector<float> e8 = Run(exact, ex.fp8, nullptr, out0, x, idx, wts, n, s.k, s.H, s.I, L);
            const std::vector<float> e16 = Run(exact, ex.bf16, nullptr, out0, x, idx, wts, n, s.k, s.H, s.I, L);
            EXPECT_LE(RelErr(e8, exact_ref), 1e-5) << where << " exact mode vs host";
            EXPECT_LE(RelErr(e8, e16), n <= CU_MOE_GROUPED_MAX_ROWS ? 1e-5 : 5e-5) << where << " exact mode vs the bf16 path";
            w_fp32.See(RelErr(e8, exact_ref), where + " exact mode");
            // the default mode
            const std::vector<float> d8 = Run(gpu_, dflt.fp8, nullptr, out0, x, idx, wts, n, s.k, s.H, s.I, L);
            const std::vector<float> d16 = Run(gpu_, dflt.bf16, nullptr, out0, x, idx, wts, n, s.k, s.H, s.I, L);
            for (float v : d8) ASSERT_TRUE(std::isfinite(v)) << where;
            if (n <= CU_MOE_GROUPED_MAX_ROWS) {
                EXPECT_LE(RelErr(d8, exact_ref), 1e-5) << where << " vs host";
                EXPECT_LE(RelErr(d8, d16), 1e-5) << where << " vs the bf16 path";
                w_fp32.See(RelErr(d8, exact_ref), where);
            } else {
                const std::vector<float> emul = MoeReference(hx, nullptr, out0, x, idx, wts, n, s.k, L, true);
                EXPECT_LE(RelErr(d8, emul), 1e-2) << where << " cuBLASLt path vs host emulation";
                EXPECT_LE(RelErr(d8, d16), 0.12) << where << " cuBLASLt path vs the bf16 path";
                w_lt.See(RelErr(d8, emul), where);
                w_lt_bf16.See(RelErr(d8, d16), where);
            }
        }
    }
    mt_backend_free(exact);
}

// The shared expert as one more slot of the GEMV kernels (moe_experts_shared), FP8 like the routed.
TEST_F(CudaMoeFp8, SharedExpertFusedOnGemv) {
    Worst worst{"fp8 moe shared"};
    uint64_t seed = 9000;
    for (const MoeShape &s : kMoeShapes) {
        const HostExperts hx = MakeHostExperts(s.E, s.H, s.I, seed), hs = MakeHostExperts(1, s.H, s.I, seed + 50);
        seed += 100;
        DevExperts dx(gpu_, hx), ds(gpu_, hs);
        for (int n : {1, 4}) {
            const std::string where = Shape({{"E", s.E}, {"k", s.k}, {"H", s.H}, {"I", s.I}, {"n", n}});
            const std::vector<float> x = MakeX(n, s.H, seed++), out0((size_t)n * s.H, NAN);  // out is overwritten
            const std::vector<int32_t> idx = DistinctIdx(seed++, n, s.k, s.E);
            std::vector<float> wts((size_t)n * s.k);
            Rng r(seed++);
            for (float &v : wts) v = r.Uniform(0.05f, 1.f);
            const std::vector<float> zero((size_t)n * s.H, 0.f);
            const std::vector<float> ref = MoeReference(hx, &hs, zero, x, idx, wts, n, s.k, 10.f, false);
            const std::vector<float> got = Run(gpu_, dx.fp8, &ds.fp8[0], out0, x, idx, wts, n, s.k, s.H, s.I, 10.f);
            EXPECT_LE(RelErr(got, ref), 1e-5) << where;
            worst.See(RelErr(got, ref), where);
        }
    }
}

// Timings at the real shapes (hidden 4096, 288 experts of 2048, top-8; random bf16 experts and
// their FP8 quantisation, weight_fp8_from), moe_experts on each at decode, decode-batch and prefill
// row counts, with the bytes of the experts the rows touch (bf16: 2 a weight; FP8: 1 a weight and
// 4 a 128 x 128 block) against the device's copy bandwidth. Prints; asserts only that both run and
// agree to the weights' e4m3 rounding (~2.6% RMS a weight, so ~3% of the output; on cuBLASLt rows
// x and h rounded besides: ~5%; bar 0.15).
TEST_F(CudaMoeFp8, TimingRealShapes) {
    const int E = 288, k = 8, H = 4096, I = 2048;
    std::vector<mt_weight> w16, w8;
    for (int e = 0; e < E; e++)
        for (int m = 0; m < 3; m++) {
            const int64_t rows = m < 2 ? I : H, cols = m < 2 ? H : I;
            mt_weight a{}, b{};
            ASSERT_EQ(gpu_->ops->weight_random(gpu_, MT_BF16, rows, cols, 31337u * (3 * e + m) + 1, 0.f,
                                               1.f / std::sqrt((float)cols), &a), MT_OK);
            ASSERT_EQ(gpu_->ops->weight_fp8_from(gpu_, &a, &b), MT_OK);
            w16.push_back(a);
            w8.push_back(b);
        }
    std::vector<mt_expert> ex16, ex8;
    for (int e = 0; e < E; e++) {
        ex16.push_back({w16[3 * e], w16[3 * e + 1], w16[3 * e + 2]});
        ex8.push_back({w8[3 * e], w8[3 * e + 1], w8[3 * e + 2]});
    }
    const size_t cbytes = (size_t)2 << 30;
    void *csrc = gpu_->ops->alloc(gpu_, cbytes), *cdst = gpu_->ops->alloc(gpu_, cbytes);
    ASSERT_TRUE(csrc && cdst);
    auto seconds = [] { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); };
    auto time_gpu = [&](const std::function<void()> &f, int reps) {
        f();
        gpu_->ops->sync(gpu_);
        const double t0 = seconds();
        for (int r = 0; r < reps; r++) f();
        gpu_->ops->sync(gpu_);
        return (seconds() - t0) / reps;
    };
    const double tc = time_gpu([&] { gpu_->ops->copy(gpu_, cdst, csrc, cbytes); }, 5);
    const double copy_bw = 2.0 * cbytes / tc;
    printf("[ timing   ] device copy 2 GiB: %.3f ms, %.0f GB/s (read + write)\n", tc * 1e3, copy_bw / 1e9);
    gpu_->ops->free(gpu_, csrc);
    gpu_->ops->free(gpu_, cdst);
    const double blocks = (double)((I + 127) / 128) * ((H + 127) / 128);
    for (int n : {1, 4, 32, 64, 512, 4096}) {
        const std::vector<int32_t> idx = DistinctIdx(4242u + n, n, k, E);
        const size_t touched = std::set<int32_t>(idx.begin(), idx.end()).size();
        const double b16 = (double)touched * 3 * H * I * 2, b8 = (double)touched * 3 * ((double)H * I + 4 * blocks);
        const std::vector<float> x = MakeX(n, H, 77u + n);
        std::vector<float> wts((size_t)n * k);
        Rng r(99u + n);
        for (float &v : wts) v = r.Uniform(0.05f, 1.f);
        float *dx = Dev(x), *dw = Dev(wts), *o16 = Dev(std::vector<float>((size_t)n * H, 0.f));
        float *o8 = Dev(std::vector<float>((size_t)n * H, 0.f));
        int32_t *di = (int32_t *)gpu_->ops->alloc(gpu_, sizeof(int32_t) * idx.size());
        gpu_->ops->upload(gpu_, di, idx.data(), sizeof(int32_t) * idx.size());
        gpu_->ops->moe_experts(gpu_, o16, dx, di, dw, ex16.data(), n, k, H, I, 10.f);
        gpu_->ops->moe_experts(gpu_, o8, dx, di, dw, ex8.data(), n, k, H, I, 10.f);
        const double e = RelErr(Host(o8, (size_t)n * H), Host(o16, (size_t)n * H));
        EXPECT_LE(e, 0.15) << "n=" << n << ": FP8 experts against the bf16 ones they were quantised from";
        // as if moe_route had written idx (the engine's case): the decode paths never read it back
        cu_backend *cub = (cu_backend *)gpu_;
        cub->route_idx = di;
        cub->route_len = (int64_t)n * k;
        cub->route_experts = E;
        const int reps = n >= 512 ? 3 : 20;
        const double t16 = time_gpu([&] { gpu_->ops->moe_experts(gpu_, o16, dx, di, dw, ex16.data(), n, k, H, I, 10.f); }, reps);
        const double t8 = time_gpu([&] { gpu_->ops->moe_experts(gpu_, o8, dx, di, dw, ex8.data(), n, k, H, I, 10.f); }, reps);
        const double flops = 2.0 * n * k * 3 * (double)H * I;
        printf("[ timing   ] n=%4d top-8 of 288, 4096x2048: %3zu experts touched; bf16 %.3f ms (%.2f GB, %.0f%% of copy, "
               "%.0f TFLOP/s), FP8 %.3f ms (%.2f GB, %.0f%% of copy, %.0f TFLOP/s): FP8/bf16 time %.2f; rel diff %.3f\n",
               n, touched, t16 * 1e3, b16 / 1e9, 100 * b16 / t16 / copy_bw, flops / t16 / 1e12, t8 * 1e3, b8 / 1e9,
               100 * b8 / t8 / copy_bw, flops / t8 / 1e12, t8 / t16, e);
        cub->route_idx = nullptr;
        if (n == 4096) { // where the FP8 prefill's time goes, each op synchronised
            mt_cuda_profile(gpu_, true, nullptr);
            gpu_->ops->moe_experts(gpu_, o8, dx, di, dw, ex8.data(), n, k, H, I, 10.f);
            mt_cuda_profile(gpu_, false, "moe_experts FP8 n=4096");
        }
        for (void *p : {(void *)dx, (void *)dw, (void *)o16, (void *)o8, (void *)di}) gpu_->ops->free(gpu_, p);
    }
    for (mt_weight &w : w16) gpu_->ops->weight_free(gpu_, &w);
    for (mt_weight &w : w8) gpu_->ops->weight_free(gpu_, &w);
}

}  // namespace
