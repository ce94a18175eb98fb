/* kernels/backend.h: the backend interface, a table of operations (one slot per op) that the model
 * runtime calls for every piece of arithmetic. One implementation per device: kernels/cpu/ (the
 * reference, fp32 math on bf16/fp16/fp32 weights) and kernels/cuda/ (later).
 *
 * Memory: every float * / int32_t * argument below lives in the backend's memory (host for the CPU
 * backend, device for CUDA), allocated with mt_backend_alloc, except where a comment says "host".
 * Activations are fp32 at this interface; a backend may use narrower types inside a fused op.
 * Weights are mt_weight views prepared once at load by mt_backend_weight.
 *
 * Ownership: the backend owns the memory it returns until the matching free. Thread-safety: one
 * backend object is used by one thread at a time (the engine thread); ops may use internal
 * threads. Ops do not fail on valid shapes: shape checks are MT_ASSERTs (bugs, not input).
 */
#ifndef MT_BACKEND_H
#define MT_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/mt.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct mt_backend mt_backend;

/* download_begin / download_end (below): the most bytes one ticket carries, and how many
 * tickets stay readable at once. */
enum { MT_TICKET_BYTES = 16384, MT_TICKETS = 4 };
/* Whether ticket t can still be read when the next begin would get ticket `next`. */
static inline bool mt_ticket_readable(int64_t t, int64_t next) { return t >= 0 && t < next && t >= next - MT_TICKETS; }

/* A captured sequence of ops (a CUDA graph); opaque, owned by the backend that made it. */
typedef struct mt_graph mt_graph;

/* A 2-D weight matrix [rows, cols] in backend memory, row-major, dtype F32, F16 or BF16.
 * A 1-D vector is rows = 1. A backend that offers weight_fp8 (below) also makes block-scaled FP8
 * weights, dtype F8E4M3, whose layout is its own (the CUDA backend's: cuda_backend.h). */
/* What a weight's product feeds, for per-projection precision choices (the model sets it after
 * the backend made the weight; backends start it at MT_WCLS_OTHER). */
typedef enum mt_wcls {
    MT_WCLS_OTHER, MT_WCLS_ROUTER, MT_WCLS_INDEXER, MT_WCLS_HC, MT_WCLS_KDA_GATE, MT_WCLS_ATTN,
    MT_WCLS_MLP, MT_WCLS_HEAD, MT_WCLS_N
} mt_wcls;

typedef struct mt_weight {
    const void *data;
    mt_dtype dtype;
    int64_t rows, cols;
    bool owned;           /* the backend allocated data (weight_free releases it) */
    uint8_t cls;          /* mt_wcls */
    /* Embedding tables (embed, embed_dev): the rows are ids [row0, row0 + rows) of a larger
     * vocabulary; other ids read as zeros (a vocab-parallel shard). 0 for every other weight. */
    int64_t row0;
    /* F8E4M3 only (weight_fp8): the block scales, in backend memory owned with data; NULL for
     * every other dtype. W[i][j] = e4m3(data at [i, j]) * scale of block (i / 128, j / 128). */
    const float *scale;
    /* weight_host: data is host memory the backend locked (host), from page `locked` (weight_free
     * unlocks from there; NULL when every page of it was locked for a neighbour already). */
    bool host;
    const void *locked;
} mt_weight;

/* One routed or shared expert: SwiGLU MLP with gate/up [I, H] and down [H, I]. */
typedef struct mt_expert {
    mt_weight gate, up, down;
} mt_expert;

/* MoE router parameters (docs/MODEL.md "MLP and MoE"). */
typedef struct mt_router_params {
    int n_experts;        /* E */
    int n_group;          /* E % n_group == 0, >= 2 experts per group */
    int topk_group;
    int top_k;            /* num_experts_per_tok */
    bool norm_topk_prob;
    float scaling;        /* routed_scaling_factor */
} mt_router_params;

/* KDA decay gate parameters. */
/* The three conv steps of a KDA layer in the rows form (kda_conv3_rows): q, k, v. */
typedef struct mt_kda_conv3 {
    float *out[3];                 /* [n, C] each */
    const float *x[3];             /* [n, C] each, the projections */
    float *const *states[3];       /* [n] -> [C, K-1] each */
    const float *w[3];             /* [C, K] each */
} mt_kda_conv3;

typedef struct mt_kda_gate_params {
    int nh, dk;
    bool has_lower_bound; /* g = lb * sigmoid(exp(A_log) * f), else -exp(A_log) * softplus(f) */
    float lower_bound;
    /* kda_gates only: the op issued just before it neither writes what kda_gates reads nor touches
     * what it writes, so a backend may run the two at once (the ops after still see both done) */
    bool beside_previous;
} mt_kda_gate_params;

