/* worker/runtime/block_table.h: a sequence's block table: block b (positions [b*page, (b+1)*page))
 * lives on page host[b] of the page pool. The table has a host copy (the allocator's view) and a
 * backend copy (what the paged ops read at run time, kernels/backend.h mt_paged).
 *
 * Ownership: the table owns both copies; rt_bt_release drops every mapped page and frees them.
 * The pool and backend are borrowed and must outlive the table. One thread at a time.
 */
#ifndef RT_BLOCK_TABLE_H
#define RT_BLOCK_TABLE_H

#include "common/mt.h"
#include "kernels/backend.h"
#include "worker/runtime/id_pool.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct rt_block_table {
    int n_blocks;              /* blocks mapped to pages */
    int max_blocks;            /* capacity */
    int32_t *host;             /* [max_blocks] host */
    int32_t *dev;              /* [max_blocks] backend memory */
} rt_block_table;

/* An empty table of max_blocks entries. MT_ERR_NOMEM leaves t empty. */
mt_status rt_bt_init(rt_block_table *t, mt_backend *be, int max_blocks);
/* Drops every mapped page and frees the table (an empty table is fine). */
void rt_bt_release(rt_block_table *t, mt_backend *be, rt_id_pool *pages);
/* Maps pages until `blocks` are mapped; the new entries go up in the backend's order of work, so
 * a step in flight still reads the old ones. MT_ERR_FULL, with nothing changed, when the pool or
 * the table is short. */
mt_status rt_bt_map(rt_block_table *t, mt_backend *be, rt_id_pool *pages, int blocks);
/* Drops the pages of blocks [from, n_blocks). */
void rt_bt_unmap(rt_block_table *t, rt_id_pool *pages, int from);
/* Makes t (emptied first) map src's first `shared` blocks to the same pages (one more holder
 * each) and then `own` fresh pages; the whole table goes up. MT_ERR_FULL, with t emptied, when the
 * pool is short of the fresh pages. */
mt_status rt_bt_share(rt_block_table *t, mt_backend *be, rt_id_pool *pages, const rt_block_table *src,
                      int shared, int own);

#ifdef __cplusplus
}
#endif
#endif /* RT_BLOCK_TABLE_H */
