"""Document-affinity routing for Ray Serve replicas (issue 18).

Round-robin or power-of-two routing spreads every hot document over every replica: each
computes and holds its own copy, which wastes the KV memory this project exists to save. Here
each document has an *owner* replica, picked by rendezvous (highest-random-weight) hashing of
the document's key with each replica's id: every router instance agrees without talking to
the others, and when a replica joins or leaves only the documents it owned move. Once a
document was sent to a replica, that replica *holds* it (its K/V is cached there) and the
document votes for it instead of its owner. A request goes to the replica that holds or owns
most of its documents, unless that replica's queue is longer than the
shortest by more than ``imbalanced_threshold`` requests (queue lengths from Serve's cache of
them; a replica missing from it, or full in it, is asked): then to the least loaded (as Ray Serve
LLM's ``PrefixCacheAffinityRouter`` falls back under imbalance). A replica that does not answer
the queue-length probe is never chosen; Ray Serve drops dead replicas from the candidates.

:func:`rank_replicas` is the policy as a pure function (tested without Ray);
:class:`DocumentAffinityRouter` is the Ray Serve ``RequestRouter`` around it, configured per
deployment through ``RequestRouterConfig``. The ingress passes the request's document keys as
the ``routing_keys`` keyword of the replica call.
"""

from __future__ import annotations

import random
from collections import OrderedDict

import xxhash
from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica


def owner(key: str, replica_ids: list[str]) -> str:
    """The replica of ``replica_ids`` that owns ``key``: the highest XXH64 of ``key`` and the id."""
    return max(replica_ids, key=lambda r: xxhash.xxh64_intdigest(f"{key}\x00{r}".encode()))


def rank_replicas(keys: list[str], queue_lens: dict[str, int | None], imbalanced_threshold: int,
                  holders: dict[str, str] | None = None) -> list[list[str]]:
    """The replicas to try, best first, for a request over documents ``keys``.

    Args:
        keys: the request's document keys (namespace and id).
        queue_lens: every candidate replica's queue length (``None``: it did not answer; never
            chosen).
        imbalanced_threshold: see the module docstring.
        holders: the replica each key was last sent to (it computed the K/V there); a key
            votes for its holder while that replica answers, else for its owner.
    Returns:
        ranks of replica ids: ``[[owner], [the others, least loaded first]]`` while the owner's
        queue is within the threshold of the shortest; ``[[all answering, least loaded first]]``
        otherwise, or when ``keys`` is empty; ``[]`` when no replica answered.
    """
    alive = sorted((r for r, q in queue_lens.items() if q is not None), key=lambda r: (queue_lens[r], r))
    if not alive:
        return []
    if not keys:
        return [alive]
    votes: dict[str, int] = {}
    for key in keys:
        held = (holders or {}).get(key)
        o = held if held is not None and queue_lens.get(held) is not None else owner(key, alive)
        votes[o] = votes.get(o, 0) + 1
    best = max(alive, key=lambda r: (votes.get(r, 0), -queue_lens[r], r))
    if queue_lens[best] - queue_lens[alive[0]] > imbalanced_threshold:
        return [alive]
    rest = [r for r in alive if r != best]
    return [[best], rest] if rest else [[best]]


def replicas_to_probe(cached: dict[str, int | None], max_ongoing: dict[str, int]) -> list[str]:
    """The replicas whose queue length must be asked for: those ``cached`` lacks (``None``) and
    those it lists as full (``max_ongoing``), which may have room again (as Serve's own router)."""
    return [r for r, q in cached.items() if q is None or q >= max_ongoing[r]]


class DocumentAffinityRouter(FIFOMixin, RequestRouter):
    """Ray Serve request router: :func:`rank_replicas` over the replicas' probed queue lengths.

    It remembers which replica it sent each document to (the last ``max_holders`` keys): a
    request whose documents went to several replicas before follows where most of them are
    cached, which keeps a document that rides along with others from being computed again on
    each owner of its companions.

    ``request_router_kwargs``: ``{"imbalanced_threshold": N}`` (default 8), ``"max_holders"``
    (default 1,000,000 keys).
    """

    def initialize_state(self, imbalanced_threshold: int = 8, max_holders: int = 1_000_000, **kwargs) -> None:
        self.imbalanced_threshold, self.max_holders = imbalanced_threshold, max_holders
        self.holders: OrderedDict[str, str] = OrderedDict()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        keys = list((pending_request.kwargs or {}).get("routing_keys") or ()) if pending_request is not None else []
        if not candidate_replicas:
            return []
        if not keys:  # nothing to be near: two random candidates, the shorter queue wins (Serve's default)
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        if len(candidate_replicas) == 1:  # nothing to choose: a full replica turns the request back itself
            return [candidate_replicas]
        queue_lens = await self._queue_lens(candidate_replicas)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        ranks = rank_replicas(keys, queue_lens, self.imbalanced_threshold, self.holders)
        return [[by_id[i] for i in rank] for rank in ranks]

    async def _queue_lens(self, replicas: list[RunningReplica]) -> dict[str, int | None]:
        """Each replica's queue length: Serve's cache of them (refreshed by every request sent
        and answered), probing (an RPC each) only the replicas it lacks or lists as full."""
        cache = self.replica_queue_len_cache
        lens = {r.replica_id.unique_id: cache.get(r.replica_id) for r in replicas}
        stale = replicas_to_probe(lens, {r.replica_id.unique_id: r.max_ongoing_requests for r in replicas})
        if stale:
            by_id = {r.replica_id.unique_id: r for r in replicas}
            for replica, queue_len in await self._probe_queue_lens([by_id[i] for i in stale], 0):
                lens[replica.replica_id.unique_id] = queue_len
        return lens

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        """The request's documents are now computed (or cached) on ``replica_id``."""
        for key in (pending_request.kwargs or {}).get("routing_keys") or ():
            self.holders[key] = replica_id.unique_id
            self.holders.move_to_end(key)
        while len(self.holders) > self.max_holders:
            self.holders.popitem(last=False)
