"""Answer quality of chunk reuse vs full attention on public multi-document QA sets.

Same prompt, same passages in the same order, greedy decoding; only the attention differs:

* ``full``: a standard prefill of the whole prompt (``LazyAttention.complete`` on the token
  ids of the reuse plan, so the tokens are identical to the reuse modes).
* ``full-shuffled``: ``full`` with the passages in a random order (sizes the effect of
  order alone; the seed is per question).
* ``reuse``: chunk reuse, each passage encoded alone from local position 0 (``anchor="none"``,
  the LazyAttention and Block-Attention setting).
* ``reuse-head``: chunk reuse, each passage encoded after the prompt head (``anchor="head"``).
* ``reuse-bos``: chunk reuse, each passage encoded after the BOS token (``anchor="bos"``).
* ``recompute-k<k>``: EPIC-style remedy, reuse with the first ``k`` tokens of every passage
  recomputed in the request; composed with transformers (``benchmarks/qa_recompute.py``)
  because the engine cannot place request-private tokens between chunks yet.
  ``recompute-k0`` is the reference's own control (it should agree with ``reuse``).
* ``http-by-id``, ``http-learned``: the questions through a ``lazyattn serve`` app on this
  machine (``benchmarks/quality_http.py``): the passages by id, or pasted as plain text and
  served from the chunks the server learned (issue 36); anchor ``bos`` as ``reuse-bos``.

Metrics per dataset and mode (``benchmarks/qa_metrics.py``): answer contains gold after
SQuAD normalisation (best-subspan EM), token F1, exact match, the fraction of questions
whose answer equals the ``full`` answer, and the paired difference to ``full``; each with a
95% bootstrap interval. Fidelity to full attention, for the engine modes (issue 20): the KL
divergence KL(full || mode) of the first answer token's distribution (nats; from
``SamplingParams(logprobs=-1)``, computed against ``full``'s distributions of the same run) and
the agreement of that token's most likely id with ``full``'s (top-1 agreement, percent). The first non-empty line of each generation is scored (a lead-in line
ending in a colon, "The answer is:", is joined with the next one): ``qa_metrics.scored_answer``.

Full run (GPU, a local HF model directory; see ``docs/quality.md``)::

    python -m benchmarks.quality --model /path/to/Llama-3.1-8B-Instruct --device cuda

CPU sample with the offline default SmolLM2 (``--resume`` adds missing modes to an output)::

    python -m benchmarks.quality --device cpu --sample-size 8 --out benchmarks/results/quality_cpu.json
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import NamedTuple

if __package__ in (None, ""):  # run as a script: make ``benchmarks.*`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch
from tqdm import tqdm

from benchmarks.qa_data import DATASET_FILES, QAExample, default_data_dir, load_qa, passage_text
from benchmarks.qa_metrics import (
    answer_contains_gold,
    exact_match,
    scored_answer,
    scored_answer_complete,
    same_answer,
    summarize,
    summarize_raw,
    token_f1,
)
from benchmarks.quality_http import HTTP_MODES, QualityServer, run_http_mode, server_engine_config
from benchmarks.serving_setup import chunk_scaling_percent
from lazyattn_rag.fidelity import kl_divergence

ENGINE_MODES = {"full": "none", "full-shuffled": "none", "reuse": "none", "reuse-head": "head", "reuse-bos": "bos"}
# Chunk-head recompute in the engine (CacheConfig.recompute_chunk_head_tokens): "reuse-k16",
# "reuse-bos-k4", ...: the reuse mode of that anchor with the first k tokens of each passage recomputed.
# Selective recompute (CacheConfig.recompute_selective_ratio, CacheBlend): "reuse-sel15",
# "reuse-bos-sel5", ...: that reuse mode with r % of each passage's tokens recomputed.
# Chunk attention scaling (CacheConfig.chunk_attention_scaling, APE): "reuse-bos-ape80" (temperature
# 0.8), "reuse-bos-ape90w80" (temperature 0.9, weight 0.8): that reuse mode with its documents so read.
_HEAD_RECOMPUTE = re.compile(r"^(reuse|reuse-head|reuse-bos)-k(\d+)$")
_SELECTIVE_RECOMPUTE = re.compile(r"^(reuse|reuse-head|reuse-bos)-sel(\d+)$")
_CHUNK_SCALING = re.compile(r"^(reuse|reuse-head|reuse-bos)-ape(\d+)(?:w(\d+))?$")


class EngineSetting(NamedTuple):
    """The engine an engine mode runs on: its anchor and remedy (``recompute_tokens``: chunk-head
    ``k``; ``selective_ratio``: selective recompute's ``r``; ``temperature``, ``weight``: chunk
    attention scaling, off at 1 and 1)."""

    anchor: str
    recompute_tokens: int = 0
    selective_ratio: float = 0.0
    temperature: float = 1.0
    weight: float = 1.0


def engine_setting(mode: str) -> EngineSetting | None:
    """The :class:`EngineSetting` of an engine mode, or ``None``."""
    if mode in ENGINE_MODES:
        return EngineSetting(ENGINE_MODES[mode])
    if m := _HEAD_RECOMPUTE.match(mode):
        return EngineSetting(ENGINE_MODES[m.group(1)], recompute_tokens=int(m.group(2)))
    if (m := _SELECTIVE_RECOMPUTE.match(mode)) and 0 < int(m.group(2)) <= 100:
        return EngineSetting(ENGINE_MODES[m.group(1)], selective_ratio=int(m.group(2)) / 100)
    if (m := _CHUNK_SCALING.match(mode)) and (setting := chunk_scaling_percent(m.group(2), m.group(3))):
        return EngineSetting(ENGINE_MODES[m.group(1)], temperature=setting[0], weight=setting[1])
    return None
def engine_run_order(modes: list[str]) -> list[str]:
    """The engine modes of ``modes`` in the order they run: ``full`` first (the others' fidelity
    is measured against it), then as given (a time-limited run gets the modes asked for first)."""
    return sorted((m for m in modes if engine_setting(m)), key=lambda m: m != "full")


DEFAULT_MODES = ("full", "full-shuffled", "reuse", "reuse-head", "reuse-bos", "recompute")
# Default sample: >= 200 questions of the large sets, all of MuSiQue (160) and 2WikiMultihopQA (131).
DEFAULT_SAMPLE_SIZES = {"hotpotqa": 200, "2wikimultihopqa": 0, "2wikimultihopqa_goldonly": 200, "musique": 0,
                        "nq_open_oracle": 200}
INSTRUCTION = ("Answer the question using the documents below. "
               "Reply with the answer only: a short phrase, a name, a date or yes/no.\n\n")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def prompt_config():
    """The benchmark's :class:`PromptConfig` (the model's chat template frames it)."""
    from lazyattn_rag.types.config import PromptConfig

    return PromptConfig(instruction=INSTRUCTION, document_separator="\n\n", question_prefix="Question: ")


def doc_ids_of(dataset: str, ex: QAExample) -> list[str]:
    return [f"{dataset}/{ex.id}/{i}" for i in range(len(ex.passages))]


def shuffled(items: list, seed: int, question_id: str) -> list:
    """A copy of ``items`` in a random order fixed by ``(seed, question_id)``."""
    out = list(items)
    random.Random(f"{seed}:{question_id}").shuffle(out)
    return out


# --- engine modes -----------------------------------------------------------------------------
def make_engine(args, anchor: str, recompute_tokens: int = 0, selective_ratio: float = 0.0,
                temperature: float = 1.0, weight: float = 1.0):
    from lazyattn_rag.llm import LazyAttention

    return LazyAttention(engine_config(args, anchor, recompute_tokens, selective_ratio, temperature, weight))


def engine_config(args, anchor: str, recompute_tokens: int = 0, selective_ratio: float = 0.0,
                  temperature: float = 1.0, weight: float = 1.0):
    """The :class:`EngineConfig` of an engine mode (and of the HTTP modes' server, anchor ``bos``)."""
    from lazyattn_rag import CacheConfig, EngineConfig, SchedulerConfig

    return EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype, cache_dir=args.cache_dir,
        cuda_graphs=args.cuda_graphs,
        cache=CacheConfig(anchor=anchor, kv_cache_fraction=args.kv_cache_fraction if args.device != "cpu" else None,
                          recompute_chunk_head_tokens=recompute_tokens, recompute_selective_ratio=selective_ratio,
                          chunk_attention_scaling=(temperature, weight) != (1.0, 1.0),
                          chunk_attention_temperature=temperature, chunk_attention_weight=weight),
        scheduler=SchedulerConfig(max_num_batched_tokens=args.max_batched_tokens, max_num_seqs=args.concurrency),
        prompt=prompt_config())


