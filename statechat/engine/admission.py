"""Admission: which waiting sequences the Scheduler admits in a step, each with the longest cached
prefix it can reuse (PrefixCache.reuse, which may load a prefix from the host tier or disk).
Plain Python over sequences and pools, no tensors.
"""

from __future__ import annotations

from collections import deque

from statechat.cache.hashing import chain_hashes
from statechat.engine.pool import BlockPool, SlotPool
from statechat.engine.prefill_plan import awaits_prefix, blocks_needed, plan_prefills
from statechat.engine.prefix import PrefixCache
from statechat.engine.sequence import Sequence, Status


class Admission:
    """The admission of Scheduler (whose `__init__` sets what these read, and whose `preempt`
    gives a sequence's blocks and slots back)."""

    blocks: BlockPool
    slots: SlotPool
    prefix: PrefixCache
    root: bytes
    bs: int
    interval: int
    use_cache: bool
    max_num_seqs: int
    waiting: deque[Sequence]
    running: list[Sequence]

    def _admit_waiting(self, seqs: list[Sequence], share: int,
                       budget: int) -> tuple[list[Sequence], list[int]]:
        """Admit waiting sequences in arrival order while each gets a chunk beside `seqs` (the
        running prompts; it may take a longer one's share) and return the prompts with their
        planned chunks (plan_prefills). One that gets none stays admitted for a later step;
        while one is so, a newcomer is admitted only if its whole prompt would get a chunk (each
        holds a slot; a cached prefix may leave one short, known only once admitted). One whose
        chunk wants more blocks than are free gives way at once (preempted), as the newest
        sequence does whenever blocks run out. One that shares a prefix with a prompt in flight
        waits while that prompt computes a checkpoint of it (awaits_prefix), to resume there."""
        sizes = plan_prefills(seqs, share, budget, self.bs)
        while self.waiting and share > 0:
            head = self.waiting[0]
            if (self.use_cache and head.params.prompt_logprobs is None
                    and awaits_prefix(head, seqs, self.bs, self.interval)):
                break
            if 0 in sizes and not plan_prefills(seqs + [head], share, budget, self.bs)[-1]:
                break
            if not self._admit(head):
                break
            planned = plan_prefills(seqs + [head], share, budget, self.bs)
            if planned[-1] and blocks_needed(seqs + [head], planned, self.bs) > (
                    self.blocks.num_available):
                self.preempt(head)
                break
            seqs, sizes = seqs + [head], planned
            if not planned[-1]:
                break
        return seqs, sizes

    def _admit(self, seq: Sequence) -> bool:
        """Move a waiting sequence to running, reusing the longest cached prefix."""
        if len(self.running) >= self.max_num_seqs:
            return False
        slot = self.slots.allocate()
        if slot is None:
            return False
        seq.slot = slot
        reused = 0
        if self.use_cache:  # (without the cache nothing ever looks a block up by its hash)
            seq.block_hashes = chain_hashes(self.root, seq.token_ids, self.bs, seq.block_hashes)
            if seq.params.prompt_logprobs is None:  # (one that asks scores every prompt token,
                # so computes them all, as vLLM's does; its blocks are still shared after it)
                reused = self.prefix.reuse(seq)
        # the admission that runs is the one reported (an earlier one, preempted at once for
        # want of blocks, may have restored more or less, and computed nothing)
        seq.num_restored, seq.num_cached_tokens = reused, min(reused, seq.num_prompt_tokens)
        seq.status = Status.RUNNING
        self.waiting.remove(seq)
        self.running.append(seq)
        return True
