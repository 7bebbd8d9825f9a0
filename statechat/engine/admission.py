"""Admission: which waiting sequences the Scheduler admits in a step, each with the longest cached
prefix it can reuse (PrefixCache.reuse, which may load a prefix from the host tier or disk).

Waiting sequences are admitted in arrival order, but for two kinds passed over, each keeping its
place in the queue while those behind it are admitted past it. One is a prompt that would get no
chunk this step while a prompt in flight that came before it gets none either: admitted, it
would only hold a slot (and the blocks of a restored prefix) through steps with nothing to
compute, and the short prompts behind it still pass it (the plan gives the fewest tokens left
their chunks first). It is admitted once all that came before it get chunks, or once later ones
were admitted past it in MAX_OVERTAKEN steps: then it is overdue, passed over no more, and
admitted in its place even with no chunk (where blocks or slots are short, those behind it wait:
admission stops there), so it stays ahead of every later arrival for the oldest in flight's
reserve. Those it waits on are in flight and finish, but while more prompts arrive than
the token budget computes, that took as long as the overload lasted: in a simulation with
4,500 tokens of 300-token prompts arriving a step for a budget of 4,096, a 6,000-token prompt
behind two others waited 28 steps, passed over all the while; now 4, the short ones' waits the
same (tests/engine/test_admission_overtaking.py; since the oldest's reserve grows while it is
starved, 2, and the short ones wait up to 5 steps rather than 2: the long ones' tokens are
computed within those steps too). Steps in which one was admitted past it are
counted, not steps passed over: in such a flood every short prompt waits some steps behind the
one before it (that one gets no chunk either), but none overtakes it, and they are not all made
overdue and admitted with no chunk, a slot each. Four such steps keep a short prompt's pass:
the long prompts it passes come due only after four, and admitting one with no chunk holds
nothing behind it back. Overdue stays so (preempted, it is not passed over once more). Its
prefill once admitted is the plan's to bound: once it is the oldest in flight, its reserve
doubles each step the fewest-tokens-left-first fill leaves it less (prefill_plan.py). The
other is a fork of a prompt in
flight that waits for their shared checkpoint (awaits_prefix), so that a request that shares
nothing with it does not wait for another's prefill. (Forks of that fork need no more: whatever
one shares with it beyond what the prompt in flight holds, it shares that prompt's part too, so
it waits for the same checkpoint; once the fork is admitted it is in flight itself.) One whose
first chunk would want more KV blocks than are free gives way at once (preempted, as the newest
sequence does whenever blocks run out), and it is tried again only once as many blocks are spare
beyond the running prompts' chunks as that admission took (its restore's and its chunk's): while
other replies hold the blocks, it does not restore its prefix again at every step. Likewise one
preempted while it ran for want of blocks (its next chunk's, or an older sequence's) is tried
again only once as many are spare as it held alone and its next chunk wants (_give_way): a
prompt that fits the KV cache alone but not beside the replies streaming waits for them, rather
than computing its first chunks again every few steps only to be preempted at the same point. A
sequence's reported reuse (`num_cached_tokens`, `cache_plan`, `reused_from`, `reused_by_tier`)
is that of its latest admission that computed something: one that gave way (or was aborted)
before computing keeps what it reported before it, so a request aborted while it waits reports
what one never admitted does. Plain Python over sequences and pools, no tensors.
"""

from __future__ import annotations

from collections import deque

from statechat.cache.hashing import chain_hashes
from statechat.engine.pool import BlockPool, SlotPool
from statechat.engine.prefill_plan import awaits_prefix, blocks_needed, plan_prefills
from statechat.engine.prefix import PrefixCache
from statechat.engine.sequence import Sequence, Status

MAX_OVERTAKEN = 4  # steps in which later prompts may be admitted past one with no chunk (then
# it is overdue, passed over no more: module docstring)