def answer_with_engine(llm, mode: str, dataset: str, ex: QAExample, sampling, seed: int):
    """One question in an engine mode; registers the passages and forgets them afterwards.

    Returns:
        ``(text, first_logprobs)``: the generation, and the first answer token's log-probabilities
        over the vocabulary (``[vocab_size]`` float32; ``sampling`` asks for ``logprobs=-1``).
    """
    ids = doc_ids_of(dataset, ex)
    llm.add_documents([(d, passage_text(t, x)) for d, (t, x) in zip(ids, ex.passages)])
    try:
        if mode.startswith("reuse"):
            deltas = llm.stream(ex.question, ids, sampling=sampling)
        else:
            order = ids if mode == "full" else shuffled(ids, seed, ex.id)
            deltas = llm.stream_prompt(llm.plan(ex.question, order).token_ids(), sampling)
        return read_first_line(deltas)
    finally:
        for d in ids:
            llm.remove_document(d)


def read_first_line(deltas):
    """Text of a delta stream, stopped (the request cancelled) once its scored answer is complete,
    and its first token's log-probabilities (a ``[vocab_size]`` float32 array, or ``None``)."""
    text, first = "", None
    for delta in deltas:
        text += delta.text
        if first is None and delta.logprobs is not None:  # the first token's (on the final delta if it was EOS)
            first = np.asarray(delta.logprobs.values(), dtype=np.float32)
        if scored_answer_complete(text):
            deltas.close()  # cancels the request in the engine and frees its blocks
            break
    return text, first


