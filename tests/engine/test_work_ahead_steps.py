"""Work done ahead (a next turn's prefix: a speculative request for no tokens) waits for each
of its steps to run: its steps sample nothing, so they would return before the device is done,
the host would queue all of its chunks at once, and a request that came meanwhile would wait
for every one of them (on a GPU) rather than for the step in flight. Other steps that sample
nothing (a long prompt's chunks) still run ahead of the device."""

from __future__ import annotations

import torch

from statechat.engine.sampling import SamplingParams
from statechat.model.loader import load_model
from statechat.paths import EMBEDDED_MODEL
from tests.helpers import cpu_engine, random_prompts


def steps_waited(speculative: bool) -> tuple[int, int]:
    """(steps the engine waited on the device, steps it ran) for a 400-token prompt of no
    tokens computed in 64-token chunks, speculative or not."""
    engine = cpu_engine(load_model(EMBEDDED_MODEL, dtype=torch.float32),
                        max_num_batched_tokens=64, enable_prefix_cache=False)
    waits = []
    finish = engine.runner.finish
    engine.runner.finish = lambda: waits.append(1) or finish()
    seq = engine.add_request(random_prompts(400)[0], SamplingParams(max_tokens=0))
    seq.speculative = speculative
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return len(waits), steps


def test_each_step_of_work_done_ahead_waits_for_the_device():
    waited, steps = steps_waited(speculative=True)
    assert steps == 7 and waited == steps  # (400 tokens in 64-token chunks)


def test_a_prompt_s_chunks_still_run_ahead_of_the_device():
    waited, steps = steps_waited(speculative=False)
    assert steps == 7 and waited == 0
