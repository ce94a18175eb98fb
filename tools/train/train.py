#!/usr/bin/env python3
"""Trains the demo glm5_next (target + MTP block) on the token streams of encode_corpus.py.

    python3 tools/train/train.py --data DIR --out MODEL_DIR [--seconds 450] [--batch 32]

The target is transformers' Glm5NextForConditionalGeneration; its whole-sequence forward is the
training forward (causal here: check.py). Each example is [gMASK]<sop> followed by SEQ-2 tokens
from a random offset of the training stream (documents there are `[gMASK]<sop> text
<|endoftext|>`). Loss: next-token cross-entropy on the SEQ-2 stream tokens, plus MTP_WEIGHT times
the MTP block's cross-entropy on the token after next (row t: e = embed(tok[t+1]), h = the final
hidden state at t before the norm, target tok[t+2]; gradients reach the target's trunk, embedding
and lm_head too). AdamW, bf16 autocast over fp32 master weights, warmup then cosine decay over the
time budget (the step count follows from the time). The routers' e_score_correction_bias is moved
by the auxiliary-loss-free rule (bias += RATE * sign(mean load - load) per step). The indexers get
no gradient through their hard top-k and keep their initial weights.

Writes MODEL_DIR (config.json, model.safetensors with the MTP tensors at layer
num_hidden_layers), MODEL_DIR/../train_log.jsonl lines and train_summary.json, and loss.png.
"""
import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import demo  # noqa: E402
from mtp import MTPBlock  # noqa: E402

MTP_WEIGHT = 0.3
BIAS_RATE = 1e-3


class LoadBalancer:
    """Auxiliary-loss-free balancing: counts each router's chosen experts during a step, then
    nudges its e_score_correction_bias toward equal load."""

    def __init__(self, model, mtp):
        self.routers = []
        for name, m in model.named_modules():
            if type(m).__name__.endswith("TopkRouter"):
                self.routers.append(m)
                m.register_forward_hook(self._hook)
        self.counts = {}
        self.mtp = mtp

    def _hook(self, module, args, out):
        idx = out[-1]
        c = torch.bincount(idx.reshape(-1), minlength=module.e_score_correction_bias.numel())
        self.counts[id(module)] = self.counts.get(id(module), 0) + c

    @torch.no_grad()
    def step(self):
        pairs = [(m, self.counts.get(id(m))) for m in self.routers]
        g = self.mtp.mlp.gate
        pairs.append((g, torch.bincount(self.mtp.mlp.last_idx.reshape(-1), minlength=g.E)))
        for m, c in pairs:
            if c is None:
                continue
            c = c.float()
            m.e_score_correction_bias += BIAS_RATE * torch.sign(c.mean() - c)
        self.counts = {}


def losses(model, mtp, fh, ids):
    out = model(input_ids=ids, use_cache=False)
    logits = out.logits
    V = logits.shape[-1]
    loss = F.cross_entropy(logits[:, 1:-1].float().reshape(-1, V), ids[:, 2:].reshape(-1))
    lm = demo.language_model(model)
    z = mtp(lm.embed_tokens(ids[:, 1:-1]), fh.h[:, :-2])           # rows 0..T-3
    ml = model.lm_head(z)
    mloss = F.cross_entropy(ml.float().reshape(-1, V), ids[:, 2:].reshape(-1))
    return loss, mloss


