"""The sampling fields of a chat-completions body: vLLM's top_k, min_p, repetition_penalty,
stop_token_ids and ignore_eos and OpenAI's penalties are taken, a bad value being a 400 naming
the field; the server's defaults (its flags over the model's generation config) fill only the
fields a body leaves out; fields the server cannot honour are taken at the values that leave
them off (clients send those by default) and are a 400 naming the field otherwise, never
silently ignored (stop_token_ids outside the vocabulary too, which could never stop a
reply). n is 1 to 16 and best_of only equal to it; choice i of a seeded request
samples with seed + i."""

from __future__ import annotations

import pytest
import torch

from statechat.api_choices import choice_params
from statechat.api_messages import parse_messages
from statechat.api_request import ApiError, parse_n, parse_params, parse_stream
from statechat.engine.sampler import sample
from statechat.engine.sampling import SamplingParams, check_vocabulary
from statechat.errors import ConfigError


def params(defaults: SamplingParams | None = None, **body):
    """The params of a body with a 10-token prompt, a context of 100 and a vocabulary of 300."""
    if defaults is None:
        return parse_params(body, prompt_len=10, max_model_len=100, vocab_size=300)
    return parse_params(body, prompt_len=10, max_model_len=100, defaults=defaults, vocab_size=300)


def test_vllm_sampling_extensions_are_taken():
    p = params(top_k=5, stop_token_ids=[7, 9], ignore_eos=True, temperature=0.5)
    assert (p.top_k, p.stop_token_ids, p.ignore_eos, p.temperature) == (5, (7, 9), True, 0.5)
    p = params(include_stop_str_in_output=True, skip_special_tokens=False)
    assert p.include_stop_str_in_output and not p.skip_special_tokens
    p = params(include_stop_str_in_output=None, skip_special_tokens=None)  # (null: left out)
    assert not p.include_stop_str_in_output and p.skip_special_tokens
    for field in ("include_stop_str_in_output", "skip_special_tokens"):
        with pytest.raises(ApiError) as info:
            params(**{field: "yes"})
        assert (info.value.param, info.value.message) == (field, f"{field} must be true or false")
    assert params(top_k=-1).top_k == 0  # vLLM's "off"
    assert params().top_k == 0 and params().stop_token_ids == () and not params().ignore_eos


@pytest.mark.parametrize("body", [
    {"presence_penalty": 0}, {"frequency_penalty": 0.0}, {"repetition_penalty": 1.0}, {"min_p": 0},
    {"logprobs": False}, {"top_logprobs": 0}, {"logprobs": None, "top_logprobs": None},
    {"ignore_eos": None}, {"logit_bias": {}}, {"tools": []}, {"tool_choice": "auto"},
    {"response_format": {"type": "text"}}, {"best_of": 1}, {"presence_penalty": None},
    {"skip_special_tokens": True}, {"include_stop_str_in_output": False}, {"min_p": -0.0},
    {"user": "someone", "metadata": {"a": "b"}, "store": False},  # no effect on the reply
])
def test_fields_left_off_are_taken(body):
    params(**body)


