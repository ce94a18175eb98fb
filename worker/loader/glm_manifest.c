/* worker/loader/glm_manifest.c: see glm_manifest.h. */
#include "worker/loader/glm_manifest.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

typedef struct emitter {
    glm_manifest_fn fn;
    void *user;
    int count;
} emitter;

static void emit_v(emitter *e, bool linear, mt_dtype dt, float mean, float std, int ndim, int64_t d0, int64_t d1,
                   int64_t d2, const char *fmt, va_list ap) {
    glm_tensor_spec s;
    memset(&s, 0, sizeof s);
    vsnprintf(s.name, sizeof s.name, fmt, ap);
    s.linear = linear;
    s.dtype = dt;
    s.ndim = ndim;
    s.shape[0] = d0;
    s.shape[1] = d1;
    s.shape[2] = d2;
    s.mean = mean;
    s.std = std;
    e->fn(&s, e->user);
    e->count++;
}

/* emit(e, dtype, mean, std, ndim, d0, d1, d2, "fmt", ...) */
static void emit(emitter *e, mt_dtype dt, float mean, float std, int ndim, int64_t d0, int64_t d1,
                 int64_t d2, const char *fmt, ...) __attribute__((format(printf, 9, 10)));
static void emit(emitter *e, mt_dtype dt, float mean, float std, int ndim, int64_t d0, int64_t d1,
                 int64_t d2, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    emit_v(e, false, dt, mean, std, ndim, d0, d1, d2, fmt, ap);
    va_end(ap);
}

