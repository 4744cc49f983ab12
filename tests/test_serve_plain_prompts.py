"""Unchanged OpenAI clients against ``lazyattn serve`` (issue 36): the plain ``openai`` package,
LangChain ``ChatOpenAI`` under the tutorial LCEL chain (``format_docs``), LlamaIndex ``OpenAILike``
under ``index.as_query_engine()``, each pasting its retrieved texts into the messages as these
apps do. One app on a real local Ray cluster: one CPU replica of the default SmolLM2 (its chat
template and tokenizer, as users run it), the registry in a real Redis, greedy answers.

How many prompt tokens a request computed is read from ``usage`` where the client returns it,
and from the replica's ``/metrics`` counter otherwise (one replica: its counter is the app's)."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("ray.serve")

from lazyattn_rag import EngineConfig  # noqa: E402
from lazyattn_rag.types.config import CacheConfig  # noqa: E402
from tests.integrations_kit import ChatSuiteSettings  # noqa: E402

APP = "lazyattn-plain"
DOCS = {
    "eiffel": "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris. It was completed in "
              "1889 as the entrance arch of the World's Fair and is 330 metres tall.",
    "fuji": "Mount Fuji is the highest mountain in Japan, at 3,776 metres. It is an active stratovolcano on the "
            "island of Honshu, about 100 kilometres south-west of Tokyo.",
    "nile": "The Nile is a major north-flowing river in north-eastern Africa. It is about 6,650 kilometres long "
            "and flows into the Mediterranean Sea.",
    "wall": "The Great Wall of China is a series of fortifications built across the historical northern borders "
            "of ancient Chinese states to guard against raids.",
    "amazon": "The Amazon rainforest covers much of the Amazon basin of South America. Most of it lies in Brazil, "
              "with parts in Peru and Colombia.",
    "sahara": "The Sahara is a desert on the African continent. With an area of about 9.2 million square "
              "kilometres it is the largest hot desert in the world.",
}
MAX_TOKENS = 6
SERVED_NAME, ORIGIN = "smollm2-rag", "https://app.example"  # --served-model-name, --allowed-origins


def engine_config(model_dir, cache_dir, redis_url) -> EngineConfig:
    return EngineConfig(model=str(model_dir), device="cpu", dtype="float32", attention_backend="torch",
                        cache_dir=cache_dir, generation_config="none",
                        cache=CacheConfig(num_blocks=2048, redis_url=redis_url))


def start_app(config, port):
    from ray import serve

    from lazyattn_rag.serve import ServeConfig, build_app

    serve.run(build_app(config, ServeConfig(num_replicas=1, num_cpus_per_replica=0, port=port,
                                            served_model_name=SERVED_NAME, allowed_origins=(ORIGIN,))),
              name=APP, route_prefix="/")


@pytest.fixture(scope="module")
def server(smollm2_dir, module_redis_server, serve_cluster, tmp_path_factory):
    """``(base_url, engine_config)``: one replica of SmolLM2, the registry in Redis."""
    from ray import serve

    config = engine_config(smollm2_dir, tmp_path_factory.mktemp("cache"), module_redis_server.url)
    url, port = serve_cluster
    start_app(config, port)
    try:
        yield url, config
    finally:
        serve.delete(APP)


@pytest.fixture(scope="module")
def http(server):
    import httpx

    with httpx.Client(base_url=server[0], timeout=300) as client:
        response = client.post("/v1/documents", json={"documents": [{"id": k, "text": v} for k, v in DOCS.items()]})
        assert response.status_code == 200, response.text
        yield client


@pytest.fixture(scope="module")
def openai_client(server, http):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server[0] + "/v1", api_key="unused")
    return client, client.models.list().data[0].id


def metric(http, name: str, **labels) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    total = 0.0
    for line in http.get("/metrics").text.splitlines():
        m = re.fullmatch(rf"{name}(?:\{{(.*)\}})? (\S+)", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def computed(http) -> float:
    return metric(http, "lazyattn_computed_prompt_tokens_total")


def by_id(openai_client, question: str, doc_ids: list[str], namespace: str = ""):
    """The answer with the documents given by id (asked twice: the engine's own prompt head is
    cached after the first, as it is in a running service)."""
    client, model = openai_client
    for _ in range(2):
        out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                             max_tokens=MAX_TOKENS, temperature=0,
                                             extra_body={"documents": doc_ids, "namespace": namespace})
    return out


def computed_of(response) -> int:
    return response.usage.prompt_tokens - response.usage.prompt_tokens_details.cached_tokens


def stats_of(response) -> dict:
    return response.model_extra["lazyattn"]["stats"]


# --- documents registered once, found in the pasted text -------------------------------------------
def paste(doc_ids, question):
    return ("Answer the question from the documents.\n\nDocuments:\n\n" + "\n\n".join(DOCS[i] for i in doc_ids)
            + f"\n\nQuestion: {question}")


def test_the_openai_package_pasting_registered_documents_computes_what_the_id_path_does(openai_client):
    client, model = openai_client

    def ask(doc_ids, question):
        return client.chat.completions.create(model=model, messages=[
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": paste(doc_ids, question)}], max_tokens=MAX_TOKENS, temperature=0)

    ask(["nile", "wall", "sahara"], "Which is the longest?")  # the app's earlier traffic
    ask(["eiffel", "fuji", "amazon"], "When was the Eiffel Tower completed?")
    second = ask(["amazon", "eiffel", "fuji"], "How tall is Mount Fuji?")  # the same documents, shuffled
    stats = stats_of(second)
    assert stats["docs_hit"] == ["amazon", "eiffel", "fuji"] and stats["docs_missed"] == []
    assert stats["doc_sources"] == dict.fromkeys(["amazon", "eiffel", "fuji"], "matched")
    reference = by_id(openai_client, "How tall is Mount Fuji?", ["amazon", "eiffel", "fuji"])
    assert computed_of(second) <= computed_of(reference) + 5, (computed_of(second), computed_of(reference))
    details = second.usage.prompt_tokens_details
    assert details.cached_tokens == details.model_extra["exact_prefix_tokens"] + details.model_extra["shifted_tokens"]
    assert details.model_extra["exact_prefix_tokens"] > 0 and details.model_extra["shifted_tokens"] >= 3 * 25


# LangChain's LCEL RAG example ("Answer the question based only on the following context"), and the
# rlm/rag-prompt hub prompt that its RAG tutorial pulls (the question before the context)
LCEL_TEMPLATES = {
    "lcel": "Answer the question based only on the following context:\n{context}\n\nQuestion: {question}\n",
    "rlm/rag-prompt": "You are an assistant for question-answering tasks. Use the following pieces of retrieved "
                      "context to answer the question. If you don't know the answer, just say that you don't know. "
                      "Use three sentences maximum and keep the answer concise.\nQuestion: {question} \nContext: "
                      "{context} \nAnswer:",
}
# what each template has the model read per question besides the question and the documents (after the
# question or between it and them): no cache holds it, since the question comes before it
PER_QUESTION_TEXT = {"lcel": "", "rlm/rag-prompt": " \nContext:Answer:"}


@pytest.mark.parametrize("template", LCEL_TEMPLATES)
def test_langchain_chatopenai_under_the_tutorial_lcel_chain(server, http, openai_client, template):
    pytest.importorskip("langchain_openai")
    from langchain_core.documents import Document
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.runnables import RunnableLambda, RunnablePassthrough
    from langchain_openai import ChatOpenAI

    retrieved = {"What flows into the Mediterranean?": ["nile", "sahara", "wall"],
                 "Where is the Great Wall?": ["wall", "nile", "sahara"],
                 "Which desert is the largest?": ["sahara", "wall", "nile"]}
    retriever = RunnableLambda(lambda q: [Document(page_content=DOCS[i], id=i) for i in retrieved[q]])

    def format_docs(docs):
        return "\n\n".join(doc.page_content for doc in docs)

    llm = ChatOpenAI(model=openai_client[1], base_url=server[0] + "/v1", api_key="unused", temperature=0,
                     max_tokens=MAX_TOKENS)
    chain = ({"context": retriever | format_docs, "question": RunnablePassthrough()}
             | ChatPromptTemplate.from_template(LCEL_TEMPLATES[template]) | llm | StrOutputParser())
    for question in retrieved:  # the last two: the same documents, shuffled
        before = computed(http)
        assert chain.invoke(question)
        spent = computed(http) - before
    reference = by_id(openai_client, "Which desert is the largest?", retrieved["Which desert is the largest?"])
    extra = http.post("/tokenize", json={"prompt": PER_QUESTION_TEXT[template], "add_special_tokens": False}
                      ).json()["count"] if PER_QUESTION_TEXT[template] else 0
    assert spent <= computed_of(reference) + extra + 5, (spent, computed_of(reference), extra)
    assert metric(http, "lazyattn_document_placements_total", source="matched") >= 6


def openailike_query_engine(server, openai_client, ids, **llm_options):
    """LlamaIndex's ``index.as_query_engine()`` over ``ids``' documents with ``OpenAILike`` pointed
    at the server (``llm_options``: the app's own, e.g. ``is_chat_model``)."""
    pytest.importorskip("llama_index.llms.openai_like")
    from llama_index.core import Document as LIDocument
    from llama_index.core import VectorStoreIndex
    from llama_index.llms.openai_like import OpenAILike

    from tests.integrations_kit import bow_llamaindex_embedding

    index = VectorStoreIndex.from_documents([LIDocument(text=DOCS[i], id_=i) for i in ids],
                                            embed_model=bow_llamaindex_embedding())
    llm = OpenAILike(model=openai_client[1], api_base=server[0] + "/v1", api_key="unused", max_tokens=MAX_TOKENS,
                     temperature=0, **llm_options)
    return index.as_query_engine(llm=llm, similarity_top_k=3)


def test_llamaindex_openailike_under_as_query_engine(server, http, openai_client):
    ids = ["eiffel", "fuji", "amazon"]
    engine = openailike_query_engine(server, openai_client, ids, is_chat_model=True, context_window=2048)
    questions = ["Which mountain is the highest in Japan, Mount Fuji?", "When was the Eiffel Tower in Paris completed?",
                 "Where does the Amazon rainforest lie?"]
    orders = []
    for question in questions:
        before = computed(http)
        response = engine.query(question)
        spent = computed(http) - before
        orders.append([n.node.ref_doc_id for n in response.source_nodes])
    assert orders[1] != orders[2] and sorted(orders[2]) == sorted(ids)  # the same documents, shuffled
    reference = by_id(openai_client, questions[2], orders[2])
    assert spent <= computed_of(reference) + 5, (spent, computed_of(reference))


# --- passages learned with nothing registered -----------------------------------------------------
PASSAGES = [
    "Copper is a chemical element with the symbol Cu and atomic number 29. It is a soft and ductile metal with "
    "very high thermal and electrical conductivity.",
    "The violin is a wooden string instrument in the violin family. It is the smallest and thus highest-pitched "
    "instrument in regular use in the family.",
    "Photosynthesis is the process by which plants use light energy to convert carbon dioxide and water into "
    "glucose and oxygen.",
]


def learned_prompt(order, question):
    return "Documents:\n\n" + "\n\n".join(PASSAGES[i] for i in order) + f"\n\nQuestion: {question}"


def test_passages_seen_before_are_learned_and_answer_as_the_id_path_at_the_same_placement(openai_client, http):
    client, model = openai_client

    def ask(order, question):
        return client.chat.completions.create(model=model, messages=[{"role": "user", "content": learned_prompt(
            order, question)}], max_tokens=MAX_TOKENS, temperature=0, extra_body={"namespace": "learning"})

    first = ask([0, 1, 2], "What is copper?")
    assert stats_of(first)["docs_hit"] == stats_of(first)["docs_missed"] == []  # seen once: computed as it is
    second = ask([2, 0, 1], "What is a violin?")
    assert len(stats_of(second)["docs_missed"]) == 3  # seen before: encoded as chunks now
    third = ask([1, 2, 0], "What does photosynthesis make?")
    stats = stats_of(third)
    assert len(stats["docs_hit"]) == 3 and set(stats["doc_sources"].values()) == {"learned"}
    assert third.usage.prompt_tokens_details.model_extra["shifted_tokens"] >= 3 * 20
    # by id, at the same placement: the same passages registered (another namespace: their own chunks)
    http.post("/v1/documents", json={"documents": [{"id": f"p{i}", "text": t} for i, t in enumerate(PASSAGES)],
                                     "namespace": "ids"})
    parts = ([{"type": "text", "text": "Documents:\n\n"}] + [{"type": "document", "id": f"p{i}"} for i in (1, 2, 0)]
             + [{"type": "text", "text": "\n\nQuestion: What does photosynthesis make?"}])
    placed = client.chat.completions.create(model=model, messages=[{"role": "user", "content": parts}],
                                            max_tokens=MAX_TOKENS, temperature=0, extra_body={"namespace": "ids"})
    assert stats_of(placed)["docs_missed"] == ["p1", "p2", "p0"]
    assert placed.usage.prompt_tokens == third.usage.prompt_tokens
    assert placed.choices[0].message.content == third.choices[0].message.content


# --- exact prefixes, and prompts with nothing to learn ---------------------------------------------
def test_a_byte_identical_repeat_computes_one_block_and_a_chats_next_turn_its_new_messages(openai_client):
    client, model = openai_client
    turn = [{"role": "system", "content": "You are a careful assistant who answers in one sentence. " * 4},
            {"role": "user", "content": "Explain what a hash table is and why lookups in it are fast on average."}]

    def ask(messages):
        return client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0)

    first, repeat = ask(turn), ask(turn)
    assert computed_of(first) == first.usage.prompt_tokens and computed_of(repeat) <= 16
    assert repeat.choices[0].message.content == first.choices[0].message.content
    follow = ask(turn + [{"role": "assistant", "content": first.choices[0].message.content},
                         {"role": "user", "content": "And a binary search tree?"}])
    assert follow.usage.prompt_tokens_details.model_extra["exact_prefix_tokens"] >= \
        first.usage.prompt_tokens // 16 * 16


