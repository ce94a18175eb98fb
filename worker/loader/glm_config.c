/* worker/loader/glm_config.c: see glm_config.h.
 *
 * The rules mirror Glm5NextTextConfig / Glm5NextConfig in transformers' configuration_glm5_next.py:
 * the same defaults, the same __post_init__ derivation of the per-layer lists (layer_types,
 * mlp_layer_types, indexer_types from index_topk_pattern or index_topk_freq /
 * index_skip_topk_offset, the linear_attn_config override), plus the checks the runtime needs
 * (docs/MODEL.md). JSON is parsed with json-c; every message names the source and the field.
 */
#include "worker/loader/glm_config.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <json-c/json.h>

#include "worker/loader/json_util.h"

/* ------------------------------------------------------------------------------------------ */
/* Defaults                                                                                   */

/* Fills all GLM_MAX_LAYERS entries; only the first num_hidden_layers are meaningful. The patterns
 * do not depend on the layer count. */
void glm_config_default_layers(glm_config *c) {
    for (int i = 0; i < GLM_MAX_LAYERS; i++) {
        c->layer_types[i] = i % 4 == 3 ? GLM_MIXER_DSA : GLM_MIXER_KDA;
        c->mlp_layer_types[i] = i < 3 ? GLM_MLP_DENSE : GLM_MLP_SPARSE;
        c->indexer_types[i] = GLM_INDEXER_FULL; /* index_topk_freq 1: every layer full */
    }
}

void glm_config_default(glm_config *c) {
    memset(c, 0, sizeof *c);
    c->vocab_size = 154880;
    c->hidden_size = 4096;
    c->intermediate_size = 12288;
    c->moe_intermediate_size = 2048;
    c->num_hidden_layers = 45;
    c->num_attention_heads = 64;
    c->num_key_value_heads = 64;
    c->n_shared_experts = 1;
    c->n_routed_experts = 288;
    c->routed_scaling_factor = 2.5f;
    c->kv_lora_rank = 512;
    c->q_lora_rank = 1536;
    c->qk_rope_head_dim = 0;
    c->v_head_dim = 256;
    c->qk_nope_head_dim = 256;
    c->n_group = 1;
    c->topk_group = 1;
    c->num_experts_per_tok = 8;
    c->norm_topk_prob = true;
    c->rms_norm_eps = 1e-5f;
    c->tie_word_embeddings = false;
    c->index_topk = 2048;
    c->index_head_dim = 128;
    c->index_n_heads = 32;
    c->swiglu_limit = 10.0f;
    c->linear_head_dim = 128;
    c->linear_num_heads = 64;
    c->linear_conv_kernel_dim = 4;
    c->has_linear_lower_bound = true;
    c->linear_lower_bound = -5.0f;
    c->hc_mult = 4;
    c->hc_eps = 1e-6f;
    c->hc_sinkhorn_iters = 20;
    c->index_kpool = 16;
    c->index_kpool_always_select_tail = true;
    c->pad_token_id = 154820;
    c->eos_token_id = -1;
    glm_config_default_layers(c);
    c->ple_max_ngram = 3;
    c->ple_heads = 8;
    c->ple_head_dim = 64;
    c->ple_conv_kernel = 4;
    c->ple_pad_id = 0;
    c->ple_norm_eps = 1e-5f;
    for (int o = 0; o < GLM_PLE_MAX_ORDER - 1; o++) c->ple_table_sizes[o] = 5 * 154880; /* 5 x the real vocabulary */
}

bool glm_config_has_ple(const glm_config *c) {
    for (int l = 0; l < c->num_hidden_layers; l++)
        if (c->ple_layer[l]) return true;
    return false;
}

static bool is_prime(int64_t n) {
    if (n < 2) return false;
    for (int64_t d = 2; d * d <= n; d++)
        if (n % d == 0) return false;
    return true;
}

int glm_ple_primes(const glm_config *c, int layer, int64_t *out) {
    const int per = (c->ple_max_ngram - 1) * c->ple_heads;
    int64_t seen_n = 0, *seen = NULL;
    int count = 0;
    for (int l = 0; l <= layer; l++) {
        if (!c->ple_layer[l]) continue;
        int64_t *grown = realloc(seen, sizeof(int64_t) * (size_t)(seen_n + per));
        MT_ASSERT(grown);
        seen = grown;
        for (int o = 0; o < c->ple_max_ngram - 1; o++) {
            int64_t p = (int64_t)c->ple_table_sizes[o] - 1;
            for (int h = 0; h < c->ple_heads; h++) {
                for (;;) {
                    p++;
                    if (!is_prime(p)) continue;
                    bool taken = false;
                    for (int64_t i = 0; i < seen_n && !taken; i++) taken = seen[i] == p;
                    if (!taken) break;
                }
                seen[seen_n++] = p;
                if (l == layer) out[count++] = p;
            }
        }
    }
    free(seen);
    return count;
}

/* ------------------------------------------------------------------------------------------ */
/* Field table                                                                                */

typedef enum field_kind { F_INT, F_FLOAT, F_BOOL } field_kind;

typedef struct field {
    const char *name;
    field_kind kind;
    size_t off;
} field;

#define FI(n) { #n, F_INT, offsetof(glm_config, n) }
#define FF(n) { #n, F_FLOAT, offsetof(glm_config, n) }
#define FB(n) { #n, F_BOOL, offsetof(glm_config, n) }

/* Plain scalar fields: present -> must have the right JSON type, absent -> default. The nullable
 * ones (num_key_value_heads, pad_token_id, eos_token_id, linear_lower_bound) are handled apart. */
static const field k_fields[] = {
    FI(vocab_size), FI(hidden_size), FI(intermediate_size), FI(moe_intermediate_size),
    FI(num_hidden_layers), FI(num_attention_heads), FI(n_shared_experts), FI(n_routed_experts),
    FF(routed_scaling_factor), FI(kv_lora_rank), FI(q_lora_rank), FI(qk_rope_head_dim),
    FI(v_head_dim), FI(qk_nope_head_dim), FI(n_group), FI(topk_group), FI(num_experts_per_tok),
    FB(norm_topk_prob), FF(rms_norm_eps), FB(tie_word_embeddings), FI(index_topk),
    FI(index_head_dim), FI(index_n_heads), FF(swiglu_limit), FI(linear_head_dim),
    FI(linear_num_heads), FI(linear_conv_kernel_dim), FI(hc_mult), FF(hc_eps),
    FI(hc_sinkhorn_iters), FI(index_kpool), FB(index_kpool_always_select_tail),
    FI(num_nextn_predict_layers),
};

/* Reads an int (JSON integer in int32 range). */
static mt_status get_int(json_object *v, const char *where, const char *name, int *out,
                         mt_error *err) {
    if (!json_object_is_type(v, json_type_int))
        return mt_errorf(err, MT_ERR_INVALID, "%s: %s must be an integer, got %s", where, name,
                         ld_json_kind(v));
    errno = 0;
    int64_t x = json_object_get_int64(v);
    if (errno != 0 || x < INT_MIN || x > INT_MAX)
        return mt_errorf(err, MT_ERR_INVALID, "%s: %s is out of range", where, name);
    *out = (int)x;
    return MT_OK;
}