/* Hyper-connection parameters for one site. */
typedef struct mt_hc_params {
    int S, H;             /* streams, hidden */
    float rms_eps;        /* rms_norm_eps, for the unweighted norm of the flattened streams */
    float hc_eps;
    int sinkhorn_iters;
} mt_hc_params;

/* DSA indexer selection parameters. */
typedef struct mt_dsa_select_params {
    int ih, id;           /* indexer heads, head dim */
    int kpool;
    int max_pools;        /* index_topk / kpool */
    bool tail;            /* index_kpool_always_select_tail */
    int max_sel;          /* row stride of the selection: max_pools * kpool + (tail ? kpool - 1 : 0) */
    /* Graph form: when t0_dev is set, the first query's position is read from it (backend
     * memory) at run time and the t0 argument is ignored; t_cap bounds every position (sizing). */
    const int32_t *t0_dev;
    int t_cap;
} mt_dsa_select_params;

/* A paged cache: a pool of pages shared by many sequences, each page holding `page`
 * consecutive positions of whichever sequence maps one of its blocks to it. A sequence's block
 * table bt (int32, backend memory) maps its block b, positions [b*page, (b+1)*page), to page bt[b];
 * position t of the sequence is then row t % page of page bt[t / page]:
 *     base + ((int64_t)bt[t / page] * page + t % page) * row
 * The DSA pool keys are a paged cache of their own over the same block table, addressed by pool
 * index: with ppp = page / kpool pools a page (page a multiple of kpool), pool p is row p % ppp of
 * page bt[p / ppp], i.e. { pg_pk, ppp, id }. Ops read an entry of bt only for a block that holds a
 * position (or pool) they touch, so bt needs entries for blocks [0, (last position) / page]. */
typedef struct mt_paged {
    float *base;          /* [n_pages, page, row] backend memory */
    int page;             /* positions per page */
    int64_t row;          /* floats per position */
} mt_paged;

/* Position t of a paged cache through its block table bt: row t % page of page bt[t / page]. On
 * the host (the CPU backend, tests, host code over a downloaded table) and, compiled by nvcc, in
 * CUDA kernels over a device table. */
#ifdef __CUDACC__
#define MT_HOST_DEVICE __host__ __device__
#else
#define MT_HOST_DEVICE
#endif
static inline MT_HOST_DEVICE float *mt_paged_at(mt_paged c, const int32_t *bt, int64_t t) {
    return c.base + ((int64_t)bt[t / c.page] * c.page + t % c.page) * c.row;
}

/* One row of mt_backend_ops.moe_keep_experts (top_k picks x, weights w), on the host and in the
 * CUDA kernel alike. */
static inline MT_HOST_DEVICE void mt_keep_experts_row(int32_t *x, float *w, int top_k, int lo, int hi) {
    int32_t kept = lo;
    for (int j = top_k - 1; j >= 0; j--)
        if (x[j] >= lo && x[j] < hi) kept = x[j];
    for (int j = 0; j < top_k; j++)
        if (x[j] < lo || x[j] >= hi) {
            x[j] = kept;
            w[j] = 0.f;
        }
}

/* Sparse MLA parameters. */
typedef struct mt_mla_params {
    int Hq, dn, dv, kvl;  /* heads, qk_nope_head_dim, v_head_dim, kv_lora_rank */
    float scale;          /* dn^-0.5 */
    const int32_t *t0_dev; /* graph form, as in mt_dsa_select_params */
    int t_cap;
} mt_mla_params;

/* The injection of a PLE memory (docs/MODEL.md "PLE layer", ple_inject). */
typedef struct mt_ple_params {
    int S, H;             /* highway streams, hidden size */
    int K, dil;           /* taps of the causal depthwise conv over S*H channels, and their spacing */
    float eps;            /* the RMSNorms' */
} mt_ple_params;

/* The n-gram hash of a PLE memory (docs/MODEL.md "PLE layer", ple_gather_rows), in backend
 * memory. Orders 2..N, heads tables each: ntab = (N - 1) * heads tables, order by order. */
#define MT_PLE_MAX_ORDER 8
#define MT_PLE_MAX_TABLES ((MT_PLE_MAX_ORDER - 1) * 64)
typedef struct mt_ple_hash {
    int N, heads;                     /* largest order; tables per order */
    uint32_t pad;                     /* the id read before a sequence's start */
    uint64_t mult[MT_PLE_MAX_ORDER];  /* multiplier of the id k positions back */
    int64_t prime[MT_PLE_MAX_TABLES]; /* each table's rows */
    int64_t off[MT_PLE_MAX_TABLES];   /* each table's first row in the table weight */
} mt_ple_hash;