ESSAY = "\n\n".join([
    "Rivers shape the land they cross. Over thousands of years a river cuts its valley, carries silt downstream "
    "and builds plains where it slows.",
    "Cities grew along rivers because water meant trade, food and power. Mills turned on their banks long before "
    "engines did.",
    "Today rivers are managed with dams and levees, which tame floods but also change the life in and around them.",
])
CODE = ("Why does this fail?\n\n```python\ndef load(path):\n    with open(path) as f:\n\n        data = f.read()\n\n"
        "    return json.loads(data)\n```\n\nIt raises NameError on the last line of the function shown above.")


@pytest.mark.parametrize("text", [ESSAY + "\n\nWhat is the main point?", CODE])
def test_a_prompt_with_no_recurring_passage_gets_the_same_tokens_as_a_plain_prompt(openai_client, http, text):
    client, model = openai_client
    messages = [{"role": "user", "content": text}]
    expected = http.post("/tokenize", json={"messages": messages}).json()["count"]  # the plain plan's
    out = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    stats = stats_of(out)
    assert out.usage.prompt_tokens == expected and stats["docs_hit"] == stats["docs_missed"] == []


def test_logprobs_come_in_openais_shape(openai_client):
    openai = pytest.importorskip("openai")
    client, model = openai_client
    messages = [{"role": "user", "content": "Name three colours."}]
    out = client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0, logprobs=True,
                                         top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 4
    assert "".join(c.token for c in content) == out.choices[0].message.content
    for c in content:  # greedy: the token picked is the most likely, and the top three come most likely first
        assert len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token and c.logprob <= 0
        assert [t.logprob for t in c.top_logprobs] == sorted((t.logprob for t in c.top_logprobs), reverse=True)
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0, stream=True,
                                            logprobs=True, top_logprobs=1, extra_body={"return_tokens_as_token_ids": True})
    streamed = [e for chunk in stream if chunk.choices and chunk.choices[0].logprobs
                for e in chunk.choices[0].logprobs.content]
    assert len(streamed) == 4 and all(e.token.startswith("token_id:") for e in streamed)
    assert [e.logprob for e in streamed] == pytest.approx([c.logprob for c in content], abs=1e-4)
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model=model, messages=messages, max_tokens=1, logprobs=True, top_logprobs=21)


