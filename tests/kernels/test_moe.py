"""The Triton fused MoE computes what the torch reference does (float64 oracle).

Token counts {1, 7, 64, 130} with top-3 of 8 experts, random routing that leaves some experts
without tokens, on both paths (decode: an item per pair and column tile, no sort; prefill:
sorted grouped GEMMs), float32 and bf16. Every buffer the launcher allocates is filled with NaN
(or -1) first, so a row the kernels fail to write shows up. The dispatcher runs the kernel under the
"triton" backend. On CUDA also Qwen3.5-35B-A3B's shapes (hidden 2048, 256 experts, top-8,
moe_intermediate 512) at decode and prefill sizes.

Every kernel has two forms on one grid axis (`kernels.hw.persistent_grid`): one program per
work item (LOOP False, CUDA's) and programs looping over the items (LOOP True, as on Ascend).
With one program per item and with 3 programs looping over items that do not divide evenly, the
outputs and every buffer the launcher fills are bit-identical, at prefill sizes where experts
get none, one and many tokens (so many tiles of the grouped GEMMs' upper bound lie past the
routed pairs), at 1 to 4 decode tokens, and at odd hidden and intermediate sizes.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import kernels
from kernels import hw, moe, reference

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
SMALL = (8, 64, 32, 3)  # E, H, I, K
QWEN35_35B_A3B = (256, 2048, 512, 8)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.fixture
def poisoned(monkeypatch):
    """Fill every buffer fused_moe allocates: NaN for floats, -1 for integers."""

    def empty(*shape, dtype=None, device=None):
        t = torch.empty(*shape, dtype=dtype, device=device)
        return t.fill_(float("nan") if t.is_floating_point() else -1)

    monkeypatch.setattr(moe, "_empty", empty)


def make_case(T, E, H, I, K, dtype, device, seed=0, num_idle=3):
    """x, weights and a routing of T tokens over E - num_idle experts (the rest get none)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen)
    w_gate_up = torch.randn(E, 2 * I, H, generator=gen) * H**-0.5
    w_down = torch.randn(E, H, I, generator=gen) * I**-0.5
    used = torch.randperm(E, generator=gen)[: E - num_idle]
    scores = torch.rand(T, len(used), generator=gen)
    ids = used[scores.topk(K, dim=-1).indices]
    weights = torch.rand(T, K, generator=gen).softmax(-1)
    to = {"device": device}
    return (
        x.to(dtype=dtype, **to),
        w_gate_up.to(dtype=dtype, **to),
        w_down.to(dtype=dtype, **to),
        ids.to(**to),
        weights.to(dtype=dtype, **to),
    )


def check(T, shapes, dtype, device, ids_dtype=torch.int64, num_idle=3):
    x, wgu, wd, ids, w = make_case(T, *shapes, dtype, device, seed=T, num_idle=num_idle)
    ids = ids.to(ids_dtype)
    out = moe.fused_moe(x, wgu, wd, ids, w)
    ref = reference.fused_moe(x.double(), wgu.double(), wd.double(), ids, w.double())
    assert out.shape == x.shape and out.dtype == dtype
    assert not out.isnan().any(), "some output rows were not written"
    assert rel_err(out, ref) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 7, 64, 130])
def test_matches_reference(device, poisoned, dtype, T):
    check(T, SMALL, dtype, device)


@pytest.mark.parametrize("path_pairs", [0, 1 << 30], ids=["prefill", "decode"])
def test_both_paths_at_a_few_tokens(device, poisoned, monkeypatch, path_pairs):
    monkeypatch.setattr(moe, "DECODE_MAX_PAIRS", path_pairs)
    check(7, SMALL, torch.float32, device, ids_dtype=torch.int32)


def test_all_tokens_on_one_expert(device, poisoned):
    E, H, I, _ = SMALL
    check(130, (E, H, I, 1), torch.float32, device, num_idle=E - 1)


