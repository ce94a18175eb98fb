/* worker/text/tokenizer.c: loading tokenizer.json and the two configs into the tables of
 * tokenizer_impl.h. See tokenizer.h for what is accepted. */
#include "worker/text/tokenizer_impl.h"

#include <errno.h>
#include <json-c/json.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* GPT-2's pattern, which the ByteLevel pre-tokenizer applies when its use_regex is true. */
static const char GPT2_SPLIT[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

/* What Rust's regex crate calls \w, which the library uses for single_word. */
static const char WORD_CHAR[] = "[\\p{Alphabetic}\\p{M}\\p{Nd}\\p{Pc}\\p{Join_Control}]";

/* ---- small helpers ---------------------------------------------------------------------- */

static uint64_t hash_bytes(const uint8_t *p, size_t n) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ull;
    return h ^ (h >> 29);
}

static uint32_t pow2_at_least(size_t n) {
    uint32_t c = 16;
    while (c < n) c <<= 1;
    return c;
}

/* Appends n bytes to the arena; returns their offset, or UINT32_MAX on out of memory. */
static uint32_t arena_add(tok_tokenizer *t, const void *p, size_t n) {
    if (t->arena_len + n > t->arena_cap) {
        size_t cap = t->arena_cap ? t->arena_cap * 2 : 1 << 16;
        while (cap < t->arena_len + n) cap *= 2;
        if (cap > UINT32_MAX) return UINT32_MAX;
        char *a = realloc(t->arena, cap);
        if (!a) return UINT32_MAX;
        t->arena = a;
        t->arena_cap = cap;
    }
    memcpy(t->arena + t->arena_len, p, n);
    uint32_t off = (uint32_t)t->arena_len;
    t->arena_len += n;
    return off;
}

/* ---- the ByteLevel alphabet ---------------------------------------------------------------
 * Every byte has a printable code point: the printable Latin-1 bytes (33-126, 161-172, 174-255)
 * stand for themselves, the others take 256, 257, ... in byte order. */

#define BYTE_CHAR_LIMIT 324 /* every code point of the alphabet is below this */
static int16_t char_to_byte[BYTE_CHAR_LIMIT];
static uint16_t byte_to_char[256];

static void byte_alphabet_fill(void) {
    for (int c = 0; c < BYTE_CHAR_LIMIT; c++) char_to_byte[c] = -1;
    int extra = 0;
    for (int b = 0; b < 256; b++) {
        bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
        int c = printable ? b : 256 + extra++;
        byte_to_char[b] = (uint16_t)c;
        char_to_byte[c] = (int16_t)b;
    }
}

static void byte_alphabet_init(void) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, byte_alphabet_fill);
}

/* Decodes one UTF-8 character of s[0..n) (already valid UTF-8 from json-c); returns its length. */
static int utf8_next(const uint8_t *s, size_t n, uint32_t *cp) {
    uint8_t c = s[0];
    if (c < 0x80 || n < 2) { *cp = c; return 1; }
    if (c < 0xe0) { *cp = ((uint32_t)(c & 0x1f) << 6) | (s[1] & 0x3f); return 2; }
    if (c < 0xf0 || n < 4) {
        if (n < 3) { *cp = c; return 1; }
        *cp = ((uint32_t)(c & 0x0f) << 12) | ((uint32_t)(s[1] & 0x3f) << 6) | (s[2] & 0x3f);
        return 3;
    }
    *cp = ((uint32_t)(c & 0x07) << 18) | ((uint32_t)(s[1] & 0x3f) << 12) |
          ((uint32_t)(s[2] & 0x3f) << 6) | (s[3] & 0x3f);
    return 4;
}

/* A token's string (tokenizer.json spelling) as the bytes the ByteLevel decoder writes for it:
 * each character through the alphabet when every one is in it, else the string's own UTF-8.
 * buf holds at least n bytes. Returns the length; *mapped says which rule applied. */
static size_t token_raw_bytes(const char *s, size_t n, uint8_t *buf, bool *mapped) {
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        i += (size_t)utf8_next((const uint8_t *)s + i, n - i, &cp);
        if (cp >= BYTE_CHAR_LIMIT || char_to_byte[cp] < 0) {
            memcpy(buf, s, n);
            *mapped = false;
            return n;
        }
        buf[o++] = (uint8_t)char_to_byte[cp];
    }
    *mapped = true;
    return o;
}

/* ---- the vocabulary map ------------------------------------------------------------------- */

int32_t tok_vocab_find(const tok_tokenizer *t, const uint8_t *p, size_t n) {
    if (!t->vocab.cap) return -1;
    uint32_t mask = t->vocab.cap - 1;
    for (uint32_t i = (uint32_t)hash_bytes(p, n) & mask;; i = (i + 1) & mask) {
        uint32_t e = t->vocab.slots[i];
        if (!e) return -1;
        int32_t id = t->vocab_ids[e - 1];
        if (t->tok_len[id] == n && memcmp(t->arena + t->tok_off[id], p, n) == 0) return id;
    }
}