class Admission:
    """The admission of Scheduler (whose `__init__` sets what these read, and whose `preempt`
    gives a sequence's blocks and slots back): each sequence that gave way for want of blocks
    (at admission, or preempted: _give_way) keeps what it waits for in its `blocks_short` until
    it is admitted again (one that gave way later, queued ahead of it, does not cut it short),
    and `reported` keeps, per running sequence, what it reported before its admission."""

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
    reported: dict[int, tuple]

    def _admit_waiting(self, seqs: list[Sequence], share: int,
                       budget: int) -> tuple[list[Sequence], list[int]]:
        """Admit waiting sequences in arrival order while each gets a chunk beside `seqs` (the
        running prompts; it may take a longer one's share) and return the prompts with their
        planned chunks (plan_prefills). One that gets none is admitted for a later step (a
        cached prefix may give it one, known only once admitted) unless a prompt that came
        before it gets none either and it is not overdue (_passes_over): then it is passed
        over, in its place. One is
        admitted only while a block is spare beyond the chunks of those before it (as many as
        its last try took, after one that gave way). One whose chunk wants more blocks than are
        free gives way at once (preempted), back in its place; no later one is admitted then.
        One that shares a prefix with a prompt in flight waits while that prompt computes a
        checkpoint of it (awaits_prefix), to resume there: it keeps its place at the queue's
        front, and those behind it are tried in turn."""
        sizes = plan_prefills(seqs, share, budget, self.bs)
        passed = 0  # passed over (forks, prompts with no chunk): they keep their places
        chunkless: list[Sequence] = []  # those passed over for want of a chunk, in order
        overtaken = 0  # how many of them a later one was admitted past
        while len(self.waiting) > passed and share > 0 and len(self.running) < self.max_num_seqs:
            head = self.waiting[passed]
            if (self.use_cache and head.params.prompt_logprobs is None
                    and awaits_prefix(head, seqs, self.bs, self.interval)):
                passed += 1
                continue
            planned = plan_prefills(seqs + [head], share, budget, self.bs)
            if self._passes_over(head, planned[-1], seqs, sizes):
                passed += 1
                chunkless.append(head)
                continue
            free = self.blocks.num_available
            if free - blocks_needed(seqs, planned[:-1], self.bs) < self._blocks_wanted(head):
                break
            if not self._admit(head):
                break
            planned = plan_prefills(seqs + [head], share, budget, self.bs)
            if planned[-1] and blocks_needed(seqs + [head], planned, self.bs) > (
                    self.blocks.num_available):
                took = free - self.blocks.num_available  # (its restore's blocks)
                restored = head.num_restored // self.bs
                self.preempt(head, at=passed)  # (back in its place, behind the forks passed)
                head.blocks_short = (took + blocks_needed([head], planned[-1:], self.bs),
                                     head.block_hashes[restored - 1] if restored else None)
                break
            seqs, sizes, overtaken = seqs + [head], planned, len(chunkless)
        for seq in chunkless[:overtaken]:
            seq.steps_overtaken += 1
        return seqs, sizes

    @staticmethod
    def _passes_over(head: Sequence, chunk: int, seqs: list[Sequence], sizes: list[int]) -> bool:
        """Whether waiting `head`, planned a `chunk` of tokens beside `seqs` (prompts in flight
        or admitted this step, planned `sizes`), keeps its place while those behind it are
        tried: it gets no chunk while one of them that came before it gets none either, and it
        is not overdue (later ones were admitted past it in fewer than MAX_OVERTAKEN steps)."""
        if chunk or head.steps_overtaken >= MAX_OVERTAKEN:
            return False
        return any(not n and s.seq_id < head.seq_id for s, n in zip(seqs, sizes))

    def _give_way(self, seq: Sequence, num_tokens: int) -> None:
        """Preempt running `seq` for want of KV blocks (its own, for `num_tokens` tokens; or an
        older sequence's: 0) and remember what it waits for before it is admitted again: the
        blocks it held alone (those it shares with a running sequence cost nothing to take back)
        and those its next chunk wants beyond them (at least one). Admitted again sooner, it
        would recompute (or restore) what it held only to be preempted at the same point, every
        few steps, until the replies holding the other blocks end. Unlike a restore's count this
        one holds even once its prefix leaves the device: computing it again takes as many."""
        alone = sum(self.blocks.ref_count[b] == 1 for b in seq.block_table)
        more = max(-(-num_tokens // self.bs) - len(seq.block_table), 1)
        self.preempt(seq)
        seq.blocks_short = (min(alone + more, self.blocks.num_blocks), None)

    def _blocks_wanted(self, head: Sequence) -> int:
        """Spare blocks `head` waits for: as many as its last try took, if that gave way for
        want of blocks and the last block it restored is still cached on the device (else its
        restore would differ), or as _give_way counted if it was preempted so; one (for its
        first chunk) otherwise."""
        if head.blocks_short is None:
            return 1
        wanted, tail = head.blocks_short
        if tail is not None and self.blocks.lookup(tail) is None:
            return 1
        return wanted

    def _admit(self, seq: Sequence) -> bool:
        """Move a waiting sequence to running, reusing the longest cached prefix."""
        if len(self.running) >= self.max_num_seqs:
            return False
        slot = self.slots.allocate()
        if slot is None:
            return False
        seq.slot = slot
        reused = 0
        before = (seq.num_cached_tokens, seq.cache_plan, seq.reused_from, seq.reused_by_tier)
        if self.use_cache:  # (without the cache nothing ever looks a block up by its hash)
            seq.block_hashes = chain_hashes(self.root, seq.token_ids, self.bs, seq.block_hashes)
            if seq.params.prompt_logprobs is None:  # (one that asks scores every prompt token,
                # so computes them all, as vLLM's does; its blocks are still shared after it)
                try:
                    reused = self.prefix.reuse(seq)
                except BaseException:  # (it stays waiting, as it was: the step raises)
                    (seq.num_cached_tokens, seq.cache_plan, seq.reused_from,
                     seq.reused_by_tier) = before
                    self.slots.release(slot)
                    seq.slot = 0
                    raise
        self.reported[seq.seq_id] = before
        seq.blocks_short = None
        seq.num_restored, seq.num_cached_tokens = reused, min(reused, seq.num_prompt_tokens)
        seq.status = Status.RUNNING
        self.waiting.remove(seq)
        self.running.append(seq)
        return True

    def _forget_admission(self, seq: Sequence) -> None:
        """`seq` gives its blocks and slots back (preempted or finished): an admission that
        computed nothing leaves the reuse reported before it, and no tokens computed."""
        before = self.reported.pop(seq.seq_id, None)
        if before is not None and seq.num_computed == seq.num_restored:
            (seq.num_cached_tokens, seq.cache_plan, seq.reused_from,
             seq.reused_by_tier) = before
            seq.num_computed = seq.num_restored = 0
