"""A kvrelay worker whose runtime side is a vLLM OpenAI server (docs/design.md section 13)."""
