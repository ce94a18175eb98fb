/* worker/loader/glm_config.h: the text config of a glm5_next checkpoint (config.json).
 *
 * Owner: the model loader. Reads both the Glm5NextForConditionalGeneration form (text fields under
 * "text_config") and the flat text-only form, applies transformers' defaults (configuration_
 * glm5_next.py of transformers 5.17) for every absent field, then validates. A rejected config
 * names the offending field in err. Thread-safety: none needed; a config is immutable once loaded.
 */
#ifndef GLM_CONFIG_H
#define GLM_CONFIG_H

#include <stdbool.h>

#include "common/mt.h"

#ifdef __cplusplus
extern "C" {
#endif

#define GLM_MAX_LAYERS 256
#define GLM_PLE_MAX_ORDER 8      /* largest n-gram order of a PLE memory */
#define GLM_PLE_MAX_HEADS 64     /* most hashed heads per order */
#define GLM_PLE_MAX_TABLES ((GLM_PLE_MAX_ORDER - 1) * GLM_PLE_MAX_HEADS)

typedef enum glm_mixer { GLM_MIXER_KDA = 0, GLM_MIXER_DSA = 1 } glm_mixer;  /* layer_types */
typedef enum glm_mlp { GLM_MLP_DENSE = 0, GLM_MLP_SPARSE = 1 } glm_mlp;     /* mlp_layer_types */
typedef enum glm_indexer { GLM_INDEXER_FULL = 0, GLM_INDEXER_SHARED = 1 } glm_indexer;

/* config.json's quantization_config (docs/MODEL.md, "FP8 checkpoints"). Only block-scaled FP8
 * is read: quant_method "fp8", fmt "e4m3", activation_scheme "dynamic", weight_block_size
 * [rows, cols]. */
#define GLM_QUANT_SKIP_BYTES 16384
typedef struct glm_quant {
    bool fp8;                    /* false: no quantization_config (every tensor at a float dtype) */
    int block_rows, block_cols;  /* weight_block_size, e.g. 128 x 128 */
    /* modules_to_not_convert: n_skip module names ("lm_head", "mlp.gate", a layer's prefix),
     * each NUL-terminated, back to back in skip */
    int n_skip;
    char skip[GLM_QUANT_SKIP_BYTES];
} glm_quant;

/* True when tensor name (e.g. "model.language_model.layers.1.mlp.gate.weight") belongs to a
 * module q lists in modules_to_not_convert: its module path (the name less its last component)
 * equals an entry, ends with "." + entry, or lies under it (entry + "."). */
bool glm_quant_skips(const glm_quant *q, const char *name);

typedef struct glm_config {
    int vocab_size;              /* 154880 */
    int hidden_size;             /* H, 4096 */
    int intermediate_size;       /* dense MLP, 12288 */
    int moe_intermediate_size;   /* I, 2048 */
    int num_hidden_layers;       /* 45 */
    int num_attention_heads;     /* Hq, 64 */
    int num_key_value_heads;     /* must equal Hq */
    int n_shared_experts;        /* 1 */
    int n_routed_experts;        /* E, 288 */
    float routed_scaling_factor; /* 2.5 */
    int kv_lora_rank;            /* 512 */
    int q_lora_rank;             /* 1536 */
    int qk_rope_head_dim;        /* must be 0 (NoPE) */
    int v_head_dim;              /* 256 */
    int qk_nope_head_dim;        /* 256 */
    int n_group;                 /* 1 */
    int topk_group;              /* 1 */
    int num_experts_per_tok;     /* 8 */
    bool norm_topk_prob;         /* true */
    float rms_norm_eps;          /* 1e-5 */
    bool tie_word_embeddings;    /* false */
    int index_topk;              /* 2048 */
    int index_head_dim;          /* id, 128 */
    int index_n_heads;           /* ih, 32 */
    float swiglu_limit;          /* L, 10 */
    int linear_head_dim;         /* dk, 128 */
    int linear_num_heads;        /* nh, 64 */
    int linear_conv_kernel_dim;  /* K, 4 */
    bool has_linear_lower_bound; /* false when "linear_lower_bound" is null: softplus gate */
    float linear_lower_bound;    /* -5 */
    int hc_mult;                 /* S, 4 */
    float hc_eps;                /* 1e-6 */
    int hc_sinkhorn_iters;       /* 20 */
    int index_kpool;             /* 16 */
    bool index_kpool_always_select_tail; /* true */
    int pad_token_id;            /* -1 when null */
    int eos_token_id;            /* -1 when null (first id when a list) */
    int num_nextn_predict_layers; /* MTP blocks after the layers (0 when absent); the runtime uses
                                  * the first, at layer index num_hidden_layers, when present */
    glm_quant quant;             /* quantization_config, at the top level or under text_config */
    /* PLE memories (docs/MODEL.md, "PLE layer"): the hashed n-gram memory injected into the
     * highway before the mixer of each layer with ple_layer[l]. Absent keys: no PLE layer. */
    bool ple_layer[GLM_MAX_LAYERS]; /* ple_layers: the indices that carry a memory */
    int ple_max_ngram;           /* N: orders 2..N, 3 */
    int ple_heads;               /* ple_heads_per_ngram: hashed heads per order, 8 */
    int ple_head_dim;            /* columns of a table row, 64 */
    int ple_table_sizes[GLM_PLE_MAX_ORDER - 1]; /* per order 2..N: the base table size, 774400 */
    int ple_conv_kernel;         /* taps of the dilated conv (dilation N), 4 */
    int ple_pad_id;              /* stands for positions before the start, 0 */
    int ple_seed;                /* seeds the hash multipliers, 0 */
    float ple_norm_eps;          /* the PLE RMSNorms' eps, 1e-5 */
    bool ple_compress_ids;       /* tokenizer compression; not supported (refused when true) */
    glm_mixer layer_types[GLM_MAX_LAYERS];
    glm_mlp mlp_layer_types[GLM_MAX_LAYERS];
    glm_indexer indexer_types[GLM_MAX_LAYERS];
} glm_config;

/* transformers' defaults (the real GLM-5.3-Flash shape) with the per-layer lists derived as
 * __post_init__ derives them for num_hidden_layers. */
void glm_config_default(glm_config *cfg);

/* Re-derives the per-layer lists for cfg->num_hidden_layers with transformers' default patterns
 * (layer i is DSA when i % 4 == 3, the first min(3, n) MLPs dense, every indexer full). */
void glm_config_default_layers(glm_config *cfg);

/* Parses config.json at path into *cfg. On error *cfg is untouched and err names the file and
 * the field. model_type, when present, must be "glm5_next" or "glm5_next_text". In the nested
 * form only text_config's fields are read, except tie_word_embeddings (the top-level value wins:
 * the conditional-generation model owns lm_head) and eos_token_id (taken from the top level when
 * text_config has none). quantization_config is read from text_config, else from the top level;
 * a quant_method other than "fp8" (or an fp8 config this loader cannot read) is
 * MT_ERR_UNSUPPORTED. Unknown fields are ignored; a known field of the wrong JSON type or an
 * unexpected null is an error. */
mt_status glm_config_load(const char *path, glm_config *cfg, mt_error *err);

/* Parses config JSON text (same rules as glm_config_load; "where" names the source in messages). */
mt_status glm_config_parse(const char *json_text, const char *where, glm_config *cfg, mt_error *err);

/* Checks the invariants the runtime relies on (docs/MODEL.md); err names the field. */
mt_status glm_config_validate(const glm_config *cfg, mt_error *err);

/* Writes cfg as a flat text config.json ("model_type": "glm5_next_text"), with its
 * quantization_config when cfg->quant.fp8, that glm_config_load reads back to the same struct. Validates first: an invalid cfg writes nothing. */
mt_status glm_config_save(const glm_config *cfg, const char *path, mt_error *err);

/* True when some layer carries a PLE memory. */
bool glm_config_has_ple(const glm_config *cfg);

/* The table sizes of PLE layer `layer` (ple_layer[layer] true): (N-1) * ple_heads primes, order
 * by order, head by head, written to out. Every head of every PLE layer gets its own prime: going
 * through the PLE layers in index order, orders 2..N, heads in order, each is the smallest prime
 * above the previous one of its order (the order's base size - 1 at its start in each layer) not
 * taken by any head before it. Returns the count. */
int glm_ple_primes(const glm_config *cfg, int layer, int64_t *out);

/* Presets for tools and benchmarks: "tiny" (hidden 64, a few hundred vocab, every layer kind),
 * "tiny-ple" (tiny with PLE memories on a KDA and a DSA layer) and "bench-4L" (GLM-5.3-Flash's real per-layer dims, 3 KDA + 1 DSA, 1 dense + 3 MoE). */
mt_status glm_config_preset(const char *name, glm_config *cfg, mt_error *err);

#ifdef __cplusplus
}
#endif
#endif /* GLM_CONFIG_H */
