"""Options shared by the CLI commands (``lazyattn ask``, ``info``, ``chat``) and their engine config."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from typer.core import TyperCommand, TyperGroup

from lazyattn_rag.types.config import ANCHOR_MODES, CacheConfig, EngineConfig

MODEL = typer.Option(None, help="A local Hugging Face model directory (Llama, Mistral, Qwen2, Qwen3) or a .gguf "
                     "file, converted once (default: the offline SmolLM2-135M-Instruct).")
DEVICE = typer.Option("auto", help="auto, cpu or cuda.")
BACKEND = typer.Option("auto", help="Attention backend: auto, torch or triton.")
ANCHOR = typer.Option(CacheConfig().anchor, help=f"Chunk encoding anchor: one of {', '.join(ANCHOR_MODES)}.")
# typer's rich help prints every option's type, on/off flags too ("--json <bool>"); an empty
# metavar leaves a flag's type column empty ("--json"). Give it to every boolean flag.
FLAG = ""


class _FlagHelp:
    """``--help`` shown as the flag it is: typer gives its built-in help option no metavar, so
    its rich help prints ``--help <bool>``."""

    def get_help_option(self, ctx):
        option = super().get_help_option(ctx)
        if option is not None:
            option.metavar = FLAG
        return option


class Group(_FlagHelp, TyperGroup):
    """The ``lazyattn`` command group (``typer.Typer(cls=Group)``)."""


class Command(_FlagHelp, TyperCommand):
    """A ``lazyattn`` command (``app.command(cls=Command)``)."""




def engine_config(model: Optional[str], device: str, backend: str, anchor: str,
                  cache_dir: Optional[Path]) -> EngineConfig:
    """The :class:`EngineConfig` the shared options describe."""
    return EngineConfig(model=model, device=device, attention_backend=backend, cache_dir=cache_dir,
                        cache=CacheConfig(anchor=anchor))


TEMPERATURE = typer.Option(None, help="Sampling temperature, 0 for greedy (default: the model's recommended, from "
                                      "its generation config; SmolLM2: 0.2).")
TOP_P = typer.Option(None, "--top-p", help="Nucleus sampling mass in (0, 1] (default: the model's).")
REPETITION_PENALTY = typer.Option(None, "--repetition-penalty",
                                  help="> 1 discourages repeating tokens (default: the model's, usually 1).")


def sampling_overrides(temperature: Optional[float], top_p: Optional[float], repetition_penalty: Optional[float],
                       **fixed) -> dict:
    """The sampling fields the user set on the command line, plus ``fixed`` ones (e.g. ``max_tokens``);
    the rest stay the model's recommended ones.

    Raises:
        ValueError: a value out of range (checked now, before any model loads).
    """
    from lazyattn_rag.types.sampling_params import SamplingParams

    overrides = {k: v for k, v in (("temperature", temperature), ("top_p", top_p),
                                   ("repetition_penalty", repetition_penalty)) if v is not None}
    overrides.update(fixed)
    SamplingParams(**overrides)  # validates
    return overrides


def with_overrides(default, overrides: dict):
    """``default`` (a :class:`SamplingParams`, the model's) with the user's ``overrides``."""
    import dataclasses

    return dataclasses.replace(default, **overrides)