/* Reads a float (JSON integer or float, finite). */
static mt_status get_float(json_object *v, const char *where, const char *name, float *out,
                           mt_error *err) {
    if (!json_object_is_type(v, json_type_int) && !json_object_is_type(v, json_type_double))
        return mt_errorf(err, MT_ERR_INVALID, "%s: %s must be a number, got %s", where, name,
                         ld_json_kind(v));
    double d = json_object_get_double(v);
    if (!isfinite(d) || !isfinite((float)d))
        return mt_errorf(err, MT_ERR_INVALID, "%s: %s must be a finite number", where, name);
    *out = (float)d;
    return MT_OK;
}

static mt_status get_bool(json_object *v, const char *where, const char *name, bool *out,
                          mt_error *err) {
    if (!json_object_is_type(v, json_type_boolean))
        return mt_errorf(err, MT_ERR_INVALID, "%s: %s must be true or false, got %s", where, name,
                         ld_json_kind(v));
    *out = json_object_get_boolean(v) != 0;
    return MT_OK;
}

/* Present and not null. */
static json_object *field_of(json_object *obj, const char *name, bool *present) {
    json_object *v = NULL;
    bool has = json_object_object_get_ex(obj, name, &v);
    if (present) *present = has;
    return has ? v : NULL;
}

/* eos_token_id: an int, a list of ints (the first is kept) or null (-1). */
static mt_status get_eos(json_object *v, const char *where, int *out, mt_error *err) {
    if (json_object_is_type(v, json_type_null)) {
        *out = -1;
        return MT_OK;
    }
    if (!json_object_is_type(v, json_type_array)) return get_int(v, where, "eos_token_id", out, err);
    int first = -1;
    size_t len = json_object_array_length(v);
    for (size_t i = 0; i < len; i++) {
        char nm[40];
        snprintf(nm, sizeof nm, "eos_token_id[%zu]", i);
        int id;
        mt_status st = get_int(json_object_array_get_idx(v, i), where, nm, &id, err);
        if (st != MT_OK) return st;
        if (i == 0) first = id;
    }
    *out = first;
    return MT_OK;
}

/* ------------------------------------------------------------------------------------------ */
/* Per-layer lists                                                                            */

/* Parses a list of strings of length n; map returns the enum value or -1 when unknown. */
typedef int (*value_map)(const char *s);

static int map_layer(const char *s) {
    if (!strcmp(s, "linear_attention")) return GLM_MIXER_KDA;
    if (!strcmp(s, "deepseek_sparse_attention") || !strcmp(s, "full_attention")) return GLM_MIXER_DSA;
    return -1;
}
static int map_mlp(const char *s) {
    if (!strcmp(s, "dense")) return GLM_MLP_DENSE;
    if (!strcmp(s, "sparse")) return GLM_MLP_SPARSE;
    return -1;
}
static int map_indexer(const char *s) {
    if (!strcmp(s, "full")) return GLM_INDEXER_FULL;
    if (!strcmp(s, "shared")) return GLM_INDEXER_SHARED;
    return -1;
}

static mt_status get_list(json_object *v, const char *where, const char *name, int n, value_map map,
                          const char *allowed, int *out, mt_error *err) {
    if (!json_object_is_type(v, json_type_array))
        return mt_errorf(err, MT_ERR_INVALID, "%s: %s must be a list of strings, got %s", where,
                         name, ld_json_kind(v));
    size_t len = json_object_array_length(v);
    if (len != (size_t)n)
        return mt_errorf(err, MT_ERR_INVALID,
                         "%s: %s has %zu entries but num_hidden_layers is %d", where, name, len, n);
    for (size_t i = 0; i < len; i++) {
        json_object *e = json_object_array_get_idx(v, i);
        if (!json_object_is_type(e, json_type_string))
            return mt_errorf(err, MT_ERR_INVALID, "%s: %s[%zu] must be a string, got %s", where,
                             name, i, ld_json_kind(e));
        int x = map(json_object_get_string(e));
        if (x < 0)
            return mt_errorf(err, MT_ERR_INVALID, "%s: %s[%zu] has unknown value \"%.64s\" (expected %s)",
                             where, name, i, json_object_get_string(e), allowed);
        out[i] = x;
    }
    return MT_OK;
}

/* indexer_types when absent: index_topk_pattern (a string of F/S, or a list of "full"/"shared"),
 * else "full" where max(i - offset + 1, 0) % freq == 0 (index_topk_freq, index_skip_topk_offset). */
static mt_status derive_indexer(json_object *obj, const char *where, glm_config *c, mt_error *err) {
    const int n = c->num_hidden_layers;
    int tmp[GLM_MAX_LAYERS];
    mt_status st;
    json_object *pat = field_of(obj, "index_topk_pattern", NULL);
    if (pat && !json_object_is_type(pat, json_type_null)) {
        if (json_object_is_type(pat, json_type_string)) {
            const char *s = json_object_get_string(pat);
            size_t len = strlen(s);
            if (len != (size_t)n)
                return mt_errorf(err, MT_ERR_INVALID,
                                 "%s: index_topk_pattern has %zu entries but num_hidden_layers is %d",
                                 where, len, n);
            for (int i = 0; i < n; i++) {
                if (s[i] == 'F') tmp[i] = GLM_INDEXER_FULL;
                else if (s[i] == 'S') tmp[i] = GLM_INDEXER_SHARED;
                else
                    return mt_errorf(err, MT_ERR_INVALID,
                                     "%s: index_topk_pattern[%d] has unknown value '%c' (expected F or S)",
                                     where, i, s[i]);
            }
        } else if ((st = get_list(pat, where, "index_topk_pattern", n, map_indexer,
                                  "\"full\" or \"shared\"", tmp, err)) != MT_OK) {
            return st;
        }
    } else {
        int freq = 1, offset = 2;
        json_object *v;
        if ((v = field_of(obj, "index_topk_freq", NULL)) && !json_object_is_type(v, json_type_null) &&
            (st = get_int(v, where, "index_topk_freq", &freq, err)) != MT_OK)
            return st;
        if ((v = field_of(obj, "index_skip_topk_offset", NULL)) &&
            !json_object_is_type(v, json_type_null) &&
            (st = get_int(v, where, "index_skip_topk_offset", &offset, err)) != MT_OK)
            return st;
        if (freq < 1) freq = 1;
        for (int i = 0; i < n; i++) {
            long long k = (long long)i - offset + 1;
            if (k < 0) k = 0;
            tmp[i] = (k % freq) == 0 ? GLM_INDEXER_FULL : GLM_INDEXER_SHARED;
        }
    }
    for (int i = 0; i < n; i++) c->indexer_types[i] = (glm_indexer)tmp[i];
    return MT_OK;
}

/* ------------------------------------------------------------------------------------------ */
/* quantization_config                                                                        */

