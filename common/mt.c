/* common/mt.c: see mt.h. */
#include "common/mt.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

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
    case MT_U8: case MT_F8E4M3: return 1;
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
    case MT_F8E4M3: return "F8_E4M3";
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

float mt_f8e4m3_to_f32(uint8_t b) {
    const int exp = (b >> 3) & 0xf, man = b & 0x7;
    float v;
    if (exp == 0xf && man == 0x7) v = NAN;
    else if (exp == 0) v = ldexpf((float)man, -9);
    else v = ldexpf((float)(man | 0x8), exp - 10);
    return (b & 0x80) ? -v : v;
}

uint8_t mt_f32_to_f8e4m3(float f) {
    const uint8_t sign = signbit(f) ? 0x80 : 0;
    const float a = fabsf(f);
    if (isnan(f)) return 0x7f;
    if (a >= 448.0f) return sign | 0x7e;
    if (a < 0.015625f) /* below 2^-6: units of 2^-9; 8 units is code 8, the smallest normal */
        return sign | (uint8_t)lrintf(a * 512.0f);
    int e;
    const float m = frexpf(a, &e); /* a = m * 2^e, m in [0.5, 1) */
    long q = lrintf(m * 16.0f);   /* 1.mmm in eighths, 8..16 */
    if (q == 16) {
        q = 8;
        e++;
    }
    const int biased = e - 1 + 7;
    if (biased > 15 || (biased == 15 && q - 8 == 7)) return sign | 0x7e;
    return sign | (uint8_t)(biased << 3) | (uint8_t)(q - 8);
}

void mt_to_f32(float *dst, const void *src, mt_dtype t, size_t n) {
    switch (t) {
    case MT_F32: memcpy(dst, src, n * 4); return;
    case MT_BF16: for (size_t i = 0; i < n; i++) dst[i] = mt_bf16_to_f32(((const uint16_t *)src)[i]); return;
    case MT_F16: for (size_t i = 0; i < n; i++) dst[i] = mt_f16_to_f32(((const uint16_t *)src)[i]); return;
    case MT_F8E4M3: for (size_t i = 0; i < n; i++) dst[i] = mt_f8e4m3_to_f32(((const uint8_t *)src)[i]); return;
    default: MT_ASSERT(!"mt_to_f32: not a float dtype");
    }
}

static mt_abort_hook g_abort_hook;
void mt_set_abort_hook(mt_abort_hook hook) { g_abort_hook = hook; }

void mt_assert_fail(const char *cond, const char *file, int line) {
    char msg[512];
    snprintf(msg, sizeof msg, "MT_ASSERT(%s) failed at %s:%d", cond, file, line);
    mt_log(MT_LOG_ERROR, "%s", msg);
    if (g_abort_hook) g_abort_hook(msg);
    abort();
}

/* ---- logging ---- */

static mt_log_level g_log_level = MT_LOG_INFO;
static mt_log_format g_log_format = MT_LOG_TEXT;
static char g_component[64] = "", g_prefix[66] = "";

void mt_log_set_level(mt_log_level lvl) { g_log_level = lvl; }
void mt_log_set_format(mt_log_format fmt) { g_log_format = fmt; }
mt_log_format mt_log_get_format(void) { return g_log_format; }

bool mt_log_format_parse(const char *s, mt_log_format *out) {
    if (!strcmp(s, "text")) *out = MT_LOG_TEXT;
    else if (!strcmp(s, "json")) *out = MT_LOG_JSON;
    else return false;
    return true;
}

void mt_log_set_component(const char *component, const char *prefix) {
    snprintf(g_component, sizeof g_component, "%s", component ? component : "");
    if (prefix) snprintf(g_prefix, sizeof g_prefix, "%s", prefix);
    else snprintf(g_prefix, sizeof g_prefix, "%s: ", g_component);
}

/* A line being built: on the stack while short, on the heap past that. On out of memory the
 * line is cut (its end is lost, never the line). */
typedef struct line_buf {
    char *p;
    size_t n, cap;
    char stack[2048];
} line_buf;

static void lb_init(line_buf *b) {
    b->p = b->stack;
    b->n = 0;
    b->cap = sizeof b->stack;
}

static bool lb_room(line_buf *b, size_t more) {
    if (b->n + more + 2 <= b->cap) return true; /* + the newline and a NUL */
    size_t cap = b->cap * 2;
    while (cap < b->n + more + 2) cap *= 2;
    char *p = b->p == b->stack ? malloc(cap) : realloc(b->p, cap);
    if (!p) return false;
    if (b->p == b->stack) memcpy(p, b->stack, b->n);
    b->p = p;
    b->cap = cap;
    return true;
}

