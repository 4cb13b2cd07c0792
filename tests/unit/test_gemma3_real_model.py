"""The real Gemma 3 270M (the default GGUF) over paged KV continues a prompt exactly as transformers does.

Float32, greedy, 32 new tokens after "The capital of France is", decoded one
token per step from pages; transformers reads the same weights from the
loader's Hugging Face cache directory.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvrelay.models.batch import ForwardBatch
from kvrelay.models.kernels.kv_pages import KVPages
from kvrelay.models.loading.loader import LoadedArtifacts, load_artifacts
from kvrelay.models.registry import build_model
from kvrelay.models.sampling import sample_next
from kvrelay.protocol.messages import Sampling

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPT = "The capital of France is"
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def artifacts() -> Iterator[LoadedArtifacts]:
    yield load_artifacts(None, torch.float32)


def test_greedy_continuation_and_prefill_logits_equal_transformers(artifacts: LoadedArtifacts) -> None:
    prompt = artifacts.tokenizer(PROMPT).input_ids
    model = build_model(artifacts.config, artifacts.weights)
    kv = KVPages.allocate(artifacts.config, 4, 16)
    table = [0, 1, 2]
    logits = model.forward(ForwardBatch.build([(prompt, 0, table)], logits="all"), kv)
    reference = AutoModelForCausalLM.from_pretrained(artifacts.model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected_logits = reference(torch.tensor([prompt])).logits[0]
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
    scale = float(expected_logits.abs().max())
    assert float((logits - expected_logits).abs().max()) < 1e-4 * scale

    tokens: list[int] = []
    position = len(prompt)
    step_logits = logits[-1:]
    for _ in range(NEW_TOKENS):
        tokens.append(sample_next(step_logits, [Sampling()], [position])[0])
        step_logits = model.forward(ForwardBatch.build([([tokens[-1]], position, table)]), kv)
        position += 1
    assert tokens == expected[0, len(prompt) :].tolist()
