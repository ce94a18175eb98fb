#!/usr/bin/env python3
"""Makes the tokenizer goldens: ids and text from the `tokenizers` library on generated strings,
for tests/tokenizer_test.cc, which checks the C tokenizer against them without the library.

    python3 tests/oracle/make_tokenizer_goldens.py [--out tests/fixtures/tok_goldens.jsonl.gz]

Run from the repository root. Tokenizers: the fixtures glm_tok and glm_tok_flags, two variants of
glm_tok, and the demo model's tokenizer (models/glm5-next-demo, the one the service ships).

Needs the `tokenizers` library (PyPI; made with 0.23.3) and Python's unicodedata at Unicode 14.0
(Python 3.11), the Unicode version of Debian 12's PCRE2: strings use only code points assigned
in Unicode 14. Every string is generated here from a fixed seed (no outside text): scripts,
emoji, whitespace runs, source code, numbers, added tokens written inside text, and for decoding
random ids and ids whose bytes split characters. The demo model's records come last and draw
from their own seed (DEMO_SEED), so adding them left the records before them as they were.

Output: gzip'd JSON lines. The first is a header {"library", "unicode", "counts"}; then
  {"fx": F, "enc": TEXT, "special": B, "ids": [...]}       encode(TEXT, add_special_tokens=B)
      plus "dec" / "dec_skip" (decode of ids with skip_special_tokens false / true) only when
      they differ from what the test derives: the post-processor's text + TEXT, and TEXT;
  {"fx": F, "dec_ids": [...], "dec": TEXT, "dec_skip": TEXT}
F names the fixture directory under tests/fixtures (glm_tok or glm_tok_flags), a variant of
glm_tok that the header's "variants" describes (fields of tokenizer.json replaced), or, when it
contains "models/", a directory relative to the repository root (models/glm5-next-demo).
The header's "counts" gives each F's numbers of records.
"""
import argparse
import gzip
import json
import os
import random
import sys
import tempfile
import unicodedata

import tokenizers
from tokenizers import Tokenizer

SEED = 20261204
N_ENC = 10000        # strings encoded with glm_tok
N_ENC_FLAGS = 1500   # strings encoded with glm_tok_flags
N_DEC = 3000         # id lists decoded with glm_tok
N_DEC_FLAGS = 300    # id lists decoded with glm_tok_flags
N_ENC_VARIANT = 500  # strings encoded with each variant below
N_DEC_VARIANT = 50
DEMO = "models/glm5-next-demo"  # the demo model's tokenizer, relative to the repository root
DEMO_SEED = 20261205  # its own generator, so the records above stay as they were
N_ENC_DEMO = 10000
N_DEC_DEMO = 1200
PREFIX = "[gMASK]<sop>"  # every tokenizer's TemplateProcessing prefix; the test assumes it

# Variants of glm_tok for the options the fixtures do not use: field (dotted path) -> new value.
# The test builds the same files from the header.
VARIANTS = {
    "glm_tok+ignore_merges": {"model.ignore_merges": True},
    "glm_tok+gpt2_regex": {"pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False,
                                             "trim_offsets": True, "use_regex": True}},
}

