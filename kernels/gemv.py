"""Linear layers of one row (decode at batch 1), with the op before them fused in.

y = f(x) @ W^T where f is nothing (`linear`), the residual add and zero-centred RMSNorm
(`add_rmsnorm_linear`, which also returns the new residual) or SwiGLU (`silu_mul_linear`).
At these sizes a step reads each weight once and does little else, so what counts is how near
the weight bytes stream at memory bandwidth, and how many kernels a layer launches: a GEMM
library reaches about half the bandwidth on the 4-17 MB matrices of a ~1B model (it tiles for
many rows), and the norm and activation kernels in between cost a launch each.

Tiling: a program owns BN output columns (weight rows) and walks K in BK steps, multiplying
a [BN, BK] weight tile with the rows' inputs elementwise and summing along K in float32 (no
dot instruction: one row would waste it). The prologue is recomputed by every program
from the (tiny, cache-resident) input rows; the first program alone writes the new residual.
Rounding follows `kernels.reference` op by op (sum rounded to the input dtype, norm rounded,
SiLU rounded, product rounded), so the fused and unfused paths differ only in the order of
the float32 sums.

More rows than GEMV_MAX_ROWS (prefill, larger decode batches) run the unfused ops with the
library GEMM, which wins there.

Portability: plain pointers, masks, elementwise math and reductions only. Weight offsets are
int64; the input and output rows' are int32, safe for the one or few rows this serves.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.activation import silu_mul
from kernels.hw import gdc_enter, num_cores, pdl
from kernels.norms import add_rmsnorm

GEMV_MAX_ROWS = 1  # more rows: the library GEMM (2 rows ran up to 1.24x slower on an H100)
WHOLE_ROW = 2048  # input widths up to this run as one tile per program
_NONE, _ADD_RMSNORM, _SILU_MUL = 0, 1, 2


@triton.jit
def _input_tile(x, residual, norm_w, new_residual, o_m, m_m, o_k, m_k, i_n, K, stride_x,
                stride_r, eps, b_rstd, PROLOGUE: tl.constexpr, WHOLE):
    """The prologue's output for input columns o_k, in float32 ([MR, BK]), and the rows'
    rstd (computed here when the whole row is this one tile, WHOLE)."""
    dtype = new_residual.dtype.element_ty
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
    else:
        b_gate = tl.load(p_x, mask=m_x, other=0.0).to(tl.float32)
        b_up = tl.load(p_x + K, mask=m_x, other=0.0).to(tl.float32)
        b_act = (b_gate * tl.sigmoid(b_gate)).to(dtype).to(tl.float32)
        b_in = (b_act * b_up).to(dtype).to(tl.float32)
    return b_in, b_rstd


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
    M: tl.constexpr,
    MR: tl.constexpr,
    PROLOGUE: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    i_n = tl.program_id(0)
    o_n = i_n * BN + tl.arange(0, BN)
    o_m = tl.arange(0, MR)
    m_n = o_n < N
    m_m = o_m < M
    p_w = w + o_n[:, None].to(tl.int64) * stride_w
    # the first weight tile is loaded before waiting for the kernel before (weights are
    # constants): under programmatic dependent launch it streams while that kernel finishes
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    b_w = tl.load(p_w + o_k[None, :], mask=m_n[:, None] & m_k[None, :], other=0.0)
    gdc_enter(USE_GDC)
    dtype = out.dtype.element_ty
    b_rstd = tl.zeros([MR], dtype=tl.float32)
    if PROLOGUE == 1 and BK < K:
        # pass 1 over the input rows: the new residual (rounded, as it is stored) and its norm
        # (with one tile for the whole row, BK >= K, the main pass computes both)
        b_sq = tl.zeros([MR], dtype=tl.float32)
        for k0 in range(0, K, BK):
            o_kk = k0 + tl.arange(0, BK)
            m_x = m_m[:, None] & (o_kk < K)[None, :]
            b_x = tl.load(x + o_m[:, None] * stride_x + o_kk[None, :], mask=m_x, other=0.0)
            b_r = tl.load(residual + o_m[:, None] * stride_r + o_kk[None, :], mask=m_x, other=0.0)
            b_s = (b_x.to(tl.float32) + b_r.to(tl.float32)).to(dtype)
            if i_n == 0:
                tl.store(new_residual + o_m[:, None] * K + o_kk[None, :], b_s, mask=m_x)
            b_sf = b_s.to(tl.float32)
            b_sq += tl.sum(b_sf * b_sf, axis=1)
        b_rstd = tl.rsqrt(b_sq / K + eps)
    b_in, b_rstd = _input_tile(x, residual, norm_w, new_residual, o_m, m_m, o_k, m_k, i_n, K,
                               stride_x, stride_r, eps, b_rstd, PROLOGUE, BK >= K)
    b_acc = tl.sum(b_in[:, None, :] * b_w.to(tl.float32)[None, :, :], axis=2)
    for k0 in range(BK, K, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < K
        b_in, b_rstd = _input_tile(x, residual, norm_w, new_residual, o_m, m_m, o_k, m_k, i_n, K,
                                   stride_x, stride_r, eps, b_rstd, PROLOGUE, False)
        b_w = tl.load(p_w + o_k[None, :], mask=m_n[:, None] & m_k[None, :], other=0.0)
        b_acc += tl.sum(b_in[:, None, :] * b_w.to(tl.float32)[None, :, :], axis=2)
    p_out = out + o_m[:, None] * N + o_n[None, :]
    tl.store(p_out, b_acc.to(dtype), mask=m_m[:, None] & m_n[None, :])


def _fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the GEMV kernel serves these operands (else the unfused path runs)."""
    return (
        x.dim() == 2
        and 0 < x.shape[0] <= GEMV_MAX_ROWS
        and w.dtype == x.dtype
        and w.stride(1) == 1
        and x.stride(1) == 1
    )


