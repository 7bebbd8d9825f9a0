"""The Triton SwiGLU (silu_mul) computes what the torch reference does, with its rounding."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels import reference
from kernels.activation import silu_mul

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("T", "I"), [(1, 48), (37, 200), (5, 1536)])
def test_silu_mul(device, dtype, T, I):
    wide = (torch.randn(T, 2 * I + 8, device=device) * 3).to(dtype)
    x = wide[:, 8:]  # rows strided, as a slice of a wider projection
    out = silu_mul(x)
    ref = reference.silu_mul(x.double())
    assert out.shape == (T, I) and out.dtype == dtype
    assert ((out.double() - ref).abs().max() / ref.abs().max()).item() <= TOL[dtype]
    # the roundings match the reference at the same dtype (1 ulp ties aside)
    same = reference.silu_mul(x)
    assert ((out.float() - same.float()).abs() <= same.float().abs() * 2**-7 + 1e-30).all()


def test_rejects_odd_width(device):
    with pytest.raises(ValueError, match="2I"):
        silu_mul(torch.randn(3, 7, device=device))
