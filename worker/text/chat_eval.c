/* worker/text/chat_eval.c: chat_render. Walks the tree of chat_impl.h with Python's and jinja2's
 * semantics for the values a chat template meets (None, bool, int, str, list, dict, Undefined,
 * the loop object). Every value of a render lives in its arena, freed when the render returns. */
#define _GNU_SOURCE /* memmem */
#include <json-c/json.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "worker/text/chat_impl.h"

typedef enum vkind { V_UNDEF, V_NONE, V_BOOL, V_INT, V_FLOAT, V_STR, V_LIST, V_DICT, V_LOOP } vkind;

typedef struct cv {
    vkind k;
    int64_t i;            /* V_BOOL, V_INT; V_LOOP: index0 */
    double f;             /* V_FLOAT */
    const char *s;        /* V_STR bytes; V_UNDEF: the name it was looked up by (may be NULL) */
    size_t n;             /* V_STR bytes; V_LIST, V_DICT entries; V_LOOP length */
    struct cv *items;     /* V_LIST [n]; V_DICT values [n] */
    struct cv *keys;      /* V_DICT keys [n], each a V_STR */
} cv;

typedef struct scope {
    struct scope *up;
    const char **names;
    cv *vals;
    int n, cap;
} scope;

typedef struct rctx {
    chat_arena arena;
    scope *sc;
    tok_text *out;
    mt_error *err;
    mt_status st;
} rctx;

static const cv UNDEF = {.k = V_UNDEF};
static const cv NONE = {.k = V_NONE};

__attribute__((format(printf, 3, 4)))
static bool rfail(rctx *c, mt_status st, const char *fmt, ...) {
    if (c->st != MT_OK) return false;
    char msg[480];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    c->st = mt_errorf(c->err, st, "chat template: %s", msg);
    return false;
}

static void *ralloc(rctx *c, size_t n) {
    void *p = chat_arena_alloc(&c->arena, n ? n : 1);
    if (!p) rfail(c, MT_ERR_NOMEM, "out of memory");
    return p;
}

static cv mk_bool(bool b) { return (cv){.k = V_BOOL, .i = b}; }
static cv mk_int(int64_t i) { return (cv){.k = V_INT, .i = i}; }
static cv mk_str(const char *s, size_t n) { return (cv){.k = V_STR, .s = s, .n = n}; }

static const char *type_name(const cv *v) {
    static const char *const names[] = {"Undefined", "NoneType", "bool", "int", "float", "str",
                                        "list", "dict", "LoopContext"};
    return names[v->k];
}

static bool undefined_error(rctx *c, const cv *v) {
    if (v->s) return rfail(c, MT_ERR_INVALID, "'%s' is undefined", v->s);
    return rfail(c, MT_ERR_INVALID, "undefined value used");
}

/* ---- UTF-8 ---- */

static uint32_t utf8_next(const char *s, size_t n, size_t *k) {
    const unsigned char *u = (const unsigned char *)s;
    if (u[0] < 0x80 || n < 2) { *k = 1; return u[0]; }
    if ((u[0] & 0xe0) == 0xc0) { *k = 2; return ((u[0] & 0x1fu) << 6) | (u[1] & 0x3fu); }
    if ((u[0] & 0xf0) == 0xe0 && n >= 3) {
        *k = 3;
        return ((u[0] & 0x0fu) << 12) | ((u[1] & 0x3fu) << 6) | (u[2] & 0x3fu);
    }
    if (n >= 4) {
        *k = 4;
        return ((u[0] & 0x07u) << 18) | ((u[1] & 0x3fu) << 12) | ((u[2] & 0x3fu) << 6) | (u[3] & 0x3fu);
    }
    *k = 1;
    return u[0];
}

static bool utf8_valid(const char *s, size_t len) {
    const unsigned char *u = (const unsigned char *)s;
    for (size_t i = 0; i < len;) {
        unsigned char c = u[i];
        size_t n = c < 0x80 ? 1 : c >= 0xc2 && c < 0xe0 ? 2 : c >= 0xe0 && c < 0xf0 ? 3
                 : c >= 0xf0 && c < 0xf5 ? 4 : 0;
        if (!n || i + n > len) return false;
        for (size_t k = 1; k < n; k++)
            if ((u[i + k] & 0xc0) != 0x80) return false;
        if (n == 3 && ((c == 0xe0 && u[i + 1] < 0xa0) || (c == 0xed && u[i + 1] >= 0xa0))) return false;
        if (n == 4 && ((c == 0xf0 && u[i + 1] < 0x90) || (c == 0xf4 && u[i + 1] >= 0x90))) return false;
        i += n;
    }
    return true;
}

static size_t utf8_count(const char *s, size_t n) {
    size_t k = 0;
    for (size_t i = 0; i < n; i++) k += ((unsigned char)s[i] & 0xc0) != 0x80;
    return k;
}