def _launch(x, w, prologue: int, K: int, residual=None, norm_w=None, eps: float = 0.0):
    """y [M, N] (and the new residual [M, K] for the norm prologue) by the GEMV kernel."""
    M, N = x.shape[0], w.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    new_residual = out  # not written without the norm prologue
    if prologue == _ADD_RMSNORM:
        new_residual = torch.empty((M, K), dtype=x.dtype, device=x.device)
    # rows up to WHOLE_ROW wide are one tile (loads of input and weights all in flight at
    # once, no second pass for the norm); wider ones are walked in 512-wide tiles
    BK = triton.next_power_of_2(K) if K <= WHOLE_ROW else 512
    # one output column block per program; 4 columns where 8 would leave cores idle
    BN = 8 if triton.cdiv(N, 8) >= 2 * num_cores(x.device) else 4
    _gemv_kernel[(triton.cdiv(N, BN),)](
        x,
        x if residual is None else residual,
        w if norm_w is None else norm_w,
        new_residual,
        w,
        out,
        N,
        K,
        x.stride(0),
        0 if residual is None else residual.stride(0),
        w.stride(0),
        eps,
        M=M,
        MR=triton.next_power_of_2(M),
        PROLOGUE=prologue,
        BN=BN,
        BK=BK,
        num_warps=8 if BN * BK >= 8192 else 4,  # a whole-row tile: spread its registers
        num_stages=3,
        **pdl(x.device),
    )
    return out, new_residual


def _check_width(K: int, w: torch.Tensor) -> None:
    if w.dim() != 2 or w.shape[1] != K:
        raise ValueError(f"linear: input width {K} does not match the weight {tuple(w.shape)}")


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T -> [M, N] in x's dtype. w is read as a constant: on CUDA its first
    tile may be loaded while the kernel before still runs (see kernels.hw.pdl), so it must not
    be what that kernel writes (as with every one-row linear here)."""
    _check_width(x.shape[-1], w)
    if not _fits(x, w):
        return F.linear(x, w)
    return _launch(x, w, _NONE, x.shape[1])[0]


def add_rmsnorm_linear(
    x: torch.Tensor, residual: torch.Tensor, norm_w: torch.Tensor, eps: float, w: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual) @ w^T, x + residual): x, residual [M, K]; norm_w [K]; w [N, K]."""
    _check_width(x.shape[-1], w)
    plain = (residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(-1) == 1
             and norm_w.shape == (x.shape[-1],) and norm_w.stride(0) == 1)
    if not (plain and _fits(x, w)):  # the unfused ops (which reject bad operands)
        normed, total = add_rmsnorm(x, residual, norm_w, eps)
        return F.linear(normed, w), total
    return _launch(x, w, _ADD_RMSNORM, x.shape[1], residual, norm_w, eps)


def silu_mul_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :I]) * x[:, I:] @ w [N, I]^T -> [M, N]: SwiGLU then the down projection."""
    if x.shape[-1] % 2 or not _fits(x, w):  # the unfused ops (which reject bad operands)
        return F.linear(silu_mul(x), w)
    _check_width(x.shape[1] // 2, w)
    return _launch(x, w, _SILU_MUL, x.shape[1] // 2)[0]
