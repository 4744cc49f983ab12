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
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``benchmarks.*`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch
from tqdm import tqdm

from benchmarks.qa_data import DATASET_FILES, QAExample, default_data_dir, load_qa, passage_text
from benchmarks.qa_metrics import scored_answer_complete
from benchmarks.quality_modes import ENGINE_MODES, engine_run_order, engine_setting, fp8_base_mode
from benchmarks.quality_results import first_token_fidelity, markdown_table, pool, rescore, resume_from
from benchmarks.quality_http import HTTP_MODES, QualityServer, run_http_mode, server_engine_config

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
def make_engine(args, *setting):
    """The engine of an :class:`~benchmarks.quality_modes.EngineSetting` (its fields in order)."""
    from lazyattn_rag.llm import LazyAttention

    return LazyAttention(engine_config(args, *setting))


def engine_config(args, anchor: str, recompute_tokens: int = 0, selective_ratio: float = 0.0,
                  temperature: float = 1.0, weight: float = 1.0, scope: str = "chunk", first_head: bool = True,
                  kv_cache_dtype: str = "auto"):
    """The :class:`EngineConfig` of an engine mode (and of the HTTP modes' server, anchor ``bos``)."""
    from lazyattn_rag import CacheConfig, EngineConfig, SchedulerConfig

    return EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype, cache_dir=args.cache_dir,
        cuda_graphs=args.cuda_graphs,
        cache=CacheConfig(anchor=anchor, kv_cache_fraction=args.kv_cache_fraction if args.device != "cpu" else None,
                          recompute_chunk_head_tokens=recompute_tokens, recompute_selective_ratio=selective_ratio,
                          chunk_attention_scaling=(temperature, weight) != (1.0, 1.0),
                          chunk_attention_temperature=temperature, chunk_attention_weight=weight,
                          chunk_attention_scope=scope, recompute_first_chunk_head=first_head,
                          kv_cache_dtype=kv_cache_dtype),
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
            base = fp8_base_mode(mode)
            first_token_fidelity(results, dataset, mode, logprobs, first_logprobs[dataset].get("full"),
                                 first_logprobs[dataset].get(base) if base else None)
        results["datasets"][dataset]["seconds"][mode] = round(seconds, 2)
        rescore(results, dataset, examples[dataset], args.seed)
        results["all_datasets"] = pool(results, args.seed)
        args.out.write_text(json.dumps(results, indent=1, ensure_ascii=False))

    # full first in each dataset: the fidelity figures of the other modes compare with its
    # distributions (a resumed run re-runs it where other modes are missing: they are not stored);
    # the others in the order given
    modes = engine_run_order(args.modes)

    def pending(dataset, mode):  # full again where another mode (an HTTP one too) still needs its distributions
        if not done(dataset, mode):  # and an FP8 mode's own mode again where the FP8 mode is still to run
            return True
        if mode == "full":
            return any(not done(dataset, m) for m in modes + [m for m in args.modes if m in HTTP_MODES])
        return any(fp8_base_mode(m) == mode and not done(dataset, m) for m in modes)

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
