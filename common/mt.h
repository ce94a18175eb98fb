/* common/mt.h: the status type, error messages, dtypes, assertions and logging shared by every
 * metrale module (router, worker, kernels, tools).
 *
 * Conventions: a function that can fail returns mt_status (0 = ok, negative = error) and, when it
 * takes an mt_error *, writes a one-line human message there naming what was wrong (file, tensor,
 * field). A call that fails leaves its outputs untouched unless its header says otherwise. Bugs
 * abort through MT_ASSERT; bad input never does.
 */
#ifndef MT_H
#define MT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The release: metrale_build_info's version label. Equals charts/metrale/Chart.yaml's appVersion
 * (the image tag; tests/deploy/chart_test.py checks). */
#define MT_VERSION "0.1.0"

typedef enum mt_status {
    MT_OK = 0,
    MT_ERR_INVALID = -1,   /* bad argument or malformed input (config, request, tensor) */
    MT_ERR_IO = -2,        /* open/read/mmap failed, file truncated */
    MT_ERR_NOMEM = -3,     /* an allocation failed */
    MT_ERR_NOT_FOUND = -4, /* a named thing (tensor, file, field) is missing */
    MT_ERR_UNSUPPORTED = -5,
    MT_ERR_FULL = -6,      /* a bounded cache or queue has no room */
    MT_ERR_BACKEND = -7,   /* the backend (CUDA, cuBLAS, NCCL) reported an error */
    MT_ERR_STATE = -8,     /* call made in the wrong state (e.g. decode before prefill) */
} mt_status;

/* Static string for a status; never NULL. */
const char *mt_status_str(mt_status s);

/* A caller-owned message buffer. Functions write one line (no trailing newline) on failure. */
typedef struct mt_error {
    char msg[512];
} mt_error;

/* printf into err (NULL err is allowed: the message is dropped). Returns st for tail calls:
 *   return mt_errorf(err, MT_ERR_INVALID, "config: %s must be > 0", name); */
mt_status mt_errorf(mt_error *err, mt_status st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Element types of tensors in checkpoints and buffers. Append-only: a value keeps its meaning for
 * good, and a removed one stays as a comment. */
typedef enum mt_dtype {
    MT_F32 = 0,
    MT_F16 = 1,
    MT_BF16 = 2,
    MT_I32 = 3,
    MT_I64 = 4,
    MT_U8 = 5,
    MT_F8E4M3 = 6, /* fp8 e4m3fn: bias 7, no infinities, 0x7f/0xff NaN; checkpoints only */
} mt_dtype;

size_t mt_dtype_size(mt_dtype t);
const char *mt_dtype_name(mt_dtype t);

/* bf16/fp16 <-> fp32, round-to-nearest-even on the way down. */
static inline float mt_bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)h << 16;
    return v.f;
}
static inline uint16_t mt_f32_to_bf16(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40); /* quiet NaN */
    v.u += 0x7fffu + ((v.u >> 16) & 1u);
    return (uint16_t)(v.u >> 16);
}
float mt_f16_to_f32(uint16_t h);
uint16_t mt_f32_to_f16(float f);

/* fp8 e4m3fn (the OCP "E4M3" of FP8 checkpoints): sign, 4 exponent bits of bias 7, 3 mantissa
 * bits; exponent 0 is subnormal (m * 2^-9), 0x7f and 0xff are NaN, there are no infinities, the
 * largest finite value is 448. The conversion to fp32 is exact. mt_f32_to_f8e4m3 rounds to
 * nearest even and saturates to +-448 (NaN becomes 0x7f). */
float mt_f8e4m3_to_f32(uint8_t b);
uint8_t mt_f32_to_f8e4m3(float f);

/* Converts n elements of src (dtype t: F32, F16, BF16 or F8E4M3) to fp32. */
void mt_to_f32(float *dst, const void *src, mt_dtype t, size_t n);

/* MT_ASSERT: a broken invariant is a bug; print the condition, file and line, then abort through
 * the hook (the worker sets one that flushes its log). Never use it for input validation. */
