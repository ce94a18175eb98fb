#!/usr/bin/env python3
"""Trains the demo model's byte-level BPE tokenizer (GLM-4 style) on the training documents.

    python3 tools/train/make_tokenizer.py --corpus DIR --out MODEL_DIR

Reads DIR/train.jsonl (tools/train/make_corpus.py) and writes MODEL_DIR/tokenizer.json,
tokenizer_config.json and generation_config.json. Deterministic for a given corpus and
`tokenizers` version (0.23.3 here).

- model: BPE over bytes (the 256 ByteLevel symbols are the initial alphabet), no unk token;
- pre-tokenizer: Sequence[Split(GLM-4 regex, Isolated), ByteLevel(add_prefix_space=False,
  use_regex=False)]; decoder ByteLevel;
- post-processor: TemplateProcessing putting `[gMASK]<sop>` before a single sequence;
- added tokens, GLM style, after the BPE vocabulary: the special ones below, then `<think>`,
  `</think>` (not special). VOCAB ids in all.
"""
import argparse
import json
import os

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from tokenizers import AddedToken

VOCAB = 6144
GLM4_SPLIT = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|"
              r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIAL = ["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>",
           "<|user|>", "<|assistant|>", "<|observation|>"]
PLAIN_ADDED = ["<think>", "</think>"]


def texts(path):
    with open(path, encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)["text"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    here = os.path.dirname(os.path.abspath(__file__))

    tok = Tokenizer(models.BPE())
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(GLM4_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    n_added = len(SPECIAL) + len(PLAIN_ADDED)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - n_added, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[])
    tok.train_from_iterator(texts(os.path.join(a.corpus, "train.jsonl")), trainer=trainer)
    assert tok.get_vocab_size() == VOCAB - n_added, tok.get_vocab_size()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in PLAIN_ADDED])
    assert tok.get_vocab_size() == VOCAB
    ids = {t: tok.token_to_id(t) for t in SPECIAL + PLAIN_ADDED}
    tok.post_processor = processors.TemplateProcessing(
        single="[gMASK] <sop> $A:0",
        pair="[gMASK] <sop> $A:0 $B:1",
        special_tokens=[("[gMASK]", ids["[gMASK]"]), ("<sop>", ids["<sop>"])],
    )
    os.makedirs(a.out, exist_ok=True)
    tok.save(os.path.join(a.out, "tokenizer.json"))

    with open(os.path.join(here, "chat_template.jinja"), encoding="utf-8") as f:
        template = f.read()
    added_decoder = {str(ids[t]): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                   "single_word": False, "special": t in SPECIAL}
                     for t in SPECIAL + PLAIN_ADDED}
    cfg = {
        "added_tokens_decoder": added_decoder,
        "additional_special_tokens": [t for t in SPECIAL if t != "<|endoftext|>"],
        "bos_token": None,
        "chat_template": template,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|endoftext|>",
        "model_max_length": 1048576,
        "pad_token": "<|endoftext|>",
        "padding_side": "left",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    with open(os.path.join(a.out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2, ensure_ascii=False)
        f.write("\n")
    gen = {
        "_from_model_config": False,
        "eos_token_id": [ids["<|endoftext|>"], ids["<|user|>"], ids["<|observation|>"]],
        "pad_token_id": ids["<|endoftext|>"],
        "do_sample": False,
    }
    with open(os.path.join(a.out, "generation_config.json"), "w", encoding="utf-8") as f:
        json.dump(gen, f, indent=2)
        f.write("\n")

    with open(os.path.join(a.corpus, "heldout.txt"), encoding="utf-8") as f:
        held = f.read().split("\n\f\n")
    n_held = sum(len(tok.encode(d).ids) + 1 for d in held)  # [gMASK]<sop> + text + <|endoftext|>
    assert n_held <= 16384, n_held
    print(json.dumps({"vocab": tok.get_vocab_size(), "special_ids": ids, "heldout_tokens": n_held}))


if __name__ == "__main__":
    main()