# Blocks of many scripts (first, last code point); only assigned code points are drawn.
SCRIPTS = {
    "latin": (0x0041, 0x024F), "ipa": (0x0250, 0x02AF), "greek": (0x0370, 0x03FF),
    "cyrillic": (0x0400, 0x052F), "armenian": (0x0531, 0x058A), "hebrew": (0x0591, 0x05F4),
    "arabic": (0x0600, 0x06FF), "syriac": (0x0700, 0x074F), "thaana": (0x0780, 0x07B1),
    "devanagari": (0x0900, 0x097F), "bengali": (0x0980, 0x09FE), "gurmukhi": (0x0A01, 0x0A76),
    "gujarati": (0x0A81, 0x0AFF), "tamil": (0x0B82, 0x0BFA), "telugu": (0x0C00, 0x0C7F),
    "kannada": (0x0C80, 0x0CF2), "malayalam": (0x0D00, 0x0D7F), "sinhala": (0x0D81, 0x0DF4),
    "thai": (0x0E01, 0x0E5B), "lao": (0x0E81, 0x0EDF), "tibetan": (0x0F00, 0x0FDA),
    "myanmar": (0x1000, 0x109F), "georgian": (0x10A0, 0x10FF), "hangul_jamo": (0x1100, 0x11FF),
    "ethiopic": (0x1200, 0x137C), "cherokee": (0x13A0, 0x13FD), "canadian": (0x1400, 0x167F),
    "ogham": (0x1680, 0x169C), "runic": (0x16A0, 0x16F8), "khmer": (0x1780, 0x17F9),
    "mongolian": (0x1800, 0x18AA), "vietnamese": (0x1EA0, 0x1EF9), "greek_ext": (0x1F00, 0x1FFE),
    "punct": (0x2000, 0x206F), "super_sub": (0x2070, 0x209C), "currency": (0x20A0, 0x20C0),
    "letterlike": (0x2100, 0x214F), "number_forms": (0x2150, 0x218B), "arrows": (0x2190, 0x21FF),
    "math": (0x2200, 0x22FF), "box": (0x2500, 0x259F), "dingbats": (0x2700, 0x27BF),
    "braille": (0x2800, 0x28FF), "cjk_punct": (0x3000, 0x303F), "hiragana": (0x3041, 0x309F),
    "katakana": (0x30A0, 0x30FF), "bopomofo": (0x3105, 0x312F), "cjk": (0x4E00, 0x9FFF),
    "yi": (0xA000, 0xA4C6), "hangul": (0xAC00, 0xD7A3), "fullwidth": (0xFF01, 0xFFEE),
    "combining": (0x0300, 0x036F), "gothic": (0x10330, 0x1034A), "cuneiform": (0x12000, 0x12399),
    "math_alnum": (0x1D400, 0x1D7FF), "cjk_ext_b": (0x20000, 0x2A6DF), "tags": (0xE0020, 0xE007F),
    "private": (0xE000, 0xF8FF), "specials": (0xFFF9, 0xFFFD),
}
SPACES = [" ", " ", " ", "\t", "\n", "\n", "\r", "\r\n", "\x0b", "\x0c", "\x85", "\xa0", "\u1680",
          "\u2000", "\u2003", "\u2009", "\u200a", "\u2028", "\u2029", "\u202f", "\u205f", "\u3000",
          "\u180e", "\u200b", "\ufeff"]
EMOJI = ["😀", "😂", "🥲", "👍", "👍🏽", "❤️", "🇩🇪", "🇯🇵", "👩‍💻", "👨‍👩‍👧‍👦", "🏳️‍🌈", "✨", "🔥",
         "🧑🏿‍🚀", "☕", "1️⃣", "#️⃣", "🫠", "🫶🏻", "🪐", "©️", "™", "🤌", "🥹"]
CONTRACTIONS = ["'s", "'S", "'t", "'T", "'re", "'RE", "'Re", "'ve", "'VE", "'m", "'M", "'ll",
                "'LL", "'d", "'D", "'x", "'"]
WORDS = ("the of and to in is for that with as on by this are be from it an or at not you "
         "function return value list object string class module import file data type error "
         "print number result default example section python call method self none true false "
         "Hello World GLM tokenizer über naïve café résumé Straße Ελλάδα Москва 東京 서울").split()
