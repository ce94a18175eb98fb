"""The glm5_next MTP block (speculative drafter) in plain PyTorch: our reference for it, since
transformers does not implement it. Follows docs MODEL.md, "MTP block":

    u = eh_proj @ concat(RMSNorm(e, enorm), RMSNorm(h, hnorm))      (embedding half first)
    u += DSA(RMSNorm(u, input_layernorm))
    u += MoE(RMSNorm(u, post_attention_layernorm))
    logits = lm_head @ RMSNorm(u, shared_head.norm)

At row t, e = embed(token[t+1]) and h = the target's final hidden state at row t *before* the final
norm. The target's residual is a highway of hc_mult streams; its final hidden state is the mean over
the streams (what the head feeds to the final norm: transformers' hc_head), so h is that mean. The
block predicts token[t+2]. It has no hyper-connection (plain residual) and its own KV/indexer cache
over its rows 0..t; embed and lm_head are the target's.

The DSA mixer here is MLA without RoPE with the lightning-indexer pool selection of MODEL.md
(index_kpool_always_select_tail honoured; an empty selection attends to every row <= t with equal
weight, as the reference does). tools/train/check.py checks this DSA against transformers' own DSA
layer on the target's weights. The indexer gets no gradient through its top-k (a hard selection);
it is trained by nothing and keeps its initial weights, like the target's indexers.

Checkpoint names (MODEL.md's table) come from checkpoint_tensors(); the experts are kept as 3-D
tensors while training and written out one expert at a time.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, n, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf).to(x.dtype)


class Indexer(nn.Module):
    def __init__(self, c):
        super().__init__()
        H, self.ih, self.id = c["hidden_size"], c["index_n_heads"], c["index_head_dim"]
        self.kpool, self.topk = c["index_kpool"], c["index_topk"]
        self.tail = bool(c.get("index_kpool_always_select_tail", False))
        self.wq_b = nn.Linear(c["q_lora_rank"], self.ih * self.id, bias=False)
        self.wk = nn.Linear(H, self.id, bias=False)
        self.k_norm = nn.LayerNorm(self.id, eps=1e-6)
        self.weights_proj = nn.Linear(H, self.ih, bias=False)
        self.index_kpool_compress_ape = nn.Parameter(torch.zeros(self.kpool, self.id))
        self.index_kpool_compress_gate = nn.Parameter(torch.empty(self.id, H))
        nn.init.normal_(self.index_kpool_compress_gate, std=0.02)

    def keys(self, x):
        """Per-position cache entries: ki [B,T,id] (LayerNorm'd key), gs [B,T,id] (pool gate)."""
        ki = F.layer_norm(self.wk(x).float(), (self.id,), self.k_norm.weight.float(),
                          self.k_norm.bias.float(), 1e-6)
        gs = F.linear(x.float(), self.index_kpool_compress_gate.float())
        return ki, gs

    def select(self, x_q, qr, pos0, ki, gs):
        """bool [B,Tq,Tk]: the positions query row pos0+i attends to."""
        B, Tq = x_q.shape[:2]
        Tk = ki.shape[1]
        dev = x_q.device
        pos = pos0 + torch.arange(Tq, device=dev)
        kpos = torch.arange(Tk, device=dev)
        if self.tail:
            tail0 = (pos + 1) - (pos + 1) % self.kpool
            sel = (kpos[None, :] >= tail0[:, None]) & (kpos[None, :] <= pos[:, None])
        else:
            sel = torch.zeros(Tq, Tk, dtype=torch.bool, device=dev)
        sel = sel.unsqueeze(0).expand(B, Tq, Tk)
        P = Tk // self.kpool
        if P == 0:
            return sel
        kp = ki[:, :P * self.kpool].reshape(B, P, self.kpool, self.id)
        g = gs[:, :P * self.kpool].reshape(B, P, self.kpool, self.id) + self.index_kpool_compress_ape.float()
        pool = (torch.softmax(g, dim=2) * kp).sum(2)                                  # [B,P,id]
        qi = self.wq_b(qr).float().view(B, Tq, self.ih, self.id)
        w = self.weights_proj(x_q).float() * self.ih ** -0.5                           # [B,Tq,ih]
        s = torch.relu(torch.einsum("bqhd,bpd->bqhp", qi, pool) * self.id ** -0.5)
        score = torch.einsum("bqh,bqhp->bqp", w, s)                                   # [B,Tq,P]
        cand = ((torch.arange(P, device=dev) + 1) * self.kpool - 1)[None, :] <= pos[:, None]
        score = score.masked_fill(~cand, float("-inf"))
        k = min(self.topk // self.kpool, P)
        idx = score.topk(k, dim=-1).indices
        chosen = torch.zeros(B, Tq, P, dtype=torch.bool, device=dev).scatter_(-1, idx, True) & cand
        chosen = chosen.repeat_interleave(self.kpool, dim=-1)
        chosen = F.pad(chosen, (0, Tk - P * self.kpool))
        return sel | chosen


class DSA(nn.Module):
    def __init__(self, c):
        super().__init__()
        H = c["hidden_size"]
        self.nh, self.dn, self.dv = c["num_attention_heads"], c["qk_nope_head_dim"], c["v_head_dim"]
        eps = c.get("rms_norm_eps", 1e-5)
        self.q_a_proj = nn.Linear(H, c["q_lora_rank"], bias=False)
        self.q_a_layernorm = RMSNorm(c["q_lora_rank"], eps)
        self.q_b_proj = nn.Linear(c["q_lora_rank"], self.nh * self.dn, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(H, c["kv_lora_rank"], bias=False)
        self.kv_a_layernorm = RMSNorm(c["kv_lora_rank"], eps)
        self.kv_b_proj = nn.Linear(c["kv_lora_rank"], self.nh * (self.dn + self.dv), bias=False)
        self.o_proj = nn.Linear(self.nh * self.dv, H, bias=False)
        self.indexer = Indexer(c)

    def cache_entries(self, x):
        """What the cache keeps per position: the latent c [B,T,kv_lora] and the indexer keys."""
        lat = self.kv_a_layernorm(self.kv_a_proj_with_mqa(x))
        ki, gs = self.indexer.keys(x)
        return lat, ki, gs

    def attend(self, x_q, pos0, lat, ki, gs):
        B, Tq = x_q.shape[:2]
        Tk = lat.shape[1]
        qr = self.q_a_layernorm(self.q_a_proj(x_q))
        q = self.q_b_proj(qr).view(B, Tq, self.nh, self.dn)
        kv = self.kv_b_proj(lat).view(B, Tk, self.nh, self.dn + self.dv)
        k, v = kv.split([self.dn, self.dv], dim=-1)
        sel = self.indexer.select(x_q, qr, pos0, ki, gs)
        pos = pos0 + torch.arange(Tq, device=x_q.device)
        causal = torch.arange(Tk, device=x_q.device)[None, :] <= pos[:, None]
        empty = ~sel.any(-1, keepdim=True)
        s = torch.einsum("bqhd,bkhd->bhqk", q, k).float() * self.dn ** -0.5
        s = torch.where(empty.unsqueeze(1), torch.zeros_like(s), s)
        allowed = torch.where(empty, causal.unsqueeze(0), sel)
        s = s.masked_fill(~allowed.unsqueeze(1), float("-inf"))
        p = torch.softmax(s, dim=-1).to(v.dtype)
        o = torch.einsum("bhqk,bkhd->bqhd", p, v).reshape(B, Tq, self.nh * self.dv)
        return self.o_proj(o)

    def forward(self, x, cache=None):
        """x [B,T,H]. cache None: the whole sequence, causal. cache a dict: append x's rows to it
        and attend from them (incremental)."""
        lat, ki, gs = self.cache_entries(x)
        if cache is None:
            return self.attend(x, 0, lat, ki, gs)
        pos0 = 0
        if "lat" in cache:
            pos0 = cache["lat"].shape[1]
            lat = torch.cat([cache["lat"], lat], 1)
            ki = torch.cat([cache["ki"], ki], 1)
            gs = torch.cat([cache["gs"], gs], 1)
        cache.update(lat=lat, ki=ki, gs=gs)
        return self.attend(x, pos0, lat, ki, gs)


class SwiGLU(nn.Module):
    def __init__(self, H, inter, limit):
        super().__init__()
        self.gate_proj = nn.Linear(H, inter, bias=False)
        self.up_proj = nn.Linear(H, inter, bias=False)
        self.down_proj = nn.Linear(inter, H, bias=False)
        self.limit = limit

    def forward(self, x):
        g, u = self.gate_proj(x), self.up_proj(x)
        if self.limit is not None:
            g, u = g.clamp(max=self.limit), u.clamp(-self.limit, self.limit)
        return self.down_proj(F.silu(g) * u)


class Router(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.E, self.k = c["n_routed_experts"], c["num_experts_per_tok"]
        self.G, self.tg = c["n_group"], c["topk_group"]
        self.norm, self.rsf = c.get("norm_topk_prob", True), c.get("routed_scaling_factor", 1.0)
        self.weight = nn.Parameter(torch.empty(self.E, c["hidden_size"]))
        nn.init.normal_(self.weight, std=0.02)
        self.register_buffer("e_score_correction_bias", torch.zeros(self.E))

    def forward(self, x):
        """x [N,H] -> dense weights [N,E] (zero where not chosen), chosen indices [N,k]."""
        with torch.autocast(x.device.type, enabled=False):  # routing in fp32, as transformers does
            s = torch.sigmoid(F.linear(x.float(), self.weight.float()))
        c = s + self.e_score_correction_bias.float()
        N = x.shape[0]
        gsc = c.view(N, self.G, self.E // self.G).topk(2, dim=-1).values.sum(-1)
        gi = gsc.topk(self.tg, dim=-1).indices
        gm = torch.zeros_like(gsc).scatter_(1, gi, 1.0).bool()
        m = gm.unsqueeze(-1).expand(N, self.G, self.E // self.G).reshape(N, self.E)
        idx = c.masked_fill(~m, float("-inf")).topk(self.k, dim=-1).indices
        w = s.gather(1, idx)
        if self.norm:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        w = w * self.rsf
        return torch.zeros_like(s).scatter(1, idx, w.to(s.dtype)), idx


class MoE(nn.Module):
    def __init__(self, c):
        super().__init__()
        H, I, E = c["hidden_size"], c["moe_intermediate_size"], c["n_routed_experts"]
        self.limit = c.get("swiglu_limit")
        self.gate = Router(c)
        self.experts_gate = nn.Parameter(torch.randn(E, I, H) * 0.02)   # [E, I, H]
        self.experts_up = nn.Parameter(torch.randn(E, I, H) * 0.02)     # [E, I, H]
        self.experts_down = nn.Parameter(torch.randn(E, H, I) * 0.02)   # [E, H, I]
        self.shared_experts = SwiGLU(H, I * c.get("n_shared_experts", 1), self.limit)
        self.last_idx = None

    def forward(self, x):
        shp = x.shape
        xf = x.reshape(-1, shp[-1])
        w, idx = self.gate(xf)
        self.last_idx = idx.detach()
        g = torch.einsum("nh,eih->nei", xf, self.experts_gate.to(xf.dtype))
        u = torch.einsum("nh,eih->nei", xf, self.experts_up.to(xf.dtype))
        if self.limit is not None:
            g, u = g.clamp(max=self.limit), u.clamp(-self.limit, self.limit)
        y = torch.einsum("nei,ehi->neh", F.silu(g) * u, self.experts_down.to(xf.dtype))
        y = (w.to(y.dtype).unsqueeze(-1) * y).sum(1)
        return (y + self.shared_experts(xf)).view(shp)


class MTPBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        H, eps = c["hidden_size"], c.get("rms_norm_eps", 1e-5)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.enorm, self.hnorm = RMSNorm(H, eps), RMSNorm(H, eps)
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(H, eps), RMSNorm(H, eps)
        self.self_attn = DSA(c)
        self.mlp = MoE(c)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(H, eps)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, e, h, cache=None):
        """e, h [B,T,H] -> the normed hidden state [B,T,H] (apply lm_head to get logits)."""
        u = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(h)], dim=-1))
        u = u + self.self_attn(self.input_layernorm(u), cache=cache)
        u = u + self.mlp(self.post_attention_layernorm(u))
        return self.shared_head.norm(u)

    def checkpoint_tensors(self, prefix):
        """name -> tensor in the checkpoint's naming (prefix e.g. 'model.language_model.layers.4.')."""
        out = {}
        for name, t in list(self.named_parameters()) + list(self.named_buffers()):
            if name.startswith("mlp.experts_"):
                continue
            out[prefix + name] = t.detach()
        E = self.mlp.experts_gate.shape[0]
        for e in range(E):
            out[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = self.mlp.experts_gate[e].detach()
            out[f"{prefix}mlp.experts.{e}.up_proj.weight"] = self.mlp.experts_up[e].detach()
            out[f"{prefix}mlp.experts.{e}.down_proj.weight"] = self.mlp.experts_down[e].detach()
        return out

    def load_checkpoint_tensors(self, sd, prefix):
        E = self.mlp.experts_gate.shape[0]
        own = dict(self.named_parameters())
        own.update(dict(self.named_buffers()))
        with torch.no_grad():
            for name, t in own.items():
                if name.startswith("mlp.experts_"):
                    continue
                t.copy_(sd[prefix + name].to(t.dtype))
            for e in range(E):
                self.mlp.experts_gate[e].copy_(sd[f"{prefix}mlp.experts.{e}.gate_proj.weight"])
                self.mlp.experts_up[e].copy_(sd[f"{prefix}mlp.experts.{e}.up_proj.weight"])
                self.mlp.experts_down[e].copy_(sd[f"{prefix}mlp.experts.{e}.down_proj.weight"])


def dsa_from_checkpoint(c, sd, prefix):
    """A DSA module holding the checkpoint tensors under prefix (e.g. a target layer's
    'model.language_model.layers.1.self_attn.'), for checking this DSA against transformers'."""
    d = DSA(c)
    own = dict(d.named_parameters())
    with torch.no_grad():
        for name, t in own.items():
            t.copy_(sd[prefix + name].to(t.dtype))
    return d
