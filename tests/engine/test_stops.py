"""Stop strings: the reply ends before the first one, whichever token completes it (the last
one included, when the reply also hits max_tokens), and a stream never shows any part of it."""

from __future__ import annotations

import pytest
import torch

from statechat.config import EngineConfig
from statechat.engine.engine import LLMEngine
from statechat.engine.output import cut_at_stop
from statechat.engine.sampling import SamplingParams
from statechat.engine.sequence import Sequence
from statechat.engine.worker import EngineWorker
from statechat.model.loader import load_model
from tests.helpers import engine_config

PROMPT = list(range(3, 40))


@pytest.fixture(scope="module")
def engine(tiny_dirs, engine_device):
    path = tiny_dirs["qwen3_5_text"]
    return LLMEngine(EngineConfig(model=path, max_model_len=256, dtype="float32",
                                  **engine_config(engine_device)),
                     loaded=load_model(path, dtype=torch.float32, device=engine_device))


def greedy(engine: LLMEngine, n: int, **stop) -> tuple[str, str]:
    out = engine.generate([PROMPT], SamplingParams(max_tokens=n, ignore_eos=True, **stop))[0]
    return out.text, out.finish_reason


def streamed(events) -> tuple[str, str]:
    text, reason = "", None
    for event in events:
        text += event.text
        reason = event.output.finish_reason if event.output is not None else reason
    return text, reason


def test_a_stop_string_ends_the_reply_and_is_never_streamed(engine):
    full, _ = greedy(engine, 40)
    for n in range(10, 30):  # a stop across two tokens: its first character came a step before
        b = len(greedy(engine, n)[0])
        stop = full[b - 1 : b + 2]
        if len(stop) == 3 and full.count(stop) == 1:
            break
    else:  # (the tiny model's reply is fixed: a change of it lands here)
        raise AssertionError("no three characters across a token boundary occur once in the reply")
    cut = full.index(stop)
    assert greedy(engine, 40, stop=[stop]) == (full[:cut], "stop")
    assert streamed(engine.stream(PROMPT, SamplingParams(max_tokens=40, ignore_eos=True,
                                                         stop=[stop]))) == (full[:cut], "stop")
    worker = EngineWorker(engine)  # the server's path
    try:
        handle = worker.submit(PROMPT, SamplingParams(max_tokens=40, ignore_eos=True, stop=(stop,)))
        assert streamed(handle) == (full[:cut], "stop")
    finally:
        worker.shutdown()


def test_a_stop_string_in_the_last_token_is_cut(engine):
    """The token that reaches max_tokens can complete a stop string: the reply is cut there
    and ends with 'stop', as it would one token earlier."""
    for n in range(6, 16):
        text, _ = greedy(engine, n)
        shorter, _ = greedy(engine, n - 1)
        new = text[len(shorter):]
        if len(new) >= 2 and text.count(new[-2:]) == 1:
            break
    else:
        raise AssertionError("no reply of 6-15 tokens ends with a token of two new characters")
    assert greedy(engine, n, stop=[new[-2:]]) == (text[:-2], "stop")


def test_a_tiny_temperature_samples_greedily(engine):
    """1e-40 once overflowed the logits into NaN and gave an empty reply."""
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=1e-40, seed=1)
    assert params.is_greedy
    assert engine.generate([PROMPT], params)[0].text == greedy(engine, 8)[0]


def test_a_stop_string_in_the_first_min_tokens_is_not_found_later(engine):
    """Stop strings are looked for only past min_tokens: a short stop inside the first
    min_tokens tokens' text does not end the reply at the next token (it once did when
    another stop was longer, whose length set how far back every stop was looked for)."""
    full, _ = greedy(engine, 40)
    for m in range(3, 20):
        shown = len(greedy(engine, m)[0])
        c = full[shown - 1] if shown else ""
        if c and c != "\ufffd":
            break
    else:
        raise AssertionError("no reply of 3-19 tokens ends with a whole character")
    cut = full.find(c, shown)
    want = (full[:cut], "stop") if cut >= 0 else (full, "length")
    assert greedy(engine, 40, stop=[c, "\x00never\x00"], min_tokens=m) == want


