"""A Llama checkpoint whose greedy continuation is known in advance: each token is followed by the next word.

``make_counting_model(directory)`` writes a real Llama artifact (``config.json``,
``model.safetensors`` and a word-level ``tokenizer.json``) whose greedy next
token depends only on the last token: word ``wNNN`` is followed by
``successor(wNNN)``, cycling through the ``WORDS`` words. Every stream of such
a model is self-describing: the ``n``-th generated token after a prompt
ending in ``t`` is ``successor^n(t)``, whatever worker produced it, whether its
prefix was restored, recomputed or decoded, in whatever batch. A consumer that
sees a token twice, out of order, or from a gap can tell from the text alone
(``expected_words`` / ``words_of``), which is what the fault checker of
``testing.invariants`` needs; no reference run is involved.

How: the embedding of word ``i`` is ``EMBED_SCALE`` times the unit vector
``e_i``; every layer's output projections (attention ``o_proj``, MLP
``down_proj``) are zero, so the residual stream is the last token's
embedding; the final RMS norm maps it to ``sqrt(hidden) * e_i``; and the LM
head's row ``successor(i)`` is ``e_i``. The other weights (queries, keys,
values, gates, norms) are random, so every layer still computes and caches
real KV at the cost of a model of this size; they only cannot change the
argmax. (torch and transformers are imported only to build the model, so the
fault checker that reads words stays light.) Special tokens are followed by the first word. The model has no
end-of-sequence token, so a request always runs to its ``max_tokens``; keep
``max_tokens`` below ``len(WORDS)`` so that no word repeats within a stream.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIALS = ("<pad>", "<bos>", "<unk>")
FIRST_WORD = len(SPECIALS)
VOCAB = 256
WORDS = tuple(f"w{i:03d}" for i in range(VOCAB - FIRST_WORD))
"""The cycle of words, in order; token id of ``WORDS[k]`` is ``FIRST_WORD + k``."""
EMBED_SCALE = 4.0


def successor(token: int) -> int:
    """The greedy next token after ``token``."""
    if token < FIRST_WORD:
        return FIRST_WORD
    return FIRST_WORD + (token - FIRST_WORD + 1) % len(WORDS)


def expected_tokens(prompt: list[int], n: int) -> list[int]:
    """The ``n`` tokens a greedy request on ``prompt`` generates."""
    out: list[int] = []
    token = prompt[-1]
    for _ in range(n):
        token = successor(token)
        out.append(token)
    return out


def word_prompt(start: int, length: int) -> list[int]:
    """A prompt of ``length`` consecutive words beginning at word index ``start`` (token ids)."""
    return [FIRST_WORD + (start + k) % len(WORDS) for k in range(length)]


def words_of(text: str) -> list[int]:
    """The token ids a streamed text spells (words separated by spaces); an unknown word raises ValueError."""
    ids = []
    for word in text.split():
        if len(word) != 4 or word[0] != "w" or not word[1:].isdigit() or int(word[1:]) >= len(WORDS):
            raise ValueError(f"{word!r} is not a word of the counting model")
        ids.append(FIRST_WORD + int(word[1:]))
    return ids


def _config(hidden_size: int, layers: int, intermediate_size: int, max_positions: int) -> LlamaConfig:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
    )


def build_counting_model(
    hidden_size: int = 256, layers: int = 4, intermediate_size: int = 512, max_positions: int = 2048, seed: int = 0
) -> LlamaForCausalLM:
    """The float32 counting Llama (see the module docstring); ``hidden_size`` must be at least ``VOCAB``."""
    import torch
    from transformers import LlamaForCausalLM

    if hidden_size < VOCAB:
        raise ValueError(f"hidden_size {hidden_size} must be at least the vocabulary size {VOCAB}")
    model = LlamaForCausalLM(_config(hidden_size, layers, intermediate_size, max_positions)).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                param.zero_()
            elif "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
            else:
                param.copy_(0.08 * torch.randn(param.shape, generator=generator))
        model.model.norm.weight.fill_(1.0)
        embed = torch.zeros(VOCAB, hidden_size)
        head = torch.zeros(VOCAB, hidden_size)
        for token in range(VOCAB):
            embed[token, token] = EMBED_SCALE
            head[successor(token), token] = 1.0
        model.model.embed_tokens.weight.copy_(embed)
        model.lm_head.weight.copy_(head)
    return model


def build_word_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over ``SPECIALS`` and ``WORDS``; decoded words are joined by single spaces."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate((*SPECIALS, *WORDS))}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<bos>", unk_token="<unk>")


def make_counting_model(directory: Path, **sizes: Any) -> Path:
    """Write the counting model (safetensors, config.json, tokenizer) into ``directory``; return it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    build_counting_model(**sizes).save_pretrained(directory)
    build_word_tokenizer().save_pretrained(directory)
    config = json.loads((directory / "config.json").read_text())
    if config.get("eos_token_id") is not None:
        raise AssertionError("the counting model must have no end-of-sequence token")
    return directory
