#!/usr/bin/env python3
"""Makes the chat template goldens: transformers' rendering of generated conversations, for
tests/chat_template_test.cc, which checks the C renderer (worker/text/chat_template.h) against
them without transformers.

    python3 tests/oracle/make_chat_goldens.py [--out tests/fixtures/chat/goldens.jsonl.gz]

Needs PyPI `transformers` (made with 5.25.0, jinja2 3.1.6; no torch). Renders with
PreTrainedTokenizerFast.apply_chat_template(..., tokenize=False) on the tokenizer of
tests/fixtures/glm_tok with bos_token and eos_token set, so the template sees what a served
request passes: messages, add_generation_prompt, bos_token, eos_token and chat_template_kwargs.

Templates: "demo" (tools/train/chat_template.jinja), "glm4_style"
(tests/fixtures/chat/glm4_style.jinja), each on N_CONV seeded conversations (system or not, 1-6
alternating user/assistant turns, observation turns, contents with many scripts, emoji, newlines,
edge whitespace, empty strings, text that looks like special tokens; add_generation_prompt both
ways; enable_thinking true/false/absent; a few unknown roles, which the templates reject), and
"snippet": small templates covering the subset's semantics one construct at a time.

Output: gzip'd JSON lines. The first is a header {"transformers", "jinja2", "bos", "eos",
"counts"}; then {"tpl": NAME, "template": SOURCE (snippets only), "messages": [[role, content]],
"agp": B, "kwargs": JSON text or null, "text": RENDERED} or, when transformers raised,
"error": MESSAGE instead of "text".
"""
import argparse
import gzip
import json
import os
import random

import jinja2
import transformers
from transformers import PreTrainedTokenizerFast

SEED = 20260411
N_CONV = 300
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
BOS, EOS = "<|bos|>", "<|endoftext|>"

SAMPLES = [
    "hello", "The quick brown fox", "Grüße aus Köln", "Ελληνικά κείμενα", "Привет, мир",
    "שלום עולם", "مرحبا بالعالم", "नमस्ते दुनिया", "বাংলা লেখা", "தமிழ் உரை", "ภาษาไทย",
    "ქართული", "日本語のテキスト", "中文文本，标点。", "한국어 문장", "Tiếng Việt có dấu",
    "ℝ∑∫≠≤ ∀x∈A", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "𠀀𠀁 ext-B", "e\u0301 combining", "zero\u200bwidth", "bom\ufeffin",
    "😀", "👍🏽", "👩‍💻", "🇯🇵🇩🇪", "🏳️‍🌈", "✨🔥", "1️⃣",
    "def f(x):\n    return x * 2\n", "{\"json\": [1, 2, {\"a\": null}]}", "a\\nb 'quoted' \"dq\"",
    "<|user|>", "<|assistant|>", "<|system|>", "<|observation|>", "[gMASK]<sop>", "<think>",
    "</think>", "{{ not a template }}", "{% if %}", "/nothink", "<|endoftext|>",
]
EDGES = ["", " ", "  ", "\n", "\n\n", "\t", "\u3000", "\xa0", "\u2028", "\r\n", " \n "]


def content(rng):
    if rng.random() < 0.06:
        return rng.choice(["", " ", "\n", "   \n\t"])
    parts = [rng.choice(SAMPLES) for _ in range(rng.randint(1, 4))]
    seps = [" ", "\n", "", "  ", "\n\n", ", "]
    s = parts[0]
    for p in parts[1:]:
        s += rng.choice(seps) + p
    if rng.random() < 0.3:
        s = rng.choice(EDGES) + s
    if rng.random() < 0.3:
        s = s + rng.choice(EDGES)
    if rng.random() < 0.08:
        s += " /nothink"
    return s


def assistant_content(rng):
    r = rng.random()
    if r < 0.25:
        return "<think>" + content(rng) + "</think>" + content(rng)
    if r < 0.3:
        return rng.choice(["", "\n", "<think></think>"])
    return content(rng)


def conversation(rng, observations):
    msgs = []
    if rng.random() < 0.5:
        msgs.append(("system", content(rng)))
    for _ in range(rng.randint(1, 6)):
        msgs.append(("user", content(rng)))
        msgs.append(("assistant", assistant_content(rng)))
        if observations and rng.random() < 0.3:
            for _ in range(rng.randint(1, 2)):
                msgs.append(("observation", content(rng)))
            msgs.append(("assistant", assistant_content(rng)))
    if rng.random() < 0.5:
        msgs.pop()  # end on the user (or an observation)
    if rng.random() < 0.03:
        msgs.insert(rng.randrange(len(msgs) + 1), (rng.choice(["tool_call", "function", "System"]), "x"))
    return msgs


