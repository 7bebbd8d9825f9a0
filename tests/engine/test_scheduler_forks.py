"""A fork of a prompt that is still being prefilled (an edit, a regenerate, the next turn sent
while it runs) waits for that prompt to compute the checkpoint they share, then resumes from
it: it neither computes the shared prefix a second time beside it nor reports less reuse than
a queue in arrival order gave, whether the step is cut to its time target or takes the whole
budget. A prompt that shares nothing with those in flight is not held back.

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


def scheduler(budget: int, interval: int, max_step_s: float) -> Scheduler:
    blocks, slots = BlockPool(400), SlotPool(40)
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
