/* worker/model/glm/glm_impl.h: internals of the GLM model runtime, shared by its files:
 * glm_weights.c (binding), glm_kda.c / glm_dsa.c (mixers), glm_mlp.c, glm_layer.c (the decoder
 * layer: hyper-connections around mixer and MLP), glm_model.c (embedding, head, sequences).
 * Shapes use the notation of docs/MODEL.md. All float * live in backend memory. */
#ifndef GLM_IMPL_H
#define GLM_IMPL_H

#include "kernels/backend.h"
#include "worker/loader/glm_config.h"
#include "worker/loader/safetensors.h"
#include "worker/model/glm/glm_model.h"
#include "worker/model/layer.h"
#include "worker/model/model.h"
#include "worker/runtime/block_table.h"
#include "worker/runtime/graph_runner.h"
#include "worker/runtime/id_pool.h"
#include "worker/dist/comm.h"

#define GLM_BUCKETS 10          /* decode graph buckets 1, 2, 4, ..., 512 */
#define GLM_PAGE 64             /* positions per DSA cache page (before rounding to kpool) */

typedef struct glm_hc_w {
    mt_weight fn;              /* [(2+S)S, S*H] */
    float *base;               /* [(2+S)S] */
    float *scale;              /* [3] */
} glm_hc_w;

typedef struct glm_kda_w {
    mt_weight q, k, v;         /* [D, H], D = nh*dk */
    float *conv[3];            /* q, k, v: [D, K] fp32 */
    mt_weight f_a, f_b;        /* [dk, H], [D, dk] */
    float *dt_bias;            /* [D] */
    float *A_log;              /* [nh] */
    mt_weight b;               /* [nh, H] */
    mt_weight g_a, g_b;        /* [dk, H], [D, dk] */
    float *o_norm;             /* [dk] */
    mt_weight o;               /* [H, D] */
} glm_kda_w;

typedef struct glm_dsa_w {
    mt_weight q_a;             /* [q_lora, H] */
    float *q_a_norm;           /* [q_lora] */
    mt_weight q_b;             /* [Hq*dn, q_lora] */
    mt_weight kv_a;            /* [kvl, H] */
    float *kv_a_norm;          /* [kvl] */
    mt_weight kv_b;            /* [Hq*(dn+dv), kvl] */
    mt_weight o;               /* [H, Hq*dv] */
    bool has_indexer;          /* indexer_types[l] == full */
    mt_weight iq;              /* wq_b [ih*id, q_lora] */
    mt_weight ik;              /* wk [id, H] */
    float *ik_norm_w, *ik_norm_b; /* [id] LayerNorm */
    mt_weight iw;              /* weights_proj [ih, H] */
    float *ape;                /* [kpool, id] */
    mt_weight igate;           /* index_kpool_compress_gate [id, H] */
} glm_dsa_w;

typedef struct glm_mlp_w {
    bool sparse;
    mt_expert dense;           /* dense MLP, intermediate_size */
    mt_weight router;          /* [E, H] */
    float *router_bias;        /* [E] */
    mt_expert *experts;        /* host array [E] */
    mt_expert shared;          /* intermediate I * n_shared */
} glm_mlp_w;

/* A PLE memory (glm_ple.c, docs/MODEL.md "PLE layer") on a decoder layer: E = ntab * head_dim
 * gathered columns a row, P = (K-1) * N rows of conv state. */
typedef struct glm_ple_w {
    bool on;                   /* the config's ple_layers names this layer */
    /* The decode forms that read the step's ids from backend memory (the rows form, one
     * sequence's graph form) hash and gather there (the backend's ple_gather_rows), so greedy
     * decode runs ahead; prefill, verifies and mixed steps hash on the host. */
    bool dev;
    mt_weight table;           /* [sum of the primes, head_dim] the n-gram rows, head after head;
                                * page-locked host memory where the backend reads it (weight_host) */
    void *host_mem;            /* a random model's table in host memory (the table's data), or NULL */
    mt_ple_hash *d_hash;       /* backend: the hash constants (dev) */
    mt_weight key;             /* [S*H, E] the keys of every stream at once */
    mt_weight value;           /* [H, E] */
    float *key_norm, *query_norm, *conv_norm; /* [S, H] */
    float *conv;               /* [S*H, K] fp32 */
    int ntab, E, P;            /* tables (orders x heads), gathered width, conv state rows */
    int64_t prime[GLM_PLE_MAX_TABLES]; /* table sizes, order by order, head by head */
    int64_t off[GLM_PLE_MAX_TABLES];   /* first row of each table in `table` */
    uint64_t mult[GLM_PLE_MAX_ORDER];  /* hash multiplier of the token k positions back */
    /* scratch for up to rows rows (backend memory unless said) */
    int rows;
    float *emb;                /* [rows, E] */
    float *keys;               /* [rows, S*H] */
    float *vals;               /* [rows, H] */
    float **tab;               /* [rows] each row's conv state (a rows table) */
    float **h_tab;             /* host [rows] mirror of tab */
    int32_t *idx;              /* host [ntab] one row's table rows */
    /* Write-on-accept (the model's verify rings, glm_model.mtp): a verify of k rows in ring j
     * leaves the conv state after each of its rows but the last in ring slot (j, 0 .. k-2), from
     * which glm_ple_keep commits the kept row's. NULL without the drafter or without conv state. */
    float *ring;               /* [n_rings, GLM_VERIFY_MAX - 1, P, S*H] */
    int n_rings;
} glm_ple_w;

