#!/usr/bin/env python3
"""Held-out perplexity of the demo model by transformers (fp32), and its MTP block's held-out
accuracy on the token after next. Runs on the device:

    python3 tools/train/eval_ppl.py --model MODEL_DIR --data DIR --out MODEL_DIR/heldout_ppl.json

The windows (demo.heldout_windows) are written out with the result so any engine can compute the
same number; see "windows" in the output.
"""
import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import demo  # noqa: E402
from check import load  # noqa: E402

DEFINITION = (
    "stream: the documents of heldout.txt (split on '\\n\\f\\n', in file order), each encoded with "
    "tokenizer.json and add_special_tokens=True ([gMASK]<sop> + text) and followed by <|endoftext|> "
    "(id 6132), concatenated; 'stream_ids' below. Windows: the stream cut into consecutive pieces of "
    "SEQ-2 = 510 tokens (the last piece shorter), each prefixed with [gMASK]<sop> (6134, 6136), so a "
    "window is at most SEQ = 512 tokens. Each window is one independent forward from an empty cache. "
    "Scored: every stream token, i.e. window positions 2..len-1, each predicted from the logits at "
    "the position before it (the two prefix tokens are not scored). NLL = sum of -ln softmax(logits) "
    "of the scored tokens in fp32; perplexity = exp(NLL / number of scored tokens).")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dev = demo.DEVICE
    torch.backends.cuda.matmul.allow_tf32 = False
    model, mtp, _ = load(a.model, dev)
    fh = demo.FinalHidden(model)
    lm = demo.language_model(model)
    held = demo.read_u16(os.path.join(a.data, "heldout.u16"), dev)
    windows = demo.heldout_windows(held)
    nll, n = 0.0, 0
    correct = 0
    m_nll, m_correct, m_n = 0.0, 0, 0
    per_window = []
    with torch.no_grad():
        for w in windows:
            logits = model(input_ids=w[None], use_cache=False).logits[0]
            s, k = demo.window_nll(logits, w)
            nll += s
            n += k
            correct += int((logits[1:-1].argmax(-1) == w[2:]).sum())
            per_window.append({"tokens": int(w.numel()), "nll": s, "scored": k})
            # The drafter's rows t = 0..len-3 (h at t and the embedding of w[t+1]) in its own cache
            # from row 0, as the runtime and training run it; rows t >= 1 predict stream tokens
            # (w[t+2], t = 1..len-3): scored are the same stream tokens but the first, which only
            # the target predicts
            h = fh.h[0]
            z = mtp(lm.embed_tokens(w[1:-1])[None], h[None, :-2])[0][1:]
            ml = torch.log_softmax(model.lm_head(z).float(), -1)
            tgt = w[3:]
            m_nll += float(-ml.gather(1, tgt[:, None]).sum())
            m_correct += int((ml.argmax(-1) == tgt).sum())
            m_n += int(tgt.numel())
    res = {
        "perplexity": math.exp(nll / n),
        "mean_nll_nats": nll / n,
        "scored_tokens": n,
        "next_token_accuracy": correct / n,
        "mtp": {"token_after_next_accuracy": m_correct / m_n, "mean_nll_nats": m_nll / m_n,
                "perplexity": math.exp(m_nll / m_n), "scored_tokens": m_n,
                "rows": "the drafter runs rows t = 0..len-3 of each window (input: h at t, embedding of "
                        "window[t+1]; its cache from row 0); scored rows t = 1..len-3, target window[t+2]"},
        "computed_by": "transformers %s Glm5NextForConditionalGeneration, fp32, eager attention and "
                       "experts, whole-window forward (equal to one-token-at-a-time: check_report.json)"
                       % __import__("transformers").__version__,
        "windows": {"definition": DEFINITION, "seq": demo.SEQ, "count": len(windows),
                    "lengths": [int(w.numel()) for w in windows], "prefix_ids": [demo.GMASK, demo.SOP],
                    "per_window": per_window},
        "stream_ids": [int(x) for x in held.tolist()],
    }
    try:  # the text-only class, where transformers has one
        from transformers import Glm5NextForCausalLM  # noqa: F401
        res["causal_lm_class"] = "present"
    except ImportError:
        res["causal_lm_class"] = "absent in this transformers"
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: v for k, v in res.items() if k not in ("windows", "stream_ids")}), flush=True)


if __name__ == "__main__":
    main()
