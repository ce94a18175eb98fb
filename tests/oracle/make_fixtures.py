#!/usr/bin/env python3
"""Makes the transformers reference fixtures for the CPU runtime test (tests/model_oracle_test.cc).

Runs where transformers' glm5_next exists (the GPU machine: transformers 5.17, torch 2.11):

    python3 tests/oracle/make_fixtures.py OUT_DIR

For each tiny config below it builds Glm5NextForConditionalGeneration, gives *every* tensor random
values of a sensible scale rounded to bf16, saves the checkpoint with save_pretrained (bf16, with
the fp32-kept tensors in fp32; one config sharded), reloads it in fp32 and feeds each prompt one
token at a time from an empty cache, then greedily continues 24 tokens, keeping the logits after
every fed token. Whole-sequence forward is not used as the reference: it is not causal for DSA
rows whose selection is empty. The smallest gap between the k-th and (k+1)-th indexer pool score
(and router expert score) is recorded; a prompt whose gap is under 1e-4 is redrawn.

Output per config: OUT_DIR/<name>/ (config.json + safetensors) and OUT_DIR/<name>/case_<k>.safetensors
holding tokens [T] i32, prompt_len [1] i32, gen [24] i32, logits [T, V] f32, pool_gap [1] f32,
router_gap [1] f32. OUT_DIR/report.json summarises.
"""
import json
import math
import os
import sys

import torch
from safetensors.torch import save_file
from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration
from transformers.models.glm5_next import modeling_glm5_next as mg

GEN = 24
GAP_MIN = 1e-4

BASE = dict(
    vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_attention_heads=4, num_key_value_heads=4, qk_nope_head_dim=16, v_head_dim=16,
    kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=0, n_shared_experts=1,
    n_routed_experts=16, num_experts_per_tok=4, routed_scaling_factor=2.5, norm_topk_prob=True,
    index_head_dim=16, index_n_heads=16, linear_head_dim=16, linear_num_heads=4,
    hc_sinkhorn_iters=20, rms_norm_eps=1e-5, swiglu_limit=10.0, pad_token_id=None,
    eos_token_id=None, tie_word_embeddings=False,
)

# Every branch of the model (docs/MODEL.md): KDA/DSA in different orders, a shared indexer right
# after a full one, dense and sparse MLPs, n_group > 1, tail on and off, lower bound a number and
# null, conv kernels 3 and 4, hc_mult 2 and 4, prompts shorter and longer than index_topk.
CONFIGS = {
    "tiny_a": dict(
        num_hidden_layers=4,
        layer_types=["linear_attention", "deepseek_sparse_attention", "deepseek_sparse_attention", "linear_attention"],
        indexer_types=["full", "full", "shared", "full"],
        mlp_layer_types=["dense", "sparse", "sparse", "dense"],
        n_group=4, topk_group=2, index_topk=16, index_kpool=4, index_kpool_always_select_tail=True,
        linear_lower_bound=-5.0, linear_conv_kernel_dim=4, hc_mult=4,
        prompts=[9, 41],
    ),
    "tiny_b": dict(
        num_hidden_layers=5,
        layer_types=["deepseek_sparse_attention", "linear_attention", "deepseek_sparse_attention",
                     "deepseek_sparse_attention", "linear_attention"],
        indexer_types=["full", "full", "full", "shared", "full"],
        mlp_layer_types=["sparse", "dense", "sparse", "sparse", "sparse"],
        n_group=1, topk_group=1, index_topk=8, index_kpool=4, index_kpool_always_select_tail=False,
        linear_lower_bound=None, linear_conv_kernel_dim=3, hc_mult=2,
        prompts=[6, 37],
    ),
    "tiny_c": dict(
        num_hidden_layers=6,
        layer_types=["linear_attention", "linear_attention", "deepseek_sparse_attention",
                     "linear_attention", "deepseek_sparse_attention", "deepseek_sparse_attention"],
        indexer_types=["full", "full", "full", "full", "full", "shared"],
        mlp_layer_types=["dense", "sparse", "sparse", "dense", "sparse", "sparse"],
        n_group=2, topk_group=1, index_topk=16, index_kpool=8, index_kpool_always_select_tail=True,
        linear_lower_bound=-3.0, linear_conv_kernel_dim=3, hc_mult=4,
        prompts=[12, 45],
        shard=True,
    ),
}

VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=64,
              projection_intermediate_size=32)

FP32_KEEP = ("e_score_correction_bias", "conv1d", "dt_bias", "A_log")


def init_value(name, shape, gen, H, S):
    """Random values of a sensible scale for the tensor called name (module naming)."""
    r = torch.randn(shape, generator=gen, dtype=torch.float32)
    fan_in = shape[-1] if len(shape) >= 2 else 1
    if name.endswith("attn_hc.fn") or name.endswith("ffn_hc.fn"):
        return r / math.sqrt(S * H)
    if name.endswith("hc.base"):
        return 0.5 * r
    if name.endswith("hc.scale"):
        return 1.0 + 0.2 * r
    if "norm" in name and name.endswith("weight"):
        return 1.0 + 0.1 * r
    if name.endswith("k_norm.bias"):
        return 0.1 * r
    if name.endswith("A_log"):
        return 0.5 * r
    if name.endswith("dt_bias"):
        return -2.0 + r
    if "conv1d" in name:
        return 0.5 * r
    if name.endswith("e_score_correction_bias"):
        return 0.05 * r
    if name.endswith("index_kpool_compress_ape"):
        return 0.5 * r
    if name.endswith("embed_tokens.weight"):
        return r
    if name.endswith("experts.gate_up_proj"):
        return r / math.sqrt(shape[-1])
    if name.endswith("experts.down_proj"):
        return r / math.sqrt(shape[-1])
    if len(shape) >= 2:
        return r / math.sqrt(fan_in)
    return 0.1 * r


def perturb(model, seed, H, S):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if not t.is_floating_point():
                continue
            v = init_value(name, tuple(t.shape), gen, H, S).to(torch.bfloat16).to(torch.float32)
            t.copy_(v.to(t.dtype))


class GapRecorder:
    """Records the smallest k-th vs (k+1)-th gap of the indexer's pool top-k and the router's
    expert top-k while the reference runs, by wrapping their forward passes."""

    def __init__(self):
        self.pool_gap = math.inf
        self.router_gap = math.inf

    def install(self):
        rec = self
        orig_topk = torch.Tensor.topk
        orig_indexer = mg.Glm5NextTextIndexer.forward
        orig_router = mg.Glm5NextTextTopkRouter.forward

        def gap_of(values, k):
            n = values.shape[-1]
            if k >= n:
                return math.inf
            s = values.sort(dim=-1, descending=True).values
            valid = s[..., k] > torch.finfo(s.dtype).min / 2  # the (k+1)-th is a real candidate
            if not bool(valid.any()):
                return math.inf
            g = (s[..., k - 1] - s[..., k])[valid]
            return float(g.min())

        def indexer_forward(self, *a, **kw):
            def topk(t, k, *ta, **tkw):
                rec.pool_gap = min(rec.pool_gap, gap_of(t.float(), k))
                return orig_topk(t, k, *ta, **tkw)
            torch.Tensor.topk = topk
            try:
                return orig_indexer(self, *a, **kw)
            finally:
                torch.Tensor.topk = orig_topk

        def router_forward(self, hidden_states):
            out = orig_router(self, hidden_states)
            h = hidden_states.view(-1, self.hidden_dim)
            s = torch.sigmoid(torch.nn.functional.linear(h.float(), self.weight.float())) + self.e_score_correction_bias
            # gap among the kept groups: recompute the mask the router used
            per = self.num_experts // self.num_group
            gs = s.view(-1, self.num_group, per).topk(2, dim=-1)[0].sum(-1)
            if self.topk_group < self.num_group:
                rec.router_gap = min(rec.router_gap, gap_of(gs, self.topk_group))
            gi = orig_topk(gs, self.topk_group, dim=-1).indices
            mask = torch.zeros_like(gs).scatter_(1, gi, 1).bool()
            m = mask.unsqueeze(-1).expand(-1, self.num_group, per).reshape(-1, self.num_experts)
            c = s.masked_fill(~m, torch.finfo(s.dtype).min)
            rec.router_gap = min(rec.router_gap, gap_of(c, self.top_k))
            return out

        mg.Glm5NextTextIndexer.forward = indexer_forward
        mg.Glm5NextTextTopkRouter.forward = router_forward


