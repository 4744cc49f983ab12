"""Framework conventions: construction from settings, to_dict/from_dict, per-call options, one
event pair per call, the no-reuse warning, prompts, token counting, unsupported features."""

import asyncio
import logging

import pytest
from langchain_core.messages import HumanMessage
from llama_index.core.base.llms.types import ChatMessage
from llama_index.core.callbacks import CallbackManager, TokenCountingHandler
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.schema import NodeWithScore, TextNode

from lazyattn_rag import SamplingParams
from lazyattn_rag.integrations.langchain import ChatLazyAttention
from lazyattn_rag.integrations.llamaindex import LazyAttentionLLM, LazyAttentionSynthesizer
from tests.integrations_kit import SMOLLM2_ENGINE_KWARGS, tiny_engine
from tests.tiny import words

LONG_TEXT = words(40, 7)  # a document of the tiny model's words (long enough to be matched)
RAG_PROMPT = "Use the context below to answer.\nContext:\n" + "Some retrieved passage text here. " * 12


@pytest.fixture(scope="module")
def engine():
    return tiny_engine()


class EventLog(BaseEventHandler):
    """Names of the instrumentation events seen (LLM and synthesize ones)."""

    names: list = []

    def handle(self, event, **kwargs):
        name = type(event).__name__
        if name.startswith(("LLM", "Synthesize")) and "InProgress" not in name:
            self.names.append(name)


@pytest.fixture
def events():
    log = EventLog(names=[])
    root = get_dispatcher()
    root.add_event_handler(log)
    yield log.names
    root.event_handlers.remove(log)


def test_llamaindex_llm_from_settings_round_trips_through_to_dict(smollm2):
    llm = LazyAttentionLLM(max_tokens=3, temperature=0.0, engine_kwargs=SMOLLM2_ENGINE_KWARGS)
    data = llm.to_dict()
    assert data["max_tokens"] == 3 and data["engine_kwargs"] == SMOLLM2_ENGINE_KWARGS and data["model"] is None
    again = LazyAttentionLLM.from_dict(data)
    assert again.engine is smollm2  # one engine per configuration per process
    out = again.complete("Say hello.")
    assert out.additional_kwargs["lazyattn"]["stats"]["num_output_tokens"] <= 3 and out.raw["usage"]
    margin = smollm2.max_model_len - again.metadata.context_window  # chat markup and document token edges
    assert 128 <= margin < 200 and again.metadata.num_output == 3


def test_settings_are_validated_at_construction():
    with pytest.raises(ValueError, match="unknown sampling_kwargs.*accepted"):
        LazyAttentionLLM(sampling_kwargs={"beam_width": 2})
    with pytest.raises(ValueError, match="unknown EngineConfig field"):
        ChatLazyAttention(engine_kwargs={"devices": "cpu"})
    with pytest.raises(ValueError, match="context_window"):
        LazyAttentionLLM(engine_kwargs={"max_model_len": 100})
    with pytest.raises(ValueError):
        ChatLazyAttention(top_p=0.0)


@pytest.mark.parametrize("call", ["complete", "stream_complete", "chat", "stream_chat", "acomplete", "achat",
                                  "astream_complete", "astream_chat"])
def test_one_llm_event_pair_and_one_token_count_per_call_with_per_call_max_tokens(engine, events, call):
    counter = TokenCountingHandler()
    llm = LazyAttentionLLM(engine, SamplingParams(max_tokens=8, ignore_eos=True),
                           callback_manager=CallbackManager([counter]))
    arg = "w1 w2 w3" if "complete" in call else [ChatMessage(role="user", content="w1 w2 w3")]

    async def consume_async():
        result = await getattr(llm, call)(arg, max_tokens=2)
        if call.startswith("astream"):
            last = None
            async for last in result:
                pass
            return last
        return result

    if call.startswith("a"):
        final = asyncio.run(consume_async())
    else:
        result = getattr(llm, call)(arg, max_tokens=2)
        final = list(result)[-1] if call.startswith("stream") else result
    stats = final.additional_kwargs["lazyattn"]["stats"]
    assert stats["num_output_tokens"] == 2  # the per-call max_tokens, not the default 8
    kind = "Completion" if "complete" in call else "Chat"
    assert events == [f"LLM{kind}StartEvent", f"LLM{kind}EndEvent"]
    assert len(counter.llm_token_counts) == 1
    assert counter.llm_token_counts[0].prompt_token_count == stats["num_prompt_tokens"]
    assert counter.llm_token_counts[0].completion_token_count == 2


