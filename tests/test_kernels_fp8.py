"""FP8 KV caches in the Triton kernels (issue 42) against their PyTorch references: the quantizing
K/V write, paged decode and paged prefill reading FP8 rows with one scale per token and KV head,
and the triton backend against the torch backend.

On the CPU these run under TRITON_INTERPRET=1 (tests/conftest.py) on small shapes; on a GPU the
same tests run compiled.
"""

import pytest
import torch
from kernel_tolerances import assert_close
from paged_case import KINDS, SeqSpec, make_batch, make_case, make_rotary

from lazyattn_rag.engine.worker.attention import build_attention_metadata
from lazyattn_rag.engine.worker.attention.base import write_kv
from lazyattn_rag.engine.worker.attention.torch_backend import TorchAttentionBackend
from lazyattn_rag.engine.worker.attention.triton_backend import TritonAttentionBackend
from lazyattn_rag.kernels.decode import paged_decode
from lazyattn_rag.kernels.kv_write import write_kv_cache
from lazyattn_rag.kernels.prefill import paged_prefill
from lazyattn_rag.kernels.reference import decode_reference, prefill_reference
from lazyattn_rag.types.kv_quant import quantize_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]

DECODE = [
    SeqSpec(chunks=[(1, 7), (15, -4), (16, 40), (17, 2**24 - 9), (37, 300)], own_len=21),
    SeqSpec(chunks=[], own_len=6),
    SeqSpec(chunks=[(64, 9), (64, 9), (32, 0)], own_len=17),
]
PREFILL = [
    SeqSpec(chunks=[(1, 7), (15, -4), (17, 2**24 - 9), (37, 300)], own_len=21, query_len=19),
    SeqSpec(chunks=[], own_len=6, query_len=6),
    SeqSpec(chunks=[(17, 5)], own_len=3, query_len=1),
    SeqSpec(chunks=[(16, -(2**24) + 1)], own_len=40, query_len=33),
]


def quantized(case, fp8):
    """The case's caches as FP8 rows and scales (unused slots stay NaN: a read of one shows)."""
    (k, ks), (v, vs) = quantize_rows(case.key_cache, fp8), quantize_rows(case.value_cache, fp8)
    return k.contiguous(), v.contiguous(), ks.contiguous(), vs.contiguous()


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype,num_splits", [(torch.float32, 1), (torch.float32, 3), (torch.bfloat16, 2),
                                             (torch.float16, 1)])
def test_decode_reads_fp8_rows_times_their_scales(fp8, dtype, num_splits):
    case = make_case(DECODE, num_heads=8, num_kv_heads=2, head_dim=64, dtype=dtype, device=DEVICE, seed=5)
    k, v, ks, vs = quantized(case, fp8)
    out = paged_decode(case.query, k, v, case.block_tables, case.num_blocks_per_seq, case.cu_seqlens_q,
                       int(case.seq_lens.max()), case.inv_freq, case.scale, num_splits=num_splits,
                       key_scale=ks, value_scale=vs)
    ref = decode_reference(case.query, k, v, case.block_tables, case.num_blocks_per_seq, case.cu_seqlens_q,
                           case.inv_freq, case.scale, key_scale=ks, value_scale=vs)
    assert out.dtype == dtype
    assert_close(out, ref, dtype, f"{fp8} splits {num_splits}")
    unscaled = decode_reference(case.query, case.key_cache, case.value_cache, case.block_tables,
                                case.num_blocks_per_seq, case.cu_seqlens_q, case.inv_freq, case.scale)
    assert (ref - unscaled).abs().max() > 1e-3  # the FP8 rounding is really in the reference


