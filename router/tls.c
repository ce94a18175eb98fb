/* router/tls.c: see tls.h. */
#include "router/tls.h"

#include <errno.h>
#include <openssl/bio.h>
#include <openssl/bn.h>
#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PEM_BYTES_MAX (1u << 20) /* a certificate chain or key file larger than this is refused */

/* One consistent set of PEM text: what the files held at one load. */
typedef struct pem_set {
    char *cert, *key, *ca; /* ca NULL without a client CA */
    size_t key_len;
    char desc[512];
} pem_set;

struct rtr_tls {
    char *cert_file, *key_file, *ca_file;
    pthread_mutex_t mu;
    pem_set cur;            /* guarded by mu: the fetcher reads it on gRPC's threads */
    unsigned generation;    /* guarded by mu: bumped by every load */
    unsigned served;        /* guarded by mu: the generation last handed to gRPC */
};

rtr_tls_params rtr_tls_default_params(void) { return (rtr_tls_params){0}; }

static void pem_set_free(pem_set *s) {
    if (s->key) OPENSSL_cleanse(s->key, s->key_len);
    free(s->cert);
    free(s->key);
    free(s->ca);
    memset(s, 0, sizeof *s);
}

/* The whole file as a NUL-terminated string; *len its length. */
static mt_status read_pem(const char *path, const char *what, char **out, size_t *len, mt_error *err) {
    FILE *f = fopen(path, "rb");
    if (!f) return mt_errorf(err, MT_ERR_IO, "tls: %s %s: %s", what, path, strerror(errno));
    char *buf = malloc(PEM_BYTES_MAX + 1);
    if (!buf) {
        fclose(f);
        return mt_errorf(err, MT_ERR_NOMEM, "tls: out of memory reading %s", path);
    }
    size_t n = fread(buf, 1, PEM_BYTES_MAX + 1, f);
    const bool bad = ferror(f) != 0;
    fclose(f);
    if (bad || n > PEM_BYTES_MAX) {
        OPENSSL_cleanse(buf, n);
        free(buf);
        return bad ? mt_errorf(err, MT_ERR_IO, "tls: %s %s: read error", what, path)
                   : mt_errorf(err, MT_ERR_INVALID, "tls: %s %s is larger than %u bytes", what, path, PEM_BYTES_MAX);
    }
    buf[n] = 0;
    *out = buf;
    *len = n;
    return MT_OK;
}

/* OpenSSL's last error as text, and the error queue cleared. */
static const char *ssl_error(char *buf, size_t len) {
    unsigned long e = ERR_peek_last_error();
    if (e) ERR_error_string_n(e, buf, len);
    else snprintf(buf, len, "no PEM data");
    ERR_clear_error();
    return buf;
}

/* Refuses encrypted keys instead of asking for a passphrase on the terminal. */
static int no_passphrase(char *buf, int size, int rwflag, void *u) {
    (void)buf, (void)size, (void)rwflag, (void)u;
    return -1;
}

/* Certificates in a PEM text: the first in *first (owned by the caller) when first != NULL. */
static int count_certs(const char *pem, X509 **first) {
    BIO *b = BIO_new_mem_buf(pem, -1);
    if (!b) return 0;
    int n = 0;
    X509 *x;
    while ((x = PEM_read_bio_X509(b, NULL, no_passphrase, NULL))) {
        if (n == 0 && first) *first = x;
        else X509_free(x);
        n++;
    }
    BIO_free(b);
    if (n > 0) ERR_clear_error(); /* the read past the last certificate */
    return n;
}

/* "subject ..., serial 0x..., expires ..." of x into out. */
static void describe_cert(X509 *x, char *out, size_t len) {
    out[0] = 0;
    BIO *b = BIO_new(BIO_s_mem());
    if (!b) return;
    BIO_puts(b, "subject ");
    X509_NAME_print_ex(b, X509_get_subject_name(x), 0, XN_FLAG_RFC2253);
    BIGNUM *bn = ASN1_INTEGER_to_BN(X509_get_serialNumber(x), NULL);
    char *hex = bn ? BN_bn2hex(bn) : NULL;
    BIO_printf(b, ", serial 0x%s, expires ", hex ? hex : "?");
    OPENSSL_free(hex);
    BN_free(bn);
    ASN1_TIME_print(b, X509_get0_notAfter(x));
    const int n = BIO_read(b, out, (int)len - 1);
    out[n > 0 ? n : 0] = 0;
    BIO_free(b);
}