/* Adds model id (whose bytes are set) to the map; a second id with the same bytes is ignored. */
static void vocab_insert(tok_tokenizer *t, int32_t id) {
    const uint8_t *p = (const uint8_t *)t->arena + t->tok_off[id];
    size_t n = t->tok_len[id];
    uint32_t mask = t->vocab.cap - 1;
    uint32_t i = (uint32_t)hash_bytes(p, n) & mask;
    for (;; i = (i + 1) & mask) {
        uint32_t e = t->vocab.slots[i];
        if (!e) break;
        int32_t other = t->vocab_ids[e - 1];
        if (t->tok_len[other] == n && memcmp(t->arena + t->tok_off[other], p, n) == 0) return;
    }
    t->vocab_ids[t->n_vocab] = id;
    t->vocab.slots[i] = ++t->n_vocab;
}

/* ---- merges ------------------------------------------------------------------------------- */

static void merge_put(tok_tokenizer *t, int32_t a, int32_t b, int32_t rank, int32_t id) {
    uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    uint32_t mask = t->merge_cap - 1;
    for (uint32_t i = (uint32_t)tok_hash_u64(key) & mask;; i = (i + 1) & mask) {
        tok_merge *m = &t->merges[i];
        if (m->key == UINT64_MAX || m->key == key) { /* a repeated pair takes the later rank */
            m->key = key;
            m->rank = rank;
            m->id = id;
            return;
        }
    }
}

/* ---- JSON helpers ------------------------------------------------------------------------- */

static const char *json_kind(json_object *v) {
    switch (json_object_get_type(v)) {
    case json_type_null: return "null";
    case json_type_boolean: return "a boolean";
    case json_type_double: return "a number";
    case json_type_int: return "an integer";
    case json_type_object: return "an object";
    case json_type_array: return "an array";
    case json_type_string: return "a string";
    }
    return "?";
}

static json_object *jget(json_object *o, const char *key) {
    json_object *v = NULL;
    if (!o || !json_object_is_type(o, json_type_object)) return NULL;
    return json_object_object_get_ex(o, key, &v) ? v : NULL;
}

static bool jnull(json_object *v) { return !v || json_object_is_type(v, json_type_null); }

static const char *jstr(json_object *o, const char *key) {
    json_object *v = jget(o, key);
    return v && json_object_is_type(v, json_type_string) ? json_object_get_string(v) : NULL;
}

static bool jbool(json_object *o, const char *key) {
    json_object *v = jget(o, key);
    return v && json_object_is_type(v, json_type_boolean) && json_object_get_boolean(v);
}

/* ---- the trie of added tokens --------------------------------------------------------------- */

static mt_status trie_add(tok_trie *tr, const uint8_t *p, size_t n, int32_t added_ix) {
    int node = 0;
    for (size_t i = 0; i < n; i++) {
        int32_t nx = tr->next[node][p[i]];
        if (!nx) {
            void *a = realloc(tr->next, sizeof *tr->next * (size_t)(tr->n_nodes + 1));
            if (!a) return MT_ERR_NOMEM;
            tr->next = a;
            a = realloc(tr->added, sizeof *tr->added * (size_t)(tr->n_nodes + 1));
            if (!a) return MT_ERR_NOMEM;
            tr->added = a;
            memset(tr->next[tr->n_nodes], 0, sizeof *tr->next);
            tr->added[tr->n_nodes] = -1;
            nx = tr->n_nodes++;
            tr->next[node][p[i]] = nx;
        }
        node = nx;
    }
    if (tr->added[node] < 0) tr->added[node] = added_ix; /* a repeated content keeps the first */
    tr->first[p[0]] = true;
    return MT_OK;
}

static mt_status trie_init(tok_trie *tr) {
    tr->next = calloc(1, sizeof *tr->next);
    tr->added = malloc(sizeof *tr->added);
    if (!tr->next || !tr->added) return MT_ERR_NOMEM;
    tr->added[0] = -1;
    tr->n_nodes = 1;
    return MT_OK;
}

static void trie_free(tok_trie *tr) {
    free(tr->next);
    free(tr->added);
}

/* ---- sections of tokenizer.json ------------------------------------------------------------- */

/* Unicode White_Space: what \s matches in the library's regex engine (Oniguruma). PCRE2's \s
 * with UCP also matches U+180E, which left White_Space in Unicode 6.3, so patterns spell it out. */
static const char WHITE_SPACE[] = "\\t-\\r\\x{20}\\x{85}\\x{a0}\\x{1680}\\x{2000}-\\x{200a}"
                                  "\\x{2028}\\x{2029}\\x{202f}\\x{205f}\\x{3000}";

/* Copies pattern with \s and \S replaced by WHITE_SPACE classes. Returns NULL when out of memory
 * or when \S stands inside a class (*bad set then), which has no plain spelling. */
static char *spell_white_space(const char *p, size_t len, bool *bad) {
    size_t cap = len * (sizeof WHITE_SPACE + 4) + 1, o = 0;
    char *out = malloc(cap);
    bool in_class = false;
    *bad = false;
    if (!out) return NULL;
    for (size_t i = 0; i < len; i++) {
        char c = p[i];
        if (c == '\\' && i + 1 < len) {
            char d = p[++i];
            if (d == 's' || d == 'S') {
                if (in_class && d == 'S') {
                    *bad = true;
                    free(out);
                    return NULL;
                }
                o += (size_t)sprintf(out + o, in_class ? "%s" : d == 's' ? "[%s]" : "[^%s]", WHITE_SPACE);
            } else {
                out[o++] = c;
                out[o++] = d;
            }
            continue;
        }
        if (!in_class && c == '[') {
            in_class = true;
            out[o++] = c;
            if (i + 1 < len && p[i + 1] == '^') out[o++] = p[++i];
            if (i + 1 < len && p[i + 1] == ']') out[o++] = p[++i]; /* a leading ] is literal */
            continue;
        }
        if (in_class && c == '[' && i + 1 < len && p[i + 1] == ':') { /* [:alpha:] */
            const char *end = strstr(p + i, ":]");
            size_t n = end && (size_t)(end - p) < len ? (size_t)(end - p) + 2 - i : 1;
            memcpy(out + o, p + i, n);
            o += n;
            i += n - 1;
            continue;
        }
        if (in_class && c == ']') in_class = false;
        out[o++] = c;
    }
    out[o] = 0;
    return out;
}

