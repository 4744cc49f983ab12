"""What ``benchmarks/kernels.py`` times with: the head shapes, a paged K/V layout with chunks at
offsets, median CUDA-graph timing with the L2 flushed, SDPA baselines and side-by-side launch options
(also used by the studies under ``benchmarks/investigations/``)."""

from __future__ import annotations


import torch
import triton
import triton.testing

from lazyattn_rag.kernels.block_table import pack_entries, unpack_block_table
from lazyattn_rag.kernels.launch import ChunkScaling, block_runs

MODELS = {
    "llama3.1-8b": dict(num_heads=32, num_kv_heads=8, head_dim=128, theta=500000.0),
    "smollm2": dict(num_heads=9, num_kv_heads=3, head_dim=64, theta=100000.0),
}
DTYPE = torch.bfloat16
BLOCK_SIZE = 16
CHUNK_SCALING = ChunkScaling(temperature=0.8, weight=0.9)  # APE on every chunk block: its cost is timed


def bench_ms(fn, graph: bool = True, rep: int = 200) -> float:
    """Median ms of ``fn`` with a cold L2, replayed from a CUDA graph when it captures."""
    fn()
    torch.cuda.synchronize()
    run = fn
    if graph:
        try:
            g = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                fn()  # warm on the side stream first (allocator, cuDNN plans)
                torch.cuda.synchronize()
                with torch.cuda.graph(g, stream=s):
                    fn()
            torch.cuda.current_stream().wait_stream(s)
            torch.cuda.synchronize()
            run = g.replay
        except Exception:  # noqa: BLE001 - fall back to eager launches
            torch.cuda.synchronize()
            run = fn
    return triton.testing.do_bench(run, warmup=50, rep=rep, return_mode="median")


def inv_freq_for(head_dim: int, theta: float, device) -> torch.Tensor:
    return (1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)).to(device)


