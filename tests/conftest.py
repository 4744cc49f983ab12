"""Shared test setup. Kernels run under Triton's interpreter when no CUDA device is present; this
must be set before anything imports triton, so it lives at the top of the first conftest."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
    """The default SmolLM2 converted to safetensors (once per session; uses the user cache dir)."""
    from lazyattn_rag.types.config import EngineConfig
    from lazyattn_rag.engine.model_loading import resolve_model

    return resolve_model(None, EngineConfig().resolved_cache_dir()).path


@pytest.fixture(scope="session")
def smollm2(smollm2_dir):
    """One shared LazyAttention over the default model (CPU, float32, torch backend)."""
    from lazyattn_rag.llm import LazyAttention

    from lazyattn_rag import EngineConfig
    from tests.integrations_kit import SMOLLM2_ENGINE_KWARGS

    return LazyAttention.shared(EngineConfig.from_dict(SMOLLM2_ENGINE_KWARGS))
