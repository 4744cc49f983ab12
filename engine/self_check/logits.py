"""The self-check's logits part: a probe request on the engine against transformers' forward pass.

See :mod:`lazyattn_rag.engine.self_check.checks` (the check as a whole) and ``docs/architecture.md``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from lazyattn_rag.engine.self_check.rotary import format_pairs, per_row_max
from lazyattn_rag.types.config import PromptConfig, SchedulerConfig
from lazyattn_rag.types.errors import DocumentTooLongError, PromptTooLongError, SelfCheckError

logger = logging.getLogger(__name__)

PROBE_TOKENS = 4  # greedy tokens of the probe request: the prefill row and 3 decode rows are compared
REFERENCE_MAX_BYTES = 4 * 2**30  # the float32 reference is loaded only up to this size (1.07B parameters)
# Logits tolerance relative to the probe's largest reference logit (at least 1), by our compute dtype: our
# engine against transformers' float32 forward. Measured values: docs/architecture.md, "Start-up self-check".
LOGITS_RTOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}
REUSE_MODES = ("lazy", "block_attention")


def reference_budget_bytes() -> int:
    """Largest float32 reference model the logits part loads: :data:`REFERENCE_MAX_BYTES`, and at
    most half of the host memory available now (the reference runs on the CPU)."""
    available = _available_memory_bytes()
    return REFERENCE_MAX_BYTES if available is None else min(REFERENCE_MAX_BYTES, available // 2)


def _available_memory_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        return None


def check_logits(engine, model_dir: Path) -> dict:
    """Run the probe request on a probe engine sharing ``engine``'s model and compare its logits
    with transformers' forward of ``model_dir`` (see the module docstring).

    Returns:
        A JSON-able report: ``passed``, ``max_abs_diff``, ``tolerance``, the plan's chunk layout,
        per-row errors, ``offset_sensitivity`` (how far the logits move when the chunk's offset is
        ignored: the probe can see position errors much smaller than that) and, when failed,
        ``problem``; or ``{"passed": True, "skipped": reason}`` for a model too large to load twice.
    """
    model = engine.runner.model
    layout = engine.runner.kv_pool.layout
    if layout.scaled:  # the reference's one forward pass cannot round a chunk's K/V as the cache stores them
        reason = (f"kv_cache_dtype {layout.kv_cache_dtype!r}: the cached K/V are FP8-rounded, which transformers' "
                  "float32 reference does not reproduce; the rotary tables were checked, and the FP8 engine is "
                  "tested against a reference that rounds alike (tests/test_fp8_kv_cache.py)")
        logger.info("self-check: logits comparison skipped (%s)", reason)
        return {"passed": True, "skipped": reason}
    num_params = sum(p.numel() for p in model.parameters())
    budget = reference_budget_bytes()
    if 4 * num_params > budget:
        reason = (f"{num_params:,} parameters: a float32 reference needs {4 * num_params / 2**30:.1f} GiB, "
                  f"more than the {budget / 2**30:.1f} GiB allowed (min of {REFERENCE_MAX_BYTES / 2**30:.0f} GiB "
                  "and half the available host memory)")
        logger.warning("self-check: logits comparison skipped (%s); the rotary tables were checked", reason)
        return {"passed": True, "skipped": reason}
    clock = [time.perf_counter()]

    def lap() -> float:
        clock.append(time.perf_counter())
        return round(clock[-1] - clock[-2], 3)

    try:
        plan, token_ids, rows, from_cache = _run_probe(engine)
    except (DocumentTooLongError, PromptTooLongError) as error:  # a toy model's context is shorter than the probe
        logger.warning("self-check: logits comparison skipped (%s)", error)
        return {"passed": True, "skipped": f"the probe does not fit the model's context: {error}"}
    isolated = _isolated_spans(plan)
    seconds = {"probe_request": lap()}
    hf = _load_reference(model_dir)
    seconds["reference_load"] = lap()
    ref = reference_logits(hf, token_ids, isolated)
    moved = {s: s - d for s, _, d in isolated}  # each chunk at its local positions: its offset ignored
    wrong = reference_logits(hf, token_ids, isolated, moved) if any(d for _, _, d in isolated) else None
    seconds["reference_forward"] = lap()
    del hf
    first = plan.num_prompt_tokens - 1  # row of the first sampled token; then one row per decode step
    row_pos = list(range(first, first + len(rows)))
    ours = torch.stack([r.to("cpu", torch.float32) for r in rows])  # [num_rows, vocab]
    err = per_row_max(ours - ref[row_pos])
    scale = ref[row_pos].abs().max().item()
    tolerance = LOGITS_RTOL[engine.runner.kv_pool.layout.dtype] * max(1.0, scale)
    report: dict[str, Any] = {
        "num_params": num_params,
        "dtype": str(engine.runner.kv_pool.layout.dtype).removeprefix("torch."),
        "backend": engine.runner.backend.name,
        "tolerance": tolerance,
        "num_prompt_tokens": plan.num_prompt_tokens,
        "chunks": [{"global_start": s, "num_tokens": e - s, "delta": d} for s, e, d in isolated],
        "chunk_served_from_cache": from_cache,
        "rows": {str(p): e for p, e in zip(row_pos, err.tolist())},
        "max_abs_diff": err.max().item(),
        "max_abs_logit": scale,
        "offset_sensitivity": None if wrong is None else per_row_max(wrong[row_pos] - ref[row_pos]).max().item(),
        "seconds": seconds,
    }
    report["passed"] = report["max_abs_diff"] <= tolerance  # False for NaN too
    sensitivity = report["offset_sensitivity"]
    if sensitivity is not None and not sensitivity > 2 * tolerance:
        logger.warning("self-check: ignoring the probe chunk's offset moves the logits by only %.3g, within twice the "
                       "tolerance %.3g: the logits comparison cannot see position errors on this model", sensitivity,
                       tolerance)
    if not report["passed"]:
        where = ", ".join(f"global {s}..{e - 1} (delta {d})" for s, e, d in isolated) or "none (plain prompt)"
        bad = [(p, e) for p, e in zip(row_pos, err.tolist()) if not e <= tolerance]
        report["problem"] = (
            f"the logits of a probe request ({plan.num_prompt_tokens} prompt tokens, one cached document chunk at "
            f"{where}, {len(rows)} greedy tokens) differ from transformers' forward of the same token ids: max abs "
            f"error {report['max_abs_diff']:.3g} (tolerance {tolerance:g} for {report['dtype']}, "
            f"{report['backend']} backend) at rows {format_pairs(bad)}; ignoring the chunk's offset would change "
            f"them by {report['offset_sensitivity'] or 0:.3g}")
    return report


def _probe_texts(tokenizer, vocab_size: int) -> tuple[str, str, str]:
    """Instruction, document and question of the probe: decoded from fixed pseudo-random ordinary
    token ids, so every tokenizer yields varied tokens (no special ones)."""
    special = set(tokenizer.all_special_ids)
    gen = torch.Generator().manual_seed(1234)
    limit = min(vocab_size, len(tokenizer))

    def text(n: int) -> str:
        ids: list[int] = []
        while len(ids) < n:
            t = int(torch.randint(limit, (1,), generator=gen))
            if t not in special:
                ids.append(t)
        return tokenizer.decode(ids, skip_special_tokens=True).strip() or "probe"

    return text(6), text(24), text(6)


def _probe_engine(engine, instruction: str):
    """A small engine over ``engine``'s model and backend: own KV blocks and chunk cache, anchor
    ``none`` (chunks at local position 0, so a chunk after the head has ``delta != 0``), no
    remedy (chunk-head or selective recompute, chunk attention scaling: the reference is plain
    reuse), no CUDA graphs, a fixed probe prompt. Nothing of ``engine`` is touched."""
    from lazyattn_rag.engine.kv.block_pool import BlockPool
    from lazyattn_rag.engine.kv.chunk_cache import ChunkCache
    from lazyattn_rag.engine.engine import LLMEngine
    from lazyattn_rag.engine.worker.runner import ModelRunner

    runner, bs = engine.runner, engine.block_size
    num_blocks = 2 * -(-512 // bs) + 4  # the probe's prompt and a position-aware copy of its chunk, with room
    config = replace(engine.config, cuda_graphs=False, scheduler=SchedulerConfig(),
                     cache=replace(engine.config.cache, anchor="none", num_blocks=num_blocks, kv_cache_bytes=None,
                                   # plain reuse, which the reference computes: no remedy of the user's
                                   recompute_chunk_head_tokens=0, recompute_selective_ratio=0.0,
                                   chunk_attention_scaling=False),
                     prompt=PromptConfig(system_prompt=None, instruction=instruction + "\n\n",
                                         document_separator="\n\n", question_prefix=""))
    probe_runner = ModelRunner(runner.model, runner.backend, runner.kv_pool.layout, num_blocks, runner.device)
    max_len = min(runner.model.config.max_position_embeddings, 512)  # the probe's, whatever the user's limit
    return LLMEngine(probe_runner, ChunkCache(BlockPool(num_blocks), bs), engine.tokenizer, engine.model_digest,
                     config, max_len)


def _run_probe(engine):
    """Run the probe request; returns (plan, token ids of prompt + fed-back outputs, the sampled
    rows' logits ``[vocab]`` each, whether the document chunk was read from the cache)."""
    from lazyattn_rag.types.sampling_params import SamplingParams

    instruction, document, question = _probe_texts(engine.tokenizer, engine.runner.model.config.vocab_size)
    probe = _probe_engine(engine, instruction)
    probe.documents.add([("self-check", document)])
    plan = probe.planner.plan(question, ["self-check"])
    if probe.config.cache.mode in REUSE_MODES:  # encode the chunk first: the request then reads it from the cache
        _drive(probe, lambda sink: probe.submit_warm(["self-check"], sink))
    rows: list[torch.Tensor] = []  # the sampled row of each step (one request: one compute job)

    def record(step) -> None:
        rows.extend(step.logits[i].to(torch.float32).clone() for i, job in enumerate(step.output.computes)
                    if job.sample)

    probe.step_listeners.append(record)
    params = SamplingParams(max_tokens=PROBE_TOKENS, ignore_eos=True)
    deltas = _drive(probe, lambda sink: probe.submit(plan, params, sink))
    outputs = [d.token_id for d in deltas if d.token_id is not None]
    stats = deltas[-1].stats
    if len(rows) != len(outputs):
        raise SelfCheckError(f"self-check: the probe sampled {len(outputs)} tokens but {len(rows)} rows were seen")
    return plan, plan.token_ids() + outputs[:-1], rows, "self-check" in (stats.docs_hit if stats else [])


def _drive(probe, submit) -> list:
    """Submit one request to ``probe`` and step it to the end; its deltas (raises its error)."""
    items: list = []
    submit(items.append)
    while probe.has_unfinished():
        probe.step()
    for item in items:
        if isinstance(item, BaseException):
            raise item
    return items


def _isolated_spans(plan) -> list[tuple[int, int, int]]:
    """``(start, end, delta)`` of each document chunk: its tokens attend only to each other."""
    spans = []
    for chunk in plan.chunks:
        if chunk.doc_id is None:  # the head: a prefix at delta 0, causal like the rest
            continue
        if chunk.local_start not in (0, chunk.global_start):
            raise SelfCheckError(f"self-check: probe chunk encoded at local position {chunk.local_start}; "
                                 "expected 0 (anchor none) or its global start")
        start = chunk.global_start
        spans.append((start, start + len(chunk.token_ids), chunk.delta))
    return spans


def _load_reference(model_dir: Path):
    from transformers import AutoModelForCausalLM

    from lazyattn_rag.utils.progress import no_transformers_bars

    with no_transformers_bars():  # a one-line announcement says this step already
        return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager",
                                                    local_files_only=True).eval()


