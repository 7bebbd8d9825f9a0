"""The GDN kernels run on persistent grids and compute the same bits however many work items
each program takes.

DESIGN.md asks for grids sized from the device's core count, each program looping over the
work. `chunk_gdn`'s three kernels (prepare and output over (chunk, value head[, V tile]) items,
state over (sequence, value head, V tile) items) and `recurrent_gdn`'s decode kernel launch
`kernels.hw.persistent_grid` programs in one of two forms of one source: one program per item
on the kernels' own grid axes (`LOOP` off, CUDA's) or programs looping on one axis. Each op
runs twice here: with a core count so large that every program takes one item, and with one
core of 3 programs, so that programs loop several times over items that do not divide evenly
(and, in the prepare and output kernels, programs past the real chunks of a varlen batch take
none). The outputs and every state slot (destinations, checkpoints, an in-place sequence, the
untouched rest) must be bit-identical, and the second run must hold no grid above 3 programs.
Only the grid and its form may change between the runs: the other launch options (tiles,
warps) must be equal.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels import gdn_chunk, gdn_recurrent, hw, reference

PROGRAMS = 3
H, HV, K, V = 2, 4, 16, 32
LENGTHS = [130, 1, 64, 63, 0]  # the last only pads, as a prefill graph's does


def _i32(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


def _gates(T, device):
    return {
        "q": torch.randn(T, H, K, device=device), "k": torch.randn(T, H, K, device=device),
        "v": torch.randn(T, HV, V, device=device), "a": 2 * torch.randn(T, HV, device=device),
        "b": 2 * torch.randn(T, HV, device=device),
        "A_log": torch.rand(HV, device=device) * 2 - 1.5, "dt_bias": torch.randn(HV, device=device),
    }


def _ops(device):
    """chunk_gdn over a varlen batch (null and real sources, an in-place sequence, checkpoints
    at every boundary) and then a decode step of 5 sequences, slot 0 among their sources."""
    cu = [0]
    for n in LENGTHS:
        cu.append(cu[-1] + n)
    pool = torch.randn(20, HV, K, V, device=device)
    pool[0] = float("nan")  # the null slot: reading it would show
    targets = [(i, bd) for i, n in enumerate(LENGTHS) for bd in range(64, n + 1, 64)]
    checkpoints = reference.Checkpoints(
        seq=_i32([i for i, _ in targets], device), boundary=_i32([b for _, b in targets], device),
        slot=_i32(range(11, 11 + len(targets)), device),
    )
    out = gdn_chunk.chunk_gdn(
        **_gates(cu[-1], device), state_pool=pool, cu_seqlens=_i32(cu, device),
        src_slots=_i32([0, 2, 3, 0, 5], device), dst_slots=_i32([6, 7, 3, 8, 9], device),
        checkpoints=checkpoints,
    )
    chunk_pool = pool.clone()
    decoded = gdn_recurrent.recurrent_gdn(
        **_gates(5, device), state_pool=pool, src_slots=_i32([6, 0, 7, 11, 0], device),
        dst_slots=_i32([6, 15, 16, 17, 18], device),
    )
    return out, chunk_pool, decoded, pool


def _run(device, cores, monkeypatch):
    """The ops' results and each launch's (kernel, grid, options), with `cores` cores of
    PROGRAMS programs each for the grids; the tile and warp choices see 64 cores either way."""
    launches = []

    def spy(kernel, grid, *args, **kwargs):
        launches.append((kernel, grid, kwargs))
        hw.launch(kernel, grid, *args, **kwargs)

    for module in (gdn_chunk, gdn_recurrent):
        monkeypatch.setattr(module, "launch", spy)
    monkeypatch.setattr(hw, "ITEM_PROGRAMS_PER_CORE", {"cuda": PROGRAMS, "other": PROGRAMS})
    monkeypatch.setattr(hw, "num_cores", lambda device: cores)
    # gdn_chunk's own core count (the state tile, the prepare kernel's warps) stays fixed: at
    # 64 cores the state kernel takes the fine tile, 2 V tiles of 16
    monkeypatch.setattr(gdn_chunk, "num_cube_cores", lambda device: 64)
    monkeypatch.setitem(gdn_chunk.CONFIG["output"], "BV", 16)  # 2 V tiles there too
    torch.manual_seed(0)
    return _ops(device), launches


def test_gdn_programs_looping_over_items_compute_what_one_program_per_item_does(
    device, monkeypatch
):
    whole, item_launches = _run(device, 10**6, monkeypatch)
    looped, launches = _run(device, 1, monkeypatch)
    kernels = [gdn_chunk._gdn_prepare_kernel, gdn_chunk._gdn_state_kernel,
               gdn_chunk._gdn_output_kernel, gdn_recurrent._gdn_recurrent_kernel]
    assert [k for k, _, _ in launches] == [k for k, _, _ in item_launches] == kernels
    assert [kw.pop("LOOP") for _, _, kw in item_launches] == [False] * 4  # one per item
    assert [kw.pop("LOOP") for _, _, kw in launches] == [True] * 4
    assert [kw for _, _, kw in launches] == [kw for _, _, kw in item_launches]  # same tiles
    # one program per item, on the kernels' own axes: 9 chunks (T // 64 + N, 6 real) x 4 heads
    # [x 2 V tiles], 5 x 4 (sequence, head) x 2 tiles of state; 5 x 4 x 2 items of decode
    assert [g for _, g, _ in item_launches] == [(9, 4), (20, 2), (9, 8), (40,)]
    assert [g for _, g, _ in launches] == [(PROGRAMS,)] * 4
    for a, b in zip(whole, looped, strict=True):  # the same bits (NaN payloads, signed zeros)
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    out, chunk_pool, decoded, pool = looped
    assert torch.isfinite(out).all() and torch.isfinite(decoded).all()
    assert torch.isfinite(chunk_pool[1:]).all() and torch.isfinite(pool[1:]).all()
