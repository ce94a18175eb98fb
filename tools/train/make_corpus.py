#!/usr/bin/env python3
"""Turns the Python 3.11 documentation (Debian package python3.11-doc, PSF license) into plain-text
documents for training the demo model, and splits off a held-out set.

    python3 tools/train/make_corpus.py [--html /usr/share/doc/python3.11/html] --out DIR

One HTML page is one document. Only the page's main body (<div class="body">) is kept; tags are
stripped and entities unescaped; block elements (paragraphs, headings, list items, table rows,
definitions) become paragraphs separated by a blank line; <pre> blocks (code) keep their lines
and indentation. The index pages (genindex*, py-modindex, search) are skipped.

The split is deterministic: pages are ordered by the SHA-1 of their relative path; the first ones
in that order go to the held-out set until it holds HELDOUT_CHARS characters (about 12-14k tokens
with the demo tokenizer; tools/train/make_tokenizer.py checks that it stays under 16k), the rest
is training text. Output:
    DIR/train.jsonl   one JSON object per line: {"path": ..., "text": ...}, sorted by path
    DIR/heldout.txt   the held-out documents in hash order, separated by a line holding only a
                      form feed (the split string is "\\n\\f\\n"; no document contains \\f)
"""
import argparse
import hashlib
import html.parser
import json
import os
import re

HELDOUT_CHARS = 48000
SKIP = re.compile(r"^(genindex.*|py-modindex|search|contents)\.html$")
BLOCK = {"p", "h1", "h2", "h3", "h4", "h5", "h6", "li", "dt", "dd", "tr", "div", "section",
         "blockquote", "table", "ul", "ol", "dl", "caption", "figure", "br", "hr"}
DROP = {"script", "style"}


class BodyText(html.parser.HTMLParser):
    """Collects the text of <div class="body"> as paragraphs; <pre> is kept verbatim."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.depth = 0          # div nesting depth inside the body div (0 = outside)
        self.pre = 0            # inside <pre>
        self.drop = 0           # inside script/style or a headerlink anchor
        self.blocks = []        # finished paragraphs
        self.cur = []           # pieces of the paragraph being built

    def flush(self):
        s = "".join(self.cur)
        self.cur = []
        s = s.strip("\n")
        if s.strip():
            self.blocks.append(s)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if self.depth == 0:
            if tag == "div" and "body" in (a.get("class") or "").split():
                self.depth = 1
            return
        if tag == "div":
            self.depth += 1
        if tag in DROP or (tag == "a" and "headerlink" in (a.get("class") or "").split()):
            self.drop += 1
            return
        if tag == "pre":
            self.flush()
            self.pre += 1
        elif tag in BLOCK and not self.pre:
            self.flush()
        elif tag in ("td", "th") and not self.pre:
            self.cur.append(" ")

    def handle_endtag(self, tag):
        if self.depth == 0:
            return
        if tag in DROP or (tag == "a" and self.drop):
            self.drop = max(0, self.drop - 1)
            return
        if tag == "pre":
            self.pre = max(0, self.pre - 1)
            self.flush()
        elif tag in BLOCK and not self.pre:
            self.flush()
        if tag == "div":
            self.depth -= 1
            if self.depth == 0:
                self.flush()

    def handle_data(self, data):
        if self.depth == 0 or self.drop:
            return
        if self.pre:
            self.cur.append(data)
        else:
            self.cur.append(re.sub(r"\s+", " ", data))

    def text(self):
        self.flush()
        out = []
        for b in self.blocks:
            if "\n" in b:  # a code block: keep lines, drop trailing spaces
                out.append("\n".join(line.rstrip() for line in b.split("\n")))
            else:
                out.append(b.strip())
        return "\n\n".join(x for x in out if x)


def page_text(path):
    with open(path, encoding="utf-8") as f:
        raw = f.read()
    p = BodyText()
    p.feed(raw)
    p.close()
    # the parser already unescaped entities (convert_charrefs)
    return p.text().replace("\f", "").replace("\r", "").replace("\u00b6", "")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--html", default="/usr/share/doc/python3.11/html")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    pages = []
    for root, dirs, files in os.walk(a.html):
        dirs[:] = sorted(d for d in dirs if not d.startswith("_"))
        for fn in sorted(files):
            if not fn.endswith(".html") or SKIP.match(fn):
                continue
            rel = os.path.relpath(os.path.join(root, fn), a.html)
            text = page_text(os.path.join(root, fn))
            if len(text) >= 200:
                pages.append((rel, text))
    pages.sort(key=lambda p: hashlib.sha1(p[0].encode()).hexdigest())
    held, train, n = [], [], 0
    for rel, text in pages:
        if n < HELDOUT_CHARS and n + len(text) <= HELDOUT_CHARS + 4000:
            held.append((rel, text))
            n += len(text)
        else:
            train.append((rel, text))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "train.jsonl"), "w", encoding="utf-8") as f:
        for rel, text in sorted(train):
            f.write(json.dumps({"path": rel, "text": text}, ensure_ascii=False) + "\n")
    with open(os.path.join(a.out, "heldout.txt"), "w", encoding="utf-8") as f:
        f.write("\n\f\n".join(t for _, t in held))
    print(json.dumps({"train_docs": len(train), "train_chars": sum(len(t) for _, t in train),
                      "heldout_docs": len(held), "heldout_chars": n,
                      "heldout_paths": [r for r, _ in held]}))


if __name__ == "__main__":
    main()
