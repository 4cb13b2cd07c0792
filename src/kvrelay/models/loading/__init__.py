"""Model files to runnable parts: safetensors and GGUF loading, weight layouts, tokenizers, fingerprints
and the default model."""
