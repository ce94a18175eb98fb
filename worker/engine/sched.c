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

/* Running means weigh the latest step by 1/8: a few steps follow a change in the batch, one
 * odd step (a page fault, a host hiccup) moves the estimate little. */
#define PACE_WEIGHT 0.125

void sched_pace_init(sched_pace *p) {
    *p = (sched_pace){ .base_ms = -1.0, .per_token_ms = -1.0 };
}

static double pace_mean(double old, double x) { return old < 0 ? x : old + PACE_WEIGHT * (x - old); }

void sched_pace_note(sched_pace *p, double ms, int tokens, int rows) {
    if (!(ms >= 0) || tokens < 0 || rows < 0) return;
    if (tokens == 0) {
        if (rows > 0) p->base_ms = pace_mean(p->base_ms, ms);
        return;
    }
    if (p->base_ms <= 0) return;
    const double x = tokens, y = ms > p->base_ms ? ms - p->base_ms : 0.0;
    const double keep = p->s0 > 0 ? 1.0 - PACE_WEIGHT : 0.0;
    p->s0 = keep * p->s0 + 1.0;
    p->sx = keep * p->sx + x;
    p->sy = keep * p->sy + y;
    p->sxx = keep * p->sxx + x * x;
    p->sxy = keep * p->sxy + x * y;
    const double mx = p->sx / p->s0, my = p->sy / p->s0;
    const double vx = p->sxx / p->s0 - mx * mx, cxy = p->sxy / p->s0 - mx * my;
    /* a line only where the chunk sizes spread (10% of their mean) and it is a cost: a positive
     * slope and a non-negative intercept; otherwise the steps are charged per token alone */
    if (vx > 0.01 * mx * mx && cxy > 0) {
        const double slope = cxy / vx, icpt = my - slope * mx;
        if (icpt >= 0) {
            p->per_token_ms = slope;
            p->chunk_ms = icpt;
            return;
        }
    }
    p->per_token_ms = my / mx;
    p->chunk_ms = 0.0;
}

int sched_pace_budget(const sched_pace *p, double target_ms, int rows, int floor, int cap) {
    if (floor > cap) floor = cap;
    if (target_ms <= 0 || rows == 0 || p->per_token_ms <= 0) return cap;
    const double base = p->base_ms > 0 ? p->base_ms : 0.0;
    const double t = (target_ms - base - p->chunk_ms) / p->per_token_ms;
    if (t <= floor) return floor;
    return t >= cap ? cap : (int)t;
}

int sched_mixed_budget(int budget, int rows, int pass, int floor) {
    if (pass < 1 || rows < 0 || budget < 1) return budget;
    const int total = rows + budget, whole = total / pass * pass;
    if (whole == total || whole - rows < floor) return budget;
    return whole - rows;
}

bool sched_deadline_hopeless(const sched_pace *p, int tokens, double remaining_ms) {
    return p->per_token_ms > 0 && tokens > 0 && p->chunk_ms + tokens * p->per_token_ms > remaining_ms;
}

bool sched_hold_prefill(double hold_ms, double held_ms, int rows, int waiting, int places, int ready, int budget) {
    return hold_ms > 0 && held_ms < hold_ms && rows > 0 && places > 0 && waiting > places && 2 * (long)ready < budget;
}
