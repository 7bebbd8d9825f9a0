"""RMSNorms of Qwen3.5: zero-centred `rmsnorm`, `add_rmsnorm` (the residual add fused in
front of it) and the GDN output's `gated_rmsnorm`.

All normalise the last dim of a row-major [..., D] tensor in blocks of BM rows, the whole row
in registers. Grids are persistent (kernels.hw.persistent_programs): program p takes the row
blocks p, p + P, p + 2P, ... (a block's math does not depend on the program that runs it).
Rounding follows `kernels.reference` step by step, so a bf16 model gets the same numbers on
every backend:
- rmsnorm: x * rsqrt(mean(x^2) + eps) * (1 + weight), all in float32, rounded once at the end.
- add_rmsnorm: the sum x + residual is rounded to x's dtype (it is the next residual), then
  normed as above.
- gated_rmsnorm: the normed x is rounded to x's dtype, multiplied by weight in the promoted
  dtype of (weight, x) (torch's rule), then times SiLU(gate) in float32, rounded to x's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.hw import gdc_enter, launch, pdl, persistent_programs


@triton.jit
def _row_block(weight, i_m, M, D, BM: tl.constexpr, BD: tl.constexpr):
    """Row block i_m of an [M, D] tensor: its rows [BM] and columns [BD], its mask [BM, BD],
    its offsets in a contiguous output, and the weight [BD] in float32. (The weight is loaded
    here, in the loop beside the rows' loads: hoisted before the loop, its wait came first.)"""
    o_d = tl.arange(0, BD)
    b_w = tl.load(weight + o_d, mask=o_d < D, other=0.0).to(tl.float32)
    o_m = i_m * BM + tl.arange(0, BM)
    m_x = (o_m < M)[:, None] & (o_d < D)[None, :]
    o_x = o_m[:, None].to(tl.int64) * D + o_d[None, :]
    return o_m, o_d, m_x, o_x, b_w


@triton.jit(do_not_specialize=["M", "NUM_PROGS"])
def _rmsnorm_kernel(x, weight, out, M, D, stride_x, eps, NUM_PROGS, PID0, BM: tl.constexpr,
                    BD: tl.constexpr):
    for i_m in range(tl.program_id(0) + PID0, tl.cdiv(M, BM), NUM_PROGS):
        o_m, o_d, m_x, o_x, b_w = _row_block(weight, i_m, M, D, BM, BD)
        p_x = x + o_m[:, None].to(tl.int64) * stride_x + o_d[None, :]
        b_x = tl.load(p_x, mask=m_x, other=0.0).to(tl.float32)
        b_rstd = tl.rsqrt(tl.sum(b_x * b_x, axis=1) / D + eps)
        b_out = b_x * b_rstd[:, None] * (1.0 + b_w[None, :])
        tl.store(out + o_x, b_out.to(out.dtype.element_ty), mask=m_x)


@triton.jit(do_not_specialize=["M", "NUM_PROGS"])
def _add_rmsnorm_kernel(
    x, residual, weight, out, new_residual, M, D, stride_x, stride_r, eps, NUM_PROGS,
    PID0, BM: tl.constexpr, BD: tl.constexpr,
):
    for i_m in range(tl.program_id(0) + PID0, tl.cdiv(M, BM), NUM_PROGS):
        o_m, o_d, m_x, o_x, b_w = _row_block(weight, i_m, M, D, BM, BD)
        p_x = x + o_m[:, None].to(tl.int64) * stride_x + o_d[None, :]
        b_x = tl.load(p_x, mask=m_x, other=0.0)
        p_r = residual + o_m[:, None].to(tl.int64) * stride_r + o_d[None, :]
        b_r = tl.load(p_r, mask=m_x, other=0.0)
        b_s = (b_x.to(tl.float32) + b_r.to(tl.float32)).to(new_residual.dtype.element_ty)
        tl.store(new_residual + o_x, b_s, mask=m_x)
        b_sf = b_s.to(tl.float32)
        b_rstd = tl.rsqrt(tl.sum(b_sf * b_sf, axis=1) / D + eps)
        b_out = b_sf * b_rstd[:, None] * (1.0 + b_w[None, :])
        tl.store(out + o_x, b_out.to(out.dtype.element_ty), mask=m_x)


@triton.jit(do_not_specialize=["M", "NUM_PROGS"])
def _gated_rmsnorm_kernel(
    x,
    gate,
    weight,
    out,
    M,
    D,
    stride_x,
    G_HEADS,
    stride_gt,
    stride_gh,
    eps,
    NUM_PROGS,
    PID0,
    PROD_DTYPE: tl.constexpr,
    BM: tl.constexpr,
    BD: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    gdc_enter(USE_GDC)
    for i_m in range(tl.program_id(0) + PID0, tl.cdiv(M, BM), NUM_PROGS):
        o_m, o_d, m_x, o_x, b_w = _row_block(weight, i_m, M, D, BM, BD)
        p_x = x + o_m[:, None].to(tl.int64) * stride_x + o_d[None, :]
        b_x = tl.load(p_x, mask=m_x, other=0.0).to(tl.float32)
        # gate row m is head m % G_HEADS of token m // G_HEADS (a slice of a wider projection)
        o_g = (o_m // G_HEADS).to(tl.int64) * stride_gt + (o_m % G_HEADS).to(tl.int64) * stride_gh
        b_g = tl.load(gate + o_g[:, None] + o_d[None, :], mask=m_x, other=0.0).to(tl.float32)
        b_out = gated_norm_rows(b_x, b_g, b_w, eps, D, out.dtype.element_ty, PROD_DTYPE)
        tl.store(out + o_x, b_out.to(out.dtype.element_ty), mask=m_x)


@triton.jit
def gated_norm_rows(b_x, b_g, b_w, eps, D, OUT_DTYPE: tl.constexpr, PROD_DTYPE: tl.constexpr):
    """The gated RMSNorm of a tile of whole rows (float32 x and gate, [BM, BD], zero past D;
    weight [BD]), in float32, following the module docstring's rounding (the GDN output
    kernel fuses it too)."""
    b_rstd = tl.rsqrt(tl.sum(b_x * b_x, axis=1) / D + eps)
    b_normed = (b_x * b_rstd[:, None]).to(OUT_DTYPE).to(tl.float32)
    b_prod = (b_w[None, :] * b_normed).to(PROD_DTYPE).to(tl.float32)
    return b_prod * (b_g * tl.sigmoid(b_g))


TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def check_norm_inputs(
    x: torch.Tensor, weight: torch.Tensor, name: str, gate: torch.Tensor | None = None
) -> None:
    D = x.shape[-1]
    if weight.shape != (D,):
        raise ValueError(f"{name}: weight {tuple(weight.shape)} does not match x's last dim {D}")
    if gate is not None and gate.shape != x.shape:
        raise ValueError(f"{name}: gate/residual {tuple(gate.shape)} must have "
                         f"x's shape {tuple(x.shape)}")
    for t in (x, weight) if gate is None else (x, weight, gate):
        if t.dtype not in TL_DTYPES:
            raise ValueError(f"{name}: unsupported dtype {t.dtype} (float32, bfloat16, float16)")
    if weight.stride(0) != 1:
        raise ValueError(f"{name} needs a contiguous weight")


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., D] as [M, D] with unit stride along D (a view where possible, as reshape gives)."""
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 or rows.shape[-1] <= 1 else rows.contiguous()


def _blocks(D: int) -> tuple[int, int]:
    BD = triton.next_power_of_2(D)
    return max(1, min(16, 4096 // BD)), BD


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm: norm(x) * (1 + weight), computed in float32.

    x: [..., D] (rows may be strided, D must be unit-stride or is copied); weight: [D].
    Returns a contiguous tensor of x's shape and dtype.
    """
    check_norm_inputs(x, weight, "rmsnorm")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    x2 = _rows(x)
    (M, D), (BM, BD) = x2.shape, _blocks(x.shape[-1])
    if M and D:
        grid = persistent_programs(triton.cdiv(M, BM), x.device)
        launch(_rmsnorm_kernel, (grid,), x2, weight, out, M, D, x2.stride(0), eps, grid,
               BM=BM, BD=BD)
    return out


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual), x + residual): a pre-norm block's residual add and the next
    norm in one pass.

    x, residual: [..., D] of one dtype (rows may be strided); weight: [D].
    Returns two contiguous tensors of x's shape and dtype.
    """
    check_norm_inputs(x, weight, "add_rmsnorm", residual)
    if residual.dtype != x.dtype:
        raise ValueError(f"add_rmsnorm: residual dtype {residual.dtype} differs from x's {x.dtype}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    new_residual = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    x2, r2 = _rows(x), _rows(residual)
    (M, D), (BM, BD) = x2.shape, _blocks(x.shape[-1])
    if M and D:
        grid = persistent_programs(triton.cdiv(M, BM), x.device)
        launch(
            _add_rmsnorm_kernel, (grid,),
            x2, r2, weight, out, new_residual, M, D, x2.stride(0), r2.stride(0), eps, grid,
            BM=BM, BD=BD,
        )
    return out, new_residual


def gated_rmsnorm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """RMSNorm of x over its last dim, times weight, times SiLU(gate) (transformers' order).

    x, gate: [..., D] (rows may be strided; a [T, H, D] gate with any token and head strides
    is read in place); weight: [D].
    Returns a contiguous tensor of x's shape and dtype.
    """
    check_norm_inputs(x, weight, "gated_rmsnorm", gate)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    x2 = _rows(x)
    if gate.dim() == 3 and gate.stride(2) == 1:  # [T, H, D] as strided: no copy for its rows
        g2, heads, stride_gt, stride_gh = gate, gate.shape[1], gate.stride(0), gate.stride(1)
    else:
        g2 = _rows(gate)
        heads, stride_gt, stride_gh = 1, g2.stride(0), 0
    (M, D), (BM, BD) = x2.shape, _blocks(x.shape[-1])
    prod_dtype = TL_DTYPES[torch.promote_types(weight.dtype, x.dtype)]
    if M and D:
        grid = persistent_programs(triton.cdiv(M, BM), x.device)
        launch(
            _gated_rmsnorm_kernel, (grid,),
            x2,
            g2,
            weight,
            out,
            M,
            D,
            x2.stride(0),
            heads,
            stride_gt,
            stride_gh,
            eps,
            grid,
            PROD_DTYPE=prod_dtype,
            BM=BM,
            BD=BD,
            **pdl(x.device),
        )
    return out
