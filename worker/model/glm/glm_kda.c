/* worker/model/glm/glm_kda.c: the KDA mixer (docs/MODEL.md, "KDA mixer"): projections, causal conv + SiLU
 * with the conv state, l2norm, decay gate, the delta rule (chunked for several rows of one
 * sequence, recurrent for one row), gated output norm and o_proj.
 *
 * Rows and states: with nst == 1 all n rows are consecutive positions of sts[0] (prefill, decode);
 * with nst == n row i is the next position of sequence sts[i] (batched decode, the rows form):
 * the projections and norms run over all rows at once, the conv and the delta rule on each row's
 * own state through the step's pointer tables (glm_rtab), so no op is issued per sequence.
 * A verify (step->vring, nst == 1, n > 1 rows) runs the conv and the delta rule row by row, as
 * n decodes would, and leaves the state after each row but the last in the ring's slots, from
 * which glm_seq_keep commits the accepted row's. Verifies in a mixed step's rows block
 * (step->vblk) do the same for all of them at once, one block of rows (row j of each) at a time. */
#include <math.h>

#include "worker/model/glm/glm_impl.h"

/* A verify block's rows [r0, r0 + n) (KDA order) that have rows after them: their sequences'
 * conv states (conv) or recurrent states into their ring slots, one copy for all of them. */
static void ring_save_rows(const glm_layer *l, const mt_step *step, int r0, int n, bool conv) {
    if (n <= 0) return;
    float *c0, *r;
    size_t cf, rf;
    glm_layer_slot_at(l, 0, &c0, &r, &cf, &rf);
    const int from = conv ? GLM_R_CONV0 : GLM_R_REC, to = conv ? GLM_R_RING_CONV : GLM_R_RING_REC;
    step->be->ops->copy_rows_ptr(step->be, glm_rtab(step, to) + r0, (const float *const *)glm_rtab(step, from) + r0,
                                 n, (int64_t)(conv ? cf : rf));
}

/* Rows [r0, r0 + n) of q, k and v: one sequence's consecutive positions (st) from their raw
 * projections in pre, each conv'd with st's conv state (q and k l2-normed, q scaled too), into
 * dst. */
static void conv_seq(const glm_layer *l, mt_backend *be, glm_layer_state *st, float *const *dst,
                     float *const *pre, int r0, int n) {
    const glm_config *c = l->cfg;
    const mt_backend_ops *op = be->ops;
    const int nh = c->linear_num_heads, dk = c->linear_head_dim, K = c->linear_conv_kernel_dim, D = nh * dk;
    const size_t o = (size_t)r0 * D;
    for (int j = 0; j < 3; j++) {
        /* q and k: the conv and their l2norm in one pass where the backend fuses them */
        const float scale = j == 0 ? 1.f / sqrtf((float)dk) : 1.f;
        if (j < 2 && op->conv1d_silu_l2norm &&
            op->conv1d_silu_l2norm(be, dst[j] + o, pre[j] + o, st->conv[j], l->kda.conv[j], n, D, K, dk, 1e-6f,
                                   scale))
            continue;
        op->conv1d_silu(be, dst[j] + o, pre[j] + o, st->conv[j], l->kda.conv[j], n, D, K);
        if (j < 2) op->l2norm(be, dst[j] + o, (int64_t)n * nh, dk, 1e-6f, scale);
    }
}

/* The decay gate g and the output gate of n rows from the low-rank inputs lo and lo_g (fused
 * where the backend offers it; raw is scratch for the unfused form). */
static void gates_rows(const glm_layer *l, mt_backend *be, float *g, float *gate, float *raw, const float *lo,
                       const float *lo_g, bool conv3, int n) {
    const glm_config *c = l->cfg;
    const glm_kda_w *w = &l->kda;
    const mt_backend_ops *op = be->ops;
    mt_kda_gate_params gp = { c->linear_num_heads, c->linear_head_dim, c->has_linear_lower_bound,
                              c->linear_lower_bound, conv3 };
    if (op->kda_gates) {
        op->kda_gates(be, g, gate, lo, lo_g, &w->f_b, &w->g_b, w->dt_bias, w->A_log, &gp, n);
    } else {
        op->matmul(be, raw, lo, &w->f_b, n);
        op->kda_gate(be, g, raw, w->dt_bias, w->A_log, &gp, n);
        op->matmul(be, gate, lo_g, &w->g_b, n);
    }
}