/* A PLE memory's per-sequence state: the last tokens (for the n-grams ending at the next one) and
 * the conv state, plus the rows a prestage gathered for the next step. */
typedef struct glm_ple_state {
    int hist_len;              /* min(tokens seen, N-1); 0: nothing seen, conv not yet reset */
    uint32_t hist[GLM_PLE_MAX_ORDER - 1]; /* the last hist_len tokens, oldest first */
    float *conv;               /* backend [P, S*H]: uninitialised until the first step resets it */
    float **tab;               /* backend [GLM_VERIFY_MAX], each entry conv: ple_inject's table for
                                * up to GLM_VERIFY_MAX rows of this sequence alone (a graph of the
                                * sequence's step holds it, so nothing is uploaded during the step) */
    float *staged;             /* backend [GLM_VERIFY_MAX, E]: rows gathered by prestages */
    /* dev: the history on the device, u32 [MT_PLE_MAX_ORDER] (hist_len, then hist), which
     * ple_gather_rows reads and advances; hist above mirrors it. dev_ahead: a step advanced it
     * from ids the host had not seen (run-ahead): the mirror is stale until read back. */
    uint32_t *d_hist;
    uint32_t **htab;           /* backend [GLM_VERIFY_MAX], each entry d_hist (as tab) */
    bool dev_ahead;
    int32_t staged_tok[GLM_VERIFY_MAX];
    int n_staged;              /* staged rows the next forward consumes (0: hash the step's ids) */
    int n_prestaged;           /* rows the current step's prestages staged (what rearm restores) */
    /* The last step's rows, provisional until a verify keeps some (glm_ple_keep): the history
     * before the step and the step's tokens (the first GLM_VERIFY_MAX of them; v_n counts all). */
    int v_hist_len;
    uint32_t v_hist[GLM_PLE_MAX_ORDER - 1];
    uint32_t v_tok[GLM_VERIFY_MAX];
    int v_n;
} glm_ple_state;

/* One decoder layer: the generic mt_layer first, then its weights. */
typedef struct glm_layer {
    mt_layer base;
    const glm_config *cfg;     /* the rank's shard of the config (glm_model.lcfg) */
    mt_comm *comm;             /* the partial sums of mixer and MLP are all-reduced over it; NULL: one rank */
    mt_backend *be;            /* the model's; states are allocated outside any step */
    glm_hc_w hc[2];            /* attention site, MLP site */
    float *in_norm;            /* input_layernorm [H] */
    float *post_norm;          /* post_attention_layernorm [H] */
    glm_kda_w kda;
    glm_dsa_w dsa;
    glm_mlp_w mlp;
    glm_ple_w ple;
    /* Pools of per-sequence state, made by the model (glm_model_set_pools) and shared by
     * its sequences. DSA: page p holds `page` consecutive positions of whichever sequence's block
     * table maps one of its blocks to p: position t of a sequence is row t % page of page
     * bt[t / page]. page is a multiple of index_kpool, so a page also holds whole pools' keys. */
    int page;                  /* positions per page (GLM_PAGE rounded up to a multiple of kpool) */
    float *pg_latent;          /* [n_pages, page, kvl] MLA latent cache */
    float *pg_ki, *pg_gs;      /* [n_pages, page, id] indexer keys, pool gate scores (full layers) */
    float *pg_pk;              /* [n_pages, page / kpool, id] pool keys of complete pools */
    /* KDA: slot s is one sequence's conv and recurrent state */
    float *sl_conv;            /* [n_slots, 3, D, K-1] */
    float *sl_rec;             /* [n_slots, nh, dk, dk] */
} glm_layer;

/* Per-sequence state of one layer. */
typedef struct glm_layer_state {
    mt_layer_state base;
    int cap;                   /* max positions */
    /* KDA */
    float *conv[3];            /* [D, K-1] each */
    float *rec;                /* [nh, dk, dk] */
    /* DSA: the sequence's block table, shared by all its DSA layers (the model owns it and maps
     * blocks to pages before the positions are written): backend memory [cap / page + 1] */
    const int32_t *bt;
    int len;                   /* host-tracked indexer/latent cache length */
    int prestage_len;          /* len when the step was prestaged (restored by the rearm hook) */
    glm_ple_state *ple;        /* the layer's PLE memory's; NULL without one */
} glm_layer_state;

