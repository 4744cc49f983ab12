"""Plain prompts tokenized in the ingress (issue 36, ``engine/planning/pretokenized.py``,
``lazyattn_rag/serve/ingress_tokens.py``): the replica takes the ingress's ids only for the exact
rendered text and the same tokenizer, its plan is the one it would have made itself, and it does
not tokenize the long text again. The replica class runs here without Ray, over the tiny engine;
``tests/test_serve_plain_prompts.py`` runs the same path through a real ``lazyattn serve``."""

from __future__ import annotations

import asyncio
import pickle

import pytest

from lazyattn_rag.engine.planning import pretokenized
from lazyattn_rag.engine.planning.pretokenized import Pretokenized, pretokenize, runs_digest
from lazyattn_rag.engine.planning.prompt import PromptTemplate
from lazyattn_rag.types.messages import DocumentRef, Message
from tests.tiny import PROMPT, tiny_llm, word_tokenizer, words

LONG = words(400, start=3)  # 400 word tokens, ~1,900 characters: over PRETOKENIZE_MIN_CHARS
MESSAGES = [Message("system", words(6, start=150)), Message("user", "Documents: " + LONG + " Question : w7 w8")]


@pytest.fixture(scope="module")
def llm():
    made = tiny_llm()
    yield made
    made.close()


class LongTextCalls:
    """Counts the tokenizer calls on texts of at least ``PRETOKENIZE_MIN_CHARS`` characters a
    template's encoders make (the work the ingress's ids replace)."""

    def __init__(self, template, monkeypatch):
        self.count = 0
        for encoder in {template.parsing, template.literal}:
            for name in ("ids", "ids_and_offsets"):
                monkeypatch.setattr(encoder, name, self._counting(getattr(encoder, name)))

    def _counting(self, fn):
        def call(text, *args, **kwargs):
            self.count += len(text) >= pretokenized.PRETOKENIZE_MIN_CHARS
            return fn(text, *args, **kwargs)
        return call


def plan_ids(llm, messages, known=None) -> list[list[int]]:
    plans = llm.client.call(lambda engine: engine.plan_plain_chat(messages, "", known_ids=known))
    return [p.token_ids() for p in plans]


def test_the_digest_tells_markup_from_literal_text_and_where_runs_split():
    base = runs_digest([("user: ", True), ("abc", False)])
    assert base == runs_digest((("user: ", True), ("abc", False)))
    assert len({base, runs_digest([("user: ", False), ("abc", False)]), runs_digest([("user:", True), (" abc", False)]),
                runs_digest([("user: abc", True)]), runs_digest([("user: ", True), ("abd", False)])}) == 5


def test_the_plan_with_the_ingress_ids_is_the_plan_without_and_skips_the_tokenizer(llm, monkeypatch):
    template = llm.engine.planner.template
    known = pretokenize(template, MESSAGES)
    assert known is not None and known.tokenizer_digest == template.tokenizer_digest
    assert len(known.ids_by_runs) == 1  # the whole rendered prompt is one text piece
    mine = plan_ids(llm, MESSAGES)
    calls = LongTextCalls(template, monkeypatch)
    assert plan_ids(llm, MESSAGES, Pretokenized.from_body(pickle.loads(pickle.dumps(known.as_body())))) == mine
    assert calls.count == 0
    assert plan_ids(llm, MESSAGES) == mine and calls.count == 1  # without them: tokenized here, once


def test_ids_are_taken_only_for_the_same_tokenizer_and_the_exact_text(llm):
    """A planted entry shows where the ids are taken: under the planner's own digest (its ids
    then form the prompt), not under another tokenizer's, nor for other text."""
    template = llm.engine.planner.template
    (digest, ids), = pretokenize(template, MESSAGES).ids_by_runs.items()
    planted = tuple(reversed(ids))  # in the vocabulary, in another order
    assert planted != ids
    taken = plan_ids(llm, MESSAGES, Pretokenized(template.tokenizer_digest, {digest: planted}))
    assert taken[-1][-len(planted):] == list(planted)  # the plain plan (the last one) is the planted ids
    mine = plan_ids(llm, MESSAGES)
    assert plan_ids(llm, MESSAGES, Pretokenized("another tokenizer", {digest: planted})) == mine
    other = [MESSAGES[0], Message("user", MESSAGES[1].content + " w9")]
    assert plan_ids(llm, other, Pretokenized(template.tokenizer_digest, {digest: planted})) == plan_ids(llm, other)


