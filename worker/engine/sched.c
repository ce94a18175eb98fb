/* worker/engine/sched.c: see sched.h. */
#include "worker/engine/sched.h"

sched_verdict sched_admit(const sched_room *room, const sched_req *r, bool preempt, bool can_evict) {
    if (room->cache_budget && room->cache_bytes + r->bytes_max > room->cache_budget) return SCHED_WAIT;
    if (room->slots_free == 0) return can_evict ? SCHED_EVICT : SCHED_WAIT;
    if (room->paged) {
        const int len = preempt ? r->n_feed + 1 : r->n_prompt + r->max_new_tokens;
        const int need = (len + room->page_tokens - 1) / room->page_tokens;
        if (room->pages_free < need) return can_evict ? SCHED_EVICT : room->n_running > 0 ? SCHED_WAIT : SCHED_ADMIT;
    }
    return SCHED_ADMIT;
}

int sched_prefill_chunk(int n_feed, int prefilled, int budget, int snap_at) {
    const int rem = n_feed - prefilled;
    int k = rem < budget ? rem : budget;
    if (snap_at > prefilled && prefilled + k > snap_at) k = snap_at - prefilled;
    return k;
}

int sched_prefix_boundary(int n_prompt, int block, int prefilled, int n_gen) {
    const int at = (n_prompt - 1) / block * block;
    return at > prefilled && n_gen == 0 ? at : 0;
}

int sched_victim(const bool *holds, int n_running, int self) {
    for (int i = n_running - 1; i > self; i--)
        if (holds[i]) return i;
    return -1;
}