/* Activation scratch for up to rows rows; sized once per model for prefill_chunk. */
typedef struct glm_scratch {
    int rows;
    float *y, *h, *a;          /* [rows, H] */
    float *post, *comb;        /* [rows, S], [rows, S, S] */
    float *buf[10];            /* [rows, W], W = the widest intermediate (glm_scratch_width) */
    int32_t *idx;              /* [rows, top_k] */
    float *wts;                /* [rows, top_k] */
    int32_t *sel, *nsel;       /* [rows, max_sel], [rows]: the DSA selection of the last full layer */
    int sel_t0, sel_n;         /* which rows sel describes (sel_t0 = GLM_SEL_MULTI: one row per
                                * sequence of a batched decode); sel_n = 0 when none */
} glm_scratch;

/* The rows form of batched decode (row i = the next position of its own sequence): for each
 * layer and each kind of per-sequence buffer, a table of one pointer per row, in backend memory
 * (see kernels/backend.h "rows"). Table (layer l, kind k) starts at tab + (l * GLM_R_KINDS + k) * cap. */
enum {
    GLM_R_CONV0, GLM_R_CONV1, GLM_R_CONV2, /* KDA conv state of q, k, v */
    GLM_R_REC,                             /* KDA recurrent state */
    GLM_R_BT,                              /* DSA: the row's block table (const int32_t *) */
    GLM_R_PLE_CONV,                        /* PLE memory: conv state (NULL: the layer has none) */
    GLM_R_PLE_STAGED,                      /* PLE memory: the staged row the step reads */
    GLM_R_PLE_HIST,                        /* PLE memory: the device history (glm_ple_w.dev) */
    GLM_R_RING_CONV,                       /* KDA, a verify block's row: the ring slot's conv
                                            * states ([3, D, K-1]) that take its state after it */
    GLM_R_RING_REC,                        /* KDA, likewise: the ring slot's recurrent state */
    GLM_R_KINDS
};

/* A mixed step's rows block with verifies (mt_step.vblk): the block's leading parts, one decode
 * row of a sequence under way or a verify's k rows each, run in the rows form, every row at its
 * own position. A KDA layer must run a verify's rows one after another, so it takes the block in
 * row-index-major order: the parts sorted by rows (most first, stably), block j holds row j of
 * the n_at[j] parts that have one, and its first save_at[j] rows (their part has a row after row
 * j) then leave their state in their ring (GLM_R_RING_*). The KDA tables are in that order; the
 * positions and block tables in the step's row order. The mixer reads the block's rows of
 * scr->h through gather (into scr->y, that order), writes its output into scr->h, and scatter
 * moves it to the rows of scr->a. */
typedef struct glm_vblock {
    int kmax;                  /* rows of the longest part */
    int n_at[GLM_VERIFY_MAX], save_at[GLM_VERIFY_MAX];
    const float *const *gather;              /* [n] backend: scr->h rows, in the KDA's order */
    float *const *scatter_dst;               /* [n] backend: scr->a rows, in the KDA's order */
    const float *const *scatter_src;         /* [n] backend: scr->h rows 0 .. n - 1 */
} glm_vblock;

/* One segment of a mixed step (mt_layer_ops.forward_segments): n consecutive rows of one
 * sequence from position t0; scr is the model's scratch with the DSA selection moved to the
 * segment's rows, so a shared-indexer layer finds the selection its full layer made for them. */
typedef struct glm_segment {
    int t0, n;
    glm_scratch scr;
    const int *vring;          /* a verify's ring (mt_step.vring), NULL for a prompt chunk */
    int vring_id;              /* its index (mt_step.vring_id) */
} glm_segment;