def test_float16_dots_keep_a_heavy_key_with_a_small_v_scale_exact():
    """One tile's V scales spanning 10**6 (every 8th key: a huge V its query all but ignores): the
    keys that carry the output have V scales 10**6 below the tile's largest, and their softmax
    weights times those scales must not fall into float16's subnormals (normalized per row)."""
    case = make_case([SeqSpec(chunks=[], own_len=64)], num_heads=4, num_kv_heads=1, head_dim=32,
                     dtype=torch.float16, device=DEVICE, seed=1)
    g = torch.Generator().manual_seed(0)
    query = torch.zeros_like(case.query)
    query[..., 0] = 4.0
    valid = ~torch.isnan(case.key_cache.float().cpu())
    k = torch.where(valid, torch.randn(valid.shape, generator=g) * 0.1, torch.nan)
    v = torch.where(valid, torch.randn(valid.shape, generator=g) * 1e-2, torch.nan)
    k[:, ::8] = torch.where(valid[:, ::8], 0.0, torch.nan)
    k[:, ::8, :, 0] = torch.where(valid[:, ::8, :, 0], -40.0, torch.nan)  # weight ~1e-28: ignored
    v[:, ::8] = torch.where(valid[:, ::8], torch.randn(v[:, ::8].shape, generator=g) * 1e4, torch.nan)
    (k8, ks), (v8, vs) = quantize_rows(k.to(DEVICE, torch.float16), FP8[0]), quantize_rows(v.to(DEVICE, torch.float16), FP8[0])
    args = (query, k8, v8, case.block_tables, case.num_blocks_per_seq, case.cu_seqlens_q)
    out = paged_decode(*args, 64, case.inv_freq, case.scale, num_splits=1, key_scale=ks, value_scale=vs)
    ref = decode_reference(*args, case.inv_freq, case.scale, key_scale=ks, value_scale=vs)
    assert vs.nan_to_num().amax() / vs[vs > 0].amin() > 1e5
    rel_err = ((out.float().cpu() - ref.float().cpu()).norm() / ref.float().cpu().norm()).item()
    assert rel_err < 2e-3, rel_err  # 2.6e-4; normalized by the tile's largest V scale instead: 2.7e-2


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype,rotation,step_kv", [(torch.float32, "query", True), (torch.float32, "key", False),
                                                    (torch.bfloat16, "query", False), (torch.bfloat16, "query", True)])
def test_prefill_reads_fp8_rows_and_the_step_in_full_precision(fp8, dtype, rotation, step_kv):
    case = make_case(PREFILL, num_heads=4, num_kv_heads=2, head_dim=64, dtype=dtype, device=DEVICE, seed=7)
    k, v, ks, vs = quantized(case, fp8)
    step = {}
    if step_kv:  # the new tokens' own K/V, unrounded (the rows the step wrote: each sequence's last keys)
        g = torch.Generator().manual_seed(3)
        n = case.query.shape[0]
        step = dict(key=torch.randn(n, 2, 64, generator=g).to(dtype=dtype, device=DEVICE),
                    value=torch.randn(n, 2, 64, generator=g).to(dtype=dtype, device=DEVICE))
        write_kv(step["key"], step["value"], k, v, _new_token_slots(case), ks, vs)
    out = paged_prefill(case.query, k, v, case.block_tables, case.num_blocks_per_seq, case.seq_lens,
                        case.cu_seqlens_q, case.max_query_len, case.inv_freq, case.scale, rotation=rotation,
                        key_scale=ks, value_scale=vs, **step)
    ref = prefill_reference(case.query, k, v, case.block_tables, case.num_blocks_per_seq, case.cu_seqlens_q,
                            case.inv_freq, case.scale, key_scale=ks, value_scale=vs, **step)
    assert_close(out, ref, dtype, f"{fp8} {rotation} step {step_kv}")
    if step_kv:  # the references differ: the step's tokens are not read back rounded
        rounded = prefill_reference(case.query, k, v, case.block_tables, case.num_blocks_per_seq, case.cu_seqlens_q,
                                    case.inv_freq, case.scale, key_scale=ks, value_scale=vs)
        assert (ref - rounded).abs().max() > 1e-3


