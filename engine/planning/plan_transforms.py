"""Plans rewritten for a remedy or a comparison mode: chunk-head recompute (EPIC) and the
position-aware copies of ``block_attention`` mode (``PromptPlanner._for_mode``)."""

from __future__ import annotations

import dataclasses

from lazyattn_rag.engine.planning.fingerprint import chunk_key
from lazyattn_rag.engine.planning.prompt_plan import ChunkSegment, PromptPlan, TextSegment


def positioned_copy(chunk: ChunkSegment) -> ChunkSegment:
    """block_attention mode: a document's copy at its offset (encoded alone at ``g``, delta 0)."""
    if chunk.doc_id is None:
        return chunk
    key = chunk_key(chunk.key, f"at:{chunk.global_start}", [])
    return ChunkSegment(key, chunk.token_ids, chunk.global_start, chunk.global_start, chunk.doc_id, chunk.key)


def with_head_recompute(plan: PromptPlan, num_tokens: int, first_document: bool = True) -> PromptPlan:
    """``plan`` with the first ``num_tokens`` tokens of every document chunk computed by the
    request (chunk-head recompute, EPIC: ``CacheConfig.recompute_chunk_head_tokens``): each
    document's head becomes a private text segment at its position (it attends to everything
    before it), and the chunk is read from the cache from that token on (``num_skipped``).
    The prompt head (an exact prefix) is left as it is, and the first document too unless
    ``first_document`` (``CacheConfig.recompute_first_chunk_head``); ``num_tokens == 0``
    returns ``plan``."""
    if num_tokens <= 0:
        return plan
    chunks, texts = [], list(plan.texts)
    first = next((c for c in plan.chunks if c.doc_id is not None), None)
    for c in plan.chunks:
        if c.doc_id is None or (c is first and not first_document):
            chunks.append(c)
            continue
        n = min(num_tokens, len(c.token_ids))
        texts.append(TextSegment(c.token_ids[:n], c.global_start))
        chunks.append(dataclasses.replace(c, num_skipped=n))
    return dataclasses.replace(plan, chunks=tuple(chunks), texts=tuple(sorted(texts, key=lambda t: t.global_start)))