static bool py_space(uint32_t c) {
    return (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x20) || c == 0x85 || c == 0xa0 ||
           c == 0x1680 || (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 ||
           c == 0x202f || c == 0x205f || c == 0x3000;
}

/* Is code point u among the characters of chars (NULL: Python whitespace)? */
static bool in_set(uint32_t u, const cv *chars) {
    if (!chars) return py_space(u);
    for (size_t i = 0, k; i < chars->n; i += k)
        if (utf8_next(chars->s + i, chars->n - i, &k) == u) return true;
    return false;
}

/* Python's str.strip / lstrip / rstrip. */
static cv py_strip(const cv *v, const cv *chars, bool left, bool right) {
    size_t a = 0, b = v->n, k;
    while (left && a < b) {
        uint32_t u = utf8_next(v->s + a, b - a, &k);
        if (!in_set(u, chars)) break;
        a += k;
    }
    while (right && b > a) {
        size_t s = b - 1;
        while (s > a && ((unsigned char)v->s[s] & 0xc0) == 0x80) s--;
        uint32_t u = utf8_next(v->s + s, b - s, &k);
        if (!in_set(u, chars)) break;
        b = s;
    }
    return mk_str(v->s + a, b - a);
}

/* ---- text building ---- */

typedef struct sbuf {
    char *s;
    size_t n, cap;
} sbuf;

static bool sb_put(rctx *c, sbuf *b, const char *s, size_t n) {
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? 2 * b->cap : 64;
        while (cap < b->n + n + 1) cap *= 2;
        char *p = ralloc(c, cap);
        if (!p) return false;
        if (b->n) memcpy(p, b->s, b->n);
        b->s = p;
        b->cap = cap;
    }
    memcpy(b->s + b->n, s, n);
    b->n += n;
    b->s[b->n] = 0;
    return true;
}

/* Python's str(v) for the values it can print exactly; Undefined prints as "" (jinja2). */
static bool to_str(rctx *c, const cv *v, sbuf *b) {
    char num[32];
    switch (v->k) {
    case V_UNDEF: return true;
    case V_NONE: return sb_put(c, b, "None", 4);
    case V_BOOL: return v->i ? sb_put(c, b, "True", 4) : sb_put(c, b, "False", 5);
    case V_INT: return sb_put(c, b, num, (size_t)snprintf(num, sizeof num, "%lld", (long long)v->i));
    case V_STR: return sb_put(c, b, v->s, v->n);
    default: return rfail(c, MT_ERR_UNSUPPORTED, "printing a %s is not supported", type_name(v));
    }
}

static bool as_str(rctx *c, const cv *v, cv *out) {
    if (v->k == V_STR) { *out = *v; return true; }
    sbuf b = {0};
    if (!to_str(c, v, &b)) return false;
    *out = mk_str(b.s ? b.s : "", b.n);
    return true;
}

/* json.dumps(v, ensure_ascii=False) as transformers' tojson filter writes it. */
static bool to_json(rctx *c, const cv *v, sbuf *b) {
    switch (v->k) {
    case V_NONE: return sb_put(c, b, "null", 4);
    case V_BOOL: return v->i ? sb_put(c, b, "true", 4) : sb_put(c, b, "false", 5);
    case V_INT: return to_str(c, v, b);
    case V_STR: {
        if (!sb_put(c, b, "\"", 1)) return false;
        for (size_t i = 0; i < v->n; i++) {
            unsigned char ch = (unsigned char)v->s[i];
            char e[8];
            const char *rep = NULL;
            switch (ch) {
            case '"': rep = "\\\""; break;
            case '\\': rep = "\\\\"; break;
            case '\n': rep = "\\n"; break;
            case '\r': rep = "\\r"; break;
            case '\t': rep = "\\t"; break;
            case '\b': rep = "\\b"; break;
            case '\f': rep = "\\f"; break;
            default:
                if (ch < 0x20) snprintf(e, sizeof e, "\\u%04x", ch), rep = e;
            }
            if (!(rep ? sb_put(c, b, rep, strlen(rep)) : sb_put(c, b, v->s + i, 1))) return false;
        }
        return sb_put(c, b, "\"", 1);
    }
    case V_LIST:
        if (!sb_put(c, b, "[", 1)) return false;
        for (size_t i = 0; i < v->n; i++)
            if ((i && !sb_put(c, b, ", ", 2)) || !to_json(c, &v->items[i], b)) return false;
        return sb_put(c, b, "]", 1);
    case V_DICT:
        if (!sb_put(c, b, "{", 1)) return false;
        for (size_t i = 0; i < v->n; i++)
            if ((i && !sb_put(c, b, ", ", 2)) || !to_json(c, &v->keys[i], b) ||
                !sb_put(c, b, ": ", 2) || !to_json(c, &v->items[i], b))
                return false;
        return sb_put(c, b, "}", 1);
    case V_FLOAT: return rfail(c, MT_ERR_UNSUPPORTED, "tojson of a float is not supported");
    default: return rfail(c, MT_ERR_INVALID, "Object of type %s is not JSON serializable", type_name(v));
    }
}

/* ---- Python semantics ---- */

static bool truthy(const cv *v) {
    switch (v->k) {
    case V_UNDEF: case V_NONE: return false;
    case V_BOOL: case V_INT: return v->i != 0;
    case V_FLOAT: return v->f != 0;
    case V_STR: case V_LIST: case V_DICT: return v->n > 0;
    case V_LOOP: return true;
    }
    return false;
}

