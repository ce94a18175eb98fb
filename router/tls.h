/* router/tls.h: the router's TLS certificate, key and client CA, read from PEM files and handed
 * to gRPC core as ssl server credentials that can change while the server runs.
 *
 * rtr_tls_create reads the files and checks them with OpenSSL (the chain parses, the key is the
 * leaf certificate's, the client CA holds at least one certificate), so a bad file is refused at
 * start with a message naming it. rtr_tls_server_credentials gives gRPC a certificate-config
 * fetcher (grpc_ssl_server_credentials_create_options_using_config_fetcher): gRPC calls it before
 * every TLS handshake, and it answers "new" once after each successful rtr_tls_reload, "unchanged"
 * otherwise. So after a reload every new connection is served the new certificate; connections
 * already open keep theirs. A reload whose files fail the checks changes nothing.
 *
 * Client certificates: with a client CA, a client must present a certificate that chains to it
 * (GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY); without one none is asked for.
 *
 * Threads: create, reload, describe and free belong to one thread (the router's); the fetcher
 * runs on gRPC's threads and shares the current PEM text with reload under a mutex. The object
 * must outlive every server that uses credentials made from it (free it after grpc_shutdown).
 */
#ifndef RTR_TLS_H
#define RTR_TLS_H

#include <grpc/grpc_security.h>
#include <stddef.h>

#include "common/mt.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct rtr_tls rtr_tls;

typedef struct rtr_tls_params {
    const char *cert_file;      /* PEM certificate chain, the server's certificate first (required) */
    const char *key_file;       /* PEM private key of that certificate (required) */
    const char *client_ca_file; /* PEM CA certificates that client certificates must chain to;
                                   NULL: no client certificate is asked for */
} rtr_tls_params;

rtr_tls_params rtr_tls_default_params(void);

/* Reads and checks the files (paths are copied). NULL + err when one is missing or fails a check. */
rtr_tls *rtr_tls_create(const rtr_tls_params *p, mt_error *err);

/* Reads the same files again. On success new handshakes use them; on failure (err says which file
 * and why) the current certificate stays. */
mt_status rtr_tls_reload(rtr_tls *t, mt_error *err);

/* "subject CN=x, serial 0x1F, expires Jan  1 00:00:00 2030 GMT[, client CA required]" of the
 * current certificate, into out (truncated to len). */
void rtr_tls_describe(const rtr_tls *t, char *out, size_t len);

/* New ssl server credentials that serve t's current certificate (see the top), for one port: a
 * second call restarts the first one's reload tracking. The caller releases them
 * (grpc_server_credentials_release) once its port is added. */
grpc_server_credentials *rtr_tls_server_credentials(rtr_tls *t);

/* Frees t and wipes the key's copy in memory. NULL ok. */
void rtr_tls_free(rtr_tls *t);

#ifdef __cplusplus
}
#endif
#endif /* RTR_TLS_H */
