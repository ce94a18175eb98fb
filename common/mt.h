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

/* Converts n elements of src (dtype t) to fp32. */
void mt_to_f32(float *dst, const void *src, mt_dtype t, size_t n);

/* MT_ASSERT: a broken invariant is a bug; print the condition, file and line, then abort through
 * the hook (the worker sets one that flushes its log). Never use it for input validation. */
typedef void (*mt_abort_hook)(const char *msg);
void mt_set_abort_hook(mt_abort_hook hook);
void mt_assert_fail(const char *cond, const char *file, int line) __attribute__((noreturn));
#define MT_ASSERT(cond) \
    do { if (!(cond)) mt_assert_fail(#cond, __FILE__, __LINE__); } while (0)

/* Logging to stderr with a level prefix. Thread-safe (one write per line). */
typedef enum mt_log_level { MT_LOG_DEBUG, MT_LOG_INFO, MT_LOG_WARN, MT_LOG_ERROR } mt_log_level;
void mt_log(mt_log_level lvl, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void mt_log_set_level(mt_log_level lvl);

/* Monotonic seconds. */
double mt_now(void);

#ifdef __cplusplus
}
#endif
#endif /* MT_H */
