/* worker/model/glm/glm_shard.c: tensor parallelism for glm5_next. A group of tp_size ranks splits
 * the model so that each rank reads and holds about 1/tp_size of it:
 *   - KDA: heads (q, k, v, conv, gates, b; the o_proj's input columns); each rank keeps its heads'
 *     conv and recurrent state, so the slot pool per rank is 1/tp_size;
 *   - DSA/MLA: query heads (q_b and kv_b rows, o_proj's input columns); the latent, its cache and
 *     the indexer are replicated (one latent head; the indexer's top-k must agree on every rank);
 *   - MLP, shared expert and every routed expert: gate/up rows and down columns (the
 *     intermediate size); the router is replicated, so every rank routes alike;
 *   - embedding and lm_head: vocab rows; the embedding reads the other ranks' rows as zeros
 *     (mt_weight.row0) and the sum over ranks gives each row; the head's slices are gathered;
 *   - hyper-connections and norms: replicated.
 * Each mixer's and MLP's output is then a partial sum, all-reduced before the hyper-connection
 * that follows it (glm_layer.c). */
#include <string.h>

#include "worker/model/glm/glm_impl.h"

mt_status glm_shard_plan(glm_model *m, mt_error *err) {
    const glm_config *c = &m->cfg;
    const int N = m->comm ? m->comm->size : 1;
    m->tp_size = N;
    m->tp_rank = m->comm ? m->comm->rank : 0;
    m->lcfg = *c;
    m->v_lo = 0;
    m->v_n = c->vocab_size;
    if (N == 1) return MT_OK;
    const struct {
        const char *name;
        int *field;
    } split[] = {
        { "linear_num_heads (KDA heads)", &m->lcfg.linear_num_heads },
        { "num_attention_heads (MLA query heads)", &m->lcfg.num_attention_heads },
        { "num_key_value_heads", &m->lcfg.num_key_value_heads },
        { "intermediate_size (dense MLP)", &m->lcfg.intermediate_size },
        { "moe_intermediate_size (each expert)", &m->lcfg.moe_intermediate_size },
        { "vocab_size (embedding and lm_head)", &m->v_n },
    };
    for (size_t i = 0; i < sizeof split / sizeof split[0]; i++) {
        if (*split[i].field % N != 0)
            return mt_errorf(err, MT_ERR_INVALID, "tensor parallelism over %d ranks: %s = %d is not a multiple of %d", N,
                             split[i].name, *split[i].field, N);
        *split[i].field /= N;
    }
    m->v_lo = m->tp_rank * m->v_n;
    return MT_OK;
}

mt_status glm_all_reduce(mt_comm *comm, float *buf, size_t count) {
    if (!comm) return MT_OK; /* a one-rank communicator still runs: its path is the group's */
    return comm->ops->all_reduce_sum(comm, buf, count);
}

mt_status glm_gather_logits(glm_model *m, int rows) {
    if (m->tp_size == 1) return MT_OK;
    mt_backend *be = m->be;
    const size_t part = (size_t)rows * m->v_n;
    mt_status st = m->comm->ops->all_gather(m->comm, m->logits_local, m->logits_gather, part);
    if (st != MT_OK) return st;
    /* [rank, row, v_n] -> [row, rank * v_n] */
    const size_t V = (size_t)m->cfg.vocab_size;
    for (int r = 0; r < m->tp_size; r++)
        for (int i = 0; i < rows; i++)
            be->ops->copy(be, m->logits + (size_t)i * V + (size_t)r * m->v_n, m->logits_gather + (size_t)r * part + (size_t)i * m->v_n,
                          sizeof(float) * (size_t)m->v_n);
    return MT_OK;
}

void glm_model_load_bytes(const glm_model *m, size_t *split_read, size_t *split_total, size_t *replicated) {
    *split_read = m->bytes_sharded_read;
    *split_total = m->bytes_sharded_total;
    *replicated = m->bytes_replicated;
}
