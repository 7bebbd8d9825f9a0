"""`kernels` dispatches every op to the right implementation, with the reference's contract.

Proves: each public op has its reference's name and parameters; "auto" runs the reference on
CPU tensors and Triton on cuda/npu; `set_backend` and `STATECHAT_KERNELS` override it and bad
names fail with a clear error; the "triton" backend really runs the kernels (CPU tensors under
the interpreter) with the reference's results; a GDN kernel module that does not exist yet
falls back to the reference, while a broken one raises.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import pytest
import torch

import kernels
from kernels import reference

OPS = [
    "add_rmsnorm_linear",
    "add_rmsnorm_logits",
    "advance_decode_inputs",
    "causal_conv1d",
    "causal_conv1d_update",
    "chunk_gdn",
    "copy_slots",
    "fused_moe",
    "gated_rmsnorm",
    "gated_rmsnorm_linear",
    "linear",
    "paged_attention",
    "qk_norm_rope_store",
    "recurrent_gdn",
    "rmsnorm",
    "store_kv",
]


@pytest.fixture
def backend():
    """Restore the backend (and the loaded Triton ops) after the test."""
    saved, ops = kernels.get_backend(), dict(kernels._triton_ops)
    yield kernels.set_backend
    kernels.set_backend(saved)
    kernels._triton_ops.clear()
    kernels._triton_ops.update(ops)


def params(fn) -> list[tuple[str, object]]:
    sig = inspect.signature(fn, follow_wrapped=False)
    return [(p.name, p.default) for p in sig.parameters.values()]


@pytest.mark.parametrize("name", OPS)
def test_ops_keep_the_reference_contract(name):
    op, ref = getattr(kernels, name), getattr(reference, name)
    assert op.__name__ == name and params(op) == params(ref)
    assert op.__doc__ == ref.__doc__
    assert kernels.CHUNK == reference.CHUNK and kernels.Checkpoints is reference.Checkpoints


@pytest.mark.parametrize("name", [n for n in OPS if "gdn" not in n])
def test_triton_launchers_keep_the_reference_parameters(name):
    pytest.importorskip("triton")
    fn = kernels.implementation(name, "cuda")
    assert fn is not getattr(reference, name)
    assert params(fn) == params(getattr(reference, name))


def test_auto_picks_by_device(backend):
    backend("auto")
    assert kernels.implementation("rmsnorm", "cpu") is reference.rmsnorm
    pytest.importorskip("triton")
    from kernels import norms

    assert kernels.implementation("rmsnorm", "cuda") is norms.rmsnorm
    assert kernels.implementation("rmsnorm", "meta") is reference.rmsnorm


def test_backend_overrides(backend):
    backend("reference")
    assert kernels.implementation("paged_attention", "cuda") is reference.paged_attention
    pytest.importorskip("triton")
    backend("triton")
    from kernels import attention

    assert kernels.implementation("paged_attention", "cpu") is attention.paged_attention


def test_triton_backend_runs_the_kernel(backend, device):
    pytest.importorskip("triton")
    backend("triton")
    x, w = torch.randn(6, 32, device=device), torch.randn(32, device=device)
    out = kernels.rmsnorm(x, w, 1e-6)
    torch.testing.assert_close(out, reference.rmsnorm(x, w, 1e-6), rtol=1e-5, atol=1e-6)


def test_bad_backend_names_fail_clearly(backend):
    with pytest.raises(ValueError, match="unknown kernel backend 'cuda'"):
        backend("cuda")
    env = {**os.environ, "STATECHAT_KERNELS": "fast"}
    run = subprocess.run(
        [sys.executable, "-c", "import kernels"],
        check=False,
        env=env,
        capture_output=True,
        text=True,
    )
    assert run.returncode != 0 and "unknown kernel backend 'fast'" in run.stderr


def test_environment_variable_sets_the_backend():
    env = {**os.environ, "STATECHAT_KERNELS": "reference"}
    code = "import kernels; print(kernels.get_backend())"
    run = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert run.stdout.strip() == "reference"


def test_missing_gdn_module_falls_back_but_broken_module_raises(backend, monkeypatch, tmp_path):
    backend("triton")
    monkeypatch.setitem(kernels._TRITON_MODULES, "chunk_gdn", "kernels.gdn_chunk_not_written")
    monkeypatch.setattr(
        kernels, "_OPTIONAL_MODULES", frozenset({"kernels.gdn_chunk_not_written", "broken_gdn"})
    )
    kernels._triton_ops.clear()
    assert kernels.implementation("chunk_gdn", "cuda") is reference.chunk_gdn

    (tmp_path / "broken_gdn.py").write_text("import a_dependency_that_is_not_installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(kernels._TRITON_MODULES, "chunk_gdn", "broken_gdn")
    kernels._triton_ops.clear()
    with pytest.raises(ModuleNotFoundError, match="a_dependency_that_is_not_installed"):
        kernels.implementation("chunk_gdn", "cuda")
