/* worker/model/glm/glm_mlp.c: the MLP site's sublayer: a dense SwiGLU MLP, or the MoE (router over
 * the routed experts plus the shared expert), with the swiglu_limit clamp. */
#include <stdlib.h>

#include "worker/model/glm/glm_impl.h"

static void swiglu_mlp(mt_backend *be, const mt_expert *e, const float *h, float *out, int n, int I,
                       float L, float *g, float *u) {
    const mt_weight *gu[2] = GLM_MLP_GROUP(e);
    float *y[2] = { g, u };
    glm_matmul_multi(be, y, h, gu, 2, n, 0u);
    be->ops->swiglu(be, g, g, u, n, I, L);
    be->ops->matmul(be, out, g, &e->down, n);
}

/* The MLP of n rows into out. With a group (rows [r0, n) a layered group's, through parts [q0,
 * q1) of P of the routed experts: experts [lo, hi)), those rows keep only their picks in the
 * range, and when q0 > 0 take neither the shared expert nor a dense MLP, out holding their sum
 * over the earlier parts (they add to it); the other rows run the whole MLP. One expert pass
 * serves all n rows, so a step reads each expert once for its decode rows and the group. */
static void mlp_rows(const glm_layer *l, mt_step *step, const float *h, float *out, int n, bool group, int r0,
                     int lo, int hi, bool later) {
    const glm_config *c = l->cfg;
    const glm_mlp_w *w = &l->mlp;
    mt_backend *be = step->be;
    glm_scratch *scr = step->scr;
    float *g = scr->buf[0], *u = scr->buf[1], *logits = scr->buf[2];
    const int whole = later ? r0 : n; /* rows through the shared expert or the dense MLP */
    if (!w->sparse) {
        if (whole > 0) swiglu_mlp(be, &w->dense, h, out, whole, c->intermediate_size, c->swiglu_limit, g, u);
        return;
    }
    be->ops->matmul(be, logits, h, &w->router, n);
    mt_router_params rp = {
        .n_experts = c->n_routed_experts, .n_group = c->n_group, .topk_group = c->topk_group,
        .top_k = c->num_experts_per_tok, .norm_topk_prob = c->norm_topk_prob,
        .scaling = c->routed_scaling_factor,
    };
    be->ops->moe_route(be, scr->idx, scr->wts, logits, w->router_bias, &rp, n);
    const int H = c->hidden_size, I = c->moe_intermediate_size, k = c->num_experts_per_tok;
    if (group) { /* the group's picks: made now at its first part (and kept), else those kept then */
        int32_t *gi = scr->idx + (size_t)r0 * k;
        float *gw = scr->wts + (size_t)r0 * k;
        const size_t pk = (size_t)(n - r0) * k;
        if (!later) {
            be->ops->copy(be, step->xidx, gi, sizeof(int32_t) * pk);
            be->ops->copy(be, step->xwts, gw, sizeof(float) * pk);
        }
        be->ops->moe_keep_experts(be, gi, gw, later ? step->xidx : NULL, later ? step->xwts : NULL, n - r0, k, lo, hi);
    }
    /* out = shared expert + the routed ones: fused by the backend where it can, else the shared
     * expert first and the routed experts accumulating into out (the same sum, in that order). */
    if (later || !be->ops->moe_experts_shared ||
        !be->ops->moe_experts_shared(be, out, h, scr->idx, scr->wts, w->experts, &w->shared, n, k, H, I,
                                     c->swiglu_limit)) {
        if (whole > 0) swiglu_mlp(be, &w->shared, h, out, whole, I * c->n_shared_experts, c->swiglu_limit, g, u);
        be->ops->moe_experts(be, out, h, scr->idx, scr->wts, w->experts, n, k, H, I, c->swiglu_limit);
    }
    if (step->census) { /* which experts this step reads, and for how many pairs (benchmark floors) */
        const int E = c->n_routed_experts;
        int32_t *idx = malloc(sizeof(int32_t) * (size_t)n * k);
        if (!idx) return;
        be->ops->download(be, idx, scr->idx, sizeof(int32_t) * (size_t)n * k);
        for (int i = 0; i < n * k; i++)
            if (idx[i] >= 0 && idx[i] < E) step->census[(size_t)l->base.index * E + idx[i]]++;
        free(idx);
    }
}

void glm_mlp_forward(const glm_layer *l, mt_step *step, const float *h, float *out, int n) {
    mlp_rows(l, step, h, out, n, false, n, 0, 0, false);
}

void glm_mlp_forward_parts(const glm_layer *l, mt_step *step, const float *h, float *out, int n) {
    const int E = l->cfg->n_routed_experts, P = step->xparts, q0 = step->xq0, q1 = step->xq1, r0 = step->xr0;
    float *grp = out + (size_t)r0 * l->cfg->hidden_size;
    const size_t bytes = sizeof(float) * (size_t)(n - r0) * l->cfg->hidden_size;
    mt_backend *be = step->be;
    if (q0 > 0) be->ops->copy(be, grp, step->xacc, bytes);
    mlp_rows(l, step, h, out, n, true, r0, (int)((int64_t)q0 * E / P), (int)((int64_t)q1 * E / P), q0 > 0);
    if (q1 < P) be->ops->copy(be, step->xacc, grp, bytes);
}
