"""Retrieval that finds the fact (issue 38.3): recall@k and answers right of the chatbot's
pipeline with embedding retrieval against hybrid retrieval (BM25 + embeddings, reciprocal rank
fusion), over a folder of invented facts written for the purpose.

    python benchmarks/retrieval_quality.py                 # default model, CPU, 3 seeds
    python benchmarks/retrieval_quality.py --docs DIR --questions FILE.json

The folder (``benchmarks/data/invented_facts/``) holds 17 short files about one invented
coast; several repeat a society's name, the file with its founder names it once. The questions
(``benchmarks/data/invented_facts_questions.json``) name the files that hold each answer.
Per (retrieval, k): **recall@k** (a gold file among the top k retrieved chunks; retrieval is
deterministic) and **answers right** (the chatbot's own pipeline, ``run_chat``'s retriever and
query engine with the model's recommended sampling and the chat's loop guard, ``--seeds`` seeds
per question, the mean; right when the answer contains one of the answers, numbers as whole
numbers). Results: ``benchmarks/results/retrieval_quality_cpu.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import platform
import sys
import time
from pathlib import Path

from chat_quality import is_right

DATA = Path(__file__).parent / "data"


def run(args) -> dict:
    from llama_index.core import VectorStoreIndex

    from lazyattn_rag import EngineConfig
    from lazyattn_rag.integrations.chatbot import ChatOptions, open_corpus
    from lazyattn_rag.integrations.hybrid_retrieval import chat_retriever
    from lazyattn_rag.integrations.llamaindex import LazyAttentionLLM, as_query_engine
    from lazyattn_rag.types.sampling_params import CHAT_LOOP_GUARD_NGRAM

    questions = json.loads(args.questions.read_text())["questions"]
    options = ChatOptions(docs=args.docs, engine=EngineConfig(device=args.device))
    store, embed_model, engine = open_corpus(options, io.StringIO())
    index = VectorStoreIndex.from_vector_store(store, embed_model=embed_model)
    documents = store.client.documents()
    base = dataclasses.replace(engine.default_sampling, max_tokens=args.max_tokens,
                               loop_guard_ngram=CHAT_LOOP_GUARD_NGRAM)
    results = {}
    for mode in ("vector", "hybrid"):
        for k in args.top_k:
            retriever = chat_retriever(index, documents, k, mode, LazyAttentionLLM(engine, base))
            rows = []
            for q in questions:
                sources = [n.node.node_id.split("#")[0] for n in retriever.retrieve(q["question"])]
                row = {"question": q["question"], "retrieved": sources, "found": any(g in sources for g in q["gold"]),
                       "answers": []}
                for seed in range(args.seeds):
                    llm = LazyAttentionLLM(engine, dataclasses.replace(base, seed=seed))
                    text = str(as_query_engine(retriever, llm).query(q["question"]).response).strip()
                    row["answers"].append({"seed": seed, "text": text, "right": is_right(text, q["answers"])})
                rows.append(row)
                print(f"[{mode} k={k}] {'found' if row['found'] else 'MISSED'} "
                      f"{sum(a['right'] for a in row['answers'])}/{args.seeds} right: {q['question']}",
                      file=sys.stderr, flush=True)
            results[f"{mode} k={k}"] = {
                "recall_at_k": sum(r["found"] for r in rows), "num_questions": len(rows),
                "answered_right": round(sum(sum(a["right"] for a in r["answers"]) / args.seeds for r in rows), 2),
                "rows": rows}
    engine.shutdown()
    return {"results": results,
            "conditions": {"model": engine.model_name, "device": args.device, "seeds": args.seeds,
                           "max_tokens": args.max_tokens, "loop_guard_ngram": CHAT_LOOP_GUARD_NGRAM,
                           "docs": str(args.docs), "questions": str(args.questions),
                           "platform": platform.platform(), "python": platform.python_version(),
                           "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=Path, default=DATA / "invented_facts")
    parser.add_argument("--questions", type=Path, default=DATA / "invented_facts_questions.json")
    parser.add_argument("--top-k", type=int, nargs="+", default=[3, 5])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/retrieval_quality_cpu.json"))
    args = parser.parse_args()
    out = run(args)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    for name, r in out["results"].items():
        print(f"{name:12s} recall@k {r['recall_at_k']}/{r['num_questions']}, answered right "
              f"{r['answered_right']:.2f}/{r['num_questions']}")


if __name__ == "__main__":
    main()
