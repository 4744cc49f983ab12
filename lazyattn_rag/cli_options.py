"""Options shared by the CLI commands (``lazyattn ask``, ``info``, ``chat``) and their engine config."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from lazyattn_rag.config import ANCHOR_MODES, CacheConfig, EngineConfig

MODEL = typer.Option(None, help="Local Hugging Face model directory (default: the offline SmolLM2-135M-Instruct).")
DEVICE = typer.Option("auto", help="auto, cpu or cuda.")
BACKEND = typer.Option("auto", help="Attention backend: auto, torch or triton.")
ANCHOR = typer.Option(CacheConfig().anchor, help=f"Chunk encoding anchor: one of {', '.join(ANCHOR_MODES)}.")


def engine_config(model: Optional[str], device: str, backend: str, anchor: str,
                  cache_dir: Optional[Path]) -> EngineConfig:
    """The :class:`EngineConfig` the shared options describe."""
    return EngineConfig(model=model, device=device, attention_backend=backend, cache_dir=cache_dir,
                        cache=CacheConfig(anchor=anchor))
