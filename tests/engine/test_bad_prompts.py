"""A prompt the engine cannot run is refused with a one-line ConfigError before anything is
queued: empty, too long for the context, text that is not valid Unicode (a lone surrogate, which
the tokenizer refused with a TypeError naming its own types), or with a token id outside the
vocabulary (which would index past the embedding table; on a GPU that is an assert that ends
the process)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from statechat.config import EngineConfig
from statechat.engine.engine import LLMEngine
from statechat.engine.sampling import SamplingParams
from statechat.errors import ConfigError
from statechat.model.loader import load_model
from tests.helpers import engine_config


@pytest.fixture(scope="module")
def engine(tiny_dirs, engine_device):
    path = tiny_dirs["qwen3_5_text"]
    return LLMEngine(EngineConfig(model=path, max_model_len=256, dtype="float32",
                                  **engine_config(engine_device)),
                     loaded=load_model(path, dtype=torch.float32, device=engine_device))


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([], "the prompt is empty"),
        ([1] * 256, "the prompt has 256 tokens; the context limit is 256"),
        ([1, 2, -3, 4], "token id -3 is outside the model's vocabulary (0 to {last})"),
        ([1, 2, "vocab", 4], "token id {vocab} is outside the model's vocabulary (0 to {last})"),
        ([1, 2**40], "token ids must be integers from 0 to {last}"),
        ([1, 2.5], "token ids must be integers from 0 to {last}"),
        ("a \ud800 b",
         "the prompt is not valid Unicode: it holds a lone surrogate (U+D800) at character 2"),
    ],
    ids=["empty", "too-long", "negative", "past-the-vocab", "past-int32", "not-an-int",
         "lone-surrogate"],
)
def test_refused_with_one_line_and_nothing_queued(engine, prompt, message):
    vocab = engine.loaded.config.vocab_size
    if isinstance(prompt, list):
        prompt = [vocab if t == "vocab" else t for t in prompt]
    good = [5, 6, 7]
    with pytest.raises(ConfigError) as info:
        engine.generate([good, prompt], SamplingParams(max_tokens=2, ignore_eos=True))
    assert str(info.value) == message.format(last=vocab - 1, vocab=vocab)
    assert not engine.has_unfinished()  # the good prompt before it was not queued either
    with pytest.raises(ConfigError):
        engine.add_request(prompt)
    # the engine goes on serving
    out = engine.generate([good], SamplingParams(max_tokens=2, ignore_eos=True))
    assert out[0].num_completion_tokens == 2


def test_params_must_match_the_prompts(engine):
    with pytest.raises(ConfigError, match="2 prompts but 1 sampling params"):
        engine.generate([[5, 6], [7, 8]], [SamplingParams(max_tokens=2)])
    with pytest.raises(ConfigError, match="^1 prompt but 2 sampling params: give one for each"):
        engine.generate([5, 6], [SamplingParams(max_tokens=2)] * 2)
    assert not engine.has_unfinished()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"seed": 2**64}, "seed must be an integer from -2**63 to 2**64 - 1"),
        ({"seed": -(2**63) - 1}, "seed must be an integer"),
        ({"temperature": float("nan")}, "temperature must be a finite number"),
        ({"temperature": float("inf")}, "temperature must be a finite number"),
        ({"temperature": 10**400}, "temperature must be a finite number"),
        ({"seed": 1.5}, "seed must be an integer"),
        ({"ignore_eos": "false"}, 'ignore_eos must be true or false, got "false"'),
        ({"ignore_eos": None}, "ignore_eos must be true or false, got null"),
    ],
    ids=["seed-too-large", "seed-too-small", "temperature-nan", "temperature-inf",
         "temperature-huge", "seed-float", "ignore-eos-a-string", "ignore-eos-none"],
)
def test_sampling_params_a_step_could_not_run_are_refused(fields, message):
    """A seed torch cannot take would fail only when its step ran, and with it every other
    request of that step: it is refused where the params are made. So is an ignore_eos that
    is not a bool (the string "false" was once taken as true: the reply ran past EOS)."""
    with pytest.raises(ConfigError, match=message.replace("*", r"\*")):
        SamplingParams(**fields)
    SamplingParams(seed=2**64 - 1)
    SamplingParams(seed=-(2**63))
    SamplingParams(seed=np.int64(3))
    assert SamplingParams(ignore_eos=np.bool_(True)).ignore_eos is True


def test_ids_of_other_integer_types_are_taken(engine):
    """numpy integers and bools are integers: they pass the check and generate as ints do."""
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    plain = engine.generate([[5, 6, 1, 0]], params)[0].token_ids
    assert engine.generate([[np.int64(5), np.uint8(6), True, False]], params)[0].token_ids == plain


def test_a_failed_generate_leaves_nothing_queued(engine, monkeypatch):
    """A step that raises inside generate() ends its requests: the engine serves the next."""
    calls = {"n": 0}
    step = engine.step

    def failing_step():
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("a device error")
        return step()

    monkeypatch.setattr(engine, "step", failing_step)
    with pytest.raises(RuntimeError, match="a device error"):
        engine.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=6, ignore_eos=True))
    assert not engine.has_unfinished()
    monkeypatch.undo()
    assert engine.generate(
        [[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True)
    )[0].num_completion_tokens == 3


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        ({"max_model_len": 10**6},
         ("max_model_len 1,000,000 exceeds the model's {positions:,} positions; lower "
          "max_model_len")),
        ({"max_model_len": 512, "num_kv_blocks": 4},
         ("the KV cache holds 256 tokens, fewer than max_model_len 512; lower max_model_len or "
          "raise num_kv_blocks")),
    ],
    ids=["past-the-positions", "past-the-kv-cache"],
)
def test_a_context_limit_the_engine_cannot_hold_is_one_line(tiny_dirs, engine_device, sizes,
                                                            message):
    """An asked context limit is kept or refused, never cut quietly (an unset one is the model's,
    capped at what the KV cache holds)."""
    path = tiny_dirs["qwen3_5_text"]
    loaded = load_model(path, dtype=torch.float32, device=engine_device)
    config = EngineConfig(model=path, dtype="float32", **sizes, **engine_config(engine_device))
    with pytest.raises(ConfigError) as err:
        LLMEngine(config, loaded=loaded)
    assert str(err.value) == message.format(positions=loaded.config.max_position_embeddings)
    unset = LLMEngine(dataclasses.replace(config, max_model_len=None), loaded=loaded)
    held = unset.scheduler.blocks.num_blocks * config.block_size
    assert unset.max_model_len == min(loaded.config.max_position_embeddings, held)