def reference_logits(hf, token_ids: list[int], isolated: list[tuple[int, ...]],
                     starts: dict[int, int] | None = None) -> torch.Tensor:
    """transformers' logits of ``token_ids`` in one forward pass with the reuse semantics.

    Args:
        hf: a transformers ``*ForCausalLM`` (float32, CPU).
        token_ids: the whole sequence.
        isolated: ``(start, end, ...)`` spans whose tokens attend only to each other (causally):
            document chunks encoded alone. Every other token attends causally to all before it.
        starts: optional ``{span start: position of its first token}``; by default every token's
            position is its index (the chunk at its global offset).
    Returns:
        ``[len(token_ids), vocab_size]`` float32 logits.
    """
    n = len(token_ids)
    allowed = torch.ones(n, n, dtype=torch.bool).tril()  # [query, key]
    positions = torch.arange(n)
    for start, end, *_ in isolated:
        allowed[start:end, :start] = False
        if starts and start in starts:
            positions[start:end] = torch.arange(starts[start], starts[start] + end - start)
    mask = torch.zeros(1, 1, n, n).masked_fill(~allowed, torch.finfo(torch.float32).min)  # additive, as eager adds it
    with torch.no_grad():
        return hf(input_ids=torch.tensor([token_ids]), position_ids=positions[None], attention_mask=mask,
                  use_cache=False).logits[0].to(torch.float32)