struct mt_step {
    mt_backend *be;
    int t0;                    /* position of the first row (host) */
    /* The rows' token ids on the host, row i's at ids[i * ids_stride]; NULL when only the device
     * has them (a PLE memory then needs a prestage for every row). */
    const int32_t *ids;
    int ids_stride;
    /* The rows' ids in backend memory, row i's at d_ids[i * d_ids_stride] (the rows form's and
     * the graph form's token tables); NULL in the eager forms. */
    const int32_t *d_ids;
    int d_ids_stride;
    glm_scratch *scr;
    /* Graph form (decode): the position as the ops read it at run time, in backend memory; NULL
     * in the eager form, where ops take t0 as an argument. */
    const int32_t *d_pos;      /* [rows]: the step's consecutive positions, d_pos[i] = d_pos[0] + i */
    /* Rows form (batched decode): positions [n] and this layer's pointer tables (kind k at
     * rtab + k * rcap), backend memory; rt_cap bounds every position. NULL otherwise. */
    const int32_t *rpos;
    void *const *rtab;
    int rcap, rt_cap;
    /* Expert census (benchmarks): when set, each MoE layer counts the (row, slot) pairs that chose
     * each expert in census[layer * n_routed_experts + e] (host; reads the routing back, so eager
     * steps only). */
    int32_t *census;
    /* Mixed step: nseg segments of the rows, in row order; NULL otherwise. The first nrows
     * segments are one row each of a sequence under way: their mixer runs once in the rows form
     * (rpos, rtab as for batched decode), the others segment by segment. */
    glm_segment *seg;
    int nseg, nrows;
    /* With verifies in the rows block: its first nrows rows are the leading nbparts segments,
     * laid out as vblk says (NULL: nbparts == nrows, one row each). */
    int nbparts;
    const glm_vblock *vblk;
    /* A verify (n > 1 rows of one sequence, write-on-accept): the KDA slots that take the
     * recurrent and conv state after each row but the last, [n - 1] (m->mtp.ring); NULL else. */
    const int *vring;
    /* Mixed step of layered sites: with mlp_rows, the rows through the MLP site are n_mlp, not
     * the attention site's n (a layered group's rows run only one of the two). */
    bool mlp_rows;
    int n_mlp;
    /* Layered expert parts: with xparts > 0, rows [xr0, n_mlp) are a layered group's, through
     * parts [xq0, xq1) of the layer's xparts parts of its routed experts (the shared expert, or
     * a dense MLP whole, with part 0). xacc [n_mlp - xr0, H] holds their sum over the parts
     * before xq0 and xidx, xwts [n_mlp - xr0, top_k] their router's picks at part 0 (read when
     * xq0 > 0: a later part keeps the first part's picks, not a new routing that could differ
     * by a rounding), and take them when xq1 < xparts (those rows then stop before hc_post).
     * 0: every row through the whole MLP. */
    int xparts, xq0, xq1, xr0;
    float *xacc, *xwts;
    int32_t *xidx;
    int vring_id;              /* which ring vring is (m->mtp.ring + vring_id * (GLM_VERIFY_MAX - 1)):
                                * where state outside the slot pool keeps its rows (glm_ple_w.ring) */
};

