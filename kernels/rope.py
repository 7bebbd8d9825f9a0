"""Per-head RMSNorm followed by rotary embedding (the q and k paths of Qwen3.5's attention).

One program per block of (token, head) rows, the whole head in registers. For the rotated
channels each row also loads its partner channel (i + R/2 for the first half, i - R/2 for the
second), so the rotation needs no data movement between lanes. Rounding follows
`kernels.reference.rmsnorm_rope` step by step: the norm is rounded to x's dtype, each product
with cos and sin is rounded, then their sum. (On an H100 the bf16 results still differ from the
torch reference's by 1 ulp in many entries; the tests compare with a float64 oracle.)

Portability: plain pointers with int64 row offsets, masks; no device-specific intrinsics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.hw import gdc_enter, pdl


@triton.jit
def _rmsnorm_rope_kernel(
    x, weight, cos, sin, out, M, H, D, R, stride_t, stride_h, stride_c, eps,
    BM: tl.constexpr, BD: tl.constexpr, USE_GDC: tl.constexpr,
):
    gdc_enter(USE_GDC)
    i_m = tl.program_id(0)
    o_m = i_m * BM + tl.arange(0, BM)
    o_d = tl.arange(0, BD)
    m_m = o_m < M
    t = (o_m // H).to(tl.int64)
    base = t * stride_t + (o_m % H).to(tl.int64) * stride_h
    m_x = m_m[:, None] & (o_d < D)[None, :]
    b_x = tl.load(x + base[:, None] + o_d[None, :], mask=m_x, other=0.0).to(tl.float32)
    b_w = tl.load(weight + o_d, mask=o_d < D, other=0.0).to(tl.float32)
    b_rstd = tl.rsqrt(tl.sum(b_x * b_x, axis=1) / D + eps)
    b_n = (b_x * b_rstd[:, None] * (1.0 + b_w[None, :])).to(out.dtype.element_ty).to(tl.float32)
    # rotation: out_i = n_i cos_i + s_i n_p sin_i, p the partner channel, s = -1 in the first half
    half = R // 2
    is_rot = o_d < R
    o_p = tl.where(o_d < half, o_d + half, o_d - half)
    m_r = m_m[:, None] & is_rot[None, :]
    b_xp = tl.load(x + base[:, None] + o_p[None, :], mask=m_r, other=0.0).to(tl.float32)
    b_wp = tl.load(weight + o_p, mask=is_rot, other=0.0).to(tl.float32)
    b_np = (b_xp * b_rstd[:, None] * (1.0 + b_wp[None, :])).to(out.dtype.element_ty).to(tl.float32)
    b_np = tl.where((o_d < half)[None, :], -b_np, b_np)
    p_c = t[:, None] * stride_c + o_d[None, :]
    b_cos = tl.load(cos + p_c, mask=m_r, other=0.0).to(tl.float32)
    b_sin = tl.load(sin + p_c, mask=m_r, other=0.0).to(tl.float32)
    dt = out.dtype.element_ty
    b_rot = ((b_n * b_cos).to(dt).to(tl.float32) + (b_np * b_sin).to(dt).to(tl.float32)).to(dt)
    b_out = tl.where(is_rot[None, :], b_rot, b_n.to(dt))
    o_out = o_m[:, None].to(tl.int64) * D + o_d[None, :]
    tl.store(out + o_out, b_out, mask=m_x)


def rmsnorm_rope(
    x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float
) -> torch.Tensor:
    """Zero-centred RMSNorm of each head, then rotation of its first R channels.

    x: [T, H, D] (token and head strides free, unit stride over D); weight: [D];
    cos, sin: [T, R] in x's dtype, R even and <= D. Returns a contiguous [T, H, D] in x's dtype.
    """
    if x.dim() != 3 or x.stride(2) != 1:
        raise ValueError(f"rmsnorm_rope needs x [T, H, D] with unit stride over D, got {tuple(x.shape)}")
    T, H, D = x.shape
    R = cos.shape[-1]
    if weight.shape != (D,) or weight.stride(0) != 1:
        raise ValueError(f"rmsnorm_rope: weight must be a contiguous [{D}], got {tuple(weight.shape)}")
    if cos.shape != (T, R) or sin.shape != cos.shape or R % 2 or R > D or cos.stride(1) != 1:
        raise ValueError(f"rmsnorm_rope: cos and sin must be [{T}, R] (R even, <= {D}), got {tuple(cos.shape)}")
    if sin.stride() != cos.stride() or cos.dtype != x.dtype or sin.dtype != x.dtype:
        raise ValueError("rmsnorm_rope: cos and sin must share a layout and x's dtype")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"rmsnorm_rope: unsupported dtype {x.dtype} (float32, bfloat16, float16)")
    out = torch.empty(T, H, D, dtype=x.dtype, device=x.device)
    M, BD = T * H, triton.next_power_of_2(D)
    BM = max(1, min(16, 4096 // BD))
    if M:
        _rmsnorm_rope_kernel[(triton.cdiv(M, BM),)](
            x, weight, cos, sin, out, M, H, D, R, x.stride(0), x.stride(1), cos.stride(0), eps,
            BM=BM, BD=BD, **pdl(x.device),
        )
    return out
