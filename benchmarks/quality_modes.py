"""The quality benchmark's modes that run on the engine (``benchmarks/quality.py``): each mode's anchor
and remedy, the order they run in and the order they are reported in."""

from __future__ import annotations

import re
from typing import NamedTuple

from benchmarks.serving_setup import chunk_scaling_percent

ENGINE_MODES = {"full": "none", "full-shuffled": "none", "reuse": "none", "reuse-head": "head", "reuse-bos": "bos"}
# Chunk-head recompute in the engine (CacheConfig.recompute_chunk_head_tokens): "reuse-k16",
# "reuse-bos-k4", ...: the reuse mode of that anchor with the first k tokens of each passage recomputed;
# "reuse-bos-k4rest": of each passage but the first (CacheConfig.recompute_first_chunk_head=False).
# Selective recompute (CacheConfig.recompute_selective_ratio, CacheBlend): "reuse-sel15",
# "reuse-bos-sel5", ...: that reuse mode with r % of each passage's tokens recomputed.
# Chunk attention scaling (CacheConfig.chunk_attention_scaling, APE): "reuse-bos-ape80" (temperature
# 0.8), "reuse-bos-ape90w80" (temperature 0.9, weight 0.8): that reuse mode with its documents so read.
_HEAD_RECOMPUTE = re.compile(r"^(reuse|reuse-head|reuse-bos)-k(\d+)(rest)?$")  # rest: not the first document's
_SELECTIVE_RECOMPUTE = re.compile(r"^(reuse|reuse-head|reuse-bos)-sel(\d+)$")
_CHUNK_SCALING = re.compile(r"^(reuse|reuse-head|reuse-bos)-ape(\d+)(?:w(\d+))?$")
# Sink weighting (chunk attention scaling over each document's first block only,
# CacheConfig.chunk_attention_scope="head"): "reuse-bos-sink50": weight 0.5, temperature 1.
_SINK_SCALING = re.compile(r"^(reuse|reuse-head|reuse-bos)-sink(\d+)$")
# An FP8 KV cache (CacheConfig.kv_cache_dtype, issue 42): "reuse-bos-fp8" (e4m3), "reuse-bos-fp8e5m2":
# that mode over FP8 K/V; its first-token KL is also taken against that mode's own (fp8_base_mode).
_FP8 = re.compile(r"^(.+)-(fp8|fp8e5m2)$")
_FP8_DTYPES = {"fp8": "fp8_e4m3", "fp8e5m2": "fp8_e5m2"}


class EngineSetting(NamedTuple):
    """The engine an engine mode runs on: its anchor and remedy (``recompute_tokens``: chunk-head
    ``k``; ``selective_ratio``: selective recompute's ``r``; ``temperature``, ``weight``: chunk
    attention scaling, off at 1 and 1, over ``scope``: ``CacheConfig.chunk_attention_scope``;
    ``first_head``: ``CacheConfig.recompute_first_chunk_head``)."""

    anchor: str
    recompute_tokens: int = 0
    selective_ratio: float = 0.0
    temperature: float = 1.0
    weight: float = 1.0
    scope: str = "chunk"
    first_head: bool = True
    kv_cache_dtype: str = "auto"


def fp8_base_mode(mode: str) -> str | None:
    """The mode an FP8 mode runs over FP8 K/V (``"reuse-bos"`` of ``"reuse-bos-fp8"``), or ``None``."""
    m = _FP8.match(mode)
    return m.group(1) if m and m.group(1) != "full" and engine_setting(m.group(1)) else None


def engine_setting(mode: str) -> EngineSetting | None:
    """The :class:`EngineSetting` of an engine mode, or ``None``."""
    if (m := _FP8.match(mode)) and (base := fp8_base_mode(mode)):
        return engine_setting(base)._replace(kv_cache_dtype=_FP8_DTYPES[m.group(2)])
    if mode in ENGINE_MODES:
        return EngineSetting(ENGINE_MODES[mode])
    if m := _HEAD_RECOMPUTE.match(mode):
        return EngineSetting(ENGINE_MODES[m.group(1)], recompute_tokens=int(m.group(2)), first_head=not m.group(3))
    if (m := _SELECTIVE_RECOMPUTE.match(mode)) and 0 < int(m.group(2)) <= 100:
        return EngineSetting(ENGINE_MODES[m.group(1)], selective_ratio=int(m.group(2)) / 100)
    if (m := _CHUNK_SCALING.match(mode)) and (setting := chunk_scaling_percent(m.group(2), m.group(3))):
        return EngineSetting(ENGINE_MODES[m.group(1)], temperature=setting[0], weight=setting[1])
    if (m := _SINK_SCALING.match(mode)) and (setting := chunk_scaling_percent("100", m.group(2))):
        return EngineSetting(ENGINE_MODES[m.group(1)], weight=setting[1], scope="head")
    return None
def engine_run_order(modes: list[str]) -> list[str]:
    """The engine modes of ``modes`` in the order they run: ``full`` first (the others' fidelity
    is measured against it), then as given (a time-limited run gets the modes asked for first)."""
    return sorted((m for m in modes if engine_setting(m)), key=lambda m: m != "full")


def mode_order(mode: str) -> tuple[int, int]:
    mode = fp8_base_mode(mode) or mode
    base = mode if not mode.startswith("recompute-k") else "recompute"
    k = int(mode.removeprefix("recompute-k")) if mode.startswith("recompute-k") else 0
    if m := _HEAD_RECOMPUTE.match(mode):
        base, k = m.group(1), int(m.group(2))
    order = ("full", "full-shuffled", "reuse", "reuse-bos", "reuse-head", "recompute")
    return (order.index(base) if base in order else len(order), k)