struct glm_model {
    mt_model base;             /* the model interface (model.h); first member */
    glm_config cfg;            /* the checkpoint's config: the whole model */
    /* Tensor parallelism (glm_shard.c): this rank's shard. lcfg is cfg with the split dimensions
     * divided by tp_size (heads, intermediate sizes); the layers compute with it. Vocab rows
     * [v_lo, v_lo + v_n) of the embedding and lm_head live here. */
    glm_config lcfg;
    mt_comm *comm;             /* NULL: one rank */
    int tp_rank, tp_size;
    int v_lo, v_n;
    float *logits_local;       /* [rows, v_n] this rank's logits (tp_size > 1) */
    float *logits_gather;      /* [tp_size, rows, v_n] every rank's (tp_size > 1) */
    void **kept_host;          /* host copies the backend's weights view (sliced columns on the CPU) */
    int n_kept_host, cap_kept_host;
    size_t bytes_sharded_read, bytes_sharded_total; /* split tensors: read by this rank, in all */
    size_t bytes_replicated;   /* tensors every rank reads whole */
    uint64_t bytes_to_load;    /* the checkpoint bytes of every tensor to bind (progress reports) */
    glm_model_params params;
    mt_backend *be;
    st_archive *ar;
    mt_weight embed, lm_head;  /* [V, H] */
    float *norm;               /* [H] */
    glm_layer *layers;         /* [num_hidden_layers] */
    const mt_layer **layer_list; /* [num_hidden_layers] &layers[i].base, for the graph runner */
    rt_runner runner;          /* graphs and the layers' graph hooks */
    glm_scratch scr;
    float *X;                  /* highway [rows, S, H] */
    /* Layered prefill: the in-flight chunks' highway rows between calls [rows, S, H] (made at
     * the first layered call), and how many sequences have a chunk in flight. */
    float *lp_X;
    int lp_count;
    /* Layered expert parts (mt_model_params.layered_expert_parts): the in-flight rows' MLP sums
     * over the parts run so far, [rows, H], and the picks of their router at the first part,
     * [rows, top_k] indices and weights, at each part's place as in lp_X (lp_A, lp_idx, lp_wts);
     * the same rows in the step's order while a call runs (lp_acc, lp_idx_s, lp_wts_s: mt_step's
     * xacc, xidx, xwts); parts of one block (lp_parts) made at the first layered call. */
    void *lp_parts;
    float *lp_A, *lp_acc, *lp_wts, *lp_wts_s;
    int32_t *lp_idx, *lp_idx_s;
    float *z;                  /* [rows, H] */
    float *logits;             /* [rows, V] */
    /* graph-form decode of one sequence: [GLM_VERIFY_MAX * S] tokens of the highway rows, then
     * [GLM_VERIFY_MAX] positions, backend memory */
    int32_t *d_step;
    rt_slot shared;            /* the decode graph when no layer ties it to a sequence */
    /* Batched decode (glm_decode_multi), rows form: tables in backend memory, host mirrors. */
    int rcap;                  /* rows per pass (= scr.rows) */
    /* [rcap * (1 + S)]: for a pass of B rows, the B positions, then the B * S tokens of the
     * highway rows (glm_model.c rows_upload, rows_body), so one upload carries both; a bucket's graph
     * holds the addresses of its own B */
    int32_t *d_rrow;
    void **d_rtab;             /* [L * GLM_R_KINDS * rcap] */
    void **d_vtab;             /* [3 * rcap] backend: a verify block's gather and scatter tables */
    int32_t *h_rrow;
    void **h_rtab;
    int rt_cap;                /* largest capacity of any sequence made so far (graph sizing) */
    /* Greedy steps run ahead (glm_decode_greedy): the last one's tokens sit in d_rrow for its B
     * rows (argmax_dev wrote them there) and ride ticket `ticket` back to the host. */
    struct glm_ahead {
        bool valid;            /* d_rrow holds the last greedy step's outputs as inputs */
        int n, B;              /* its sequences and the rows its pass used */
        int64_t ticket;
        glm_seq **seqs;        /* [rcap] its sequences, in order */
    } ahead;
    int32_t *h_tok;            /* [rcap * S] host: a ticket's token table */
    /* Decode graphs per bucket of rows (1, 2, 4, ... rcap), sized by rt_cap; pad rows of a bucket
     * run on pad_seq (one slot and one page, made with the pools; pad rows all write its position
     * 0, and their outputs are dropped). */
    rt_slot bucket[GLM_BUCKETS];
    /* A mixed step that is only a rows block with verifies (glm_forward_mixed), by its verifies'
     * rows k, the bucket of its verifies and 1 + the bucket of its decode rows (0: none); pads on
     * pad_seq fill both buckets, a pad verify's rows at its positions 0 .. k - 1 (one page) */
    rt_slot vbucket[GLM_VERIFY_MAX + 1][GLM_BUCKETS][GLM_BUCKETS + 1];
    glm_seq *pad_seq;
    /* Pools: page ids for the DSA caches and slot ids for the KDA state (the memory behind them is
     * each layer's pg_* and sl_*), shared by every sequence; a page may be mapped by several
     * sequences (a shared prompt prefix). Empty (n == 0) until made. */
    rt_id_pool pages, slots;
    int n_seqs;                /* live sequences (the pools cannot be remade under them) */
    int32_t *census;           /* [L * E] host, NULL unless glm_model_set_expert_census */
    /* The MTP block (glm_mtp.c), when the checkpoint has one: its decoder layer is layers[L]
     * (a DSA mixer with its own indexer and an MoE, no hyper-connections; its pages live beside
     * the target's), eh_proj split into the embedding half and the hidden half. With
     * params.mtp every sequence's drafter follows its target (glm_mtp_follow), so it can draft
     * at any step. */
    struct glm_mtp {
        bool has;              /* the block is loaded */
        bool on;               /* has && params.mtp: sequences carry drafter state */
        mt_weight eh_e, eh_h;  /* [H, H] each: eh_proj's columns [0, H) and [H, 2H) */
        float *enorm, *hnorm, *norm; /* [H]; norm = shared_head.norm */
        float *hin;            /* [rows + 1, H] the drafter's hidden inputs of one pass */
        float *e, *u, *t;      /* [rows, H] embeddings, residual, temporary */
        int32_t *d_rpos;       /* [rows] backend: a batched draft's positions (rows form) */
        void **d_rtab;         /* [GLM_R_KINDS, rows] backend: its tables (only GLM_R_BT is read) */
        int32_t *d_tok;        /* [rows] backend: a batched draft's tokens */
        rt_slot bucket[GLM_BUCKETS]; /* batched drafts' graphs per bucket of rows, as the decode's */
        void **d_ptr;          /* [5, rows] backend: glm_mtp_follow_parts' row tables (the
                                * drafter's inputs [rows]; its copies' destinations and sources
                                * [2 * rows] each) */
        /* Write-on-accept: a verify of k rows in ring j leaves the recurrent state after each of
         * its rows but the last in ring[j][0 .. k-2] (KDA slots of the pool, one per row), and
         * the drafter's pending hidden row after each row in ring_h[j] [k, H]; glm_seq_keep
         * commits the kept row's from there. Ring j holds ring_owner[j]'s last verify; one
         * forward verifies at most n_rings sequences (params.verify_seqs), ring j for its j-th. */
        int n_rings;
        int *ring;             /* host [n_rings, GLM_VERIFY_MAX - 1] slot ids */
        float *ring_h;         /* backend [n_rings, GLM_VERIFY_MAX, H] */
        const struct glm_seq **ring_owner; /* host [n_rings] */
        /* glm_seq_keep_rows' copy tables: per kind (layer l's conv states at 2l, its recurrent
         * state at 2l + 1, the pending hidden row at 2L) n destinations, then n sources, for a
         * call of n <= n_rings sequences; backend memory and its host staging */
        void **d_keep, **h_keep;
        float *capture;        /* glm_model_capture_drafter: host [capture_rows, vocab], or NULL */
        int capture_rows;
    } mtp;
    int n_state_layers;        /* layers with per-sequence state: L, plus 1 with the MTP block */
};

