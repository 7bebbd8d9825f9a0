"""A launch split to fit the device's program limit computes what one launch computes.

Ascend's runtime takes at most 65,535 programs per launch, a limit that long prefills and large
batches pass (docs/kernels.md, Ascend section); `kernels.hw.launch` then runs the grid in pieces
along axis 0, each kernel reading its axis-0 index as `tl.program_id(0) + PID0`. Here the limit
is forced down to a few programs, so that small shapes split: every op's outputs, and the
state slots and caches it writes, are bit-identical to those of an unsplit run. `launch` itself
is checked to keep every piece within the limit and to run each program exactly once.
"""

from __future__ import annotations

import math

import pytest
import torch

from kernels import (
    activation,
    attention,
    conv1d,
    gdn_chunk,
    gdn_recurrent,
    gemv,
    hw,
    moe,
    norms,
    rope,
    sampler,
    slots,
)
from kernels.reference import Checkpoints
from tests.kernels.test_attention import make_batch
from tests.kernels.test_gdn import _inputs
from tests.kernels.test_moe import make_case
from tests.kernels.test_rope import attention_inputs
from tests.kernels.test_sampler import params_of

MODULES = (activation, attention, conv1d, gdn_chunk, gdn_recurrent, gemv, moe, norms, rope,
           sampler, slots)
CAP = 4


class FakeKernel:
    """Records the grid and PID0 of each launch."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, PID0, **kw: self.calls.append((grid, PID0))


@pytest.mark.parametrize("grid", [(1000, 3), (70_000,), (5, 2, 2), (16_385, 4)])
def test_launch_splits_along_axis_0_within_the_limit(grid, monkeypatch):
    monkeypatch.setattr(hw, "MAX_PROGRAMS", 100 if grid[0] == 1000 else 65_535)
    kernel, x = FakeKernel(), torch.zeros(1)
    hw.launch(kernel, grid, x)
    cap = hw.max_programs(x.device)
    covered = [p for piece, pid0 in kernel.calls for p in range(pid0, pid0 + piece[0])]
    assert covered == list(range(grid[0]))
    assert all(math.prod(piece) <= cap and piece[1:] == grid[1:] for piece, _ in kernel.calls)
    if math.prod(grid) <= cap:
        assert kernel.calls == [(grid, 0)]  # an unsplit launch: the grid as it was
    else:  # pieces start at multiples of 16 (one specialisation of PID0)
        assert all(pid0 % 16 == 0 for _, pid0 in kernel.calls)


def test_launch_rejects_a_grid_too_wide_beyond_axis_0(monkeypatch):
    monkeypatch.setattr(hw, "MAX_PROGRAMS", 8)
    with pytest.raises(ValueError, match="beyond its axis 0"):
        hw.launch(FakeKernel(), (2, 9), torch.zeros(1))


def _i32(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


def conv_ops(device, D: int = 64):
    """The conv's prefill (with checkpoints, over three sequences) and decode update on random
    inputs of D channels: (prefill output, update output, the pool both wrote)."""
    T, W = 200, 4
    x, weight = torch.randn(T, D, device=device), torch.randn(D, W, device=device)
    pool = torch.randn(12, W - 1, D, device=device)
    cu, src, dst = _i32([0, 70, 130, 200], device), _i32([0, 3, 5], device), _i32([1, 2, 4], device)
    ckpt = Checkpoints(_i32([0, 1, 2, 2], device), _i32([64, 60, 64, 70], device),
                       _i32([6, 7, 8, 9], device))
    out = conv1d.causal_conv1d(x, weight, pool, cu, src, dst, ckpt)
    x1 = torch.randn(6, D, device=device)
    out1 = conv1d.causal_conv1d_update(x1, weight, pool, _i32([1, 2, 4, 0, 6, 7], device),
                                       _i32([1, 2, 4, 10, 11, 3], device))
    return out, out1, pool


def _slots_and_norms(device):
    pool = torch.randn(14, 3, 5, device=device)
    slots.copy_slots(pool, _i32([1, 2, 3, 4, 5, 6], device), _i32([12, 8, 7, 9, 11, 10], device))
    x, res = torch.randn(100, 32, device=device), torch.randn(100, 32, device=device)
    w = torch.randn(32, device=device)
    return (pool, norms.rmsnorm(x, w, 1e-6), *norms.add_rmsnorm(x, res, w, 1e-6),
            activation.silu_mul(torch.randn(20, 2048, device=device)))


def _rope_store(device):
    args = attention_inputs(24, 3, 1, 32, 32, torch.float32, device)
    q_out = rope.qk_norm_rope_store(**args)
    k, v = (torch.randn(10, 2, 8, device=device) for _ in range(2))
    k_cache, v_cache = (torch.zeros(3, 8, 2, 8, device=device) for _ in range(2))
    slot_mapping = torch.tensor([0, 3, -1, 5, 9, 10, 11, 20, -1, 23], device=device)
    slots.store_kv(k, v, k_cache, v_cache, slot_mapping)
    return q_out, args["k_cache"], args["v_cache"], k_cache, v_cache


def _gdn(device):
    H, HV, K, V = 2, 4, 16, 16
    inputs = _inputs(200, H, HV, K, V, torch.float32)
    pool = torch.randn(8, HV, K, V, device=device)
    cu = _i32([0, 70, 150, 200], device)
    ckpt = Checkpoints(_i32([0, 1], device), _i32([64, 64], device), _i32([6, 7], device))
    out = gdn_chunk.chunk_gdn(**inputs, state_pool=pool, cu_seqlens=cu,
                              src_slots=_i32([0, 2, 3], device), dst_slots=_i32([1, 2, 5], device),
                              checkpoints=ckpt)
    step = {name: t for name, t in _inputs(6, H, HV, K, V, torch.float32).items()
            if name in ("q", "k", "v", "a", "b")}
    out1 = gdn_recurrent.recurrent_gdn(**step, A_log=inputs["A_log"], dt_bias=inputs["dt_bias"],
                                       state_pool=pool, src_slots=_i32([1, 2, 5, 0, 3, 4], device),
                                       dst_slots=_i32([1, 2, 5, 6, 3, 4], device))
    return out, out1, pool


def _attention(device):
    """Prefill, decode, and decode split along the keys (merged; run under a larger cap)."""
    outs = []
    for new_lens, ctx_lens in (([5, 9], [20, 9]), ([1] * 6, [40, 3, 17, 64, 9, 30]),
                               ([1] * 6, [900, 3, 170, 640, 9, 300])):
        q, k_cache, v_cache, tables, cu, ctx = make_batch(new_lens, ctx_lens, 8, 1, 16,
                                                          torch.float32, device)
        outs.append(attention.paged_attention(q, k_cache, v_cache, tables, cu, ctx, 0.25))
    return outs


def _more(device):
    """The rest: gated and per-head norms, decode inputs, penalties, candidates, the
    vocabulary-wide sampler, the MoE's sorted (prefill) path."""
    x, gate, w = (torch.randn(100, 32, device=device) for _ in range(3))
    heads = torch.randn(30, 4, 32, device=device)
    cos, sin = (torch.randn(30, 8, device=device) for _ in range(2))
    B = 2600  # 6 programs of 512 rows
    tokens, ids, positions = (torch.randint(0, 1000, (B,), device=device) for _ in range(3))
    slot_mapping = torch.randint(-1, 9000, (B,), device=device)
    ctx = (positions + 1).to(torch.int32)
    slots.advance_decode_inputs(tokens, ids, positions, slot_mapping, ctx)
    logits = torch.randn(6, 100, device=device) * 2
    rows = torch.tensor([0, 1, 2, 3, 4, 5], device=device)
    params = params_of([(0.7, 0.9, -math.inf, 1.2, 0.3, 0.5), (1.0, 0.3, -math.inf, 1, 0, 0),
                        (1.5, math.inf, math.log(0.05), 0.9, -0.2, 1.0)] * 2, device)
    counts = torch.randint(0, 3, (6, 100), dtype=torch.int32, device=device)
    in_prompt = torch.rand(6, 100, device=device) < 0.1
    values = torch.randn(6, 5, device=device).sort(dim=-1, descending=True).values
    cols = torch.stack([torch.randperm(100, device=device)[:5] for _ in range(6)])
    noise = torch.empty(6, 100, device=device).exponential_(1)
    x2, wgu, wd, ids2, w2 = make_case(40, 8, 32, 32, 2, torch.float32, device)
    return (norms.gated_rmsnorm(x, gate, w[0], 1e-6),
            rope.rmsnorm_rope(heads, w[0], cos, sin, 1e-6), ids, positions, slot_mapping, ctx,
            sampler.penalize_logits(logits, rows, rows, params, counts, in_prompt, 100),
            sampler.draw_candidates(values, cols, noise[:, :5].contiguous(), rows % 5 + 1, params),
            sampler.sample_vocabulary(logits, rows, rows, params, counts, in_prompt, noise),
            moe.fused_moe(x2, wgu, wd, ids2, w2))


