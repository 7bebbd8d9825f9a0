"""The sampling fields of a chat-completions body: vLLM's top_k, stop_token_ids and ignore_eos
are taken; fields the server cannot honour are taken at the values that leave them off (clients
send those by default) and are a 400 naming the field otherwise, never silently ignored."""

from __future__ import annotations

import pytest

from statechat.server import ApiError, parse_params


def params(**body):
    return parse_params(body, prompt_len=10, max_model_len=100)


def test_vllm_sampling_extensions_are_taken():
    p = params(top_k=5, stop_token_ids=[7, 9], ignore_eos=True, temperature=0.5)
    assert (p.top_k, p.stop_token_ids, p.ignore_eos, p.temperature) == (5, (7, 9), True, 0.5)
    assert params(top_k=-1).top_k == 0  # vLLM's "off"
    assert params().top_k == 0 and params().stop_token_ids == () and not params().ignore_eos


@pytest.mark.parametrize("body", [
    {"presence_penalty": 0}, {"frequency_penalty": 0.0}, {"repetition_penalty": 1.0}, {"min_p": 0},
    {"logprobs": False}, {"top_logprobs": 0}, {"logit_bias": {}}, {"tools": []}, {"tool_choice": "auto"},
    {"response_format": {"type": "text"}}, {"best_of": 1}, {"presence_penalty": None},
    {"skip_special_tokens": True}, {"include_stop_str_in_output": False}, {"min_p": -0.0},
    {"user": "someone", "metadata": {"a": "b"}, "store": False},  # no effect on the reply
])
def test_fields_left_off_are_taken(body):
    params(**body)


@pytest.mark.parametrize("body, field", [
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"frequency_penalty": -1}, "frequency_penalty"),
    ({"repetition_penalty": 1.1}, "repetition_penalty"),
    ({"logprobs": True}, "logprobs"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"logit_bias": {"5": 100}}, "logit_bias"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"guided_json": {"type": "object"}}, "guided_json"),
    ({"min_tokens": 4}, "min_tokens"),
    ({"include_stop_str_in_output": True}, "include_stop_str_in_output"),
    ({"skip_special_tokens": False}, "skip_special_tokens"),
    ({"presence_penalty": False}, "presence_penalty"),  # a boolean is not the 0 of a number
    ({"logprobs": 0}, "logprobs"),  # nor a number the False of a flag
])
def test_fields_the_server_cannot_honour_are_400s(body, field):
    with pytest.raises(ApiError) as info:
        params(**body)
    assert (info.value.status, info.value.param) == (400, field)
    assert info.value.message == f"{field} is not supported by this server; leave it out"


@pytest.mark.parametrize("body, field", [
    ({"top_k": -2}, "top_k"), ({"top_k": 1.5}, "top_k"), ({"top_k": True}, "top_k"),
    ({"stop_token_ids": [1, "2"]}, "stop_token_ids"), ({"stop_token_ids": 3}, "stop_token_ids"),
    ({"stop_token_ids": [True]}, "stop_token_ids"), ({"ignore_eos": "yes"}, "ignore_eos"),
])
def test_bad_extension_values_are_400s(body, field):
    with pytest.raises(ApiError) as info:
        params(**body)
    assert (info.value.status, info.value.param) == (400, field)