def run_engine_mode(llm, mode, dataset, examples, args) -> tuple[dict[str, str], dict[str, np.ndarray]]:
    """Every question of ``dataset`` in ``mode``: generations and first-token log-probabilities by question id."""
    from lazyattn_rag import SamplingParams

    sampling = SamplingParams(max_tokens=args.max_answer_tokens, logprobs=-1)
    out, first = {}, {}
    with ThreadPoolExecutor(max_workers=args.concurrency) as pool, \
            tqdm(total=len(examples), desc=f"{dataset:>24} {mode}", leave=True) as bar:
        futures = {pool.submit(answer_with_engine, llm, mode, dataset, ex, sampling, args.seed): ex for ex in examples}
        for f in as_completed(futures):
            out[futures[f].id], first[futures[f].id] = f.result()
            bar.update()
    return out, first


# --- the transformers reference (recompute remedy) -------------------------------------------
def run_recompute_mode(ref, template, k, dataset, examples, args) -> dict[str, str]:
    out = {}
    head = template.head_token_ids()
    for ex in tqdm(examples, desc=f"{dataset:>24} recompute-k{k}"):
        chunks = [template.document_token_ids(passage_text(t, x)) for t, x in ex.passages]
        def stop(ids):
            return scored_answer_complete(template.tokenizer.decode(ids, skip_special_tokens=True))

        tokens = ref.generate(head, chunks, template.tail_token_ids(ex.question), k, args.max_answer_tokens, stop)
        out[ex.id] = template.tokenizer.decode(tokens, skip_special_tokens=True)
    return out


