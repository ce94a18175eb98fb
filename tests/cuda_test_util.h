// tests/cuda_test_util.h: what the CUDA test files share: whether a GPU is usable (CI hosts have
// the toolkit but no GPU, and the tests skip there saying why) and the relative error measure.
#ifndef MT_TESTS_CUDA_TEST_UTIL_H
#define MT_TESTS_CUDA_TEST_UTIL_H

#include <cuda_runtime_api.h>

#include <cmath>
#include <string>
#include <vector>

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

#endif  // MT_TESTS_CUDA_TEST_UTIL_H
