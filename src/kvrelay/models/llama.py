"""The Llama family over paged KV: Llama, Qwen2 (QKV bias) and Qwen3 (QK RMS norm).

After transformers' ``modeling_llama.py``, ``modeling_qwen2.py`` and
``modeling_qwen3.py``: pre-norm residual blocks (input norm, attention;
post-attention norm, SiLU-gated MLP), RMSNorm as ``w * x_hat.to(dtype)``, rope
with one base for every layer, a final norm and an LM head (tied when the
config says so). The config's ``attention_bias`` adds q/k/v biases (and an
o_proj bias where the checkpoint has one); ``qk_norm`` adds Qwen3's per-head
norms before rope.
"""

from __future__ import annotations

import torch

from kvrelay.models.config import ModelConfig
from kvrelay.models.layers import (
    PagedModel,
    PagedSelfAttention,
    RMSNorm,
    Rotary,
    StepContext,
    attention_then_tail,
    decode_tail,
    link_tails,
)
from kvrelay.models.mlp import GatedMLP
from kvrelay.models.weights import Weights


class LlamaLayer:
    """One pre-norm decoder layer of the Llama family."""

    def __init__(self, w: Weights, config: ModelConfig, layer: int) -> None:
        prefix = f"model.layers.{layer}"
        hidden, eps = (config.hidden_size,), config.rms_norm_eps
        self.input_norm = RMSNorm(w.take(f"{prefix}.input_layernorm.weight", hidden), eps, unit_offset=False)
        self.post_attention_norm = RMSNorm(
            w.take(f"{prefix}.post_attention_layernorm.weight", hidden), eps, unit_offset=False
        )
        self.attention = PagedSelfAttention(w, f"{prefix}.self_attn", config, layer)
        self.mlp = GatedMLP(w, f"{prefix}.mlp", config)
        self.tail = decode_tail(self.attention, self.mlp, (None, self.post_attention_norm, None), eps, False)
        self.index = layer
        self.next_rope: str | None = None

    def __call__(self, h: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        h, attended, done = attention_then_tail(self, h, ctx)
        if done:
            return h
        h = h.add_(self.attention.o(attended))
        return h.add_(self.mlp(self.post_attention_norm(h)))


class LlamaModel(PagedModel):
    """Llama, Qwen2 or Qwen3, as ``config.attention_bias`` and ``config.qk_norm`` say."""

    def __init__(self, config: ModelConfig, w: Weights) -> None:
        super().__init__(config, w.dtype, w.device)
        self.embedding = w.take("model.embed_tokens.weight", (config.vocab_size, config.hidden_size))
        layers = [LlamaLayer(w, config, i) for i in range(config.num_layers)]
        link_tails(layers)
        self.layers = list(layers)
        self.norm = RMSNorm(w.take("model.norm.weight", (config.hidden_size,)), config.rms_norm_eps, unit_offset=False)
        self.rotaries = {"full_attention": Rotary(config.head_dim, config.rope_theta, w.device)}
        self.set_lm_head(w)