def test_metrics_split_the_reused_tokens(http):
    text = http.get("/metrics").text
    for name in ("exact_prefix_tokens", "shifted_tokens", "computed_prompt_tokens", "recomputed_tokens"):
        assert f'lazyattn_{name}_total{{model_name="{SERVED_NAME}",replica="' in text
    assert metric(http, "lazyattn_shifted_tokens_total") > 0 and metric(http, "lazyattn_exact_prefix_tokens_total") > 0
    for source in ("id", "matched", "learned"):
        assert metric(http, "lazyattn_document_placements_total", source=source) > 0


def test_a_restarted_server_still_serves_the_registered_ids(server, http, openai_client):
    """The app is deleted and deployed again (ingress and replica restart, Redis stays): the
    registry comes back from Redis, so ids registered before are placed, not refused."""
    from ray import serve

    serve.delete(APP)
    start_app(server[1], int(server[0].rsplit(":", 1)[1]))
    listed = {d["id"] for d in http.get("/v1/documents").json()["data"]}
    assert set(DOCS) <= listed
    out = by_id(openai_client, "How tall is the Eiffel Tower?", ["eiffel"])
    assert stats_of(out)["docs_missed"] + stats_of(out)["docs_hit"] == ["eiffel"]


# --- /v1/completions: the prompt in the caller's own template ---------------------------------------
def test_completions_place_the_registered_documents_found_in_the_prompt(openai_client, http):
    client, model = openai_client
    prompt = paste(["fuji", "nile"], "Which is longer?") + "\nAnswer:"

    def complete():  # ignore_eos (vLLM's extension): SmolLM2 ends a raw prompt of this shape at once
        return client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                         extra_body={"ignore_eos": True})

    first, second = complete(), complete()
    assert first.object == "text_completion" and first.id.startswith("cmpl-") and first.choices[0].text
    assert stats_of(second)["docs_hit"] == ["fuji", "nile"]
    assert stats_of(second)["doc_sources"] == {"fuji": "matched", "nile": "matched"}
    assert second.choices[0].text == first.choices[0].text and second.choices[0].finish_reason == "length"
    details = second.usage.prompt_tokens_details
    assert details.model_extra["shifted_tokens"] >= 2 * 25 and details.model_extra["exact_prefix_tokens"] > 0
    assert second.usage.prompt_tokens == first.usage.prompt_tokens
    assert second.usage.completion_tokens == MAX_TOKENS
    # the documents field places its documents before the prompt's text
    by_field = client.completions.create(model=model, prompt="Question: Which is longer?\nAnswer:",
                                         max_tokens=MAX_TOKENS, temperature=0,
                                         extra_body={"documents": ["nile", "fuji"], "ignore_eos": True})
    assert stats_of(by_field)["docs_hit"] == ["nile", "fuji"] and by_field.choices[0].text