/* A string field of quantization_config, or NULL when absent or null (or, with *st set, of another
 * type). */
static const char *quant_str(json_object *q, const char *name, const char *where, mt_status *st,
                             mt_error *err) {
    json_object *v = field_of(q, name, NULL);
    if (!v || json_object_is_type(v, json_type_null)) return NULL;
    if (!json_object_is_type(v, json_type_string)) {
        *st = mt_errorf(err, MT_ERR_INVALID, "%s: quantization_config.%s must be a string, got %s", where, name,
                        ld_json_kind(v));
        return NULL;
    }
    return json_object_get_string(v);
}

/* Reads the quantization_config object q into *out (zeroed on entry). */
static mt_status parse_quant(json_object *q, const char *where, glm_quant *out, mt_error *err) {
    mt_status st = MT_OK;
    if (!json_object_is_type(q, json_type_object))
        return mt_errorf(err, MT_ERR_INVALID, "%s: quantization_config must be an object, got %s", where,
                         ld_json_kind(q));
    const char *method = quant_str(q, "quant_method", where, &st, err);
    if (st != MT_OK) return st;
    if (!method)
        return mt_errorf(err, MT_ERR_INVALID, "%s: quantization_config has no quant_method", where);
    if (strcmp(method, "fp8"))
        return mt_errorf(err, MT_ERR_UNSUPPORTED,
                         "%s: quantization_config.quant_method \"%.64s\" is not supported (this loader reads "
                         "\"fp8\": block-scaled e4m3 weights)", where, method);
    const char *fmt = quant_str(q, "fmt", where, &st, err);
    if (st != MT_OK) return st;
    if (fmt && strcmp(fmt, "e4m3") && strcmp(fmt, "float8_e4m3fn"))
        return mt_errorf(err, MT_ERR_UNSUPPORTED, "%s: quantization_config.fmt \"%.64s\" is not supported (e4m3 only)",
                         where, fmt);
    const char *act = quant_str(q, "activation_scheme", where, &st, err);
    if (st != MT_OK) return st;
    if (act && strcmp(act, "dynamic"))
        return mt_errorf(err, MT_ERR_UNSUPPORTED,
                         "%s: quantization_config.activation_scheme \"%.64s\" is not supported (dynamic only)", where,
                         act);
    json_object *bs = field_of(q, "weight_block_size", NULL);
    if (!bs || json_object_is_type(bs, json_type_null))
        return mt_errorf(err, MT_ERR_UNSUPPORTED,
                         "%s: quantization_config has no weight_block_size (per-tensor FP8 scales are not read)",
                         where);
    if (!json_object_is_type(bs, json_type_array) || json_object_array_length(bs) != 2)
        return mt_errorf(err, MT_ERR_INVALID, "%s: quantization_config.weight_block_size must be a list of two integers",
                         where);
    int b[2];
    for (int i = 0; i < 2; i++) {
        char nm[48];
        snprintf(nm, sizeof nm, "quantization_config.weight_block_size[%d]", i);
        if ((st = get_int(json_object_array_get_idx(bs, (size_t)i), where, nm, &b[i], err)) != MT_OK) return st;
        if (b[i] < 1) return mt_errorf(err, MT_ERR_INVALID, "%s: %s is %d, must be > 0", where, nm, b[i]);
    }
    out->fp8 = true;
    out->block_rows = b[0];
    out->block_cols = b[1];
    json_object *skip = field_of(q, "modules_to_not_convert", NULL);
    if (!skip || json_object_is_type(skip, json_type_null)) return MT_OK;
    if (!json_object_is_type(skip, json_type_array))
        return mt_errorf(err, MT_ERR_INVALID, "%s: quantization_config.modules_to_not_convert must be a list, got %s",
                         where, ld_json_kind(skip));
    size_t used = 0;
    for (size_t i = 0; i < json_object_array_length(skip); i++) {
        json_object *e = json_object_array_get_idx(skip, i);
        if (!json_object_is_type(e, json_type_string) || !*json_object_get_string(e))
            return mt_errorf(err, MT_ERR_INVALID,
                             "%s: quantization_config.modules_to_not_convert[%zu] must be a non-empty string", where, i);
        const size_t n = strlen(json_object_get_string(e)) + 1;
        if (used + n > sizeof out->skip)
            return mt_errorf(err, MT_ERR_UNSUPPORTED,
                             "%s: quantization_config.modules_to_not_convert holds more than %d bytes of names", where,
                             GLM_QUANT_SKIP_BYTES);
        memcpy(out->skip + used, json_object_get_string(e), n);
        used += n;
        out->n_skip++;
    }
    return MT_OK;
}

bool glm_quant_skips(const glm_quant *q, const char *name) {
    const char *dot = strrchr(name, '.');
    const size_t mlen = dot ? (size_t)(dot - name) : strlen(name); /* the module path */
    const char *e = q->skip;
    for (int i = 0; i < q->n_skip; i++, e += strlen(e) + 1) {
        const size_t n = strlen(e);
        if (n <= mlen && !strncmp(name + mlen - n, e, n) && (n == mlen || name[mlen - n - 1] == '.'))
            return true; /* the module, or one ending with it */
        if (n < mlen && !strncmp(name, e, n) && name[n] == '.') return true; /* under it */
    }
    return false;
}

/* ------------------------------------------------------------------------------------------ */
/* Parse                                                                                      */

/* A list of ints at most max long into out; *len its length. */
static mt_status get_int_list(json_object *v, const char *where, const char *name, int max, int *out, int *len,
                              mt_error *err) {
    if (!json_object_is_type(v, json_type_array))
        return mt_errorf(err, MT_ERR_INVALID, "%s: %s must be a list of integers, got %s", where, name,
                         ld_json_kind(v));
    const size_t n = json_object_array_length(v);
    if (n > (size_t)max) return mt_errorf(err, MT_ERR_INVALID, "%s: %s has %zu entries, at most %d", where, name, n, max);
    for (size_t i = 0; i < n; i++) {
        char what[64];
        snprintf(what, sizeof what, "%s[%zu]", name, i);
        mt_status st = get_int(json_object_array_get_idx(v, i), where, what, &out[i], err);
        if (st != MT_OK) return st;
    }
    *len = (int)n;
    return MT_OK;
}