@torch.no_grad()
def heldout_loss(model, mtp, fh, windows):
    model.eval()
    tot, n, mtot, mn = 0.0, 0, 0.0, 0
    full = [w for w in windows if len(w) == demo.SEQ]
    rest = [w for w in windows if len(w) != demo.SEQ]
    groups = [torch.stack(full[i:i + 16]) for i in range(0, len(full), 16)] + [w[None] for w in rest]
    with torch.autocast(demo.DEVICE, dtype=torch.bfloat16):
        for ids in groups:
            l, ml = losses(model, mtp, fh, ids)
            k = ids[:, 2:].numel()
            tot += float(l) * k
            mtot += float(ml) * k
            n += k
    model.train()
    return tot / n, mtot / n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--logdir", required=True)
    ap.add_argument("--seconds", type=float, default=450)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=150)
    ap.add_argument("--eval-every", type=float, default=45.0)
    ap.add_argument("--experts", default=None, help="experts_implementation (default: transformers')")
    a = ap.parse_args()
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    dev = demo.DEVICE
    from transformers import Glm5NextForConditionalGeneration
    cfg = demo.make_config()
    if a.experts:
        cfg._experts_implementation = a.experts
        cfg.text_config._experts_implementation = a.experts
    model = Glm5NextForConditionalGeneration(cfg).to(dev)
    model.train()
    mtp = MTPBlock(demo.text_cfg_dict(model)).to(dev)
    fh = demo.FinalHidden(model)
    lb = LoadBalancer(model, mtp)
    counts = demo.count_params(model, mtp)
    print(json.dumps({"params": counts}), flush=True)

    train = demo.read_u16(os.path.join(a.data, "train.u16"), dev)
    held = demo.read_u16(os.path.join(a.data, "heldout.u16"), dev)
    windows = demo.heldout_windows(held)
    named = [(n, p) for n, p in model.named_parameters() if ".visual." not in "." + n]
    named += [("mtp." + n, p) for n, p in mtp.named_parameters()]
    decay = [p for n, p in named if p.dim() >= 2 and "embed_tokens" not in n]
    no_decay = [p for n, p in named if not (p.dim() >= 2 and "embed_tokens" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8, fused=dev == "cuda")
    params = [p for _, p in named]
    n = demo.SEQ - 2
    pre = torch.tensor([demo.GMASK, demo.SOP], device=dev).expand(a.batch, 2)
    ar = torch.arange(n, device=dev)
    gen = torch.Generator(device=dev).manual_seed(1)

    os.makedirs(a.logdir, exist_ok=True)
    logf = open(os.path.join(a.logdir, "train_log.jsonl"), "w")
    hist = []
    t0 = time.time()
    last_eval = t0
    step = 0
    while True:
        el = time.time() - t0
        if el >= a.seconds:
            break
        frac = el / a.seconds
        lr = a.lr * min(1.0, (step + 1) / a.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        off = torch.randint(0, train.numel() - n, (a.batch,), device=dev, generator=gen)
        ids = torch.cat([pre[:a.batch], train[off[:, None] + ar]], dim=1)
        opt.zero_grad(set_to_none=True)
        try:
            with torch.autocast(demo.DEVICE, dtype=torch.bfloat16):
                loss, mloss = losses(model, mtp, fh, ids)
                total = loss + MTP_WEIGHT * mloss
            total.backward()
        except torch.OutOfMemoryError:
            if step > 0 or a.batch == 1:
                raise
            a.batch //= 2  # the first step sizes the batch: halve until it fits
            print(json.dumps({"out_of_memory": True, "batch": a.batch}), flush=True)
            opt.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            t0 = time.time()
            continue
        gn = torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        lb.step()
        step += 1
        if step % 20 == 0 or step == 1:
            rec = {"step": step, "t": round(time.time() - t0, 2), "lr": lr, "loss": float(loss),
                   "mtp_loss": float(mloss), "grad_norm": float(gn),
                   "tokens": step * a.batch * demo.SEQ}
            if time.time() - last_eval >= a.eval_every:
                rec["heldout_loss"], rec["heldout_mtp_loss"] = heldout_loss(model, mtp, fh, windows)
                last_eval = time.time()
            hist.append(rec)
            logf.write(json.dumps(rec) + "\n")
            logf.flush()
            print(json.dumps(rec), flush=True)
    hl, hml = heldout_loss(model, mtp, fh, windows)
    # the last 50 steps' mean train loss (a noisy single batch says little)
    tail = [r["loss"] for r in hist[-3:]]
    final = {"step": step, "t": round(time.time() - t0, 2), "heldout_loss": hl, "heldout_mtp_loss": hml,
             "loss": float(loss), "mtp_loss": float(mloss), "tokens": step * a.batch * demo.SEQ}
    hist.append(final)
    logf.write(json.dumps(final) + "\n")
    logf.close()
    print(json.dumps(final), flush=True)
    summary = {"params": counts, "steps": step, "seconds": final["t"], "batch": a.batch, "seq": demo.SEQ,
               "tokens_seen": final["tokens"], "train_stream_tokens": int(train.numel()),
               "epochs": final["tokens"] / train.numel(), "lr": a.lr, "mtp_weight": MTP_WEIGHT,
               "final_train_loss_last_logged": tail, "final_heldout_loss_bf16": hl,
               "final_heldout_mtp_loss_bf16": hml, "torch": torch.__version__,
               "transformers": __import__("transformers").__version__,
               "gpu": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu"}
    with open(os.path.join(a.logdir, "train_summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    try:
        plot(hist, os.path.join(a.logdir, "loss.png"))
    except Exception as e:  # the plot is a convenience; the log holds the numbers
        print("plot failed:", e, flush=True)
    names = demo.save_with_mtp(model, mtp, a.out)
    print(json.dumps({"saved": a.out, "tensors": len(names)}), flush=True)


def plot(hist, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    tr = [(r["step"], r["loss"], r["mtp_loss"]) for r in hist if "loss" in r]
    ho = [(r["step"], r["heldout_loss"], r["heldout_mtp_loss"]) for r in hist if "heldout_loss" in r]
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.plot([s for s, _, _ in tr], [l for _, l, _ in tr], label="train (next token)", lw=1)
    ax.plot([s for s, _, _ in tr], [m for _, _, m in tr], label="train MTP (token after next)", lw=1)
    ax.plot([s for s, _, _ in ho], [l for _, l, _ in ho], "o-", label="held-out (next token)")
    ax.plot([s for s, _, _ in ho], [m for _, _, m in ho], "s-", label="held-out MTP")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("glm5-next-demo on the Python 3.11 docs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