/* A linear map's weight [out, in], scaled so outputs keep unit-ish variance. */
static void emit_lin(emitter *e, int64_t out, int64_t in, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static void emit_lin(emitter *e, int64_t out, int64_t in, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    emit_v(e, true, MT_BF16, 0.f, 1.f / sqrtf((float)in), 2, out, in, 0, fmt, ap);
    va_end(ap);
}

#define LIN(e, out, in, ...) emit_lin(e, (out), (in), __VA_ARGS__)
#define NORMW(e, n, ...) emit(e, MT_BF16, 1.f, 0.1f, 1, (n), 0, 0, __VA_ARGS__)

static void emit_mlp(emitter *e, const char *pre, int H, int I) {
    LIN(e, I, H, "%sgate_proj.weight", pre);
    LIN(e, I, H, "%sup_proj.weight", pre);
    LIN(e, H, I, "%sdown_proj.weight", pre);
}

/* One decoder layer's tensors under prefix p, of the given kinds; hc: with its hyper-connections. */
static void emit_layer(emitter *e, const glm_config *c, const char *p, glm_mixer mixer, glm_mlp mlp,
                       glm_indexer indexer, bool hc) {
    const int H = c->hidden_size, S = c->hc_mult, nh = c->linear_num_heads, dk = c->linear_head_dim;
    const int Hq = c->num_attention_heads;
    if (hc) {
        const int mix = (2 + S) * S;
        for (int site = 0; site < 2; site++) {
            const char *sn = site == 0 ? "attn" : "ffn";
            emit(e, MT_BF16, 0.f, 1.f / sqrtf((float)(S * H)), 2, mix, (int64_t)S * H, 0, "%shc_%s_fn", p, sn);
            emit(e, MT_BF16, 0.f, 0.5f, 1, mix, 0, 0, "%shc_%s_base", p, sn);
            emit(e, MT_BF16, 1.f, 0.2f, 1, 3, 0, 0, "%shc_%s_scale", p, sn);
        }
    }
    NORMW(e, H, "%sinput_layernorm.weight", p);
    NORMW(e, H, "%spost_attention_layernorm.weight", p);
    if (mixer == GLM_MIXER_KDA) {
        const int D = nh * dk, K = c->linear_conv_kernel_dim;
        LIN(e, D, H, "%sself_attn.q_proj.weight", p);
        LIN(e, D, H, "%sself_attn.k_proj.weight", p);
        LIN(e, D, H, "%sself_attn.v_proj.weight", p);
        emit(e, MT_F32, 0.f, 0.5f, 3, D, 1, K, "%sself_attn.q_conv1d.weight", p);
        emit(e, MT_F32, 0.f, 0.5f, 3, D, 1, K, "%sself_attn.k_conv1d.weight", p);
        emit(e, MT_F32, 0.f, 0.5f, 3, D, 1, K, "%sself_attn.v_conv1d.weight", p);
        LIN(e, dk, H, "%sself_attn.f_a_proj.weight", p);
        LIN(e, D, dk, "%sself_attn.f_b_proj.weight", p);
        emit(e, MT_F32, -2.f, 1.f, 1, D, 0, 0, "%sself_attn.dt_bias", p);
        emit(e, MT_F32, 0.f, 0.5f, 1, nh, 0, 0, "%sself_attn.A_log", p);
        LIN(e, nh, H, "%sself_attn.b_proj.weight", p);
        LIN(e, dk, H, "%sself_attn.g_a_proj.weight", p);
        LIN(e, D, dk, "%sself_attn.g_b_proj.weight", p);
        NORMW(e, dk, "%sself_attn.o_norm.weight", p);
        LIN(e, H, D, "%sself_attn.o_proj.weight", p);
    } else {
        const int ql = c->q_lora_rank, kvl = c->kv_lora_rank;
        LIN(e, ql, H, "%sself_attn.q_a_proj.weight", p);
        NORMW(e, ql, "%sself_attn.q_a_layernorm.weight", p);
        LIN(e, (int64_t)Hq * c->qk_nope_head_dim, ql, "%sself_attn.q_b_proj.weight", p);
        LIN(e, kvl + c->qk_rope_head_dim, H, "%sself_attn.kv_a_proj_with_mqa.weight", p);
        NORMW(e, kvl, "%sself_attn.kv_a_layernorm.weight", p);
        LIN(e, (int64_t)Hq * (c->qk_nope_head_dim + c->v_head_dim), kvl, "%sself_attn.kv_b_proj.weight", p);
        LIN(e, H, (int64_t)Hq * c->v_head_dim, "%sself_attn.o_proj.weight", p);
        if (indexer == GLM_INDEXER_FULL) {
            const int ih = c->index_n_heads, id = c->index_head_dim, kp = c->index_kpool;
            LIN(e, (int64_t)ih * id, ql, "%sself_attn.indexer.wq_b.weight", p);
            LIN(e, id, H, "%sself_attn.indexer.wk.weight", p);
            NORMW(e, id, "%sself_attn.indexer.k_norm.weight", p);
            emit(e, MT_BF16, 0.f, 0.1f, 1, id, 0, 0, "%sself_attn.indexer.k_norm.bias", p);
            LIN(e, ih, H, "%sself_attn.indexer.weights_proj.weight", p);
            emit(e, MT_BF16, 0.f, 0.5f, 2, kp, id, 0, "%sself_attn.indexer.index_kpool_compress_ape", p);
            LIN(e, id, H, "%sself_attn.indexer.index_kpool_compress_gate", p);
        }
    }
    char mp[128];
    if (mlp == GLM_MLP_DENSE) {
        snprintf(mp, sizeof mp, "%smlp.", p);
        emit_mlp(e, mp, H, c->intermediate_size);
    } else {
        const int E = c->n_routed_experts, I = c->moe_intermediate_size;
        LIN(e, E, H, "%smlp.gate.weight", p);
        emit(e, MT_F32, 0.f, 0.05f, 1, E, 0, 0, "%smlp.gate.e_score_correction_bias", p);
        for (int x = 0; x < E; x++) {
            snprintf(mp, sizeof mp, "%smlp.experts.%d.", p, x);
            emit_mlp(e, mp, H, I);
        }
        snprintf(mp, sizeof mp, "%smlp.shared_experts.", p);
        emit_mlp(e, mp, H, I * c->n_shared_experts);
    }
}

/* A PLE memory's tensors under prefix p (docs/MODEL.md, "PLE layer"). */
static void emit_ple(emitter *e, const glm_config *c, const char *p, int layer) {
    const int H = c->hidden_size, S = c->hc_mult, K = c->ple_conv_kernel;
    const int nt = (c->ple_max_ngram - 1) * c->ple_heads, E = nt * c->ple_head_dim;
    int64_t primes[GLM_PLE_MAX_TABLES], rows = 0;
    const int n = glm_ple_primes(c, layer, primes);
    for (int i = 0; i < n; i++) rows += primes[i];
    emit(e, MT_BF16, 0.f, 1.f, 2, rows, c->ple_head_dim, 0, "%sple.table.weight", p);
    LIN(e, (int64_t)S * H, E, "%sple.key_proj.weight", p);
    LIN(e, H, E, "%sple.value_proj.weight", p);
    emit(e, MT_BF16, 1.f, 0.1f, 2, S, H, 0, "%sple.key_norm.weight", p);
    emit(e, MT_BF16, 1.f, 0.1f, 2, S, H, 0, "%sple.query_norm.weight", p);
    emit(e, MT_BF16, 1.f, 0.1f, 2, S, H, 0, "%sple.conv_norm.weight", p);
    emit(e, MT_F32, 0.f, 0.3f, 3, (int64_t)S * H, 1, K, "%sple.conv.weight", p);
}

int glm_manifest_foreach(const glm_config *c, glm_manifest_fn fn, void *user) {
    emitter e = { fn, user, 0 };
    const int H = c->hidden_size;
    emit(&e, MT_BF16, 0.f, 1.f, 2, c->vocab_size, H, 0, "model.language_model.embed_tokens.weight");
    NORMW(&e, H, "model.language_model.norm.weight");
    if (!c->tie_word_embeddings) LIN(&e, c->vocab_size, H, "lm_head.weight");
    for (int l = 0; l < c->num_hidden_layers; l++) {
        char p[96];
        snprintf(p, sizeof p, "model.language_model.layers.%d.", l);
        emit_layer(&e, c, p, c->layer_types[l], c->mlp_layer_types[l], c->indexer_types[l], true);
        if (c->ple_layer[l]) emit_ple(&e, c, p, l);
    }
    return e.count;
}

int glm_manifest_mtp_foreach(const glm_config *c, glm_manifest_fn fn, void *user) {
    emitter e = { fn, user, 0 };
    const int H = c->hidden_size;
    char p[96];
    snprintf(p, sizeof p, "model.language_model.layers.%d.", c->num_hidden_layers);
    LIN(&e, H, 2 * H, "%seh_proj.weight", p);
    NORMW(&e, H, "%senorm.weight", p);
    NORMW(&e, H, "%shnorm.weight", p);
    NORMW(&e, H, "%sshared_head.norm.weight", p);
    emit_layer(&e, c, p, GLM_MIXER_DSA, GLM_MLP_SPARSE, GLM_INDEXER_FULL, false);
    return e.count;
}

static void add_bytes(const glm_tensor_spec *s, void *user) {
    uint64_t n = mt_dtype_size(s->dtype);
    for (int i = 0; i < s->ndim; i++) n *= (uint64_t)s->shape[i];
    *(uint64_t *)user += n;
}

uint64_t glm_manifest_bytes(const glm_config *cfg) {
    uint64_t total = 0;
    glm_manifest_foreach(cfg, add_bytes, &total);
    return total;
}
