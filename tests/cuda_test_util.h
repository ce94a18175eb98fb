// tests/cuda_test_util.h: what the CUDA test files share: whether a GPU is usable (CI hosts have
// the toolkit but no GPU, and the tests skip there saying why), the relative error measure, a
// seeded random stream, the per-test worst-error report and case labels.
#ifndef MT_TESTS_CUDA_TEST_UTIL_H
#define MT_TESTS_CUDA_TEST_UTIL_H

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

extern "C" {
#include "kernels/cuda/cuda_backend.h"
}

// The backend params of the exact numerics mode (MT_NUMERICS_EXACT, x in two 16-bit parts): the
// kernel and fixture tests that compare with the CPU's fp32 at the strict bar run in it. The
// default mode (bf16 activations rounded once) is checked against the CPU on margin models.
// The exact numerics with the MoE's row classes of the other modes (moe_exact_grouped false), so
// that tests of the tensor-core MoE paths reach them in the exact mode too; the product's exact
// mode takes the grouped kernels at every row count.
inline mt_cuda_params ExactParams() {
    mt_cuda_params p = mt_cuda_default_params();
    p.numerics = MT_NUMERICS_EXACT;
    p.moe_exact_grouped = false;
    return p;
}

// Empty when a CUDA device is usable, else why not.
inline std::string NoGpuReason() {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) return std::string("cudaGetDeviceCount: ") + cudaGetErrorString(e);
    if (n == 0) return "cudaGetDeviceCount found 0 devices";
    return "";
}

// ||got - want|| / ||want|| (plain ||got - want|| when want is all zeros).
inline double RelErr(const std::vector<float> &got, const std::vector<float> &want) {
    double num = 0, den = 0;
    for (size_t i = 0; i < want.size(); i++) {
        const double d = (double)got[i] - want[i];
        num += d * d;
        den += (double)want[i] * want[i];
    }
    return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// splitmix64: a stream of uniform floats in [lo, hi), never exactly 0.
struct Rng {
    uint64_t s;
    explicit Rng(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 1) {}
    uint64_t Next() {
        uint64_t z = (s += 0x9E3779B97F4A7C15ull);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        return z ^ (z >> 31);
    }
    float Uniform(float lo, float hi) {
        float v = lo + (hi - lo) * (float)((Next() >> 40) * (1.0 / 16777216.0));
        return v == 0.f ? (hi - lo) * 1e-3f : v;
    }
};

// n rows of k distinct experts each, uniform over [0, E) (k <= E), from Rng(seed).
inline std::vector<int32_t> DistinctIdx(uint64_t seed, int n, int k, int E) {
    Rng r(seed);
    std::vector<int32_t> idx((size_t)n * k);
    for (int i = 0; i < n; i++)
        for (int j = 0; j < k; j++) {
            int32_t e;
            bool dup;
            do {
                e = (int32_t)(r.Next() % E);
                dup = false;
                for (int q = 0; q < j; q++) dup |= idx[(size_t)i * k + q] == e;
            } while (dup);
            idx[(size_t)i * k + j] = e;
        }
    return idx;
}

// Worst relative error seen by one test, printed at its end.
struct Worst {
    std::string op;
    double err = 0;
    std::string where;
    void See(double e, const std::string &w) {
        if (e >= err) { err = e; where = w; }
    }
    ~Worst() {
        if (!op.empty()) std::printf("[ metric   ] %-14s worst rel err %.3g at %s\n", op.c_str(), err, where.c_str());
    }
};

// "k=v k=v ...": the shape of a case, for messages.
inline std::string Shape(std::initializer_list<std::pair<const char *, long long>> kv) {
    std::string s;
    for (auto &p : kv) {
        if (!s.empty()) s += " ";
        s += p.first + std::string("=") + std::to_string(p.second);
    }
    return s;
}

#endif  // MT_TESTS_CUDA_TEST_UTIL_H
