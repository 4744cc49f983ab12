"""The RAG prompt plan: head, document chunks, text segments and query as token-id segments.

::

    global pos: 0 ..... P | g1 ...... g1+L1 | g2 ...... g2+L2 | ... | gq ..... gq+Lq | generated
    segments:   [ head   ][ chunk doc A      ][ chunk doc B      ]     [ query tail    ][ decode ...
    delta:        0        g1 - l             g2 - l                   0                0

Segments are tokenized separately (``engine/planning/prompt.py``) and concatenated as token ids; the
joined string is never re-tokenized, so a boundary tokenizes the same way on a cache hit as
on a miss.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property

from lazyattn_rag.engine.planning.fingerprint import chunk_key


class PrefixKeys(Sequence[str]):
    """The chained key of each full block of ``token_ids`` from ``seed``: block ``j``'s key
    names every token up to its end (exact-prefix reuse, as vLLM's automatic prefix caching).

    A key is hashed when it is first read, so a plan that is weighed and dropped (the passage
    learner's plain layout of a prompt it serves from chunks) hashes only the blocks looked up.
    Compares equal to the tuple of its keys.

    Args:
        token_ids: the tail's tokens.
        seed: what the chain starts from (a digest of everything before the tail).
        block_size: tokens per block.
    """

    def __init__(self, token_ids: Sequence[int], seed: str, block_size: int):
        self._token_ids, self._block_size = token_ids, block_size
        self._keys: list[str] = []
        self._parent = seed
        self._len = len(token_ids) // block_size

    def __len__(self) -> int:
        return self._len

    def _hash_to(self, n: int) -> None:
        bs = self._block_size
        for j in range(len(self._keys), n):
            self._parent = chunk_key(self._parent, "prefix", list(self._token_ids[j * bs: (j + 1) * bs]))
            self._keys.append(self._parent)

    def hash_all(self) -> None:
        """Hash every key now (a plan about to be queued: spare the engine thread the work)."""
        self._hash_to(self._len)

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(self._len)
            self._hash_to(max(start + 1, stop) if step < 0 else stop)
            return tuple(self._keys[index])
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError(f"prefix block {index} of {self._len}")
        self._hash_to(index + 1)
        return self._keys[index]

    def __iter__(self) -> Iterator[str]:
        for j in range(self._len):
            yield self[j]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (PrefixKeys, tuple, list)):
            return tuple(self) == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"PrefixKeys({self._len} blocks, {len(self._keys)} hashed)"


@dataclass(frozen=True)
class ChunkSegment:
    """A cached chunk placed in a request.

    Attributes:
        key: the chunk's cache key.
        token_ids: its tokens.
        local_start: ``l``, the position its first token was encoded at.
        global_start: ``g``, where it sits in this request.
        doc_id: the document id (a learned passage's ``passage:<hash>``), or ``None`` for the head.
        source_key: for a position-aware copy (``block_attention`` mode), the document's
            position-agnostic key; copies of one source can be made from each other.
        num_skipped: its first tokens that the request computes itself (a :class:`TextSegment`
            of them at ``global_start``: chunk-head recompute, ``CacheConfig.recompute_chunk_head_tokens``);
            only the others are read from the cache. The chunk is still acquired whole.
        source: how a document came to be placed (``RequestStats.doc_sources``): ``"id"``,
            ``"matched"`` (its text found in the prompt) or ``"learned"`` (a passage learned from
            traffic, ``CacheConfig.learn_passages``: content-keyed like a document but bound to
            no document id, so its entry lives until evicted).
    """

    key: str
    token_ids: tuple[int, ...]
    local_start: int
    global_start: int
    doc_id: str | None
    source_key: str | None = None
    num_skipped: int = 0
    source: str = "id"

    @property
    def learned(self) -> bool:
        return self.source == "learned"

    @property
    def cached_token_ids(self) -> tuple[int, ...]:
        """The tokens read from the cache (after the ``num_skipped`` the request computes)."""
        return self.token_ids[self.num_skipped:]

    @property
    def delta(self) -> int:
        """RoPE offset of this placement (``g - l``)."""
        return self.global_start - self.local_start


@dataclass(frozen=True)
class TextSegment:
    """Request-private prompt tokens placed between cached chunks.

    A framework's template text between two documents (a header, a separator that is not
    whitespace) is computed by the request like its query tail: its tokens are written rotated
    at their global positions (``delta = 0``) and attend to everything before them (the chunks
    and text segments earlier in the prompt). Documents placed after it do not attend to it
    (each was encoded alone).

    Attributes:
        token_ids: its tokens (non-empty).
        global_start: position of its first token in the request.
    """

    token_ids: tuple[int, ...]
    global_start: int


@dataclass(frozen=True)
class PromptPlan:
    """One request's prompt: cached chunks (head first), private text segments between them,
    then the new query tokens.

    Attributes:
        chunks: head and documents in prompt order.
        query_token_ids: the tail (question and template closing), computed per request.
        prefix_block_keys: the chained hash of every full block of ``query_token_ids``, from a
            seed that names everything before the tail (exact-prefix reuse, as vLLM's automatic
            prefix caching; ``CacheConfig.prefix_caching`` and ``mode="prefix"``).
        texts: private text segments between chunks, in prompt order. Chunks and texts tile
            positions ``0 .. tail_start - 1`` without gaps; the tail follows.
        selective_ratio: selective recompute's ``r`` for this request's documents
            (``CacheConfig.recompute_selective_ratio``); 0: none.
        chunk_scaling: the request reads its documents' blocks with chunk attention scaling
            (APE, ``CacheConfig.chunk_attention_scaling``): their block-table entries are flagged.
        chunk_scaling_blocks: with ``chunk_scaling``, how many leading blocks of each document
            are flagged; 0: all of them (``CacheConfig.chunk_attention_scope``: 0 for
            ``"chunk"``, 1 for ``"head"``).
        head_prefix_keys: the chained key of every full block of the prompt head's tokens from
            the seed of a prompt with nothing placed (``prefix_block_keys`` of a plain prompt that
            starts with the same tokens): a head not cached yet is seeded from those of its blocks
            an earlier plain prompt left in the cache, and only the rest is computed (a plain
            client's second ask, laid out with learned passages, keeps its system prompt). Empty:
            no head, or exact-prefix caching off.

    Its token counts are computed once (the plan is frozen; the scheduler and the runner read
    them for every running request every step).
    """

    chunks: tuple[ChunkSegment, ...]
    query_token_ids: tuple[int, ...]
    prefix_block_keys: Sequence[str] = ()
    texts: tuple[TextSegment, ...] = ()
    selective_ratio: float = 0.0
    chunk_scaling: bool = False
    chunk_scaling_blocks: int = 0
    head_prefix_keys: Sequence[str] = ()

    @cached_property
    def num_cached_prompt_tokens(self) -> int:
        return sum(len(c.cached_token_ids) for c in self.chunks)

    @cached_property
    def num_text_tokens(self) -> int:
        """Tokens of the private text segments (computed per request, before the tail)."""
        return sum(len(t.token_ids) for t in self.texts)

    @cached_property
    def num_head_recompute_tokens(self) -> int:
        """Document tokens the request recomputes as chunk heads (``ChunkSegment.num_skipped``)."""
        return sum(c.num_skipped for c in self.chunks if c.doc_id is not None)

    @property
    def remedy(self) -> str | None:
        """The answer-fidelity remedy the plan runs (``RequestStats.remedy``):
        ``"chunk_head_recompute"``, ``"selective_recompute"``, ``"chunk_attention_scaling"`` or
        ``None``."""
        if self.num_head_recompute_tokens:
            return "chunk_head_recompute"
        if self.selective_ratio:
            return "selective_recompute"
        return "chunk_attention_scaling" if self.chunk_scaling else None

    @cached_property
    def tail_start(self) -> int:
        """Global position of the first query-tail token."""
        return self.num_cached_prompt_tokens + self.num_text_tokens

    @cached_property
    def num_prompt_tokens(self) -> int:
        return self.tail_start + len(self.query_token_ids)

    def segments(self) -> list[ChunkSegment | TextSegment]:
        """Chunks and text segments in prompt order (the tail excluded); a chunk's recomputed
        head (a text segment at the chunk's own start) comes before the chunk."""
        return sorted([*self.chunks, *self.texts], key=lambda s: (s.global_start, isinstance(s, ChunkSegment)))

    def token_ids(self) -> list[int]:
        """The whole prompt as one id list (what a full prefill would see)."""
        ids = [t for s in self.segments()
               for t in (s.cached_token_ids if isinstance(s, ChunkSegment) else s.token_ids)]
        return ids + list(self.query_token_ids)

    def head_recompute_copy(self, text: TextSegment, block_size: int) -> tuple[ChunkSegment, int, int] | None:
        """Where ``text`` is the recomputed head of a chunk whose cached part starts inside a
        block: ``(chunk, first_slot, num_slots)``, the slots of that block (of the chunk's block
        ``num_skipped // block_size``) that the request copies behind its fresh tokens, in its
        own last block of ``text``; ``None`` otherwise."""
        chunk = next((c for c in self.chunks if c.num_skipped and c.global_start == text.global_start), None)
        if chunk is None or chunk.num_skipped % block_size == 0:
            return None
        first = chunk.num_skipped % block_size
        num = min(block_size - first, len(chunk.token_ids) - chunk.num_skipped)
        return (chunk, first, num) if num > 0 else None
