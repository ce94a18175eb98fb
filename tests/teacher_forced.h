// tests/teacher_forced.h: the teacher-forced run the GPU model and numerics tests compare with the
// CPU's (model_cuda_test.cc, numerics_cuda_test.cc).
#ifndef MT_TESTS_TEACHER_FORCED_H
#define MT_TESTS_TEACHER_FORCED_H

#include <gtest/gtest.h>

#include <vector>

#include "worker/model/glm/glm_model.h"

// Prefills the first half of toks, decodes the rest one at a time; the logits of every position
// [T, V]. On the GPU the prefill rows take the tensor-core GEMMs, the decode rows the GEMVs.
inline std::vector<float> TeacherForced(glm_model *m, const std::vector<int32_t> &toks) {
    const int V = glm_model_config(m)->vocab_size, T = (int)toks.size(), P = T / 2;
    std::vector<float> out((size_t)T * V);
    glm_seq *s = nullptr;
    mt_error err{};
    EXPECT_EQ(glm_seq_new(m, T, &s, &err), MT_OK) << err.msg;
    EXPECT_EQ(glm_prefill(m, s, toks.data(), P, out.data(), true, &err), MT_OK) << err.msg;
    for (int t = P; t < T; t++) EXPECT_EQ(glm_decode(m, s, toks[t], out.data() + (size_t)t * V, &err), MT_OK) << err.msg;
    glm_seq_free(s);
    return out;
}

#endif  // MT_TESTS_TEACHER_FORCED_H