static mt_status compile_regex(tok_tokenizer *t, const char *pattern, size_t len, bool literal,
                               const char *what, mt_error *err) {
    if (t->n_split == TOK_MAX_SPLITS)
        return mt_errorf(err, MT_ERR_UNSUPPORTED, "pre_tokenizer: more than %d Split steps",
                         TOK_MAX_SPLITS);
    int ec;
    PCRE2_SIZE eo;
    uint32_t opts = PCRE2_UTF | PCRE2_UCP | (literal ? PCRE2_LITERAL : 0);
    char *spelled = NULL;
    if (!literal) {
        bool bad;
        if (!(spelled = spell_white_space(pattern, len, &bad)))
            return bad ? mt_errorf(err, MT_ERR_UNSUPPORTED, "pre_tokenizer: %s regex has \\S inside "
                                   "a class, which is not supported", what)
                       : mt_errorf(err, MT_ERR_NOMEM, "out of memory");
        pattern = spelled;
        len = strlen(spelled);
    }
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)pattern, len, opts, &ec, &eo, NULL);
    free(spelled);
    if (!re) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(ec, msg, sizeof msg);
        return mt_errorf(err, MT_ERR_UNSUPPORTED, "pre_tokenizer: %s regex does not compile with "
                         "PCRE2 (offset %zu, \\s spelled out): %s", what, (size_t)eo, (const char *)msg);
    }
    /* The JIT is optional: without one (or when it refuses) the interpreter runs the pattern. */
    t->split_jit = pcre2_jit_compile(re, PCRE2_JIT_COMPLETE) == 0 && (t->n_split == 0 || t->split_jit);
    t->split[t->n_split++] = re;
    return MT_OK;
}

static mt_status parse_byte_level(tok_tokenizer *t, json_object *p, const char *where, mt_error *err) {
    if (jbool(p, "add_prefix_space"))
        return mt_errorf(err, MT_ERR_UNSUPPORTED, "%s: ByteLevel add_prefix_space true is not "
                         "supported", where);
    json_object *ur = jget(p, "use_regex");
    bool use_regex = ur ? json_object_get_boolean(ur) : true; /* the library's default */
    if (use_regex) return compile_regex(t, GPT2_SPLIT, strlen(GPT2_SPLIT), false, "ByteLevel", err);
    return MT_OK;
}

static mt_status parse_split(tok_tokenizer *t, json_object *p, mt_error *err) {
    const char *beh = jstr(p, "behavior");
    if (!beh || strcmp(beh, "Isolated") != 0)
        return mt_errorf(err, MT_ERR_UNSUPPORTED, "pre_tokenizer: Split behavior %s is not "
                         "supported (only Isolated)", beh ? beh : "(missing)");
    if (jbool(p, "invert"))
        return mt_errorf(err, MT_ERR_UNSUPPORTED, "pre_tokenizer: Split invert true is not supported");
    json_object *pat = jget(p, "pattern");
    const char *re = jstr(pat, "Regex");
    if (re) return compile_regex(t, re, strlen(re), false, "Split", err);
    const char *lit = jstr(pat, "String");
    if (lit) return compile_regex(t, lit, strlen(lit), true, "Split", err);
    return mt_errorf(err, MT_ERR_INVALID, "pre_tokenizer: Split pattern is neither Regex nor String");
}

static mt_status parse_pre_tokenizer(tok_tokenizer *t, json_object *p, mt_error *err) {
    const char *type = jstr(p, "type");
    if (jnull(p) || !type)
        return mt_errorf(err, MT_ERR_UNSUPPORTED, "pre_tokenizer: none; only byte-level BPE "
                         "(a ByteLevel pre-tokenizer) is supported");
    if (strcmp(type, "ByteLevel") == 0) return parse_byte_level(t, p, "pre_tokenizer", err);
    if (strcmp(type, "Sequence") != 0)
        return mt_errorf(err, MT_ERR_UNSUPPORTED, "pre_tokenizer: type %s is not supported "
                         "(ByteLevel, or a Sequence of Split steps and ByteLevel)", type);
    json_object *list = jget(p, "pretokenizers");
    size_t n = list && json_object_is_type(list, json_type_array) ? json_object_array_length(list) : 0;
    if (n == 0) return mt_errorf(err, MT_ERR_INVALID, "pre_tokenizer: Sequence with no steps");
    for (size_t i = 0; i < n; i++) {
        json_object *s = json_object_array_get_idx(list, i);
        const char *st = jstr(s, "type");
        bool last = i + 1 == n;
        if (st && strcmp(st, "Split") == 0 && !last) {
            mt_status rc = parse_split(t, s, err);
            if (rc != MT_OK) return rc;
        } else if (st && strcmp(st, "ByteLevel") == 0 && last) {
            return parse_byte_level(t, s, "pre_tokenizer", err);
        } else {
            return mt_errorf(err, MT_ERR_UNSUPPORTED, "pre_tokenizer: step %zu is %s; only Split "
                             "steps followed by one ByteLevel are supported", i, st ? st : "untyped");
        }
    }
    return mt_errorf(err, MT_ERR_UNSUPPORTED, "pre_tokenizer: the Sequence does not end in "
                     "ByteLevel");
}

