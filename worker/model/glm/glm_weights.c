/* worker/model/glm/glm_weights.c: binds checkpoint tensors to the layers' weight structs. The whole
 * manifest (glm_manifest.h) is checked first, so a missing tensor or a wrong shape is reported by
 * name before anything is uploaded; matrices become backend weights (views on the CPU), vectors
 * are converted to fp32 backend buffers. Block-scaled FP8 linear weights (docs/MODEL.md, "FP8
 * checkpoints") of the dense projections and of the routed experts stay FP8 on a backend that
 * multiplies FP8 (mt_backend_ops.weight_fp8) unless params.dequant_fp8; every other FP8 weight,
 * and every one on other backends, is dequantised on the host to bf16, this rank's part only, and
 * placed as a bf16 weight. */
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/mt_rand.h"
#include "worker/loader/glm_manifest.h"
#include "worker/model/glm/glm_impl.h"

typedef struct check_ctx {
    const st_archive *ar;
    const glm_quant *quant;
    mt_error *err;
    mt_status st;
    uint64_t bytes;    /* of the tensors checked */
} check_ctx;

/* A linear weight may be FP8 with its block scales, unless modules_to_not_convert lists it;
 * anything else must be at a float dtype. */
static void check_one(const glm_tensor_spec *s, void *user) {
    check_ctx *c = user;
    if (c->st != MT_OK) return;
    const st_tensor *t, *scale = NULL;
    if (!s->linear) {
        c->st = st_get(c->ar, s->name, s->ndim, s->shape, &t, c->err);
    } else {
        const glm_quant *q = c->quant;
        c->st = st_get_weight(c->ar, s->name, s->ndim, s->shape, q->fp8 ? q->block_rows : 0,
                              q->fp8 ? q->block_cols : 0, &t, &scale, c->err);
        if (c->st == MT_OK && scale && glm_quant_skips(q, s->name))
            c->st = mt_errorf(c->err, MT_ERR_INVALID,
                              "%s: tensor %s is F8_E4M3 but config.json's modules_to_not_convert lists its module",
                              t->file, s->name);
    }
    if (c->st == MT_OK) c->bytes += t->nbytes + (scale ? scale->nbytes : 0);
}

/* The block scales of F8_E4M3 tensor t (st_get_weight checked them). */
static const st_tensor *scale_of(const st_archive *ar, const st_tensor *t) {
    char name[256];
    snprintf(name, sizeof name, "%s_scale_inv", t->name);
    const st_tensor *s = st_find(ar, name);
    MT_ASSERT(s); /* the manifest check ran first */
    return s;
}

/* Where weights come from: the checkpoint archive, or (random) mean + std * N(0,1) drawn from
 * mt_rand_key(seed, name) at the manifest's dtype and scale, made in the backend's memory. */
/* How a tensor is split across the ranks of a tensor-parallel group (glm_shard.c): kept whole,
 * or rank r takes the r-th of tp_size equal parts of its first dimension (rows; for a vector its
 * elements, for the KDA conv [D, 1, K] its D) or of its last (the input columns of a matrix). */
typedef enum shard { WHOLE, ROWS, COLS } shard;

typedef struct binder {
    glm_model *m;
    mt_error *err;
    shard sh;                /* of the next bind */
    /* Of the next binds: an FP8 tensor may stay FP8 (its consumers are matmul, matmul_multi and,
     * for experts, moe_experts(_shared)). Off for the weights other ops read (kv_b, hc fn), the
     * discrete choices' and gates' (router, indexer, KDA gates), eh_proj and lm_head. */
    bool fp8_keep;
    char name[192];
    bool random;
    uint64_t seed;
    glm_tensor_spec *specs;  /* random: the manifest */
    int n_specs;
} binder;

static const st_tensor *find(binder *b, const char *fmt, va_list ap) {
    vsnprintf(b->name, sizeof b->name, fmt, ap);
    if (b->random) return NULL;
    const st_tensor *t = st_find(b->m->ar, b->name);
    MT_ASSERT(t); /* the manifest check ran first */
    return t;
}

static const glm_tensor_spec *spec_of(const binder *b) {
    for (int i = 0; i < b->n_specs; i++)
        if (!strcmp(b->specs[i].name, b->name)) return &b->specs[i];
    MT_ASSERT(!"binder: tensor missing from the manifest");
    return NULL;
}

static int64_t spec_count(const glm_tensor_spec *s) {
    int64_t n = 1;
    for (int i = 0; i < s->ndim; i++) n *= s->shape[i];
    return n;
}

/* A random matrix's shard. On several ranks each rank draws its own part from a key of its own:
 * random sharded models are for measuring speed, not for comparing ranks' outputs. */
static mt_status bind_w_random(binder *b, mt_weight *w) {
    const glm_tensor_spec *s = spec_of(b);
    const glm_model *m = b->m;
    int64_t rows = s->shape[0], cols = spec_count(s) / s->shape[0];
    uint64_t key = mt_rand_key(b->seed, s->name);
    if (b->sh != WHOLE && m->tp_size > 1) {
        if (b->sh == ROWS) rows /= m->tp_size;
        else cols /= m->tp_size;
        key = mt_rand_key(key, m->tp_rank == 0 ? "rank0" : "rank");
        key += (uint64_t)m->tp_rank;
    }
    mt_backend *be = b->m->be;
    const bool fp8 = b->fp8_keep && m->params.random_fp8 && be->ops->weight_fp8_from;
    mt_weight src = { 0 };
    mt_status st = be->ops->weight_random(be, s->dtype, rows, cols, key, s->mean, s->std, fp8 ? &src : w);
    if (st == MT_OK && fp8) {
        st = be->ops->weight_fp8_from(be, &src, w);
        be->ops->weight_free(be, &src);
    }
    if (st != MT_OK) return mt_errorf(b->err, st, "cannot make random tensor %s on the backend", s->name);
    return MT_OK;
}

