"""The residency index follows store / remove events, stays within its key bound, and drops epochs."""

from __future__ import annotations

import itertools
import random

import pytest

from kvrelay.core.planning.index import GPU, OBJECT, RAM, SSD, TIER_BITS, ResidencyIndex


def keys(n: int, tag: bytes = b"k") -> list[bytes]:
    return [tag + i.to_bytes(15, "little") for i in range(n)]


def test_store_remove_and_lookup_per_worker_and_tier() -> None:
    ix = ResidencyIndex()
    ks = keys(4)
    ix.store("a", "gpu", ks[:3])
    ix.store("b", "ram", ks[:2])
    ix.store("b", "object", ks)
    values = ix.lookup(ks)
    assert len(values) == 4
    assert [ix.tiers_of(v, "a") for v in values] == [GPU, GPU, GPU, 0]
    assert [ix.tiers_of(v, "b") for v in values] == [RAM, RAM, 0, 0]
    assert all(v & OBJECT for v in values)
    ix.remove("a", "gpu", ks[1:2])
    assert ix.tiers_of(ix.lookup(ks)[1], "a") == 0
    assert ix.holders(ix.lookup(ks)[0]) == [("a", GPU), ("b", RAM)]


def test_lookup_stops_at_the_first_key_nobody_holds() -> None:
    ix = ResidencyIndex()
    ks = keys(5)
    ix.store("a", "ssd", ks[:2] + ks[3:])
    assert len(ix.lookup(ks)) == 2
    assert ix.tiers_of(ix.lookup(ks)[0], "a") == SSD


def test_bound_forgets_the_least_recently_stored_keys() -> None:
    ix = ResidencyIndex(max_keys=3)
    ks = keys(5)
    ix.store("a", "gpu", ks[:3])
    ix.store("a", "gpu", ks[0:1])  # refresh k0
    ix.store("a", "gpu", ks[3:5])
    assert len(ix) == 3 and ix.forgotten == 2
    assert ix.lookup([ks[1]]) == [] and ix.lookup([ks[2]]) == []
    assert len(ix.lookup([ks[0]])) == 1 and len(ix.lookup(ks[3:])) == 2


def test_drop_worker_forgets_only_that_worker() -> None:
    ix = ResidencyIndex()
    ks = keys(3)
    ix.store("a", "gpu", ks)
    ix.store("b", "gpu", ks[:1])
    assert ix.drop_worker("a") == 3
    assert len(ix) == 1 and ix.tiers_of(ix.lookup(ks)[0], "b") == GPU
    assert ix.tiers_of(ix.lookup(ks)[0], "a") == 0


@pytest.mark.parametrize("seed", range(20))
def test_random_events_match_a_plain_model(seed: int) -> None:
    print(f"seed {seed}")
    rng = random.Random(seed)
    ix = ResidencyIndex(max_keys=rng.choice([40, 1000]))
    model: dict[bytes, int] = {}  # key -> packed value, in LRU order of stores
    pool = keys(60) + [b"short" + bytes([i]) for i in range(5)]
    workers = [f"w{i}" for i in range(rng.randrange(1, 20))]
    for _ in range(300):
        op = rng.random()
        w = rng.choice(workers)
        shift = 4 * (ix.slot(w) + 1)
        tier = rng.choice(["gpu", "ram", "ssd", "object"])
        bit = TIER_BITS[tier] << (0 if tier == "object" else shift)
        batch = rng.sample(pool, rng.randrange(1, 12))
        if op < 0.55:
            ix.store(w, tier, batch)
            for k in dict.fromkeys(batch):
                model[k] = model.pop(k, 0) | bit
            while len(model) > ix.max_keys:
                model.pop(next(iter(model)))
        elif op < 0.9:
            ix.remove(w, tier, batch)
            for k in batch:
                if k in model:
                    model[k] &= ~bit
                    if not model[k]:
                        del model[k]
        else:
            ix.drop_worker(w)
            for k in list(model):
                model[k] &= ~(0xF << shift)
                if not model[k]:
                    del model[k]
        chain = rng.sample(pool, rng.randrange(0, 20))
        expected = []
        for k in chain:
            if k not in model:
                break
            expected.append(model[k])
        assert ix.lookup(chain) == expected
        assert ix.runs(chain) == [(v, len(list(g))) for v, g in itertools.groupby(expected)]
        assert len(ix) == len(model)
        local, shared = ix.holdings()
        for wx, slot in ix.slots.items():
            for t in ("gpu", "ram", "ssd"):
                want = sorted(k for k, v in model.items() if (v >> (4 * (slot + 1))) & TIER_BITS[t])
                assert ix.keys_of(wx, t) == want
                assert sorted(local[wx][t]) == want
        assert sorted(shared) == sorted(k for k, v in model.items() if v & OBJECT)


def test_equal_values_are_one_object_and_runs_count_them() -> None:
    ix = ResidencyIndex()
    ks = keys(6)
    ix.store("a", "gpu", ks[:2])
    ix.store("a", "gpu", ks[2:4])  # another event, the same resulting value
    ix.store("b", "ram", ks[3:5])
    values = ix.lookup(ks)
    assert values[0] is values[1] is values[2] and values[3] is not values[2]
    assert ix.runs(ks) == [(values[0], 3), (values[3], 1), (values[4], 1)]
    ix.remove("b", "ram", ks[3:4])  # k3 goes back to gpu of a alone: the shared value again
    assert ix.lookup(ks)[3] is values[0] and ix.runs(ks)[0] == (values[0], 4)
