// common/mt: status strings, error formatting, dtype sizes and conversions, log records.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <regex>
#include <string>

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
    EXPECT_EQ(mt_dtype_size(MT_F8E4M3), 1u);
    EXPECT_STREQ(mt_dtype_name(MT_BF16), "BF16");
    EXPECT_STREQ(mt_dtype_name(MT_F8E4M3), "F8_E4M3");
}

// fp8 e4m3fn: every one of the 256 codes against the format's definition, in double:
// (-1)^s * 2^(1 - 7) * m/8 for exponent 0, (-1)^s * 2^(e - 7) * (1 + m/8) otherwise, NaN at
// S.1111.111, no infinities.
TEST(Mt, F8E4M3EveryCodeMatchesTheFormat) {
    int nans = 0;
    for (int b = 0; b < 256; b++) {
        const int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
        const float got = mt_f8e4m3_to_f32((uint8_t)b);
        if (e == 15 && m == 7) {
            EXPECT_TRUE(std::isnan(got)) << b;
            nans++;
            continue;
        }
        const double want = (s ? -1.0 : 1.0) * (e == 0 ? std::pow(2.0, -6) * (m / 8.0)
                                                       : std::pow(2.0, e - 7) * (1.0 + m / 8.0));
        EXPECT_EQ((double)got, want) << "code 0x" << std::hex << b;
        EXPECT_EQ(std::signbit(got), s == 1) << b;
        // the conversion back is exact for every code but the NaNs (and -0 keeps its sign)
        EXPECT_EQ(mt_f32_to_f8e4m3(got), (uint8_t)b) << "code 0x" << std::hex << b;
        float one;
        const uint8_t code = (uint8_t)b;
        mt_to_f32(&one, &code, MT_F8E4M3, 1);
        EXPECT_EQ(one, got);
    }
    EXPECT_EQ(nans, 2);
    EXPECT_EQ(mt_f8e4m3_to_f32(0x7e), 448.f);
    EXPECT_EQ(mt_f8e4m3_to_f32(0x01), 0.001953125f);  // 2^-9, the smallest subnormal
    EXPECT_EQ(mt_f8e4m3_to_f32(0x38), 1.f);
}

TEST(Mt, F32ToF8E4M3RoundsToNearestEvenAndSaturates) {
    EXPECT_EQ(mt_f32_to_f8e4m3(1.0625f), 0x38);   // halfway 1 .. 1.125: to the even mantissa (1)
    EXPECT_EQ(mt_f32_to_f8e4m3(1.1875f), 0x3a);   // halfway 1.125 .. 1.25: to 1.25
    EXPECT_EQ(mt_f32_to_f8e4m3(1.07f), 0x39);     // nearer 1.125
    EXPECT_EQ(mt_f32_to_f8e4m3(0.0029296875f), 0x02);  // 1.5 * 2^-9: subnormal tie to 2 * 2^-9
    EXPECT_EQ(mt_f32_to_f8e4m3(0.0146484375f), 0x08);  // 7.5 * 2^-9: up into the first normal
    EXPECT_EQ(mt_f32_to_f8e4m3(0.0009765625f), 0x00);  // 2^-10: tie to zero
    EXPECT_EQ(mt_f32_to_f8e4m3(460.f), 0x7e);
    EXPECT_EQ(mt_f32_to_f8e4m3(-1e9f), 0xfe);
    EXPECT_EQ(mt_f32_to_f8e4m3(INFINITY), 0x7e);
    EXPECT_EQ(mt_f32_to_f8e4m3(NAN), 0x7f);
    // between any two neighbouring codes, the nearer one wins
    for (int b = 0; b < 0x7e; b++) {
        const float lo = mt_f8e4m3_to_f32((uint8_t)b), hi = mt_f8e4m3_to_f32((uint8_t)(b + 1));
        EXPECT_EQ(mt_f32_to_f8e4m3(lo + (hi - lo) * 0.25f), b) << b;
        EXPECT_EQ(mt_f32_to_f8e4m3(lo + (hi - lo) * 0.75f), b + 1) << b;
        EXPECT_EQ(mt_f32_to_f8e4m3(-(lo + (hi - lo) * 0.5f)), 0x80 | ((b & 1) ? b + 1 : b)) << b;
    }
}