static void lb_put(line_buf *b, const char *s, size_t len) {
    if (!lb_room(b, len)) return;
    memcpy(b->p + b->n, s, len);
    b->n += len;
}

static void lb_puts(line_buf *b, const char *s) { lb_put(b, s, strlen(s)); }

static void lb_vprintf(line_buf *b, const char *fmt, va_list ap) {
    va_list ap2;
    va_copy(ap2, ap);
    int len = vsnprintf(b->p + b->n, b->cap - b->n, fmt, ap);
    if (len < 0) {
        va_end(ap2);
        return;
    }
    if ((size_t)len + 2 > b->cap - b->n) {
        if (lb_room(b, (size_t)len)) vsnprintf(b->p + b->n, b->cap - b->n, fmt, ap2);
        else len = (int)(b->cap - b->n) - 2; /* cut, as vsnprintf wrote it */
    }
    va_end(ap2);
    b->n += (size_t)len;
}

static void lb_printf(line_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void lb_printf(line_buf *b, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    lb_vprintf(b, fmt, ap);
    va_end(ap);
}

/* The length of the valid UTF-8 sequence at s[0, n), or 0 when it is not one. */
static size_t utf8_len(const unsigned char *s, size_t n) {
    const unsigned c = s[0];
    size_t len;
    unsigned min;
    if (c < 0x80) return 1;
    if (c >= 0xc2 && c <= 0xdf) len = 2, min = 0x80;
    else if (c >= 0xe0 && c <= 0xef) len = 3, min = 0x800;
    else if (c >= 0xf0 && c <= 0xf4) len = 4, min = 0x10000;
    else return 0;
    if (len > n) return 0;
    unsigned cp = c & (0x7f >> len);
    for (size_t i = 1; i < len; i++) {
        if ((s[i] & 0xc0) != 0x80) return 0;
        cp = cp << 6 | (s[i] & 0x3f);
    }
    return cp >= min && cp <= 0x10ffff && !(cp >= 0xd800 && cp <= 0xdfff) ? len : 0;
}

/* s as the inside of a JSON string (quote, backslash and control characters escaped; a byte that
 * is not valid UTF-8 becomes U+FFFD). */
static void lb_json_str(line_buf *b, const char *str) {
    const unsigned char *s = (const unsigned char *)str;
    size_t n = strlen(str);
    while (n) {
        size_t run = 0; /* bytes that need no escape */
        while (run < n && s[run] >= 0x20 && s[run] < 0x80 && s[run] != '"' && s[run] != '\\') run++;
        lb_put(b, (const char *)s, run);
        s += run, n -= run;
        if (!n) break;
        const unsigned c = s[0];
        size_t len = 1;
        if (c == '"') lb_puts(b, "\\\"");
        else if (c == '\\') lb_puts(b, "\\\\");
        else if (c == '\n') lb_puts(b, "\\n");
        else if (c == '\r') lb_puts(b, "\\r");
        else if (c == '\t') lb_puts(b, "\\t");
        else if (c < 0x20) lb_printf(b, "\\u%04x", c);
        else if ((len = utf8_len(s, n)) > 0) lb_put(b, (const char *)s, len);
        else len = 1, lb_puts(b, "\\ufffd");
        s += len, n -= len;
    }
}

static void lb_time(line_buf *b) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    lb_printf(b, "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour,
              tm.tm_min, tm.tm_sec, (int)(ts.tv_nsec / 1000000));
}

char *mt_json_quote(const char *s) {
    line_buf b;
    lb_init(&b);
    lb_puts(&b, "\"");
    lb_json_str(&b, s);
    lb_puts(&b, "\"");
    char *out = malloc(b.n + 1);
    if (out) {
        memcpy(out, b.p, b.n);
        out[b.n] = '\0';
    }
    if (b.p != b.stack) free(b.p);
    return out;
}

static const char *const LEVEL_CHAR[] = { "D", "I", "W", "E" };
static const char *const LEVEL_NAME[] = { "debug", "info", "warn", "error" };

