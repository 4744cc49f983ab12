"""LangChain's own standard test suites for chat models (``langchain-tests``), the ones partner
integrations run, against ``ChatLazyAttention`` on the default model (SmolLM2, CPU).

Declared supported: structured output (the schema as a token mask). Declared unsupported (so
those tests skip): tool calling, image/audio/PDF inputs (a text model), JSON mode (it works, but
leaves the keys to the model, and the 135M default model drops one of the test's two).
"""

import pytest
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from lazyattn_rag.integrations.langchain import ChatLazyAttention
from tests.integrations_kit import SMOLLM2_ENGINE_KWARGS, ChatSuiteSettings


class _Settings(ChatSuiteSettings):
    @property
    def chat_model_class(self) -> type[ChatLazyAttention]:
        return ChatLazyAttention

    @property
    def chat_model_params(self) -> dict:
        from lazyattn_rag import SamplingParams

        # sampling= (not max_tokens=) so the suite's own max_tokens=10 can override it
        return {"sampling": SamplingParams(max_tokens=24), "engine_kwargs": SMOLLM2_ENGINE_KWARGS}

    @property
    def supports_model_override(self) -> bool:
        return True

    @property
    def model_override_value(self) -> str:
        """The default model's converted folder: a local path, as ``model=`` takes."""
        from lazyattn_rag.types.config import EngineConfig
        from lazyattn_rag.engine.model.model_loading import resolve_model

        return str(resolve_model(None, EngineConfig().resolved_cache_dir()).path)


class TestChatLazyAttentionUnit(_Settings, ChatModelUnitTests):
    pass


@pytest.mark.slow
class TestChatLazyAttentionIntegration(_Settings, ChatModelIntegrationTests):
    pass
