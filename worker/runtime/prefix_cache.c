/* worker/runtime/prefix_cache.c: see prefix_cache.h. */
#include "worker/runtime/prefix_cache.h"

#include <stdlib.h>
#include <string.h>

void rt_prefix_cache_init(rt_prefix_cache *c, mt_model *m, size_t budget) {
    *c = (rt_prefix_cache){ .model = m, .budget = budget };
}

static void drop(rt_prefix_cache *c, int i) {
    rt_prefix *p = &c->entries[i];
    c->bytes -= p->bytes;
    mt_seq_free(p->snap);
    free(p->tokens);
    c->entries[i] = c->entries[--c->n];
}

void rt_prefix_cache_release(rt_prefix_cache *c) {
    while (c->n > 0) drop(c, c->n - 1);
    free(c->entries);
    c->entries = NULL;
    c->cap = 0;
}

int rt_prefix_find(const rt_prefix_cache *c, const int32_t *prompt, int n) {
    int best = -1;
    for (int i = 0; i < c->n; i++) {
        const rt_prefix *p = &c->entries[i];
        if (p->len < n && (best < 0 || p->len > c->entries[best].len) &&
            !memcmp(p->tokens, prompt, sizeof(int32_t) * (size_t)p->len))
            best = i;
    }
    return best;
}

int rt_prefix_restore(rt_prefix_cache *c, int i, mt_seq *dst, uint64_t now, mt_error *err) {
    if (i < 0 || mt_seq_copy_prefix(c->model, c->entries[i].snap, dst, err) != MT_OK) {
        c->misses++;
        return 0;
    }
    c->entries[i].last_used = now;
    c->hits++;
    return c->entries[i].len;
}

static bool kept(const rt_prefix_cache *c, const int32_t *tokens, int len) {
    for (int i = 0; i < c->n; i++)
        if (c->entries[i].len == len && !memcmp(c->entries[i].tokens, tokens, sizeof(int32_t) * (size_t)len))
            return true;
    return false;
}

bool rt_prefix_evict_one(rt_prefix_cache *c) {
    if (c->n == 0) return false;
    int lru = 0;
    for (int i = 1; i < c->n; i++)
        if (c->entries[i].last_used < c->entries[lru].last_used) lru = i;
    drop(c, lru);
    return true;
}

void rt_prefix_keep(rt_prefix_cache *c, const mt_seq *src, const int32_t *tokens, int len, uint64_t now) {
    if (!c->budget || kept(c, tokens, len)) return;
    mt_seq *snap = NULL;
    mt_error err = { "" };
    if (mt_seq_new(c->model, len, &snap, &err) != MT_OK) return;
    if (mt_seq_copy_prefix(c->model, src, snap, &err) != MT_OK || mt_seq_bytes(snap) > c->budget) {
        mt_seq_free(snap);
        return;
    }
    const size_t bytes = mt_seq_bytes(snap); /* its slot and its pages (shared with src) */
    while (c->bytes + bytes > c->budget && rt_prefix_evict_one(c)) {}
    int32_t *copy = malloc(sizeof(int32_t) * (size_t)len);
    if (c->n == c->cap) {
        const int cap = c->cap ? 2 * c->cap : 16;
        rt_prefix *grown = realloc(c->entries, sizeof *grown * (size_t)cap);
        if (grown) {
            c->entries = grown;
            c->cap = cap;
        }
    }
    if (!copy || c->n == c->cap) {
        free(copy);
        mt_seq_free(snap);
        return;
    }
    memcpy(copy, tokens, sizeof(int32_t) * (size_t)len);
    c->entries[c->n++] = (rt_prefix){ copy, len, snap, bytes, now };
    c->bytes += bytes;
}