typedef void (*mt_abort_hook)(const char *msg);
void mt_set_abort_hook(mt_abort_hook hook);
void mt_assert_fail(const char *cond, const char *file, int line) __attribute__((noreturn));
#define MT_ASSERT(cond) \
    do { if (!(cond)) mt_assert_fail(#cond, __FILE__, __LINE__); } while (0)

/* Logging to stderr: one record a line, each line one write() (thread-safe; lines of several
 * threads or processes sharing the descriptor do not interleave). Two formats:
 *   MT_LOG_TEXT (the default):  2026-05-01T12:00:00.123Z [I] router: listening on port 50051
 *   MT_LOG_JSON, one object a line:
 *     {"time":"2026-05-01T12:00:00.123Z","level":"info","component":"router","event":"log",
 *      "msg":"listening on port 50051"}
 * time is RFC 3339 UTC with milliseconds; level is debug, info, warn or error; component names
 * the process ("router", "worker 3", "serve"). A plain mt_log line is event "log" with its text
 * in msg (less the process's own prefix, "router: ", which component says). mt_log_event writes a
 * structured record: an event name, the request id when there is one, and typed fields; in text
 * it reads "[I] router: finished request_id=r1 status=OK completion_tokens=8".
 *
 * The format, level and component are process-wide settings made once by main, before any
 * thread logs; mt_log and mt_log_event may be called from any thread. */
typedef enum mt_log_level { MT_LOG_DEBUG, MT_LOG_INFO, MT_LOG_WARN, MT_LOG_ERROR } mt_log_level;
typedef enum mt_log_format { MT_LOG_TEXT = 0, MT_LOG_JSON = 1 } mt_log_format;
void mt_log(mt_log_level lvl, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void mt_log_set_level(mt_log_level lvl);
void mt_log_set_format(mt_log_format fmt);
mt_log_format mt_log_get_format(void);
/* "text" or "json" (the --log-format values); false for anything else. */
bool mt_log_format_parse(const char *s, mt_log_format *out);
/* component: the process's name in records; prefix: what its messages begin with ("router: "),
 * left out of JSON msg (NULL: component followed by ": "). Both copied (truncated to 63 bytes). */
void mt_log_set_component(const char *component, const char *prefix);

/* A field of a structured record. Make them with the mt_logf_* constructors. */
typedef enum mt_log_kind {
    MT_LOGF_STR,    /* s, escaped; NULL s: the field is left out */
    MT_LOGF_INT,    /* i */
    MT_LOGF_UINT,   /* u */
    MT_LOGF_DOUBLE, /* d; NaN and infinities are written null */
    MT_LOGF_BOOL,   /* b */
    MT_LOGF_JSON,   /* s, a JSON value (an array of ids) written as it is; NULL: left out */
} mt_log_kind;
typedef struct mt_log_field {
    const char *key;
    mt_log_kind kind;
    const char *s;
    int64_t i;
    uint64_t u;
    double d;
    bool b;
} mt_log_field;
static inline mt_log_field mt_logf_str(const char *k, const char *v) {
    return (mt_log_field){ .key = k, .kind = MT_LOGF_STR, .s = v };
}
static inline mt_log_field mt_logf_int(const char *k, int64_t v) {
    return (mt_log_field){ .key = k, .kind = MT_LOGF_INT, .i = v };
}
static inline mt_log_field mt_logf_uint(const char *k, uint64_t v) {
    return (mt_log_field){ .key = k, .kind = MT_LOGF_UINT, .u = v };
}
static inline mt_log_field mt_logf_double(const char *k, double v) {
    return (mt_log_field){ .key = k, .kind = MT_LOGF_DOUBLE, .d = v };
}
static inline mt_log_field mt_logf_bool(const char *k, bool v) {
    return (mt_log_field){ .key = k, .kind = MT_LOGF_BOOL, .b = v };
}
static inline mt_log_field mt_logf_json(const char *k, const char *v) {
    return (mt_log_field){ .key = k, .kind = MT_LOGF_JSON, .s = v };
}
/* Writes one structured record (see above). request_id may be NULL; fields[n] are borrowed for
 * the call. Strings are written as valid UTF-8 (a bad byte becomes U+FFFD). */
void mt_log_event(mt_log_level lvl, const char *event, const char *request_id, const mt_log_field *fields,
                  size_t n);
/* s as a quoted JSON string, escaped as records escape strings, for a JSON value a caller builds
 * (mt_logf_json). malloc'ed (the caller frees it); NULL when out of memory. */
char *mt_json_quote(const char *s);

/* Monotonic seconds. */
double mt_now(void);

#ifdef __cplusplus
}
#endif
#endif /* MT_H */
