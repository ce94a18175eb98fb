// common/mt: status strings, error formatting, dtype sizes and conversions.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

extern "C" {
#include "common/mt.h"
}

TEST(Mt, StatusStringsAreDistinct) {
    const mt_status all[] = {MT_OK, MT_ERR_INVALID, MT_ERR_IO, MT_ERR_NOMEM, MT_ERR_NOT_FOUND,
                             MT_ERR_UNSUPPORTED, MT_ERR_FULL, MT_ERR_BACKEND, MT_ERR_STATE};
    for (mt_status a : all)
        for (mt_status b : all)
            if (a != b) {
                EXPECT_STRNE(mt_status_str(a), mt_status_str(b));
            }
    EXPECT_STREQ(mt_status_str((mt_status)-99), "unknown status");
}

TEST(Mt, ErrorfWritesAndReturnsTheStatus) {
    mt_error e{};
    EXPECT_EQ(mt_errorf(&e, MT_ERR_INVALID, "field %s = %d", "hc_mult", 0), MT_ERR_INVALID);
    EXPECT_STREQ(e.msg, "field hc_mult = 0");
    EXPECT_EQ(mt_errorf(nullptr, MT_ERR_IO, "dropped"), MT_ERR_IO);
    char big[2000];
    memset(big, 'a', sizeof big - 1);
    big[sizeof big - 1] = 0;
    mt_errorf(&e, MT_ERR_IO, "%s", big);  // truncated, still terminated
    EXPECT_EQ(strlen(e.msg), sizeof e.msg - 1);
}

TEST(Mt, Bf16RoundsToNearestEven) {
    EXPECT_EQ(mt_f32_to_bf16(1.0f), 0x3f80);
    EXPECT_EQ(mt_bf16_to_f32(0x3f80), 1.0f);
    // 1 + 2^-8 is halfway between bf16 1.0 and 1 + 2^-7: ties to even (1.0).
    EXPECT_EQ(mt_f32_to_bf16(1.0f + 1.0f / 256), 0x3f80);
    EXPECT_EQ(mt_f32_to_bf16(1.0f + 3.0f / 256), 0x3f82);
    EXPECT_TRUE(std::isnan(mt_bf16_to_f32(mt_f32_to_bf16(NAN))));
    for (float v : {-3.5f, 0.15625f, 1e-20f, 6.5e4f}) {
        float r = mt_bf16_to_f32(mt_f32_to_bf16(v));
        EXPECT_NEAR(r, v, std::fabs(v) / 128) << v;
    }
}

TEST(Mt, F16RoundTripsIncludingSubnormalsAndOverflow) {
    for (float v : {0.f, 1.f, -2.5f, 65504.f, 6.103515625e-05f, 5.960464477539063e-08f, 0.1f}) {
        float r = mt_f16_to_f32(mt_f32_to_f16(v));
        EXPECT_NEAR(r, v, std::fabs(v) / 1024 + 1e-12) << v;
    }
    EXPECT_TRUE(std::isinf(mt_f16_to_f32(mt_f32_to_f16(1e6f))));
    EXPECT_TRUE(std::isnan(mt_f16_to_f32(mt_f32_to_f16(NAN))));
}

TEST(Mt, DtypeSizes) {
    EXPECT_EQ(mt_dtype_size(MT_F32), 4u);
    EXPECT_EQ(mt_dtype_size(MT_BF16), 2u);
    EXPECT_EQ(mt_dtype_size(MT_F16), 2u);
    EXPECT_EQ(mt_dtype_size(MT_I64), 8u);
    EXPECT_STREQ(mt_dtype_name(MT_BF16), "BF16");
}