/* The delta rule over rows [r0, r0 + n) of one sequence (st): recurrent for a row, chunked for
 * more. */
static void delta_seq(const glm_layer *l, mt_backend *be, glm_layer_state *st, float *const *b, int r0, int n) {
    const int nh = l->cfg->linear_num_heads, dk = l->cfg->linear_head_dim;
    const size_t o = (size_t)r0 * nh * dk;
    float *q = b[1] + o, *k = b[2] + o, *v = b[3] + o, *g = b[4] + o, *beta = b[5] + (size_t)r0 * nh, *out = b[6] + o;
    if (n == 1) be->ops->kda_recurrent(be, out, q, k, v, g, beta, st->rec, 1, nh, dk);
    else be->ops->kda_chunked(be, out, q, k, v, g, beta, st->rec, n, nh, dk);
}

mt_status glm_kda_forward(const glm_layer *l, glm_layer_state **sts, int nst, mt_step *step,
                          const float *h, float *out, int n) {
    const glm_config *c = l->cfg;
    const glm_kda_w *w = &l->kda;
    mt_backend *be = step->be;
    const mt_backend_ops *op = be->ops;
    const int nh = c->linear_num_heads, dk = c->linear_head_dim, K = c->linear_conv_kernel_dim;
    const int D = nh * dk;
    float **b = step->scr->buf;
    float *raw = b[0], *q = b[1], *k = b[2], *v = b[3], *g = b[4], *beta = b[5], *o = b[6];
    float *lo = b[7], *gate = b[8], *lo_g = b[9];
    const bool rows = step->rtab != NULL; /* the rows form, even for n == 1 (a graph bucket) */
    MT_ASSERT(rows ? nst == n : nst == 1);
    const bool ring = !rows && n > 1 && step->vring != NULL;
    if (!rows && !ring) { /* one sequence's consecutive rows: a chunk of its own */
        const glm_segment one = { .t0 = step->t0, .n = n };
        return glm_kda_forward_chunks(l, sts, &one, 1, step, h, out, n);
    }
    /* the rows form with verifies: the conv and the delta rule block by block (glm_vblock) */
    const glm_vblock *vb = rows ? step->vblk : NULL;
    const int nblk = vb ? vb->kmax : 1;

    /* Every projection of h together: q, k, v (raw, o and g hold them until the conv, or with the
     * fused rows op q, k, v themselves, which it convolves in place), and the three small ones,
     * f_a, b (its sigmoid, beta, with it) and g_a (g_b's input waits in lo_g); then each conv. */
    const bool conv3 = rows && op->kda_conv3_rows;
    const mt_weight *proj[6] = GLM_KDA_GROUP(w);
    float *dst[3] = { q, k, v }, *pre[6] = { conv3 ? q : raw, conv3 ? k : o, conv3 ? v : g, lo, beta, lo_g };
    glm_matmul_multi(be, pre, h, proj, 6, n, 1u << 4);
    const float q_scale = 1.f / sqrtf((float)dk);
    if (conv3) { /* the three convs and two norms in one backend op (a block's rows at a time) */
        for (int b = 0, r0 = 0; b < nblk; r0 += vb ? vb->n_at[b] : n, b++) {
            const int nb = vb ? vb->n_at[b] : n;
            mt_kda_conv3 cv;
            for (int j = 0; j < 3; j++) {
                cv.out[j] = dst[j] + (size_t)r0 * D;
                cv.x[j] = pre[j] + (size_t)r0 * D;
                cv.states[j] = glm_rtab(step, GLM_R_CONV0 + j) + r0;
                cv.w[j] = w->conv[j];
            }
            op->kda_conv3_rows(be, &cv, nb, D, K, dk, 1e-6f, q_scale);
            if (vb) ring_save_rows(l, step, r0, vb->save_at[b], true);
        }
    } else if (ring) {
        for (int r = 0; r < n; r++) {
            conv_seq(l, be, sts[0], dst, pre, r, 1);
            if (r < n - 1) glm_layer_save_slot(l, sts[0], step->vring[r], true, false);
        }
    } else { /* a block's rows at a time: its three convs, then its ring saves */
        for (int b = 0, r0 = 0; b < nblk; r0 += vb ? vb->n_at[b] : n, b++) {
            const size_t o = (size_t)r0 * D;
            for (int j = 0; j < 3; j++)
                op->conv1d_silu_rows(be, dst[j] + o, pre[j] + o, glm_rtab(step, GLM_R_CONV0 + j) + r0, w->conv[j],
                                     vb ? vb->n_at[b] : n, D, K);
            if (vb) ring_save_rows(l, step, r0, vb->save_at[b], true);
        }
        for (int j = 0; j < 2; j++) op->l2norm(be, dst[j], (int64_t)n * nh, dk, 1e-6f, j == 0 ? q_scale : 1.f);
    }

    /* the decay gate and the output gate's projection (fused where the backend offers it); after
     * the in-place convs they read (lo, lo_g) and write (g, gate) nothing the convs touch, so the
     * backend may run the two together */
    gates_rows(l, be, g, gate, raw, lo, lo_g, conv3, n);

    if (ring) {
        for (int r = 0; r < n; r++) {
            delta_seq(l, be, sts[0], b, r, 1);
            if (r < n - 1) glm_layer_save_slot(l, sts[0], step->vring[r], false, true);
        }
    } else {
        for (int b = 0, r0 = 0; b < nblk; r0 += vb ? vb->n_at[b] : n, b++) {
            const size_t o_r = (size_t)r0 * D;
            op->kda_recurrent_rows(be, o + o_r, q + o_r, k + o_r, v + o_r, g + o_r, beta + (size_t)r0 * nh,
                                   glm_rtab(step, GLM_R_REC) + r0, vb ? vb->n_at[b] : n, nh, dk);
            if (vb) ring_save_rows(l, step, r0, vb->save_at[b], false);
        }
    }

    op->gated_rmsnorm(be, raw, o, gate, w->o_norm, (int64_t)n * nh, dk, c->rms_norm_eps);
    op->matmul(be, out, raw, &w->o, n);
    return MT_OK;
}