static bool is_num(const cv *v) { return v->k == V_BOOL || v->k == V_INT || v->k == V_FLOAT; }
static double num(const cv *v) { return v->k == V_FLOAT ? v->f : (double)v->i; }

static bool py_eq(const cv *a, const cv *b) {
    if (is_num(a) && is_num(b)) {
        if (a->k != V_FLOAT && b->k != V_FLOAT) return a->i == b->i;
        return num(a) == num(b);
    }
    if (a->k != b->k) return false;
    switch (a->k) {
    case V_UNDEF: case V_NONE: return true;
    case V_STR: return a->n == b->n && !memcmp(a->s, b->s, a->n);
    case V_LIST:
        if (a->n != b->n) return false;
        for (size_t i = 0; i < a->n; i++)
            if (!py_eq(&a->items[i], &b->items[i])) return false;
        return true;
    case V_DICT:
        if (a->n != b->n) return false;
        for (size_t i = 0; i < a->n; i++) {
            size_t j = 0;
            while (j < b->n && !py_eq(&a->keys[i], &b->keys[j])) j++;
            if (j == b->n || !py_eq(&a->items[i], &b->items[j])) return false;
        }
        return true;
    default: return a == b;
    }
}

/* a < b etc. for numbers and strings. */
static bool py_order(rctx *c, int op, const cv *a, const cv *b, bool *r) {
    if (a->k == V_UNDEF) return undefined_error(c, a);
    if (b->k == V_UNDEF) return undefined_error(c, b);
    int cmp;
    if (is_num(a) && is_num(b)) {
        if (a->k != V_FLOAT && b->k != V_FLOAT) cmp = a->i < b->i ? -1 : a->i > b->i;
        else cmp = num(a) < num(b) ? -1 : num(a) > num(b);
    } else if (a->k == V_STR && b->k == V_STR) {
        size_t n = a->n < b->n ? a->n : b->n;
        cmp = memcmp(a->s, b->s, n);
        if (!cmp) cmp = a->n < b->n ? -1 : a->n > b->n;
    } else {
        static const char *const sym[] = {"", "", "<", "<=", ">", ">="};
        return rfail(c, MT_ERR_INVALID, "'%s' not supported between instances of '%s' and '%s'",
                     sym[op], type_name(a), type_name(b));
    }
    *r = op == CHAT_CMP_LT ? cmp < 0 : op == CHAT_CMP_LE ? cmp <= 0 : op == CHAT_CMP_GT ? cmp > 0 : cmp >= 0;
    return true;
}

static bool py_in(rctx *c, const cv *a, const cv *b, bool *r) {
    switch (b->k) {
    case V_UNDEF: *r = false; return true; /* Undefined iterates as empty */
    case V_STR:
        if (a->k != V_STR)
            return rfail(c, MT_ERR_INVALID, "'in <string>' requires string as left operand, not %s", type_name(a));
        *r = a->n == 0 || (a->n <= b->n && memmem(b->s, b->n, a->s, a->n));
        return true;
    case V_LIST:
        *r = false;
        for (size_t i = 0; i < b->n && !*r; i++) *r = py_eq(a, &b->items[i]);
        return true;
    case V_DICT:
        if (a->k == V_LIST || a->k == V_DICT)
            return rfail(c, MT_ERR_INVALID, "unhashable type: '%s'", type_name(a));
        *r = false;
        for (size_t i = 0; i < b->n && !*r; i++) *r = py_eq(a, &b->keys[i]);
        return true;
    default:
        return rfail(c, MT_ERR_INVALID, "argument of type '%s' is not iterable", type_name(b));
    }
}

/* Attribute names that Python resolves on these types before jinja2 tries the item: printing or
 * using one would need Python's objects. */
static bool python_attr(vkind k, const char *name) {
    static const char *const dict_m[] = {"clear", "copy", "fromkeys", "get", "items", "keys", "pop",
                                         "popitem", "setdefault", "update", "values", NULL};
    static const char *const list_m[] = {"append", "clear", "copy", "count", "extend", "index",
                                         "insert", "pop", "remove", "reverse", "sort", NULL};
    static const char *const str_m[] = {
        "capitalize", "casefold", "center", "count", "encode", "endswith", "expandtabs", "find",
        "format", "format_map", "index", "isalnum", "isalpha", "isascii", "isdecimal", "isdigit",
        "isidentifier", "islower", "isnumeric", "isprintable", "isspace", "istitle", "isupper",
        "join", "ljust", "lower", "lstrip", "maketrans", "partition", "removeprefix",
        "removesuffix", "replace", "rfind", "rindex", "rjust", "rpartition", "rsplit", "rstrip",
        "split", "splitlines", "startswith", "strip", "swapcase", "title", "translate", "upper",
        "zfill", NULL};
    if (name[0] == '_') return true;
    const char *const *m = k == V_DICT ? dict_m : k == V_LIST ? list_m : k == V_STR ? str_m : NULL;
    for (; m && *m; m++)
        if (!strcmp(*m, name)) return true;
    return false;
}