def test_completions_stream_token_ids_and_refusals(openai_client, http):
    openai = pytest.importorskip("openai")
    client, model = openai_client
    prompt = "The capital of France is"
    whole = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert all(c.object == "text_completion" for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    ids = http.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=MAX_TOKENS, temperature=0)
    assert by_ids.choices[0].text == whole.choices[0].text and by_ids.usage.prompt_tokens == len(ids)
    assert client.completions.create(model=model, prompt=prompt, temperature=0).usage.completion_tokens == 16
    assert client.completions.create(model=model, prompt=prompt, temperature=0,  # null: as left out
                                     max_tokens=None).usage.completion_tokens == 16
    only_top = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=1.0,
                                         extra_body={"min_p": 1.0})  # keeps the most likely token: greedy
    assert only_top.choices[0].text == whole.choices[0].text
    echoed = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, echo=True)
    assert echoed.choices[0].text == prompt + whole.choices[0].text
    echoed_ids = list(client.completions.create(model=model, prompt=ids, max_tokens=MAX_TOKENS, temperature=0,
                                                echo=True, stream=True))
    assert "".join(c.choices[0].text for c in echoed_ids if c.choices) == prompt + whole.choices[0].text
    with pytest.raises(openai.BadRequestError, match="echo with logprobs"):
        client.completions.create(model=model, prompt=prompt, max_tokens=2, echo=True, logprobs=1)
    for field, value in (("suffix", "x"), ("best_of", 2), ("logprobs", 21),
                         ("tools", [{"type": "function", "function": {"name": "f"}}])):
        with pytest.raises(openai.BadRequestError, match=field):
            client.completions.create(model=model, prompt=prompt, max_tokens=2, extra_body={field: value})
    with pytest.raises(openai.BadRequestError, match="n must be in"):
        client.completions.create(model=model, prompt=prompt, max_tokens=2, n=0)