mt_status glm_kda_forward_chunks(const glm_layer *l, glm_layer_state **sts, const glm_segment *seg, int ns,
                                 mt_step *step, const float *h, float *out, int n) {
    const glm_config *c = l->cfg;
    const glm_kda_w *w = &l->kda;
    mt_backend *be = step->be;
    const int nh = c->linear_num_heads, dk = c->linear_head_dim;
    float **b = step->scr->buf;
    float *raw = b[0], *q = b[1], *k = b[2], *v = b[3], *g = b[4], *beta = b[5], *o = b[6];
    float *lo = b[7], *gate = b[8], *lo_g = b[9];
    const mt_weight *proj[6] = GLM_KDA_GROUP(w);
    float *dst[3] = { q, k, v }, *pre[6] = { raw, o, g, lo, beta, lo_g };
    glm_matmul_multi(be, pre, h, proj, 6, n, 1u << 4);
    int r = 0;
    for (int i = 0; i < ns; r += seg[i++].n) conv_seq(l, be, sts[i], dst, pre, r, seg[i].n);
    MT_ASSERT(r == n);
    gates_rows(l, be, g, gate, raw, lo, lo_g, false, n);
    r = 0;
    for (int i = 0; i < ns; r += seg[i++].n) delta_seq(l, be, sts[i], b, r, seg[i].n);
    be->ops->gated_rmsnorm(be, raw, o, gate, w->o_norm, (int64_t)n * nh, dk, c->rms_norm_eps);
    be->ops->matmul(be, out, raw, &w->o, n);
    return MT_OK;
}
