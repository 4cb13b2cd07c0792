"""Deterministic token values of the simulator.

A simulated worker generates ``token_value(seed, position)`` at each absolute
position of the sequence (prompt included), so a continuation on another worker
draws exactly what the first attempt would have, and a consumer can check every
delivered token.
"""

from __future__ import annotations

TOKEN_VOCAB = 32000


_MASK64 = (1 << 64) - 1


def token_value(seed: int, position: int) -> int:
    """The deterministic token a request with sampling ``seed`` draws at absolute ``position``.

    A splitmix64 finalizer over (seed, position): cheap, well mixed, and the same
    on every platform and process.
    """
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xD1B54A32D192ED03 + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) % TOKEN_VOCAB
