"""lazyattn-rag: position-agnostic KV reuse for retrieval-augmented generation.

Documents' K/V are cached once and placed at any offset of any prompt; their rotary
position encoding is applied at attention time (LazyAttention, ICML 2026).
"""

from lazyattn_rag.config import CacheConfig, EngineConfig, PromptConfig, SchedulerConfig
from lazyattn_rag.documents import Document
from lazyattn_rag.errors import (
    CacheCapacityError,
    DocumentTooLongError,
    EmptyInputError,
    LazyAttentionError,
    PromptTooLongError,
    UnknownDocumentError,
)
from lazyattn_rag.messages import DocumentRef, Message
from lazyattn_rag.outputs import Completion, RequestStats, StreamDelta

__version__ = "0.1.0"

__all__ = [
    "AsyncLazyAttention", "CacheCapacityError", "CacheConfig", "Completion", "Document", "DocumentRef", "DocumentTooLongError", "EmptyInputError",
    "EngineConfig", "LazyAttention", "LazyAttentionError", "Message", "PromptConfig", "PromptTooLongError", "RequestStats",
    "SamplingParams", "SchedulerConfig", "StreamDelta", "UnknownDocumentError",
]


def __getattr__(name: str):  # keeps `import lazyattn_rag` light: no torch (~1-2 s) until used
    if name == "SamplingParams":
        from lazyattn_rag.sampling import SamplingParams

        return SamplingParams
    if name == "LazyAttention":
        from lazyattn_rag.llm import LazyAttention

        return LazyAttention
    if name == "AsyncLazyAttention":
        from lazyattn_rag.async_llm import AsyncLazyAttention

        return AsyncLazyAttention
    raise AttributeError(name)
