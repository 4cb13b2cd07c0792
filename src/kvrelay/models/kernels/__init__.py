"""Compute over the paged KV cache: attention, sliding-window rings, page tensors, the greedy head,
huge pages and the native C kernels."""