CODE = [
    "def {f}({a}, {b}=None):\n    return {a} + {b}\n",
    "for (int {a} = 0; {a} < {n}; {a}++) {{\n\t{b}[{a}] = {a} * {n};\n}}\n",
    "if ({a} != NULL && {b}->{f} >= {n}) return -{n};",
    "const {f} = ({a}) => {{ return `${{{a}}}:{n}`; }};",
    "    {a}_{b} = {{'{f}': [{n}, {n}.5, -{n}e-3], \"k\": None}}  # {f}\n",
    "#include <stdio.h>\nint main(void) {{ printf(\"%d\\n\", {n}); }}\n",
    "SELECT {a}, COUNT(*) FROM {b} WHERE {f} > {n} GROUP BY {a};",
    "<div class=\"{a}\">{b} &amp; {f}</div>\n",
    "fn {f}(&mut self, {a}: u32) -> Result<(), Error> {{ Ok(()) }}",
    "{a} := make(map[string]int, {n})\n{a}[\"{b}\"]++\n",
    "$ ls -la /usr/{a}/{b} | grep '{f}' && echo $?\n",
    "\t\t{a}.{f}({b}, {n})\r\n",
]
ASCII_PUNCT = "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"


def assigned(cp):
    c = chr(cp)
    cat = unicodedata.category(c)
    return cat not in ("Cn", "Cs")


class Gen:
    def __init__(self, rng, vocab_words, added):
        self.r = rng
        self.vocab_words = vocab_words
        self.added = added

    def char(self, script=None):
        r = self.r
        lo, hi = SCRIPTS[script or r.choice(list(SCRIPTS))]
        for _ in range(100):
            cp = r.randint(lo, hi)
            if assigned(cp):
                return chr(cp)
        return "x"

    def script_word(self, script=None):
        script = script or self.r.choice(list(SCRIPTS))
        return "".join(self.char(script) for _ in range(self.r.randint(1, 8)))

    def space(self):
        r = self.r
        k = r.choice([1, 1, 1, 2, 3, 5, 17])
        return "".join(r.choice(SPACES) for _ in range(k)) if r.random() < 0.4 else " " * k

    def word(self):
        r = self.r
        x = r.random()
        if x < 0.35:
            return r.choice(self.vocab_words)
        if x < 0.5:
            return r.choice(WORDS)
        if x < 0.75:
            return self.script_word()
        if x < 0.82:
            return r.choice(EMOJI)
        if x < 0.9:
            return self.number()
        return "".join(r.choice(ASCII_PUNCT) for _ in range(r.randint(1, 4)))

    def number(self):
        r = self.r
        forms = [lambda: str(r.randint(0, 9)), lambda: str(r.randint(0, 10**r.randint(1, 30))),
                 lambda: f"{r.uniform(-1e6, 1e6):.{r.randint(0, 8)}f}",
                 lambda: f"{r.random():e}", lambda: f"{r.randint(0, 10**9):,}",
                 lambda: "".join(r.choice("٠١٢٣٤٥٦٧٨٩०१२३४५६७८९０１２３") for _ in range(r.randint(1, 7))),
                 lambda: "0x%x" % r.randint(0, 2**64), lambda: r.choice("½⅓¼²³₁₂Ⅻ")]
        return r.choice(forms)()

    def sentence(self):
        r = self.r
        out = []
        for _ in range(r.randint(1, 14)):
            out.append(self.word())
            if r.random() < 0.1:
                out.append(r.choice(CONTRACTIONS))
            out.append(" " if r.random() < 0.8 else self.space())
        if r.random() < 0.5:
            out.append(r.choice(".!?…。"))
        return "".join(out)

    def code(self):
        r = self.r
        names = ["x", "i", "buf", "self", "tokenizer", "_priv", "ÄØ", "变量", "n2"]
        return r.choice(CODE).format(f=r.choice(names) + "_fn", a=r.choice(names), b=r.choice(names),
                                     n=r.randint(0, 99999))

    def whitespace_run(self):
        r = self.r
        parts = []
        for _ in range(r.randint(1, 8)):
            parts.append(r.choice(SPACES) * r.randint(1, 6))
            if r.random() < 0.4:
                parts.append(self.word())
        return "".join(parts)

    def with_added(self, base):
        """base with added tokens (or near misses) put inside it."""
        r = self.r
        s = base
        for _ in range(r.randint(1, 4)):
            t = r.choice(self.added)
            if r.random() < 0.15:
                t = t[:r.randint(1, max(1, len(t) - 1))]  # a prefix that matches nothing
            pad_l = r.choice(["", "", " ", "  ", "\n", "\t ", "\u3000", "a", "_", "é", "1"])
            pad_r = r.choice(["", "", " ", "  ", "\n", " \t", "\xa0", "b", "_", "\u0301", "2"])
            at = r.randint(0, len(s))
            s = s[:at] + pad_l + t + pad_r + s[at:]
        return s

    def random_mix(self):
        r = self.r
        n = r.randint(0, 40)
        pools = [lambda: self.char(), lambda: r.choice(SPACES), lambda: r.choice(ASCII_PUNCT),
                 lambda: chr(r.randint(0x20, 0x7e)), lambda: r.choice(EMOJI),
                 lambda: r.choice(CONTRACTIONS), lambda: r.choice("\x00\x01\x1b\x7f\x9f\u00ad")]
        return "".join(r.choice(pools)() for _ in range(n))

    def text(self, i):
        r = self.r
        kind = i % 10
        if kind == 0:
            s = self.sentence()
        elif kind == 1:
            s = " ".join(self.script_word() for _ in range(r.randint(1, 6)))
        elif kind == 2:
            s = " ".join(r.choice(EMOJI) + (self.word() if r.random() < 0.5 else "")
                         for _ in range(r.randint(1, 6)))
        elif kind == 3:
            s = self.whitespace_run()
        elif kind == 4:
            s = "".join(self.code() for _ in range(r.randint(1, 3)))
        elif kind == 5:
            s = r.choice([" ", "", ", ", "\n"]).join(self.number() for _ in range(r.randint(1, 6)))
        elif kind == 6:
            s = self.with_added(self.sentence())
        elif kind == 7:
            s = self.random_mix()
        elif kind == 8:
            s = self.sentence() + "\n\n" + self.code() + self.whitespace_run()
        else:
            s = self.with_added(self.random_mix())
        if i % 997 == 0:  # a few long ones: long words and long whitespace runs
            s += r.choice([" " * 5000, "\n" * 300, "a" * 3000, "\t \n" * 400, "字" * 2000,
                           "ab" * 1500 + " " + "9" * 1000])
        if i % 1009 == 0:
            s = ""
        return s


