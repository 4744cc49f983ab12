"""lazyattn-rag: position-agnostic KV reuse for retrieval-augmented generation.

Documents' K/V are cached once and placed at any offset of any prompt; their rotary
position encoding is applied at attention time (LazyAttention, ICML 2026).
"""

from lazyattn_rag.config import CacheConfig, EngineConfig, PromptConfig
from lazyattn_rag.documents import Document
from lazyattn_rag.errors import (
    CacheCapacityError,
    DocumentTooLongError,
    EmptyInputError,
    LazyAttentionError,
    PromptTooLongError,
    UnknownDocumentError,
)
from lazyattn_rag.outputs import Completion, RequestStats, StreamDelta
from lazyattn_rag.sampling import SamplingParams

__version__ = "0.1.0"

__all__ = [
    "CacheCapacityError", "CacheConfig", "Completion", "Document", "DocumentTooLongError", "EmptyInputError",
    "EngineConfig", "LazyAttention", "LazyAttentionError", "PromptConfig", "PromptTooLongError", "RequestStats",
    "SamplingParams", "StreamDelta", "UnknownDocumentError",
]


def __getattr__(name: str):
    if name == "LazyAttention":  # keeps `import lazyattn_rag` light
        from lazyattn_rag.llm import LazyAttention

        return LazyAttention
    raise AttributeError(name)
