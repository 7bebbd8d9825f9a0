"""vLLM's skip_special_tokens and include_stop_str_in_output beside the server's parsers. With
`--reasoning-parser qwen3` and a tokenizer that marks `</think>` special (the tiny one does),
skip_special_tokens false keeps the tag's text, so the reply splits there, whole or streamed,
and usage's reasoning_tokens counts the reasoning's tokens up to the tag (it counted every
token: the count decoded the reply without special tokens, so never found the tag). With
`--tool-call-parser qwen3_coder`, a named tool_choice whose request keeps stop strings gets the
same single call and no content as one that does not: the `</tool_call>` the server added as a
stop, kept at the reply's end, is read as the call's end, not left in the reply."""

from __future__ import annotations

import json

import pytest
import torch

from statechat.model.loader import load_model
from statechat.paths import EMBEDDED_MODEL
from tests.helpers import THINKING, force_reply, with_template
from tests.server.test_reasoning_server import ASK, post
from tests.server.test_reasoning_server import serving as reasoning_serving
from tests.server.test_tool_choice import BOTH, NAMED, REST
from tests.server.test_tool_choice_named import SECOND
from tests.server.test_tools_server import reassembled, whole, without_ids
from tests.serving import TOOLS_ASK, tools_fixtures
from tests.serving import post as tools_post

tools_loaded, tools_server = tools_fixtures()
ROUTE = "/v1/chat/completions"


@pytest.fixture(scope="module")
def loaded():
    return with_template(load_model(EMBEDDED_MODEL, dtype=torch.float32), THINKING)


@pytest.fixture(scope="module")
def server(loaded):
    with reasoning_serving(loaded) as srv:
        yield srv


def test_a_kept_special_think_tag_splits_the_reply_and_counts_its_tokens(loaded, server,
                                                                          monkeypatch):
    tok = loaded.tokenizer
    ids = (tok.encode("ab", add_special_tokens=False) + [tok.convert_tokens_to_ids("</think>")]
           + tok.encode("cd", add_special_tokens=False))
    force_reply(server.worker.engine, monkeypatch, "", ids)
    body = {**ASK, "skip_special_tokens": False, "n": 2}
    reply = post(server, ROUTE, body)
    for choice in reply["choices"]:
        message = choice["message"]
        assert (message["reasoning"], message["content"]) == ("ab", "cd")
    # ("a", "b" and the tag, in each choice; not "c", "d" and the end of turn)
    assert reply["usage"]["completion_tokens_details"] == {"reasoning_tokens": 2 * 3}
    chunks = post(server, ROUTE, {**body, "stream": True,
                                  "stream_options": {"include_usage": True}})
    for k in range(2):
        deltas = [c["choices"][0]["delta"] for c in chunks
                  if c["choices"] and c["choices"][0]["index"] == k]
        assert "".join(d.get("reasoning", "") for d in deltas) == "ab"
        assert "".join(d.get("content", "") for d in deltas) == "cd"
    assert chunks[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": 2 * 3}


def test_a_named_call_that_keeps_its_stop_is_the_same_call(tools_server, monkeypatch):
    force_reply(tools_server.worker.engine, monkeypatch, REST + SECOND)
    body = {**TOOLS_ASK, "tools": BOTH, "tool_choice": NAMED}
    plain = whole(tools_post(tools_server, body)["choices"][0])
    kept = {**body, "include_stop_str_in_output": True}
    got = whole(tools_post(tools_server, kept)["choices"][0])
    chunks = tools_post(tools_server, {**kept, "stream": True})
    assert without_ids(got) == without_ids(plain)
    assert got["content"] is None and got["finish_reason"] == "stop"
    assert json.loads(got["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris",
                                                                         "days": 3}
    assert without_ids(reassembled(chunks, 0)) == without_ids(got)
