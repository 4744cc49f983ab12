"""``lazyattn serve`` on a real local Ray cluster (issue 18): two CPU replicas of a tiny random Llama
(a Hugging Face directory, loaded as users load theirs) behind the ingress, the document-affinity
router, a shared Redis tier, and the HTTP API driven with httpx, the ``openai`` package and this
package's own clients. One app serves the whole module (Ray and Serve start once, ~20 s); the
test that kills a replica runs last."""

from __future__ import annotations

import dataclasses
import json
import re
import threading
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("ray.serve")

from lazyattn_rag import EngineConfig, SamplingParams  # noqa: E402
from lazyattn_rag.types.config import CacheConfig  # noqa: E402
from tests.tiny import hf_and_ours, hf_config, word_tokenizer, words  # noqa: E402

APP = "lazyattn-test"
DOCS = {f"d{i}": words(40, start=10 + 11 * i) for i in range(12)}
QUESTION = "w5 w6"


def engine_config(model_dir, cache_dir, redis_url=None) -> EngineConfig:
    return EngineConfig(model=str(model_dir), device="cpu", dtype="float32", attention_backend="torch",
                        cache_dir=cache_dir, cache=CacheConfig(num_blocks=256, block_size=16, redis_url=redis_url,
                                                               tier_loads="always"))  # tiny model: both take ms


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("model")
    hf, _ = hf_and_ours(hf_config())
    hf.save_pretrained(path)
    word_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(model_dir, module_redis_server, serve_cluster, tmp_path_factory):
    """``(base_url, engine_config)`` of the app: 2 replicas, affinity routing with an imbalance
    threshold of 1 request, 1 MiB body limit."""
    from ray import serve

    from lazyattn_rag.serve import ServeConfig, build_app

    config = engine_config(model_dir, tmp_path_factory.mktemp("cache"), module_redis_server.url)
    url, port = serve_cluster
    serve.run(build_app(config, ServeConfig(num_replicas=2, num_cpus_per_replica=0, imbalanced_threshold=1,
                                            max_body_bytes=1 << 20, port=port)), name=APP, route_prefix="/")
    try:
        yield url, config
    finally:
        serve.delete(APP)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server[0], timeout=120) as client:
        assert client.post("/v1/documents", json={"documents": [{"id": k, "text": v} for k, v in DOCS.items()]}
                           ).status_code == 200
        yield client


def ask(http, doc_ids, max_tokens=4, **extra) -> dict:
    response = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": QUESTION}],
                                                       "documents": doc_ids, "max_tokens": max_tokens,
                                                       "temperature": 0, **extra})
    assert response.status_code == 200, response.text
    return response.json()


def test_models_documents_and_tokenize(http):
    models = http.get("/v1/models").json()
    assert models["data"][0]["max_model_len"] > 0 and models["lazyattn"]["prompt"]["question_prefix"]
    listed = http.get("/v1/documents").json()
    assert sorted(d["id"] for d in listed["data"]) == sorted(DOCS) and listed["version"] >= len(DOCS)
    assert http.get("/v1/documents", params={"texts": "true"}).json()["data"][0]["text"] in DOCS.values()
    some = http.get("/v1/documents", params={"id": ["d2", "nope", "d1"], "texts": "true"}).json()["data"]
    assert [(d["id"], d["text"]) for d in some] == [("d2", DOCS["d2"]), ("d1", DOCS["d1"])]
    tokens = http.post("/tokenize", json={"prompt": "w1 w2 w3", "add_special_tokens": False}).json()
    assert tokens["count"] == 3 and len(tokens["tokens"]) == 3
    assert http.post("/tokenize", json={"messages": [{"role": "user", "content": "w1"}]}).json()["count"] > 1
    assert http.post("/v1/documents", json={"documents": [{"id": "tmp", "text": "w9 w8"}]}).status_code == 200
    assert http.delete("/v1/documents/tmp").json()["deleted"] is True
    gone = http.delete("/v1/documents/tmp")
    assert gone.status_code == 404 and "'tmp'" in gone.json()["error"]["message"]