def test_stop_reason_names_the_stop_string_or_token(engine):
    """vLLM's stop_reason: the stop string matched (of two, the one that begins first, though
    listed second), or the stop_token_ids token, or an EOS id other than the tokenizer's; None
    for the tokenizer's EOS and for a reply cut at max_tokens. A stream's last output carries
    it too."""
    full, _ = greedy(engine, 40)
    # `later` begins inside `stop`: it completes with it, or after
    i = next(i for i in range(4, 30)
             if full.count(full[i : i + 2]) == full.count(full[i + 1 : i + 3]) == 1)
    stop, later = full[i : i + 2], full[i + 1 : i + 3]
    params = SamplingParams(max_tokens=40, ignore_eos=True, stop=[later, stop])
    out = engine.generate([PROMPT], params)[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (full[: full.index(stop)], "stop",
                                                              stop)
    assert list(engine.stream(PROMPT, params))[-1].output.stop_reason == stop
    ids = engine.generate([PROMPT], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    out = engine.generate([PROMPT], SamplingParams(max_tokens=8, stop_token_ids=[ids[3]],
                                                   ignore_eos=True))[0]
    assert (out.token_ids, out.finish_reason, out.stop_reason) == (ids[: ids.index(ids[3]) + 1],
                                                                   "stop", ids[3])
    eos = engine.tokenizer.eos_token_id
    out = engine.generate([PROMPT], SamplingParams(max_tokens=8, logit_bias={eos: 100},
                                                   stop_token_ids=[eos]))[0]
    assert (out.token_ids, out.finish_reason, out.stop_reason) == ([eos], "stop", None)
    # generation_config.json's other EOS id (<|endoftext|> beside the tokenizer's <|im_end|>)
    # ends the reply as a stop token does, named (vLLM's); once its stop_reason was None
    (other,) = engine.eos_ids - {eos}
    out = engine.generate([PROMPT], SamplingParams(max_tokens=8, logit_bias={other: 100}))[0]
    assert (out.token_ids, out.text, out.finish_reason, out.stop_reason) == ([other], "", "stop",
                                                                             other)
    out = engine.generate([PROMPT], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert (out.finish_reason, out.stop_reason) == ("length", None)


def test_of_stops_one_token_completes_the_first_to_begin_is_the_reason():
    """A token that completes two stops at once: the text is cut at the one that begins first,
    and that one is the stop_reason, wherever it is listed."""
    seq = Sequence([1, 2, 3], SamplingParams(stop=["bcd", "abc"]), num_prompt_tokens=2,
                   text="xxabcdy")
    assert cut_at_stop(seq, 2)
    assert (seq.text, seq.stop_reason) == ("xx", "abc")


def test_a_stop_token_on_the_last_token_allowed_ends_with_stop(engine):
    """A stop token (or EOS) sampled as the max_tokens-th token, or as the token that fills the
    context, ends the reply with "stop" and its stop_reason, its text dropped, as one sampled
    earlier does (vLLM's order: stop tokens before length; the model ended it of itself)."""
    ids = engine.generate([PROMPT], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    k = next(k for k in range(7, 0, -1) if ids[k] not in ids[:k])
    before = engine.generate([PROMPT], SamplingParams(max_tokens=k, ignore_eos=True))[0]
    out = engine.generate([PROMPT], SamplingParams(max_tokens=k + 1, ignore_eos=True,
                                                   stop_token_ids=[ids[k]]))[0]
    assert (out.token_ids, out.text, out.finish_reason, out.stop_reason) == (
        ids[: k + 1], before.text, "stop", ids[k])
    eos = engine.tokenizer.eos_token_id
    out = engine.generate([PROMPT], SamplingParams(max_tokens=1, logit_bias={eos: 100}))[0]
    assert (out.token_ids, out.finish_reason, out.stop_reason) == ([eos], "stop", None)
    full = list(range(3, 3 + engine.max_model_len - 1))  # (one token of room left)
    out = engine.generate([full], SamplingParams(max_tokens=9, logit_bias={eos: 100}))[0]
    assert (out.token_ids, out.finish_reason) == ([eos], "stop")
    out = engine.generate([full], SamplingParams(max_tokens=9, ignore_eos=True))[0]
    assert (len(out.token_ids), out.finish_reason) == (1, "length")
