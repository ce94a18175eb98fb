#!/usr/bin/env python3
"""Makes the MTP (speculative drafter) reference fixture "mtp_a" for the runtime tests.

Runs on CPU where transformers' glm5_next exists (made with transformers 5.25, torch 2.15):

    python3 tests/oracle/make_mtp_fixtures.py [OUT_DIR]        # default tests/fixtures/mtp_a

It needs tests/fixtures/tiny_a/ (config.json + model.safetensors, from make_fixtures.py), and reads
tests/oracle/make_fixtures.py (init_value: the tensor scales; GapRecorder: the target's top-k gaps),
tools/train/mtp.py (MTPBlock: our reference of the MTP block, which transformers does not implement)
and tools/train/demo.py (FinalHidden: the target's final hidden state before the final norm).

The model: tiny_a's exact config.json with "num_nextn_predict_layers": 1 added to text_config, and a
checkpoint holding every tensor of tiny_a/model.safetensors unchanged plus an MTP block at layer
index num_hidden_layers (4), prefix model.language_model.layers.4.: eh_proj.weight [H, 2H],
enorm.weight, hnorm.weight, shared_head.norm.weight, input_layernorm.weight,
post_attention_layernorm.weight, the DSA mixer self_attn.* with a full indexer (names and shapes of
tiny_a's layer 1), the MoE mlp.gate.weight, mlp.gate.e_score_correction_bias (fp32),
mlp.experts.{e}.{gate,up,down}_proj.weight, mlp.shared_experts.{gate,up,down}_proj.weight; no hc_*.
Its values are random with make_fixtures.py's scales for the same names, rounded to bf16 and stored
bf16 (the bias fp32). transformers skips the layer-4 tensors when it loads the target.

References, all fp32 (the bf16 weights loaded into float32):
  target: Glm5NextForConditionalGeneration from OUT_DIR fed the prompt one token at a time with the
    cache (whole-sequence forward is not causal for DSA rows with an empty selection). h[t] is the
    input of model.language_model.norm at position t: the mean over the hc_mult streams.
  MTP rows: MTPBlock loaded with the layer-4 tensors. Row t (t = 0..T-2) takes
    e = embed_tokens[tokens[t+1]] and h[t], its cache holds rows 0..t, and
    logits[t] = lm_head @ shared_head.norm(u) (u the block's residual state); it predicts
    tokens[t+2]. The rows are fed one at a time into the block's cache; the whole-sequence block
    forward is compared with them (report.json) but is not the reference.
  chains (DeepSeek-V3 sequential MTP, K = 3 drafts): for each start row t0 in chain_t, the cache
    holds committed rows 0..t0-1; step 1 = row t0 with (h[t0], embed(tokens[t0+1])) gives L1, the
    residual u1 (before shared_head.norm) and d1 = argmax L1 (so L1 == logits[t0]); step 2 = row
    t0+1 with (h := u1, e := embed(d1)) gives L2, u2, d2; step 3 = row t0+2 with (u2, embed(d2))
    gives L3, d3. Each step appends its row to the block's cache.

The target's indexer/router top-k and the MTP block's indexer/router top-k (rows and chains) must
have a gap of at least GAP_MIN between the k-th and (k+1)-th candidate scores; a prompt where one
does not is redrawn (fixed generator, so the run is deterministic).

Output in OUT_DIR: config.json, model.safetensors, report.json (versions, seeds, gaps, checks), and
mtp_case_<k>.safetensors (case_0: T = 40, case_1: T = 150) holding
  tokens        [T] i32        the prompt, drawn from [0, vocab)
  h             [T, H] f32     the target's final hidden state before the final norm, per position
  logits        [T-1, V] f32   MTP row t's logits (e = embed(tokens[t+1]), h[t]; cache rows 0..t)
  chain_t       [C] i32        the chains' start rows t0 (C = 4: T//4, T//2, 3T//4, T-2)
  chain_tokens  [C, 3] i32     d1, d2, d3 of each chain
  chain_logits  [C, 3, V] f32  L1, L2, L3 of each chain
  target_logits [T, V] f32     the target's logits after each fed token (same one-at-a-time run)
  router_gap    [1] f32        smallest router top-k gap over the target and MTP block (rows + chains)
  pool_gap      [1] f32        smallest indexer pool top-k gap, same scope
report.json also gives the target-only and MTP-only gaps separately.
"""
import inspect
import json
import math
import os
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tools", "train"))

import make_fixtures as mf  # noqa: E402  (init_value, GapRecorder, GAP_MIN)
from demo import FinalHidden  # noqa: E402
from mtp import MTPBlock  # noqa: E402

