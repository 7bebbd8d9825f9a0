"""Under overload (more short prompts arrive every step than the token budget computes), a long
prompt that waits with no chunk, behind long ones in flight, is admitted past by later arrivals
in at most MAX_OVERTAKEN steps, then admitted in its place (it waited 28 steps, passed over all
the while); the short prompts that flood in are admitted within a few steps.

Plain Python: a scheduler over its pools, with no prefix cache and no decodes.
"""

from __future__ import annotations

from types import SimpleNamespace

from statechat.engine.admission import MAX_OVERTAKEN
from statechat.engine.cost import CostModel
from statechat.engine.pool import BlockPool, SlotPool
from statechat.engine.sampling import SamplingParams
from statechat.engine.scheduler import Scheduler
from statechat.engine.sequence import Sequence

BS, BUDGET = 64, 4096


def request(num_tokens: int) -> Sequence:
    return Sequence(list(range(num_tokens)), SamplingParams(max_tokens=1, ignore_eos=True))


def flood(steps: int, per_step: int = 15) -> tuple[Sequence, dict[int, int], dict[int, int]]:
    """Run `steps` steps, `per_step` 300-token prompts arriving at each (4,500 tokens a step for
    a budget of 4,096) and 6,000-token prompts at the first, third and fifth; each reply ends at
    its first token. The first long prompt takes the oldest's reserve (a block, doubled each
    step it is starved: prefill_plan.reserve), the second is admitted with no chunk, and the
    third waits: returns it and, by seq_id, the step each prompt arrived at and the one it was
    admitted at."""
    sched = Scheduler(BlockPool(4096), SlotPool(256), SimpleNamespace(cost=CostModel(1e-3)),
                      b"root", BS, max_num_seqs=64, max_num_batched_tokens=BUDGET,
                      checkpoint_interval=0, enable_prefix_cache=False)
    arrived: dict[int, int] = {}
    admitted: dict[int, int] = {}
    longs = {t: request(6000) for t in (0, 2, 4)}
    for t in range(steps):
        for seq in ([longs[t]] if t in longs else []) + [request(300) for _ in range(per_step)]:
            sched.add(seq)
            arrived[seq.seq_id] = t
        batch = sched.schedule()
        for seq in sched.running:
            admitted.setdefault(seq.seq_id, t)
        sched.postprocess(batch, [1] * sum(it.needs_logits for it in batch.items))
        for seq in [s for s in sched.running if s.is_decoding]:
            sched.finish(seq, "length")
    return longs[4], arrived, admitted


def test_a_long_prompt_is_passed_over_by_later_arrivals_for_a_bounded_number_of_steps():
    long, arrived, admitted = flood(steps=MAX_OVERTAKEN + 12)
    assert long.seq_id in admitted
    wait = admitted[long.seq_id] - arrived[long.seq_id]
    assert wait <= MAX_OVERTAKEN + 2
    overtook = [i for i, t in admitted.items() if i > long.seq_id and t <= admitted[long.seq_id]]
    assert overtook  # (it was passed over: short prompts behind it went first meanwhile)


def test_the_short_prompts_that_flood_in_are_admitted_as_before():
    """Each short prompt is admitted within a few steps of its arrival (the queue grows by what
    the budget cannot compute, the long prompts' prefills included), not held behind the long
    one."""
    long, arrived, admitted = flood(steps=24)
    shorts = [i for i in arrived if i != long.seq_id and arrived[i] < 12]
    assert all(i in admitted for i in shorts)
    assert max(admitted[i] - arrived[i] for i in shorts) <= 5  # (2 while the long ones got a
    # block a step: their 18,000 tokens are now computed within these steps too)
