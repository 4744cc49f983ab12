"""The document-affinity routing policy (lazyattn_rag/serve/router.py) as a pure function: owners by
rendezvous hashing, the least-loaded fallback past the imbalance threshold, replicas that did not
answer never chosen, and few documents moving when a replica joins."""

from __future__ import annotations

import pytest

pytest.importorskip("ray.serve")

from lazyattn_rag.serve.router import owner, rank_replicas, replicas_to_probe  # noqa: E402

KEYS = [f"\x00doc{i}" for i in range(1000)]


def test_each_document_has_one_owner_that_does_not_depend_on_the_replicas_order():
    replicas = ["a", "b", "c"]
    owners = {k: owner(k, replicas) for k in KEYS}
    assert owners == {k: owner(k, list(reversed(replicas))) for k in KEYS}
    counts = {r: list(owners.values()).count(r) for r in replicas}
    assert all(280 <= n <= 390 for n in counts.values()), counts  # about a third each


def test_a_replica_joining_takes_documents_only_from_the_others_and_about_its_share():
    before = {k: owner(k, ["a", "b", "c"]) for k in KEYS}
    after = {k: owner(k, ["a", "b", "c", "d"]) for k in KEYS}
    moved = [k for k in KEYS if before[k] != after[k]]
    assert all(after[k] == "d" for k in moved) and 200 <= len(moved) <= 300


def test_the_owner_of_most_documents_ranks_first_the_rest_least_loaded_first():
    queue = {"a": 0, "b": 3, "c": 1}
    keys = [k for k in KEYS if owner(k, list(queue)) == "b"][:3] + [next(k for k in KEYS if owner(k, list(queue)) == "a")]
    assert rank_replicas(keys, queue, imbalanced_threshold=3) == [["b"], ["a", "c"]]


def test_past_the_threshold_the_least_loaded_takes_it():
    queue = {"a": 0, "b": 4, "c": 1}
    keys = [k for k in KEYS if owner(k, list(queue)) == "b"][:2]
    assert rank_replicas(keys, queue, imbalanced_threshold=3) == [["a", "c", "b"]]
    assert rank_replicas(keys, queue, imbalanced_threshold=4) == [["b"], ["a", "c"]]


def test_replicas_that_did_not_answer_are_never_chosen_and_none_left_means_no_rank():
    queue = {"a": None, "b": 2, "c": None}
    assert rank_replicas(KEYS[:5], queue, imbalanced_threshold=0) == [["b"]]
    assert rank_replicas(KEYS[:5], {"a": None}, imbalanced_threshold=0) == []


def test_a_request_without_documents_goes_to_the_least_loaded():
    assert rank_replicas([], {"a": 2, "b": 0, "c": 1}, imbalanced_threshold=8) == [["b", "c", "a"]]


def test_a_document_votes_for_the_replica_holding_it_while_that_replica_answers():
    queue = {"a": 0, "b": 0}
    owned_by_a = [k for k in KEYS if owner(k, list(queue)) == "a"][:3]
    assert rank_replicas(owned_by_a, queue, 8, holders={}) == [["a"], ["b"]]
    held = {k: "b" for k in owned_by_a[:2]}  # two of the three were computed on b
    assert rank_replicas(owned_by_a, queue, 8, holders=held) == [["b"], ["a"]]
    assert rank_replicas(owned_by_a, {"a": 0, "b": None}, 8, holders=held) == [["a"]]  # b gone: owners again


def test_only_replicas_missing_from_the_queue_cache_or_full_in_it_are_probed():
    cached = {"a": 3, "b": None, "c": 8, "d": 0}
    assert replicas_to_probe(cached, {"a": 8, "b": 8, "c": 8, "d": 8}) == ["b", "c"]
    assert replicas_to_probe({"a": 3}, {"a": 4}) == []