/* The PLE keys (docs/MODEL.md, "PLE layer"); the per-layer list needs num_hidden_layers. */
static mt_status parse_ple(json_object *obj, const char *where, glm_config *c, mt_error *err) {
    static const struct { const char *name; size_t off; } ints[] = {
        { "ple_max_ngram", offsetof(glm_config, ple_max_ngram) },
        { "ple_heads_per_ngram", offsetof(glm_config, ple_heads) },
        { "ple_head_dim", offsetof(glm_config, ple_head_dim) },
        { "ple_conv_kernel", offsetof(glm_config, ple_conv_kernel) },
        { "ple_pad_id", offsetof(glm_config, ple_pad_id) },
        { "ple_seed", offsetof(glm_config, ple_seed) },
    };
    mt_status st;
    json_object *v;
    for (size_t i = 0; i < sizeof ints / sizeof ints[0]; i++)
        if ((v = field_of(obj, ints[i].name, NULL)) &&
            (st = get_int(v, where, ints[i].name, (int *)((char *)c + ints[i].off), err)) != MT_OK)
            return st;
    if ((v = field_of(obj, "ple_norm_eps", NULL)) && (st = get_float(v, where, "ple_norm_eps", &c->ple_norm_eps, err)) != MT_OK)
        return st;
    if ((v = field_of(obj, "ple_compress_ids", NULL)) &&
        (st = get_bool(v, where, "ple_compress_ids", &c->ple_compress_ids, err)) != MT_OK)
        return st;
    int tmp[GLM_MAX_LAYERS], n = 0;
    if ((v = field_of(obj, "ple_table_sizes", NULL))) {
        if ((st = get_int_list(v, where, "ple_table_sizes", GLM_PLE_MAX_ORDER - 1, tmp, &n, err)) != MT_OK) return st;
        if (n != c->ple_max_ngram - 1)
            return mt_errorf(err, MT_ERR_INVALID, "%s: ple_table_sizes has %d entries, ple_max_ngram %d needs %d", where,
                             n, c->ple_max_ngram, c->ple_max_ngram - 1);
        for (int o = 0; o < n; o++) c->ple_table_sizes[o] = tmp[o];
    }
    if ((v = field_of(obj, "ple_layers", NULL))) {
        if ((st = get_int_list(v, where, "ple_layers", GLM_MAX_LAYERS, tmp, &n, err)) != MT_OK) return st;
        for (int i = 0; i < n; i++) {
            if (tmp[i] < 0 || tmp[i] >= c->num_hidden_layers)
                return mt_errorf(err, MT_ERR_INVALID, "%s: ple_layers[%d] is %d, outside 0..%d", where, i, tmp[i],
                                 c->num_hidden_layers - 1);
            c->ple_layer[tmp[i]] = true;
        }
    }
    return MT_OK;
}

/* Reads the text fields of obj (the text_config object, or the whole flat config) into c, which
 * holds the defaults on entry. */
static mt_status parse_text(json_object *obj, const char *where, glm_config *c, mt_error *err) {
    mt_status st;
    bool present;
    json_object *v;

    for (size_t i = 0; i < sizeof k_fields / sizeof k_fields[0]; i++) {
        const field *f = &k_fields[i];
        v = field_of(obj, f->name, &present);
        if (!present) continue; /* null is a type error below: these fields are not nullable */
        char *dst = (char *)c + f->off;
        switch (f->kind) {
        case F_INT: st = get_int(v, where, f->name, (int *)dst, err); break;
        case F_FLOAT: st = get_float(v, where, f->name, (float *)dst, err); break;
        case F_BOOL: st = get_bool(v, where, f->name, (bool *)dst, err); break;
        default: st = MT_ERR_INVALID; break;
        }
        if (st != MT_OK) return st;
    }

    /* transformers' attribute_map: num_local_experts is an alias of n_routed_experts. */
    if (!field_of(obj, "n_routed_experts", NULL) && (v = field_of(obj, "num_local_experts", NULL)) &&
        (st = get_int(v, where, "num_local_experts", &c->n_routed_experts, err)) != MT_OK)
        return st;

    /* num_key_value_heads: null -> num_attention_heads. Absent -> the default (64), as in
     * transformers, which validate then compares with num_attention_heads. */
    v = field_of(obj, "num_key_value_heads", &present);
    if (present) {
        if (json_object_is_type(v, json_type_null)) c->num_key_value_heads = c->num_attention_heads;
        else if ((st = get_int(v, where, "num_key_value_heads", &c->num_key_value_heads, err)) != MT_OK)
            return st;
    }

    v = field_of(obj, "pad_token_id", &present);
    if (present) {
        if (json_object_is_type(v, json_type_null)) c->pad_token_id = -1;
        else if ((st = get_int(v, where, "pad_token_id", &c->pad_token_id, err)) != MT_OK)
            return st;
    }

    v = field_of(obj, "eos_token_id", &present);
    if (present && (st = get_eos(v, where, &c->eos_token_id, err)) != MT_OK) return st;

    v = field_of(obj, "linear_lower_bound", &present);
    if (present) {
        if (json_object_is_type(v, json_type_null)) {
            c->has_linear_lower_bound = false;
        } else {
            if ((st = get_float(v, where, "linear_lower_bound", &c->linear_lower_bound, err)) != MT_OK)
                return st;
            c->has_linear_lower_bound = true;
        }
    }

    /* The per-layer lists need a sane layer count first. */
    if (c->num_hidden_layers < 1 || c->num_hidden_layers > GLM_MAX_LAYERS)
        return mt_errorf(err, MT_ERR_INVALID, "%s: num_hidden_layers is %d, must be in 1..%d", where,
                         c->num_hidden_layers, GLM_MAX_LAYERS);
    const int n = c->num_hidden_layers;
    glm_config_default_layers(c);
    int tmp[GLM_MAX_LAYERS];

    if ((v = field_of(obj, "layer_types", NULL)) && !json_object_is_type(v, json_type_null)) {
        if ((st = get_list(v, where, "layer_types", n, map_layer,
                           "\"linear_attention\", \"deepseek_sparse_attention\" or \"full_attention\"",
                           tmp, err)) != MT_OK)
            return st;
        for (int i = 0; i < n; i++) c->layer_types[i] = (glm_mixer)tmp[i];
    }
    if ((v = field_of(obj, "mlp_layer_types", NULL)) && !json_object_is_type(v, json_type_null)) {
        if ((st = get_list(v, where, "mlp_layer_types", n, map_mlp, "\"dense\" or \"sparse\"", tmp,
                           err)) != MT_OK)
            return st;
        for (int i = 0; i < n; i++) c->mlp_layer_types[i] = (glm_mlp)tmp[i];
    }
    if ((v = field_of(obj, "indexer_types", NULL)) && !json_object_is_type(v, json_type_null)) {
        if ((st = get_list(v, where, "indexer_types", n, map_indexer, "\"full\" or \"shared\"", tmp,
                           err)) != MT_OK)
            return st;
        for (int i = 0; i < n; i++) c->indexer_types[i] = (glm_indexer)tmp[i];
    } else if ((st = derive_indexer(obj, where, c, err)) != MT_OK) {
        return st;
    }

    if ((st = parse_ple(obj, where, c, err)) != MT_OK) return st;

    /* linear_attn_config overrides the linear_* fields (after them, as __post_init__ does). */
    if ((v = field_of(obj, "linear_attn_config", NULL)) && !json_object_is_type(v, json_type_null)) {
        if (!json_object_is_type(v, json_type_object))
            return mt_errorf(err, MT_ERR_INVALID, "%s: linear_attn_config must be an object, got %s",
                             where, ld_json_kind(v));
        json_object *e;
        if ((e = field_of(v, "head_dim", NULL)) &&
            (st = get_int(e, where, "linear_attn_config.head_dim", &c->linear_head_dim, err)) != MT_OK)
            return st;
        if ((e = field_of(v, "num_heads", NULL)) &&
            (st = get_int(e, where, "linear_attn_config.num_heads", &c->linear_num_heads, err)) != MT_OK)
            return st;
        if ((e = field_of(v, "short_conv_kernel_size", NULL)) &&
            (st = get_int(e, where, "linear_attn_config.short_conv_kernel_size",
                          &c->linear_conv_kernel_dim, err)) != MT_OK)
            return st;
        e = field_of(v, "gate_lower_bound", &present);
        if (present) {
            if (json_object_is_type(e, json_type_null)) {
                c->has_linear_lower_bound = false;
            } else {
                if ((st = get_float(e, where, "linear_attn_config.gate_lower_bound",
                                    &c->linear_lower_bound, err)) != MT_OK)
                    return st;
                c->has_linear_lower_bound = true;
            }
        }
        bool safe_gate = true;
        if ((e = field_of(v, "safe_gate", NULL)) && !json_object_is_type(e, json_type_null) &&
            (st = get_bool(e, where, "linear_attn_config.safe_gate", &safe_gate, err)) != MT_OK)
            return st;
        if (safe_gate && !c->has_linear_lower_bound) {
            c->has_linear_lower_bound = true;
            c->linear_lower_bound = -5.0f;
        }
    }
    return MT_OK;
}

