/* worker/text/chat_parse.c: chat_compile. A lexer that follows jinja2's (whitespace control,
 * trim_blocks, lstrip_blocks) and a recursive-descent parser with jinja2's precedence, producing
 * the tree of chat_impl.h. Constructs outside the subset stop the parse with their position. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "worker/text/chat_impl.h"

/* ---- arena ---- */

typedef struct chat_block {
    struct chat_block *next;
    size_t used, cap;
    _Alignas(16) unsigned char data[];
} chat_block;

void *chat_arena_alloc(chat_arena *a, size_t n) {
    n = (n + 15) & ~(size_t)15;
    chat_block *b = a->head;
    if (!b || b->cap - b->used < n) {
        size_t cap = n > 16384 ? n : 16384;
        b = malloc(sizeof *b + cap);
        if (!b) return NULL;
        b->next = a->head;
        b->used = 0;
        b->cap = cap;
        a->head = b;
    }
    void *p = b->data + b->used;
    b->used += n;
    memset(p, 0, n);
    return p;
}

void chat_arena_free(chat_arena *a) {
    for (chat_block *b = a->head, *next; b; b = next) {
        next = b->next;
        free(b);
    }
    a->head = NULL;
}

/* ---- lexer ---- */

typedef enum tkind {
    T_DATA, T_BLOCK_BEGIN, T_BLOCK_END, T_VAR_BEGIN, T_VAR_END,
    T_NAME, T_STRING, T_INT, T_OP, T_EOF,
} tkind;

typedef struct token {
    tkind k;
    const char *s;  /* T_DATA, T_NAME, T_STRING (decoded), T_OP: bytes in the arena */
    size_t len;
    int64_t ival;   /* T_INT */
    size_t pos;     /* offset in the normalised source */
} token;

typedef struct parser {
    chat_arena *arena;
    const char *src;      /* normalised source */
    size_t n;
    token *toks;
    size_t n_toks, cap_toks, at;
    mt_error *err;
    mt_status st;         /* first error */
} parser;

