"""A prompt that fits the KV cache alone but not beside the replies that stream (their blocks and
its own are more than there are) is not admitted again and again while they run: preempted once
for want of blocks (its next chunk's, or a growing reply's), it waits until as many blocks are
spare as it held and its next chunk wants, rather than recomputing its first chunks every few
steps beside the replies (before: a 400-token prompt beside two 3-block replies on 10 blocks was
admitted 8 times and recomputed 1,792 tokens; beside two growing ones, 20 times and 5,056). It
is admitted again in the step after the replies give their blocks back. Each sequence that gave
way keeps its own wait: a reply preempted after it (queued ahead of it) does not cut it short.

Plain Python: a scheduler over its pools and a prefix cache of the device tier alone.
"""

from __future__ import annotations

import random

import pytest

from statechat.engine.pool import BlockPool, SlotPool
from statechat.engine.prefix import PrefixCache
from statechat.engine.sampling import SamplingParams
from statechat.engine.scheduler import Scheduler
from statechat.engine.sequence import Sequence

BS = 64


def scheduler(num_blocks: int, interval: int) -> Scheduler:
    blocks, slots = BlockPool(num_blocks), SlotPool(16)
    prefix = PrefixCache(blocks, slots, None, None, BS, 1, 1, 1e-3)  # (no store, no loads)
    return Scheduler(blocks, slots, prefix, b"root", BS, max_num_seqs=8,
                     max_num_batched_tokens=128, checkpoint_interval=interval)


def request(tokens: list[int], max_tokens: int) -> Sequence:
    return Sequence(list(tokens), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def step(sched: Scheduler) -> list[Sequence]:
    """Run a step (every sequence sampling token 5; a reply ends at max_tokens); return the
    sequences it fed, in its order."""
    batch = sched.schedule()
    assert batch.items
    sched.postprocess(batch, [5] * sum(it.needs_logits for it in batch.items))
    sched.copied()
    for it in batch.items:
        seq = it.seq
        if not seq.is_finished and it.needs_logits and (
                len(seq.output_ids) >= seq.params.max_tokens):
            sched.finish(seq, "length")
    return [it.seq for it in batch.items]


@pytest.mark.parametrize(("reply_prompt", "reply_len", "interval", "delay"), [
    (130, 40, 0, 0),  # replies of 3 blocks each, to the end: the prompt's own chunk wants a block
    (130, 40, 2, 0),  # the same, with checkpoints every 2 blocks inside the prompt
    (100, 100, 0, 0),  # replies of 2 blocks growing to 4: their next block wants one too
    (100, 100, 2, 0),
    (100, 100, 0, 23),  # a reply's next block preempts it, not its own chunk
])
def test_a_prompt_that_fits_only_alone_waits_for_the_replies_instead_of_thrashing(
        reply_prompt, reply_len, interval, delay):
    sched = scheduler(10, interval)
    rng = random.Random(0)
    replies = [request([rng.randrange(1000) for _ in range(reply_prompt)], reply_len)
               for _ in range(2)]
    for reply in replies:
        sched.add(reply)
    while not all(r.is_decoding for r in replies):
        step(sched)
    for _ in range(delay):
        step(sched)
    prompt = request([rng.randrange(1000) for _ in range(400)], 1)  # 7 blocks of the 10
    sched.add(prompt)
    first_run = admissions = readmitted = 0
    replies_end, was_running = None, False
    for n in range(1, 500):
        fed = step(sched)
        if prompt in fed and not was_running:
            admissions += 1
            readmitted = n
        was_running = prompt in sched.running
        if not prompt.num_preemptions:
            first_run = prompt.num_computed
        if replies_end is None and all(r.is_finished for r in replies):
            replies_end = n
        if prompt.is_finished:
            break
    assert readmitted <= replies_end + 1  # (admitted once the replies gave their blocks back)
    assert (admissions, prompt.num_preemptions) == (2, 1)
    assert prompt.num_recomputed == first_run  # (what it computed before the replies grew)
    assert all(len(r.output_ids) == reply_len for r in replies)


def test_blocks_shared_with_a_running_reply_are_not_waited_for():
    """A prompt that resumed from a streaming reply's prompt and shares its blocks waits, once
    preempted, only for the blocks it held alone and its next chunk: it is admitted again as
    soon as a short reply ends, while the one it shares blocks with still streams."""
    sched = scheduler(12, 0)
    rng = random.Random(1)
    base = [rng.randrange(1000) for _ in range(260)]
    long_reply = request(base, 60)  # (5 blocks, to its end; its prompt's checkpoint at 256)
    short_reply = request([rng.randrange(1000) for _ in range(130)], 20)  # (3 blocks)
    for reply in (long_reply, short_reply):
        sched.add(reply)
    while not long_reply.is_decoding or not short_reply.is_decoding:
        step(sched)
    prompt = request(base[:256] + [rng.randrange(1000) for _ in range(300)], 1)
    sched.add(prompt)  # (4 blocks shared, then 5 of its own: 4 are free)
    while not prompt.num_preemptions:
        step(sched)
    while not short_reply.is_finished:
        step(sched)
        assert prompt in sched.waiting
    step(sched)
    assert prompt in sched.running and not long_reply.is_finished
    while not prompt.is_finished:
        step(sched)
    assert prompt.num_preemptions == 1 and prompt.num_cached_tokens == 256


def test_a_reply_that_gives_way_after_a_waiting_prompt_leaves_it_its_wait():
    """A prompt that gave way for want of blocks waits for them; a reply preempted later for an
    older one's next block goes back ahead of it and waits too. Once the older reply ends, the
    preempted one runs again, and the prompt still waits for as many blocks as it held: it is
    not admitted beside the reply only to be preempted again as that one's prefill grows
    (it was: its own wait was the latest one's, which the reply's replaced)."""
    sched = scheduler(16, 2)
    rng = random.Random(0)
    old = request([rng.randrange(1000) for _ in range(60)], 700)  # (12 blocks at its end)
    reply = request([rng.randrange(1000) for _ in range(300)], 600)  # (15 at its end)
    for seq in (old, reply):
        sched.add(seq)
    while not old.is_decoding or not reply.is_decoding:
        step(sched)
    prompt = request([rng.randrange(1000) for _ in range(700)], 1)  # (11 blocks)
    sched.add(prompt)
    while not prompt.num_preemptions:
        step(sched)
    first_run = prompt.num_recomputed  # (what it computed before it gave way)
    while not reply.num_preemptions:
        step(sched)
    assert list(sched.waiting) == [reply, prompt]
    while not prompt.is_finished:
        step(sched)
    assert (prompt.num_preemptions, prompt.num_recomputed) == (1, first_run)
    assert reply.num_preemptions == 1 and not old.num_preemptions
