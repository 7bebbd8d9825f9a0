"""The Triton causal conv1d kernels compute what the torch reference does (float64 oracle).

Prefill: varlen batches of lengths {1, 63, 64, 65, 200}, source slots including the null slot 0,
checkpoint windows at several block boundaries (the segment's end included), and src == dst
(a continued prefill updating its slot in place). Decode: src == 0, src == dst and distinct
slots. Every slot that should be written is poisoned with NaN first and must come out exactly
equal to the reference; every other slot must be untouched.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels import conv1d, reference
from kernels.conv1d import causal_conv1d, causal_conv1d_update
from kernels.reference import Checkpoints

LENGTHS = [1, 63, 64, 65, 200]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


def i32(values, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


def run_both(fn, ref_fn, x, weight, pool, *args):
    """Run the kernel on (x, weight, pool) and the reference on float64 copies."""
    pool64 = pool.double()
    ref = ref_fn(x.double(), weight.double(), pool64, *args)
    out = fn(x, weight, pool, *args)
    return out, ref, pool64


def check_pool(pool, pool64, before, written: list[int]) -> None:
    assert not pool.isnan().any(), "a slot that should be written was left (partly) unwritten"
    assert torch.equal(pool.double(), pool64), "slot contents differ from the reference"
    untouched = [s for s in range(pool.shape[0]) if s not in written]
    assert torch.equal(pool[untouched], before[untouched]), (
        "a slot that should not be written changed"
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_place", [False, True])
def test_prefill_varlen_with_checkpoints(device, dtype, in_place):
    D, W, num_slots = 48, 4, 16
    T = sum(LENGTHS)
    x = torch.randn(T, D, device=device).to(dtype)
    weight = torch.randn(D, W, device=device).to(dtype)
    pool = torch.randn(num_slots, W - 1, D, device=device).to(dtype)
    cu = i32([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], device)
    src = [0, 3, 5, 0, 7] if not in_place else [2, 3, 5, 6, 7]
    dst = [1, 2, 4, 6, 8] if not in_place else src
    # (seq, boundary, slot): the 64-long segment's end, and 64/128/192 inside the 200 one
    ckpt = [(2, 64, 9), (3, 64, 10), (4, 64, 11), (4, 128, 12), (4, 192, 13)]
    checkpoints = Checkpoints(*(i32([c[j] for c in ckpt], device) for j in range(3)))
    written = sorted(set(dst) | {c[2] for c in ckpt})
    for s in written:
        if s not in src:
            pool[s] = float("nan")
    before = pool.clone()
    out, ref, pool64 = run_both(
        causal_conv1d,
        reference.causal_conv1d,
        x,
        weight,
        pool,
        cu,
        i32(src, device),
        i32(dst, device),
        checkpoints,
    )
    assert out.dtype == dtype and out.shape == (T, D)
    assert rel_err(out, ref) <= TOL[dtype]
    check_pool(pool, pool64, before, written)


def test_prefill_without_checkpoints_single_token_in_place(device):
    """A one-token continuation reads most of its window from the slot it overwrites."""
    D, W = 40, 4
    x = torch.randn(3, D, device=device)
    weight = torch.randn(D, W, device=device)
    pool = torch.randn(6, W - 1, D, device=device)
    cu, slots = i32([0, 1, 3], device), i32([4, 2], device)
    before = pool.clone()
    out, ref, pool64 = run_both(
        causal_conv1d, reference.causal_conv1d, x, weight, pool, cu, slots, slots
    )
    assert rel_err(out, ref) <= 1e-5
    check_pool(pool, pool64, before, [2, 4])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_update(device, dtype):
    D, W, num_slots = 72, 4, 12
    src, dst = [0, 3, 5, 6, 0, 8], [1, 3, 4, 6, 2, 9]  # slot 0, in place (3, 6) and moves
    x = torch.randn(len(src), D, device=device).to(dtype)
    weight = torch.randn(D, W, device=device).to(dtype)
    pool = torch.randn(num_slots, W - 1, D, device=device).to(dtype)
    for s in set(dst) - set(src):
        pool[s] = float("nan")
    before = pool.clone()
    out, ref, pool64 = run_both(
        causal_conv1d_update,
        reference.causal_conv1d_update,
        x,
        weight,
        pool,
        i32(src, device),
        i32(dst, device),
    )
    assert out.dtype == dtype and out.shape == x.shape
    assert rel_err(out, ref) <= TOL[dtype]
    check_pool(pool, pool64, before, dst)


def test_row_strided_input(device):
    """x as the model passes it: the first columns of a wider fused projection (no copy)."""
    D, W = 48, 4
    wide = torch.randn(70, D + 40, device=device)
    x = wide[:, 8 : 8 + D]
    weight = torch.randn(D, W, device=device)
    pool = torch.randn(5, W - 1, D, device=device)
    cu, src, dst = i32([0, 65, 70], device), i32([0, 3], device), i32([1, 3], device)
    out, ref, _ = run_both(causal_conv1d, reference.causal_conv1d, x, weight, pool, cu, src, dst)
    assert rel_err(out, ref) <= 1e-5
    step = wide[:2, 8 : 8 + D]
    out, ref, _ = run_both(
        causal_conv1d_update, reference.causal_conv1d_update, step, weight, pool, dst, dst
    )
    assert rel_err(out, ref) <= 1e-5


@pytest.mark.parametrize("many", [0, 10**9], ids=["large-tiles", "small-tiles"])
def test_prefill_tiles_over_many_channels(device, many, monkeypatch):
    """Both token tiles of the prefill kernel (chosen by the grid's size: forced here), over
    channels that take three tiles, the last one partial, of a row-strided projection."""
    monkeypatch.setattr(conv1d, "PREFILL_MANY", many)
    D, W = 300, 4
    T = sum(LENGTHS)
    wide = torch.randn(T, D + 20, device=device)
    x = wide[:, 4 : 4 + D]
    weight = torch.randn(D, W, device=device)
    pool = torch.randn(12, W - 1, D, device=device)
    cu = i32([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], device)
    src, dst = i32([0, 3, 5, 0, 7], device), i32([1, 2, 4, 6, 8], device)
    before = pool.clone()
    tiles, kernel = [], conv1d._conv_fwd_kernel

    class Spy:  # records the token tile each launch takes
        def __getitem__(self, grid):
            return lambda *args, **kw: tiles.append(kw["BT"]) or kernel[grid](*args, **kw)

    monkeypatch.setattr(conv1d, "_conv_fwd_kernel", Spy())
    out, ref, pool64 = run_both(causal_conv1d, reference.causal_conv1d, x, weight, pool, cu, src,
                                dst)
    assert tiles == [conv1d.PREFILL_BT if many == 0 else conv1d.PREFILL_FEW_BT]
    assert rel_err(out, ref) <= 1e-5
    check_pool(pool, pool64, before, [1, 2, 4, 6, 8])


def test_rejects_mismatched_shapes(device):
    x = torch.randn(4, 8, device=device)
    pool = torch.zeros(3, 3, 8, device=device)
    with pytest.raises(ValueError, match="shapes disagree"):
        causal_conv1d_update(
            x, torch.randn(8, 5, device=device), pool, i32([1] * 4, device), i32([1] * 4, device)
        )