def _moe_gemv_sampler(device):
    x, wgu, wd, ids, w = make_case(20, 8, 32, 32, 2, torch.float32, device)
    out = moe.fused_moe(x, wgu, wd, ids, w)
    lin = gemv.linear(torch.randn(1, 32, device=device), torch.randn(2048, 32, device=device))
    logits = torch.randn(6, 100, device=device) * 2
    rows = torch.tensor([0, 1, 2, 3, 4, 5], device=device)
    params = params_of([(0.7, 0.9, -math.inf, 1.2, 0.3, 0.5), (1.0, math.inf, -math.inf, 1, 0, 0),
                        (1.5, math.inf, math.log(0.05), 0.9, -0.2, 1.0)] * 2, device)
    noise = torch.empty(6, 3, device=device).exponential_(1)
    top_k = torch.tensor([3, 1, 2, 3, 2, 1], device=device)
    drawn = sampler.sample_top_k(logits, rows, rows, params, None, None, top_k, noise)
    scores = sampler.score_logits(logits, torch.tensor([5, 0, 99, 7, 3, 1], device=device), 2)
    return out, lin, drawn, scores


CASES = {"conv1d": conv_ops, "slots-norms-silu": _slots_and_norms, "rope-store_kv": _rope_store,
         "gdn": _gdn, "attention": _attention, "moe-gemv-sampler": _moe_gemv_sampler,
         "more": _more}


@pytest.mark.parametrize("case", CASES)
def test_split_launches_compute_what_one_launch_computes(case, device, monkeypatch):
    totals = []

    def spy(kernel, grid, *args, **kwargs):
        totals.append(math.prod(grid))
        hw.launch(kernel, grid, *args, **kwargs)

    for module in MODULES:
        monkeypatch.setattr(module, "launch", spy)
    # the attention decode below splits its keys ~20 ways (merged by a second kernel)
    monkeypatch.setitem(attention.CUDA_DECODE, "programs_per_core", 16)
    torch.manual_seed(0)
    whole = CASES[case](device)
    monkeypatch.setattr(hw, "MAX_PROGRAMS", CAP)
    monkeypatch.setattr(hw, "CUDA_MAX_PROGRAMS", CAP)
    torch.manual_seed(0)
    split = CASES[case](device)
    assert max(totals) > CAP  # some launch did split
    for a, b in zip(whole, split, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
