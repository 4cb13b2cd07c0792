"""The wire seam: messages, identifiers and the msgpack codec (pure data)."""