typedef struct mt_backend_ops {
    const char *name;
    /* Ops return once their work is queued, not done (a device's stream): the host can prepare
     * the next work while it runs. false: each op has done its work when it returns. */
    bool queued;

    /* ---- lifetime ---- */
    void (*destroy)(mt_backend *be);                          /* frees be itself */

    /* ---- memory ---- */
    void *(*alloc)(mt_backend *be, size_t bytes);             /* zeroed; NULL on OOM */
    void (*free)(mt_backend *be, void *p);                    /* NULL ok */
    void (*upload)(mt_backend *be, void *dst, const void *host_src, size_t bytes);
    /* Optional (NULL: use upload): upload in the backend's order of work. Ops issued later see
     * the data and host_src may be reused on return, but the call need not wait for the copy
     * itself (a decode step's small tables then cost no round trip of their own). */
    void (*upload_async)(mt_backend *be, void *dst, const void *host_src, size_t bytes);
    void (*download)(mt_backend *be, void *host_dst, const void *src, size_t bytes);
    /* Optional (both or neither; NULL: use download): reading a small result back without
     * draining the backend's queue. download_begin queues a copy of src[bytes] (at most
     * MT_TICKET_BYTES) behind the work queued so far and returns its ticket; download_end waits
     * for that copy only (work queued after the begin goes on running) and writes the bytes to
     * host_dst. A ticket stays readable, any number of times, until MT_TICKETS more begins;
     * download_end of an older one is MT_ERR_STATE. */
    int64_t (*download_begin)(mt_backend *be, const void *src, size_t bytes);
    mt_status (*download_end)(mt_backend *be, int64_t ticket, void *host_dst, size_t bytes);
    void (*copy)(mt_backend *be, void *dst, const void *src, size_t bytes);
    void (*zero)(mt_backend *be, void *p, size_t bytes);
    /* Makes a weight usable by this backend from host data (the CPU backend keeps a view of the
     * mapping; a device backend copies). Returns MT_ERR_NOMEM on failure. */
    mt_status (*weight)(mt_backend *be, const void *host, mt_dtype dt, int64_t rows, int64_t cols,
                        mt_weight *out);
    /* A weight of random values mean + std * N(0,1), element i drawn by mt_rand_normal(key, i)
     * (common/mt_rand.h), made in the backend's memory without a host copy: benchmarks of the
     * real model's size need no checkpoint file. MT_ERR_NOMEM on failure. */
    mt_status (*weight_random)(mt_backend *be, mt_dtype dt, int64_t rows, int64_t cols, uint64_t key,
                               float mean, float std, mt_weight *out);
    void (*weight_free)(mt_backend *be, mt_weight *w);
    /* Optional (NULL: not offered). Moves 2 <= count <= 6 weights that one matmul_multi call takes (the
     * same dtype and columns, each made by weight or weight_random) into one allocation, w[0]'s
     * rows first, then w[1]'s and so on, so that a call over them in this order can run them as
     * one product. The values are unchanged; w[0] owns the allocation (its weight_free releases it,
     * the others' release nothing). MT_ERR_UNSUPPORTED for weights this backend does not pack,
     * MT_ERR_NOMEM without room for the copy; either way every weight is left as it was. Graphs
     * recorded before over these weights are stale afterwards. */
    mt_status (*weights_pack)(mt_backend *be, mt_weight *const *w, int count);
    /* Optional (NULL: weights live in backend memory). A weight over host memory that the caller
     * keeps mapped until weight_free (a file's read-only mapping): the backend locks those pages
     * in place and its ops read them over the bus through a device address, so a table larger
     * than the device needs no copy, and processes that map the same file share one copy in the
     * host's page cache. Offered to embed and ple_gather_rows. MT_ERR_IO when the memory cannot
     * be locked. */
    mt_status (*weight_host)(mt_backend *be, const void *host, mt_dtype dt, int64_t rows, int64_t cols,
                             mt_weight *out);
    /* Optional (NULL: the backend multiplies only float weights; loaders dequantise FP8). A weight
     * of dtype F8E4M3 kept in FP8 with its block scales, from host data: q [rows, cols] e4m3
     * row-major and scale_inv [ceil(rows / 128), ceil(cols / 128)] fp32 row-major, one scale per
     * 128 x 128 block (the last row and column of blocks may be partial). Such a weight goes only
     * to matmul, matmul_multi, kda_gates and, as the gate, up and down of every expert of a call
     * (all F8E4M3 together), to moe_experts and moe_experts_shared; the other ops that take
     * weights (embed, hc_pre, mla_sparse's kv_b) never see one. MT_ERR_NOMEM on failure, *out
     * unchanged. */
    mt_status (*weight_fp8)(mt_backend *be, const uint8_t *q, const float *scale_inv, int64_t rows, int64_t cols,
                            mt_weight *out);
    /* Optional, with weight_fp8 (NULL: not offered): the F8E4M3 weight of the float weight src
     * (F32, F16 or BF16, in backend memory, unchanged), quantised in backend memory per 128 x 128
     * block: scale_inv = the block's amax / 448 (1 for a block of zeros), each value / scale_inv
     * rounded to nearest even e4m3. For benchmarks of FP8 models from random weights (no host
     * copy). MT_ERR_NOMEM on failure, *out unchanged. */
    mt_status (*weight_fp8_from)(mt_backend *be, const mt_weight *src, mt_weight *out);
    void (*sync)(mt_backend *be);
    /* Memory the backend can still allocate, and its total (bytes). For the start-up memory plan. */
    mt_status (*mem_info)(mt_backend *be, size_t *free_bytes, size_t *total_bytes);

    /* ---- graphs (NULL: the backend cannot capture; the model decodes eagerly) ---- */
    /* Starts recording the ops that follow instead of running them. */
    mt_status (*graph_begin)(mt_backend *be);
    /* Ends the recording; on failure (an op that cannot be captured ran) *out is NULL and the
     * backend is usable again. */
    mt_status (*graph_end)(mt_backend *be, mt_graph **out);
    mt_status (*graph_launch)(mt_backend *be, mt_graph *g);
    void (*graph_free)(mt_backend *be, mt_graph *g);  /* NULL ok */
    /* A counter that changes whenever memory a recorded graph may point at (the backend's own
     * scratch) was replaced: a graph recorded under another value must not be replayed. NULL:
     * never changes. */
    uint64_t (*graph_epoch)(mt_backend *be);

    /* ---- positions in backend memory (the graph form of decode) ---- */
    /* out[n, H] = table[ids[i]] with ids in backend memory (row ids[i] - table.row0; zeros for an
     * id outside the table's rows). */
    void (*embed_dev)(mt_backend *be, float *out, const mt_weight *table, const int32_t *ids, int n);
    /* The cache write of one sequence: row i of src[n, dst.row] becomes position t0 + i of the paged
     * cache dst through the block table bt (rows may cross pages). Graph form: with pos set (backend
     * memory) the first position is *pos, read at run time, and t0 is ignored; eager writes (prefill)
     * pass pos = NULL. Every block the rows touch must be mapped in bt before the call. */
    void (*copy_rows_at)(mt_backend *be, mt_paged dst, const int32_t *bt, int t0, const int32_t *pos,
                         const float *src, int n);
    /* When position *pos completes a pool ((*pos + 1) % kpool == 0), its pool key, as dsa_pool_keys. */
    void (*dsa_pool_keys_at)(mt_backend *be, mt_paged pool_keys, mt_paged ki, mt_paged gs, const int32_t *bt,
                             const float *ape, const int32_t *pos, int kpool);

    /* ---- batched decode, one row per sequence (the "rows" form) ----
     * Row i is the next position pos[i] of its own sequence; the per-sequence memory a row reads
     * and writes comes from a table of pointers (one per row). pos and every table live in backend
     * memory and are read at run time, so a captured graph holds the tables' addresses, not any
     * sequence's memory: a batch whose members change replays the same graph. The DSA caches are
     * paged (mt_paged): every row shares the layer's pools and brings its own block table, bts[i]. */
    /* One conv step per row: out[i, C] = silu(conv(states[i] ++ x[i])), states[i] [C, K-1] updated. */
    void (*conv1d_silu_rows)(mt_backend *be, float *out, const float *x, float *const *states,
                             const float *w, int n, int C, int K);
    /* Optional (NULL: not offered): a KDA layer's three conv steps and its q, k l2norms at once:
     * for j < 3, c->out[j] = conv1d_silu_rows(c->x[j], c->states[j], c->w[j]); then out[0] and
     * out[1] l2-normalised per head of dk (l2norm with eps, scale q_scale for out[0], 1 for
     * out[1]). C = heads x dk. out[j] may be x[j] (in place). */
    void (*kda_conv3_rows)(mt_backend *be, const mt_kda_conv3 *c, int n, int C, int K, int dk, float eps,
                           float q_scale);
    /* One delta-rule step per row, as kda_recurrent with n = 1 on states[i] [nh, dk, dk]; q, k, v,
     * g, o [n, nh, dk], beta [n, nh]. */
    void (*kda_recurrent_rows)(mt_backend *be, float *o, const float *q, const float *k, const float *v,
                               const float *g, const float *beta, float *const *states, int n, int nh, int dk);
    /* Optional (NULL: not offered): copy_rows_to(dst[j], src[j]) for j < count <= 4, the same bts,
     * pos and n, in one launch where the backend can. */
    void (*copy_rows_to_n)(mt_backend *be, const mt_paged *dst, const float *const *src, int count,
                           const int32_t *const *bts, const int32_t *pos, int n);
    /* Each row's own buffer into a block: out[i, w] = srcs[i][0 .. w) (a PLE memory's rows its
     * prestage gathered). srcs [n] is a table; no srcs[i] overlaps out. */
    void (*copy_rows_from)(mt_backend *be, float *out, const float *const *srcs, int n, int64_t w);
    /* Rows from one table to another: dsts[i][0 .. w) = srcs[i][0 .. w) (both tables [n] in backend
     * memory; no destination overlaps a source or another destination); a NULL dsts[i] skips row
     * i (a graph's pad rows). */
    void (*copy_rows_ptr)(mt_backend *be, float *const *dsts, const float *const *srcs, int n, int64_t w);
    /* Each row's cache write: src[i, dst.row] becomes position pos[i] of dst through bts[i]. */
    void (*copy_rows_to)(mt_backend *be, mt_paged dst, const int32_t *const *bts, const int32_t *pos,
                         const float *src, int n);
    /* For each row whose position completes a pool, that pool's key (as dsa_pool_keys_at), through
     * bts[i]. */
    void (*dsa_pool_keys_rows)(mt_backend *be, mt_paged pool_keys, mt_paged ki, mt_paged gs,
                               const int32_t *const *bts, const float *ape, const int32_t *pos, int n, int kpool);
    /* dsa_select of one query per row: query i at position pos[i] over the pool keys of bts[i]. t_cap
     * of p bounds every position; t0_dev is unused. */
    void (*dsa_select_rows)(mt_backend *be, int32_t *sel, int32_t *nsel, const float *qi, const float *w,
                            mt_paged pool_keys, const int32_t *const *bts, const int32_t *pos, int n,
                            const mt_dsa_select_params *p);
    /* mla_sparse of one query per row: query i at position pos[i] over the latent rows of bts[i].
     * t_cap of p bounds every position; t0_dev is unused. */
    void (*mla_sparse_rows)(mt_backend *be, float *out, const float *q, mt_paged latent,
                            const int32_t *const *bts, const mt_weight *kv_b, const int32_t *sel,
                            const int32_t *nsel, int max_sel, const int32_t *pos, int n, const mt_mla_params *p);

    /* ---- PLE memory ---- */
    /* Optional (NULL: not offered; the model refuses PLE layers on such a backend): n rows, row i
     * with the keys keys[i, S*H] and the value v = vals[i, H] of its gathered table rows, its
     * highway row X[i, S, H] (updated in place) and its conv state states[i] [(K-1)*dil, S*H]
     * (oldest row first; the rows of one sequence are consecutive, in order, and share the
     * pointer; states is a table in backend memory, unread when K == 1). Per stream s: gate =
     * sigmoid(signed sqrt of RMSNorm(key_s; key_norm[s]) . RMSNorm(X[i, s]; query_norm[s]) /
     * sqrt(H)), value_s = gate * v; the conv input is RMSNorm(value_s; conv_norm[s]); X[i, s] +=
     * value_s + silu(conv). Each row then moves its state on by one row. key_norm, query_norm,
     * conv_norm [S, H]; conv_w [S*H, K]. */
    void (*ple_inject)(mt_backend *be, float *X, const float *keys, const float *vals, float *const *states,
                       const float *key_norm, const float *query_norm, const float *conv_norm,
                       const float *conv_w, int n, const mt_ple_params *p);
    /* Optional (NULL: the model hashes and gathers on the host). The gathered n-gram rows of n
     * rows whose ids are in backend memory (row i's at ids[i * ids_stride]), so a step whose
     * tokens the device made needs no host work. hist[i] (a table in backend memory) is row i's
     * sequence's history, u32 [MT_PLE_MAX_ORDER] in backend memory: its length h <= N - 1, then
     * its last h ids, oldest first; the rows of one sequence are consecutive, in order, and
     * share the pointer. emb[i] [ntab * d] fp32 = for each table t (order o, head j), row
     * off[t] + (XOR_{k<o} x_{i-k} mult[k]) mod prime[t] of table [sum of the primes, d], where
     * x_{i-k} is the id k positions back (the sequence's earlier rows, then its history, then
     * pad). Each sequence's history then takes its rows' ids (the last N - 1 kept). */
    void (*ple_gather_rows)(mt_backend *be, float *emb, const mt_weight *table, const int32_t *ids, int ids_stride,
                            uint32_t *const *hist, const mt_ple_hash *hash, int N, int ntab, int n);

    /* ---- dense ---- */
    /* out[n, H] = table[ids[i]] ; ids on the host (row ids[i] - table.row0; zeros for an id
     * outside the table's rows). */
    void (*embed)(mt_backend *be, float *out, const mt_weight *table, const int32_t *ids, int n);
    /* y[n, w.rows] = x[n, w.cols] . w^T, fp32 accumulation. y must not alias x. */
    void (*matmul)(mt_backend *be, float *y, const float *x, const mt_weight *w, int n);
    /* Optional (NULL: not offered): y[j] = matmul(x, w[j]) for j < count <= 6, the same x, and
     * then y[j] = sigmoid(y[j]) where bit j of sigmoid_mask is set: as those matmul and sigmoid
     * calls, in one launch where the backend can. */
    void (*matmul_multi)(mt_backend *be, float *const *y, const float *x, const mt_weight *const *w, int count,
                         int n, unsigned sigmoid_mask);
    /* out[n, d] = x * rsqrt(mean(x^2) + eps) * (w ? w : 1); out may alias x. */
    void (*rmsnorm)(mt_backend *be, float *out, const float *x, const float *w, int n, int d, float eps);
    /* LayerNorm with weight and bias; out may alias x. */
    void (*layernorm)(mt_backend *be, float *out, const float *x, const float *w, const float *b,
                      int n, int d, float eps);
    /* out[n, I] = silu(min(gate, L)) * clamp(up, -L, L); out may alias gate. */
    void (*swiglu)(mt_backend *be, float *out, const float *gate, const float *up, int n, int I, float L);
    /* x[count] = sigmoid(x), in place. */
    void (*sigmoid)(mt_backend *be, float *x, int64_t count);
    /* y[count] += x[count] (a plain residual). */
    void (*add)(mt_backend *be, float *y, const float *x, int64_t count);
    /* x[n, d] /= sqrt(sum(x^2) + eps) per row of d, then *= scale. */
    void (*l2norm)(mt_backend *be, float *x, int64_t n, int d, float eps, float scale);

    /* ---- MoE ---- */
    /* Router over fp32 logits[n, E] (x . W_gate^T): writes idx[n, top_k] and weights[n, top_k]. */
    void (*moe_route)(mt_backend *be, int32_t *idx, float *weights, const float *logits,
                      const float *bias /* [E] */, const mt_router_params *p, int n);
    /* out[n, H] += sum_k weights[i,k] * expert_{idx[i,k]}(x[i]) for the routed experts. */
    void (*moe_experts)(mt_backend *be, float *out, const float *x, const int32_t *idx,
                        const float *weights, const mt_expert *experts /* host array [E] */,
                        int n, int top_k, int H, int I, float L);
    /* Optional (NULL: not offered): keeps the picks idx[n, top_k] of experts in [lo, hi), having
     * first taken them from from_idx and from_weights when those are not NULL (picks a router made
     * earlier, each below the router's expert count). Every other pick gets weight 0 and, as its
     * expert, the row's first kept one (lo when the row keeps none), so that moe_experts then reads
     * no expert outside the range and adds each row's sum over its kept picks (a layered prompt's
     * MoE run over parts of the experts in turn, on the picks of its first part). */
    void (*moe_keep_experts)(mt_backend *be, int32_t *idx, float *weights, const int32_t *from_idx,
                             const float *from_weights, int n, int top_k, int lo, int hi);
    /* Optional (NULL: not offered): out[n, H] = shared(x) + the routed sum above, `shared` an
     * expert shaped like the routed ones, fused where the backend can (the CUDA GEMV path: the
     * shared expert as one more slot). Returns false, having done nothing, for a shape it does
     * not fuse; the caller then runs the shared expert and moe_experts itself. */
    bool (*moe_experts_shared)(mt_backend *be, float *out, const float *x, const int32_t *idx,
                               const float *weights, const mt_expert *experts, const mt_expert *shared,
                               int n, int top_k, int H, int I, float L);

    /* ---- KDA ---- */
    /* Causal depthwise conv + SiLU over time: out[n, C], x[n, C], state[C, K-1] (the previous K-1
     * inputs, oldest first; updated), w[C, K]. */
    void (*conv1d_silu)(mt_backend *be, float *out, const float *x, float *state, const float *w,
                        int n, int C, int K);
    /* Optional (NULL: not offered): conv1d_silu, then out l2-normalised per group of dk channels
     * (as l2norm(out, n * C / dk, dk, eps, scale)), in one pass where the backend can. C % dk == 0,
     * out != x. Returns false, having done nothing, for a shape it does not fuse. */
    bool (*conv1d_silu_l2norm)(mt_backend *be, float *out, const float *x, float *state, const float *w,
                               int n, int C, int K, int dk, float eps, float scale);
    /* Optional (NULL: not offered): g = kda_gate(f_in . f_b^T) and gate = g_in . g_b^T, as matmul,
     * kda_gate and matmul would give, in one launch where the backend can. f_in [n, f_b.cols],
     * g_in [n, g_b.cols]; g [n, nh*dk] (f_b.rows), gate [n, g_b.rows]. */
    void (*kda_gates)(mt_backend *be, float *g, float *gate, const float *f_in, const float *g_in,
                      const mt_weight *f_b, const mt_weight *g_b, const float *dt_bias, const float *A_log,
                      const mt_kda_gate_params *p, int n);
    /* g[n, nh*dk] = gate(f[n, nh*dk] + dt_bias) with A_log[nh]; g may alias f. */
    void (*kda_gate)(mt_backend *be, float *g, const float *f, const float *dt_bias,
                     const float *A_log, const mt_kda_gate_params *p, int n);
    /* Delta rule over n steps: q, k [n, nh, dk] l2-normalised (q pre-scaled), v, g [n, nh, dk],
     * beta [n, nh]; state [nh, dk(k), dk(v)] fp32 updated; o [n, nh, dk].
     * kda_chunked and kda_recurrent compute the same function. */
    void (*kda_recurrent)(mt_backend *be, float *o, const float *q, const float *k, const float *v,
                          const float *g, const float *beta, float *state, int n, int nh, int dk);
    void (*kda_chunked)(mt_backend *be, float *o, const float *q, const float *k, const float *v,
                        const float *g, const float *beta, float *state, int n, int nh, int dk);
    /* out[rows, d] = rmsnorm(o; w, eps) * sigmoid(gate); rows = n * nh. */
    void (*gated_rmsnorm)(mt_backend *be, float *out, const float *o, const float *gate,
                          const float *w, int64_t rows, int d, float eps);

    /* ---- DSA ----
     * The caches are paged (mt_paged) through the sequence's block table bt: the MLA latent
     * [positions, kvl], the indexer keys ki and pool gate scores gs [positions, id] (one page size),
     * and the pool keys [pools, id] (page / kpool pools a page, same block table). */
    /* Pool keys for pools [p0, p1): P[p, :] = sum_j softmax_j(gs[p*kp+j] + ape[j]) * ki[p*kp+j],
     * softmax per channel; writes pool_keys rows p0 .. p1-1, reads ki, gs positions
     * [p0*kpool, p1*kpool). ki.row == gs.row == pool_keys.row (= id), ki.page == gs.page ==
     * pool_keys.page * kpool. */
    void (*dsa_pool_keys)(mt_backend *be, mt_paged pool_keys, mt_paged ki, mt_paged gs, const int32_t *bt,
                          const float *ape /* [kpool, id] */, int p0, int p1, int kpool);
    /* For n queries at positions t0..t0+n-1: scores pools complete at each query, keeps the best
     * min(max_pools, #candidates) and the tail; writes positions into sel[n, max_sel] and counts
     * into nsel[n]. qi[n, ih, id]; w[n, ih] is weights_proj(x), scaled by ih^-0.5 here; reads pool
     * keys [0, (t0+n)/kpool) through bt (pool_keys.row == id). */
    void (*dsa_select)(mt_backend *be, int32_t *sel, int32_t *nsel, const float *qi, const float *w,
                       mt_paged pool_keys, const int32_t *bt, int t0, int n, const mt_dsa_select_params *p);
    /* Sparse MLA in the latent space: q[n, Hq, dn]; latent rows (latent.row == kvl) through bt;
     * kv_b [Hq*(dn+dv), kvl]; attends query i over positions sel[i, 0..nsel[i]) (nsel == 0: all
     * positions <= t0+i, equally weighted); out[n, Hq, dv]. */
    void (*mla_sparse)(mt_backend *be, float *out, const float *q, mt_paged latent, const int32_t *bt,
                       const mt_weight *kv_b, const int32_t *sel, const int32_t *nsel, int max_sel,
                       int t0, int n, const mt_mla_params *p);

    /* ---- hyper-connections ---- */
    /* From the highway X[n, S, H]: post[n, S], comb[n, S, S] (comb[r][s] mixes stream r into s),
     * y[n, H] = sum_s pre[s] X[s]. fn [(2+S)S, S*H], base [(2+S)S], scale [3]. */
    void (*hc_pre)(mt_backend *be, float *y, float *post, float *comb, const float *X,
                   const mt_weight *fn, const float *base, const float *scale,
                   const mt_hc_params *p, int n);
    /* Optional (NULL: not offered): hc_pre, then h[n, H] = rmsnorm(y) * norm_w with eps
     * p->rms_eps, as the two ops would give; y is the backend's to use as scratch (it may or may
     * not hold y afterwards). */
    void (*hc_pre_norm)(mt_backend *be, float *h, float *y, float *post, float *comb, const float *X,
                        const mt_weight *fn, const float *base, const float *scale, const float *norm_w,
                        const mt_hc_params *p, int n);
    /* Optional (NULL: not offered): hc_post(X, a, post, comb), then hc_pre_norm(h, y, post, comb,
     * X, fn, ...) of the next site: the function of the two ops (post and comb are read as the
     * first's and written as the second's; a fused form may add its sums in another order), in
     * one launch where the backend can. */
    void (*hc_post_pre_norm)(mt_backend *be, float *X, const float *a, float *h, float *y, float *post, float *comb,
                             const mt_weight *fn, const float *base, const float *scale, const float *norm_w,
                             const mt_hc_params *p, int n);
    /* X[s] = post[s] * a + sum_r comb[r][s] * X[r], in place; a[n, H]. */
    void (*hc_post)(mt_backend *be, float *X, const float *a, const float *post, const float *comb,
                    const mt_hc_params *p, int n);
    /* z[n, H] = mean_s X[n, s, :]. */
    void (*hc_head)(mt_backend *be, float *z, const float *X, int n, int S, int H);
    /* Optional (NULL: not offered): z = rmsnorm(hc_head(X)) * w with eps, as hc_head then rmsnorm
     * would give, in one launch where the backend can. */
    void (*hc_head_norm)(mt_backend *be, float *z, const float *X, const float *w, int n, int S, int H, float eps);

    /* ---- sampling ---- */
    /* out (host)[n] = argmax of logits[n, V] (lowest index on ties). */
    void (*argmax)(mt_backend *be, int32_t *out, const float *logits, int n, int V);
    /* Optional (NULL: not offered): the same argmax left in backend memory, each row's index
     * written rep times, out[i * rep + j] for j < rep (a decode step's token table, one entry per
     * hyper-connection stream), so the next step can take it as input without a round trip. */
    void (*argmax_dev)(mt_backend *be, int32_t *out, int rep, const float *logits, int n, int V);
} mt_backend_ops;