/* The record's start: time, level, component and the request id when there is one. */
static void lb_head(line_buf *b, mt_log_level lvl, const char *request_id) {
    if (g_log_format == MT_LOG_JSON) {
        lb_puts(b, "{\"time\":\"");
        lb_time(b);
        lb_printf(b, "\",\"level\":\"%s\",\"component\":\"", LEVEL_NAME[lvl]);
        lb_json_str(b, g_component);
        lb_puts(b, "\"");
        if (request_id) {
            lb_puts(b, ",\"request_id\":\"");
            lb_json_str(b, request_id);
            lb_puts(b, "\"");
        }
    } else {
        lb_time(b);
        lb_printf(b, " [%s] ", LEVEL_CHAR[lvl]);
    }
}

/* Ends the line and writes it with one write(). */
static void lb_emit(line_buf *b) {
    if (g_log_format == MT_LOG_JSON) lb_puts(b, "}");
    if (b->n + 1 > b->cap) b->n = b->cap - 1; /* lb_room keeps room for the newline */
    b->p[b->n++] = '\n';
    size_t off = 0;
    while (off < b->n) {
        const ssize_t w = write(STDERR_FILENO, b->p + off, b->n - off);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) break;
        off += (size_t)w;
    }
    if (b->p != b->stack) free(b->p);
}

void mt_log(mt_log_level lvl, const char *fmt, ...) {
    if (lvl < g_log_level) return;
    line_buf b;
    lb_init(&b);
    lb_head(&b, lvl, NULL);
    va_list ap;
    va_start(ap, fmt);
    if (g_log_format == MT_LOG_JSON) {
        line_buf m;
        lb_init(&m);
        lb_vprintf(&m, fmt, ap);
        m.p[m.n] = '\0';
        const size_t np = strlen(g_prefix);
        const char *msg = np && !strncmp(m.p, g_prefix, np) ? m.p + np : m.p;
        lb_puts(&b, ",\"event\":\"log\",\"msg\":\"");
        lb_json_str(&b, msg);
        lb_puts(&b, "\"");
        if (m.p != m.stack) free(m.p);
    } else {
        lb_vprintf(&b, fmt, ap);
    }
    va_end(ap);
    lb_emit(&b);
}

/* A text value: as it is when it has no space, quote, '=' or control character; else quoted. */
static void lb_text_str(line_buf *b, const char *s) {
    bool plain = *s != '\0';
    for (const char *p = s; *p && plain; p++) plain = (unsigned char)*p > 0x20 && *p != '"' && *p != '=';
    if (plain) {
        lb_puts(b, s);
        return;
    }
    lb_puts(b, "\"");
    lb_json_str(b, s);
    lb_puts(b, "\"");
}

static void lb_number(line_buf *b, const mt_log_field *f) {
    switch (f->kind) {
    case MT_LOGF_INT: lb_printf(b, "%lld", (long long)f->i); break;
    case MT_LOGF_UINT: lb_printf(b, "%llu", (unsigned long long)f->u); break;
    case MT_LOGF_DOUBLE:
        if (isfinite(f->d)) lb_printf(b, "%.6g", f->d);
        else lb_puts(b, "null");
        break;
    case MT_LOGF_BOOL: lb_puts(b, f->b ? "true" : "false"); break;
    default: break;
    }
}

void mt_log_event(mt_log_level lvl, const char *event, const char *request_id, const mt_log_field *fields,
                  size_t n) {
    if (lvl < g_log_level) return;
    const bool json = g_log_format == MT_LOG_JSON;
    line_buf b;
    lb_init(&b);
    lb_head(&b, lvl, request_id);
    if (json) {
        lb_puts(&b, ",\"event\":\"");
        lb_json_str(&b, event);
        lb_puts(&b, "\"");
    } else {
        lb_printf(&b, "%s%s", g_prefix, event);
        if (request_id) {
            lb_puts(&b, " request_id=");
            lb_text_str(&b, request_id);
        }
    }
    for (size_t i = 0; i < n; i++) {
        const mt_log_field *f = &fields[i];
        if ((f->kind == MT_LOGF_STR || f->kind == MT_LOGF_JSON) && !f->s) continue;
        if (json) {
            lb_puts(&b, ",\"");
            lb_json_str(&b, f->key);
            lb_puts(&b, "\":");
        } else {
            lb_printf(&b, " %s=", f->key);
        }
        if (f->kind == MT_LOGF_STR && json) {
            lb_puts(&b, "\"");
            lb_json_str(&b, f->s);
            lb_puts(&b, "\"");
        } else if (f->kind == MT_LOGF_STR) {
            lb_text_str(&b, f->s);
        } else if (f->kind == MT_LOGF_JSON) {
            lb_puts(&b, f->s);
        } else {
            lb_number(&b, f);
        }
    }
    lb_emit(&b);
}

double mt_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