def test_n_answers_share_one_computed_prompt(openai_client, http):
    client, model = openai_client
    question = [{"role": "user", "content": "Name three rivers of Europe and say which is the longest."}]
    before = computed(http)
    out = client.chat.completions.create(model=model, messages=question, n=3, max_tokens=MAX_TOKENS, temperature=1.0,
                                         seed=4, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2] and all(c.message.content for c in out.choices)
    assert len({c.message.content for c in out.choices}) > 1  # three samples
    assert out.usage.completion_tokens == 3 * MAX_TOKENS
    assert computed(http) - before == computed_of(out)  # the prompt once, not three times
    chunks = list(client.chat.completions.create(model=model, messages=question, n=3, max_tokens=MAX_TOKENS,
                                                 temperature=1.0, seed=4, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    streamed = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
                for i in range(3)]
    assert streamed == [c.message.content for c in out.choices]  # the same seeds: the same answers
    assert sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason) == [0, 1, 2]
    assert chunks[-1].usage.completion_tokens == 3 * MAX_TOKENS
    texts = client.completions.create(model=model, prompt="The Nile flows into", n=2, max_tokens=MAX_TOKENS,
                                      temperature=0)
    assert [c.index for c in texts.choices] == [0, 1] and texts.choices[0].text == texts.choices[1].text


