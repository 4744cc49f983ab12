"""EPIC-style remedy for chunk reuse, composed with transformers (a reference, not the engine).

Chunk reuse encodes every passage alone, so each passage's first tokens act as an attention
sink and never see the passages before them. EPIC (Hu et al., "Epic: Efficient
Position-Independent Context Caching for Serving LLMs", 2024, "LegoLink") recomputes the
first ``k`` tokens of every chunk in the request, attending to everything before them, and
keeps the cached K/V of the rest. Our engine cannot yet place request-private tokens between
cached chunks, so this module composes the prompt with the Hugging Face model directly:

1. the prompt head is prefilled normally (positions ``0 .. P-1``);
2. all passages are encoded alone in one right-padded batch (local positions ``0 .. L-1``,
   no anchor, as the engine's ``anchor="none"`` does);
3. in prompt order, for each passage at global start ``g``: its first ``k`` tokens are run
   through the model at positions ``g .. g+k-1`` on top of the cache built so far (full
   attention to the head, the earlier passages and each other), then the cached K of its
   remaining tokens is rotated by ``g`` (``R_g R_j k = R_(g+j) k``) and appended with its V;
4. the question tail is prefilled and the answer decoded greedily.

With ``k = 0`` this is exactly the engine's ``anchor="none"`` reuse (a control for the
reference itself); with ``k >= `` every passage's length it is a full prefill.
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

# f(k, v, start) -> (k, v): one chunk's K/V of one layer, [1, kv_heads, n, head_dim], K rotated at
# the local positions start .. start + n - 1
KVTransform = Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def generation_eos_ids(model_dir: Path, tokenizer) -> set[int]:
    """End-of-sequence ids: ``generation_config.json``'s plus the tokenizer's (as the engine uses)."""
    ids = set()
    f = Path(model_dir) / "generation_config.json"
    if f.is_file():
        eos = json.loads(f.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids



@functools.cache
def cache_argument(model_class) -> str:
    """The keyword ``model_class.forward`` takes its KV cache by: ``cache`` where transformers has
    renamed it (``past_key_values`` is deprecated there and warns), ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"

def _runs(n: int, fresh: set[int]) -> list[tuple[int, int, bool]]:
    """``0 .. n-1`` cut into maximal runs ``(start, end, in fresh)``."""
    runs, start = [], 0
    for i in range(1, n + 1):
        if i == n or (i in fresh) != (start in fresh):
            runs.append((start, i, start in fresh))
            start = i
    return runs


