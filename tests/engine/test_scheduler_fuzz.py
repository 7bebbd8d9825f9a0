"""Seeded scheduler fuzz: requests arriving at random steps, of random lengths (a token to the
whole KV cache, exact blocks among them), many sharing prefixes (forks, repeats), some asking
for no tokens or for prompt logprobs, under random token budgets, step time caps, block and
slot counts, sequence limits and checkpoint intervals. Every step schedules something while
work remains (the engine raises on an empty one), stays within its budget, every request
finishes within a bounded number of steps, a waiting request that has computed nothing reports
no reuse (an admission that gave way at once for want of blocks reported its restore), reuse is
reported in whole blocks short of the prompt (or all of it, for one preempted mid-reply), and
at the end every KV block is free and no checkpoint is pinned.

Plain Python: a scheduler over its pools and a prefix cache of the device tier alone; the engine
loop is mimicked (a request ends at max_tokens, or with its prompt when it asks for none).
"""

from __future__ import annotations

import random

import pytest

from statechat.engine.pool import BlockPool, SlotPool
from statechat.engine.prefix import PrefixCache
from statechat.engine.sampling import SamplingParams
from statechat.engine.scheduler import Batch, Scheduler
from statechat.engine.sequence import Sequence

BS = 64
MAX_STEPS = 5000


def configure(rng: random.Random) -> dict:
    return {
        "num_blocks": rng.choice([rng.randint(2, 8), rng.randint(3, 40)]),
        "budget": rng.choice([64, 100, 128, 192, 256, 1000, 4096]),
        "max_num_seqs": rng.randint(1, 8),
        "num_slots": rng.choice([rng.randint(2, 5), rng.randint(2, 12)]),
        "rate": rng.choice([1e-4, 1e-3, 1e-2, 1.0]),  # (at 1.0, a cap of a single block)
        "max_step_s": rng.choice([0.0, 0.2]),
        "use_cache": rng.random() < 0.7,
        "interval": rng.choice([0, 1, 2, 3]),
    }


def workload(rng: random.Random, max_len: int) -> list[tuple[int, Sequence]]:
    """(arrival step, request), a third of them at step 0."""
    bases = [[rng.randrange(50) for _ in range(max_len)] for _ in range(3)]
    reqs = []
    for _ in range(rng.randint(1, 30)):
        max_tokens = rng.choice([0, 1, 3, 10, 70])
        n = rng.choice([rng.randint(1, max(1, max_len - max_tokens)), BS, 2 * BS])
        n = min(n, max_len - 1)
        max_tokens = min(max_tokens, max_len - n)
        tokens = (rng.choice(bases)[:n] if rng.random() < 0.6
                  else [rng.randrange(50) for _ in range(n)])
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                prompt_logprobs=1 if rng.random() < 0.15 else None)
        reqs.append((rng.choice([0, rng.randint(0, 30)]), Sequence(tokens, params)))
    return sorted(reqs, key=lambda r: r[0])


def end_step(sched: Scheduler, batch: Batch, max_len: int) -> None:
    """What the engine does after a step: requests that reached their end finish."""
    for it in batch.items:
        seq = it.seq
        if seq.is_finished:
            continue
        replied = it.needs_logits and (len(seq.output_ids) >= seq.params.max_tokens
                                       or len(seq) >= max_len)
        prompt_only = not batch.is_decode and not seq.params.max_tokens and not seq.num_uncomputed
        if replied or prompt_only:
            sched.finish(seq, "length")


def run(seed: int) -> None:
    rng = random.Random(seed)
    cfg = configure(rng)
    blocks, slots = BlockPool(cfg["num_blocks"]), SlotPool(cfg["num_slots"])
    prefix = PrefixCache(blocks, slots, None, None, BS, 1, 1, cfg["rate"])
    sched = Scheduler(blocks, slots, prefix, b"root", BS, cfg["max_num_seqs"], cfg["budget"],
                      cfg["interval"], cfg["use_cache"], cfg["max_step_s"])
    max_len = cfg["num_blocks"] * BS  # (the engine's context limit: what the KV cache holds)
    reqs = workload(rng, max_len)
    pending, step = list(reqs), 0
    while pending or sched.has_work():
        while pending and pending[0][0] <= step:
            sched.add(pending.pop(0)[1])
        step += 1
        assert step < MAX_STEPS, f"seed {seed}: no end ({cfg})"
        if not sched.has_work():
            continue
        batch = sched.schedule()
        state = ([(len(s), s.num_computed) for s in sched.running],
                 [len(s) for s in sched.waiting], blocks.num_available, slots.num_available)
        assert batch.items, f"seed {seed}, step {step}: nothing scheduled, {state} ({cfg})"
        assert batch.num_tokens <= cfg["budget"], f"seed {seed}: over budget ({cfg})"
        for seq in sched.waiting:  # (one admitted, then given way before computing: no reuse)
            assert seq.num_recomputed or (seq.num_cached_tokens, seq.cache_plan) == (-1, None), (
                f"seed {seed}, step {step}: a waiting request reports reuse ({cfg})")
        sched.postprocess(batch, [rng.randrange(50) for it in batch.items if it.needs_logits])
        sched.copied()
        end_step(sched, batch, max_len)
        sched.take_new_checkpoints()
    assert blocks.num_available == cfg["num_blocks"], f"seed {seed}: blocks held"
    assert all(c.refs == 0 for c in slots.checkpoints.values()), f"seed {seed}: pinned"
    for _, seq in reqs:
        assert seq.is_finished
        # (a whole prompt when one preempted mid-reply resumed from its reply's blocks)
        cached = seq.num_cached_tokens
        assert cached % BS == 0 and cached < seq.num_prompt_tokens or (
            cached == seq.num_prompt_tokens and seq.num_preemptions)
        assert len(seq.output_ids) == seq.params.max_tokens


@pytest.mark.parametrize("first", range(0, 600, 100))
def test_every_request_finishes_and_no_step_is_empty(first):
    for seed in range(first, first + 100):
        run(seed)
