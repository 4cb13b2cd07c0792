"""Inference engines a kvrelay worker can serve through, besides its own paged runtime."""