def test_penalties_and_min_p_are_taken():
    p = params(min_p=0.1, presence_penalty=1.5, frequency_penalty=-0.5, repetition_penalty=1.2)
    assert (p.min_p, p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == \
        (0.1, 1.5, -0.5, 1.2)
    off = params(min_p=None, presence_penalty=0, frequency_penalty=None)
    assert (off.min_p, off.presence_penalty, off.frequency_penalty, off.repetition_penalty) == \
        (0.0, 0.0, 0.0, 1.0)


@pytest.mark.parametrize("body, field, says", [
    ({"min_p": 1.5}, "min_p", "min_p must be in [0, 1]"),
    ({"min_p": "0.1"}, "min_p", "min_p must be a number"),
    ({"presence_penalty": 2.5}, "presence_penalty", "presence_penalty must be in [-2, 2]"),
    ({"presence_penalty": False}, "presence_penalty", "presence_penalty must be a number"),
    ({"frequency_penalty": -3}, "frequency_penalty", "frequency_penalty must be in [-2, 2]"),
    ({"repetition_penalty": 0}, "repetition_penalty", "repetition_penalty must be > 0"),
    ({"repetition_penalty": [1.1]}, "repetition_penalty", "repetition_penalty must be a number"),
    ({"repetition_penalty": 10**400}, "repetition_penalty", "repetition_penalty is out of range"),
])
def test_bad_penalties_and_min_p_are_400s(body, field, says):
    with pytest.raises(ApiError) as info:
        params(**body)
    assert (info.value.status, info.value.param) == (400, field)
    assert info.value.message.startswith(says)


def test_server_defaults_fill_only_what_the_body_leaves_out():
    """`serve --temperature 0.6 --top-k 20 ...` (or the model's generation config): the
    defaults of every request; a body's own field wins, and null counts as left out."""
    defaults = SamplingParams(temperature=0.6, top_p=0.95, top_k=20, min_p=0.05,
                              repetition_penalty=1.1, presence_penalty=0.5, max_tokens=40)
    p = params(defaults)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.presence_penalty,
            p.max_tokens) == (0.6, 0.95, 20, 0.05, 1.1, 0.5, 40)
    own = params(defaults, temperature=0, top_k=-1, min_p=0, repetition_penalty=1.0,
                 presence_penalty=None, max_tokens=5)
    assert (own.temperature, own.top_k, own.min_p, own.repetition_penalty, own.presence_penalty,
            own.max_tokens, own.top_p) == (0.0, 0, 0.0, 1.0, 0.5, 5, 0.95)
    assert params(SamplingParams(max_tokens=4000)).max_tokens == 90  # capped to the room left
    plain = params()  # no defaults given: OpenAI's, as before
    assert (plain.temperature, plain.top_p, plain.top_k, plain.max_tokens) == (1.0, 1.0, 0, 90)


@pytest.mark.parametrize("body, field", [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"echo": 0}, "echo"),  # a number is not the False of a flag
])
def test_fields_the_server_cannot_honour_are_400s(body, field):
    with pytest.raises(ApiError) as info:
        params(**body)
    assert (info.value.status, info.value.param) == (400, field)
    assert info.value.message == f"{field} is not supported by this server; leave it out"


def test_min_tokens_and_logit_bias():
    p = params(min_tokens=5, logit_bias={"7": -100, "3": 2.5})
    assert (p.min_tokens, p.logit_bias) == (5, ((3, 2.5), (7, -100.0)))
    # (a default max_tokens capped to the room left caps min_tokens with it)
    assert params(SamplingParams(max_tokens=4000), min_tokens=500).min_tokens == 90
    assert params().logit_bias == () and params(logit_bias=None).min_tokens == 0


def test_logprobs_and_top_logprobs():
    assert params(prompt_logprobs=3).prompt_logprobs == 3 and params().prompt_logprobs is None
    assert params(logprobs=True, top_logprobs=5).logprobs == 5
    assert params(logprobs=True).logprobs == 0
    assert params(logprobs=False, top_logprobs=0).logprobs is None and params().logprobs is None