/* Reads the three files into s and checks them (see tls.h). */
static mt_status load(const rtr_tls *t, pem_set *s, mt_error *err) {
    memset(s, 0, sizeof *s);
    size_t n;
    char e[256];
    mt_status st;
    X509 *leaf = NULL;
    EVP_PKEY *key = NULL;
    if ((st = read_pem(t->cert_file, "certificate", &s->cert, &n, err)) ||
        (st = read_pem(t->key_file, "key", &s->key, &s->key_len, err)) ||
        (t->ca_file && (st = read_pem(t->ca_file, "client CA", &s->ca, &n, err))))
        goto fail;
    st = MT_ERR_INVALID;
    if (count_certs(s->cert, &leaf) == 0) {
        mt_errorf(err, st, "tls: certificate %s: no PEM certificate (%s)", t->cert_file, ssl_error(e, sizeof e));
        goto fail;
    }
    BIO *b = BIO_new_mem_buf(s->key, -1);
    if (b) key = PEM_read_bio_PrivateKey(b, NULL, no_passphrase, NULL);
    BIO_free(b);
    if (!key) {
        mt_errorf(err, st, "tls: key %s: no unencrypted PEM private key (%s)", t->key_file, ssl_error(e, sizeof e));
        goto fail;
    }
    if (X509_check_private_key(leaf, key) != 1) {
        mt_errorf(err, st, "tls: key %s does not belong to the certificate in %s", t->key_file, t->cert_file);
        ERR_clear_error();
        goto fail;
    }
    if (s->ca && count_certs(s->ca, NULL) == 0) {
        mt_errorf(err, st, "tls: client CA %s: no PEM certificate (%s)", t->ca_file, ssl_error(e, sizeof e));
        goto fail;
    }
    describe_cert(leaf, s->desc, sizeof s->desc);
    X509_free(leaf);
    EVP_PKEY_free(key);
    return MT_OK;
fail:
    X509_free(leaf);
    EVP_PKEY_free(key);
    pem_set_free(s);
    return st;
}

rtr_tls *rtr_tls_create(const rtr_tls_params *p, mt_error *err) {
    if (!p->cert_file || !p->key_file) {
        mt_errorf(err, MT_ERR_INVALID, "tls: a certificate and a key file are both required");
        return NULL;
    }
    rtr_tls *t = calloc(1, sizeof *t);
    if (!t) {
        mt_errorf(err, MT_ERR_NOMEM, "tls: out of memory");
        return NULL;
    }
    pthread_mutex_init(&t->mu, NULL);
    if (!(t->cert_file = strdup(p->cert_file)) || !(t->key_file = strdup(p->key_file)) ||
        (p->client_ca_file && !(t->ca_file = strdup(p->client_ca_file)))) {
        mt_errorf(err, MT_ERR_NOMEM, "tls: out of memory");
        goto fail;
    }
    if (load(t, &t->cur, err)) goto fail;
    t->generation = 1; /* served = 0: the first fetch hands it to gRPC */
    return t;
fail:
    rtr_tls_free(t);
    return NULL;
}

mt_status rtr_tls_reload(rtr_tls *t, mt_error *err) {
    pem_set next;
    mt_status st = load(t, &next, err);
    if (st) return st;
    pthread_mutex_lock(&t->mu);
    pem_set old = t->cur;
    t->cur = next;
    t->generation++;
    pthread_mutex_unlock(&t->mu);
    pem_set_free(&old);
    return MT_OK;
}

void rtr_tls_describe(const rtr_tls *t, char *out, size_t len) {
    if (!len) return;
    /* cur changes only on this thread (reload), so no lock is needed to read it here */
    snprintf(out, len, "%s%s", t->cur.desc, t->ca_file ? ", client certificate required" : "");
}

/* gRPC's certificate-config fetcher: called before each handshake on gRPC's threads. */
static grpc_ssl_certificate_config_reload_status fetch(void *user, grpc_ssl_server_certificate_config **config) {
    rtr_tls *t = user;
    grpc_ssl_certificate_config_reload_status st = GRPC_SSL_CERTIFICATE_CONFIG_RELOAD_UNCHANGED;
    pthread_mutex_lock(&t->mu);
    if (t->served != t->generation) {
        grpc_ssl_pem_key_cert_pair pair = {.private_key = t->cur.key, .cert_chain = t->cur.cert};
        /* gRPC 1.51 asserts that a fetched config has root certificates even when no client
         * certificate is asked for (ssl_security_connector.cc); then they are never used, and the
         * server's own chain stands in for them. */
        const char *roots = t->cur.ca ? t->cur.ca : t->cur.cert;
        *config = grpc_ssl_server_certificate_config_create(roots, &pair, 1); /* copies the text */
        if (*config) {
            t->served = t->generation;
            st = GRPC_SSL_CERTIFICATE_CONFIG_RELOAD_NEW;
        } else {
            st = GRPC_SSL_CERTIFICATE_CONFIG_RELOAD_FAIL;
        }
    }
    pthread_mutex_unlock(&t->mu);
    return st;
}

grpc_server_credentials *rtr_tls_server_credentials(rtr_tls *t) {
    const grpc_ssl_client_certificate_request_type req =
        t->ca_file ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE;
    pthread_mutex_lock(&t->mu);
    t->served = 0; /* new credentials start from the current certificate */
    pthread_mutex_unlock(&t->mu);
    grpc_ssl_server_credentials_options *o = grpc_ssl_server_credentials_create_options_using_config_fetcher(req, fetch, t);
    return o ? grpc_ssl_server_credentials_create_with_options(o) : NULL;
}

void rtr_tls_free(rtr_tls *t) {
    if (!t) return;
    pem_set_free(&t->cur);
    free(t->cert_file);
    free(t->key_file);
    free(t->ca_file);
    pthread_mutex_destroy(&t->mu);
    free(t);
}
