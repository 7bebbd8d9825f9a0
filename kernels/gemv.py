"""Linear layers of one row (decode at batch 1), with the op before them fused in.

y = f(x) @ W^T where f is nothing (`linear`), the residual add and zero-centred RMSNorm
(`add_rmsnorm_linear`, which also returns the new residual), SwiGLU (`silu_mul_linear`) or
the GDN layer's gated RMSNorm of each head (`gated_rmsnorm_linear`). The lm_head of a decode
step (`add_rmsnorm_logits`) writes float32 logits and finds their argmax as it goes: each
program keeps the best column of its tiles (strictly larger replaces, so the first of equal
ones stays) and `_argmax_kernel` takes the largest of the programs' candidates, of equal ones
the first column. A NaN logit is not taken for the largest (torch.argmax picks the first NaN).
At these sizes a step reads each weight once and does little else, so what counts is how near
the weight bytes stream at memory bandwidth, and how many kernels a layer launches: a GEMM
library reaches about half the bandwidth on the 4-17 MB matrices of a ~1B model (it tiles for
many rows), and the norm and activation kernels in between cost a launch each.

Tiling: a fixed number of programs per core (persistent); program p owns the column tiles
p, p + P, p + 2P, ... of BN output columns (weight rows) each, and walks K in BK steps,
multiplying a [BN, BK] weight tile with the rows' inputs elementwise and summing along K in
float32 (no dot instruction: one row would waste it). Before it reduces a tile it issues the
loads of its next one, so every program keeps a tile in flight, and its first tile is loaded
before it waits for the kernel before (see kernels.hw.pdl). Rows up to WHOLE_ROW wide are one
tile along K, and the prologue runs once per program; wider rows recompute it for each
tile. The first program alone writes the new residual.
Rounding follows `kernels.reference` op by op (sum rounded to the input dtype, norm rounded,
SiLU rounded, product rounded), so the fused and unfused paths differ only in the order of
the float32 sums.

More rows than GEMV_MAX_ROWS (prefill, larger decode batches) run the unfused ops with the
library GEMM, which wins there.

Portability: plain pointers, masks, elementwise math, reductions (one returning indices: the
argmax), a reshape (the gated norm) and a CTA barrier (the conv) only. Weight offsets are
int64; the input and output rows' are int32, safe for the one or few rows this serves.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.activation import silu_mul
from kernels.conv1d import causal_conv1d_update_in_place, check_conv
from kernels.hw import cuda_hints, gdc_enter, launch, num_cores, pdl
from kernels.norms import (
    TL_DTYPES,
    add_rmsnorm,
    check_norm_inputs,
    gated_norm_rows,
    gated_rmsnorm,
)
from kernels.reference import DecodeConv

GEMV_MAX_ROWS = 1  # more rows: the library GEMM (2 rows ran up to 1.24x slower on an H100)
WHOLE_ROW = 4096  # input widths up to this run as one tile per program
WALK_BK = 1024  # the tile width along wider rows
# Launch: a fixed number of programs per core, each walking column tiles of about
# `tile_elems` weights (module-level so a benchmark can sweep it). On an H100 the decode
# chain of a ~1B model's 96 linears ran 0.526 ms with these against 0.72 with one tile per
# program (docs/kernels.md); other devices may want others.
CUDA_GEMV = {"tile_elems": 8192, "num_warps": 8, "programs_per_core": 4}
_NONE, _ADD_RMSNORM, _SILU_MUL, _GATED_NORM = 0, 1, 2, 3


@triton.jit
def _input_tile(x, residual, norm_w, new_residual, o_m, m_m, o_k, m_k, i_n, K, stride_x,
                stride_r, eps, b_rstd, PROLOGUE: tl.constexpr, WHOLE, HD: tl.constexpr,
                HEAD_ROWS: tl.constexpr, PROD_DTYPE: tl.constexpr):
    """The prologue's output for input columns o_k, in float32 ([MR, BK]), and the rows'
    rstd (computed here when the whole row is this one tile, WHOLE). `residual` is the gate
    of the gated norm (heads of HD columns; whole rows only)."""
    dtype = x.dtype.element_ty
    m_x = m_m[:, None] & m_k[None, :]
    p_x = x + o_m[:, None] * stride_x + o_k[None, :]
    if PROLOGUE == 0:
        b_in = tl.load(p_x, mask=m_x, other=0.0).to(tl.float32)
    elif PROLOGUE == 1:
        b_x = tl.load(p_x, mask=m_x, other=0.0)
        b_r = tl.load(residual + o_m[:, None] * stride_r + o_k[None, :], mask=m_x, other=0.0)
        b_sum = (b_x.to(tl.float32) + b_r.to(tl.float32)).to(dtype)
        b_s = b_sum.to(tl.float32)
        if WHOLE:
            if i_n == 0:
                tl.store(new_residual + o_m[:, None] * K + o_k[None, :], b_sum, mask=m_x)
            b_rstd = tl.rsqrt(tl.sum(b_s * b_s, axis=1) / K + eps)
        b_nw = tl.load(norm_w + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_in = (b_s * b_rstd[:, None] * (1.0 + b_nw[None, :])).to(dtype).to(tl.float32)
    elif PROLOGUE == 2:
        b_gate = tl.load(p_x, mask=m_x, other=0.0).to(tl.float32)
        b_up = tl.load(p_x + K, mask=m_x, other=0.0).to(tl.float32)
        b_act = (b_gate * tl.sigmoid(b_gate)).to(dtype).to(tl.float32)
        b_in = (b_act * b_up).to(dtype).to(tl.float32)
    else:  # the gated RMSNorm of each head (columns past K are zero: heads of zeros stay 0)
        b_x = tl.load(p_x, mask=m_x, other=0.0).to(tl.float32)
        b_g = tl.load(residual + o_m[:, None] * stride_r + o_k[None, :], mask=m_x, other=0.0)
        b_w = tl.load(norm_w + tl.arange(0, HD)).to(tl.float32)
        b_o = gated_norm_rows(tl.reshape(b_x, [HEAD_ROWS, HD]),  # [MR, BK] as rows of a head
                              tl.reshape(b_g.to(tl.float32), [HEAD_ROWS, HD]), b_w, eps, HD,
                              dtype, PROD_DTYPE)
        b_in = tl.reshape(b_o, b_x.shape).to(dtype).to(tl.float32)
    return b_in, b_rstd


@triton.jit
def _conv_window(o_n, conv_w, conv_pool, i_src, m_m, CONV_D, CONV_W: tl.constexpr,
                 WP: tl.constexpr):
    """The conv operands of a GDN layer's decode for output columns o_n < CONV_D (its
    channels): the window [MR, WP, BN] of the rows' source slots (rows past W-1 and slot 0
    read as zeros) and the taps [WP, BN] and last tap [BN] of the weight. Loaded before the
    tile's reduction, so that their latency hides behind it."""
    m_c = o_n < CONV_D
    o_r = tl.arange(0, WP)
    m_r = o_r < CONV_W - 1
    o_win = o_r[None, :, None] * CONV_D + o_n[None, None, :]
    m_win = (m_m & (i_src != 0))[:, None, None] & m_r[None, :, None] & m_c[None, None, :]
    b_win = tl.load(conv_pool + (i_src * (CONV_W - 1) * CONV_D)[:, None, None] + o_win,
                    mask=m_win, other=0.0)
    p_taps = conv_w + o_n.to(tl.int64)[None, :] * CONV_W + o_r[:, None]
    b_taps = tl.load(p_taps, mask=m_r[:, None] & m_c[None, :], other=0.0).to(tl.float32)
    b_last = tl.load(conv_w + o_n.to(tl.int64) * CONV_W + CONV_W - 1, mask=m_c, other=0.0)
    return b_win, b_taps, b_last.to(tl.float32)