// Runs f with stderr going to a temporary file; returns what was written there.
template <class F> static std::string CaptureStderr(F f) {
    FILE *tmp = tmpfile();
    EXPECT_NE(tmp, nullptr);
    fflush(stderr);
    const int saved = dup(2);
    dup2(fileno(tmp), 2);
    f();
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    std::string out;
    rewind(tmp);
    char buf[4096];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, tmp)) > 0) out.append(buf, n);
    fclose(tmp);
    return out;
}

// The settings are process-wide: each test restores the defaults.
struct LogSettings {
    LogSettings(mt_log_format f) {
        mt_log_set_format(f);
        mt_log_set_component("router", "router: ");
    }
    ~LogSettings() {
        mt_log_set_format(MT_LOG_TEXT);
        mt_log_set_component("", "");
    }
};

static const std::string kTime = R"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z)";

TEST(MtLog, TextLinesStartWithTheTimeAndLevel) {
    LogSettings s(MT_LOG_TEXT);
    const std::string out = CaptureStderr([] {
        mt_log(MT_LOG_WARN, "router: worker %s dead", "w1");
        const mt_log_field f[] = { mt_logf_str("status", "OK"), mt_logf_str("details", "two words"),
                                   mt_logf_uint("completion_tokens", 8), mt_logf_str("gone", nullptr) };
        mt_log_event(MT_LOG_INFO, "finished", "r-1", f, 4);
    });
    EXPECT_TRUE(std::regex_match(out, std::regex(kTime + R"( \[W\] router: worker w1 dead\n)" + kTime +
                                                 R"( \[I\] router: finished request_id=r-1 status=OK )"
                                                 R"(details="two words" completion_tokens=8\n)")))
        << out;
}

TEST(MtLog, JsonRecordsAreOneObjectALineWithEscapedStrings) {
    LogSettings s(MT_LOG_JSON);
    const std::string out = CaptureStderr([] {
        mt_log(MT_LOG_INFO, "router: listening on port %d", 50051);
        mt_log(MT_LOG_ERROR, "wire: \"quoted\" \\ tab\t nl\n ctl\x01");
        const mt_log_field f[] = {
            mt_logf_str("text", "caf\xc3\xa9 \xe4\xb8\xad bad\xff\xc3("), mt_logf_int("neg", -3),
            mt_logf_double("ms", 1.5), mt_logf_double("nan", NAN), mt_logf_bool("queued", true),
            mt_logf_json("ids", "[1,2]"), mt_logf_json("none", nullptr), mt_logf_str("none2", nullptr),
        };
        mt_log_event(MT_LOG_DEBUG, "dropped", "r", f, 8); // below the level: nothing
        mt_log_event(MT_LOG_INFO, "admitted", "r\"1", f, 8);
        mt_log_event(MT_LOG_INFO, "plain", nullptr, nullptr, 0);
    });
    const std::string t = R"(\{"time":")" + kTime + R"(",)";
    const std::string want =
        t + R"("level":"info","component":"router","event":"log","msg":"listening on port 50051"\}\n)" +
        t + R"("level":"error","component":"router","event":"log","msg":"wire: \\"quoted\\" \\\\ tab\\t nl\\n ctl\\u0001"\}\n)" +
        t + R"("level":"info","component":"router","request_id":"r\\"1","event":"admitted",)"
            R"("text":"caf\xc3\xa9 \xe4\xb8\xad bad\\ufffd\\ufffd\(","neg":-3,"ms":1.5,"nan":null,"queued":true,)"
            R"("ids":\[1,2\]\}\n)" +
        t + R"("level":"info","component":"router","event":"plain"\}\n)";
    EXPECT_TRUE(std::regex_match(out, std::regex(want))) << out;
}

TEST(MtLog, LongLinesAndQuoting) {
    LogSettings s(MT_LOG_JSON);
    const std::string big(10000, 'x');
    const std::string out = CaptureStderr([&] { mt_log(MT_LOG_INFO, "%s", big.c_str()); });
    EXPECT_NE(out.find("\"msg\":\"" + big + "\"}\n"), std::string::npos);
    char *q = mt_json_quote("a\"b\\c\x02");
    ASSERT_NE(q, nullptr);
    EXPECT_STREQ(q, "\"a\\\"b\\\\c\\u0002\"");
    free(q);
    mt_log_format f = MT_LOG_TEXT;
    EXPECT_TRUE(mt_log_format_parse("json", &f));
    EXPECT_EQ(f, MT_LOG_JSON);
    EXPECT_TRUE(mt_log_format_parse("text", &f));
    EXPECT_EQ(f, MT_LOG_TEXT);
    EXPECT_FALSE(mt_log_format_parse("xml", &f));
}