# --- scoring ----------------------------------------------------------------------------------
def score_mode(examples: list[QAExample], generations: dict[str, str], full: dict[str, str] | None,
               seed: int, first_token: dict[str, dict] | None = None) -> dict:
    """Summaries (percent, 95% bootstrap CI) of one mode's generations on one dataset.

    ``first_token``: per question id, ``{"top1": id, "kl_vs_full": nats, "full_top1": id}`` of the
    first answer token (see :func:`first_token_fidelity`); summarized when every question has it.
    """
    preds = [scored_answer(generations[ex.id]) for ex in examples]
    contains = [answer_contains_gold(p, ex.answers) for p, ex in zip(preds, examples)]
    result = {
        "contains_gold": summarize(contains, seed=seed),
        "f1": summarize([token_f1(p, ex.answers) for p, ex in zip(preds, examples)], seed=seed),
        "em": summarize([exact_match(p, ex.answers) for p, ex in zip(preds, examples)], seed=seed),
    }
    if full is not None:
        full_preds = [scored_answer(full[ex.id]) for ex in examples]
        full_contains = [answer_contains_gold(p, ex.answers) for p, ex in zip(full_preds, examples)]
        result["same_as_full"] = summarize([same_answer(p, q) for p, q in zip(preds, full_preds)], seed=seed)
        result["contains_gold_minus_full"] = summarize([a - b for a, b in zip(contains, full_contains)], seed=seed)
    ft = [f for f in (first_token.get(ex.id) for ex in examples) if f is not None and "kl_vs_full" in f] \
        if first_token else []
    if ft:  # over the questions that have them ("n"; all of them when full ran in the same invocation)
        result["first_token_kl"] = summarize_raw([f["kl_vs_full"] for f in ft], seed=seed)
        result["first_token_top1_agreement"] = summarize([float(f["top1"] == f["full_top1"]) for f in ft], seed=seed)
    return result


def first_token_fidelity(results: dict, dataset: str, mode: str, logprobs: dict[str, np.ndarray],
                         full_logprobs: dict[str, np.ndarray] | None) -> None:
    """Store, per question, ``mode``'s first-token top-1 id and, with ``full``'s distributions of
    this run, its KL(full || mode) and full's top-1 id (``generations[..]["first_token"][mode]``)."""
    for qid, lp in logprobs.items():
        if lp is None:
            continue
        entry = {"top1": int(np.argmax(lp))}
        ref = full_logprobs.get(qid) if full_logprobs else None
        if ref is not None:
            entry |= {"kl_vs_full": kl_divergence(ref, lp), "full_top1": int(np.argmax(ref))}
        results["generations"][dataset][qid].setdefault("first_token", {})[mode] = entry


def rescore(results: dict, dataset: str, examples: list[QAExample], seed: int) -> None:
    """Recompute the summaries of every mode that has answered all of ``dataset``'s questions."""
    gens = results["generations"][dataset]
    done = set.intersection(*(set(g["modes"]) for g in gens.values())) if gens else set()
    by_mode = {m: {qid: g["modes"][m] for qid, g in gens.items()} for m in done}
    d = results["datasets"][dataset]
    first = {m: {qid: g.get("first_token", {}).get(m) for qid, g in gens.items()} for m in done}
    d["modes"] = {m: score_mode(examples, by_mode[m], by_mode.get("full") if m != "full" else None, seed,
                                first[m] if m != "full" else None)
                  | {"seconds": d["seconds"].get(m)} for m in sorted(by_mode, key=mode_order)}


def pool(results: dict, seed: int) -> dict:
    """Summaries over the questions of all datasets together, for the modes every dataset has."""
    gens = results["generations"]
    modes = [set.intersection(*(set(g["modes"]) for g in d.values())) for d in gens.values() if d]
    common = set.intersection(*modes) if modes else set()
    examples = [QAExample(f"{d}/{qid}", "", tuple(g["answers"]), ()) for d, qs in gens.items() for qid, g in qs.items()]
    by_mode = {m: {f"{d}/{qid}": g["modes"][m] for d, qs in gens.items() for qid, g in qs.items()} for m in common}
    first = {m: {f"{d}/{qid}": g.get("first_token", {}).get(m) for d, qs in gens.items() for qid, g in qs.items()}
             for m in common}
    if not examples:
        return {}
    return {m: score_mode(examples, by_mode[m], by_mode.get("full") if m != "full" else None, seed,
                          first[m] if m != "full" else None)
            for m in sorted(by_mode, key=mode_order)}


