"""Start-up self-check: a model whose positions we would compute wrongly must not serve.

Deferred RoPE is only as right as our rotary tables and the K/V path that moves a cached
chunk to its offset. Both are compared at start-up with transformers, the independent
reference (``docs/architecture.md``, "Start-up self-check"):

* **rotary** (every start with an HF config, about a millisecond): transformers' own rotary
  module of the model's architecture (``LlamaRotaryEmbedding``, ``Qwen2RotaryEmbedding``, ...,
  built from the config, no weights) and its ``apply_rotary_pos_emb`` encode probe vectors at
  positions 0, 1, 17, 4095, ``max_position_embeddings - 1``, 2^20 - 1 and 2^24 - 1; the
  model's :class:`~lazyattn_rag.kernels.rope.RotaryEmbedding` must encode them the same way,
  and its pure rotation ``R_delta`` must move a vector encoded at ``j`` to where transformers
  encodes it at ``j + delta`` (and back), for offsets up to the model's context length.
* **logits** (model directories whose float32 copy fits :func:`reference_budget_bytes`): a
  real request on a small probe engine that shares the loaded model (its device, dtype and
  attention backend): a head, one document chunk encoded alone (anchor ``none``), warmed
  first so the request reads it from the cache at offset ``delta = len(head) != 0``, a
  question tail and :data:`PROBE_TOKENS` greedy tokens. transformers runs the same token ids
  in one forward pass with normal position ids and a 4D mask in which the document attends
  only to itself (it was encoded alone) and every other token causally to everything before
  it. Every sampled row's full logits are compared. Cache modes without chunk reuse
  (``full``, ``prefix``) probe a plain prompt instead.

A passing verdict is written to ``<cache_dir>/self_check/<key>.json``; the key covers the
model fingerprint (weights, dtype, RoPE, tokenizer, block size), :data:`CHECK_VERSION`, the
package, transformers and torch versions, the device type, the attention backend and
whether chunks are reused, so the check runs once per model and code version. A failure is
never cached: it raises :class:`~lazyattn_rag.types.errors.SelfCheckError` naming what differed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from lazyattn_rag.types.config import EngineConfig, PromptConfig, SchedulerConfig
from lazyattn_rag.types.errors import DocumentTooLongError, PromptTooLongError, SelfCheckError
from lazyattn_rag.kernels.rope import RotaryEmbedding

logger = logging.getLogger(__name__)

CHECK_VERSION = 1  # bump when the check changes: every cached verdict is then re-checked
PROBE_TOKENS = 4  # greedy tokens of the probe request: the prefill row and 3 decode rows are compared
REFERENCE_MAX_BYTES = 4 * 2**30  # the float32 reference is loaded only up to this size (1.07B parameters)
ROTARY_TOLERANCE = 1e-4  # on probe vectors scaled to max |x| = 1; the same float32 angles agree to ~1e-7
# Logits tolerance relative to the probe's largest reference logit (at least 1), by our compute dtype: our
# engine against transformers' float32 forward. Measured on SmolLM2-135M (largest logit 32.9; H200, triton):
# float32 3.7e-5 (relative 1.1e-6), float16 0.066 (2.0e-3), bfloat16 0.55 (1.7e-2); ignoring the chunk's
# offset moves the logits by 5.1 (benchmarks/results/self_check_h200.json, docs/architecture.md).
LOGITS_RTOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}
_REUSE_MODES = ("lazy", "block_attention")


def run_self_check(engine, hf_config: Any, config: EngineConfig, model_dir: Path | None = None) -> str:
    """Self-check a freshly built engine.

    Args:
        engine: the :class:`~lazyattn_rag.engine.engine.LLMEngine` just built (model on its device).
        hf_config: the model's transformers config; ``None`` skips the check (nothing to compare with).
        config: the engine configuration (``self_check``, ``cache_dir``, cache mode).
        model_dir: the model's directory: enables the logits part and the cached verdict. Without
            it (``LazyAttention.from_model``) only the rotary part runs, every time.
    Returns:
        What ran: ``"off"`` (``EngineConfig.self_check=False`` or no config), ``"rotary"`` (no
        directory: the rotary part), ``"cached"`` (a cached passing verdict, nothing ran) or
        ``"ran"`` (both parts ran now and the verdict was cached: the first start of a model).
    Raises:
        SelfCheckError: our positions differ from transformers' (the message says where and by
            how much, and how to proceed).
    """
    if not config.self_check or hf_config is None:
        return "off"
    if model_dir is None:
        report = {"rotary": check_rotary(engine.runner.model.rotary, hf_config)}
        _raise_on_failure(report, hf_config, engine, config)
        return "rotary"
    path = verdict_path(engine, config)
    if read_verdict(path) is not None:
        return "cached"
    from lazyattn_rag.engine.model_loading import transformers_config

    hf_config = transformers_config(hf_config)  # the real class: the check builds transformers' rotary from it
    # Shown (the CLI configures no logging: warnings reach stderr) because it makes this start slower.
    logger.warning("first start of this model: checking its positions against transformers once "
                   "(a few seconds on a CPU; later starts read the verdict from %s)", path.parent)
    start = time.perf_counter()
    report: dict[str, Any] = {"rotary": check_rotary(engine.runner.model.rotary, hf_config)}
    report["rotary"]["seconds"] = round(time.perf_counter() - start, 4)
    if report["rotary"]["passed"]:
        report["logits"] = check_logits(engine, Path(model_dir))
    report["seconds"] = round(time.perf_counter() - start, 3)
    _raise_on_failure(report, hf_config, engine, config)
    write_verdict(path, verdict_key(engine, config), report)
    logger.info("self-check passed in %.2f s (verdict cached in %s)", report["seconds"], path)
    return "ran"


# --- verdict cache ---------------------------------------------------------------------------
def verdict_key(engine, config: EngineConfig) -> dict:
    """What a cached verdict is valid for (JSON-able)."""
    from importlib.metadata import version

    import transformers

    return {
        "check_version": CHECK_VERSION,
        "package": version("lazyattn-rag"),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "model": engine.model_digest,
        "device": engine.runner.device.type,
        "backend": engine.runner.backend.name,
        "reuse": config.cache.mode in _REUSE_MODES,
    }


def verdict_path(engine, config: EngineConfig) -> Path:
    """``<cache_dir>/self_check/<sha256 of the verdict key, 32 hex digits>.json``."""
    key = json.dumps(verdict_key(engine, config), sort_keys=True)
    return config.resolved_cache_dir() / "self_check" / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


def read_verdict(path: Path) -> dict | None:
    """The cached passing verdict at ``path``, or ``None`` (absent, unreadable or not a pass)."""
    try:
        verdict = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return verdict if isinstance(verdict, dict) and verdict.get("passed") is True else None


def write_verdict(path: Path, key: dict, report: dict) -> None:
    """Write a passing verdict atomically (a temporary file renamed over the target). A cache dir
    that cannot hold it (read-only, or a file where a folder should be) costs only the cache:
    the check runs again next time, and a warning says why."""
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"passed": True, "key": key, "report": report,
                                   "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, indent=1))
        tmp.replace(path)
    except OSError as error:
        logger.warning("the self-check passed but its verdict cannot be saved in %s (%s); it will run again "
                       "at the next start", path.parent, error)
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


# --- rotary ----------------------------------------------------------------------------------
def probe_positions(hf_config: Any) -> list[int]:
    """Positions the rotary tables are compared at: small, a tile boundary, the model's last
    position, and offsets near 2^20 and 2^24 (the block table's supported range)."""
    last = int(getattr(hf_config, "max_position_embeddings", 2048)) - 1
    return sorted({0, 1, 17, 4095, last, 2**20 - 1, 2**24 - 1})


def hf_rotary(hf_config: Any):
    """transformers' rotary module for ``hf_config``'s architecture, and that architecture's
    ``apply_rotary_pos_emb`` (found from the config's ``model_type``; no weights are made)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = getattr(hf_config, "model_type", None)
    class_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if class_name is None:
        raise SelfCheckError(f"transformers has no causal LM for model_type {model_type!r} to check against")
    module = sys.modules[getattr(transformers, class_name).__module__]
    rotary_name = class_name.replace("ForCausalLM", "RotaryEmbedding")
    rotary_cls = getattr(module, rotary_name, None)
    apply = getattr(module, "apply_rotary_pos_emb", None)
    if rotary_cls is None or apply is None:
        raise SelfCheckError(f"{module.__name__} has no {rotary_name} / apply_rotary_pos_emb to check against")
    return rotary_cls(config=hf_config).eval(), apply


def check_rotary(rotary: RotaryEmbedding, hf_config: Any) -> dict:
    """Compare our rotary encoding and pure rotation with transformers' (CPU, float32).

    Returns:
        A JSON-able report: ``passed``, ``max_abs_diff``, ``tolerance``, per-position errors of
        the encoding (``encode``) and of the deferred rotation (``rotate_by``), the sizes of both
        ``inv_freq`` buffers and, when failed, ``problem`` (a sentence for the error).
    """
    hf_module, apply = hf_rotary(hf_config)
    positions = probe_positions(hf_config)
    head_dim = rotary.head_dim
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 1, head_dim, generator=gen)  # [batch, heads, 1, head_dim], transformers' layout
    x = x / x.abs().max()

    def theirs(pos: list[int]) -> torch.Tensor:  # [n, heads, head_dim], encoded at pos by transformers
        xs = x.expand(1, 2, len(pos), head_dim)
        with torch.no_grad():
            cos, sin = hf_module(xs, torch.tensor([pos]))
            q, _ = apply(xs, xs, cos, sin)
        return q[0].transpose(0, 1)

    def ours_at(pos: list[int]) -> torch.Tensor:
        return rotary.encode(x[0].transpose(0, 1).expand(len(pos), 2, head_dim), torch.tensor(pos))

    report: dict[str, Any] = {"positions": positions, "tolerance": ROTARY_TOLERANCE,
                              "inv_freq_size": int(rotary.inv_freq.numel()),
                              "transformers_inv_freq_size": int(hf_module.inv_freq.numel()),
                              "transformers_module": type(hf_module).__name__}
    try:
        encode_err = _per_row_max(ours_at(positions) - theirs(positions))
    except RuntimeError as error:  # shapes disagree (e.g. rotary_dim): the tables cannot even be compared
        report.update(passed=False, max_abs_diff=float("inf"), problem=(
            f"our rotary encoding and transformers' {type(hf_module).__name__} could not be compared ({error}); "
            f"we rotate {rotary.rotary_dim} of {head_dim} dimensions with {report['inv_freq_size']} frequencies, "
            f"transformers has {report['transformers_inv_freq_size']}"))
        return report
    # R_delta of a vector encoded at j lands where transformers encodes j + delta, and R_-delta brings it
    # back; float32 angles at position p are exact to ~p * max(inv_freq) * 2^-24, hence the bound below.
    j, limit = 5, int(getattr(hf_config, "max_position_embeddings", 2048))
    deltas = sorted({d for d in positions if 0 < d < limit - 1 - j} | {limit - 1 - j})
    moved = rotary.rotate_by(ours_at([j] * len(deltas)), torch.tensor(deltas))
    back = rotary.rotate_by(ours_at([j + d for d in deltas]), -torch.tensor(deltas))
    rotate_err = torch.maximum(_per_row_max(moved - theirs([j + d for d in deltas])),
                               _per_row_max(back - theirs([j] * len(deltas))))
    f_max = float(rotary.inv_freq.abs().max()) if rotary.inv_freq.numel() else 0.0
    rotate_tol = [ROTARY_TOLERANCE + 2.0**-21 * (j + d) * f_max for d in deltas]
    bad_encode = [(p, e) for p, e in zip(positions, encode_err.tolist()) if not e <= ROTARY_TOLERANCE]
    bad_rotate = [(d, e) for d, e, t in zip(deltas, rotate_err.tolist(), rotate_tol) if not e <= t]
    report.update(
        encode={str(p): e for p, e in zip(positions, encode_err.tolist())},
        rotate_by={str(d): e for d, e in zip(deltas, rotate_err.tolist())},
        max_abs_diff=max(encode_err.max().item(), rotate_err.max().item() if deltas else 0.0),
        passed=not bad_encode and not bad_rotate,
    )
    problems = []
    if bad_encode:
        problems.append(
            f"our rotary encoding differs from transformers' {type(hf_module).__name__} at positions "
            f"{_pairs(bad_encode)} (max abs error {max(e for _, e in bad_encode):.3g}, tolerance "
            f"{ROTARY_TOLERANCE:g} on unit-scaled vectors); we rotate {rotary.rotary_dim} of {head_dim} dimensions "
            f"with {report['inv_freq_size']} frequencies, transformers has {report['transformers_inv_freq_size']}")
    if bad_rotate:
        problems.append(
            f"our deferred rotation R_delta does not move a key encoded at position {j} to where transformers "
            f"encodes position {j} + delta, for delta {_pairs(bad_rotate)} (max abs error "
            f"{max(e for _, e in bad_rotate):.3g})")
    if problems:
        report["problem"] = "; ".join(problems)
    return report


def _per_row_max(diff: torch.Tensor) -> torch.Tensor:
    return diff.abs().flatten(1).amax(dim=1)


def _pairs(items: list[tuple[int, float]], limit: int = 8) -> str:
    shown = ", ".join(f"{p}: {e:.3g}" for p, e in items[:limit])
    return "{" + shown + (", ..." if len(items) > limit else "") + "}"


# --- logits ----------------------------------------------------------------------------------
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
    err = _per_row_max(ours - ref[row_pos])
    scale = ref[row_pos].abs().max().item()
    tolerance = LOGITS_RTOL[engine.runner.kv_caches[0][0].dtype] * max(1.0, scale)
    report: dict[str, Any] = {
        "num_params": num_params,
        "dtype": str(engine.runner.kv_caches[0][0].dtype).removeprefix("torch."),
        "backend": engine.runner.backend.name,
        "tolerance": tolerance,
        "num_prompt_tokens": plan.num_prompt_tokens,
        "chunks": [{"global_start": s, "num_tokens": e - s, "delta": d} for s, e, d in isolated],
        "chunk_served_from_cache": from_cache,
        "rows": {str(p): e for p, e in zip(row_pos, err.tolist())},
        "max_abs_diff": err.max().item(),
        "max_abs_logit": scale,
        "offset_sensitivity": None if wrong is None else _per_row_max(wrong[row_pos] - ref[row_pos]).max().item(),
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
            f"{report['backend']} backend) at rows {_pairs(bad)}; ignoring the chunk's offset would change "
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
    CUDA graphs, a fixed probe prompt. Nothing of ``engine`` is touched."""
    from lazyattn_rag.engine.block_pool import BlockPool
    from lazyattn_rag.engine.chunk_cache import ChunkCache
    from lazyattn_rag.engine.engine import LLMEngine
    from lazyattn_rag.engine.runner import ModelRunner

    runner, bs = engine.runner, engine.block_size
    num_blocks = 2 * -(-512 // bs) + 4  # the probe's prompt and a position-aware copy of its chunk, with room
    config = replace(engine.config, cuda_graphs=False, scheduler=SchedulerConfig(),
                     cache=replace(engine.config.cache, anchor="none", num_blocks=num_blocks, kv_cache_bytes=None),
                     prompt=PromptConfig(system_prompt=None, instruction=instruction + "\n\n",
                                         document_separator="\n\n", question_prefix=""))
    probe_runner = ModelRunner(runner.model, runner.backend, num_blocks, bs, runner.device,
                               runner.kv_caches[0][0].dtype)
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
    if probe.config.cache.mode in _REUSE_MODES:  # encode the chunk first: the request then reads it from the cache
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


# --- the error --------------------------------------------------------------------------------
def _raise_on_failure(report: dict, hf_config: Any, engine, config: EngineConfig) -> None:
    failed = {part: r for part, r in report.items() if isinstance(r, dict) and not r.get("passed", True)}
    if not failed:
        return
    rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
    lines = [(f"start-up self-check failed: this model's positions differ from transformers' (model_type "
              f"{getattr(hf_config, 'model_type', None)!r}, rope {rope!r}, head_dim "
              f"{engine.runner.model.rotary.head_dim}, max_position_embeddings "
              f"{getattr(hf_config, 'max_position_embeddings', None)}), so cached chunks would be placed at "
              "silently wrong positions and the engine refuses to start.")]
    lines += [f"- {part}: {r['problem']}" for part, r in failed.items()]
    if "rotary" in failed:
        lines.append("To proceed: fix the model's RoPE configuration (config.json) or report it as unsupported; "
                     "EngineConfig(self_check=False) skips this check at your own risk (every position, not only "
                     "cached chunks, would then differ from transformers).")
    else:
        lines.append("To proceed: CacheConfig(mode='full') serves without chunk reuse (the check then probes a "
                     "plain prompt), another attention_backend may not have the fault, or EngineConfig("
                     "self_check=False) skips this check at your own risk.")
    raise SelfCheckError("\n".join(lines), report)
