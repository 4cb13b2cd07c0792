"""Large CPU tensors of the runtime are advised onto 2 MiB transparent huge pages; small ones are plain.

Whether the kernel then grants huge pages depends on its settings and on free
memory, so the tests check what this code controls: the 2 MiB alignment and the
``MADV_HUGEPAGE`` advice on the range (``hg`` in the mapping's ``VmFlags``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kvrelay.models.config import ModelConfig
from kvrelay.models.kernels.huge_pages import HUGE_PAGE, copy_to_huge_pages, huge_page_empty, huge_page_zeros
from kvrelay.models.kernels.kv_pages import KVPages
from kvrelay.models.loading.loader import load_artifacts
from kvrelay.testing.tiny_models import make_tiny_model
from tests.support.bench_smoke import run_bench

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="madvise(MADV_HUGEPAGE) is Linux's")


def vm_flags(address: int) -> set[str]:
    """The ``VmFlags`` of the mapping of this process that holds ``address``."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(part, 16) for part in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


def advised(tensor: torch.Tensor) -> bool:
    start = tensor.data_ptr()
    return start % HUGE_PAGE == 0 and all("hg" in vm_flags(a) for a in (start, start + tensor.nbytes - 1))


@linux_only
def test_a_large_tensor_is_aligned_and_advised_over_its_whole_range() -> None:
    t = huge_page_empty((3, 1024, 1024), torch.float32)
    assert t.shape == (3, 1024, 1024) and t.dtype == torch.float32 and t.is_contiguous()
    assert advised(t)
    t.fill_(1.5)
    assert float(t.sum()) == 1.5 * t.numel()


def test_a_small_tensor_is_plain() -> None:
    t = huge_page_empty((7, 5), torch.bfloat16)
    assert t.shape == (7, 5) and t.dtype == torch.bfloat16
    assert t.untyped_storage().nbytes() == t.nbytes


def test_turned_off_every_tensor_is_plain(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVRELAY_HUGE_PAGES", "0")
    t = huge_page_zeros((4, 1024, 1024), torch.bfloat16, "cpu")
    assert t.untyped_storage().nbytes() == t.nbytes
    assert not bool(t.any())


@linux_only
def test_zeros_are_zero_and_advised() -> None:
    t = huge_page_zeros((2, 1024, 1024), torch.bfloat16, "cpu")
    assert advised(t) and not bool(t.any())


@linux_only
def test_a_copy_converts_and_keeps_every_value() -> None:
    source = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(5))
    copy = copy_to_huge_pages(source, torch.bfloat16)
    assert advised(copy)
    assert torch.equal(copy, source.to(torch.bfloat16))


def test_a_copy_takes_only_cpu_tensors() -> None:
    with pytest.raises(ValueError, match="takes CPU tensors; got one on meta"):
        copy_to_huge_pages(torch.empty(4, device="meta"), torch.float32)


@linux_only
def test_the_page_pool_is_advised() -> None:
    config = ModelConfig.from_hf(
        {
            "model_type": "llama",
            "vocab_size": 64,
            "hidden_size": 64,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
        }
    )
    pool = KVPages.allocate(config, num_pages=512, page_tokens=16, dtype=torch.bfloat16)
    assert advised(pool.k) and advised(pool.v)
    assert not bool(pool.k.any())


@linux_only
def test_weights_converted_at_load_are_advised_and_unchanged(tmp_path: Path) -> None:
    # One layer with a 17,000-wide MLP: each MLP matrix is just over 2 MiB in bfloat16.
    directory = make_tiny_model("llama", tmp_path / "wide", seed=3, num_hidden_layers=1, intermediate_size=17000)
    full = load_artifacts(directory, dtype=torch.float32, cache_dir=tmp_path / "cache")
    half = load_artifacts(directory, dtype=torch.bfloat16, cache_dir=tmp_path / "cache")
    large = [name for name, t in half.weights.items() if t.nbytes >= HUGE_PAGE]
    assert sorted(large) == [f"model.layers.0.mlp.{p}_proj.weight" for p in ("down", "gate", "up")]
    for name in large:
        assert advised(half.weights[name]), name
    for name, tensor in half.weights.items():
        assert torch.equal(tensor, full.weights[name].to(torch.bfloat16)), name


def test_huge_pages_bench_smoke(tmp_path: Path) -> None:
    """bench/huge_pages.py runs on a small head and writes every figure (values not asserted)."""
    args = ["--vocab", "8192", "--repeats", "1", "--threads", "1", "--evict-mib", "1"]
    code, figures = run_bench("huge_pages.py", args, tmp_path / "figures.json")
    assert code == 0
    assert {f["name"] for f in figures} >= {"lm_head_row_median_ms", "huge_pages_granted_mib"}
    assert all(set(f) == {"name", "value", "unit", "baseline", "baseline_value"} for f in figures)
