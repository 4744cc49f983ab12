"""Do our cached keys quantize to FP8 better before RoPE than after? A first measurement for
issue 42 (item 4), on the CPU, before any FP8 kernel exists.

Each passage of the shared QA sets is encoded alone (as a document chunk is: BOS, then the
passage at local positions) by the default model through transformers. In every layer its keys
and values are quantized to ``float8_e4m3fn`` and back (a scale maps each group's largest
magnitude to 448, FP8 E4M3's largest finite value), six ways for the keys:

* ``pre_rope_per_channel``: keys before RoPE, one scale per KV head and channel over the
  passage's tokens (the pre-RoPE per-channel key quantization of KVQuant, Hooper et al., 2024,
  section 3.1-3.2), rotated after dequantization, as the kernels would;
* ``pre_rope_per_head``: keys before RoPE, one scale per KV head;
* ``pre_rope_per_tensor``: keys before RoPE, one scale for the layer's chunk;
* ``post_rope_per_channel``: keys after RoPE at their local positions, one scale per KV head and
  channel (what a cache that stores rotated keys would do);
* ``pre_rope_per_token`` and ``post_rope_per_token``: one scale per token and KV head, before or
  after RoPE: the scheme a cache can apply as it writes each token (the request's own tokens and
  generated ones arrive one step at a time, and a chunk may be encoded over several steps), with
  no pass over the whole chunk first;

and the values one way, one scale per token and KV head (``v_per_token``), applied in every
scheme. Against the passage's exact float32 attention in that layer (every query row over the
rows up to it, causal, GQA), per layer and passage: the KL divergence of each row's attention
distribution (exact ‖ quantized, nats, the mean over rows and heads) and the relative error of
the attention output (‖O_q − O‖ / ‖O‖), averaged over layers and passages. The keys' scales
use the passage's own tokens only, so a chunk's bytes and scales never depend on where it is placed.

    python benchmarks/fp8_key_scales.py --num-passages 120 --out fp8_key_scales_cpu

JSON: ``benchmarks/results/<out>.json``; write-up: docs/quality.md ("FP8 keys before and after RoPE").
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.qa_data import DATASET_FILES, default_data_dir, load_qa, passage_text  # noqa: E402
from benchmarks.serving_results import command_line, environment, write  # noqa: E402

FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
KEY_SCHEMES = ("pre_rope_per_channel", "pre_rope_per_head", "pre_rope_per_tensor", "post_rope_per_channel",
               "pre_rope_per_token", "post_rope_per_token")


def fp8_round_trip(x: torch.Tensor, reduce_dims: tuple[int, ...]) -> torch.Tensor:
    """``x`` quantized to float8_e4m3fn and back, one scale per group (the dims not in
    ``reduce_dims``); float32 in and out."""
    amax = x.abs().amax(dim=reduce_dims, keepdim=True).clamp_min(1e-12)
    scale = amax / FP8_MAX
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(torch.float32) * scale


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE (half-split pairing, as Hugging Face's ``rotate_half``). x: [heads, T, D]; cos, sin: [T, D]."""
    half = x.shape[-1] // 2
    rotated_half = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated_half * sin


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention's log-probabilities [H, T, T] and output [H, T, D]; q: [H, T, D], k, v:
    [H_kv, T, D] (each KV head serves H / H_kv query heads)."""
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    t = q.shape[1]
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    logp = torch.log_softmax(scores, dim=-1)
    return logp, logp.exp() @ v


def compare(exact: tuple[torch.Tensor, torch.Tensor], quantized: tuple[torch.Tensor, torch.Tensor]) -> dict:
    logp, out = exact
    logq, out_q = quantized
    p = logp.exp()
    kl = torch.where(p > 0, p * (logp - logq), torch.zeros_like(p)).sum(-1)  # [H, T]
    return {"kl": kl.mean().item(), "output_rel_error": ((out_q - out).norm() / out.norm()).item()}


def layer_errors(q_pre, k_pre, v, cos, sin) -> dict[str, dict]:
    """Every key scheme's errors in one layer; q_pre: [H, T, D], k_pre, v: [H_kv, T, D] (before RoPE)."""
    q, k = rotate(q_pre, cos, sin), rotate(k_pre, cos, sin)
    exact = attention(q, k, v)
    v_q = fp8_round_trip(v, (2,))  # per token and KV head
    keys = {"pre_rope_per_channel": rotate(fp8_round_trip(k_pre, (1,)), cos, sin),
            "pre_rope_per_head": rotate(fp8_round_trip(k_pre, (1, 2)), cos, sin),
            "pre_rope_per_tensor": rotate(fp8_round_trip(k_pre, (0, 1, 2)), cos, sin),
            "post_rope_per_channel": fp8_round_trip(k, (1,)),
            "pre_rope_per_token": rotate(fp8_round_trip(k_pre, (2,)), cos, sin),
            "post_rope_per_token": fp8_round_trip(k, (2,))}
    out = {name: compare(exact, attention(q, key, v_q)) for name, key in keys.items()}
    out["v_per_token_only"] = compare(exact, attention(q, k, v_q))
    return out


