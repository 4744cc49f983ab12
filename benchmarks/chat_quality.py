"""Answered-right counts of the chatbot on a fixed question set, before and after a change of
its generation settings (issue 15): the chatbot's own pipeline (LlamaIndex retrieval over the
FAISS store, ``as_query_engine`` with :class:`LazyAttentionLLM`) over local document folders.

    python benchmarks/chat_quality.py                      # default model, CPU
    python benchmarks/chat_quality.py --seeds 3 --out benchmarks/results/chat_quality_cpu.json

Settings compared side by side in one run (same retrieval, same engine):

* ``v0.1``: what ``lazyattn chat`` used: greedy, stop at a blank line, 128 tokens;
* ``greedy, end of turn``: greedy, stop only at the template's end of turn (the model's EOS);
* ``model defaults``: the model's recommended sampling (``LazyAttention.default_sampling``, from
  its generation config), end of turn, 128 tokens; sampled settings run with ``--seeds`` seeds
  per question and count the mean;
* ``model defaults + repetition_penalty 1.1``: the same with a mild repetition penalty;
* ``model defaults + loop guard N`` (``--loop-guards N ...``): the model's sampling with
  ``SamplingParams.loop_guard_ngram=N`` (issue 38: the answer ends before a repeated run of N
  tokens).

``--settings`` runs only the named ones. Besides answers right, each setting counts the answers
that reach the token cap (``num_output_tokens == max_tokens``: what a looping answer does).

A question is answered right when the answer contains one of its answers and none of its wrong
ones (case-insensitive; numbers as whole numbers); retrieval is scored the same way on the
retrieved chunks (is an answer in what the model saw). An answer is a phrase loop when some
6-word sequence occurs 3 times or more.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import platform
import re
import statistics
import sys
import time
from pathlib import Path

from lazyattn_rag.types.sampling_params import SamplingParams

QUESTIONS = Path(__file__).parent / "data" / "chat_questions.json"
MAX_TOKENS = 128


def sklearn_descr_dir() -> Path | None:
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "datasets" / "descr"
    return path if path.is_dir() else None


def settings(default: SamplingParams, max_tokens: int, loop_guards=()) -> dict[str, SamplingParams]:
    model = dataclasses.replace(default, max_tokens=max_tokens, loop_guard_ngram=None)
    return {
        "v0.1": SamplingParams(max_tokens=max_tokens, stop=("\n\n",)),
        "greedy, end of turn": SamplingParams(max_tokens=max_tokens),
        "model defaults": model,
        "model defaults + repetition_penalty 1.1": dataclasses.replace(model, repetition_penalty=1.1),
        **{f"model defaults + loop guard {n}": dataclasses.replace(model, loop_guard_ngram=n) for n in loop_guards},
    }


def _contains(text: str, answer: str) -> bool:
    """Case-insensitive; a number only as a whole number (``13`` not in ``130`` or ``2013``)."""
    if answer.replace(",", "").isdigit():
        return re.search(rf"(?<![\d,]){re.escape(answer)}(?![\d,])", text) is not None
    return answer.lower() in text.lower()


def is_right(text: str, answers: list[str], wrong: list[str] = ()) -> bool:
    return any(_contains(text, a) for a in answers) and not any(_contains(text, w) for w in wrong)


def is_degenerate(text: str, n: int = 6, times: int = 3) -> bool:
    """A phrase loop: some ``n``-word sequence occurs ``times`` times or more."""
    words = text.split()
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    return any(grams.count(g) >= times for g in set(grams))


def query_engines(corpora: dict[str, Path | None], llm_engine, top_k: int, cache_dir: Path, log):
    """One retriever per corpus, built (or loaded) as the chatbot builds its index."""
    from llama_index.core import VectorStoreIndex

    from lazyattn_rag.integrations.chatbot import corpus_fingerprint, load_or_build_store
    from lazyattn_rag.integrations.corpus import folder_sources, pydoc_sources
    from lazyattn_rag.integrations.embeddings import llamaindex_embedding

    embed_model = llamaindex_embedding()
    out = {}
    for name, path in corpora.items():
        sources = pydoc_sources() if path is None else folder_sources(path)
        index_dir = cache_dir / "indexes" / corpus_fingerprint(sources, embed_model, 16)
        store = load_or_build_store(sources, embed_model, index_dir, 16, False, log)
        store.client.attach_engine(llm_engine)
        out[name] = VectorStoreIndex.from_vector_store(store, embed_model=embed_model)
    return out


def run(args) -> dict:
    from lazyattn_rag import EngineConfig, LazyAttention
    from lazyattn_rag.integrations.llamaindex import LazyAttentionLLM, as_query_engine

    data = json.loads(QUESTIONS.read_text())
    corpora = {"pydoc": None, "sklearn_descr": args.sklearn_descr}
    engine = LazyAttention(EngineConfig(device=args.device))
    indexes = query_engines(corpora, engine, args.top_k, engine.config.resolved_cache_dir(), sys.stderr)
    results = {"questions": [], "settings": {}}
    chosen = settings(engine.default_sampling, args.max_tokens, args.loop_guards)
    for name, base in chosen.items():
        if args.settings and name not in args.settings:
            continue
        seeds = range(args.seeds) if base.temperature > 0 else [None]
        llms = {seed: LazyAttentionLLM(engine, dataclasses.replace(base, seed=seed)) for seed in seeds}
        rows = []
        for q in data["questions"]:
            per_seed = []
            for seed, llm in llms.items():
                query_engine = as_query_engine(indexes[q["corpus"]], llm, similarity_top_k=args.top_k)
                t0 = time.perf_counter()
                response = query_engine.query(q["question"])
                text = str(response.response).strip()
                context = " ".join(n.node.get_content() for n in response.source_nodes)
                per_seed.append({"answer": text, "right": is_right(text, q["answers"], q.get("wrong", [])),
                                 "retrieved_right": is_right(context, q["answers"]),
                                 "degenerate": is_degenerate(text),
                                 "num_output_tokens": response.metadata["lazyattn"]["stats"]["num_output_tokens"],
                                 "seconds": time.perf_counter() - t0, "seed": seed})
                print(f"[{name}] {q['question']} -> {'RIGHT' if per_seed[-1]['right'] else 'wrong'}: "
                      f"{text[:100]!r}", file=sys.stderr, flush=True)
            rows.append(per_seed)
        right = sum(sum(r["right"] for r in per) / len(per) for per in rows)
        results["settings"][name] = {"sampling": dataclasses.asdict(base), "num_seeds": len(seeds),
                                     "answered_right": right, "num_questions": len(rows),
                                     "degenerate": sum(sum(r["degenerate"] for r in per) / len(per) for per in rows),
                                     "reached_cap": sum(sum(r["num_output_tokens"] >= args.max_tokens for r in per)
                                                        / len(per) for per in rows),
                                     "median_output_tokens": statistics.median(
                                         r["num_output_tokens"] for per in rows for r in per),
                                     "retrieved_right": sum(per[0]["retrieved_right"] for per in rows),
                                     "runs": rows}
        print(f"== {name}: {right:.2f} / {len(rows)} answered right", file=sys.stderr, flush=True)
    results["questions"] = data["questions"]
    results["conditions"] = {"model": engine.model_name, "device": str(engine.device), "top_k": args.top_k,
                             "max_tokens": args.max_tokens, "platform": platform.platform(),
                             "python": platform.python_version(), "command": " ".join(sys.argv),
                             "sklearn_descr": str(args.sklearn_descr)}
    engine.shutdown()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--top-k", type=int, default=3)
    parser.add_argument("--seeds", type=int, default=3, help="seeds per question for sampled settings")
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help="the chat's answer limit")
    parser.add_argument("--sklearn-descr", type=Path, default=sklearn_descr_dir(),
                        help="folder of .rst documents (default: scikit-learn's dataset descriptions)")
    parser.add_argument("--loop-guards", type=int, nargs="*", default=[], help="loop guard n-grams to compare")
    parser.add_argument("--settings", nargs="*", default=[], help="run only these settings (names as printed)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/chat_quality_cpu.json"))
    args = parser.parse_args()
    if args.sklearn_descr is None:
        parser.error("scikit-learn's dataset descriptions were not found: pass --sklearn-descr FOLDER")
    results = run(args)
    args.out.write_text(json.dumps(results, indent=1))
    for name, r in results["settings"].items():
        print(f"{name:40s} {r['answered_right']:.2f} / {r['num_questions']} answered right, "
              f"{r['degenerate']:.2f} phrase loops, {r['reached_cap']:.2f} reach the cap, "
              f"median {r['median_output_tokens']} tokens "
              f"(retrieval found an answer for {r['retrieved_right']})")


if __name__ == "__main__":
    main()
