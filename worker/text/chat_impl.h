/* worker/text/chat_impl.h: the parsed form of a chat template, shared by the parser
 * (chat_parse.c) and the evaluator (chat_eval.c). Not for other modules: they use
 * chat_template.h. */
#ifndef CHAT_IMPL_H
#define CHAT_IMPL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "worker/text/chat_template.h"

/* A bump allocator: blocks freed together. Used for the parsed tree and for each render. */
typedef struct chat_arena {
    struct chat_block *head;
} chat_arena;
void *chat_arena_alloc(chat_arena *a, size_t n); /* zeroed; NULL on out of memory */
void chat_arena_free(chat_arena *a);

typedef enum chat_expr_kind {
    CE_STR,     /* str, len */
    CE_INT,     /* i */
    CE_BOOL,    /* i */
    CE_NONE,
    CE_LIST,    /* args[n_args] */
    CE_VAR,     /* name */
    CE_ATTR,    /* a.name */
    CE_ITEM,    /* a[b] */
    CE_BINOP,   /* a op b: op is a CHAT_OP_* */
    CE_COMPARE, /* a, then args[i] compared with ops[i] in a chain */
    CE_AND,
    CE_OR,
    CE_NOT,     /* not a */
    CE_NEG,     /* -a */
    CE_CONCAT,  /* args[n_args] joined by ~ */
    CE_COND,    /* b if a else c (c may be NULL) */
    CE_TEST,    /* a is [not] name: i = negated */
    CE_FILTER,  /* a | name(args) */
    CE_RAISE,   /* raise_exception(args[0]) */
    CE_METHOD,  /* a.name(args) */
} chat_expr_kind;

enum { CHAT_OP_ADD, CHAT_OP_SUB, CHAT_OP_MUL, CHAT_OP_FLOORDIV, CHAT_OP_MOD };
enum { CHAT_CMP_EQ, CHAT_CMP_NE, CHAT_CMP_LT, CHAT_CMP_LE, CHAT_CMP_GT, CHAT_CMP_GE, CHAT_CMP_IN,
       CHAT_CMP_NOTIN };

typedef struct chat_expr {
    chat_expr_kind kind;
    int op;
    const char *name;       /* NUL-terminated, in the template's arena */
    const char *str;        /* CE_STR bytes */
    size_t len;
    int64_t i;
    struct chat_expr *a, *b, *c;
    struct chat_expr **args;
    int *ops;               /* CE_COMPARE: [n_args] */
    int n_args;
} chat_expr;

typedef enum chat_node_kind {
    CN_TEXT,    /* str, len */
    CN_OUTPUT,  /* {{ expr }} */
    CN_IF,      /* conds[n_branches] with bodies[n_branches]; else_body */
    CN_FOR,     /* for name in expr: body, else_body */
    CN_SET,     /* set name = expr */
} chat_node_kind;

typedef struct chat_body {
    struct chat_node **nodes;
    int n;
} chat_body;

typedef struct chat_node {
    chat_node_kind kind;
    const char *str;
    size_t len;
    const char *name;
    chat_expr *expr;
    chat_expr **conds;
    chat_body *bodies;
    int n_branches;
    chat_body body, else_body;
} chat_node;

struct chat_template {
    chat_arena arena;
    chat_body root;
};

#endif /* CHAT_IMPL_H */
