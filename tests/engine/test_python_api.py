"""The Python API behaves as a vLLM user expects: a stream delivers its whole reply even when
something else steps the engine; a stop token's id ends the reply without its text; a state
cache too small to run is refused when the engine is configured; an aborted request reports
what it computed; a tuple or numpy array of ids is a prompt, and one prompt not in a list is a
batch of one to `generate` (vLLM's), while other values, and params that are not
SamplingParams, are one-line errors; so are EngineConfig fields of the wrong
type, and a CPU cache budget too small names its field; `~` in a path is the home folder."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from statechat.config import EngineConfig
from statechat.engine.engine import LLMEngine
from statechat.engine.sampling import SamplingParams
from statechat.errors import ConfigError
from statechat.model.loader import load_model
from tests.helpers import engine_config

PROMPT = [5, 6, 7]  # (the tiny model replies with letters to it)


@pytest.fixture(scope="module")
def loaded(tiny_dirs, engine_device):
    return load_model(tiny_dirs["qwen3_5_text"], dtype=torch.float32, device=engine_device)


@pytest.fixture(scope="module")
def engine(loaded, engine_device):
    """Prefill chunks of one block: a long prompt takes several steps."""
    return LLMEngine(EngineConfig(model=loaded.path, max_model_len=256, dtype="float32",
                                  max_num_batched_tokens=64, **engine_config(engine_device)),
                     loaded=loaded)


def greedy(n: int, **fields) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, **fields)


def joined(events) -> tuple[str, list[int], object]:
    """A stream's text, token ids and final output."""
    events = list(events)
    return ("".join(e.text for e in events), [t for e in events for t in e.token_ids],
            events[-1].output if events else None)


def test_a_stream_delivers_its_tail_when_another_steps_the_engine(engine):
    want = engine.generate([PROMPT], greedy(10))[0]
    first = engine.stream(PROMPT, greedy(10))
    head = next(first)
    other = joined(engine.stream([9, 10, 11], greedy(30)))  # runs the first to its end too
    assert other[2].num_completion_tokens == 30
    text, ids, out = joined(first)
    assert head.text + text == want.text and head.token_ids + ids == want.token_ids
    assert out is not None and out.token_ids == want.token_ids and out.finish_reason == "length"
    assert not engine.has_unfinished()


def _stop_token(engine) -> tuple[list[int], int]:
    """The greedy reply and the place of a token in it that decodes to letters, seen there first
    (and before any EOS)."""
    full = engine.generate([PROMPT], greedy(30))[0].token_ids
    for k in range(1, len(full)):
        if full[k - 1] in engine.eos_ids:
            break
        if engine.tokenizer.decode([full[k]]).strip().isalpha() and full[k] not in full[:k]:
            return full, k
    raise AssertionError("no letter token in the tiny model's reply")


@pytest.mark.parametrize("how", ["stop_token_ids", "eos"])
def test_a_stop_token_keeps_its_id_but_not_its_text(engine, how):
    full, k = _stop_token(engine)
    before = engine.generate([PROMPT], greedy(k))[0].text  # the text of the tokens before it
    assert before
    if how == "eos":
        params, ignored = SamplingParams(max_tokens=30), SamplingParams(max_tokens=k + 1)
        engine.eos_ids.add(full[k])  # (the runner reads the same set)
    else:
        params, ignored = greedy(30, stop_token_ids=[full[k]]), greedy(k + 1)
    try:
        out = engine.generate([PROMPT], params)[0]
        streamed = joined(engine.stream(PROMPT, params))
        plain = engine.generate([PROMPT], dataclasses.replace(ignored, ignore_eos=True))[0]
    finally:
        engine.eos_ids.discard(full[k])
    assert (out.token_ids, out.text, out.finish_reason) == (full[: k + 1], before, "stop")
    assert streamed[:2] == (before, full[: k + 1]) and streamed[2].text == before
    assert plain.text.startswith(before) and len(plain.text) > len(before)  # (not a stop: kept)