/* Host fp32 values of a random vector, rounded through its stored dtype like a checkpoint. */
static float *random_vector(const binder *b, size_t *n) {
    const glm_tensor_spec *s = spec_of(b);
    *n = (size_t)spec_count(s);
    size_t lo = 0;
    if (b->sh == ROWS && b->m->tp_size > 1) {
        *n /= (size_t)b->m->tp_size;
        lo = *n * (size_t)b->m->tp_rank;
    }
    float *v = malloc(sizeof(float) * (*n ? *n : 1));
    if (!v) return NULL;
    const uint64_t key = mt_rand_key(b->seed, s->name);
    for (size_t i = 0; i < *n; i++) {
        v[i] = s->mean + s->std * mt_rand_normal(key, lo + i);
        if (s->dtype == MT_BF16) v[i] = mt_bf16_to_f32(mt_f32_to_bf16(v[i]));
    }
    return v;
}

/* What the product of the tensor named name feeds (mt_wcls): the discrete choices (router top-k,
 * indexer top-k), the mHC mix (Sinkhorn), the KDA decay and beta gates, or plain projections. */
static uint8_t wcls_of(const char *name) {
    static const struct { const char *part; mt_wcls cls; } map[] = {
        { "mlp.gate.weight", MT_WCLS_ROUTER }, { ".indexer.", MT_WCLS_INDEXER }, { ".hc_", MT_WCLS_HC },
        { ".f_a_proj", MT_WCLS_KDA_GATE }, { ".f_b_proj", MT_WCLS_KDA_GATE }, { ".b_proj", MT_WCLS_KDA_GATE },
        { ".g_a_proj", MT_WCLS_KDA_GATE }, { ".g_b_proj", MT_WCLS_KDA_GATE }, { "self_attn.", MT_WCLS_ATTN },
        { ".mlp.", MT_WCLS_MLP }, { "lm_head", MT_WCLS_HEAD },
    };
    for (size_t i = 0; i < sizeof map / sizeof map[0]; i++)
        if (strstr(name, map[i].part)) return (uint8_t)map[i].cls;
    return MT_WCLS_OTHER;
}

/* Keeps a host buffer for the model's lifetime (a backend weight that views it), or frees it now
 * (one that copied it). */
static mt_status keep_host(glm_model *m, void *buf, const mt_weight *w) {
    if (w->owned) {
        free(buf);
        return MT_OK;
    }
    if (m->n_kept_host == m->cap_kept_host) {
        const int cap = m->cap_kept_host ? 2 * m->cap_kept_host : 64;
        void **grown = realloc(m->kept_host, sizeof *grown * (size_t)cap);
        if (!grown) return MT_ERR_NOMEM;
        m->kept_host = grown;
        m->cap_kept_host = cap;
    }
    m->kept_host[m->n_kept_host++] = buf;
    return MT_OK;
}

/* Rows [r0, r0 + nr) x columns [c0, c0 + nc) of the FP8 matrix t, dequantised to a bf16 host
 * buffer and placed as a bf16 backend weight. */
static mt_status place_fp8(glm_model *m, const st_tensor *t, int64_t r0, int64_t nr, int64_t c0, int64_t nc,
                           mt_weight *w, mt_error *err) {
    const glm_quant *q = &m->cfg.quant;
    uint16_t *buf = malloc(sizeof(uint16_t) * (size_t)(nr * nc) + 1);
    if (!buf) return mt_errorf(err, MT_ERR_NOMEM, "out of memory for tensor %s", t->name);
    mt_status st = st_dequant_fp8(t, scale_of(m->ar, t), q->block_rows, q->block_cols, r0, nr, c0, nc, MT_BF16, buf,
                                  err);
    if (st == MT_OK && (st = m->be->ops->weight(m->be, buf, MT_BF16, nr, nc, w)) != MT_OK)
        mt_errorf(err, st, "%s: cannot place tensor %s on the backend", t->file, t->name);
    if (st == MT_OK && (st = keep_host(m, buf, w)) != MT_OK)
        mt_errorf(err, st, "out of memory for tensor %s", t->name);
    else if (st != MT_OK) free(buf);
    return st;
}

/* The weight_fp8 block edge (kernels/backend.h). */
enum { FP8_KEPT_BLOCK = 128 };

/* Rows [r0, r0 + nr) x columns [c0, c0 + nc) of the FP8 matrix t kept in FP8 on the backend
 * (weight_fp8, 128 x 128 blocks). A checkpoint of 128 x 128 blocks (GLM's, DeepSeek's) cut on
 * block edges gives its e4m3 bytes and scales as they are. Other block sizes (the test fixtures'
 * 16 x 32) and cuts through blocks are dequantised to fp32 and quantised again to 128 x 128
 * blocks (scale = block amax / 448, each value rounded to nearest even e4m3): one more rounding
 * of each weight, which the exact form never adds. */
