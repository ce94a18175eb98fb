/* worker/text/chat_template.h: chat templates (the Jinja source in tokenizer_config.json's
 * `chat_template`) rendered in C with the text that transformers' apply_chat_template gives.
 *
 * transformers renders with jinja2's ImmutableSandboxedEnvironment(trim_blocks=True,
 * lstrip_blocks=True) and these variables: messages (a list of {role, content} dicts), tools and
 * documents (None), add_generation_prompt, the tokenizer's special tokens (bos_token, eos_token)
 * and then the request's chat_template_kwargs, which win over the special tokens. chat_render
 * passes the same ones.
 *
 * The subset (anything else is refused by chat_compile, naming the construct and its line:column):
 *   - text, {{ expr }}, {# comments #}, whitespace control {%- -%} {{- -}} {#- -#} and {%+ +%},
 *     trim_blocks and lstrip_blocks as jinja2 applies them, the source's newlines normalised and
 *     one trailing newline dropped (jinja2's defaults);
 *   - {% if %} {% elif %} {% else %} {% endif %};
 *     {% for x in expr %} ... {% else %} ... {% endfor %} with loop.index, index0, revindex,
 *     revindex0, first, last, length (each iteration is its own scope, as in jinja2);
 *     {% set name = expr %};
 *   - expressions: string (with Python escapes), integer, true/false/none literals (either case),
 *     list literals [a, b], variables, a.b, a['b'], a[0] (negative indexes too), `x if c else y`,
 *     == != < > <= >= (chained), in, not in, and, or, not, + - * // % on integers, + on strings
 *     and lists, ~, unary -, parentheses;
 *     tests: defined, undefined, none, string, number, integer, boolean, mapping, true, false
 *     (each with `is not`);
 *     filters: trim, length/count, default/d (with the boolean second argument), upper, lower,
 *     string, tojson (transformers' own: json.dumps with ensure_ascii=False);
 *     raise_exception(msg); string methods strip/lstrip/rstrip (optional chars), startswith,
 *     endswith.
 *   Undefined values behave as jinja2's default Undefined: they print as "", are false, are empty
 *   to `for`, `length` and `in`, and an attribute, item, arithmetic or ordering of one is an error.
 *
 * Not refused at compile but refused at render with MT_ERR_UNSUPPORTED (never a guessed text):
 * printing a float, list or dict (Python's repr), tojson of a float, upper/lower of non-ASCII text,
 * and attributes of dicts, strings or lists that name a Python method without calling it.
 *
 * Ownership and threads: a chat_template is immutable after chat_compile; any number of threads
 * may call chat_render on it at once (each render allocates its own state and frees it before
 * returning). The caller frees it with chat_free.
 */
#ifndef CHAT_TEMPLATE_H
#define CHAT_TEMPLATE_H

#include <stdbool.h>
#include <stddef.h>

#include "common/mt.h"
#include "worker/text/tokenizer.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct chat_template chat_template;

/* One message; NULL role or content is rendered as Python's None. Borrowed for the call. */
typedef struct chat_message {
    const char *role;
    const char *content;
} chat_message;

/* The tokenizer's special tokens as the template sees them; NULL = not passed (undefined). */
typedef struct chat_vars {
    const char *bos_token;
    const char *eos_token;
} chat_vars;

/* Parses source (NUL-terminated UTF-8). On failure *out is untouched, the status is
 * MT_ERR_UNSUPPORTED (a construct outside the subset) or MT_ERR_INVALID (a syntax error), and err
 * says "chat template LINE:COL: ...". The caller frees *out with chat_free. */
mt_status chat_compile(const char *source, chat_template **out, mt_error *err);
void chat_free(chat_template *t); /* NULL ok */

/* Appends the rendering of msgs[0..n) to out. kwargs_json: a JSON object of extra variables (the
 * request's chat_template_kwargs, e.g. {"enable_thinking": false}) or NULL; it may not set
 * messages, tools, documents or add_generation_prompt. extra may be NULL.
 * Errors: MT_ERR_INVALID when kwargs_json is not a JSON object, the template raises
 * (raise_exception: err holds its message), or an operation fails as it would in jinja2 (a type
 * error, an undefined value used as an error); MT_ERR_UNSUPPORTED for the render-time limits
 * above; MT_ERR_NOMEM. On failure out->n is as it was. */
mt_status chat_render(const chat_template *t, const chat_message *msgs, size_t n,
                      bool add_generation_prompt, const char *kwargs_json, const chat_vars *extra,
                      tok_text *out, mt_error *err);

#ifdef __cplusplus
}
#endif
#endif /* CHAT_TEMPLATE_H */
