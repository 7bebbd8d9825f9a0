"""Continuous-batching scheduler: plain Python over sequences, blocks and slots, no tensors.

Each step: every decoding sequence gets one token first (so a long prompt never starves decodes),
then prefills share what is left of the token budget, in chunks that end on block boundaries (a
prompt's last chunk excepted): fewest tokens left first, so a short prompt is not kept waiting for
a long one's whole prefill, and the oldest prompt in flight at least a block a step, doubled each
step in a row the fill left it less, up to half the share, so none starves (prefill_plan.py).
Waiting sequences are admitted in arrival order, passed over in their places a prompt that would
get no chunk while an earlier one gets none (until later ones were admitted past it in four steps:
then it is admitted in its place), and a fork that waits for a checkpoint of a prompt in flight
(admission.py). While decodes run (or work done ahead, a next turn's prefix, runs alone: a request
may come), the prefills' share is cut to what the measured prefill rate computes within the step's
time target (`max_step_s`; at least one block, so a prompt always progresses): a long prompt
arriving does not stall the streams for a whole budget's chunk. Otherwise prefills take the whole
budget. When KV blocks run out the newest running sequence is preempted: it gives everything back
and is recomputed later (from the prefix cache when it can), once as many blocks are spare as it
held and its next chunk wants (admission.py). Prefill chunks ask the kernels to leave GDN
checkpoints at the boundaries the policy wants; decodes copy the state at block boundaries so that
a reply's end can be checkpointed (which boundaries, and their publishing: checkpoints.py).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from statechat.cache.hashing import chain_hashes
from statechat.engine.admission import Admission
from statechat.engine.checkpoints import CheckpointPolicy
from statechat.engine.persist import NewCheckpoint
from statechat.engine.pool import BlockPool, SlotPool
from statechat.engine.prefill_plan import chunk_len, note_starved
from statechat.engine.prefix import PrefixCache
from statechat.engine.sequence import Sequence, Status


@dataclass
class ScheduledSeq:
    """One sequence's share of a step."""

    seq: Sequence
    start: int  # first token fed (== seq.num_computed when scheduled)
    num_tokens: int
    src_slot: int
    checkpoints: list[tuple[int, int]] = field(default_factory=list)  # (boundary from start, slot)
    needs_logits: bool = False  # the step reaches the sequence's end: sample a token (unless
    # the request wants none: max_tokens 0)
    is_taken_in: bool = False  # postprocess has taken its checkpoint slots: published or
    # pending, no longer the step's to give back (CheckpointPolicy.drop_targets)

    def __post_init__(self) -> None:
        seq = self.seq
        self.needs_logits = self.start + self.num_tokens == len(seq) and (
            seq.params.max_tokens > 0 or len(seq) > seq.num_prompt_tokens)


@dataclass
class Batch:
    items: list[ScheduledSeq]
    is_decode: bool = False  # every item feeds one token of an ongoing reply
    capped: bool = False  # its prefills were cut to the step's time target (_prefill_cap)

    def __post_init__(self) -> None:
        self.is_decode = bool(self.items) and all(it.seq.is_decoding for it in self.items)

    @property
    def num_tokens(self) -> int:
        return sum(it.num_tokens for it in self.items)