def test_completion_logprobs_are_the_engines_own_in_the_legacy_shape(server, openai_client):
    from lazyattn_rag import LazyAttention, SamplingParams

    client, model = openai_client
    prompt = "The capital of France is"
    whole = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0, logprobs=2,
                                      extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0, logprobs=2,
                                            stream=True, extra_body={"ignore_eos": True}))
    legacy = whole.choices[0].logprobs
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for lp in streamed for t in lp.tokens] == legacy.tokens and len(legacy.tokens) == 4
    assert [o for lp in streamed for o in lp.text_offset] == legacy.text_offset
    assert "".join(legacy.tokens) == whole.choices[0].text
    assert legacy.text_offset == [sum(len(t) for t in legacy.tokens[:i]) for i in range(4)]
    with LazyAttention(server[1]) as local:  # the server's engine configuration, in this process
        own = local.complete(prompt, SamplingParams(max_tokens=4, logprobs=2, ignore_eos=True))
    tokenizer = local.tokenizer
    assert [tokenizer.decode([t]) for t in own.token_ids] == legacy.tokens
    for position, (chosen, top) in enumerate(zip(own.token_ids, own.logprobs)):
        assert abs(legacy.token_logprobs[position] - top[chosen]) < 1e-4
        best = {tokenizer.decode([i]): v for i, v in sorted(top.items(), key=lambda kv: -kv[1])[:2]}
        served = legacy.top_logprobs[position]
        assert served.keys() == best.keys() and all(abs(served[k] - best[k]) < 1e-4 for k in best)


