#!/usr/bin/env python3
"""Encodes the corpus into token streams for training and evaluation.

    python3 tools/train/encode_corpus.py --corpus DIR --model MODEL_DIR --out OUT_DIR

Each document is encoded with add_special_tokens (so it starts `[gMASK]<sop>`) and followed by
`<|endoftext|>`; the documents are concatenated in file order (train.jsonl's order, heldout.txt's
order) into one stream. Writes OUT_DIR/train.u16 and OUT_DIR/heldout.u16: the ids as little-endian
uint16, no header.
"""
import argparse
import array
import json
import os
import sys

from tokenizers import Tokenizer


def stream(tok, docs, eot):
    out = array.array("H")
    for d in docs:
        out.extend(tok.encode(d, add_special_tokens=True).ids)
        out.append(eot)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    tok = Tokenizer.from_file(os.path.join(a.model, "tokenizer.json"))
    eot = tok.token_to_id("<|endoftext|>")
    with open(os.path.join(a.corpus, "train.jsonl"), encoding="utf-8") as f:
        train = [json.loads(line)["text"] for line in f]
    with open(os.path.join(a.corpus, "heldout.txt"), encoding="utf-8") as f:
        held = f.read().split("\n\f\n")
    os.makedirs(a.out, exist_ok=True)
    for name, docs in (("train", train), ("heldout", held)):
        s = stream(tok, docs, eot)
        if sys.byteorder != "little":
            s.byteswap()
        with open(os.path.join(a.out, name + ".u16"), "wb") as f:
            s.tofile(f)
        print(name, len(docs), "docs", len(s), "tokens")


if __name__ == "__main__":
    main()
