// router/admission: FIFO order, the bound, removal from the middle, push_front past the bound.
#include <gtest/gtest.h>

extern "C" {
#include "router/admission.h"
}

TEST(RouterAdmission, FifoWithinCapacity) {
    rtr_admission q;
    rtr_admission_init(&q, 3);
    rtr_qnode n[4] = {};
    for (int i = 0; i < 3; i++) EXPECT_EQ(rtr_admission_push(&q, &n[i]), MT_OK);
    EXPECT_EQ(rtr_admission_push(&q, &n[3]), MT_ERR_FULL);
    EXPECT_FALSE(n[3].queued);
    EXPECT_EQ(rtr_admission_push(&q, &n[0]), MT_ERR_STATE);  // already queued
    EXPECT_EQ(rtr_admission_len(&q), 3u);
    for (int i = 0; i < 3; i++) EXPECT_EQ(rtr_admission_pop(&q), &n[i]);
    EXPECT_EQ(rtr_admission_pop(&q), nullptr);
    EXPECT_EQ(rtr_admission_len(&q), 0u);
}

TEST(RouterAdmission, RemoveFromTheMiddleAndTwice) {
    rtr_admission q;
    rtr_admission_init(&q, 8);
    rtr_qnode n[3] = {};
    for (auto &x : n) rtr_admission_push(&q, &x);
    rtr_admission_remove(&q, &n[1]);
    rtr_admission_remove(&q, &n[1]);  // no-op
    EXPECT_EQ(rtr_admission_len(&q), 2u);
    EXPECT_EQ(rtr_admission_pop(&q), &n[0]);
    EXPECT_EQ(rtr_admission_pop(&q), &n[2]);
    rtr_qnode lone = {};
    rtr_admission_remove(&q, &lone);  // never queued: no-op
    EXPECT_EQ(rtr_admission_len(&q), 0u);
}

TEST(RouterAdmission, ZeroCapacityAndPushFront) {
    rtr_admission q;
    rtr_admission_init(&q, 0);
    rtr_qnode a = {}, b = {};
    EXPECT_EQ(rtr_admission_push(&q, &a), MT_ERR_FULL);
    EXPECT_EQ(rtr_admission_push_front(&q, &a), MT_OK);  // a failed dispatch returns past the bound
    EXPECT_EQ(rtr_admission_push_front(&q, &b), MT_OK);
    EXPECT_EQ(rtr_admission_push_front(&q, &b), MT_ERR_STATE);
    EXPECT_EQ(rtr_admission_pop(&q), &b);
    EXPECT_EQ(rtr_admission_pop(&q), &a);
}
