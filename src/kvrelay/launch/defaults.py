"""The one home of the process faces' defaults: the launch options and the ``kvrelay`` flags both read these.

Torch-free and import-light, so every command can show its defaults in ``--help``
without loading a model. Chunk and page sizes live in ``kvrelay.protocol.chunk_keys``
(every layer shares them); the router's timeouts are ``RouterConfig``'s; the
dtype names are ``kvrelay.models.dtypes``'.
"""

from __future__ import annotations

from kvrelay.core.policies import DEFAULT_POLICY
from kvrelay.paths import data_dir

HOST = "127.0.0.1"
"""The address HTTP and the worker WebSocket listen on."""
HTTP_PORT = 8000
"""The OpenAI-compatible API's port."""
WORKER_PORT = 8001
"""The router's worker WebSocket port (``kvrelay cluster`` picks a free one instead)."""
STATUS_HOST = "127.0.0.1"
"""The address of a router's or worker's read-only status listener (``launch/status.py``)."""
POLICY = DEFAULT_POLICY
"""The routing policy."""

DTYPE = "bfloat16"
"""The weights and KV dtype of a served worker (``kvrelay generate`` and the engine default to float32)."""
KV_TOKENS = 65536
"""A worker's KV cache capacity in tokens."""
LANES = 16
"""Concurrent sequences on a worker's device."""
VLLM_LANES = 256
"""Concurrent requests a vLLM worker counts its engine to run at most (the engine's ``--max-num-seqs``)."""
TOKEN_BUDGET = 512
"""Tokens per device iteration (the chunked prefill budget)."""
PREFILL_ONLY_BUDGET = 4096
"""Tokens of a device iteration with no decoding lane: no decode step waits behind it, and a cold prompt
runs in fewer, larger forwards (docs/performance.md, "Prefill-only forwards")."""
RAM_BYTES = 1 << 30
"""Bytes of a worker's ram chunk tier."""
SSD_BYTES = 16 << 30
"""Bytes of a worker's local chunk directory (the ssd tier)."""
S3_PREFIX = "kvrelay/"
"""Key prefix of chunks in the S3 bucket of the object tier."""

HEARTBEAT_S = 0.5
"""Seconds between a worker's heartbeats."""
GRACE_S = 10.0
"""On shutdown, seconds a worker's running requests may take before they are handed over."""
DRAIN_S = 30.0
"""On SIGINT/SIGTERM, seconds the HTTP face (``kvrelay serve``, ``kvrelay router``) lets running requests take;
then each ends with a ``shutting_down`` error that says how many of its tokens were delivered."""
PEER_HOST = "127.0.0.1"
"""The address a worker serves its ram and ssd chunks to peers on."""
SERVE_WORKER_ID = "local-0"
"""The id of ``kvrelay serve``'s one worker."""


def chunk_dir(worker_id: str) -> str:
    """A worker's local chunk directory (its ssd tier) when none is given: ``chunks/<worker id>`` under the data
    directory (read now, so ``$KVRELAY_DATA_DIR`` counts)."""
    return str(data_dir() / "chunks" / worker_id)