static bool loop_attr(const cv *l, const char *name, cv *r) {
    int64_t i = l->i, n = (int64_t)l->n;
    if (!strcmp(name, "index")) *r = mk_int(i + 1);
    else if (!strcmp(name, "index0")) *r = mk_int(i);
    else if (!strcmp(name, "revindex")) *r = mk_int(n - i);
    else if (!strcmp(name, "revindex0")) *r = mk_int(n - i - 1);
    else if (!strcmp(name, "first")) *r = mk_bool(i == 0);
    else if (!strcmp(name, "last")) *r = mk_bool(i == n - 1);
    else if (!strcmp(name, "length")) *r = mk_int(n);
    else return false;
    return true;
}

static bool get_attr(rctx *c, const cv *o, const char *name, cv *r) {
    if (o->k == V_UNDEF) return undefined_error(c, o);
    if (o->k == V_LOOP) {
        if (loop_attr(o, name, r)) return true;
        return rfail(c, MT_ERR_UNSUPPORTED, "loop.%s is not supported", name);
    }
    if (python_attr(o->k, name))
        return rfail(c, MT_ERR_UNSUPPORTED, "attribute '%s' of a %s is not supported", name, type_name(o));
    *r = (cv){.k = V_UNDEF, .s = name};
    if (o->k == V_DICT)
        for (size_t i = 0; i < o->n; i++)
            if (strlen(name) == o->keys[i].n && !memcmp(name, o->keys[i].s, o->keys[i].n)) {
                *r = o->items[i];
                break;
            }
    return true;
}

static bool get_item(rctx *c, const cv *o, const cv *key, cv *r) {
    if (o->k == V_UNDEF) return undefined_error(c, o);
    *r = UNDEF;
    if (o->k == V_DICT) {
        for (size_t i = 0; i < o->n; i++)
            if (py_eq(&o->keys[i], key)) { *r = o->items[i]; return true; }
    } else if ((o->k == V_LIST || o->k == V_STR) && (key->k == V_INT || key->k == V_BOOL)) {
        int64_t len = (int64_t)(o->k == V_LIST ? o->n : utf8_count(o->s, o->n));
        int64_t i = key->i < 0 ? key->i + len : key->i;
        if (i < 0 || i >= len) return true;
        if (o->k == V_LIST) { *r = o->items[i]; return true; }
        size_t at = 0, k;
        for (int64_t j = 0; j < i; j++) utf8_next(o->s + at, o->n - at, &k), at += k;
        utf8_next(o->s + at, o->n - at, &k);
        *r = mk_str(o->s + at, k);
        return true;
    }
    if (key->k == V_STR) { /* jinja2 falls back to the attribute */
        char *name = ralloc(c, key->n + 1);
        if (!name) return false;
        memcpy(name, key->s, key->n);
        if (o->k == V_LOOP && loop_attr(o, name, r)) return true;
        if (o->k == V_DICT || o->k == V_LIST || o->k == V_STR) {
            if (python_attr(o->k, name))
                return rfail(c, MT_ERR_UNSUPPORTED, "attribute '%s' of a %s is not supported", name, type_name(o));
        }
        r->s = name;
    }
    return true;
}

/* ---- expressions ---- */

static bool eval(rctx *c, const chat_expr *e, cv *r);

static bool lookup(rctx *c, const char *name, cv *r) {
    for (scope *s = c->sc; s; s = s->up)
        for (int i = s->n - 1; i >= 0; i--)
            if (!strcmp(s->names[i], name)) { *r = s->vals[i]; return true; }
    *r = (cv){.k = V_UNDEF, .s = name};
    return true;
}

static bool bind(rctx *c, scope *s, const char *name, cv v) {
    for (int i = 0; i < s->n; i++)
        if (!strcmp(s->names[i], name)) { s->vals[i] = v; return true; }
    if (s->n == s->cap) {
        int cap = s->cap ? 2 * s->cap : 8;
        const char **names = ralloc(c, (size_t)cap * sizeof *names);
        cv *vals = ralloc(c, (size_t)cap * sizeof *vals);
        if (!names || !vals) return false;
        if (s->n) {
            memcpy(names, s->names, (size_t)s->n * sizeof *names);
            memcpy(vals, s->vals, (size_t)s->n * sizeof *vals);
        }
        s->names = names;
        s->vals = vals;
        s->cap = cap;
    }
    s->names[s->n] = name;
    s->vals[s->n++] = v;
    return true;
}