static mt_status place_fp8_kept(glm_model *m, const st_tensor *t, int64_t r0, int64_t nr, int64_t c0, int64_t nc,
                                mt_weight *w, mt_error *err) {
    const glm_quant *q = &m->cfg.quant;
    const int64_t B = FP8_KEPT_BLOCK, cols = t->shape[1], rb = (nr + B - 1) / B, cbk = (nc + B - 1) / B;
    const bool exact = q->block_rows == B && q->block_cols == B && r0 % B == 0 && c0 % B == 0;
    const st_tensor *sc = scale_of(m->ar, t);
    uint8_t *wq = malloc((size_t)(nr * nc) + 1);
    float *ws = malloc(sizeof(float) * (size_t)(rb * cbk) + sizeof(float));
    float *f = exact ? NULL : malloc(sizeof(float) * (size_t)(nr * nc) + sizeof(float));
    mt_status st = MT_OK;
    if (!wq || !ws || (!exact && !f)) {
        st = mt_errorf(err, MT_ERR_NOMEM, "out of memory for tensor %s", t->name);
        goto done;
    }
    if (exact) {
        const size_t ses = mt_dtype_size(sc->dtype);
        for (int64_t i = 0; i < nr; i++) {
            const uint8_t *src = (const uint8_t *)t->data + (size_t)((r0 + i) * cols + c0);
            for (int64_t j = 0; j < nc; j++)
                if ((src[j] & 0x7f) == 0x7f) {
                    st = mt_errorf(err, MT_ERR_INVALID, "%s: tensor %.200s holds an FP8 NaN (0x%02x) at [%lld, %lld]",
                                   t->file, t->name, src[j], (long long)(r0 + i), (long long)(c0 + j));
                    goto done;
                }
            memcpy(wq + (size_t)(i * nc), src, (size_t)nc);
        }
        for (int64_t bi = 0; bi < rb; bi++)
            for (int64_t bj = 0; bj < cbk; bj++)
                mt_to_f32(&ws[bi * cbk + bj],
                          (const char *)sc->data + (size_t)((r0 / B + bi) * sc->shape[1] + c0 / B + bj) * ses,
                          sc->dtype, 1);
    } else {
        if ((st = st_dequant_fp8(t, sc, q->block_rows, q->block_cols, r0, nr, c0, nc, MT_F32, f, err)) != MT_OK)
            goto done;
        for (int64_t bi = 0; bi < rb; bi++)
            for (int64_t bj = 0; bj < cbk; bj++) {
                const int64_t i1 = (bi + 1) * B < nr ? (bi + 1) * B : nr, j1 = (bj + 1) * B < nc ? (bj + 1) * B : nc;
                float amax = 0.f;
                for (int64_t i = bi * B; i < i1; i++)
                    for (int64_t j = bj * B; j < j1; j++) amax = fmaxf(amax, fabsf(f[i * nc + j]));
                const float s = amax > 0.f ? amax / 448.f : 1.f;
                ws[bi * cbk + bj] = s;
                for (int64_t i = bi * B; i < i1; i++)
                    for (int64_t j = bj * B; j < j1; j++) wq[i * nc + j] = mt_f32_to_f8e4m3(f[i * nc + j] / s);
            }
    }
    if ((st = m->be->ops->weight_fp8(m->be, wq, ws, nr, nc, w)) != MT_OK)
        mt_errorf(err, st, "%s: cannot place tensor %s on the backend", t->file, t->name);
done:
    free(wq);
    free(ws);
    free(f);
    return st;
}

/* An FP8 part of t: kept FP8 (place_fp8_kept) where the bind allows it, the backend multiplies
 * FP8 and the params do not ask for bf16; else dequantised to bf16 (place_fp8). */
static mt_status place_fp8_part(binder *b, const st_tensor *t, int64_t r0, int64_t nr, int64_t c0, int64_t nc,
                                mt_weight *w) {
    glm_model *m = b->m;
    if (b->fp8_keep && m->be->ops->weight_fp8 && !m->params.dequant_fp8)
        return place_fp8_kept(m, t, r0, nr, c0, nc, w, b->err);
    return place_fp8(m, t, r0, nr, c0, nc, w, b->err);
}

/* This rank's part of matrix t [rows, cols] made a backend weight: whole, a run of rows (read in
 * place), or a run of columns (gathered row by row into a host buffer); an FP8 matrix's part is
 * kept FP8 or dequantised (place_fp8_part), whichever blocks the cut goes through. Counts the
 * bytes read. */