def kwargs(rng):
    r = rng.random()
    if r < 0.34:
        return None
    k = {"enable_thinking": r < 0.67}
    if rng.random() < 0.2:
        k["unused_flag"] = [1, "two", None]
    return k


# Small templates, each exercising part of the subset; rendered with SNIPPET_MESSAGES.
SNIPPETS = [
    "{% set x = 1 %}{% for m in messages %}{{ x }}{% set x = 2 %}{{ x }}{% endfor %}{{ x }}",
    "{% set y = 5 %}{% for m in messages %}{% if loop.first %}{% set y = 1 %}{% endif %}[{{ y }}]{% endfor %}",
    "a\n  {# c #}\nb", "a\n  {{ 1 }}  \n  {% if 1 %}x{% endif %}\nb", "{{ 'a' }}  {% if 1 %}x{% endif %}",
    "x {% if 1 %}\ny{% endif %}\n z", "{#c#}\nz", "a\r\nb\n", "a\n\n", "{{ u.x }}", "{{ u.x is defined }}",
    "{{ n.x }}", "{{ (1 == True) }}", "{{ 'a' in u }}", "{{ 'a' < 1 }}", "{{ u ~ 1 }}", "{{ u + 1 }}",
    "{{ x or 'd' }}", "{{ 1 and 'q' }}", "{{ '\\n\\q\\x41\\u00e9\\t' }}", "{{ 'abc'[-1] }}{{ 'h\u00e9llo'[1] }}",
    "{{ messages[5] is defined }}", "{{ messages[-1].content }}",
    "{% for a in messages %}{% for b in messages %}{{ loop.index }}{% endfor %}{{ loop.index }}{% endfor %}",
    "\t  {%- if 1 %}x{% endif %}", "{% if 1 -%}  \n\n x{%- endif %}", " {%+ if 1 %}x{% endif %}",
    "  {% if 1 +%}\nx{% endif %}", "{{ 'x' ~ none }}{{ none }}{{ true }}", "{{ 'a' 'b' }}", "{{ -1 }}",
    "{{ 3 - 1 }}", "{{ 7 // -2 }}{{ -7 % 3 }}{{ 2 * 3 }}{{ 'ab' * 2 }}", "{{ ' \u3000x\u200b '.strip() }}|",
    "{{ u|tojson }}", "{{ [1, 'a\"\\n\\u0001\u00e9', none, true]|tojson }}", "{{ messages|tojson }}",
    "{% for x in messages %}{{ x.role }}{% else %}E{% endfor %}{{ x }}", "{% for x in [] %}{{ x }}{% else %}E{% endfor %}",
    "{{ messages[0]['role'] }}", "{{ true + 1 }}", "{{ u['x'] }}", "{{ 1 if u }}|", "{{ not u }}", "{{ u == u }}",
    "{{ u|length }}{{ messages|length }}{{ 'h\u00e9'|length }}", "{{ 'a' in none }}", "{{ 5 is string }}",
    "{{ u is none }}{{ none is none }}{{ 1 is number }}{{ true is integer }}{{ d is mapping }}{{ false is false }}",
    "{% for a in 'ab\u00e9' %}{{ a }}{{ loop.revindex }}{{ loop.revindex0 }}{{ loop.length }}{% endfor %}",
    "{% for a in messages[0] %}{{ a }}{% endfor %}", "{% for a in u %}{{ a }}{% endfor %}", "{% for a in 3 %}{% endfor %}",
    "{{ raise_exception('boom ' ~ 1) }}", "{{ u | default('d') }}{{ '' | default('e', true) }}{{ 0|d('z') }}{{ u|default }}|",
    "{{ ' X '|trim|lower }}{{ 'y'|upper }}{{ 'xxyxx'|trim('x') }}{{ 5|string ~ 'a' }}",
    "{{ 'abc'.startswith('ab') }}{{ 'abc'.endswith('bc') }}{{ 'xxaxx'.strip('x') }}{{ '  a '.lstrip() }}|{{ ' a  '.rstrip() }}|",
    "{{ 1 < 2 < 3 }}{{ 3 > 2 > 2 }}{{ 'a' not in 'abc' }}{{ 2 in [1,2] }}{{ 'b' >= 'a' }}{{ 2 <= 1 }}",
    "{{ enable_thinking }}{{ enable_thinking is defined }}", "{% if enable_thinking is defined and not enable_thinking %}off{% endif %}",
    "{{ bos_token }}{{ eos_token }}", "{{ 'a' + 1 }}", "{{ messages.0.role }}", "{{ loop }}",
    "{{ 'x' if false else 'y' }}{{ 'x' if true }}", "{{ messages[0].content|trim }}|{{ messages[0].content.strip() }}|",
    "{{ not 1 == 2 }}{{ -2 + 3 }}", "{{- '  a  ' -}}   \n  {{ 'b' }}", "{%- for m in messages -%}\n  {{ m.role }}\n{%- endfor %}",
    "a   {#- c -#}   b", "{% if true %}\n    x\n    {% if true %}\n        y\n    {% endif %}\n{% endif %}\n",
    "{{ (x.y is defined) if x is defined else 'nope' }}", "{{ messages|length > 2 and messages[0].role == 'system' }}",
    "{{ d.a }}{{ d.c.e }}{{ 'a' in d }}{{ d|tojson }}{{ d.b|length }}{{ d.b[2] }}", "{% set d = 1 %}{{ d }}",
    "{{ 1 // 0 }}", "{{ [1, 2] + [3] | length }}{{ ([1] + [2])|tojson }}", "{{ 'a' == 'a' != 'b' }}",
    "{% for m in messages %}{% if loop.index0 % 2 == 0 %}E{% else %}O{% endif %}{{ loop.last }}{% endfor %}",
    "{% for m in messages %}{% if m.role == 'system' %}{% elif m.role == 'user' %}U{% else %}A{% endif %}{% endfor %}",
    "line1\n{% for m in messages %}\n  - {{ m.role }}\n{% endfor %}\nend\n", "{{ 'x'.strip(none) }}{{ 'x'.startswith(1) }}",
    "{% if u.startswith('a') %}{% endif %}", "{{ n.strip() }}", "{{ 5 < u }}", "{{ -'a' }}",
]
SNIPPET_MESSAGES = [("system", "  sys  "), ("user", "hi\n"), ("assistant", "yo")]
SNIPPET_KWARGS = {"d": {"a": 1, "b": [True, None, "x"], "c": {"e": "\u00e9"}}, "n": None}