static bool arith(rctx *c, int op, const cv *a, const cv *b, cv *r) {
    static const char *const sym[] = {"+", "-", "*", "//", "%"};
    if (a->k == V_UNDEF) return undefined_error(c, a);
    if (b->k == V_UNDEF) return undefined_error(c, b);
    bool ia = a->k == V_INT || a->k == V_BOOL, ib = b->k == V_INT || b->k == V_BOOL;
    if (ia && ib) {
        int64_t x = a->i, y = b->i, z;
        bool ovf = false;
        switch (op) {
        case CHAT_OP_ADD: ovf = __builtin_add_overflow(x, y, &z); break;
        case CHAT_OP_SUB: ovf = __builtin_sub_overflow(x, y, &z); break;
        case CHAT_OP_MUL: ovf = __builtin_mul_overflow(x, y, &z); break;
        default:
            if (y == 0) return rfail(c, MT_ERR_INVALID, "integer division or modulo by zero");
            if (x == INT64_MIN && y == -1) { ovf = true; break; }
            z = op == CHAT_OP_FLOORDIV ? x / y : x % y;
            if (op == CHAT_OP_FLOORDIV && (x % y != 0) && ((x < 0) != (y < 0))) z--;
            if (op == CHAT_OP_MOD && z != 0 && ((z < 0) != (y < 0))) z += y;
        }
        if (ovf) return rfail(c, MT_ERR_UNSUPPORTED, "integer beyond 64 bits");
        *r = mk_int(z);
        return true;
    }
    if (op == CHAT_OP_ADD && a->k == V_STR && b->k == V_STR) {
        char *s = ralloc(c, a->n + b->n + 1);
        if (!s) return false;
        memcpy(s, a->s, a->n);
        memcpy(s + a->n, b->s, b->n);
        *r = mk_str(s, a->n + b->n);
        return true;
    }
    if (op == CHAT_OP_ADD && a->k == V_LIST && b->k == V_LIST) {
        cv *items = ralloc(c, (a->n + b->n) * sizeof *items);
        if (!items) return false;
        if (a->n) memcpy(items, a->items, a->n * sizeof *items);
        if (b->n) memcpy(items + a->n, b->items, b->n * sizeof *items);
        *r = (cv){.k = V_LIST, .items = items, .n = a->n + b->n};
        return true;
    }
    if (op == CHAT_OP_MUL && ((a->k == V_STR && ib) || (ia && b->k == V_STR))) {
        const cv *s = a->k == V_STR ? a : b;
        int64_t times = a->k == V_STR ? b->i : a->i;
        if (times < 0) times = 0;
        if (times > 0 && s->n > (size_t)(1 << 24) / (size_t)times)
            return rfail(c, MT_ERR_UNSUPPORTED, "string repetition over 16 MiB");
        char *o = ralloc(c, s->n * (size_t)times + 1);
        if (!o) return false;
        for (int64_t k = 0; k < times; k++) memcpy(o + (size_t)k * s->n, s->s, s->n);
        *r = mk_str(o, s->n * (size_t)times);
        return true;
    }
    if (a->k == V_FLOAT || b->k == V_FLOAT)
        return rfail(c, MT_ERR_UNSUPPORTED, "float arithmetic is not supported");
    if (op == CHAT_OP_MOD && a->k == V_STR)
        return rfail(c, MT_ERR_UNSUPPORTED, "string %% formatting is not supported");
    return rfail(c, MT_ERR_INVALID, "unsupported operand type(s) for %s: '%s' and '%s'", sym[op],
                 type_name(a), type_name(b));
}

static bool ascii_case(rctx *c, const cv *v, bool upper, cv *r) {
    char *o = ralloc(c, v->n + 1);
    if (!o) return false;
    for (size_t i = 0; i < v->n; i++) {
        char ch = v->s[i];
        if ((unsigned char)ch >= 0x80)
            return rfail(c, MT_ERR_UNSUPPORTED, "%s of non-ASCII text is not supported", upper ? "upper" : "lower");
        o[i] = upper && ch >= 'a' && ch <= 'z' ? (char)(ch - 32) : !upper && ch >= 'A' && ch <= 'Z' ? (char)(ch + 32) : ch;
    }
    *r = mk_str(o, v->n);
    return true;
}

static bool filter(rctx *c, const chat_expr *e, cv *r) {
    cv v, args[2];
    if (!eval(c, e->a, &v)) return false;
    for (int i = 0; i < e->n_args; i++)
        if (!eval(c, e->args[i], &args[i])) return false;
    const char *f = e->name;
    if (!strcmp(f, "default") || !strcmp(f, "d")) {
        bool use = v.k == V_UNDEF || (e->n_args > 1 && truthy(&args[1]) && !truthy(&v));
        *r = use ? (e->n_args ? args[0] : mk_str("", 0)) : v;
        return true;
    }
    if (!strcmp(f, "length") || !strcmp(f, "count")) {
        switch (v.k) {
        case V_UNDEF: *r = mk_int(0); return true;
        case V_STR: *r = mk_int((int64_t)utf8_count(v.s, v.n)); return true;
        case V_LIST: case V_DICT: *r = mk_int((int64_t)v.n); return true;
        default: return rfail(c, MT_ERR_INVALID, "object of type '%s' has no len()", type_name(&v));
        }
    }
    if (!strcmp(f, "tojson")) {
        sbuf b = {0};
        if (!to_json(c, &v, &b)) return false;
        *r = mk_str(b.s, b.n);
        return true;
    }
    cv s;
    if (!as_str(c, &v, &s)) return false; /* the rest work on soft_str(value) */
    if (!strcmp(f, "trim")) {
        if (e->n_args && args[0].k != V_STR && args[0].k != V_NONE && args[0].k != V_UNDEF)
            return rfail(c, MT_ERR_INVALID, "strip arg must be None or str");
        *r = py_strip(&s, e->n_args && args[0].k == V_STR ? &args[0] : NULL, true, true);
        return true;
    }
    if (!strcmp(f, "upper") || !strcmp(f, "lower")) return ascii_case(c, &s, f[0] == 'u', r);
    *r = s; /* string */
    return true;
}