@triton.jit
def _conv_epilogue(b_acc, b_win, b_taps, b_last, o_m, m_m, o_n, x, conv_pool, i_dst, CONV_D,
                   CONV_W: tl.constexpr, WP: tl.constexpr):
    """The decode conv of columns o_n < CONV_D (the rest pass through): the projection output
    as stored (rounded) is the window's new input; the shifted window goes to the rows'
    destination slots. Only this program touches these channels, and a barrier separates the
    window's reads from these writes, so src == dst (in place) is safe."""
    b_x = b_acc.to(x.dtype.element_ty).to(tl.float32)
    m_c = o_n < CONV_D
    b_conv = b_x * b_last[None, :] + tl.sum(b_win.to(tl.float32) * b_taps[None, :, :], axis=1)
    tl.debug_barrier()  # every window read before any write (in place)
    o_r = tl.arange(0, WP)
    m_rows = (o_r >= 1) & (o_r < CONV_W - 1)  # window rows that move down one
    m_shift = m_m[:, None, None] & m_rows[None, :, None] & m_c[None, None, :]
    o_win = o_r[None, :, None] * CONV_D + o_n[None, None, :]
    p_dst = conv_pool + (i_dst * (CONV_W - 1) * CONV_D)[:, None, None] + o_win
    tl.store(p_dst - CONV_D, b_win, mask=m_shift)  # row r of the window to row r - 1
    p_new = conv_pool + (i_dst * (CONV_W - 1) + CONV_W - 2)[:, None] * CONV_D + o_n[None, :]
    tl.store(p_new, b_x.to(conv_pool.dtype.element_ty), mask=m_m[:, None] & m_c[None, :])
    return tl.where(m_c[None, :], b_conv * tl.sigmoid(b_conv), b_acc)


