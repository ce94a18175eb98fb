/* common/mt.c: see mt.h. */
#include "common/mt.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

const char *mt_status_str(mt_status s) {
    switch (s) {
    case MT_OK: return "ok";
    case MT_ERR_INVALID: return "invalid argument";
    case MT_ERR_IO: return "i/o error";
    case MT_ERR_NOMEM: return "out of memory";
    case MT_ERR_NOT_FOUND: return "not found";
    case MT_ERR_UNSUPPORTED: return "unsupported";
    case MT_ERR_FULL: return "no room";
    case MT_ERR_BACKEND: return "backend error";
    case MT_ERR_STATE: return "wrong state";
    }
    return "unknown status";
}

mt_status mt_errorf(mt_error *err, mt_status st, const char *fmt, ...) {
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err->msg, sizeof err->msg, fmt, ap);
        va_end(ap);
    }
    return st;
}

size_t mt_dtype_size(mt_dtype t) {
    switch (t) {
    case MT_F32: case MT_I32: return 4;
    case MT_F16: case MT_BF16: return 2;
    case MT_I64: return 8;
    case MT_U8: return 1;
    }
    return 0;
}

const char *mt_dtype_name(mt_dtype t) {
    switch (t) {
    case MT_F32: return "F32";
    case MT_F16: return "F16";
    case MT_BF16: return "BF16";
    case MT_I32: return "I32";
    case MT_I64: return "I64";
    case MT_U8: return "U8";
    }
    return "?";
}

float mt_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    float v;
    if (exp == 0) v = ldexpf((float)man, -24);
    else if (exp == 31) v = man ? NAN : INFINITY;
    else v = ldexpf((float)(man | 0x400), (int)exp - 25);
    union { uint32_t u; float f; } r = { .f = v };
    r.u |= sign;
    return r.f;
}

uint16_t mt_f32_to_f16(float f) {
    union { uint32_t u; float f; } v = { .f = f };
    uint16_t sign = (uint16_t)((v.u >> 16) & 0x8000);
    float a = fabsf(f);
    if (isnan(f)) return sign | 0x7e00;
    if (a >= 65520.0f) return sign | 0x7c00;
    if (a < 6.103515625e-05f) { /* subnormal: units of 2^-24, round to nearest even */
        return sign | (uint16_t)lrintf(a * 16777216.0f);
    }
    int e;
    float m = frexpf(a, &e); /* a = m * 2^e, m in [0.5,1) */
    uint32_t man = (uint32_t)lrintf(m * 2048.0f); /* 11 bits incl. hidden */
    if (man == 2048) { man = 1024; e++; }
    if (e + 14 >= 31) return sign | 0x7c00;
    return sign | (uint16_t)((uint32_t)(e + 14) << 10) | (uint16_t)(man & 0x3ff);
}

void mt_to_f32(float *dst, const void *src, mt_dtype t, size_t n) {
    switch (t) {
    case MT_F32: memcpy(dst, src, n * 4); return;
    case MT_BF16: for (size_t i = 0; i < n; i++) dst[i] = mt_bf16_to_f32(((const uint16_t *)src)[i]); return;
    case MT_F16: for (size_t i = 0; i < n; i++) dst[i] = mt_f16_to_f32(((const uint16_t *)src)[i]); return;
    default: MT_ASSERT(!"mt_to_f32: not a float dtype");
    }
}

static mt_abort_hook g_abort_hook;
void mt_set_abort_hook(mt_abort_hook hook) { g_abort_hook = hook; }

void mt_assert_fail(const char *cond, const char *file, int line) {
    char msg[512];
    snprintf(msg, sizeof msg, "MT_ASSERT(%s) failed at %s:%d", cond, file, line);
    fprintf(stderr, "%s\n", msg);
    if (g_abort_hook) g_abort_hook(msg);
    abort();
}

static mt_log_level g_log_level = MT_LOG_INFO;
void mt_log_set_level(mt_log_level lvl) { g_log_level = lvl; }

void mt_log(mt_log_level lvl, const char *fmt, ...) {
    static const char *names[] = { "D", "I", "W", "E" };
    if (lvl < g_log_level) return;
    char line[1024];
    int n = snprintf(line, sizeof line, "[%s] ", names[lvl]);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line + n, sizeof line - (size_t)n - 1, fmt, ap);
    va_end(ap);
    size_t len = strlen(line);
    line[len] = '\n';
    fwrite(line, 1, len + 1, stderr);
}

double mt_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
