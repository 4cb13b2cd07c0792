"""Gemma 3 (text) over paged KV, after transformers' ``modeling_gemma3.py``.

Per layer: input norm, attention (QK RMS norm before rope; rope base 10,000 on
sliding layers and 1,000,000 on global ones; sliding layers see a window of
``sliding_window`` tokens including the query), post-attention norm, residual;
pre-feedforward norm, GELU-tanh MLP, post-feedforward norm, residual (everything
after the attention in one kernel call for a decode step's rows, ``layers.decode_tail``). Every
RMSNorm is ``x_hat * (1 + w)`` in float32. Embeddings are scaled by
``sqrt(hidden)`` cast to the weight dtype; the LM head is tied.
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


class Gemma3Layer:
    """One Gemma 3 decoder layer (four norms around attention and MLP)."""

    def __init__(self, w: Weights, config: ModelConfig, layer: int) -> None:
        prefix = f"model.layers.{layer}"
        hidden, eps = (config.hidden_size,), config.rms_norm_eps

        def norm(name: str) -> RMSNorm:
            return RMSNorm(w.take(f"{prefix}.{name}.weight", hidden), eps, unit_offset=True)

        self.input_norm = norm("input_layernorm")
        self.post_attention_norm = norm("post_attention_layernorm")
        self.pre_feedforward_norm = norm("pre_feedforward_layernorm")
        self.post_feedforward_norm = norm("post_feedforward_layernorm")
        self.attention = PagedSelfAttention(w, f"{prefix}.self_attn", config, layer, qk_norm_unit_offset=True)
        self.mlp = GatedMLP(w, f"{prefix}.mlp", config)
        norms = (self.post_attention_norm, self.pre_feedforward_norm, self.post_feedforward_norm)
        self.tail = decode_tail(self.attention, self.mlp, norms, eps, unit_offset=True)
        self.index = layer
        self.next_rope: str | None = None

    def __call__(self, h: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        h, attended, done = attention_then_tail(self, h, ctx)
        if done:
            return h
        h = self.post_attention_norm.add_to(h, self.attention.o(attended))
        return self.post_feedforward_norm.add_to(h, self.mlp(self.pre_feedforward_norm(h)))


class Gemma3Model(PagedModel):
    """Gemma 3 text decoder; see the module docstring for its conventions."""

    def __init__(self, config: ModelConfig, w: Weights) -> None:
        super().__init__(config, w.dtype, w.device)
        if config.rope_local_theta is None or config.sliding_window is None:
            raise ValueError("a Gemma 3 config needs rope_local_theta and sliding_window")
        self.embedding = w.take("model.embed_tokens.weight", (config.vocab_size, config.hidden_size))
        self.embed_scale = torch.tensor(config.hidden_size**0.5).to(device=w.device, dtype=w.dtype)
        layers = [Gemma3Layer(w, config, i) for i in range(config.num_layers)]
        link_tails(layers)
        self.layers = list(layers)
        self.norm = RMSNorm(w.take("model.norm.weight", (config.hidden_size,)), config.rms_norm_eps, unit_offset=True)
        self.rotaries = {
            "full_attention": Rotary(config.head_dim, config.rope_theta, w.device),
            "sliding_attention": Rotary(config.head_dim, config.rope_local_theta, w.device),
        }
        self.set_lm_head(w)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed(input_ids) * self.embed_scale