@pytest.mark.parametrize("body, field, message", [
    ({"prompt_logprobs": False}, "prompt_logprobs", "prompt_logprobs must be an integer"),
    ({"logit_bias": {"5": 101}}, "logit_bias",
     "logit_bias values must be in [-100, 100], got 101.0"),
    ({"logit_bias": {"a": 1}}, "logit_bias",
     'logit_bias keys must be token ids (integers >= 0), got "a"'),
    ({"logit_bias": [5]}, "logit_bias", "logit_bias must map token ids to numbers, got [5]"),
    ({"stop": [""]}, "stop", 'stop must be a string or a list of non-empty strings, got [""]'),
    ({"logit_bias": {"500": 1}}, "logit_bias",
     "logit_bias token id 500 is outside the model's vocabulary (0 to 299)"),
    ({"stop_token_ids": [7, 300]}, "stop_token_ids",
     "stop_token_ids token id 300 is outside the model's vocabulary (0 to 299)"),
    ({"stop_token_ids": [-1, 7]}, "stop_token_ids",
     "stop_token_ids token id -1 is outside the model's vocabulary (0 to 299)"),
    ({"min_tokens": 50, "max_tokens": 20}, "min_tokens",
     "min_tokens must be from 0 to max_tokens (20), got 50"),
    ({"min_tokens": -1}, "min_tokens", "min_tokens must be from 0 to max_tokens (90), got -1"),
    ({"prompt_logprobs": 21}, "prompt_logprobs", "prompt_logprobs must be from 0 to 20, got 21"),
    ({"prompt_logprobs": 2, "stream": True}, "prompt_logprobs",
     "prompt_logprobs is not supported with stream; leave one out"),
    ({"max_tokens": 0}, "max_tokens", "max_tokens must be >= 1"),
    ({"logprobs": 0}, "logprobs", "logprobs must be true or false"),
    ({"logprobs": True, "top_logprobs": False}, "top_logprobs", "top_logprobs must be an integer"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "top_logprobs must be from 0 to 20"),
    ({"top_logprobs": 3}, "top_logprobs", "top_logprobs needs logprobs true"),
])
def test_bad_logprobs_fields_are_400s(body, field, message):
    with pytest.raises(ApiError) as info:
        params(**body)
    assert (info.value.status, info.value.param, info.value.message) == (400, field, message)


@pytest.mark.parametrize("ids", [[-1], [7, 300]])
def test_the_engine_refuses_stop_token_ids_outside_the_vocabulary(ids):
    """(The engine's own check, as the Python API and `batch` call it: such an id can never be
    sampled, so the stop it asks for would never come.)"""
    with pytest.raises(ConfigError, match=r"^stop_token_ids token id -?\d+ is outside the "
                                          r"model's vocabulary \(0 to 299\)$"):
        check_vocabulary(SamplingParams(stop_token_ids=ids), 300)


@pytest.mark.parametrize("body, field", [
    ({"top_k": -2}, "top_k"), ({"top_k": 1.5}, "top_k"), ({"top_k": True}, "top_k"),
    ({"stop_token_ids": [1, "2"]}, "stop_token_ids"), ({"stop_token_ids": 3}, "stop_token_ids"),
    ({"stop_token_ids": [True]}, "stop_token_ids"), ({"ignore_eos": "yes"}, "ignore_eos"),
])
def test_bad_extension_values_are_400s(body, field):
    with pytest.raises(ApiError) as info:
        params(**body)
    assert (info.value.status, info.value.param) == (400, field)


@pytest.mark.parametrize("body, n", [({}, 1), ({"n": None}, 1), ({"n": 16}, 16),
                                     ({"n": 3, "best_of": 3}, 3), ({"n": 2, "best_of": None}, 2),
                                     ({"best_of": 1}, 1)])
def test_n_and_best_of(body, n):
    assert parse_n(body) == n
    params(**body)


@pytest.mark.parametrize("body, field", [
    ({"n": 0}, "n"), ({"n": 17}, "n"), ({"n": True}, "n"), ({"n": 2.5}, "n"), ({"n": "2"}, "n"),
    ({"n": 2, "best_of": 3}, "best_of"), ({"best_of": 2}, "best_of"),
    ({"n": 2, "best_of": 1}, "best_of"),
])
def test_bad_n_and_best_of_are_400s(body, field):
    with pytest.raises(ApiError) as info:
        params(**body)
    assert (info.value.status, info.value.param) == (400, field)


