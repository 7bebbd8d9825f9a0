"""The cost model's prefill rate is not taught by idle time: a prompt computed for no tokens
(a next-turn warm-up's `max_tokens=0`) is never synchronised, and its run of steps was kept
open, so the next request's first timed step counted the idle gap since as prefill time (the
rate went from 7.5e-5 to 2.6e-3 s a token after 5 s idle)."""

from __future__ import annotations

import time

import torch

from statechat.engine.sampling import SamplingParams
from statechat.model.loader import load_model
from statechat.paths import EMBEDDED_MODEL
from tests.helpers import cpu_engine, random_prompts


def test_an_idle_gap_after_a_warm_up_is_no_prefill_time():
    engine = cpu_engine(load_model(EMBEDDED_MODEL, dtype=torch.float32),
                        enable_prefix_cache=False)
    first, warm, nxt = random_prompts(200, 200, 200, seed=4)
    engine.generate([first], SamplingParams(max_tokens=1))
    before = engine.prefix.cost.prefill_s_per_token
    engine.generate([warm], SamplingParams(max_tokens=0))  # (a warm-up: nothing sampled)
    time.sleep(2.0)
    engine.generate([nxt], SamplingParams(max_tokens=1))
    after = engine.prefix.cost.prefill_s_per_token
    # 2 s over 400 tokens would be 5e-3 s a token; 200 tokens take well under 0.5 s here,
    # even on a loaded machine
    assert after < before * 0.7 + 0.3 * (0.5 / 200), (before, after)
