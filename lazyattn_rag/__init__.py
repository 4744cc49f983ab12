"""lazyattn-rag: position-agnostic KV reuse for retrieval-augmented generation.

Documents' K/V are cached once and placed at any offset of any prompt; their rotary
position encoding is applied at attention time (LazyAttention, ICML 2026).
"""

from importlib.metadata import version

from lazyattn_rag.types.config import CacheConfig, EngineConfig, PromptConfig, RequestRemedies, SchedulerConfig
from lazyattn_rag.types.documents import Document
from lazyattn_rag.types.errors import (
    CacheCapacityError,
    DocumentTooLongError,
    EmptyInputError,
    LazyAttentionError,
    PromptTooLongError,
    UnknownDocumentError,
)
from lazyattn_rag.types.messages import DocumentRef, Message
from lazyattn_rag.types.outputs import Completion, FidelityReport, RequestStats, StreamDelta
from lazyattn_rag.types.sampling_params import SamplingParams
from lazyattn_rag.types.structured_output import StructuredOutputParams

__version__ = version("lazyattn-rag")  # pyproject.toml's, as installed

__all__ = [
    "AsyncLazyAttention", "CacheCapacityError", "CacheConfig", "Completion", "Document", "DocumentRef", "DocumentTooLongError", "EmptyInputError",
    "EngineConfig", "FidelityReport", "LazyAttention", "LazyAttentionError", "Message", "PromptConfig", "PromptTooLongError", "RequestRemedies",
    "RequestStats",
    "SamplingParams", "SchedulerConfig", "StreamDelta", "StructuredOutputParams", "UnknownDocumentError",
]


def __getattr__(name: str):  # keeps `import lazyattn_rag` light: no torch (~1-2 s) until used
    if name == "LazyAttention":
        from lazyattn_rag.llm import LazyAttention

        return LazyAttention
    if name == "AsyncLazyAttention":
        from lazyattn_rag.async_llm import AsyncLazyAttention

        return AsyncLazyAttention
    raise AttributeError(name)