static mt_status parse_template(tok_tokenizer *t, json_object *p, mt_error *err) {
    if (t->post.ids)
        return mt_errorf(err, MT_ERR_UNSUPPORTED, "post_processor: more than one TemplateProcessing");
    json_object *single = jget(p, "single"), *specials = jget(p, "special_tokens");
    if (!single || !json_object_is_type(single, json_type_array))
        return mt_errorf(err, MT_ERR_INVALID, "post_processor: TemplateProcessing has no single");
    size_t n = json_object_array_length(single), total = 0;
    /* Two passes: count the ids, then fill them. */
    for (int pass = 0; pass < 2; pass++) {
        int before = 0, after = 0, seqs = 0;
        for (size_t i = 0; i < n; i++) {
            json_object *item = json_object_array_get_idx(single, i);
            json_object *sp = jget(item, "SpecialToken"), *seq = jget(item, "Sequence");
            if (seq) {
                const char *which = jstr(seq, "id");
                if (!which || strcmp(which, "A") != 0 || seqs++)
                    return mt_errorf(err, MT_ERR_UNSUPPORTED, "post_processor: single must hold "
                                     "the sequence $A once");
                continue;
            }
            const char *name = jstr(sp, "id");
            json_object *ids = jget(jget(specials, name ? name : ""), "ids");
            if (!name || !ids || !json_object_is_type(ids, json_type_array))
                return mt_errorf(err, MT_ERR_INVALID, "post_processor: template item %zu names "
                                 "no entry of special_tokens", i);
            for (size_t k = 0; k < json_object_array_length(ids); k++) {
                int64_t id = json_object_get_int64(json_object_array_get_idx(ids, k));
                if (id < 0 || id >= t->n_ids || t->tok_len[id] == UINT32_MAX)
                    return mt_errorf(err, MT_ERR_INVALID, "post_processor: special token %s has "
                                     "id %lld, which names no token", name, (long long)id);
                if (pass == 1) t->post.ids[before + after] = (int32_t)id;
                if (seqs) after++; else before++;
            }
        }
        if (!seqs)
            return mt_errorf(err, MT_ERR_INVALID, "post_processor: single has no $A");
        if (pass == 0) {
            total = (size_t)(before + after);
            t->post.ids = malloc(sizeof(int32_t) * (total + 1));
            if (!t->post.ids) return mt_errorf(err, MT_ERR_NOMEM, "out of memory");
        }
        t->post.n_before = before;
        t->post.n_after = after;
    }
    return MT_OK;
}

static mt_status parse_post_processor(tok_tokenizer *t, json_object *p, mt_error *err) {
    if (jnull(p)) return MT_OK;
    const char *type = jstr(p, "type");
    if (!type) return mt_errorf(err, MT_ERR_INVALID, "post_processor: no type");
    if (strcmp(type, "ByteLevel") == 0) return MT_OK; /* offsets only; ids are unchanged */
    if (strcmp(type, "TemplateProcessing") == 0) return parse_template(t, p, err);
    if (strcmp(type, "Sequence") == 0) {
        json_object *list = jget(p, "processors");
        size_t n = list && json_object_is_type(list, json_type_array) ? json_object_array_length(list) : 0;
        for (size_t i = 0; i < n; i++) {
            json_object *s = json_object_array_get_idx(list, i);
            const char *st = jstr(s, "type");
            if (st && strcmp(st, "Sequence") == 0)
                return mt_errorf(err, MT_ERR_UNSUPPORTED, "post_processor: nested Sequence");
            mt_status rc = parse_post_processor(t, s, err);
            if (rc != MT_OK) return rc;
        }
        return MT_OK;
    }
    return mt_errorf(err, MT_ERR_UNSUPPORTED, "post_processor: type %s is not supported "
                     "(TemplateProcessing, ByteLevel, a Sequence of them, or null)", type);
}

/* Sets id's bytes from its tokenizer.json string. */
static mt_status set_token(tok_tokenizer *t, int32_t id, const char *s, size_t n, uint8_t *buf,
                           bool *mapped) {
    size_t len = token_raw_bytes(s, n, buf, mapped);
    uint32_t off = arena_add(t, buf, len);
    if (off == UINT32_MAX) return MT_ERR_NOMEM;
    t->tok_off[id] = off;
    t->tok_len[id] = (uint32_t)len;
    return MT_OK;
}

