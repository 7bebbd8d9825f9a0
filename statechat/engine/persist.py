"""CheckpointWriter: PrefixCache's saving half. After each step, new checkpoints (with the KV
blocks before them that the disk does not hold yet) are copied to the host and queued on the
store's write-behind queue; those a full queue turns away wait in device memory, in order,
for a later step or the engine's close. It also lets the store go when its index fails.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Iterator, MutableSet
from concurrent.futures import Future
from dataclasses import dataclass

from statechat.cache import sqlite_files
from statechat.cache.store import SaveJob, StateStore
from statechat.engine.pool import BlockPool, SlotPool

log = logging.getLogger("statechat.cache")

SAVED, NO_ROOM, GONE = "saved", "no room", "gone"  # what PrefixCache._save made of a checkpoint
# flush_deferred waits for the writer's last reports (a checkpoint to queue again) while it
# finishes a job at least this often: one stuck behind another process's lock is left to close
RETRY_STALL_S = 5.0


class RecentHashes(MutableSet):
    """A set of hashes that keeps the `limit` added last, the oldest forgotten first: what the
    engine knows to be on disk, which the disk's own LRU forgets as it evicts. One forgotten
    while still on disk costs a copy that the writer then skips, or, where the device tier no
    longer holds its block, a checkpoint left unsaved (a later miss); never a wrong answer."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._hashes: dict[bytes, None] = {}  # (in the order added, the latest last)

    def __contains__(self, h: object) -> bool:
        return h in self._hashes

    def __len__(self) -> int:
        return len(self._hashes)

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._hashes)

    def add(self, h: bytes) -> None:
        self._hashes.pop(h, None)
        self._hashes[h] = None
        if len(self._hashes) > self.limit:
            del self._hashes[next(iter(self._hashes))]

    def update(self, hashes) -> None:
        for h in hashes:
            self.add(h)

    def discard(self, h: bytes) -> None:
        self._hashes.pop(h, None)

    def difference_update(self, hashes) -> None:
        for h in hashes:
            self.discard(h)

    def clear(self) -> None:
        self._hashes.clear()


@dataclass
class NewCheckpoint:
    """A checkpoint just published in the device tier, with the blocks it stands on."""

    hash: bytes
    num_tokens: int
    slot: int
    block_hashes: list[bytes]
    block_ids: list[int]
    retried: bool = False  # queued again once already, its chain found incomplete on disk