def test_dispatcher_runs_the_kernel(device, monkeypatch):
    saved = kernels.get_backend()
    try:
        kernels.set_backend("triton")
        assert kernels.implementation("fused_moe", device) is moe.fused_moe
        x, wgu, wd, ids, w = make_case(9, *SMALL, torch.float32, device)
        out = kernels.fused_moe(x, wgu, wd, ids, w)
    finally:
        kernels.set_backend(saved)
    torch.testing.assert_close(out, reference.fused_moe(x, wgu, wd, ids, w), rtol=1e-5, atol=1e-6)


def test_rejects_mismatched_shapes(device):
    x, wgu, wd, ids, w = make_case(3, *SMALL, torch.float32, device)
    with pytest.raises(ValueError, match="does not fit"):
        moe.fused_moe(x, wgu, wd[:, :, :-1], ids, w)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Qwen3.5-35B-A3B shapes need a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 32, 300, 2048])
def test_qwen35_35b_a3b_shapes(device, poisoned, dtype, T):
    check(T, QWEN35_35B_A3B, dtype, device, num_idle=16)


PROGRAMS = 3


def _skewed_prefill(device, monkeypatch):
    """24 tokens, top-2 of 8 experts: expert 0 takes every token (2 tiles of 16 rows), expert 1
    one, experts 2-4 the rest, 5-7 none: 6 real tiles of the 11 the grid is sized for."""
    monkeypatch.setattr(moe, "DECODE_MAX_PAIRS", 0)
    x, wgu, wd, ids, w = make_case(24, 8, 36, 40, 2, torch.float32, device)
    ids = torch.stack([torch.zeros(24), torch.arange(24) % 3 + 2], dim=1).long()
    ids[5, 1] = 1
    return [moe.fused_moe(x, wgu, wd, ids.to(device), w)]


def _decode_1_to_4(device, monkeypatch):
    outs = []
    for T in (1, 2, 3, 4):
        x, wgu, wd, ids, w = make_case(T, 8, 33, 20, 2, torch.bfloat16, device, seed=T,
                                       num_idle=0)
        outs.append(moe.fused_moe(x, wgu, wd, ids, w))
    return outs


def _run(case, device, per_core, monkeypatch):
    """The case's outputs, every buffer fused_moe filled, and each launch's grid and LOOP, with
    one core of `per_core` programs (None: one program per item, as on CUDA; nothing in moe
    but the grids reads the core count)."""
    grids, buffers = [], []

    def spy(kernel, grid, *args, **kwargs):
        grids.append((grid, kwargs["LOOP"]))
        hw.launch(kernel, grid, *args, **kwargs)

    def empty(*shape, dtype=None, device=None):
        t = torch.empty(*shape, dtype=dtype, device=device)
        buffers.append(t.fill_(float("nan") if t.is_floating_point() else -1))
        return t

    monkeypatch.setattr(moe, "launch", spy)
    monkeypatch.setattr(moe, "_empty", empty)
    monkeypatch.setattr(hw, "ITEM_PROGRAMS_PER_CORE", {"cuda": per_core, "other": per_core})
    monkeypatch.setattr(hw, "num_cores", lambda device: 1)
    return case(device, monkeypatch) + buffers, grids


@pytest.mark.parametrize("case", [_skewed_prefill, _decode_1_to_4], ids=["prefill", "decode"])
def test_programs_looping_over_items_compute_what_one_program_per_item_does(
    case, device, monkeypatch
):
    whole, item_launches = _run(case, device, None, monkeypatch)
    looped, launches = _run(case, device, PROGRAMS, monkeypatch)
    item_grids, grids = [g for g, _ in item_launches], [g for g, _ in launches]
    assert all(len(g) == 1 for g in item_grids + grids)  # one grid axis: the items are in the loop
    assert [g[0] for g in grids] == [min(g[0], PROGRAMS) for g in item_grids]
    assert max(g[0] for g in item_grids) >= 3 * PROGRAMS  # programs did loop, several times
    # both forms of the kernels ran: each loops where it has fewer programs than items
    assert not any(loop for _, loop in item_launches)
    assert [loop for _, loop in launches] == [g[0] > PROGRAMS for g in item_grids]
    for a, b in zip(whole, looped, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
