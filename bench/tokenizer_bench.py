#!/usr/bin/env python3
"""Encode throughput of our tokenizer beside the Hugging Face `tokenizers` library, one thread each,
same model, same documents, one run; prints one table.

    bazel build //tools:metrale-tokenize
    bench/tokenizer_bench.py [--model tests/fixtures/glm_tok] [--docs DIR] [--mb 8] [--repeat 5]

Documents: the *.txt files under --docs (default: the reStructuredText sources of Debian's
python3.11-doc), each one document, taken in name order up to --mb MB. Ours:
bazel-bin/tools/metrale-tokenize --bench (tok_encode per document, add_special_tokens off, timed
inside the binary after an untimed pass). The library: Tokenizer.encode per document
(add_special_tokens off) with RAYON_NUM_THREADS=1, after an untimed pass. The two sides take
turns, one timed pass each, --repeat rounds (default 5), so a busy machine slows both alike; each
side's best pass counts. MB/s are 10^6 bytes of UTF-8 text a second. The two sides' ids must agree (compared
through an FNV-1a hash of every id), or the script fails.
"""
import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ["RAYON_NUM_THREADS"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

try:
    from tokenizers import Tokenizer
    import tokenizers
except ImportError:
    sys.exit("tokenizer_bench: needs the tokenizers library (pip install tokenizers)")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def documents(src, limit):
    files = sorted(glob.glob(os.path.join(src, "**", "*.txt"), recursive=True))
    if not files:
        sys.exit(f"tokenizer_bench: no *.txt under {src} (install python3.11-doc, or pass --docs)")
    docs, total = [], 0
    for f in files:
        with open(f, encoding="utf-8", errors="replace") as fh:
            d = fh.read().replace("\0", "")
        docs.append(d)
        total += len(d.encode())
        if total >= limit:
            break
    return docs


class Ours:
    """metrale-tokenize --bench over the documents, one timed pass a call."""

    def __init__(self, binary, model, docs):
        with tempfile.NamedTemporaryFile("wb", suffix=".txt", delete=False) as f:
            f.write(b"\0".join(d.encode() for d in docs))
            self.path = f.name
        self.cmd = [binary, "--model", model, "--bench", self.path, "--repeat", "1"]

    def run(self):
        return json.loads(subprocess.run(self.cmd, check=True, capture_output=True, text=True).stdout)

    def close(self):
        os.unlink(self.path)


def fnv_ids(ids_lists):
    """FNV-1a 64 over every id as 4 little-endian bytes (what metrale-tokenize --bench prints)."""
    h = 1469598103934665603
    for ids in ids_lists:
        for b in b"".join(i.to_bytes(4, "little") for i in ids):
            h = ((h ^ b) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


class Library:
    """Tokenizer.encode over the documents, one timed pass a call."""

    def __init__(self, model, docs):
        self.tok = Tokenizer.from_file(os.path.join(model, "tokenizer.json"))
        self.docs = docs
        first = [self.tok.encode(d, add_special_tokens=False).ids for d in docs]  # untimed
        self.fnv = fnv_ids(first)
        self.bytes = sum(len(d.encode()) for d in docs)

    def run(self):
        t0 = time.perf_counter()
        tokens = sum(len(self.tok.encode(d, add_special_tokens=False).ids) for d in self.docs)
        dt = time.perf_counter() - t0
        return {"bytes": self.bytes, "tokens": tokens, "seconds": dt, "mb_s": self.bytes / dt / 1e6,
                "ids_fnv": self.fnv}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.path.join(ROOT, "tests/fixtures/glm_tok"))
    ap.add_argument("--docs", default="/usr/share/doc/python3.11/html/_sources")
    ap.add_argument("--mb", type=float, default=8.0)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--binary", default=os.path.join(ROOT, "bazel-bin/tools/metrale-tokenize"))
    a = ap.parse_args()
    if not os.access(a.binary, os.X_OK):
        sys.exit(f"tokenizer_bench: {a.binary} missing: bazel build //tools:metrale-tokenize")
    docs = documents(a.docs, int(a.mb * 1e6))
    ours, lib = Ours(a.binary, a.model, docs), Library(a.model, docs)
    o = l = None
    try:
        for _ in range(a.repeat):
            r = ours.run()
            o = r if o is None or r["seconds"] < o["seconds"] else o
            r = lib.run()
            l = r if l is None or r["seconds"] < l["seconds"] else l
    finally:
        ours.close()
    if o["tokens"] != l["tokens"] or o["bytes"] != l["bytes"] or o["ids_fnv"] != l["ids_fnv"]:
        sys.exit(f"tokenizer_bench: the two sides disagree: ours {o}, library {l}")
    print(f"model {a.model}, {len(docs)} documents, {o['bytes'] / 1e6:.2f} MB, {o['tokens']} tokens,"
          f" best of {a.repeat} alternating passes, one thread each; ids identical (FNV-1a {o['ids_fnv']})")
    print("| encoder | MB/s | s a pass | tokens/s |")
    print("|---|---:|---:|---:|")
    for name, r in [("metrale tok_encode", o), (f"tokenizers {tokenizers.__version__} encode", l)]:
        print(f"| {name} | {r['mb_s']:.2f} | {r['seconds']:.3f} | {r['tokens'] / r['seconds']:.0f} |")
    print(f"ours / library: {o['mb_s'] / l['mb_s']:.2f}x")


if __name__ == "__main__":
    main()
