"""The Redis storage tier (engine/tiers/redis_store.py) against a real redis-server (tests/redis_server.py):
round trips and exact stats, only our prefix touched, TTL, two stores and two writers sharing a
server, and failures answered instead of raised: a server stopped, restarted, slow past the socket
timeout, or never there (issue 17)."""

import threading
import time

import pytest
import redis
import torch

from lazyattn_rag.engine.tiers.chunk_format import ChunkKV, decode_chunk, encode_chunk
from lazyattn_rag.engine.tiers.redis_store import RedisStore
from tests.redis_server import free_port

MODEL = "m" * 64
PREFIX = "lazyattn:chunk:"
FAST_S = 0.05  # an answer that did not wait on the network


def payload(key: str, num_tokens: int = 4) -> bytes:
    g = torch.Generator().manual_seed(len(key) + num_tokens)
    kv = torch.randn(2, num_tokens, 1, 4, generator=g)
    return encode_chunk(ChunkKV(key, MODEL, tuple(range(num_tokens)), 0, kv, kv + 1))


@pytest.fixture
def raw(redis_server):
    client = redis.Redis.from_url(redis_server.url, socket_timeout=5)
    yield client
    client.close()


def timed(call):
    start = time.perf_counter()
    result = call()
    return result, time.perf_counter() - start


def test_round_trip_miss_contains_keys_delete_discard_clear_and_exact_stats(redis_server, raw):
    store = RedisStore(redis_server.url)
    a, b = "a" * 64, "b" * 64
    pa, pb = payload(a), payload(b, 8)
    assert store.name == "redis" and store.capacity_bytes is None and store.available
    assert store.get(a) is None and a not in store and store.keys() == [] and store.num_bytes == 0
    assert store.put(a, pa) and store.put(b, pb)
    assert raw.get(PREFIX + a) == pa  # one whole value under the prefix
    assert a in store and store.get(a) == pa
    assert decode_chunk(store.get(b), b, MODEL).token_ids == tuple(range(8))
    assert store.keys() == [a, b] and store.num_bytes == len(pa) + len(pb)
    raw.set("foreign", b"x")
    raw.set("lazyattn:other", b"y")  # another prefix: not ours
    store.delete(a)
    assert a not in store and store.get(a) is None
    store.delete(a)  # deleting a missing key is fine
    assert store.put(a, pa)
    store.discard(b)  # the caller found it corrupt
    assert b not in store and store.keys() == [a]
    assert store.clear() == 1
    assert store.keys() == [] and raw.get("foreign") == b"x" and raw.get("lazyattn:other") == b"y"
    s = store.stats
    assert (s.num_hits, s.num_misses, s.num_puts, s.num_errors, s.num_outages) == (2, 2, 3, 1, 0)
    assert s.num_bytes_read == len(pa) + len(pb) and s.num_bytes_written == 2 * len(pa) + len(pb)
    assert store.available
    store.close()
    store.close()
    assert not store.available and store.get(a) is None and not store.put(a, pa)


def test_a_prefix_with_glob_characters_matches_only_itself(redis_server, raw):
    store = RedisStore(redis_server.url, key_prefix="t*[x]:")
    raw.set("tX[x]:k", b"1")  # matched by the unescaped pattern t*[x]:*
    raw.set("t*x:k", b"2")
    assert store.put("k", b"3") and store.keys() == ["k"] and store.num_bytes == 1
    assert store.clear() == 1 and raw.get("tX[x]:k") == b"1" and raw.get("t*x:k") == b"2"


def test_a_write_the_server_refuses_is_an_error_not_an_outage(redis_server, raw):
    store = RedisStore(redis_server.url)
    raw.config_set("maxmemory-policy", "noeviction")
    raw.config_set("maxmemory", 1)  # full: every write is refused with OOM
    assert not store.put("k", b"x" * 1000)
    assert store.available and store.stats.num_errors == 1 and store.stats.num_outages == 0
    assert store.get("k") is None  # reads still served
    raw.config_set("maxmemory", 0)
    assert store.put("k", b"x") and store.get("k") == b"x"


def test_with_a_ttl_values_expire(redis_server, raw):
    store = RedisStore(redis_server.url, ttl_seconds=1)
    forever = RedisStore(redis_server.url, key_prefix="forever:")
    assert store.put("k", b"x") and forever.put("k", b"x")
    assert 0 < raw.pttl(PREFIX + "k") <= 1000 and raw.ttl("forever:k") == -1  # -1: no expiry
    deadline = time.monotonic() + 3
    while "k" in store and time.monotonic() < deadline:
        time.sleep(0.05)
    assert store.get("k") is None and forever.get("k") == b"x"
    with pytest.raises(ValueError, match="ttl_seconds"):
        RedisStore(redis_server.url, ttl_seconds=0)


