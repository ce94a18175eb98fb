// What the MTP tests share (tests/model_mtp_test.cc on the CPU, tests/spec_cuda_test.cc on the
// GPU): reading a tensor of tests/fixtures/mtp_a's cases, and the worst difference of two logit
// rows.
#ifndef MT_TESTS_MTP_FIXTURE_H
#define MT_TESTS_MTP_FIXTURE_H

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

extern "C" {
#include "worker/loader/safetensors.h"
}

// The whole of tensor name in ar, as T values; empty (and a test failure) when missing.
template <typename T>
std::vector<T> TakeTensor(st_archive *ar, const char *name) {
    const st_tensor *t = st_find(ar, name);
    EXPECT_NE(t, nullptr) << name;
    if (!t) return {};
    const T *p = static_cast<const T *>(t->data);
    return std::vector<T>(p, p + t->nbytes / sizeof(T));
}

inline float MaxAbsDiff(const float *a, const float *b, int n) {
    float d = 0;
    for (int i = 0; i < n; i++) d = std::max(d, std::fabs(a[i] - b[i]));
    return d;
}

#endif  // MT_TESTS_MTP_FIXTURE_H
