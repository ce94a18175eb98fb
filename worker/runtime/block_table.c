/* worker/runtime/block_table.c: see block_table.h. */
#include "worker/runtime/block_table.h"

#include <stdlib.h>

/* An upload in the backend's order of work, without a round trip where the backend offers one. */
static void upload_ordered(mt_backend *be, void *dst, const void *src, size_t bytes) {
    (be->ops->upload_async ? be->ops->upload_async : be->ops->upload)(be, dst, src, bytes);
}

mt_status rt_bt_init(rt_block_table *t, mt_backend *be, int max_blocks) {
    *t = (rt_block_table){ .max_blocks = max_blocks };
    t->host = calloc((size_t)max_blocks, sizeof(int32_t));
    t->dev = be->ops->alloc(be, sizeof(int32_t) * (size_t)max_blocks);
    if (t->host && t->dev) return MT_OK;
    free(t->host);
    be->ops->free(be, t->dev);
    *t = (rt_block_table){ 0 };
    return MT_ERR_NOMEM;
}

void rt_bt_release(rt_block_table *t, mt_backend *be, rt_id_pool *pages) {
    if (t->host) rt_bt_unmap(t, pages, 0);
    free(t->host);
    be->ops->free(be, t->dev);
    *t = (rt_block_table){ 0 };
}

mt_status rt_bt_map(rt_block_table *t, mt_backend *be, rt_id_pool *pages, int blocks) {
    if (blocks <= t->n_blocks) return MT_OK;
    if (blocks > t->max_blocks || blocks - t->n_blocks > pages->n_free) return MT_ERR_FULL;
    const int first = t->n_blocks;
    for (int b = first; b < blocks; b++) t->host[b] = rt_id_take(pages);
    t->n_blocks = blocks;
    upload_ordered(be, t->dev + first, t->host + first, sizeof(int32_t) * (size_t)(blocks - first));
    return MT_OK;
}

void rt_bt_unmap(rt_block_table *t, rt_id_pool *pages, int from) {
    for (int b = from; b < t->n_blocks; b++) rt_id_drop(pages, t->host[b]);
    if (from < t->n_blocks) t->n_blocks = from;
}

mt_status rt_bt_share(rt_block_table *t, mt_backend *be, rt_id_pool *pages, const rt_block_table *src,
                      int shared, int own) {
    rt_bt_unmap(t, pages, 0);
    MT_ASSERT(shared <= src->n_blocks && shared + own <= t->max_blocks);
    if (own > pages->n_free) return MT_ERR_FULL;
    for (int b = 0; b < shared; b++) {
        t->host[b] = src->host[b];
        rt_id_share(pages, src->host[b]);
    }
    for (int b = shared; b < shared + own; b++) t->host[b] = rt_id_take(pages);
    t->n_blocks = shared + own;
    if (t->n_blocks) be->ops->upload(be, t->dev, t->host, sizeof(int32_t) * (size_t)t->n_blocks);
    return MT_OK;
}
