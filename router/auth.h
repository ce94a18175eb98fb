/* router/auth.h: the bearer token of metrale-router --auth-token-file, and its check against a
 * call's metadata.
 *
 * A token is the first line of its file: 1..RTR_AUTH_TOKEN_MAX visible ASCII characters (no
 * spaces; spaces and tabs around it and the line end are dropped), so that it fits an HTTP/2
 * header as "authorization: Bearer <token>" (RFC 6750). A call is authenticated when its first
 * "authorization" metadata entry is "Bearer " (the scheme in any case, then spaces) followed by
 * exactly the token. The comparison takes a time that depends on the token's length only, never
 * on how much of it a guess gets right.
 *
 * Pure functions; any thread.
 */
#ifndef RTR_AUTH_H
#define RTR_AUTH_H

#include <grpc/grpc.h>
#include <stdbool.h>
#include <stddef.h>

#include "common/mt.h"

#ifdef __cplusplus
extern "C" {
#endif

#define RTR_AUTH_TOKEN_MAX 4096

/* Reads the token from path into *token (malloc'd; free it with rtr_auth_token_free). On
 * failure *token is untouched and err names the file and what is wrong with it. */
mt_status rtr_auth_token_read(const char *path, char **token, mt_error *err);

/* Wipes and frees a token. NULL ok. */
void rtr_auth_token_free(char *token);

/* Whether the "authorization" value (len bytes, not NUL-terminated) carries the token. */
bool rtr_auth_header_ok(const char *token, const char *value, size_t len);

/* Whether the call's metadata carries the token (see the top). */
bool rtr_auth_metadata_ok(const char *token, const grpc_metadata_array *md);

#ifdef __cplusplus
}
#endif
#endif /* RTR_AUTH_H */
