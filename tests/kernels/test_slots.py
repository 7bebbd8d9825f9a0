"""The Triton slot copy and KV store write exactly what the reference writes, and nothing else.

copy_slots: pools of several shapes and dtypes (a conv pool in bf16, a recurrent-state pool in
float32 holding NaN payloads, which must survive bit for bit), the null slot as a source.
store_kv: strided keys/values (sliced out of a wider projection), tokens skipped with -1,
float32 and bf16 caches; written positions are poisoned first, all others must stay untouched.
advance_decode_inputs: real rows step on, padding rows (slot -1) do not, across program blocks.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels import reference
from kernels.slots import advance_decode_inputs, copy_slots, store_kv


def i32(values, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


@pytest.mark.parametrize(
    "shape, dtype",
    [((9, 3, 40), torch.bfloat16), ((9, 2, 8, 8), torch.float32), ((9, 5), torch.int32)],
)
def test_copy_slots(device, shape, dtype):
    pool = (torch.randn(shape, device=device) * 100).to(dtype)
    if dtype.is_floating_point:
        pool[6].view(torch.int16 if dtype == torch.bfloat16 else torch.int32).fill_(
            -1
        )  # NaN payloads
    src, dst = i32([0, 6, 2, 3], device), i32([1, 4, 7, 8], device)
    expected = pool.clone()
    reference.copy_slots(expected, src, dst)
    copy_slots(pool, src, dst)
    assert torch.equal(pool.view(torch.uint8), expected.view(torch.uint8))


def test_copy_slots_nothing_to_copy(device):
    pool = torch.randn(3, 4, device=device)
    before = pool.clone()
    copy_slots(pool, i32([], device), i32([], device))
    assert torch.equal(pool, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv(device, dtype):
    T, H, D, num_blocks, block_size = 70, 2, 32, 5, 16
    kv = torch.randn(T, H, 3 * D, device=device).to(dtype)
    k, v = kv[..., :D], kv[..., D : 2 * D]  # strided, as sliced from a fused projection
    slots = torch.randperm(num_blocks * block_size, device=device)[:T]
    slots[[0, 17, 69]] = -1
    k_cache = torch.randn(num_blocks, block_size, H, D, device=device).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, H, D, device=device).to(dtype)
    written = slots[slots >= 0]
    for cache in (k_cache, v_cache):
        cache.view(-1, H, D)[written] = float("nan")
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reference.store_kv(k, v, k_ref, v_ref, slots)
    store_kv(k, v, k_cache, v_cache, slots)
    assert not k_cache.isnan().any() and not v_cache.isnan().any()
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_store_kv_rejects_int32_slot_mapping(device):
    k = torch.randn(2, 1, 16, device=device)
    cache = torch.zeros(1, 16, 1, 16, device=device)
    with pytest.raises(ValueError, match="int64"):
        store_kv(k, k, cache, cache.clone(), torch.tensor([0, 1], dtype=torch.int32, device=device))


@pytest.mark.parametrize("B", [1, 5, 700])  # 700: two programs of 512 rows
def test_advance_decode_inputs(device, B):
    gen = torch.Generator().manual_seed(B)
    i64 = {"dtype": torch.int64}
    tokens = torch.randint(0, 1000, (B,), generator=gen, **i64).to(device)
    ids = torch.randint(0, 1000, (B,), generator=gen, **i64).to(device)
    positions = torch.randint(0, 500, (B,), generator=gen, **i64).to(device)
    slots = torch.randint(0, 9000, (B,), generator=gen, **i64).to(device)
    slots[torch.arange(B, device=device) % 3 == 2] = -1  # padding rows
    ctx = (positions + 1).to(torch.int32)
    want = [t.clone() for t in (ids, positions, slots, ctx)]
    reference.advance_decode_inputs(tokens, *want)
    live = slots >= 0
    assert torch.equal(want[0], torch.where(live, tokens, ids))
    assert torch.equal(want[1] - positions, live.long()) and torch.equal(want[3] - ctx, live.int())
    advance_decode_inputs(tokens, ids, positions, slots, ctx)
    for got, ref in zip((ids, positions, slots, ctx), want):
        assert torch.equal(got, ref)


def test_advance_decode_inputs_rejects_int32_positions(device):
    rows = [torch.zeros(3, dtype=torch.int64, device=device) for _ in range(4)]
    with pytest.raises(ValueError, match="int64"):
        advance_decode_inputs(rows[0], rows[1], rows[2].int(), rows[3], rows[3].int())
