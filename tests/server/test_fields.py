"""Fields of a request body that its API does not read: each request that has some gets one
warning line in the server's log naming them, sorted (their values never), and is served as
usual; fields ignored on purpose (user, store, metadata, ...) and those the API reads are not
named; a long list is cut to 20 names and a count, and a name is escaped and cut. The known
fields are those the parsers read."""

from __future__ import annotations

import contextlib
import json
import urllib.request
from types import SimpleNamespace

from statechat.api_chat import CHAT_FIELDS, chat_prompt, chat_shape
from statechat.api_completions import COMPLETION_FIELDS, parse_completion
from statechat.api_request import (
    DEFAULT_SAMPLING,
    SHARED_FIELDS,
    named,
    parse_params,
    parse_stream,
    unknown_fields,
)
from statechat.api_tools import parse_tools
from tests.server.conftest import KEY

CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2, "temperature": 0}
WARNING = "fields unknown to this server, ignored"


def post(server, route: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(f"{server.url}{route}", data=json.dumps(body).encode(),
                                 headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return resp.status, json.loads(resp.read())


def warnings_of(server, capsys, monkeypatch, route: str, body: dict) -> list[str]:
    """The server's warning lines about unknown fields while it serves `body` (a 200)."""
    monkeypatch.setattr(server, "quiet", False)
    capsys.readouterr()
    status, reply = post(server, route, body)
    assert status == 200 and reply["choices"]
    return [line for line in capsys.readouterr().err.splitlines() if WARNING in line]


def test_unknown_chat_fields_are_named_once_sorted(server, capsys, monkeypatch):
    body = {**CHAT, "zeta_field": "SECRET-VALUE", "alpha_field": {"x": 1}, "user": "someone",
            "store": False, "metadata": {"k": "v"}, "seed": 3, "extra_body_typo": None}
    (line,) = warnings_of(server, capsys, monkeypatch, "/v1/chat/completions", body)
    assert line.endswith(f"POST /v1/chat/completions: {WARNING}: alpha_field, extra_body_typo, "
                         "zeta_field")
    assert "SECRET" not in line


def test_known_and_ignored_fields_are_not_named(server, capsys, monkeypatch):
    body = {**CHAT, "user": "someone", "service_tier": "auto", "parallel_tool_calls": True,
            "tools": [], "stream": False, "n": 1, "chat_template_kwargs": {}}
    assert warnings_of(server, capsys, monkeypatch, "/v1/chat/completions", body) == []


def test_unknown_completion_fields_are_named(server, capsys, monkeypatch):
    """top_logprobs, a chat field, does nothing here (`logprobs` is the count): it is named."""
    body = {"prompt": "state cache", "max_tokens": 2, "echo": True, "logprobs": 1,
            "top_logprobs": 3, "messages": [], "user": "someone"}
    (line,) = warnings_of(server, capsys, monkeypatch, "/v1/completions", body)
    assert line.endswith(f"POST /v1/completions: {WARNING}: messages, top_logprobs")


def test_stream_options_the_server_does_not_read_are_named():
    """stream_options holds fields too: vLLM's continuous_usage_stats gets no usage in each
    chunk here, so it is named with the rest (include_usage, which the server reads, is not)."""
    body = {**CHAT, "stream": True, "zeta_field": 1,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    assert unknown_fields(body, CHAT_FIELDS) == [
        "stream_options.continuous_usage_stats", "zeta_field"]
    assert unknown_fields({**CHAT, "stream": True, "stream_options": {"include_usage": True}},
                          CHAT_FIELDS) == []


def test_a_long_list_is_cut():
    names = [f"field_{i:02d}" for i in range(25)]
    assert named(names) == ", ".join(names[:20]) + " and 5 more"
    assert named(["x" * 500]) == "x" * 37 + "..."
    assert named(["bad\nname"]) == "bad\\nname"


class Reads(dict):
    """A body that records the names of the fields read from it."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.read: set[str] = set()

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)


def test_the_known_fields_are_those_read():
    shared = Reads()
    parse_params(shared, prompt_len=10, max_model_len=100, vocab_size=300)
    parse_stream(shared)
    assert shared.read == SHARED_FIELDS
    chat = Reads(CHAT)
    worker = SimpleNamespace(render=lambda messages, add, template_kwargs, tools=None,
                             chat_template=None: [1, 2])
    chat_prompt(worker, chat, {})
    parse_tools(chat, None)  # (chat_request's: tools, tool_choice and parallel_tool_calls)
    chat_shape(SimpleNamespace(engine=SimpleNamespace(tokenizer=None)), chat, [1, 2], None)
    assert chat.read | SHARED_FIELDS == CHAT_FIELDS
    text = Reads({"prompt": [1, 2, 3]})  # (its other fields go to parse_params, as `shared`)
    loaded = SimpleNamespace(config=SimpleNamespace(vocab_size=300))
    worker = SimpleNamespace(tokenizer_for=lambda num_chars: contextlib.nullcontext(None),
                             max_model_len=100,
                             engine=SimpleNamespace(tokenizer=None, loaded=loaded))
    parse_completion(text, worker, DEFAULT_SAMPLING)
    assert text.read | (SHARED_FIELDS - {"top_logprobs"}) == COMPLETION_FIELDS

