"""The Triton RMSNorms compute what the torch reference does, with the reference's rounding.

Against a float64 oracle: rows of odd widths, strided rows (q sliced out of q_proj's output, as
the attention layer passes it), float32 and bf16. Against the reference at bf16 itself: the
intermediate roundings (normed x to x's dtype, weight product in the promoted dtype) match,
so the outputs are bit-identical but for rare 1-ulp ties.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels import reference
from kernels.norms import add_rmsnorm, gated_rmsnorm, rmsnorm

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
EPS = 1e-6


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


def strided_rows(T: int, H: int, D: int, dtype, device) -> torch.Tensor:
    """[T, H, D] with row stride 2D: the first half of each head of a [T, H, 2D] projection."""
    return torch.randn(T, H, 2 * D, device=device).to(dtype)[..., :D]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("strided", [False, True])
def test_rmsnorm(device, dtype, strided):
    x = (
        strided_rows(7, 3, 40, dtype, device)
        if strided
        else torch.randn(5, 6, 96, device=device).to(dtype) * 3
    )
    weight = (0.5 * torch.randn(x.shape[-1], device=device)).to(dtype)
    out = rmsnorm(x, weight, EPS)
    ref = reference.rmsnorm(x.double(), weight.double(), EPS)
    assert out.shape == x.shape and out.dtype == dtype
    assert rel_err(out, ref) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_gated_rmsnorm(device, dtype, weight_dtype):
    x = torch.randn(9, 4, 48, device=device).to(dtype)
    gate = torch.randn(9, 4, 48, device=device).to(dtype)
    weight = (1 + 0.3 * torch.randn(48, device=device)).to(weight_dtype)
    out = gated_rmsnorm(x, gate, weight, EPS)
    ref = reference.gated_rmsnorm(x.double(), gate.double(), weight.double(), EPS)
    assert out.shape == x.shape and out.dtype == dtype
    assert rel_err(out, ref) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rmsnorm_reads_a_strided_gate_in_place(device, dtype):
    """The GDN layer's z: [T, H, D] heads sliced out of a wider projection output, so its rows
    cannot be flattened without a copy; the kernel reads them where they are."""
    proj = torch.randn(9, 5 * 4 * 48 + 7, device=device).to(dtype)
    gate = proj[:, 3 : 3 + 4 * 48].reshape(9, 4, 48)  # a view: row stride 5 * 4 * 48 + 7
    assert gate.stride() == (proj.shape[1], 48, 1)
    x = torch.randn(9, 4, 48, device=device).to(dtype)
    weight = (1 + 0.3 * torch.randn(48, device=device)).to(dtype)
    out = gated_rmsnorm(x, gate, weight, EPS)
    ref = reference.gated_rmsnorm(x.double(), gate.double(), weight.double(), EPS)
    assert rel_err(out, ref) <= TOL[dtype]
    # the same numbers as the path that flattens a copy of the gate into [T * H, D] rows
    flat = gated_rmsnorm(x.reshape(-1, 48), gate.reshape(-1, 48), weight, EPS)
    assert torch.equal(out, flat.view(9, 4, 48))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rmsnorm(device, dtype):
    x = strided_rows(7, 3, 40, dtype, device)  # strided, as a layer output may be
    residual = (torch.randn(7, 3, 40, device=device) * 4).to(dtype)
    weight = (0.5 * torch.randn(40, device=device)).to(dtype)
    out, total = add_rmsnorm(x, residual, weight, EPS)
    assert out.shape == total.shape == x.shape and out.dtype == total.dtype == dtype
    # the sum is rounded to the dtype (it is the next residual); the norm starts from it
    assert torch.equal(total, x + residual)
    assert rel_err(out, reference.rmsnorm(total.double(), weight.double(), EPS)) <= TOL[dtype]
    ref_out, ref_total = reference.add_rmsnorm(x, residual, weight, EPS)
    assert torch.equal(total, ref_total)
    assert rel_err(out, ref_out.double()) <= TOL[dtype]


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_bf16_rounding_matches_reference(device, weight_dtype):
    x = torch.randn(64, 128, device=device).bfloat16()
    gate = torch.randn(64, 128, device=device).bfloat16()
    weight = (1 + 0.3 * torch.randn(128, device=device)).to(weight_dtype)
    for out, ref in (
        (gated_rmsnorm(x, gate, weight, EPS), reference.gated_rmsnorm(x, gate, weight, EPS)),
        (rmsnorm(x, weight, EPS), reference.rmsnorm(x, weight, EPS)),
    ):
        same = (out == ref).float().mean().item()
        assert same >= 0.99, f"only {same:.1%} of bf16 outputs equal the reference's"
        ulp = ref.float().abs() * 2**-7
        assert ((out.float() - ref.float()).abs() <= ulp).all()


def test_rejects_wrong_weight(device):
    with pytest.raises(ValueError, match="weight"):
        rmsnorm(torch.randn(3, 8, device=device), torch.zeros(7, device=device), EPS)
