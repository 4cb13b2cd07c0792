"""The device loop: one thread that steps the continuously batched model, its iteration policy and jobs."""
