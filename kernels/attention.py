"""Causal attention of new queries over a paged KV cache, prefill and decode in one kernel.

Tiling: a program owns one KV head and a tile of BQ consecutive query tokens of one sequence;
the tile's rows are (token, q head of that KV head's group) pairs, BM = BQ * G rows padded to a
power of two, so every K/V block is loaded once for the whole group (G = Hq / Hkv). KV tiles
are the cache's own blocks (block_size tokens), fetched through the block table.

Work items without host sync: sequence i's tiles are numbered from cu_seqlens_q[i] // BQ + i
(or cu_seqlens_q[i] when BQ == 1), which leaves room for ceil(len_i / BQ) tiles; the items are
the T // BQ + N tile numbers times the KV heads times the key splits, and each finds its
sequence by binary search; an unused number sees no key block and stores nothing (masks, no
early exit). Grids are persistent (kernels.hw.persistent_programs): program p takes items p,
p + P, p + 2P, ..., numbered so that the first items are the last tiles (the longest in a
causal prefill) and a tile's heads and splits are neighbours. The merge's items are (row,
channel tile) pairs.

Split-KV: when the tiles alone cannot fill the device (decode, with BQ = 1 and one query per
sequence, and a short run of new queries over a long cached context, e.g. an edited message),
the KV blocks a tile needs are cut into NUM_SPLITS ranges, each program writes an unnormalised
partial result (running max, sum, accumulator) in float32, and a second kernel merges the
splits. The number of splits follows from the shapes only (the grid, the block-table width),
never from the data, so a launch can be captured in a CUDA graph.

Softmax runs online in float32 (base 2, with scale * log2(e) folded into the scores).
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from kernels.hw import (
    cuda_hints,
    dot_precision,
    gdc_enter,
    launch,
    num_cube_cores,
    pdl,
    persistent_programs,
)

_LOG2E = 1.4426950408889634
log = logging.getLogger("statechat.kernels")


@triton.jit
def _attn_block(
    b_q,
    b_acc,
    b_m,
    b_l,
    k_cache,
    v_cache,
    p_table,
    i_blk,
    i_kvh,
    b_pos,
    ctx_len,
    qk_scale,
    stride_cb,
    stride_ct,
    D: tl.constexpr,
    BD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    IS_MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Fold KV block i_blk of the sequence into the running (acc, m, l) of the tile's rows."""
    o_n = tl.arange(0, BLOCK_SIZE)
    o_d = tl.arange(0, BD)
    i_phys = tl.load(p_table + i_blk).to(tl.int64)
    o_base = i_phys * stride_cb + i_kvh * D
    k_pos = i_blk * BLOCK_SIZE + o_n
    m_d = o_d < D
    if IS_MASKED:
        m_n = k_pos < ctx_len
    else:
        m_n = o_n < BLOCK_SIZE
    p_kt = k_cache + o_base + o_n[None, :] * stride_ct + o_d[:, None]
    b_kt = tl.load(p_kt, mask=m_d[:, None] & m_n[None, :], other=0.0)
    b_s = tl.dot(b_q, b_kt, input_precision=DOT_PRECISION) * qk_scale
    if IS_MASKED:
        b_s = tl.where(k_pos[None, :] <= b_pos[:, None], b_s, float("-inf"))
    b_m_new = tl.maximum(b_m, tl.max(b_s, axis=1))
    b_m_use = b_m_new
    if IS_MASKED:
        # a row may have seen no key yet (a split of keys past it): exp2 must not see
        # -inf - -inf; its max stays -inf, so a merge gives the split no weight
        b_m_use = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
    b_alpha = tl.exp2(b_m - b_m_use)
    b_p = tl.exp2(b_s - b_m_use[:, None])
    b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
    p_v = v_cache + o_base + o_n[:, None] * stride_ct + o_d[None, :]
    b_v = tl.load(p_v, mask=m_n[:, None] & m_d[None, :], other=0.0)
    b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v, input_precision=DOT_PRECISION)
    return b_acc, b_m_new, b_l


# the counts and the block tables' width change from step to step: one build for all
@triton.jit(do_not_specialize=["stride_bt", "N", "NUM_TILES", "NUM_SEARCH_STEPS", "NUM_SPLITS",
                               "NUM_ITEMS", "NUM_PROGS"])