def test_ray_serves_own_config_file_starts_the_app(server, model_dir):
    """examples/serve_config.yaml through the path `serve run` / `serve deploy` take: its schema,
    Ray's validation of the args against the builder's ServeArgs, the built app (here beside the
    module's, under another route prefix, with the test model)."""
    import yaml
    from ray import serve
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve.schema import ServeDeploySchema

    from lazyattn_rag.serve.builder import app

    path = Path(__file__).resolve().parents[1] / "examples" / "serve_config.yaml"
    config = ServeDeploySchema.model_validate(yaml.safe_load(path.read_text()))
    entry = config.applications[0]
    assert entry.import_path == "lazyattn_rag.serve.builder:app"
    args = {**entry.args, "model": str(model_dir), "device": "cpu", "backend": "torch", "max_model_len": "256"}
    with pytest.raises(Exception, match="max_modle_len"):
        call_user_app_builder_with_args_if_necessary(app, {"max_modle_len": "5"})
    serve.run(call_user_app_builder_with_args_if_necessary(app, args), name="from-config", route_prefix="/cfg")
    try:
        with httpx.Client(base_url=server[0] + "/cfg", timeout=120) as client:
            models = client.get("/v1/models").json()
            assert models["data"][0]["id"] == entry.args["served_model_name"] and models["data"][0]["max_model_len"] == 256
            answer = client.post("/v1/completions", json={"prompt": "w1 w2", "max_tokens": 3, "ignore_eos": True})
            assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 3
    finally:
        serve.delete("from-config")