def test_llamaindex_openailike_with_its_defaults_answers_through_completions(server, http, openai_client):
    before = metric(http, "lazyattn_http_responses_total", route="/v1/completions")
    # is_chat_model=False: LlamaIndex's default, the completions route
    engine = openailike_query_engine(server, openai_client, ["nile", "sahara", "amazon"])
    for question in ("Which river is the longest?", "Which desert is the largest?"):
        engine.query(question)  # (SmolLM2 may end this raw prompt at once: an empty answer is the model's)
    assert metric(http, "lazyattn_http_responses_total", route="/v1/completions") == before + 2
    hits = metric(http, "lazyattn_document_placements_total", source="matched")
    engine.query("Where is the Amazon rainforest?")
    assert metric(http, "lazyattn_document_placements_total", source="matched") >= hits + 3


# --- the operator's routes and OpenAI's error shape ---------------------------------------------------
def test_version_detokenize_models_errors_and_cors(server, http, openai_client):
    import lazyattn_rag

    assert http.get("/version").json() == {"version": lazyattn_rag.__version__}
    models = http.get("/v1/models").json()["data"]
    assert [m["id"] for m in models] == [SERVED_NAME] and isinstance(models[0]["created"], int)
    ids = http.post("/tokenize", json={"prompt": "The Eiffel Tower", "add_special_tokens": False}).json()["tokens"]
    assert http.post("/detokenize", json={"tokens": ids}).json() == {"prompt": "The Eiffel Tower"}
    bad = http.post("/detokenize", json={"tokens": [ids[0], 10**9]})
    assert bad.status_code == 400 and "token id 1000000000" in bad.json()["error"]["message"]
    for method, path, status in (("GET", "/v1/nothing", 404), ("GET", "/v1/chat/completions", 405),
                                 ("GET", "/v1/documents?texts=maybe", 400),
                                 ("GET", "/v1/documents/version?namespace=a%00b", 400)):
        response = http.request(method, path)
        error = response.json()["error"]
        assert response.status_code == status and error["message"] and set(error) == {"message", "type", "param",
                                                                                      "code"}, response.text
    other = http.post("/v1/completions", json={"model": "another", "prompt": "x"})
    assert other.status_code == 404 and SERVED_NAME in other.json()["error"]["message"]
    preflight = http.options("/v1/chat/completions", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                                                               "Access-Control-Request-Headers": "authorization"})
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == ORIGIN
    refused = http.options("/v1/chat/completions", headers={"Origin": "https://elsewhere.example",
                                                             "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in refused.headers
    answer = http.post("/v1/completions", json={"prompt": "Paris is", "max_tokens": 2}, headers={"Origin": ORIGIN})
    assert answer.headers["access-control-allow-origin"] == ORIGIN and answer.json()["model"] == SERVED_NAME


# --- structured output -----------------------------------------------------------------------------
CITIES = ("Paris", "Berlin", "Madrid", "Rome", "Lisbon", "Vienna", "Prague", "Warsaw", "Dublin", "Oslo",
          "Athens", "Cairo", "Tokyo", "Seoul", "Lima", "Quito", "Nairobi", "Ottawa", "Sydney", "Hanoi")


def city_model():
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=40)
        country: str = Field(max_length=40)
        population: int = Field(ge=0, le=10**9)  # bounded: the small model may repeat a digit forever

    return City


def test_json_schema_answers_validate_for_twenty_prompts(openai_client):
    from concurrent.futures import ThreadPoolExecutor

    client, model = openai_client
    City = city_model()
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": City.model_json_schema(), "strict": True}}

    def ask_city(city):
        return client.chat.completions.create(
            model=model, max_tokens=64, temperature=0, response_format=fmt,
            messages=[{"role": "user", "content": f"Describe {city} as JSON: its name, country and population."}])

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask_city, CITIES))
    for answer in answers:
        assert answer.choices[0].finish_reason == "stop", answer.choices[0].message.content
        City.model_validate_json(answer.choices[0].message.content)
    assert len(answers) == 20
    parsed = client.chat.completions.parse(model=model, max_tokens=64, temperature=0, response_format=City,
                                           messages=[{"role": "user", "content": "Describe Paris as JSON."}])
    assert isinstance(parsed.choices[0].message.parsed, City)


