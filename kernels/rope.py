"""Per-head RMSNorm followed by rotary embedding (the q and k paths of Qwen3.5's attention).

- `rmsnorm_rope`: normalize and rotate the heads of one tensor.
- `qk_norm_rope_store`: the attention layer's whole step before attention in one launch: q and
  k normalized and rotated, k and v written to the paged KV cache (what `rmsnorm_rope` twice
  and `kernels.slots.store_kv` do, bit for bit, in three launches).

Kernels walk blocks of (token, head) rows, the whole head in registers, on a persistent grid
(kernels.hw.persistent_programs: program p takes blocks p, p + P, ...). For the rotated
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

from kernels.hw import gdc_enter, launch, pdl, persistent_programs
from kernels.slots import check_store_kv


@triton.jit
def _norm_rope_rows(
    x, weight, cos, sin, o_m, m_m, H, D, R, stride_t, stride_h, stride_c, eps, BD: tl.constexpr
):
    """Rows o_m [BM] (token * H + head, m_m masks the tail) of x [T, H, D], normalized and
    rotated: [BM, BD] in x's dtype."""
    dt = x.dtype.element_ty
    o_d = tl.arange(0, BD)
    t = (o_m // H).to(tl.int64)
    base = t * stride_t + (o_m % H).to(tl.int64) * stride_h
    m_x = m_m[:, None] & (o_d < D)[None, :]
    b_x = tl.load(x + base[:, None] + o_d[None, :], mask=m_x, other=0.0).to(tl.float32)
    b_w = tl.load(weight + o_d, mask=o_d < D, other=0.0).to(tl.float32)
    b_rstd = tl.rsqrt(tl.sum(b_x * b_x, axis=1) / D + eps)
    b_n = (b_x * b_rstd[:, None] * (1.0 + b_w[None, :])).to(dt).to(tl.float32)
    # rotation: out_i = n_i cos_i + s_i n_p sin_i, p the partner channel, s = -1 in the first half
    half = R // 2
    is_rot = o_d < R
    o_p = tl.where(o_d < half, o_d + half, o_d - half)
    m_r = m_m[:, None] & is_rot[None, :]
    b_xp = tl.load(x + base[:, None] + o_p[None, :], mask=m_r, other=0.0).to(tl.float32)
    b_wp = tl.load(weight + o_p, mask=is_rot, other=0.0).to(tl.float32)
    b_np = (b_xp * b_rstd[:, None] * (1.0 + b_wp[None, :])).to(dt).to(tl.float32)
    b_np = tl.where((o_d < half)[None, :], -b_np, b_np)
    p_c = t[:, None] * stride_c + o_d[None, :]
    b_cos = tl.load(cos + p_c, mask=m_r, other=0.0).to(tl.float32)
    b_sin = tl.load(sin + p_c, mask=m_r, other=0.0).to(tl.float32)
    b_rot = ((b_n * b_cos).to(dt).to(tl.float32) + (b_np * b_sin).to(dt).to(tl.float32)).to(dt)
    return tl.where(is_rot[None, :], b_rot, b_n.to(dt))


@triton.jit(do_not_specialize=["M", "NUM_PROGS"])
def _rmsnorm_rope_kernel(
    x, weight, cos, sin, out, M, H, D, R, stride_t, stride_h, stride_c, eps, NUM_PROGS,
    PID0, BM: tl.constexpr, BD: tl.constexpr, USE_GDC: tl.constexpr,
):
    gdc_enter(USE_GDC)
    o_d = tl.arange(0, BD)
    for i_m in range(tl.program_id(0) + PID0, tl.cdiv(M, BM), NUM_PROGS):
        o_m = i_m * BM + tl.arange(0, BM)
        m_m = o_m < M
        b_out = _norm_rope_rows(
            x, weight, cos, sin, o_m, m_m, H, D, R, stride_t, stride_h, stride_c, eps, BD
        )
        o_out = o_m[:, None].to(tl.int64) * D + o_d[None, :]
        tl.store(out + o_out, b_out, mask=m_m[:, None] & (o_d < D)[None, :])


@triton.jit(do_not_specialize=["M_q", "M_k", "NUM_PROGS"])
def _qk_norm_rope_store_kernel(
    q, k, v, q_weight, k_weight, cos, sin, q_out, k_cache, v_cache, slot_mapping,
    M_q, M_k, Hq, Hkv, D, R, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_c, eps, NUM_PROGS, PID0, BM: tl.constexpr, BD: tl.constexpr, USE_GDC: tl.constexpr,
):
    # blocks [0, cdiv(M_q, BM)) are q rows, the rest k rows (and the v rows beside them)
    gdc_enter(USE_GDC)
    num_q_blocks = tl.cdiv(M_q, BM)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    for i_m in range(tl.program_id(0) + PID0, num_q_blocks + tl.cdiv(M_k, BM), NUM_PROGS):
        if i_m < num_q_blocks:
            o_m = i_m * BM + tl.arange(0, BM)
            m_m = o_m < M_q
            b_q = _norm_rope_rows(
                q, q_weight, cos, sin, o_m, m_m, Hq, D, R, stride_qt, stride_qh, stride_c, eps,
                BD,
            )
            o_out = o_m[:, None].to(tl.int64) * D + o_d[None, :]
            tl.store(q_out + o_out, b_q, mask=m_m[:, None] & m_d[None, :])
        else:
            o_m = (i_m - num_q_blocks) * BM + tl.arange(0, BM)
            m_m = o_m < M_k
            b_k = _norm_rope_rows(
                k, k_weight, cos, sin, o_m, m_m, Hkv, D, R, stride_kt, stride_kh, stride_c, eps,
                BD,
            )
            t = (o_m // Hkv).to(tl.int64)
            i_h = (o_m % Hkv).to(tl.int64)
            i_slot = tl.load(slot_mapping + t, mask=m_m, other=-1)
            m_w = (m_m & (i_slot >= 0))[:, None] & m_d[None, :]
            p_v = v + (t * stride_vt + i_h * stride_vh)[:, None] + o_d[None, :]
            b_v = tl.load(p_v, mask=m_w)
            o_c = ((i_slot * Hkv + i_h) * D)[:, None] + o_d[None, :]
            tl.store(k_cache + o_c, b_k.to(k_cache.dtype.element_ty), mask=m_w)
            tl.store(v_cache + o_c, b_v.to(v_cache.dtype.element_ty), mask=m_w)


def _block_rows(D: int) -> tuple[int, int]:
    """(rows per program, channels padded to a power of two) for heads of D channels."""
    BD = triton.next_power_of_2(D)
    return max(1, min(16, 4096 // BD)), BD


def check_rmsnorm_rope(
    op: str, x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    """Raise a one-line ValueError, naming `op`, unless the inputs fit `rmsnorm_rope`."""
    if x.dim() != 3 or x.stride(2) != 1:
        raise ValueError(
            f"{op} needs x [T, H, D] with unit stride over D, got {tuple(x.shape)}"
        )
    T, _, D = x.shape
    R = cos.shape[-1]
    if weight.shape != (D,) or weight.stride(0) != 1:
        raise ValueError(f"{op}: weight must be a contiguous [{D}], got {tuple(weight.shape)}")
    if cos.shape != (T, R) or sin.shape != cos.shape or R % 2 or R > D or cos.stride(1) != 1:
        raise ValueError(
            f"{op}: cos and sin must be [{T}, R] (R even, <= {D}), got {tuple(cos.shape)}"
        )
    if sin.stride() != cos.stride() or cos.dtype != x.dtype or sin.dtype != x.dtype:
        raise ValueError(f"{op}: cos and sin must share a layout and x's dtype")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{op}: unsupported dtype {x.dtype} (float32, bfloat16, float16)")


def rmsnorm_rope(
    x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float
) -> torch.Tensor:
    """Zero-centred RMSNorm of each head, then rotation of its first R channels.

    x: [T, H, D] (token and head strides free, unit stride over D); weight: [D];
    cos, sin: [T, R] in x's dtype, R even and <= D. Returns a contiguous [T, H, D] in x's dtype.
    """
    check_rmsnorm_rope("rmsnorm_rope", x, weight, cos, sin)
    T, H, D = x.shape
    out = torch.empty(T, H, D, dtype=x.dtype, device=x.device)
    M = T * H
    BM, BD = _block_rows(D)
    if M:
        grid = persistent_programs(triton.cdiv(M, BM), x.device)
        launch(
            _rmsnorm_rope_kernel, (grid,),
            x, weight, cos, sin, out, M, H, D, cos.shape[1], x.stride(0), x.stride(1),
            cos.stride(0), eps, grid, BM=BM, BD=BD, **pdl(x.device),
        )
    return out


def qk_norm_rope_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """`rmsnorm_rope` of q and of k, and `store_kv` of the rotated k and of v, in one launch.

    q: [T, Hq, D]; k, v: [T, Hkv, D] (token and head strides free, unit stride over D);
    q_weight, k_weight: [D]; cos, sin: [T, R] in q's dtype, R even and <= D; k_cache, v_cache:
    [num_blocks, block_size, Hkv, D] contiguous; slot_mapping: [T] int64 (-1 = skip).
    Returns the rotated q, a contiguous [T, Hq, D] in q's dtype.
    """
    op = "qk_norm_rope_store"
    check_rmsnorm_rope(op, q, q_weight, cos, sin)
    check_rmsnorm_rope(op, k, k_weight, cos, sin)
    check_store_kv(op, k, v, k_cache, v_cache, slot_mapping)
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"{op}: q and k heads must have one size, got {q.shape[2]}, {k.shape[2]}")
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    q_out = torch.empty(T, Hq, D, dtype=q.dtype, device=q.device)
    M_q, M_k = T * Hq, T * Hkv
    BM, BD = _block_rows(D)
    if T:
        grid = persistent_programs(triton.cdiv(M_q, BM) + triton.cdiv(M_k, BM), q.device)
        launch(
            _qk_norm_rope_store_kernel, (grid,),
            q, k, v, q_weight, k_weight, cos, sin, q_out, k_cache, v_cache, slot_mapping,
            M_q, M_k, Hq, Hkv, D, cos.shape[1], q.stride(0), q.stride(1), k.stride(0),
            k.stride(1), v.stride(0), v.stride(1), cos.stride(0), eps, grid,
            BM=BM, BD=BD, **pdl(q.device),
        )
    return q_out