def test_unknown_call_keywords_raise_with_the_accepted_names(engine):
    llm = LazyAttentionLLM(engine)
    with pytest.raises(TypeError, match=r"unsupported keyword argument\(s\) \['tools'\].*max_tokens"):
        llm.complete("w1", tools=[])
    model = ChatLazyAttention(engine=engine)
    with pytest.raises(TypeError, match=r"\['frobnicate'\].*temperature"):
        model.invoke("w1", frobnicate=True)


def test_langchain_per_call_max_tokens_stop_and_token_counts(engine):
    model = ChatLazyAttention(engine=engine, sampling=SamplingParams(max_tokens=8, ignore_eos=True))
    message = model.invoke([HumanMessage("w1 w2 w3")], max_tokens=2)
    assert message.usage_metadata["output_tokens"] == 2
    full = model.invoke([HumanMessage("w1 w2 w3")])
    assert message.content == " ".join(full.content.split()[:2]) or full.content.startswith(message.content)
    second_word = full.content.split()[1]
    cut = model.invoke([HumanMessage("w1 w2 w3")], stop=[second_word])
    assert second_word not in cut.content and cut.response_metadata["finish_reason"] == "stop"
    ids = engine.tokenizer("w1 w2 w3 w4", add_special_tokens=False)["input_ids"]
    assert model.get_token_ids("w1 w2 w3 w4") == ids and model.get_num_tokens("w1 w2 w3 w4") == len(ids)


def test_unsupported_features_say_so(engine):
    model = ChatLazyAttention(engine=engine)
    with pytest.raises(NotImplementedError, match="does not support tool calling"):
        model.bind_tools([])
    with pytest.raises(ValueError, match="unknown method 'tools'; accepted: json_schema, function_calling, json_mode"):
        model.with_structured_output({"title": "T", "type": "object"}, method="tools")
    with pytest.raises(ValueError, match="needs a schema"):
        model.with_structured_output(None)
    with pytest.raises(TypeError, match="tools"):  # passed to the model's calls, as ChatOpenAI does: refused there
        model.with_structured_output({"title": "T", "type": "object"}, tools=[]).invoke("w1")


def test_the_no_reuse_warning_comes_once_per_llm_and_not_when_a_document_is_placed(engine, caplog):
    caplog.set_level(logging.WARNING, logger="lazyattn_rag.integrations")
    llm = LazyAttentionLLM(engine, SamplingParams(max_tokens=1))
    plain = llm.complete(RAG_PROMPT)
    assert "reason" in plain.additional_kwargs["lazyattn"]["prompt_match"]
    llm.complete(RAG_PROMPT)
    warnings = [r for r in caplog.records if "reuses no cached document" in r.getMessage()]
    assert len(warnings) == 1 and "no documents are known" in warnings[0].getMessage()
    llm.complete("w1 w2")  # short, nothing RAG-like: no warning (and none again anyway)

    engine.add_document("placed", LONG_TEXT)
    caplog.clear()
    other = LazyAttentionLLM(engine, SamplingParams(max_tokens=1))
    out = other.complete("Context: " + LONG_TEXT + "\n" + RAG_PROMPT)
    assert out.additional_kwargs["lazyattn"]["doc_ids"] == ["placed"]
    assert not [r for r in caplog.records if "reuses no cached document" in r.getMessage()]
    model = ChatLazyAttention(engine=engine, sampling=SamplingParams(max_tokens=1))
    model.invoke([HumanMessage(RAG_PROMPT.replace("passage", "passages"))])
    warnings = [r for r in caplog.records if "reuses no cached document" in r.getMessage()]
    assert len(warnings) == 1 and "none of the" in warnings[0].getMessage()
    engine.remove_document("placed")