def reference(model, prompt):
    """Feeds prompt then GEN greedy tokens one at a time; returns tokens, logits [T, V], gen."""
    cache = None
    tokens = list(prompt)
    rows = []
    gen = []
    i = 0
    with torch.no_grad():
        while i < len(tokens):
            out = model(input_ids=torch.tensor([[tokens[i]]]), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            rows.append(out.logits[0, -1].float().clone())
            i += 1
            if i >= len(prompt) and len(gen) < GEN:
                nxt = int(rows[-1].argmax())
                gen.append(nxt)
                tokens.append(nxt)
    return tokens, torch.stack(rows), gen


def main():
    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(0)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    rec = GapRecorder()
    rec.install()  # once: a second install would wrap the first and record into the wrong object
    report = {"transformers": __import__("transformers").__version__, "torch": torch.__version__, "configs": {}}
    for ci, (name, spec) in enumerate(CONFIGS.items()):
        spec = dict(spec)
        prompts = spec.pop("prompts")
        shard = spec.pop("shard", False)
        text = dict(BASE, **spec)
        cfg = Glm5NextConfig(text_config=text, vision_config=VISION, tie_word_embeddings=False)
        model = Glm5NextForConditionalGeneration(cfg)
        perturb(model, 1000 + ci, text["hidden_size"], text["hc_mult"])
        model = model.to(torch.bfloat16)
        with torch.no_grad():
            for pname, t in list(model.named_parameters()) + list(model.named_buffers()):
                if any(k in pname for k in FP32_KEEP) and t.is_floating_point():
                    t.data = t.data.float()
        mdir = os.path.join(out_dir, name)
        model.save_pretrained(mdir, max_shard_size="150KB" if shard else "1GB")
        ref = Glm5NextForConditionalGeneration.from_pretrained(
            mdir, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager")
        ref.eval()
        # every stored value must survive the round trip: the reference computes on what was saved
        sd_saved = {k: v.float() for k, v in model.state_dict().items()}
        sd_ref = ref.state_dict()
        mism = [k for k in sd_ref if k in sd_saved and not torch.equal(sd_saved[k], sd_ref[k].float())]
        V = text["vocab_size"]
        gen_rng = torch.Generator().manual_seed(77 + ci)
        cases = []
        for k, plen in enumerate(prompts):
            for attempt in range(20):
                rec.pool_gap = rec.router_gap = math.inf
                prompt = torch.randint(0, V, (plen,), generator=gen_rng).tolist()
                tokens, logits, gen = reference(ref, prompt)
                if rec.pool_gap >= GAP_MIN and rec.router_gap >= GAP_MIN:
                    break
            # diagnostic: one whole-sequence forward beside the one-token-at-a-time reference
            with torch.no_grad():
                full = ref(input_ids=torch.tensor([tokens]), use_cache=False).logits[0].float()
            save_file({
                "tokens": torch.tensor(tokens, dtype=torch.int32),
                "prompt_len": torch.tensor([plen], dtype=torch.int32),
                "gen": torch.tensor(gen, dtype=torch.int32),
                "logits": logits.contiguous(),
                "pool_gap": torch.tensor([min(rec.pool_gap, 1e30)], dtype=torch.float32),
                "router_gap": torch.tensor([min(rec.router_gap, 1e30)], dtype=torch.float32),
            }, os.path.join(mdir, f"case_{k}.safetensors"))
            cases.append({"prompt_len": plen, "tokens": len(tokens), "attempts": attempt + 1,
                          "pool_gap": rec.pool_gap, "router_gap": rec.router_gap,
                          "full_forward_max_abs_diff": float((full - logits).abs().max()),
                          "logit_absmax": float(logits.abs().max())})
        files = sorted(os.listdir(mdir))
        from safetensors import safe_open
        keys = []
        for f in files:
            if f.endswith(".safetensors") and not f.startswith("case_"):
                with safe_open(os.path.join(mdir, f), "pt") as sf:
                    keys += [(k, str(sf.get_slice(k).get_dtype()), list(sf.get_slice(k).get_shape())) for k in sf.keys()]
        report["configs"][name] = {"cases": cases, "files": files, "roundtrip_mismatch": mism,
                                   "text_keys": sorted([k for k in keys if "visual" not in k[0]]),
                                   "n_visual_keys": sum(1 for k in keys if "visual" in k[0])}
        print(name, json.dumps(cases), flush=True)
    with open(os.path.join(out_dir, "report.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