static mt_status parse_model(tok_tokenizer *t, json_object *m, json_object *added, mt_error *err) {
    const char *type = jstr(m, "type");
    if (!type || strcmp(type, "BPE") != 0)
        return mt_errorf(err, MT_ERR_UNSUPPORTED, "model: type %s is not supported (only BPE)",
                         type ? type : "(missing)");
    static const char *const refused[] = {"dropout", "unk_token", "continuing_subword_prefix",
                                          "end_of_word_suffix"};
    for (size_t i = 0; i < sizeof refused / sizeof *refused; i++) {
        json_object *v = jget(m, refused[i]);
        bool zero = (json_object_is_type(v, json_type_double) || json_object_is_type(v, json_type_int)) &&
                    json_object_get_double(v) == 0.0; /* dropout 0 is no dropout */
        if (!jnull(v) && !zero)
            return mt_errorf(err, MT_ERR_UNSUPPORTED, "model: %s is set; it is not supported",
                             refused[i]);
    }
    if (jbool(m, "byte_fallback"))
        return mt_errorf(err, MT_ERR_UNSUPPORTED, "model: byte_fallback true is not supported");
    t->ignore_merges = jbool(m, "ignore_merges");
    json_object *vocab = jget(m, "vocab"), *merges = jget(m, "merges");
    if (!vocab || !json_object_is_type(vocab, json_type_object))
        return mt_errorf(err, MT_ERR_INVALID, "model: vocab is %s, not an object",
                         vocab ? json_kind(vocab) : "missing");
    if (!merges || !json_object_is_type(merges, json_type_array))
        return mt_errorf(err, MT_ERR_INVALID, "model: merges is %s, not an array",
                         merges ? json_kind(merges) : "missing");

    /* Ids: the largest of the vocabulary and the added tokens. */
    int64_t max_id = -1;
    size_t longest = 0;
    json_object_object_foreach(vocab, key, val) {
        if (!json_object_is_type(val, json_type_int))
            return mt_errorf(err, MT_ERR_INVALID, "model: vocab entry \"%.64s\" is %s, not an id",
                             key, json_kind(val));
        int64_t id = json_object_get_int64(val);
        if (id < 0 || id >= INT32_MAX / 2)
            return mt_errorf(err, MT_ERR_INVALID, "model: vocab id %lld out of range", (long long)id);
        if (id > max_id) max_id = id;
        size_t kl = strlen(key);
        if (kl > longest) longest = kl;
    }
    size_t n_added = added ? json_object_array_length(added) : 0;
    for (size_t i = 0; i < n_added; i++) {
        json_object *a = json_object_array_get_idx(added, i);
        json_object *idv = jget(a, "id");
        const char *content = jstr(a, "content");
        if (!idv || !json_object_is_type(idv, json_type_int) || !content)
            return mt_errorf(err, MT_ERR_INVALID, "added_tokens[%zu]: needs an integer id and a "
                             "string content", i);
        int64_t id = json_object_get_int64(idv);
        if (id < 0 || id >= INT32_MAX / 2)
            return mt_errorf(err, MT_ERR_INVALID, "added_tokens[%zu]: id %lld out of range", i,
                             (long long)id);
        if (id > max_id) max_id = id;
        if (strlen(content) > longest) longest = strlen(content);
    }
    if (max_id < 0) return mt_errorf(err, MT_ERR_INVALID, "model: empty vocabulary");
    t->n_ids = (int32_t)max_id + 1;
    size_t nv = (size_t)json_object_object_length(vocab);
    t->tok_off = calloc((size_t)t->n_ids, sizeof *t->tok_off);
    t->tok_len = malloc(sizeof *t->tok_len * (size_t)t->n_ids);
    t->tok_flags = calloc((size_t)t->n_ids, 1);
    t->vocab.cap = pow2_at_least(nv * 2);
    t->vocab.slots = calloc(t->vocab.cap, sizeof *t->vocab.slots);
    t->vocab_ids = malloc(sizeof *t->vocab_ids * (nv + 1));
    uint8_t *buf = malloc(longest * 2 + 8);
    if (!t->tok_off || !t->tok_len || !t->tok_flags || !t->vocab.slots || !t->vocab_ids || !buf) {
        free(buf);
        return mt_errorf(err, MT_ERR_NOMEM, "out of memory for %d ids", t->n_ids);
    }
    memset(t->tok_len, 0xff, sizeof *t->tok_len * (size_t)t->n_ids);

    /* The vocabulary. Entries outside the byte alphabet can never come out of merges; they keep
     * their UTF-8 for decoding and stay out of the byte map. */
    {
        json_object_object_foreach(vocab, key, val) {
            int32_t id = (int32_t)json_object_get_int64(val);
            bool mapped;
            if (set_token(t, id, key, strlen(key), buf, &mapped) != MT_OK) {
                free(buf);
                return mt_errorf(err, MT_ERR_NOMEM, "out of memory for the vocabulary");
            }
            if (mapped) vocab_insert(t, id);
        }
    }
    for (int b = 0; b < 256; b++) {
        uint8_t c = (uint8_t)b;
        t->byte_id[b] = tok_vocab_find(t, &c, 1);
    }

    /* Merges, ranked by their order. */
    size_t nm = json_object_array_length(merges);
    t->merge_cap = pow2_at_least(nm * 2 + 1);
    t->merges = malloc(sizeof *t->merges * t->merge_cap);
    if (!t->merges) {
        free(buf);
        return mt_errorf(err, MT_ERR_NOMEM, "out of memory for %zu merges", nm);
    }
    for (uint32_t i = 0; i < t->merge_cap; i++) t->merges[i].key = UINT64_MAX;
    for (size_t i = 0; i < nm; i++) {
        json_object *e = json_object_array_get_idx(merges, i);
        const char *l, *r;
        size_t ll, rl;
        if (json_object_is_type(e, json_type_string)) {
            const char *s = json_object_get_string(e);
            const char *sp = strchr(s, ' ');
            if (!sp || strchr(sp + 1, ' ')) {
                free(buf);
                return mt_errorf(err, MT_ERR_INVALID, "model: merge %zu \"%.64s\" is not two "
                                 "tokens split by one space", i, s);
            }
            l = s, ll = (size_t)(sp - s), r = sp + 1, rl = strlen(sp + 1);
        } else if (json_object_is_type(e, json_type_array) && json_object_array_length(e) == 2 &&
                   json_object_is_type(json_object_array_get_idx(e, 0), json_type_string) &&
                   json_object_is_type(json_object_array_get_idx(e, 1), json_type_string)) {
            l = json_object_get_string(json_object_array_get_idx(e, 0));
            r = json_object_get_string(json_object_array_get_idx(e, 1));
            ll = strlen(l), rl = strlen(r);
        } else {
            free(buf);
            return mt_errorf(err, MT_ERR_INVALID, "model: merge %zu is %s, not \"a b\" or [a, b]",
                             i, json_kind(e));
        }
        bool ml, mr;
        size_t lb = token_raw_bytes(l, ll, buf, &ml);
        size_t rb = token_raw_bytes(r, rl, buf + lb, &mr);
        if (!ml || !mr) continue; /* a side outside the byte alphabet never forms */
        int32_t a = tok_vocab_find(t, buf, lb), b = tok_vocab_find(t, buf + lb, rb);
        int32_t ab = tok_vocab_find(t, buf, lb + rb);
        if (a < 0 || b < 0 || ab < 0) {
            free(buf);
            return mt_errorf(err, MT_ERR_INVALID, "model: merge %zu (%.*s %.*s) uses a token "
                             "that is not in the vocabulary", i, (int)(ll > 64 ? 64 : ll), l,
                             (int)(rl > 64 ? 64 : rl), r);
        }
        merge_put(t, a, b, (int32_t)i, ab);
    }

    /* Added tokens: their bytes (the decoder's rule), flags and the two tries. */
    t->added = calloc(n_added + 1, sizeof *t->added);
    if (!t->added || trie_init(&t->trie_raw) != MT_OK || trie_init(&t->trie_norm) != MT_OK) {
        free(buf);
        return mt_errorf(err, MT_ERR_NOMEM, "out of memory for the added tokens");
    }
    for (size_t i = 0; i < n_added; i++) {
        json_object *a = json_object_array_get_idx(added, i);
        const char *content = jstr(a, "content");
        size_t cl = strlen(content);
        tok_added *d = &t->added[t->n_added];
        d->id = (int32_t)json_object_get_int64(jget(a, "id"));
        d->special = jbool(a, "special");
        d->single_word = jbool(a, "single_word");
        d->lstrip = jbool(a, "lstrip");
        d->rstrip = jbool(a, "rstrip");
        d->normalized = jbool(a, "normalized");
        d->off = arena_add(t, content, cl);
        d->len = (uint32_t)cl;
        bool mapped;
        if (d->off == UINT32_MAX || set_token(t, d->id, content, cl, buf, &mapped) != MT_OK) {
            free(buf);
            return mt_errorf(err, MT_ERR_NOMEM, "out of memory for the added tokens");
        }
        t->tok_flags[d->id] |= TOK_F_ADDED;
        if (cl == 0) continue; /* an empty content never matches */
        if (d->single_word) t->any_single_word = true;
        t->n_added++;
    }
    /* Tries hold the non-empty contents; decode skips the special ones' ids. */
    for (int i = 0; i < t->n_added; i++) {
        tok_added *d = &t->added[i];
        tok_trie *tr = d->normalized ? &t->trie_norm : &t->trie_raw;
        if (trie_add(tr, (const uint8_t *)t->arena + d->off, d->len, i) != MT_OK) {
            free(buf);
            return mt_errorf(err, MT_ERR_NOMEM, "out of memory for the added tokens");
        }
        if (d->special) t->tok_flags[d->id] |= TOK_F_SPECIAL;
    }
    free(buf);
    if (t->any_single_word) {
        int ec;
        PCRE2_SIZE eo;
        t->word_char = pcre2_compile((PCRE2_SPTR)WORD_CHAR, PCRE2_ZERO_TERMINATED,
                                     PCRE2_UTF | PCRE2_UCP | PCRE2_ANCHORED, &ec, &eo, NULL);
        if (!t->word_char)
            return mt_errorf(err, MT_ERR_UNSUPPORTED, "added_tokens: single_word needs Unicode "
                             "properties this PCRE2 lacks");
    }
    return MT_OK;
}

