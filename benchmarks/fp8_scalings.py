"""FP8 key scalings compared on whole answers (issue 42, item 4): one scale per token and KV head
(what the engine's FP8 cache stores) against the issue's three, per-channel scales before RoPE,
one scale per tensor, and per-channel scales of the rotated keys.

The engine stores only its own scheme, so the comparison runs on the transformers reference of
chunk reuse (``benchmarks/qa_recompute.py``'s ``RecomputeReference`` with ``k = 0``: the engine's
reuse, composed with the Hugging Face model): the quality benchmark's prompt (its template and
instruction), every passage encoded alone after the BOS anchor (``CacheConfig.anchor="bos"``,
the quality benchmark's ``reuse-bos``), each passage's K/V of every layer rounded to
``float8_e4m3fn`` and back with the scheme's scales before it is placed at its offset, then the
question and a greedy answer. Values: one scale per token and KV head in every scheme (the
engine's). Key schemes (a scale maps each group's largest magnitude to 448):

* ``per_token``: the rotated keys, one scale per token and KV head (the engine's FP8 cache);
* ``pre_rope_per_channel``: the keys before RoPE (the cached keys rotated back by their local
  positions), one scale per KV head and channel over the passage (KVQuant's pre-RoPE per-channel
  key quantization, Hooper et al., 2024, section 3.1-3.2), rotated again after the round trip;
* ``pre_rope_per_tensor``: before RoPE, one scale for the passage's keys of the layer;
* ``post_rope_per_channel``: the rotated keys, one scale per KV head and channel.

Only the passages are rounded (the head, the anchor as the passages see it and the question stay
exact; the engine also stores those in FP8, one scale per token). Per question: the first answer
token's KL divergence against the unrounded reuse (``exact ‖ rounded``, nats) and against full
attention over the same prompt, top-1 agreement with the unrounded reuse, and whether the greedy
answer contains a gold answer; means with 95 % bootstrap intervals, pooled over the sets.

    python benchmarks/fp8_scalings.py --sample-size 16 --out fp8_scalings_cpu

JSON: ``benchmarks/results/<out>.json``; write-up: docs/quality.md ("FP8 keys before and after RoPE").
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make ``benchmarks.*`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.fp8_key_scales import fp8_round_trip, rotate  # noqa: E402
from benchmarks.qa_data import DATASET_FILES, default_data_dir, load_qa, passage_text  # noqa: E402
from benchmarks.qa_metrics import answer_contains_gold, scored_answer_complete, summarize, summarize_raw  # noqa: E402
from benchmarks.serving_results import command_line, environment, write  # noqa: E402

SCHEMES = ("per_token", "pre_rope_per_channel", "pre_rope_per_tensor", "post_rope_per_channel")


def scheme_transform(rotary, scheme: str):
    """``f(k, v, start) -> (k, v)`` rounding one passage's K/V of one layer (``[1, kv_heads, n, d]``,
    K rotated at local positions ``start ..``) the way ``scheme`` names; ``rotary`` is the model's
    rotary embedding module (``hf.model.rotary_emb``)."""
    def transform(k: torch.Tensor, v: torch.Tensor, start: int):
        kf, vf = k[0].float(), v[0].float()  # [kv_heads, n, d]
        v_q = fp8_round_trip(vf, (2,))
        if scheme == "per_token":
            k_q = fp8_round_trip(kf, (2,))
        elif scheme == "post_rope_per_channel":
            k_q = fp8_round_trip(kf, (1,))
        else:
            positions = torch.arange(start, start + kf.shape[1], device=k.device)[None]
            cos, sin = rotary(kf, positions)
            cos, sin = (cos[0] / rotary.attention_scaling).float(), (sin[0] / rotary.attention_scaling).float()
            k_pre = rotate(kf, cos, -sin)  # R_(-j) R_j k
            k_q = rotate(fp8_round_trip(k_pre, (1,) if scheme == "pre_rope_per_channel" else (0, 1, 2)), cos, sin)
        return k_q[None].to(k.dtype), v_q[None].to(v.dtype)
    return transform


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1)


def kl(logp: torch.Tensor, logq: torch.Tensor) -> float:
    """KL(p ‖ q) in nats of two log-probability vectors."""
    return float((logp.exp() * (logp - logq)).sum())


def question_rows(ref, template, anchor_ids, ex, transforms, max_tokens: int) -> dict[str, dict[str, float]]:
    """One question's figures per scheme (and the unrounded reuse's contains-gold)."""
    head, tail = template.head_token_ids(), template.tail_token_ids(ex.question)
    chunks = [template.document_token_ids(passage_text(t, x)) for t, x in ex.passages]
    full = log_softmax(ref.full_first_token_logits(head + [i for c in chunks for i in c] + tail))

    def stop(ids):
        return scored_answer_complete(template.tokenizer.decode(ids, skip_special_tokens=True))

    def run(**reuse) -> tuple[torch.Tensor, float]:
        logits, tokens = ref.generate_with_first_logits(head, chunks, tail, 0, max_tokens, stop,
                                                        anchor_ids=anchor_ids, **reuse)
        text = template.tokenizer.decode(tokens, skip_special_tokens=True)
        return log_softmax(logits), answer_contains_gold(text, ex.answers)

    exact, gold = run()
    rows = {"none": {"kl_vs_full": kl(full, exact), "contains_gold": gold}}
    for name, transform in transforms.items():
        rounded, gold = run(kv_transform=transform)
        rows[name] = {"kl_vs_unrounded": kl(exact, rounded), "kl_vs_full": kl(full, rounded),
                      "top1_agreement": float(exact.argmax() == rounded.argmax()), "contains_gold": gold}
    return rows


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=default_data_dir(), help="folder holding qa/*.jsonl")
    p.add_argument("--datasets", default=",".join(DATASET_FILES))
    p.add_argument("--sample-size", type=int, default=16, help="questions per dataset")
    p.add_argument("--max-answer-tokens", type=int, default=32)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--out", default="fp8_scalings_cpu")
    args = p.parse_args(argv)
    if args.data is None:
        p.error("no --data given and ../shared/data does not exist")
    from transformers import AutoTokenizer

    from benchmarks.qa_recompute import RecomputeReference, generation_eos_ids
    from benchmarks.quality import prompt_config
    from lazyattn_rag.engine.model.model_loading import resolve_model
    from lazyattn_rag.engine.planning.prompt import PromptTemplate
    from lazyattn_rag.types.config import EngineConfig

    path = resolve_model(None, EngineConfig().resolved_cache_dir()).path
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    template = PromptTemplate(tokenizer, prompt_config())
    anchor_ids = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else template.head_token_ids()[:1]
    ref = RecomputeReference(path, args.device, getattr(torch, args.dtype), generation_eos_ids(path, tokenizer))
    transforms = {name: scheme_transform(ref.hf.model.rotary_emb, name) for name in SCHEMES}
    per_question: dict[str, dict[str, list[float]]] = {}
    datasets = [d for d in args.datasets.split(",") if d]
    for dataset in datasets:
        for ex in load_qa(args.data, dataset, args.sample_size, seed=0):
            for name, row in question_rows(ref, template, anchor_ids, ex, transforms, args.max_answer_tokens).items():
                for metric, value in row.items():
                    per_question.setdefault(name, {}).setdefault(metric, []).append(value)
        result = report(per_question)  # after each set: a run cut short keeps what it measured
        write(args.out, {"environment": environment(), "command": command_line(), "model": str(path),
                         "datasets": datasets[:datasets.index(dataset) + 1], "sample_size": args.sample_size,
                         "dtype": args.dtype, "anchor": "bos", "fp8": "float8_e4m3fn", **result,
                         "per_question": per_question})
    return result


def report(per_question: dict[str, dict[str, list[float]]]) -> dict:
    """Means with 95 % intervals per scheme and metric, and each scheme's KL minus the engine's
    per-token scheme's (paired by question); printed and returned."""
    summary = {name: {metric: (summarize_raw if metric.startswith("kl") else summarize)(values)
                      for metric, values in m.items()} for name, m in per_question.items()}
    base = per_question["per_token"]["kl_vs_unrounded"]
    paired = {name: summarize_raw([a - b for a, b in zip(per_question[name]["kl_vs_unrounded"], base)])
              for name in SCHEMES if name != "per_token"}
    for name, m in summary.items():
        print(name, {metric: round(s["mean"], 4) for metric, s in m.items()}, flush=True)
    print("KL minus per_token's, paired:", {name: round(s["mean"], 5) for name, s in paired.items()}, flush=True)
    return {"summary": summary, "kl_minus_per_token": paired}


if __name__ == "__main__":
    main()
