"""The cost of structured output (issue 40): the token mask per decode step, and TPOT with and
without a JSON schema, side by side in one run.

1. **Mask per step**: the answers of the constrained runs are replayed through a fresh matcher;
   each step fills xgrammar's bitmask and applies it to ``[vocab_size]`` float32 logits on the
   engine's device (``GrammarState.mask``), then accepts the token. Medians and p99 in µs.
2. **TPOT**: the same questions answered with and without the schema, interleaved round by
   round, at batch 1 (one question at a time) and batch ``--batch`` (that many streams at once);
   medians of the requests' ``stats.tpot_ms``. The schema's answers end when the JSON closes,
   so both sides generate ``--max-tokens`` with ``ignore_eos`` off and TPOT is per token.

    python benchmarks/structured_output.py --device cpu --dtype float32 --backend torch --out structured_output_cpu
    python benchmarks/structured_output.py --device cuda --dtype bfloat16 --backend triton --out structured_output_h200
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Annotated

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import typer

from benchmarks.serving_results import command_line, environment, write
from lazyattn_rag import CacheConfig, EngineConfig, SamplingParams, StructuredOutputParams
from lazyattn_rag.llm import LazyAttention
from lazyattn_rag.engine.output.grammar import mask_rows

CITIES = ("Paris", "Berlin", "Madrid", "Rome", "Lisbon", "Vienna", "Prague", "Warsaw", "Dublin", "Oslo",
          "Athens", "Cairo", "Tokyo", "Seoul", "Lima", "Quito")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "country": {"type": "string", "maxLength": 40},
                                           "population": {"type": "integer", "minimum": 0, "maximum": 10**9}},
          "required": ["name", "country", "population"]}


def _messages(city: str) -> list[dict]:
    return [{"role": "user", "content": f"Describe {city} as JSON: its name, its country and its population."}]


def _tpot(llm: LazyAttention, params: SamplingParams, batch: int, valid: list[bool] | None = None
          ) -> tuple[list[float], list[list[int]]]:
    """TPOTs and token ids of the answers to every city, ``batch`` streams at a time; with
    ``valid``, whether each answer that ended by itself (not at ``max_tokens``) is valid against
    ``SCHEMA`` (its required fields with their types and bounds)."""
    tpots, answers = [], []
    for start in range(0, len(CITIES), batch):
        streams = [llm.stream_chat(_messages(c), sampling=params) for c in CITIES[start:start + batch]]
        for stream in streams:
            deltas = list(stream)
            answers.append([d.token_id for d in deltas if d.token_id is not None])
            if deltas[-1].stats.tpot_ms is not None:
                tpots.append(deltas[-1].stats.tpot_ms)
            if valid is not None and deltas[-1].finish_reason == "stop":
                valid.append(_fits_schema("".join(d.text for d in deltas)))
    return tpots, answers


def _fits_schema(text: str) -> bool:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    return (isinstance(value, dict) and {"name", "country", "population"} <= value.keys()
            and isinstance(value["name"], str) and isinstance(value["country"], str)
            and type(value["population"]) is int and 0 <= value["population"] <= 10**9)


def _mask_us(llm: LazyAttention, constraint: StructuredOutputParams, answers: list[list[int]]) -> list[float]:
    engine = llm.engine
    logits = torch.randn(engine.runner.model.config.vocab_size, device=engine.runner.device)
    times = []
    for tokens in answers:
        state = engine.grammars.matcher(constraint)
        for token in tokens:
            if engine.runner.device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            masked = mask_rows(logits[None], {0: state})[0]
            if engine.runner.device.type == "cuda":
                torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e6)
            assert torch.isfinite(masked[token]), "a token of the answer was masked"
            state.accept(token)
    return times


def main(device: str = "cpu", dtype: str = "float32", backend: str = "torch", rounds: int = 3, batch: int = 8,
         max_tokens: int = 48, out: Annotated[str | None, typer.Option(help="results name or .json path")] = None):
    llm = LazyAttention(EngineConfig(device=device, dtype=dtype, attention_backend=backend,
                                     cache=CacheConfig(num_blocks=1024)))
    constraint = StructuredOutputParams(json=SCHEMA)
    sides = {"free": SamplingParams(max_tokens=max_tokens),
             "json_schema": SamplingParams(max_tokens=max_tokens, structured_output=constraint)}
    _tpot(llm, sides["json_schema"], batch)  # warm-up: compiles the grammar, caches the prompt head
    tpot = {(side, b): [] for side in sides for b in (1, batch)}
    answers: list[list[int]] = []
    valid: list[bool] = []
    for _ in range(rounds):
        for b in (1, batch):
            for side, params in sides.items():
                values, side_answers = _tpot(llm, params, b, valid if side == "json_schema" else None)
                tpot[side, b] += values
                answers += side_answers if side == "json_schema" else []
    mask = _mask_us(llm, constraint, answers)
    result = {"environment": environment(), "command": command_line(), "model": "SmolLM2-135M-Instruct",
              "num_questions": len(CITIES), "rounds": rounds, "max_tokens": max_tokens,
              "mask_us_per_step": {"median": statistics.median(mask), "p99": sorted(mask)[int(0.99 * len(mask))],
                                   "num_steps": len(mask)},
              "tpot_ms": {f"{side}_batch{b}": statistics.median(v) for (side, b), v in tpot.items()},
              # the schema's answers that closed their JSON, and how many of them are objects of it
              "json_schema_answers": {"num_finished": len(valid), "num_valid": sum(valid)}}
    for b in (1, batch):
        result["tpot_ms"][f"ratio_batch{b}"] = result["tpot_ms"][f"json_schema_batch{b}"] / result["tpot_ms"][
            f"free_batch{b}"]
    llm.shutdown()
    print(result)
    if out:
        write(out, result)


if __name__ == "__main__":
    typer.run(main)