/* Python's str.isspace, which jinja2's \s and str.strip follow. */
static bool py_space(uint32_t c) {
    return (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x20) || c == 0x85 || c == 0xa0 ||
           c == 0x1680 || (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 ||
           c == 0x202f || c == 0x205f || c == 0x3000;
}

/* Length of the whitespace character at s[0..n), 0 when it is not one. */
static size_t space_at(const char *s, size_t n) {
    const unsigned char *u = (const unsigned char *)s;
    if (n == 0) return 0;
    if (u[0] < 0x80) return py_space(u[0]) ? 1 : 0;
    uint32_t c;
    size_t k;
    if ((u[0] & 0xe0) == 0xc0 && n >= 2) c = ((u[0] & 0x1fu) << 6) | (u[1] & 0x3fu), k = 2;
    else if ((u[0] & 0xf0) == 0xe0 && n >= 3)
        c = ((u[0] & 0x0fu) << 12) | ((u[1] & 0x3fu) << 6) | (u[2] & 0x3fu), k = 3;
    else return 0;
    return py_space(c) ? k : 0;
}

/* Length of the whitespace ending at s[n) (the last character), 0 when it is not one. */
static size_t space_before(const char *s, size_t n) {
    for (size_t k = 1; k <= 3 && k <= n; k++) {
        unsigned char c = (unsigned char)s[n - k];
        if ((c & 0xc0) != 0x80) return space_at(s + n - k, k) == k ? k : 0;
    }
    return 0;
}

static void line_col(const parser *p, size_t pos, int *line, int *col) {
    *line = 1;
    *col = 1;
    for (size_t i = 0; i < pos && i < p->n; i++) {
        if (p->src[i] == '\n') (*line)++, *col = 1;
        else if (((unsigned char)p->src[i] & 0xc0) != 0x80) (*col)++;
    }
}

__attribute__((format(printf, 4, 5)))
static bool fail(parser *p, mt_status st, size_t pos, const char *fmt, ...) {
    if (p->st != MT_OK) return false;
    char msg[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    int line, col;
    line_col(p, pos, &line, &col);
    p->st = mt_errorf(p->err, st, "chat template %d:%d: %s", line, col, msg);
    return false;
}

static bool nomem(parser *p) {
    if (p->st == MT_OK) p->st = mt_errorf(p->err, MT_ERR_NOMEM, "chat template: out of memory");
    return false;
}

static bool push_tok(parser *p, tkind k, const char *s, size_t len, size_t pos) {
    if (p->n_toks == p->cap_toks) {
        size_t cap = p->cap_toks ? 2 * p->cap_toks : 256;
        token *t = realloc(p->toks, cap * sizeof *t);
        if (!t) return nomem(p);
        p->toks = t;
        p->cap_toks = cap;
    }
    p->toks[p->n_toks++] = (token){.k = k, .s = s, .len = len, .pos = pos};
    return true;
}

static int hexval(char c) {
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10
         : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
}

static size_t put_utf8(char *o, uint32_t c) {
    if (c < 0x80) { o[0] = (char)c; return 1; }
    if (c < 0x800) { o[0] = (char)(0xc0 | c >> 6); o[1] = (char)(0x80 | (c & 0x3f)); return 2; }
    if (c < 0x10000) {
        o[0] = (char)(0xe0 | c >> 12); o[1] = (char)(0x80 | ((c >> 6) & 0x3f));
        o[2] = (char)(0x80 | (c & 0x3f)); return 3;
    }
    o[0] = (char)(0xf0 | c >> 18); o[1] = (char)(0x80 | ((c >> 12) & 0x3f));
    o[2] = (char)(0x80 | ((c >> 6) & 0x3f)); o[3] = (char)(0x80 | (c & 0x3f)); return 4;
}

/* A string literal at s[0] (the quote); Python's escapes as jinja2 decodes them
 * ("unicode-escape"). Returns the bytes consumed, 0 on error. */
static size_t lex_string(parser *p, size_t at) {
    const char *s = p->src;
    char q = s[at];
    size_t i = at + 1;
    char *o = chat_arena_alloc(p->arena, p->n - at + 1);
    if (!o) return nomem(p), 0;
    size_t n = 0;
    while (i < p->n && s[i] != q) {
        if (s[i] != '\\') { o[n++] = s[i++]; continue; }
        if (i + 1 >= p->n) break;
        char e = s[i + 1];
        int digits = e == 'x' ? 2 : e == 'u' ? 4 : e == 'U' ? 8 : 0;
        static const char from[] = "\\'\"abfnrtv\n", to[] = "\\'\"\a\b\f\n\r\t\v";
        const char *simple = strchr(from, e);
        if (e && simple) {
            size_t k = (size_t)(simple - from);
            if (e != '\n') o[n++] = to[k]; /* backslash-newline is a line continuation */
            i += 2;
        } else if (digits) {
            uint32_t c = 0;
            for (int d = 0; d < digits; d++) {
                int h = i + 2 + (size_t)d < p->n ? hexval(s[i + 2 + d]) : -1;
                if (h < 0) return fail(p, MT_ERR_INVALID, i, "bad \\%c escape in a string", e), 0;
                c = c * 16 + (uint32_t)h;
            }
            if (c > 0x10ffff || (c >= 0xd800 && c < 0xe000))
                return fail(p, MT_ERR_UNSUPPORTED, i, "escape of a surrogate or beyond U+10FFFF"), 0;
            n += put_utf8(o + n, c);
            i += 2 + (size_t)digits;
        } else if (e >= '0' && e <= '7') {
            uint32_t c = 0;
            size_t k = i + 1;
            for (int d = 0; d < 3 && k < p->n && s[k] >= '0' && s[k] <= '7'; d++, k++)
                c = c * 8 + (uint32_t)(s[k] - '0');
            n += put_utf8(o + n, c);
            i = k;
        } else if (e == 'N') {
            return fail(p, MT_ERR_UNSUPPORTED, i, "\\N{...} escape"), 0;
        } else {
            o[n++] = '\\'; /* unknown escapes stay as written */
            i++;
        }
    }
    if (i >= p->n) return fail(p, MT_ERR_INVALID, at, "unterminated string"), 0;
    if (!push_tok(p, T_STRING, o, n, at)) return 0;
    return i + 1 - at;
}

static const char *const OPS[] = {"//", "**", "==", "!=", ">=", "<=", "+", "-", "/", "*", "%",
                                  "~", "[", "]", "(", ")", "{", "}", ">", "<", "=", ".", ":",
                                  "|", ",", ";"};

/* Tokens of one tag from pos until its end ("}}" or "%}" with their signs). Returns the offset
 * after the end and what it consumed, or 0 on error. */
static size_t lex_tag(parser *p, size_t pos, bool block, bool *line_start) {
    const char *s = p->src;
    const char *end = block ? "%}" : "}}";
    int depth = 0; /* brackets: inside them an end marker is an operator (as jinja2 does) */
    for (;;) {
        while (pos < p->n) {
            size_t k = space_at(s + pos, p->n - pos);
            if (!k) break;
            pos += k;
        }
        if (pos >= p->n) return fail(p, MT_ERR_INVALID, pos, "unexpected end of template inside a tag"), 0;
        if (depth == 0) {
            size_t e = 0;
            bool strip = false, keep = false;
            if (s[pos] == '-' && !strncmp(s + pos + 1, end, 2)) e = 3, strip = true;
            else if (block && s[pos] == '+' && !strncmp(s + pos + 1, end, 2)) e = 3, keep = true;
            else if (!strncmp(s + pos, end, 2)) e = 2;
            if (e) {
                if (!push_tok(p, block ? T_BLOCK_END : T_VAR_END, NULL, 0, pos)) return 0;
                pos += e;
                if (strip) {
                    while (pos < p->n) {
                        size_t k = space_at(s + pos, p->n - pos);
                        if (!k) break;
                        pos += k;
                    }
                } else if (block && !keep && pos < p->n && s[pos] == '\n') {
                    pos++; /* trim_blocks */
                }
                *line_start = s[pos - 1] == '\n';
                return pos;
            }
        }
        char c = s[pos];
        if (c == '\'' || c == '"') {
            size_t k = lex_string(p, pos);
            if (!k) return 0;
            pos += k;
        } else if (c >= '0' && c <= '9') {
            size_t i = pos;
            int64_t v = 0;
            while (i < p->n && s[i] >= '0' && s[i] <= '9') {
                if (v > (INT64_MAX - 9) / 10) return fail(p, MT_ERR_UNSUPPORTED, pos, "integer literal too large"), 0;
                v = v * 10 + (s[i++] - '0');
            }
            bool dotted = pos > 0 && s[pos - 1] == '.';
            if (i < p->n && (s[i] == '_' || s[i] == 'x' || s[i] == 'o' || s[i] == 'b' ||
                             ((s[i] == '.' || s[i] == 'e') && !dotted && i + 1 < p->n &&
                              s[i + 1] >= '0' && s[i + 1] <= '9')))
                return fail(p, MT_ERR_UNSUPPORTED, pos, "number literal other than a decimal integer"), 0;
            if (!push_tok(p, T_INT, NULL, 0, pos)) return 0;
            p->toks[p->n_toks - 1].ival = v;
            pos = i;
        } else if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_') {
            size_t i = pos;
            while (i < p->n && ((s[i] >= 'a' && s[i] <= 'z') || (s[i] >= 'A' && s[i] <= 'Z') ||
                                (s[i] >= '0' && s[i] <= '9') || s[i] == '_'))
                i++;
            if (!push_tok(p, T_NAME, s + pos, i - pos, pos)) return 0;
            pos = i;
        } else {
            size_t k = 0;
            for (size_t o = 0; o < sizeof OPS / sizeof OPS[0]; o++) {
                size_t l = strlen(OPS[o]);
                if (!strncmp(s + pos, OPS[o], l)) { k = l; break; }
            }
            if (!k) return fail(p, MT_ERR_INVALID, pos, "unexpected character '%c'", c), 0;
            if (s[pos] == '(' || s[pos] == '[' || s[pos] == '{') depth++;
            if ((s[pos] == ')' || s[pos] == ']' || s[pos] == '}') && depth > 0) depth--;
            if (!push_tok(p, T_OP, s + pos, k, pos)) return 0;
            pos += k;
        }
    }
}

/* Splits the normalised source into data and tags, applying the whitespace rules. */
static bool lex(parser *p) {
    const char *s = p->src;
    size_t pos = 0;
    bool line_start = true;
    while (pos < p->n) {
        const char *open = NULL;
        for (size_t i = pos; i + 1 < p->n; i++)
            if (s[i] == '{' && (s[i + 1] == '{' || s[i + 1] == '%' || s[i + 1] == '#')) {
                open = s + i;
                break;
            }
        if (!open) return push_tok(p, T_DATA, s + pos, p->n - pos, pos);
        size_t at = (size_t)(open - s), text_end = at, after = at + 2;
        char type = open[1], sign = after < p->n && (s[after] == '-' || s[after] == '+') ? s[after] : 0;
        if (sign) after++;
        if (sign == '-') {
            while (text_end > pos) {
                size_t k = space_before(s + pos, text_end - pos);
                if (!k) break;
                text_end -= k;
            }
        } else if (sign != '+' && type != '{') { /* lstrip_blocks */
            size_t l = at;
            while (l > pos && s[l - 1] != '\n') l--;
            if (l > pos || line_start) {
                size_t i = l;
                while (i < at) {
                    size_t k = space_at(s + i, at - i);
                    if (!k) break;
                    i += k;
                }
                if (i == at) text_end = l;
            }
        }
        if (text_end > pos && !push_tok(p, T_DATA, s + pos, text_end - pos, pos)) return false;
        if (type == '#') {
            const char *close = NULL;
            for (size_t i = after; i + 1 < p->n; i++)
                if (s[i] == '#' && s[i + 1] == '}') { close = s + i; break; }
            if (!close) return fail(p, MT_ERR_INVALID, at, "missing end of comment");
            size_t c = (size_t)(close - s), e = c + 2;
            char csign = c > after && (s[c - 1] == '-' || s[c - 1] == '+') ? s[c - 1] : 0;
            if (csign == '-') {
                while (e < p->n) {
                    size_t k = space_at(s + e, p->n - e);
                    if (!k) break;
                    e += k;
                }
            } else if (csign != '+' && e < p->n && s[e] == '\n') {
                e++;
            }
            line_start = s[e - 1] == '\n';
            pos = e;
            continue;
        }
        bool block = type == '%';
        if (!push_tok(p, block ? T_BLOCK_BEGIN : T_VAR_BEGIN, NULL, 0, at)) return false;
        pos = lex_tag(p, after, block, &line_start);
        if (!pos) return false;
    }
    return true;
}

/* ---- parser ---- */

static token *cur(parser *p) { return &p->toks[p->at]; }
static token *peek(parser *p, size_t k) {
    return &p->toks[p->at + k < p->n_toks ? p->at + k : p->n_toks - 1];
}
static bool is_op(const token *t, const char *op) {
    return t->k == T_OP && t->len == strlen(op) && !memcmp(t->s, op, t->len);
}
static bool is_name(const token *t, const char *name) {
    return t->k == T_NAME && t->len == strlen(name) && !memcmp(t->s, name, t->len);
}
static const char *tok_desc(const token *t) {
    switch (t->k) {
    case T_DATA: return "text";
    case T_BLOCK_BEGIN: return "'{%'";
    case T_BLOCK_END: return "end of tag";
    case T_VAR_BEGIN: return "'{{'";
    case T_VAR_END: return "end of expression";
    case T_NAME: return "name";
    case T_STRING: return "string";
    case T_INT: return "integer";
    case T_OP: return "operator";
    case T_EOF: return "end of template";
    }
    return "?";
}

static bool expect_op(parser *p, const char *op) {
    if (!is_op(cur(p), op))
        return fail(p, MT_ERR_INVALID, cur(p)->pos, "expected '%s', got %s", op, tok_desc(cur(p)));
    p->at++;
    return true;
}

static char *dup_name(parser *p, const token *t) {
    char *s = chat_arena_alloc(p->arena, t->len + 1);
    if (!s) return nomem(p), NULL;
    memcpy(s, t->s, t->len);
    return s;
}

static chat_expr *new_expr(parser *p, chat_expr_kind k) {
    chat_expr *e = chat_arena_alloc(p->arena, sizeof *e);
    if (!e) return nomem(p), NULL;
    e->kind = k;
    return e;
}

/* A growable array of pointers in the arena (copied when it grows; the old copy stays until the
 * arena goes). */
static bool grow(parser *p, void ***v, int n, int *cap) {
    if (n < *cap) return true;
    int nc = *cap ? 2 * *cap : 4;
    void **nv = chat_arena_alloc(p->arena, (size_t)nc * sizeof *nv);
    if (!nv) return nomem(p);
    if (n) memcpy(nv, *v, (size_t)n * sizeof *nv);
    *v = nv;
    *cap = nc;
    return true;
}

static chat_expr *parse_expr(parser *p, bool with_cond);
static chat_expr *parse_unary(parser *p, bool with_filter);

/* Names that jinja2 or transformers define as callables; the subset has only raise_exception. */
static bool is_global_callable(const token *t) {
    static const char *const names[] = {"range", "dict", "lipsum", "cycler", "joiner", "namespace",
                                        "strftime_now", "raise_exception"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (is_name(t, names[i])) return true;
    return false;
}

/* "(" args ")" into e->args (positional only). */
static bool parse_args(parser *p, chat_expr *e, const char *what) {
    if (!expect_op(p, "(")) return false;
    int cap = 0;
    while (!is_op(cur(p), ")")) {
        if (e->n_args && !expect_op(p, ",")) return false;
        if (is_op(cur(p), ")")) break;
        if (cur(p)->k == T_NAME && is_op(peek(p, 1), "="))
            return fail(p, MT_ERR_UNSUPPORTED, cur(p)->pos, "keyword argument to %s", what);
        if (is_op(cur(p), "*") || is_op(cur(p), "**"))
            return fail(p, MT_ERR_UNSUPPORTED, cur(p)->pos, "*args in a call to %s", what);
        chat_expr *a = parse_expr(p, true);
        if (!a || !grow(p, (void ***)&e->args, e->n_args, &cap)) return false;
        e->args[e->n_args++] = a;
    }
    p->at++;
    return true;
}

static chat_expr *parse_call(parser *p, chat_expr *callee, size_t pos) {
    if (callee->kind == CE_VAR && !strcmp(callee->name, "raise_exception")) {
        chat_expr *e = new_expr(p, CE_RAISE);
        if (!e || !parse_args(p, e, "raise_exception")) return NULL;
        if (e->n_args != 1) return fail(p, MT_ERR_UNSUPPORTED, pos, "raise_exception takes one argument"), NULL;
        return e;
    }
    if (callee->kind == CE_ATTR) {
        static const char *const methods[] = {"strip", "lstrip", "rstrip", "startswith", "endswith"};
        size_t m = 0;
        while (m < 5 && strcmp(callee->name, methods[m])) m++;
        if (m == 5) return fail(p, MT_ERR_UNSUPPORTED, pos, "method '%s'", callee->name), NULL;
        chat_expr *e = new_expr(p, CE_METHOD);
        if (!e) return NULL;
        e->name = callee->name;
        e->a = callee->a;
        if (!parse_args(p, e, callee->name)) return NULL;
        if (m < 3 ? e->n_args > 1 : e->n_args != 1)
            return fail(p, MT_ERR_UNSUPPORTED, pos, "'%s' with %d arguments", e->name, e->n_args), NULL;
        return e;
    }
    if (callee->kind == CE_VAR)
        return fail(p, MT_ERR_UNSUPPORTED, pos, "function '%s'", callee->name), NULL;
    return fail(p, MT_ERR_UNSUPPORTED, pos, "call of an expression"), NULL;
}

static chat_expr *parse_primary(parser *p) {
    token *t = cur(p);
    chat_expr *e = NULL;
    if (t->k == T_NAME) {
        p->at++;
        if (is_name(t, "true") || is_name(t, "True") || is_name(t, "false") || is_name(t, "False")) {
            if ((e = new_expr(p, CE_BOOL))) e->i = t->s[0] == 't' || t->s[0] == 'T';
        } else if (is_name(t, "none") || is_name(t, "None")) {
            e = new_expr(p, CE_NONE);
        } else {
            if (is_global_callable(t) && !is_op(cur(p), "("))
                return fail(p, MT_ERR_UNSUPPORTED, t->pos, "'%.*s' used as a value", (int)t->len, t->s), NULL;
            if ((e = new_expr(p, CE_VAR)) && !(e->name = dup_name(p, t))) return NULL;
        }
        return e;
    }
    if (t->k == T_STRING) {
        size_t len = 0, k = p->at;
        while (p->toks[k].k == T_STRING) len += p->toks[k++].len;
        if (!(e = new_expr(p, CE_STR))) return NULL;
        char *s = chat_arena_alloc(p->arena, len + 1);
        if (!s) return nomem(p), NULL;
        for (len = 0; cur(p)->k == T_STRING; p->at++) {
            memcpy(s + len, cur(p)->s, cur(p)->len);
            len += cur(p)->len;
        }
        e->str = s;
        e->len = len;
        return e;
    }
    if (t->k == T_INT) {
        p->at++;
        if ((e = new_expr(p, CE_INT))) e->i = t->ival;
        return e;
    }
    if (is_op(t, "(")) {
        p->at++;
        e = parse_expr(p, true);
        if (!e) return NULL;
        if (is_op(cur(p), ",")) return fail(p, MT_ERR_UNSUPPORTED, cur(p)->pos, "tuple"), NULL;
        return expect_op(p, ")") ? e : NULL;
    }
    if (is_op(t, "[")) {
        p->at++;
        if (!(e = new_expr(p, CE_LIST))) return NULL;
        int cap = 0;
        while (!is_op(cur(p), "]")) {
            if (e->n_args && !expect_op(p, ",")) return NULL;
            if (is_op(cur(p), "]")) break;
            chat_expr *a = parse_expr(p, true);
            if (!a || !grow(p, (void ***)&e->args, e->n_args, &cap)) return NULL;
            e->args[e->n_args++] = a;
        }
        p->at++;
        return e;
    }
    if (is_op(t, "{")) return fail(p, MT_ERR_UNSUPPORTED, t->pos, "dict literal"), NULL;
    return fail(p, MT_ERR_INVALID, t->pos, "unexpected %s in an expression", tok_desc(t)), NULL;
}

static chat_expr *parse_postfix(parser *p, chat_expr *e) {
    while (e) {
        token *t = cur(p);
        if (is_op(t, ".")) {
            p->at++;
            token *n = cur(p);
            chat_expr *x;
            if (n->k == T_NAME) {
                if (!(x = new_expr(p, CE_ATTR)) || !(x->name = dup_name(p, n))) return NULL;
            } else if (n->k == T_INT) {
                chat_expr *idx = new_expr(p, CE_INT);
                if (!idx || !(x = new_expr(p, CE_ITEM))) return NULL;
                idx->i = n->ival;
                x->b = idx;
            } else {
                return fail(p, MT_ERR_INVALID, n->pos, "expected a name after '.'"), NULL;
            }
            p->at++;
            x->a = e;
            e = x;
        } else if (is_op(t, "[")) {
            p->at++;
            if (is_op(cur(p), ":")) return fail(p, MT_ERR_UNSUPPORTED, cur(p)->pos, "slice"), NULL;
            chat_expr *x = new_expr(p, CE_ITEM);
            if (!x || !(x->b = parse_expr(p, true))) return NULL;
            if (is_op(cur(p), ":")) return fail(p, MT_ERR_UNSUPPORTED, cur(p)->pos, "slice"), NULL;
            if (is_op(cur(p), ",")) return fail(p, MT_ERR_UNSUPPORTED, cur(p)->pos, "tuple index"), NULL;
            if (!expect_op(p, "]")) return NULL;
            x->a = e;
            e = x;
        } else if (is_op(t, "(")) {
            e = parse_call(p, e, t->pos);
        } else {
            break;
        }
    }
    return e;
}

static bool known(const char *const *names, size_t n, const char *name) {
    for (size_t i = 0; i < n; i++)
        if (!strcmp(names[i], name)) return true;
    return false;
}

static chat_expr *parse_filters(parser *p, chat_expr *e) {
    static const char *const filters[] = {"trim", "length", "count", "default", "d", "upper",
                                          "lower", "string", "tojson"};
    static const char *const tests[] = {"defined", "undefined", "none", "string", "number",
                                        "integer", "boolean", "mapping", "true", "false"};
    while (e) {
        token *t = cur(p);
        if (is_op(t, "|")) {
            p->at++;
            token *n = cur(p);
            if (n->k != T_NAME) return fail(p, MT_ERR_INVALID, n->pos, "expected a filter name"), NULL;
            chat_expr *x = new_expr(p, CE_FILTER);
            if (!x || !(x->name = dup_name(p, n))) return NULL;
            p->at++;
            if (is_op(cur(p), "."))
                return fail(p, MT_ERR_UNSUPPORTED, n->pos, "dotted filter name"), NULL;
            if (!known(filters, sizeof filters / sizeof filters[0], x->name))
                return fail(p, MT_ERR_UNSUPPORTED, n->pos, "filter '%s'", x->name), NULL;
            if (is_op(cur(p), "(") && !parse_args(p, x, x->name)) return NULL;
            const char *f = x->name;
            int max = !strcmp(f, "trim") ? 1 : !strcmp(f, "default") || !strcmp(f, "d") ? 2 : 0;
            if (x->n_args > max)
                return fail(p, MT_ERR_UNSUPPORTED, n->pos, "filter '%s' with %d arguments", f, x->n_args), NULL;
            x->a = e;
            e = x;
        } else if (is_name(t, "is")) {
            p->at++;
            chat_expr *x = new_expr(p, CE_TEST);
            if (!x) return NULL;
            if (is_name(cur(p), "not")) x->i = 1, p->at++;
            token *n = cur(p);
            if (n->k != T_NAME)
                return fail(p, MT_ERR_INVALID, n->pos, "expected a test name"), NULL;
            if (!(x->name = dup_name(p, n))) return NULL;
            if (!known(tests, sizeof tests / sizeof tests[0], x->name))
                return fail(p, MT_ERR_UNSUPPORTED, n->pos, "test '%s'", x->name), NULL;
            p->at++;
            token *after = cur(p); /* jinja2 reads an argument here: `is divisibleby 3` */
            if ((is_op(after, "(") || is_op(after, "[") || is_op(after, "{") || after->k == T_NAME ||
                 after->k == T_STRING || after->k == T_INT) &&
                !is_name(after, "else") && !is_name(after, "or") && !is_name(after, "and"))
                return fail(p, MT_ERR_UNSUPPORTED, after->pos, "test with an argument"), NULL;
            x->a = e;
            e = x;
        } else if (is_op(t, "(")) {
            e = parse_call(p, e, t->pos);
        } else {
            break;
        }
    }
    return e;
}

static chat_expr *parse_unary(parser *p, bool with_filter) {
    token *t = cur(p);
    chat_expr *e;
    if (is_op(t, "-")) {
        p->at++;
        if (!(e = new_expr(p, CE_NEG)) || !(e->a = parse_unary(p, false))) return NULL;
    } else if (is_op(t, "+")) {
        return fail(p, MT_ERR_UNSUPPORTED, t->pos, "unary '+'"), NULL;
    } else {
        e = parse_primary(p);
    }
    e = parse_postfix(p, e);
    return with_filter ? parse_filters(p, e) : e;
}

static chat_expr *binop(parser *p, int op, chat_expr *a, chat_expr *b) {
    if (!a || !b) return NULL;
    chat_expr *e = new_expr(p, CE_BINOP);
    if (e) e->op = op, e->a = a, e->b = b;
    return e;
}

static chat_expr *parse_math2(parser *p) {
    chat_expr *e = parse_unary(p, true);
    for (;;) {
        token *t = cur(p);
        if (is_op(t, "**")) return fail(p, MT_ERR_UNSUPPORTED, t->pos, "operator '**'"), NULL;
        if (is_op(t, "/")) return fail(p, MT_ERR_UNSUPPORTED, t->pos, "operator '/'"), NULL;
        int op = is_op(t, "*") ? CHAT_OP_MUL : is_op(t, "//") ? CHAT_OP_FLOORDIV
               : is_op(t, "%") ? CHAT_OP_MOD : -1;
        if (op < 0 || !e) return e;
        p->at++;
        e = binop(p, op, e, parse_unary(p, true));
    }
}

static chat_expr *parse_concat(parser *p) {
    chat_expr *e = parse_math2(p);
    if (!e || !is_op(cur(p), "~")) return e;
    chat_expr *c = new_expr(p, CE_CONCAT);
    if (!c) return NULL;
    int cap = 0;
    if (!grow(p, (void ***)&c->args, c->n_args, &cap)) return NULL;
    c->args[c->n_args++] = e;
    while (is_op(cur(p), "~")) {
        p->at++;
        chat_expr *a = parse_math2(p);
        if (!a || !grow(p, (void ***)&c->args, c->n_args, &cap)) return NULL;
        c->args[c->n_args++] = a;
    }
    return c;
}

static chat_expr *parse_math1(parser *p) {
    chat_expr *e = parse_concat(p);
    while (e && (is_op(cur(p), "+") || is_op(cur(p), "-"))) {
        int op = is_op(cur(p), "+") ? CHAT_OP_ADD : CHAT_OP_SUB;
        p->at++;
        e = binop(p, op, e, parse_concat(p));
    }
    return e;
}

static chat_expr *parse_compare(parser *p) {
    chat_expr *e = parse_math1(p);
    if (!e) return NULL;
    static const char *const ops[] = {"==", "!=", "<", "<=", ">", ">="};
    chat_expr *c = NULL;
    int cap = 0;
    for (;;) {
        int op = -1;
        for (int k = 0; k < 6; k++)
            if (is_op(cur(p), ops[k])) op = k;
        if (op >= 0) p->at++;
        else if (is_name(cur(p), "in")) op = CHAT_CMP_IN, p->at++;
        else if (is_name(cur(p), "not") && is_name(peek(p, 1), "in")) op = CHAT_CMP_NOTIN, p->at += 2;
        else break;
        if (!c) {
            if (!(c = new_expr(p, CE_COMPARE))) return NULL;
            c->a = e;
        }
        chat_expr *b = parse_math1(p);
        if (!b || !grow(p, (void ***)&c->args, c->n_args, &cap)) return NULL;
        int *nops = chat_arena_alloc(p->arena, (size_t)cap * sizeof *nops);
        if (!nops) return nomem(p), NULL;
        if (c->n_args) memcpy(nops, c->ops, (size_t)c->n_args * sizeof *nops);
        c->ops = nops;
        c->ops[c->n_args] = op;
        c->args[c->n_args++] = b;
    }
    return c ? c : e;
}

static chat_expr *parse_not(parser *p) {
    if (is_name(cur(p), "not")) {
        p->at++;
        chat_expr *e = new_expr(p, CE_NOT);
        if (!e || !(e->a = parse_not(p))) return NULL;
        return e;
    }
    return parse_compare(p);
}

static chat_expr *parse_and(parser *p) {
    chat_expr *e = parse_not(p);
    while (e && is_name(cur(p), "and")) {
        p->at++;
        chat_expr *x = new_expr(p, CE_AND);
        if (!x || !(x->b = parse_not(p))) return NULL;
        x->a = e;
        e = x;
    }
    return e;
}

static chat_expr *parse_or(parser *p) {
    chat_expr *e = parse_and(p);
    while (e && is_name(cur(p), "or")) {
        p->at++;
        chat_expr *x = new_expr(p, CE_OR);
        if (!x || !(x->b = parse_and(p))) return NULL;
        x->a = e;
        e = x;
    }
    return e;
}

static chat_expr *parse_expr(parser *p, bool with_cond) {
    chat_expr *e = parse_or(p);
    while (with_cond && e && is_name(cur(p), "if")) {
        p->at++;
        chat_expr *x = new_expr(p, CE_COND);
        if (!x || !(x->a = parse_or(p))) return NULL;
        if (is_name(cur(p), "else")) {
            p->at++;
            if (!(x->c = parse_expr(p, true))) return NULL;
        }
        x->b = e;
        e = x;
    }
    return e;
}

/* ---- statements ---- */

static bool parse_body(parser *p, chat_body *body, const char *const *ends, int n_ends,
                       const char *opener, size_t opener_pos);

static bool expect_block_end(parser *p) {
    if (cur(p)->k != T_BLOCK_END)
        return fail(p, MT_ERR_INVALID, cur(p)->pos, "expected end of tag, got %s", tok_desc(cur(p)));
    p->at++;
    return true;
}

static chat_node *new_node(parser *p, chat_node_kind k) {
    chat_node *n = chat_arena_alloc(p->arena, sizeof *n);
    if (!n) return nomem(p), NULL;
    n->kind = k;
    return n;
}

/* The name of the block tag at the cursor (just after '{%'). */
static bool at_tag(parser *p, const char *name) { return is_name(cur(p), name); }

static chat_node *parse_if(parser *p, size_t pos) {
    chat_node *n = new_node(p, CN_IF);
    if (!n) return NULL;
    int cap_c = 0, cap_b = 0;
    static const char *const ends[] = {"elif", "else", "endif"};
    for (;;) { /* at the condition of if / elif */
        chat_expr *c = parse_expr(p, true);
        if (!c || !expect_block_end(p)) return NULL;
        if (!grow(p, (void ***)&n->conds, n->n_branches, &cap_c)) return NULL;
        if (n->n_branches == cap_b) {
            int nc = cap_b ? 2 * cap_b : 4;
            chat_body *nb = chat_arena_alloc(p->arena, (size_t)nc * sizeof *nb);
            if (!nb) return nomem(p), NULL;
            if (cap_b) memcpy(nb, n->bodies, (size_t)cap_b * sizeof *nb);
            n->bodies = nb;
            cap_b = nc;
        }
        n->conds[n->n_branches] = c;
        if (!parse_body(p, &n->bodies[n->n_branches++], ends, 3, "if", pos)) return NULL;
        if (at_tag(p, "elif")) { p->at++; continue; }
        if (at_tag(p, "else")) {
            p->at++;
            if (!expect_block_end(p) || !parse_body(p, &n->else_body, ends + 2, 1, "if", pos))
                return NULL;
        }
        p->at++; /* endif */
        return expect_block_end(p) ? n : NULL;
    }
}

static chat_node *parse_for(parser *p, size_t pos) {
    chat_node *n = new_node(p, CN_FOR);
    if (!n) return NULL;
    token *t = cur(p);
    if (t->k != T_NAME) return fail(p, MT_ERR_INVALID, t->pos, "expected a loop variable"), NULL;
    if (is_op(peek(p, 1), ","))
        return fail(p, MT_ERR_UNSUPPORTED, peek(p, 1)->pos, "for loop over tuples (a, b)"), NULL;
    if (!(n->name = dup_name(p, t))) return NULL;
    p->at++;
    if (!is_name(cur(p), "in")) return fail(p, MT_ERR_INVALID, cur(p)->pos, "expected 'in'"), NULL;
    p->at++;
    if (!(n->expr = parse_expr(p, false))) return NULL;
    if (is_name(cur(p), "if")) return fail(p, MT_ERR_UNSUPPORTED, cur(p)->pos, "for loop filter (for ... if)"), NULL;
    if (is_name(cur(p), "recursive")) return fail(p, MT_ERR_UNSUPPORTED, cur(p)->pos, "recursive for loop"), NULL;
    if (!expect_block_end(p)) return NULL;
    static const char *const ends[] = {"else", "endfor"};
    if (!parse_body(p, &n->body, ends, 2, "for", pos)) return NULL;
    if (at_tag(p, "else")) {
        p->at++;
        if (!expect_block_end(p) || !parse_body(p, &n->else_body, ends + 1, 1, "for", pos)) return NULL;
    }
    p->at++; /* endfor */
    return expect_block_end(p) ? n : NULL;
}

static chat_node *parse_set(parser *p) {
    token *t = cur(p);
    if (t->k != T_NAME) return fail(p, MT_ERR_INVALID, t->pos, "expected a name after 'set'"), NULL;
    token *nx = peek(p, 1);
    if (is_op(nx, ".")) return fail(p, MT_ERR_UNSUPPORTED, nx->pos, "set of an attribute (namespace)"), NULL;
    if (is_op(nx, ",")) return fail(p, MT_ERR_UNSUPPORTED, nx->pos, "set of a tuple"), NULL;
    if (nx->k == T_BLOCK_END || is_op(nx, "|"))
        return fail(p, MT_ERR_UNSUPPORTED, t->pos, "block set ({%% set x %%}...{%% endset %%})"), NULL;
    chat_node *n = new_node(p, CN_SET);
    if (!n || !(n->name = dup_name(p, t))) return NULL;
    p->at++;
    if (!expect_op(p, "=") || !(n->expr = parse_expr(p, true))) return NULL;
    if (is_op(cur(p), ",")) return fail(p, MT_ERR_UNSUPPORTED, cur(p)->pos, "tuple"), NULL;
    return expect_block_end(p) ? n : NULL;
}

/* Parses nodes until a block tag named in ends (left at the cursor, after its '{%'), or the end of
 * the template when n_ends is 0. */
static bool parse_body(parser *p, chat_body *body, const char *const *ends, int n_ends,
                       const char *opener, size_t opener_pos) {
    int cap = 0;
    for (;;) {
        token *t = cur(p);
        chat_node *n = NULL;
        if (t->k == T_EOF) {
            if (!n_ends) return true;
            return fail(p, MT_ERR_INVALID, opener_pos, "'%s' is never closed (missing '%s')", opener,
                        ends[n_ends - 1]);
        } else if (t->k == T_DATA) {
            if (!(n = new_node(p, CN_TEXT))) return false;
            n->str = t->s;
            n->len = t->len;
            p->at++;
        } else if (t->k == T_VAR_BEGIN) {
            p->at++;
            if (!(n = new_node(p, CN_OUTPUT)) || !(n->expr = parse_expr(p, true))) return false;
            if (is_op(cur(p), ",")) return fail(p, MT_ERR_UNSUPPORTED, cur(p)->pos, "tuple");
            if (cur(p)->k != T_VAR_END)
                return fail(p, MT_ERR_INVALID, cur(p)->pos, "expected '}}', got %s", tok_desc(cur(p)));
            p->at++;
        } else if (t->k == T_BLOCK_BEGIN) {
            p->at++;
            token *name = cur(p);
            if (name->k != T_NAME) return fail(p, MT_ERR_INVALID, name->pos, "expected a tag name");
            for (int i = 0; i < n_ends; i++)
                if (is_name(name, ends[i])) return true;
            p->at++;
            if (is_name(name, "if")) n = parse_if(p, name->pos);
            else if (is_name(name, "for")) n = parse_for(p, name->pos);
            else if (is_name(name, "set")) n = parse_set(p);
            else if (is_name(name, "elif") || is_name(name, "else") || is_name(name, "endif") ||
                     is_name(name, "endfor") || is_name(name, "endset"))
                return fail(p, MT_ERR_INVALID, name->pos, "unexpected '%.*s'", (int)name->len, name->s);
            else
                return fail(p, MT_ERR_UNSUPPORTED, name->pos, "tag '%.*s'", (int)name->len, name->s);
            if (!n) return false;
        } else {
            return fail(p, MT_ERR_INVALID, t->pos, "unexpected %s", tok_desc(t));
        }
        if (!grow(p, (void ***)&body->nodes, body->n, &cap)) return false;
        body->nodes[body->n++] = n;
    }
}

mt_status chat_compile(const char *source, chat_template **out, mt_error *err) {
    if (!source) return mt_errorf(err, MT_ERR_INVALID, "chat template: no source");
    parser p = {.err = err};
    chat_template *t = calloc(1, sizeof *t);
    if (!t) return mt_errorf(err, MT_ERR_NOMEM, "chat template: out of memory");
    p.arena = &t->arena;
    /* jinja2: \r\n, \r and \n become \n, and one trailing newline is dropped. */
    size_t n = strlen(source);
    char *src = chat_arena_alloc(p.arena, n + 1);
    if (!src) { nomem(&p); goto fail; }
    size_t m = 0;
    for (size_t i = 0; i < n; i++) {
        if (source[i] == '\r') {
            src[m++] = '\n';
            if (i + 1 < n && source[i + 1] == '\n') i++;
        } else {
            src[m++] = source[i];
        }
    }
    if (m && src[m - 1] == '\n') m--;
    p.src = src;
    p.n = m;
    if (!lex(&p) || !push_tok(&p, T_EOF, NULL, 0, m)) goto fail;
    if (!parse_body(&p, &t->root, NULL, 0, NULL, 0)) goto fail;
    free(p.toks);
    *out = t;
    return MT_OK;
fail:
    free(p.toks);
    chat_free(t);
    return p.st;
}

void chat_free(chat_template *t) {
    if (!t) return;
    chat_arena_free(&t->arena);
    free(t);
}
