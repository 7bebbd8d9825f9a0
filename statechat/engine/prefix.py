"""PrefixCache: where a new request resumes, across the device, host and disk tiers.

On admission it finds every usable prefix (all KV blocks available in some tier and a GDN
checkpoint at its end), predicts for each the time to load what is not on the device (the load's
fixed cost plus its bytes over the tier's measured bandwidth; for disk, the page cache's costs
for the part of each blob the page cache holds and the disk's for the rest) against the time to
recompute what it saves (tokens over the measured prefill rate), and takes the cheapest, so a
hit is never slower than no hit. The plan goes in two steps: the checkpoints and the host tier
are looked up first, and a bound (every other block on disk, read at the best disk rate) decides
whether the disk's blocks are worth looking up at all; only then is the index asked about them
and the page cache about (a sample of) their blobs. It loads what it chose into the device pools
(a hit in a lower tier is promoted) and reports the plan. After each step it persists new
checkpoints, with the KV blocks before them, through the store's write-behind queue
(CheckpointWriter, persist.py). The load itself is PrefixRestore's (restore.py).
"""

from __future__ import annotations

import logging
import sqlite3
import time
from concurrent.futures import Future

from statechat.cache import sqlite_files
from statechat.cache.blobs import BlobError
from statechat.cache.store import Lookup, StateStore
from statechat.engine.cost import DEVICE, DISK, PAGE_CACHE, CostModel
from statechat.engine.persist import CheckpointWriter, NewCheckpoint, RecentHashes
from statechat.engine.pool import BlockPool, SlotPool
from statechat.engine.restore import PrefixRestore
from statechat.engine.sequence import Sequence

log = logging.getLogger("statechat.cache")


