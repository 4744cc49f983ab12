"""The server's document registry (issue 36): SQLite and Redis stores shared by ingress replicas, the
memory mirror that catches up with them, and the ingress's matching of registered texts in plain
messages (no Ray: the functions the ingress calls)."""

from __future__ import annotations

import pytest

from lazyattn_rag.serve.config import ServeConfig
from lazyattn_rag.serve.http_errors import ApiError
from lazyattn_rag.serve.payload import chat_payload, match_messages
from lazyattn_rag.serve.protocol import ChatCompletionRequest
from lazyattn_rag.serve.registry import (DocumentStore, RedisRegistry, RegistryUnavailable, SqliteRegistry,
                                        open_registry)
from lazyattn_rag.types.config import CacheConfig, EngineConfig

A = "Alpha is the first document, long enough to be matched in a prompt."
B = "Beta is the second document, also long enough to be matched anywhere."


def exercise(make_store):
    """Two ingresses over one store: what one registers or deletes, the other sees after a sync;
    a new one starts with everything."""
    first, second = DocumentStore(make_store()), DocumentStore(make_store())
    first.put("", [("a", A), ("b", B)])
    first.put("team", [("a", B)])
    assert second.get("", "a") is None  # not caught up yet
    second.sync()
    assert (second.get("", "a"), second.get("", "b"), second.get("team", "a")) == (A, B, B)
    version = second.version
    second.put("", [("a", A)])  # the same text again: no change
    assert second.version == version
    second.put("", [("a", B)])
    second.delete("", "b")
    first.sync()
    assert first.get("", "a") == B and first.get("", "b") is None and first.ids("") == ["a"]
    assert [c.doc_id for _, _, c, _ in first.matcher("").occurrences("x " + B + " y")[0]] == ["a"]
    assert first.matcher("").occurrences("x " + A + " y")[0] == []  # a's old text, and b, are gone
    third = DocumentStore(make_store())  # a restarted ingress
    assert third.get("", "a") == B and third.get("team", "a") == B and third.get("", "b") is None
    # a namespace's version is where its last change lies in the store's log: every ingress,
    # a restarted one too, gives the same, and another namespace's changes leave it as it is
    second.sync()
    assert dict(first.versions) == dict(second.versions) == dict(third.versions) == {"": 5, "team": 3}
    second.delete("", "a")
    third.sync()
    assert third.versions == {"": 6, "team": 3} and DocumentStore(make_store()).versions == third.versions
    assert third.generation == first.generation != ""
    third.delete("team", "unknown")  # no document: nothing logged, no version moves
    assert DocumentStore(make_store()).versions == third.versions


def test_the_sqlite_registry_is_shared_by_ingresses_and_outlives_them(tmp_path):
    exercise(lambda: SqliteRegistry(tmp_path / "registry" / "app.sqlite3"))


def test_the_redis_registry_is_shared_by_ingresses_and_outlives_them(redis_server):
    pytest.importorskip("redis")
    exercise(lambda: RedisRegistry(redis_server.url, prefix="test:registry"))


def test_a_redis_server_that_lost_the_registry_is_followed_not_ignored(redis_server):
    """Flushed (or restarted without persistence, or evicted under allkeys-lru): the change log
    begins a new generation and every ingress starts over from what the server holds."""
    pytest.importorskip("redis")
    first, second = DocumentStore(RedisRegistry(redis_server.url)), DocumentStore(RedisRegistry(redis_server.url))
    first.put("", [(f"d{i}", f"{A} {i}") for i in range(5)])
    second.sync()
    assert second.get("", "d0") is not None
    RedisRegistry(redis_server.url).client.flushdb()
    first.put("", [("new", B)])
    assert first.get("", "new") == B and first.get("", "d0") is None
    generation = second.generation
    second.sync()
    assert second.get("", "new") == B and second.ids("") == ["new"] and second.generation != generation
    assert [c.doc_id for _, _, c, _ in second.matcher("").occurrences("x " + B + " y")[0]] == ["new"]


