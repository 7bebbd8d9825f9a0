"""n samples where the engine is short of something: with the prefix cache off each sample
computes the prompt itself and reports so (none cached, every prompt token computed; prompt
logprobs still sample 0's, given to each); with fewer sequence slots than samples
(max_num_seqs 2, n 4) and KV blocks for less than two replies (so some give way), every sample
still ends and greedy ones are the n=1 reply; sample 0 aborted while the others wait for its
prompt (at once, mid-prefill, once it is done) leaves them to run to their end. The idle engine
then holds no block or slot it should not (tests.helpers.assert_idle_pools)."""

from __future__ import annotations

import pytest
import torch

from statechat.engine.sampling import SamplingParams
from statechat.model.loader import load_model
from tests.helpers import assert_idle_pools, cpu_engine, random_prompts


@pytest.fixture(scope="module")
def loaded(tiny_dirs):
    return load_model(tiny_dirs["qwen3_5_text"], dtype=torch.float32)


def short_engine(loaded, **fields):
    """An engine with 2 sequence slots, 12 KV blocks and 128-token steps."""
    return cpu_engine(loaded, **{"max_model_len": 512, "num_kv_blocks": 12,
                                 "num_state_slots": 8, "max_num_seqs": 2,
                                 "max_num_batched_tokens": 128, **fields})


def test_without_the_prefix_cache_each_sample_computes_the_prompt_and_says_so(loaded):
    engine = cpu_engine(loaded, max_model_len=512, enable_prefix_cache=False)
    (prompt,) = random_prompts(150, seed=21)
    asked = SamplingParams(max_tokens=4, ignore_eos=True, n=3, prompt_logprobs=1)
    out = engine.generate(prompt, asked)[0]
    assert [(s.num_cached_tokens, s.num_computed_tokens) for s in out.outputs] == [(0, 150)] * 3
    assert out.prompt_logprobs is not None
    assert all(s.prompt_logprobs == out.prompt_logprobs for s in out.outputs)
    assert_idle_pools(engine)


def test_more_samples_than_sequence_slots_and_blocks_all_end(loaded):
    engine = short_engine(loaded, num_kv_blocks=8)  # (two replies want 10: 2 shared)
    (prompt,) = random_prompts(150, seed=22)
    greedy = SamplingParams(max_tokens=200, ignore_eos=True)
    one = engine.generate(prompt, greedy)[0]
    seqs = engine.add_samples(*engine.check_prompt(prompt),
                              SamplingParams(max_tokens=200, ignore_eos=True, n=4))
    while engine.has_unfinished():
        engine.step()
    assert [s.output_ids for s in seqs] == [one.token_ids] * 4
    assert [s.finish_reason for s in seqs] == ["length"] * 4
    assert any(s.num_preemptions for s in seqs)  # (the case under test)
    assert_idle_pools(engine)


@pytest.mark.parametrize("steps", [0, 1, 3])
def test_sample_0_aborted_leaves_the_others_to_end(loaded, steps):
    engine = short_engine(loaded)
    (prompt,) = random_prompts(300, seed=23)
    asked = SamplingParams(max_tokens=20, ignore_eos=True, n=4, temperature=1.0, seed=1)
    seqs = engine.add_samples(*engine.check_prompt(prompt), asked)
    for _ in range(steps):  # (300 tokens: 3 steps to compute the prompt)
        engine.step()
    engine.abort(seqs[0])
    while engine.has_unfinished():
        engine.step()
    assert [s.finish_reason for s in seqs] == ["abort"] + ["length"] * 3
    assert all(len(s.output_ids) == 20 for s in seqs[1:])
    assert_idle_pools(engine)