@triton.jit
def _w_tile(w, i_t, k0, N, K, stride_w, BN: tl.constexpr, BK: tl.constexpr):
    """Weight rows i_t * BN ... of columns k0 ... as a [BN, BK] tile (zeros past N and K)."""
    o_n = i_t * BN + tl.arange(0, BN)
    o_k = k0 + tl.arange(0, BK)
    p_w = w + o_n[:, None].to(tl.int64) * stride_w + o_k[None, :]
    return tl.load(p_w, mask=(o_n < N)[:, None] & (o_k < K)[None, :], other=0.0)


@triton.jit
def _gemv_kernel(
    x,
    residual,
    norm_w,
    new_residual,
    w,
    out,
    N,
    K,
    stride_x,
    stride_r,
    stride_w,
    eps,
    NUM_PROGS,
    conv_w,
    conv_pool,
    src_slots,
    dst_slots,
    CONV_D,
    part_val,
    part_idx,
    PID0,
    M: tl.constexpr,
    MR: tl.constexpr,
    PROLOGUE: tl.constexpr,
    HD: tl.constexpr,
    HEAD_ROWS: tl.constexpr,
    PROD_DTYPE: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    WHOLE: tl.constexpr,
    CONV_W: tl.constexpr,
    WP: tl.constexpr,
    ARGMAX: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    pid = tl.program_id(0) + PID0
    num_tiles = tl.cdiv(N, BN)
    o_m = tl.arange(0, MR)
    m_m = o_m < M
    # the first weight tile is loaded before waiting for the kernel before (weights are
    # constants): under programmatic dependent launch it streams while that kernel finishes
    b_w = _w_tile(w, pid, 0, N, K, stride_w, BN, BK)
    gdc_enter(USE_GDC)
    b_rstd = tl.zeros([MR], dtype=tl.float32)
    if PROLOGUE == 1 and not WHOLE:
        # pass 1 over the input rows: the new residual (rounded, as it is stored) and its norm
        # (with one tile for the whole row the input tile below computes both)
        dtype = x.dtype.element_ty
        b_sq = tl.zeros([MR], dtype=tl.float32)
        for k0 in range(0, K, BK):
            o_kk = k0 + tl.arange(0, BK)
            m_x = m_m[:, None] & (o_kk < K)[None, :]
            b_x = tl.load(x + o_m[:, None] * stride_x + o_kk[None, :], mask=m_x, other=0.0)
            b_r = tl.load(residual + o_m[:, None] * stride_r + o_kk[None, :], mask=m_x, other=0.0)
            b_s = (b_x.to(tl.float32) + b_r.to(tl.float32)).to(dtype)
            if pid == 0:
                tl.store(new_residual + o_m[:, None] * K + o_kk[None, :], b_s, mask=m_x)
            b_sf = b_s.to(tl.float32)
            b_sq += tl.sum(b_sf * b_sf, axis=1)
        b_rstd = tl.rsqrt(b_sq / K + eps)
    o_k = tl.arange(0, BK)
    b_in = tl.zeros([MR, BK], dtype=tl.float32)
    if WHOLE:  # the prologue once: every column tile of this program uses the same input
        b_in, b_rstd = _input_tile(x, residual, norm_w, new_residual, o_m, m_m, o_k, o_k < K,
                                   pid, K, stride_x, stride_r, eps, b_rstd, PROLOGUE, True, HD,
                                   HEAD_ROWS, PROD_DTYPE)
    b_best = tl.zeros([MR], dtype=tl.float32) + float("-inf")  # ARGMAX: this program's best
    b_arg = tl.zeros([MR], dtype=tl.int32)
    if CONV_W > 0:
        i_src = tl.load(src_slots + o_m, mask=m_m, other=0).to(tl.int64)
        i_dst = tl.load(dst_slots + o_m, mask=m_m, other=0).to(tl.int64)
    # column tiles pid, pid + NUM_PROGS, ...; each step issues the next weight tile's loads
    # before it reduces the current one, so a program always has loads in flight
    for i_t in range(pid, num_tiles, NUM_PROGS):
        o_n = i_t * BN + tl.arange(0, BN)
        if CONV_W > 0:
            b_win, b_taps, b_last = _conv_window(o_n, conv_w, conv_pool, i_src, m_m, CONV_D,
                                                 CONV_W, WP)
        b_acc = tl.zeros([MR, BN], dtype=tl.float32)
        for k0 in range(0, K, BK):
            if not WHOLE:
                b_in, b_rstd = _input_tile(x, residual, norm_w, new_residual, o_m, m_m, k0 + o_k,
                                           k0 + o_k < K, pid, K, stride_x, stride_r, eps, b_rstd,
                                           PROLOGUE, False, HD, HEAD_ROWS, PROD_DTYPE)
            wrap = k0 + BK >= K
            b_next = _w_tile(w, tl.where(wrap, i_t + NUM_PROGS, i_t), tl.where(wrap, 0, k0 + BK),
                             N, K, stride_w, BN, BK)
            b_acc += tl.sum(b_in[:, None, :] * b_w.to(tl.float32)[None, :, :], axis=2)
            b_w = b_next
        if CONV_W > 0:  # noqa: SIM102 - a constexpr test, then a runtime one
            if i_t * BN < CONV_D:
                b_acc = _conv_epilogue(b_acc, b_win, b_taps, b_last, o_m, m_m, o_n, x, conv_pool,
                                       i_dst, CONV_D, CONV_W, WP)
        # rounded to the input dtype, as the reference's projection is (then to a float32 out)
        b_y = b_acc.to(x.dtype.element_ty).to(out.dtype.element_ty)
        m_y = m_m[:, None] & (o_n < N)[None, :]
        tl.store(out + o_m[:, None] * N + o_n[None, :], b_y, mask=m_y)
        if ARGMAX:  # the tiles come in increasing columns: keep the first of equal maxima
            b_v = tl.where(m_y, b_y.to(tl.float32), float("-inf"))
            b_tmax, b_targ = tl.max(b_v, axis=1, return_indices=True,
                                    return_indices_tie_break_left=True)
            is_better = b_tmax > b_best
            b_best = tl.where(is_better, b_tmax, b_best)
            b_arg = tl.where(is_better, i_t * BN + b_targ, b_arg)
    if ARGMAX:  # one candidate per program and row; _argmax_kernel picks the row's
        tl.store(part_val + o_m * NUM_PROGS + pid, b_best, mask=m_m)
        tl.store(part_idx + o_m * NUM_PROGS + pid, b_arg, mask=m_m)


@triton.jit
def _argmax_kernel(part_val, part_idx, out, NUM_PROGS, PID0, BP: tl.constexpr,
                   USE_GDC: tl.constexpr):
    """Row program_id(0)'s argmax from the GEMV programs' candidates: the largest value, and
    of equal ones the first column (as torch.argmax)."""
    gdc_enter(USE_GDC)
    i_m = tl.program_id(0) + PID0
    o_p = tl.arange(0, BP)
    m_p = o_p < NUM_PROGS
    b_v = tl.load(part_val + i_m * NUM_PROGS + o_p, mask=m_p, other=float("-inf"))
    b_i = tl.load(part_idx + i_m * NUM_PROGS + o_p, mask=m_p, other=0)
    b_top = tl.max(b_v, axis=0)
    b_first = tl.min(tl.where(m_p & (b_v == b_top), b_i, 2147483647), axis=0)
    tl.store(out + i_m, b_first.to(tl.int64))


def _fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the GEMV kernel serves these operands (else the unfused path runs)."""
    return (
        x.dim() == 2
        and 0 < x.shape[0] <= GEMV_MAX_ROWS
        and w.dtype == x.dtype
        and w.stride(1) == 1
        and x.stride(1) == 1
    )


def _tiles(K: int, N: int, device: torch.device) -> tuple[int, int, int]:
    """(BK, BN, programs) of a GEMV over rows K wide into N outputs."""
    # rows up to WHOLE_ROW wide are one tile (the prologue runs once per program); wider ones
    # are walked in WALK_BK-wide tiles (the prologue recomputed for each)
    BK = triton.next_power_of_2(K) if K <= WHOLE_ROW else WALK_BK
    BN = max(1, CUDA_GEMV["tile_elems"] // BK)
    num_tiles = triton.cdiv(N, BN)
    return BK, BN, min(num_tiles, CUDA_GEMV["programs_per_core"] * num_cores(device))


def _launch(x, w, prologue: int, K: int, residual=None, norm_w=None, eps: float = 0.0,
            head_dim: int = 1, conv=None, argmax: torch.Tensor | None = None):
    """y [M, N] (and the new residual [M, K] for the norm prologue) by the GEMV kernel; with
    `argmax` ([M] int64), y is float32 and its argmax per row is written there."""
    M, N = x.shape[0], w.shape[0]
    out_dtype = x.dtype if argmax is None else torch.float32
    out = torch.empty((M, N), dtype=out_dtype, device=x.device)
    new_residual = out  # not written without the norm prologue
    if prologue == _ADD_RMSNORM:
        new_residual = torch.empty((M, K), dtype=x.dtype, device=x.device)
    BK, BN, num_progs = _tiles(K, N, x.device)
    # the gated norm's product dtype (the weight times the normed x, as the reference rounds it)
    prod = torch.promote_types(norm_w.dtype, x.dtype) if prologue == _GATED_NORM else x.dtype
    part_val = part_idx = out  # never touched without argmax
    if argmax is not None:
        part_val = torch.empty((M, num_progs), dtype=torch.float32, device=x.device)
        part_idx = torch.empty((M, num_progs), dtype=torch.int32, device=x.device)
    launch(
        _gemv_kernel, (num_progs,),
        x, x if residual is None else residual, w if norm_w is None else norm_w, new_residual,
        w, out, N, K, x.stride(0), 0 if residual is None else residual.stride(0), w.stride(0),
        eps, num_progs,
        *(conv or (w, w, w, w)),  # never read without the conv
        0 if conv is None else conv[0].shape[0],
        part_val, part_idx,
        M=M, MR=triton.next_power_of_2(M), PROLOGUE=prologue, HD=head_dim,
        HEAD_ROWS=triton.next_power_of_2(M) * BK // head_dim, PROD_DTYPE=TL_DTYPES[prod],
        BN=BN, BK=BK, WHOLE=BK >= K,
        CONV_W=0 if conv is None else conv[0].shape[1],
        WP=1 if conv is None else triton.next_power_of_2(conv[0].shape[1] - 1),
        ARGMAX=argmax is not None,
        **cuda_hints(x.device, num_warps=CUDA_GEMV["num_warps"]),
        **pdl(x.device),
    )
    if argmax is not None:
        launch(_argmax_kernel, (M,), part_val, part_idx, argmax, num_progs,
               BP=triton.next_power_of_2(num_progs), **pdl(x.device))
    return out, new_residual


def _check_width(K: int, w: torch.Tensor) -> None:
    if w.dim() != 2 or w.shape[1] != K:
        raise ValueError(f"linear: input width {K} does not match the weight {tuple(w.shape)}")


def _check_conv(op: str, conv: DecodeConv, rows: int, N: int) -> None:
    """A GDN in-projection's conv operands, checked as causal_conv1d_update checks them."""
    if len(conv) != 4:
        raise ValueError(f"{op}: conv must be (weight, conv_pool, src_slots, dst_slots)")
    weight, pool, src, dst = conv
    if weight.dim() != 2 or not 0 < weight.shape[0] <= N:
        raise ValueError(
            f"{op}: conv weight {tuple(weight.shape)} must be [D, W], D <= {N} outputs"
        )
    # the projection's conv columns as the conv sees them: shape and layout only (no memory)
    check_conv(torch.empty((rows, weight.shape[0]), device="meta"), weight, pool, (src, dst))
    if src.shape != (rows,) or dst.shape != (rows,):
        raise ValueError(
            f"{op}: {rows} rows but {tuple(src.shape)} src / {tuple(dst.shape)} dst slots"
        )


def _conv_after(y: torch.Tensor, conv: DecodeConv | None) -> torch.Tensor:
    """The unfused path's conv: y[:, :D] replaced by its decode conv, in place."""
    if conv is not None:
        causal_conv1d_update_in_place(y[:, : conv[0].shape[0]], *conv)
    return y


def linear(x: torch.Tensor, w: torch.Tensor, conv: DecodeConv | None = None) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T -> [M, N] in x's dtype. w is read as a constant: on CUDA its first
    tile may be loaded while the kernel before still runs (see kernels.hw.pdl), so it must not
    be what that kernel writes (as with every one-row linear here).

    conv: None, or a GDN layer's decode conv (kernels.reference.DecodeConv): output columns
    :D then go through causal_conv1d_update (SiLU included, windows read at src and written at
    dst), as the layer's q/k/v projection needs."""
    _check_width(x.shape[-1], w)
    if conv is not None:
        _check_conv("linear", conv, x.shape[0], w.shape[0])
    if not _fits(x, w):
        return _conv_after(F.linear(x, w), conv)
    return _launch(x, w, _NONE, x.shape[1], conv=conv)[0]


def _plain_norm(x: torch.Tensor, residual: torch.Tensor, norm_w: torch.Tensor) -> bool:
    """Whether the norm prologue's operands are as the kernel reads them (else the unfused
    ops run, and reject bad ones)."""
    return (residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(-1) == 1
            and norm_w.shape == (x.shape[-1],) and norm_w.stride(0) == 1)


def add_rmsnorm_linear(
    x: torch.Tensor, residual: torch.Tensor, norm_w: torch.Tensor, eps: float, w: torch.Tensor,
    conv: DecodeConv | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual) @ w^T, x + residual): x, residual [M, K]; norm_w [K]; w [N, K];
    conv as for `linear`."""
    _check_width(x.shape[-1], w)
    if conv is not None:
        _check_conv("add_rmsnorm_linear", conv, x.shape[0], w.shape[0])
    if not (_plain_norm(x, residual, norm_w) and _fits(x, w)):  # the unfused ops
        normed, total = add_rmsnorm(x, residual, norm_w, eps)
        return _conv_after(F.linear(normed, w), conv), total
    return _launch(x, w, _ADD_RMSNORM, x.shape[1], residual, norm_w, eps, conv=conv)


def add_rmsnorm_logits(
    x: torch.Tensor, residual: torch.Tensor, norm_w: torch.Tensor, eps: float, w: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, argmax): the last residual add and norm, the lm_head, the logits as float32
    ([M, N], the projection rounded to x's dtype first) and their argmax ([M] int64, the first
    of equal maxima). x, residual: [M, K]; norm_w: [K]; w: [N, K]."""
    _check_width(x.shape[-1], w)
    if not (_plain_norm(x, residual, norm_w) and _fits(x, w)):  # the unfused ops
        logits = F.linear(add_rmsnorm(x, residual, norm_w, eps)[0], w).float()
        return logits, logits.argmax(dim=-1)
    greedy = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    logits, _ = _launch(x, w, _ADD_RMSNORM, x.shape[1], residual, norm_w, eps, argmax=greedy)
    return logits, greedy