def test_a_redis_version_never_names_two_contents(redis_server):
    """A break-it trial: a mirror syncing beside a writer reported version 2 holding the text of
    version 3 (the log, its length and the texts were read in three round trips); a log evicted
    alone made a namespace's version go back. Now one snapshot, and a lost log a new generation."""
    pytest.importorskip("redis")
    import threading

    writer, mirror = DocumentStore(RedisRegistry(redis_server.url)), DocumentStore(RedisRegistry(redis_server.url))
    done, seen = threading.Event(), []

    def write():
        for j in range(300):
            writer.put("n", [("d", f"v{j}")])
        done.set()

    thread = threading.Thread(target=write)
    thread.start()
    while not done.is_set():
        mirror.sync()
        if mirror.get("n", "d") is not None:
            seen.append((mirror.versions["n"], mirror.get("n", "d")))
    thread.join()
    assert seen and all(text == f"v{version - 1}" for version, text in seen)  # position p wrote v(p-1)
    store = RedisRegistry(redis_server.url)
    generation = mirror.generation
    store.client.delete(store.log)  # evicted alone
    writer.put("n", [("d", "after")])
    mirror.sync()
    assert mirror.get("n", "d") == "after" and mirror.generation != generation


def test_a_redis_outage_serves_the_last_documents_and_refuses_writes_by_name(redis_server):
    """Redis down: reads keep the mirror's documents (no error), writes raise RegistryUnavailable
    naming the outage, and once the server is back (and the retry interval passed) the mirror
    catches up with what it holds."""
    pytest.importorskip("redis")
    store, other = DocumentStore(RedisRegistry(redis_server.url)), DocumentStore(RedisRegistry(redis_server.url))
    store.put("", [("d0", A)])
    redis_server.stop()
    store.sync()  # the server is gone: no exception, the last contents kept
    assert store.unavailable is not None and "ConnectionError" in store.unavailable
    assert store.get("", "d0") == A and [c.doc_id for _, _, c, _ in store.matcher("").occurrences(A)[0]] == ["d0"]
    with pytest.raises(RegistryUnavailable, match="the document registry cannot be reached .*ConnectionError"):
        store.put("", [("d1", B)])
    with pytest.raises(RegistryUnavailable):
        store.delete("", "d0")
    assert store.get("", "d0") == A and store.get("", "d1") is None
    redis_server.start()
    other.put("", [("d1", B)])  # written while the first mirror still waits to try again
    store.sync()
    assert store.get("", "d1") is None  # within RETRY_S: not tried yet
    store._retry_at = 0.0  # the retry interval passed
    store.sync()
    # the test's server restarts empty (no persistence): the mirror follows what it holds now
    assert store.unavailable is None and store.get("", "d1") == B and store.ids("") == ["d1"]


def test_the_registry_goes_where_the_config_says(tmp_path):
    engine = EngineConfig(cache_dir=tmp_path)
    auto = open_registry(ServeConfig(), engine)
    assert isinstance(auto, SqliteRegistry) and auto.path == tmp_path / "registry" / "lazyattn.sqlite3"
    assert isinstance(open_registry(ServeConfig(registry=str(tmp_path / "r.db")), engine), SqliteRegistry)
    assert open_registry(ServeConfig(registry="memory"), engine) is None
    with_redis = EngineConfig(cache_dir=tmp_path, cache=CacheConfig(redis_url="redis://127.0.0.1:1/0"))
    assert isinstance(open_registry(ServeConfig(), with_redis), RedisRegistry)
    with pytest.raises(ValueError, match="registry"):
        ServeConfig(registry="")