def _new_token_slots(case) -> torch.Tensor:
    """``[num_tokens]`` flat cache slots of every sequence's last ``query_len`` keys."""
    from lazyattn_rag.kernels.block_table import unpack_block_table

    block_size, slots = case.key_cache.shape[1], []
    for s in range(case.block_tables.shape[0]):
        ids, _, valid = unpack_block_table(case.block_tables[s, : int(case.num_blocks_per_seq[s])].cpu())
        seq_slots = [b * block_size + o for b, n in zip(ids.tolist(), valid.tolist()) for o in range(n)]
        q_len = int(case.cu_seqlens_q[s + 1] - case.cu_seqlens_q[s])
        slots += seq_slots[len(seq_slots) - q_len:]
    return torch.tensor(slots, dtype=torch.int64, device=case.key_cache.device)


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("num_kv_heads,head_dim,src_dtype", [(3, 64, torch.float32), (8, 128, torch.bfloat16)])
def test_the_quantizing_write_equals_the_reference_bit_for_bit(fp8, num_kv_heads, head_dim, src_dtype):
    g = torch.Generator().manual_seed(head_dim)
    num_blocks, block_size, num_tokens = 6, 16, 21
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(src_dtype) * 3
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(src_dtype)
    key[4, 1] = 0  # a zero row: scale 1, zeros stored
    key[5, 0] = 0
    key[5, 0, 3] = 1e-43 if src_dtype == torch.float32 else 0  # a float32 denormal: its scale underflows to 1
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    caches = [torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=fp8) for _ in range(2)]
    scales = [torch.zeros(num_blocks, block_size, num_kv_heads) for _ in range(2)]
    expected = [t.clone() for t in caches + scales]
    write_kv(key, value, expected[0], expected[1], slots, expected[2], expected[3])
    got = [t.clone().to(DEVICE) for t in caches + scales]
    write_kv_cache(key.to(DEVICE), value.to(DEVICE), got[0], got[1], slots.to(DEVICE), got[2], got[3])
    for e, o in zip(expected, got):
        assert torch.equal(o.cpu().view(torch.uint8) if o.dtype == fp8 else o.cpu(),
                           e.view(torch.uint8) if e.dtype == fp8 else e)
    flat = expected[2].view(-1, num_kv_heads)[slots]
    assert flat[4, 1] == 1 and torch.equal(flat[0], key[0].float().abs().amax(-1) / torch.finfo(fp8).max)


def head_major(scale: torch.Tensor) -> torch.Tensor:
    """``scale`` ``[num_blocks, block_size, num_kv_heads]`` as a view of ``[num_blocks,
    num_kv_heads, block_size]`` storage (one head's scales of a block contiguous): read through
    the contiguous layout's strides, a key would get another key's scale."""
    return scale.permute(0, 2, 1).contiguous().permute(0, 2, 1)


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_scales_of_another_layout_read_by_their_strides(kind):
    """The kernels index scales by their strides: head-major scales (the same values) give the
    same output bit for bit as contiguous ones."""
    specs, dtype = (DECODE, torch.bfloat16) if kind == "decode" else (PREFILL, torch.float32)
    case = make_case(specs, num_heads=8, num_kv_heads=2, head_dim=64, dtype=dtype, device=DEVICE, seed=11)
    k, v, ks, vs = quantized(case, torch.float8_e4m3fn)
    hks, hvs = head_major(ks), head_major(vs)
    assert hks.stride() == (32, 1, 16) and not hks.is_contiguous()
    if kind == "decode":
        run = lambda a, b: paged_decode(case.query, k, v, case.block_tables, case.num_blocks_per_seq,  # noqa: E731
                                        case.cu_seqlens_q, int(case.seq_lens.max()), case.inv_freq, case.scale,
                                        num_splits=2, key_scale=a, value_scale=b)
    else:
        run = lambda a, b: paged_prefill(case.query, k, v, case.block_tables, case.num_blocks_per_seq,  # noqa: E731
                                         case.seq_lens, case.cu_seqlens_q, case.max_query_len, case.inv_freq,
                                         case.scale, key_scale=a, value_scale=b)
    expected = run(ks, vs)
    assert torch.isfinite(expected).all()
    assert torch.equal(run(hks, hvs), expected)
    with pytest.raises(ValueError, match=r"key_scale and value_scale must have the same strides, got "
                                         r"\(32, 1, 16\) and \(32, 2, 1\)"):
        run(hks, vs)