static mt_status parse_tokenizer_json(tok_tokenizer *t, const char *path, mt_error *err) {
    json_object *root = json_object_from_file(path);
    if (!root)
        return mt_errorf(err, errno == ENOENT ? MT_ERR_NOT_FOUND : MT_ERR_IO, "%s: cannot read or "
                         "parse: %s", path, json_util_get_last_err() ? json_util_get_last_err() : "");
    mt_status rc = MT_OK;
    mt_error sub;
    if (!json_object_is_type(root, json_type_object)) {
        rc = mt_errorf(&sub, MT_ERR_INVALID, "not a JSON object");
        goto done;
    }
    if (!jnull(jget(root, "truncation")) || !jnull(jget(root, "padding"))) {
        rc = mt_errorf(&sub, MT_ERR_UNSUPPORTED, "truncation and padding must be null");
        goto done;
    }
    json_object *norm = jget(root, "normalizer");
    if (!jnull(norm)) {
        rc = mt_errorf(&sub, MT_ERR_UNSUPPORTED, "normalizer %s is not supported (only null)",
                       jstr(norm, "type") ? jstr(norm, "type") : "(untyped)");
        goto done;
    }
    json_object *added = jget(root, "added_tokens");
    if (added && !json_object_is_type(added, json_type_array)) {
        rc = mt_errorf(&sub, MT_ERR_INVALID, "added_tokens is %s, not an array", json_kind(added));
        goto done;
    }
    if ((rc = parse_model(t, jget(root, "model"), added, &sub)) != MT_OK) goto done;
    if ((rc = parse_pre_tokenizer(t, jget(root, "pre_tokenizer"), &sub)) != MT_OK) goto done;
    if ((rc = parse_post_processor(t, jget(root, "post_processor"), &sub)) != MT_OK) goto done;
    json_object *dec = jget(root, "decoder");
    if (!jstr(dec, "type") || strcmp(jstr(dec, "type"), "ByteLevel") != 0) {
        rc = mt_errorf(&sub, MT_ERR_UNSUPPORTED, "decoder %s is not supported (only ByteLevel)",
                       jstr(dec, "type") ? jstr(dec, "type") : "null");
        goto done;
    }
done:
    json_object_put(root);
    if (rc != MT_OK) mt_errorf(err, rc, "%s: %s", path, sub.msg);
    return rc;
}