static bool method(rctx *c, const chat_expr *e, cv *r) {
    cv o, a = NONE;
    if (!eval(c, e->a, &o)) return false;
    if (o.k == V_UNDEF) return undefined_error(c, &o);
    if (e->n_args && !eval(c, e->args[0], &a)) return false;
    if (o.k != V_STR) /* jinja2: the attribute is Undefined, and calling it fails */
        return rfail(c, MT_ERR_INVALID, "'%s' object has no attribute '%s'", type_name(&o), e->name);
    const char *m = e->name;
    if (!strcmp(m, "startswith") || !strcmp(m, "endswith")) {
        if (a.k != V_STR)
            return rfail(c, MT_ERR_INVALID, "%s first arg must be str or a tuple of str, not %s", m, type_name(&a));
        bool ok = a.n <= o.n && !memcmp(m[0] == 's' ? o.s : o.s + o.n - a.n, a.s, a.n);
        *r = mk_bool(ok);
        return true;
    }
    if (a.k != V_STR && a.k != V_NONE)
        return rfail(c, MT_ERR_INVALID, "%s arg must be None or str", m);
    *r = py_strip(&o, a.k == V_STR ? &a : NULL, m[0] != 'r', m[0] != 'l');
    return true;
}

static bool test(rctx *c, const chat_expr *e, cv *r) {
    cv v;
    if (!eval(c, e->a, &v)) return false;
    const char *t = e->name;
    bool b;
    if (!strcmp(t, "defined")) b = v.k != V_UNDEF;
    else if (!strcmp(t, "undefined")) b = v.k == V_UNDEF;
    else if (!strcmp(t, "none")) b = v.k == V_NONE;
    else if (!strcmp(t, "string")) b = v.k == V_STR;
    else if (!strcmp(t, "number")) b = is_num(&v);
    else if (!strcmp(t, "integer")) b = v.k == V_INT;
    else if (!strcmp(t, "boolean")) b = v.k == V_BOOL;
    else if (!strcmp(t, "mapping")) b = v.k == V_DICT;
    else if (!strcmp(t, "true")) b = v.k == V_BOOL && v.i;
    else b = v.k == V_BOOL && !v.i; /* false */
    *r = mk_bool(b != (e->i != 0));
    return true;
}

static bool eval(rctx *c, const chat_expr *e, cv *r) {
    cv a, b;
    switch (e->kind) {
    case CE_STR: *r = mk_str(e->str, e->len); return true;
    case CE_INT: *r = mk_int(e->i); return true;
    case CE_BOOL: *r = mk_bool(e->i != 0); return true;
    case CE_NONE: *r = NONE; return true;
    case CE_LIST: {
        cv *items = ralloc(c, (size_t)e->n_args * sizeof *items);
        if (!items) return false;
        for (int i = 0; i < e->n_args; i++)
            if (!eval(c, e->args[i], &items[i])) return false;
        *r = (cv){.k = V_LIST, .items = items, .n = (size_t)e->n_args};
        return true;
    }
    case CE_VAR: return lookup(c, e->name, r);
    case CE_ATTR: return eval(c, e->a, &a) && get_attr(c, &a, e->name, r);
    case CE_ITEM: return eval(c, e->a, &a) && eval(c, e->b, &b) && get_item(c, &a, &b, r);
    case CE_BINOP: return eval(c, e->a, &a) && eval(c, e->b, &b) && arith(c, e->op, &a, &b, r);
    case CE_COMPARE: {
        if (!eval(c, e->a, &a)) return false;
        bool res = true;
        for (int i = 0; i < e->n_args && res; i++) {
            if (!eval(c, e->args[i], &b)) return false;
            int op = e->ops[i];
            if (op == CHAT_CMP_EQ) res = py_eq(&a, &b);
            else if (op == CHAT_CMP_NE) res = !py_eq(&a, &b);
            else if (op == CHAT_CMP_IN || op == CHAT_CMP_NOTIN) {
                if (!py_in(c, &a, &b, &res)) return false;
                if (op == CHAT_CMP_NOTIN) res = !res;
            } else if (!py_order(c, op, &a, &b, &res)) {
                return false;
            }
            a = b;
        }
        *r = mk_bool(res);
        return true;
    }
    case CE_AND:
        if (!eval(c, e->a, &a)) return false;
        return truthy(&a) ? eval(c, e->b, r) : (*r = a, true);
    case CE_OR:
        if (!eval(c, e->a, &a)) return false;
        return truthy(&a) ? (*r = a, true) : eval(c, e->b, r);
    case CE_NOT:
        if (!eval(c, e->a, &a)) return false;
        *r = mk_bool(!truthy(&a));
        return true;
    case CE_NEG:
        if (!eval(c, e->a, &a)) return false;
        if (a.k == V_UNDEF) return undefined_error(c, &a);
        if (a.k == V_INT || a.k == V_BOOL) {
            if (a.i == INT64_MIN) return rfail(c, MT_ERR_UNSUPPORTED, "integer beyond 64 bits");
            *r = mk_int(-a.i);
            return true;
        }
        return rfail(c, MT_ERR_INVALID, "bad operand type for unary -: '%s'", type_name(&a));
    case CE_CONCAT: {
        sbuf s = {0};
        for (int i = 0; i < e->n_args; i++)
            if (!eval(c, e->args[i], &a) || !to_str(c, &a, &s)) return false;
        *r = mk_str(s.s ? s.s : "", s.n);
        return true;
    }
    case CE_COND:
        if (!eval(c, e->a, &a)) return false;
        if (truthy(&a)) return eval(c, e->b, r);
        if (e->c) return eval(c, e->c, r);
        *r = UNDEF;
        return true;
    case CE_TEST: return test(c, e, r);
    case CE_FILTER: return filter(c, e, r);
    case CE_RAISE: {
        if (!eval(c, e->args[0], &a)) return false;
        sbuf s = {0};
        if (!to_str(c, &a, &s)) return false;
        return rfail(c, MT_ERR_INVALID, "raise_exception: %s", s.s ? s.s : "");
    }
    case CE_METHOD: return method(c, e, r);
    }
    return rfail(c, MT_ERR_INVALID, "bad expression");
}

