#!/usr/bin/env python3
"""Proves that the training forward is causal and equals transformers' glm5_next fed one token at a
time, on held-out sequences, in fp32. Runs where transformers 5.17 and a GPU are (the device):

    python3 tools/train/check.py --model MODEL_DIR --data DIR --out REPORT.json [--seqs 2]

For each of the first N held-out perplexity windows (SEQ tokens, demo.heldout_windows):
  1. equality: the whole-sequence forward (the training forward, use_cache=False) against the same
     model fed one token at a time from an empty cache (use_cache=True): max |logit diff| over every
     position, and the same for the final hidden state before the norm (the MTP block's input);
  2. causality: the second half of the window replaced by random tokens; the whole-sequence
     logits of the first half must not move;
  3. the MTP block (mtp.py): its whole-sequence form against its incremental form with its own
     cache, fed the incremental target's hidden states;
  4. mtp.py's DSA against transformers' DSA layer: every target DSA layer's mixer input is
     captured during the whole-sequence forward and mtp.DSA, holding that layer's checkpoint
     tensors, must give transformers' output.
The model is loaded in fp32 (eager attention and experts) from the bf16 checkpoint, so both sides
compute on exactly the stored values. Tolerance: TOL on every logit.
"""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import demo  # noqa: E402
from mtp import MTPBlock, dsa_from_checkpoint  # noqa: E402

TOL = 1e-3


def load(model_dir, dev):
    from safetensors.torch import load_file
    from transformers import Glm5NextForConditionalGeneration
    model = Glm5NextForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager").to(dev)
    model.eval()
    sd = {k: v.float().to(dev) for k, v in load_file(os.path.join(model_dir, "model.safetensors")).items()}
    mtp = MTPBlock(demo.text_cfg_dict(model)).to(dev)
    mtp.load_checkpoint_tensors(sd, demo.MTP_PREFIX)
    mtp.eval()
    return model, mtp, sd


@torch.no_grad()
def incremental(model, fh, ids):
    cache = None
    rows, hs = [], []
    for i in range(ids.numel()):
        out = model(input_ids=ids[i:i + 1][None], past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        rows.append(out.logits[0, -1])
        hs.append(fh.h[0, -1])
    return torch.stack(rows), torch.stack(hs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seqs", type=int, default=2)
    a = ap.parse_args()
    dev = demo.DEVICE
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model, mtp, sd = load(a.model, dev)
    fh = demo.FinalHidden(model)
    lm = demo.language_model(model)
    tc = demo.text_cfg_dict(model)
    dsa_layers = [i for i, t in enumerate(tc["layer_types"]) if t == "deepseek_sparse_attention"]
    captured = {}

    def capture(i):
        def hook(module, args, kwargs, out):
            x = kwargs.get("hidden_states", args[0] if args else None)
            captured[i] = (x.detach(), (out[0] if isinstance(out, tuple) else out).detach())
        return hook

    for i in dsa_layers:
        lm.layers[i].self_attn.register_forward_hook(capture(i), with_kwargs=True)
    mine = {i: dsa_from_checkpoint(tc, sd, "model.language_model.layers.%d.self_attn." % i).to(dev).eval()
            for i in dsa_layers}

    held = demo.read_u16(os.path.join(a.data, "heldout.u16"), dev)
    windows = demo.heldout_windows(held)
    gen = torch.Generator(device=dev).manual_seed(5)
    report = {"tolerance": TOL, "dtype": "float32", "transformers": __import__("transformers").__version__,
              "torch": torch.__version__, "model": os.path.basename(os.path.normpath(a.model)), "sequences": []}
    ok = True
    with torch.no_grad():
        for w in range(a.seqs):
            ids = windows[w]
            t0 = time.time()
            captured.clear()
            full = model(input_ids=ids[None], use_cache=False).logits[0]
            h_full = fh.h[0].clone()
            dsa = {}
            for i in dsa_layers:
                x, ref = captured[i]
                got = mine[i](x)
                dsa[str(i)] = float((got - ref).abs().max())
            inc, h_inc = incremental(model, fh, ids)
            T = ids.numel()
            ids2 = ids.clone()
            ids2[T // 2:] = torch.randint(0, 6132, (T - T // 2,), device=dev, generator=gen)
            full2 = model(input_ids=ids2[None], use_cache=False).logits[0]
            # MTP: whole rows 0..T-2 vs incremental with its own cache, on the incremental h
            e = lm.embed_tokens(ids[1:])[None]
            m_full = model.lm_head(mtp(e, h_inc[None, :-1]))[0]
            cache = {}
            m_inc = torch.stack([model.lm_head(mtp(e[:, t:t + 1], h_inc[None, t:t + 1], cache=cache))[0, 0]
                                 for t in range(T - 1)])
            rec = {
                "window": w, "tokens": T,
                "logits_max_abs_diff_full_vs_incremental": float((full - inc).abs().max()),
                "logits_absmax": float(inc.abs().max()),
                "argmax_agreement": float((full.argmax(-1) == inc.argmax(-1)).float().mean()),
                "final_hidden_max_abs_diff": float((h_full - h_inc).abs().max()),
                "causality_first_half_max_abs_diff": float((full2[:T // 2] - full[:T // 2]).abs().max()),
                "causality_second_half_changed_by": float((full2[T // 2:] - full[T // 2:]).abs().max()),
                "mtp_logits_max_abs_diff_full_vs_incremental": float((m_full - m_inc).abs().max()),
                "mtp_dsa_vs_transformers_dsa_max_abs_diff": dsa,
                "seconds": round(time.time() - t0, 1),
            }
            rec["pass"] = (rec["logits_max_abs_diff_full_vs_incremental"] <= TOL
                           and rec["causality_first_half_max_abs_diff"] <= TOL
                           and rec["mtp_logits_max_abs_diff_full_vs_incremental"] <= TOL
                           and max(dsa.values()) <= TOL)
            ok &= rec["pass"]
            report["sequences"].append(rec)
            print(json.dumps(rec), flush=True)
    report["pass"] = ok
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)
    print("PASS" if ok else "FAIL", flush=True)


if __name__ == "__main__":
    main()