def test_an_answer_its_usage_and_a_stream(http):
    first, again = ask(http, ["d0", "d1"]), ask(http, ["d0", "d1"])
    assert first["object"] == "chat.completion" and first["choices"][0]["finish_reason"] == "length"
    assert first["choices"][0]["message"]["content"] == again["choices"][0]["message"]["content"]
    usage = again["usage"]
    stats = again["lazyattn"]["stats"]
    assert usage["completion_tokens"] == 4 and usage["total_tokens"] == usage["prompt_tokens"] + 4
    assert usage["prompt_tokens_details"]["cached_tokens"] == stats["num_cached_tokens"] >= 80  # both documents
    assert stats["docs_hit"] == ["d0", "d1"] and again["lazyattn"]["replica"] == first["lazyattn"]["replica"]
    body = {"messages": [{"role": "user", "content": QUESTION}], "documents": ["d0", "d1"], "max_tokens": 4,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == again["choices"][0]["message"]["content"]
    final, usage_chunk = chunks[-2], chunks[-1]
    assert final["choices"][0]["finish_reason"] == "length" and final["lazyattn"]["stats"]["docs_hit"] == ["d0", "d1"]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 4


def test_documents_placed_by_message_parts_and_inline(http):
    parts = [{"type": "text", "text": "w1 "}, {"type": "document", "id": "d2"}, {"type": "text", "text": QUESTION}]
    out = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": parts}], "max_tokens": 2})
    assert out.status_code == 200 and out.json()["lazyattn"]["stats"]["docs_missed"] == ["d2"]
    inline = ask(http, [{"id": "x1", "text": words(30, start=150)}], max_tokens=2)
    assert inline["lazyattn"]["stats"]["docs_missed"] == ["x1"]
    assert "x1" not in {d["id"] for d in http.get("/v1/documents").json()["data"]}  # placed, not kept


def test_affinity_sends_a_document_set_to_one_replica_which_then_computes_no_document_token(http):
    where = {}
    for i in range(3, 12):
        first, second = ask(http, [f"d{i}"], max_tokens=1), ask(http, [f"d{i}"], max_tokens=1)
        assert first["lazyattn"]["replica"] == second["lazyattn"]["replica"]
        stats = second["lazyattn"]["stats"]
        assert stats["docs_hit"] == [f"d{i}"] and stats["doc_tiers"] == {f"d{i}": "kv"}
        assert stats["num_computed_tokens"] == stats["num_prompt_tokens"] - stats["num_cached_tokens"]
        assert stats["num_cached_tokens"] - stats["num_exact_prefix_tokens"] >= 40  # the whole document
        where[f"d{i}"] = first["lazyattn"]["replica"]
    assert len(set(where.values())) == 2  # 9 documents over 2 owners: both own some (odds 1 in 256 otherwise)


def test_past_the_imbalance_threshold_requests_go_to_the_least_loaded_replica(http):
    owner = ask(http, ["d0"], max_tokens=1)["lazyattn"]["replica"]
    replicas, lock = [], threading.Lock()

    def long_answer():
        out = ask(http, ["d0"], max_tokens=400, ignore_eos=True)
        with lock:
            replicas.append(out["lazyattn"]["replica"])

    threads = [threading.Thread(target=long_answer) for _ in range(6)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join(timeout=120)
    assert len(replicas) == 6 and owner in replicas and len(set(replicas)) == 2


@pytest.mark.parametrize("body, status, words_in_message", [
    (b"{not json", 400, "not valid JSON"),
    ({"messages": [{"role": "user", "content": "w1"}], "max_tokens": -3}, 400, "max_tokens"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "w1"}], "n": 129}, 400, "n must be in [1, 128]"),
    ({"messages": [{"role": "user", "content": "w1"}], "max_tokens": 100000}, 400, "max_tokens=100000): shorten"),
    ({"messages": [{"role": "user", "content": "w1"}], "stream_options": {"include_usage": True}}, 400,
     "stream_options needs stream: true"),
    ({"messages": [{"role": "user", "content": "w1"}], "echo": True}, 400, "not supported by this server: echo"),
    ({"messages": [{"role": "user", "content": "w1"}], "stream": True,
      "stream_options": {"continuous_usage_stats": True}}, 400, "continuous_usage_stats is not supported"),
    ({"messages": [{"role": "user", "content": "w1"}], "tools": [{"type": "function"}]}, 400, "tools"),
    ({"messages": [{"role": "user", "content": "w1"}], "temperature": -1}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "w1"}], "n": "2"}, 400, "n: Input should be a valid integer"),
    ({"messages": [{"role": "user", "content": "w1"}], "documents": ["nope"]}, 404, "'nope'"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "id": "gone"}]}]}, 404, "'gone'"),
    ({"messages": [{"role": "user", "content": "w1"}], "model": "gpt-4o"}, 404, "gpt-4o"),
    ({"messages": [{"role": "user", "content": "w1 " * 20000}]}, 400, "tokens"),
    ({"messages": [{"role": "user", "content": "x" * (1 << 20)}]}, 413, "limit"),
    ({"messages": [{"role": "user", "content": "w1"}], "stop": ["w9"] * 17}, 400, "stop"),
    ({"messages": [{"role": "user", "content": "w1"}], "stop": "w" * 300}, 400, "stop"),
    (b'{"messages": [{"role": "user", "content": "w1 \\ud800"}]}', 400, "Unicode"),
    (b"[" * 50000 + b"]" * 50000, 400, "nested"),
    ({"messages": [{"role": "user", "content": "w1"}], "documents": ["d0", {"id": "d0", "text": "w7 w7"}]}, 400,
     "two different texts"),
])
def test_bad_requests_get_4xx_with_a_message_and_the_server_stays_up(http, body, status, words_in_message):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    response = http.post("/v1/chat/completions", **kwargs)
    assert response.status_code == status, response.text
    assert words_in_message in response.json()["error"]["message"]
    assert ask(http, ["d0"], max_tokens=1)["choices"][0]["finish_reason"] == "length"


