"""Varlen chunked gated delta rule (prefill) with fused gating, q/k L2 norm and checkpoints.

Contract: `kernels.reference.chunk_gdn`. Three launches, chunk size BT = 64:

1. `_gdn_prepare_kernel`, one work item per (chunk, value head): gating (g = -exp(A_log) *
   softplus(a + dt_bias), chunk-local cumsum; beta = sigmoid(b)), the inverse L2 norms of q
   and k (stored for steps 2-3, so raw q/k feed every dot product and the norms become row or
   column scales), the strictly lower matrix A_ij = beta_i (k_i . k_j) exp(g_i - g_j) over
   normalised keys and the WY factors
   w = (I + A)^-1 (beta exp(g) k) and u = (I + A)^-1 (beta v). (I + A) is solved in 16-row
   sub-blocks: the 16x16 diagonal blocks are inverted with a product of (I + L^(2^n)) factors
   (L is nilpotent), the rest is block forward substitution.
2. `_gdn_state_kernel`, one work item per (sequence, value head, V tile), sequential over the
   sequence's chunks: reads the source slot, keeps the state S [K, BV] in float32 registers,
   stores S before each chunk (for step 3) and v_new = u - w S, and updates
   S <- exp(g_last) S + (k exp(g_last - g))^T v_new. Checkpoint slots are written from this
   loop; the final state goes to the destination slot.
3. `_gdn_output_kernel`, one work item per (chunk, value head, V tile):
   o = (q exp(g)) S + (q k^T * exp(g_i - g_j), causal) v_new; with `norm`, and a head in one
   tile, the layer's gated RMSNorm follows in registers (`kernels.norms.gated_norm_rows`), so o
   is written once, normed.

Grids (`kernels.hw.persistent_grid`): on CUDA one program per item (the `LOOP` constexpr
off) on the kernels' natural axes (chunks x heads, sequence x heads x V tiles); elsewhere a
persistent grid of P programs on one axis, program p taking items p, p + P, ..., numbered so
that chunks, or sequence x value head, run fastest. Chunk
bookkeeping for varlen batches is computed on the device (no host sync): the prepare and
output grids are sized from the host-known bound T // BT + N chunks; looping, their items end
at the real chunk count read from `chunk_offsets[N]`, so programs past the real work take no
item; one program per item, a program past them finds N in `chunk_seq` and does nothing (no
early return either way).
Checkpoint targets become a per-chunk slot map (0 = none), so a sequence has at most one
checkpoint slot per boundary (repeated targets must agree on it).

Precision: float32 inputs use IEEE float32 dot products (TF32 would miss 1e-5); 16-bit inputs
use 16-bit operands in the large dot products, like FLA, and TF32 in the WY solve (CUDA; IEEE
elsewhere). State and all accumulations are float32. Scratch (w, u, v_new, per-chunk states)
is in the input dtype.

Portability: plain pointers with int64 scalar bases and int32 tile offsets (no block pointers:
triton 3.9 removed them), masks for padding, scalar `if` for the optional slot reads/writes,
no CUDA-only intrinsics. CONFIG holds the tiles and the CUDA launch hints (num_warps,
num_stages; passed on CUDA only, as is TF32).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.hw import (
    cuda_hints,
    dot_precision,
    launch,
    num_cube_cores,
    persistent_grid,
)
from kernels.norms import TL_DTYPES, check_norm_inputs, gated_norm_rows, gated_rmsnorm
from kernels.reference import CHUNK, Checkpoints

# compile-time constants of the kernels (the launchers use CHUNK)
BT = tl.constexpr(CHUNK)  # tokens per chunk
BC = tl.constexpr(16)  # rows per sub-block of the WY solve (BT // BC == 4 is hard-wired below)

# Launch configuration per kernel; the benchmark script may override entries.
CONFIG = {
    # "many_warps" from "many" full chunks per core up, counted from the tokens (so a step's
    # largest prefill graph builds it before any eager step of as many tokens needs it). H100,
    # 16 heads: 8,192 tokens 147 against 161 us on 4 warps; 4,096 and 2,048 tokens even (82 / 84
    # and 43 / 44 us); 1,024 tokens 40 against 21 us.
    "prepare": {"BK": 128, "BV": 128, "num_warps": 4, "num_stages": 1, "many_warps": 2, "many": 8},
    "state": {"BV": 32, "num_warps": 4, "num_stages": 3, "wide_BV": 64, "wide_cost": 1.28,
              "fine_BV": 16, "fine_warps": 2},
    "output": {"BV": 64, "BK": 64, "num_warps": 4, "num_stages": 3, "norm_max_V": 128,
               "norm_warps": 4},
}


@triton.jit
def _softplus(x):
    # torch's softplus (threshold 20); x = -inf gives 0, so masked rows get no decay
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))


@triton.jit
def _load_gates(a, b, stride_a, stride_b, t, m_t, b_neg_A, b_dt_bias):
    """Raw log decay g and beta of rows t, fp32 [BC]; masked rows get g = 0, beta = 0."""
    b_a = tl.load(a + t * stride_a, mask=m_t, other=float("-inf")).to(tl.float32)
    b_b = tl.load(b + t * stride_b, mask=m_t, other=float("-inf")).to(tl.float32)
    return b_neg_A * _softplus(b_a + b_dt_bias), tl.sigmoid(b_b)


@triton.jit
def _load_rows(x, stride_t, t, m_t, o_c):
    """x[t, o_c] in x's dtype, [R, C] (masked rows are 0)."""
    p_x = x + t[:, None] * stride_t + o_c[None, :]
    return tl.load(p_x, mask=m_t[:, None], other=0.0)


@triton.jit
def _rstd(b_x, axis: tl.constexpr):
    """1 / sqrt(sum(x^2) + 1e-6) along `axis` (the L2 norm of FLA and transformers)."""
    b_xf = b_x.to(tl.float32)
    return tl.rsqrt(tl.sum(b_xf * b_xf, axis=axis) + 1e-6)


@triton.jit
def _kkt_block(
    b_ki, b_kj, b_gi, b_gj, b_si, b_rj, IS_DIAG: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr
):
    """Block (i, j) of A = beta_i (k_i . k_j) / (|k_i| |k_j|) exp(g_i - g_j), strictly lower.

    b_ki, b_kj: raw keys [BC, K]; b_si = beta_i / |k_i|, b_rj = 1 / |k_j|: [BC].
    """
    b_A = tl.dot(b_ki.to(DT), tl.trans(b_kj.to(DT)), input_precision=PREC)
    b_A *= b_si[:, None] * b_rj[None, :]
    b_dg = b_gi[:, None] - b_gj[None, :]
    if IS_DIAG:
        o_r = tl.arange(0, BC)
        m_lower = o_r[:, None] > o_r[None, :]
        b_A = tl.where(m_lower, b_A * tl.exp(tl.where(m_lower, b_dg, 0.0)), 0.0)
    else:
        b_A = b_A * tl.exp(b_dg)  # g is non-increasing, so b_dg <= 0 below the diagonal
    return b_A


