"""What a serving process does with the objects its start-up made, once it is ready.

``freeze_startup_objects()`` moves every object alive now (imported modules, the tokenizer, the model's
Python wrappers, configuration) into the collector's permanent generation (``gc.freeze``), so the full
collections that serving triggers no longer traverse them. On the 2-core development machine a full
collection of the router's 280,000 start-up objects (transformers and torch are imported) took 100 ms idle
and stopped the event loop for as long, longer under load, beside first tokens of 10-50 ms; after the
freeze it takes under a millisecond. Objects allocated later are collected as before; the frozen ones are
the process's for its lifetime anyway.
"""

from __future__ import annotations

import gc


def freeze_startup_objects() -> None:
    """Collect once, then freeze what is left (see the module docstring)."""
    gc.collect()
    gc.freeze()