def test_inline_documents_do_not_pile_up_in_the_replicas_and_tokenize_places_documents(http):
    for i in range(4):
        ask(http, [{"id": f"once{i}", "text": words(20, start=100 + i)}], max_tokens=1)
    reports = [ask(http, [f"d{i}"], max_tokens=1)["lazyattn"] for i in range(6)]
    assert all(r["stats"]["docs_hit"] or r["stats"]["docs_missed"] for r in reports)
    text = http.get("/metrics").text
    counts = [float(line.split()[-1]) for line in text.splitlines() if line.startswith("lazyattn_documents{")]
    # the one-off inline documents were dropped after their request ("tmp", deleted at the ingress
    # earlier, stays on the replica that registered it: documented)
    assert counts and max(counts) <= len(DOCS) + 1
    body = {"messages": [{"role": "user", "content": [{"type": "document", "id": "d1"}, {"type": "text", "text": "w1"}]}]}
    answers = {json.dumps(http.post("/tokenize", json=body).json()) for _ in range(6)}  # whichever replica answers
    assert len(answers) == 1 and json.loads(answers.pop())["count"] > 40
    assert http.post("/tokenize", json={"messages": None}).status_code == 400


def test_a_client_never_answers_over_a_text_another_client_registered_since(server, http):
    from lazyattn_rag import Document
    from lazyattn_rag.remote import RemoteLazyAttention

    a, b = RemoteLazyAttention(server[0]), RemoteLazyAttention(server[0])
    mine = Document("shared", words(10, start=70))
    first = a.generate(QUESTION, documents=[mine], sampling=SamplingParams(max_tokens=1))
    b.add_document("shared", words(50, start=120))  # the same id, another text, from another client
    again = a.generate(QUESTION, documents=[mine], sampling=SamplingParams(max_tokens=1))
    assert again.stats.num_prompt_tokens == first.stats.num_prompt_tokens  # over a's 10 words, not b's 50
    for odd in (".", "..", "a/b#c"):
        a.add_document(odd, "w1 w2")
        a.remove_document(odd)
        assert odd not in a.document_ids()


def test_an_openai_client_works_unchanged(server, http):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server[0] + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTION}], max_tokens=3,
                                         temperature=0, extra_body={"documents": ["d0", "d1"]})
    assert out.choices[0].message.content and out.usage.completion_tokens == 3
    assert out.usage.prompt_tokens_details.cached_tokens >= 80
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTION}],
                                            max_tokens=3, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"documents": ["d0", "d1"]})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == out.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 3
    with pytest.raises(openai.NotFoundError, match="nope"):
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "w1"}],
                                       extra_body={"documents": ["nope"]})


def test_the_package_clients_answer_as_an_in_process_engine_does(server, http):
    from lazyattn_rag.llm import LazyAttention
    from lazyattn_rag.remote import RemoteLazyAttention
    from lazyattn_rag.types.errors import UnknownDocumentError

    greedy = SamplingParams(max_tokens=5)
    with LazyAttention(dataclasses.replace(server[1], cache=CacheConfig(num_blocks=256, block_size=16))) as local:
        local.add_documents(list(DOCS.items()))
        expected = local.generate(QUESTION, ["d4", "d5"], sampling=greedy).text
        remote = RemoteLazyAttention(server[0])
        assert remote.model_name == local.model_name and remote.max_model_len == local.max_model_len
        assert remote.generate(QUESTION, ["d4", "d5"], sampling=greedy).text == expected
        streamed = list(remote.stream(QUESTION, ["d4", "d5"], sampling=greedy))
        assert "".join(d.text for d in streamed) == expected and streamed[-1].stats.docs_hit == ["d4", "d5"]
        with pytest.raises(UnknownDocumentError, match="nope"):
            remote.generate(QUESTION, ["nope"])
        assert remote.tokenizer.encode("w1 w2", add_special_tokens=False) == local.tokenizer.encode(
            "w1 w2", add_special_tokens=False)

        from langchain_core.documents import Document as LCDocument

        from lazyattn_rag.integrations.langchain import ChatLazyAttention
        from lazyattn_rag.integrations.llamaindex import LazyAttentionLLM

        chat = ChatLazyAttention(server_url=server[0], max_tokens=5)
        lc_docs = [LCDocument(id=i, page_content=DOCS[i]) for i in ("d4", "d5")]
        assert chat.invoke(QUESTION, documents=lc_docs).content == expected
        assert chat.invoke(QUESTION, documents=["d4", "d5"]).content == expected  # registered ids
        with pytest.raises(UnknownDocumentError, match="not registered: 'nope'"):
            chat.invoke(QUESTION, documents=["d4", "nope"])
        assert remote.document_texts(["d5", "nope", "d4"]) == {"d5": DOCS["d5"], "d4": DOCS["d4"]}
        llm = LazyAttentionLLM(server_url=server[0], max_tokens=5)
        assert llm.metadata.context_window < local.max_model_len
        assert "".join(d.text for d in llm.stream_rag(QUESTION, [_doc("d4"), _doc("d5")], greedy)) == expected


