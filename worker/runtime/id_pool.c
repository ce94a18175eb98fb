/* worker/runtime/id_pool.c: see id_pool.h. */
#include "worker/runtime/id_pool.h"

#include <stdlib.h>

mt_status rt_id_pool_init(rt_id_pool *p, int n) {
    *p = (rt_id_pool){ 0 };
    if (n < 1) return MT_ERR_INVALID;
    p->free_ids = malloc(sizeof(int32_t) * (size_t)n);
    p->refs = calloc((size_t)n, sizeof(int32_t));
    if (!p->free_ids || !p->refs) {
        rt_id_pool_release(p);
        return MT_ERR_NOMEM;
    }
    for (int i = 0; i < n; i++) p->free_ids[i] = n - 1 - i;
    p->n = p->n_free = n;
    return MT_OK;
}

void rt_id_pool_release(rt_id_pool *p) {
    free(p->free_ids);
    free(p->refs);
    *p = (rt_id_pool){ 0 };
}

int32_t rt_id_take(rt_id_pool *p) {
    if (p->n_free == 0) return -1;
    const int32_t id = p->free_ids[--p->n_free];
    p->refs[id] = 1;
    return id;
}

void rt_id_share(rt_id_pool *p, int32_t id) {
    MT_ASSERT(id >= 0 && id < p->n && p->refs[id] > 0);
    p->refs[id]++;
}

void rt_id_drop(rt_id_pool *p, int32_t id) {
    MT_ASSERT(id >= 0 && id < p->n && p->refs[id] > 0);
    if (--p->refs[id] == 0) p->free_ids[p->n_free++] = id;
}