class RecomputeReference:
    """Greedy answers of chunk reuse with each chunk's first ``k`` tokens recomputed.

    Args:
        model_dir: a local Hugging Face model directory (Llama family, half-split RoPE).
        device: torch device string (``"cpu"``, ``"cuda"``).
        dtype: torch dtype of weights and K/V.
        eos_ids: token ids that end an answer.
    """

    def __init__(self, model_dir: Path | str, device: str, dtype: torch.dtype, eos_ids: set[int]):
        from transformers import AutoModelForCausalLM

        self.device = torch.device(device)
        self.hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, local_files_only=True,
                                                       attn_implementation="sdpa").to(self.device).eval()
        self.eos_ids = set(eos_ids)
        self._encoded = None  # the last (chunks, anchor) encoded alone and its K/V: modes of one prompt share it

    @classmethod
    def from_model(cls, hf, eos_ids: set[int]) -> "RecomputeReference":
        """Wrap an already-loaded transformers ``*ForCausalLM`` (tests, custom loading)."""
        self = cls.__new__(cls)
        self.hf, self.device, self.eos_ids = hf.eval(), next(hf.parameters()).device, set(eos_ids)
        self._encoded = None
        return self

    def _forward(self, ids: list[int], start: int, cache) -> torch.Tensor:
        """Run ``ids`` at positions ``start ..`` on top of ``cache``; logits of the last token."""
        x = torch.tensor([ids], device=self.device)
        pos = torch.arange(start, start + len(ids), device=self.device)[None]
        return self.hf(input_ids=x, position_ids=pos, **{cache_argument(type(self.hf)): cache},
                       use_cache=True).logits[0, -1]

    def _encode_alone(self, chunks: list[list[int]], anchor_ids: Sequence[int] = ()):
        """Per-layer (K, V) ``[num_chunks, kv_heads, max_len, head_dim]``, each chunk encoded after
        ``anchor_ids`` from position 0 (the anchor's own K/V dropped: chunk tokens at positions
        ``len(anchor_ids) ..``); the same chunks and anchor again reuse the last encoding (nothing
        downstream writes into it)."""
        from transformers import DynamicCache

        key = (tuple(anchor_ids), tuple(map(tuple, chunks)))
        if self._encoded is not None and self._encoded[0] == key:
            return self._encoded[1]
        n = len(anchor_ids)
        chunks = [list(anchor_ids) + list(c) for c in chunks]
        longest = max(len(c) for c in chunks)
        ids = torch.zeros((len(chunks), longest), dtype=torch.long)
        mask = torch.zeros((len(chunks), longest), dtype=torch.long)
        for i, c in enumerate(chunks):  # right padding: real tokens never attend to the pads after them
            ids[i, : len(c)] = torch.tensor(c)
            mask[i, : len(c)] = 1
        cache = DynamicCache()
        pos = torch.arange(longest)[None].expand(len(chunks), -1)
        self.hf(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), position_ids=pos.to(self.device),
                **{cache_argument(type(self.hf)): cache}, use_cache=True)
        encoded = [(layer.keys[:, :, n:], layer.values[:, :, n:]) for layer in cache.layers]
        self._encoded = (key, encoded)
        return encoded

    def _shift_keys(self, k: torch.Tensor, delta: int) -> torch.Tensor:
        """Rotate K ``[1, kv_heads, n, d]`` (already at local positions) by ``delta`` positions, in float32."""
        rotary = self.hf.model.rotary_emb
        kf = k.float()
        pos = torch.full((1, k.shape[2]), delta, dtype=torch.int64, device=k.device)
        cos, sin = rotary(kf, pos)  # [1, n, d], multiplied by attention_scaling
        cos, sin = cos / rotary.attention_scaling, sin / rotary.attention_scaling
        return (kf * cos[:, None] + _rotate_half(kf) * sin[:, None]).to(k.dtype)

    @torch.no_grad()
    def first_token_logits(self, head_ids: list[int], chunk_ids: list[list[int]], tail_ids: list[int],
                           recompute_tokens: int, **reuse) -> torch.Tensor:
        """``[vocab_size]`` logits of the first answer token (arguments as :meth:`generate`)."""
        return self._prefill(head_ids, chunk_ids, tail_ids, recompute_tokens, **reuse)[0]

    @torch.no_grad()
    def full_first_token_logits(self, prompt_ids: list[int]) -> torch.Tensor:
        """``[vocab_size]`` logits of the first answer token of a normal (full attention) prefill."""
        from transformers import DynamicCache

        return self._forward(list(prompt_ids), 0, DynamicCache())

    @torch.no_grad()
    def selected_first_token_logits(self, head_ids: list[int], chunk_ids: list[list[int]], tail_ids: list[int],
                                    selected: list[set[int]]) -> torch.Tensor:
        """``[vocab_size]`` logits of the first answer token with the tokens ``selected[c]`` of
        chunk ``c`` (local indices) recomputed at every layer and the others read as encoded
        alone (selective recompute's semantics, CacheBlend), composed token run by token run."""
        return self._prefill(head_ids, chunk_ids, tail_ids, 0, selected)[0]

    def _prefill(self, head_ids, chunk_ids, tail_ids, recompute_tokens: int, selected=None,
                 anchor_ids: Sequence[int] = (), kv_transform: KVTransform | None = None):
        """The composed prompt: ``(last-token logits, cache, next position)``; ``selected``
        (per chunk, local indices to recompute) replaces the first ``recompute_tokens``; chunks
        encoded after ``anchor_ids`` and their K/V passed through ``kv_transform`` (see :meth:`generate`).

        Raises:
            ValueError: ``recompute_tokens < 0`` or no chunks.
        """
        from transformers import DynamicCache

        if recompute_tokens < 0 or not chunk_ids:
            raise ValueError(f"need recompute_tokens >= 0 and chunks; got {recompute_tokens}, {len(chunk_ids)} chunks")
        alone = self._encode_alone(chunk_ids, anchor_ids)
        local = len(anchor_ids)
        if kv_transform is not None:  # per chunk, its own tokens only (not the right padding)
            alone = [[kv_transform(k[c:c + 1, :, :len(ids)], v[c:c + 1, :, :len(ids)], local)
                      for c, ids in enumerate(chunk_ids)] for k, v in alone]
        else:
            alone = [[(k[c:c + 1], v[c:c + 1]) for c in range(len(chunk_ids))] for k, v in alone]
        cache = DynamicCache()
        if head_ids:
            self._forward(head_ids, 0, cache)
        pos = len(head_ids)
        for c, ids in enumerate(chunk_ids):
            fresh = set(range(min(recompute_tokens, len(ids)))) if selected is None else set(selected[c])
            for a, b, is_fresh in _runs(len(ids), fresh):
                if is_fresh:
                    self._forward(ids[a:b], pos + a, cache)
                    continue
                for layer, per_chunk in enumerate(alone):
                    k, v = per_chunk[c]
                    cache.update(self._shift_keys(k[:, :, a:b], pos - local), v[:, :, a:b], layer)
            pos += len(ids)
        logits = self._forward(tail_ids, pos, cache)
        return logits, cache, pos + len(tail_ids)

    @torch.no_grad()
    def generate(self, head_ids: list[int], chunk_ids: list[list[int]], tail_ids: list[int],
                 recompute_tokens: int, max_tokens: int, stop=None, **reuse) -> list[int]:
        """Greedy answer token ids (without the EOS) for one prompt.

        Args:
            head_ids: the prompt head (chat-template opening and instruction).
            chunk_ids: each passage's token ids (text plus separator), in prompt order.
            tail_ids: the question and the template's closing.
            recompute_tokens: ``k``, tokens recomputed at the start of each chunk (>= 0).
            max_tokens: most tokens to generate (>= 1).
            stop: optional ``stop(token_ids) -> bool`` checked after each token; ``True`` ends the answer.
            anchor_ids: keyword only: token ids each chunk is encoded after (``CacheConfig.anchor``;
                default none); the chunk's K/V start at local position ``len(anchor_ids)``.
            kv_transform: keyword only: ``f(k, v, start) -> (k, v)`` applied to each chunk's K/V
                (``[1, kv_heads, len(chunk), head_dim]`` per layer, K rotated at the local positions
                ``start ..``) before they are placed, e.g. an FP8 round trip.
        Raises:
            ValueError: ``recompute_tokens < 0``, ``max_tokens < 1`` or no chunks.
        """
        return self.generate_with_first_logits(head_ids, chunk_ids, tail_ids, recompute_tokens, max_tokens, stop,
                                               **reuse)[1]

    @torch.no_grad()
    def generate_with_first_logits(self, head_ids: list[int], chunk_ids: list[list[int]], tail_ids: list[int],
                                   recompute_tokens: int, max_tokens: int, stop=None,
                                   **reuse) -> tuple[torch.Tensor, list[int]]:
        """:meth:`generate`'s answer with the first answer token's ``[vocab_size]`` logits (one prefill for both)."""
        if max_tokens < 1:
            raise ValueError(f"need max_tokens >= 1, got {max_tokens}")
        logits, cache, pos = self._prefill(head_ids, chunk_ids, tail_ids, recompute_tokens, **reuse)
        first = logits
        tokens: list[int] = []
        while True:
            token = int(logits.argmax())
            if token in self.eos_ids:
                break
            tokens.append(token)
            if len(tokens) >= max_tokens or (stop is not None and stop(tokens)):
                break
            logits = self._forward([token], pos, cache)
            pos += 1
        return first, tokens
