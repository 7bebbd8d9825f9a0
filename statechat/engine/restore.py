"""PrefixRestore: PrefixCache's loading half. The prefix that `reuse` chose is put in place: its
blocks on the device taken, the rest read from the host tier or disk into new device blocks, and
its checkpoint pinned or read into a state slot; each load teaches the cost model its tier's
costs (timed from its start to its state in the pools: what the request waits for), and the
request's `cache_plan` says where the load's time went.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, wait

from statechat.cache.store import Lookup, StateStore
from statechat.engine.cost import DEVICE, DISK, HOST, CostModel
from statechat.engine.persist import RecentHashes
from statechat.engine.pool import BlockPool, SlotPool
from statechat.engine.sequence import Sequence


class PrefixRestore:
    """The loading of PrefixCache (whose `__init__` sets what these read): `store`, `blocks`,
    `slots`, `runner`, `cost`, `persisted`, `bs` and the per-block and per-slot byte counts."""

    store: StateStore | None
    blocks: BlockPool
    slots: SlotPool
    cost: CostModel
    persisted: RecentHashes
    bs: int
    bytes_per_block: int
    bytes_per_slot: int

    def _load_blocks(self, need: list[bytes], held: dict, tiers: list[str], lower: Lookup,
                     t_start: float, with_ckpt: bool) -> tuple[float, float, tuple | None]:
        """Read the lower-tier blocks `need` into their device blocks `held[h]`. A load from one
        tier teaches its rate, unless its disk blocks are read alongside the checkpoint
        (`with_ckpt`): then (bytes, cached share) is returned for one observation of both.
        Returns (read done, written, that pair)."""
        t_read = t_start
        if need:  # host-tier tensors are the store's arena: held still until copies are launched
            with self.store.reading():
                groups = self.store.load_blocks([h.hex() for h in need])
                t_read = time.perf_counter()
                for group_hashes, tensors in groups:
                    block_ids = [held[bytes.fromhex(h)] for h in group_hashes]
                    self.runner.write_blocks(block_ids, tensors)
        t_write = time.perf_counter()
        need_tiers = {t for t in tiers if t != DEVICE}
        if need and len(need_tiers) == 1:
            nbytes = len(need) * self.bytes_per_block
            resident = sum(lower.cached("kv", h.hex()) for h in need) / len(need)
            tier = need_tiers.pop()
            if tier == DISK and not lower.known("kv", [h.hex() for h in need]):
                return t_read, t_write, None  # a share estimated from a sample teaches no rate
            if with_ckpt and tier == DISK:
                return t_read, t_write, (nbytes, resident)
            self.cost.observe_load(tier, nbytes, time.perf_counter() - t_start, resident)
        return t_read, t_write, None

    def _release_held(self, held: dict[bytes, int]) -> None:
        """Give back the blocks a restore took (`held`: hash -> block, in the chain's order)
        the last first, as Scheduler._release does: the LRU then evicts the chain from its tail
        (its first block gone, the rest would be of no use)."""
        for block in reversed(held.values()):
            self.blocks.release(block)

    def _undo(self, seq: Sequence, held: dict[bytes, int], slot: list[int]) -> None:
        """A restore that raised gives back all it took (its blocks; its checkpoint's slot,
        taken or pinned), whatever the error: `seq` holds nothing, as before it began. Blocks
        already loaded and registered stay cached, and a checkpoint slot registered too."""
        self._release_held(held)
        seq.block_table = []
        if seq.resume_slot:
            self.slots.unpin(seq.resume_slot)
            seq.resume_slot = 0
        elif slot:
            self.slots.release(slot[0])

    @staticmethod
    def _no_room(seq: Sequence) -> int:
        """The device has no free blocks or state slot to load the chosen prefix into: the
        request computes its prompt, and its plan says so (not a load that never ran)."""
        seq.cache_plan.update(choice="recompute", no_room=True)
        return 0

    def _restore(self, seq: Sequence, hashes: list[bytes], tiers: list[str], lower: Lookup) -> int:
        """Take device blocks, load the rest, and pin or load the checkpoint at the end."""
        need = [h for h, t in zip(hashes, tiers) if t != DEVICE]
        ckpt_on_device = self.slots.has(hashes[-1])
        if not ckpt_on_device and not self.slots.num_available:
            return self._no_room(seq)
        held = {}  # take the device blocks first, so allocating below cannot evict them
        for h, t in zip(hashes, tiers):
            if t == DEVICE:
                held[h] = self.blocks.lookup(h)
                self.blocks.acquire(held[h])
        if len(need) > self.blocks.num_available:
            self._release_held(held)
            return self._no_room(seq)
        held.update((h, self.blocks.allocate()) for h in need)
        slot: list[int] = []  # (the checkpoint's slot, while taken but not yet registered)
        try:
            return self._load(seq, hashes, tiers, lower, need, held, ckpt_on_device, slot)
        except BaseException:  # (an unusable blob or index, and any other error alike)
            self._undo(seq, held, slot)
            raise

    def _load(self, seq: Sequence, hashes: list[bytes], tiers: list[str], lower: Lookup,
              need: list[bytes], held: dict[bytes, int], ckpt_on_device: bool,
              slot: list[int]) -> int:
        """_restore's loads into the blocks `held` it took (`need`'s from lower tiers) and the
        checkpoint's slot (kept in `slot` until registered, for _undo)."""
        t_start = time.perf_counter()
        last = hashes[-1]
        # a checkpoint on disk alone is read while the blocks are (one in the host tier is read
        # below, inside reading())
        ckpt_read = None if ckpt_on_device else self._read_ahead(last, lower)
        t_read, t_write, together = self._load_blocks_beside(need, held, tiers, lower, t_start,
                                                             ckpt_read, last)
        nbytes = len(need) * self.bytes_per_block
        for h in need:
            self.blocks.register(held[h], h)
            self.persisted.add(h)
        seq.block_table = [held[h] for h in hashes]
        ck_tier = DEVICE
        if not ckpt_on_device:
            ck_tier, t0 = self._load_checkpoint(last, len(hashes) * self.bs, ckpt_read, slot)
            self._observe_checkpoint(last, ck_tier, lower, t_start, t0, together,
                                     alone=ckpt_read is None or not need)
            nbytes += self.bytes_per_slot
        # where the load's time went: reading the blocks (lower tiers), writing them into the
        # pools, and the checkpoint (read and write)
        seq.cache_plan.update(loaded_bytes=nbytes, load_s=round(time.perf_counter() - t_start, 6),
                              blocks_read_s=round(t_read - t_start, 6),
                              blocks_write_s=round(t_write - t_read, 6),
                              ckpt_s=round(time.perf_counter() - t_write, 6))
        self._resume(seq, hashes, tiers, ck_tier)
        return seq.num_computed

    def _read_ahead(self, last: bytes, lower: Lookup) -> Future | None:
        """Begin the read of checkpoint `last` from disk, unless the host tier holds it (None):
        its cached share asked exactly (the plan may have estimated it)."""
        if self.store.host.has("ckpt", last.hex()):
            return None
        lower.ask("ckpt", last.hex())
        return self.store.read_checkpoint_ahead(last.hex())

    def _load_blocks_beside(self, need: list[bytes], held: dict[bytes, int], tiers: list[str],
                            lower: Lookup, t_start: float, ckpt_read: Future | None, last: bytes
                            ) -> tuple[float, float, tuple | None]:
        """_load_blocks while the checkpoint's read ahead (if any) runs, both from disk taught
        as one load; a failure cancels that read, or waits for it to end, before it raises."""
        try:
            return self._load_blocks(need, held, tiers, lower, t_start,
                                     ckpt_read is not None and last.hex() in lower.ckpt_blobs)
        except BaseException:
            if ckpt_read is not None and not ckpt_read.cancel():
                wait([ckpt_read])  # no second read of its blob while this one runs (a retry)
            raise

    def _load_checkpoint(self, last: bytes, num_tokens: int, ckpt_read: Future | None,
                         slot: list[int]) -> tuple[str, float]:
        """Write checkpoint `last` (read ahead, else read from the host tier or disk now) into a
        new state slot, registered at `num_tokens`: (the tier it came from, when its wait began).
        A failed read raises here, as load_checkpoint would: the blocks, now registered, are
        given back, and the caller plans again."""
        t0 = time.perf_counter()
        read = ckpt_read.result() if ckpt_read is not None else None
        with self.store.reading():
            ck_tier = (DISK if read is not None or not self.store.host.has("ckpt", last.hex())
                       else HOST)
            tensors = read if read is not None else self.store.load_checkpoint(last.hex())
            slot.append(self.slots.allocate())
            self.runner.write_slot(slot[0], tensors)
        self.slots.register(last, slot.pop(), num_tokens)
        return ck_tier, t0

    def _observe_checkpoint(self, last: bytes, ck_tier: str, lower: Lookup, t_start: float,
                            t0: float, together: tuple | None, alone: bool) -> None:
        """Teach the cost model the checkpoint's load: with the blocks when both came from disk
        (`together`: the blocks' bytes and cached share), else on its own when it was read
        alone (`alone`) from the host tier or from a blob the plan's lookup knew."""
        resident = lower.cached("ckpt", last.hex())
        if together is not None:  # blocks and checkpoint, both from disk, as one load
            total = together[0] + self.bytes_per_slot
            share = (together[0] * together[1] + self.bytes_per_slot * resident) / total
            self.cost.observe_load(DISK, total, time.perf_counter() - t_start, share)
        elif alone and (ck_tier == HOST or last.hex() in lower.ckpt_blobs):
            # read alone (one read alongside other blocks overlapped them: no rate of its
            # own); a checkpoint not in the plan's lookup has an unknown cached share
            self.cost.observe_load(ck_tier, self.bytes_per_slot, time.perf_counter() - t0,
                                   resident)

    def _resume(self, seq: Sequence, hashes: list[bytes], tiers: list[str], ck_tier: str) -> None:
        """Point `seq` at its restored prefix: its resume slot pinned (the stored rows marked
        used), its computed tokens, and where they came from."""
        last = hashes[-1]
        seq.resume_slot = self.slots.acquire(last)
        if self.store is not None:  # (its rows on disk count as used: the writer marks them)
            self.store.touch(last.hex())
        seq.num_computed = len(hashes) * self.bs
        seq.reused_from = ck_tier
        seq.reused_by_tier = {t: tiers.count(t) * self.bs for t in set(tiers)}