def test_too_few_state_slots_are_refused_and_the_fewest_run(loaded, engine_device, caplog):
    """Below 3 slots is one line; 3 run (the same tokens) and say that the prefix cache can
    then keep no checkpoint."""
    with pytest.raises(ConfigError) as err:
        EngineConfig(model=loaded.path, num_state_slots=2)
    assert str(err.value) == ("num_state_slots must be at least 3 (the null slot, the pad slot "
                              "and one running sequence's state), got 2")
    prompts, params = [list(range(3, 73)), PROMPT], greedy(64)  # (blocks end in prompt and reply)
    base = EngineConfig(model=loaded.path, max_model_len=256, dtype="float32",
                        **engine_config(engine_device))
    want = [o.token_ids for o in LLMEngine(base, loaded=loaded).generate(prompts, params)]
    for cache in (True, False):
        fewest = dataclasses.replace(base, num_state_slots=3, enable_prefix_cache=cache)
        caplog.clear()
        engine = LLMEngine(fewest, loaded=loaded)
        said = [r.getMessage() for r in caplog.records if "state slots" in r.getMessage()]
        warning = ("statechat: 3 state slots leave none for checkpoints, so the prefix cache "
                   "reuses nothing; give num_state_slots 4 or more")
        assert said == ([warning] if cache else [])
        for _ in range(2):  # (the second after the first left what it could in the cache)
            assert [o.token_ids for o in engine.generate(prompts, params)] == want


def test_an_aborted_request_reports_what_it_computed(engine):
    waiting = engine.add_request(PROMPT, greedy(4))
    engine.abort(waiting)
    out = engine.output(waiting)
    assert (out.finish_reason, out.num_cached_tokens, out.num_computed_tokens) == ("abort", 0, 0)
    long = engine.add_request([(7 * i) % 300 + 1 for i in range(150)], greedy(4))
    engine.step()  # one chunk of 64 tokens
    engine.abort(long)
    assert engine.output(long).num_computed_tokens == 64


@pytest.mark.parametrize("prompt", [(5, 6, 7), np.array([5, 6, 7]),
                                    np.array([5, 6, 7], dtype=np.int32), range(5, 8)],
                         ids=["tuple", "int64-array", "int32-array", "range"])
def test_a_sequence_or_array_of_ids_is_a_prompt(engine, prompt):
    want = engine.generate([[5, 6, 7]], greedy(3))[0].token_ids
    assert engine.generate([prompt], greedy(3))[0].token_ids == want
    assert joined(engine.stream(prompt, greedy(3)))[1] == want


@pytest.mark.parametrize("prompt", ["hello", [5, 6, 7], (5, 6, 7), np.array([5, 6, 7])],
                         ids=["string", "ids", "tuple", "array"])
def test_one_prompt_is_a_batch_of_one(engine, prompt):
    """As vLLM's LLM.generate: a list of ids was refused, each id taken for a prompt."""
    batch = [prompt.tolist() if isinstance(prompt, np.ndarray) else prompt]
    want = engine.generate(batch, greedy(3))
    got = engine.generate(prompt, greedy(3))
    assert [(o.prompt_token_ids, o.token_ids) for o in got] == [
        (o.prompt_token_ids, o.token_ids) for o in want]


def test_stop_token_ids_take_what_a_prompt_takes():
    """A tuple, range or 1-D integer numpy array of ids, as a prompt's (an array was
    refused); a float array stays a one-line error."""
    for ids in ((5, 6), range(5, 7), np.array([5, 6]), np.array([5, 6], dtype=np.int32)):
        assert SamplingParams(stop_token_ids=ids).stop_token_ids == (5, 6)
    with pytest.raises(ConfigError, match="stop_token_ids must be a list of integers"):
        SamplingParams(stop_token_ids=np.array([5.0, 6.0]))


def test_ids_of_numpy_integers_come_back_as_ints(engine):
    """(They once stayed numpy integers in prompt_token_ids, which json.dumps refuses.)"""
    out = engine.generate([[np.int64(5), np.int32(6), True]], greedy(2))[0]
    assert json.dumps(out.prompt_token_ids) == "[5, 6, 1]"


@pytest.mark.parametrize(("prompt", "got"), [
    (None, "None"), (5, "int"), (b"abc", "bytes"), ({"ids": [5]}, "dict"),
    (np.array([[5, 6]]), "a 2-D int64 numpy array"),
    (np.array([5.0, 6.0]), "a 1-D float64 numpy array"),
], ids=["none", "int", "bytes", "dict", "2-d-array", "float-array"])
def test_other_prompts_are_one_line(engine, prompt, got):
    with pytest.raises(ConfigError) as err:
        engine.generate([[5, 6], prompt], greedy(2))
    assert str(err.value) == f"a prompt must be a string or a list of token ids, got {got}"
    assert not engine.has_unfinished()