/* Prefixes err->msg with "where: " (validate does not know the source). */
static mt_status prefix_error(mt_error *err, mt_status st, const char *where) {
    if (err) {
        char tmp[sizeof err->msg];
        snprintf(tmp, sizeof tmp, "%s", err->msg);
        mt_errorf(err, st, "%s: %s", where, tmp);
    }
    return st;
}

mt_status glm_config_parse(const char *text, const char *where, glm_config *cfg, mt_error *err) {
    if (!where) where = "config";
    if (!text || !cfg) return mt_errorf(err, MT_ERR_INVALID, "%s: no config text", where);
    mt_status st = MT_OK;
    glm_config *c = malloc(sizeof *c);
    json_tokener *tok = json_tokener_new();
    json_object *root = NULL;
    if (!c || !tok) {
        st = mt_errorf(err, MT_ERR_NOMEM, "%s: out of memory", where);
        goto done;
    }
    size_t len = strlen(text);
    if (len > INT_MAX) {
        st = mt_errorf(err, MT_ERR_INVALID, "%s: config is too large", where);
        goto done;
    }
    root = json_tokener_parse_ex(tok, text, (int)len);
    enum json_tokener_error jerr = json_tokener_get_error(tok);
    if (!root || jerr != json_tokener_success) {
        st = mt_errorf(err, MT_ERR_INVALID, "%s: not valid JSON (%s at offset %zu)", where,
                       jerr == json_tokener_continue ? "unexpected end of input"
                                                     : json_tokener_error_desc(jerr),
                       json_tokener_get_parse_end(tok));
        goto done;
    }
    for (size_t i = json_tokener_get_parse_end(tok); i < len; i++) {
        if (!strchr(" \t\r\n", text[i])) {
            st = mt_errorf(err, MT_ERR_INVALID, "%s: not valid JSON (trailing data at offset %zu)",
                           where, i);
            goto done;
        }
    }
    if (!json_object_is_type(root, json_type_object)) {
        st = mt_errorf(err, MT_ERR_INVALID, "%s: the config must be a JSON object, got %s", where,
                       ld_json_kind(root));
        goto done;
    }

    json_object *v = field_of(root, "model_type", NULL);
    if (v) {
        const char *mt = json_object_is_type(v, json_type_string) ? json_object_get_string(v) : NULL;
        if (!mt || (strcmp(mt, "glm5_next") && strcmp(mt, "glm5_next_text"))) {
            st = mt_errorf(err, MT_ERR_INVALID,
                           "%s: model_type is %s%.64s%s, expected \"glm5_next\" or \"glm5_next_text\"",
                           where, mt ? "\"" : "", mt ? mt : ld_json_kind(v), mt ? "\"" : "");
            goto done;
        }
    }

    glm_config_default(c);
    json_object *text_obj = root;
    v = field_of(root, "text_config", NULL);
    if (v && !json_object_is_type(v, json_type_null)) {
        if (!json_object_is_type(v, json_type_object)) {
            st = mt_errorf(err, MT_ERR_INVALID, "%s: text_config must be an object, got %s", where,
                           ld_json_kind(v));
            goto done;
        }
        text_obj = v;
    }
    if ((st = parse_text(text_obj, where, c, err)) != MT_OK) goto done;

    if (text_obj != root) {
        /* Glm5NextForConditionalGeneration owns lm_head: its top-level tie_word_embeddings wins.
         * eos_token_id is often only top-level there; take it when text_config has none. */
        if ((v = field_of(root, "tie_word_embeddings", NULL)) &&
            (st = get_bool(v, where, "tie_word_embeddings", &c->tie_word_embeddings, err)) != MT_OK)
            goto done;
        bool in_text, at_top;
        field_of(text_obj, "eos_token_id", &in_text);
        v = field_of(root, "eos_token_id", &at_top);
        if (!in_text && at_top && (st = get_eos(v, where, &c->eos_token_id, err)) != MT_OK) goto done;
    }
    /* quantization_config: text_config's, else the top level's. */
    v = field_of(text_obj, "quantization_config", NULL);
    if ((!v || json_object_is_type(v, json_type_null)) && text_obj != root)
        v = field_of(root, "quantization_config", NULL);
    if (v && !json_object_is_type(v, json_type_null) && (st = parse_quant(v, where, &c->quant, err)) != MT_OK)
        goto done;

    if ((st = glm_config_validate(c, err)) != MT_OK) {
        prefix_error(err, st, where);
        goto done;
    }
    *cfg = *c;
done:
    if (root) json_object_put(root);
    if (tok) json_tokener_free(tok);
    free(c);
    return st;
}

