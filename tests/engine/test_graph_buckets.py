"""The prefill graphs' buckets cover every chunk the scheduler can cut, with little padding."""

from __future__ import annotations

import pytest

from kernels import CHUNK
from statechat.engine.prefill_graphs import LARGE_BUCKET_STEP, PREFILL_BUCKETS, prefill_buckets


@pytest.mark.parametrize("budget", [64, 100, 1984, 2048, 4096, 5000, 8192, 16384])
def test_buckets_cover_every_chunk_up_to_the_budget(budget):
    sizes = prefill_buckets(budget)
    assert sizes == sorted(set(sizes)) and all(b % CHUNK == 0 for b in sizes)
    for n in range(1, budget + 1):
        b = next(b for b in sizes if n <= b - CHUNK)  # a bucket holds n plus one padding block
        if n > PREFILL_BUCKETS[-1]:  # past the fixed buckets: at most 1.5 steps (the last
            # gap, before the budget's own bucket) and a block
            assert b - n <= LARGE_BUCKET_STEP * 3 // 2 + CHUNK
    # a chunk of the whole budget (the common chunk of a long prompt) pads by one block at most
    full = -(-budget // CHUNK) * CHUNK
    assert sizes[-1] == full + CHUNK
    assert ([b for b in sizes[:-1] if b <= PREFILL_BUCKETS[-1]]
            == [b for b in PREFILL_BUCKETS if b < sizes[-1]])
