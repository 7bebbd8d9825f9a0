"""One decode step of the gated delta rule for N sequences, in one launch (Triton).

Contract: `kernels.reference.recurrent_gdn`. One work item per (sequence, value head, V tile):
it recomputes the gates and the L2 norms of its q/k rows (cheap: K values each), reads a
[K, BV] tile of the float32 state from the source slot, applies

    S <- exp(g) S;  S <- S + k (beta (v - k^T S));  o = q^T S   (q scaled by K^-0.5)

and writes the tile to the destination slot. Each item reads its whole tile before writing
it and no two items share a tile, so src == dst (in place) is safe. The op is bound by
the state's memory traffic; the V tiling gives N * HV * V / BV items, enough to fill the
GPU at N = 1. The grid (`kernels.hw.persistent_grid`) has one program per item on CUDA and is
persistent elsewhere: P programs, program p taking items p, p + P, ... (a head's V tiles
adjacent).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.gdn_chunk import _check_inputs, _softplus
from kernels.hw import cuda_hints, gdc_enter, launch, pdl, persistent_grid

# Launch configuration: BV by number of (sequence, head) pairs; the benchmark may override.
CONFIG = {"small_BV": 16, "large_BV": 32, "small_pairs": 1024, "num_warps": 4}


@triton.jit(do_not_specialize=["N", "NUM_PROGS"])
def _gdn_recurrent_kernel(
    q,
    k,
    v,
    a,
    b,
    A_log,
    dt_bias,
    o,
    state_pool,
    src_slots,
    dst_slots,
    stride_qn,
    stride_kn,
    stride_vn,
    stride_an,
    stride_bn,
    scale,
    N,
    NUM_PROGS,
    PID0,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BV: tl.constexpr,
    USE_GDC: tl.constexpr,
    LOOP: tl.constexpr,
):
    # items (sequence x value head, V tile), a head's V tiles adjacent (V // BV is a
    # constant: the item's parts cost no division)
    if LOOP:
        for i_item in range(tl.program_id(0) + PID0, N * HV * (V // BV), NUM_PROGS):
            _recurrent_tile(
                q, k, v, a, b, A_log, dt_bias, o, state_pool, src_slots, dst_slots, stride_qn,
                stride_kn, stride_vn, stride_an, stride_bn, scale, i_item // (V // BV),
                i_item % (V // BV), H, HV, K, V, BV, USE_GDC,
            )
    else:  # one program per item
        i_item = tl.program_id(0) + PID0
        _recurrent_tile(
            q, k, v, a, b, A_log, dt_bias, o, state_pool, src_slots, dst_slots, stride_qn,
            stride_kn, stride_vn, stride_an, stride_bn, scale, i_item // (V // BV),
            i_item % (V // BV), H, HV, K, V, BV, USE_GDC,
        )


@triton.jit
def _recurrent_tile(
    q, k, v, a, b, A_log, dt_bias, o, state_pool, src_slots, dst_slots, stride_qn, stride_kn,
    stride_vn, stride_an, stride_bn, scale, i_nh, i_v, H: tl.constexpr, HV: tl.constexpr,
    K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, USE_GDC: tl.constexpr,
):
    """The decode step of V tile i_v of value head i_nh % HV of sequence i_nh // HV."""
    i_n, i_hv = tl.cast(i_nh // HV, tl.int64), i_nh % HV
    i_h = i_hv // (HV // H)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    o_kv = o_k[:, None] * V + o_v[None, :]

    # the slots and the state tile are read before waiting for the kernel before (they are
    # not what it writes: see recurrent_gdn), so under programmatic dependent launch the
    # state streams in while that kernel finishes (a program's later items find it finished)
    i_src = tl.load(src_slots + i_n).to(tl.int64)
    i_dst = tl.load(dst_slots + i_n).to(tl.int64)
    # slot 0 is the null slot: zeros, never read (full-shape mask for the interpreter)
    m_src = (tl.zeros([K, BV], dtype=tl.int64) + i_src) != 0
    b_h = tl.load(state_pool + (i_src * HV + i_hv) * K * V + o_kv, mask=m_src, other=0.0)
    b_A_log = tl.load(A_log + i_hv).to(tl.float32)
    b_dt_bias = tl.load(dt_bias + i_hv).to(tl.float32)
    gdc_enter(USE_GDC)

    b_q = tl.load(q + i_n * stride_qn + i_h * K + o_k).to(tl.float32)
    b_k = tl.load(k + i_n * stride_kn + i_h * K + o_k).to(tl.float32)
    b_q *= tl.rsqrt(tl.sum(b_q * b_q, axis=0) + 1e-6) * scale
    b_k *= tl.rsqrt(tl.sum(b_k * b_k, axis=0) + 1e-6)
    b_v = tl.load(v + i_n * stride_vn + i_hv * V + o_v).to(tl.float32)
    b_a = tl.load(a + i_n * stride_an + i_hv).to(tl.float32)
    b_b = tl.load(b + i_n * stride_bn + i_hv).to(tl.float32)
    b_g = -tl.exp(b_A_log) * _softplus(b_a + b_dt_bias)
    b_beta = tl.sigmoid(b_b)

    b_h *= tl.exp(b_g)
    b_delta = b_beta * (b_v - tl.sum(b_h * b_k[:, None], axis=0))
    b_h += b_k[:, None] * b_delta[None, :]
    b_o = tl.sum(b_h * b_q[:, None], axis=0)
    tl.store(state_pool + (i_dst * HV + i_hv) * K * V + o_kv, b_h)
    tl.store(o + i_n * (HV * V) + i_hv * V + o_v, b_o.to(o.dtype.element_ty))


def recurrent_gdn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state_pool: torch.Tensor,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
) -> torch.Tensor:
    """One decode step of the gated delta rule for N sequences (one token each), one launch.

    q, k: [N, H, K]; v: [N, HV, V] (HV a multiple of H), same dtype, heads contiguous;
    a, b: [N, HV] raw gate inputs; A_log, dt_bias: [HV];
    state_pool: [num_slots, HV, K, V] float32, read at src_slots (0 = zeros, never read) and
    written at dst_slots; src_slots, dst_slots: [N] int32 (dst may equal src: in place; dst
    slots distinct). Returns o: [N, HV, V] in v's dtype. No host synchronisation.
    On CUDA the state, the slots, A_log and dt_bias may be read while the kernel launched
    before this one still runs (see kernels.hw.pdl): that kernel must not write them (in a
    decode step it is the in-projection, or at more rows the conv update).
    """
    N = q.shape[0] if q.dim() == 3 else -1
    H, HV, K, V = _check_inputs(q, k, v, a, b, A_log, dt_bias, state_pool, src_slots, dst_slots, N)
    o = torch.empty(N, HV, V, dtype=v.dtype, device=v.device)
    if N == 0:
        return o
    pairs = N * HV
    bv = _value_tile(pairs, V)
    grid, loop = persistent_grid(pairs * (V // bv), v.device)
    launch(
        _gdn_recurrent_kernel, (grid,),
        q, k, v, a, b, A_log, dt_bias, o, state_pool, src_slots, dst_slots,
        q.stride(0), k.stride(0), v.stride(0), a.stride(0), b.stride(0), K**-0.5, N, grid,
        H=H, HV=HV, K=K, V=V, BV=bv, LOOP=loop,
        **cuda_hints(v.device, num_warps=CONFIG["num_warps"]),
        **pdl(v.device),
    )
    return o


def _value_tile(pairs: int, V: int) -> int:
    """The V tile of a step of `pairs` (sequence, value head) programs: the small one while
    the grid is small, so that it holds more programs."""
    bv = CONFIG["small_BV"] if pairs <= CONFIG["small_pairs"] else CONFIG["large_BV"]
    return min(bv, V)
