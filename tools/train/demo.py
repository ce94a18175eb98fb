"""The demo model's shape and the helpers that training, checking and evaluation share.

The target model is transformers' own glm5_next (Glm5NextForConditionalGeneration, 5.17): its
whole-sequence forward is the training forward. It is causal here because every DSA selection is
non-empty (index_kpool_always_select_tail), which tools/train/check.py proves by comparing it with
the same model fed one token at a time from an empty cache. The MTP block is ours (mtp.py).
"""
import math
import os

import torch

# glm5_next text config: the CPU-small shape (head dims 32, kv_lora 64, q_lora 96, index_head_dim
# 32, linear_head_dim 32, conv 4, n_group 4 / topk_group 2) with 4 layers and 8 experts of 64.
TEXT = dict(
    vocab_size=6144, hidden_size=256, intermediate_size=384, moe_intermediate_size=64,
    num_hidden_layers=4,
    layer_types=["linear_attention", "deepseek_sparse_attention", "linear_attention", "deepseek_sparse_attention"],
    mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
    indexer_types=["full", "full", "full", "full"],
    num_attention_heads=8, num_key_value_heads=8, qk_nope_head_dim=32, v_head_dim=32,
    qk_rope_head_dim=0, kv_lora_rank=64, q_lora_rank=96,
    n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=4, topk_group=2,
    routed_scaling_factor=2.5, norm_topk_prob=True, swiglu_limit=10.0,
    index_topk=64, index_kpool=16, index_head_dim=32, index_n_heads=16,
    index_kpool_always_select_tail=True,
    linear_num_heads=8, linear_head_dim=32, linear_conv_kernel_dim=4,
    hc_mult=4, rms_norm_eps=1e-5,
    num_nextn_predict_layers=1,
    tie_word_embeddings=False,
    pad_token_id=None, eos_token_id=[6132, 6139, 6141], bos_token_id=None,
)
# The smallest vision tower transformers accepts: the checkpoint is a glm5_next one
# (Glm5NextForConditionalGeneration); the text runtime ignores model.visual.*.
VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=256,
              projection_intermediate_size=32)
FP32_KEEP = ("e_score_correction_bias", "conv1d", "dt_bias", "A_log")
SEQ = 512            # training length = perplexity window length
GMASK, SOP, EOT = 6134, 6136, 6132
MTP_PREFIX = "model.language_model.layers.%d." % TEXT["num_hidden_layers"]


# The device the scripts run on (cuda; cpu for a smoke test).
DEVICE = os.environ.get("DEMO_DEVICE", "cuda")


def make_config():
    # pad_token_id stays None: a padding_idx would freeze <|endoftext|>'s embedding row, and the
    # documents are separated by that token. The tokenizer config names it as the pad token.
    from transformers import Glm5NextConfig
    return Glm5NextConfig(text_config=dict(TEXT), vision_config=dict(VISION), tie_word_embeddings=False,
                          eos_token_id=TEXT["eos_token_id"])


def text_cfg_dict(model):
    """The text config as a plain dict (mtp.py reads it)."""
    return model.config.text_config.to_dict()


def language_model(model):
    return model.model.language_model


class FinalHidden:
    """Captures the target's final hidden state before the final norm (the norm's input: the mean
    over the hc_mult streams of the last highway) on every forward."""

    def __init__(self, model):
        self.h = None
        language_model(model).norm.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.h = args[0]


def read_u16(path, device="cpu"):
    import numpy as np
    return torch.from_numpy(np.fromfile(path, dtype="<u2").astype("int64")).to(device)


def heldout_windows(stream, seq=SEQ):
    """The perplexity windows over the held-out stream (see heldout_ppl.json): the stream is cut
    into consecutive pieces of seq-2 tokens (the last may be shorter) and each piece gets
    [gMASK]<sop> in front. Every stream token is predicted once, from its window's prefix; the
    two prefix tokens themselves are not predicted."""
    n = seq - 2
    out = []
    for i in range(0, len(stream), n):
        piece = stream[i:i + n]
        out.append(torch.cat([torch.tensor([GMASK, SOP], dtype=piece.dtype, device=piece.device), piece]))
    return out


def window_nll(logits, win):
    """Sum of -log p over the window's stream tokens (positions 2..), and their count."""
    lp = torch.log_softmax(logits[1:-1].float(), dim=-1)
    tgt = win[2:]
    return float(-lp.gather(1, tgt[:, None]).sum()), int(tgt.numel())


def count_params(model, mtp):
    text = sum(p.numel() for n, p in model.named_parameters() if ".visual." not in "." + n)
    text += sum(b.numel() for n, b in model.named_buffers() if "e_score_correction_bias" in n)
    visual = sum(p.numel() for n, p in model.named_parameters() if ".visual." in "." + n)
    m = sum(t.numel() for t in mtp.checkpoint_tensors("").values())
    return {"target_text": text, "mtp": m, "text_plus_mtp": text + m, "visual_unused": visual}


def to_checkpoint_dtypes(model):
    model.to(torch.bfloat16)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if any(k in name for k in FP32_KEEP) and t.is_floating_point():
            t.data = t.data.float()
    return model


def save_with_mtp(model, mtp, out_dir):
    """save_pretrained in bf16 (fp32-kept tensors in fp32), then the MTP tensors added to the same
    safetensors file under layer index num_hidden_layers."""
    from safetensors.torch import load_file, save_file
    to_checkpoint_dtypes(model)
    model.save_pretrained(out_dir, max_shard_size="64MB")
    path = os.path.join(out_dir, "model.safetensors")
    sd = load_file(path)
    for name, t in mtp.checkpoint_tensors(MTP_PREFIX).items():
        keep32 = any(k in name for k in FP32_KEEP)
        sd[name] = t.float().contiguous() if keep32 else t.to(torch.bfloat16).contiguous()
    save_file(sd, path, metadata={"format": "pt"})
    return sorted(sd)
