// router/auth: the token file's first line (trimmed, checked), and the authorization header:
// "Bearer" in any case, spaces, then exactly the token; anything shorter, longer or different
// is refused, and so is a call whose metadata has no authorization entry.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include <unistd.h>

extern "C" {
#include <grpc/slice.h>

#include "router/auth.h"
}

namespace {

std::string WriteFile(const std::string &text) {
    char tmpl[] = "/tmp/rtr_auth_XXXXXX";
    int fd = mkstemp(tmpl);
    EXPECT_GE(fd, 0);
    EXPECT_EQ(write(fd, text.data(), text.size()), (ssize_t)text.size());
    close(fd);
    return tmpl;
}

// The token read from a file holding text, or "" with the error in *why.
std::string Read(const std::string &text, std::string *why = nullptr) {
    const std::string path = WriteFile(text);
    char *tok = nullptr;
    mt_error err{};
    mt_status st = rtr_auth_token_read(path.c_str(), &tok, &err);
    unlink(path.c_str());
    if (st) {
        if (why) *why = err.msg;
        return "";
    }
    std::string out = tok;
    rtr_auth_token_free(tok);
    return out;
}

bool Header(const char *token, const std::string &v) { return rtr_auth_header_ok(token, v.data(), v.size()); }

}  // namespace

TEST(RouterAuth, TokenIsTheFirstLineTrimmed) {
    EXPECT_EQ(Read("s3cret\n"), "s3cret");
    EXPECT_EQ(Read("s3cret"), "s3cret");
    EXPECT_EQ(Read("  s3cret \r\nsecond line\n"), "s3cret");
    EXPECT_EQ(Read("a.b-c_d~e+f/g=\n"), "a.b-c_d~e+f/g=");
}

TEST(RouterAuth, BadTokenFilesAreRefused) {
    std::string why;
    EXPECT_EQ(Read("\nsecond\n", &why), "");
    EXPECT_NE(why.find("empty"), std::string::npos) << why;
    EXPECT_EQ(Read("two words\n", &why), "");
    EXPECT_NE(why.find("not visible ASCII"), std::string::npos) << why;
    EXPECT_EQ(Read(std::string(RTR_AUTH_TOKEN_MAX + 1, 'x') + "\n", &why), "");
    EXPECT_NE(why.find("longer"), std::string::npos) << why;
    EXPECT_EQ(Read(std::string(RTR_AUTH_TOKEN_MAX, 'x') + "\n").size(), (size_t)RTR_AUTH_TOKEN_MAX);
    char *tok = nullptr;
    mt_error err{};
    EXPECT_EQ(rtr_auth_token_read("/no/such/token", &tok, &err), MT_ERR_IO);
    EXPECT_EQ(tok, nullptr);
    EXPECT_NE(std::string(err.msg).find("/no/such/token"), std::string::npos) << err.msg;
}

TEST(RouterAuth, HeaderMustCarryExactlyTheToken) {
    const char *t = "s3cret";
    EXPECT_TRUE(Header(t, "Bearer s3cret"));
    EXPECT_TRUE(Header(t, "bearer s3cret"));
    EXPECT_TRUE(Header(t, "BEARER   s3cret"));
    EXPECT_FALSE(Header(t, "Bearer s3cre"));
    EXPECT_FALSE(Header(t, "Bearer s3crett"));
    EXPECT_FALSE(Header(t, "Bearer S3cret"));
    EXPECT_FALSE(Header(t, "Bearer "));
    EXPECT_FALSE(Header(t, "Bearer"));
    EXPECT_FALSE(Header(t, "s3cret"));
    EXPECT_FALSE(Header(t, "Basic s3cret"));
    EXPECT_FALSE(Header(t, "Bearers3cret"));
    EXPECT_FALSE(Header(t, std::string("Bearer s3cret\0", 14)));
    EXPECT_FALSE(Header(nullptr, "Bearer s3cret"));
}

TEST(RouterAuth, MetadataTakesTheAuthorizationEntry) {
    grpc_metadata md[2] = {};
    md[0].key = grpc_slice_from_static_string("x-other");
    md[0].value = grpc_slice_from_static_string("Bearer s3cret");
    md[1].key = grpc_slice_from_static_string("authorization");
    md[1].value = grpc_slice_from_static_string("Bearer s3cret");
    grpc_metadata_array a{};
    a.metadata = md;
    a.count = 1;
    EXPECT_FALSE(rtr_auth_metadata_ok("s3cret", &a));  // only another key
    a.count = 2;
    EXPECT_TRUE(rtr_auth_metadata_ok("s3cret", &a));
    EXPECT_FALSE(rtr_auth_metadata_ok("other", &a));
    a.count = 0;
    EXPECT_FALSE(rtr_auth_metadata_ok("s3cret", &a));
}
