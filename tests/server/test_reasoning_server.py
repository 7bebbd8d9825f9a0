"""`serve --reasoning-parser qwen3` end to end, with a thinking template and a reply forced token
by token (the tiny model never writes `</think>` of itself): the message's `reasoning` (and its
old name `reasoning_content`) holds the reasoning and `content` the answer, whole or streamed
(each delta carries one or the other, both where it spans the tag), for every choice of n; a
reply cut inside its reasoning is all reasoning with a null content; `enable_thinking: false`
leaves it all content; logprobs and usage still count every token, and usage counts the
reasoning's (completion_tokens_details.reasoning_tokens, summed over choices, whole or
streamed); `include_reasoning: false` leaves the reasoning's fields out and the content as it
was; /v1/completions and a server without the flag give the raw text (no reasoning_tokens),
`include_reasoning` taken and doing nothing there; a reasoning sent back reaches the
template."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest
import torch

from statechat.api_chat import chat_prompt
from statechat.api_request import ApiError
from statechat.chat.next_turn import next_turn_prefix
from statechat.chat.template import render
from statechat.model.loader import load_model
from statechat.paths import EMBEDDED_MODEL
from tests import serving as served
from tests.helpers import THINKING, force_reply, with_template
from tests.server.conftest import KEY

openai = pytest.importorskip("openai", reason="the openai client is a dev dependency")
REPLY = "Let me see.</think>\n\nIt is 4."
THOUGHT = "Let me see.</think>"  # (the reasoning's tokens spell it: one a character)
ASK = {"model": "m", "messages": [{"role": "user", "content": "2+2?"}], "temperature": 0}


@pytest.fixture(scope="module")
def loaded():
    return with_template(load_model(EMBEDDED_MODEL, dtype=torch.float32), THINKING)


def serving(loaded, warm_next_turn: bool = False):
    """A server of `loaded` with the reasoning parser (and tools off)."""
    return served.serving(loaded, warm_next_turn=warm_next_turn, reasoning_parser="qwen3",
                           tool_call_parser=None)


@pytest.fixture(scope="module")
def server(loaded):
    with serving(loaded) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture
def forced(server, monkeypatch):
    """Every reply made `REPLY` then the end of turn; the forced token ids."""
    return force_reply(server.worker.engine, monkeypatch, REPLY)


def post(server, route: str, body: dict) -> list[dict] | dict:
    """The JSON answer, or a stream's chunks."""
    return answer(server, route, body)[1]