@triton.jit
def _unit_lower_inverse(b_L, PREC: tl.constexpr):
    """(I + L)^-1 of a strictly lower [BC, BC] L (L^16 = 0) as
    (I - L)(I + L^2)(I + L^4)(I + L^8)."""
    o_r = tl.arange(0, BC)
    b_X = tl.where(o_r[:, None] == o_r[None, :], 1.0, 0.0) - b_L
    b_P = tl.dot(b_L, b_L, input_precision=PREC)
    b_X += tl.dot(b_X, b_P, input_precision=PREC)
    b_P = tl.dot(b_P, b_P, input_precision=PREC)
    b_X += tl.dot(b_X, b_P, input_precision=PREC)
    b_P = tl.dot(b_P, b_P, input_precision=PREC)
    b_X += tl.dot(b_X, b_P, input_precision=PREC)
    return b_X


@triton.jit
def _block_solve(
    b_r0,
    b_r1,
    b_r2,
    b_r3,
    b_D0,
    b_D1,
    b_D2,
    b_D3,
    b_A10,
    b_A20,
    b_A21,
    b_A30,
    b_A31,
    b_A32,
    PREC: tl.constexpr,
):
    """x = (I + A)^-1 r by forward substitution over 4 row blocks; D_i = (I + A_ii)^-1."""
    b_x0 = tl.dot(b_D0, b_r0, input_precision=PREC)
    b_x1 = tl.dot(b_D1, b_r1 - tl.dot(b_A10, b_x0, input_precision=PREC), input_precision=PREC)
    b_s = tl.dot(b_A20, b_x0, input_precision=PREC) + tl.dot(b_A21, b_x1, input_precision=PREC)
    b_x2 = tl.dot(b_D2, b_r2 - b_s, input_precision=PREC)
    b_s = tl.dot(b_A30, b_x0, input_precision=PREC) + tl.dot(b_A31, b_x1, input_precision=PREC)
    b_s += tl.dot(b_A32, b_x2, input_precision=PREC)
    b_x3 = tl.dot(b_D3, b_r3 - b_s, input_precision=PREC)
    return b_x0, b_x1, b_x2, b_x3


@triton.jit
def _store_rows(x, stride_t, t, m_t, o_c, b_x):
    p_x = x + t[:, None] * stride_t + o_c[None, :]
    tl.store(p_x, b_x.to(x.dtype.element_ty), mask=m_t[:, None])


@triton.jit
def _store_rstd(p, stride, b_r0, b_r1, b_r2, b_r3, m_0, m_1, m_2, m_3):
    o_r = tl.arange(0, BC)
    tl.store(p + o_r * stride, b_r0, mask=m_0)
    tl.store(p + (o_r + BC) * stride, b_r1, mask=m_1)
    tl.store(p + (o_r + 2 * BC) * stride, b_r2, mask=m_2)
    tl.store(p + (o_r + 3 * BC) * stride, b_r3, mask=m_3)


@triton.jit(do_not_specialize=["N", "NUM_PROGS"])
def _gdn_prepare_kernel(
    q,
    k,
    v,
    a,
    b,
    A_log,
    dt_bias,
    w,
    u,
    g_cum,
    rstd_q,
    rstd_k,
    cu_seqlens,
    chunk_seq,
    chunk_offsets,
    stride_qt,
    stride_kt,
    stride_vt,
    stride_at,
    stride_bt,
    N,
    NUM_PROGS,
    PID0,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    PREC: tl.constexpr,
    DT: tl.constexpr,
    LOOP: tl.constexpr,
):
    # items (chunk, value head), chunks fastest
    if LOOP:  # over the real chunks only: programs past them take none
        num_chunks = tl.load(chunk_offsets + N)
        for i_item in range(tl.program_id(0) + PID0, num_chunks * HV, NUM_PROGS):
            _prepare_chunk(
                q, k, v, a, b, A_log, dt_bias, w, u, g_cum, rstd_q, rstd_k, cu_seqlens,
                chunk_seq, chunk_offsets, stride_qt, stride_kt, stride_vt, stride_at, stride_bt,
                i_item % num_chunks, i_item // num_chunks, H, HV, K, V, BK, BV, PREC, DT,
            )
    else:  # one program per item, on a grid of the chunks' bound x value heads: past the real
        # chunks chunk_seq holds N
        i_c, i_hv = tl.program_id(0) + PID0, tl.program_id(1)
        if tl.load(chunk_seq + i_c) < N:
            _prepare_chunk(
                q, k, v, a, b, A_log, dt_bias, w, u, g_cum, rstd_q, rstd_k, cu_seqlens,
                chunk_seq, chunk_offsets, stride_qt, stride_kt, stride_vt, stride_at, stride_bt,
                i_c, i_hv, H, HV, K, V, BK, BV, PREC, DT,
            )


