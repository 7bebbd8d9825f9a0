"""The state caches on the CPU: zeros from the start, aligned, and resident only where used."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from statechat.model.context import ModelCaches
from statechat.model.loader import load_model


def resident_bytes() -> int:
    """This process's resident memory (statm counts pages: 4 KiB, or 16/64 KiB on some ARM)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture(scope="module")
def config(tiny_dirs):
    return load_model(tiny_dirs["qwen3_5"], dtype=torch.float32, device="cpu").config


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_caches_are_zeros_aligned_and_writable(config, dtype):
    caches = ModelCaches.allocate(config, 3, 5, 64, dtype, "cpu")
    for t in caches.conv + caches.k + caches.v:
        assert t.dtype == dtype and t.is_contiguous() and t.data_ptr() % 64 == 0
        assert not t.any()
    for t in caches.ssm:
        assert t.dtype == torch.float32 and t.data_ptr() % 64 == 0 and not t.any()
    caches.k[0][2].fill_(1)
    assert caches.k[0][2].all() and not caches.k[0][1].any() and not caches.k[1].any()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_a_cpu_cache_budget_is_not_resident_until_used(config):
    """A GiB of caches for a tiny model used to be filled with zeros at start: 0.4 s and a GiB
    of memory for every engine, before a single block was written."""
    per_block = ModelCaches.bytes_per_block(config, torch.float32, 64)
    blocks = (1 << 30) // per_block
    before = resident_bytes()
    caches = ModelCaches.allocate(config, 3, blocks, 64, torch.float32, "cpu")
    grown = resident_bytes() - before
    assert sum(t.numel() * 4 for t in caches.k + caches.v) >= (1 << 30) - per_block
    assert grown < 64 << 20, f"{grown / 2**20:.0f} MiB resident for caches not used yet"
    caches.v[0][blocks - 1].fill_(2.0)
    assert caches.v[0][blocks - 1].eq(2.0).all() and not caches.v[0][blocks - 2].any()