import transformers  # noqa: E402
from transformers import Glm5NextForConditionalGeneration  # noqa: E402

SRC = os.path.join(ROOT, "tests", "fixtures", "tiny_a")
GAP_MIN = mf.GAP_MIN
WEIGHT_SEED = 3000          # the MTP block's random values
PROMPT_SEED = 4000          # prompt generator; case k uses PROMPT_SEED + k
CASES = [40, 150]           # T per case
CHAIN_K = 3
FP32_KEEP = ("e_score_correction_bias",)
MTP_ONLY = ("eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight")


def gap_of(values, k):
    """Smallest k-th minus (k+1)-th over the rows whose (k+1)-th is a real candidate."""
    n = values.shape[-1]
    if k >= n:
        return math.inf
    s = values.float().sort(dim=-1, descending=True).values
    valid = s[..., k] > torch.finfo(s.dtype).min / 2   # -inf / finfo.min mark non-candidates
    if not bool(valid.any()):
        return math.inf
    return float((s[..., k - 1] - s[..., k])[valid].min())


class MTPGaps:
    """Records the MTP block's router and indexer top-k gaps by wrapping the instance's modules."""

    def __init__(self, block):
        self.router_gap = self.pool_gap = math.inf
        rec = self
        router = block.mlp.gate
        orig_router = router.forward

        def router_forward(x):
            out = orig_router(x)
            s = torch.sigmoid(F.linear(x.float(), router.weight.float()))
            c = s + router.e_score_correction_bias.float()
            N, G = c.shape[0], router.G
            gs = c.view(N, G, router.E // G).topk(2, dim=-1).values.sum(-1)
            if router.tg < G:
                rec.router_gap = min(rec.router_gap, gap_of(gs, router.tg))
            gi = gs.topk(router.tg, dim=-1).indices
            gm = torch.zeros_like(gs).scatter_(1, gi, 1.0).bool()
            m = gm.unsqueeze(-1).expand(N, G, router.E // G).reshape(N, router.E)
            rec.router_gap = min(rec.router_gap, gap_of(c.masked_fill(~m, float("-inf")), router.k))
            return out

        router.forward = router_forward
        indexer = block.self_attn.indexer
        orig_select = indexer.select

        def select(*a, **kw):
            orig_topk = torch.Tensor.topk

            def topk(t, k, *ta, **tkw):   # the only topk in Indexer.select is the pool choice
                rec.pool_gap = min(rec.pool_gap, gap_of(t, k))
                return orig_topk(t, k, *ta, **tkw)
            torch.Tensor.topk = topk
            try:
                return orig_select(*a, **kw)
            finally:
                torch.Tensor.topk = orig_topk

        indexer.select = select

    def reset(self):
        self.router_gap = self.pool_gap = math.inf


def mtp_step(block, e, h, cache):
    """block.forward split open: returns (u, normed) with u the residual before shared_head.norm."""
    u = block.eh_proj(torch.cat([block.enorm(e), block.hnorm(h)], dim=-1))
    u = u + block.self_attn(block.input_layernorm(u), cache=cache)
    u = u + block.mlp(block.post_attention_layernorm(u))
    return u, block.shared_head.norm(u)


def make_mtp_tensors(c, prefix, src_sd):
    """The MTP block's checkpoint tensors: random, make_fixtures' scales, bf16 (bias fp32)."""
    proto = MTPBlock(c).checkpoint_tensors(prefix)
    # the DSA/MoE names must be exactly those of a full-indexer DSA layer with a MoE (tiny_a layer 1)
    ref = {k[len("model.language_model.layers.1."):]: tuple(v.shape) for k, v in src_sd.items()
           if k.startswith("model.language_model.layers.1.") and ".hc_" not in "." + k}
    mine = {k[len(prefix):]: tuple(v.shape) for k, v in proto.items() if not k[len(prefix):] in MTP_ONLY}
    assert mine == ref, (sorted(set(mine.items()) ^ set(ref.items())))
    H = c["hidden_size"]
    gen = torch.Generator().manual_seed(WEIGHT_SEED)
    out = {}
    for name in sorted(proto):
        v = mf.init_value(name, tuple(proto[name].shape), gen, H, c["hc_mult"])
        if any(k in name for k in FP32_KEEP):
            out[name] = v.to(torch.bfloat16).float().contiguous()   # bf16-representable, kept fp32
        else:
            out[name] = v.to(torch.bfloat16).contiguous()
    assert out[prefix + "eh_proj.weight"].shape == (H, 2 * H)
    return out


def call_kw(model):
    """The cache keyword of this transformers version's forward (5.17: past_key_values; 5.25: cache)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def out_cache(out):
    c = getattr(out, "cache", None)
    return c if c is not None else getattr(out, "past_key_values", None)


def target_run(model, hook, tokens):
    """One token at a time from an empty cache: logits [T, V], h [T, H] (norm input)."""
    kw = call_kw(model)
    cache = None
    logits, hs = [], []
    with torch.no_grad():
        for tok in tokens:
            out = model(input_ids=torch.tensor([[tok]]), use_cache=True, **{kw: cache})
            cache = out_cache(out)
            logits.append(out.logits[0, -1].float().clone())
            hs.append(hook.h[0, -1].float().clone())
    return torch.stack(logits), torch.stack(hs)


def mtp_rows(block, embed, lm_head, tokens, h):
    """Rows 0..T-2 one at a time into one cache: logits [T-1, V], the final cache."""
    cache = {}
    rows = []
    with torch.no_grad():
        for t in range(len(tokens) - 1):
            e = embed[tokens[t + 1]].view(1, 1, -1)
            normed = block(e, h[t].view(1, 1, -1), cache=cache)
            rows.append(F.linear(normed[0, -1], lm_head))
    return torch.stack(rows), cache


def mtp_chain(block, embed, lm_head, tokens, h, full_cache, t0):
    """Chain from start row t0 (cache = committed rows 0..t0-1): tokens [3], logits [3, V]."""
    cache = {k: v[:, :t0].clone() for k, v in full_cache.items()} if t0 > 0 else {}
    hh = h[t0].view(1, 1, -1)
    e = embed[tokens[t0 + 1]].view(1, 1, -1)
    toks, logs = [], []
    with torch.no_grad():
        for _ in range(CHAIN_K):
            u, normed = mtp_step(block, e, hh, cache)
            L = F.linear(normed[0, -1], lm_head)
            d = int(L.argmax())
            toks.append(d)
            logs.append(L)
            hh, e = u, embed[d].view(1, 1, -1)
    return toks, torch.stack(logs)


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "tests", "fixtures", "mtp_a")
    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(0)
    torch.set_num_threads(max(1, os.cpu_count() or 1))

    # config: tiny_a's, plus num_nextn_predict_layers
    with open(os.path.join(SRC, "config.json")) as f:
        cfg = json.load(f)
    cfg["text_config"]["num_nextn_predict_layers"] = 1
    cfg["text_config"] = dict(sorted(cfg["text_config"].items()))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    c = cfg["text_config"]
    L = c["num_hidden_layers"]
    prefix = "model.language_model.layers.%d." % L

    # checkpoint: tiny_a's tensors unchanged + the MTP block
    src_sd = load_file(os.path.join(SRC, "model.safetensors"))
    mtp_sd = make_mtp_tensors(c, prefix, src_sd)
    assert not set(mtp_sd) & set(src_sd)
    sd = dict(src_sd)
    sd.update(mtp_sd)
    save_file(sd, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})

    # the target, in fp32
    rec = mf.GapRecorder()
    rec.install()
    model, info = Glm5NextForConditionalGeneration.from_pretrained(
        out_dir, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager",
        output_loading_info=True)
    model.eval()
    info = {k: sorted(v) if isinstance(v, (set, list)) else str(v) for k, v in info.items()}
    bad_unexpected = [k for k in info.get("unexpected_keys", []) if not k.startswith(prefix)]
    assert not info.get("missing_keys") and not bad_unexpected and not info.get("mismatched_keys"), info
    lm = model.model.language_model
    own = {k: v for k, v in model.state_dict().items()}
    roundtrip = [k for k in src_sd if k in own and not torch.equal(src_sd[k].float(), own[k].float())]
    not_loaded = [k for k in src_sd if k not in own]   # names transformers fuses on load (experts)
    hook = FinalHidden(model)
    embed = lm.embed_tokens.weight.detach().float()
    lm_head = model.lm_head.weight.detach().float()

    # the MTP block, in fp32
    block = MTPBlock(c).float().eval()
    block.load_checkpoint_tensors({k: v.float() for k, v in mtp_sd.items()}, prefix)
    for k, v in block.checkpoint_tensors(prefix).items():
        assert torch.equal(v.float(), mtp_sd[k].float()), k
    mgaps = MTPGaps(block)

    V = c["vocab_size"]
    report = {"transformers": transformers.__version__, "torch": torch.__version__,
              "source": "tests/fixtures/tiny_a", "weight_seed": WEIGHT_SEED, "prompt_seed": PROMPT_SEED,
              "gap_min": GAP_MIN, "mtp_prefix": prefix, "n_mtp_tensors": len(mtp_sd),
              "loading_info": {k: (v if k != "unexpected_keys" else
                                   {"count": len(v), "all_mtp_layer": all(x.startswith(prefix) for x in v)})
                               for k, v in info.items()},
              "target_roundtrip_mismatch": roundtrip,
              "target_keys_compared": len(src_sd) - len(not_loaded),
              "target_keys_renamed_on_load": len(not_loaded), "cases": []}

    for k, T in enumerate(CASES):
        rng = torch.Generator().manual_seed(PROMPT_SEED + k)
        for attempt in range(20):
            tokens = torch.randint(0, V, (T,), generator=rng).tolist()
            rec.pool_gap = rec.router_gap = math.inf
            tlogits, h = target_run(model, hook, tokens)
            t_gaps = (rec.router_gap, rec.pool_gap)
            mgaps.reset()
            logits, full_cache = mtp_rows(block, embed, lm_head, tokens, h)
            chain_t = [T // 4, T // 2, 3 * T // 4, T - 2]
            chains = [mtp_chain(block, embed, lm_head, tokens, h, full_cache, t0) for t0 in chain_t]
            m_gaps = (mgaps.router_gap, mgaps.pool_gap)
            if min(t_gaps + m_gaps) >= GAP_MIN:
                break
        else:
            raise SystemExit(f"case {k}: no prompt with all gaps >= {GAP_MIN} in 20 draws")
        router_gap = min(t_gaps[0], m_gaps[0])
        pool_gap = min(t_gaps[1], m_gaps[1])

        # diagnostics: whole-sequence MTP block and target beside the incremental references
        with torch.no_grad():
            e_all = embed[torch.tensor(tokens[1:])].unsqueeze(0)
            whole = F.linear(block(e_all, h[:-1].unsqueeze(0), cache=None)[0], lm_head)
            tfull = model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0].float()
        chain_logits = torch.stack([cl for _, cl in chains])
        step1_vs_rows = float((chain_logits[:, 0] - logits[torch.tensor(chain_t)]).abs().max())
        assert step1_vs_rows < 1e-5, step1_vs_rows

        save_file({
            "tokens": torch.tensor(tokens, dtype=torch.int32),
            "h": h.contiguous(),
            "logits": logits.contiguous(),
            "chain_t": torch.tensor(chain_t, dtype=torch.int32),
            "chain_tokens": torch.tensor([ct for ct, _ in chains], dtype=torch.int32),
            "chain_logits": chain_logits.contiguous(),
            "target_logits": tlogits.contiguous(),
            "router_gap": torch.tensor([min(router_gap, 1e30)], dtype=torch.float32),
            "pool_gap": torch.tensor([min(pool_gap, 1e30)], dtype=torch.float32),
        }, os.path.join(out_dir, f"mtp_case_{k}.safetensors"))
        case = {"T": T, "attempts": attempt + 1, "chain_t": chain_t,
                "chain_tokens": [ct for ct, _ in chains],
                "router_gap": router_gap, "pool_gap": pool_gap,
                "target_router_gap": t_gaps[0], "target_pool_gap": t_gaps[1],
                "mtp_router_gap": m_gaps[0], "mtp_pool_gap": m_gaps[1],
                "mtp_whole_vs_incremental_max_abs_diff": float((whole - logits).abs().max()),
                "target_whole_vs_incremental_max_abs_diff": float((tfull - tlogits).abs().max()),
                "chain_step1_vs_row_max_abs_diff": step1_vs_rows,
                "logit_absmax": float(logits.abs().max()), "target_logit_absmax": float(tlogits.abs().max()),
                "h_absmax": float(h.abs().max())}
        report["cases"].append(case)
        print(f"mtp_case_{k}", json.dumps(case), flush=True)

    # sanity: the target loaded here reproduces tiny_a's own recorded case logits (its tokens fed the
    # same way; those were made with the transformers version recorded in tiny_a's report)
    check = []
    for name in sorted(os.listdir(SRC)):
        if name.startswith("case_") and name.endswith(".safetensors"):
            ref = load_file(os.path.join(SRC, name))
            tl, _ = target_run(model, hook, ref["tokens"].tolist())
            check.append({"case": name, "tokens": int(ref["tokens"].numel()),
                          "max_abs_diff": float((tl - ref["logits"].float()).abs().max())})
    report["tiny_a_case_check"] = check
    print("tiny_a_case_check", json.dumps(check), flush=True)

    report["files"] = {f: os.path.getsize(os.path.join(out_dir, f)) for f in sorted(os.listdir(out_dir))
                       if f != "report.json"}
    with open(os.path.join(out_dir, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