@triton.jit
def _prepare_chunk(
    q, k, v, a, b, A_log, dt_bias, w, u, g_cum, rstd_q, rstd_k, cu_seqlens, chunk_seq,
    chunk_offsets, stride_qt, stride_kt, stride_vt, stride_at, stride_bt, i_c, i_hv,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr,
):
    """The prepare kernel's work on chunk i_c (a real one) of value head i_hv."""
    i_n = tl.load(chunk_seq + i_c)
    i_local = i_c - tl.load(chunk_offsets + i_n)
    bos = tl.load(cu_seqlens + i_n)
    num_rows = tl.load(cu_seqlens + i_n + 1) - bos - i_local * BT  # valid rows of this chunk (>= 1)
    t0 = bos.to(tl.int64) + i_local * BT  # first token, int64: base of every pointer below
    i_h = i_hv // (HV // H)

    # 4 sub-blocks of BC rows: chunk-local row indices and their masks
    o_r = tl.arange(0, BC)
    t_0, t_1, t_2, t_3 = o_r, o_r + BC, o_r + 2 * BC, o_r + 3 * BC
    m_0, m_1, m_2, m_3 = t_0 < num_rows, t_1 < num_rows, t_2 < num_rows, t_3 < num_rows
    q += t0 * stride_qt + i_h * K
    k += t0 * stride_kt + i_h * K
    v += t0 * stride_vt + i_hv * V
    a += t0 * stride_at + i_hv
    b += t0 * stride_bt + i_hv
    w += t0 * (HV * K) + i_hv * K
    u += t0 * (HV * V) + i_hv * V
    g_cum += t0 * HV + i_hv

    # gates; g becomes the chunk-local cumulative log decay
    b_neg_A = -tl.exp(tl.load(A_log + i_hv).to(tl.float32))
    b_dt_bias = tl.load(dt_bias + i_hv).to(tl.float32)
    b_g0, b_beta0 = _load_gates(a, b, stride_at, stride_bt, t_0, m_0, b_neg_A, b_dt_bias)
    b_g1, b_beta1 = _load_gates(a, b, stride_at, stride_bt, t_1, m_1, b_neg_A, b_dt_bias)
    b_g2, b_beta2 = _load_gates(a, b, stride_at, stride_bt, t_2, m_2, b_neg_A, b_dt_bias)
    b_g3, b_beta3 = _load_gates(a, b, stride_at, stride_bt, t_3, m_3, b_neg_A, b_dt_bias)
    b_carry1 = tl.sum(b_g0, axis=0)
    b_carry2 = b_carry1 + tl.sum(b_g1, axis=0)
    b_carry3 = b_carry2 + tl.sum(b_g2, axis=0)
    b_g0 = tl.cumsum(b_g0, axis=0)
    b_g1 = tl.cumsum(b_g1, axis=0) + b_carry1
    b_g2 = tl.cumsum(b_g2, axis=0) + b_carry2
    b_g3 = tl.cumsum(b_g3, axis=0) + b_carry3
    tl.store(g_cum + t_0 * HV, b_g0, mask=m_0)
    tl.store(g_cum + t_1 * HV, b_g1, mask=m_1)
    tl.store(g_cum + t_2 * HV, b_g2, mask=m_2)
    tl.store(g_cum + t_3 * HV, b_g3, mask=m_3)

    # A over L2-normalised keys in 16x16 blocks, from raw keys and row scales 1 / |k|
    o_k = tl.arange(0, K)
    b_k0 = _load_rows(k, stride_kt, t_0, m_0, o_k)
    b_k1 = _load_rows(k, stride_kt, t_1, m_1, o_k)
    b_k2 = _load_rows(k, stride_kt, t_2, m_2, o_k)
    b_k3 = _load_rows(k, stride_kt, t_3, m_3, o_k)
    b_r0, b_r1, b_r2, b_r3 = _rstd(b_k0, 1), _rstd(b_k1, 1), _rstd(b_k2, 1), _rstd(b_k3, 1)
    if i_hv % (HV // H) == 0:  # one item per key head stores the norms used by the next kernels
        _store_rstd(rstd_k + t0 * H + i_h, H, b_r0, b_r1, b_r2, b_r3, m_0, m_1, m_2, m_3)
        _store_rstd(
            rstd_q + t0 * H + i_h,
            H,
            _rstd(_load_rows(q, stride_qt, t_0, m_0, o_k), 1),
            _rstd(_load_rows(q, stride_qt, t_1, m_1, o_k), 1),
            _rstd(_load_rows(q, stride_qt, t_2, m_2, o_k), 1),
            _rstd(_load_rows(q, stride_qt, t_3, m_3, o_k), 1),
            m_0,
            m_1,
            m_2,
            m_3,
        )
    b_s0, b_s1, b_s2, b_s3 = b_beta0 * b_r0, b_beta1 * b_r1, b_beta2 * b_r2, b_beta3 * b_r3
    b_A00 = _kkt_block(b_k0, b_k0, b_g0, b_g0, b_s0, b_r0, True, PREC, DT)
    b_A11 = _kkt_block(b_k1, b_k1, b_g1, b_g1, b_s1, b_r1, True, PREC, DT)
    b_A22 = _kkt_block(b_k2, b_k2, b_g2, b_g2, b_s2, b_r2, True, PREC, DT)
    b_A33 = _kkt_block(b_k3, b_k3, b_g3, b_g3, b_s3, b_r3, True, PREC, DT)
    b_A10 = _kkt_block(b_k1, b_k0, b_g1, b_g0, b_s1, b_r0, False, PREC, DT)
    b_A20 = _kkt_block(b_k2, b_k0, b_g2, b_g0, b_s2, b_r0, False, PREC, DT)
    b_A21 = _kkt_block(b_k2, b_k1, b_g2, b_g1, b_s2, b_r1, False, PREC, DT)
    b_A30 = _kkt_block(b_k3, b_k0, b_g3, b_g0, b_s3, b_r0, False, PREC, DT)
    b_A31 = _kkt_block(b_k3, b_k1, b_g3, b_g1, b_s3, b_r1, False, PREC, DT)
    b_A32 = _kkt_block(b_k3, b_k2, b_g3, b_g2, b_s3, b_r2, False, PREC, DT)
    b_D0 = _unit_lower_inverse(b_A00, PREC)
    b_D1 = _unit_lower_inverse(b_A11, PREC)
    b_D2 = _unit_lower_inverse(b_A22, PREC)
    b_D3 = _unit_lower_inverse(b_A33, PREC)

    # w = (I + A)^-1 (beta exp(g) k / |k|), BK columns at a time (keys reloaded from cache)
    b_s0 *= tl.exp(b_g0)
    b_s1 *= tl.exp(b_g1)
    b_s2 *= tl.exp(b_g2)
    b_s3 *= tl.exp(b_g3)
    for i_k in range(K // BK):
        o_c = i_k * BK + tl.arange(0, BK)
        b_w0, b_w1, b_w2, b_w3 = _block_solve(
            _load_rows(k, stride_kt, t_0, m_0, o_c).to(tl.float32) * b_s0[:, None],
            _load_rows(k, stride_kt, t_1, m_1, o_c).to(tl.float32) * b_s1[:, None],
            _load_rows(k, stride_kt, t_2, m_2, o_c).to(tl.float32) * b_s2[:, None],
            _load_rows(k, stride_kt, t_3, m_3, o_c).to(tl.float32) * b_s3[:, None],
            b_D0,
            b_D1,
            b_D2,
            b_D3,
            b_A10,
            b_A20,
            b_A21,
            b_A30,
            b_A31,
            b_A32,
            PREC,
        )
        _store_rows(w, HV * K, t_0, m_0, o_c, b_w0)
        _store_rows(w, HV * K, t_1, m_1, o_c, b_w1)
        _store_rows(w, HV * K, t_2, m_2, o_c, b_w2)
        _store_rows(w, HV * K, t_3, m_3, o_c, b_w3)

    # u = (I + A)^-1 (beta v)
    for i_v in range(V // BV):
        o_c = i_v * BV + tl.arange(0, BV)
        b_u0, b_u1, b_u2, b_u3 = _block_solve(
            _load_rows(v, stride_vt, t_0, m_0, o_c).to(tl.float32) * b_beta0[:, None],
            _load_rows(v, stride_vt, t_1, m_1, o_c).to(tl.float32) * b_beta1[:, None],
            _load_rows(v, stride_vt, t_2, m_2, o_c).to(tl.float32) * b_beta2[:, None],
            _load_rows(v, stride_vt, t_3, m_3, o_c).to(tl.float32) * b_beta3[:, None],
            b_D0,
            b_D1,
            b_D2,
            b_D3,
            b_A10,
            b_A20,
            b_A21,
            b_A30,
            b_A31,
            b_A32,
            PREC,
        )
        _store_rows(u, HV * V, t_0, m_0, o_c, b_u0)
        _store_rows(u, HV * V, t_1, m_1, o_c, b_u1)
        _store_rows(u, HV * V, t_2, m_2, o_c, b_u2)
        _store_rows(u, HV * V, t_3, m_3, o_c, b_u3)


@triton.jit(do_not_specialize=["N", "NUM_PROGS"])
def _gdn_state_kernel(
    k,
    w,
    u,
    g_cum,
    rstd_k,
    v_new,
    h_chunks,
    state_pool,
    cu_seqlens,
    chunk_offsets,
    src_slots,
    dst_slots,
    ckpt_slots,
    stride_kt,
    N,
    NUM_PROGS,
    PID0,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BV: tl.constexpr,
    PREC: tl.constexpr,
    DT: tl.constexpr,
    LONG: tl.constexpr,
    LOOP: tl.constexpr,
):
    # items (sequence x value head, V tile), sequence x value head fastest
    if LOOP:
        for i_item in range(tl.program_id(0) + PID0, N * HV * (V // BV), NUM_PROGS):
            _state_sequence(
                k, w, u, g_cum, rstd_k, v_new, h_chunks, state_pool, cu_seqlens, chunk_offsets,
                src_slots, dst_slots, ckpt_slots, stride_kt, i_item % (N * HV),
                i_item // (N * HV), H, HV, K, V, BV, PREC, DT, LONG,
            )
    else:  # one program per item, on a grid of sequence x value head, V tiles
        _state_sequence(
            k, w, u, g_cum, rstd_k, v_new, h_chunks, state_pool, cu_seqlens, chunk_offsets,
            src_slots, dst_slots, ckpt_slots, stride_kt, tl.program_id(0) + PID0,
            tl.program_id(1), H, HV, K, V, BV, PREC, DT, LONG,
        )


@triton.jit
def _state_sequence(
    k, w, u, g_cum, rstd_k, v_new, h_chunks, state_pool, cu_seqlens, chunk_offsets, src_slots,
    dst_slots, ckpt_slots, stride_kt, i_nh, i_v, H: tl.constexpr, HV: tl.constexpr,
    K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr,
    LONG: tl.constexpr,
):
    """The state kernel's work on V tile i_v of value head i_nh % HV of sequence i_nh // HV."""
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    seq_len = tl.load(cu_seqlens + i_n + 1) - tl.load(cu_seqlens + i_n)
    num_chunks = tl.cdiv(seq_len, BT)
    i_c0 = tl.load(chunk_offsets + i_n).to(tl.int64)
    i_src = tl.load(src_slots + i_n).to(tl.int64)
    i_dst = tl.load(dst_slots + i_n).to(tl.int64)

    # int64 scalar bases + int32 tile offsets keep register use low
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    o_kv = o_k[:, None] * V + o_v[None, :]  # [K, BV] inside one head's state
    p_w0 = w + bos * (HV * K) + i_hv * K
    p_u0 = u + bos * (HV * V) + i_hv * V
    p_vn0 = v_new + bos * (HV * V) + i_hv * V
    p_k0 = k + bos * stride_kt + i_h * K
    p_g0 = g_cum + bos * HV + i_hv
    p_r0 = rstd_k + bos * H + i_h

    b_h = tl.zeros([K, BV], dtype=tl.float32)
    if i_src != 0:  # slot 0 is the null slot: zeros, never read
        b_h = tl.load(state_pool + (i_src * HV + i_hv) * (K * V) + o_kv)
    # Each chunk's checkpoint slot is read one chunk ahead (ckpt_slots has one entry past the
    # last chunk): a read in the chunk that uses it stalled every step (H100, 16 heads of 8,192
    # tokens: 175-177 us, against 142-144 us now; docs/bench.md, session 18).
    i_ckpt_next = tl.load(ckpt_slots + i_c0).to(tl.int64)
    for i_t in range(num_chunks):
        i_c = i_c0 + i_t
        r_t = i_t * BT + o_t  # rows of this chunk inside the sequence
        if LONG:  # a row times a stride can pass 2^31 (16,384 x 131,072): int64 offsets
            r_t = r_t.to(tl.int64)
        m_t = r_t < seq_len
        i_ckpt = i_ckpt_next
        i_ckpt_next = tl.load(ckpt_slots + i_c + 1).to(tl.int64)
        tl.store(h_chunks + (i_c * HV + i_hv) * (K * V) + o_kv, b_h.to(h_chunks.dtype.element_ty))

        # v_new = u - w S
        b_w = tl.load(p_w0 + r_t[:, None] * (HV * K) + o_k[None, :], mask=m_t[:, None], other=0.0)
        o_tv = r_t[:, None] * (HV * V) + o_v[None, :]
        b_v = tl.load(p_u0 + o_tv, mask=m_t[:, None], other=0.0).to(tl.float32)
        b_v -= tl.dot(b_w.to(DT), b_h.to(DT), input_precision=PREC)
        tl.store(p_vn0 + o_tv, b_v.to(v_new.dtype.element_ty), mask=m_t[:, None])

        # S <- exp(g_last) S + (k / |k|)^T (exp(g_last - g) v_new); keys are loaded raw and
        # transposed ([K, BT]), their 1 / |k| row scale is folded into v_new
        b_g = tl.load(p_g0 + r_t * HV, mask=m_t, other=0.0)
        b_g_last = tl.load(p_g0 + (tl.minimum(i_t * BT + BT, seq_len) - 1) * HV)
        b_rk = tl.load(p_r0 + r_t * H, mask=m_t, other=0.0)
        b_kt = tl.load(p_k0 + r_t[None, :] * stride_kt + o_k[:, None], mask=m_t[None, :], other=0.0)
        b_v *= (tl.exp(b_g_last - b_g) * b_rk)[:, None]
        b_h *= tl.exp(b_g_last)
        b_h += tl.dot(b_kt.to(DT), b_v.to(DT), input_precision=PREC)

        if i_ckpt != 0:  # checkpoint after this chunk
            tl.store(state_pool + (i_ckpt * HV + i_hv) * (K * V) + o_kv, b_h)
    tl.store(state_pool + (i_dst * HV + i_hv) * (K * V) + o_kv, b_h)


@triton.jit(do_not_specialize=["N", "NUM_PROGS"])
def _gdn_output_kernel(
    q,
    k,
    v_new,
    h_chunks,
    g_cum,
    rstd_q,
    rstd_k,
    o,
    z,
    norm_w,
    cu_seqlens,
    chunk_seq,
    chunk_offsets,
    stride_qt,
    stride_kt,
    stride_ot,
    stride_zt,
    stride_zh,
    N,
    scale,
    eps,
    NUM_PROGS,
    PID0,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BV: tl.constexpr,
    PREC: tl.constexpr,
    DT: tl.constexpr,
    NORM: tl.constexpr,
    PROD_DTYPE: tl.constexpr,
    BK: tl.constexpr,
    LOOP: tl.constexpr,
):
    # items (chunk, value head x V tile), chunks fastest
    if LOOP:  # over the real chunks only: programs past them take none
        num_chunks = tl.load(chunk_offsets + N)
        for i_item in range(tl.program_id(0) + PID0, num_chunks * (HV * (V // BV)), NUM_PROGS):
            _output_chunk(
                q, k, v_new, h_chunks, g_cum, rstd_q, rstd_k, o, z, norm_w, cu_seqlens,
                chunk_seq, chunk_offsets, stride_qt, stride_kt, stride_ot, stride_zt, stride_zh,
                scale, eps, i_item % num_chunks, i_item // num_chunks, H, HV, K, V, BV, PREC,
                DT, NORM, PROD_DTYPE, BK,
            )
    else:  # one program per item, on a grid of the chunks' bound x (value head, V tile): past
        # the real chunks chunk_seq holds N
        i_c, i_vh = tl.program_id(0) + PID0, tl.program_id(1)
        if tl.load(chunk_seq + i_c) < N:
            _output_chunk(
                q, k, v_new, h_chunks, g_cum, rstd_q, rstd_k, o, z, norm_w, cu_seqlens,
                chunk_seq, chunk_offsets, stride_qt, stride_kt, stride_ot, stride_zt, stride_zh,
                scale, eps, i_c, i_vh, H, HV, K, V, BV, PREC, DT, NORM, PROD_DTYPE, BK,
            )


@triton.jit
def _output_chunk(
    q, k, v_new, h_chunks, g_cum, rstd_q, rstd_k, o, z, norm_w, cu_seqlens, chunk_seq,
    chunk_offsets, stride_qt, stride_kt, stride_ot, stride_zt, stride_zh, scale, eps, i_c, i_vh,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
    PREC: tl.constexpr, DT: tl.constexpr, NORM: tl.constexpr, PROD_DTYPE: tl.constexpr,
    BK: tl.constexpr,
):
    """The output kernel's work on chunk i_c (a real one) of V tile i_vh % (V // BV) of value
    head i_vh // (V // BV)."""
    i_n = tl.load(chunk_seq + i_c)
    i_hv, i_v = i_vh // (V // BV), i_vh % (V // BV)
    i_h = i_hv // (HV // H)
    i_local = i_c - tl.load(chunk_offsets + i_n)
    bos = tl.load(cu_seqlens + i_n)
    num_rows = tl.load(cu_seqlens + i_n + 1) - bos - i_local * BT
    t0 = bos.to(tl.int64) + i_local * BT  # int64 base of every pointer below
    o_t = tl.arange(0, BT)
    m_t = o_t < num_rows
    o_v = i_v * BV + tl.arange(0, BV)

    # raw q and k feed the dot products; their L2 norms and the scale become row/column scales
    b_rq = tl.load(rstd_q + t0 * H + i_h + o_t * H, mask=m_t, other=0.0) * scale
    b_rk = tl.load(rstd_k + t0 * H + i_h + o_t * H, mask=m_t, other=0.0)
    b_g = tl.load(g_cum + t0 * HV + i_hv + o_t * HV, mask=m_t, other=0.0)
    b_so = b_rq * tl.exp(b_g)
    p_q0 = q + t0 * stride_qt + i_h * K
    p_k0 = k + t0 * stride_kt + i_h * K
    p_h0 = h_chunks + (i_c.to(tl.int64) * HV + i_hv) * (K * V)
    # inter-chunk (q exp(g)) S and the intra-chunk scores q k^T, BK keys at a time: the loop
    # lets the loads of the next keys overlap this step's products
    b_o = tl.zeros([BT, BV], dtype=tl.float32)
    b_A = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(K // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        b_q = tl.load(p_q0 + o_t[:, None] * stride_qt + o_k[None, :], mask=m_t[:, None], other=0.0)
        b_kt = tl.load(p_k0 + o_t[None, :] * stride_kt + o_k[:, None], mask=m_t[None, :], other=0.0)
        b_h = tl.load(p_h0 + o_k[:, None] * V + o_v[None, :])
        # The two products get distinct q operands (row-scaled copies): sharing one operand
        # between Hopper wgmmas of different N (BV != BT) hit an illegal shared-memory access
        # in triton 3.6.
        b_qf = b_q.to(tl.float32)
        b_o += tl.dot((b_qf * b_so[:, None]).to(DT), b_h.to(DT), input_precision=PREC)
        b_A += tl.dot((b_qf * b_rq[:, None]).to(DT), b_kt.to(DT), input_precision=PREC)
    # causal (q k^T * exp(g_i - g_j)) v_new
    b_A *= b_rk[None, :]
    m_causal = o_t[:, None] >= o_t[None, :]
    b_A = tl.where(
        m_causal, b_A * tl.exp(tl.where(m_causal, b_g[:, None] - b_g[None, :], 0.0)), 0.0
    )
    p_v = v_new + t0 * (HV * V) + i_hv * V + o_t[:, None] * (HV * V) + o_v[None, :]
    b_v = tl.load(p_v, mask=m_t[:, None], other=0.0)
    b_o += tl.dot(b_A.to(DT), b_v.to(DT), input_precision=PREC)
    if NORM:  # the gated RMSNorm of whole rows (BV == V) on the output as it would be stored
        b_z = tl.load(
            z + t0 * stride_zt + i_hv * stride_zh + o_t[:, None] * stride_zt + o_v[None, :],
            mask=m_t[:, None],
            other=0.0,
        )
        b_w = tl.load(norm_w + o_v).to(tl.float32)
        b_x = b_o.to(o.dtype.element_ty).to(tl.float32)
        b_o = gated_norm_rows(b_x, b_z.to(tl.float32), b_w, eps, V, o.dtype.element_ty, PROD_DTYPE)
    p_o = o + t0 * stride_ot + i_hv * V + o_t[:, None] * stride_ot + o_v[None, :]
    tl.store(p_o, b_o.to(o.dtype.element_ty), mask=m_t[:, None])


_INTERPRETED = type(_gdn_state_kernel).__name__ == "InterpretedFunction"


def _check_inputs(q, k, v, a, b, A_log, dt_bias, state_pool, src_slots, dst_slots, num_seqs):
    """Shared shape/dtype/layout checks of chunk_gdn and recurrent_gdn; returns (H, HV, K, V)."""
    if q.dim() != 3 or k.shape != q.shape:
        raise ValueError(
            f"q and k must be [T, H, K] with equal shapes, got {tuple(q.shape)} and "
            f"{tuple(k.shape)}"
        )
    T, H, K = q.shape
    if v.dim() != 3 or v.shape[0] != T:
        raise ValueError(f"v must be [T, HV, V] with T={T}, got {tuple(v.shape)}")
    HV, V = v.shape[1], v.shape[2]
    if HV % H != 0:
        raise ValueError(f"value heads ({HV}) must be a multiple of key heads ({H})")
    for name, n in (("K", K), ("V", V)):
        if n < 16 or n & (n - 1):
            raise ValueError(f"head dim {name}={n} must be a power of two >= 16")
    for name, x in (("a", a), ("b", b)):
        if x.shape != (T, HV):
            raise ValueError(f"{name} must be [T, HV] = {(T, HV)}, got {tuple(x.shape)}")
    for name, x in (("A_log", A_log), ("dt_bias", dt_bias)):
        if x.shape != (HV,) or not x.is_contiguous():
            raise ValueError(
                f"{name} must be a contiguous [HV] = [{HV}] tensor, got {tuple(x.shape)}"
            )
    if state_pool.dim() != 4 or state_pool.shape[1:] != (HV, K, V) or (
            state_pool.dtype != torch.float32):
        raise ValueError(
            f"state_pool must be float32 [num_slots, {HV}, {K}, {V}], got "
            f"{state_pool.dtype} {tuple(state_pool.shape)}"
        )
    _check_layouts(q, k, v, a, b, state_pool, src_slots, dst_slots, num_seqs)
    return H, HV, K, V


def _check_layouts(q, k, v, a, b, state_pool, src_slots, dst_slots, num_seqs) -> None:
    """The rest of `_check_inputs`, once the shapes agree: slots, strides and dtypes."""
    if not state_pool.is_contiguous():
        raise ValueError("state_pool must be contiguous")
    for name, x in (("src_slots", src_slots), ("dst_slots", dst_slots)):
        if (x.shape != (num_seqs,) or x.dtype not in (torch.int32, torch.int64)
                or not x.is_contiguous()):
            raise ValueError(
                f"{name} must be a contiguous int32 [{num_seqs}] tensor, "
                f"got {x.dtype} {tuple(x.shape)}"
            )
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
            raise ValueError(
                f"{name} must have contiguous heads (strides [*, {x.shape[2]}, 1]), "
                f"got {x.stride()}"
            )
    for name, x in (("a", a), ("b", b)):
        if x.stride(1) != 1:
            raise ValueError(f"{name} must have a unit stride over heads, got {x.stride()}")
    if q.dtype != k.dtype or q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(
            f"q and k must share a float32/bfloat16/float16 dtype, got {q.dtype}, {k.dtype}"
        )
    if v.dtype != q.dtype:
        raise ValueError(f"v must have q's dtype {q.dtype}, got {v.dtype}")


def _dot_types(dtype: torch.dtype, device: torch.device):
    """(input_precision, operand dtype) of the large dot products for inputs of `dtype`.

    float32 needs IEEE products (TF32 misses 1e-5). 16-bit inputs multiply in their own type,
    except under TRITON_INTERPRET, whose bfloat16 tl.dot is wrong (triton 3.9): float32 there.
    The WY solve's float32 operands take TF32 on CUDA only (`hw.dot_precision`).
    """
    if dtype == torch.float32 or (dtype == torch.bfloat16 and _INTERPRETED):
        return "ieee", tl.float32
    return dot_precision(device, dtype), tl.bfloat16 if dtype == torch.bfloat16 else tl.float16


def _chunk_layout(cu_seqlens: torch.Tensor, max_chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Device-side chunk bookkeeping: (chunk_offsets [N+1], chunk_seq [max_chunks]) int32.

    Sequence i owns global chunks chunk_offsets[i] .. chunk_offsets[i+1]-1; chunk_seq maps a
    global chunk to its sequence, N for chunks past the last one.
    """
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    chunk_offsets = torch.zeros_like(cu_seqlens)
    torch.cumsum((lens + CHUNK - 1) // CHUNK, dim=0, out=chunk_offsets[1:])
    idx = torch.arange(max_chunks, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    chunk_seq = torch.searchsorted(chunk_offsets[1:].contiguous(), idx, right=True).to(torch.int32)
    return chunk_offsets, chunk_seq


class ChunkLayout(NamedTuple):
    """Chunk bookkeeping of one step (see `chunk_layout`): chunk_offsets [N+1] and chunk_seq
    [T // CHUNK + N] as `_chunk_layout` gives them, and ckpt_slots [T // CHUNK + N + 1], the
    checkpoint slot of each global chunk's end (0: none; the last entry is never a checkpoint:
    the state kernel reads it ahead of the last chunk)."""

    chunk_offsets: torch.Tensor
    chunk_seq: torch.Tensor
    ckpt_slots: torch.Tensor
    busy_seqs: int  # sequences with real work (the launch tuning counts these)


def chunk_layout(
    cu_seqlens: torch.Tensor, num_tokens: int, checkpoints: Checkpoints | None = None,
    pad_seqs: int = 0,
) -> ChunkLayout:
    """What `chunk_gdn` derives from cu_seqlens, the token count and the checkpoints: a dozen
    small device ops, worth computing once for all the GDN layers of a step. pad_seqs: how many
    of the last sequences only pad a graph's shapes; the state kernel's tile is chosen for the
    others (a prefill graph's one chunk of 16 value heads takes the fine tile)."""
    num_seqs = cu_seqlens.shape[0] - 1
    if not 0 <= pad_seqs < max(num_seqs, 1):
        raise ValueError(f"chunk_layout: {pad_seqs} padding sequences of {num_seqs}")
    cu_seqlens = cu_seqlens.to(torch.int32).contiguous()
    max_chunks = num_tokens // CHUNK + num_seqs
    chunk_offsets, chunk_seq = _chunk_layout(cu_seqlens, max_chunks)
    ckpt_slots = torch.zeros(max_chunks + 1, dtype=torch.int32, device=cu_seqlens.device)
    if checkpoints is not None and checkpoints.seq.numel() > 0:
        seq = checkpoints.seq.long()
        idx = chunk_offsets[seq].long() + checkpoints.boundary.long() // CHUNK - 1
        ckpt_slots[idx] = checkpoints.slot.to(torch.int32)
    return ChunkLayout(chunk_offsets, chunk_seq, ckpt_slots, num_seqs - pad_seqs)


def _state_tile(num_rows: int, V: int, device: torch.device) -> tuple[int, int]:
    """V tile and warps of the state kernel, whose grid is num_rows (sequences x value heads)
    x V / BV.

    The kernel is one sequential loop per program, so the grid's wave count sets its time. The
    wide tile halves the programs at `wide_cost` times the time per program (H200, HV=48 vs
    HV=32 at T=16384); it is taken when that means fewer waves, e.g. 48 heads of one sequence
    on 132 SMs: 192 narrow programs in 2 waves, or 96 wide ones in 1. A narrow grid that would
    leave half the cores idle takes the fine tile on 2 warps instead (H100, 16 heads of one
    sequence at T=8192: the state kernel 0.174 against 0.207 ms).
    """
    cfg = CONFIG["state"]
    narrow, wide, fine = min(V, cfg["BV"]), min(V, cfg["wide_BV"]), min(V, cfg["fine_BV"])
    cores = num_cube_cores(device)
    if fine < narrow and num_rows * (V // narrow) <= cores // 2:
        return fine, cfg["fine_warps"]
    waves = [-(-num_rows * (V // bv) // cores) for bv in (narrow, wide)]
    return (wide if waves[1] * cfg["wide_cost"] < waves[0] else narrow), cfg["num_warps"]


def state_tile_counts(heads: int, V: int, device: torch.device, most: int) -> list[int]:
    """The fewest sequences (1 up to `most`) that take each of the state kernel's tiles for a
    model of `heads` value heads of V: the step sizes whose eager prefills build every tile
    (`ModelRunner.warm_up`)."""
    counts, seen = [], set()
    for n in range(1, most + 1):
        tile = _state_tile(n * heads, V, device)
        if tile not in seen:
            seen.add(tile)
            counts.append(n)
    return counts


def chunk_gdn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state_pool: torch.Tensor,
    cu_seqlens: torch.Tensor,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    checkpoints: Checkpoints | None = None,
    layout: ChunkLayout | None = None,
    norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """Varlen chunked gated delta rule with fused gating and q/k L2 norm (Triton).

    q, k: [T, H, K]; v: [T, HV, V] (HV a multiple of H; value head j reads key head j // (HV/H));
    q, k, v share a dtype (float32, bfloat16 or float16), heads contiguous, any token stride.
    a, b: [T, HV] raw gate inputs (unit stride over heads); A_log, dt_bias: [HV].
    state_pool: [num_slots, HV, K, V] float32, read at src_slots (0 = zeros, never read) and
    written at dst_slots and at checkpoint slots; cu_seqlens: [N+1] int32;
    src_slots, dst_slots: [N] int32; a dst slot may equal its own sequence's src slot only.
    checkpoints: targets that share a (sequence, boundary) must name the same slot (the state
    is written once per chunk). layout: `chunk_layout(cu_seqlens, T, checkpoints)` of this very
    step, shared by its layers (computed here when None; only its shapes are checked).
    norm: (gate [T, HV, V] with unit stride over V, weight [V], eps): return
    `gated_rmsnorm(o, gate, weight, eps)` instead of o, fused into the output kernel when a
    head fits one tile (V <= 128).
    Returns o: [T, HV, V] in v's dtype. No host synchronisation.
    """
    N = cu_seqlens.shape[0] - 1
    H, HV, K, V = _check_inputs(q, k, v, a, b, A_log, dt_bias, state_pool, src_slots, dst_slots, N)
    _check_step(q, v, cu_seqlens, norm)
    cu_seqlens = cu_seqlens.to(torch.int32).contiguous()
    layout = _step_layout(cu_seqlens, q.shape[0], checkpoints, layout)
    prec, dot_dtype = _dot_types(q.dtype, q.device)
    s = _scratch(q, H, HV, K, V, layout.chunk_seq.shape[0])
    o = torch.empty(q.shape[0], HV, V, dtype=v.dtype, device=q.device)
    _launch_prepare(q, k, v, a, b, A_log, dt_bias, cu_seqlens, layout, s, prec, dot_dtype)
    _launch_state(k, state_pool, src_slots, dst_slots, cu_seqlens, layout, s, prec, dot_dtype)
    fused = _launch_output(q, k, o, norm, cu_seqlens, layout, s, prec, dot_dtype)
    if norm is not None and not fused:
        return gated_rmsnorm(o, *norm)
    return o


def _check_step(q, v, cu_seqlens, norm) -> None:
    """chunk_gdn's checks beyond `_check_inputs`: cu_seqlens and the fused norm's operands,
    all before any state is written."""
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"cu_seqlens must be int32 [N+1], got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}"
        )
    T, HV, V = q.shape[0], v.shape[1], v.shape[2]
    if norm is not None:
        if norm[0].shape != (T, HV, V) or norm[0].stride(2) != 1 or norm[1].shape != (V,):
            raise ValueError(f"chunk_gdn: norm wants a gate [{T}, {HV}, {V}] "
                             f"(unit stride over V) and a weight [{V}], "
                             f"got {tuple(norm[0].shape)} and {tuple(norm[1].shape)}")
        check_norm_inputs(v, norm[1], "chunk_gdn norm", norm[0])


def _step_layout(
    cu_seqlens: torch.Tensor, T: int, checkpoints: Checkpoints | None, layout: ChunkLayout | None
) -> ChunkLayout:
    """The given layout once its shapes fit this step (int32 cu_seqlens [N+1], T tokens), or a
    new one when None."""
    N = cu_seqlens.shape[0] - 1
    max_chunks = T // CHUNK + N
    if layout is None:
        return chunk_layout(cu_seqlens, T, checkpoints)
    if (layout.chunk_seq.shape != (max_chunks,) or layout.chunk_offsets.shape != (N + 1,)
            or layout.ckpt_slots.shape != (max_chunks + 1,)):
        raise ValueError(
            f"chunk_gdn: the layout is for another step ({layout.chunk_seq.shape[0]} chunks and "
            f"{layout.ckpt_slots.shape[0]} checkpoint entries, want {max_chunks} and "
            f"{max_chunks + 1} for {T} tokens in {N} sequences)"
        )
    return layout


class _Scratch(NamedTuple):
    """What the three kernels of one chunk_gdn call pass each other, in q's dtype unless noted:
    w [T, HV, K]; u, v_new [T, HV, V]; g_cum [T, HV], rstd_q, rstd_k [T, H] float32;
    h_chunks [max_chunks, HV, K, V], the state before each chunk."""

    w: torch.Tensor
    u: torch.Tensor
    v_new: torch.Tensor
    g_cum: torch.Tensor
    rstd_q: torch.Tensor
    rstd_k: torch.Tensor
    h_chunks: torch.Tensor


def _scratch(q: torch.Tensor, H: int, HV: int, K: int, V: int, max_chunks: int) -> _Scratch:
    """Uninitialised scratch of a chunk_gdn call over q's T tokens."""
    T, dtype, dev = q.shape[0], q.dtype, q.device
    return _Scratch(
        torch.empty(T, HV, K, dtype=dtype, device=dev),
        torch.empty(T, HV, V, dtype=dtype, device=dev),
        torch.empty(T, HV, V, dtype=dtype, device=dev),
        torch.empty(T, HV, dtype=torch.float32, device=dev),
        torch.empty(T, H, dtype=torch.float32, device=dev),
        torch.empty(T, H, dtype=torch.float32, device=dev),
        torch.empty(max_chunks, HV, K, V, dtype=dtype, device=dev),
    )


def _launch_prepare(q, k, v, a, b, A_log, dt_bias, cu_seqlens, layout, s, prec, dot_dtype):
    """Step 1: gates, inverse norms and the WY factors of every chunk into s."""
    (T, H, K), HV, V = q.shape, v.shape[1], v.shape[2]
    N, max_chunks = cu_seqlens.shape[0] - 1, layout.chunk_seq.shape[0]
    cfg = CONFIG["prepare"]
    many = (T // CHUNK) * HV >= cfg["many"] * num_cube_cores(q.device)
    if max_chunks > 0:
        grid, loop = persistent_grid(max_chunks * HV, q.device, dots=True)
        launch(
            _gdn_prepare_kernel, (grid,) if loop else (max_chunks, HV),
            q, k, v, a, b, A_log, dt_bias, s.w, s.u, s.g_cum, s.rstd_q, s.rstd_k,
            cu_seqlens, layout.chunk_seq, layout.chunk_offsets,
            q.stride(0), k.stride(0), v.stride(0), a.stride(0), b.stride(0), N, grid,
            H=H, HV=HV, K=K, V=V, BK=min(K, cfg["BK"]), BV=min(V, cfg["BV"]),
            PREC=prec, DT=dot_dtype, LOOP=loop,
            **cuda_hints(q.device, num_warps=cfg["many_warps"] if many else cfg["num_warps"],
                         num_stages=cfg["num_stages"]),
        )


def _launch_state(k, state_pool, src_slots, dst_slots, cu_seqlens, layout, s, prec, dot_dtype):
    """Step 2: each sequence's state through its chunks, into s.h_chunks, s.v_new, the
    checkpoint slots and its destination slot."""
    (T, H), (HV, K, V) = k.shape[:2], state_pool.shape[1:]
    N = cu_seqlens.shape[0] - 1
    cfg = CONFIG["state"]
    bv, state_warps = _state_tile(layout.busy_seqs * HV, V, k.device)
    if N > 0:
        grid, loop = persistent_grid(N * HV * (V // bv), k.device, dots=True)
        launch(
            _gdn_state_kernel, (grid,) if loop else (N * HV, V // bv),
            k, s.w, s.u, s.g_cum, s.rstd_k, s.v_new, s.h_chunks, state_pool,
            cu_seqlens, layout.chunk_offsets, src_slots, dst_slots, layout.ckpt_slots,
            k.stride(0), N, grid,
            H=H, HV=HV, K=K, V=V, BV=bv, PREC=prec, DT=dot_dtype,
            LONG=T * max(k.stride(0), HV * max(K, V)) >= 2**31, LOOP=loop,
            **cuda_hints(k.device, num_warps=state_warps, num_stages=cfg["num_stages"]),
        )


def _launch_output(q, k, o, norm, cu_seqlens, layout, s, prec, dot_dtype) -> bool:
    """Step 3: o of every chunk, gated-normed in the kernel when the head fits a tile (the
    return value says whether it was)."""
    (H, K), HV, V = q.shape[1:], o.shape[1], o.shape[2]
    N, max_chunks = cu_seqlens.shape[0] - 1, layout.chunk_seq.shape[0]
    cfg = CONFIG["output"]
    bv = min(V, cfg["BV"])
    num_warps = cfg["num_warps"]
    z, norm_w, eps = norm if norm is not None else (o, o, 0.0)
    fused = norm is not None and V <= cfg["norm_max_V"]
    if fused:
        bv, num_warps = V, cfg["norm_warps"]
    if bv < 32:
        # triton 3.6 on Hopper computes wrong outputs here with a 16-wide V tile and K >= 32
        # (H200: K=32/64, V=16, bf16 and fp16, relative error 0.5-0.96, no fault); with 2 warps
        # there is no warp group, hence no wgmma, and the result is right (4e-3 in bf16).
        num_warps = min(num_warps, 2)
    if max_chunks > 0:
        grid, loop = persistent_grid(max_chunks * HV * (V // bv), q.device, dots=True)
        launch(
            _gdn_output_kernel, (grid,) if loop else (max_chunks, HV * (V // bv)),
            q, k, s.v_new, s.h_chunks, s.g_cum, s.rstd_q, s.rstd_k, o, z, norm_w,
            cu_seqlens, layout.chunk_seq, layout.chunk_offsets,
            q.stride(0), k.stride(0), o.stride(0), z.stride(0), z.stride(1), N, K**-0.5, eps,
            grid,
            H=H, HV=HV, K=K, V=V, BV=bv, PREC=prec, DT=dot_dtype, NORM=fused,
            PROD_DTYPE=TL_DTYPES[torch.promote_types(norm_w.dtype, o.dtype)],
            BK=min(K, cfg["BK"]), LOOP=loop,
            **cuda_hints(q.device, num_warps=num_warps, num_stages=cfg["num_stages"]),
        )
    return fused