def test_what_the_ingress_leaves_to_the_replica(llm):
    template = llm.engine.planner.template
    assert pretokenize(template, [Message("user", words(20))]) is None  # short: not worth sending
    assert pretokenize(template, [Message("user", (LONG, DocumentRef("doc"), "w1"))]) is None  # places a document
    assert pretokenize(template, [Message("assistant", LONG), Message("assistant", LONG)]) is not None
    slow = type("Slow", (), {"tokenizer_digest": None})()
    assert pretokenize(slow, MESSAGES) is None  # a slow tokenizer's ids are never taken from elsewhere
    assert pretokenized.tokenizer_digest(None) is None


def test_the_digest_names_the_tokenizer_not_its_padding_or_truncation():
    """The shared tokenizer's JSON holds padding and truncation settings that its own calls
    change; the digest reads a private copy without them, so the ingress's copy and the
    replica's agree whatever either was last called with."""
    tokenizer = word_tokenizer()
    digest = PromptTemplate(tokenizer, PROMPT).tokenizer_digest
    tokenizer.backend_tokenizer.enable_truncation(64)
    tokenizer.backend_tokenizer.enable_padding(length=80)
    assert PromptTemplate(tokenizer, PROMPT).tokenizer_digest == digest
    assert PromptTemplate(word_tokenizer(prepend_bos=True), PROMPT).tokenizer_digest != digest


@pytest.mark.parametrize("body", [
    {"runs": []}, {"tokenizer": "d", "runs": [["k"]]}, {"tokenizer": "d", "runs": [["k", [1, -2]]]},
    {"tokenizer": "d", "runs": [["k", [1, 2.0]]]}, {"tokenizer": 3, "runs": []}, {"tokenizer": "d", "runs": {"k": 5}},
    {"tokenizer": "d", "runs": [["k", {4: 5}]]}, {"tokenizer": "d", "runs": [["k", b"\x04" * 8]]},
    {"tokenizer": "d", "runs": [[7, [1]]]}, {"tokenizer": "d", "runs": [["k", [2 ** 70]]]}, "ids",
])
def test_a_malformed_body_is_ignored_and_logged(body, caplog):
    """The ids only spare work: ids that do not parse are dropped (the replica tokenizes), never
    a failed request."""
    assert Pretokenized.from_body(body) is None
    assert "token ids sent with a request are ignored" in caplog.text
    assert Pretokenized.from_body({"tokenizer": "d", "runs": [["k", [0, 5]]]}) == Pretokenized("d", {"k": (0, 5)})


def test_the_ingress_sends_ids_once_it_has_the_template_and_the_replica_answers_the_same(monkeypatch):
    pytest.importorskip("ray.serve")
    from lazyattn_rag.serve.ingress_tokens import IngressTokenizer
    from lazyattn_rag.serve.replica import EngineReplica

    replica = EngineReplica(build=tiny_llm)

    class Handle:  # what Ray Serve's handle gives: the replica's answer, pickled across
        class prompt_tokenizer:
            @staticmethod
            async def remote():
                return pickle.loads(pickle.dumps(await replica.prompt_tokenizer()))

    wire = [{"role": m.role, "content": m.content} for m in MESSAGES]

    def payload():
        return {"messages": wire, "documents": [], "placed": [], "sampling": {"max_tokens": 4, "temperature": 0},
                "namespace": "", "transient": []}

    async def answer(body) -> str:
        return "".join(e.get("text", "") for e in [e async for e in replica.generate(body)] if "finish_reason" in e)

    async def run():
        tokens = IngressTokenizer(Handle())
        first = payload()
        await tokens.add_to(first)  # starts fetching the template; this request goes as before
        assert "pretokenized" not in first
        await tokens._loading
        sent = payload()
        await tokens.add_to(sent)
        assert set(sent["pretokenized"]) == {"tokenizer", "runs"}
        short = payload() | {"messages": [{"role": "user", "content": "w1 w2"}]}
        await tokens.add_to(short)
        assert "pretokenized" not in short
        expected = await answer(first)
        calls = LongTextCalls(replica.llm.engine.planner.template, monkeypatch)
        assert await answer(sent) == expected
        assert calls.count == 0
        stats = replica.llm.stats()
        assert (stats["num_ingress_ids_taken"], stats["num_ingress_ids_refused"]) == (1, 0)
        foreign = payload() | {"pretokenized": sent["pretokenized"] | {"tokenizer": "another tokenizer"}}
        assert await answer(foreign) == expected
        stats = replica.llm.stats()
        assert (stats["num_ingress_ids_taken"], stats["num_ingress_ids_refused"]) == (1, 1)
        off = IngressTokenizer(Handle(), enabled=False)
        unsent = payload()
        await off.add_to(unsent)
        assert "pretokenized" not in unsent and off._loading is None

    try:
        asyncio.run(run())
    finally:
        replica.llm.close()