def test_the_package_clients_send_plain_text_and_let_the_server_find_the_documents(server, http):
    """A formatted prompt from a wrapper with ``server_url=``: no version call, no download of the
    registry; the server finds the registered documents in the text (``doc_sources``: matched)."""
    from lazyattn_rag.integrations.langchain import ChatLazyAttention

    def reads():
        text = http.get("/metrics").text
        return {route: responses(text, route=route)
                for route in ("/v1/documents/version", "/v1/documents", "/v1/chat/completions")}

    chat = ChatLazyAttention(server_url=server[0], max_tokens=2)
    before = reads()
    for question in ("w5 w6", "w7"):
        out = chat.invoke(f"documents below :\n\n{DOCS['d7']}\n\n{DOCS['d8']}\n\nQuestion : {question}")
    after = reads()
    assert after["/v1/chat/completions"] - before["/v1/chat/completions"] == 2  # one call per question
    assert after["/v1/documents/version"] == before["/v1/documents/version"]
    assert after["/v1/documents"] == before["/v1/documents"]
    stats = out.response_metadata["lazyattn"]["stats"]
    assert stats["doc_sources"] == {"d7": "matched", "d8": "matched"} and stats["docs_hit"] == ["d7", "d8"]


def responses(metrics_text: str, **labels) -> float:
    """The ``lazyattn_http_responses_total`` samples whose labels include ``labels``, summed."""
    total = 0.0
    for line in metrics_text.splitlines():
        m = re.fullmatch(r"lazyattn_http_responses_total\{(.*)\} (\S+)", line)
        if m and all(f'{k}="{v}"' in m.group(1).split(",") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def _doc(doc_id):
    from lazyattn_rag import Document

    return Document(doc_id, DOCS[doc_id])


def samples(metrics_text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """Every sample of ``name`` as ``(labels, value)``."""
    out = []
    for line in metrics_text.splitlines():
        m = re.fullmatch(rf"{name}(?:\{{(.*)\}})? (\S+)", line)
        if m:
            out.append((dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or "")), float(m.group(2))))
    return out


def test_metrics_show_each_replica(server, http):
    text = http.get("/metrics").text
    assert responses(text, route="/v1/chat/completions", method="POST", status="200") > 0
    assert text.count("lazyattn_replica_answers_total{replica=") == 2
    ratios = samples(text, "lazyattn_doc_hit_ratio")
    model = http.get("/v1/models").json()["data"][0]["id"]
    assert len({labels["replica"] for labels, _ in ratios}) == 2 and {labels["model_name"] for labels, _ in ratios} == {model}
    assert samples(text, "lazyattn_replicas_reporting") == [({}, 2.0)]
    # the tier this app has (a Redis URL given, no disk directory), per replica
    assert [labels["tier"] for labels, _ in samples(text, "lazyattn_tier_available")] == ["redis", "redis"]


