// router/tls: the certificate, key and client CA files are checked at create (present, PEM, the
// key is the certificate's and not encrypted, the CA holds a certificate); a reload that fails a
// check keeps the current certificate, one that passes replaces it. Certificates are made here
// with OpenSSL.
#include <gtest/gtest.h>

#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <cstdio>
#include <string>
#include <vector>

#include <unistd.h>

extern "C" {
#include <grpc/grpc.h>

#include "router/tls.h"
}

namespace {

std::string Pem(EVP_PKEY *k, const EVP_CIPHER *cipher = nullptr) {
    BIO *b = BIO_new(BIO_s_mem());
    PEM_write_bio_PrivateKey(b, k, cipher, nullptr, 0, nullptr, (void *)"passphrase");
    char *p;
    long n = BIO_get_mem_data(b, &p);
    std::string out(p, n);
    BIO_free(b);
    return out;
}

std::string Pem(X509 *x) {
    BIO *b = BIO_new(BIO_s_mem());
    PEM_write_bio_X509(b, x);
    char *p;
    long n = BIO_get_mem_data(b, &p);
    std::string out(p, n);
    BIO_free(b);
    return out;
}

// A self-signed certificate for key with this common name and serial.
X509 *Cert(EVP_PKEY *key, const char *cn, long serial) {
    X509 *x = X509_new();
    X509_set_version(x, 2);
    ASN1_INTEGER_set(X509_get_serialNumber(x), serial);
    X509_gmtime_adj(X509_getm_notBefore(x), 0);
    X509_gmtime_adj(X509_getm_notAfter(x), 3600);
    X509_set_pubkey(x, key);
    X509_NAME *name = X509_get_subject_name(x);
    X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_ASC, (const unsigned char *)cn, -1, -1, 0);
    X509_set_issuer_name(x, name);
    X509_sign(x, key, EVP_sha256());
    return x;
}

class TlsFiles : public ::testing::Test {
  protected:
    void SetUp() override {
        char tmpl[] = "/tmp/rtr_tls_XXXXXX";
        dir_ = mkdtemp(tmpl);
        cert_ = dir_ + "/tls.crt";
        key_ = dir_ + "/tls.key";
        ca_ = dir_ + "/ca.crt";
        grpc_init();
    }
    void TearDown() override {
        for (const auto &f : {cert_, key_, ca_}) unlink(f.c_str());
        rmdir(dir_.c_str());
        for (EVP_PKEY *k : keys_) EVP_PKEY_free(k);
        grpc_shutdown();
    }
    // A new key and its certificate, written to the files.
    void Write(const char *cn, long serial) {
        EVP_PKEY *k = EVP_EC_gen("P-256");
        keys_.push_back(k);
        X509 *x = Cert(k, cn, serial);
        Put(cert_, Pem(x));
        Put(key_, Pem(k));
        X509_free(x);
    }
    static void Put(const std::string &path, const std::string &text) {
        FILE *f = fopen(path.c_str(), "w");
        fputs(text.c_str(), f);
        fclose(f);
    }
    rtr_tls *Create(bool with_ca, std::string *why) {
        rtr_tls_params p = rtr_tls_default_params();
        p.cert_file = cert_.c_str();
        p.key_file = key_.c_str();
        p.client_ca_file = with_ca ? ca_.c_str() : nullptr;
        mt_error err{};
        rtr_tls *t = rtr_tls_create(&p, &err);
        *why = err.msg;
        return t;
    }
    static std::string Describe(const rtr_tls *t) {
        char d[600];
        rtr_tls_describe(t, d, sizeof d);
        return d;
    }
    std::string dir_, cert_, key_, ca_;
    std::vector<EVP_PKEY *> keys_;
};

}  // namespace

TEST_F(TlsFiles, CreateChecksTheFiles) {
    std::string why;
    EXPECT_EQ(Create(false, &why), nullptr);  // nothing written yet
    EXPECT_NE(why.find(cert_), std::string::npos) << why;

    Write("first", 0x11);
    rtr_tls *t = Create(false, &why);
    ASSERT_NE(t, nullptr) << why;
    EXPECT_NE(Describe(t).find("CN=first"), std::string::npos) << Describe(t);
    EXPECT_NE(Describe(t).find("serial 0x11"), std::string::npos) << Describe(t);
    grpc_server_credentials *c = rtr_tls_server_credentials(t);
    EXPECT_NE(c, nullptr);
    grpc_server_credentials_release(c);
    rtr_tls_free(t);

    EXPECT_EQ(Create(true, &why), nullptr);  // no CA file
    EXPECT_NE(why.find("client CA"), std::string::npos) << why;
    Put(ca_, "not a certificate\n");
    EXPECT_EQ(Create(true, &why), nullptr);
    EXPECT_NE(why.find("no PEM certificate"), std::string::npos) << why;
    std::string cert_pem;
    {
        FILE *f = fopen(cert_.c_str(), "r");
        char buf[8192];
        cert_pem.assign(buf, fread(buf, 1, sizeof buf, f));
        fclose(f);
    }
    Put(ca_, cert_pem);
    t = Create(true, &why);
    ASSERT_NE(t, nullptr) << why;
    EXPECT_NE(Describe(t).find("client certificate required"), std::string::npos) << Describe(t);
    rtr_tls_free(t);

    Put(key_, Pem(EVP_EC_gen("P-256")));  // another key (leaked: a test)
    EXPECT_EQ(Create(false, &why), nullptr);
    EXPECT_NE(why.find("does not belong"), std::string::npos) << why;
    Put(key_, Pem(keys_[0], EVP_aes_128_cbc()));  // the right key, encrypted
    EXPECT_EQ(Create(false, &why), nullptr);
    EXPECT_NE(why.find("no unencrypted PEM private key"), std::string::npos) << why;
    Put(cert_, "garbage\n");
    EXPECT_EQ(Create(false, &why), nullptr);
    EXPECT_NE(why.find("no PEM certificate"), std::string::npos) << why;
}

TEST_F(TlsFiles, ReloadReplacesOnlyWithGoodFiles) {
    Write("first", 0x11);
    std::string why;
    rtr_tls *t = Create(false, &why);
    ASSERT_NE(t, nullptr) << why;

    // a new certificate without its key yet: refused, the first one stays
    EVP_PKEY *k2 = EVP_EC_gen("P-256");
    keys_.push_back(k2);
    X509 *x2 = Cert(k2, "second", 0x22);
    Put(cert_, Pem(x2));
    mt_error err{};
    EXPECT_EQ(rtr_tls_reload(t, &err), MT_ERR_INVALID);
    EXPECT_NE(std::string(err.msg).find("does not belong"), std::string::npos) << err.msg;
    EXPECT_NE(Describe(t).find("serial 0x11"), std::string::npos) << Describe(t);

    Put(key_, Pem(k2));
    EXPECT_EQ(rtr_tls_reload(t, &err), MT_OK) << err.msg;
    EXPECT_NE(Describe(t).find("CN=second"), std::string::npos) << Describe(t);
    EXPECT_NE(Describe(t).find("serial 0x22"), std::string::npos) << Describe(t);

    unlink(key_.c_str());
    EXPECT_EQ(rtr_tls_reload(t, &err), MT_ERR_IO);
    EXPECT_NE(Describe(t).find("serial 0x22"), std::string::npos) << Describe(t);
    X509_free(x2);
    rtr_tls_free(t);
}
