/* router/admission.h: the bounded admission queue. Requests that passed validation wait here, in
 * arrival order, until a worker has room; a full queue is the caller's RESOURCE_EXHAUSTED.
 *
 * Intrusive: the queued object embeds an rtr_qnode, so push, pop and remove (a cancelled request
 * leaves from the middle) are O(1) and never allocate. The queue does not own the objects.
 * Not thread-safe: the router's event-loop thread owns it.
 */
#ifndef RTR_ADMISSION_H
#define RTR_ADMISSION_H

#include <stdbool.h>
#include <stddef.h>

#include "common/mt.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct rtr_qnode {
    struct rtr_qnode *prev, *next; /* both NULL while not queued */
    bool queued;
} rtr_qnode;

typedef struct rtr_admission {
    rtr_qnode head;  /* sentinel */
    size_t len;
    size_t capacity;
} rtr_admission;

/* capacity 0 is allowed: nothing waits, a request is admitted only when a worker has room now. */
void rtr_admission_init(rtr_admission *q, size_t capacity);

/* Appends n. MT_ERR_FULL (queue unchanged) when len == capacity; MT_ERR_STATE if n is queued. */
mt_status rtr_admission_push(rtr_admission *q, rtr_qnode *n);

/* Puts n back at the front, ignoring the capacity (a dispatch that failed to reach its worker
 * returns its request where it was). MT_ERR_STATE if n is queued. */
mt_status rtr_admission_push_front(rtr_admission *q, rtr_qnode *n);

/* Removes and returns the oldest node, NULL when empty. */
rtr_qnode *rtr_admission_pop(rtr_admission *q);

/* Removes n if it is queued; no-op otherwise. */
void rtr_admission_remove(rtr_admission *q, rtr_qnode *n);

static inline size_t rtr_admission_len(const rtr_admission *q) { return q->len; }

#ifdef __cplusplus
}
#endif
#endif /* RTR_ADMISSION_H */