def test_synthesizer_prompts_are_customizable_and_it_emits_the_default_paths_events(engine, events):
    from llama_index.core import PromptTemplate
    from llama_index.core.response_synthesizers import get_response_synthesizer

    llm = LazyAttentionLLM(engine, SamplingParams(max_tokens=2, ignore_eos=True))
    nodes = [NodeWithScore(node=TextNode(id_="n1", text=words(20, 3)), score=1.0),
             NodeWithScore(node=TextNode(id_="n2", text=words(24, 60)), score=0.5)]
    default = get_response_synthesizer(llm=llm, response_mode="compact")
    default.synthesize("w1 w2", nodes)
    default_events = list(events)
    events.clear()
    ours = LazyAttentionSynthesizer(llm)
    assert ours.get_prompts() == {"text_qa_template": None}
    by_id = ours.synthesize("w1 w2", nodes)
    assert events == default_events == ["SynthesizeStartEvent", "LLMPredictStartEvent", "LLMChatStartEvent",
                                         "LLMChatEndEvent", "LLMPredictEndEvent", "SynthesizeEndEvent"]
    assert by_id.metadata["lazyattn"]["doc_ids"] == ["n1", "n2"]

    template = PromptTemplate("w150 w151 {context_str} Question : {query_str}")
    ours.update_prompts({"text_qa_template": template})
    assert ours.get_prompts()["text_qa_template"].template == template.template
    custom = ours.synthesize("w1 w2", nodes)
    meta = custom.metadata["lazyattn"]
    assert meta["doc_ids"] == ["n1", "n2"] and meta["stats"]["docs_hit"] == ["n1", "n2"]  # placed from the cache
    assert meta["calls"][0]["prompt_match"]["num_candidates"] >= 2


def test_a_step_inside_a_framework_query_that_retrieved_nothing_yet_does_not_warn(engine, caplog):
    """condense_question chat mode: the rewrite call runs before retrieval, its prompt speaks of
    "context" and documents of earlier turns are registered; it is no RAG prompt: no warning."""
    from llama_index.core import VectorStoreIndex
    from llama_index.core.embeddings import MockEmbedding

    caplog.set_level(logging.WARNING, logger="lazyattn_rag.integrations")
    llm = LazyAttentionLLM(engine, SamplingParams(max_tokens=2, ignore_eos=True))
    index = VectorStoreIndex([TextNode(id_="cq", text=LONG_TEXT)], embed_model=MockEmbedding(embed_dim=8))
    chat = index.as_chat_engine(chat_mode="condense_question", llm=llm, similarity_top_k=1)
    chat.chat("w1 w2")
    second = chat.chat("w3 w4 " + "and what about the context of that? " * 10)
    assert not [r for r in caplog.records if "reuses no cached document" in r.getMessage()]
    assert second.response  # answered (the query engine placed the node)
    engine.remove_document("cq")


def test_a_streamed_summary_has_zero_stats_until_the_stream_is_read(engine):
    from llama_index.core import VectorStoreIndex
    from llama_index.core.embeddings import MockEmbedding

    from lazyattn_rag.integrations.llamaindex import as_query_engine

    llm = LazyAttentionLLM(engine, SamplingParams(max_tokens=2, ignore_eos=True))
    index = VectorStoreIndex([TextNode(id_="zs", text=LONG_TEXT)], embed_model=MockEmbedding(embed_dim=8))
    # (the id path: llama-index-core 0.14.22-0.14.24's own refine read a whole stream before returning it)
    response = as_query_engine(index, llm, 1, streaming=True).query("w1")
    before = response.metadata["lazyattn"]
    assert before["stats"]["num_prompt_tokens"] == 0 and before["finish_reason"] is None
    "".join(response.response_gen)
    assert before["stats"]["num_prompt_tokens"] > 0 and before["stats"]["docs_missed"] == ["zs"]
    engine.remove_document("zs")
