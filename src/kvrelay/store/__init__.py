"""Content-addressed KV chunks: keys, chunk format, and the ram / ssd / peer / object tiers."""
