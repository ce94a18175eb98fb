/* worker/text/tokenizer_impl.h: the tokenizer's tables, shared by its loader (tokenizer.c), its
 * encoder (tok_encode.c) and its decoder (tok_decode.c). Not for other modules: they use
 * tokenizer.h. */
#ifndef TOK_TOKENIZER_IMPL_H
#define TOK_TOKENIZER_IMPL_H

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "worker/text/tokenizer.h"

/* Open-addressing map from a byte string (in the tokenizer's arena) to an id. */
typedef struct tok_strmap {
    uint32_t *slots;        /* [cap] entry index + 1; 0 = empty */
    uint32_t cap;           /* power of two */
} tok_strmap;

/* Map from an adjacent pair of ids to the merge that joins them. */
typedef struct tok_merge {
    uint64_t key;           /* (left << 32) | right; UINT64_MAX = empty slot */
    int32_t rank;           /* lower merges first */
    int32_t id;             /* the merged token */
} tok_merge;

/* One added token (tokenizer.json "added_tokens"). */
typedef struct tok_added {
    int32_t id;
    uint32_t off, len;      /* content in the arena */
    bool special, single_word, lstrip, rstrip, normalized;
} tok_added;

/* A byte trie over added tokens' contents for leftmost-longest matching. Node 0 is the root. */
typedef struct tok_trie {
    int32_t (*next)[256];   /* [n_nodes][256] child node, 0 = none */
    int32_t *added;         /* [n_nodes] index into tok_tokenizer.added, -1 = no token ends here */
    int n_nodes;
    bool first[256];        /* bytes that start some token */
} tok_trie;

#define TOK_MAX_SPLITS 8

/* The position of the template's sequence among its special tokens. */
typedef struct tok_template {
    int32_t *ids;           /* [n_before + n_after] */
    int n_before, n_after;
} tok_template;

struct tok_tokenizer {
    char *arena;            /* every token's bytes and added contents */
    size_t arena_len, arena_cap;

    int32_t n_ids;          /* largest id + 1 */
    uint32_t *tok_off;      /* [n_ids] raw bytes of each id in the arena */
    uint32_t *tok_len;      /* [n_ids] UINT32_MAX = no token */
    uint8_t *tok_flags;     /* [n_ids] TOK_F_* */

    /* model vocabulary by raw bytes (entries = model ids, for ignore_merges and look-ups) */
    tok_strmap vocab;
    int32_t *vocab_ids;     /* [n_vocab] */
    uint32_t n_vocab;
    int32_t byte_id[256];   /* the id of each single byte, -1 = none (the byte is dropped) */
    bool ignore_merges;

    tok_merge *merges;      /* [merge_cap] */
    uint32_t merge_cap;     /* power of two */

    tok_added *added;       /* [n_added] */
    int n_added;
    tok_trie trie_raw;      /* normalized false: matched in the raw text */
    tok_trie trie_norm;     /* normalized true: matched in the pieces between */
    bool any_single_word;
    pcre2_code *word_char;  /* Rust regex's \w, for single_word; NULL when unused */

    pcre2_code *split[TOK_MAX_SPLITS]; /* the pre-tokenizer's regexes, applied in order */
    int n_split;
    bool split_jit;

    tok_template post;

    int32_t bos, pad;
    int32_t *eos;
    int n_eos;
    char *chat_template;
};

enum {
    TOK_F_ADDED = 1,        /* an added token */
    TOK_F_SPECIAL = 2,      /* an added token marked special */
};

/* The word cache of an encoder: direct-mapped by a hash of the word's bytes. */
#define TOK_CACHE_SLOTS 16384
#define TOK_CACHE_WORD 24   /* longest word cached, bytes */
#define TOK_CACHE_IDS 12    /* most ids of a cached word */
typedef struct tok_cache_slot {
    uint8_t word[TOK_CACHE_WORD];
    uint8_t len;            /* 0 = empty */
    uint8_t n_ids;
    int32_t ids[TOK_CACHE_IDS];
} tok_cache_slot;

/* One symbol of a word being merged: a doubly linked list over the word's bytes. */
typedef struct tok_sym {
    int32_t id;
    int32_t prev, next;     /* -1 = none */
    int32_t len;            /* bytes; 0 = merged into its left neighbour */
} tok_sym;

/* A candidate merge in the heap: ordered by rank, then by position. */
typedef struct tok_cand {
    int32_t rank;
    int32_t pos;            /* the left symbol */
    int32_t id;             /* the merged token when pushed */
} tok_cand;

struct tok_encoder {
    const tok_tokenizer *t;
    pcre2_match_data *md;
    pcre2_match_context *mctx;
    pcre2_jit_stack *jit_stack;
    tok_cache_slot *cache;  /* [TOK_CACHE_SLOTS] */
    tok_sym *syms;          /* merge workspace, grown to the longest word */
    tok_cand *heap;
    size_t ws_cap;
};

static inline uint64_t tok_hash_u64(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    return x ^ (x >> 33);
}

/* The merge of the pair (a, b), or NULL. */
static inline const tok_merge *tok_merge_find(const tok_tokenizer *t, int32_t a, int32_t b) {
    uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    uint32_t mask = t->merge_cap - 1;
    for (uint32_t i = (uint32_t)tok_hash_u64(key) & mask;; i = (i + 1) & mask) {
        const tok_merge *m = &t->merges[i];
        if (m->key == key) return m;
        if (m->key == UINT64_MAX) return NULL;
    }
}

/* The model id whose raw bytes are p[0..n), or -1. */
int32_t tok_vocab_find(const tok_tokenizer *t, const uint8_t *p, size_t n);

/* Strict UTF-8 check (no surrogates, no overlongs, <= U+10FFFF). Returns the offset of the first
 * bad byte, or len when s is valid. */
size_t tok_utf8_check(const uint8_t *s, size_t len);

/* Bytes of id, or NULL (see tok_id_to_bytes). */
static inline const uint8_t *tok_bytes_of(const tok_tokenizer *t, int32_t id, size_t *len) {
    if (id < 0 || id >= t->n_ids || t->tok_len[id] == UINT32_MAX) return NULL;
    *len = t->tok_len[id];
    return (const uint8_t *)t->arena + t->tok_off[id];
}

/* Grows v to hold at least need ids. */
mt_status tok_ids_reserve(tok_ids *v, size_t need);
mt_status tok_text_reserve(tok_text *t, size_t need);

#endif /* TOK_TOKENIZER_IMPL_H */
