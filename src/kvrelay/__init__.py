"""kvrelay: KV-cache-aware routing and serving of LLM continuations."""

__version__ = "0.1.0"
