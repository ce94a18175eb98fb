/* kernels/cpu/cpu_dense.c: embedding, GEMM on bf16/fp16/fp32 weights with fp32 accumulation,
 * norms, SwiGLU, sigmoid, l2norm, argmax. The GEMM converts each weight row once and uses it for
 * every input row, split across threads by output rows. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu_ops.h"

void cpu_weight_row(const mt_weight *w, int64_t r, float *dst) {
    const size_t es = mt_dtype_size(w->dtype);
    mt_to_f32(dst, (const char *)w->data + (size_t)r * (size_t)w->cols * es, w->dtype, (size_t)w->cols);
}

void cpu_embed(mt_backend *be, float *out, const mt_weight *table, const int32_t *ids, int n) {
    (void)be;
    for (int i = 0; i < n; i++) {
        MT_ASSERT(ids[i] >= 0 && ids[i] < table->rows);
        cpu_weight_row(table, ids[i], out + (size_t)i * table->cols);
    }
}

/* Row by row: consecutive positions may sit on different pages. */
void cpu_copy_rows_at(mt_backend *be, mt_paged dst, const int32_t *bt, int t0, const int32_t *pos,
                      const float *src, int n) {
    (void)be;
    if (pos) t0 = *pos; /* host memory on this backend */
    MT_ASSERT(t0 >= 0 && n >= 0 && dst.page > 0 && dst.row > 0);
    for (int i = 0; i < n; i++)
        memcpy(mt_paged_at(dst, bt, (int64_t)t0 + i), src + (size_t)i * (size_t)dst.row, sizeof(float) * (size_t)dst.row);
}

static float dot(const float *a, const float *b, int64_t n) {
    float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        s0 += a[i] * b[i];
        s1 += a[i + 1] * b[i + 1];
        s2 += a[i + 2] * b[i + 2];
        s3 += a[i + 3] * b[i + 3];
    }
    for (; i < n; i++) s0 += a[i] * b[i];
    return (s0 + s1) + (s2 + s3);
}

static uint32_t g_round_x;       /* mt_cpu_set_round_x */
static int g_round_bits = 8;     /* mt_cpu_set_round_bits: significant bits kept (8: bf16) */

static int g_round_fp8lo;        /* mt_cpu_set_round_fp8lo: 0 off, 1 row scales, 2 matrix scales */

void mt_cpu_set_round_x(uint32_t mask) { g_round_x = mask; }
void mt_cpu_set_round_bits(int bits) { g_round_bits = bits < 2 ? 2 : bits > 24 ? 24 : bits; }
void mt_cpu_set_round_fp8lo(int mode) { g_round_fp8lo = mode == 1 || mode == 2 ? mode : 0; }

/* v as fp8 e4m3 holds it: 4 significant bits to nearest even, normals from 2^-6, subnormals in
 * steps of 2^-9, saturating at 448. */
static float e4m3(float v) {
    const float a = fabsf(v);
    if (a >= 448.f) return v < 0 ? -448.f : 448.f;
    if (a < 0x1p-6f) return nearbyintf(v * 0x1p9f) * 0x1p-9f;
    union { uint32_t u; float f; } t = { .f = v };
    t.u += (1u << 19) - 1u + ((t.u >> 20) & 1u);
    t.u &= ~((1u << 20) - 1u);
    return t.f;
}

static float amax(const float *src, int64_t k) {
    float mx = 0.f;
    for (int64_t j = 0; j < k; j++) mx = fmaxf(mx, fabsf(src[j]));
    return mx;
}

/* dst[k] = e4m3(src[k] / s) * s with s = mx / 448 (mx: the row's max |src| for a scale per row, or
 * the whole matrix's for one scale). */
static void fp8_row(float *dst, const float *src, int64_t k, float mx) {
    const float sc = mx > 0.f ? mx / 448.f : 1.f;
    for (int64_t j = 0; j < k; j++) dst[j] = e4m3(src[j] / sc) * sc;
}

/* f rounded to g_round_bits significant bits, to nearest even (8 is mt_f32_to_bf16's rounding);
 * fp32's exponent range kept (fp16's narrower one is not modelled). */
static float round_bits(float f) {
    if (g_round_bits >= 24) return f;
    union { uint32_t u; float f; } v = { .f = f };
    if ((v.u & 0x7f800000u) == 0x7f800000u) return f; /* inf, NaN */
    const int sh = 24 - g_round_bits;
    v.u += (1u << (sh - 1)) - 1u + ((v.u >> sh) & 1u);
    v.u &= ~((1u << sh) - 1u);
    return v.f;
}

/* Research hook, fp8 low part: y = x_hi . w + x_lo . w8, x_hi = bf16(x), x_lo = x - x_hi as fp8
 * e4m3, w8 the weight as e4m3, each with a scale per row (g_round_fp8lo 1) or one scale per
 * matrix (2): a bf16 GEMM plus an fp8 one at twice the rate, as a faster two-part prefill GEMM
 * would compute. */