def test_whole_number_floats_are_integers():
    """100.0 is taken for an integer field, as pydantic's lax mode (vLLM's request models)
    takes it, and becomes the int 100; 100.5, true and NaN are 400s naming the field."""
    p = params(max_tokens=20.0, top_k=5.0, seed=7.0, min_tokens=2.0, logprobs=True,
               top_logprobs=3.0, prompt_logprobs=1.0, stop_token_ids=[4.0, 9], n=2.0,
               best_of=2.0)
    got = (p.max_tokens, p.top_k, p.seed, p.min_tokens, p.logprobs, p.prompt_logprobs,
           *p.stop_token_ids, parse_n({"n": 2.0, "best_of": 2.0}))
    assert got == (20, 5, 7, 2, 3, 1, 4, 9, 2) and all(type(v) is int for v in got)
    assert params(max_completion_tokens=6.0, max_tokens=9).max_tokens == 6
    for key in ("max_tokens", "max_completion_tokens", "top_k", "seed", "min_tokens", "n",
                "prompt_logprobs"):
        for bad in (3.5, True, float("nan"), float("inf")):
            with pytest.raises(ApiError) as info:
                params(**{key: bad})
            assert (info.value.status, info.value.param) == (400, key), (key, bad)
            assert info.value.message.startswith(f"{key} must be an integer"), info.value.message
    for body, key in (({"logprobs": True, "top_logprobs": 1.5}, "top_logprobs"),
                      ({"stop_token_ids": [1.5]}, "stop_token_ids"),
                      ({"n": 2, "best_of": 2.5}, "best_of")):
        with pytest.raises(ApiError) as info:
            params(**body)
        assert (info.value.status, info.value.param) == (400, key)


def test_an_asked_max_tokens_past_the_room_left_is_a_400():
    """As vLLM answers it: a max_tokens (or max_completion_tokens) the prompt leaves no room
    for is refused, naming the field, rather than cut to the room; the server's default is
    still capped to it, and a max_tokens that just fits is taken."""
    assert params(max_tokens=90).max_tokens == 90 and params().max_tokens == 90
    for body, field in (({"max_tokens": 91}, "max_tokens"),
                        ({"max_completion_tokens": 4000, "max_tokens": 5},
                         "max_completion_tokens"), ({"max_tokens": 91.0}, "max_tokens")):
        with pytest.raises(ApiError) as info:
            params(**body)
        assert (info.value.status, info.value.param, info.value.code) == \
            (400, field, "context_length_exceeded")
        assert info.value.message.startswith(f"{field} is too large: ")
        assert "the context holds 100 tokens and the prompt has 10, which leaves 90" in \
            info.value.message
    # of several prompts (text completions), the longest must leave the room asked for
    assert parse_params({"max_tokens": 50}, 10, 100, longest_len=50).max_tokens == 50
    with pytest.raises(ApiError) as info:
        parse_params({"max_tokens": 51}, 10, 100, longest_len=50)
    assert "the longest prompt has 50, which leaves 50" in info.value.message
    # a prompt that fills the context is the engine's check to refuse (context_length_exceeded)
    assert parse_params({"max_tokens": 5}, 100, 100).max_tokens == 1


def test_choice_seeds_and_room():
    seeded = SamplingParams(seed=5, max_tokens=50)
    assert [p.seed for p in choice_params(seeded, 3, 10, 100)] == [5, 6, 7]
    assert choice_params(SamplingParams(), 3, 10, 100)[2].seed is None
    assert choice_params(SamplingParams(seed=2**64 - 1), 2, 10, 100)[1].seed == 0  # wraps
    assert choice_params(seeded, 1, 70, 100)[0].max_tokens == 30  # the room this prompt leaves
    assert {p.n for p in choice_params(seeded, 3, 10, 100)} == {1}


@pytest.mark.parametrize("body, message", [
    ({"stream_options": {"include_usage": True}}, "stream_options needs stream true"),
    ({"stream": True, "stream_options": 3}, "stream_options must be an object"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}},
     "stream_options.include_usage must be true or false"),
])
def test_bad_stream_options_are_400s(body, message):
    """Each a 400 whose param names the field as the body nests it."""
    with pytest.raises(ApiError) as info:
        parse_stream(body)
    assert (info.value.status, info.value.message) == (400, message)
    assert message.startswith(info.value.param + " ")


def test_stream_options():
    """include_usage read; an empty stream_options asks nothing, so it is taken without
    streaming as well (as vLLM takes it)."""
    assert parse_stream({"stream": True, "stream_options": {"include_usage": True}}) == (True, True)
    assert parse_stream({"stream": True}) == (True, False)
    assert parse_stream({"stream": None, "stream_options": None}) == (False, False)
    assert parse_stream({"stream_options": {}}) == (False, False)


