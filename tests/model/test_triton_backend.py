"""The whole model runs on the Triton kernels (the interpreter on the CPU, the GPU in CI runs
there) and gives the reference backend's logits: prefill with a checkpoint target, a second
chunk continuing the state, and decode steps. Catches layout mismatches between the model's
tensors and the kernels' contracts (strides, dtypes) that kernel-level tests cannot see."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import kernels
from statechat.model.loader import load_model
from tests.helpers import OneSequence


def run(loaded, ids: list[int]) -> torch.Tensor:
    seq = OneSequence(loaded, max_tokens=256)
    rows = [seq.step(ids[:70], all_logits=True), seq.step(ids[70:90], all_logits=True)]
    rows += [seq.step([t]) for t in ids[90:94]]
    return torch.cat(rows)


def test_triton_backend_matches_reference(tiny_dirs):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    loaded = load_model(tiny_dirs["qwen3_5"], dtype=torch.float32, device=device)
    ids = torch.randint(0, loaded.config.vocab_size, (94,),
                        generator=torch.Generator().manual_seed(2)).tolist()
    previous = kernels.get_backend()
    try:
        kernels.set_backend("reference")
        want = run(loaded, ids)
        kernels.set_backend("triton")
        got = run(loaded, ids)
    finally:
        kernels.set_backend(previous)
    err = (got - want).abs().max().item() / want.abs().max().item()
    assert err < 1e-4, err