def silu_mul_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :I]) * x[:, I:] @ w [N, I]^T -> [M, N]: SwiGLU then the down projection."""
    if x.shape[-1] % 2 or not _fits(x, w):  # the unfused ops (which reject bad operands)
        return F.linear(silu_mul(x), w)
    _check_width(x.shape[1] // 2, w)
    return _launch(x, w, _SILU_MUL, x.shape[1] // 2)[0]


def gated_rmsnorm_linear(
    x: torch.Tensor, gate: torch.Tensor, norm_w: torch.Tensor, eps: float, w: torch.Tensor
) -> torch.Tensor:
    """gated_rmsnorm(x, gate, norm_w, eps) as [T, H * D] @ w [N, H * D]^T -> [T, N]:
    x, gate [T, H, D] (token strides free; heads must be contiguous within a row for the
    kernel, else the unfused ops run); norm_w [D]."""
    if x.dim() != 3:
        raise ValueError(f"gated_rmsnorm_linear needs x [T, H, D], got {tuple(x.shape)}")
    T, H, D = x.shape
    _check_width(H * D, w)
    check_norm_inputs(x, norm_w, "gated_rmsnorm_linear", gate)
    rows = (x.stride(2) == 1 and x.stride(1) == D and gate.stride(2) == 1 and gate.stride(1) == D)
    x2 = x.reshape(T, H * D) if rows else x
    if not (rows and H * D <= WHOLE_ROW and D == triton.next_power_of_2(D) and _fits(x2, w)
            and gate.dtype == x.dtype):
        return linear(gated_rmsnorm(x, gate, norm_w, eps).reshape(T, H * D), w)
    return _launch(x2, w, _GATED_NORM, H * D, gate.reshape(T, H * D), norm_w, eps, head_dim=D)[0]
