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

static void cpu_embed(mt_backend *be, float *out, const mt_weight *table, const int32_t *ids, int n) {
    (void)be;
    for (int i = 0; i < n; i++) {
        const int64_t r = (int64_t)ids[i] - table->row0;
        if (r >= 0 && r < table->rows) cpu_weight_row(table, r, out + (size_t)i * table->cols);
        else memset(out + (size_t)i * table->cols, 0, sizeof(float) * (size_t)table->cols); /* another shard's */
    }
}

/* Row by row: consecutive positions may sit on different pages. */
static void cpu_copy_rows_at(mt_backend *be, mt_paged dst, const int32_t *bt, int t0, const int32_t *pos,
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

static void cpu_matmul(mt_backend *be, float *y, const float *x, const mt_weight *w, int n) {
    const int64_t out = w->rows, in = w->cols;
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
}

static void cpu_rmsnorm(mt_backend *be, float *out, const float *x, const float *w, int n, int d, float eps) {
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

static void cpu_layernorm(mt_backend *be, float *out, const float *x, const float *w, const float *b, int n,
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

static void cpu_swiglu(mt_backend *be, float *out, const float *gate, const float *up, int n, int I, float L) {
    (void)be;
    for (int64_t i = 0; i < (int64_t)n * I; i++) {
        const float g = fminf(gate[i], L);
        const float u = fminf(fmaxf(up[i], -L), L);
        out[i] = cpu_siluf(g) * u;
    }
}

static void cpu_add(mt_backend *be, float *y, const float *x, int64_t count) {
    (void)be;
    for (int64_t i = 0; i < count; i++) y[i] += x[i];
}

static void cpu_sigmoid(mt_backend *be, float *x, int64_t count) {
    (void)be;
    for (int64_t i = 0; i < count; i++) x[i] = cpu_sigmoidf(x[i]);
}

static void cpu_l2norm(mt_backend *be, float *x, int64_t n, int d, float eps, float scale) {
    (void)be;
    for (int64_t i = 0; i < n; i++) {
        float *xi = x + (size_t)i * d;
        float ss = 0;
        for (int j = 0; j < d; j++) ss += xi[j] * xi[j];
        const float r = scale / sqrtf(ss + eps);
        for (int j = 0; j < d; j++) xi[j] *= r;
    }
}

static void cpu_argmax_dev(mt_backend *be, int32_t *out, int rep, const float *logits, int n, int V) {
    (void)be;
    for (int i = 0; i < n; i++) {
        const float *l = logits + (size_t)i * V;
        int best = 0;
        for (int v = 1; v < V; v++)
            if (l[v] > l[best]) best = v;
        for (int j = 0; j < rep; j++) out[(size_t)i * rep + j] = best;
    }
}

static void cpu_argmax(mt_backend *be, int32_t *out, const float *logits, int n, int V) {
    cpu_argmax_dev(be, out, 1, logits, n, V);
}

void cpu_dense_fill(mt_backend_ops *t) {
    t->embed = cpu_embed;
    t->embed_dev = cpu_embed; /* host memory: ids are already readable */
    t->copy_rows_at = cpu_copy_rows_at;
    t->matmul = cpu_matmul;
    t->rmsnorm = cpu_rmsnorm;
    t->layernorm = cpu_layernorm;
    t->swiglu = cpu_swiglu;
    t->sigmoid = cpu_sigmoid;
    t->add = cpu_add;
    t->l2norm = cpu_l2norm;
    t->argmax = cpu_argmax;
    t->argmax_dev = cpu_argmax_dev;
}
