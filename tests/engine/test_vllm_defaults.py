"""The Python API's defaults are vLLM's: `generate` and `stream` given no sampling params sample
as the checkpoint's generation_config.json recommends (vLLM's LLM.generate without
sampling_params), not with SamplingParams' own defaults; and SamplingParams takes vLLM's None
for `stop`, `stop_token_ids` and `logit_bias` (none) and for `max_tokens` (up to the context
limit), where a vLLM user's code passes it; EngineConfig takes vLLM's dtype "auto" and a
torch.dtype."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from statechat.engine.sampling import SamplingParams
from statechat.errors import ConfigError
from statechat.model.loader import load_model
from tests.helpers import cpu_engine

PROMPT = [5, 6, 7]
PENALTY = 1.5  # greedy with it makes another reply than plain greedy (the tiny model repeats)


@pytest.fixture(scope="module")
def loaded(tiny_dirs):
    return load_model(tiny_dirs["qwen3_5_text"], dtype=torch.float32)


@pytest.fixture(scope="module")
def recommending(loaded):
    """An engine over a checkpoint that recommends a repetition penalty (greedy otherwise:
    its replies are deterministic)."""
    config = dataclasses.replace(loaded.config,
                                 sampling_defaults=(("repetition_penalty", PENALTY),))
    return cpu_engine(dataclasses.replace(loaded, config=config), max_model_len=128)


def test_no_params_sample_as_the_checkpoint_recommends(recommending):
    n = SamplingParams().max_tokens
    want = recommending.generate([PROMPT], SamplingParams(repetition_penalty=PENALTY))[0]
    plain = recommending.generate([PROMPT], SamplingParams())[0]
    assert want.token_ids != plain.token_ids  # (else the test proves nothing)
    assert recommending.generate(PROMPT)[0].token_ids == want.token_ids
    assert recommending.generate([PROMPT, PROMPT], [None, SamplingParams()])[0].token_ids \
        == want.token_ids
    streamed = [t for e in recommending.stream(PROMPT) for t in e.token_ids]
    assert streamed == want.token_ids and len(want.token_ids) <= n


def test_none_is_vllms_none(loaded):
    assert SamplingParams(stop=None, stop_token_ids=None, logit_bias=None) == SamplingParams()
    engine = cpu_engine(loaded, max_model_len=64)
    out = engine.generate([PROMPT], SamplingParams(max_tokens=None, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(PROMPT) + len(out.token_ids) == 64


def test_dtype_auto_and_torch_dtypes(tiny_dirs):
    """EngineConfig takes vLLM's dtype="auto" (the device's default) and a torch.dtype."""
    from statechat.config import EngineConfig

    model = tiny_dirs["qwen3_5_text"]
    assert EngineConfig(model=model, dtype="auto").dtype is None
    assert EngineConfig(model=model, dtype=torch.bfloat16).dtype == "bfloat16"
    with pytest.raises(ConfigError, match="dtype must be auto, float32, bfloat16 or float16, got "
                                          "'float64'"):
        EngineConfig(model=model, dtype=torch.float64)