def test_two_stores_share_a_server_and_two_writers_of_one_key_leave_one_whole_value(redis_server, raw):
    first, second = RedisStore(redis_server.url), RedisStore(redis_server.url)  # as two processes would
    key = "s" * 64
    data = payload(key)  # (encode_chunk's bytes vary between calls: safetensors orders the metadata freely)
    assert first.put(key, data) and second.get(key) == data
    values = [bytes([c]) * (1 << 20) for c in b"ab"]  # 1 MiB each: written in many socket sends
    errors = []

    def write(store, value):
        try:
            for _ in range(10):
                assert store.put(key, value)
        except AssertionError as e:
            errors.append(e)

    writers = [threading.Thread(target=write, args=(s, v)) for s, v in zip((first, second), values)]
    for w in writers:
        w.start()
    for w in writers:
        w.join(30)
    assert not errors and not any(w.is_alive() for w in writers)
    assert raw.get(PREFIX + key) in values and first.get(key) == second.get(key)


def test_one_store_is_safe_to_share_between_threads(redis_server):
    store = RedisStore(redis_server.url)

    def work(i):
        for j in range(25):
            assert store.put(f"k{i}-{j}", b"v" * 10) and store.get(f"k{i}-{j}") == b"v" * 10

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    s = store.stats
    assert (s.num_puts, s.num_hits, s.num_errors) == (100, 100, 0) and s.num_bytes_written == 1000
    assert len(store.keys()) == 100


def test_a_stopped_server_is_one_outage_answered_at_once_until_it_returns(redis_server):
    store = RedisStore(redis_server.url, retry_after_s=0.2, socket_timeout_s=0.5)
    key, data = "o" * 64, b"data"
    assert store.put(key, data)
    redis_server.stop()
    assert store.get(key) is None  # no exception
    assert not store.available and store.stats.num_outages == 1 and store.stats.num_errors == 1
    for _ in range(5):  # within retry_after_s: no network, no waiting
        for call in (lambda: store.get(key), lambda: store.put(key, data), lambda: key in store,
                     store.keys, store.clear, lambda: store.num_bytes, lambda: store.delete(key)):
            result, elapsed_s = timed(call)
            assert not result and elapsed_s < FAST_S
    assert store.stats.num_errors == 1  # answered without trying: no new failures
    time.sleep(0.25)
    assert store.get(key) is None  # tried again, still down: one more error, the same outage
    assert store.stats.num_outages == 1 and store.stats.num_errors == 2
    redis_server.start()  # same port, empty (nothing saved)
    time.sleep(0.25)
    assert store.get(key) is None and store.available  # answered: a plain miss
    assert store.put(key, data) and store.get(key) == data
    assert store.stats.num_outages == 1 and store.stats.num_errors == 2


def test_a_server_restarted_between_calls_is_no_outage(redis_server):
    store = RedisStore(redis_server.url)
    assert store.put("k", b"x") and store.get("k") == b"x"  # a pooled connection to the old server
    redis_server.stop()
    redis_server.start()
    assert store.get("k") is None and store.put("k", b"y") and store.get("k") == b"y"  # redis-py reconnected
    assert store.available and store.stats.num_outages == 0 and store.stats.num_errors == 0


def test_a_slow_server_costs_one_timeout_and_marks_the_tier_unavailable(redis_server, raw):
    store = RedisStore(redis_server.url, socket_timeout_s=0.2, retry_after_s=0.3)
    key, data = "w" * 64, b"data"
    assert store.put(key, data)
    raw.execute_command("CLIENT", "PAUSE", 1000)  # every client's commands wait 1 s (UNPAUSE too)
    result, elapsed_s = timed(lambda: store.get(key))
    assert result is None and 0.15 < elapsed_s < 0.6  # about socket_timeout_s
    assert not store.available and store.stats.num_outages == 1
    for call in (lambda: store.get(key), lambda: store.put(key, data)):  # the server is still slow
        result, elapsed_s = timed(call)
        assert not result and elapsed_s < FAST_S
    assert raw.ping()  # waits out the pause
    time.sleep(0.35)
    assert store.get(key) == data and store.available and store.stats.num_outages == 1


def test_a_server_that_is_not_there_at_construction_is_an_outage_not_an_exception():
    port = free_port()  # nobody listens here
    store, elapsed_s = timed(lambda: RedisStore(f"redis://127.0.0.1:{port}/0", socket_timeout_s=0.2, retry_after_s=60))
    assert elapsed_s < 1 and not store.available and store.stats.num_outages == 1
    assert store.get("k") is None and not store.put("k", b"x") and "k" not in store
    assert store.keys() == [] and store.clear() == 0 and store.num_bytes == 0
    assert store.stats.num_misses == 1 and store.stats.num_errors == 1
    store.close()


def test_bad_arguments_are_refused():
    for kwargs, match in (({"socket_timeout_s": 0}, "socket_timeout_s"), ({"retry_after_s": -1}, "retry_after_s"),
                          ({"key_prefix": ""}, "key_prefix")):
        with pytest.raises(ValueError, match=match):
            RedisStore("redis://127.0.0.1:1/0", **kwargs)
    with pytest.raises(ValueError):
        RedisStore("http://127.0.0.1:1/0")