def copy_bandwidth(device) -> dict:
    n = 2 * 1024**3 // 2  # 2 GiB of bf16
    a = torch.randn(n // 1024, 1024, device=device, dtype=DTYPE)
    b = torch.empty_like(a)
    ms = bench_ms(lambda: b.copy_(a), graph=False)
    return {"bytes": 2 * a.numel() * a.element_size(), "ms": ms, "GBps": 2 * a.numel() * a.element_size() / ms / 1e6}


def build_paged(seq_segments: list[list[tuple[int, int]]], num_kv_heads, head_dim, device, seed=0, pool_factor=1.25):
    """Dense K/V per sequence and the same data scattered into a paged pool.

    seq_segments: per sequence, ``[(length, delta), ...]`` segments each starting at a block boundary.
    Returns dense ``[B, Hkv, L, D]`` K, V (sequences padded to the longest with zeros), the caches,
    block tables, blocks per sequence and seq_lens.
    """
    g = torch.Generator(device="cpu").manual_seed(seed)
    tables, total = [], 0
    for segs in seq_segments:
        t = []
        for length, delta in segs:
            for start in range(0, length, BLOCK_SIZE):
                t.append([0, delta, min(BLOCK_SIZE, length - start)])
        tables.append(t)
        total += len(t)
    pool = int(total * pool_factor) + 1
    perm = torch.randperm(pool, generator=g).tolist()
    it = iter(perm)
    for t in tables:
        for e in t:
            e[0] = next(it)
    seq_lens = [sum(e[2] for e in t) for t in tables]
    L = max(seq_lens)
    B = len(tables)
    k_dense = torch.zeros(B, num_kv_heads, L, head_dim, dtype=DTYPE, device=device)
    v_dense = torch.zeros_like(k_dense)
    k_cache = torch.randn(pool, BLOCK_SIZE, num_kv_heads, head_dim, dtype=DTYPE, device=device)
    v_cache = torch.randn_like(k_cache)
    for i, t in enumerate(tables):
        ids = torch.tensor([e[0] for e in t], device=device)
        valid = torch.tensor([e[2] for e in t], device=device)
        slots = (ids[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE, device=device)[None, :])
        slots = slots[torch.arange(BLOCK_SIZE, device=device)[None, :] < valid[:, None]]  # [seq_len]
        flat_k = k_cache.view(-1, num_kv_heads, head_dim)
        flat_v = v_cache.view(-1, num_kv_heads, head_dim)
        k_dense[i, :, : slots.numel()] = flat_k[slots].transpose(0, 1)
        v_dense[i, :, : slots.numel()] = flat_v[slots].transpose(0, 1)
    max_blocks = max(len(t) for t in tables)
    bt = torch.zeros(B, max_blocks, dtype=torch.int64)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = pack_entries([tuple(e) for e in t])
    return dict(
        k_dense=k_dense, v_dense=v_dense, k_cache=k_cache, v_cache=v_cache, block_tables=bt.to(device),
        num_blocks=torch.tensor([len(t) for t in tables], dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device), seq_lens_list=seq_lens,
    )


def flag_chunk_blocks(P: dict):
    """The batch's block tables with every chunk block (delta != 0) flagged for chunk attention
    scaling, and their runs: what an APE request's tables look like."""
    _, deltas, _ = unpack_block_table(P["block_tables"])
    tables = P["block_tables"] | ((deltas != 0).to(torch.int64) << 30)
    return tables, block_runs(tables, P["num_blocks"], BLOCK_SIZE)


def add_chunk_scaling(res: dict, make, ms_on: list[float]) -> None:
    """The kernel's time with the chunks read with chunk attention scaling (APE), and its
    overhead over the plain run (``ms_on``), each measured twice."""
    ms = [bench_ms(make("query", scaled=True)) for _ in range(2)]
    res["chunk_scaling_ms"] = ms
    res["chunk_scaling_overhead_pct"] = 100 * (min(ms) / min(ms_on) - 1)


def sdpa_runner(backend_name: str, q, k, v, **kw):
    """A closure running SDPA with one backend; GQA natively if the backend takes it, else K/V expanded."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend_name]
    group = q.shape[1] // k.shape[1]

    def native():
        with sdpa_kernel([backend]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=group > 1, **kw)

    try:
        native()
        torch.cuda.synchronize()
        return native, "native GQA"
    except Exception:  # noqa: BLE001
        ke, ve = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)

        def expanded():
            with sdpa_kernel([backend]):
                return torch.nn.functional.scaled_dot_product_attention(q, ke, ve, **kw)

        expanded()
        torch.cuda.synchronize()
        return expanded, "K/V expanded to query heads (reads group x more bytes)"


def config_sweep(make, configs: dict, work: float, unit: str, per: float = 1e6) -> tuple[dict, str]:
    """Time ``make(**config)`` for each named config (``bench_ms``, 100 repetitions):
    ``(sweep, best)``, ``sweep`` by name ``{"ms", unit: work / ms / per}`` (or ``{"error"}`` for
    a config that does not build here) and ``best`` the fastest one's name."""
    sweep = {}
    for name, config in configs.items():
        try:
            ms = bench_ms(make(**config), rep=100)
            sweep[name] = {"ms": ms, unit: work / ms / per}
        except Exception as e:  # noqa: BLE001
            sweep[name] = {"error": repr(e)[:200]}
    ok = {k: v for k, v in sweep.items() if "ms" in v}
    return sweep, min(ok, key=lambda k: ok[k]["ms"])


def launch_options(ours, variants: dict, work: float, unit: str, per: float = 1e6, repeats: int = 3) -> dict:
    """The default launch against each variant (``ours(**variant)``), interleaved ``repeats``
    times so that drift hits all alike: median ms, ``work / ms / per`` in ``unit``, speedup over
    the default, and each variant's largest difference from the default's output (the same kernel
    maths, so it must stay at rounding level); a variant that does not compile records its error."""
    runs = {"default": ours()}
    outputs = {"default": runs["default"]().float().clone()}
    res = {}
    for name, kw in variants.items():
        fn = ours(**kw)
        try:  # the first call compiles: an option this Triton cannot build here fails now, not when timed
            outputs[name] = fn().float().clone()
        except Exception as e:  # noqa: BLE001
            res[name] = {"error": repr(e)[:300]}
            continue
        runs[name] = fn
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            times[name].append(bench_ms(fn, rep=100))
    base = sorted(times["default"])[repeats // 2]
    for name, ms_list in times.items():
        ms = sorted(ms_list)[repeats // 2]
        res[name] = {"ms": ms_list, "median_ms": ms, unit: work / ms / per, "speedup_vs_default": base / ms,
                     "max_abs_diff_vs_default": (outputs[name] - outputs["default"]).abs().max().item()}
    return res


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm())


def decode_segments(batch: int, context: int) -> list[list[tuple[int, int]]]:
    """The decode layout (``build_paged``'s segments): per sequence a 256-token head, 4 chunks of
    1900 tokens at offsets distinct per sequence, and its own tokens up to ``context``."""
    head, n_chunks, chunk = 256, 4, 1900
    # a chunk's offset = its global start - its local start (the anchor: the head)
    return [[(head, 0)] + [(chunk, c * chunk + 37 * b) for c in range(n_chunks)]
            + [(context - head - n_chunks * chunk, 0)] for b in range(batch)]


def prefill_segments(new_tokens: int, cached_chunks: int, chunk_len: int) -> list[list[tuple[int, int]]]:
    """The prefill layout: one sequence of ``cached_chunks`` chunks at offsets, then its new tokens."""
    return [[(chunk_len, 1000 + 5000 * c) for c in range(cached_chunks)] + [(new_tokens, 0)]]