class CheckpointWriter:
    """The saving of PrefixCache (whose `__init__` sets what these read): `store`, `blocks`,
    `slots`, `runner`, `persisted`, `stored_ckpts`, `disk_checks`, `deferred`, `deferrals`,
    `unsaved`, `root` and the per-block and per-slot byte counts."""

    store: StateStore | None
    blocks: BlockPool
    slots: SlotPool
    persisted: RecentHashes
    stored_ckpts: RecentHashes
    disk_checks: list[Future]
    deferred: dict[bytes, NewCheckpoint]
    unsaved: list[tuple[NewCheckpoint, list[str], bool]]

    def persist(self, new: list[NewCheckpoint], root: bytes) -> None:
        """Copy new checkpoints (and blocks not yet persisted) to host and queue them. What the
        disk held when the request was admitted (a prefix recomputed after a restart) is neither
        copied nor queued; no lookup runs here, so a step never waits on the index (a check
        of the disk's blocks still running is applied at a later step: until then its blocks
        may be copied again, and the writer skips those already on disk). Checkpoints the full
        queue turns away wait in order, as they stand in the device tier, for a later step (or
        the engine's close) to find room; those the device tier evicts first are not saved, and
        counted (`StateStore.dropped`)."""
        if not self.disk_tier_on():
            return
        self._apply_disk_checks()
        if self.store is None:  # (a check met a failed index)
            return
        self._apply_unsaved()
        self.root = root
        lost = 0
        while self.deferred:  # the oldest first; none after the first the queue turns away
            h, ck = next(iter(self.deferred.items()))
            outcome = self._save(ck, fresh=False)
            if outcome == NO_ROOM:
                break
            del self.deferred[h]
            lost += outcome == GONE
        for ck in new:
            outcome = NO_ROOM if self.deferred else self._save(ck, fresh=True)
            if outcome == NO_ROOM:
                if not self.deferrals:
                    log.warning("statechat cache: the write queue is full; new checkpoints wait "
                                "in device memory until it has room")
                self.deferrals += 1
                self.deferred[ck.hash] = ck
            lost += outcome == GONE
        self._count_lost(lost, "left device memory before the write queue had room for them")

    def flush_deferred(self, timeout: float = 60.0) -> None:
        """Queue the checkpoints still waiting for room, waiting up to `timeout` in all for it
        (the engine closes, or drops its device tier), and those the writer's jobs still queued
        find to be worth queueing again (`_apply_unsaved`)."""
        deadline, lost = time.monotonic() + timeout, 0
        if self.store is not None and self.store.failed is None:
            self.store.flush(timeout, stall_s=RETRY_STALL_S)
            self._apply_unsaved()
        for ck in list(self.deferred.values()) if self.store is not None else []:
            wait_s = max(0.0, deadline - time.monotonic())
            lost += self._save(ck, fresh=False, wait_s=wait_s) != SAVED
        self.deferred.clear()
        self._count_lost(lost, "could not be saved (the write queue stayed full, or they left "
                               "device memory first)")

    def _count_lost(self, lost: int, why: str) -> None:
        if lost:
            self.store.dropped += lost
            log.warning("statechat cache: %d checkpoint(s) %s; %d unsaved in all", lost, why,
                        self.store.dropped)

    def _save(self, ck: NewCheckpoint, fresh: bool, wait_s: float = 0.0) -> object:
        """Queue `ck` with its blocks not yet persisted: SAVED; NO_ROOM (nothing read from the
        pools) when the queue has none for it within `wait_s`; GONE when the device tier no
        longer holds what it needs, or the job is over the queue's bound in bytes. The state
        and blocks are read where the device tier holds them now: its checkpoint's slot, and
        a block's registered copy (the same hash, the same contents), else, for a checkpoint
        of this very step (`fresh`), the sequence's own block."""
        todo = [(i, h) for i, h in enumerate(ck.block_hashes) if h not in self.persisted]
        has_ckpt = ck.hash in self.stored_ckpts
        if has_ckpt and not todo:  # (computed again: its rows on disk count as used)
            self.store.touch(ck.hash.hex())
            return SAVED
        size = len(todo) * self.bytes_per_block + (0 if has_ckpt else self.bytes_per_slot)
        if size > self.store.max_pending_bytes:
            log.warning("statechat cache: the write queue is full for a checkpoint of %d bytes "
                        "(its bound is %d); not saved", size, self.store.max_pending_bytes)
            return GONE
        if not self.store.has_room(size, wait_s):
            return NO_ROOM
        held = self.slots.checkpoints.get(ck.hash)
        ids = [self.blocks.lookup(h) for _, h in todo]
        if fresh:
            ids = [b if b is not None else ck.block_ids[i] for b, (i, _) in zip(ids, todo)]
        if (held is None and not has_ckpt) or None in ids:
            return GONE
        blocks = [(h.hex(), (ck.block_hashes[i - 1] if i else self.root).hex(), i) for i, h in todo]
        block_tensors = self.runner.read_blocks(ids) if todo else {}
        state = None if has_ckpt else self.runner.read_slot(held.slot)
        job = SaveJob(None if has_ckpt else ck.hash.hex(), ck.num_tokens, state, blocks,
                      block_tensors, ready=self.runner.snapshot_ready(), chain=ck.hash.hex(),
                      chain_blocks=[h.hex() for h in ck.block_hashes],
                      unsaved=lambda hashes, retry: self.unsaved.append((ck, hashes, retry)))
        if not self.store.save(job):
            return NO_ROOM
        self.persisted.update(h for _, h in todo)
        self.stored_ckpts.add(ck.hash)
        return SAVED

    def _apply_unsaved(self) -> None:
        """Forget, as on disk, what the writer found missing after a job (`SaveJob.unsaved`, a
        list the writer thread appends to): a failed write's blocks and checkpoint, or the
        blocks of a chain deleted under the engine (`cache clear`, an eviction), whose
        checkpoint was not indexed. A later save of the chain carries them again; such a
        checkpoint is queued again once, while device memory holds it."""
        while self.unsaved:
            ck, hashes, retry = self.unsaved.pop(0)
            for h in map(bytes.fromhex, hashes):
                self.persisted.discard(h)
                self.stored_ckpts.discard(h)
            if retry and not ck.retried and ck.hash not in self.deferred:
                ck.retried = True
                self.deferred[ck.hash] = ck

    def disk_tier_on(self) -> bool:
        """Whether the lower tiers are in use: not with no store, nor once the store's index
        has failed (in this engine or in the store's writer thread): the store is let go then."""
        if self.store is not None and self.store.failed is not None:
            self.index_failed(None)
        return self.store is not None

    def index_failed(self, error: sqlite3.DatabaseError | None) -> None:
        """The store's index failed (`error`, where this engine met it): the disk tier is off
        for the rest of the process (StateStore.give_up logs it once), and the engine goes on
        from device memory as if it had no store (its owner, the engine, still closes it)."""
        if error is not None:
            self.store.give_up(error)
        self.store = None
        self.deferred.clear()
        for check in self.disk_checks:
            check.cancel()
        self.disk_checks = []

    def _apply_disk_checks(self) -> None:
        """Mark as persisted the blocks that finished checks (`blocks_on_disk_ahead`) found."""
        running = []
        for check in self.disk_checks:
            if not check.done():
                running.append(check)
            elif not check.cancelled() and sqlite_files.is_unusable(check.exception()):
                self.index_failed(check.exception())
                return
            elif check.cancelled() or check.exception() is not None:  # (a lock held elsewhere)
                log.warning("statechat cache: could not ask the index which blocks are on disk "
                            "(%s)", "cancelled" if check.cancelled() else check.exception())
            else:
                self.persisted.update(bytes.fromhex(h) for h in check.result())
        self.disk_checks = running