def answer(server, route: str, body: dict) -> tuple[int, list[dict] | dict]:
    """The status and JSON answer (an error's too), or a stream's chunks."""
    try:
        return 200, _post(server, route, body)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _post(server, route: str, body: dict) -> list[dict] | dict:
    req = urllib.request.Request(f"{server.url}{route}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          "Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        text = resp.read().decode()
    if not body.get("stream"):
        return json.loads(text)
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def test_a_whole_reply_is_split(server, forced):
    reply = post(server, "/v1/chat/completions", {**ASK, "n": 2})
    for k, choice in enumerate(reply["choices"]):
        assert choice["index"] == k and choice["finish_reason"] == "stop"
        assert choice["message"] == {"role": "assistant", "content": "\n\nIt is 4.",
                                     "reasoning": "Let me see.",
                                     "reasoning_content": "Let me see."}
    assert reply["usage"]["completion_tokens"] == 2 * len(forced)  # (the reasoning counts)


def test_a_stream_gives_reasoning_then_content(server, forced):
    chunks = post(server, "/v1/chat/completions", {**ASK, "n": 2, "stream": True,
                                                   "stream_options": {"include_usage": True}})
    for k in range(2):
        deltas = [c["choices"][0]["delta"] for c in chunks
                  if c["choices"] and c["choices"][0]["index"] == k]
        assert deltas[0] == {"role": "assistant", "content": ""} and deltas[-1] == {}
        body = deltas[1:-1]
        assert "".join(d.get("reasoning", "") for d in body) == "Let me see."
        assert "".join(d.get("content", "") for d in body) == "\n\nIt is 4."
        assert all(d.get("reasoning") == d.get("reasoning_content") for d in body)
        assert all(set(d) in ({"content"}, {"reasoning", "reasoning_content"}) for d in body)
        first_content = next(i for i, d in enumerate(body) if "content" in d)
        assert all("content" not in d for d in body[:first_content])
        assert all("reasoning" not in d for d in body[first_content:])
    assert chunks[-1]["usage"]["completion_tokens"] == 2 * len(forced)


def test_the_openai_client_reads_both_parts(client, forced):
    reply = client.chat.completions.create(**ASK)
    message = reply.choices[0].message
    assert (message.reasoning, message.content) == ("Let me see.", "\n\nIt is 4.")
    chunks = list(client.chat.completions.create(**ASK, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == "Let me see."
    assert "".join(d.content or "" for d in deltas) == "\n\nIt is 4."


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("cut, reasoning, finish", [
    ({"max_tokens": 6}, "Let me", "length"), ({"stop": [" see"]}, "Let me", "stop"),
])
def test_a_reply_cut_inside_its_reasoning_is_all_reasoning(server, forced, stream, cut,
                                                           reasoning, finish):
    reply = post(server, "/v1/chat/completions", {**ASK, **cut, "stream": stream})
    if not stream:
        message = reply["choices"][0]["message"]
        assert (message["reasoning"], message["content"]) == (reasoning, None)
        assert reply["choices"][0]["finish_reason"] == finish
        return
    deltas = [c["choices"][0]["delta"] for c in reply]
    assert "".join(d.get("reasoning", "") for d in deltas) == reasoning
    assert "".join(d.get("content", "") for d in deltas) == ""
    assert reply[-1]["choices"][0]["finish_reason"] == finish


@pytest.mark.parametrize("stream", [False, True])
def test_without_thinking_the_reply_is_all_content(server, forced, stream):
    body = {**ASK, "chat_template_kwargs": {"enable_thinking": False}, "stream": stream}
    reply = post(server, "/v1/chat/completions", body)
    if not stream:
        message = reply["choices"][0]["message"]
        assert (message["reasoning"], message["content"]) == (None, REPLY)
        return
    deltas = [c["choices"][0]["delta"] for c in reply]
    assert "".join(d.get("content", "") for d in deltas) == REPLY
    assert not any("reasoning" in d for d in deltas)


def test_logprobs_cover_every_token_of_both_parts(server, forced):
    body = {**ASK, "logprobs": True, "top_logprobs": 2}
    whole = post(server, "/v1/chat/completions", body)["choices"][0]
    assert len(whole["logprobs"]["content"]) == len(forced)
    chunks = post(server, "/v1/chat/completions", {**body, "stream": True})
    entries = [e for c in chunks if c["choices"][0]["logprobs"]
               for e in c["choices"][0]["logprobs"]["content"]]
    assert [e["token"] for e in entries] == [e["token"] for e in whole["logprobs"]["content"]]


def test_text_completions_and_a_server_without_the_flag_give_the_raw_text(server, forced,
                                                                          monkeypatch):
    text = post(server, "/v1/completions", {"model": "m", "prompt": "2+2?", "max_tokens": 40})
    assert text["choices"][0]["text"] == REPLY  # (vLLM parses chat completions only)
    monkeypatch.setattr(server, "reasoning_parser", None)
    message = post(server, "/v1/chat/completions", ASK)["choices"][0]["message"]
    assert message == {"role": "assistant", "content": REPLY}


def test_the_answer_sent_back_resumes_from_the_next_turns_warm_up(loaded, monkeypatch):
    """A client sends the next turn with the reply's `content` alone (the answer, its leading
    blank line included): the template renders it as it renders the whole reply (Qwen3.5's
    drops an earlier reply's reasoning and trims it), so the request resumes from the prefix
    the server computed ahead from the whole reply."""
    answer = "\n\n" + "four is the sum of two and two. " * 10
    with serving(loaded, warm_next_turn=True) as srv:
        force_reply(srv.worker.engine, monkeypatch, "Let me see.</think>" + answer)
        first = [{"role": "user", "content": "2+2?"}]
        message = post(srv, "/v1/chat/completions", {**ASK, "messages": first})[
            "choices"][0]["message"]
        assert message["content"] == answer
        deadline = time.monotonic() + 60
        while srv.next_turns.considered < 1 or srv.next_turns.last is None:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        srv.next_turns.last.result(timeout=60)
        history = [*first, {"role": "assistant", "content": message["content"]}]
        usage = post(srv, "/v1/chat/completions", {
            **ASK, "messages": [*history, {"role": "user", "content": "and 3+3?"}]})["usage"]
        prefix = next_turn_prefix(lambda ms: srv.worker.render(ms, False), history)
    assert len(prefix) >= 2 * 64
    assert usage["prompt_tokens_details"]["cached_tokens"] == len(prefix) // 64 * 64


@pytest.mark.parametrize("stream", [False, True])
def test_a_reply_continued_inside_its_reasoning_goes_on_as_reasoning(server, forced, stream):
    """continue_final_message on an assistant message whose `<think>` is not closed yet (a
    reasoning prefill, or a reply cut inside its reasoning sent back): the continuation is
    reasoning up to the `</think>` it writes, as vLLM reads it, not all content."""
    messages = [*ASK["messages"], {"role": "assistant", "content": "<think>\nHmm."}]
    body = {**ASK, "messages": messages, "continue_final_message": True,
            "add_generation_prompt": False, "stream": stream}
    reply = post(server, "/v1/chat/completions", body)
    if stream:
        deltas = [c["choices"][0]["delta"] for c in reply]
        got = tuple("".join(d.get(k) or "" for d in deltas) for k in ("reasoning", "content"))
    else:
        message = reply["choices"][0]["message"]
        got = message["reasoning"], message["content"]
    assert got == ("Let me see.", "\n\nIt is 4.")


# a template that renders an assistant turn's reasoning_content, as Qwen's do after the last
# user message
SHOWS_REASONING = (
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' }}"
    "{%- if m['reasoning_content'] is string %}"
    "{{- '<think>\\n' + m['reasoning_content'] + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{- m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
)


@pytest.mark.parametrize("name", ["reasoning", "reasoning_content"])
def test_reasoning_sent_back_reaches_the_template(loaded, name):
    """An assistant message's reasoning, sent back under either name the parser gives it,
    is the template's `reasoning_content` (vLLM passes it on); a reasoning that is not text
    is a 400 naming it."""
    tokenizer = with_template(loaded, SHOWS_REASONING).tokenizer
    worker = SimpleNamespace(render=lambda messages, add, template_kwargs, tools=None, **_: render(
        tokenizer, messages, add, template_kwargs, tools))
    turn = {"role": "assistant", "content": "It is 4.", name: "Let me see."}
    body = {"messages": [ASK["messages"][0], turn]}
    text = tokenizer.decode(chat_prompt(worker, body, {}))
    assert "<think>\nLet me see.\n</think>\n\nIt is 4." in text
    with pytest.raises(ApiError) as bad:
        chat_prompt(worker, {"messages": [ASK["messages"][0], {**turn, name: 4}]}, {})
    assert bad.value.status == 400 and bad.value.param == f"messages[1].{name}"


def test_usage_counts_the_reasoning_tokens_of_every_choice(server, forced):
    """(It was left out: a client could not tell the reasoning's cost from the answer's.)"""
    thought = len(THOUGHT)
    whole = post(server, "/v1/chat/completions", {**ASK, "n": 2})["usage"]
    assert whole["completion_tokens_details"] == {"reasoning_tokens": 2 * thought}
    chunks = post(server, "/v1/chat/completions", {**ASK, "n": 2, "stream": True,
                                                   "stream_options": {"include_usage": True}})
    assert chunks[-1]["usage"] == {**whole, "prompt_tokens_details": chunks[-1]["usage"][
        "prompt_tokens_details"]}
    cut = post(server, "/v1/chat/completions", {**ASK, "max_tokens": 6})["usage"]
    assert cut["completion_tokens_details"] == {"reasoning_tokens": 6}  # (all reasoning)
    plain = post(server, "/v1/chat/completions",
                 {**ASK, "chat_template_kwargs": {"enable_thinking": False}})["usage"]
    assert plain["completion_tokens_details"] == {"reasoning_tokens": 0}


@pytest.mark.parametrize("stream", [False, True])
def test_include_reasoning_false_leaves_the_reasoning_out(server, forced, stream):
    """(vLLM's field was ignored: the reasoning went out all the same.)"""
    body = {**ASK, "n": 2, "include_reasoning": False, "stream": stream,
            **({"stream_options": {"include_usage": True}} if stream else {})}
    reply = post(server, "/v1/chat/completions", body)
    if not stream:
        for choice in reply["choices"]:
            assert choice["message"] == {"role": "assistant", "content": "\n\nIt is 4."}
        usage = reply["usage"]
    else:
        for k in range(2):
            deltas = [c["choices"][0]["delta"] for c in reply
                      if c["choices"] and c["choices"][0]["index"] == k]
            assert not any({"reasoning", "reasoning_content"} & set(d) for d in deltas)
            assert "".join(d.get("content", "") for d in deltas) == "\n\nIt is 4."
        usage = reply[-1]["usage"]
    assert usage["completion_tokens_details"] == {"reasoning_tokens": 2 * len(THOUGHT)}


@pytest.mark.parametrize("parser", ["qwen3", None])
def test_include_reasoning_must_be_true_or_false(server, forced, monkeypatch, parser):
    monkeypatch.setattr(server, "reasoning_parser", parser)
    for bad in ("no", 0, [], {}):
        status, reply = answer(server, "/v1/chat/completions", {**ASK, "include_reasoning": bad})
        assert status == 400 and reply["error"]["param"] == "include_reasoning", bad
    if parser is None:  # (taken, and changes nothing: the raw text, no reasoning_tokens)
        for flag in (True, False):
            reply = post(server, "/v1/chat/completions", {**ASK, "include_reasoning": flag})
            assert reply["choices"][0]["message"] == {"role": "assistant", "content": REPLY}
            assert "completion_tokens_details" not in reply["usage"]
