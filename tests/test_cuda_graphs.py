"""Decode steps replayed from CUDA graphs (``engine/worker/cuda_graphs.py``) against eager steps.

On the CPU the graphs' static-buffer function runs eagerly (``capture=False``) with the Triton
kernels under the interpreter: that checks the buffer handling, the bucketing and the padding
rows. On CUDA the engine captures real graphs and the same comparison runs on replays.
"""

import asyncio
import random

import pytest
import torch

from lazyattn_rag import AsyncLazyAttention, SamplingParams
from lazyattn_rag.engine.worker.attention.triton_backend import plan_decode_batch
from lazyattn_rag.engine.worker.cuda_graphs import DecodeGraphs, graph_batch_sizes, graph_block_table_width
from lazyattn_rag.llm import LazyAttention
from tests.paged_case import sequence_input
from tests.tiny import words

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
GREEDY = SamplingParams(max_tokens=5, ignore_eos=True)
MAX_MODEL_LEN, BLOCK_SIZE, NUM_BLOCKS = 512, 16, 96


def test_graph_batch_sizes():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(3) == [1, 2, 4]
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 64]
    assert graph_batch_sizes(200) == [1, 2, 4, 8, 16, 32, 64, 128, 192, 256]
    with pytest.raises(ValueError, match="max_num_seqs"):
        graph_batch_sizes(0)


def decode_seq(token: int, position: int, table: list[tuple[int, int, int]], slot: int):
    return sequence_input([token], [position], table, [slot])


def test_bucketing_padding_and_eager_fallbacks():
    calls = []

    def forward(input_ids, positions, metadata):
        calls.append((input_ids.clone(), metadata.num_blocks_per_seq.clone(), metadata.slot_mapping.clone(),
                      metadata.backend_state["triton"].runs.num_runs.clone(), positions.clone(),
                      metadata.seq_lens.clone(), metadata.block_tables.clone()))
        return torch.arange(input_ids.numel() * 3, dtype=torch.float32).view(-1, 3)

    graphs = DecodeGraphs(forward, plan_decode_batch, [1, 2, 4],  # the triton backend's capture hook
                          max_blocks_per_seq=3, block_size=4, padding_slot=40,
                          device=torch.device("cpu"), capture=False)
    seqs = [decode_seq(7, 5, [(1, 9, 4), (2, 0, 2)], 9),  # a chunk at delta 9, then the request's block
            decode_seq(8, 0, [(3, 0, 1)], 12),
            decode_seq(9, 2, [(4, 0, 3)], 18)]
    logits = graphs.run(seqs)
    assert logits.tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0], [6.0, 7.0, 8.0]]  # first 3 rows of bucket 4
    ids, num_blocks, slots, num_runs, positions, seq_lens, block_tables = calls[-1]
    assert ids.tolist() == [7, 8, 9, 0]
    assert num_blocks.tolist() == [2, 1, 1, 0]  # the padding row has no blocks (its output is zero)
    assert slots.tolist() == [9, 12, 18, 40]  # and writes to the padding slot only
    assert num_runs.tolist() == [2, 1, 1, 0]
    assert positions.tolist()[:3] == [5, 0, 2] and seq_lens.tolist()[:3] == [6, 1, 3]
    assert block_tables.shape == (4, 3)  # the static width; each row's used words are the packed entries
    for row, seq in zip(block_tables, seqs):
        assert row[: seq.block_table.numel()].tolist() == seq.block_table.tolist()
    assert graphs.run(seqs[:1]) is not None and calls[-1][0].tolist() == [7]  # bucket 1
    assert graphs.num_replays == 2
    bad = decode_seq(3, 4, [(6, 0, 2)], 30)
    bad.slot_mapping.append(31)  # two slots for one new token
    with pytest.raises(ValueError, match="sequence 1: 1 tokens, 1 positions, 2 slots"):
        graphs.run([seqs[1], bad])
    assert len(calls) == 2 and graphs.num_replays == 2  # nothing ran
    with pytest.raises(ValueError, match="sequence 0: empty block table for 1 new tokens"):
        graphs.run([decode_seq(3, 4, [], 30)])
    assert graphs.run(seqs[1:3]) is not None  # the next step runs with its own inputs only
    ids, num_blocks, slots, _, _, seq_lens, _ = calls[-1]
    assert (ids.tolist(), num_blocks.tolist(), slots.tolist(), seq_lens.tolist()) == ([8, 9], [1, 1], [12, 18], [1, 3])
    prefill = sequence_input([1, 2], [0, 1], [(5, 0, 2)], [20, 21])
    assert graphs.run(seqs[:1] + [prefill]) is None  # a prefill row: eager
    assert graphs.run(seqs + seqs[:2]) is None  # 5 sequences > the largest bucket
    assert graphs.run([decode_seq(1, 12, [(1, 0, 4), (2, 0, 4), (3, 0, 4), (4, 0, 1)], 16)]) is None  # 4 blocks > 3
    assert len(calls) == 3 and graphs.num_replays == 3