/* ---- the two configs ---------------------------------------------------------------------- */

/* A token named in tokenizer_config.json: a string, or an object with "content". */
static const char *config_token(json_object *cfg, const char *key) {
    json_object *v = jget(cfg, key);
    if (v && json_object_is_type(v, json_type_string)) return json_object_get_string(v);
    return jstr(v, "content");
}

static mt_status add_eos(tok_tokenizer *t, int64_t id, const char *file, mt_error *err) {
    if (id < 0 || id >= t->n_ids)
        return mt_errorf(err, MT_ERR_INVALID, "%s: eos id %lld is outside the vocabulary (%d)",
                         file, (long long)id, t->n_ids);
    for (int i = 0; i < t->n_eos; i++)
        if (t->eos[i] == id) return MT_OK;
    int32_t *e = realloc(t->eos, sizeof *e * (size_t)(t->n_eos + 1));
    if (!e) return mt_errorf(err, MT_ERR_NOMEM, "out of memory");
    t->eos = e;
    t->eos[t->n_eos++] = (int32_t)id;
    return MT_OK;
}

static char *read_text_file(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    char *s = NULL;
    if (fseek(f, 0, SEEK_END) == 0) {
        long n = ftell(f);
        if (n >= 0 && fseek(f, 0, SEEK_SET) == 0 && (s = malloc((size_t)n + 1))) {
            if (fread(s, 1, (size_t)n, f) != (size_t)n) {
                free(s);
                s = NULL;
            } else {
                s[n] = 0;
            }
        }
    }
    fclose(f);
    return s;
}

static mt_status parse_configs(tok_tokenizer *t, const char *dir, mt_error *err) {
    char path[4096];
    mt_status rc = MT_OK;
    snprintf(path, sizeof path, "%s/generation_config.json", dir);
    json_object *gen = NULL, *cfg = NULL;
    FILE *probe = fopen(path, "rb");
    if (probe) {
        fclose(probe);
        if (!(gen = json_object_from_file(path)))
            return mt_errorf(err, MT_ERR_INVALID, "%s: cannot parse", path);
        json_object *e = jget(gen, "eos_token_id");
        if (e && json_object_is_type(e, json_type_array)) {
            for (size_t i = 0; i < json_object_array_length(e) && rc == MT_OK; i++)
                rc = add_eos(t, json_object_get_int64(json_object_array_get_idx(e, i)), path, err);
        } else if (e && json_object_is_type(e, json_type_int)) {
            rc = add_eos(t, json_object_get_int64(e), path, err);
        }
        json_object *b = jget(gen, "bos_token_id"), *p = jget(gen, "pad_token_id");
        if (b && json_object_is_type(b, json_type_int)) t->bos = (int32_t)json_object_get_int64(b);
        if (p && json_object_is_type(p, json_type_int)) t->pad = (int32_t)json_object_get_int64(p);
        if (rc != MT_OK) goto done;
    }
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    probe = fopen(path, "rb");
    if (probe) {
        fclose(probe);
        if (!(cfg = json_object_from_file(path))) {
            rc = mt_errorf(err, MT_ERR_INVALID, "%s: cannot parse", path);
            goto done;
        }
        const char *names[3] = {config_token(cfg, "eos_token"), config_token(cfg, "bos_token"),
                                config_token(cfg, "pad_token")};
        int32_t ids[3];
        for (int i = 0; i < 3; i++) {
            ids[i] = names[i] ? tok_token_to_id(t, names[i]) : -1;
            if (names[i] && ids[i] < 0) {
                rc = mt_errorf(err, MT_ERR_INVALID, "%s: %s \"%.64s\" is not a token", path,
                               i == 0 ? "eos_token" : i == 1 ? "bos_token" : "pad_token", names[i]);
                goto done;
            }
        }
        if (ids[0] >= 0 && (rc = add_eos(t, ids[0], path, err)) != MT_OK) goto done;
        if (t->bos < 0) t->bos = ids[1];
        if (t->pad < 0) t->pad = ids[2];
        json_object *ct = jget(cfg, "chat_template");
        const char *tmpl = NULL;
        if (ct && json_object_is_type(ct, json_type_string)) {
            tmpl = json_object_get_string(ct);
        } else if (ct && json_object_is_type(ct, json_type_array)) { /* named templates */
            for (size_t i = 0; i < json_object_array_length(ct); i++) {
                json_object *o = json_object_array_get_idx(ct, i);
                if (!tmpl || (jstr(o, "name") && strcmp(jstr(o, "name"), "default") == 0))
                    tmpl = jstr(o, "template");
            }
        }
        if (tmpl && !(t->chat_template = strdup(tmpl))) {
            rc = mt_errorf(err, MT_ERR_NOMEM, "out of memory");
            goto done;
        }
    }
    /* A chat_template.jinja beside them is the template when present. */
    snprintf(path, sizeof path, "%s/chat_template.jinja", dir);
    char *jinja = read_text_file(path);
    if (jinja) {
        free(t->chat_template);
        t->chat_template = jinja;
    }
done:
    if (gen) json_object_put(gen);
    if (cfg) json_object_put(cfg);
    return rc;
}

