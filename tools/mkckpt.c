/* tools/mkckpt.c: writes a random glm5_next checkpoint (config.json + safetensors) for tests and
 * benchmarks.
 *
 *   mkckpt (--preset tiny|tiny-ple|bench-4L|test-wide | --config config.json) --out DIR [--layers N] [--seed N]
 *          [--shard-mb N] [--dtype bf16|f16|f32|fp8] [--margin GAP [--margin-prompts N] [--margin-len L]]
 *
 * Every tensor of the manifest (worker/loader/glm_manifest.h) is written, value = mean + std *
 * N(0,1). The normals are counter-based: element k of a tensor is a pure function of (seed,
 * tensor name, k), so the output does not depend on the thread count, the chunking, the shard
 * size or the order of the other tensors. BF16 manifest tensors are stored at --dtype (default
 * bf16); the fp32-kept ones stay F32. Data is produced shard by shard through the writer's
 * deferred tensors, so memory stays at one 64 MiB chunk however large the checkpoint (bench-4L
 * is ~48 GB: use --shard-mb, e.g. 5000).
 *
 * --dtype fp8 writes an FP8 checkpoint (docs/MODEL.md, "FP8 checkpoints"): every linear weight
 * of the manifest not in modules_to_not_convert is F8_E4M3 with its "_scale_inv" block scales,
 * the other tensors bf16, and config.json gets a quantization_config (the --config file's block
 * size and modules_to_not_convert when it has one, else blocks of 128 x 128). A tensor's blocks
 * share one scale, the largest value the sampler draws over 448, so each value is its normal
 * draw rounded to fp8 and chunks stay independent.
 *
 * --margin GAP makes a margin model (tools/mkckpt_margin.h): the router bias and the indexer
 * weights are reshaped, through replacement values the writer stores instead of the random ones,
 * until a CPU run of N deterministic prompts certifies every top-k gap >= GAP; DIR/margin.json
 * holds the certificate. Exit 1 when it cannot certify.
 */
#include <errno.h>
#include <getopt.h>
#include <stdbool.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/mt.h"
#include "tools/mkckpt_margin.h"
#include "worker/loader/glm_config.h"
#include "worker/loader/glm_manifest.h"
#include "worker/loader/safetensors.h"

typedef struct ck_tensor {
    glm_tensor_spec spec;
    mt_dtype out;      /* stored dtype */
    uint64_t key;      /* RNG stream of this tensor: mix(seed, name) */
    float scale;       /* F8E4M3: the value of one fp8 unit; a scale tensor: its every value */
    bool is_scale;     /* the "_scale_inv" block scales of the tensor before it */
    float *vals;       /* [elements] replacement values (--margin), NULL: the random ones */
} ck_tensor;

typedef struct ck_plan {
    ck_tensor *t;      /* [n] */
    size_t n, cap;
    mt_dtype bf16_as;  /* --dtype (F8E4M3: linear weights only, the rest bf16) */
    const glm_quant *quant; /* --dtype fp8 */
    uint64_t seed;
    int oom;
    st_writer *w;      /* the writer holding the plan's tensors, for saves after the first */
    const char *out;
    size_t shard_bytes;
} ck_plan;

/* splitmix64's output function. */
static inline uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint64_t hash_str(const char *s) {
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++) h = (h ^ (uint8_t)*s) * 1099511628211ull;
    return h;
}

/* N(0,1) by inverse transform: a 32-bit uniform u picks a point on a piecewise-linear
 * interpolation of the normal quantile function, sampled at k_qn + 1 knots. Much faster than
 * Box-Muller (one L1-resident table load instead of log, sqrt and sincos) and as good at bf16
 * precision: the interpolation error is < 3e-4 for |z| < 3 and the tails are cut at 3.7 sigma
 * (0.02% of draws land beyond 3.5 sigma instead of 0.05%). */