def resume_from(results: dict, prior: dict, examples: dict[str, list[QAExample]], seed: int) -> None:
    """Copy a previous run's generations for the same questions into ``results`` (``--resume``).

    Raises:
        ValueError: a dataset of the previous run holds other questions (another seed or sample size).
    """
    for dataset, gens in prior.get("generations", {}).items():
        if dataset not in examples:  # not part of this run: kept as it was
            results["datasets"][dataset], results["generations"][dataset] = prior["datasets"][dataset], gens
            continue
        if set(gens) != {ex.id for ex in examples[dataset]}:
            raise ValueError(f"--resume: {dataset} in the previous output has other questions; use the same "
                             "--seed and --sample-size, or another --out")
        for qid, g in gens.items():
            results["generations"][dataset][qid]["modes"].update(g["modes"])
            if "first_token" in g:
                results["generations"][dataset][qid].setdefault("first_token", {}).update(g["first_token"])
        results["datasets"][dataset]["seconds"].update(prior["datasets"][dataset].get("seconds", {}))
        rescore(results, dataset, examples[dataset], seed)


def mode_order(mode: str) -> tuple[int, int]:
    base = mode if not mode.startswith("recompute-k") else "recompute"
    k = int(mode.removeprefix("recompute-k")) if mode.startswith("recompute-k") else 0
    if m := _HEAD_RECOMPUTE.match(mode):
        base, k = m.group(1), int(m.group(2))
    order = ("full", "full-shuffled", "reuse", "reuse-bos", "reuse-head", "recompute")
    return (order.index(base) if base in order else len(order), k)


def markdown_table(results: dict) -> str:
    """One table per dataset: mode, contains-gold, F1, EM, same-as-full, difference to full (95% CIs)."""
    lines = []
    datasets = dict(results["datasets"])
    if len(datasets) > 1 and results.get("all_datasets"):
        n = sum(d["num_questions"] for d in datasets.values())
        datasets["all datasets pooled"] = {"num_questions": n, "modes": results["all_datasets"]}
    fmt = lambda s: f"{s['mean']:.1f} [{s['ci95'][0]:.1f}, {s['ci95'][1]:.1f}]"  # noqa: E731
    for dataset, d in datasets.items():
        n = next(iter(d["modes"].values()))["contains_gold"]["n"] if d["modes"] else 0
        lines += [f"\n**{dataset}** ({n} questions)\n",
                  "| mode | contains gold % | token F1 % | EM % | same answer as full % "
                  "| contains gold − full (points) | first-token KL vs full (nats) | first-token top-1 = full % |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        kl_fmt = lambda s: f"{s['mean']:.3f} [{s['ci95'][0]:.3f}, {s['ci95'][1]:.3f}]"  # noqa: E731
        for mode, m in d["modes"].items():
            same = fmt(m["same_as_full"]) if "same_as_full" in m else "–"
            diff = fmt(m["contains_gold_minus_full"]) if "contains_gold_minus_full" in m else "–"
            kl = kl_fmt(m["first_token_kl"]) if "first_token_kl" in m else "–"
            top1 = fmt(m["first_token_top1_agreement"]) if "first_token_top1_agreement" in m else "–"
            lines.append(f"| {mode} | {fmt(m['contains_gold'])} | {fmt(m['f1'])} | {fmt(m['em'])} | {same} | {diff} "
                         f"| {kl} | {top1} |")
    return "\n".join(lines)


# --- driver -----------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--data", type=Path, default=default_data_dir(),
                   help="folder holding qa/*.jsonl (default: ../shared/data when present)")
    p.add_argument("--datasets", default=",".join(DATASET_FILES), help="comma-separated dataset names")
    p.add_argument("--sample-size", type=int, default=None,
                   help="questions per dataset (0 = all); default: 200 of HotpotQA, 2Wiki gold-only and NQ, "
                        "all of MuSiQue and 2Wiki")
    p.add_argument("--seed", type=int, default=0, help="seed of the question sample, the shuffles and the bootstrap")
    p.add_argument("--model", default=None, help="local HF model directory (default: the offline SmolLM2)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:i]")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto = bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--max-answer-tokens", type=int, default=32, help="most tokens generated per answer")
    p.add_argument("--modes", default=",".join(DEFAULT_MODES),
                   help=f"comma-separated subset of {', '.join(ENGINE_MODES)}, recompute (transformers reference), "
                        "engine chunk-head recompute modes such as reuse-k16, reuse-bos-k4, selective "
                        "recompute modes (percent of each passage) such as reuse-sel15, reuse-bos-sel5, and chunk "
                        "attention scaling modes (APE: temperature and weight in percent) such as "
                        "reuse-bos-ape80, reuse-bos-ape100w80")
    p.add_argument("--recompute-tokens", default="0,16",
                   help="comma-separated k values of the recompute remedy; 0 is the reference's own control "
                        "(reuse through transformers: compare k > 0 with it, not with the engine's numerics)")
    p.add_argument("--concurrency", type=int, default=None, help="requests in flight (default 64 on CUDA, 4 on CPU)")
    p.add_argument("--max-batched-tokens", type=int, default=None,
                   help="engine tokens per step (default 16384 on CUDA, 2048 on CPU)")
    p.add_argument("--kv-cache-fraction", type=float, default=0.5, help="fraction of free GPU memory for K/V")
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="where converted models and weight hashes are kept (default: the user cache dir)")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="run decode steps eagerly on CUDA (default: replay captured CUDA graphs)")
    p.add_argument("--http-kv-cache-bytes", type=int, default=8 << 30,
                   help="KV budget of the HTTP modes' server replica (http-by-id, http-learned)")
    p.add_argument("--report", action="store_true", help="print the tables of an existing --out JSON and exit")
    p.add_argument("--resume", action="store_true",
                   help="keep the answers already in --out (same questions) and run only the missing modes")
    p.add_argument("--out", type=Path, default=None,
                   help="output JSON (default benchmarks/results/quality_<device>.json)")
    args = p.parse_args(argv)
    if args.data is None and not args.report:
        p.error("no --data given and ../shared/data does not exist")
    if args.cache_dir is None:
        try:
            import platformdirs  # noqa: F401  (EngineConfig's default cache dir needs it)
        except ImportError:
            args.cache_dir = Path.home() / ".cache" / "lazyattn-rag"
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = args.device.startswith("cuda")
    args.concurrency = args.concurrency or (64 if cuda else 4)
    args.max_batched_tokens = args.max_batched_tokens or (16384 if cuda else 2048)
    if args.dtype == "auto":
        args.dtype = "bfloat16" if cuda else "float32"
    args.out = args.out or Path(__file__).resolve().parent / "results" / f"quality_{args.device.split(':')[0]}.json"
    args.datasets = [d for d in args.datasets.split(",") if d]
    args.modes = [m for m in args.modes.split(",") if m]
    args.recompute_tokens = [int(k) for k in args.recompute_tokens.split(",") if k]
    unknown = [m for m in args.modes if engine_setting(m) is None and m not in ("recompute", *HTTP_MODES)]
    if unknown:
        p.error(f"unknown modes {unknown}")
    return args


