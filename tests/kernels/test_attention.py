"""The Triton paged attention computes what the torch reference does (float64 oracle).

Prefill: varlen batches of {1, 63, 64, 65, 200} new tokens over cached prefixes (context longer
than the new tokens), random non-contiguous block tables, grouped KV heads with groups of 1, 2
and 3 (Qwen3.5's 6 is not a power of two either). Decode: one query per sequence, with and
without split-KV; short query runs over long contexts, split along the keys. Cache positions
past each context and unused block-table entries point at NaN, so any read outside the causal
window shows up in the output. float32 and bf16; on CUDA also Qwen3.5's shapes (D=256, Hq/Hkv
= 8/2 and 24/4). Both kernels run on persistent grids: programs that loop over several work
items compute the same bits as one program per item.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels import attention, hw, reference
from kernels.attention import paged_attention
from kernels.hw import num_cube_cores

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
BLOCK = 64
SMALL_HEADS = [(2, 2, 16), (4, 2, 32), (6, 2, 16)]  # (Hq, Hkv, D)
QWEN_HEADS = [(8, 2, 256), (24, 4, 256)]
HEADS = SMALL_HEADS + (QWEN_HEADS if torch.cuda.is_available() else [])


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


def make_batch(new_lens, ctx_lens, Hq, Hkv, D, dtype, device):
    """q, block tables and NaN-poisoned caches with random keys/values in each context."""
    num_used = [(c + BLOCK - 1) // BLOCK for c in ctx_lens]
    max_blocks = max(num_used) + 2
    num_blocks = sum(num_used) + 3  # a few never-used blocks, left NaN
    k_cache = torch.full((num_blocks, BLOCK, Hkv, D), float("nan"), device=device)
    v_cache = torch.full_like(k_cache, float("nan"))
    perm = torch.randperm(num_blocks - 1, device=device)  # the last block is "beyond" every table
    tables = torch.full(
        (len(ctx_lens), max_blocks), num_blocks - 1, dtype=torch.int32, device=device
    )
    start = 0
    for i, (ctx, n) in enumerate(zip(ctx_lens, num_used)):
        blocks = perm[start : start + n]
        start += n
        tables[i, :n] = blocks.int()
        flat_k, flat_v = k_cache[blocks].view(-1, Hkv, D), v_cache[blocks].view(-1, Hkv, D)
        flat_k[:ctx], flat_v[:ctx] = (torch.randn(ctx, Hkv, D, device=device) for _ in range(2))
        k_cache[blocks], v_cache[blocks] = (
            flat_k.view(n, BLOCK, Hkv, D),
            flat_v.view(n, BLOCK, Hkv, D),
        )
    T = sum(new_lens)
    q = torch.randn(T, Hq, D, device=device)
    cu = torch.tensor(
        [0, *torch.tensor(new_lens).cumsum(0).tolist()], dtype=torch.int32, device=device
    )
    ctx = torch.tensor(ctx_lens, dtype=torch.int32, device=device)
    return q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), tables, cu, ctx


def check(new_lens, ctx_lens, heads, dtype, device):
    Hq, Hkv, D = heads
    q, k_cache, v_cache, tables, cu, ctx = make_batch(new_lens, ctx_lens, Hq, Hkv, D, dtype, device)
    scale = D**-0.5
    out = paged_attention(q, k_cache, v_cache, tables, cu, ctx, scale)
    ref = reference.paged_attention(
        q.double(), k_cache.double(), v_cache.double(), tables, cu, ctx, scale
    )
    assert out.shape == q.shape and out.dtype == dtype
    assert not out.isnan().any(), "attention read outside the causal window or left rows unwritten"
    assert rel_err(out, ref) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", HEADS)
def test_prefill_with_cached_prefix(device, dtype, heads):
    new_lens = [1, 63, 64, 65, 200]
    prefixes = [130, 0, 64, 7, 70]
    check(new_lens, [n + p for n, p in zip(new_lens, prefixes)], heads, dtype, device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", SMALL_HEADS)
@pytest.mark.parametrize(
    "new_lens, ctx_lens",
    [([20], [720]), ([200, 1], [260, 1100]), ([1, 63], [900, 63])],
    ids=["short-over-long", "rows-before-the-last-split", "two-seqs"],
)
def test_prefill_split_along_the_keys(device, dtype, heads, new_lens, ctx_lens, monkeypatch):
    """Few query tiles over a long context take key splits (a resume after an edit); some
    splits lie wholly after some rows' positions and must get no weight in the merge."""
    monkeypatch.setitem(attention.CUDA_PREFILL, "programs_per_core", 4)  # splits on the CPU too
    q_tiles = sum(n // (64 // (heads[0] // heads[1])) + 1 for n in new_lens) * heads[1]
    assert q_tiles < 4 * num_cube_cores(torch.device(device))
    check(new_lens, ctx_lens, heads, dtype, device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("num_seqs", [1, 5, 16])  # 1: many KV splits, 16: none (on CPU)
def test_decode(device, dtype, heads, num_seqs):
    ctx_lens = torch.randint(1, 400, (num_seqs,)).tolist()
    ctx_lens[0] = 384 if num_seqs == 1 else 1
    check([1] * num_seqs, ctx_lens, heads, dtype, device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ctx_len", [2000, 1100])  # 17 splits; 10 splits, the last one empty
def test_decode_merges_many_splits_in_chunks(device, dtype, ctx_len, monkeypatch):
    """A decode graph over a wide block table splits the keys a hundred ways or more; the
    merge walks the splits in chunks (here of 4, the last one partial, and 8 channels at a
    time), online: a later chunk's larger max rescales what came before."""
    monkeypatch.setattr(attention, "MERGE_MAX_BS", 4)
    monkeypatch.setattr(attention, "MERGE_TILE", 32)
    monkeypatch.setitem(attention.CUDA_DECODE, "programs_per_core", 16)
    check([1], [ctx_len], HEADS[0], dtype, device)
    # the output gate, read by every channel program of the merge (D = 32: four of them)
    Hq, Hkv, D = 4, 2, 32
    q, k_cache, v_cache, tables, cu, ctx = make_batch([1], [ctx_len], Hq, Hkv, D, dtype, device)
    gate = (torch.randn(1, Hq, 2 * D, device=device) * 2).to(dtype)[..., D:]
    out = paged_attention(q, k_cache, v_cache, tables, cu, ctx, D**-0.5, gate)
    ref = reference.paged_attention(q.double(), k_cache.double(), v_cache.double(), tables, cu,
                                    ctx, D**-0.5, gate.double())
    assert rel_err(out, ref) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "new_lens, ctx_lens, splits",
    [([63, 65], [63, 200], False), ([20], [720], True), ([1, 1, 1], [384, 5, 70], True)],
    ids=["prefill", "prefill-split", "decode-split"],
)
def test_output_gate_in_the_epilogue(device, dtype, new_lens, ctx_lens, splits, monkeypatch):
    """Qwen3.5's sigmoid output gate, taken strided from q_proj's output (per head: D query
    channels, then D gate channels), is applied by the attention kernel (or by its merge of
    key splits) as the model did it: out rounded, times sigmoid(gate) rounded."""
    if splits:
        monkeypatch.setitem(attention.CUDA_PREFILL, "programs_per_core", 4)
    Hq, Hkv, D = 4, 2, 32
    q, k_cache, v_cache, tables, cu, ctx = make_batch(new_lens, ctx_lens, Hq, Hkv, D, dtype, device)
    gate = (torch.randn(q.shape[0], Hq, 2 * D, device=device) * 2).to(dtype)[..., D:]
    scale = D**-0.5
    out = paged_attention(q, k_cache, v_cache, tables, cu, ctx, scale, gate)
    plain = paged_attention(q, k_cache, v_cache, tables, cu, ctx, scale)
    unfused = plain * torch.sigmoid(gate)  # what the model computed before the fusion
    if dtype == torch.bfloat16:  # the same roundings: equal but for rare 1-ulp sigmoid ties
        assert (out != unfused).float().mean() < 0.01
    assert rel_err(out, unfused.double()) <= TOL[dtype]
    ref = reference.paged_attention(
        q.double(), k_cache.double(), v_cache.double(), tables, cu, ctx, scale, gate.double()
    )
    assert rel_err(out, ref) <= TOL[dtype]


def test_gate_must_match_q(device):
    q, k_cache, v_cache, tables, cu, ctx = make_batch([4], [4], 2, 1, 16, torch.float32, device)
    with pytest.raises(ValueError, match="gate"):
        paged_attention(q, k_cache, v_cache, tables, cu, ctx, 1.0, q[:, :1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="long contexts only on the device")
@pytest.mark.parametrize("heads", QWEN_HEADS)
def test_long_context_qwen_shapes(device, heads):
    check([1000, 1, 300], [5000, 8192, 2300], heads, torch.bfloat16, device)
    check([1] * 32, torch.randint(1, 8192, (32,)).tolist(), heads, torch.bfloat16, device)


def test_rejects_heads_that_do_not_group(device):
    q = torch.randn(3, 3, 16, device=device)
    cache = torch.zeros(2, BLOCK, 2, 16, device=device)
    one = torch.ones(1, 1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="does not fit"):
        paged_attention(
            q,
            cache,
            cache,
            one,
            torch.tensor([0, 3], dtype=torch.int32, device=device),
            one[0],
            1.0,
        )


def test_split_widths_name_the_narrowest_table_of_each_launch_form(monkeypatch):
    """The widths at which an eager warm-up builds every form of the attention: on 132 cores a
    decode step of one sequence (8 heads over 2 KV heads of 256) keeps its keys whole below 4
    blocks, then merges 2-16, 17-32 and 33-50 splits in three tiles."""
    monkeypatch.setattr(attention, "num_cube_cores", lambda device: 132)
    token = torch.empty(1, 8, 256, dtype=torch.bfloat16)
    assert attention.split_widths(token, 2, 200) == [1, 4, 34, 66]
    assert attention.split_widths(token, 2, 40) == [1, 4, 34]
    splits = [attention._launch_shape(token, 1, 2, w)[3] for w in (3, 4, 33, 34, 65, 66)]
    assert splits == [1, 2, 16, 17, 32, 33]


def test_the_reference_scores_a_tile_of_queries_at_a_time(monkeypatch):
    """The reference attention (the CPU engine's) holds the scores of QUERY_TILE queries at a
    time, over the keys they see, and gives what the whole chunk's scores at once give: a
    4,096-token chunk over an 8k context took gigabytes of scores, and seconds, on the CPU."""
    torch.manual_seed(0)
    q, k_cache, v_cache, tables, cu, ctx = make_batch([600, 1, 300], [700, 50, 300], 4, 2, 16,
                                                      torch.float32, "cpu")
    args = (q, k_cache, v_cache, tables, cu, ctx, 0.25)
    widths, einsum = [], torch.einsum

    def recorded(eq, *operands):
        out = einsum(eq, *operands)
        if eq.startswith("thd"):
            widths.append(out.shape[1:])  # (the scores: [Hq, queries, keys])
        return out

    monkeypatch.setattr(torch, "einsum", recorded)
    tiled = reference.paged_attention(*args)
    assert max(t for t, _ in widths) == reference.QUERY_TILE == 256
    assert (256, 356) in widths  # (the first tile of the 600: the 100 cached keys and its own)
    monkeypatch.setattr(reference, "QUERY_TILE", 1 << 20)
    whole = reference.paged_attention(*args)
    torch.testing.assert_close(tiled, whole, rtol=1e-6, atol=1e-6)


def _prefill_chunk_decode(device):
    """Prefill of odd-length sequences over shuffled cache blocks (tiles of 32 tokens: the 27
    leave a spare tile number, an item with no work); chunked prefill (queries from
    mid-sequence) split along the keys; a gated decode split along the keys and merged in two
    channel tiles."""
    outs = []
    for new_lens, ctx_lens in (([37, 27, 99], [37, 27, 99]), ([9, 3], [450, 301]),
                               ([1, 1, 1], [300, 9, 170])):
        q, k_cache, v_cache, tables, cu, ctx = make_batch(new_lens, ctx_lens, 4, 2, 16,
                                                          torch.float32, device)
        gate = torch.randn_like(q) if new_lens[0] == 1 else None
        outs.append(paged_attention(q, k_cache, v_cache, tables, cu, ctx, 0.25, gate))
    return outs


def _run_on_cores(cores, device, monkeypatch):
    """The outputs and each launch's (kernel, grid) with `cores` cores of 3 programs each."""
    launches = []

    def spy(kernel, grid, *args, **kwargs):
        launches.append((kernel, grid))
        hw.launch(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(attention, "launch", spy)
    # the key splits follow attention's own `num_cube_cores`, fixed here: only the grids change
    monkeypatch.setattr(attention, "num_cube_cores", lambda device: 8)
    monkeypatch.setitem(attention.CUDA_PREFILL, "programs_per_core", 4)
    monkeypatch.setitem(attention.CUDA_DECODE, "programs_per_core", 16)
    monkeypatch.setattr(attention, "MERGE_TILE", 128)  # 8 channels of 16 per merge item
    monkeypatch.setattr(hw, "ROW_PROGRAMS_PER_CORE", {"cuda": 3, "other": 3})
    monkeypatch.setattr(hw, "num_cores", lambda device: cores)
    torch.manual_seed(0)
    return _prefill_chunk_decode(device), launches


def test_programs_looping_over_tiles_compute_what_one_program_per_tile_does(device, monkeypatch):
    """Attention and its merge of key splits on persistent grids: with one core of 3 programs,
    each program loops over many (tile, head, split) items, spare tile numbers included; the
    outputs are bit-identical to those of one program per item."""
    whole, item_launches = _run_on_cores(10**6, device, monkeypatch)
    looped, launches = _run_on_cores(1, device, monkeypatch)
    assert sum(k is attention._merge_splits_kernel for k, _ in launches) == 2  # splits merged
    assert [g for _, g in launches] == [(min(g[0], 3),) for _, g in item_launches]
    assert max(g[0] for _, g in item_launches) >= 9  # programs did loop, several times
    assert not any(out.isnan().any() for out in looped)  # spare items wrote nothing
    for a, b in zip(whole, looped, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
