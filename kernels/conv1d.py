"""Causal depthwise conv1d + SiLU over varlen batches, with conv windows kept in state slots.

Two ops with the contract of `kernels.reference`:
- `causal_conv1d`: prefill. One kernel computes the outputs in tiles of tokens x channels
  (each tile finds the sequences of its tokens by binary search over `cu_seqlens`), one
  program per tile on CUDA, else on a persistent grid (`kernels.hw.persistent_grid`: program
  p takes tiles p, p + P, ...); a
  second launch then writes the final window of each sequence to its destination slot and the
  windows at checkpoint boundaries to their slots. Two launches keep "read the source slot" strictly
  before "write the destination slot", so src == dst is safe.
- `causal_conv1d_update`: decode, one token per sequence. Each program reads its window and
  writes the shifted window channel by channel in increasing row order, so that every element
  is read before it is overwritten by the same thread: src == dst (in place) is safe.

conv_pool layout: [num_slots, W-1, D], oldest input first; slot 0 is the null slot (zeros).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.hw import (
    cuda_hints,
    gdc_enter,
    launch,
    num_cores,
    pdl,
    persistent_grid,
    persistent_programs,
)
from kernels.reference import Checkpoints

# Prefill tiles (tokens x channels per work item; 4 warps). Channel tiles are the fastest items,
# so programs that run together read the same rows. H100, bench_e2e's 6,144 channels inside an
# 8,224-wide projection (docs/bench.md, session 18): 8,192 tokens took 104 us in 32 x 128 tiles
# and 122 us in 16 x 128 (125 us in 32 x 256 tiles walking the tokens first, as before); 84
# tokens took 3.0 us in 16 x 128 and 3.8 us in 32 x 128. So the larger tile from PREFILL_MANY
# programs per core up.
PREFILL_BT, PREFILL_FEW_BT, PREFILL_BD, PREFILL_WARPS, PREFILL_MANY = 32, 16, 128, 4, 8


@triton.jit
def _window_value(x, stride_x, conv_pool, i_src, bos, t, o_d, m_d, D, W: tl.constexpr):
    """Input at packed position t of the sequence starting at bos; t < bos reads the src window.

    i_src is the source slot (0 = zeros); x rows are stride_x apart; returns float32 [..., BD]
    like o_d.
    """
    is_seq = t >= bos
    b_x = tl.load(x + t.to(tl.int64) * stride_x + o_d, mask=m_d & is_seq, other=0.0).to(tl.float32)
    # row of the saved window: W-1 inputs, oldest first, so input bos-1 is row W-2
    i_row = (W - 1) + (t - bos)
    p_init = conv_pool + (i_src.to(tl.int64) * (W - 1) + i_row) * D + o_d
    m_init = m_d & (t < bos) & (i_row >= 0) & (i_src != 0)
    b_init = tl.load(p_init, mask=m_init, other=0.0).to(tl.float32)
    return b_x + b_init


@triton.jit(do_not_specialize=["T", "N", "NUM_SEARCH_STEPS", "NUM_ITEMS", "NUM_PROGS"])
def _conv_fwd_kernel(
    x,
    weight,
    conv_pool,
    out,
    cu_seqlens,
    src_slots,
    stride_x,
    T,
    D,
    N,
    NUM_SEARCH_STEPS,
    NUM_ITEMS,
    NUM_PROGS,
    PID0,
    W: tl.constexpr,
    BT: tl.constexpr,
    BD: tl.constexpr,
    LOOP: tl.constexpr,
):
    # items are (token tile, channel tile), channel tiles fastest: programs that run together
    # read the same rows
    if LOOP:
        for i_p in range(tl.program_id(0) + PID0, NUM_ITEMS, NUM_PROGS):
            _conv_fwd_tile(x, weight, conv_pool, out, cu_seqlens, src_slots, stride_x, T, D, N,
                           NUM_SEARCH_STEPS, i_p, W, BT, BD)
    else:  # one program per tile
        _conv_fwd_tile(x, weight, conv_pool, out, cu_seqlens, src_slots, stride_x, T, D, N,
                       NUM_SEARCH_STEPS, tl.program_id(0) + PID0, W, BT, BD)


@triton.jit
def _conv_fwd_tile(x, weight, conv_pool, out, cu_seqlens, src_slots, stride_x, T, D, N,
                   NUM_SEARCH_STEPS, i_p, W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    """Outputs of tile i_p: tokens i_t * BT .. + BT, channels i_d * BD .. + BD."""
    i_d, i_t = i_p % tl.cdiv(D, BD), i_p // tl.cdiv(D, BD)
    o_t = i_t * BT + tl.arange(0, BT)
    o_d = i_d * BD + tl.arange(0, BD)
    m_t = o_t < T
    m_d = o_d < D
    # sequence of each token: the largest i < N with cu_seqlens[i] <= t
    i_lo = tl.zeros([BT], dtype=tl.int32)
    i_hi = tl.zeros([BT], dtype=tl.int32) + (N - 1)
    for _ in range(NUM_SEARCH_STEPS):
        i_mid = (i_lo + i_hi + 1) // 2
        b_start = tl.load(cu_seqlens + i_mid)
        is_right = b_start <= o_t
        i_lo = tl.where(is_right, i_mid, i_lo)
        i_hi = tl.where(is_right, i_hi, i_mid - 1)
    b_bos = tl.load(cu_seqlens + i_lo)
    b_src = tl.load(src_slots + i_lo)

    b_acc = tl.zeros([BT, BD], dtype=tl.float32)
    m_td = m_t[:, None] & m_d[None, :]
    # tiles whose windows all lie inside their sequences (all but a few) take plain loads
    b_inside = tl.min(tl.where(m_t, o_t - b_bos, W), axis=0) >= W - 1
    if b_inside:
        for i_w in tl.static_range(W):
            b_w = tl.load(weight + o_d.to(tl.int64) * W + i_w, mask=m_d, other=0.0).to(tl.float32)
            p_x = x + (o_t[:, None] - (W - 1 - i_w)).to(tl.int64) * stride_x + o_d[None, :]
            b_acc += tl.load(p_x, mask=m_td, other=0.0).to(tl.float32) * b_w[None, :]
    else:
        for i_w in tl.static_range(W):
            b_w = tl.load(weight + o_d.to(tl.int64) * W + i_w, mask=m_d, other=0.0).to(tl.float32)
            t = o_t[:, None] - (W - 1 - i_w)
            b_v = _window_value(
                x, stride_x, conv_pool, b_src[:, None], b_bos[:, None], t, o_d[None, :], m_td, D, W
            )
            b_acc += b_v * b_w[None, :]
    b_out = b_acc * tl.sigmoid(b_acc)
    p_out = out + o_t[:, None].to(tl.int64) * D + o_d[None, :]
    tl.store(p_out, b_out.to(out.dtype.element_ty), mask=m_t[:, None] & m_d[None, :])


@triton.jit(do_not_specialize=["N", "NUM_ITEMS", "NUM_PROGS"])
def _conv_save_kernel(
    x,
    conv_pool,
    cu_seqlens,
    src_slots,
    dst_slots,
    ckpt_seq,
    ckpt_boundary,
    ckpt_slot,
    stride_x,
    D,
    N,
    NUM_ITEMS,
    NUM_PROGS,
    PID0,
    W: tl.constexpr,
    BD: tl.constexpr,
):
    """Windows i < N: final window of sequence i; window N + c: that of checkpoint c. Work items
    are (window, channel tile), NUM_ITEMS of them, program p taking items p, p + P, ..."""
    num_d = tl.cdiv(D, BD)
    for i_q in range(tl.program_id(0) + PID0, NUM_ITEMS, NUM_PROGS):
        i_p, i_d = i_q // num_d, i_q % num_d
        o_d = i_d * BD + tl.arange(0, BD)
        m_d = o_d < D
        # a sequence's window or a checkpoint's, chosen by selects over loads at valid
        # indices (no branch: the checkpoint arrays hold at least one entry, see the launcher)
        is_seq = i_p < N
        i_c = tl.maximum(i_p - N, 0)
        i_n = tl.where(is_seq, i_p, tl.load(ckpt_seq + i_c))
        i_slot = tl.where(is_seq, tl.load(dst_slots + tl.minimum(i_p, N - 1)),
                          tl.load(ckpt_slot + i_c))
        bos = tl.load(cu_seqlens + i_n)
        b_end = tl.where(is_seq, tl.load(cu_seqlens + i_n + 1), bos + tl.load(ckpt_boundary + i_c))
        # vector forms: scalar booleans in masks trip the Triton interpreter
        i_src = tl.load(src_slots + i_n) + o_d * 0
        # Row r of the new window is input b_end-(W-1)+r. Rows go in increasing order and each
        # reads a row >= its own, so with src == dst no element is overwritten before it is read.
        for i_r in tl.static_range(W - 1):
            t = b_end - (W - 1) + i_r + o_d * 0
            b_v = _window_value(x, stride_x, conv_pool, i_src, bos, t, o_d, m_d, D, W)
            p_dst = conv_pool + (i_slot.to(tl.int64) * (W - 1) + i_r) * D + o_d
            tl.store(p_dst, b_v.to(conv_pool.dtype.element_ty), mask=m_d)


@triton.jit(do_not_specialize=["N", "NUM_PROGS"])
def _conv_update_kernel(
    x, weight, conv_pool, out, src_slots, dst_slots, stride_x, stride_out, N, D, NUM_PROGS,
    PID0, W: tl.constexpr, BD: tl.constexpr, USE_GDC: tl.constexpr,
):
    """Work items (sequence, channel tile), program p taking items p, p + P, ..."""
    gdc_enter(USE_GDC)
    num_d = tl.cdiv(D, BD)
    for i_p in range(tl.program_id(0) + PID0, N * num_d, NUM_PROGS):
        i_n, i_d = i_p // num_d, i_p % num_d
        o_d = i_d * BD + tl.arange(0, BD)
        m_d = o_d < D
        i_src = tl.load(src_slots + i_n)
        i_dst = tl.load(dst_slots + i_n)
        m_src = m_d & (o_d * 0 + i_src != 0)  # vector form: see _conv_save_kernel
        p_src = conv_pool + i_src.to(tl.int64) * (W - 1) * D + o_d
        p_dst = conv_pool + i_dst.to(tl.int64) * (W - 1) * D + o_d
        p_x = x + tl.cast(i_n, tl.int64) * stride_x + o_d
        b_x = tl.load(p_x, mask=m_d, other=0.0).to(tl.float32)
        b_wl = tl.load(weight + o_d.to(tl.int64) * W + (W - 1), mask=m_d, other=0.0)
        b_acc = b_x * b_wl.to(tl.float32)
        # Row r of the window is read before row r-1 of the destination is written (same thread).
        for i_r in tl.static_range(W - 1):
            b_v = tl.load(p_src + i_r * D, mask=m_src, other=0.0).to(tl.float32)
            b_w = tl.load(weight + o_d.to(tl.int64) * W + i_r, mask=m_d, other=0.0).to(tl.float32)
            b_acc += b_v * b_w
            if i_r > 0:
                tl.store(p_dst + (i_r - 1) * D, b_v.to(conv_pool.dtype.element_ty), mask=m_d)
        tl.store(p_dst + (W - 2) * D, b_x.to(conv_pool.dtype.element_ty), mask=m_d)
        b_out = b_acc * tl.sigmoid(b_acc)
        p_out = out + tl.cast(i_n, tl.int64) * stride_out + o_d
        tl.store(p_out, b_out.to(out.dtype.element_ty), mask=m_d)


def check_conv(
    x: torch.Tensor, weight: torch.Tensor, conv_pool: torch.Tensor, slots: tuple[torch.Tensor, ...]
) -> None:
    if x.ndim != 2 or weight.ndim != 2 or conv_pool.ndim != 3:
        raise ValueError(
            f"conv1d expects x [T, D], weight [D, W], conv_pool [num_slots, W-1, D]; got "
            f"{tuple(x.shape)}, {tuple(weight.shape)}, {tuple(conv_pool.shape)}"
        )
    D, W = weight.shape
    if W < 2 or x.shape[1] != D or conv_pool.shape[1:] != (W - 1, D):
        raise ValueError(
            f"conv1d shapes disagree: x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
            f"conv_pool {tuple(conv_pool.shape)} "
            "(want x [T, D], weight [D, W>=2], conv_pool [num_slots, W-1, D])"
        )
    if x.stride(1) != 1:
        raise ValueError("conv1d needs x with contiguous channels (stride 1 along D)")
    for name, t in (("weight", weight), ("conv_pool", conv_pool)):
        if not t.is_contiguous():
            raise ValueError(f"conv1d needs a contiguous {name}")
    for s in slots:
        if s.dtype != torch.int32 or not s.is_contiguous():
            raise ValueError(
                "conv1d needs contiguous int32 cu_seqlens, slots and checkpoint tensors"
            )


def _block_d(D: int) -> int:
    return min(triton.next_power_of_2(D), 256)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_pool: torch.Tensor,
    cu_seqlens: torch.Tensor,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    checkpoints: Checkpoints | None = None,
) -> torch.Tensor:
    """Varlen causal depthwise conv1d (no bias) followed by SiLU.

    x: [T, D]; weight: [D, W]; conv_pool: [num_slots, W-1, D], read at src_slots (slot 0 =
    zeros) and written at dst_slots and at the checkpoint slots (window of inputs n-W+1 .. n-1
    of the segment for boundary n); cu_seqlens: [N+1] int32; src_slots, dst_slots: [N] int32;
    checkpoints: C targets (seq, boundary, slot), each [C] int32.
    Returns [T, D] in x's dtype; math in float32. x may be row-strided (a view into a fused
    projection); its channels must be contiguous.
    """
    ckpt = (
        (checkpoints.seq, checkpoints.boundary, checkpoints.slot) if checkpoints is not None else ()
    )
    check_conv(x, weight, conv_pool, (cu_seqlens, src_slots, dst_slots, *ckpt))
    T, D = x.shape
    W = weight.shape[1]
    N = cu_seqlens.shape[0] - 1
    if src_slots.shape[0] != N or dst_slots.shape[0] != N:
        raise ValueError(
            f"conv1d: {N} sequences but {src_slots.shape[0]} src / {dst_slots.shape[0]} dst slots"
        )
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if T > 0:
        BD = min(PREFILL_BD, triton.next_power_of_2(D))
        many = triton.cdiv(T, PREFILL_BT) * triton.cdiv(D, BD) >= PREFILL_MANY * num_cores(x.device)
        BT = PREFILL_BT if many else PREFILL_FEW_BT
        steps = max(N - 1, 1).bit_length()
        items = triton.cdiv(D, BD) * triton.cdiv(T, BT)
        grid, loop = persistent_grid(items, x.device)
        launch(
            _conv_fwd_kernel, (grid,), x, weight, conv_pool, out, cu_seqlens, src_slots,
            x.stride(0), T, D, N, steps, items, grid, W=W, BT=BT, BD=BD, LOOP=loop,
            **cuda_hints(x.device, num_warps=PREFILL_WARPS),
        )
    BD = _block_d(D)
    num_ckpt = ckpt[0].shape[0] if ckpt else 0
    if not ckpt:
        ckpt = (dst_slots, dst_slots, dst_slots)  # loaded at 0, never used: no window past N
    items = (N + num_ckpt) * triton.cdiv(D, BD)
    grid = persistent_programs(items, x.device)
    launch(_conv_save_kernel, (grid,), x, conv_pool, cu_seqlens, src_slots, dst_slots, *ckpt,
           x.stride(0), D, N, items, grid, W=W, BD=BD)
    return out


def causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_pool: torch.Tensor,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
) -> torch.Tensor:
    """One decode step of causal_conv1d; src and dst may be the same slot (updated in place).

    x: [N, D]; weight: [D, W]; conv_pool: [num_slots, W-1, D]; src_slots, dst_slots: [N] int32.
    Returns [N, D] in x's dtype; x may be row-strided, as in causal_conv1d.
    """
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _update(x, weight, conv_pool, src_slots, dst_slots, out)
    return out


def causal_conv1d_update_in_place(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_pool: torch.Tensor,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
) -> None:
    """causal_conv1d_update with its output written over x (each element is read and then
    written by the same thread): for a projection's columns, e.g. a GDN in-projection's."""
    _update(x, weight, conv_pool, src_slots, dst_slots, x)


def _update(x, weight, conv_pool, src_slots, dst_slots, out) -> None:
    check_conv(x, weight, conv_pool, (src_slots, dst_slots))
    N, D = x.shape
    W = weight.shape[1]
    if src_slots.shape[0] != N or dst_slots.shape[0] != N:
        raise ValueError(
            f"conv1d_update: {N} tokens but {src_slots.shape[0]} src / "
            f"{dst_slots.shape[0]} dst slots"
        )
    BD = _block_d(D)
    if N > 0:
        grid = persistent_programs(N * triton.cdiv(D, BD), x.device)
        launch(
            _conv_update_kernel, (grid,), x, weight, conv_pool, out, src_slots, dst_slots,
            x.stride(0), out.stride(0), N, D, grid, W=W, BD=BD, **pdl(x.device),
        )
