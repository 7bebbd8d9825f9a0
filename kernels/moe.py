"""Fused mixture-of-experts: routed SwiGLU experts, weighted and summed over each token's top-k.

Two paths, chosen from host-known sizes only (no host sync anywhere in the launcher):

Prefill (many (token, expert) pairs), four kernels:
1. `_sort_kernel`, over the experts e: counts the pairs routed to experts < e and to e,
   writes counts[e] and the flat indices (t * K + k) of e's pairs, in order, into
   sorted_pairs[start_e : start_e + count_e] (start_e = pairs routed to experts < e).
2. `_gate_up_kernel`, a grouped GEMM over tiles of BM sorted rows of one expert: gathers the
   tokens' rows of x, multiplies by the expert's gate and up rows, and writes
   silu(gate) * up, rounded to x's dtype, to act[sorted row].
3. `_down_kernel`, the same tiling: act rows times the expert's down_proj, scaled by the pair's
   routing weight, written to y[pair] (x's dtype).
4. `_combine_kernel`: out[t] = sum over k of y[t * K + k], in float32, in k order.
   A tile finds its expert from counts alone: each work item loads counts [E], turns it into
   tiles per expert (ceil(count / BM)) and their running sum, and picks the expert whose range
   holds its tile number. The items cover an upper bound of the tile count,
   ceil(T*K / BM) + min(E, T*K) (each non-empty expert adds at most one partial tile), times
   the N tiles; an item past the real tiles masks out all its rows and makes no trips over
   the reduction dimension, so it loads and stores nothing (no early return, no host sync).

Decode (few pairs), two kernels and no sort: `_gate_up_gemv_kernel` computes each pair's
activation row directly (an item per pair and block of I), and `_down_combine_kernel`
loops over a token's K pairs in order, so the down projection and the weighted sum are one
pass.

Every grid has one axis over the work items (kernels.hw.persistent_grid): experts, or (row
tile, N tile) pairs, or (token or pair, N tile) pairs, numbered row tiles, tokens or pairs first,
the order in which CUDA ran the two-axis grids of before. Each kernel has two forms from one
source (its `LOOP` constexpr; an item's work sits in a helper): one program per item (CUDA),
or a persistent grid whose program p takes items p, p + P, p + 2P, ... (elsewhere). The
grouped GEMMs (tl.dot) size theirs from an NPU's AI cores (`dots=True`).

Both paths are deterministic (no atomics): a token's output does not depend on the other
tokens in the batch beyond which path runs.

GEMMs accumulate in float32 (tl.dot with input_precision="ieee" for float32 inputs); the
activation is rounded to x's dtype before the down projection, as the reference does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.hw import dot_precision, launch, persistent_grid


@triton.jit
def _sort_expert(topk_ids, counts, sorted_pairs, NUM_PAIRS, i_e, BLOCK: tl.constexpr):
    b_lt = tl.zeros([BLOCK], dtype=tl.int32)
    b_eq = tl.zeros([BLOCK], dtype=tl.int32)
    for i_blk in range(tl.cdiv(NUM_PAIRS, BLOCK)):
        o_p = tl.arange(0, BLOCK).to(tl.int64) + i_blk * BLOCK
        m_p = o_p < NUM_PAIRS
        b_e = tl.load(topk_ids + o_p, mask=m_p, other=0)
        b_lt += (m_p & (b_e < i_e)).to(tl.int32)
        b_eq += (m_p & (b_e == i_e)).to(tl.int32)
    tl.store(counts + i_e, tl.sum(b_eq, axis=0))
    b_run = tl.sum(b_lt, axis=0)  # where expert e's pairs start in sorted order
    for i_blk in range(tl.cdiv(NUM_PAIRS, BLOCK)):
        o_p = tl.arange(0, BLOCK).to(tl.int64) + i_blk * BLOCK
        m_p = o_p < NUM_PAIRS
        b_e = tl.load(topk_ids + o_p, mask=m_p, other=0)
        b_hit = (m_p & (b_e == i_e)).to(tl.int32)
        b_rank = tl.cumsum(b_hit, axis=0) - 1
        p_out = sorted_pairs + (b_run + b_rank).to(tl.int64)
        tl.store(p_out, o_p.to(tl.int32), mask=b_hit > 0)
        b_run += tl.sum(b_hit, axis=0)


@triton.jit(do_not_specialize=["NUM_PAIRS", "NUM_PROGS"])
def _sort_kernel(topk_ids, counts, sorted_pairs, NUM_PAIRS, E, NUM_PROGS, PID0,
                 LOOP: tl.constexpr, BLOCK: tl.constexpr):
    if LOOP:
        for i_e in range(tl.program_id(0) + PID0, E, NUM_PROGS):
            _sort_expert(topk_ids, counts, sorted_pairs, NUM_PAIRS, i_e, BLOCK)
    else:  # one program per expert
        _sort_expert(topk_ids, counts, sorted_pairs, NUM_PAIRS, tl.program_id(0) + PID0, BLOCK)


@triton.jit
def _tile_rows(counts, i_tile, E, BE: tl.constexpr, BM: tl.constexpr):
    """(expert, first sorted row, end of the expert's rows) of tile i_tile; expert E = none."""
    o_e = tl.arange(0, BE)
    b_cnt = tl.load(counts + o_e, mask=o_e < E, other=0)
    b_tiles = (b_cnt + BM - 1) // BM
    b_tile_end = tl.cumsum(b_tiles, axis=0)
    i_e = tl.sum((b_tile_end <= i_tile).to(tl.int32), axis=0)
    m_sel = o_e == i_e
    tile_start = tl.sum(tl.where(m_sel, b_tile_end - b_tiles, 0), axis=0)
    row_start = tl.sum(tl.where(o_e < i_e, b_cnt, 0), axis=0)
    row_end = row_start + tl.sum(tl.where(m_sel, b_cnt, 0), axis=0)
    return i_e, row_start + (i_tile - tile_start) * BM, row_end


@triton.jit
def _gate_up_tile(x, w_gate_up, act, counts, sorted_pairs, H, I, E, K, stride_xt, stride_we,
                  stride_wn, NUM_TILES, i_item, BE: tl.constexpr, BM: tl.constexpr,
                  BN: tl.constexpr, BK: tl.constexpr, DOT_PRECISION: tl.constexpr):
    i_tile, i_n = i_item % NUM_TILES, i_item // NUM_TILES  # row tiles first, as CUDA ran
    i_e, row0, row_end = _tile_rows(counts, i_tile, E, BE, BM)
    # a tile past the routed pairs: no rows (row0 >= row_end) and no trips over H
    k_end = tl.where(i_e < E, H, 0)
    o_m = row0 + tl.arange(0, BM)
    m_m = o_m < row_end
    b_pair = tl.load(sorted_pairs + o_m.to(tl.int64), mask=m_m, other=0)
    o_tok = (b_pair // K).to(tl.int64)
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < I
    p_w = w_gate_up + i_e.to(tl.int64) * stride_we
    b_g = tl.zeros([BM, BN], dtype=tl.float32)
    b_u = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, k_end, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < H
        b_x = tl.load(
            x + o_tok[:, None] * stride_xt + o_k[None, :],
            mask=m_m[:, None] & m_k[None, :],
            other=0.0,
        )
        m_w = m_k[:, None] & m_n[None, :]
        b_wg = tl.load(
            p_w + o_n[None, :].to(tl.int64) * stride_wn + o_k[:, None], mask=m_w, other=0.0
        )
        b_wu = tl.load(
            p_w + (I + o_n[None, :]).to(tl.int64) * stride_wn + o_k[:, None], mask=m_w,
            other=0.0,
        )
        b_g = tl.dot(b_x, b_wg, b_g, input_precision=DOT_PRECISION)
        b_u = tl.dot(b_x, b_wu, b_u, input_precision=DOT_PRECISION)
    b_act = b_g * tl.sigmoid(b_g) * b_u
    p_act = act + o_m[:, None].to(tl.int64) * I + o_n[None, :]
    tl.store(p_act, b_act.to(act.dtype.element_ty), mask=m_m[:, None] & m_n[None, :])


@triton.jit(do_not_specialize=["NUM_TILES", "NUM_PROGS"])
def _gate_up_kernel(
    x,
    w_gate_up,
    act,
    counts,
    sorted_pairs,
    H,
    I,
    E,
    K,
    stride_xt,
    stride_we,
    stride_wn,
    NUM_TILES,
    NUM_PROGS,
    PID0,
    LOOP: tl.constexpr,
    BE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    if LOOP:
        for i_item in range(tl.program_id(0) + PID0, NUM_TILES * tl.cdiv(I, BN), NUM_PROGS):
            _gate_up_tile(x, w_gate_up, act, counts, sorted_pairs, H, I, E, K, stride_xt,
                          stride_we, stride_wn, NUM_TILES, i_item, BE, BM, BN, BK, DOT_PRECISION)
    else:  # one program per (row tile, N tile)
        _gate_up_tile(x, w_gate_up, act, counts, sorted_pairs, H, I, E, K, stride_xt, stride_we,
                      stride_wn, NUM_TILES, tl.program_id(0) + PID0, BE, BM, BN, BK,
                      DOT_PRECISION)


@triton.jit
def _down_tile(act, w_down, topk_weights, y, counts, sorted_pairs, H, I, E, stride_we,
               stride_wn, NUM_TILES, i_item, BE: tl.constexpr, BM: tl.constexpr,
               BN: tl.constexpr, BK: tl.constexpr, DOT_PRECISION: tl.constexpr):
    i_tile, i_n = i_item % NUM_TILES, i_item // NUM_TILES  # row tiles first, as CUDA ran
    i_e, row0, row_end = _tile_rows(counts, i_tile, E, BE, BM)
    k_end = tl.where(i_e < E, I, 0)  # a tile past the routed pairs: no rows, no trips
    o_m = row0 + tl.arange(0, BM)
    m_m = o_m < row_end
    b_pair = tl.load(sorted_pairs + o_m.to(tl.int64), mask=m_m, other=0).to(tl.int64)
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < H
    p_w = w_down + i_e.to(tl.int64) * stride_we
    b_y = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, k_end, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < I
        b_a = tl.load(
            act + o_m[:, None].to(tl.int64) * I + o_k[None, :],
            mask=m_m[:, None] & m_k[None, :],
            other=0.0,
        )
        b_w = tl.load(
            p_w + o_n[None, :].to(tl.int64) * stride_wn + o_k[:, None],
            mask=m_k[:, None] & m_n[None, :],
            other=0.0,
        )
        b_y = tl.dot(b_a, b_w, b_y, input_precision=DOT_PRECISION)
    b_wt = tl.load(topk_weights + b_pair, mask=m_m, other=0.0).to(tl.float32)
    b_y = b_y * b_wt[:, None]
    p_y = y + b_pair[:, None] * H + o_n[None, :]
    tl.store(p_y, b_y.to(y.dtype.element_ty), mask=m_m[:, None] & m_n[None, :])


@triton.jit(do_not_specialize=["NUM_TILES", "NUM_PROGS"])
def _down_kernel(
    act,
    w_down,
    topk_weights,
    y,
    counts,
    sorted_pairs,
    H,
    I,
    E,
    stride_we,
    stride_wn,
    NUM_TILES,
    NUM_PROGS,
    PID0,
    LOOP: tl.constexpr,
    BE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    if LOOP:
        for i_item in range(tl.program_id(0) + PID0, NUM_TILES * tl.cdiv(H, BN), NUM_PROGS):
            _down_tile(act, w_down, topk_weights, y, counts, sorted_pairs, H, I, E, stride_we,
                       stride_wn, NUM_TILES, i_item, BE, BM, BN, BK, DOT_PRECISION)
    else:  # one program per (row tile, N tile)
        _down_tile(act, w_down, topk_weights, y, counts, sorted_pairs, H, I, E, stride_we,
                   stride_wn, NUM_TILES, tl.program_id(0) + PID0, BE, BM, BN, BK, DOT_PRECISION)


@triton.jit
def _combine_item(y, out, T, H, K, i_item, BKK: tl.constexpr, BN: tl.constexpr):
    o_k = tl.arange(0, BKK)
    i_t, i_n = (i_item % T).to(tl.int64), i_item // T
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < H
    p_y = y + (i_t * K + o_k[:, None]) * H + o_n[None, :]
    b_y = tl.load(p_y, mask=(o_k < K)[:, None] & m_n[None, :], other=0.0).to(tl.float32)
    tl.store(out + i_t * H + o_n, tl.sum(b_y, axis=0).to(out.dtype.element_ty), mask=m_n)


@triton.jit(do_not_specialize=["T", "NUM_PROGS"])
def _combine_kernel(y, out, T, H, K, NUM_PROGS, PID0, LOOP: tl.constexpr, BKK: tl.constexpr,
                    BN: tl.constexpr):
    if LOOP:
        for i_item in range(tl.program_id(0) + PID0, T * tl.cdiv(H, BN), NUM_PROGS):
            _combine_item(y, out, T, H, K, i_item, BKK, BN)
    else:  # one program per (token, N tile)
        _combine_item(y, out, T, H, K, tl.program_id(0) + PID0, BKK, BN)


@triton.jit
def _gate_up_gemv_item(x, w_gate_up, act, topk_ids, H, I, K, stride_xt, stride_we, stride_wn,
                       NUM_PAIRS, i_item, BN: tl.constexpr, BK: tl.constexpr):
    i_p, i_n = (i_item % NUM_PAIRS).to(tl.int64), i_item // NUM_PAIRS
    i_t = i_p // K
    i_e = tl.load(topk_ids + i_p).to(tl.int64)
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < I
    p_w = w_gate_up + i_e * stride_we
    b_g = tl.zeros([BN], dtype=tl.float32)
    b_u = tl.zeros([BN], dtype=tl.float32)
    for k0 in range(0, H, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < H
        b_x = tl.load(x + i_t * stride_xt + o_k, mask=m_k, other=0.0).to(tl.float32)
        m_w = m_n[:, None] & m_k[None, :]
        b_wg = tl.load(
            p_w + o_n[:, None].to(tl.int64) * stride_wn + o_k[None, :], mask=m_w, other=0.0
        )
        b_wu = tl.load(
            p_w + (I + o_n[:, None]).to(tl.int64) * stride_wn + o_k[None, :], mask=m_w,
            other=0.0,
        )
        b_g += tl.sum(b_wg.to(tl.float32) * b_x[None, :], axis=1)
        b_u += tl.sum(b_wu.to(tl.float32) * b_x[None, :], axis=1)
    b_act = b_g * tl.sigmoid(b_g) * b_u
    tl.store(act + i_p * I + o_n, b_act.to(act.dtype.element_ty), mask=m_n)


@triton.jit(do_not_specialize=["NUM_PAIRS", "NUM_PROGS"])
def _gate_up_gemv_kernel(
    x,
    w_gate_up,
    act,
    topk_ids,
    H,
    I,
    K,
    stride_xt,
    stride_we,
    stride_wn,
    NUM_PAIRS,
    NUM_PROGS,
    PID0,
    LOOP: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    if LOOP:
        for i_item in range(tl.program_id(0) + PID0, NUM_PAIRS * tl.cdiv(I, BN), NUM_PROGS):
            _gate_up_gemv_item(x, w_gate_up, act, topk_ids, H, I, K, stride_xt, stride_we,
                               stride_wn, NUM_PAIRS, i_item, BN, BK)
    else:  # one program per (pair, N tile)
        _gate_up_gemv_item(x, w_gate_up, act, topk_ids, H, I, K, stride_xt, stride_we,
                           stride_wn, NUM_PAIRS, tl.program_id(0) + PID0, BN, BK)


@triton.jit
def _down_combine_item(act, w_down, topk_ids, topk_weights, out, T, H, I, K, stride_we,
                       stride_wn, i_item, BN: tl.constexpr, BK: tl.constexpr):
    i_t, i_n = (i_item % T).to(tl.int64), i_item // T
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < H
    b_out = tl.zeros([BN], dtype=tl.float32)
    for i_k in range(K):
        i_p = i_t * K + i_k
        i_e = tl.load(topk_ids + i_p).to(tl.int64)
        p_w = w_down + i_e * stride_we
        b_y = tl.zeros([BN], dtype=tl.float32)
        for k0 in range(0, I, BK):
            o_k = k0 + tl.arange(0, BK)
            m_k = o_k < I
            b_a = tl.load(act + i_p * I + o_k, mask=m_k, other=0.0).to(tl.float32)
            b_w = tl.load(
                p_w + o_n[:, None].to(tl.int64) * stride_wn + o_k[None, :],
                mask=m_n[:, None] & m_k[None, :],
                other=0.0,
            )
            b_y += tl.sum(b_w.to(tl.float32) * b_a[None, :], axis=1)
        b_out += tl.load(topk_weights + i_p).to(tl.float32) * b_y
    tl.store(out + i_t * H + o_n, b_out.to(out.dtype.element_ty), mask=m_n)


@triton.jit(do_not_specialize=["T", "NUM_PROGS"])
def _down_combine_kernel(
    act,
    w_down,
    topk_ids,
    topk_weights,
    out,
    T,
    H,
    I,
    K,
    stride_we,
    stride_wn,
    NUM_PROGS,
    PID0,
    LOOP: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    if LOOP:
        for i_item in range(tl.program_id(0) + PID0, T * tl.cdiv(H, BN), NUM_PROGS):
            _down_combine_item(act, w_down, topk_ids, topk_weights, out, T, H, I, K, stride_we,
                               stride_wn, i_item, BN, BK)
    else:  # one program per (token, N tile)
        _down_combine_item(act, w_down, topk_ids, topk_weights, out, T, H, I, K, stride_we,
                           stride_wn, tl.program_id(0) + PID0, BN, BK)


# Launch tuning; module-level so that a benchmark can sweep it. "interp" is the CPU interpreter.
DECODE_MAX_PAIRS = 64  # T * K at most this: the decode path (no sort)
CUDA_PREFILL = {"BN": 64, "BK": 64, "num_warps": 4, "num_stages": 3}
CUDA_DECODE = {"BN": 16, "BK": 128, "num_warps": 4}
INTERP_PREFILL = {"BN": 32, "BK": 32}
INTERP_DECODE = {"BN": 16, "BK": 32}
_TL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_empty = torch.empty  # every buffer the launcher allocates (tests poison them through this)


def _check(x, w_gate_up, w_down, topk_ids, topk_weights) -> None:
    if x.ndim != 2 or w_gate_up.ndim != 3 or w_down.ndim != 3:
        raise ValueError(
            "fused_moe expects x [T, H], w_gate_up [E, 2I, H], w_down [E, H, I]; got "
            f"{tuple(x.shape)}, {tuple(w_gate_up.shape)}, {tuple(w_down.shape)}"
        )
    T, H = x.shape
    E, two_i, _ = w_gate_up.shape
    if w_gate_up.shape[2] != H or two_i % 2 or w_down.shape != (E, H, two_i // 2):
        raise ValueError(
            f"fused_moe: x {tuple(x.shape)} does not fit w_gate_up {tuple(w_gate_up.shape)} and "
            f"w_down {tuple(w_down.shape)}"
        )
    if topk_ids.ndim != 2 or topk_ids.shape[0] != T or topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"fused_moe needs topk_ids and topk_weights of shape [T={T}, K]; got "
            f"{tuple(topk_ids.shape)}, {tuple(topk_weights.shape)}"
        )
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"fused_moe needs int32 or int64 topk_ids, got {topk_ids.dtype}")
    if x.dtype not in _TL_DTYPES or w_gate_up.dtype != x.dtype or w_down.dtype != x.dtype:
        raise ValueError(
            f"fused_moe needs x and weights of one float dtype; got {x.dtype}, "
            f"{w_gate_up.dtype}, {w_down.dtype}"
        )
    if x.stride(1) != 1 or w_gate_up.stride(2) != 1 or w_down.stride(2) != 1:
        raise ValueError("fused_moe needs x and the weights with a unit-stride last dim")
    if w_gate_up.stride(1) != H or w_down.stride(1) != two_i // 2:
        raise ValueError("fused_moe needs each expert's weight matrix contiguous")


def fused_moe(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """Routed SwiGLU experts, weighted and summed over each token's top-k choices.

    x: [T, H] (unit-stride rows); w_gate_up: [E, 2I, H] (gate rows, then up rows);
    w_down: [E, H, I]; both with contiguous expert matrices, x's dtype; topk_ids: [T, K] int32
    or int64 in [0, E); topk_weights: [T, K] float, any dtype.
    Returns [T, H] in x's dtype (float32 accumulation; activation rounded to x's dtype).
    """
    _check(x, w_gate_up, w_down, topk_ids, topk_weights)
    T, H = x.shape
    K = topk_ids.shape[1]
    out = _empty((T, H), dtype=x.dtype, device=x.device)
    if T == 0 or K == 0:
        return out.zero_()
    ids, weights = topk_ids.contiguous(), topk_weights.contiguous()
    if T * K <= DECODE_MAX_PAIRS:
        return _decode(x, w_gate_up, w_down, ids, weights, out)
    return _prefill(x, w_gate_up, w_down, ids, weights, out)


def _decode(x, w_gate_up, w_down, ids, weights, out) -> torch.Tensor:
    T, H = x.shape
    I, K = w_down.shape[2], ids.shape[1]
    is_cuda = x.device.type == "cuda"
    cfg = dict(CUDA_DECODE if is_cuda else INTERP_DECODE)
    BN, BK = cfg.pop("BN"), cfg.pop("BK")
    act = _empty((T * K, I), dtype=x.dtype, device=x.device)
    grid, loop = persistent_grid(T * K * triton.cdiv(I, BN), x.device)
    launch(
        _gate_up_gemv_kernel, (grid,),
        x,
        w_gate_up,
        act,
        ids,
        H,
        I,
        K,
        x.stride(0),
        w_gate_up.stride(0),
        w_gate_up.stride(1),
        T * K,
        grid,
        LOOP=loop,
        BN=BN,
        BK=BK,
        **cfg,
    )
    grid, loop = persistent_grid(T * triton.cdiv(H, BN), x.device)
    launch(
        _down_combine_kernel, (grid,),
        act,
        w_down,
        ids,
        weights,
        out,
        T,
        H,
        I,
        K,
        w_down.stride(0),
        w_down.stride(1),
        grid,
        LOOP=loop,
        BN=BN,
        BK=BK,
        **cfg,
    )
    return out


def _prefill_tiles(x: torch.Tensor, E: int, num_pairs: int) -> tuple[dict, int, int, int]:
    """(launch hints, BM, BN, BK) of the prefill path's expert kernels."""
    is_cuda = x.device.type == "cuda"
    cfg = dict(CUDA_PREFILL if is_cuda else INTERP_PREFILL)
    BN, BK = cfg.pop("BN"), cfg.pop("BK")
    if is_cuda and x.element_size() > 2:
        cfg["num_stages"] = 1  # float32 tiles: one stage fits in shared memory
    # rows per tile: about the mean number of pairs per expert, 16..64
    BM = min(64, max(16, triton.next_power_of_2(triton.cdiv(num_pairs, E))))
    return cfg, BM, BN, BK


def _prefill(x, w_gate_up, w_down, ids, weights, out) -> torch.Tensor:
    """The (token, choice) pairs sorted by expert, run through each expert's gate/up and down
    matrices in tiles of BM pairs, then each token's K results combined into out."""
    T, H = x.shape
    E, I, K = w_gate_up.shape[0], w_down.shape[2], ids.shape[1]
    num_pairs = T * K
    cfg, BM, BN, BK = _prefill_tiles(x, E, num_pairs)
    BE = max(2, triton.next_power_of_2(E))
    precision = dot_precision(x.device, x.dtype)
    dev = x.device
    counts = _empty(E, dtype=torch.int32, device=dev)
    sorted_pairs = _empty(num_pairs, dtype=torch.int32, device=dev)
    block = min(1024, max(16, triton.next_power_of_2(num_pairs)))
    grid, loop = persistent_grid(E, dev)
    launch(_sort_kernel, (grid,), ids, counts, sorted_pairs, num_pairs, E, grid, LOOP=loop,
           BLOCK=block)
    num_tiles = triton.cdiv(num_pairs, BM) + min(E, num_pairs)  # upper bound, see the docstring
    act = _empty((num_pairs, I), dtype=x.dtype, device=dev)
    grid, loop = persistent_grid(num_tiles * triton.cdiv(I, BN), dev, dots=True)
    launch(
        _gate_up_kernel, (grid,),
        x, w_gate_up, act, counts, sorted_pairs, H, I, E, K,
        x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), num_tiles, grid, LOOP=loop,
        BE=BE, BM=BM, BN=BN, BK=BK, DOT_PRECISION=precision, **cfg,
    )
    y = _empty((num_pairs, H), dtype=x.dtype, device=dev)
    grid, loop = persistent_grid(num_tiles * triton.cdiv(H, BN), dev, dots=True)
    launch(
        _down_kernel, (grid,),
        act, w_down, weights, y, counts, sorted_pairs, H, I, E,
        w_down.stride(0), w_down.stride(1), num_tiles, grid, LOOP=loop,
        BE=BE, BM=BM, BN=BN, BK=BK, DOT_PRECISION=precision, **cfg,
    )
    BN_C = min(1024, triton.next_power_of_2(H))
    BKK = max(2, triton.next_power_of_2(K))
    grid, loop = persistent_grid(T * triton.cdiv(H, BN_C), dev)
    launch(_combine_kernel, (grid,), y, out, T, H, K, grid, LOOP=loop, BKK=BKK, BN=BN_C)
    return out
