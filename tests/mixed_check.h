// tests/mixed_check.h: one check of the mixed step (glm_forward_mixed, and mt_model_forward with
// prompt chunks and decode rows in one batch) shared by the CPU and GPU model tests, so both
// backends are held to the same contract: a step that runs several sequences' prompt chunks and
// decode rows in one pass leaves every sequence as the same work done part by part would, and
// returns the same logits.
#ifndef MT_TESTS_MIXED_CHECK_H
#define MT_TESTS_MIXED_CHECK_H

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

#include "kernels/backend.h"
#include "worker/model/glm/glm_model.h"

// Worst |a - b| over max |b|.
inline double MixedRelDiff(const std::vector<float> &a, const std::vector<float> &b) {
    double d = 0, scale = 1e-30;
    for (size_t i = 0; i < a.size(); i++) {
        d = std::max(d, (double)std::fabs(a[i] - b[i]));
        scale = std::max(scale, (double)std::fabs(b[i]));
    }
    return d / scale;
}

// Twin sequences A, B, C on each path. Before the step: A has a 12-token prompt, B the first 7 of
// its 16. The step: A's decode row, the rest of B's prompt (last logits), C's 11-token prompt
// (every row's logits). Mixed: one glm_forward_mixed; reference: glm_decode_multi, glm_prefill,
// glm_prefill. Then 6 greedy batched decode steps of all three on each path (and, with a drafter,
// a draft of each) must agree, so the caches, recurrent states and drafter rows the step left are
// the same. tol: relative logit difference allowed (0 for the CPU: the same sums in the same order).
// layers > 0: B's and C's chunks are layered (glm_mixed_part.layers), the step running them
// `layers` layers (sites, on a model loaded with layered_sites) beside A's row and the calls after
// it carrying them on to the last layer: alone, or with beside, beside A's next decode rows (A
// decoding the same tokens on the reference path), so that a call can start the chunks at an MLP
// site with decode rows in the pass.
inline void CheckMixedStep(glm_model *m, const char *name, double tol, int layers = 0, bool beside = false) {
    const int V = glm_model_config(m)->vocab_size;
    mt_error err{};
    auto prompt = [&](int n, int salt) {
        std::vector<int32_t> p;
        for (int i = 0; i < n; i++) p.push_back((i * 37 + salt * 11 + 3) % V);
        return p;
    };
    const std::vector<int32_t> pa = prompt(12, 1), pb = prompt(16, 2), pc = prompt(11, 3);
    glm_seq *mx[3], *rf[3];
    for (int q = 0; q < 3; q++) {
        ASSERT_EQ(glm_seq_new(m, 64, &mx[q], &err), MT_OK) << err.msg;
        ASSERT_EQ(glm_seq_new(m, 64, &rf[q], &err), MT_OK) << err.msg;
    }
    std::vector<float> la(V);
    for (glm_seq *s : { mx[0], rf[0] }) ASSERT_EQ(glm_prefill(m, s, pa.data(), 12, la.data(), false, &err), MT_OK) << err.msg;
    for (glm_seq *s : { mx[1], rf[1] }) ASSERT_EQ(glm_prefill(m, s, pb.data(), 7, nullptr, false, &err), MT_OK) << err.msg;
    const int32_t ta = glm_argmax(la.data(), V);

    // the reference, part by part
    std::vector<float> ra(V), rb(V), rc((size_t)11 * V);
    ASSERT_EQ(glm_decode_multi(m, &rf[0], &ta, 1, ra.data(), &err), MT_OK) << err.msg;
    ASSERT_EQ(glm_prefill(m, rf[1], pb.data() + 7, 9, rb.data(), false, &err), MT_OK) << err.msg;
    ASSERT_EQ(glm_prefill(m, rf[2], pc.data(), 11, rc.data(), true, &err), MT_OK) << err.msg;

    // the same as one mixed step
    std::vector<float> ma(V), mb(V), mc((size_t)11 * V);
    int32_t greedy = -1;
    const glm_mixed_part parts[3] = {
        { mx[0], &ta, 1, ma.data(), false, &greedy },
        { mx[1], pb.data() + 7, 9, mb.data(), false, nullptr, false, layers },
        { mx[2], pc.data(), 11, mc.data(), true, nullptr, false, layers },
    };
    ASSERT_EQ(glm_forward_mixed(m, parts, 3, 0, &err), MT_OK) << err.msg;
    EXPECT_EQ(greedy, glm_argmax(ra.data(), V)) << name; /* the first call's decode row */
    for (int call = 1; glm_seq_len(mx[2]) == 0; call++) { /* layered: the chunks go on */
        ASSERT_GT(layers, 0) << name;
        ASSERT_TRUE(glm_seq_in_flight(mx[2])) << name;
        ASSERT_LT(call, glm_model_layered_units(m)) << name;
        if (!beside) {
            ASSERT_EQ(glm_forward_mixed(m, parts + 1, 2, 0, &err), MT_OK) << err.msg;
            continue;
        }
        int32_t tm0 = glm_argmax(ma.data(), V), tr0 = glm_argmax(ra.data(), V);
        ASSERT_EQ(tm0, tr0) << name << " call " << call;
        const glm_mixed_part next[3] = { { mx[0], &tm0, 1, ma.data(), false, nullptr }, parts[1], parts[2] };
        ASSERT_EQ(glm_forward_mixed(m, next, 3, 0, &err), MT_OK) << err.msg;
        ASSERT_EQ(glm_decode_multi(m, &rf[0], &tr0, 1, ra.data(), &err), MT_OK) << err.msg;
    }
    const double da = MixedRelDiff(ma, ra), db = MixedRelDiff(mb, rb), dc = MixedRelDiff(mc, rc);
    std::printf("%s%s: mixed step vs part by part: decode row %.2e, chunk %.2e, prompt (all rows) %.2e\n", name,
                layers ? beside ? " (layered, rows beside)" : " (layered)" : "", da, db, dc);
    EXPECT_LE(da, tol) << name;
    EXPECT_LE(db, tol) << name;
    EXPECT_LE(dc, tol) << name;
    for (int q = 0; q < 3; q++) EXPECT_EQ(glm_seq_len(mx[q]), glm_seq_len(rf[q])) << name;

    // what the step left behind: the next steps of all three agree
    int32_t tm[3] = { glm_argmax(ma.data(), V), glm_argmax(mb.data(), V), glm_argmax(mc.data() + (size_t)10 * V, V) };
    int32_t tr[3] = { glm_argmax(ra.data(), V), glm_argmax(rb.data(), V), glm_argmax(rc.data() + (size_t)10 * V, V) };
    std::vector<float> lm((size_t)3 * V), lr((size_t)3 * V);
    double worst = 0;
    for (int t = 0; t < 6; t++) {
        for (int q = 0; q < 3; q++) ASSERT_EQ(tm[q], tr[q]) << name << " step " << t << " sequence " << q;
        ASSERT_EQ(glm_decode_multi(m, mx, tm, 3, lm.data(), &err), MT_OK) << err.msg;
        ASSERT_EQ(glm_decode_multi(m, rf, tr, 3, lr.data(), &err), MT_OK) << err.msg;
        worst = std::max(worst, MixedRelDiff(lm, lr));
        for (int q = 0; q < 3; q++) {
            tm[q] = glm_argmax(lm.data() + (size_t)q * V, V);
            tr[q] = glm_argmax(lr.data() + (size_t)q * V, V);
        }
    }
    std::printf("%s: the 6 decode steps after it: %.2e\n", name, worst);
    EXPECT_LE(worst, tol) << name;
    if (glm_model_has_drafter(m)) {
        std::vector<float> dm(V), dr(V);
        for (int q = 0; q < 3; q++) {
            ASSERT_EQ(glm_model_draft(m, mx[q], tm[q], dm.data(), &err), MT_OK) << err.msg;
            ASSERT_EQ(glm_model_draft(m, rf[q], tr[q], dr.data(), &err), MT_OK) << err.msg;
            EXPECT_LE(MixedRelDiff(dm, dr), tol) << name << " drafter of sequence " << q;
        }
    }
    for (int q = 0; q < 3; q++) {
        glm_seq_free(mx[q]);
        glm_seq_free(rf[q]);
    }
}

#endif  // MT_TESTS_MIXED_CHECK_H
