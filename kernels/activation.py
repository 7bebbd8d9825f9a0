"""SwiGLU activation: silu(gate) * up over the output of a fused gate/up projection.

Works in tiles of BM rows x BI columns of the intermediate width, on a persistent grid
(kernels.hw.persistent_programs: program p takes tiles p, p + P, ...); reads the gate and up
halves of each row and writes their product. Rounding follows `kernels.reference.silu_mul`
(torch's: SiLU in float32 rounded to the input dtype, then the product in float32 rounded
again), so every backend gives the same numbers.

Portability: plain pointers, int64 row offsets, masks; no device-specific intrinsics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.hw import launch, persistent_programs


@triton.jit(do_not_specialize=["M", "NUM_PROGS"])
def _silu_mul_kernel(x, out, M, I, stride_x, NUM_PROGS, PID0, BM: tl.constexpr,
                     BI: tl.constexpr):
    num_i = tl.cdiv(I, BI)
    for i_p in range(tl.program_id(0) + PID0, tl.cdiv(M, BM) * num_i, NUM_PROGS):
        i_m, i_i = i_p // num_i, i_p % num_i  # the tiles of a row block are neighbours
        o_m = i_m * BM + tl.arange(0, BM)
        o_i = i_i * BI + tl.arange(0, BI)
        mask = (o_m < M)[:, None] & (o_i < I)[None, :]
        p_gate = x + o_m[:, None].to(tl.int64) * stride_x + o_i[None, :]
        b_gate = tl.load(p_gate, mask=mask, other=0.0).to(tl.float32)
        b_up = tl.load(p_gate + I, mask=mask, other=0.0).to(tl.float32)
        b_act = (b_gate * tl.sigmoid(b_gate)).to(out.dtype.element_ty).to(tl.float32)
        tl.store(out + o_m[:, None].to(tl.int64) * I + o_i[None, :],
                 (b_act * b_up).to(out.dtype.element_ty), mask=mask)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] (gate columns, then up columns; rows may be strided) -> [T, I] in x's dtype."""
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(1) != 1:
        raise ValueError("silu_mul needs a [T, 2I] tensor with unit column stride, "
                         f"got {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"silu_mul: unsupported dtype {x.dtype} (float32, bfloat16, float16)")
    M, I = x.shape[0], x.shape[1] // 2
    out = torch.empty(M, I, dtype=x.dtype, device=x.device)
    BI = min(1024, triton.next_power_of_2(max(I, 16)))
    BM = max(1, 2048 // BI)
    if M and I:
        grid = persistent_programs(triton.cdiv(M, BM) * triton.cdiv(I, BI), x.device)
        launch(_silu_mul_kernel, (grid,), x, out, M, I, x.stride(0), grid, BM=BM, BI=BI)
    return out
