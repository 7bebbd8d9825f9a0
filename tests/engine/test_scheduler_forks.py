"""A fork of a prompt that is still being prefilled (an edit, a regenerate, the next turn sent
while it runs) waits for that prompt to compute the checkpoint they share, then resumes from
it: it neither computes the shared prefix a second time beside it nor reports less reuse than
a queue in arrival order gave, whether the step is cut to its time target or takes the whole
budget. A prompt that shares nothing with those in flight is not held back, nor is one queued
behind a waiting fork: it is admitted in the step it would be with no fork ahead, while the
forks (forks of a fork among them) keep their places and still resume from their checkpoints.

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


def scheduler(budget: int, interval: int, max_step_s: float, num_blocks: int = 400) -> Scheduler:
    blocks, slots = BlockPool(num_blocks), SlotPool(40)
    prefix = PrefixCache(blocks, slots, None, None, BS, 1, 1, 1e-3)  # (no store, no loads)
    return Scheduler(blocks, slots, prefix, b"root", BS, max_num_seqs=16,
                     max_num_batched_tokens=budget, checkpoint_interval=interval,
                     max_step_s=max_step_s)


def request(tokens: list[int], max_tokens: int = 1) -> Sequence:
    return Sequence(list(tokens), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def step(sched: Scheduler) -> int:
    """Run a step (every sequence sampling token 5); return its prefill tokens."""
    batch = sched.schedule()
    prefill = sum(it.num_tokens for it in batch.items if not it.seq.is_decoding)
    sched.postprocess(batch, [5] * sum(it.needs_logits for it in batch.items))
    sched.copied()
    for it in batch.items:
        seq = it.seq
        if it.needs_logits and len(seq.output_ids) >= seq.params.max_tokens:
            sched.finish(seq, "length")
    return prefill


@pytest.mark.parametrize(("budget", "interval", "fork_len", "decodes"), [
    (512, 2, 1500, 0),  # the long prompt first (fewer tokens left): the fork was admitted idle
    (256, 2, 1900, 0),
    (4096, 2, 1500, 2),  # capped beside two streams: the fork, shorter, went first
    (4096, 4, 1900, 2),
])
def test_a_fork_of_a_prompt_in_flight_resumes_from_its_checkpoint(budget, interval, fork_len,
                                                                  decodes):
    sched = scheduler(budget, interval, max_step_s=0.2 if decodes else 0.0)
    for i in range(decodes):
        sched.add(request([900 + i] * 10, max_tokens=100))
    step(sched)
    rng = random.Random(0)
    long = [rng.randrange(1000) for _ in range(2000)]
    first = request(long)
    sched.add(first)
    computed = step(sched)
    fork = request(long[:fork_len] + [7] * 10)
    sched.add(fork)
    while not (first.is_finished and fork.is_finished):
        computed += step(sched)
    # its last shared checkpoint: the last multiple of the interval within the shared blocks
    shared = fork_len // BS * BS // (interval * BS) * (interval * BS)
    assert fork.num_cached_tokens == shared
    assert computed == len(long) + fork.num_prompt_tokens - shared  # nothing computed twice


def test_an_unrelated_prompt_is_not_held_back():
    sched = scheduler(4096, 2, max_step_s=0.2)
    sched.add(request([900] * 10, max_tokens=100))
    step(sched)
    rng = random.Random(1)
    first = request([rng.randrange(1000) for _ in range(2000)])
    sched.add(first)
    step(sched)
    other = request([rng.randrange(1000) for _ in range(150)])
    sched.add(other)
    step(sched)
    step(sched)  # (a share of 192 tokens: the other's 150 first)
    assert other.is_finished and other.num_cached_tokens == 0


def until_admitted(sched: Scheduler, seq: Sequence) -> tuple[int, int]:
    """Run steps until `seq` is admitted (running or done); return how many (the one that
    admitted it counted) and their prefill tokens."""
    computed = 0
    for n in range(1, 100):
        computed += step(sched)
        if seq not in sched.waiting:
            return n, computed
    raise AssertionError("never admitted")


@pytest.mark.parametrize(("budget", "interval", "decodes"), [(512, 2, 0), (4096, 2, 2)])
def test_a_prompt_behind_a_waiting_fork_is_admitted_as_if_none_were_ahead(budget, interval,
                                                                           decodes):
    """A fork waits for the prompt in flight to compute their shared checkpoint; a request
    queued behind it that shares nothing with either is admitted in the step it would be with no
    fork ahead, and the fork still resumes from that checkpoint."""
    steps, reuse = [], []
    for with_fork in (False, True):
        sched = scheduler(budget, interval, max_step_s=0.2 if decodes else 0.0)
        for i in range(decodes):
            sched.add(request([900 + i] * 10, max_tokens=100))
        step(sched)
        rng = random.Random(2)
        long = [rng.randrange(1000) for _ in range(2000)]
        first = request(long)
        sched.add(first)
        computed = step(sched)
        fork = request(long[:1500] + [7] * 10)
        if with_fork:
            sched.add(fork)
        other = request([rng.randrange(1000) for _ in range(150)])
        sched.add(other)
        n, more = until_admitted(sched, other)
        steps.append(n)
        computed += more
        while sched.has_work():
            computed += step(sched)
        reuse.append((other.num_cached_tokens, computed))
        if with_fork:
            assert fork.num_cached_tokens == 1408  # (22 blocks: the interval's last in 1,500)
    assert steps[0] == steps[1] == 1
    assert reuse[1] == (0, reuse[0][1] + fork.num_prompt_tokens - 1408)  # nothing twice


def test_forks_of_a_fork_wait_in_order_and_an_unrelated_prompt_passes_them():
    """Two waiting forks of the prompt in flight, a fork of the first of them (its whole prompt
    and more), and a prompt that shares nothing behind all three: that one is admitted at once;
    each fork resumes from the latest checkpoint it shares (the prompt's, then the fork's own
    prompt end), and no prefix is computed twice."""
    sched = scheduler(512, 2, max_step_s=0.0)
    rng = random.Random(3)
    long = [rng.randrange(1000) for _ in range(2000)]
    first = request(long)
    sched.add(first)
    computed = step(sched)
    fork_a = request(long[:1500] + [7] * 600)
    fork_b = request(long[:1700] + [8] * 10)
    fork_of_a = request(fork_a.token_ids + [9] * 100)
    other = request([rng.randrange(1000) for _ in range(150)])
    for seq in (fork_a, fork_b, fork_of_a, other):
        sched.add(seq)
    n, more = until_admitted(sched, other)
    assert n == 1
    assert list(sched.waiting) == [fork_a, fork_b, fork_of_a]  # (in their places)
    while sched.has_work():
        more += step(sched)
    cached = [s.num_cached_tokens for s in (fork_a, fork_b, fork_of_a, other)]
    assert cached == [1408, 1664, 2048, 0]  # (fork_a's prompt ends at its 32nd block)
    prompts = sum(s.num_prompt_tokens for s in (first, fork_a, fork_b, fork_of_a, other))
    assert computed + more == prompts - sum(cached)


def test_one_that_gives_way_for_blocks_behind_a_waiting_fork_keeps_its_place():
    """A request admitted past a waiting fork whose restore leaves too few blocks for the step's
    chunks gives way at once, back in its place behind the fork (not ahead of it), and admits
    nothing after it; all end once the prompt in flight is done."""
    sched = scheduler(512, 2, max_step_s=0.0, num_blocks=34)
    rng = random.Random(4)
    warm = request([rng.randrange(1000) for _ in range(200)])
    sched.add(warm)
    step(sched)  # (its checkpoint at 192 and 3 blocks stay cached)
    long = [rng.randrange(1000) for _ in range(2000)]
    first = request(long)
    sched.add(first)
    for _ in range(3):
        step(sched)  # (it holds 24 blocks; its last chunk takes 8 of the 10 left)
    fork = request(long + [7] * 10)  # (it waits for the prompt's end)
    other = request(warm.token_ids + [6])  # (its 3 restored blocks and 1 for its chunk)
    behind = request([rng.randrange(1000) for _ in range(100)])
    for seq in (fork, other, behind):
        sched.add(seq)
    assert step(sched) == 464
    assert other.num_preemptions == 1 and list(sched.waiting) == [fork, other, behind]
    while sched.has_work():
        step(sched)
    assert fork.num_cached_tokens == 1984 and other.is_finished and behind.is_finished