def test_params_that_are_not_sampling_params_are_one_line(engine):
    message = "sampling params must be a SamplingParams, got dict; build one with SamplingParams"
    for call in (lambda: engine.generate([[5, 6]], {"max_tokens": 2}),
                 lambda: engine.generate([[5, 6]], [{"max_tokens": 2}]),
                 lambda: next(engine.stream([5, 6], {"max_tokens": 2}))):
        with pytest.raises(ConfigError, match=message):
            call()
    assert not engine.has_unfinished()
    params = (greedy(2), greedy(1))  # (a tuple of params, one each)
    assert [o.num_completion_tokens for o in engine.generate([[5, 6], [7]], params)] == [2, 1]


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"block_size": "64"}, "block_size must be an integer, got '64'"),
        ({"max_num_seqs": 1.5}, "max_num_seqs must be an integer, got 1.5"),
        ({"max_model_len": "100"}, "max_model_len must be an integer, got '100'"),
        ({"num_kv_blocks": True}, "num_kv_blocks must be an integer, got True"),
        ({"memory_fraction": "0.5"}, "memory_fraction must be a number, got '0.5'"),
        ({"enable_prefix_cache": "no"}, "enable_prefix_cache must be True or False, got 'no'"),
        ({"host_cache_bytes": -5}, "host_cache_bytes must be 0 or more, got -5"),
        ({"max_step_ms": "200"}, "max_step_ms must be a number, got '200'"),
        ({"max_step_ms": -1}, "max_step_ms must be 0 (off) or more, got -1.0"),
        ({"max_step_ms": float("nan")}, "max_step_ms must be 0 (off) or more, got nan"),
        ({"model": None}, "model must be a path, got NoneType"),
    ],
)
def test_config_fields_of_the_wrong_type_are_one_line(fields, says):
    """They once raised a TypeError in the checks, failed inside the caches' allocation, or
    were taken ("no" turning the cache on, 1.5 sequences)."""
    with pytest.raises(ConfigError) as err:
        EngineConfig(**{"model": "m", **fields})
    assert str(err.value) == says


def test_the_step_time_target_is_200_ms_on_the_cpu_and_off_elsewhere_unless_set():
    assert EngineConfig(model="m").step_target_s("cpu") == 0.2
    assert EngineConfig(model="m").step_target_s("cuda") == 0.0
    assert EngineConfig(model="m", max_step_ms=50).step_target_s("cuda") == 0.05
    assert EngineConfig(model="m", max_step_ms=0).step_target_s("cpu") == 0.0


def test_config_takes_numpy_counts_and_a_str_path():
    config = EngineConfig(model="m", max_model_len=np.int64(256), memory_fraction=np.float32(0.5))
    assert (config.model, config.max_model_len, type(config.max_model_len)) == (Path("m"), 256, int)


def test_a_cache_dir_under_home_is_there_not_in_a_folder_named_tilde(loaded, engine_device,
                                                                      tmp_path, monkeypatch):
    """As the command line's --cache-dir: `~` is the home folder, for the model and the cache."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    home = tmp_path / "home"
    config = EngineConfig(model="~/m", cache_dir="~/cache", max_model_len=256,
                          **engine_config(engine_device))
    assert (config.model, config.cache_dir) == (home / "m", home / "cache")
    LLMEngine(dataclasses.replace(config, model=loaded.path), loaded=loaded).close()
    assert (home / "cache" / "index.db").is_file()
    assert not (tmp_path / "~").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_a_missing_gpu_is_named_for_python_as_for_the_command_line():
    """EngineConfig(device="cuda") with no GPU: one line that says what to pass instead, from
    Python as well as on the command line."""
    from statechat.devices import resolve_device

    with pytest.raises(ConfigError, match=r'^device cuda .* --device cpu \(device="cpu" from '
                                          r"Python\) or auto$"):
        resolve_device("cuda")


def test_a_cpu_cache_too_small_names_its_field(loaded):
    if loaded.device.type != "cpu":
        pytest.skip("the CPU's cache budget")
    with pytest.raises(ConfigError) as err:
        LLMEngine(EngineConfig(model=loaded.path, device="cpu", cpu_cache_bytes=0), loaded=loaded)
    assert str(err.value) == ("not enough memory for the KV and state caches; raise "
                              "cpu_cache_bytes (0) or lower max_num_seqs")


def test_a_home_of_no_such_user_is_one_line():
    """`~user` of a user this machine does not have: one line, not a RuntimeError."""
    with pytest.raises(ConfigError, match=r"^cache_dir ~no-such-user-statechat/x: no home"):
        EngineConfig(model="/tmp", cache_dir="~no-such-user-statechat/x")
