"""Chained block hashes: chain_hashes gives block_hash's chain, whole or continued from a prefix."""

from __future__ import annotations

import hashlib
from array import array

import torch

from statechat.cache.hashing import block_hash, chain_hashes, int32_bytes

ROOT = hashlib.sha256(b"model").digest()


def test_chain_hashes_are_block_hashes_chained_from_the_root():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 250_000, (64 * 5 + 17,), generator=gen).tolist()
    want, parent = [], ROOT
    for i in range(5):
        block = ids[i * 64 : (i + 1) * 64]
        parent = hashlib.sha256(parent + array("i", block).tobytes()).digest()
        assert parent == block_hash(want[-1] if want else ROOT, block)
        want.append(parent)
    assert chain_hashes(ROOT, ids, 64) == want  # the partial last block gets no hash
    assert chain_hashes(ROOT, ids, 64, want[:2]) == want  # continued from known hashes
    assert chain_hashes(ROOT, ids, 64, want) == want
    assert chain_hashes(ROOT, ids[:63], 64) == []
    assert chain_hashes(ROOT, ids, 128)[0] == block_hash(ROOT, ids[:128])
    packed = int32_bytes(ids)  # the bytes a caller already has (the engine's prompt check)
    assert packed == array("i", ids).tobytes()
    assert chain_hashes(ROOT, ids, 64, packed=packed) == want
    assert chain_hashes(ROOT, ids, 64, want[:3], packed=packed) == want
    assert chain_hashes(ROOT, ids, 64, packed=packed[:-4]) == want  # not the ids' bytes: unused
