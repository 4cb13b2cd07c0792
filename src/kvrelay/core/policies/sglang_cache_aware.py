"""sgl-router's ``cache_aware`` policy (sglang-router 0.3.2): an approximate prefix tree of what it routed.

This is the older variant; its successor, SGLang Model Gateway (smg), sends a
request below the cache threshold to the least-loaded worker instead of the one
with the smallest tree and has a KV-event mode (``smg_cache_aware``).

Source followed (read, not copied):

- sgl-project/sglang ``sgl-router/src/policies/cache_aware.rs`` (``select_worker``):
  loads are the router's own in-flight request counts per worker; the system is
  imbalanced when ``max - min > balance_abs_threshold`` AND
  ``max > min * balance_rel_threshold``; then the least-loaded worker wins.
  Otherwise the longest prefix match in the tree decides: when
  ``matched / len(text) > cache_threshold`` the matching worker wins, else the
  worker with the smallest tree. Either way the request is inserted into the
  tree under the chosen worker at selection time.
- sgl-project/sglang ``sgl-router/src/policies/tree.rs``: one multi-tenant
  radix tree; each node records, per tenant (worker), the time it was last
  inserted; per-tenant size counts the characters of the nodes it holds;
  ``evict_tenant_by_size(max_size)`` runs every ``eviction_interval_secs`` and
  removes, per tenant over ``max_size``, least-recently-used leaves first;
  ``get_smallest_tenant`` is the tenant with the smallest size.
- sgl-project/sglang ``sgl-router/py_src/sglang_router/router_args.py``
  (commit 083d6013, ``RouterArgs`` lines 30-34): the defaults.

Defaults: ``cache_threshold`` 0.3, ``balance_abs_threshold`` 64,
``balance_rel_threshold`` 1.5, ``eviction_interval_s`` 120, ``max_tree_size``
2**26 (per worker).

Adaptations, each keeping what the real router sees: the tree holds token ids
(the real one holds raw text characters); time is the router's logical clock;
only eligible workers are considered (the real router filters healthy
workers); ties (equal match, equal tree size) are drawn with the seeded
``ctx.rng`` (the real one takes the first entry of a hash map); a worker seen
with a new epoch is removed from the tree (the real router removes a worker
that left and re-adds it). It never reads residency: it knows only what it
routed. The chosen worker is offered its cheapest route (``route.best``), as
for every policy, so the comparison is of worker selection alone.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

from kvrelay.core.planning.candidates import WorkerRoute
from kvrelay.core.planning.predicted_ttft import Candidate
from kvrelay.core.policies.base import Policy, RoutingContext


class _Node:
    __slots__ = ("children", "key", "parent", "tenants")

    def __init__(self, key: tuple[int, ...], parent: _Node | None) -> None:
        self.key = key
        self.children: dict[int, _Node] = {}
        self.tenants: dict[str, float] = {}
        """Tenant -> time of its last insert through this node."""
        self.parent = parent


def _shared_length(key: tuple[int, ...], tokens: Sequence[int], start: int) -> int:
    """How many leading tokens of ``key`` equal ``tokens[start:]``."""
    end = start + len(key)
    if tokens[start:end] == key:
        return len(key)
    n = 0
    for a, b in zip(key, tokens[start:end]):
        if a != b:
            break
        n += 1
    return n


class ApproximateTree:
    """A multi-tenant radix tree over token ids (SGLang router ``tree.rs``).

    Invariants: a tenant present on a node is present on all its ancestors;
    ``size(t)`` is the sum of key lengths of the nodes holding ``t``.
    """

    def __init__(self) -> None:
        self.root = _Node((), None)
        self.sizes: dict[str, int] = {}

    def size(self, tenant: str) -> int:
        return self.sizes.get(tenant, 0)

    def insert(self, tokens: Sequence[int], tenant: str, now: float) -> None:
        """Record that ``tokens`` was routed to ``tenant`` at ``now``."""
        tokens = tuple(tokens)
        node = self.root
        node.tenants[tenant] = now
        self.sizes.setdefault(tenant, 0)
        i, n = 0, len(tokens)
        while i < n:
            child = node.children.get(tokens[i])
            if child is None:
                leaf = _Node(tokens[i:], node)
                leaf.tenants[tenant] = now
                node.children[tokens[i]] = leaf
                self.sizes[tenant] += n - i
                return
            m = _shared_length(child.key, tokens, i)
            if m < len(child.key):
                upper = _Node(child.key[:m], node)
                upper.tenants = dict(child.tenants)
                child.key = child.key[m:]
                child.parent = upper
                upper.children[child.key[0]] = child
                node.children[tokens[i]] = upper
                child = upper
            if tenant not in child.tenants:
                self.sizes[tenant] += len(child.key)
            child.tenants[tenant] = now
            node = child
            i += len(child.key)

    def match(self, tokens: Sequence[int]) -> dict[str, int]:
        """Per tenant, the length of the longest prefix of ``tokens`` it holds (absent: 0)."""
        node, i, n = self.root, 0, len(tokens)
        matched: dict[str, int] = {}
        while i < n:
            child = node.children.get(tokens[i])
            if child is None:
                break
            m = _shared_length(child.key, tokens, i)
            for tenant in child.tenants:
                matched[tenant] = i + m
            if m < len(child.key):
                break
            node, i = child, i + m
        return matched

    def deepest_tenant(self, tokens: Sequence[int]) -> tuple[int, str | None]:
        """The longest prefix of ``tokens`` in the tree, and the tenant that inserted last at its deepest node
        (the node the match ends in, partly matched or not); ``(0, None)`` when nothing matches."""
        node, i, n = self.root, 0, len(tokens)
        deepest: _Node | None = None
        while i < n:
            child = node.children.get(tokens[i])
            if child is None:
                break
            m = _shared_length(child.key, tokens, i)
            deepest, i = child, i + m
            if m < len(child.key):
                break
            node = child
        if deepest is None or not deepest.tenants:
            return 0, None
        return i, max(deepest.tenants.items(), key=lambda kv: (kv[1], kv[0]))[0]

    def evict(self, max_size: int) -> None:
        """Remove least-recently-used leaves of every tenant larger than ``max_size`` until it fits."""
        order = itertools.count()
        heap: list[tuple[float, int, str, _Node]] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node is self.root:
                continue
            for tenant in self._leaf_tenants(node):
                if self.sizes.get(tenant, 0) > max_size:
                    heap.append((node.tenants[tenant], next(order), tenant, node))
        heapq.heapify(heap)
        while heap:
            _, _, tenant, node = heapq.heappop(heap)
            if self.sizes.get(tenant, 0) <= max_size or tenant not in node.tenants:
                continue
            parent = self._drop(node, tenant)
            if parent is not None and parent is not self.root and tenant in self._leaf_tenants(parent):
                heapq.heappush(heap, (parent.tenants[tenant], next(order), tenant, parent))

    def remove_tenant(self, tenant: str) -> None:
        """Forget everything routed to ``tenant``."""
        stack = [self.root]
        nodes: list[_Node] = []
        while stack:
            node = stack.pop()
            if tenant in node.tenants:
                nodes.append(node)
                stack.extend(node.children.values())
        for node in reversed(nodes):
            if node is self.root:
                node.tenants.pop(tenant, None)
            else:
                self._drop(node, tenant)
        self.sizes.pop(tenant, None)

    @staticmethod
    def _leaf_tenants(node: _Node) -> set[str]:
        """Tenants for which ``node`` is a leaf (no child holds them)."""
        below: set[str] = set()
        for child in node.children.values():
            below.update(child.tenants)
        return set(node.tenants) - below

    def _drop(self, node: _Node, tenant: str) -> _Node | None:
        """Remove ``tenant`` from ``node`` (pruning it when empty); return its parent."""
        del node.tenants[tenant]
        self.sizes[tenant] = max(0, self.sizes.get(tenant, 0) - len(node.key))
        parent = node.parent
        if parent is not None and not node.tenants and not node.children:
            del parent.children[node.key[0]]
        return parent


class SGLangCacheAware(Policy):
    name = "sglang_cache_aware"

    def __init__(
        self,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        eviction_interval_s: float = 120.0,
        max_tree_size: int = 2**26,
    ) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.eviction_interval_s = eviction_interval_s
        self.max_tree_size = max_tree_size
        self.tree = ApproximateTree()
        self._epochs: dict[str, int] = {}
        self._last_eviction: float | None = None

    def choose(self, ctx: RoutingContext) -> Candidate | None:
        routes = sorted(ctx.routes, key=lambda r: r.worker_id)
        if not routes:
            return None
        self._forget_restarted(ctx, routes)
        loads = {r.worker_id: ctx.workers[r.worker_id].load.active for r in routes}
        high, low = max(loads.values()), min(loads.values())
        if high - low > self.balance_abs_threshold and high > low * self.balance_rel_threshold:
            return min(routes, key=lambda r: (loads[r.worker_id], r.worker_id)).best
        by_id = {r.worker_id: r for r in routes}
        matched = {w: n for w, n in self.tree.match(ctx.prompt).items() if w in by_id}
        best_len = max(matched.values(), default=0)
        if ctx.prompt and best_len / len(ctx.prompt) > self.cache_threshold:
            tied = sorted(w for w, n in matched.items() if n == best_len)
        else:
            smallest = min(self.tree.size(w) for w in by_id)
            tied = [w for w in by_id if self.tree.size(w) == smallest]
        return self._pick(ctx, tied, by_id).best

    def on_routed(self, ctx: RoutingContext, chosen: Candidate) -> None:
        self.tree.insert(ctx.prompt, chosen.worker_id, ctx.now)
        if self._last_eviction is None:
            self._last_eviction = ctx.now
        elif ctx.now - self._last_eviction >= self.eviction_interval_s:
            self.tree.evict(self.max_tree_size)
            self._last_eviction = ctx.now

    def _forget_restarted(self, ctx: RoutingContext, routes: list[WorkerRoute]) -> None:
        for r in routes:
            epoch = ctx.workers[r.worker_id].heartbeat.epoch
            known = self._epochs.get(r.worker_id)
            if known is not None and known != epoch:
                self.tree.remove_tenant(r.worker_id)
            self._epochs[r.worker_id] = epoch

    @staticmethod
    def _pick(ctx: RoutingContext, tied: list[str], by_id: dict[str, WorkerRoute]) -> WorkerRoute:
        return by_id[tied[0] if len(tied) == 1 else ctx.rng.choice(tied)]
