/* router/auth.c: see auth.h. */
#include "router/auth.h"

#include <errno.h>
#include <grpc/slice.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

static bool visible(unsigned char c) { return c > 0x20 && c < 0x7f; }

/* Overwrites n bytes so that the compiler keeps the stores (the buffer is freed right after). */
static void wipe(char *p, size_t n) {
    volatile char *v = p;
    while (n--) *v++ = 0;
}

mt_status rtr_auth_token_read(const char *path, char **token, mt_error *err) {
    FILE *f = fopen(path, "rb");
    if (!f) return mt_errorf(err, MT_ERR_IO, "auth: token file %s: %s", path, strerror(errno));
    char line[RTR_AUTH_TOKEN_MAX + 64];
    const bool got = fgets(line, sizeof line, f) != NULL;
    fclose(f);
    size_t n = got ? strlen(line) : 0;
    const bool whole = n == 0 || line[n - 1] == '\n' || n < sizeof line - 1;
    while (n > 0 && (line[n - 1] == '\n' || line[n - 1] == '\r' || line[n - 1] == ' ' || line[n - 1] == '\t')) n--;
    size_t start = 0;
    while (start < n && (line[start] == ' ' || line[start] == '\t')) start++;
    mt_status st = MT_OK;
    if (n == start) {
        st = mt_errorf(err, MT_ERR_INVALID, "auth: token file %s: the first line is empty", path);
    } else if (!whole || n - start > RTR_AUTH_TOKEN_MAX) {
        st = mt_errorf(err, MT_ERR_INVALID, "auth: token file %s: the token is longer than %d characters", path,
                       RTR_AUTH_TOKEN_MAX);
    } else {
        for (size_t i = start; i < n && !st; i++)
            if (!visible((unsigned char)line[i]))
                st = mt_errorf(err, MT_ERR_INVALID,
                               "auth: token file %s: character %zu of the token is not visible ASCII (no spaces)", path,
                               i - start + 1);
    }
    if (!st) {
        char *t = malloc(n - start + 1);
        if (!t) {
            st = mt_errorf(err, MT_ERR_NOMEM, "auth: out of memory");
        } else {
            memcpy(t, line + start, n - start);
            t[n - start] = 0;
            *token = t;
        }
    }
    wipe(line, sizeof line);
    return st;
}

void rtr_auth_token_free(char *token) {
    if (!token) return;
    wipe(token, strlen(token));
    free(token);
}

/* a == b, in a time that depends on nb only. */
static bool equal_ct(const char *a, size_t na, const char *b, size_t nb) {
    size_t d = na ^ nb;
    for (size_t i = 0; i < nb; i++) {
        const unsigned char x = i < na ? (unsigned char)a[i] : 0;
        d |= (size_t)(x ^ (unsigned char)b[i]);
    }
    return d == 0;
}

bool rtr_auth_header_ok(const char *token, const char *value, size_t len) {
    static const char scheme[] = "Bearer";
    const size_t ns = sizeof scheme - 1;
    if (!token || len <= ns || strncasecmp(value, scheme, ns) != 0 || value[ns] != ' ') return false;
    size_t i = ns;
    while (i < len && value[i] == ' ') i++;
    return equal_ct(value + i, len - i, token, strlen(token));
}

bool rtr_auth_metadata_ok(const char *token, const grpc_metadata_array *md) {
    for (size_t i = 0; i < md->count; i++) {
        if (grpc_slice_str_cmp(md->metadata[i].key, "authorization") != 0) continue;
        const grpc_slice v = md->metadata[i].value;
        return rtr_auth_header_ok(token, (const char *)GRPC_SLICE_START_PTR(v), GRPC_SLICE_LENGTH(v));
    }
    return false;
}