def test_metrics_move_during_a_running_request(server, http):
    """The gauges are the replicas' state at the scrape, not the last finished request's; the
    latency histograms count each finished request once."""
    def total(text, name, **labels):
        return sum(v for found, v in samples(text, name) if labels.items() <= found.items())

    before = http.get("/metrics").text
    body = {"messages": [{"role": "user", "content": QUESTION}], "documents": ["d3"], "max_tokens": 200,
            "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))  # the answer is running
        during = http.get("/metrics").text
        assert total(during, "lazyattn_requests_running") >= 1
        assert total(during, "lazyattn_kv_blocks_in_use") > 0
        assert [line for line in lines if line.startswith("data:")][-1] == "data: [DONE]"
    after = http.get("/metrics").text
    assert total(after, "lazyattn_requests_running") == 0 and total(after, "lazyattn_kv_blocks_in_use") == 0
    for name in ("time_to_first_token", "time_per_output_token", "e2e_request_latency", "request_queue_time"):
        counted = total(after, f"lazyattn_{name}_seconds_count") - total(before, f"lazyattn_{name}_seconds_count")
        assert counted == 1, name
        assert total(after, f"lazyattn_{name}_seconds_bucket", le="+Inf") == total(after, f"lazyattn_{name}_seconds_count")


def test_health_is_503_when_no_engine_replica_answers(server):
    """An ingress whose engine replica never answers (a stand-in deployment that stalls, on the
    same Serve instance): /health answers 503 after its wait (``health_timeout_s``), in OpenAI's
    error shape."""
    import asyncio

    from ray import serve

    from lazyattn_rag.serve import ServeConfig
    from lazyattn_rag.serve.ingress import make_ingress

    # no graceful wait when deleted: the stalled call would hold each replica for Serve's 20 s default
    @serve.deployment(name="stalled-engine", ray_actor_options={"num_cpus": 0}, graceful_shutdown_timeout_s=0)
    class StalledEngine:
        async def info(self):
            await asyncio.sleep(3600)

    ingress = serve.deployment(name="stalled-ingress", ray_actor_options={"num_cpus": 0}, graceful_shutdown_timeout_s=0)(
        make_ingress(ServeConfig(registry="memory", health_timeout_s=1.5)))
    serve.run(ingress.bind(StalledEngine.bind()), name="stalled", route_prefix="/stalled")
    try:
        start = time.monotonic()
        response = httpx.get(server[0] + "/stalled/health", timeout=60)
        assert response.status_code == 503 and time.monotonic() - start >= 1.5
        error = response.json()["error"]
        assert error["code"] == "replica_unavailable" and "no engine replica answered within 1.5 s" in error["message"]
        assert httpx.get(server[0] + "/health", timeout=60).status_code == 200  # the real app's replicas answer
    finally:
        serve.delete("stalled")


def test_a_killed_replica_fails_its_stream_cleanly_retries_a_whole_answer_and_the_other_loads_from_redis(server, http):
    """The replica owning d6 dies while it streams one answer and computes another (not streamed):
    the stream, which had sent tokens, ends with an ``error`` event; the other answer is retried on
    the other replica and comes back whole; d6, computed on the dead replica, is loaded from the
    shared Redis tier there, not recomputed."""
    import ray

    from ray import serve

    owner = ask(http, ["d6"], max_tokens=1)["lazyattn"]["replica"]  # d6 computed there, and written to Redis
    handle = serve.get_deployment_handle("engine", APP)
    deadline = time.monotonic() + 60
    while not any("redis" in h["where"] for h in handle.broadcast("holds", DOCS["d6"]).results(timeout_s=60)):
        assert time.monotonic() < deadline, "the tiers' writer did not store d6"  # polled, not timed
        time.sleep(0.05)
    whole = {}
    long_body = {"messages": [{"role": "user", "content": QUESTION}], "documents": ["d6"], "max_tokens": 2000,
                 "ignore_eos": True}
    retried = threading.Thread(target=lambda: whole.update(http.post("/v1/chat/completions", json={
        **long_body, "max_tokens": 300}).json()))
    with http.stream("POST", "/v1/chat/completions", json={**long_body, "stream": True}) as response:
        lines = response.iter_lines()
        next(line for line in lines if '"content": "w' in line)  # tokens are flowing
        retried.start()
        deadline = time.monotonic() + 60
        while not any(s["replica"] == owner and s["num_requests_running"] >= 2
                      for s in handle.broadcast("stats").results(timeout_s=60)):  # both answers run on the owner
            assert time.monotonic() < deadline, "the whole answer did not reach d6's owner"
            time.sleep(0.02)
        ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP}#engine#{owner}", namespace="serve"), no_restart=True)
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]" and '"error"' in rest[-2] and "replica" in rest[-2]
    retried.join(timeout=120)
    assert whole["lazyattn"]["replica"] != owner and whole["usage"]["completion_tokens"] == 300
    after = ask(http, ["d6"], max_tokens=1)
    assert after["lazyattn"]["replica"] not in (owner, None)
    assert after["lazyattn"]["stats"]["doc_tiers"] in ({"d6": "redis"}, {"d6": "kv"})  # kv: the retry loaded it
    assert whole["lazyattn"]["stats"]["doc_tiers"] == {"d6": "redis"}
    assert "lazyattn_request_retries_total 1.0" in http.get("/metrics").text  # the whole answer, once