def test_max_completion_tokens_wins_and_stop_and_model_fields():
    """vLLM's reading: max_completion_tokens over max_tokens; "" is refused as [""] is; more
    than 64 stop strings name the field; any model name is served, a non-string one is not."""
    assert params(max_completion_tokens=4, max_tokens=6).max_tokens == 4
    assert params(max_tokens=6).max_tokens == 6
    assert params(model="gpt-4", stop="x").stop == ("x",)
    for body, field in (({"stop": ""}, "stop"), ({"stop": [str(i) for i in range(65)]}, "stop"),
                        ({"stop_token_ids": list(range(65))}, "stop_token_ids"),
                        ({"model": 5}, "model"), ({"model": ["m"]}, "model")):
        with pytest.raises(ApiError) as info:
            params(**body)
        assert (info.value.status, info.value.param) == (400, field), body


def test_a_top_p_below_float32s_range_keeps_the_likeliest_token():
    """A top_p that float32 reads as 0 kept no token, and the draw fell on id 0 (EOS)."""
    from statechat.engine.sampling import TOP_P_TINY

    assert params(top_p=1e-300).top_p == TOP_P_TINY
    assert params(top_p=1e-20).top_p == 1e-20
    logits = torch.full((1, 50), -3.0)
    logits[0, 17] = 0.0
    tokens = sample(logits, [SamplingParams(temperature=1.0, top_p=1e-300, seed=3)], [None])
    assert tokens.tolist() == [17]


@pytest.mark.parametrize("messages, field", [
    (["hi"], "messages[0]"),
    ([{"role": "user", "content": "x"}, 5], "messages[1]"),
    ([{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function"}]}],
     "messages[0].tool_calls"),
])
def test_malformed_messages_name_the_message(messages, field):
    with pytest.raises(ApiError) as info:
        parse_messages(messages)
    assert (info.value.status, info.value.param) == (400, field)


@pytest.mark.parametrize("tools, roles", [(False, "system, developer, user, assistant"),
                                           (True, "system, developer, user, assistant, tool")])
def test_a_bad_role_is_shown_with_every_role_taken(tools, roles):
    """The 400 shows the role given and every role taken: it left out `developer`, which is
    taken (as system), and did not say what was wrong with a role such as "User"."""
    for role in ("User", "function", None):
        with pytest.raises(ApiError) as info:
            parse_messages([{"role": role, "content": "hi"}], tools=tools)
        assert str(info.value) == f"messages[0].role must be one of {roles}, got {role!r}"


@pytest.mark.parametrize("given, field, says", [
    ({"reasoning_content": 4, "reasoning": "x"}, "reasoning_content", "must be a string"),
    ({"reasoning_content": "x", "reasoning": 4}, "reasoning", "must be a string"),
    ({"reasoning_content": 4}, "reasoning_content", "must be a string"),
    ({"reasoning_content": "x", "reasoning": "y"}, "reasoning",
     "must be the same text as messages[1].reasoning_content"),
])
def test_a_bad_reasoning_sent_back_is_named(given, field, says):
    """The field that is not a string (or differs from the other name's text) is the one the
    400 names: it named `reasoning` when reasoning_content was the bad one."""
    turn = {"role": "assistant", "content": "It is 4.", **given}
    with pytest.raises(ApiError) as info:
        parse_messages([{"role": "user", "content": "2+2?"}, turn])
    assert (info.value.status, info.value.param) == (400, f"messages[1].{field}")
    assert str(info.value).startswith(f"messages[1].{field} {says}"), str(info.value)


def test_a_number_too_long_to_read_is_cut_in_its_error():
    """A 300-digit number (1e300, which counts as whole) is cut in the 400's message, as a
    seed's is, not printed in full in every place the message names it."""
    for body in [{"min_tokens": 1e300}, {"max_completion_tokens": 1e300},
                 {"stop_token_ids": [1e300]}, {"max_tokens": 10 ** 60}]:
        with pytest.raises(ApiError) as caught:
            parse_params(body, prompt_len=10, max_model_len=1024, vocab_size=384)
        assert len(caught.value.message) < 300, caught.value.message