/* ---- statements ---- */

static bool emit(rctx *c, const char *s, size_t n) {
    tok_text *o = c->out;
    if (o->n + n + 1 > o->cap) {
        size_t cap = o->cap ? o->cap : 256;
        while (cap < o->n + n + 1) cap *= 2;
        char *p = realloc(o->s, cap);
        if (!p) return rfail(c, MT_ERR_NOMEM, "out of memory");
        o->s = p;
        o->cap = cap;
    }
    memcpy(o->s + o->n, s, n);
    o->n += n;
    o->s[o->n] = 0;
    return true;
}

static bool exec_body(rctx *c, const chat_body *b);

static bool exec_for(rctx *c, const chat_node *n) {
    cv it;
    if (!eval(c, n->expr, &it)) return false;
    size_t len = 0;
    switch (it.k) {
    case V_UNDEF: break;
    case V_LIST: case V_DICT: len = it.n; break;
    case V_STR: len = utf8_count(it.s, it.n); break;
    default: return rfail(c, MT_ERR_INVALID, "'%s' object is not iterable", type_name(&it));
    }
    size_t at = 0;
    for (size_t i = 0; i < len; i++) {
        cv x;
        if (it.k == V_STR) {
            size_t k;
            utf8_next(it.s + at, it.n - at, &k);
            x = mk_str(it.s + at, k);
            at += k;
        } else {
            x = it.k == V_LIST ? it.items[i] : it.keys[i];
        }
        scope *s = ralloc(c, sizeof *s);
        if (!s) return false;
        s->up = c->sc;
        cv loop = {.k = V_LOOP, .i = (int64_t)i, .n = len};
        if (!bind(c, s, n->name, x) || !bind(c, s, "loop", loop)) return false;
        c->sc = s;
        bool ok = exec_body(c, &n->body);
        c->sc = s->up;
        if (!ok) return false;
    }
    return len ? true : exec_body(c, &n->else_body);
}

static bool exec_body(rctx *c, const chat_body *b) {
    for (int i = 0; i < b->n; i++) {
        const chat_node *n = b->nodes[i];
        cv v;
        switch (n->kind) {
        case CN_TEXT:
            if (!emit(c, n->str, n->len)) return false;
            break;
        case CN_OUTPUT: {
            sbuf s = {0};
            if (!eval(c, n->expr, &v) || !to_str(c, &v, &s) || !emit(c, s.s, s.n)) return false;
            break;
        }
        case CN_IF: {
            const chat_body *run = &n->else_body;
            for (int k = 0; k < n->n_branches; k++) {
                if (!eval(c, n->conds[k], &v)) return false;
                if (truthy(&v)) { run = &n->bodies[k]; break; }
            }
            if (!exec_body(c, run)) return false;
            break;
        }
        case CN_FOR:
            if (!exec_for(c, n)) return false;
            break;
        case CN_SET:
            if (!eval(c, n->expr, &v) || !bind(c, c->sc, n->name, v)) return false;
            break;
        }
    }
    return true;
}

/* ---- variables ---- */