def byte_token_ids(tok):
    """The id of each single byte's token."""
    alphabet = {}
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    for b, c in zip(bs, cs):
        alphabet[b] = tok.token_to_id(chr(c))
    return alphabet


def decode_case(rng, tok, gen, byte_ids, i):
    """Ids to decode: random ids, or ids whose bytes split characters."""
    n_ids = tok.get_vocab_size(with_added_tokens=True)
    kind = i % 5
    if kind == 0:
        return [rng.randrange(n_ids) for _ in range(rng.randint(1, 30))]
    if kind == 1:  # raw bytes, mostly invalid or cut UTF-8
        bad = [0x80, 0xbf, 0xc0, 0xc1, 0xc2, 0xdf, 0xe0, 0xe1, 0xed, 0xef, 0xf0, 0xf4, 0xf5, 0xff,
               0xa0, 0x9f, 0x90, 0x8f, 0x41, 0x20]
        return [byte_ids[rng.choice(bad)] for _ in range(rng.randint(1, 12))]
    if kind == 2:  # a slice of a multi-byte text's ids, cut anywhere
        ids = tok.encode(" ".join(gen.script_word() for _ in range(4)) + rng.choice(EMOJI),
                         add_special_tokens=False).ids
        a = rng.randrange(len(ids))
        return ids[a:rng.randint(a + 1, len(ids))]
    if kind == 3:  # one character's bytes, cut, with specials and out-of-range ids between
        s = gen.char().encode("utf-8") + rng.choice(EMOJI).encode("utf-8")
        ids = [byte_ids[b] for b in s]
        ids = ids[rng.randint(0, 2):]
        k = rng.randint(0, len(ids))
        extra = rng.choice([tok.token_to_id("<|user|>"), tok.token_to_id("[gMASK]"),
                            tok.token_to_id("<think>"), n_ids + 5, 10**6])
        return ids[:k] + [extra] + ids[k:]
    ids = tok.encode(gen.with_added(gen.sentence()), add_special_tokens=True).ids
    return [x for x in ids if rng.random() < 0.8]


