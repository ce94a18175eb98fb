/* kernels/cpu/cpu_ops.h: internal to the CPU backend. The op families live in one file each
 * (cpu_dense.c, cpu_moe.c, cpu_kda.c, cpu_dsa.c, cpu_hc.c); cpu_backend.c fills the table. */
#ifndef MT_CPU_OPS_H
#define MT_CPU_OPS_H

#include <math.h>

#include "kernels/backend.h"

/* Row r of w as fp32 into dst[w->cols]. */
void cpu_weight_row(const mt_weight *w, int64_t r, float *dst);

void cpu_embed(mt_backend *be, float *out, const mt_weight *table, const int32_t *ids, int n);
void cpu_copy_rows_at(mt_backend *be, mt_paged dst, const int32_t *bt, int t0, const int32_t *pos,
                      const float *src, int n);
void cpu_matmul(mt_backend *be, float *y, const float *x, const mt_weight *w, int n);
void cpu_rmsnorm(mt_backend *be, float *out, const float *x, const float *w, int n, int d, float eps);
void cpu_layernorm(mt_backend *be, float *out, const float *x, const float *w, const float *b, int n,
                   int d, float eps);
void cpu_swiglu(mt_backend *be, float *out, const float *gate, const float *up, int n, int I, float L);
void cpu_sigmoid(mt_backend *be, float *x, int64_t count);
void cpu_l2norm(mt_backend *be, float *x, int64_t n, int d, float eps, float scale);
void cpu_argmax(mt_backend *be, int32_t *out, const float *logits, int n, int V);
void cpu_argmax_dev(mt_backend *be, int32_t *out, int rep, const float *logits, int n, int V);

void cpu_moe_route(mt_backend *be, int32_t *idx, float *weights, const float *logits,
                   const float *bias, const mt_router_params *p, int n);
void cpu_moe_experts(mt_backend *be, float *out, const float *x, const int32_t *idx,
                     const float *weights, const mt_expert *experts, int n, int top_k, int H, int I,
                     float L);

void cpu_conv1d_silu(mt_backend *be, float *out, const float *x, float *state, const float *w, int n,
                     int C, int K);
void cpu_kda_gate(mt_backend *be, float *g, const float *f, const float *dt_bias, const float *A_log,
                  const mt_kda_gate_params *p, int n);
void cpu_kda_recurrent(mt_backend *be, float *o, const float *q, const float *k, const float *v,
                       const float *g, const float *beta, float *state, int n, int nh, int dk);
void cpu_kda_chunked(mt_backend *be, float *o, const float *q, const float *k, const float *v,
                     const float *g, const float *beta, float *state, int n, int nh, int dk);
void cpu_gated_rmsnorm(mt_backend *be, float *out, const float *o, const float *gate, const float *w,
                       int64_t rows, int d, float eps);

void cpu_dsa_pool_keys(mt_backend *be, mt_paged pool_keys, mt_paged ki, mt_paged gs, const int32_t *bt,
                       const float *ape, int p0, int p1, int kpool);
void cpu_dsa_pool_keys_at(mt_backend *be, mt_paged pool_keys, mt_paged ki, mt_paged gs, const int32_t *bt,
                          const float *ape, const int32_t *pos, int kpool);
void cpu_dsa_select(mt_backend *be, int32_t *sel, int32_t *nsel, const float *qi, const float *w,
                    mt_paged pool_keys, const int32_t *bt, int t0, int n, const mt_dsa_select_params *p);
void cpu_mla_sparse(mt_backend *be, float *out, const float *q, mt_paged latent, const int32_t *bt,
                    const mt_weight *kv_b, const int32_t *sel, const int32_t *nsel, int max_sel,
                    int t0, int n, const mt_mla_params *p);

void cpu_hc_pre(mt_backend *be, float *y, float *post, float *comb, const float *X,
                const mt_weight *fn, const float *base, const float *scale, const mt_hc_params *p,
                int n);
void cpu_hc_post(mt_backend *be, float *X, const float *a, const float *post, const float *comb,
                 const mt_hc_params *p, int n);
void cpu_hc_head(mt_backend *be, float *z, const float *X, int n, int S, int H);

/* cpu_rows.c: the rows form (batched decode), one single-sequence call per row */
void cpu_conv1d_silu_rows(mt_backend *be, float *out, const float *x, float *const *states, const float *w,
                          int n, int C, int K);
void cpu_kda_recurrent_rows(mt_backend *be, float *o, const float *q, const float *k, const float *v,
                            const float *g, const float *beta, float *const *states, int n, int nh, int dk);
void cpu_copy_rows_to(mt_backend *be, mt_paged dst, const int32_t *const *bts, const int32_t *pos,
                      const float *src, int n);
void cpu_dsa_pool_keys_rows(mt_backend *be, mt_paged pool_keys, mt_paged ki, mt_paged gs,
                            const int32_t *const *bts, const float *ape, const int32_t *pos, int n, int kpool);
void cpu_dsa_select_rows(mt_backend *be, int32_t *sel, int32_t *nsel, const float *qi, const float *w,
                         mt_paged pool_keys, const int32_t *const *bts, const int32_t *pos, int n,
                         const mt_dsa_select_params *p);
void cpu_mla_sparse_rows(mt_backend *be, float *out, const float *q, mt_paged latent,
                         const int32_t *const *bts, const mt_weight *kv_b, const int32_t *sel,
                         const int32_t *nsel, int max_sel, const int32_t *pos, int n, const mt_mla_params *p);

/* Work (multiply-adds) below which an op stays on one thread: forking costs more than it saves,
 * and with the cores shared (router, workers, tests) waiting threads can cost far more. */
#define CPU_PAR_MIN_WORK ((int64_t)1 << 18)

static inline float cpu_sigmoidf(float x) { return 1.f / (1.f + expf(-x)); }
static inline float cpu_siluf(float x) { return x / (1.f + expf(-x)); }

#endif /* MT_CPU_OPS_H */