struct glm_seq {
    mt_seq base;               /* the model interface (model.h); first member */
    glm_model *m;
    int cap, len;
    int slot;                  /* KDA state slot */
    rt_block_table bt;         /* its pages: [cap / page + 1] blocks */
    mt_layer_state **states;   /* [num_hidden_layers] */
    rt_slot graph;             /* this sequence's decode graph (runner.plan.per_sequence) */
    rt_slot verify[GLM_VERIFY_MAX + 1]; /* its verify graphs, by rows (2 .. GLM_VERIFY_MAX) */
    /* Drafter state (m->mtp.on): the drafter's rows are positions 0 .. its layer state's len - 1;
     * row t takes the target's hidden state at t and the embedding of token t + 1, so after a
     * target step it holds len - 1 rows and hp is the target's last row, waiting for the next
     * token. draft() adds that row, then rows on its own residual u (speculative: n_spec of
     * them, dropped by the next target step). */
    float *hp, *u;             /* [H] backend: pending hidden row; the last draft's residual */
    int n_spec;
    /* The last multi-row decode (a verify), for glm_seq_keep: its first position and rows (the
     * states after each row wait in m->mtp.ring). */
    int v_pos, v_n;
    int v_ring;                /* the ring of its last verify */
    /* A layered chunk in flight (glm_forward_mixed): the layers it has run (0: none in flight),
     * its rows, and where they wait in m->lp_X. */
    int lp_done, lp_n, lp_off;
};

#define GLM_SEL_MULTI (-1)

/* Table of kind k (GLM_R_*) of the step's layer, rows form. */
static inline float *const *glm_rtab(const mt_step *s, int k) {
    return (float *const *)(s->rtab + (size_t)k * (size_t)s->rcap);
}

/* The groups of projections that take the same input, in the order of their glm_matmul_multi
 * call (the two-part classes last, MT_CUDA_EXACT_CLASSES): initializers of an array of weight
 * pointers, for the calls and for glm_weights_pack, which packs each group in this order. A DSA
 * layer takes the first GLM_DSA_IN_COUNT of its input group and GLM_DSA_Q_COUNT of its query
 * group (without an indexer, 2 and 1). */
#define GLM_KDA_GROUP(w) { &(w)->q, &(w)->k, &(w)->v, &(w)->f_a, &(w)->b, &(w)->g_a }
#define GLM_DSA_IN_GROUP(w) { &(w)->q_a, &(w)->kv_a, &(w)->ik, &(w)->igate, &(w)->iw }
#define GLM_DSA_Q_GROUP(w) { &(w)->q_b, &(w)->iq }
#define GLM_DSA_IN_COUNT(w) ((w)->has_indexer ? 5 : 2)
#define GLM_DSA_Q_COUNT(w) ((w)->has_indexer ? 2 : 1)
#define GLM_MLP_GROUP(e) { &(e)->gate, &(e)->up }

/* y[j] = x . w[j]^T for j < count (<= 6), then sigmoid over the y[j] of bit j of sigmoid_mask;
 * one backend launch where it offers matmul_multi. */
static inline void glm_matmul_multi(mt_backend *be, float *const *y, const float *x, const mt_weight *const *w,
                                    int count, int n, unsigned sigmoid_mask) {
    if (be->ops->matmul_multi) {
        be->ops->matmul_multi(be, y, x, w, count, n, sigmoid_mask);
        return;
    }
    for (int j = 0; j < count; j++) {
        be->ops->matmul(be, y[j], x, w[j], n);
        if (sigmoid_mask >> j & 1u) be->ops->sigmoid(be, y[j], (int64_t)n * w[j]->rows);
    }
}

