/* router/admission.c: see admission.h. A circular doubly-linked list around a sentinel. */
#include "router/admission.h"

void rtr_admission_init(rtr_admission *q, size_t capacity) {
    q->head.prev = q->head.next = &q->head;
    q->head.queued = false;
    q->len = 0;
    q->capacity = capacity;
}

static void link_after(rtr_admission *q, rtr_qnode *at, rtr_qnode *n) {
    n->prev = at;
    n->next = at->next;
    at->next->prev = n;
    at->next = n;
    n->queued = true;
    q->len++;
}

mt_status rtr_admission_push(rtr_admission *q, rtr_qnode *n) {
    if (n->queued) return MT_ERR_STATE;
    if (q->len >= q->capacity) return MT_ERR_FULL;
    link_after(q, q->head.prev, n);
    return MT_OK;
}

mt_status rtr_admission_push_front(rtr_admission *q, rtr_qnode *n) {
    if (n->queued) return MT_ERR_STATE;
    link_after(q, &q->head, n);
    return MT_OK;
}

void rtr_admission_remove(rtr_admission *q, rtr_qnode *n) {
    if (!n->queued) return;
    n->prev->next = n->next;
    n->next->prev = n->prev;
    n->prev = n->next = NULL;
    n->queued = false;
    q->len--;
}

rtr_qnode *rtr_admission_pop(rtr_admission *q) {
    if (q->len == 0) return NULL;
    rtr_qnode *n = q->head.next;
    rtr_admission_remove(q, n);
    return n;
}