static void matmul_fp8lo(mt_backend *be, float *y, const float *x, const mt_weight *w, int n) {
    const int64_t out = w->rows, in = w->cols;
    float *hi = malloc(sizeof(float) * (size_t)n * (size_t)in), *lo = malloc(sizeof(float) * (size_t)n * (size_t)in);
    MT_ASSERT(hi && lo);
    for (int64_t i = 0; i < (int64_t)n * in; i++) {
        hi[i] = mt_bf16_to_f32(mt_f32_to_bf16(x[i]));
        lo[i] = x[i] - hi[i];
    }
    const bool per_row = g_round_fp8lo == 1;
    const float lo_mx = per_row ? 0.f : amax(lo, (int64_t)n * in);
    for (int i = 0; i < n; i++) {
        float *r = lo + (size_t)i * in;
        fp8_row(r, r, in, per_row ? amax(r, in) : lo_mx);
    }
    float w_mx = 0.f; /* the weight's max |w| (one scale for the matrix) */
    if (!per_row) {
        float *row = malloc(sizeof(float) * (size_t)in);
        MT_ASSERT(row);
        for (int64_t o = 0; o < out; o++) {
            cpu_weight_row(w, o, row);
            w_mx = fmaxf(w_mx, amax(row, in));
        }
        free(row);
    }
#pragma omp parallel num_threads(be->n_threads) if (out * in * n > CPU_PAR_MIN_WORK)
    {
        float *row = malloc(sizeof(float) * (size_t)in * 2), *row8 = row + in;
        MT_ASSERT(row);
#pragma omp for schedule(static)
        for (int64_t o = 0; o < out; o++) {
            cpu_weight_row(w, o, row);
            fp8_row(row8, row, in, per_row ? amax(row, in) : w_mx);
            for (int i = 0; i < n; i++)
                y[(size_t)i * out + o] = dot(hi + (size_t)i * in, row, in) + dot(lo + (size_t)i * in, row8, in);
        }
        free(row);
    }
    free(hi);
    free(lo);
}

void cpu_matmul(mt_backend *be, float *y, const float *x, const mt_weight *w, int n) {
    const int64_t out = w->rows, in = w->cols;
    float *xr = NULL;
    if ((g_round_x & (1u << w->cls)) && g_round_fp8lo) {
        matmul_fp8lo(be, y, x, w, n);
        return;
    }
    if (g_round_x & (1u << w->cls)) { /* research hook: x as a single-rounding GEMM sees it */
        xr = malloc(sizeof(float) * (size_t)n * (size_t)in);
        MT_ASSERT(xr);
        for (int64_t i = 0; i < (int64_t)n * in; i++) xr[i] = round_bits(x[i]);
        x = xr;
    }
    /* Blocks of 4 weight rows per thread step keep each x row hot for 4 outputs. */
#pragma omp parallel num_threads(be->n_threads) if (out * in * n > CPU_PAR_MIN_WORK)
    {
        float *rows = malloc(sizeof(float) * (size_t)in * 4);
#pragma omp for schedule(static)
        for (int64_t o = 0; o < out; o += 4) {
            const int nb = (int)(out - o < 4 ? out - o : 4);
            for (int b = 0; b < nb; b++) cpu_weight_row(w, o + b, rows + (size_t)b * in);
            for (int i = 0; i < n; i++) {
                const float *xi = x + (size_t)i * in;
                for (int b = 0; b < nb; b++) y[(size_t)i * out + o + b] = dot(xi, rows + (size_t)b * in, in);
            }
        }
        free(rows);
    }
    free(xr);
}

void cpu_rmsnorm(mt_backend *be, float *out, const float *x, const float *w, int n, int d, float eps) {
    (void)be;
    for (int i = 0; i < n; i++) {
        const float *xi = x + (size_t)i * d;
        float *oi = out + (size_t)i * d;
        double ss = 0;
        for (int j = 0; j < d; j++) ss += (double)xi[j] * xi[j];
        const float r = 1.f / sqrtf((float)(ss / d) + eps);
        for (int j = 0; j < d; j++) oi[j] = xi[j] * r * (w ? w[j] : 1.f);
    }
}

void cpu_layernorm(mt_backend *be, float *out, const float *x, const float *w, const float *b, int n,
                   int d, float eps) {
    (void)be;
    for (int i = 0; i < n; i++) {
        const float *xi = x + (size_t)i * d;
        float *oi = out + (size_t)i * d;
        double mean = 0, var = 0;
        for (int j = 0; j < d; j++) mean += xi[j];
        mean /= d;
        for (int j = 0; j < d; j++) var += (xi[j] - mean) * (xi[j] - mean);
        var /= d;
        const float r = 1.f / sqrtf((float)var + eps);
        for (int j = 0; j < d; j++) oi[j] = (float)(xi[j] - mean) * r * w[j] + b[j];
    }
}

void cpu_swiglu(mt_backend *be, float *out, const float *gate, const float *up, int n, int I, float L) {
    (void)be;
    for (int64_t i = 0; i < (int64_t)n * I; i++) {
        const float g = fminf(gate[i], L);
        const float u = fminf(fmaxf(up[i], -L), L);
        out[i] = cpu_siluf(g) * u;
    }
}

void cpu_sigmoid(mt_backend *be, float *x, int64_t count) {
    (void)be;
    for (int64_t i = 0; i < count; i++) x[i] = cpu_sigmoidf(x[i]);
}

void cpu_l2norm(mt_backend *be, float *x, int64_t n, int d, float eps, float scale) {
    (void)be;
    for (int64_t i = 0; i < n; i++) {
        float *xi = x + (size_t)i * d;
        float ss = 0;
        for (int j = 0; j < d; j++) ss += xi[j] * xi[j];
        const float r = scale / sqrtf(ss + eps);
        for (int j = 0; j < d; j++) xi[j] *= r;
    }
}

void cpu_argmax_dev(mt_backend *be, int32_t *out, int rep, const float *logits, int n, int V) {
    (void)be;
    for (int i = 0; i < n; i++) {
        const float *l = logits + (size_t)i * V;
        int best = 0;
        for (int v = 1; v < V; v++)
            if (l[v] > l[best]) best = v;
        for (int j = 0; j < rep; j++) out[(size_t)i * rep + j] = best;
    }
}

void cpu_argmax(mt_backend *be, int32_t *out, const float *logits, int n, int V) {
    cpu_argmax_dev(be, out, 1, logits, n, V);
}