def load(fixtures, root, fx):
    base, plus, _ = fx.partition("+")
    path = os.path.join(root if "models/" in base else fixtures, base, "tokenizer.json")
    if not plus:
        return Tokenizer.from_file(path)
    with open(path) as f:
        d = json.load(f)
    for field, value in VARIANTS[fx].items():
        parent, _, key = field.rpartition(".")
        (d[parent] if parent else d)[key] = value
    with tempfile.TemporaryDirectory() as tmp:
        p = os.path.join(tmp, "tokenizer.json")
        with open(p, "w") as f:
            json.dump(d, f)
        return Tokenizer.from_file(p)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fixtures", default="tests/fixtures")
    ap.add_argument("--root", default=".", help="the repository root, for fixtures under models/")
    ap.add_argument("--out", default="tests/fixtures/tok_goldens.jsonl.gz")
    a = ap.parse_args()
    if unicodedata.unidata_version != "14.0.0":
        sys.exit(f"needs Python with Unicode 14.0 (this one has {unicodedata.unidata_version})")
    rng = random.Random(SEED)
    lines = []
    counts = {}
    runs = [("glm_tok", N_ENC, N_DEC, rng), ("glm_tok_flags", N_ENC_FLAGS, N_DEC_FLAGS, rng)]
    runs += [(v, N_ENC_VARIANT, N_DEC_VARIANT, rng) for v in VARIANTS]
    runs += [(DEMO, N_ENC_DEMO, N_DEC_DEMO, random.Random(DEMO_SEED))]
    for fx, n_enc, n_dec, rng in runs:
        tok = load(a.fixtures, a.root, fx)
        added = [t.content for t in tok.get_added_tokens_decoder().values()]
        vocab_words = sorted(tok.decode([i]) for i in range(2000) if tok.decode([i]).strip().isalpha())
        gen = Gen(rng, vocab_words, added)
        prefix = tok.decode(tok.encode("", add_special_tokens=True).ids, skip_special_tokens=False)
        if prefix != PREFIX:
            sys.exit(f"{fx}: the post-processor adds {prefix!r}, the test expects {PREFIX!r}")
        for i in range(n_enc):
            s = gen.text(i)
            special = i % 3 != 2
            ids = tok.encode(s, add_special_tokens=special).ids
            rec = {"fx": fx, "enc": s, "special": special, "ids": ids}
            dec = tok.decode(ids, skip_special_tokens=False)
            dec_skip = tok.decode(ids, skip_special_tokens=True)
            if dec != (prefix if special else "") + s:
                rec["dec"] = dec
            if dec_skip != s:
                rec["dec_skip"] = dec_skip
            lines.append(rec)
        byte_ids = byte_token_ids(tok)
        for i in range(n_dec):
            ids = decode_case(rng, tok, gen, byte_ids, i)
            lines.append({"fx": fx, "dec_ids": ids, "dec": tok.decode(ids, skip_special_tokens=False),
                          "dec_skip": tok.decode(ids, skip_special_tokens=True)})
        counts[fx] = {"encode": n_enc, "decode": n_dec}
    header = {"library": f"tokenizers {tokenizers.__version__}",
              "unicode": unicodedata.unidata_version, "counts": counts, "variants": VARIANTS}
    with gzip.GzipFile(a.out, "wb", mtime=0) as f:
        for rec in [header] + lines:
            f.write((json.dumps(rec, ensure_ascii=False, separators=(",", ":")) + "\n").encode())
    print(f"{a.out}: {len(lines)} cases, {os.path.getsize(a.out)} bytes", file=sys.stderr)


if __name__ == "__main__":
    main()
