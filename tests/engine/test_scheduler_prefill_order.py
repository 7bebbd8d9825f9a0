"""A short prompt that arrives while a long one prefills gets its first token within a step,
whether the step's prefill share is cut to its time target (replies streaming) or is the whole
token budget; and no stream of short prompts starves the long one: it progresses by at least a
block a step and finishes.

Plain Python: a scheduler over its pools, with a cost model whose rate is set, not measured.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from statechat.engine.cost import CostModel
from statechat.engine.pool import BlockPool, SlotPool
from statechat.engine.sampling import SamplingParams
from statechat.engine.scheduler import Batch, Scheduler
from statechat.engine.sequence import Sequence

BS = 64


def scheduler(rate: float, max_step_s: float, budget: int, blocks: int = 4096) -> Scheduler:
    prefix = SimpleNamespace(cost=CostModel(rate))
    return Scheduler(BlockPool(blocks), SlotPool(64), prefix, b"root", BS, max_num_seqs=32,
                     max_num_batched_tokens=budget, checkpoint_interval=0,
                     enable_prefix_cache=False, max_step_s=max_step_s)


def request(num_tokens: int) -> Sequence:
    return Sequence(list(range(num_tokens)), SamplingParams(max_tokens=1000, ignore_eos=True))


def step(sched: Scheduler) -> Batch:
    batch = sched.schedule()
    sched.postprocess(batch, [1] * sum(it.needs_logits for it in batch.items))
    return batch


def start_decoding(sched: Scheduler, count: int) -> None:
    for _ in range(count):
        sched.add(request(10))
    step(sched)
    assert all(seq.is_decoding for seq in sched.running)


def chunk(batch: Batch, seq: Sequence) -> int:
    return sum(it.num_tokens for it in batch.items if it.seq is seq)


@pytest.mark.parametrize(("rate", "budget", "decodes", "long_len"), [
    (1e-3, 4096, 2, 4000),  # the CPU: a 192-token share a step beside two streams
    (1.0, 4096, 1, 4000),  # a slow CPU: one block a step
    (1e-3, 8192, 0, 32768),  # no streams: the whole budget (the GPU benches' 8,192)
])
def test_a_short_prompt_does_not_wait_for_a_long_ones_prefill(rate, budget, decodes, long_len):
    sched = scheduler(rate, max_step_s=0.2, budget=budget)
    start_decoding(sched, decodes)
    long = request(long_len)
    sched.add(long)
    step(sched)
    step(sched)  # the long prompt is under way
    done = long.num_computed
    assert 0 < done <= long_len // 2
    short, streams = request(30), [s for s in sched.running if s.is_decoding]
    sched.add(short)
    batch = step(sched)
    assert short.is_decoding  # its whole prompt ran: its first token is sampled
    assert all(chunk(batch, s) == 1 for s in streams)  # the streams went on
    assert long.num_computed - done >= BS  # and the long prompt still moved on


def test_a_short_prompt_passes_several_long_ones():
    """Fewest tokens left first: a 30-token prompt behind two long ones, one started and one
    admitted but not yet run, and a 300-token one behind all three."""
    sched = scheduler(1e-3, max_step_s=0.2, budget=4096)
    start_decoding(sched, 2)
    first, second = request(3000), request(2000)
    sched.add(first)
    sched.add(second)
    step(sched)
    short, medium = request(30), request(300)
    sched.add(medium)
    sched.add(short)
    batch = step(sched)  # 192 tokens: the 30-token prompt, then a block of each of the others
    assert short.is_decoding and chunk(batch, medium) == 64 and chunk(batch, first) == 64
    step(sched)
    step(sched)  # the medium prompt's last 236 tokens, a block of the first prompt each step
    assert medium.is_decoding and first.num_computed == 256 and second.num_computed == 128


@pytest.mark.parametrize(("rate", "budget", "decodes"), [
    (1e-3, 4096, 2),  # capped: shorts that ask for more than the 192-token share every step
    (1.0, 4096, 1),  # capped to a block: the shorts get it, the oldest prompt one more
    (1e-3, 4096, 0),  # uncapped: shorts that ask for more than the whole budget every step
])
def test_a_stream_of_short_prompts_does_not_starve_a_long_one(rate, budget, decodes):
    sched = scheduler(rate, max_step_s=0.2, budget=budget)
    start_decoding(sched, decodes)
    long = request(10000)
    sched.add(long)
    step(sched)
    assert 0 < long.num_computed < 6000
    share = sched._prefill_cap(decodes) if decodes else budget
    shorts: list[Sequence] = []
    steps = 0
    while not long.is_decoding:
        while len(sched.waiting) < 40:  # the 29 running ask for about 3.6 shares a step
            shorts.append(request(share // 8 + 1))
            sched.add(shorts[-1])
        before, rest = long.num_computed, long.num_uncomputed
        batch = step(sched)
        steps += 1
        assert long.num_computed - before >= min(BS, rest)
        assert batch.num_tokens <= budget
        if decodes:  # within the cap, but for a cap of one block: then two
            assert batch.num_tokens - decodes <= max(share, 2 * BS)
        for seq in [s for s in sched.running if s.is_decoding and s in shorts]:
            sched.finish(seq, "length")  # (their replies end: room for the next ones)
    assert steps <= 10000 // BS
    assert any(s.is_finished for s in shorts)  # the shorts ran too, beside it


@pytest.mark.parametrize(("rate", "decodes"), [(1e-3, 0), (1e-3, 2)])
def test_a_short_prompt_queued_behind_long_ones_is_not_held_in_arrival_order(rate, decodes):
    """Four long prompts, one under way and three waiting that get no chunk this step: a short
    prompt queued behind them passes them and gets its first token in the next step (it
    waited a step per long prompt ahead of it); they keep their places and are admitted in
    turn."""
    sched = scheduler(rate, max_step_s=0.2, budget=4096)
    start_decoding(sched, decodes)
    first = request(6000)
    sched.add(first)
    step(sched)
    longs = [request(6000) for _ in range(3)]
    for seq in longs:
        sched.add(seq)
    short = request(10)
    sched.add(short)
    step(sched)
    assert short.is_decoding
    waiting = [id(s) for s in sched.waiting]
    assert waiting and waiting == [id(s) for s in longs[-len(waiting):]]  # (in their order)
    while not all(s.is_decoding for s in [first] + longs):
        step(sched)
