"""A structured output of a thinking model's reply (`serve --reasoning-parser qwen3`, a template
whose generation prompt opens `<think>`) holds the answer, not the reasoning: the reply may
think freely and then, after its `</think>`, is held (the tiny model is pushed to write
`</think>` first by a logit_bias on it, which the constraint would otherwise forbid); with
thinking off (`enable_thinking: false`: the prompt closes the block itself) the whole reply is
held, as it is without a reasoning parser, where there is no answer apart from the reply."""

from __future__ import annotations

import pytest
import torch

from statechat.model.loader import load_model
from statechat.paths import EMBEDDED_MODEL
from tests import serving as served
from tests.helpers import THINKING, with_template

CHOICES = ["alpha", "beta"]


@pytest.fixture(scope="module")
def loaded():
    return with_template(load_model(EMBEDDED_MODEL, dtype=torch.float32), THINKING)


@pytest.fixture(scope="module")
def server(loaded):
    with served.serving(loaded, reasoning_parser="qwen3", tool_call_parser=None) as srv:
        yield srv


def ask(server, loaded, **fields) -> dict:
    """The message of a greedy reply held to CHOICES, its `</think>` (a special token of the
    tiny tokenizer: kept in the text) pushed up."""
    end = loaded.tokenizer.convert_tokens_to_ids("</think>")
    reply = served.post(server, {
        "model": "m", "messages": [{"role": "user", "content": "Pick."}], "max_tokens": 20,
        "temperature": 0, "guided_choice": CHOICES, "logit_bias": {str(end): 100},
        "skip_special_tokens": False, **fields})
    assert reply["choices"][0]["finish_reason"] == "stop", reply
    return reply["choices"][0]["message"]


def test_the_answer_after_the_thinking_is_held(server, loaded):
    message = ask(server, loaded)
    assert message["content"] in CHOICES and not message["reasoning"]
    chunks = served.post(server, {"model": "m", "messages": [{"role": "user", "content": "Hm"}],
                                  "max_tokens": 20, "guided_choice": CHOICES, "stream": True,
                                  "logit_bias": {"4": 100}, "skip_special_tokens": False,
                                  "temperature": 0})
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                      if c.get("choices"))
    assert content in CHOICES


def test_with_thinking_off_the_whole_reply_is_held(server, loaded):
    message = ask(server, loaded, chat_template_kwargs={"enable_thinking": False})
    assert message["content"] in CHOICES  # (no `</think>` drawn: the choice from the start)


def test_without_a_parser_the_whole_reply_is_held(loaded):
    with served.serving(loaded, tool_call_parser=None) as srv:
        assert ask(srv, loaded)["content"] in CHOICES