def test_scales_that_do_not_fit_are_refused():
    cache = torch.zeros(2, 16, 2, 64, dtype=torch.float8_e4m3fn, device=DEVICE)
    k = torch.ones(3, 2, 64, device=DEVICE)
    slots = torch.tensor([0, 5, 17], device=DEVICE)
    scale = torch.zeros(2, 16, 2, device=DEVICE)
    with pytest.raises(ValueError, match="needs both key_scale and value_scale"):
        write_kv_cache(k, k, cache, cache.clone(), slots)
    with pytest.raises(ValueError, match=r"key_scale must be contiguous float32 \[2, 16, 2\]"):
        write_kv_cache(k, k, cache, cache.clone(), slots, scale[:, :8], scale)
    with pytest.raises(ValueError, match="needs no key_scale and value_scale"):
        write_kv_cache(k, k, cache.float(), cache.float(), slots, scale, scale)


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("kind", ["decode", "mixed", "prefill_no_delta"])
def test_triton_backend_matches_torch_backend_on_fp8_caches(fp8, kind):
    num_heads, num_kv_heads, head_dim, dtype = 8, 2, 64, torch.bfloat16
    seqs, k_cache, v_cache, g = make_batch(KINDS[kind], 16, num_kv_heads, head_dim, torch.float32, seed=len(kind))
    (k_cache, k_scale), (v_cache, v_scale) = quantize_rows(k_cache, fp8), quantize_rows(v_cache, fp8)
    n = sum(s.query_len for s in seqs)
    query, key, value = (torch.randn(n, h, head_dim, generator=g).to(dtype=dtype, device=DEVICE)
                         for h in (num_heads, num_kv_heads, num_kv_heads))
    args = (make_rotary(head_dim), num_heads, num_kv_heads, head_dim, head_dim**-0.5)
    ref_caches = [t.clone() for t in (k_cache, v_cache, k_scale, v_scale)]
    expected = TorchAttentionBackend(*args).forward(query, key, value, ref_caches[0], ref_caches[1],
                                                    build_attention_metadata(seqs, 16, DEVICE), *ref_caches[2:])
    caches = [t.clone().to(DEVICE) for t in (k_cache, v_cache, k_scale, v_scale)]
    out = TritonAttentionBackend(*args).forward(query, key, value, caches[0], caches[1],
                                                build_attention_metadata(seqs, 16, DEVICE), *caches[2:])
    assert out.dtype == dtype
    assert_close(out, expected, dtype, kind)
    for got, want in zip(caches, ref_caches):  # the same bytes written (NaN canaries where nothing was)
        torch.testing.assert_close(got.cpu().float(), want.cpu().float(), equal_nan=True, rtol=0, atol=0)


def test_e4m3_caches_are_refused_by_name_on_gpus_before_sm89():
    from lazyattn_rag.kernels.launch import fp8_dtype_error

    for dtype in ("fp8", "fp8_e4m3"):
        assert fp8_dtype_error(dtype, (8, 0)) == ("FP8 e4m3 K/V need a GPU of compute capability 8.9 or newer "
                                                  "(this one is 8.0); use kv_cache_dtype 'fp8_e5m2' or 'auto'")
        assert fp8_dtype_error(dtype, (8, 9)) is None and fp8_dtype_error(dtype, (9, 0)) is None
        assert fp8_dtype_error(dtype, None) is None  # the interpreter
    assert fp8_dtype_error("fp8_e5m2", (8, 0)) is None and fp8_dtype_error("auto", (7, 5)) is None
