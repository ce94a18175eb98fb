// tests/verify_check.h: one check of the speculative verify entry (glm_decode_verify: k rows of
// one sequence through the graph runner and each layer's decode_batched) shared by the CPU and
// GPU model tests, so both backends are held to the same contract.
#ifndef MT_TESTS_VERIFY_CHECK_H
#define MT_TESTS_VERIFY_CHECK_H

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "worker/model/glm/glm_model.h"

// For k = 2 .. 5 (rows that cross indexer pool boundaries), on a fresh twin pair of sequences
// with the same prompt: k single decodes of greedy tokens on one, then one verify of those k
// tokens on the other. The verify's k rows of logits equal the singles' (the same greedy token
// at every row, logits within rel_tol of the largest), both sequences are then at the same
// length, and a following single decode on each agrees as well (the state each left is the same).
// A verify is repeated for a second round on the same sequences, so a graph of k rows, captured
// on its second use, replays. Bad input (k out of range, a bad token, no room) is refused with
// the sequence unchanged.
inline void CheckVerifyEqualsSingles(glm_model *m, const char *name, double rel_tol) {
    const int V = glm_model_config(m)->vocab_size;
    mt_error err{};
    double worst = 0;
    for (int k = 2; k <= 5; k++) {
        glm_seq *a = nullptr, *b = nullptr;
        std::vector<int32_t> p;
        for (int i = 0; i < 5 + 3 * k; i++) p.push_back((i * 29 + k * 11 + 1) % V);
        ASSERT_EQ(glm_seq_new(m, 96, &a, &err), MT_OK) << err.msg;
        ASSERT_EQ(glm_seq_new(m, 96, &b, &err), MT_OK) << err.msg;
        std::vector<float> la(V), lb(V);
        ASSERT_EQ(glm_prefill(m, a, p.data(), (int)p.size(), la.data(), false, &err), MT_OK) << err.msg;
        ASSERT_EQ(glm_prefill(m, b, p.data(), (int)p.size(), lb.data(), false, &err), MT_OK) << err.msg;
        for (int round = 0; round < 3; round++) {
            std::vector<int32_t> toks;
            std::vector<float> singles;
            for (int i = 0; i < k; i++) {
                toks.push_back(glm_argmax(la.data(), V));
                ASSERT_EQ(glm_decode(m, a, toks.back(), la.data(), &err), MT_OK) << err.msg;
                singles.insert(singles.end(), la.begin(), la.end());
            }
            std::vector<float> ver((size_t)k * V);
            ASSERT_EQ(glm_decode_verify(m, b, toks.data(), k, ver.data(), &err), MT_OK) << name << " k=" << k << ": "
                                                                                       << err.msg;
            ASSERT_EQ(glm_seq_len(a), glm_seq_len(b)) << name << " k=" << k;
            for (int i = 0; i < k; i++) {
                const float *s = singles.data() + (size_t)i * V, *v = ver.data() + (size_t)i * V;
                double mx = 0, d = 0;
                for (int t = 0; t < V; t++) {
                    mx = std::fmax(mx, std::fabs(s[t]));
                    d = std::fmax(d, std::fabs(s[t] - v[t]));
                }
                worst = std::fmax(worst, d / mx);
                EXPECT_EQ(glm_argmax(s, V), glm_argmax(v, V)) << name << " k=" << k << " round " << round << " row " << i;
            }
            lb.assign(ver.end() - V, ver.end());
        }
        // after the verifies both continue alike
        const int32_t next = glm_argmax(la.data(), V);
        ASSERT_EQ(glm_decode(m, a, next, la.data(), &err), MT_OK) << err.msg;
        ASSERT_EQ(glm_decode(m, b, next, lb.data(), &err), MT_OK) << err.msg;
        double mx = 0, d = 0;
        for (int t = 0; t < V; t++) {
            mx = std::fmax(mx, std::fabs(la[t]));
            d = std::fmax(d, std::fabs(la[t] - lb[t]));
        }
        worst = std::fmax(worst, d / mx);
        // refused input changes nothing
        const int len = glm_seq_len(b);
        std::vector<int32_t> bad(GLM_VERIFY_MAX + 1, 1);
        EXPECT_EQ(glm_decode_verify(m, b, bad.data(), GLM_VERIFY_MAX + 1, nullptr, &err), MT_ERR_INVALID);
        bad[1] = V;
        EXPECT_EQ(glm_decode_verify(m, b, bad.data(), 2, nullptr, &err), MT_ERR_INVALID);
        EXPECT_EQ(glm_seq_len(b), len);
        glm_seq_free(a);
        glm_seq_free(b);
    }
    glm_seq *tiny = nullptr;
    ASSERT_EQ(glm_seq_new(m, 4, &tiny, &err), MT_OK);
    const int32_t five[5] = {1, 2, 3, 4, 5};
    ASSERT_EQ(glm_prefill(m, tiny, five, 2, nullptr, false, &err), MT_OK);
    EXPECT_EQ(glm_decode_verify(m, tiny, five, 3, nullptr, &err), MT_ERR_FULL);
    EXPECT_EQ(glm_seq_len(tiny), 2);
    glm_seq_free(tiny);
    EXPECT_LE(worst, rel_tol) << name;
    printf("%s: verify of k = 2..5 rows vs k single decodes, worst |diff| / max|logit| %.2e\n", name, worst);
}

#endif  // MT_TESTS_VERIFY_CHECK_H
