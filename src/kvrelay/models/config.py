"""The architecture configuration every adapter reads (docs/design.md section 9).

``ModelConfig.from_hf(d)`` reads a Hugging Face ``config.json`` dict (the text
config of Gemma 3, or Llama / Qwen2 / Qwen3) and returns one frozen record with
every field an adapter needs; it raises ``UnsupportedModelError`` naming the
architecture or the missing field. Weight tensors use Hugging Face names.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = ("gemma3", "llama", "qwen2", "qwen3")


class UnsupportedModelError(ValueError):
    """A model whose architecture or configuration kvrelay cannot serve."""


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """One decoder-only architecture's shape and conventions.

    ``layer_types[i]`` is ``"sliding_attention"`` or ``"full_attention"``;
    ``sliding_window`` counts the query position itself (a token sees itself
    and the ``sliding_window - 1`` tokens before it).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    layer_types: tuple[str, ...]
    sliding_window: int | None = None
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    attention_bias: bool = False
    qk_norm: bool = False
    hidden_activation: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def attention_scale(self) -> float:
        """Multiplier of q @ k^T: ``query_pre_attn_scalar ** -0.5`` for Gemma 3, else ``head_dim ** -0.5``."""
        base = self.query_pre_attn_scalar if self.query_pre_attn_scalar is not None else self.head_dim
        return float(base) ** -0.5

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V for one token across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> ModelConfig:
        """Read a Hugging Face config dict (Gemma 3's nested ``text_config`` included)."""
        d = dict(raw.get("text_config") or raw)
        model_type = str(d.get("model_type") or raw.get("model_type") or "")
        arch = {"gemma3_text": "gemma3", "gemma3": "gemma3"}.get(model_type, model_type)
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture '{model_type}' is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        missing = [k for k in required if k not in d]
        if missing:
            raise UnsupportedModelError(f"config.json lacks {', '.join(missing)}")
        num_heads = int(d["num_attention_heads"])
        num_layers = int(d["num_hidden_layers"])
        head_dim = int(d.get("head_dim") or int(d["hidden_size"]) // num_heads)
        eos = d.get("eos_token_id", raw.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        common: dict[str, Any] = dict(
            architecture=arch,
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(d.get("max_position_embeddings", 8192)),
            bos_token_id=d.get("bos_token_id", raw.get("bos_token_id")),
            eos_token_ids=eos_ids,
        )
        if arch == "gemma3":
            pattern = int(d.get("sliding_window_pattern", 6))
            layer_types = d.get("layer_types") or [
                "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)
            ]
            return cls(
                **common,
                rope_theta=float(_rope_theta(d, "full_attention", 1_000_000.0)),
                rope_local_theta=float(d.get("rope_local_base_freq") or _rope_theta(d, "sliding_attention", 10_000.0)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
                layer_types=tuple(layer_types),
                sliding_window=int(d.get("sliding_window", 512)),
                query_pre_attn_scalar=float(d.get("query_pre_attn_scalar", head_dim)),
                attention_bias=bool(d.get("attention_bias", False)),
                qk_norm=True,
                hidden_activation=str(d.get("hidden_activation") or "gelu_pytorch_tanh"),
            )
        return cls(
            **common,
            rope_theta=float(_rope_theta(d, "full_attention", 10_000.0)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            layer_types=tuple(["full_attention"] * num_layers),
            attention_bias=bool(d.get("attention_bias", arch == "qwen2")),
            qk_norm=arch == "qwen3",
            hidden_activation=str(d.get("hidden_act") or "silu"),
        )


def _rope_theta(d: dict[str, Any], layer_type: str, default: float) -> float:
    """``rope_theta`` of a config, also where transformers 5 nests it under ``rope_parameters``."""
    if "rope_theta" in d and d["rope_theta"] is not None and layer_type == "full_attention":
        return float(d["rope_theta"])
    params = d.get("rope_parameters") or {}
    if layer_type in params and isinstance(params[layer_type], dict):
        return float(params[layer_type].get("rope_theta", default))
    if "rope_theta" in params:
        return float(params["rope_theta"])
    return default
