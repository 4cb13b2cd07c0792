"""Model loading, tokenizers and architecture adapters over the paged KV cache."""