def test_an_ingress_whose_template_fetch_fails_leaves_tokenizing_to_the_replicas_and_tries_again(caplog):
    """A failed fetch (a replica not ready yet) is logged and retried after a wait that
    doubles, not given up for the ingress's life; meanwhile requests go without ids."""
    pytest.importorskip("ray.serve")
    from lazyattn_rag.serve import ingress_tokens
    from lazyattn_rag.serve.ingress_tokens import IngressTokenizer

    calls = []
    llm = tiny_llm()

    class FailsTwice:
        class prompt_tokenizer:
            @staticmethod
            async def remote():
                calls.append(1)
                if len(calls) <= 2:
                    raise RuntimeError("replica not ready")
                return {"tokenizer": llm.tokenizer, "prompt": llm.config.prompt}

    async def run():
        tokens = IngressTokenizer(FailsTwice())
        body = {"messages": [{"role": "user", "content": LONG}]}
        await tokens.add_to(body)
        await tokens._loading
        await tokens.add_to(body)  # within the wait: not fetched again
        assert "pretokenized" not in body and len(calls) == 1 and tokens._retry_wait_s == 10
        tokens._retry_at = 0  # the wait is over
        await tokens.add_to(body)
        await tokens._loading
        assert len(calls) == 2 and tokens._retry_wait_s == 20 and tokens.template is None
        tokens._retry_at = 0
        await tokens.add_to(body)
        await tokens._loading
        await tokens.add_to(body)
        assert len(calls) == 3 and set(body["pretokenized"]) == {"tokenizer", "runs"}
        placed = {"messages": body["messages"], "placed": ["doc"]}  # the replica builds its own RAG prompt
        await tokens.add_to(placed)
        assert "pretokenized" not in placed

    try:
        asyncio.run(run())
    finally:
        llm.close()
    assert ingress_tokens.RETRY_FIRST_S == 5
    assert caplog.text.count("could not build their prompt template (RuntimeError: replica not ready)") == 2


ALTERNATING = ("{% for m in messages %}{% if loop.index0 % 2 == 0 and m['role'] != 'user' %}"
               "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
               "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")


def test_a_chat_template_that_refuses_the_messages_is_a_400_from_the_replica_not_an_ingress_failure():
    pytest.importorskip("ray.serve")
    from lazyattn_rag.serve.replica import EngineReplica

    tokenizer = word_tokenizer()
    tokenizer.chat_template = ALTERNATING
    replica = EngineReplica(build=lambda: tiny_llm(tokenizer=tokenizer))
    refused = [Message("assistant", LONG), Message("user", "w1")]
    try:
        assert pretokenize(replica.llm.engine.planner.template, refused) is None
        assert pretokenize(replica.llm.engine.planner.template, [Message("user", LONG)]) is not None
        body = {"messages": [{"role": m.role, "content": m.content} for m in refused], "documents": [], "placed": [],
                "sampling": {"max_tokens": 2}, "namespace": "", "transient": []}

        async def run():
            return [e async for e in replica.generate(body)]

        (event,) = asyncio.run(run())
        assert event["error"]["status"] == 400 and event["error"]["type"] == "TemplateError"
        assert "roles must alternate user/assistant" in event["error"]["message"]
    finally:
        replica.llm.close()