mt_status glm_config_load(const char *path, glm_config *cfg, mt_error *err) {
    if (!path) return mt_errorf(err, MT_ERR_INVALID, "config: no path");
    FILE *f = fopen(path, "rb");
    if (!f) return mt_errorf(err, MT_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    mt_status st = MT_OK;
    char *buf = NULL;
    if (fseek(f, 0, SEEK_END) != 0) goto io;
    long size = ftell(f);
    if (size < 0 || fseek(f, 0, SEEK_SET) != 0) goto io;
    if (size > (1L << 26)) {
        st = mt_errorf(err, MT_ERR_INVALID, "%s: %ld bytes is too large for a config", path, size);
        goto done;
    }
    buf = malloc((size_t)size + 1);
    if (!buf) {
        st = mt_errorf(err, MT_ERR_NOMEM, "%s: out of memory", path);
        goto done;
    }
    if (fread(buf, 1, (size_t)size, f) != (size_t)size) goto io;
    buf[size] = 0;
    if (strlen(buf) != (size_t)size) {
        st = mt_errorf(err, MT_ERR_INVALID, "%s: not valid JSON (NUL byte in file)", path);
        goto done;
    }
    st = glm_config_parse(buf, path, cfg, err);
    goto done;
io:
    st = mt_errorf(err, MT_ERR_IO, "%s: read failed: %s", path, strerror(errno));
done:
    free(buf);
    fclose(f);
    return st;
}

/* ------------------------------------------------------------------------------------------ */
/* Validate                                                                                   */

mt_status glm_config_validate(const glm_config *c, mt_error *err) {
#define BAD(...) return mt_errorf(err, MT_ERR_INVALID, __VA_ARGS__)
    if (c->num_hidden_layers < 1 || c->num_hidden_layers > GLM_MAX_LAYERS)
        BAD("num_hidden_layers is %d, must be in 1..%d", c->num_hidden_layers, GLM_MAX_LAYERS);
    const struct { const char *name; int v; } pos[] = {
        { "vocab_size", c->vocab_size },
        { "hidden_size", c->hidden_size },
        { "intermediate_size", c->intermediate_size },
        { "moe_intermediate_size", c->moe_intermediate_size },
        { "num_attention_heads", c->num_attention_heads },
        { "num_key_value_heads", c->num_key_value_heads },
        { "n_shared_experts", c->n_shared_experts },
        { "n_routed_experts", c->n_routed_experts },
        { "kv_lora_rank", c->kv_lora_rank },
        { "q_lora_rank", c->q_lora_rank },
        { "v_head_dim", c->v_head_dim },
        { "qk_nope_head_dim", c->qk_nope_head_dim },
        { "n_group", c->n_group },
        { "topk_group", c->topk_group },
        { "num_experts_per_tok", c->num_experts_per_tok },
        { "index_topk", c->index_topk },
        { "index_head_dim", c->index_head_dim },
        { "index_n_heads", c->index_n_heads },
        { "linear_head_dim", c->linear_head_dim },
        { "linear_num_heads", c->linear_num_heads },
        { "linear_conv_kernel_dim", c->linear_conv_kernel_dim },
    };
    for (size_t i = 0; i < sizeof pos / sizeof pos[0]; i++)
        if (pos[i].v < 1) BAD("%s is %d, must be > 0", pos[i].name, pos[i].v);
    if (c->hc_mult < 1) BAD("hc_mult is %d, must be >= 1", c->hc_mult);
    if (c->hc_sinkhorn_iters < 1) BAD("hc_sinkhorn_iters is %d, must be >= 1", c->hc_sinkhorn_iters);
    if (c->index_kpool < 1) BAD("index_kpool is %d, must be >= 1", c->index_kpool);
    if (c->num_nextn_predict_layers < 0)
        BAD("num_nextn_predict_layers is %d, must be >= 0", c->num_nextn_predict_layers);
    if (c->num_nextn_predict_layers > 0 && c->num_hidden_layers >= GLM_MAX_LAYERS)
        BAD("an MTP block needs num_hidden_layers < %d, got %d", GLM_MAX_LAYERS, c->num_hidden_layers);
    if (c->index_topk % c->index_kpool != 0)
        BAD("index_topk (%d) must be divisible by index_kpool (%d)", c->index_topk, c->index_kpool);
    if (c->qk_rope_head_dim > 0)
        BAD("qk_rope_head_dim is %d: DSA layers are NoPE, it must be 0", c->qk_rope_head_dim);
    if (c->qk_rope_head_dim < 0) BAD("qk_rope_head_dim is %d, must be 0", c->qk_rope_head_dim);
    if (c->num_attention_heads != c->num_key_value_heads)
        BAD("num_key_value_heads (%d) must equal num_attention_heads (%d)", c->num_key_value_heads,
            c->num_attention_heads);

    /* Products the tensor shapes use must fit an int. */
    const struct { const char *what; int64_t v; } prod[] = {
        { "linear_num_heads * linear_head_dim", (int64_t)c->linear_num_heads * c->linear_head_dim },
        { "num_attention_heads * (qk_nope_head_dim + v_head_dim)",
          (int64_t)c->num_attention_heads * ((int64_t)c->qk_nope_head_dim + c->v_head_dim) },
        { "index_n_heads * index_head_dim", (int64_t)c->index_n_heads * c->index_head_dim },
        { "hc_mult * hidden_size", (int64_t)c->hc_mult * c->hidden_size },
        { "(2 + hc_mult) * hc_mult", (2 + (int64_t)c->hc_mult) * c->hc_mult },
        { "moe_intermediate_size * n_shared_experts",
          (int64_t)c->moe_intermediate_size * c->n_shared_experts },
    };
    for (size_t i = 0; i < sizeof prod / sizeof prod[0]; i++)
        if (prod[i].v > INT_MAX) BAD("%s is too large (%lld)", prod[i].what, (long long)prod[i].v);

    if (c->n_routed_experts % c->n_group != 0)
        BAD("n_routed_experts (%d) must be divisible by n_group (%d)", c->n_routed_experts, c->n_group);
    const int per_group = c->n_routed_experts / c->n_group;
    if (per_group < 2)
        BAD("n_routed_experts / n_group is %d: each group needs >= 2 experts (group score is a top-2 sum)",
            per_group);
    if (c->topk_group > c->n_group)
        BAD("topk_group (%d) must be <= n_group (%d)", c->topk_group, c->n_group);
    if ((int64_t)c->num_experts_per_tok > (int64_t)c->topk_group * per_group)
        BAD("num_experts_per_tok (%d) exceeds the %d experts in topk_group (%d) groups",
            c->num_experts_per_tok, c->topk_group * per_group, c->topk_group);

    if (!(c->rms_norm_eps > 0.f) || !isfinite(c->rms_norm_eps))
        BAD("rms_norm_eps must be > 0");
    if (!(c->hc_eps >= 0.f) || !isfinite(c->hc_eps)) BAD("hc_eps must be >= 0");
    if (!isfinite(c->routed_scaling_factor)) BAD("routed_scaling_factor must be finite");
    if (!(c->swiglu_limit > 0.f) || !isfinite(c->swiglu_limit)) BAD("swiglu_limit must be > 0");
    if (c->has_linear_lower_bound && !isfinite(c->linear_lower_bound))
        BAD("linear_lower_bound must be finite");
    if (c->quant.fp8 && (c->quant.block_rows < 1 || c->quant.block_cols < 1))
        BAD("quantization_config.weight_block_size is [%d, %d], must be > 0", c->quant.block_rows,
            c->quant.block_cols);
    if (c->quant.n_skip < 0) BAD("quantization_config has %d modules_to_not_convert", c->quant.n_skip);

    for (int l = 0; l < c->num_hidden_layers; l++) {
        if (c->layer_types[l] != GLM_MIXER_KDA && c->layer_types[l] != GLM_MIXER_DSA)
            BAD("layer_types[%d] has unknown value %d", l, (int)c->layer_types[l]);
        if (c->mlp_layer_types[l] != GLM_MLP_DENSE && c->mlp_layer_types[l] != GLM_MLP_SPARSE)
            BAD("mlp_layer_types[%d] has unknown value %d", l, (int)c->mlp_layer_types[l]);
        if (c->indexer_types[l] != GLM_INDEXER_FULL && c->indexer_types[l] != GLM_INDEXER_SHARED)
            BAD("indexer_types[%d] has unknown value %d", l, (int)c->indexer_types[l]);
    }
    if (glm_config_has_ple(c)) {
        if (c->ple_max_ngram < 2 || c->ple_max_ngram > GLM_PLE_MAX_ORDER)
            BAD("ple_max_ngram is %d, must be in 2..%d", c->ple_max_ngram, GLM_PLE_MAX_ORDER);
        if (c->ple_heads < 1 || c->ple_heads > GLM_PLE_MAX_HEADS)
            BAD("ple_heads_per_ngram is %d, must be in 1..%d", c->ple_heads, GLM_PLE_MAX_HEADS);
        if (c->ple_head_dim < 1) BAD("ple_head_dim is %d, must be > 0", c->ple_head_dim);
        if (c->ple_conv_kernel < 1) BAD("ple_conv_kernel is %d, must be > 0", c->ple_conv_kernel);
        for (int o = 0; o < c->ple_max_ngram - 1; o++)
            if (c->ple_table_sizes[o] < 2) BAD("ple_table_sizes[%d] is %d, must be >= 2", o, c->ple_table_sizes[o]);
        if (!(c->ple_norm_eps > 0.f) || !isfinite(c->ple_norm_eps)) BAD("ple_norm_eps must be > 0");
        if (c->ple_pad_id < 0) BAD("ple_pad_id is %d, must be >= 0", c->ple_pad_id);
        if (c->ple_compress_ids)
            return mt_errorf(err, MT_ERR_UNSUPPORTED, "ple_compress_ids (tokenizer compression) is not supported");
    }
    for (int l = 0; l < c->num_hidden_layers; l++) {
        if (c->layer_types[l] != GLM_MIXER_DSA || c->indexer_types[l] != GLM_INDEXER_SHARED) continue;
        if (l == 0 || c->layer_types[l - 1] != GLM_MIXER_DSA ||
            c->indexer_types[l - 1] != GLM_INDEXER_FULL)
            BAD("indexer_types[%d] is \"shared\" but layer %d is not a DSA layer with a \"full\" indexer",
                l, l - 1);
    }
    return MT_OK;
#undef BAD
}

/* ------------------------------------------------------------------------------------------ */
/* Save                                                                                       */

/* Shortest decimal that reads back as the same float, always with a '.' or exponent so Python
 * reads a float. */
static json_object *new_float(float f) {
    char buf[48];
    for (int prec = 6; prec <= 9; prec++) {
        snprintf(buf, sizeof buf, "%.*g", prec, (double)f);
        if (strtof(buf, NULL) == f) break;
    }
    if (!strpbrk(buf, ".eEn")) strncat(buf, ".0", sizeof buf - strlen(buf) - 1);
    return json_object_new_double_s((double)f, buf);
}

/* Adds v (owned) under k; -1 when v is NULL (an allocation failed) or the add fails. */
static int add(json_object *o, const char *k, json_object *v) {
    if (!v) return -1;
    if (json_object_object_add(o, k, v) != 0) {
        json_object_put(v);
        return -1;
    }
    return 0;
}

/* Appends the string s to the array a; -1 when that fails. */
static int add_str(json_object *a, const char *s) {
    json_object *v = json_object_new_string(s);
    if (!v) return -1;
    if (json_object_array_add(a, v) != 0) {
        json_object_put(v);
        return -1;
    }
    return 0;
}

mt_status glm_config_save(const glm_config *c, const char *path, mt_error *err) {
    mt_status st = glm_config_validate(c, err);
    if (st != MT_OK) return prefix_error(err, st, path);
    json_object *o = json_object_new_object();
    if (!o) return mt_errorf(err, MT_ERR_NOMEM, "%s: out of memory", path);
    int bad = 0;
    bad |= add(o, "model_type", json_object_new_string("glm5_next_text"));
    for (size_t i = 0; i < sizeof k_fields / sizeof k_fields[0]; i++) {
        const field *f = &k_fields[i];
        const char *src = (const char *)c + f->off;
        switch (f->kind) {
        case F_INT: bad |= add(o, f->name, json_object_new_int(*(const int *)src)); break;
        case F_FLOAT: bad |= add(o, f->name, new_float(*(const float *)src)); break;
        case F_BOOL: bad |= add(o, f->name, json_object_new_boolean(*(const bool *)src)); break;
        }
    }
    bad |= add(o, "num_key_value_heads", json_object_new_int(c->num_key_value_heads));
    /* json-c spells JSON null as a NULL value. */
    if (c->has_linear_lower_bound) bad |= add(o, "linear_lower_bound", new_float(c->linear_lower_bound));
    else bad |= json_object_object_add(o, "linear_lower_bound", NULL);
    if (c->pad_token_id >= 0) bad |= add(o, "pad_token_id", json_object_new_int(c->pad_token_id));
    else bad |= json_object_object_add(o, "pad_token_id", NULL);
    if (c->eos_token_id >= 0) bad |= add(o, "eos_token_id", json_object_new_int(c->eos_token_id));
    else bad |= json_object_object_add(o, "eos_token_id", NULL);

    if (c->quant.fp8 && !bad) {
        json_object *q = json_object_new_object();
        bad |= add(o, "quantization_config", q);
        json_object *bs = bad ? NULL : json_object_new_array();
        if (!bad) {
            bad |= add(q, "quant_method", json_object_new_string("fp8"));
            bad |= add(q, "fmt", json_object_new_string("e4m3"));
            bad |= add(q, "activation_scheme", json_object_new_string("dynamic"));
            bad |= add(q, "weight_block_size", bs);
        }
        if (!bad) {
            bad |= json_object_array_add(bs, json_object_new_int(c->quant.block_rows));
            bad |= json_object_array_add(bs, json_object_new_int(c->quant.block_cols));
        }
        json_object *sk = bad ? NULL : json_object_new_array();
        if (!bad) bad |= add(q, "modules_to_not_convert", sk);
        const char *e = c->quant.skip;
        for (int i = 0; i < c->quant.n_skip && !bad; i++, e += strlen(e) + 1) bad |= add_str(sk, e);
    }
    json_object *lt = json_object_new_array(), *mt = json_object_new_array(),
                *it = json_object_new_array();
    bad |= add(o, "layer_types", lt) | add(o, "mlp_layer_types", mt) | add(o, "indexer_types", it);
    for (int l = 0; l < c->num_hidden_layers && !bad; l++) {
        bad |= json_object_array_add(lt, json_object_new_string(
            c->layer_types[l] == GLM_MIXER_DSA ? "deepseek_sparse_attention" : "linear_attention"));
        bad |= json_object_array_add(mt, json_object_new_string(
            c->mlp_layer_types[l] == GLM_MLP_DENSE ? "dense" : "sparse"));
        bad |= json_object_array_add(it, json_object_new_string(
            c->indexer_types[l] == GLM_INDEXER_FULL ? "full" : "shared"));
    }
    if (glm_config_has_ple(c) && !bad) {
        json_object *pl = json_object_new_array(), *ts = json_object_new_array();
        bad |= add(o, "ple_layers", pl) | add(o, "ple_table_sizes", ts);
        for (int l = 0; l < c->num_hidden_layers && !bad; l++)
            if (c->ple_layer[l]) bad |= json_object_array_add(pl, json_object_new_int(l));
        for (int k = 0; k < c->ple_max_ngram - 1 && !bad; k++)
            bad |= json_object_array_add(ts, json_object_new_int(c->ple_table_sizes[k]));
        bad |= add(o, "ple_max_ngram", json_object_new_int(c->ple_max_ngram));
        bad |= add(o, "ple_heads_per_ngram", json_object_new_int(c->ple_heads));
        bad |= add(o, "ple_head_dim", json_object_new_int(c->ple_head_dim));
        bad |= add(o, "ple_conv_kernel", json_object_new_int(c->ple_conv_kernel));
        bad |= add(o, "ple_pad_id", json_object_new_int(c->ple_pad_id));
        bad |= add(o, "ple_seed", json_object_new_int(c->ple_seed));
        bad |= add(o, "ple_norm_eps", new_float(c->ple_norm_eps));
    }
    if (bad) {
        json_object_put(o);
        return mt_errorf(err, MT_ERR_NOMEM, "%s: out of memory", path);
    }
    const char *s = json_object_to_json_string_ext(
        o, JSON_C_TO_STRING_PRETTY | JSON_C_TO_STRING_SPACED | JSON_C_TO_STRING_NOSLASHESCAPE);
    FILE *f = s ? fopen(path, "wb") : NULL;
    if (!s) {
        st = mt_errorf(err, MT_ERR_NOMEM, "%s: out of memory", path);
    } else if (!f) {
        st = mt_errorf(err, MT_ERR_IO, "%s: cannot create: %s", path, strerror(errno));
    } else {
        size_t n = strlen(s);
        int ok = fwrite(s, 1, n, f) == n && fputc('\n', f) != EOF;
        ok = (fclose(f) == 0) && ok;
        if (!ok) {
            st = mt_errorf(err, MT_ERR_IO, "%s: write failed: %s", path, strerror(errno));
            remove(path);
        }
    }
    json_object_put(o);
    return st;
}

/* ------------------------------------------------------------------------------------------ */
/* Presets                                                                                    */

mt_status glm_config_preset(const char *name, glm_config *cfg, mt_error *err) {
    glm_config c;
    glm_config_default(&c);
    const bool ple = name && !strcmp(name, "tiny-ple");
    if (name && (!strcmp(name, "tiny") || ple)) {
        c.vocab_size = 256;
        c.hidden_size = 64;
        c.intermediate_size = 128;
        c.moe_intermediate_size = 32;
        c.num_hidden_layers = 4;
        c.num_attention_heads = 4;
        c.num_key_value_heads = 4;
        c.qk_nope_head_dim = 16;
        c.v_head_dim = 16;
        c.kv_lora_rank = 32;
        c.q_lora_rank = 48;
        c.n_routed_experts = 16;
        c.n_group = 4;
        c.topk_group = 2;
        c.num_experts_per_tok = 4;
        c.n_shared_experts = 1;
        c.index_topk = 16;
        c.index_kpool = 4;
        c.index_head_dim = 16;
        c.index_n_heads = 16;
        c.linear_num_heads = 4;
        c.linear_head_dim = 16;
        c.linear_conv_kernel_dim = 4;
        c.hc_mult = 4;
        c.hc_sinkhorn_iters = 20;
        c.has_linear_lower_bound = true;
        c.linear_lower_bound = -5.0f;
        c.index_kpool_always_select_tail = true;
        c.pad_token_id = -1; /* the real pad id is outside a 256-token vocabulary */
        c.eos_token_id = -1;
        glm_config_default_layers(&c);
        const glm_mixer lt[4] = { GLM_MIXER_KDA, GLM_MIXER_DSA, GLM_MIXER_DSA, GLM_MIXER_KDA };
        const glm_mlp mt[4] = { GLM_MLP_DENSE, GLM_MLP_SPARSE, GLM_MLP_SPARSE, GLM_MLP_SPARSE };
        const glm_indexer it[4] = { GLM_INDEXER_FULL, GLM_INDEXER_FULL, GLM_INDEXER_SHARED,
                                    GLM_INDEXER_FULL };
        for (int i = 0; i < 4; i++) {
            c.layer_types[i] = lt[i];
            c.mlp_layer_types[i] = mt[i];
            c.indexer_types[i] = it[i];
        }
        if (ple) { /* a memory before a KDA and before a DSA mixer; tables of a few hundred rows */
            c.ple_layer[0] = c.ple_layer[2] = true;
            c.ple_max_ngram = 3;
            c.ple_heads = 2;
            c.ple_head_dim = 8;
            c.ple_table_sizes[0] = 61;
            c.ple_table_sizes[1] = 89;
            c.ple_conv_kernel = 3;
            c.ple_seed = 7;
        }
    } else if (name && !strcmp(name, "bench-4L")) {
        /* Real per-layer dims. Mixers follow the default pattern (KDA, KDA, KDA, DSA, every
         * indexer full); the MLPs are 1 dense + 3 MoE rather than the default 3 + 1. */
        c.num_hidden_layers = 4;
        glm_config_default_layers(&c);
        for (int i = 1; i < 4; i++) c.mlp_layer_types[i] = GLM_MLP_SPARSE;
    } else if (name && !strcmp(name, "test-wide")) {
        /* The wider random model of the GPU model test (tests/model_cuda_test.cc): real head
         * sizes (KDA heads of 128, MLA heads of 256/256 over a 512 latent, indexer heads of 128) at
         * hidden 512, 64 experts, a shared indexer. */
        c.vocab_size = 2048; c.hidden_size = 512; c.intermediate_size = 1024; c.moe_intermediate_size = 256;
        c.num_hidden_layers = 4; c.num_attention_heads = 4; c.num_key_value_heads = 4;
        c.linear_num_heads = 4; c.n_routed_experts = 64; c.num_experts_per_tok = 8; c.n_group = 8; c.topk_group = 4;
        c.index_topk = 128; c.index_kpool = 16; c.index_n_heads = 8;
        glm_config_default_layers(&c);
        c.mlp_layer_types[1] = GLM_MLP_SPARSE;
        c.layer_types[1] = GLM_MIXER_DSA; c.layer_types[2] = GLM_MIXER_DSA; c.indexer_types[2] = GLM_INDEXER_SHARED;
    } else {
        return mt_errorf(err, MT_ERR_NOT_FOUND,
                         "config preset \"%s\" is unknown (expected tiny, tiny-ple, bench-4L or test-wide)", name ? name : "(null)");
    }
    mt_status st = glm_config_validate(&c, err);
    if (st != MT_OK) return st;
    *cfg = c;
    return MT_OK;
}
