/* worker/runtime/prefix_cache.h: kept prompt prefixes for reuse. An entry is the model state
 * after tokens[0, len) of an earlier prompt, held as a sequence of its own (its pages shared with
 * the sequence it was taken from, its recurrent slot and aux state copied), so a later prompt that
 * starts with those tokens copies the state in instead of prefilling them. Entries live within a
 * byte budget; the least recently used goes first.
 *
 * Ownership: the cache owns its entries' token copies and sequences; rt_prefix_cache_release
 * frees them. The model is borrowed and must outlive the cache. One thread at a time.
 */
#ifndef RT_PREFIX_CACHE_H
#define RT_PREFIX_CACHE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/mt.h"
#include "worker/model/model.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct rt_prefix {
    int32_t *tokens;           /* [len] */
    int len;
    mt_seq *snap;              /* a sequence of capacity len, at len */
    size_t bytes;              /* mt_seq_bytes(snap) */
    uint64_t last_used;        /* the caller's clock when last hit or kept */
} rt_prefix;

typedef struct rt_prefix_cache {
    mt_model *model;
    size_t budget;             /* bytes the entries may hold together; 0: the cache is off */
    rt_prefix *entries;        /* [n], unordered */
    int n, cap;
    size_t bytes;              /* held now */
    uint64_t hits, misses;
} rt_prefix_cache;

void rt_prefix_cache_init(rt_prefix_cache *c, mt_model *m, size_t budget);
void rt_prefix_cache_release(rt_prefix_cache *c); /* frees every entry; an empty cache is fine */

/* The longest kept prefix of prompt[0, n) that leaves at least one token; -1 when none. */
int rt_prefix_find(const rt_prefix_cache *c, const int32_t *prompt, int n);
/* Copies entry i's state into dst (a fresh sequence) and marks it used at `now`; counts a hit,
 * or with i < 0 or a failed copy a miss (err says why the copy failed). Returns the positions
 * restored (0 on a miss). */
int rt_prefix_restore(rt_prefix_cache *c, int i, mt_seq *dst, uint64_t now, mt_error *err);
/* Keeps src's state (exactly at len, the state after tokens[0, len)) as an entry used at `now`,
 * evicting the least recently used entries to stay within the budget. Best effort: any failure
 * (no slot, no pages, no memory, larger than the budget) keeps nothing. */
void rt_prefix_keep(rt_prefix_cache *c, const mt_seq *src, const int32_t *tokens, int len, uint64_t now);
/* Drops the least recently used entry; false when none is kept. */
bool rt_prefix_evict_one(rt_prefix_cache *c);

#ifdef __cplusplus
}
#endif
#endif /* RT_PREFIX_CACHE_H */