struct mt_backend {
    const mt_backend_ops *ops;
    int n_threads;        /* CPU threads the backend may use */
};

/* The CPU backend (kernels/cpu/). n_threads <= 0 means all online cores. NULL on OOM. */
mt_backend *mt_cpu_backend_new(int n_threads);

/* The CPU backend's gap recorder: while on, the CPU router (moe_route) and indexer selection
 * (dsa_select and its rows form) note, for every top-k choice that is not forced, the gap between
 * the k-th and the (k+1)-th candidate, and the recorder keeps the smallest per kind. It shows how
 * far a run's discrete choices are from flipping (tools/mkckpt --margin). Choices that are forced
 * do not count: as many candidates as places (or fewer), and the indexer's always-selected tail,
 * which is not a candidate. Off by default; when off the ops pay one branch per call.
 * Process-wide state: the ops update it under a lock (they may run on internal threads); call
 * reset, record and get from one thread while no CPU op runs. */
typedef enum mt_gap_kind {
    MT_GAP_GROUP,   /* router group selection: group scores (sum of a group's two largest s + bias) */
    MT_GAP_EXPERT,  /* router expert selection among the kept groups: s + bias */
    MT_GAP_POOL,    /* indexer pool selection: gap / the query's largest |pool score| */
    MT_GAP_N
} mt_gap_kind;

typedef struct mt_cpu_gaps {
    double min[MT_GAP_N];   /* smallest gap seen per kind; INFINITY when none counted */
    int64_t count[MT_GAP_N]; /* choices that counted */
} mt_cpu_gaps;

void mt_cpu_gaps_reset(void);            /* forgets what was seen (the on/off switch stays) */
void mt_cpu_gaps_record(bool on);
void mt_cpu_gaps_get(mt_cpu_gaps *out);
/* Notes one choice's gap (what the ops call; tests may call it too). Ignored while off. */
void mt_cpu_gaps_note(mt_gap_kind kind, double gap);

/* Destroys any backend; NULL is fine. */
static inline void mt_backend_free(mt_backend *be) {
    if (be) be->ops->destroy(be);
}

#ifdef __cplusplus
}
#endif
#endif /* MT_BACKEND_H */