static mt_status place_shard(binder *b, const st_tensor *t, int64_t rows, int64_t cols, mt_weight *w) {
    glm_model *m = b->m;
    const size_t es = mt_dtype_size(t->dtype), N = (size_t)m->tp_size, r = (size_t)m->tp_rank;
    const bool fp8 = t->dtype == MT_F8E4M3;
    mt_status st;
    if (b->sh == WHOLE || N == 1) {
        if (b->sh == WHOLE) m->bytes_replicated += t->nbytes;
        else m->bytes_sharded_read += t->nbytes, m->bytes_sharded_total += t->nbytes;
        if (fp8) return place_fp8_part(b, t, 0, rows, 0, cols, w);
        st = m->be->ops->weight(m->be, t->data, t->dtype, rows, cols, w);
        goto placed;
    }
    m->bytes_sharded_total += t->nbytes;
    m->bytes_sharded_read += t->nbytes / N;
    if (b->sh == ROWS) {
        const int64_t lr = rows / (int64_t)N;
        if (fp8) return place_fp8_part(b, t, (int64_t)r * lr, lr, 0, cols, w);
        st = m->be->ops->weight(m->be, (const char *)t->data + r * (size_t)lr * cols * es, t->dtype, lr, cols, w);
        goto placed;
    }
    const size_t lc = (size_t)cols / N, rb = lc * es;
    if (fp8) return place_fp8_part(b, t, 0, rows, (int64_t)(r * lc), (int64_t)lc, w);
    char *buf = malloc(rb * (size_t)rows + 1);
    if (!buf) return mt_errorf(b->err, MT_ERR_NOMEM, "out of memory for tensor %s", t->name);
    for (int64_t i = 0; i < rows; i++)
        memcpy(buf + (size_t)i * rb, (const char *)t->data + ((size_t)i * cols + r * lc) * es, rb);
    st = m->be->ops->weight(m->be, buf, t->dtype, rows, (int64_t)lc, w);
    if (st == MT_OK) st = keep_host(m, buf, w);
    else free(buf);
placed:
    return st == MT_OK ? MT_OK : mt_errorf(b->err, st, "%s: cannot place tensor %s on the backend", t->file, t->name);
}

