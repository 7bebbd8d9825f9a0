"""Under sustained overload (4,500 tokens of 300-token prompts arriving every step for a budget of
4,096), a 6,000-token prompt already admitted gets its first token within a bounded number of
steps: the oldest prompt in flight is reserved a block, doubled for each step in a row that the
fewest-tokens-left-first fill left it less, up to half the share (it got one block a step, 94
steps for its prompt, and with more long prompts arriving never finished). The short prompts
still get their first tokens within a few steps of arriving; and under a load the budget
computes, the reserve is never raised: every short prompt gets its first token in the step it
arrives, beside the long one. Nor does it grow while the free KV blocks do not hold every
prompt in flight to its end: two long prompts in a cache that holds one and a half of them
finish one after the other, the shorter first, neither preempted (the oldest's reserve took half
of every step, the two grew side by side, and the newer one gave way after computing 10,304 of
its 13,000 tokens: 38 steps, not 27).

Plain Python: a scheduler over its pools, with no prefix cache and no decodes.
"""

from __future__ import annotations

from types import SimpleNamespace

from statechat.engine.cost import CostModel
from statechat.engine.pool import BlockPool, SlotPool
from statechat.engine.sampling import SamplingParams
from statechat.engine.scheduler import Scheduler
from statechat.engine.sequence import Sequence

BS, BUDGET = 64, 4096


def request(num_tokens: int) -> Sequence:
    return Sequence(list(range(num_tokens)), SamplingParams(max_tokens=1, ignore_eos=True))


def scheduler(num_blocks: int, budget: int = BUDGET) -> Scheduler:
    return Scheduler(BlockPool(num_blocks), SlotPool(256), SimpleNamespace(cost=CostModel(1e-3)),
                     b"root", BS, max_num_seqs=64, max_num_batched_tokens=budget,
                     checkpoint_interval=0, enable_prefix_cache=False)


def flood(steps: int, per_step: int, long_at: int = 3) -> tuple[Sequence, dict, dict]:
    """Run `steps` steps, `per_step` 300-token prompts arriving at each and a 6,000-token one at
    step `long_at`; each reply ends at its first token. Returns the long prompt and, by seq_id,
    the step each prompt arrived at and the one its first token came at."""
    sched = scheduler(8192)
    long = request(6000)
    arrived: dict[int, int] = {}
    first: dict[int, int] = {}
    for t in range(steps):
        for seq in ([long] if t == long_at else []) + [request(300) for _ in range(per_step)]:
            sched.add(seq)
            arrived[seq.seq_id] = t
        batch = sched.schedule()
        sched.postprocess(batch, [1] * sum(it.needs_logits for it in batch.items))
        for seq in [s for s in sched.running if s.is_decoding]:
            first[seq.seq_id] = t
            sched.finish(seq, "length")
    return long, arrived, first


def test_under_overload_a_long_prompt_in_flight_gets_its_first_token_within_a_bound():
    long, arrived, first = flood(steps=24, per_step=15)
    assert long.seq_id in first
    assert first[long.seq_id] - arrived[long.seq_id] <= 10  # (7; a block a step: 94)
    shorts = [i for i in arrived if i != long.seq_id and arrived[i] < 12]
    assert all(i in first for i in shorts)
    assert max(first[i] - arrived[i] for i in shorts) <= 4  # (3; 2 at a block a step)


def test_under_a_load_the_budget_computes_short_prompts_still_go_first():
    """12 short prompts a step (3,600 tokens): each gets its first token in its arrival step,
    while the long one takes what they leave."""
    long, arrived, first = flood(steps=24, per_step=12)
    shorts = [i for i in arrived if i != long.seq_id]
    assert all(first.get(i) == arrived[i] for i in shorts)
    assert long.seq_id in first


def test_the_reserve_takes_no_blocks_another_prompt_in_flight_needs_to_finish():
    sched = scheduler(300, budget=1024)  # (19,200 tokens)
    old, new = request(14000), request(13000)
    sched.add(old)
    sched.add(new)
    steps = 0
    while sched.has_work():
        steps += 1
        batch = sched.schedule()
        sched.postprocess(batch, [1] * sum(it.needs_logits for it in batch.items))
        for seq in [s for s in sched.running if s.is_decoding]:
            sched.finish(seq, "length")
    assert (old.num_preemptions, new.num_preemptions) == (0, 0)
    assert steps == 27  # (27,000 tokens, 1,024 a step)