enum { k_qn_bits = 12, k_qn = 1 << k_qn_bits };
static struct { float q, dq; } g_quantile[k_qn]; /* knot i and the step to knot i + 1 */
/* Acklam's rational approximation of the normal quantile (relative error < 1.2e-9). */
static double normal_quantile(double p) {
    static const double a[] = { -3.969683028665376e+01, 2.209460984245205e+02, -2.759285104469687e+02,
                                1.383577518672690e+02, -3.066479806614716e+01, 2.506628277459239e+00 };
    static const double b[] = { -5.447609879822406e+01, 1.615858368580409e+02, -1.556989798598866e+02,
                                6.680131188771972e+01, -1.328068155288572e+01 };
    static const double c[] = { -7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e+00,
                                -2.549732539343734e+00, 4.374664141464968e+00, 2.938163982698783e+00 };
    static const double d[] = { 7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e+00,
                                3.754408661907416e+00 };
    const double lo = 0.02425, hi = 1 - lo;
    if (p < lo) {
        double q = sqrt(-2 * log(p));
        return (((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) /
               ((((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1);
    }
    if (p > hi) return -normal_quantile(1 - p);
    double q = p - 0.5, r = q * q;
    return (((((a[0] * r + a[1]) * r + a[2]) * r + a[3]) * r + a[4]) * r + a[5]) * q /
           (((((b[0] * r + b[1]) * r + b[2]) * r + b[3]) * r + b[4]) * r + 1);
}

static void quantile_table_init(void) {
    /* knots at quantile((i + 0.5) / (k_qn + 1)), i = 0..k_qn */
    float knot[k_qn + 1];
    for (int i = 0; i <= k_qn; i++) knot[i] = (float)normal_quantile((i + 0.5) / (k_qn + 1.0));
    for (int i = 0; i < k_qn; i++) {
        g_quantile[i].q = knot[i];
        g_quantile[i].dq = knot[i + 1] - knot[i];
    }
}

static inline float normal_from_u32(uint32_t r) {
    const uint32_t i = r >> (32 - k_qn_bits);
    const float f = (float)(r & ((1u << (32 - k_qn_bits)) - 1)) * (1.0f / (float)(1u << (32 - k_qn_bits)));
    return g_quantile[i].q + f * g_quantile[i].dq;
}

/* Normals number 2p and 2p+1 of stream key. */
static inline void normal_pair(uint64_t key, uint64_t p, float *z0, float *z1) {
    uint64_t r = mix64(key + (p + 1) * 0x9e3779b97f4a7c15ull);
    *z0 = normal_from_u32((uint32_t)r);
    *z1 = normal_from_u32((uint32_t)(r >> 32));
}

/* The largest |N(0,1)| draw normal_from_u32 returns (the last knot). */
static float normal_max(void) { return g_quantile[k_qn - 1].q + g_quantile[k_qn - 1].dq; }

static inline void store(void *dst, size_t i, mt_dtype t, float v, float scale) {
    switch (t) {
    case MT_F8E4M3: ((uint8_t *)dst)[i] = mt_f32_to_f8e4m3(v / scale); break;
    case MT_BF16: ((uint16_t *)dst)[i] = mt_f32_to_bf16(v); break;
    case MT_F16: ((uint16_t *)dst)[i] = mt_f32_to_f16(v); break;
    default: ((float *)dst)[i] = v; break;
    }
}

/* st_fill_fn: elements [offset / es, (offset + nbytes) / es) of tensor index. offset is a multiple
 * of 8 bytes, so the first element is even and pairs line up. */
static mt_status fill(void *user, size_t index, uint64_t offset, void *dst, size_t nbytes,
                      mt_error *err) {
    (void)err;
    const ck_plan *plan = user;
    const ck_tensor *t = &plan->t[index];
    const size_t es = mt_dtype_size(t->out);
    const uint64_t k0 = offset / es;
    const int64_t n = (int64_t)(nbytes / es);
    const float mean = t->spec.mean, std = t->spec.std, scale = t->scale;
    if (t->is_scale) {
        for (int64_t i = 0; i < n; i++) ((float *)dst)[i] = scale;
        return MT_OK;
    }
    const int64_t npairs = (n + 1) / 2;
    if (t->vals) {
        for (int64_t i = 0; i < n; i++) store(dst, (size_t)i, t->out, t->vals[k0 + (uint64_t)i], scale);
        return MT_OK;
    }
#pragma omp parallel for schedule(static)
    for (int64_t q = 0; q < npairs; q++) {
        float z0, z1;
        normal_pair(t->key, k0 / 2 + (uint64_t)q, &z0, &z1);
        store(dst, (size_t)(2 * q), t->out, mean + std * z0, scale);
        if (2 * q + 1 < n) store(dst, (size_t)(2 * q + 1), t->out, mean + std * z1, scale);
    }
    return MT_OK;
}

static size_t tensor_elems(const ck_tensor *t) {
    size_t n = 1;
    for (int d = 0; d < t->spec.ndim; d++) n *= (size_t)t->spec.shape[d];
    return n;
}

static ck_tensor *find_tensor(ck_plan *plan, const char *name) {
    for (size_t i = 0; i < plan->n; i++)
        if (!strcmp(plan->t[i].spec.name, name)) return &plan->t[i];
    return NULL;
}

static inline float load(const void *src, mt_dtype t) {
    switch (t) {
    case MT_BF16: return mt_bf16_to_f32(*(const uint16_t *)src);
    case MT_F16: return mt_f16_to_f32(*(const uint16_t *)src);
    default: return *(const float *)src;
    }
}

/* ckm_ckpt over the plan: values as stored (rounded to the stored dtype), replacements, saves. */
static mt_status ck_read(void *user, const char *name, float *out, size_t n, mt_error *err) {
    ck_plan *plan = user;
    ck_tensor *t = find_tensor(plan, name);
    if (!t) return mt_errorf(err, MT_ERR_NOT_FOUND, "%s: not in the checkpoint", name);
    if (tensor_elems(t) != n) return mt_errorf(err, MT_ERR_INVALID, "%s: %zu elements, not %zu", name, tensor_elems(t), n);
    for (size_t i = 0; i < n; i += 2) {
        float z[2];
        normal_pair(t->key, i / 2, &z[0], &z[1]);
        for (size_t j = i; j < i + 2 && j < n; j++) {
            uint32_t cell;
            store(&cell, 0, t->out, t->vals ? t->vals[j] : t->spec.mean + t->spec.std * z[j - i], t->scale);
            out[j] = load(&cell, t->out);
        }
    }
    return MT_OK;
}

static mt_status ck_replace(void *user, const char *name, const float *vals, size_t n, mt_error *err) {
    ck_plan *plan = user;
    ck_tensor *t = find_tensor(plan, name);
    if (!t) return mt_errorf(err, MT_ERR_NOT_FOUND, "%s: not in the checkpoint", name);
    if (tensor_elems(t) != n) return mt_errorf(err, MT_ERR_INVALID, "%s: %zu elements, not %zu", name, tensor_elems(t), n);
    if (!t->vals && !(t->vals = malloc(sizeof(float) * n))) return mt_errorf(err, MT_ERR_NOMEM, "out of memory");
    memcpy(t->vals, vals, sizeof(float) * n);
    return MT_OK;
}

static mt_status ck_save(void *user, mt_error *err) {
    ck_plan *plan = user;
    return st_writer_save(plan->w, plan->out, plan->shard_bytes, err);
}

static ck_tensor *plan_push(ck_plan *plan) {
    if (plan->n == plan->cap) {
        size_t cap = plan->cap ? plan->cap * 2 : 1024;
        ck_tensor *nt = realloc(plan->t, cap * sizeof *nt);
        if (!nt) {
            plan->oom = 1;
            return NULL;
        }
        plan->t = nt;
        plan->cap = cap;
    }
    ck_tensor *t = &plan->t[plan->n++];
    memset(t, 0, sizeof *t);
    return t;
}

static void collect(const glm_tensor_spec *s, void *user) {
    ck_plan *plan = user;
    if (plan->oom) return;
    ck_tensor *t = plan_push(plan);
    if (!t) return;
    t->spec = *s;
    t->out = s->dtype == MT_BF16 ? plan->bf16_as : s->dtype;
    t->key = mix64(plan->seed ^ hash_str(s->name));
    if (t->out != MT_F8E4M3) return;
    const glm_quant *q = plan->quant;
    if (!s->linear || glm_quant_skips(q, s->name)) {
        t->out = MT_BF16;
        return;
    }
    t->scale = (fabsf(s->mean) + s->std * normal_max()) / 448.0f;
    ck_tensor *sc = plan_push(plan);
    if (!sc) return;
    sc->spec = *s;
    const size_t n = strlen(s->name);
    MT_ASSERT(n + sizeof "_scale_inv" <= sizeof sc->spec.name); /* manifest names are short */
    memcpy(sc->spec.name + n, "_scale_inv", sizeof "_scale_inv");
    sc->spec.shape[0] = (s->shape[0] + q->block_rows - 1) / q->block_rows;
    sc->spec.shape[1] = (s->shape[1] + q->block_cols - 1) / q->block_cols;
    sc->out = MT_F32;
    sc->is_scale = true;
    sc->scale = plan->t[plan->n - 2].scale;
}

static void usage(FILE *f) {
    fprintf(f,
            "usage: mkckpt (--preset tiny|tiny-ple|bench-4L|test-wide | --config config.json) --out DIR\n"
            "              [--layers N] [--seed N] [--shard-mb N] [--dtype bf16|f16|f32|fp8]\n"
            "              [--margin GAP [--margin-prompts N] [--margin-len L]]\n"
            "  --preset    start from a built-in config (glm_config_preset)\n"
            "  --config    start from a config.json instead\n"
            "  --layers    keep the first N layers (extra ones follow the default pattern)\n"
            "  --seed      RNG seed (default 0)\n"
            "  --shard-mb  shards of at most N MiB of tensor data + index (default 0: one file)\n"
            "  --dtype     storage of the bf16 tensors (default bf16); fp32 ones stay fp32;\n"
            "              fp8: linear weights block-scaled F8_E4M3, the rest bf16\n"
            "  --margin    reshape the router bias and indexer weights until every top-k choice on\n"
            "              the test prompts (CPU run) has its k-th and (k+1)-th candidates >= GAP\n"
            "              apart (indexer: relative to the largest score); writes DIR/margin.json\n"
            "  --margin-prompts  prompts of the certificate (default 10)\n"
            "  --margin-len      greedy tokens after each prompt (default 64)\n");
}

/* mkdir -p */
static int make_dirs(const char *path) {
    char buf[4096];
    size_t n = strlen(path);
    if (n == 0 || n >= sizeof buf) return -1;
    memcpy(buf, path, n + 1);
    for (size_t i = 1; i <= n; i++) {
        if (buf[i] == '/' || buf[i] == 0) {
            char c = buf[i];
            buf[i] = 0;
            if (mkdir(buf, 0755) != 0 && errno != EEXIST) return -1;
            buf[i] = c;
        }
    }
    return 0;
}

static int parse_u64(const char *s, uint64_t *out) {
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 0);
    if (errno || end == s || *end || *s == '-') return -1;
    *out = v;
    return 0;
}

int main(int argc, char **argv) {
    static const struct option opts[] = {
        { "preset", required_argument, 0, 'p' }, { "config", required_argument, 0, 'c' },
        { "out", required_argument, 0, 'o' },    { "seed", required_argument, 0, 's' },
        { "shard-mb", required_argument, 0, 'm' }, { "dtype", required_argument, 0, 'd' },
        { "layers", required_argument, 0, 'l' }, { "help", no_argument, 0, 'h' },
        { "margin", required_argument, 0, 'g' }, { "margin-prompts", required_argument, 0, 'n' },
        { "margin-len", required_argument, 0, 'L' },
        { 0, 0, 0, 0 },
    };
    const char *preset = NULL, *config = NULL, *out = NULL, *dtype = "bf16";
    uint64_t seed = 0, shard_mb = 0, layers = 0, mprompts = 10, mlen = 64;
    double margin = 0;
    bool margin_set = false, mopts = false;
    int c;
    while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        switch (c) {
        case 'p': preset = optarg; break;
        case 'c': config = optarg; break;
        case 'o': out = optarg; break;
        case 'd': dtype = optarg; break;
        case 's':
            if (parse_u64(optarg, &seed)) { fprintf(stderr, "mkckpt: bad --seed %s\n", optarg); return 2; }
            break;
        case 'm':
            if (parse_u64(optarg, &shard_mb) || shard_mb > ((uint64_t)1 << 40)) {
                fprintf(stderr, "mkckpt: bad --shard-mb %s\n", optarg);
                return 2;
            }
            break;
        case 'l':
            if (parse_u64(optarg, &layers) || layers < 1 || layers > GLM_MAX_LAYERS) {
                fprintf(stderr, "mkckpt: --layers must be in 1..%d\n", GLM_MAX_LAYERS);
                return 2;
            }
            break;
        case 'g': {
            char *end;
            errno = 0;
            margin = strtod(optarg, &end);
            if (errno || end == optarg || *end || !isfinite(margin) || margin <= 0 || margin >= 1) {
                fprintf(stderr, "mkckpt: --margin must be a number in (0, 1), got %s\n", optarg);
                return 2;
            }
            margin_set = true;
            break;
        }
        case 'n':
            if (parse_u64(optarg, &mprompts) || mprompts < 1 || mprompts > 1000) {
                fprintf(stderr, "mkckpt: --margin-prompts must be in 1..1000, got %s\n", optarg);
                return 2;
            }
            mopts = true;
            break;
        case 'L':
            if (parse_u64(optarg, &mlen) || mlen < 1 || mlen > 4096) {
                fprintf(stderr, "mkckpt: --margin-len must be in 1..4096, got %s\n", optarg);
                return 2;
            }
            mopts = true;
            break;
        case 'h': usage(stdout); return 0;
        default: usage(stderr); return 2;
        }
    }
    if (optind < argc || !out || (!preset && !config)) {
        usage(stderr);
        return 2;
    }
    if (mopts && !margin_set) {
        fprintf(stderr, "mkckpt: --margin-prompts and --margin-len need --margin\n");
        return 2;
    }
    ck_plan plan = { .seed = seed };
    if (!strcmp(dtype, "bf16")) plan.bf16_as = MT_BF16;
    else if (!strcmp(dtype, "f16")) plan.bf16_as = MT_F16;
    else if (!strcmp(dtype, "f32")) plan.bf16_as = MT_F32;
    else if (!strcmp(dtype, "fp8")) plan.bf16_as = MT_F8E4M3;
    else {
        fprintf(stderr, "mkckpt: --dtype must be bf16, f16, f32 or fp8, got %s\n", dtype);
        return 2;
    }
    if (margin_set && plan.bf16_as == MT_F8E4M3) {
        fprintf(stderr, "mkckpt: --margin shapes bf16, f16 or f32 checkpoints, not --dtype fp8\n");
        return 2;
    }

    glm_config cfg;
    mt_error err = { { 0 } };
    mt_status st = config ? glm_config_load(config, &cfg, &err) : glm_config_preset(preset, &cfg, &err);
    if (st != MT_OK) {
        fprintf(stderr, "mkckpt: %s\n", err.msg);
        return 1;
    }
    if (layers) {
        /* The first N layers of the config; layers past its end follow transformers' default
         * pattern for their index. */
        glm_config def = cfg;
        glm_config_default_layers(&def);
        for (int i = cfg.num_hidden_layers; i < (int)layers; i++) {
            cfg.layer_types[i] = def.layer_types[i];
            cfg.mlp_layer_types[i] = def.mlp_layer_types[i];
            cfg.indexer_types[i] = def.indexer_types[i];
        }
        cfg.num_hidden_layers = (int)layers;
        if ((st = glm_config_validate(&cfg, &err)) != MT_OK) {
            fprintf(stderr, "mkckpt: --layers %d: %s\n", (int)layers, err.msg);
            return 1;
        }
    }
    if (plan.bf16_as == MT_F8E4M3 && !cfg.quant.fp8) {
        cfg.quant.fp8 = true;
        cfg.quant.block_rows = cfg.quant.block_cols = 128;
    }
    plan.quant = &cfg.quant;
    quantile_table_init();
    glm_manifest_foreach(&cfg, collect, &plan);
    st_writer *w = st_writer_new();
    if (plan.oom || !w) {
        fprintf(stderr, "mkckpt: out of memory\n");
        return 1;
    }
    uint64_t total = 0;
    for (size_t i = 0; i < plan.n && st == MT_OK; i++) {
        const ck_tensor *t = &plan.t[i];
        st = st_writer_add_deferred(w, t->spec.name, t->out, t->spec.ndim, t->spec.shape, fill,
                                    &plan, &err);
        uint64_t n = mt_dtype_size(t->out);
        for (int d = 0; d < t->spec.ndim; d++) n *= (uint64_t)t->spec.shape[d];
        total += n;
    }
    if (st != MT_OK) {
        fprintf(stderr, "mkckpt: %s\n", err.msg);
        st_writer_free(w);
        free(plan.t);
        return 1;
    }
    /* A margin model is run on the CPU a few times and its replaced tensors are kept in memory. */
    const uint64_t margin_max_bytes = (uint64_t)4 << 30;
    if (margin_set && total > margin_max_bytes) {
        fprintf(stderr, "mkckpt: --margin runs the model on the CPU: %.1f GB is above its %.0f GB limit\n",
                (double)total / 1e9, (double)margin_max_bytes / 1e9);
        st_writer_free(w);
        free(plan.t);
        return 2;
    }
    if (make_dirs(out) != 0) {
        fprintf(stderr, "mkckpt: cannot create %s: %s\n", out, strerror(errno));
        return 1;
    }
    char path[4200];
    snprintf(path, sizeof path, "%s/config.json", out);
    if ((st = glm_config_save(&cfg, path, &err)) != MT_OK) {
        fprintf(stderr, "mkckpt: %s\n", err.msg);
        return 1;
    }

    plan.w = w;
    plan.out = out;
    plan.shard_bytes = (size_t)(shard_mb << 20);
    if (st == MT_OK) {
        fprintf(stderr, "mkckpt: %zu tensors, %.3f GB into %s\n", plan.n, (double)total / 1e9, out);
        double t0 = mt_now();
        st = st_writer_save(w, out, (size_t)(shard_mb << 20), &err);
        double dt = mt_now() - t0;
        if (st == MT_OK)
            fprintf(stderr, "mkckpt: wrote in %.1f s (%.2f GB/s)\n", dt, dt > 0 ? (double)total / 1e9 / dt : 0.0);
    }
    int rc = 0;
    if (st == MT_OK && margin_set) {
        ckm_params mp = ckm_default_params();
        mp.gap = margin;
        mp.prompts = (int)mprompts;
        mp.len = (int)mlen;
        mp.seed = seed;
        const ckm_ckpt ck = { &plan, ck_read, ck_replace, ck_save };
        ckm_result res;
        double t0 = mt_now();
        st = ckm_shape(out, &cfg, &mp, &ck, &res, &err);
        if (st == MT_OK) {
            printf("margin: %s gap %g in %.1f s (%d runs): smallest group %.6g, expert %.6g, pool %.6g (relative)\n",
                   res.certified ? "certified" : "NOT certified", margin, mt_now() - t0, res.runs,
                   res.gaps.min[MT_GAP_GROUP], res.gaps.min[MT_GAP_EXPERT], res.gaps.min[MT_GAP_POOL]);
            if (!res.certified) {
                fprintf(stderr, "mkckpt: could not certify gap %g within %d shaping rounds (%s/margin.json says "
                                "what was reached)\n", margin, mp.rounds, out);
                rc = 1;
            }
        }
    }
    st_writer_free(w);
    for (size_t i = 0; i < plan.n; i++) free(plan.t[i].vals);
    free(plan.t);
    if (st != MT_OK) {
        fprintf(stderr, "mkckpt: %s\n", err.msg);
        return 1;
    }
    return rc;
}