def test_registered_texts_are_found_in_plain_messages_and_named_documents_left_alone():
    store = DocumentStore()
    store.put("", [("a", A), ("b", B)])
    prompt = f"Context:\n\n{B}\n\n{A}\n\nQuestion: which?"
    wire, found = match_messages([{"role": "system", "content": "Be brief."}, {"role": "user", "content": prompt}],
                                 store, "")
    assert found == ["b", "a"] and wire[0] == {"role": "system", "content": "Be brief."}
    assert wire[1]["content"] == [{"type": "text", "text": "Context:\n\n"}, {"type": "document", "id": "b", "matched": True},
                                  {"type": "document", "id": "a", "matched": True},
                                  {"type": "text", "text": "\n\nQuestion: which?"}]
    assert match_messages([{"role": "user", "content": prompt}], store, "other") == ([{"role": "user",
                                                                                       "content": prompt}], [])
    payload, keys = chat_payload(ChatCompletionRequest(messages=[{"role": "user", "content": prompt}]), store, 16)
    assert payload["documents"] == [("b", B), ("a", A)] and keys[:2] == ["\x00b", "\x00a"]
    assert len(keys) == 2  # no passage of its own text is long enough to route
    named = ChatCompletionRequest(messages=[{"role": "user", "content": prompt}], documents=["a"])
    payload, _ = chat_payload(named, store, 16)
    assert payload["messages"][0]["content"] == prompt and payload["placed"] == ["a"]  # named: not matched
    with pytest.raises(ApiError, match="'nope'"):
        chat_payload(ChatCompletionRequest(messages=[{"role": "user", "content": "q"}], documents=["nope"]), store)


def test_passages_of_plain_text_route_the_request():
    store = DocumentStore()
    text = "Documents:\n\n" + "A passage long enough to route a request by. " * 2 + "\n\nQuestion: what?"
    _, keys = chat_payload(ChatCompletionRequest(messages=[{"role": "user", "content": text}]), store, 16)
    assert len(keys) == 1 and keys[0].startswith("passage\x00")
    _, none = chat_payload(ChatCompletionRequest(messages=[{"role": "user", "content": text}]), store, None)
    assert none == []


def test_the_sqlite_registry_is_readable_by_its_owner_only(tmp_path):
    """It holds every tenant's texts: mode 0600, and deleted texts overwritten (secure_delete)."""
    from lazyattn_rag.serve.registry import SqliteRegistry

    store = SqliteRegistry(tmp_path / "registry" / "app.sqlite3")
    store.put("team-a", [("pii", "SSN-123-45-6789")])
    store.delete("team-a", "pii")
    assert (tmp_path / "registry" / "app.sqlite3").stat().st_mode & 0o777 == 0o600
    assert store._db().execute("PRAGMA secure_delete").fetchone()[0] == 1


@pytest.mark.parametrize("replace", [False, True])
def test_a_sqlite_file_deleted_or_replaced_under_a_running_server_is_unreachable_not_a_ghost(tmp_path, replace):
    """Its connections would go on writing to the unlinked file, which no restart or other ingress
    reads: the mirror serves what it read and writes are refused until a restart, which starts a
    new file (a new generation)."""
    path = tmp_path / "app.sqlite3"
    store = DocumentStore(SqliteRegistry(path))
    store.put("team-a", [("a", A)])
    old_generation = store.generation
    path.unlink()
    if replace:
        SqliteRegistry(path).put("team-a", [("b", B)])  # another file in its place
    with pytest.raises(RegistryUnavailable, match="deleted or replaced while the server ran"):
        store.put("team-a", [("c", "C text")])
    store.sync()
    assert store.unavailable is not None and store.get("team-a", "a") == A  # the mirror still serves
    restarted = DocumentStore(SqliteRegistry(path))
    assert restarted.get("team-a", "c") is None and restarted.generation != old_generation
    assert restarted.ids("team-a") == (["b"] if replace else [])


def test_one_id_with_two_texts_in_one_registration_is_refused_by_name():
    """A break-it trial registered ``[{"id": "x", "text": A}, {"id": "x", "text": B}]`` with a 200 and
    the last text kept; the same id with the same text twice stays harmless."""
    from lazyattn_rag.serve.http_errors import parse
    from lazyattn_rag.serve.protocol import DocumentsRequest

    with pytest.raises(ApiError, match="document id 'x' is given twice with different texts") as error:
        parse(DocumentsRequest, {"documents": [{"id": "x", "text": A}, {"id": "y", "text": A}, {"id": "x", "text": B}]})
    assert error.value.status == 400
    twice = parse(DocumentsRequest, {"documents": [{"id": "x", "text": A}, {"id": "x", "text": A}]})
    assert [d.id for d in twice.documents] == ["x", "x"]