static mt_status bind_w(binder *b, mt_weight *w, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static mt_status bind_w(binder *b, mt_weight *w, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    const st_tensor *t = find(b, fmt, ap);
    va_end(ap);
    mt_status st;
    if (b->random) {
        st = bind_w_random(b, w);
    } else {
        int64_t cols = 1;
        for (int i = 1; i < t->ndim; i++) cols *= t->shape[i];
        if ((st = place_shard(b, t, t->shape[0], cols, w)) != MT_OK) return st;
    }
    if (st == MT_OK) w->cls = wcls_of(b->name);
    return st;
}

static mt_status bind_v(binder *b, float **v, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static mt_status bind_v(binder *b, float **v, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    const st_tensor *t = find(b, fmt, ap);
    va_end(ap);
    size_t n = 0;
    float *host;
    if (b->random) {
        host = random_vector(b, &n);
    } else {
        n = t->nbytes / mt_dtype_size(t->dtype);
        size_t lo = 0;
        glm_model *m = b->m;
        if (b->sh == ROWS && m->tp_size > 1) {
            n /= (size_t)m->tp_size;
            lo = n * (size_t)m->tp_rank;
            m->bytes_sharded_total += t->nbytes;
            m->bytes_sharded_read += t->nbytes / (size_t)m->tp_size;
        } else {
            m->bytes_replicated += t->nbytes;
        }
        if ((host = malloc(sizeof(float) * (n ? n : 1))))
            mt_to_f32(host, (const char *)t->data + lo * mt_dtype_size(t->dtype), t->dtype, n);
    }
    float *dev = b->m->be->ops->alloc(b->m->be, sizeof(float) * (n ? n : 1));
    if (!host || !dev) {
        free(host);
        b->m->be->ops->free(b->m->be, dev);
        return mt_errorf(b->err, MT_ERR_NOMEM, "out of memory for tensor %s", b->name);
    }
    b->m->be->ops->upload(b->m->be, dev, host, sizeof(float) * n);
    free(host);
    *v = dev;
    return MT_OK;
}

#define TRY(x) do { mt_status s_ = (x); if (s_ != MT_OK) return s_; } while (0)

/* ---- a PLE memory's n-gram table in page-locked host memory ---- */

/* Elements [lo, hi) of a random bf16 or fp32 table in host memory, as weight_random draws them. */
typedef struct table_fill {
    void *dst;
    mt_dtype dt;
    uint64_t key, lo, hi;
    float mean, std;
} table_fill;

static void *table_fill_run(void *arg) {
    const table_fill *f = arg;
    for (uint64_t i = f->lo; i < f->hi; i++) {
        const float v = f->mean + f->std * mt_rand_normal(f->key, i);
        if (f->dt == MT_BF16) ((uint16_t *)f->dst)[i] = mt_f32_to_bf16(v);
        else ((float *)f->dst)[i] = v;
    }
    return NULL;
}

/* A random table of spec s in host memory of its own (page-aligned, filled by up to 16 threads:
 * a bench's tables are tens of GB), or NULL when out of memory. */
static void *random_host_table(const glm_tensor_spec *s, uint64_t key, int64_t rows, int64_t cols) {
    const uint64_t n = (uint64_t)rows * (uint64_t)cols;
    const size_t pg = 4096, bytes = ((size_t)n * mt_dtype_size(s->dtype) + pg - 1) / pg * pg;
    void *host = NULL;
    if (posix_memalign(&host, pg, bytes ? bytes : pg) != 0) return NULL;
    enum { FILL_THREADS = 16 };
    table_fill f[FILL_THREADS];
    pthread_t th[FILL_THREADS];
    bool started[FILL_THREADS] = { false };
    for (int k = 0; k < FILL_THREADS; k++) {
        f[k] = (table_fill){ host, s->dtype, key, n * k / FILL_THREADS, n * (k + 1) / FILL_THREADS, s->mean, s->std };
        started[k] = pthread_create(&th[k], NULL, table_fill_run, &f[k]) == 0;
        if (!started[k]) table_fill_run(&f[k]); /* no thread: this one does its part */
    }
    for (int k = 0; k < FILL_THREADS; k++)
        if (started[k]) pthread_join(th[k], NULL);
    return host;
}

/* The table of l's memory. Where the backend reads page-locked host memory (weight_host) and
 * the model does not ask for device memory, it stays in host memory, read over the bus: a
 * checkpoint's straight from the archive's mapping (ranks of a host share the page cache), a
 * random model's in host memory the layer owns (bf16 or fp32 tables; others go to the device).
 * Memory the backend cannot lock leaves the table in backend memory, with a warning. */
static mt_status bind_ple_table(binder *b, glm_ple_w *pw, const char *p) {
    glm_model *m = b->m;
    mt_backend *be = m->be;
    char name[192];
    snprintf(name, sizeof name, "%sple.table.weight", p);
    if (!be->ops->weight_host || m->params.ple_table_device) return bind_w(b, &pw->table, "%s", name);
    snprintf(b->name, sizeof b->name, "%s", name);
    mt_status st;
    if (!b->random) {
        const st_tensor *t = st_find(m->ar, name);
        MT_ASSERT(t && t->ndim == 2); /* the manifest check ran first */
        if (t->dtype == MT_F8E4M3) return bind_w(b, &pw->table, "%s", name);
        st = be->ops->weight_host(be, t->data, t->dtype, t->shape[0], t->shape[1], &pw->table);
        if (st == MT_OK) m->bytes_replicated += t->nbytes;
    } else {
        const glm_tensor_spec *s = spec_of(b);
        if (s->dtype != MT_BF16 && s->dtype != MT_F32) return bind_w(b, &pw->table, "%s", name);
        const int64_t rows = s->shape[0], cols = spec_count(s) / s->shape[0];
        if (!(pw->host_mem = random_host_table(s, mt_rand_key(b->seed, s->name), rows, cols)))
            return mt_errorf(b->err, MT_ERR_NOMEM, "out of host memory for tensor %s", name);
        st = be->ops->weight_host(be, pw->host_mem, s->dtype, rows, cols, &pw->table);
    }
    if (st != MT_OK) { /* logged by the backend: the table goes to its memory instead */
        mt_log(MT_LOG_WARN, "%s stays in backend memory: host memory cannot be locked for it (%s)", name,
               mt_status_str(st));
        free(pw->host_mem);
        pw->host_mem = NULL;
        return bind_w(b, &pw->table, "%s", name);
    }
    pw->table.cls = wcls_of(name);
    return MT_OK;
}

/* A SwiGLU MLP: dense, shared or routed expert. Its FP8 weights may stay FP8 (a backend with
 * weight_fp8 takes FP8 experts in moe_experts, kernels/backend.h). */
static mt_status bind_mlp(binder *b, mt_expert *e, const char *pre) {
    b->fp8_keep = true;
    b->sh = ROWS;
    TRY(bind_w(b, &e->gate, "%sgate_proj.weight", pre));
    TRY(bind_w(b, &e->up, "%sup_proj.weight", pre));
    b->sh = COLS;
    TRY(bind_w(b, &e->down, "%sdown_proj.weight", pre));
    b->sh = WHOLE;
    b->fp8_keep = false;
    return MT_OK;
}

static mt_status bind_layer(binder *b, glm_layer *l, int i) {
    const glm_config *c = &b->m->cfg;
    char p[96], mp[128];
    snprintf(p, sizeof p, "model.language_model.layers.%d.", i);
    static const char *site[2] = { "attn", "ffn" };
    for (int s = 0; s < 2 && i < c->num_hidden_layers; s++) { /* the MTP block has no hyper-connections */
        TRY(bind_w(b, &l->hc[s].fn, "%shc_%s_fn", p, site[s]));
        TRY(bind_v(b, &l->hc[s].base, "%shc_%s_base", p, site[s]));
        TRY(bind_v(b, &l->hc[s].scale, "%shc_%s_scale", p, site[s]));
    }
    TRY(bind_v(b, &l->in_norm, "%sinput_layernorm.weight", p));
    TRY(bind_v(b, &l->post_norm, "%spost_attention_layernorm.weight", p));
    if (c->layer_types[i] == GLM_MIXER_KDA) {
        glm_kda_w *k = &l->kda;
        static const char qkv[3] = { 'q', 'k', 'v' };
        b->sh = ROWS; /* the heads */
        b->fp8_keep = true;
        TRY(bind_w(b, &k->q, "%sself_attn.q_proj.weight", p));
        TRY(bind_w(b, &k->k, "%sself_attn.k_proj.weight", p));
        TRY(bind_w(b, &k->v, "%sself_attn.v_proj.weight", p));
        b->fp8_keep = false;
        for (int j = 0; j < 3; j++) TRY(bind_v(b, &k->conv[j], "%sself_attn.%c_conv1d.weight", p, qkv[j]));
        b->sh = WHOLE;
        TRY(bind_w(b, &k->f_a, "%sself_attn.f_a_proj.weight", p));
        b->sh = ROWS;
        TRY(bind_w(b, &k->f_b, "%sself_attn.f_b_proj.weight", p));
        TRY(bind_v(b, &k->dt_bias, "%sself_attn.dt_bias", p));
        TRY(bind_v(b, &k->A_log, "%sself_attn.A_log", p));
        TRY(bind_w(b, &k->b, "%sself_attn.b_proj.weight", p));
        b->sh = WHOLE;
        TRY(bind_w(b, &k->g_a, "%sself_attn.g_a_proj.weight", p));
        b->sh = ROWS;
        TRY(bind_w(b, &k->g_b, "%sself_attn.g_b_proj.weight", p));
        b->sh = WHOLE;
        TRY(bind_v(b, &k->o_norm, "%sself_attn.o_norm.weight", p));
        b->sh = COLS;
        b->fp8_keep = true;
        TRY(bind_w(b, &k->o, "%sself_attn.o_proj.weight", p));
        b->fp8_keep = false;
        b->sh = WHOLE;
    } else {
        glm_dsa_w *d = &l->dsa;
        b->fp8_keep = true; /* q_a, q_b, kv_a, o: matmul only (kv_b goes to mla_sparse) */
        TRY(bind_w(b, &d->q_a, "%sself_attn.q_a_proj.weight", p));
        TRY(bind_v(b, &d->q_a_norm, "%sself_attn.q_a_layernorm.weight", p));
        b->sh = ROWS; /* the query heads */
        TRY(bind_w(b, &d->q_b, "%sself_attn.q_b_proj.weight", p));
        b->sh = WHOLE;
        TRY(bind_w(b, &d->kv_a, "%sself_attn.kv_a_proj_with_mqa.weight", p));
        TRY(bind_v(b, &d->kv_a_norm, "%sself_attn.kv_a_layernorm.weight", p));
        b->sh = ROWS;
        b->fp8_keep = false;
        TRY(bind_w(b, &d->kv_b, "%sself_attn.kv_b_proj.weight", p));
        b->sh = COLS;
        b->fp8_keep = true;
        TRY(bind_w(b, &d->o, "%sself_attn.o_proj.weight", p));
        b->fp8_keep = false;
        b->sh = WHOLE;
        d->has_indexer = c->indexer_types[i] == GLM_INDEXER_FULL;
        if (d->has_indexer) {
            TRY(bind_w(b, &d->iq, "%sself_attn.indexer.wq_b.weight", p));
            TRY(bind_w(b, &d->ik, "%sself_attn.indexer.wk.weight", p));
            TRY(bind_v(b, &d->ik_norm_w, "%sself_attn.indexer.k_norm.weight", p));
            TRY(bind_v(b, &d->ik_norm_b, "%sself_attn.indexer.k_norm.bias", p));
            TRY(bind_w(b, &d->iw, "%sself_attn.indexer.weights_proj.weight", p));
            TRY(bind_v(b, &d->ape, "%sself_attn.indexer.index_kpool_compress_ape", p));
            TRY(bind_w(b, &d->igate, "%sself_attn.indexer.index_kpool_compress_gate", p));
        }
    }
    if (l->ple.on) { /* replicated on every rank: the memory is computed whole */
        glm_ple_w *pw = &l->ple;
        TRY(bind_ple_table(b, pw, p));
        TRY(bind_w(b, &pw->key, "%sple.key_proj.weight", p));
        TRY(bind_w(b, &pw->value, "%sple.value_proj.weight", p));
        TRY(bind_v(b, &pw->key_norm, "%sple.key_norm.weight", p));
        TRY(bind_v(b, &pw->query_norm, "%sple.query_norm.weight", p));
        TRY(bind_v(b, &pw->conv_norm, "%sple.conv_norm.weight", p));
        TRY(bind_v(b, &pw->conv, "%sple.conv.weight", p));
    }
    glm_mlp_w *mw = &l->mlp;
    mw->sparse = c->mlp_layer_types[i] == GLM_MLP_SPARSE;
    if (!mw->sparse) {
        snprintf(mp, sizeof mp, "%smlp.", p);
        return bind_mlp(b, &mw->dense, mp);
    }
    TRY(bind_w(b, &mw->router, "%smlp.gate.weight", p));
    TRY(bind_v(b, &mw->router_bias, "%smlp.gate.e_score_correction_bias", p));
    mw->experts = calloc((size_t)c->n_routed_experts, sizeof(mt_expert));
    if (!mw->experts) return mt_errorf(b->err, MT_ERR_NOMEM, "out of memory for the experts of layer %d", i);
    for (int e = 0; e < c->n_routed_experts; e++) {
        snprintf(mp, sizeof mp, "%smlp.experts.%d.", p, e);
        TRY(bind_mlp(b, &mw->experts[e], mp));
    }
    snprintf(mp, sizeof mp, "%smlp.shared_experts.", p);
    return bind_mlp(b, &mw->shared, mp);
}

/* One half of eh_proj [H, 2H] (columns [c0, c0 + H)) as its own weight [H, H], so the block's
 * input projection is two products of the two normed halves, without a concatenation. */
static mt_status bind_eh_half(binder *b, mt_weight *w, const char *name, int c0) {
    glm_model *m = b->m;
    const int64_t H = m->cfg.hidden_size;
    snprintf(b->name, sizeof b->name, "%s", name);
    if (b->random) {
        const glm_tensor_spec *s = spec_of(b);
        mt_status st = m->be->ops->weight_random(m->be, s->dtype, H, H, mt_rand_key(mt_rand_key(b->seed, s->name),
                                                 c0 ? "hidden" : "embedding"), s->mean, s->std, w);
        return st == MT_OK ? MT_OK : mt_errorf(b->err, st, "cannot make random tensor %s on the backend", name);
    }
    const st_tensor *t = st_find(m->ar, name);
    MT_ASSERT(t); /* the manifest check ran first */
    if (t->dtype == MT_F8E4M3) {
        m->bytes_replicated += t->nbytes / 2;
        return place_fp8(m, t, 0, H, c0, H, w, b->err);
    }
    const size_t es = mt_dtype_size(t->dtype), rb = (size_t)H * es;
    char *buf = malloc(rb * (size_t)H);
    if (!buf) return mt_errorf(b->err, MT_ERR_NOMEM, "out of memory for tensor %s", name);
    for (int64_t r = 0; r < H; r++) memcpy(buf + (size_t)r * rb, (const char *)t->data + ((size_t)r * 2 * H + c0) * es, rb);
    m->bytes_replicated += t->nbytes / 2;
    mt_status st = m->be->ops->weight(m->be, buf, t->dtype, H, H, w);
    if (st == MT_OK) st = keep_host(m, buf, w);
    else free(buf);
    return st == MT_OK ? MT_OK : mt_errorf(b->err, st, "%s: cannot place tensor %s on the backend", t->file, name);
}

/* The MTP block at layer index L (glm_manifest_mtp_foreach): eh_proj's halves, its norms, and
 * its decoder layer (layers[L]), sharded like the target's layers. */
static mt_status bind_mtp(binder *b) {
    glm_model *m = b->m;
    const int L = m->cfg.num_hidden_layers;
    char p[96], name[160];
    snprintf(p, sizeof p, "model.language_model.layers.%d.", L);
    snprintf(name, sizeof name, "%seh_proj.weight", p);
    TRY(bind_eh_half(b, &m->mtp.eh_e, name, 0));
    TRY(bind_eh_half(b, &m->mtp.eh_h, name, m->cfg.hidden_size));
    TRY(bind_v(b, &m->mtp.enorm, "%senorm.weight", p));
    TRY(bind_v(b, &m->mtp.hnorm, "%shnorm.weight", p));
    TRY(bind_v(b, &m->mtp.norm, "%sshared_head.norm.weight", p));
    return bind_layer(b, &m->layers[L], L);
}

/* The embedding: on several ranks this rank's vocab rows [v_lo, v_lo + v_n), which the lookups
 * of other ranks' ids read as zeros (mt_weight.row0), so the sum over ranks of each rank's lookup
 * is the embedding. */
static mt_status bind_embed(binder *b) {
    glm_model *m = b->m;
    b->sh = ROWS;
    mt_status st = bind_w(b, &m->embed, "model.language_model.embed_tokens.weight");
    b->sh = WHOLE;
    m->embed.row0 = m->v_lo;
    return st;
}

/* Tells params.on_load_progress how far binding got (checkpoint weights only). */
static void report_progress(const binder *b) {
    const glm_model *m = b->m;
    if (b->random || !m->params.on_load_progress || !m->bytes_to_load) return;
    m->params.on_load_progress(m->params.load_progress_user, m->bytes_sharded_total + m->bytes_replicated,
                               m->bytes_to_load, m->bytes_sharded_read + m->bytes_replicated);
}

static mt_status bind_all(binder *bp) {
    binder b = *bp;
    glm_model *m = b.m;
    TRY(bind_embed(&b));
    if (m->cfg.tie_word_embeddings) {
        m->lm_head = m->embed;
        m->lm_head.row0 = 0;
        m->lm_head.cls = MT_WCLS_HEAD;
    } else {
        b.sh = ROWS; /* vocab-parallel */
        TRY(bind_w(&b, &m->lm_head, "lm_head.weight"));
        b.sh = WHOLE;
    }
    TRY(bind_v(&b, &m->norm, "model.language_model.norm.weight"));
    report_progress(&b);
    for (int i = 0; i < m->cfg.num_hidden_layers; i++) {
        TRY(bind_layer(&b, &m->layers[i], i));
        report_progress(&b);
    }
    if (m->mtp.has) {
        TRY(bind_mtp(&b));
        report_progress(&b);
    }
    return MT_OK;
}

mt_status glm_weights_bind(glm_model *m, mt_error *err) {
    check_ctx cc = { m->ar, &m->cfg.quant, err, MT_OK, 0 };
    glm_manifest_foreach(&m->cfg, check_one, &cc);
    if (cc.st == MT_OK && m->mtp.has) glm_manifest_mtp_foreach(&m->cfg, check_one, &cc);
    if (cc.st != MT_OK) return cc.st;
    m->bytes_to_load = cc.bytes;
    binder b = { .m = m, .err = err };
    return bind_all(&b);
}

typedef struct spec_list {
    glm_tensor_spec *v;
    int n;
} spec_list;

static void collect_spec(const glm_tensor_spec *s, void *user) {
    spec_list *l = user;
    l->v[l->n++] = *s;
}

static void count_spec(const glm_tensor_spec *s, void *user) {
    (void)s;
    (*(int *)user)++;
}

mt_status glm_weights_random(glm_model *m, uint64_t seed, mt_error *err) {
    int n = 0;
    glm_manifest_foreach(&m->cfg, count_spec, &n);
    if (m->mtp.has) glm_manifest_mtp_foreach(&m->cfg, count_spec, &n);
    spec_list l = { calloc((size_t)n, sizeof(glm_tensor_spec)), 0 };
    if (!l.v) return mt_errorf(err, MT_ERR_NOMEM, "out of memory for the manifest");
    glm_manifest_foreach(&m->cfg, collect_spec, &l);
    if (m->mtp.has) glm_manifest_mtp_foreach(&m->cfg, collect_spec, &l);
    binder b = { .m = m, .err = err, .random = true, .seed = seed, .specs = l.v, .n_specs = l.n };
    mt_status st = bind_all(&b);
    free(l.v);
    return st;
}

/* One group of projections that take the same input (GLM_*_GROUP, in their call's order), packed
 * where the backend can; a group the backend cannot pack (no room, FP8) runs apart as before. */
static void pack_group(glm_model *m, mt_weight *const *w, int count, const char *what, int layer) {
    for (int j = 0; j < count; j++)
        if (!w[j]->data) return;
    const mt_status st = m->be->ops->weights_pack(m->be, w, count);
    if (st == MT_ERR_NOMEM)
        mt_log(MT_LOG_WARN, "layer %d: no device memory to pack the %s projections; they run apart", layer, what);
    else if (st != MT_OK && st != MT_ERR_UNSUPPORTED)
        mt_log(MT_LOG_WARN, "layer %d: packing the %s projections failed (%s); they run apart", layer, what,
               mt_status_str(st));
}

void glm_weights_pack(glm_model *m) {
    if (!m->params.pack_projections || !m->be->ops->weights_pack || !m->layers) return;
    for (int i = 0; i < m->n_state_layers; i++) {
        glm_layer *l = &m->layers[i];
        glm_kda_w *k = &l->kda;
        mt_weight *kw[] = GLM_KDA_GROUP(k);
        pack_group(m, kw, 6, "KDA", i);
        glm_dsa_w *d = &l->dsa;
        mt_weight *dh[] = GLM_DSA_IN_GROUP(d);
        pack_group(m, dh, GLM_DSA_IN_COUNT(d), "attention input", i);
        mt_weight *dq[] = GLM_DSA_Q_GROUP(d);
        if (GLM_DSA_Q_COUNT(d) > 1) pack_group(m, dq, GLM_DSA_Q_COUNT(d), "attention query", i);
        glm_mlp_w *mw = &l->mlp;
        mt_weight *gu[] = GLM_MLP_GROUP(&mw->dense);
        pack_group(m, gu, 2, "MLP", i);
        mt_weight *su[] = GLM_MLP_GROUP(&mw->shared);
        pack_group(m, su, 2, "shared expert", i);
    }
}

static void free_expert(mt_backend *be, mt_expert *e) {
    be->ops->weight_free(be, &e->gate);
    be->ops->weight_free(be, &e->up);
    be->ops->weight_free(be, &e->down);
}

/* Frees whatever was bound (fields left zero by a failed bind are skipped by the backend). */
void glm_weights_release(glm_model *m) {
    mt_backend *be = m->be;
    if (!m->layers) return;
    be->ops->weight_free(be, &m->mtp.eh_e);
    be->ops->weight_free(be, &m->mtp.eh_h);
    be->ops->free(be, m->mtp.enorm);
    be->ops->free(be, m->mtp.hnorm);
    be->ops->free(be, m->mtp.norm);
    for (int i = 0; i < m->n_state_layers; i++) {
        glm_layer *l = &m->layers[i];
        for (int s = 0; s < 2; s++) {
            be->ops->weight_free(be, &l->hc[s].fn);
            be->ops->free(be, l->hc[s].base);
            be->ops->free(be, l->hc[s].scale);
        }
        be->ops->free(be, l->in_norm);
        be->ops->free(be, l->post_norm);
        glm_kda_w *k = &l->kda;
        mt_weight *kw[] = { &k->q, &k->k, &k->v, &k->f_a, &k->f_b, &k->b, &k->g_a, &k->g_b, &k->o };
        for (size_t j = 0; j < sizeof kw / sizeof kw[0]; j++) be->ops->weight_free(be, kw[j]);
        for (int j = 0; j < 3; j++) be->ops->free(be, k->conv[j]);
        be->ops->free(be, k->dt_bias);
        be->ops->free(be, k->A_log);
        be->ops->free(be, k->o_norm);
        glm_dsa_w *d = &l->dsa;
        mt_weight *dw[] = { &d->q_a, &d->q_b, &d->kv_a, &d->kv_b, &d->o, &d->iq, &d->ik, &d->iw, &d->igate };
        for (size_t j = 0; j < sizeof dw / sizeof dw[0]; j++) be->ops->weight_free(be, dw[j]);
        float *dv[] = { d->q_a_norm, d->kv_a_norm, d->ik_norm_w, d->ik_norm_b, d->ape };
        for (size_t j = 0; j < sizeof dv / sizeof dv[0]; j++) be->ops->free(be, dv[j]);
        glm_mlp_w *mw = &l->mlp;
        free_expert(be, &mw->dense);
        free_expert(be, &mw->shared);
        be->ops->weight_free(be, &mw->router);
        be->ops->free(be, mw->router_bias);
        if (mw->experts)
            for (int e = 0; e < m->cfg.n_routed_experts; e++) free_expert(be, &mw->experts[e]);
        free(mw->experts);
        glm_ple_release(l);
    }
    if (!m->cfg.tie_word_embeddings) be->ops->weight_free(be, &m->lm_head);
    be->ops->weight_free(be, &m->embed);
    be->ops->free(be, m->norm);
}
