"""The row kernels run on persistent grids and compute the same bits however many items each
program takes.

DESIGN.md asks for grids sized from the device's core count, each program looping over the
work (on Ascend every program beyond the cores is another round of launches). The norms, rope,
`silu_mul`, the slot kernels and conv1d's decode and window kernels launch
`kernels.hw.persistent_programs` programs: one per work item up to ROW_PROGRAMS_PER_CORE x
cores, program p then taking items p, p + P, p + 2P, ...; conv1d's prefill launches
`kernels.hw.persistent_grid`'s (ITEM_PROGRAMS_PER_CORE), in its looping form when it has
fewer programs than items. Here each op runs twice: with a core
count so large that every program takes one item (the grids of before), and with one core of 3
programs, so that programs loop several times over items that do not divide evenly. Outputs,
and the slots and caches written, must be bit-identical, and the second run must hold no grid
above 3 programs.
"""

from __future__ import annotations

import pytest
import torch

from kernels import activation, conv1d, hw, norms, rope, slots
from tests.kernels.test_program_cap import conv_ops
from tests.kernels.test_rope import attention_inputs

MODULES = (activation, conv1d, norms, rope, slots)
PROGRAMS = 3


def _i32(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


def _norms(device):
    x, res = (torch.randn(150, 32, device=device) for _ in range(2))
    w = torch.randn(32, device=device)
    heads, gate = torch.randn(30, 4, 32, device=device), torch.randn(30, 8, 32, device=device)
    return (norms.rmsnorm(x, w, 1e-6), *norms.add_rmsnorm(x, res, w, 1e-6),
            norms.gated_rmsnorm(heads, gate[:, 2:6], w, 1e-6))  # a strided [T, H, D] gate


def _rope(device):
    heads = torch.randn(40, 4, 32, device=device)
    cos, sin = (torch.randn(40, 8, device=device) for _ in range(2))
    args = attention_inputs(24, 6, 2, 32, 32, torch.float32, device)  # 9 q blocks, 3 k ones
    q_out = rope.qk_norm_rope_store(**args)
    return rope.rmsnorm_rope(heads, heads[0, 0], cos, sin, 1e-6), q_out, args["k_cache"], \
        args["v_cache"]


def _silu_and_slots(device):
    out = activation.silu_mul(torch.randn(7, 2 * 1100, device=device))  # 2 column tiles a row
    pool = torch.randn(14, 3, 1000, device=device)  # 2 blocks of 2,048 a slot
    slots.copy_slots(pool, _i32([1, 2, 3, 4, 5, 6], device), _i32([12, 8, 7, 9, 11, 10], device))
    k, v = (torch.randn(10, 2, 8, device=device) for _ in range(2))
    k_cache, v_cache = (torch.zeros(3, 8, 2, 8, device=device) for _ in range(2))
    slot_mapping = torch.tensor([0, 3, -1, 5, 9, 10, 11, 20, -1, 23], device=device)
    slots.store_kv(k, v, k_cache, v_cache, slot_mapping)
    B = 2600  # 6 blocks of 512 rows
    tokens, ids, positions = (torch.randint(0, 1000, (B,), device=device) for _ in range(3))
    slot_mapping = torch.randint(-1, 9000, (B,), device=device)
    ctx = (positions + 1).to(torch.int32)
    slots.advance_decode_inputs(tokens, ids, positions, slot_mapping, ctx)
    return out, pool, k_cache, v_cache, ids, positions, slot_mapping, ctx


def _conv(device):
    return conv_ops(device, D=300)  # 2 channel tiles of 256 (3 of 128 in the prefill)


CASES = {"norms": _norms, "rope": _rope, "silu-slots": _silu_and_slots, "conv1d": _conv}


def _run(case, device, cores, monkeypatch):
    """The case's outputs and the grid of each launch, with `cores` cores of PROGRAMS each
    (on every device type)."""
    grids = []

    def spy(kernel, grid, *args, **kwargs):
        grids.append(grid)
        hw.launch(kernel, grid, *args, **kwargs)

    for module in MODULES:
        monkeypatch.setattr(module, "launch", spy)
    monkeypatch.setattr(hw, "ROW_PROGRAMS_PER_CORE", {"cuda": PROGRAMS, "other": PROGRAMS})
    monkeypatch.setattr(hw, "ITEM_PROGRAMS_PER_CORE", {"cuda": PROGRAMS, "other": PROGRAMS})
    monkeypatch.setattr(hw, "num_cores", lambda device: cores)
    torch.manual_seed(0)
    return CASES[case](device), grids


@pytest.mark.parametrize("case", CASES)
def test_programs_looping_over_items_compute_what_one_program_per_item_does(
    case, device, monkeypatch
):
    whole, item_grids = _run(case, device, 10**6, monkeypatch)
    looped, grids = _run(case, device, 1, monkeypatch)
    assert [g[0] for g in grids] == [min(g[0], PROGRAMS) for g in item_grids]
    assert all(len(g) == 1 for g in grids)  # one grid axis: the items are in the loop
    assert max(g[0] for g in item_grids) >= 3 * PROGRAMS  # programs did loop, several times
    for a, b in zip(whole, looped, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
