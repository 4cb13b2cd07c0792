"""The OpenAI-compatible HTTP ingress."""
