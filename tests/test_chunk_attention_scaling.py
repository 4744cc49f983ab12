"""Chunk attention scaling (APE, Yang et al. ICLR 2025; ``CacheConfig.chunk_attention_scaling``,
issue 20): keys of a request's document blocks get the softmax weight ``W * exp(s / T)``.

Checked against independent references:

* the kernels (Triton interpreter on the CPU) against plain attention over a rewritten batch:
  ``T = 1/2, W = 2`` equals every flagged block read twice, unflagged, with its keys doubled;
* the kernels against their float32 references with the same scaling;
* the engine against transformers: the documents encoded alone and composed by hand, their keys
  divided by ``T``, ``ln W`` added to their columns of a 4D attention mask.

The flag lands on the documents' entries only, ``T = W = 1`` is refused, a request without it
is plain reuse bit for bit, and asking for it turns the recompute remedies off.
"""

import math

import pytest
import torch
from kernel_tolerances import assert_close
from paged_case import SeqSpec, make_case

from lazyattn_rag import SamplingParams
from lazyattn_rag.kernels.block_table import (
    MAX_BLOCK_ID,
    BlockTableOverflowError,
    block_scaled,
    pack_block_table,
    unpack_block_table,
)
from lazyattn_rag.kernels.decode import paged_decode
from lazyattn_rag.kernels.launch import ChunkScaling, block_runs
from lazyattn_rag.kernels.prefill import paged_prefill
from lazyattn_rag.kernels.reference import decode_reference, prefill_reference
from lazyattn_rag.types.config import CacheConfig, RequestRemedies
from tests.observe import settle
from tests.recompute_case import (FIRST, QUESTION, ape_engine, assert_chunks_unchanged_and_nothing_held,
                                  first_logprobs, remedy_engine, scaled_reference_logprobs as reference_logprobs)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
APE = ChunkScaling(temperature=0.5, weight=2.0)

# Decode: the (32, 0) chunk sits right before the own tokens with the same delta 0, so only the
# flag separates their runs. Prefill: 9 new tokens after chunks, one of them flagged mid-table.
DECODE = [SeqSpec(chunks=[(7, 0), (15, -4), (40, 16), (37, 300), (32, 0)], own_len=21),
          SeqSpec(chunks=[(37, 9)], own_len=1)]
PREFILL = [SeqSpec(chunks=[(7, 0), (19, 7), (16, 26), (33, 42)], own_len=12, query_len=9),
           SeqSpec(chunks=[(5, 0), (40, 5)], own_len=20, query_len=20)]
FLAGGED_CHUNKS = [{1, 2, 4}, {0}], [{1, 3}, {1}]  # per sequence: which chunks are documents


