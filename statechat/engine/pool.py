"""Pools of the device tier: KV blocks and GDN state slots, both prefix-cached by block hash.

Plain bookkeeping, no tensors: the runner owns the memory, these classes own the indices.

- BlockPool: fixed-size KV blocks with reference counts. A full block is registered under its
  chained hash and stays cached after its last user releases it, until its memory is needed
  (LRU eviction of unreferenced cached blocks).
- SlotPool: GDN state slots. Slot 0 is the null slot ("start from zeros") and is never handed
  out. A slot is either a sequence's working state or a checkpoint registered under the hash of
  the block boundary it holds; unreferenced checkpoints are evicted LRU when slots run out.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


class BlockPool:
    """KV block allocation with a hash -> block prefix cache."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_count = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.by_hash: dict[bytes, int] = {}
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))  # never-cached blocks
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced, LRU first

    @property
    def num_available(self) -> int:
        return len(self.free) + len(self.evictable)

    def allocate(self) -> int:
        """A block for new tokens; evicts the least recently used cached block if needed."""
        if self.free:
            block = self.free.pop()
        elif self.evictable:
            block, _ = self.evictable.popitem(last=False)
            del self.by_hash[self.hash_of[block]]
            self.hash_of[block] = None
        else:
            raise RuntimeError("no KV block available")  # callers check num_available first
        self.ref_count[block] = 1
        return block

    def lookup(self, h: bytes) -> int | None:
        return self.by_hash.get(h)

    def acquire(self, block: int) -> None:
        """Take a reference to a cached block (it leaves the eviction list)."""
        if self.ref_count[block] == 0:
            self.evictable.pop(block, None)
        self.ref_count[block] += 1

    def release(self, block: int) -> None:
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            if self.hash_of[block] is not None:
                self.evictable[block] = None
            else:
                self.free.append(block)

    def register(self, block: int, h: bytes) -> None:
        """Publish a full block under its hash (first writer wins; a duplicate stays private)."""
        if h not in self.by_hash and self.hash_of[block] is None:
            self.by_hash[h] = block
            self.hash_of[block] = h


@dataclass
class Checkpoint:
    slot: int
    num_tokens: int  # block boundary the state belongs to
    refs: int = 0  # sequences about to read it


class SlotPool:
    """GDN state slots: working states of running sequences and hash-indexed checkpoints."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.free: list[int] = list(range(num_slots - 1, 0, -1))
        self.checkpoints: dict[bytes, Checkpoint] = {}
        self.hash_of_slot: dict[int, bytes] = {}
        self.lru: OrderedDict[bytes, None] = OrderedDict()  # unreferenced checkpoints, LRU first

    @property
    def num_available(self) -> int:
        return len(self.free) + len(self.lru)

    def allocate(self) -> int | None:
        """A free slot, evicting the least recently used unreferenced checkpoint; None if none."""
        if self.free:
            return self.free.pop()
        if self.lru:
            h, _ = self.lru.popitem(last=False)
            slot = self.checkpoints.pop(h).slot
            del self.hash_of_slot[slot]
            return slot
        return None

    def release(self, slot: int) -> None:
        if slot:
            self.free.append(slot)

    def acquire(self, h: bytes) -> int:
        """Pin checkpoint `h` until `unpin`; returns its slot."""
        ckpt = self.checkpoints[h]
        ckpt.refs += 1
        self.lru.pop(h, None)
        return ckpt.slot

    def unpin(self, slot: int) -> None:
        h = self.hash_of_slot[slot]
        ckpt = self.checkpoints[h]
        ckpt.refs -= 1
        if ckpt.refs == 0:
            self.lru[h] = None  # most recently used

    def register(self, h: bytes, slot: int, num_tokens: int) -> bool:
        """Publish `slot` as the checkpoint of boundary `h`; False (slot freed) if one exists."""
        if h in self.checkpoints:
            self.release(slot)
            return False
        self.checkpoints[h] = Checkpoint(slot, num_tokens)
        self.hash_of_slot[slot] = h
        self.lru[h] = None
        return True

    def has(self, h: bytes) -> bool:
        return h in self.checkpoints