class PrefixCache(PrefixRestore, CheckpointWriter):
    """Where a new request resumes (`reuse`; the chosen prefix loaded by PrefixRestore's
    `_restore`), and the saving of new checkpoints (CheckpointWriter's `persist`)."""

    def __init__(self, blocks: BlockPool, slots: SlotPool, runner, store: StateStore | None,
                 block_size: int, bytes_per_block: int, bytes_per_slot: int,
                 prefill_s_per_token: float) -> None:
        self.blocks, self.slots, self.runner, self.store = blocks, slots, runner, store
        self.bs = block_size
        self.bytes_per_block, self.bytes_per_slot = bytes_per_block, bytes_per_slot
        self.cost = CostModel(prefill_s_per_token)
        # blocks queued for or known on disk, and checkpoints known on disk (seen at admission):
        # the latest of them, twice as many as the disk's budget holds
        budget = store.budget if store is not None else 0
        self.persisted = RecentHashes(2 * budget // bytes_per_block)
        self.stored_ckpts = RecentHashes(2 * budget // bytes_per_slot)
        self.disk_checks: list[Future] = []  # blocks on disk, asked while a request computes
        # checkpoints the full write queue turned away: retried after later steps while the
        # device tier still holds them, and saved (waiting for room) when the engine closes
        self.deferred: dict[bytes, NewCheckpoint] = {}  # (in the order they came)
        self.deferrals = 0  # checkpoints that had to wait
        # (checkpoint, hex hashes, retry) the writer thread found missing on disk after a job
        self.unsaved: list[tuple[NewCheckpoint, list[str], bool]] = []
        self.root = b""  # the hash chain's root (the model's fingerprint), as persist is given it

    def calibrate(self) -> None:
        """Time a page-cache read of a stored checkpoint (if one is cached whole), so that the
        first plan after a start prices disk reads at this machine's rate."""
        try:
            sample = self.store.read_rate_sample() if self.store is not None else None
        except sqlite3.DatabaseError as e:  # (a lock held elsewhere: no sample this time)
            if sqlite_files.is_unusable(e):
                self.index_failed(e)
            return
        if sample is not None:
            self.cost.calibrate(PAGE_CACHE, *sample)

    # --- admission ----------------------------------------------------------------------
    def reuse(self, seq: Sequence) -> int:
        """Restore the cheapest usable prefix of `seq` into its block table and resume slot. An
        index error meanwhile plans it again from device memory alone; one that says the index
        is unusable (sqlite_files.is_unusable) turns the disk tier off too, while a transient one (a
        lock another process held past the busy timeout) costs this request's disk hit alone.
        A restore that raises, whatever the error, has given back all it took (_undo)."""
        self.disk_tier_on()
        for _ in range(3):  # a blob failing verification (or unreadable) drops out; plan again
            try:
                return self._reuse_once(seq)
            except sqlite3.DatabaseError as e:
                if sqlite_files.is_unusable(e):
                    self.index_failed(e)  # (logged once by the store)
                else:
                    log.warning("statechat cache: the index could not be read (%s); this "
                                "request goes on from memory", e)
                return self._reuse_from_memory(seq)
            except BlobError:
                # what this prompt was taken to have on disk may be what failed: its blocks
                # and checkpoints are saved again once computed (the writer skips those still
                # on disk)
                self.stored_ckpts.difference_update(seq.block_hashes)
                self.persisted.difference_update(seq.block_hashes)
        seq.cache_plan.update(choice="recompute", load_failed=True)  # (each try found a bad blob)
        return 0

    def _reuse_from_memory(self, seq: Sequence) -> int:
        """`_reuse_once` from device memory alone, the store kept for later requests."""
        store, self.store = self.store, None
        try:
            return self._reuse_once(seq)
        finally:
            self.store = store

    def _reuse_once(self, seq: Sequence) -> int:
        """Plan where `seq` resumes (the cheapest prefix to load, if loading it beats recomputing
        it), say so in its `cache_plan`, and restore that prefix: the tokens reused (0: none)."""
        hashes = seq.block_hashes[: (len(seq) - 1) // self.bs]  # leave one token to compute
        if not hashes:
            return 0
        t_plan = time.perf_counter()
        hx = [h.hex() for h in hashes]
        num_device = self._num_on_device(hashes)
        lower, t_lookup, bound = Lookup({}, {}), 0.0, False
        rate = self.cost.prefill_s_per_token
        if self.store is not None:
            lower, t_lookup, bound, plan = self._look_up(len(seq), hashes, hx, num_device, rate)
        if not bound:
            plan = self._cheapest(len(seq), hashes, hx, num_device, lower)
        k, cost, load, tiers, assumed = plan  # (under a bound, best_k is 0)
        best_k = k if k and cost <= len(seq) * rate else 0
        # both predictions for the cheapest prefix to load, whichever way the choice went (under
        # a bound the prefix may lean on blocks assumed on disk, and its load time is a lower
        # bound)
        seq.cache_plan = {
            "candidate_tokens": k * self.bs,
            "predicted_load_s": round(load, 6),
            "predicted_recompute_s": round(k * self.bs * rate, 6),
            "choice": "load" if best_k else "recompute",
            "lookup_s": round(t_lookup, 6),
        }
        if assumed:
            seq.cache_plan["load_is_lower_bound"] = True
        share = None if bound else self._disk_share(hashes, hx, k, lower)
        if share is not None:
            seq.cache_plan["disk_resident"] = round(share, 3)
        seq.cache_plan["plan_s"] = round(time.perf_counter() - t_plan, 6)
        return self._restore(seq, hashes[:best_k], tiers[:best_k], lower) if best_k else 0

    def _num_on_device(self, hashes: list[bytes]) -> int:
        """How many of the chain's first blocks the device tier holds, without a gap."""
        num_device = 0
        for h in hashes:
            if self.blocks.lookup(h) is None:
                break
            num_device += 1
        return num_device

    def _look_up(self, num_tokens: int, hashes: list[bytes], hx: list[str], num_device: int,
                 rate: float) -> tuple[Lookup, float, bool, tuple]:
        """The lower tiers' part of a plan for a prompt of `num_tokens` whose first `num_device`
        blocks are on the device: the checkpoints and the host tier's blocks looked up, then the
        disk's blocks too unless a bound (_cheapest's optimistic plan) says no prefix could pay
        (then they are asked about while the request computes). Returns (the lookup, seconds
        spent in the index, whether the bound ruled the disk's blocks out, the bound's plan)."""
        t = time.perf_counter()  # the checkpoints first, and the host tier's blocks
        lower = self.store.where(hx[num_device:], hx, disk_blocks=False)
        t_lookup = time.perf_counter() - t
        # what the disk holds of this prompt's checkpoints now: one seen there before and
        # deleted since (`cache clear`, an eviction) is saved again once computed again
        self.stored_ckpts.difference_update(h for h, x in zip(hashes, hx)
                                            if x not in lower.ckpts)
        self.stored_ckpts.update(bytes.fromhex(h) for h, tier in lower.ckpts.items()
                                 if tier == DISK)
        # a first plan prices every block past the device's that the host tier lacks at the
        # best rate a disk read could reach: when even that pays for no prefix, the disk's
        # blocks are not looked up (nor the page cache asked) before the request computes
        plan = self._cheapest(num_tokens, hashes, hx, num_device, lower, optimistic=True)
        bound = not (plan[0] and plan[1] <= num_tokens * rate)
        if not bound:
            t = time.perf_counter()
            on_disk = self.store.where(hx[num_device:], [])
            t_lookup += time.perf_counter() - t
            lower.blocks.update(on_disk.blocks)
            lower.block_blobs.update(on_disk.block_blobs)
            lower.sample_residency(hx)
            # what is on disk now needs no saving if this request recomputes it (see persist)
            self.persisted.update(bytes.fromhex(h) for h, tier in lower.blocks.items()
                                  if tier == DISK)
        elif num_device < len(hashes):  # learnt while it computes
            self.disk_checks.append(self.store.blocks_on_disk_ahead(hx[num_device:]))
        return lower, t_lookup, bound, plan

    def _disk_share(self, hashes: list[bytes], hx: list[str], k: int, lower: Lookup
                    ) -> float | None:
        """The share (by bytes) of the disk part of the prefix of k blocks (its blocks and its
        checkpoint that only the disk holds) that the page cache held; None if no part of it is
        on disk."""
        cand = hx[:k]
        disk = [(lower.cached("kv", h), self.bytes_per_block) for h in cand
                if h in lower.block_blobs]
        if cand and cand[-1] in lower.ckpt_blobs and not self.slots.has(hashes[k - 1]):
            disk.append((lower.cached("ckpt", cand[-1]), self.bytes_per_slot))
        if not disk:
            return None
        return sum(f * n for f, n in disk) / sum(n for _, n in disk)

    def _cheapest(self, num_tokens: int, hashes: list[bytes], hx: list[str], num_device: int,
                  lower: Lookup, optimistic: bool = False
                  ) -> tuple[int, float, float, list[str], bool]:
        """The prefix (in blocks, 0 for none) whose load plus the recompute of the rest of a
        prompt of `num_tokens` costs least: (blocks, that cost, its load's seconds, the tier of
        each of its blocks, whether its price assumed anything). `optimistic`: a block in no
        tier of `lower` is taken to be on disk and read at the best disk rate, and so is a
        checkpoint on disk (no latencies either), so the cost is a lower bound of every plan
        the disk's blocks could allow."""
        cost_model, rate = self.cost, self.cost.prefill_s_per_token
        best = max(cost_model.bandwidth[PAGE_CACHE], cost_model.bandwidth[DISK])
        cand_k, cand_cost, cand_load, cand_assumed = 0, float("inf"), 0.0, False
        # the blocks' bytes, and their load's fixed cost: one, the slowest tier's (their
        # segments are read together)
        load_s, tiers, fixed, assumed = 0.0, [], 0.0, False
        for k, h in enumerate(hashes, start=1):
            if k <= num_device:  # a device block costs nothing to load
                tier = DEVICE
            else:
                tier = lower.blocks.get(hx[k - 1])
                if tier is None and not optimistic:
                    break
                if tier is None:  # (optimistic: its lookup holds no disk blocks)
                    tier, load_s, assumed = DISK, load_s + self.bytes_per_block / best, True
                else:
                    cached = lower.cached("kv", hx[k - 1])
                    load_s += cost_model.bytes_s(tier, self.bytes_per_block, cached)
                    fixed = max(fixed, cost_model.fixed_s(tier, cached))
            tiers.append(tier)
            ck_tier = DEVICE if self.slots.has(h) else lower.ckpts.get(hx[k - 1])
            if ck_tier is None:
                continue
            ck_fixed = 0.0
            if ck_tier == DISK and optimistic:
                ck_load, ck_assumed = self.bytes_per_slot / best, True
            else:
                ck_cached = lower.cached("ckpt", hx[k - 1]) if ck_tier == DISK else 0.0
                ck_load, ck_assumed = (
                    cost_model.bytes_s(ck_tier, self.bytes_per_slot, ck_cached), False
                )
                ck_fixed = cost_model.fixed_s(ck_tier, ck_cached)
            # a checkpoint on disk is read while the blocks are: one fixed cost for both
            ck_fixed = max(ck_fixed - fixed, 0.0) if ck_tier == DISK else ck_fixed
            total_load = load_s + ck_load + fixed + ck_fixed
            cost = total_load + (num_tokens - k * self.bs) * rate
            if cost <= cand_cost:
                cand_k, cand_cost, cand_load, cand_assumed = (k, cost, total_load,
                                                              assumed or ck_assumed)
        return cand_k, cand_cost, cand_load, tiers, cand_assumed