/* The bucket of a batched step of n rows: the graph of 1 << glm_bucket_of(n) rows serves it. */
static inline int glm_bucket_of(int n) {
    int b = 0;
    while ((1 << b) < n) b++;
    return b;
}
/* The bucket graphs' pad sequence, made when missing; false when the pools have no room for it. */
bool glm_pad_ensure(glm_model *m);

/* glm_mtp.c: the MTP block (docs/MODEL.md, "MTP block"). */
/* The drafter rows of s that stand (its layer state's length less the speculative rows). */
static inline int glm_mtp_committed(const glm_model *m, const glm_seq *s) {
    return ((const glm_layer_state *)s->states[m->cfg.num_hidden_layers])->len - s->n_spec;
}
/* After a target pass over n consecutive rows of s at positions len - n .. len - 1 (s->len
 * already advanced), whose highway rows are X[n, S, H] and tokens tokens[n]: the drafter takes
 * the rows whose next token is now known (the pending row and rows 0 .. n - 2) and keeps the
 * last row's hidden state pending. Drops speculative drafter rows first. */
mt_status glm_mtp_follow(glm_model *m, glm_seq *s, const float *X, const int32_t *tokens, int n);
/* One part of glm_mtp_follow_parts: n rows of s, their tokens, and for a verify (NULL otherwise)
 * where its rows' hidden states go for glm_seq_keep ([n, H] backend, the ring's ring_h). */
typedef struct glm_follow_part {
    glm_seq *s;
    const int32_t *tokens;
    int n;
    float *ring_h;
} glm_follow_part;
/* glm_mtp_follow for the np parts of one target pass (distinct sequences, rows in part order in
 * X [sum n, S, H]), in one pass of the block over every part's drafter rows (the rows form), the
 * parts' pending rows and verify rings copied out in one op each. On a backend without the row
 * copies, with the drafter's capture on, or for one part: glm_mtp_follow per part. */
mt_status glm_mtp_follow_parts(glm_model *m, const glm_follow_part *p, int np, const float *X);
/* The drafter's next row for s with token: logits (host) [vocab]. */
mt_status glm_mtp_draft(glm_model *m, glm_seq *s, int32_t token, float *logits, mt_error *err);
/* Whether batched drafts replay graphs: decode graphs on a backend that captures, one rank, the
 * drafter's capture off. */
bool glm_mtp_draft_graphs(const glm_model *m);

/* glm_ple.c: PLE memories (docs/MODEL.md "PLE layer"). */
/* Hash constants and scratch of l's memory for passes of up to rows rows; MT_ERR_UNSUPPORTED on a
 * backend without ple_inject. Weights are bound first. */
mt_status glm_ple_init(glm_layer *l, int rows, int n_rings, bool dev, mt_error *err);
void glm_ple_release(glm_layer *l);            /* weights and scratch; safe on a partial init */
mt_status glm_ple_state_alloc(const glm_layer *l, glm_layer_state *st, mt_error *err);
void glm_ple_state_free(const glm_layer *l, glm_layer_state *st);
size_t glm_ple_state_bytes(const glm_layer *l);
/* Injects the memory into the highway rows X[n, S, H], laid out as for the layer's forward
 * (nst == 1: n positions of one sequence; nst == n: one row a sequence; step->seg: segments).
 * A state with staged rows consumes them (its rows must be exactly those), others hash the step's
 * ids and advance their history. */
mt_status glm_ple_forward(const glm_layer *l, glm_layer_state **sts, int nst, mt_step *step, float *X, int n);
mt_status glm_ple_prestage(const glm_layer *l, glm_layer_state *st, int32_t token);
void glm_ple_rearm(glm_layer_state *st);
void glm_ple_sync(glm_layer_state *st);       /* a step ran (eagerly or replayed): nothing staged */
/* Keeps the first keep rows of the state's last step, a verify in ring `ring`: the history as
 * after those rows, the conv state from the ring. MT_ERR_STATE (nothing changed) when the last
 * step was not a verify of at least keep rows. */
mt_status glm_ple_keep(const glm_layer *l, glm_layer_state *st, int keep, int ring);
size_t glm_ple_aux_bytes(const glm_layer *l, const void *bytes, size_t len); /* 0: not a PLE blob */
mt_status glm_ple_snapshot(const glm_layer *l, const glm_layer_state *st, void **bytes, size_t *len, mt_error *err);
/* Checked first with glm_ple_aux_bytes == len; cannot fail after. Clears the staged rows. */
void glm_ple_restore(const glm_layer *l, glm_layer_state *st, const void *bytes, size_t len);

/* glm_entry.c: the model interface (worker/model/model.h) over this model. */
extern const mt_model_ops glm_model_iface;

