"""The Triton per-head RMSNorm + rotary embedding computes what the torch reference does, and the
fused q/k norm + rotary + KV store writes exactly what the three separate kernels write.

Checked against a float64 oracle. In bf16 the kernel rounds where the reference rounds, but it
is not bit-identical to the bf16 reference on a GPU (an H100 showed 1-ulp differences in many
entries, cause not pinned down), so no bitwise check against the reference is made here; the
fused op is compared bit for bit with `rmsnorm_rope` twice and `store_kv`.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels import reference
from kernels.rope import qk_norm_rope_store, rmsnorm_rope
from kernels.slots import store_kv

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
EPS = 1e-6


def tables(T: int, R: int, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.randint(0, 40000, (T,), device=device).float()
    inv = 1.0 / (1e7 ** (torch.arange(0, R, 2, device=device).float() / R))
    emb = torch.cat([pos[:, None] * inv, pos[:, None] * inv], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("H", "D", "R"), [(3, 64, 16), (2, 32, 32), (4, 256, 64)])
def test_rmsnorm_rope(device, dtype, H, D, R):
    T = 7
    x = (torch.randn(T, H, 2 * D, device=device) * 2).to(dtype)[..., :D]  # q sliced from q+gate
    weight = (0.4 * torch.randn(D, device=device)).to(dtype)
    cos, sin = tables(T, R, dtype, device)
    out = rmsnorm_rope(x, weight, cos, sin, EPS)
    ref = reference.rmsnorm_rope(x.double(), weight.double(), cos.double(), sin.double(), EPS)
    assert out.shape == (T, H, D) and out.dtype == dtype and out.is_contiguous()
    assert ((out.double() - ref).abs().max() / ref.abs().max()).item() <= TOL[dtype]


def test_rejects_odd_rotary_width(device):
    cos = torch.zeros(2, 5, device=device)
    with pytest.raises(ValueError, match="R even"):
        x, weight = torch.randn(2, 1, 8, device=device), torch.zeros(8, device=device)
        rmsnorm_rope(x, weight, cos, cos, EPS)


def attention_inputs(T: int, Hq: int, Hkv: int, D: int, R: int, dtype, device) -> dict:
    """q and k sliced out of one projection as `Attention.mix` does, v with other strides, the
    norms' weights, rotary tables, poisoned caches (NaN where this step writes) and slots with
    two tokens skipped."""
    num_blocks, block_size = 3, 8
    proj = (torch.randn(T, 2 * Hq * D + Hkv * D, device=device) * 2).to(dtype)
    qg, k = proj.split([2 * Hq * D, Hkv * D], dim=-1)
    v = torch.randn(T, Hkv, D + 8, device=device).to(dtype)[..., :D]
    rest = torch.randperm(num_blocks * block_size - 1, device=device)[: T - 1] + 1
    slots = torch.cat([rest.new_zeros(1), rest])  # slot 0 is a real slot too
    slots[[1, T - 2]] = -1
    k_cache = torch.randn(num_blocks, block_size, Hkv, D, device=device).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, Hkv, D, device=device).to(dtype)
    for cache in (k_cache, v_cache):
        cache.view(-1, Hkv, D)[slots[slots >= 0]] = float("nan")
    cos, sin = tables(T, R, dtype, device)
    return {
        "q": qg.view(T, Hq, 2 * D)[..., :D],
        "k": k.view(T, Hkv, D),
        "v": v,
        "q_weight": (0.4 * torch.randn(D, device=device)).to(dtype),
        "k_weight": (0.4 * torch.randn(D, device=device)).to(dtype),
        "cos": cos,
        "sin": sin,
        "eps": EPS,
        "k_cache": k_cache,
        "v_cache": v_cache,
        "slot_mapping": slots,
    }


def fresh(args: dict, dtype: torch.dtype | None = None) -> dict:
    """args with caches of their own; with dtype, every float tensor cast to it."""
    out = dict(args)
    for name, t in args.items():
        if dtype is not None and isinstance(t, torch.Tensor) and t.is_floating_point():
            out[name] = t.to(dtype)
    out["k_cache"], out["v_cache"] = out["k_cache"].clone(), out["v_cache"].clone()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("Hq", "Hkv", "D", "R"), [(3, 1, 32, 32), (4, 2, 64, 16), (8, 2, 256, 64)])
def test_qk_norm_rope_store_matches_the_three_ops(device, dtype, Hq, Hkv, D, R):
    args = attention_inputs(7, Hq, Hkv, D, R, dtype, device)
    fused = fresh(args)
    q_out = qk_norm_rope_store(**fused)

    apart = fresh(args)
    q_rot, k_rot = (
        rmsnorm_rope(apart[x], apart[f"{x}_weight"], apart["cos"], apart["sin"], EPS)
        for x in ("q", "k")
    )
    store_kv(k_rot, apart["v"], apart["k_cache"], apart["v_cache"], apart["slot_mapping"])
    assert q_out.shape == (7, Hq, D) and q_out.dtype == dtype and q_out.is_contiguous()
    assert torch.equal(q_out, q_rot)
    for name in ("k_cache", "v_cache"):
        assert not fused[name].isnan().any()
        assert torch.equal(fused[name], apart[name]), name

    oracle = fresh(args, torch.float64)
    q_ref = reference.qk_norm_rope_store(**oracle)
    for got, want in ((q_out, q_ref), (fused["k_cache"], oracle["k_cache"])):
        assert ((got.double() - want).abs().max() / want.abs().max()).item() <= TOL[dtype]
    assert torch.equal(fused["v_cache"].double(), oracle["v_cache"])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"slot_mapping": lambda a: a["slot_mapping"].int()}, "int64"),
        (
            {"q": lambda a: a["q"][..., :16], "q_weight": lambda a: a["q_weight"][:16]},
            "heads must have one size",
        ),
        (
            {
                "k_cache": lambda a: a["k_cache"][:, :, :1].contiguous(),
                "v_cache": lambda a: a["v_cache"][:, :, :1].contiguous(),
            },
            "does not fit cache",
        ),
        ({"v": lambda a: a["v"][:, :1]}, "expects k, v"),
        ({"cos": lambda a: a["cos"][:, :5], "sin": lambda a: a["sin"][:, :5]}, "R even"),
        ({"k_weight": lambda a: a["k_weight"][:16]}, "weight must be"),
    ],
)
def test_qk_norm_rope_store_rejects_bad_inputs(device, change, message):
    args = attention_inputs(5, 2, 2, 32, 16, torch.float32, device)
    args.update({name: make(args) for name, make in change.items()})
    with pytest.raises(ValueError, match=f"qk_norm_rope_store.*{message}"):
        qk_norm_rope_store(**args)
