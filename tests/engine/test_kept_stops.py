"""vLLM's include_stop_str_in_output and skip_special_tokens through the Python API: a reply
keeps the stop string that ended it (and nothing after it), or the stop token's text, when
asked, in `generate`, in a stream (which then holds nothing back) and through the worker, the
same text each way and the same tokens and logprobs as without it; skip_special_tokens=False
keeps special tokens' text (a `</think>` the tiny tokenizer marks special, the `<|im_end|>`
that ends the reply once stops are kept). Bad values are one line."""

from __future__ import annotations

import pytest
import torch

from statechat.config import EngineConfig
from statechat.engine.engine import LLMEngine
from statechat.engine.sampling import SamplingParams
from statechat.engine.worker import EngineWorker
from statechat.errors import ConfigError
from statechat.model.loader import load_model
from tests.helpers import engine_config, force_reply

PROMPT = list(range(3, 40))


@pytest.fixture(scope="module")
def loaded(tiny_dirs, engine_device):
    return load_model(tiny_dirs["qwen3_5_text"], dtype=torch.float32, device=engine_device)


def make_engine(loaded, engine_device) -> LLMEngine:
    return LLMEngine(EngineConfig(model=loaded.path, max_model_len=256, dtype="float32",
                                  **engine_config(engine_device)), loaded=loaded)


@pytest.fixture(scope="module")
def engine(loaded, engine_device):
    return make_engine(loaded, engine_device)


def every_way(engine: LLMEngine, params: SamplingParams) -> list[tuple[str, str, object]]:
    """(text, finish_reason, stop_reason) of generate, a stream and the worker's stream."""
    out = engine.generate([PROMPT], params)[0]
    ways = [(out.text, out.finish_reason, out.stop_reason)]
    for events in (list(engine.stream(PROMPT, params)), None):
        if events is None:
            worker = EngineWorker(engine)
            try:
                events = list(worker.submit(PROMPT, params))
            finally:
                worker.shutdown()
        last = events[-1].output
        ways.append(("".join(e.text for e in events), last.finish_reason, last.stop_reason))
    return ways


def test_a_kept_stop_string_ends_the_text_every_way(engine):
    full = engine.generate([PROMPT], SamplingParams(max_tokens=40, ignore_eos=True))[0]
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 2]
    cut = full.text.index(stop)
    kept = SamplingParams(max_tokens=40, ignore_eos=True, stop=[stop], logprobs=1,
                          include_stop_str_in_output=True)
    assert every_way(engine, kept) == [(full.text[: cut + len(stop)], "stop", stop)] * 3
    dropped = SamplingParams(max_tokens=40, ignore_eos=True, stop=[stop], logprobs=1)
    assert every_way(engine, dropped) == [(full.text[:cut], "stop", stop)] * 3
    a, b = (engine.generate([PROMPT], p)[0] for p in (kept, dropped))
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


def test_special_tokens_show_when_not_skipped(loaded, engine_device, monkeypatch):
    engine = make_engine(loaded, engine_device)  # (force_reply wants an engine of its own)
    tok = engine.tokenizer
    force_reply(engine, monkeypatch, "", tok.encode("ab", add_special_tokens=False)
                + [tok.convert_tokens_to_ids("</think>")]
                + tok.encode("cd", add_special_tokens=False))
    texts = {}
    for skip in (True, False):
        for keep in (False, True):
            params = SamplingParams(max_tokens=20, skip_special_tokens=skip,
                                    include_stop_str_in_output=keep)
            ways = every_way(engine, params)
            assert len({text for text, _, _ in ways}) == 1, ways
            texts[skip, keep] = ways[0][0]
    assert texts[True, False] == texts[True, True] == "abcd"
    assert texts[False, False] == "ab</think>cd"
    assert texts[False, True] == "ab</think>cd<|im_end|>"  # (the stop token's text, kept)


@pytest.mark.parametrize("field", ["include_stop_str_in_output", "skip_special_tokens"])
def test_a_flag_that_is_not_a_bool_is_one_line(field):
    with pytest.raises(ConfigError, match=f"^{field} must be true or false, got \"no\"$"):
        SamplingParams(**{field: "no"})