static bool from_json(rctx *c, json_object *j, cv *r) {
    switch (json_object_get_type(j)) {
    case json_type_null: *r = NONE; return true;
    case json_type_boolean: *r = mk_bool(json_object_get_boolean(j)); return true;
    case json_type_int: *r = mk_int(json_object_get_int64(j)); return true;
    case json_type_double: *r = (cv){.k = V_FLOAT, .f = json_object_get_double(j)}; return true;
    case json_type_string: {
        const char *s = json_object_get_string(j);
        size_t n = (size_t)json_object_get_string_len(j);
        if (!utf8_valid(s, n)) return rfail(c, MT_ERR_INVALID, "chat_template_kwargs: a string is not valid UTF-8");
        *r = mk_str(s, n);
        return true;
    }
    case json_type_array: {
        size_t n = json_object_array_length(j);
        cv *items = ralloc(c, n * sizeof *items);
        if (!items) return false;
        for (size_t i = 0; i < n; i++)
            if (!from_json(c, json_object_array_get_idx(j, i), &items[i])) return false;
        *r = (cv){.k = V_LIST, .items = items, .n = n};
        return true;
    }
    case json_type_object: {
        size_t n = (size_t)json_object_object_length(j), i = 0;
        cv *keys = ralloc(c, n * sizeof *keys), *vals = ralloc(c, n * sizeof *vals);
        if (!keys || !vals) return false;
        json_object_object_foreach(j, k, v) {
            keys[i] = mk_str(k, strlen(k));
            if (!from_json(c, v, &vals[i++])) return false;
        }
        *r = (cv){.k = V_DICT, .keys = keys, .items = vals, .n = n};
        return true;
    }
    }
    return rfail(c, MT_ERR_INVALID, "chat_template_kwargs: unexpected JSON value");
}

static bool str_or_none(rctx *c, const char *s, const char *what, cv *r) {
    if (!s) { *r = NONE; return true; }
    size_t n = strlen(s);
    if (!utf8_valid(s, n)) return rfail(c, MT_ERR_INVALID, "%s is not valid UTF-8", what);
    *r = mk_str(s, n);
    return true;
}

static bool set_globals(rctx *c, scope *g, const chat_message *msgs, size_t n, bool agp,
                        json_object *kw, const chat_vars *extra) {
    static const char *const role = "role", *const content = "content";
    cv *list = ralloc(c, n * sizeof *list);
    if (!list) return false;
    for (size_t i = 0; i < n; i++) {
        cv *keys = ralloc(c, 2 * sizeof *keys), *vals = ralloc(c, 2 * sizeof *vals);
        if (!keys || !vals) return false;
        keys[0] = mk_str(role, 4);
        keys[1] = mk_str(content, 7);
        if (!str_or_none(c, msgs[i].role, "a message's role", &vals[0]) ||
            !str_or_none(c, msgs[i].content, "a message's content", &vals[1]))
            return false;
        list[i] = (cv){.k = V_DICT, .keys = keys, .items = vals, .n = 2};
    }
    cv v;
    if (!bind(c, g, "messages", (cv){.k = V_LIST, .items = list, .n = n}) ||
        !bind(c, g, "tools", NONE) || !bind(c, g, "documents", NONE) ||
        !bind(c, g, "add_generation_prompt", mk_bool(agp)))
        return false;
    if (extra && extra->bos_token &&
        (!str_or_none(c, extra->bos_token, "bos_token", &v) || !bind(c, g, "bos_token", v)))
        return false;
    if (extra && extra->eos_token &&
        (!str_or_none(c, extra->eos_token, "eos_token", &v) || !bind(c, g, "eos_token", v)))
        return false;
    if (!kw) return true;
    json_object_object_foreach(kw, k, jv) {
        if (!strcmp(k, "messages") || !strcmp(k, "tools") || !strcmp(k, "documents") ||
            !strcmp(k, "add_generation_prompt"))
            return rfail(c, MT_ERR_INVALID, "chat_template_kwargs may not set '%s'", k);
        if (!from_json(c, jv, &v) || !bind(c, g, k, v)) return false;
    }
    return true;
}

mt_status chat_render(const chat_template *t, const chat_message *msgs, size_t n,
                      bool add_generation_prompt, const char *kwargs_json, const chat_vars *extra,
                      tok_text *out, mt_error *err) {
    rctx c = {.out = out, .err = err};
    size_t n0 = out->n;
    json_object *kw = NULL;
    if (kwargs_json) {
        json_tokener *tk = json_tokener_new();
        if (!tk) return mt_errorf(err, MT_ERR_NOMEM, "chat template: out of memory");
        size_t len = strlen(kwargs_json);
        kw = json_tokener_parse_ex(tk, kwargs_json, (int)len);
        enum json_tokener_error je = json_tokener_get_error(tk);
        size_t used = json_tokener_get_parse_end(tk);
        json_tokener_free(tk);
        while (used < len && strchr(" \t\r\n", kwargs_json[used])) used++;
        if (je != json_tokener_success || used != len || !json_object_is_type(kw, json_type_object)) {
            json_object_put(kw);
            return mt_errorf(err, MT_ERR_INVALID, "chat_template_kwargs is not a JSON object%s%s",
                             je != json_tokener_success ? ": " : "",
                             je != json_tokener_success ? json_tokener_error_desc(je) : "");
        }
    }
    scope *g = ralloc(&c, sizeof *g), *root = ralloc(&c, sizeof *root);
    bool ok = g && root && set_globals(&c, g, msgs, n, add_generation_prompt, kw, extra);
    if (ok) {
        root->up = g; /* the template's own `set`s shadow the variables passed in */
        c.sc = root;
        ok = exec_body(&c, &t->root);
    }
    chat_arena_free(&c.arena);
    json_object_put(kw);
    if (!ok) {
        out->n = n0;
        if (out->s) out->s[n0] = 0;
        return c.st;
    }
    if (!out->s && emit(&c, "", 0) == false) return c.st; /* an empty render is still a string */
    return MT_OK;
}
