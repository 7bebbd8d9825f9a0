"""CheckpointPolicy: the Scheduler's choice of the block boundaries that keep a GDN checkpoint,
and their publishing in the device tier. Plain Python over sequences and slots, no tensors.

A prefill chunk asks the kernels for checkpoints at the prompt's last boundary short of its end
(its very end too where that is a boundary, or for a request of no tokens) and every `interval`
blocks; a decode keeps the state at each block boundary it crosses (and at the prompt's end,
where that is one the prefill left none at) in a pending slot, published as the reply-end
checkpoint when the sequence finishes (a reply computed again after a preemption keeps its last
boundary so too; one that crosses an interval checkpoint drops the earlier pending state). A
decode's state reaches its slot by a copy after the step (`copying`): an interval checkpoint is
published, and a pending state kept, only once the copy has run (`copied`); a copy that fails
leaves neither (`drop_copies`). A boundary whose hash already has a checkpoint gets no other, and
a checkpoint never waits for a slot: with none free it is skipped.
"""

from __future__ import annotations

from statechat.engine.persist import NewCheckpoint
from statechat.engine.pool import SlotPool
from statechat.engine.sequence import Sequence


class CheckpointPolicy:
    """The checkpoints of Scheduler (whose `__init__` sets what these read): `slots`, `bs` (the
    block size), `interval` (blocks between checkpoints of a long prefill; 0: none), `use_cache`,
    `new_checkpoints` (published since the last take) and `copying` (the slot copies the last
    postprocess asked for, not run yet: (sequence, boundary, destination slot))."""

    slots: SlotPool
    bs: int
    interval: int
    use_cache: bool
    new_checkpoints: list[NewCheckpoint]
    copying: list[tuple[Sequence, int, int]]

    def _checkpoint_targets(self, seq: Sequence, start: int, end: int) -> list[tuple[int, int]]:
        if not self.use_cache:
            return []
        # the prompt's last boundary short of its end, which the same prompt again resumes
        # from (it computes at least its last token); its very end as well where that is a
        # boundary (an edited reply resumes there, whatever boundaries the reply crosses) or for
        # a request of no tokens (a prefix computed ahead of a longer prompt)
        n = seq.num_prompt_tokens
        marks = {(n - 1) // self.bs * self.bs}
        if seq.params.max_tokens == 0 or n % self.bs == 0:
            marks.add(n // self.bs * self.bs)
        # a reply computed again after a preemption: its last boundary short of its end is
        # where a decode would have left the reply-end checkpoint's pending state
        resumed = len(seq) // self.bs * self.bs
        targets = []
        first = (start // self.bs + 1) * self.bs
        for b in range(first, end + 1, self.bs):
            wanted = b in marks or (self.interval and b % (self.interval * self.bs) == 0)
            pending = not wanted and b == resumed and n <= b < len(seq)
            if not (wanted or pending) or self.slots.has(seq.block_hashes[b // self.bs - 1]):
                continue
            if pending:
                seq.pending_slot = seq.pending_slot or self.slots.allocate() or 0
                if seq.pending_slot:
                    seq.pending_tokens = b
                    targets.append((b - start, seq.pending_slot))
                continue
            slot = self.slots.allocate()
            if slot is None:
                break  # never block generation for a checkpoint
            targets.append((b - start, slot))
        return targets

    def _decode_boundary(self, seq: Sequence, prefill: bool = False) -> list[tuple[int, int]]:
        """At a block boundary during decode, or where a prefill that ends on one leaves the
        reply to begin (`prefill`): keep the state for the reply-end checkpoint. (A reply
        shorter than a block after a prompt that fills its last block ends past that boundary
        alone: without it the next turn resumed a block earlier, at the prompt's checkpoint.)"""
        if not self.use_cache:
            return []
        b = seq.num_computed
        h = seq.block_hashes[b // self.bs - 1]
        if prefill and self.slots.has(h):  # (the prefill left one there: a prompt's interval
            return []  # checkpoint, or the same prompt's, computed before)
        if self.interval and b % (self.interval * self.bs) == 0 and not self.slots.has(h):
            slot = self.slots.allocate()
            if slot is not None:  # (published once copied)
                # the reply's end is at or past this checkpoint now: a state pending at an
                # earlier boundary would be a checkpoint the policy does not keep
                self.slots.release(seq.pending_slot)
                seq.pending_slot = seq.pending_tokens = 0
                self.copying.append((seq, b, slot))
                return [(seq.slot, slot)]
        if not seq.pending_slot:
            seq.pending_slot = self.slots.allocate() or 0
        if not seq.pending_slot:
            return []
        seq.pending_tokens = b
        self.copying.append((seq, b, seq.pending_slot))
        return [(seq.slot, seq.pending_slot)]

    def copied(self) -> None:
        """The copies `postprocess` asked for have run: publish the interval checkpoints among
        them (a pending state is published when its sequence finishes)."""
        copying, self.copying = self.copying, []
        for seq, boundary, slot in copying:
            if slot != seq.pending_slot:
                self._publish(seq, boundary, slot)

    def drop_copies(self) -> None:
        """The copies `postprocess` asked for did not run, or may not have run whole (a device
        error, an interrupt, a failure in postprocess itself): give their slots back, unpublished.
        A pending state among them is dropped, whatever boundary it held before: the copy may
        have overwritten part of it, and published at its sequence's end a later request would
        resume from it (and the disk tier keep it)."""
        copying, self.copying = self.copying, []
        for seq, _, slot in copying:
            if slot == seq.pending_slot:
                seq.pending_slot = seq.pending_tokens = 0
            self.slots.release(slot)

    def drop_targets(self, batch) -> None:
        """A step that failed before it was postprocessed (before its tokens were read, or
        after, before or while `postprocess` took them in): give back the checkpoint slots its
        prefill chunks asked for, a reply's pending one too, but those of the items postprocess
        had taken in (published: the prefix cache's; freed too, the next request was handed a
        slot its boundary still named). What they hold is not known to be the state they were
        to take: published, a later request would resume from it (and the disk tier keep it);
        kept, they were lost for good."""
        for it in batch.items:
            seq = it.seq
            if it.is_taken_in:
                continue
            for _, slot in it.checkpoints:
                if slot == seq.pending_slot:
                    seq.pending_slot = seq.pending_tokens = 0
                self.slots.release(slot)

    def _publish(self, seq: Sequence, boundary: int, slot: int) -> None:
        """Register `slot` as the checkpoint at `boundary` of `seq` (freed if one exists)."""
        k = boundary // self.bs
        h = seq.block_hashes[k - 1]
        if self.slots.register(h, slot, boundary):
            self.new_checkpoints.append(
                NewCheckpoint(h, boundary, slot, seq.block_hashes[:k], seq.block_table[:k])
            )

    def take_new_checkpoints(self) -> list[NewCheckpoint]:
        """The checkpoints published since the last call, each handed out once."""
        new, self.new_checkpoints = self.new_checkpoints, []
        return new
