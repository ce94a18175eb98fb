#!/usr/bin/env python3
"""Builds the small GLM-style tokenizer the tokenizer tests use (tests/fixtures/glm_tok/).

    python3 tools/tokenizer/make_glm_tokenizer.py [--src DIR] [--out DIR] [--vocab N]

Needs the `tokenizers` library (PyPI) and Debian's python3.11-doc, whose reStructuredText sources
(/usr/share/doc/python3.11/html/_sources, PSF license) are the training text. The result has the
form of a GLM-4 tokenizer.json: byte-level BPE over GLM-4's split regex, GLM's added tokens after
the learned vocabulary, a `[gMASK]<sop>` prefix from TemplateProcessing, the ByteLevel decoder.

Writes, under --out (default tests/fixtures):
  glm_tok/tokenizer.json, tokenizer_config.json, generation_config.json
      the fixture: 6000 learned ids (--vocab; the tests expect 6000), then the added tokens;
      two eos ids (<|endoftext|>, <|user|>)
  glm_tok_flags/tokenizer.json (+ the same two configs)
      the same model with extra added tokens that use lstrip, rstrip, single_word and
      normalized, for the tests of those options
"""
import argparse
import glob
import json
import os

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from tokenizers import processors, trainers

GLM4_SPLIT = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|"
              r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
              r"\s*[\r\n]+|\s+(?!\S)|\s+")
VOCAB = 6000
# GLM-4's added tokens, in GLM-4's order. <think> and </think> are added but not special.
SPECIAL = ["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>",
           "<|user|>", "<|assistant|>", "<|observation|>"]
NON_SPECIAL = ["<think>", "</think>"]
EOS = ["<|endoftext|>", "<|user|>"]

# A chat template of GLM's form (kept by the tokenizer as a string; nothing here renders it).
CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'system' %}<|system|>\n{{ m['content'] }}"
    "{%- elif m['role'] == 'user' %}<|user|>\n{{ m['content'] }}"
    "{%- elif m['role'] == 'assistant' %}<|assistant|>\n{{ m['content'] }}"
    "{%- elif m['role'] == 'observation' %}<|observation|>\n{{ m['content'] }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>\n{%- endif %}")


def training_files(src):
    files = sorted(glob.glob(os.path.join(src, "**", "*.txt"), recursive=True))
    if not files:
        raise SystemExit(f"no *.txt under {src}: install python3.11-doc")
    return files


def build(src, vocab=VOCAB):
    tok = Tokenizer(models.BPE(dropout=None, unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(GLM4_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    trainer = trainers.BpeTrainer(vocab_size=vocab, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[])
    tok.train(training_files(src), trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in NON_SPECIAL])
    ids = {t: tok.token_to_id(t) for t in ["[gMASK]", "<sop>"]}
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(
            single="[gMASK]:0 <sop>:0 $A:0",
            pair="[gMASK]:0 <sop>:0 $A:0 $B:1",
            special_tokens=[(t, i) for t, i in ids.items()]),
    ])
    return tok


def add_flag_tokens(tok):
    """Added tokens that exercise the options: each name says what it sets."""
    tok.add_special_tokens([
        AddedToken("<|lstrip|>", special=True, normalized=False, lstrip=True),
        AddedToken("<|rstrip|>", special=True, normalized=False, rstrip=True),
        AddedToken("<|strip|>", special=True, normalized=False, lstrip=True, rstrip=True),
        AddedToken("<|word|>", special=True, normalized=False, single_word=True),
    ])
    tok.add_tokens([
        AddedToken("hello", special=False, normalized=False, single_word=True),
        AddedToken("<|norm|>", special=False, normalized=True),
        AddedToken("<|norm|>long", special=False, normalized=False),
        AddedToken(" spaced ", special=False, normalized=False),
        AddedToken("é字", special=False, normalized=False, lstrip=True, rstrip=True),
    ])


def write_dir(tok, out):
    os.makedirs(out, exist_ok=True)
    tok.save(os.path.join(out, "tokenizer.json"), pretty=False)
    decoder = {}
    for i in range(tok.get_vocab_size(with_added_tokens=True)):
        t = tok.get_added_tokens_decoder().get(i)
        if t is not None:
            decoder[str(i)] = {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized,
                               "rstrip": t.rstrip, "single_word": t.single_word,
                               "special": t.special}
    config = {
        "added_tokens_decoder": decoder,
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|endoftext|>",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
        f.write("\n")
    gen = {"eos_token_id": [tok.token_to_id(t) for t in EOS],
           "pad_token_id": tok.token_to_id("<|endoftext|>")}
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=2)
        f.write("\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--src", default="/usr/share/doc/python3.11/html/_sources")
    ap.add_argument("--out", default="tests/fixtures")
    ap.add_argument("--vocab", type=int, default=VOCAB, help="learned ids (a larger one for benches)")
    a = ap.parse_args()
    tok = build(a.src, a.vocab)
    write_dir(tok, os.path.join(a.out, "glm_tok"))
    add_flag_tokens(tok)
    write_dir(tok, os.path.join(a.out, "glm_tok_flags"))
    print(f"vocabulary {tok.get_vocab_size(with_added_tokens=False)} learned,"
          f" {tok.get_vocab_size(with_added_tokens=True)} with the added tokens")


if __name__ == "__main__":
    main()
