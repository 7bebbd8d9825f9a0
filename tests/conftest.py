"""Shared fixtures: tiny Qwen3.5 checkpoints written with transformers' own classes."""

from __future__ import annotations

import os

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's interpreter, which triton reads when a kernel
# is decorated: set here, before any test module (an engine test that warms up, say) imports
# one. (tests/kernels/conftest.py says more.)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.helpers import make_tiny

# Tiny models on a shared 2-core machine: one intra-op thread is far faster than two that
# spin against each other (and against the other tests' processes).
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, object]:
    """float32 tiny checkpoints: multimodal layout (one file) and text layout (sharded, tied)."""
    base = tmp_path_factory.mktemp("tiny")
    return {
        "qwen3_5": make_tiny(base / "mm", layout="qwen3_5", dtype="float32"),
        "qwen3_5_text": make_tiny(base / "text", layout="qwen3_5_text", dtype="float32",
                                  shard_size="200KB", tie=True, seed=1),
    }


@pytest.fixture(scope="session")
def engine_device() -> str:
    """Where engine tests that do not name a device run: the GPU when there is one (so the lent
    machine runs them through the Triton kernels and graphs), else the CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