def load_examples(args, template, max_model_len: int) -> tuple[dict[str, list[QAExample]], dict[str, int]]:
    """Sampled questions per dataset, without those whose prompt + answer exceeds the context."""
    kept, skipped = {}, {}
    for dataset in args.datasets:
        size = args.sample_size if args.sample_size is not None else DEFAULT_SAMPLE_SIZES.get(dataset, 200)
        examples = load_qa(args.data, dataset, size, args.seed)
        head, fits = len(template.head_token_ids()), []
        for ex in examples:
            n = head + len(template.tail_token_ids(ex.question)) + sum(
                len(template.document_token_ids(passage_text(t, x))) for t, x in ex.passages)
            if n + args.max_answer_tokens < max_model_len:
                fits.append(ex)
        kept[dataset], skipped[dataset] = fits, len(examples) - len(fits)
    return kept, skipped


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.report:
        results = json.loads(args.out.read_text())
        results["all_datasets"] = pool(results, args.seed)
        print(markdown_table(results))
        return results
    from transformers import AutoConfig, AutoTokenizer

    from lazyattn_rag.types.config import EngineConfig
    from lazyattn_rag.engine.model.model_loading import resolve_model
    from lazyattn_rag.engine.planning.prompt import PromptTemplate

    source = resolve_model(args.model, EngineConfig(cache_dir=args.cache_dir).resolved_cache_dir())
    tokenizer = AutoTokenizer.from_pretrained(str(source.path), local_files_only=True)
    hf_config = AutoConfig.from_pretrained(str(source.path), local_files_only=True)
    template = PromptTemplate(tokenizer, prompt_config())
    examples, skipped = load_examples(args, template, hf_config.max_position_embeddings)
    results = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "model": source.name, "model_dir": str(source.path),
        "host": platform.node(), "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else None,
        "prompt_template": {"head": template.head_text(), "document": template.document_text("Title: {title}\n{text}"),
                            "tail": template.tail_text("{question}")},
        "datasets": {d: {"num_questions": len(e), "num_skipped_too_long": skipped[d], "seconds": {}, "modes": {}}
                     for d, e in examples.items()},
        "generations": {d: {ex.id: {"answers": list(ex.answers), "modes": {}} for ex in e}
                        for d, e in examples.items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.resume and args.out.is_file():
        resume_from(results, json.loads(args.out.read_text()), examples, args.seed)

    def done(dataset, mode):
        return all(mode in g["modes"] for g in results["generations"][dataset].values())

    first_logprobs: dict[str, dict[str, dict]] = {d: {} for d in args.datasets}  # this run's, by mode

    def record(dataset, mode, generations, seconds, logprobs=None):
        for qid, text in generations.items():
            results["generations"][dataset][qid]["modes"][mode] = text
        if logprobs is not None:
            first_logprobs[dataset][mode] = logprobs
            first_token_fidelity(results, dataset, mode, logprobs, first_logprobs[dataset].get("full"))
        results["datasets"][dataset]["seconds"][mode] = round(seconds, 2)
        rescore(results, dataset, examples[dataset], args.seed)
        results["all_datasets"] = pool(results, args.seed)
        args.out.write_text(json.dumps(results, indent=1, ensure_ascii=False))

    # full first in each dataset: the fidelity figures of the other modes compare with its
    # distributions (a resumed run re-runs it where other modes are missing: they are not stored);
    # the others in the order given
    modes = engine_run_order(args.modes)

    def pending(dataset, mode):  # full again where another mode (an HTTP one too) still needs its distributions
        return not done(dataset, mode) or (mode == "full" and any(
            not done(dataset, m) for m in modes + [m for m in args.modes if m in HTTP_MODES]))

    for setting in dict.fromkeys(engine_setting(m) for m in modes):
        todo = [(d, m) for d in args.datasets for m in modes if engine_setting(m) == setting and pending(d, m)]
        if not todo:
            continue
        llm = make_engine(args, *setting)
        try:
            for dataset, mode in todo:
                start = time.perf_counter()
                gens, logprobs = run_engine_mode(llm, mode, dataset, examples[dataset], args)
                record(dataset, mode, gens, time.perf_counter() - start, logprobs)
        finally:
            llm.shutdown()
            del llm
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    http_todo = [(d, m) for d in args.datasets for m in args.modes if m in HTTP_MODES and not done(d, m)]
    if http_todo:
        server_config = server_engine_config(engine_config(args, "bos"), args.http_kv_cache_bytes)
        with QualityServer(server_config, args.concurrency) as server:
            for dataset, mode in http_todo:
                start = time.perf_counter()
                gens, logprobs, counts = run_http_mode(server, mode, dataset, examples[dataset], prompt_config(),
                                                       args, hf_config.vocab_size)
                results["datasets"][dataset].setdefault("placements", {})[mode] = counts
                record(dataset, mode, gens, time.perf_counter() - start, logprobs)

    if "recompute" in args.modes:
        from benchmarks.qa_recompute import RecomputeReference, generation_eos_ids

        eos_ids = generation_eos_ids(source.path, tokenizer)
        ref = RecomputeReference(source.path, args.device, _DTYPES[args.dtype], eos_ids)
        for dataset in args.datasets:
            for k in args.recompute_tokens:
                if done(dataset, f"recompute-k{k}"):
                    continue
                start = time.perf_counter()
                gens = run_recompute_mode(ref, template, k, dataset, examples[dataset], args)
                record(dataset, f"recompute-k{k}", gens, time.perf_counter() - start)
    results["all_datasets"] = pool(results, args.seed)
    args.out.write_text(json.dumps(results, indent=1, ensure_ascii=False))
    print(markdown_table(results))
    print(f"\nwrote {args.out}")
    return results


if __name__ == "__main__":
    main()
