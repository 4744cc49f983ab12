"""``lazyattn serve`` facing several teams (issue 37), on a real local Ray cluster: API keys bound
to namespaces (401, 403, lists and hits within the key's namespace), deletes that reach every
replica's KV pool and the shared disk and Redis tiers, and a Ray cluster that listens on loopback
only. Two CPU replicas of a tiny random Llama; one app for the module (~20 s to start).

The tiers are checked through the disk directory's files and a real ``redis-server``'s keys, the
replicas through ``EngineReplica.holds`` called on each of them (``DeploymentHandle.broadcast``).
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

pytest.importorskip("ray.serve")

import redis  # noqa: E402

from lazyattn_rag import EngineConfig  # noqa: E402
from lazyattn_rag.types.config import CacheConfig  # noqa: E402
from tests.tiny import hf_and_ours, hf_config, word_tokenizer, words  # noqa: E402

APP = "lazyattn-security"
QUESTION = "w5 w6"
KEYS = {"a": "sk-team-a", "b": "sk-team-b", "reader": "sk-team-a-reader", "admin": "sk-admin"}


@pytest.fixture(scope="module")
def server(module_redis_server, serve_cluster, tmp_path_factory):
    """``(base_url, disk_dir, redis_client)``: 2 replicas, keys for team-a (may manage documents),
    team-b (may manage), a team-a reader and an admin (``--api-key``: every namespace)."""
    from ray import serve

    from lazyattn_rag.serve import ServeConfig, build_app

    model_dir = tmp_path_factory.mktemp("model")
    hf, _ = hf_and_ours(hf_config())
    hf.save_pretrained(model_dir)
    word_tokenizer().save_pretrained(model_dir)
    disk = tmp_path_factory.mktemp("chunks")
    config = EngineConfig(model=str(model_dir), device="cpu", dtype="float32", attention_backend="torch",
                          cache_dir=tmp_path_factory.mktemp("cache"),
                          cache=CacheConfig(num_blocks=256, block_size=16, disk_dir=str(disk),
                                            redis_url=module_redis_server.url, tier_loads="always"))
    key_file = tmp_path_factory.mktemp("keys") / "keys.json"
    key_file.write_text(json.dumps({"keys": [
        {"key": KEYS["a"], "namespaces": ["team-a"], "manage_documents": True},
        {"key": KEYS["b"], "namespaces": ["team-b"], "manage_documents": True},
        {"key": KEYS["reader"], "namespaces": ["team-a"], "name": "team-a reader"},
    ]}))
    url, port = serve_cluster
    serve.run(build_app(config, ServeConfig(num_replicas=2, num_cpus_per_replica=0, port=port,
                                            api_keys=(KEYS["admin"],), api_key_file=str(key_file))),
              name=APP, route_prefix="/")
    try:
        yield url, disk, redis.Redis.from_url(module_redis_server.url)
    finally:
        serve.delete(APP)


@pytest.fixture(scope="module")
def clients(server):
    """An httpx client per key (and ``"none"``: no key)."""
    made = {who: httpx.Client(base_url=server[0], timeout=120, headers={"Authorization": f"Bearer {key}"})
            for who, key in KEYS.items()}
    made["none"] = httpx.Client(base_url=server[0], timeout=120)
    yield made
    for client in made.values():
        client.close()


def register(client, documents: dict[str, str], **extra) -> httpx.Response:
    return client.post("/v1/documents", json={"documents": [{"id": i, "text": t} for i, t in documents.items()],
                                              **extra})


def ask(client, doc_ids, max_tokens=2, **extra) -> httpx.Response:
    return client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": QUESTION}],
                                                     "documents": doc_ids, "max_tokens": max_tokens,
                                                     "temperature": 0, **extra})


def everywhere(method: str, *args) -> list:
    """``EngineReplica.<method>(*args)`` on every replica."""
    from ray import serve

    return serve.get_deployment_handle("engine", APP).broadcast(method, *args).results(timeout_s=120)


def files(disk) -> set[str]:
    return {p.name for p in disk.rglob("*.lakv")}


def test_the_ray_processes_listen_on_loopback_only(server):
    """Every listening socket of this process and the processes it started (Ray's GCS, raylet,
    workers, agents, Serve's controller, proxy and replicas, the test's redis-server) is on a
    loopback address."""
    import psutil

    me = psutil.Process()
    pids = {p.pid: p.name() for p in [me, *me.children(recursive=True)]}
    listening = [(c.laddr.ip, c.laddr.port, pids[c.pid]) for c in psutil.net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN and c.pid in pids]
    names = {name for _, _, name in listening}
    assert {"gcs_server", "raylet"} <= names and any("ProxyActor" in n for n in names), names
    from lazyattn_rag.serve.auth import is_loopback

    assert [s for s in listening if not is_loopback(s[0])] == []


def test_no_key_or_a_wrong_key_is_401_and_health_needs_none(clients, server):
    for client in (clients["none"], httpx.Client(base_url=server[0], headers={"Authorization": "Bearer sk-nope"})):
        response = client.get("/v1/models")
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
        assert response.headers["www-authenticate"] == "Bearer"
        assert ask(client, []).status_code == 401
        assert client.get("/v1/documents").status_code == 401
    assert clients["none"].get("/health").status_code == 200
    assert clients["a"].get("/v1/models").status_code == 200


def test_a_key_reads_lists_and_registers_in_its_own_namespaces_only(clients):
    a, b, reader, admin = clients["a"], clients["b"], clients["reader"], clients["admin"]
    response = register(a, {"memo": "w1 w2 w3 w4 team a's memo"})
    assert response.status_code == 200 and response.json()["namespace"] == "team-a"
    assert register(b, {"memo": "w9 w8 w7 team b's memo"}).json()["namespace"] == "team-b"
    listed = a.get("/v1/documents", params={"texts": True}).json()
    assert listed["namespace"] == "team-a" and listed["data"] == [
        {"id": "memo", "object": "document", "text": "w1 w2 w3 w4 team a's memo"}]
    assert reader.get("/v1/documents").json()["data"] == [{"id": "memo", "object": "document"}]
    assert b.get("/v1/documents", params={"texts": True}).json()["data"][0]["text"] == "w9 w8 w7 team b's memo"
    for response in (b.get("/v1/documents", params={"namespace": "team-a", "texts": True}),
                     register(b, {"x": "w1 w2"}, namespace="team-a"),
                     ask(b, ["memo"], namespace="team-a"),
                     b.delete("/v1/documents/memo", params={"namespace": "team-a"}),
                     b.post("/v1/documents/warm", json={"ids": ["memo"], "namespace": "team-a"}),
                     b.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}],
                                               "namespace": "team-a"})):
        assert response.status_code == 403, response.text
        assert response.json()["error"]["code"] == "namespace_forbidden" and "'team-a'" in response.text
    for response in (register(reader, {"x": "w1 w2"}), reader.delete("/v1/documents/memo"),
                     reader.post("/v1/documents/warm", json={"ids": ["memo"]})):
        assert response.status_code == 403 and response.json()["error"]["code"] == "documents_read_only"
    assert ask(reader, ["memo"]).status_code == 200
    assert admin.get("/v1/documents", params={"namespace": "team-b"}).json()["data"][0]["id"] == "memo"
    assert admin.get("/v1/documents").json()["data"] == []  # the shared namespace: nobody registered there


def test_a_request_never_hits_another_namespaces_chunks(clients, server):
    """team-a computes a text (KV pool, disk, Redis); team-b's first request over the very same
    text computes it too: its K/V is keyed by namespace, in the pool and in every tier."""
    a, b = clients["a"], clients["b"]
    text = words(48, start=37)
    register(a, {"same": text})
    first = ask(a, ["same"]).json()
    assert first["lazyattn"]["stats"]["doc_tiers"] == {"same": "computed"}
    deadline = time.monotonic() + 30
    while not any("redis" in h["where"] for h in everywhere("holds", text, "team-a")):  # the writer stores it
        assert time.monotonic() < deadline
        time.sleep(0.05)
    register(b, {"same": text})
    theirs = ask(b, ["same"]).json()
    assert theirs["lazyattn"]["stats"]["doc_tiers"] == {"same": "computed"}
    assert theirs["usage"]["prompt_tokens_details"]["shifted_tokens"] == 0
    again = ask(b, ["same"]).json()
    assert again["lazyattn"]["stats"]["doc_tiers"] in ({"same": "kv"}, {"same": "redis"}, {"same": "disk"})


def test_a_delete_removes_the_document_from_every_replica_and_tier(clients, server):
    _, disk, store = server
    a = clients["a"]
    text = words(64, start=111)
    assert register(a, {"gone": text}).status_code == 200
    everywhere("warm", [("gone", text)], "team-a")  # computed on both replicas
    held = everywhere("holds", text, "team-a")
    assert len(held) == 2 and all("kv" in h["where"] for h in held), held
    assert any({"disk", "redis"} <= set(h["where"]) for h in held), held
    disk_files, redis_keys = files(disk), set(store.keys())

    response = a.delete("/v1/documents/gone")
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["deleted"] and body["namespace"] == "team-a"
    assert set(body["removed"]["tiers"]) == {"disk", "redis"} and body["removed"]["num_kv_blocks"] == 2 * 4
    assert body["removed"]["cached_on"] == [] and len(body["replicas"]) == 2
    assert [h["where"] for h in everywhere("holds", text, "team-a")] == [[], []], json.dumps(body)
    assert len(disk_files - files(disk)) == 1 and files(disk) <= disk_files
    assert len(redis_keys - set(store.keys())) == 1 and set(store.keys()) <= redis_keys
    response = ask(a, ["gone"])
    assert response.status_code == 404 and "'gone'" in response.text
    assert a.delete("/v1/documents/gone").status_code == 404


def test_a_request_running_over_a_deleted_document_completes_with_its_text(clients, server):
    a = clients["a"]
    text = words(40, start=163)
    register(a, {"running": text})
    deleted = {}
    body = {"messages": [{"role": "user", "content": QUESTION}], "documents": ["running"], "max_tokens": 200,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    with a.stream("POST", "/v1/chat/completions", json=body) as response:
        lines = response.iter_lines()
        next(line for line in lines if '"content": "w' in line)  # tokens are flowing
        deleting = threading.Thread(target=lambda: deleted.update(a.delete("/v1/documents/running").json()))
        deleting.start()
        rest = [line for line in lines if line]
    deleting.join(timeout=120)
    assert rest[-1] == "data: [DONE]" and '"error"' not in "".join(rest)
    assert json.loads(rest[-2][len("data: "):])["usage"]["completion_tokens"] == 200
    assert deleted["deleted"] and deleted["removed"]["num_in_use"] == 1 and deleted["removed"]["cached_on"] == []
    assert [h["where"] for h in everywhere("holds", text, "team-a")] == [[], []], json.dumps(deleted)


def test_the_package_clients_carry_a_key(server):
    """``RemoteLazyAttention(api_key=)`` and the wrappers' ``api_key`` reach the key's namespace;
    without a key the server refuses them (``PermissionError``); a remote delete says what went."""
    from langchain_core.documents import Document

    from lazyattn_rag.integrations.langchain import ChatLazyAttention
    from lazyattn_rag.remote import RemoteLazyAttention

    url = server[0]
    with pytest.raises(PermissionError, match="401"):
        RemoteLazyAttention(url)
    remote = RemoteLazyAttention(url, api_key=KEYS["b"])
    text = words(24, start=57)
    remote.add_document("note", text)
    assert set(remote.document_ids()) == {"memo", "same", "note"}  # team-b's, registered by the tests above
    chat = ChatLazyAttention(server_url=url, api_key=KEYS["b"], max_tokens=2)
    assert "sk-team-b" not in repr(chat)
    answer = chat.invoke(QUESTION, documents=[Document(id="note", page_content=text)])
    assert answer.response_metadata["lazyattn"]["stats"]["doc_tiers"] == {"note": "computed"}
    with pytest.raises(PermissionError, match="403"):
        remote.document_ids("team-a")
    removed = remote.remove_document("note")
    assert removed.namespace == "team-b" and removed.num_kv_blocks == 2 and not removed.shared
    assert "note" not in remote.document_ids()


def test_what_a_tenant_sees_of_the_others(clients):
    """The registry version a key sees is its namespace's; /metrics (every tenant's counts) needs
    a key allowed every namespace; an id with a control character is refused (it could not be
    deleted through a URL path)."""
    a, b, admin = clients["a"], clients["b"], clients["admin"]
    before = b.get("/v1/documents/version").json()
    assert before["namespace"] == "team-b"
    register(a, {"another": words(20, start=90)})
    a.delete("/v1/documents/another")
    assert b.get("/v1/documents/version").json() == before
    response = b.get("/metrics")
    assert response.status_code == 403 and response.json()["error"]["code"] == "metrics_forbidden"
    assert admin.get("/metrics").status_code == 200
    response = register(a, {"a\nb": "w1 w2"})
    assert response.status_code == 400 and "documents.0.id" in response.text
