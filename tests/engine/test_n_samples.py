"""SamplingParams.n through the Python API, shaped as vLLM's: `generate` gives one RequestOutput
per prompt, whose `outputs` hold its n samples (index 0 to n-1) and whose own fields are
sample 0's; n=1 keeps its shape (`outputs` is the output alone). Greedy samples are identical;
seeded ones are reproducible and differ, sample i being the n=1 reply seeded with seed + i. The
samples after the first resume from its prompt through the prefix cache, and report it: the
prompt is computed once. A stream gives every sample's events with its index, each sample's
text and output those `generate` gives; prompt_logprobs are computed by sample 0 alone and given
to each (in a stream, on each sample's first event and its output, as `generate` gives them).
add_request (one sequence) refuses n > 1, and a bad n is one line."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from statechat.config import EngineConfig
from statechat.engine.engine import LLMEngine
from statechat.engine.sampling import SamplingParams
from statechat.errors import ConfigError
from statechat.model.loader import load_model
from tests.helpers import engine_config, random_prompts

BS = 64


@pytest.fixture(scope="module")
def engine(tiny_dirs, engine_device):
    path = tiny_dirs["qwen3_5_text"]
    return LLMEngine(EngineConfig(model=path, max_model_len=512, dtype="float32",
                                  **engine_config(engine_device)),
                     loaded=load_model(path, dtype=torch.float32, device=engine_device))


def params(**fields) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 6, "ignore_eos": True, **fields})


def test_n_samples_come_in_outputs_and_n_1_keeps_its_shape(engine):
    (prompt,) = random_prompts(20, seed=11)
    one = engine.generate(prompt, params())[0]
    assert one.outputs == [one] and one.index == 0
    outs = engine.generate([prompt, prompt[:10]], params(n=3))
    assert len(outs) == 2 and all(len(out.outputs) == 3 for out in outs)
    assert [s.index for s in outs[0].outputs] == [0, 1, 2]
    first = outs[0].outputs[0]
    assert (first.text, first.token_ids) == (outs[0].text, outs[0].token_ids)
    # greedy: every sample is the n=1 reply
    assert {(s.text, tuple(s.token_ids)) for s in outs[0].outputs} == {
        (one.text, tuple(one.token_ids))}


def test_seeded_samples_are_reproducible_and_sample_i_uses_seed_plus_i(engine):
    (prompt,) = random_prompts(20, seed=12)
    hot = params(temperature=1.0, seed=7, max_tokens=12)
    many = dataclasses.replace(hot, n=3)
    first = [s.token_ids for s in engine.generate(prompt, many)[0].outputs]
    again = [s.token_ids for s in engine.generate(prompt, many)[0].outputs]
    assert first == again and len({tuple(t) for t in first}) > 1
    alone = [engine.generate(prompt, dataclasses.replace(hot, seed=7 + i))[0].token_ids
             for i in range(3)]
    assert first == alone
    streamed: dict[int, list[int]] = {}
    for event in engine.stream(prompt, many):
        streamed.setdefault(event.index, []).extend(event.token_ids)
    assert [streamed[i] for i in range(3)] == first


def test_the_samples_share_the_prompts_prefix_and_say_so(engine):
    (prompt,) = random_prompts(150, seed=13)
    out = engine.generate(prompt, params(n=3))[0]
    reused = (len(prompt) - 1) // BS * BS
    assert [s.num_cached_tokens for s in out.outputs] == [0, reused, reused]
    assert [s.num_computed_tokens for s in out.outputs] == [150] + [150 - reused] * 2


def test_a_stream_of_n_samples_gives_each_its_text_and_output(engine):
    (prompt,) = random_prompts(90, seed=14)
    want = engine.generate(prompt, params(n=2, temperature=1.0, seed=3))[0].outputs
    texts, outputs = {0: "", 1: ""}, {}
    for event in engine.stream(prompt, params(n=2, temperature=1.0, seed=3)):
        texts[event.index] += event.text
        if event.output is not None:
            outputs[event.index] = event.output
    assert [texts[i] for i in range(2)] == [s.text for s in want]
    assert [outputs[i].index for i in range(2)] == [0, 1]
    assert [outputs[i].token_ids for i in range(2)] == [s.token_ids for s in want]
    assert not engine.has_unfinished()


def test_prompt_logprobs_are_computed_once_and_given_to_every_sample(engine):
    (prompt,) = random_prompts(150, seed=15)
    one = engine.generate(prompt, params(prompt_logprobs=1))[0]
    out = engine.generate(prompt, params(prompt_logprobs=1, n=2))[0]
    assert all(s.prompt_logprobs == one.prompt_logprobs for s in out.outputs)
    assert out.outputs[0].num_cached_tokens == 0  # (it scores its prompt: computed whole)
    assert out.outputs[1].num_cached_tokens == (len(prompt) - 1) // BS * BS


def test_a_stream_gives_every_sample_the_prompt_logprobs_as_generate_does(engine):
    (prompt,) = random_prompts(150, seed=16)
    asked = params(prompt_logprobs=1, n=3)
    want = engine.generate(prompt, asked)[0].outputs
    firsts, outputs = {}, {}
    for event in engine.stream(prompt, asked):
        firsts.setdefault(event.index, event.prompt_logprobs)
        if event.output is not None:
            outputs[event.index] = event.output
    assert want[0].prompt_logprobs is not None
    assert [firsts[i] for i in range(3)] == [s.prompt_logprobs for s in want]
    assert [outputs[i].prompt_logprobs for i in range(3)] == [s.prompt_logprobs for s in want]


def test_add_request_refuses_n_and_a_bad_n_is_one_line(engine):
    with pytest.raises(ConfigError, match="add_request runs one sample, not n=2"):
        engine.add_request([5, 6, 7], params(n=2))
    assert not engine.has_unfinished()
    for bad, says in ((0, "n must be at least 1, got 0"), (1.5, "n must be an integer")):
        with pytest.raises(ConfigError, match=says):
            SamplingParams(n=bad)