def test_a_requests_remedies_reach_the_engine_over_http(server, http):
    """``remedies`` in the body (RemoteLazyAttention's ``remedies=``): the replica computes what an
    in-process engine computes for them; a bad one is 400 and the server keeps serving."""
    from lazyattn_rag.llm import LazyAttention
    from lazyattn_rag.remote import RemoteLazyAttention
    from lazyattn_rag.types.config import RequestRemedies

    greedy = SamplingParams(max_tokens=3, temperature=0.0)
    heads = RequestRemedies(recompute_chunk_head_tokens=4)
    with LazyAttention(dataclasses.replace(server[1], cache=CacheConfig(num_blocks=256, block_size=16))) as local:
        local.add_documents(list(DOCS.items()))
        expected = local.generate(QUESTION, ["d9", "d10"], sampling=greedy, remedies=heads)
    with RemoteLazyAttention(server[0]) as remote:
        got = remote.generate(QUESTION, ["d9", "d10"], sampling=greedy, remedies=heads)
        assert got.stats.num_recomputed_tokens == expected.stats.num_recomputed_tokens == 8
        assert got.text == expected.text
        with pytest.raises(ValueError, match="recompute"):
            remote.generate(QUESTION, ["d9"], sampling=greedy, remedies=RequestRemedies(
                recompute_chunk_head_tokens=4, recompute_selective_ratio=0.1))
    bad = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": QUESTION}],
                                                  "documents": ["d9"], "remedies": {"recompute_chunk_head_tokens": -1}})
    assert bad.status_code == 400 and "recompute_chunk_head_tokens" in bad.text
    for loose in ({"recompute_chunk_head_tokens": "2"}, {"recompute_chunk_head_tokens": True},
                  {"recompute_chunk_head_tokens": 1 << 40}, {"chunk_attention_scaling": 1}):
        refused = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": QUESTION}],
                                                          "documents": ["d9"], "remedies": loose})
        assert refused.status_code == 400, (loose, refused.text)
    answer = ask(http, ["d9"])  # not streamed: the timings of every stage, in order
    assert answer["choices"][0]["finish_reason"] == "length"
    t = answer["lazyattn"]["timings"]
    assert (t["ingress_received"] <= t["ingress_sent"] <= t["replica_received"] <= t["replica_submitting"]
            <= t["replica_first_event"] <= t["ingress_first_event"])
    assert http.head("/health").status_code == 200


def test_a_registry_outage_keeps_answering_and_refuses_writes_by_name(server, http, module_redis_server):
    """Redis (the registry's store here) down: requests by id and pasted ones are answered from the
    ingress's last view of the registry, /health says degraded and why, registering is a 503
    naming the registry (a break-it trial found 500s for everything, /health ok). Last in this
    module: it stops the module's Redis."""
    module_redis_server.stop()
    try:
        health = http.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "degraded", health.text
        assert "ConnectionError" in health.json()["registry"]
        added = http.post("/v1/documents", json={"documents": [{"id": "late", "text": "w1 w2 w3"}]})
        assert added.status_code == 503 and added.json()["error"]["code"] == "registry_unavailable", added.text
        assert ask(http, ["d1"])["usage"]["completion_tokens"] > 0
        pasted = http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": f"context :\n\n{DOCS['d2']}\n\nQuestion : {QUESTION}"}],
            "max_tokens": 2})
        assert pasted.status_code == 200, pasted.text
        assert pasted.json()["lazyattn"]["stats"]["doc_sources"] == {"d2": "matched"}
    finally:
        module_redis_server.start()
