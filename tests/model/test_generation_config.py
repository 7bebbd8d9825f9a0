"""A checkpoint's generation_config.json gives its recommended sampling (temperature, top_p,
top_k, min_p, repetition_penalty; other keys are not sampling defaults); a value of the wrong
type or range is left out with a warning and the model still loads; a missing or damaged file
gives none; none of it changes the cache's fingerprint of the model."""

from __future__ import annotations

import json
import logging
import shutil

import pytest

from statechat.model.config import ModelConfig
from statechat.paths import EMBEDDED_MODEL


@pytest.fixture
def ckpt(tmp_path):
    """A copy of the embedded tiny checkpoint's configs (all ModelConfig reads)."""
    for name in ("config.json", "generation_config.json"):
        shutil.copy(EMBEDDED_MODEL / name, tmp_path / name)
    return tmp_path


def with_generation_config(path, **fields):
    gen = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**gen, **fields}))
    return ModelConfig.from_hf(path)


def test_qwen_recommended_sampling_is_read(ckpt):
    plain = ModelConfig.from_hf(ckpt)
    config = with_generation_config(ckpt, do_sample=True, temperature=0.6, top_k=20, top_p=0.95,
                                    min_p=0, repetition_penalty=1.05, max_new_tokens=99)
    assert dict(config.sampling_defaults) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                              "min_p": 0.0, "repetition_penalty": 1.05}
    assert config.eos_token_ids == plain.eos_token_ids == (2, 0)
    assert plain.sampling_defaults == ()  # (the tiny models have none)
    assert config.digest() == plain.digest()  # the cache's entries stay valid


def test_top_k_as_a_float_and_minus_one(ckpt):
    assert dict(with_generation_config(ckpt, top_k=20.0).sampling_defaults) == {"top_k": 20}
    assert dict(with_generation_config(ckpt, top_k=-1).sampling_defaults) == {"top_k": 0}  # off


@pytest.mark.parametrize("key, value", [
    ("temperature", -0.5), ("temperature", "0.7"), ("top_p", 0), ("top_p", 1.5), ("top_k", 2.5),
    ("top_k", -2), ("top_k", True), ("min_p", 1.5), ("repetition_penalty", 0),
    ("repetition_penalty", float("nan")), ("temperature", 10**400), ("top_p", [0.9]),
])
def test_a_bad_value_is_left_out_with_a_warning(ckpt, caplog, key, value):
    with caplog.at_level(logging.WARNING, logger="statechat.model"):
        config = with_generation_config(ckpt, **{key: value}, top_p=0.8) if key != "top_p" \
            else with_generation_config(ckpt, **{key: value}, temperature=0.8)
    kept = {"top_p": 0.8} if key != "top_p" else {"temperature": 0.8}
    assert dict(config.sampling_defaults) == kept
    [record] = caplog.records
    message = record.getMessage()
    assert f"ignoring {key}" in message and "generation_config.json" in message
    assert "\n" not in message and len(message) < 300


@pytest.mark.parametrize("text", [None, "{not json", "[1, 2]", '"text"', "[" * 100_000])
def test_a_missing_or_damaged_file_gives_none(ckpt, text):
    gen = ckpt / "generation_config.json"
    if text is None:
        gen.unlink()
    else:
        gen.write_text(text)
    config = ModelConfig.from_hf(ckpt)
    assert config.sampling_defaults == ()
    assert config.eos_token_ids == (0,)  # config.json's own
