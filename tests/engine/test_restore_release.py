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
    seq = SimpleNamespace(cache_plan={}, block_table=[], resume_slot=0)
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
    seq = SimpleNamespace(cache_plan={}, block_table=[], resume_slot=0)
    with pytest.raises(BlobError):
        pc._restore(seq, CHAIN, [DEVICE] * 3 + [DISK] * 2, Lookup({}, {}))
    for _ in range(3):
        pc.blocks.allocate()  # (the 2 free blocks, then one cached block evicted)
    assert device_prefix(pc) == 2


class Failing(RuntimeError):
    """An error no restore expects (a device copy that fails, say): neither an index's nor a
    blob's."""


def loading_prefix(num_free: int, fail: str) -> PrefixCache:
    """cached_chain's prefix cache with a store whose blocks and checkpoint load from the host
    tier, and a runner whose copy of `fail` ("blocks" or "slot") raises Failing."""
    pc = cached_chain(num_free)
    tensors = {"x": None}
    pc.store = SimpleNamespace(
        reading=contextlib.nullcontext, host=SimpleNamespace(has=lambda *_: True),
        load_blocks=lambda hashes: [(hashes, tensors)], load_checkpoint=lambda _h: tensors,
        touch=lambda _h: None)

    def copy(what):
        def run(*_args):
            if what == fail:
                raise Failing(what)
        return run
    pc.runner = SimpleNamespace(write_blocks=copy("blocks"), write_slot=copy("slot"))
    return pc


@pytest.mark.parametrize("fail", ["blocks", "slot"])
def test_any_error_in_a_restore_gives_back_its_blocks_and_slot(fail):
    pc = loading_prefix(2, fail)
    free_blocks, free_slots = pc.blocks.num_available, pc.slots.num_available
    seq = SimpleNamespace(cache_plan={}, block_table=[], resume_slot=0)
    with pytest.raises(Failing):
        pc._restore(seq, CHAIN, [DEVICE] * 3 + [DISK] * 2, Lookup({}, {}))
    assert seq.block_table == [] and seq.resume_slot == 0
    assert pc.blocks.num_available == free_blocks
    assert pc.slots.num_available == free_slots
    assert not pc.slots.has(CHAIN[-1])  # (no checkpoint published that was never written)
    # (blocks loaded before the failure stay cached: their data is whole)
    assert device_prefix(pc) == (3 if fail == "blocks" else 5)


def test_a_restore_that_succeeds_holds_the_chain_and_pins_its_checkpoint():
    pc = loading_prefix(2, fail="")
    seq = SimpleNamespace(cache_plan={}, block_table=[], resume_slot=0, num_computed=0)
    assert pc._restore(seq, CHAIN, [DEVICE] * 3 + [DISK] * 2, Lookup({}, {})) == 5 * 64
    assert len(seq.block_table) == 5 and seq.resume_slot
    assert pc.slots.has(CHAIN[-1])
