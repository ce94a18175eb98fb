// tests/run_ahead_check.h: one check of glm_decode_greedy shared by the CPU and GPU model tests
// (model_layer_test.cc, model_cuda_test.cc), so both backends are held to the same contract.
#ifndef MT_TESTS_RUN_AHEAD_CHECK_H
#define MT_TESTS_RUN_AHEAD_CHECK_H

#include <gtest/gtest.h>

#include <vector>

#include "kernels/backend.h"
#include "worker/model/glm/glm_model.h"

// Greedy steps run ahead (each step after the first takes its tokens from the device, and the
// host reads step k's tokens only after step k + 1 is queued) give the tokens of the plain path
// (glm_decode_multi, then glm_last_argmax) on twin sequences, step for step, over steps that
// cross bucket sizes when graphs are on; flip_graphs: graphs go off for step 3 and on again for
// step 4 inside the chain, so a pass changes its row count (bucket of 8, then 5 rows, then 8) and
// must take the chain's tokens from the ticket. The device chain refuses other sequences, another
// order, or a sequence decoded alone since; a ticket MT_TICKETS steps old can no longer be read.
inline void CheckRunAhead(glm_model *m, const char *name, bool flip_graphs = false) {
    const int V = glm_model_config(m)->vocab_size, nq = 5, steps = 12;
    ASSERT_GE(glm_model_ahead_rows(m), nq) << name;
    mt_error err{};
    glm_seq *a[nq], *b[nq];
    std::vector<int32_t> ta(nq), tb(nq), got(nq);
    for (int q = 0; q < nq; q++) {
        std::vector<int32_t> p;
        for (int i = 0; i < 3 + 4 * q; i++) p.push_back((i * 31 + q * 17 + 5) % V);
        ASSERT_EQ(glm_seq_new(m, 64, &a[q], &err), MT_OK) << err.msg;
        ASSERT_EQ(glm_seq_new(m, 64, &b[q], &err), MT_OK) << err.msg;
        ASSERT_EQ(glm_prefill(m, a[q], p.data(), (int)p.size(), nullptr, false, &err), MT_OK) << err.msg;
        ASSERT_EQ(glm_prefill(m, b[q], p.data(), (int)p.size(), nullptr, false, &err), MT_OK) << err.msg;
        ta[q] = tb[q] = (q * 13 + 2) % V;
    }
    // the plain path first (a batched decode between greedy steps would take the device's table)
    std::vector<std::vector<int32_t>> ref(steps);
    for (int t = 0; t < steps; t++) {
        const int n = t < 6 ? nq : nq - 2; // the batch shrinks once: the chain restarts from the host
        ASSERT_EQ(glm_decode_multi(m, b, tb.data(), n, nullptr, &err), MT_OK) << err.msg;
        ASSERT_EQ(glm_last_argmax(m, n, tb.data()), MT_OK);
        ref[t].assign(tb.begin(), tb.begin() + n);
    }
    int64_t first = -1, prev = -1;
    for (int t = 0; t < steps; t++) {
        const int n = t < 6 ? nq : nq - 2;
        const bool restart = t == 0 || t == 6;
        if (flip_graphs && (t == 3 || t == 4)) glm_model_set_decode_graphs(m, t == 4);
        int64_t ticket = -1;
        ASSERT_EQ(glm_decode_greedy(m, a, restart ? ta.data() : nullptr, n, &ticket, &err), MT_OK)
            << name << " step " << t << ": " << err.msg;
        if (t == 0) first = ticket;
        if (!restart) { // step t - 1's tokens, read after step t was queued
            ASSERT_EQ(glm_greedy_tokens(m, prev, got.data(), n), MT_OK);
            for (int q = 0; q < n; q++) EXPECT_EQ(got[q], ref[t - 1][q]) << name << " step " << t - 1 << " row " << q;
        }
        if (t == 5) { // the restart's tokens, from the host
            ASSERT_EQ(glm_greedy_tokens(m, ticket, ta.data(), n), MT_OK);
            for (int q = 0; q < n; q++) EXPECT_EQ(ta[q], ref[5][q]) << name << " step 5 row " << q;
        }
        prev = ticket;
    }
    ASSERT_EQ(glm_greedy_tokens(m, prev, got.data(), nq - 2), MT_OK);
    for (int q = 0; q < nq - 2; q++) EXPECT_EQ(got[q], ref[steps - 1][q]) << name << " last step, row " << q;
    EXPECT_EQ(glm_greedy_tokens(m, first, got.data(), nq), MT_ERR_STATE) << name;
    // after a plain batched decode the device's tokens are not the chain's any more
    ASSERT_EQ(glm_decode_multi(m, b, tb.data(), nq - 2, nullptr, &err), MT_OK) << err.msg;
    int64_t ticket = -1;
    EXPECT_EQ(glm_decode_greedy(m, a, nullptr, nq - 2, &ticket, &err), MT_ERR_INVALID) << name;
    ASSERT_EQ(glm_decode_greedy(m, a, tb.data(), nq - 2, &ticket, &err), MT_OK) << err.msg;
    glm_seq *swapped[2] = { a[1], a[0] };
    EXPECT_EQ(glm_decode_greedy(m, swapped, nullptr, 2, &ticket, &err), MT_ERR_INVALID) << name;
    ASSERT_EQ(glm_decode_greedy(m, a, tb.data(), 2, &ticket, &err), MT_OK) << err.msg;
    std::vector<float> logits(V);
    ASSERT_EQ(glm_decode(m, a[1], 7, logits.data(), &err), MT_OK) << err.msg; // a[1] leaves the chain
    EXPECT_EQ(glm_decode_greedy(m, a, nullptr, 2, &ticket, &err), MT_ERR_INVALID) << name;
    for (int q = 0; q < nq; q++) {
        glm_seq_free(a[q]);
        glm_seq_free(b[q]);
    }
}

#endif // MT_TESTS_RUN_AHEAD_CHECK_H