/* glm_shard.c: tensor parallelism. */
/* lcfg and the vocab slice from cfg and the communicator; MT_ERR_INVALID names the dimension that
 * the group's size does not divide. */
mt_status glm_shard_plan(glm_model *m, mt_error *err);
/* All-reduce of buf[count] (backend memory) over the group; nothing without a communicator. */
mt_status glm_all_reduce(mt_comm *comm, float *buf, size_t count);
/* The vocab-parallel head's logits [rows, v_n] of every rank into m->logits [rows, vocab]. */
mt_status glm_gather_logits(glm_model *m, int rows);
/* lm_head over normed rows z [rows, H] into m->logits (gathered over the ranks), downloaded into
 * logits_host when not NULL. */
mt_status glm_logits_rows(glm_model *m, const float *z, int rows, float *logits_host);

/* glm_weights.c */
mt_status glm_weights_bind(glm_model *m, mt_error *err);
mt_status glm_weights_random(glm_model *m, uint64_t seed, mt_error *err);
/* Packs each group of projections that share an input (backend weights_pack), after the bind. */
void glm_weights_pack(glm_model *m);
void glm_weights_release(glm_model *m);

/* glm_layer.c: fills l->base (ops, caps) for layer index i. */
void glm_layer_init(glm_layer *l, const glm_config *cfg, mt_backend *be, int i);
int glm_scratch_width(const glm_config *cfg);
/* glm_state.c: the pooled per-sequence state memory of the layers (pages, slots). */
bool glm_layer_pools_alloc(glm_layer *l, int n_pages, int n_slots); /* false: out of memory */
void glm_layer_pools_free(glm_layer *l);
void glm_layer_bind_state(const glm_layer *l, glm_layer_state *st, int slot, const int32_t *bt);
void glm_layers_copy_page(const glm_layer *ls, int n, int32_t from, int32_t to);
void glm_layers_copy_slot(const glm_layer *ls, int n, int from, int to);
/* A KDA layer's state of one sequence into slot `slot` of its pool: the three conv states
 * (conv) and/or the recurrent state (rec), in the backend's order of work. */
void glm_layer_save_slot(const glm_layer *l, const glm_layer_state *st, int slot, bool conv, bool rec);
void glm_layers_zero_slot(const glm_layer *ls, int n, int slot);
/* Where slot `slot` of a KDA layer keeps its state: the three conv states, consecutive
 * ([3, D, K-1]), and the recurrent state, and their floats. */
void glm_layer_slot_at(const glm_layer *l, int slot, float **conv, float **rec, size_t *conv_floats,
                       size_t *rec_floats);
size_t glm_layer_state_bytes(const glm_layer *l, int max_tokens);
size_t glm_layer_slot_bytes(const glm_layer *l);  /* KDA layers; 0 for DSA */
size_t glm_layer_page_bytes(const glm_layer *l);  /* DSA layers; 0 for KDA */
int glm_max_sel(const glm_config *cfg);

/* Mixers and MLP: h[n, H] -> out[n, H]. The mixers take nst == 1 state for n consecutive
 * positions of one sequence, or nst == n states, row i being the next position of sts[i]. */
mt_status glm_kda_forward(const glm_layer *l, glm_layer_state **sts, int nst, mt_step *step,
                          const float *h, float *out, int n);
mt_status glm_dsa_forward(const glm_layer *l, glm_layer_state **sts, int nst, mt_step *step,
                          const float *h, float *out, int n);
/* A mixed step's prompt chunks together: rows [0, n) of h are the segments seg[0, ns) in order,
 * segment i consecutive positions of sts[i] from seg[i].t0 (no verify among them; the eager
 * form). The projections, the row-wise norms and gates and o_proj run over all n rows at once, so
 * the chunks read the weights once between them; the conv, the delta rule, the cache writes,
 * the selection and the attention segment by segment, each on its own sequence's state (a DSA
 * segment's selection in seg[i].scr). */
mt_status glm_kda_forward_chunks(const glm_layer *l, glm_layer_state **sts, const glm_segment *seg, int ns,
                                 mt_step *step, const float *h, float *out, int n);
mt_status glm_dsa_forward_chunks(const glm_layer *l, glm_layer_state **sts, glm_segment *seg, int ns,
                                 mt_step *step, const float *h, float *out, int n);
void glm_mlp_forward(const glm_layer *l, mt_step *step, const float *h, float *out, int n);
/* n rows through the MLP site, rows [xr0, n) a layered group's through parts [xq0, xq1) of it
 * (mt_step.xparts), from and to step->xacc as those fields say. */
void glm_mlp_forward_parts(const glm_layer *l, mt_step *step, const float *h, float *out, int n);

#endif /* GLM_IMPL_H */
