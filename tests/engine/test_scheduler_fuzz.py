"""Seeded scheduler fuzz: requests arriving at random steps, of random lengths (a token to the
whole KV cache, exact blocks among them), many sharing prefixes (forks, repeats), some asking
for no tokens or for prompt logprobs, under random token budgets, step time caps, block and
slot counts, sequence limits and checkpoint intervals. Every step schedules something while
work remains (the engine raises on an empty one), stays within its budget, every request
finishes within a bounded number of steps, a waiting request that has computed nothing reports
no reuse (an admission that gave way at once for want of blocks reported its restore), reuse is
reported in whole blocks short of the prompt (or all of it, for one preempted mid-reply), and
at the end every KV block is free and no checkpoint is pinned. A second fuzz floods the
scheduler with short prompts and long ones arriving together, and next-turn warm-ups
(speculative, aborted when a request comes, as the worker does), in caches of 40 to 1,000
blocks: every chunk ends on a block boundary or its sequence's end, no block is held by more
sequences than count it, a step of warm-ups alone keeps to its time target, and every request
finishes.

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
from statechat.engine.sequence import Sequence, Status

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


def flood_workload(rng: random.Random, max_len: int, tokens: int) -> list[tuple[int, Sequence]]:
    """(arrival step, request), about `tokens` tokens in all: bursts of short prompts, long ones
    among them, and warm-ups (speculative requests for no tokens, as the worker's next turn),
    many sharing a prefix."""
    base = [rng.randrange(50) for _ in range(max_len)]
    reqs: list[tuple[int, Sequence]] = []
    step = 0
    while sum(len(seq) for _, seq in reqs) < tokens:
        for _ in range(rng.choice([0, 1, 2, 8, 20])):
            max_tokens = rng.choice([0, 1, 3, 10])
            n = rng.randint(BS, max_len) if rng.random() < 0.15 else rng.randint(1, 300)
            n = max(1, min(n, max_len - 1 - max_tokens))
            ids = base[:n] if rng.random() < 0.4 else [rng.randrange(50) for _ in range(n)]
            reqs.append((step, Sequence(ids, SamplingParams(max_tokens=max_tokens,
                                                            ignore_eos=True))))
        if rng.random() < 0.3:
            ahead = Sequence(base[: rng.randint(1, max_len - 1)],
                             SamplingParams(max_tokens=0, ignore_eos=True))
            ahead.speculative = True
            reqs.append((step, ahead))
        step += 1
    return reqs


def check_step(sched: Scheduler, batch: Batch, cfg: dict, alone_ahead: bool) -> None:
    """The invariants of a step just scheduled (`alone_ahead`: only warm-ups run or wait)."""
    assert batch.items and batch.num_tokens <= cfg["budget"], cfg
    for it in batch.items:
        end = it.start + it.num_tokens
        assert end == len(it.seq) or end % BS == 0, (it.start, it.num_tokens, len(it.seq), cfg)
        assert len(it.seq.block_table) * BS >= end, cfg
    held: dict[int, int] = {}
    for seq in sched.running:
        for block in seq.block_table:
            held[block] = held.get(block, 0) + 1
    assert all(sched.blocks.ref_count[b] >= n for b, n in held.items()), cfg
    if alone_ahead and 0 < cfg["max_step_s"] < float("inf"):
        within = sched.prefix.cost.prefill_tokens_within(cfg["max_step_s"])
        assert batch.num_tokens <= max(within, 2 * BS), cfg  # (a one-block share: two blocks)


def run_flood(seed: int) -> None:
    rng = random.Random(seed)
    cfg = {"num_blocks": rng.choice([40, 100, 300, 1000]),
           "budget": rng.choice([256, 1000, 2048, 4096]),
           "max_step_s": rng.choice([0.0, 0.02, 0.2, float("inf")])}
    blocks, slots = BlockPool(cfg["num_blocks"]), SlotPool(rng.choice([8, 64]))
    prefix = PrefixCache(blocks, slots, None, None, BS, 1, 1, rng.choice([1e-4, 1e-3, 1e-2, 1.0]))
    sched = Scheduler(blocks, slots, prefix, b"root", BS, rng.choice([4, 16, 64]),
                      cfg["budget"], rng.choice([0, 2, 8]), rng.random() < 0.7,
                      cfg["max_step_s"])
    max_len = cfg["num_blocks"] * BS
    reqs = flood_workload(rng, max_len, rng.choice([10, 40]) * cfg["budget"])
    pending, step = list(reqs), 0
    bound = 2 * sum(len(seq) for _, seq in reqs) // BS + 500  # (a block a step, and more)
    while pending or sched.has_work():
        while pending and pending[0][0] <= step:
            seq = pending.pop(0)[1]
            if not seq.speculative:  # (a request aborts the warm-ups: EngineWorker._handle)
                for ahead in [s for s in (*sched.running, *sched.waiting) if s.speculative]:
                    if ahead.status == Status.WAITING:
                        sched.waiting.remove(ahead)
                        ahead.status = Status.FINISHED
                    else:
                        sched.finish(ahead, "abort")
            sched.add(seq)
        step += 1
        assert step < bound, f"seed {seed}: no end ({cfg})"
        if not sched.has_work():
            continue
        alone_ahead = all(s.speculative for s in (*sched.running, *sched.waiting))
        batch = sched.schedule()
        check_step(sched, batch, cfg, alone_ahead)
        sched.postprocess(batch, [rng.randrange(50) for it in batch.items if it.needs_logits])
        sched.copied()
        end_step(sched, batch, max_len)
        sched.take_new_checkpoints()
    assert blocks.num_available == cfg["num_blocks"], f"seed {seed}: blocks held"
    for _, seq in reqs:
        assert seq.is_finished
        assert seq.speculative or len(seq.output_ids) == seq.params.max_tokens


@pytest.mark.parametrize("first", range(0, 300, 100))
def test_floods_of_long_short_and_speculative_prompts_keep_every_invariant(first):
    for seed in range(first, first + 100):
        run_flood(seed)