class Scheduler(Admission, CheckpointPolicy):
    def __init__(
        self,
        blocks: BlockPool,
        slots: SlotPool,
        prefix: PrefixCache,
        hash_root: bytes,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        checkpoint_interval: int,
        enable_prefix_cache: bool = True,
        max_step_s: float = 0.0,
    ) -> None:
        self.blocks, self.slots, self.prefix, self.root = blocks, slots, prefix, hash_root
        self.bs = block_size
        self.max_num_seqs, self.budget = max_num_seqs, max_num_batched_tokens
        self.interval = checkpoint_interval
        self.use_cache = enable_prefix_cache
        self.max_step_s = max_step_s  # a step with decodes: its time target (0: none)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.new_checkpoints: list[NewCheckpoint] = []  # published since the last take
        self.copying: list[tuple[Sequence, int, int]] = []  # slot copies asked for, not run yet
        self.reported: dict[int, tuple] = {}  # seq_id -> its reuse reported before admission

    # --- requests -----------------------------------------------------------------------
    def add(self, seq: Sequence, packed: bytes | None = None) -> None:
        """Queue a request; `packed`, its prompt's int32 bytes where the caller has them, hashes
        its full blocks now (admission then has none to hash)."""
        if self.use_cache:
            seq.block_hashes = chain_hashes(self.root, seq.token_ids, self.bs, seq.block_hashes,
                                            packed)
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # --- scheduling ---------------------------------------------------------------------
    def schedule(self) -> Batch:
        """The next step: every decode, then the prefill chunks prefill_plan shares out among
        the running prompts and those `_admit_waiting` admits."""
        items: list[ScheduledSeq] = []
        budget = self.budget
        for seq in list(self.running):
            decoding = seq.is_decoding and seq.status == Status.RUNNING
            if decoding and self._ensure_blocks(seq, seq.num_computed + 1, items):
                items.append(ScheduledSeq(seq, seq.num_computed, 1, seq.slot))
                budget -= 1
        cap = self._prefill_cap(len(items) or int(self._all_speculative()))
        capped, share = cap < budget, min(budget, cap)
        seqs = [s for s in self.running if not s.is_decoding and s.status == Status.RUNNING]
        seqs, sizes = self._admit_waiting(seqs, share, budget)
        note_starved(seqs, sizes, share, self.bs, self.blocks.num_available)
        for seq, num_tokens in zip(seqs, sizes):  # (oldest first: see _ensure_blocks)
            if num_tokens and seq.status == Status.RUNNING:
                item = self._prefill_chunk(seq, num_tokens, items)
                if item is not None:
                    items.append(item)
        return Batch(items, capped=capped)

    def _all_speculative(self) -> bool:
        """Whether every sequence running or waiting is work done ahead (Sequence.speculative):
        a request may come at any moment, and it waits for the step in flight."""
        seqs = (*self.running, *self.waiting)
        return bool(seqs) and all(s.speculative for s in seqs)

    def _prefill_cap(self, num_decodes: int) -> int:
        """The prefill tokens a step with `num_decodes` decodes may take: with decodes and a
        time target, what the measured prefill rate computes within it less the decodes (each
        counted as a prefill token), whole blocks and at least one; else the whole budget. A
        step of work done ahead alone is capped as one with a decode (`num_decodes` 1): its
        time is what a request that arrives during it waits.
        (These steps are timed as capped, Batch.capped: they set the latest rate, which the
        cap follows when it is the slower, so a step that overran cuts the next one and the
        steps settle at the target; the learned rate stays a prompt's alone.)"""
        if not num_decodes or self.max_step_s <= 0:
            return self.budget
        tokens = self.prefix.cost.prefill_tokens_within(self.max_step_s) - num_decodes
        return max(tokens // self.bs * self.bs, self.bs)

    def _prefill_chunk(self, seq: Sequence, budget: int,
                       items: list[ScheduledSeq]) -> ScheduledSeq | None:
        start = seq.num_computed
        end = start + chunk_len(seq, budget, self.bs)
        if end <= start or not self._ensure_blocks(seq, end, items):
            return None
        src = seq.resume_slot or (seq.slot if start > 0 else 0)
        return ScheduledSeq(seq, start, end - start, src, self._checkpoint_targets(seq, start, end))

    def _ensure_blocks(self, seq: Sequence, num_tokens: int, items: list[ScheduledSeq]) -> bool:
        """Give `seq` blocks for `num_tokens` tokens, preempting newer sequences if needed (the
        newest first, `seq` itself last: Admission._give_way)."""
        need = (num_tokens + self.bs - 1) // self.bs - len(seq.block_table)
        while need > self.blocks.num_available:
            scheduled = {id(it.seq) for it in items}
            victims = [s for s in self.running if id(s) not in scheduled]
            if not victims:
                return False
            victim = victims[-1]
            self._give_way(victim, num_tokens if victim is seq else 0)
            if victim is seq:
                return False
        for _ in range(max(need, 0)):
            seq.block_table.append(self.blocks.allocate())
        return True

    def preempt(self, seq: Sequence, at: int = 0) -> None:
        """Give back everything `seq` holds; it will be recomputed (from cache if possible). It
        waits at index `at` of the queue (its front: it came before those waiting)."""
        self._release(seq)
        seq.status = Status.WAITING
        seq.num_recomputed += seq.num_computed - seq.num_restored  # (restored: not computed)
        seq.num_computed = seq.num_restored = 0
        seq.num_preemptions += 1
        seq.steps_starved = 0  # (admitted again, it is not the oldest)
        self.waiting.insert(at, seq)

    def _release(self, seq: Sequence) -> None:
        # the last block first: the LRU then evicts a cached chain from its tail, and what is
        # left of it stays a prefix that a checkpoint before the gap can resume (its first
        # block gone, the rest were of no use)
        for block in reversed(seq.block_table):
            self.blocks.release(block)
        seq.block_table = []
        self._forget_admission(seq)
        if seq.resume_slot:
            self.slots.unpin(seq.resume_slot)
            seq.resume_slot = 0
        self.slots.release(seq.slot)
        self.slots.release(seq.pending_slot)
        seq.slot = seq.pending_slot = seq.pending_tokens = 0
        self.running.remove(seq)

    # --- the step after, queued before this one's tokens are read ----------------------
    def can_continue(self, batch: Batch, max_len: int) -> bool:
        """Whether the decode step after `batch` may be queued before `batch`'s tokens are read
        (LLMEngine's async scheduling): nothing waits to be admitted, `batch` decodes every
        running sequence, none can end by length with it, and none completes a block with it.
        (A completed block copies the GDN state after `batch` into a checkpoint slot, and the
        step after would already have moved that state on; it may also need a new block.) Nor
        may a row of `batch` read its state from another slot than its own: a reply preempted
        and resumed from a checkpoint, all but its last token restored (the decode graphs feed
        the step after from their inputs advanced in place, which keep each row's source slot).
        A sequence that ends on a stop token or string still costs the step after one wasted
        row: its slot and blocks are given back only to be reused by later work on the same
        stream."""
        if not batch.is_decode or self.waiting or len(batch.items) != len(self.running):
            return False
        for it in batch.items:
            seq = it.seq
            if (seq.status != Status.RUNNING or (it.start + 1) % self.bs == 0
                    or it.src_slot != seq.slot):
                return False
            made = len(seq) - seq.num_prompt_tokens  # (output_ids would copy the reply)
            if made + 1 >= seq.params.max_tokens or it.start + 2 >= max_len:
                return False
        return True

    def continuation(self, batch: Batch) -> Batch:
        """The decode step after `batch` for the same sequences in the same order, each fed the
        token `batch` samples for it (on the device: see ModelRunner.launch)."""
        items = [ScheduledSeq(it.seq, it.start + 1, 1, it.seq.slot) for it in batch.items]
        for it in items:
            it.needs_logits = True  # its input token is not in seq.token_ids yet
        return Batch(items)

    # --- after the step -----------------------------------------------------------------
    def postprocess(self, batch: Batch, tokens: list[int]) -> list[tuple[int, int]]:
        """Advance sequences by the step's results; return slot copies (src, dst) to run now,
        then call `copied` (or, if they failed, or this raised, `drop_copies`).

        tokens: one sampled token per item whose `needs_logits`, in item order. Items of
        sequences that finished after the step was queued (a continuation's) are skipped.
        """
        copies: list[tuple[int, int]] = []
        sampled = iter(tokens)
        for it in batch.items:
            seq = it.seq
            if seq.is_finished:
                if it.needs_logits:
                    next(sampled)
                continue
            was_decode = seq.is_decoding
            full_before = seq.num_computed // self.bs
            seq.num_computed += it.num_tokens
            if seq.resume_slot:
                self.slots.unpin(seq.resume_slot)
                seq.resume_slot = 0
            for j in range(full_before, seq.num_computed // self.bs if self.use_cache else 0):
                self.blocks.register(seq.block_table[j], seq.block_hashes[j])
            it.is_taken_in = True  # (before publishing: a failure past here leaks, never frees,
            # a slot the prefix cache may name)
            for boundary, slot in it.checkpoints:
                if slot != seq.pending_slot:  # (a pending state is published when it finishes)
                    self._publish(seq, it.start + boundary, slot)
            if seq.num_computed % self.bs == 0 and (was_decode or it.needs_logits):
                copies += self._decode_boundary(seq, prefill=not was_decode)
            if it.needs_logits:
                seq.token_ids.append(next(sampled))
                if self.use_cache:
                    seq.block_hashes = chain_hashes(self.root, seq.token_ids, self.bs,
                                                    seq.block_hashes)
        return copies

    def finish(self, seq: Sequence, reason: str) -> None:
        """End `seq`: publish its reply-end checkpoint and give back its blocks and slots."""
        seq.finish_reason = reason
        if seq.pending_slot:
            self._publish(seq, seq.pending_tokens, seq.pending_slot)
            seq.pending_slot = 0
        self._release(seq)
        seq.status = Status.FINISHED
