"""Moving state between slots and into the paged KV cache.

- `copy_slots`: pool[dst[i]] = pool[src[i]] for M pairs, any pool shape [num_slots, ...] and
  dtype (copied as raw bits, so NaN payloads and -0.0 survive).
- `store_kv`: scatter this step's keys and values into [num_blocks, block_size, Hkv, D] caches
  at `slot_mapping` (block * block_size + offset, -1 = skip).
- `advance_decode_inputs`: a decode graph's inputs turned into those of the step after it,
  captured at the graph's end (see statechat/engine/graphs.py).

Grids are persistent (kernels.hw.persistent_programs): program p takes the work items (slot
blocks, tokens, row blocks) p, p + P, p + 2P, ...
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.hw import gdc_enter, launch, pdl, persistent_programs

_BLOCK = 2048
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit(do_not_specialize=["M", "NUM_PROGS"])
def _copy_slots_kernel(pool, src, dst, M, E, NUM_PROGS, PID0, BLOCK: tl.constexpr):
    num_e = tl.cdiv(E, BLOCK)
    for i_p in range(tl.program_id(0) + PID0, M * num_e, NUM_PROGS):
        i_m, i_e = i_p // num_e, i_p % num_e  # the blocks of a slot are neighbours
        o_e = i_e * BLOCK + tl.arange(0, BLOCK)
        m_e = o_e < E
        i_src = tl.load(src + i_m).to(tl.int64)
        i_dst = tl.load(dst + i_m).to(tl.int64)
        b_v = tl.load(pool + i_src * E + o_e, mask=m_e)
        tl.store(pool + i_dst * E + o_e, b_v, mask=m_e)


def copy_slots(pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """pool[dst[i]] = pool[src[i]] for every i.

    pool: [num_slots, ...] contiguous, any dtype; src, dst: [M] int32 slot indices, the src and
    dst sets disjoint (a slot is never read after being written in the same call).
    """
    if not pool.is_contiguous() or pool.ndim < 1 or pool.element_size() not in _BITS:
        raise ValueError(
            "copy_slots needs a contiguous pool [num_slots, ...] of 1, 2, 4 or 8-byte elements"
        )
    if (
        src.shape != dst.shape
        or src.ndim != 1
        or src.dtype != torch.int32
        or dst.dtype != torch.int32
    ):
        raise ValueError(
            f"copy_slots needs src and dst [M] int32; got {tuple(src.shape)} {src.dtype}, "
            f"{tuple(dst.shape)} {dst.dtype}"
        )
    M = src.shape[0]
    E = pool[0].numel() if pool.shape[0] else 0
    if M == 0 or E == 0:
        return
    bits = pool.view(_BITS[pool.element_size()])
    grid = persistent_programs(M * triton.cdiv(E, _BLOCK), pool.device)
    launch(_copy_slots_kernel, (grid,), bits, src.contiguous(), dst.contiguous(), M, E, grid,
           BLOCK=_BLOCK)


@triton.jit(do_not_specialize=["T", "NUM_PROGS"])
def _store_kv_kernel(
    k,
    v,
    k_cache,
    v_cache,
    slot_mapping,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    T,
    H,
    D,
    NUM_PROGS,
    PID0,
    BH: tl.constexpr,
    BD: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    gdc_enter(USE_GDC)
    o_h = tl.arange(0, BH)
    o_d = tl.arange(0, BD)
    m_hd = (o_h < H)[:, None] & (o_d < D)[None, :]
    for i_t in range(tl.program_id(0) + PID0, T, NUM_PROGS):
        # the token's slot in every lane (a mask, not a branch: -1 loads and stores nothing)
        i_slot = tl.load(slot_mapping + i_t + o_h * 0).to(tl.int64)
        m_w = m_hd & (i_slot >= 0)[:, None]
        i_t64 = tl.cast(i_t, tl.int64)
        p_k = k + i_t64 * stride_kt + o_h[:, None] * stride_kh + o_d[None, :]
        p_v = v + i_t64 * stride_vt + o_h[:, None] * stride_vh + o_d[None, :]
        b_k = tl.load(p_k, mask=m_w)
        b_v = tl.load(p_v, mask=m_w)
        o_c = i_slot[:, None] * H * D + o_h[:, None] * D + o_d[None, :]
        tl.store(k_cache + o_c, b_k.to(k_cache.dtype.element_ty), mask=m_w)
        tl.store(v_cache + o_c, b_v.to(v_cache.dtype.element_ty), mask=m_w)


def check_store_kv(
    op: str,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Raise a one-line ValueError, naming `op`, unless the inputs fit `store_kv`."""
    if k.ndim != 3 or v.shape != k.shape or k_cache.ndim != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"{op} expects k, v [T, Hkv, D] and caches [num_blocks, block_size, Hkv, D]; got "
            f"{tuple(k.shape)}, {tuple(v.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    T, H, D = k.shape
    if k_cache.shape[2:] != (H, D):
        raise ValueError(
            f"{op}: k {tuple(k.shape)} does not fit cache heads/dim {tuple(k_cache.shape[2:])}"
        )
    if slot_mapping.shape != (T,) or slot_mapping.dtype != torch.int64:
        raise ValueError(
            f"{op} needs slot_mapping [T] int64; got "
            f"{tuple(slot_mapping.shape)} {slot_mapping.dtype}"
        )
    if k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError(f"{op} needs k and v with a unit-stride last dim")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and slot_mapping.is_contiguous()):
        raise ValueError(f"{op} needs contiguous caches and slot_mapping")


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write new keys/values into the paged cache.

    k, v: [T, Hkv, D] (token and head strides free, D unit-stride); k_cache, v_cache:
    [num_blocks, block_size, Hkv, D] contiguous; slot_mapping: [T] int64, block * block_size +
    offset for each token (-1 = skip).
    """
    check_store_kv("store_kv", k, v, k_cache, v_cache, slot_mapping)
    T, H, D = k.shape
    if T == 0:
        return
    BH, BD = triton.next_power_of_2(H), triton.next_power_of_2(D)
    grid = persistent_programs(T, k.device)
    launch(
        _store_kv_kernel,
        (grid,),
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        T,
        H,
        D,
        grid,
        BH=BH,
        BD=BD,
        **pdl(k.device),
    )


@triton.jit(do_not_specialize=["B", "NUM_PROGS"])
def _advance_kernel(tokens, ids, positions, slot_mapping, context_lens, B, NUM_PROGS, PID0,
                    BLOCK: tl.constexpr, USE_GDC: tl.constexpr):
    gdc_enter(USE_GDC)
    for i_b in range(tl.program_id(0) + PID0, tl.cdiv(B, BLOCK), NUM_PROGS):
        o = i_b * BLOCK + tl.arange(0, BLOCK)
        b_slot = tl.load(slot_mapping + o, mask=o < B, other=-1)
        m = b_slot >= 0  # rows that write KV; padding rows (and rows past B) stay as they are
        tl.store(ids + o, tl.load(tokens + o, mask=m), mask=m)
        tl.store(positions + o, tl.load(positions + o, mask=m) + 1, mask=m)
        tl.store(slot_mapping + o, b_slot + 1, mask=m)
        tl.store(context_lens + o, tl.load(context_lens + o, mask=m) + 1, mask=m)


def advance_decode_inputs(
    tokens: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
    context_lens: torch.Tensor,
) -> None:
    """In place: each row with slot_mapping >= 0 feeds tokens[i] at the next position, into the
    next slot, over one more key (kernels.reference.advance_decode_inputs)."""
    B = ids.shape[0]
    int64_rows = (tokens, ids, positions, slot_mapping)
    bad_ctx = (context_lens.shape != (B,) or context_lens.dtype != torch.int32
               or context_lens.stride(0) != 1)
    if bad_ctx or any(t.shape != (B,) or t.dtype != torch.int64 or t.stride(0) != 1
                      for t in int64_rows):
        raise ValueError("advance_decode_inputs needs contiguous [B] rows: int64 tokens, ids, "
                         "positions, slot_mapping and int32 context_lens")
    BLOCK = 512
    if B:
        grid = persistent_programs(triton.cdiv(B, BLOCK), ids.device)
        launch(_advance_kernel, (grid,), tokens, ids, positions, slot_mapping, context_lens, B,
               grid, BLOCK=BLOCK, **pdl(ids.device))