def _paged_attn_kernel(
    q,
    k_cache,
    v_cache,
    out,
    gate,
    part_acc,
    part_ml,
    block_tables,
    cu_seqlens_q,
    context_lens,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_gt,
    stride_gh,
    stride_cb,
    stride_ct,
    stride_bt,
    N,
    NUM_TILES,
    NUM_SEARCH_STEPS,
    NUM_SPLITS,
    NUM_ITEMS,
    NUM_PROGS,
    PID0,
    HQ: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    BD: tl.constexpr,
    BQ: tl.constexpr,
    BM: tl.constexpr,
    PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    IS_SPLIT: tl.constexpr,
    HAS_GATE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    gdc_enter(USE_GDC)
    HKV: tl.constexpr = HQ // G
    # items: (tile, split, KV head), the heads the fastest, so a tile's programs are neighbours;
    # the longest tiles (the last of each sequence) tend to get the high numbers: the first
    # items take those, last tile first
    for i_item in range(tl.program_id(0) + PID0, NUM_ITEMS, NUM_PROGS):
        i_tile = NUM_TILES - 1 - i_item // (HKV * NUM_SPLITS)
        i_kvh, i_split = i_item % HKV, i_item // HKV % NUM_SPLITS
        # sequence of this tile: the largest i < N whose first tile number (cu // BQ + i * PAD,
        # PAD = 0 when BQ == 1 as tiles are then exactly tokens) is <= i_tile
        i_lo = i_tile * 0  # a tensor even when N == 1 is specialised to a constant
        i_hi = i_lo + (N - 1)
        for _ in range(NUM_SEARCH_STEPS):
            i_mid = (i_lo + i_hi + 1) // 2
            is_right = tl.load(cu_seqlens_q + i_mid) // BQ + i_mid * PAD <= i_tile
            i_lo = tl.where(is_right, i_mid, i_lo)
            i_hi = tl.where(is_right, i_hi, i_mid - 1)
        i_n = i_lo
        bos = tl.load(cu_seqlens_q + i_n)
        q_len = tl.load(cu_seqlens_q + i_n + 1) - bos
        q_start = (i_tile - (bos // BQ + i_n * PAD)) * BQ
        ctx_len = tl.load(context_lens + i_n)
        pos0 = ctx_len - q_len + q_start  # position of the tile's first query
        q_last = tl.minimum(q_start + BQ, q_len) - 1
        num_blocks = (ctx_len - q_len + q_last) // BLOCK_SIZE + 1  # blocks the tile may see
        # a tile number past its sequence's queries (the numbering leaves some): no key
        # blocks, so both loops take no trip, and every row is masked off
        num_blocks = tl.where(q_start < q_len, num_blocks, 0)
        blocks_per_split = tl.cdiv(num_blocks, NUM_SPLITS)
        blk_lo = i_split * blocks_per_split
        blk_hi = tl.minimum(blk_lo + blocks_per_split, num_blocks)
        blk_full = tl.minimum((pos0 + 1) // BLOCK_SIZE, blk_hi)  # blocks seen whole by every row

        o_m = tl.arange(0, BM)
        o_d = tl.arange(0, BD)
        r_tok = o_m // G
        r_head = i_kvh * G + o_m % G
        m_row = (r_tok < BQ) & (q_start + r_tok < q_len)
        b_pos = pos0 + r_tok
        o_tok = (bos + q_start + r_tok).to(tl.int64)
        p_q = q + o_tok[:, None] * stride_qt + r_head[:, None] * stride_qh + o_d[None, :]
        b_q = tl.load(p_q, mask=m_row[:, None] & (o_d < D)[None, :], other=0.0)

        b_acc = tl.zeros([BM, BD], dtype=tl.float32)
        b_m = tl.zeros([BM], dtype=tl.float32) + float("-inf")
        b_l = tl.zeros([BM], dtype=tl.float32)
        p_table = block_tables + i_n.to(tl.int64) * stride_bt
        for i_blk in range(blk_lo, blk_full):
            b_acc, b_m, b_l = _attn_block(
                b_q,
                b_acc,
                b_m,
                b_l,
                k_cache,
                v_cache,
                p_table,
                i_blk,
                i_kvh,
                b_pos,
                ctx_len,
                qk_scale,
                stride_cb,
                stride_ct,
                D,
                BD,
                BLOCK_SIZE,
                False,
                DOT_PRECISION,
            )
        for i_blk in range(tl.maximum(blk_lo, blk_full), blk_hi):
            b_acc, b_m, b_l = _attn_block(
                b_q,
                b_acc,
                b_m,
                b_l,
                k_cache,
                v_cache,
                p_table,
                i_blk,
                i_kvh,
                b_pos,
                ctx_len,
                qk_scale,
                stride_cb,
                stride_ct,
                D,
                BD,
                BLOCK_SIZE,
                True,
                DOT_PRECISION,
            )

        o_row = o_tok * HQ + r_head  # row of [T, Hq]
        if IS_SPLIT:
            o_part = o_row * NUM_SPLITS + i_split
            p_acc = part_acc + o_part[:, None] * D + o_d[None, :]
            tl.store(p_acc, b_acc, mask=m_row[:, None] & (o_d < D)[None, :])
            tl.store(part_ml + o_part * 2, b_m, mask=m_row)
            tl.store(part_ml + o_part * 2 + 1, b_l, mask=m_row)
        else:
            # rows off the tile divide by 1: a spare tile number's saw no key (0 / 0)
            b_out = b_acc / tl.where(m_row, b_l, 1.0)[:, None]
            m_out = m_row[:, None] & (o_d < D)[None, :]
            if HAS_GATE:
                o_g = o_tok[:, None] * stride_gt + r_head[:, None].to(tl.int64) * stride_gh
                p_g = gate + o_g + o_d[None, :]
                b_out = _gated(b_out, tl.load(p_g, mask=m_out, other=0.0), out.dtype.element_ty)
            p_out = out + o_row[:, None] * D + o_d[None, :]
            tl.store(p_out, b_out.to(out.dtype.element_ty), mask=m_out)


@triton.jit
def _gated(b_out, b_gate, dtype: tl.constexpr):
    """out * sigmoid(gate) with the reference's roundings: each factor rounded to the output
    dtype, the product computed in float32."""
    b_sig = tl.sigmoid(b_gate.to(tl.float32)).to(dtype).to(tl.float32)
    return b_out.to(dtype).to(tl.float32) * b_sig


@triton.jit(do_not_specialize=["NUM_SPLITS", "NUM_ITEMS", "NUM_PROGS"])
def _merge_splits_kernel(
    part_acc,
    part_ml,
    out,
    gate,
    stride_gt,
    stride_gh,
    NUM_SPLITS,
    NUM_ITEMS,
    NUM_PROGS,
    PID0,
    HQ: tl.constexpr,
    D: tl.constexpr,
    BD: tl.constexpr,
    BS: tl.constexpr,
    HAS_GATE: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    gdc_enter(USE_GDC)
    ND: tl.constexpr = (D + BD - 1) // BD
    # items: (row of [T, Hq], channel tile), a row's tiles neighbours
    for i_item in range(tl.program_id(0) + PID0, NUM_ITEMS, NUM_PROGS):
        i_row = tl.cast(i_item // ND, tl.int64)
        o_d = i_item % ND * BD + tl.arange(0, BD)
        m_d = o_d < D
        # the splits in chunks of BS, merged online (a chunk's loads wait for nothing before
        # them; a decode's splits usually fit one chunk): the running max, and the partial sums
        # and accumulators weighted against it, rescaled when a chunk raises it
        b_top = tl.full([], float("-inf"), tl.float32)
        b_acc = tl.zeros([BD], dtype=tl.float32)
        b_l = tl.zeros([BS], dtype=tl.float32)
        for s0 in range(0, NUM_SPLITS, BS):
            o_part = i_row * NUM_SPLITS + s0 + tl.arange(0, BS)
            m_s = s0 + tl.arange(0, BS) < NUM_SPLITS
            b_m = tl.load(part_ml + o_part * 2, mask=m_s, other=float("-inf"))
            b_ls = tl.load(part_ml + o_part * 2 + 1, mask=m_s, other=0.0)
            b_part = tl.load(part_acc + o_part[:, None] * D + o_d[None, :],
                             mask=m_s[:, None] & m_d[None, :], other=0.0)
            b_new = tl.maximum(b_top, tl.max(b_m, axis=0))
            # splits that saw no key (max -inf) weigh 0; while every max is -inf, so is the top
            b_use = tl.where(b_new == float("-inf"), 0.0, b_new)
            b_alpha = tl.exp2(b_top - b_use)
            b_w = tl.exp2(b_m - b_use)
            b_l = b_l * b_alpha + b_ls * b_w
            b_acc = b_acc * b_alpha + tl.sum(b_part * b_w[:, None], axis=0)
            b_top = b_new
        b_out = b_acc / tl.sum(b_l, axis=0)
        if HAS_GATE:
            p_g = gate + (i_row // HQ) * stride_gt + (i_row % HQ) * stride_gh + o_d
            b_out = _gated(b_out, tl.load(p_g, mask=m_d, other=0.0), out.dtype.element_ty)
        tl.store(out + i_row * D + o_d, b_out.to(out.dtype.element_ty), mask=m_d)


# The merge's tiles: from MERGE_MIN_BS up to MERGE_MAX_BS splits at a time (all of a decode's,
# usually), times as many channels as keep a tile at MERGE_TILE float32 elements (no spills at
# 4 warps). The floor keeps the builds few (16, 32, 64, 128 splits), as the split count of an
# eager step follows its block tables' width.
MERGE_MIN_BS, MERGE_MAX_BS, MERGE_TILE = 16, 128, 4096


def _merge_tile(num_splits: int, BD: int) -> tuple[int, int]:
    """(splits, channels) of a merge tile."""
    bs = min(max(triton.next_power_of_2(num_splits), MERGE_MIN_BS), MERGE_MAX_BS)
    return bs, max(1, min(BD, MERGE_TILE // bs))


# Launch tuning, module-level so that a benchmark can sweep it. Warps and stages are passed on
# CUDA only; programs_per_core sets the number of key splits on every device (measured on CUDA).
# Prefill, 16-bit: 128-row tiles with 3 stages ran 2.1x faster than 64 rows with 2 on an H100
# (Hq=8, Hkv=2, D=256, 8k and 32k tokens; docs/kernels.md). Float32 tiles keep 64 rows and one
# stage, the most that fits. A device whose shared memory cannot hold a config's tiles falls
# back to the smaller one (`_SMALL_PREFILL`), once per process.
CUDA_PREFILL = {"BM": 128, "num_warps": 8, "num_stages": 3, "programs_per_core": 1}
_SMALL_PREFILL = {"BM": 64, "num_warps": 8, "num_stages": 2}
MIN_SPLIT_BLOCKS = 4  # KV blocks per split at the least (prefill): fewer cost more to merge
# Decode on an H100 (Hq=8, Hkv=2, D=256; docs/bench.md, session 9): 0.75 programs per core
# (50 splits of the keys at B=1) ran the 1b model's decode graph after 8k in 0.935 ms against
# one per core's 0.980 (66 splits; 0.5 per core: 0.944, 0.25: 0.981-0.983), though one per
# core was the fastest in isolation (session 8): most of the gain showed in the lm_head, at
# the end of the step, for reasons not understood.
CUDA_DECODE = {"num_warps": 4, "num_stages": 2, "programs_per_core": 0.75}
DECODE_MIN_SPLIT_BLOCKS = 2  # KV blocks per split at the least (decode), of the table's width


_TOO_LARGE: set[torch.device] = set()  # devices where CUDA_PREFILL's tiles did not fit


def _prefill_config(q: torch.Tensor) -> dict:
    """Tile rows, warps and stages of a prefill launch: CUDA_PREFILL for 16-bit data where it
    fits, else the small tiles (float32, devices with less shared memory, other backends)."""
    if q.device.type != "cuda" or q.element_size() > 2 or q.device in _TOO_LARGE:
        return _SMALL_PREFILL
    return CUDA_PREFILL


def _check(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, gate) -> None:
    """paged_attention's checks of its tensors (shapes and strides: no device value read)."""
    if q.ndim != 3 or k_cache.ndim != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"paged_attention expects q [T, Hq, D] and caches [num_blocks, block_size, Hkv, D]; "
            "got "
            f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    Hq, D = q.shape[1:]
    block_size, Hkv = k_cache.shape[1:3]
    if k_cache.shape[3] != D or Hq % Hkv:
        raise ValueError(
            f"paged_attention: q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)}"
        )
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"paged_attention needs a power-of-two block_size >= 16, got {block_size}")
    if q.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"paged_attention needs q and caches of one dtype; got {q.dtype}, {k_cache.dtype}"
        )
    if q.stride(2) != 1 or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(
            "paged_attention needs contiguous caches and q with a unit-stride last dim"
        )
    N = cu_seqlens_q.shape[0] - 1
    if block_tables.ndim != 2 or block_tables.shape[0] != N or context_lens.shape != (N,):
        raise ValueError(
            f"paged_attention: {N} sequences but block_tables {tuple(block_tables.shape)}, "
            f"context_lens {tuple(context_lens.shape)}"
        )
    for name, t in (
        ("block_tables", block_tables),
        ("cu_seqlens_q", cu_seqlens_q),
        ("context_lens", context_lens),
    ):
        if t.dtype != torch.int32 or t.stride(-1) != 1:
            raise ValueError(f"paged_attention needs {name} as int32 with a unit-stride last dim")
    if gate is not None and (gate.shape != q.shape or gate.dtype != q.dtype or gate.stride(2) != 1):
        raise ValueError(
            f"paged_attention: gate {tuple(gate.shape)} {gate.dtype} must match q "
            f"{tuple(q.shape)} {q.dtype} with a unit-stride last dim"
        )


def _launch_shape(q: torch.Tensor, N: int, Hkv: int, width: int) -> tuple[int, int, int, int]:
    """(BQ, BM, tiles, key splits) of a launch over q's tokens of N sequences (a decode step when
    each has one) whose block tables are `width` wide."""
    T, Hq, D = q.shape
    G = Hq // Hkv
    if T == N:
        BQ, BM = 1, max(16, triton.next_power_of_2(G))
        num_tiles = T
        # about programs_per_core x cores programs, each split with at least two KV blocks
        num_programs = max(1, round(CUDA_DECODE["programs_per_core"] * num_cube_cores(q.device)))
        return BQ, BM, num_tiles, min(triton.cdiv(num_programs, N * Hkv),
                                      max(1, width // DECODE_MIN_SPLIT_BLOCKS))
    BM = max(_prefill_config(q)["BM"], triton.next_power_of_2(G))
    BQ = BM // G
    num_tiles = T // BQ + N
    # few tiles over long contexts (a short resume): split the keys until the device is full
    num_programs = CUDA_PREFILL["programs_per_core"] * num_cube_cores(q.device)
    num_splits = min(triton.cdiv(num_programs, num_tiles * Hkv), max(1, width // MIN_SPLIT_BLOCKS))
    if q.device.type == "cuda" and q.element_size() > 2 and D > 128:
        # float32 tiles of wide heads spill registers; with splits the H100's driver could
        # not find the local memory for them (launch "out of memory"): whole tiles instead
        num_splits = 1
    return BQ, BM, num_tiles, num_splits


def split_widths(q: torch.Tensor, num_kv_heads: int, most: int) -> list[int]:
    """The narrowest block-table widths (1 up to `most`) at which a step of one sequence with
    q's tokens (one token: a decode step) takes each launch form of the attention: whole keys,
    or split keys merged in each of `_merge_tile`'s tiles. Eager steps at these widths build
    every form such steps can take (`ModelRunner.warm_up`); only q's shape, dtype and device
    are read."""
    forms, widths = set(), []
    BD = triton.next_power_of_2(q.shape[2])
    for width in range(1, most + 1):
        splits = _launch_shape(q, 1, num_kv_heads, width)[3]
        form = _merge_tile(splits, BD) if splits > 1 else None
        if form not in forms:
            forms.add(form)
            widths.append(width)
    return widths


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of new queries over a paged KV cache (prefill and decode alike).

    q: [T, Hq, D] (Hq a multiple of Hkv; token/head strides free); k_cache, v_cache:
    [num_blocks, block_size, Hkv, D] contiguous, q's dtype; block_tables: [N, max_blocks] int32;
    cu_seqlens_q: [N+1] int32; context_lens: [N] int32, tokens in the cache for each sequence
    including its new ones (which are its last tokens); gate: None or [T, Hq, D] of q's dtype
    (token/head strides free), applied as out * sigmoid(gate) before the store.
    Returns [T, Hq, D] in q's dtype; softmax in float32.
    """
    _check(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, gate)
    T, Hkv, N = q.shape[0], k_cache.shape[2], cu_seqlens_q.shape[0] - 1
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if T == 0 or N == 0:
        return out
    is_decode = T == N
    config = CUDA_DECODE if is_decode else _prefill_config(q)
    BQ, BM, num_tiles, num_splits = _launch_shape(q, N, Hkv, block_tables.shape[1])
    parts = _split_parts(q, num_splits, out)
    gate_strides = (0, 0) if gate is None else (gate.stride(0), gate.stride(1))
    args = (q, k_cache, v_cache, out, q if gate is None else gate, *parts, block_tables,
            cu_seqlens_q, context_lens, scale * _LOG2E, q.stride(0), q.stride(1), *gate_strides,
            k_cache.stride(0), k_cache.stride(1), block_tables.stride(0), N, num_tiles,
            max(N - 1, 1).bit_length(), num_splits)
    constants = _constants(q, k_cache, gate is not None, BQ, BM, num_splits > 1, config)
    num_items = num_tiles * Hkv * num_splits
    programs = persistent_programs(num_items, q.device, dots=True)
    try:
        launch(_paged_attn_kernel, (programs,), *args, num_items, programs, **constants)
    except OutOfResources as e:
        if is_decode or config is _SMALL_PREFILL:
            raise
        _TOO_LARGE.add(q.device)  # this device cannot hold the large tiles: never try again
        log.warning("statechat: attention prefill tiles of %d rows do not fit %s (%s); "
                    "using %d rows there (about 2x slower on an H100)",
                    CUDA_PREFILL["BM"], q.device, e, _SMALL_PREFILL["BM"])
        return paged_attention(
            q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, gate
        )
    if num_splits > 1:
        _launch_merge(q, gate, gate_strides, *parts, out, num_splits)
    return out


def _split_parts(q: torch.Tensor, num_splits: int, out: torch.Tensor):
    """(part_acc [T, Hq, splits, D], part_ml [T, Hq, splits, 2]) float32, the splits' partial
    results (accumulator; running max and sum); `out` twice, never touched, without splits."""
    if num_splits <= 1:
        return out, out
    T, Hq, D = q.shape
    part_acc = torch.empty((T, Hq, num_splits, D), dtype=torch.float32, device=q.device)
    part_ml = torch.empty((T, Hq, num_splits, 2), dtype=torch.float32, device=q.device)
    return part_acc, part_ml


def _constants(q, k_cache, has_gate: bool, BQ: int, BM: int, is_split: bool, config: dict):
    """The attention kernel's compile-time constants, then its launch hints (CUDA only)."""
    Hq, D = q.shape[1:]
    BD = triton.next_power_of_2(D)
    # float32 tiles: one stage fits in shared memory
    stages = 1 if q.element_size() > 2 else config["num_stages"]
    return {
        "HQ": Hq,
        "G": Hq // k_cache.shape[2],
        "D": D,
        "BD": BD,
        "BQ": BQ,
        "BM": BM,
        "PAD": int(BQ > 1),
        "BLOCK_SIZE": k_cache.shape[1],
        "IS_SPLIT": is_split,
        "HAS_GATE": has_gate,
        "DOT_PRECISION": dot_precision(q.device, q.dtype),
        **pdl(q.device),
        **cuda_hints(q.device, num_warps=config["num_warps"], num_stages=stages),
    }


def _launch_merge(q, gate, gate_strides, part_acc, part_ml, out, num_splits: int) -> None:
    """The splits' partial results merged into out [T, Hq, D] (gated when gate is given)."""
    T, Hq, D = q.shape
    BS_merge, BD_merge = _merge_tile(num_splits, triton.next_power_of_2(D))
    num_items = T * Hq * triton.cdiv(D, BD_merge)
    programs = persistent_programs(num_items, q.device)
    launch(
        _merge_splits_kernel, (programs,),
        part_acc, part_ml, out, q if gate is None else gate, *gate_strides, num_splits,
        num_items, programs,
        HQ=Hq, D=D, BD=BD_merge, BS=BS_merge, HAS_GATE=gate is not None, **pdl(q.device),
    )