def capture(model, input_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Each layer's (q, k, v) before RoPE for ``input_ids`` [1, T]: [H, T, D], [H_kv, T, D], [H_kv, T, D]."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    found: dict[int, dict[str, torch.Tensor]] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        for name in ("q_proj", "k_proj", "v_proj"):
            def hook(_module, _inputs, output, i=i, name=name):
                found.setdefault(i, {})[name] = output[0].reshape(output.shape[1], -1, head_dim).transpose(0, 1)
            hooks.append(getattr(layer.self_attn, name).register_forward_hook(hook))
    try:
        with torch.no_grad():
            model(input_ids)
    finally:
        for h in hooks:
            h.remove()
    return [(found[i]["q_proj"], found[i]["k_proj"], found[i]["v_proj"]) for i in range(len(model.model.layers))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=default_data_dir(), help="folder holding qa/*.jsonl")
    p.add_argument("--datasets", default=",".join(DATASET_FILES))
    p.add_argument("--num-passages", type=int, default=120, help="passages in all, spread over the datasets")
    p.add_argument("--model", default=None, help="a model directory (default: the project's default model)")
    p.add_argument("--out", default="fp8_key_scales_cpu")
    args = p.parse_args()
    if args.data is None:
        p.error("no --data given and ../shared/data does not exist")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lazyattn_rag.engine.model.model_loading import resolve_model
    from lazyattn_rag.types.config import EngineConfig

    path = args.model or resolve_model(None, EngineConfig().resolved_cache_dir()).path
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    datasets = [d for d in args.datasets.split(",") if d]
    per_dataset = max(1, args.num_passages // len(datasets))
    texts = []
    for dataset in datasets:
        seen = 0
        for ex in load_qa(args.data, dataset, sample_size=per_dataset, seed=0):
            if seen < per_dataset and ex.passages:
                texts.append((dataset, passage_text(*ex.passages[0])))
                seen += 1
    rows = {name: {"kl": [], "output_rel_error": []} for name in (*KEY_SCHEMES, "v_per_token_only")}
    per_layer: dict[str, list[list[float]]] = {name: [] for name in rows}
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    for dataset, text in texts:
        ids = torch.tensor([bos + tokenizer(text, add_special_tokens=False)["input_ids"][:512]])
        positions = torch.arange(ids.shape[1])[None]
        cos, sin = model.model.rotary_emb(torch.zeros(1, dtype=torch.float32), positions)
        cos, sin = cos[0].float(), sin[0].float()
        errors = [layer_errors(q, k, v, cos, sin) for q, k, v in capture(model, ids)]
        for name in rows:
            for metric in rows[name]:
                rows[name][metric].append(statistics.fmean(e[name][metric] for e in errors))
            per_layer[name].append([e[name]["kl"] for e in errors])
    num_layers = len(per_layer[KEY_SCHEMES[0]][0])
    summary = {name: {metric: statistics.fmean(values) for metric, values in m.items()} for name, m in rows.items()}
    summary_layers = {name: [statistics.fmean(run[i] for run in runs) for i in range(num_layers)]
                      for name, runs in per_layer.items()}
    for name, s in summary.items():
        print(f"{name:>24}: KL {s['kl']:.2e} nats, output relative error {s['output_rel_error']:.4f}")
    write(args.out, {"environment": environment(), "command": command_line(), "model": str(path),
                     "num_passages": len(texts), "datasets": datasets, "fp8": "float8_e4m3fn", "fp8_max": FP8_MAX,
                     "summary": summary, "kl_by_layer": summary_layers,
                     "per_passage": {name: m for name, m in rows.items()}})


if __name__ == "__main__":
    main()