def flag_chunks(case, specs, flagged: list[set[int]], block_size: int = 16):
    """Set the scaled bit on the blocks of the listed chunks (block-table rows are rebuilt)."""
    tables = case.block_tables.clone()
    for s, spec in enumerate(specs):
        index = 0
        for c, (length, _) in enumerate(spec.chunks):
            n = -(-length // block_size)
            if c in flagged[s]:
                tables[s, index: index + n] |= 1 << 30
            index += n
    case.block_tables = tables
    return case


def duplicated_and_doubled(case):
    """The same batch without flags, where each flagged block is read twice with keys times 2
    (so plain attention gives each of its keys ``2 * exp(2 s)``: ``T = 1/2, W = 2``)."""
    rows, n_blocks = [], []
    key_cache, value_cache = case.key_cache, case.value_cache
    extra_k, extra_v = [], []
    next_id = key_cache.shape[0]
    for s in range(case.block_tables.shape[0]):
        words = case.block_tables[s, : int(case.num_blocks_per_seq[s])].cpu()
        ids, deltas, valid = unpack_block_table(words)
        flags = block_scaled(words)
        row = []
        for b, d, v, f in zip(ids.tolist(), deltas.tolist(), valid.tolist(), flags.tolist()):
            if not f:
                row.append((b, d, v))
                continue
            extra_k.append(key_cache[b] * 2)
            extra_v.append(value_cache[b])
            row += [(next_id, d, v), (next_id, d, v)]
            next_id += 1
        rows.append(row)
        n_blocks.append(len(row))
    width = max(n_blocks)
    tables = torch.zeros(len(rows), width, dtype=torch.int64)
    for s, row in enumerate(rows):
        t = torch.tensor(row, dtype=torch.int64)
        tables[s, : len(row)] = pack_block_table(t[:, 0], t[:, 1], t[:, 2])
    key_cache = torch.cat((key_cache, torch.stack(extra_k)))
    value_cache = torch.cat((value_cache, torch.stack(extra_v)))
    seq_lens = torch.tensor([sum(r[2] for r in row) for row in rows], dtype=torch.int32, device=DEVICE)
    return (key_cache, value_cache, tables.to(DEVICE), torch.tensor(n_blocks, dtype=torch.int32, device=DEVICE),
            seq_lens)


def decode_case(dtype=torch.float32):
    case = make_case(DECODE, num_heads=8, num_kv_heads=2, head_dim=64, dtype=dtype, device=DEVICE, seed=5)
    return flag_chunks(case, DECODE, FLAGGED_CHUNKS[0])


def prefill_case(dtype=torch.float32):
    case = make_case(PREFILL, num_heads=4, num_kv_heads=2, head_dim=64, dtype=dtype, device=DEVICE, seed=6)
    return flag_chunks(case, PREFILL, FLAGGED_CHUNKS[1])


def test_flag_packs_and_unpacks_beside_the_other_fields():
    ids, deltas, valid = torch.tensor([0, MAX_BLOCK_ID, 5]), torch.tensor([-(2**25), 2**25 - 1, 0]), torch.tensor([1, 128, 7])
    words = pack_block_table(ids, deltas, valid, torch.tensor([True, False, True]))
    assert block_scaled(words).tolist() == [True, False, True]
    assert all(torch.equal(a, b) for a, b in zip(unpack_block_table(words), (ids, deltas, valid)))
    with pytest.raises(BlockTableOverflowError, match="block id 1073741824"):
        pack_block_table(torch.tensor([MAX_BLOCK_ID + 1]), torch.tensor([0]), torch.tensor([1]))
    assert MAX_BLOCK_ID == 2**30 - 1


def test_runs_split_where_the_flag_changes():
    case = decode_case()
    runs = block_runs(case.block_tables, case.num_blocks_per_seq, 16)
    # seq 0 blocks: chunk0 [0], chunk1 [1], chunk2 [2..4], chunk3 [5..7], chunk4 [8..9], own [10..11]
    assert runs.num_runs.tolist() == [6, 2]
    assert runs.starts[0, :7].tolist() == [0, 1, 2, 5, 8, 10, 12]


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_kernel_equals_plain_attention_over_doubled_blocks(num_splits):
    case = decode_case()
    out = paged_decode(case.query, case.key_cache, case.value_cache, case.block_tables, case.num_blocks_per_seq,
                       case.cu_seqlens_q, int(case.seq_lens.max()), case.inv_freq, case.scale,
                       num_splits=num_splits, chunk_scaling=APE)
    k, v, tables, n_blocks, seq_lens = duplicated_and_doubled(case)
    plain = decode_reference(case.query, k, v, tables, n_blocks, case.cu_seqlens_q, case.inv_freq, case.scale)
    assert_close(out, plain, torch.float32, f"splits {num_splits}")
    ignored = paged_decode(case.query, case.key_cache, case.value_cache, case.block_tables, case.num_blocks_per_seq,
                           case.cu_seqlens_q, int(case.seq_lens.max()), case.inv_freq, case.scale,
                           num_splits=num_splits)
    unflagged = decode_reference(case.query, case.key_cache, case.value_cache, case.block_tables & ~(1 << 30),
                                 case.num_blocks_per_seq, case.cu_seqlens_q, case.inv_freq, case.scale)
    assert_close(ignored, unflagged, torch.float32, "no scaling: the flag is ignored")
    assert (out.cpu() - ignored.cpu()).abs().max() > 0.05


def test_prefill_kernel_equals_plain_attention_over_doubled_blocks():
    case = prefill_case()
    out = paged_prefill(case.query, case.key_cache, case.value_cache, case.block_tables, case.num_blocks_per_seq,
                        case.seq_lens, case.cu_seqlens_q, case.max_query_len, case.inv_freq, case.scale,
                        chunk_scaling=APE)
    k, v, tables, n_blocks, _ = duplicated_and_doubled(case)
    plain = prefill_reference(case.query, k, v, tables, n_blocks, case.cu_seqlens_q, case.inv_freq, case.scale)
    assert_close(out, plain, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scaling", [ChunkScaling(0.8, 1.0), ChunkScaling(1.0, 0.6), ChunkScaling(0.9, 1.3)])
def test_kernels_equal_their_references_with_scaling(dtype, scaling):
    for case, kernel in ((decode_case(dtype), "decode"), (prefill_case(dtype), "prefill")):
        common = (case.query, case.key_cache, case.value_cache, case.block_tables, case.num_blocks_per_seq)
        if kernel == "decode":
            out = paged_decode(*common, case.cu_seqlens_q, int(case.seq_lens.max()), case.inv_freq, case.scale,
                               chunk_scaling=scaling)
            ref = decode_reference(*common, case.cu_seqlens_q, case.inv_freq, case.scale, chunk_scaling=scaling)
        else:
            out = paged_prefill(*common, case.seq_lens, case.cu_seqlens_q, case.max_query_len, case.inv_freq,
                                case.scale, chunk_scaling=scaling)
            ref = prefill_reference(*common, case.cu_seqlens_q, case.inv_freq, case.scale, chunk_scaling=scaling)
        assert_close(out, ref, dtype, f"{kernel} {scaling}")


def test_scaling_values_are_checked():
    for bad in (0, -1.0, math.inf, math.nan, True, "1"):
        with pytest.raises(ValueError, match="temperature"):
            ChunkScaling(temperature=bad)
        with pytest.raises(ValueError, match="chunk_attention_weight"):
            CacheConfig(chunk_attention_weight=bad)
    with pytest.raises(ValueError, match="changes nothing"):
        CacheConfig(chunk_attention_scaling=True)
    with pytest.raises(ValueError, match="mode must be 'lazy'"):
        CacheConfig(chunk_attention_scaling=True, chunk_attention_temperature=0.8, mode="block_attention")
    with pytest.raises(ValueError, match="choose one remedy"):
        CacheConfig(chunk_attention_scaling=True, chunk_attention_temperature=0.8, recompute_chunk_head_tokens=4)


# --- the engine -------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("scope, num_scaled_tokens", [("chunk", None), ("head", 16)])
def test_engine_equals_the_composed_reference(make_llm, backend, scope, num_scaled_tokens):
    """Scope "head": only each document's first block (16 tokens; documents "a" and "b" are longer)."""
    hf, llm = ape_engine(make_llm, backend, scope=scope)
    first_logprobs(llm)  # the documents encoded (misses), then served as hits
    ours = first_logprobs(llm)
    assert llm.generate(QUESTION, ["a", "b", "c"], sampling=FIRST).stats.docs_hit == ["a", "b", "c"]
    assert (ours - reference_logprobs(hf, llm, 0.7, 1.5, num_scaled_tokens=num_scaled_tokens)).abs().max().item() <= 1e-4
    assert (ours - reference_logprobs(hf, llm, 1.0, 1.0)).abs().max().item() > 1e-3  # scaling made a difference
    if scope == "head":  # and it was not the whole chunks' scaling
        assert (ours - reference_logprobs(hf, llm, 0.7, 1.5)).abs().max().item() > 1e-3


def test_the_reference_without_scaling_is_plain_reuse(make_llm):
    """The hand-built reference itself: at T = W = 1 it is the oracle of plain reuse."""
    hf, plain = remedy_engine(make_llm)
    first_logprobs(plain)
    assert (first_logprobs(plain) - reference_logprobs(hf, plain, 1.0, 1.0)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("scope", ["chunk", "head"])
def test_flags_mark_document_entries_only(make_llm, scope):
    """Every block of each document ("chunk"), or each document's first block ("head")."""
    _, llm = ape_engine(make_llm, scope=scope)
    llm.generate(QUESTION, ["a", "b"], sampling=FIRST)  # encodes the chunks
    seen = []  # each compute job's context flags, read in the step (they are released with the request)
    remove = llm.add_step_listener(lambda step: seen.extend(
        (job.request.plan, [e.scaled for e in job.request.context_entries]) for job in step.output.computes))
    llm.generate(QUESTION, ["a", "b"], sampling=SamplingParams(max_tokens=3, ignore_eos=True))  # still running
    settle(llm)
    remove()
    plan, flags = seen[0]
    assert plan.chunk_scaling
    expected = [c.doc_id is not None and (scope == "chunk" or i == 0)
                for c in plan.chunks for i in range(-(-len(c.token_ids) // 16))]
    assert flags == expected and plan.chunk_scaling_blocks == (scope == "head")
    assert any(expected) and not all(expected)  # the prompt head is not flagged


def test_request_without_scaling_is_plain_reuse_bit_for_bit(make_llm):
    _, plain = remedy_engine(make_llm)
    _, ape = ape_engine(make_llm)
    _, off = ape_engine(make_llm, on=False)  # configured, not on by default
    for llm in (plain, ape, off):
        first_logprobs(llm)  # the documents encoded: the comparisons below are all hits
    assert torch.equal(first_logprobs(plain), first_logprobs(ape, remedies=RequestRemedies(chunk_attention_scaling=False)))
    assert torch.equal(first_logprobs(plain), first_logprobs(off))
    assert not torch.equal(first_logprobs(plain), first_logprobs(off, remedies=RequestRemedies(chunk_attention_scaling=True)))


def test_one_remedy_per_request(make_llm):
    _, llm = ape_engine(make_llm)
    assert not llm.engine.planner.plan(QUESTION, ["a"], remedies=RequestRemedies(recompute_chunk_head_tokens=4)).chunk_scaling
    with pytest.raises(ValueError, match="choose one remedy"):
        llm.generate(QUESTION, ["a"], sampling=FIRST, remedies=RequestRemedies(chunk_attention_scaling=True, recompute_chunk_head_tokens=4))
    with pytest.raises(ValueError, match="True, False or None"):
        llm.generate(QUESTION, ["a"], sampling=FIRST, remedies=RequestRemedies(chunk_attention_scaling=1))
    _, plain = remedy_engine(make_llm)
    with pytest.raises(ValueError, match="changes nothing"):
        plain.generate(QUESTION, ["a"], sampling=FIRST, remedies=RequestRemedies(chunk_attention_scaling=True))
    assert len(plain.generate(QUESTION, ["a"], sampling=FIRST).token_ids) == 1  # the engine still serves
    with pytest.raises(ValueError, match="chunk_attention_scope must be 'chunk' or 'head', got 'sink'"):
        CacheConfig(chunk_attention_scope="sink")


def test_chunks_unchanged_and_nothing_held(make_llm):
    _, llm = ape_engine(make_llm)
    assert_chunks_unchanged_and_nothing_held(llm)