def render(tok, template, msgs, agp, kw):
    try:
        text = tok.apply_chat_template([{"role": r, "content": c} for r, c in msgs], chat_template=template,
                                       tokenize=False, add_generation_prompt=agp, **(kw or {}))
        return {"text": text}
    except Exception as e:  # the template raised (raise_exception, a type error, ...)
        return {"error": "%s: %s" % (type(e).__name__, e)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(ROOT, "tests/fixtures/chat/goldens.jsonl.gz"))
    args = ap.parse_args()
    tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(ROOT, "tests/fixtures/glm_tok/tokenizer.json"),
                                  bos_token=BOS, eos_token=EOS)
    rng = random.Random(SEED)
    rows, counts = [], {}
    for name, path, obs in [("demo", "tools/train/chat_template.jinja", True),
                            ("glm4_style", "tests/fixtures/chat/glm4_style.jinja", True)]:
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            template = f.read()
        for _ in range(N_CONV):
            msgs, agp, kw = conversation(rng, obs), rng.random() < 0.5, kwargs(rng)
            row = {"tpl": name, "messages": msgs, "agp": agp, "kwargs": json.dumps(kw) if kw is not None else None}
            row.update(render(tok, template, msgs, agp, kw))
            rows.append(row)
            counts[name] = counts.get(name, 0) + 1
    for template in SNIPPETS:
        for agp in (False, True):
            row = {"tpl": "snippet", "template": template, "messages": SNIPPET_MESSAGES, "agp": agp,
                   "kwargs": json.dumps(SNIPPET_KWARGS)}
            row.update(render(tok, template, SNIPPET_MESSAGES, agp, SNIPPET_KWARGS))
            rows.append(row)
            counts["snippet"] = counts.get("snippet", 0) + 1
    header = {"transformers": transformers.__version__, "jinja2": jinja2.__version__, "bos": BOS, "eos": EOS,
              "counts": counts}
    with gzip.GzipFile(args.out, "wb", mtime=0) as f:
        for row in [header] + rows:
            f.write((json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8"))
    errors = sum("error" in r for r in rows)
    print("wrote %s: %s, %d raised" % (args.out, counts, errors))


if __name__ == "__main__":
    main()
