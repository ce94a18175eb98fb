#!/usr/bin/env python3
"""Reference goldens for the PLE memory (docs/MODEL.md, "PLE layer"), for tests/model_ple_test.cc.

    python3 tests/oracle/make_ple_fixture.py CKPT_DIR

CKPT_DIR is a checkpoint with PLE layers (tools/mkckpt --preset tiny-ple). This script knows only
the math as MODEL.md states it, written afresh over whole sequences (no per-step state): hashes,
prime table sizes, the gathered rows, the gates, the value and the dilated causal conv over the
whole history. It reads the memory's tensors straight from the checkpoint, draws a token
sequence and random highway rows X [T, S*H] per PLE layer, and writes CKPT_DIR/ple_case.safetensors:
tokens [T] i32, and per PLE layer l: x_<l> [T, S*H] f32 (the input) and out_<l> [T, S*H] f32
(the highway after the injection). numpy only (float64 math), so it runs anywhere.
"""
import json
import os
import struct
import sys

import numpy as np
from safetensors.numpy import save_file

T = 23
MASK = (1 << 64) - 1


def read_tensors(d):
    """name -> float32 array, from model.safetensors or the shards of the index (BF16/F16/F32)."""
    idx = os.path.join(d, "model.safetensors.index.json")
    files = sorted(set(json.load(open(idx))["weight_map"].values())) if os.path.exists(idx) else ["model.safetensors"]
    out = {}
    for f in files:
        raw = open(os.path.join(d, f), "rb").read()
        (n,) = struct.unpack("<Q", raw[:8])
        hdr = json.loads(raw[8:8 + n])
        base = 8 + n
        for name, t in hdr.items():
            if name == "__metadata__":
                continue
            a, b = t["data_offsets"]
            buf = raw[base + a:base + b]
            if t["dtype"] == "BF16":
                v = (np.frombuffer(buf, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
            elif t["dtype"] == "F16":
                v = np.frombuffer(buf, dtype="<f2").astype(np.float32)
            elif t["dtype"] == "F32":
                v = np.frombuffer(buf, dtype="<f4")
            else:
                continue
            out[name] = v.reshape(t["shape"])
    return out


def is_prime(n):
    if n < 2:
        return False
    d = 2
    while d * d <= n:
        if n % d == 0:
            return False
        d += 1
    return True


def primes_of(cfg, layers):
    """layer -> its table sizes: distinct primes over every head of every PLE layer, in order."""
    seen, out = set(), {}
    for l in layers:
        mine = []
        for o in range(cfg["ple_max_ngram"] - 1):
            p = cfg["ple_table_sizes"][o] - 1
            for _ in range(cfg["ple_heads_per_ngram"]):
                p += 1
                while not is_prime(p) or p in seen:
                    p += 1
                seen.add(p)
                mine.append(p)
        out[l] = mine
    return out


def mix64(z):
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def multipliers(seed, layer, n):
    return [mix64((seed * 0x9E3779B97F4A7C15 + layer * 0xD1B54A32D192ED03 + k + 1) & MASK) | 1 for k in range(n)]


def rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def ple_reference(cfg, w, layer, primes, tokens, X):
    """The injection for positions 0..T-1 of one sequence: X [T, S, H] -> X + output."""
    N, heads, hd = cfg["ple_max_ngram"], cfg["ple_heads_per_ngram"], cfg["ple_head_dim"]
    S, H, K, eps = cfg["hc_mult"], cfg["hidden_size"], cfg["ple_conv_kernel"], cfg["ple_norm_eps"]
    pad, Tn = cfg["ple_pad_id"], len(tokens)
    mult = multipliers(cfg["ple_seed"], layer, N)
    offs = np.concatenate([[0], np.cumsum(primes)[:-1]])
    pre = f"model.language_model.layers.{layer}.ple."
    table = w[pre + "table.weight"].astype(np.float64)
    # hashed rows: the token k back (the pad id before the start), multiplied, XORed, mod prime
    E = np.zeros((Tn, len(primes) * hd))
    for t in range(Tn):
        back = [tokens[t - k] if t - k >= 0 else pad for k in range(N)]
        col = 0
        for o in range(2, N + 1):
            h = 0
            for k in range(o):
                h ^= (back[k] * mult[k]) & MASK
            for _ in range(heads):
                row = offs[col] + h % primes[col]
                E[t, col * hd:(col + 1) * hd] = table[row]
                col += 1
    keys = E @ w[pre + "key_proj.weight"].astype(np.float64).T    # [T, S*H]
    v = E @ w[pre + "value_proj.weight"].astype(np.float64).T     # [T, H]
    kn, qn, cn = (w[pre + n].astype(np.float64) for n in ("key_norm.weight", "query_norm.weight", "conv_norm.weight"))
    value = np.zeros((Tn, S, H))
    for s in range(S):
        k = rms(keys[:, s * H:(s + 1) * H], kn[s], eps)
        q = rms(X[:, s], qn[s], eps)
        g = (k * q).sum(-1) / np.sqrt(H)
        g = np.sqrt(np.maximum(np.abs(g), 1e-6)) * np.sign(g)
        value[:, s] = (1 / (1 + np.exp(-g)))[:, None] * v
    normed = np.stack([rms(value[:, s], cn[s], eps) for s in range(S)], 1).reshape(Tn, S * H)
    cw = w[pre + "conv.weight"].astype(np.float64).reshape(S * H, K)
    conv = np.zeros((Tn, S * H))
    for t in range(Tn):
        for j in range(K):
            src = t - (K - 1 - j) * N  # dilation N
            if src >= 0:
                conv[t] += cw[:, j] * normed[src]
    silu = conv / (1 + np.exp(-conv))
    return X.reshape(Tn, S * H) + value.reshape(Tn, S * H) + silu


def main():
    d = sys.argv[1]
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg = cfg.get("text_config", cfg)
    layers = sorted(cfg["ple_layers"])
    w = read_tensors(d)
    primes = primes_of(cfg, layers)
    rng = np.random.default_rng(34)
    tokens = rng.integers(0, cfg["vocab_size"], T)
    tokens[9:12] = tokens[3:6]  # a repeated trigram: the same rows again, in another context
    S, H = cfg["hc_mult"], cfg["hidden_size"]
    out = {"tokens": tokens.astype(np.int32)}
    for l in layers:
        X = rng.standard_normal((T, S, H)).astype(np.float32)
        ref = ple_reference(cfg, w, l, primes[l], [int(t) for t in tokens], X.astype(np.float64))
        out[f"x_{l}"] = X.reshape(T, S * H)
        out[f"out_{l}"] = ref.astype(np.float32)
        print(f"layer {l}: primes {primes[l]}, |out - x| max {np.abs(ref - X.reshape(T, -1)).max():.3f}")
    save_file(out, os.path.join(d, "ple_case.safetensors"))


if __name__ == "__main__":
    main()