def test_vllms_guided_fields_on_chat_and_completions_and_refusals(openai_client, http):
    openai = pytest.importorskip("openai")
    client, model = openai_client
    question = [{"role": "user", "content": "Is the Nile in Africa?"}]
    choice = client.chat.completions.create(model=model, messages=question, max_tokens=8, temperature=0.7, seed=1,
                                            extra_body={"guided_choice": ["yes", "no"]})
    assert choice.choices[0].message.content in ("yes", "no") and choice.choices[0].finish_reason == "stop"
    year = client.completions.create(model=model, prompt="The Eiffel Tower was completed in the year",
                                     max_tokens=8, temperature=0, extra_body={"guided_regex": r" ?1[0-9]{3}"})
    assert re.fullmatch(r" ?1[0-9]{3}", year.choices[0].text)
    streamed = client.chat.completions.create(model=model, messages=question, max_tokens=24, temperature=0,
                                              stream=True, response_format={"type": "json_object"})
    assert isinstance(json.loads("".join(c.choices[0].delta.content or "" for c in streamed if c.choices)), dict)
    vllm_new = client.chat.completions.create(model=model, messages=question, max_tokens=8, temperature=0,
                                              extra_body={"structured_outputs": {"choice": ["Africa", "Asia"]}})
    assert vllm_new.choices[0].message.content in ("Africa", "Asia")
    for body, words in (({"guided_regex": "("}, "regex does not compile"),
                        ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_regex, guided_choice"),
                        ({"guided_decoding_backend": "outlines", "guided_choice": ["a"]}, "guided_decoding_backend"),
                        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools")):
        with pytest.raises(openai.BadRequestError, match=re.escape(words)):
            client.chat.completions.create(model=model, messages=question, max_tokens=2, extra_body=body)
    assert client.chat.completions.create(model=model, messages=question, max_tokens=2).choices[0].message


def test_langchain_chatopenai_with_structured_output(server, openai_client):
    ChatOpenAI = pytest.importorskip("langchain_openai").ChatOpenAI
    _, model = openai_client
    City = city_model()
    llm = ChatOpenAI(base_url=server[0] + "/v1", api_key="unused", model=model, temperature=0, max_tokens=64)
    city = llm.with_structured_output(City, method="json_schema").invoke("Describe Rome as JSON.")
    assert isinstance(city, City) and city.name


# --- LangChain's standard chat-model suite through ChatOpenAI, structured output declared supported -----
try:
    from langchain_tests.integration_tests import ChatModelIntegrationTests
    from openai import BadRequestError
except ImportError:  # test extras; without them there is no suite to run
    ChatModelIntegrationTests, BadRequestError = object, Exception


class TestChatOpenAIThroughServe(ChatSuiteSettings, ChatModelIntegrationTests):
    """The suite LangChain's partner packages run, against this module's server through an
    unchanged ``ChatOpenAI`` (what it is told: ``ChatSuiteSettings``)."""

    base_url: str = ""

    @pytest.fixture(autouse=True)
    def _served(self, server):
        type(self).base_url = server[0] + "/v1"

    @property
    def chat_model_class(self):
        return pytest.importorskip("langchain_openai").ChatOpenAI

    @property
    def chat_model_params(self) -> dict:
        return {"model": SERVED_NAME, "base_url": self.base_url, "api_key": "unused", "max_tokens": 24,
                "stream_usage": True}  # usage on streams: ChatOpenAI asks only OpenAI's own URL for it by default

    @pytest.mark.xfail(reason="ChatOpenAI sends a Pydantic v1 schema as a tool call, which the server refuses by "
                              "name (400 'not supported by this server: tools')", strict=True,
                       raises=BadRequestError)
    def test_structured_output_pydantic_2_v1(self, model) -> None:
        super().test_structured_output_pydantic_2_v1(model)
