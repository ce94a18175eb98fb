/* worker/model/glm/glm_mlp.c: the MLP site's sublayer: a dense SwiGLU MLP, or the MoE (router over
 * the routed experts plus the shared expert), with the swiglu_limit clamp. */
#include <stdlib.h>

#include "worker/model/glm/glm_impl.h"

static void swiglu_mlp(mt_backend *be, const mt_expert *e, const float *h, float *out, int n, int I,
                       float L, float *g, float *u) {
    const mt_weight *gu[2] = { &e->gate, &e->up };
    float *y[2] = { g, u };
    glm_matmul_multi(be, y, h, gu, 2, n, 0u);
    be->ops->swiglu(be, g, g, u, n, I, L);
    be->ops->matmul(be, out, g, &e->down, n);
}

void glm_mlp_forward(const glm_layer *l, mt_step *step, const float *h, float *out, int n) {
    const glm_config *c = l->cfg;
    const glm_mlp_w *w = &l->mlp;
    mt_backend *be = step->be;
    glm_scratch *scr = step->scr;
    float *g = scr->buf[0], *u = scr->buf[1], *logits = scr->buf[2];
    if (!w->sparse) {
        swiglu_mlp(be, &w->dense, h, out, n, c->intermediate_size, c->swiglu_limit, g, u);
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
    /* out = shared expert + the routed ones: fused by the backend where it can, else the shared
     * expert first and the routed experts accumulating into out (the same sum, in that order). */
    if (!be->ops->moe_experts_shared ||
        !be->ops->moe_experts_shared(be, out, h, scr->idx, scr->wts, w->experts, &w->shared, n, k, H, I,
                                     c->swiglu_limit)) {
        swiglu_mlp(be, &w->shared, h, out, n, I * c->n_shared_experts, c->swiglu_limit, g, u);
        be->ops->moe_experts(be, out, h, scr->idx, scr->wts, w->experts, n, k, H, I, c->swiglu_limit);
    }
    if (step->census) { /* which experts this step reads (benchmark floors) */
        const int E = c->n_routed_experts;
        int32_t *idx = malloc(sizeof(int32_t) * (size_t)n * k);
        if (!idx) return;
        be->ops->download(be, idx, scr->idx, sizeof(int32_t) * (size_t)n * k);
        for (int i = 0; i < n * k; i++)
            if (idx[i] >= 0 && idx[i] < E) step->census[(size_t)l->base.index * E + idx[i]] = 1;
        free(idx);
    }
}
