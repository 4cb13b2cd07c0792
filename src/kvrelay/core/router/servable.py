"""Whether some worker can ever serve a request whose planning found no route, or the error that ends it.

Pure, over ``RouterState``; ``router.attempts`` ends the request with the error or holds it in the router queue.
"""

from __future__ import annotations

from kvrelay.core.planning import candidates as cand
from kvrelay.core.planning import predicted_ttft
from kvrelay.core.planning.exclusions import ExclusionKind
from kvrelay.core.router.events import ErrorKind, RequestError
from kvrelay.core.router.state import RequestState, RouterState


def unservable(
    state: RouterState, rs: RequestState, plan: cand.Plan, prompt_len: int, remaining: int, now: float
) -> RequestError | None:
    """The error that ends a request no worker can ever serve (model not served, over every context limit, more
    KV than any worker holds); None when it may wait, after forgetting exclusions that would keep it waiting for
    nothing (``rs.excluded_workers``, ``rs.excluded_pairs``). Called when planning found no route.

    A new request for a model no live worker serves ends at once; one that was offered before waits, since the
    worker that served it may come back (a new epoch, a restart), at most ``no_worker_wait_s``."""
    model = rs.request.model
    serving = [w for w, v in state.views.items() if model in v.heartbeat.models]
    if not serving and rs.attempt == 0:
        served = sorted({m for v in state.views.values() for m in v.heartbeat.models})
        return RequestError(
            ErrorKind.NO_WORKER, f"model '{model}' is not served; served models: {', '.join(served) or 'none'}"
        )
    if not serving:
        # A request some worker took before waits in the router queue for a server of its model to come back (a
        # worker back in a new epoch after its old one was fenced, a restarted worker), for no_worker_wait_s.
        if rs.queued_since is not None and now - rs.queued_since > state.config.no_worker_wait_s:
            return RequestError(
                ErrorKind.NO_WORKER,
                f"waited {now - rs.queued_since:.1f} s for a worker serving model '{model}' to come back; none did",
            )
        rs.excluded_workers.clear()  # the worker that comes back may be the one this request lost
        rs.excluded_pairs.clear()
        return None
    if _all_excluded(plan, serving, ExclusionKind.CONTEXT_LIMIT):
        return RequestError(ErrorKind.OVER_CONTEXT_LIMIT, plan.excluded[serving[0]].text)
    fitting = [state.views[w].heartbeat for w in serving if not _excluded_for(plan, w, ExclusionKind.CONTEXT_LIMIT)]
    largest = max(fitting, key=lambda hb: hb.pages_total * hb.page_tokens)
    tokens = prompt_len + remaining
    if not any(predicted_ttft.pages_needed(tokens, hb.page_tokens) <= hb.pages_total for hb in fitting):
        most = largest.pages_total * largest.page_tokens
        return RequestError(
            ErrorKind.NO_CAPACITY,
            f"the prompt ({prompt_len} tokens) and {remaining} tokens to generate need KV for {tokens} tokens; "
            f"the largest worker serving '{model}' holds {most} when idle: ask for at most "
            f"{max(0, most - prompt_len)} tokens or send a shorter prompt",
        )
    if _all_excluded(plan, serving, ExclusionKind.FAILED_BEFORE):
        # Every server of the model failed this request once: forget the exclusions
        # and wait for fresh heartbeats rather than fail while attempts remain.
        rs.excluded_workers.clear()
        rs.excluded_pairs.clear()
    return None


def _all_excluded(plan: cand.Plan, workers: list[str], kind: ExclusionKind) -> bool:
    """Whether planning excluded every one of ``workers`` for ``kind``."""
    return all(_excluded_for(plan, w, kind) for w in workers)


def _excluded_for(plan: cand.Plan, worker_id: str, kind: ExclusionKind) -> bool:
    return (e := plan.excluded.get(worker_id)) is not None and e.kind is kind
