"""A restore that gives up (no room on the device for the blocks it would load, or a blob that
fails) gives back the cached blocks it took as a finished request does: the chain's last one
first, so the LRU then evicts the chain from its tail and the blocks left still resume a prefix.
It gave them back first-first: the next allocation evicted the chain's first block, and every
other cached block of the chain was then of no use."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest

from statechat.cache.blobs import BlobError
from statechat.cache.store import Lookup
from statechat.engine.cost import DEVICE, DISK
from statechat.engine.pool import BlockPool, SlotPool
from statechat.engine.prefix import PrefixCache

CHAIN = [bytes([i]) * 32 for i in range(5)]  # a prompt's 5 block hashes: 3 on the device


def cached_chain(num_free: int) -> PrefixCache:
    """A prefix cache whose device pool holds CHAIN's first 3 blocks, cached and unreferenced
    (given back by their request last first), 3 blocks in use and `num_free` free."""
    blocks = BlockPool(6 + num_free)
    chain = [blocks.allocate() for _ in range(3)]
    for block, h in zip(chain, CHAIN):
        blocks.register(block, h)
    for block in reversed(chain):
        blocks.release(block)
    for _ in range(3):
        blocks.allocate()  # (another request's)
    return PrefixCache(blocks, SlotPool(4), None, None, 64, 1, 1, 1e-6)


def device_prefix(pc: PrefixCache) -> int:
    """How many of CHAIN's first blocks the device still holds (a lookup resumes from them)."""
    n = 0
    while n < len(CHAIN) and pc.blocks.lookup(CHAIN[n]) is not None:
        n += 1
    return n


def test_a_restore_with_no_room_gives_back_the_chain_from_its_tail():
    pc = cached_chain(1)  # (1 block free: no room for the 2 from disk)
    seq = SimpleNamespace(cache_plan={}, block_table=[])
    assert pc._restore(seq, CHAIN, [DEVICE] * 3 + [DISK] * 2, Lookup({}, {})) == 0
    assert seq.cache_plan["no_room"]
    pc.blocks.allocate()
    pc.blocks.allocate()  # (the free block, then one cached block evicted)
    assert device_prefix(pc) == 2


def test_a_failed_load_gives_back_the_chain_from_its_tail():
    pc = cached_chain(2)  # (room for the 2 from disk)

    def unusable(_hashes):
        raise BlobError("checksum mismatch")

    pc.store = SimpleNamespace(reading=contextlib.nullcontext, load_blocks=unusable,
                               host=SimpleNamespace(has=lambda *_: True))
    seq = SimpleNamespace(cache_plan={}, block_table=[])
    with pytest.raises(BlobError):
        pc._restore(seq, CHAIN, [DEVICE] * 3 + [DISK] * 2, Lookup({}, {}))
    for _ in range(3):
        pc.blocks.allocate()  # (the 2 free blocks, then one cached block evicted)
    assert device_prefix(pc) == 2
