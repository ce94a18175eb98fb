/* worker/runtime/id_pool.h: pools of numbered places in preallocated state memory: the cache
 * pages (reference-counted: sequences sharing a prompt prefix map the same page) and the
 * recurrent-state slots (one owner each). They hand out ids only; which memory an id addresses is
 * the model's business (a page id is a row of every paged layer's cache, a slot id a row of every
 * recurrent layer's state).
 *
 * Ownership: the pool owns its arrays; rt_id_pool_free releases them (NULL ok). Thread-safety: one
 * thread at a time (the engine thread).
 */
#ifndef RT_ID_POOL_H
#define RT_ID_POOL_H

#include <stdbool.h>
#include <stdint.h>

#include "common/mt.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct rt_id_pool {
    int n;                     /* ids 0 .. n-1; 0 until made */
    int n_free;
    int32_t *free_ids;         /* [n] stack of free ids, popped from the end (ascending ids first) */
    int32_t *refs;             /* [n] holders of each id */
} rt_id_pool;

/* Makes a pool of n ids, all free. MT_ERR_NOMEM leaves p empty. */
mt_status rt_id_pool_init(rt_id_pool *p, int n);
void rt_id_pool_release(rt_id_pool *p); /* back to empty; an empty pool is fine */
/* A free id with one holder; -1 when none is free. */
int32_t rt_id_take(rt_id_pool *p);
/* One more holder of a taken id (a shared page). */
void rt_id_share(rt_id_pool *p, int32_t id);
/* One holder fewer; the id is free again with none left. */
void rt_id_drop(rt_id_pool *p, int32_t id);

#ifdef __cplusplus
}
#endif
#endif /* RT_ID_POOL_H */
