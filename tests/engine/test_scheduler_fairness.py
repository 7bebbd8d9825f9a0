"""A long prompt that arrives while replies decode is prefilled in chunks that keep each step
within the step's time target (at the cost model's prefill rate), whole blocks and at least one,
so the streams keep flowing; with no decodes running it takes the whole token budget.

Plain Python: a scheduler over its pools, with a cost model whose rate is set, not measured.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from statechat.engine.cost import CostModel
from statechat.engine.pool import BlockPool, SlotPool
from statechat.engine.sampling import SamplingParams
from statechat.engine.scheduler import Scheduler
from statechat.engine.sequence import Sequence

BS, BUDGET = 64, 4096


def scheduler(rate: float, max_step_s: float) -> Scheduler:
    """A scheduler with room for long prompts whose cost model prices a token at `rate` s."""
    prefix = SimpleNamespace(cost=CostModel(rate))
    return Scheduler(BlockPool(1024), SlotPool(32), prefix, b"root", BS, max_num_seqs=16,
                     max_num_batched_tokens=BUDGET, checkpoint_interval=0,
                     enable_prefix_cache=False, max_step_s=max_step_s)


def request(num_tokens: int) -> Sequence:
    return Sequence(list(range(num_tokens)), SamplingParams(max_tokens=1000, ignore_eos=True))


def start_decoding(sched: Scheduler, count: int) -> None:
    """Admit `count` short prompts and run their prefill: they decode from the next step."""
    for _ in range(count):
        sched.add(request(10))
    batch = sched.schedule()
    sched.postprocess(batch, [1] * len(batch.items))
    assert all(seq.is_decoding for seq in sched.running)


def prefill_tokens(batch) -> int:
    return sum(it.num_tokens for it in batch.items if not it.seq.is_decoding)


@pytest.mark.parametrize(("rate", "decodes", "expected"), [
    (1e-3, 2, 192),  # 200 tokens within 0.2 s, less 2 decodes: 198, three whole blocks
    (1e-4, 8, 1984),  # 2000, less 8: 1992, 31 blocks
    (1.0, 1, BS),  # a slower rate than a block per step: still one block, the prompt moves on
])
def test_a_step_with_decodes_takes_no_more_prefill_than_its_time_allows(rate, decodes,
                                                                          expected):
    sched = scheduler(rate, max_step_s=0.2)
    start_decoding(sched, decodes)
    long = request(6000)
    sched.add(long)
    done = 0
    while long.num_uncomputed > 1000:
        batch = sched.schedule()
        assert sum(it.seq.is_decoding for it in batch.items) == decodes  # every stream advances
        assert prefill_tokens(batch) == expected
        sched.postprocess(batch, [1] * sum(it.needs_logits for it in batch.items))
        done += expected
        assert long.num_computed == done


def test_the_cap_is_shared_by_prefills_and_a_prompts_last_chunk_ends_it():
    sched = scheduler(1e-3, max_step_s=0.2)
    start_decoding(sched, 1)
    first, second = request(100), request(5000)
    sched.add(first)
    sched.add(second)
    batch = sched.schedule()  # 199 tokens: the first prompt whole, one block of the second
    chunks = {id(it.seq): it.num_tokens for it in batch.items}
    assert chunks[id(first)] == 100 and chunks[id(second)] == BS


def test_with_no_decodes_a_prefill_takes_the_whole_budget():
    sched = scheduler(1e-3, max_step_s=0.2)
    sched.add(request(6000))
    assert prefill_tokens(sched.schedule()) == BUDGET


def test_an_infinite_time_target_is_no_cap():
    sched = scheduler(1e-3, max_step_s=float("inf"))
    start_decoding(sched, 2)
    sched.add(request(6000))
    assert prefill_tokens(sched.schedule()) == (BUDGET - 2) // BS * BS


def test_with_no_time_target_decodes_leave_the_prefill_the_rest_of_the_budget():
    sched = scheduler(1e-3, max_step_s=0.0)
    start_decoding(sched, 2)
    sched.add(request(6000))
    assert prefill_tokens(sched.schedule()) == (BUDGET - 2) // BS * BS


def test_a_step_that_overran_cuts_the_next_one_at_once():
    """The learned rate moves 30% per timed step; the cap follows the latest step's own rate
    when it is slower, so one slow step is not followed by several."""
    sched = scheduler(1e-3, max_step_s=0.2)
    cost = sched.prefix.cost
    cost.observe_prefill(1000, 1.0)  # measured: 1 ms a token
    start_decoding(sched, 2)
    long = request(6000)
    sched.add(long)
    batch = sched.schedule()
    assert prefill_tokens(batch) == 192
    sched.postprocess(batch, [1] * sum(it.needs_logits for it in batch.items))
    cost.observe_prefill(194, 0.4)  # the step took twice its target (a busy machine, say)
    assert prefill_tokens(sched.schedule()) == BS  # 97 tokens in 0.2 s, less 2 decodes: 1 block


def test_capped_steps_teach_the_cap_but_not_the_rate_a_recompute_is_priced_at():
    """A step cut to its time target says so (Batch.capped), and the engine's timing of it
    sets only the latest rate, which the cap follows: its small chunks and decode rows cost
    more a token than a prompt computed alone, and the prefix cache prices a recompute at the
    learned rate (it leaned to loading after a stream had run beside a long prompt)."""
    sched = scheduler(1e-3, max_step_s=0.2)
    cost = sched.prefix.cost
    cost.observe_prefill(1000, 1.0)
    start_decoding(sched, 2)
    sched.add(request(6000))
    assert sched.schedule().capped
    cost.observe_prefill(194, 0.4, capped=True)
    assert cost.prefill_s_per_token == 1e-3 and cost.latest_s_per_token == 0.4 / 194
    alone = scheduler(1e-3, max_step_s=0.2)
    alone.add(request(6000))
    assert not alone.schedule().capped  # (no decodes: the whole budget)


def test_the_engine_times_capped_steps_as_capped(tiny_dirs):
    """On the CPU engine (a time target of 1 us: one block a step beside a stream), the prefill
    runs that include capped steps reach the cost model as capped, and leave its rate alone."""
    import torch

    from statechat.config import EngineConfig
    from statechat.engine.engine import LLMEngine
    from statechat.model.loader import load_model

    path = tiny_dirs["qwen3_5_text"]
    engine = LLMEngine(EngineConfig(model=path, device="cpu", max_step_ms=0.001,
                                    enable_prefix_cache=False),
                       loaded=load_model(path, dtype=torch.float32))
    cost, seen = engine.prefix.cost, []
    observe = cost.observe_prefill
    cost.observe_prefill = lambda tokens, seconds, capped=False: (
        seen.append(capped), observe(tokens, seconds, capped))
    engine.add_request(list(range(3, 40)), SamplingParams(max_tokens=60, ignore_eos=True))
    engine.step()
    engine.step()  # (the stream decodes)
    rate = cost.prefill_s_per_token
    engine.add_request([3 + i % 300 for i in range(400)], SamplingParams(max_tokens=1))
    while engine.has_unfinished():
        engine.step()
    assert any(seen) and cost.prefill_s_per_token == rate  # (some run was capped)


def test_work_done_ahead_alone_keeps_to_the_time_target():
    """A speculative prefill (the next turn's prefix, computed while the user types) running
    alone is cut to the step time target as a step with a decode is: a request that arrives
    meanwhile waits for that step (it took a whole budget's chunk, 0.24-0.36 s on the CPU)."""
    sched = scheduler(1e-3, max_step_s=0.2)
    ahead = request(6000)
    ahead.speculative = True
    sched.add(ahead)
    assert prefill_tokens(sched.schedule()) == 192  # 200 tokens within 0.2 s, less one: 3 blocks


def test_work_done_ahead_beside_a_request_takes_the_budget_as_any_prompt():
    sched = scheduler(1e-3, max_step_s=0.2)
    ahead = request(6000)
    ahead.speculative = True
    sched.add(ahead)
    sched.add(request(6000))
    assert prefill_tokens(sched.schedule()) == BUDGET