def graph_llm(make_llm, cuda_graphs: bool, max_num_seqs: int = 3, torch_compile: bool = False,
              **config) -> LazyAttention:
    """A tiny Llama (head_dim 32) on the triton backend with documents d0..d4; ``make_llm`` is the
    fixture, ``config`` more engine settings."""
    _, llm = make_llm(seed=3, model_config=dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                                                head_dim=32),
                      device=DEVICE, attention_backend="triton", cuda_graphs=cuda_graphs, max_model_len=MAX_MODEL_LEN,
                      num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_num_batched_tokens=256,
                      max_num_seqs=max_num_seqs, torch_compile=torch_compile, **config)
    if cuda_graphs and not CUDA:  # the same static-buffer path, run eagerly under the interpreter
        llm.loop.call(llm.engine.runner.enable_cuda_graphs, graph_batch_sizes(max_num_seqs),
                      graph_block_table_width(MAX_MODEL_LEN, BLOCK_SIZE), capture=False)
    for i in range(5):
        llm.add_document(f"d{i}", words(7 + 6 * i, start=13 * i))
    return llm


def run_concurrently(llm: LazyAttention, requests) -> list[list[int]]:
    allm = AsyncLazyAttention(llm)

    async def run_all():
        return await asyncio.gather(*(allm.generate(q, ids, sampling=GREEDY) for q, ids in requests))

    return [c.token_ids for c in asyncio.run(run_all())]


@pytest.mark.parametrize("torch_compile", [False, True], ids=["eager-layers", "compiled-layers"])
def test_graph_decode_steps_give_the_eager_outputs(make_llm, torch_compile):
    """Graph-replayed decode steps (of the eager layers, or of the torch.compile'd ones of issue
    19, captured with their compiled kernels) give the eager engine's greedy tokens."""
    rng = random.Random(1)
    requests = [(words(rng.randint(1, 3), start=150 + i), rng.sample([f"d{j}" for j in range(5)], k=rng.randint(1, 3)))
                for i in range(5)]
    eager = graph_llm(make_llm, cuda_graphs=False)
    assert eager.engine.runner.graphs is None
    expected = run_concurrently(eager, requests)
    eager.shutdown()
    llm = graph_llm(make_llm, cuda_graphs=True, torch_compile=torch_compile)
    runner = llm.engine.runner
    assert (runner.compiled is not None) == torch_compile
    assert runner.graphs is not None and runner.graphs.batch_sizes == [1, 2, 4]
    assert len(runner.graphs.graphs) == (3 if CUDA else 0)
    assert runner.kv_pool.layers[0][0].shape[0] == NUM_BLOCKS + 1 and llm.engine.cache.pool.num_blocks == NUM_BLOCKS
    assert run_concurrently(llm, requests) == expected
    assert runner.graphs.num_replays >= GREEDY.max_tokens - 1  # at least the last request's decode steps
    stats = llm.stats()
    assert stats["num_blocks_free"] + stats["num_blocks_cached"] == NUM_BLOCKS  # nothing leaked
    llm.shutdown()


def test_graph_decode_steps_with_chunk_attention_scaling(make_llm):
    """Decode graphs read the documents' flags from their static block tables: APE requests
    (chunk attention scaling, issue 20) replayed give the eager engine's tokens, which differ
    from plain reuse's."""
    rng = random.Random(2)
    requests = [(words(rng.randint(1, 3), start=150 + i), rng.sample([f"d{j}" for j in range(5)], k=rng.randint(2, 3)))
                for i in range(4)]
    ape = dict(chunk_attention_scaling=True, chunk_attention_temperature=0.5, chunk_attention_weight=3.0)
    eager = graph_llm(make_llm, cuda_graphs=False, **ape)
    expected = run_concurrently(eager, requests)
    eager.shutdown()
    plain = graph_llm(make_llm, cuda_graphs=False)
    assert run_concurrently(plain, requests) != expected
    plain.shutdown()
    llm = graph_llm(make_llm, cuda_graphs=True, **ape)
    assert run_concurrently(llm, requests) == expected
    assert llm.engine.runner.graphs.num_replays >= GREEDY.max_tokens - 1
