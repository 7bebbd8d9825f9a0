"""The device-tier pools are plain bookkeeping: cached blocks and checkpoints outlive their
users until memory is needed, least recently used first, and pinned ones are never evicted."""

from __future__ import annotations

from statechat.engine.pool import BlockPool, SlotPool


def test_cached_blocks_are_evicted_lru_only_when_needed():
    pool = BlockPool(3)
    a, b = pool.allocate(), pool.allocate()
    pool.register(a, b"ha")
    pool.register(b, b"hb")
    pool.release(a)
    pool.release(b)  # both cached, unreferenced; a is older
    assert pool.num_available == 3 and pool.lookup(b"ha") == a
    pool.acquire(pool.lookup(b"ha"))  # a is in use again
    c = pool.allocate()  # the never-used block first
    d = pool.allocate()  # then the LRU cached one: b (a is referenced)
    assert c not in (a, b) and d == b
    assert pool.lookup(b"hb") is None and pool.lookup(b"ha") == a


def test_duplicate_registration_keeps_the_first_block():
    pool = BlockPool(2)
    a, b = pool.allocate(), pool.allocate()
    pool.register(a, b"h")
    pool.register(b, b"h")
    assert pool.lookup(b"h") == a
    pool.release(b)
    assert pool.num_available == 1  # b was private: back to the free list


def test_pinned_checkpoints_survive_and_slot_zero_is_never_handed_out():
    slots = SlotPool(4)  # slots 1..3
    s1, s2, s3 = slots.allocate(), slots.allocate(), slots.allocate()
    assert 0 not in (s1, s2, s3) and slots.allocate() is None
    assert slots.register(b"x", s1, 64) and slots.register(b"y", s2, 128)
    assert not slots.register(b"x", s3, 64)  # one checkpoint per boundary: s3 is freed
    pinned = slots.acquire(b"x")
    assert slots.allocate() == s3
    assert slots.allocate() == s2 and not slots.has(b"y")  # the unpinned checkpoint goes
    assert slots.allocate() is None and slots.has(b"x")  # the pinned one stays
    slots.unpin(pinned)
    assert slots.allocate() == s1 and not slots.has(b"x")