/* ---- public ------------------------------------------------------------------------------- */

static mt_status load(const char *dir, const char *json_path, tok_tokenizer **out, mt_error *err) {
    byte_alphabet_init();
    tok_tokenizer *t = calloc(1, sizeof *t);
    if (!t) return mt_errorf(err, MT_ERR_NOMEM, "out of memory");
    t->bos = t->pad = -1;
    mt_status rc = parse_tokenizer_json(t, json_path, err);
    if (rc == MT_OK && dir) rc = parse_configs(t, dir, err);
    if (rc != MT_OK) goto fail;
    *out = t;
    return MT_OK;
fail:
    tok_free(t);
    return rc;
}

mt_status tok_load(const char *dir, tok_tokenizer **out, mt_error *err) {
    char path[4096];
    if (snprintf(path, sizeof path, "%s/tokenizer.json", dir) >= (int)sizeof path)
        return mt_errorf(err, MT_ERR_INVALID, "model directory path too long");
    return load(dir, path, out, err);
}

mt_status tok_load_file(const char *path, tok_tokenizer **out, mt_error *err) {
    return load(NULL, path, out, err);
}

void tok_free(tok_tokenizer *t) {
    if (!t) return;
    free(t->arena);
    free(t->tok_off);
    free(t->tok_len);
    free(t->tok_flags);
    free(t->vocab.slots);
    free(t->vocab_ids);
    free(t->merges);
    free(t->added);
    trie_free(&t->trie_raw);
    trie_free(&t->trie_norm);
    pcre2_code_free(t->word_char);
    for (int i = 0; i < t->n_split; i++) pcre2_code_free(t->split[i]);
    free(t->post.ids);
    free(t->eos);
    free(t->chat_template);
    free(t);
}

int32_t tok_vocab_size(const tok_tokenizer *t) { return t->n_ids; }

const uint8_t *tok_id_to_bytes(const tok_tokenizer *t, int32_t id, size_t *len) {
    return tok_bytes_of(t, id, len);
}

bool tok_is_special(const tok_tokenizer *t, int32_t id) {
    return id >= 0 && id < t->n_ids && (t->tok_flags[id] & TOK_F_SPECIAL);
}

int32_t tok_token_to_id(const tok_tokenizer *t, const char *token) {
    size_t n = strlen(token);
    for (int i = 0; i < t->n_added; i++)
        if (t->added[i].len == n && memcmp(t->arena + t->added[i].off, token, n) == 0)
            return t->added[i].id;
    uint8_t *buf = malloc(n + 1);
    if (!buf) return -1;
    bool mapped;
    size_t len = token_raw_bytes(token, n, buf, &mapped);
    int32_t id = mapped ? tok_vocab_find(t, buf, len) : -1;
    free(buf);
    return id;
}

tok_special_ids tok_special(const tok_tokenizer *t) {
    tok_special_ids s = {.bos = t->bos, .eos = t->eos, .n_eos = t->n_eos, .pad = t->pad};
    return s;
}

const char *tok_chat_template(const tok_tokenizer *t) { return t->chat_template; }

mt_status tok_ids_reserve(tok_ids *v, size_t need) {
    if (need <= v->cap) return MT_OK;
    size_t cap = v->cap ? v->cap : 64;
    while (cap < need) cap *= 2;
    int32_t *p = realloc(v->ids, sizeof *p * cap);
    if (!p) return MT_ERR_NOMEM;
    v->ids = p;
    v->cap = cap;
    return MT_OK;
}

mt_status tok_text_reserve(tok_text *t, size_t need) {
    need += 1; /* the NUL */
    if (need <= t->cap) return MT_OK;
    size_t cap = t->cap ? t->cap : 256;
    while (cap < need) cap *= 2;
    char *p = realloc(t->s, cap);
    if (!p) return MT_ERR_NOMEM;
    t->s = p;
    t->cap = cap;
    return MT_OK;
}

void tok_ids_free(tok_ids *v) {
    if (!v) return;
    free(v->ids);
    v->ids = NULL;
    v->n = v->cap = 0;
}

void tok_text_free(tok_text *t) {
    if (!t) return;
    free(t->s);
    t->s = NULL;
    t->n = t->cap = 0;
}
