// tests/cuda_scale_test.cc: mt_cuda_scale against a CPU loop. Skips when no CUDA device is usable
// (CI and dev hosts have the toolkit but no GPU); the argument checks run everywhere.
#include <gtest/gtest.h>

#include "tests/cuda_test_util.h"

#include <cuda_runtime_api.h>

#include <string>
#include <vector>

#include "kernels/cuda/scale.h"

namespace {


class CudaScale : public ::testing::Test {
  protected:
    void SetUp() override {
        std::string why = NoGpuReason();
        if (!why.empty()) GTEST_SKIP() << "no CUDA GPU on this host (" << why << "); skipping";
    }
};

// Runs y = a * x on the device; in_place makes y and x the same buffer.
std::vector<float> RunScale(const std::vector<float> &x, float a, bool in_place) {
    size_t n = x.size(), bytes = n * sizeof(float);
    float *dx = nullptr, *dy = nullptr;
    EXPECT_EQ(cudaMalloc((void **)&dx, bytes), cudaSuccess);
    if (!in_place) EXPECT_EQ(cudaMalloc((void **)&dy, bytes), cudaSuccess);
    else dy = dx;
    EXPECT_EQ(cudaMemcpy(dx, x.data(), bytes, cudaMemcpyHostToDevice), cudaSuccess);
    EXPECT_EQ(mt_cuda_scale(dy, dx, a, n, 0), MT_OK);
    std::vector<float> y(n);
    EXPECT_EQ(cudaMemcpy(y.data(), dy, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
    if (!in_place) cudaFree(dy);
    cudaFree(dx);
    return y;
}

TEST(CudaScaleArgs, RejectsNullAndAcceptsEmpty) {
    float v = 0.0f;
    EXPECT_EQ(mt_cuda_scale(nullptr, &v, 2.0f, 1, 0), MT_ERR_INVALID);
    EXPECT_EQ(mt_cuda_scale(&v, nullptr, 2.0f, 1, 0), MT_ERR_INVALID);
    EXPECT_EQ(mt_cuda_scale(nullptr, nullptr, 2.0f, 0, 0), MT_OK);
}

TEST_F(CudaScale, MatchesCpuLoop) {
    // Sizes around the block (256) and past the grid cap (65536 blocks) so threads loop.
    for (size_t n : {size_t{1}, size_t{255}, size_t{256}, size_t{257}, size_t{100003},
                     size_t{65536} * 256 + 7}) {
        for (bool in_place : {false, true}) {
            std::vector<float> x(n);
            for (size_t i = 0; i < n; i++) x[i] = (float)((i * 7919) % 2001) * 0.01f - 10.0f;
            const float a = -1.75f;
            std::vector<float> y = RunScale(x, a, in_place);
            size_t bad = 0;
            for (size_t i = 0; i < n; i++) {
                float want = a * x[i];
                if (y[i] != want && bad++ < 5)
                    ADD_FAILURE() << "n=" << n << " in_place=" << in_place << " y[" << i
                                  << "]=" << y[i] << " want " << want;
            }
            EXPECT_EQ(bad, 0u) << "n=" << n << " in_place=" << in_place;
        }
    }
}

}  // namespace
