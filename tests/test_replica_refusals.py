"""A request the model's chat template refuses (a template that raises, e.g. "roles must
alternate", as Mistral's and Llama 2's do) is the caller's fault: the replica answers it with a
400 error event naming the template's message, not a 500, and keeps serving. The replica class
runs here without Ray, over the tiny engine with a chat template of its own."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("ray.serve")

from lazyattn_rag.serve.replica import EngineReplica  # noqa: E402
from tests.tiny import tiny_llm, word_tokenizer  # noqa: E402

ALTERNATING = ("{% for m in messages %}{% if loop.index0 % 2 == 0 and m['role'] != 'user' %}"
               "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
               "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")


def body(messages: list[dict]) -> dict:
    return {"messages": messages, "documents": [], "placed": [], "sampling": {"max_tokens": 2, "temperature": 0},
            "namespace": "", "transient": []}


def test_a_message_order_the_chat_template_refuses_is_a_400_and_the_replica_keeps_serving():
    tokenizer = word_tokenizer()
    tokenizer.chat_template = ALTERNATING
    replica = EngineReplica(build=lambda: tiny_llm(tokenizer=tokenizer))

    async def events(messages):
        return [e async for e in replica.generate(body(messages))]

    try:
        (event,) = asyncio.run(events([{"role": "assistant", "content": "w1 w2"}, {"role": "user", "content": "w3"}]))
        assert event["error"]["status"] == 400 and event["error"]["type"] == "TemplateError"
        assert event["error"]["message"] == "roles must alternate user/assistant"
        answered = asyncio.run(events([{"role": "user", "content": "w3 w4"}]))
        assert answered[-1]["finish_reason"] == "length" and "error" not in answered[-1]
    finally:
        replica.llm.close()
