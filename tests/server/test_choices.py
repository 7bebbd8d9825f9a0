"""Chat completions with n choices, through the openai client: n choices indexed 0..n-1; with a
seed the request is reproducible, its choices differ and choice 0 is the n=1 reply (choice i
samples with seed + i, as the Python API's sample i does); greedy choices are identical; usage
counts the prompt once and every choice's tokens; a stream interleaves the choices, each with
its own role and finish chunk, and matches the whole reply; the choices after the first resume
from its prompt (in a chat, also when it asks for prompt_logprobs, which choice 0 alone computes
and a stream gives every choice's first event, later choices' events waiting for them); a client
that goes away, streamed or not, stops every choice, whose reuse lines are logged marked
aborted; n and best_of out of range are 400s naming them."""

from __future__ import annotations

import dataclasses
import http.client
import json
import re
import threading
import time

import pytest

from statechat.api_choices import Choices
from statechat.config import EngineConfig
from statechat.engine.engine import LLMEngine, StreamEvent
from statechat.paths import EMBEDDED_MODEL
from tests.server.conftest import KEY, steps_held_until_an_abort

openai = pytest.importorskip("openai", reason="the openai client is a dev dependency")
MESSAGES = [{"role": "system", "content": "state cache block token layer chat model"},
            {"role": "user", "content": "prefix reuse delta gate kernel"}]
ASK = {"model": "m", "messages": MESSAGES, "max_tokens": 8, "extra_body": {"ignore_eos": True}}


def test_seeded_choices_are_reproducible_and_differ(client):
    first = client.chat.completions.create(**ASK, n=3, temperature=1.0, seed=7)
    again = client.chat.completions.create(**ASK, n=3, temperature=1.0, seed=7)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.message.content for c in again.choices] == texts
    assert len(set(texts)) > 1
    one = client.chat.completions.create(**ASK, temperature=1.0, seed=7)
    assert one.choices[0].message.content == texts[0]
    assert first.usage.prompt_tokens == one.usage.prompt_tokens
    assert first.usage.completion_tokens == 3 * 8
    assert first.usage.total_tokens == first.usage.prompt_tokens + 24


def test_the_choices_are_the_python_apis_samples(client, server, monkeypatch):
    """Choice i is sample i of the engine's generate with the same params and n (one fan-out:
    engine/samples.py)."""
    seen = spy_on_choices(monkeypatch)
    reply = client.chat.completions.create(**ASK, n=3, temperature=1.0, seed=11)
    first = seen[0].handles[0]
    engine = LLMEngine(EngineConfig(model=EMBEDDED_MODEL, device="cpu", max_model_len=1024),
                       loaded=server.worker.engine.loaded)
    out = engine.generate(first.output.prompt_token_ids, dataclasses.replace(first.params, n=3))
    assert [s.text for s in out[0].outputs] == [c.message.content for c in reply.choices]


def test_greedy_choices_are_identical(client):
    reply = client.chat.completions.create(**ASK, n=4, temperature=0)
    assert len({c.message.content for c in reply.choices}) == 1
    assert [c.finish_reason for c in reply.choices] == ["length"] * 4


def test_stream_interleaves_the_choices(client):
    whole = client.chat.completions.create(**ASK, n=3, temperature=1.0, seed=11)
    chunks = list(client.chat.completions.create(**ASK, n=3, temperature=1.0, seed=11,
                                                 stream=True,
                                                 stream_options={"include_usage": True}))
    texts, roles, finishes = ["", "", ""], [0, 0, 0], [[], [], []]
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.delta.content or ""
        roles[choice.index] += choice.delta.role == "assistant"
        if choice.finish_reason:
            finishes[choice.index].append(choice.finish_reason)
    assert texts == [c.message.content for c in whole.choices]
    assert roles == [1, 1, 1] and finishes == [["length"]] * 3
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    # (the chunks before it carry a null usage, as OpenAI's do: they left the field out)
    assert all("usage" in c.model_fields_set and c.usage is None for c in chunks[:-1])


def spy_on_choices(monkeypatch) -> list:
    """The Choices the server makes, as it makes them."""
    seen, submit = [], Choices.submit

    def spy(*args, **kwargs):
        seen.append(submit(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(Choices, "submit", spy)
    return seen


def post(server, body: dict) -> http.client.HTTPConnection:
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=30)
    conn.request("POST", "/v1/chat/completions", json.dumps(body),
                 {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    return conn


def all_aborted(handles) -> bool:
    deadline = time.monotonic() + 30
    while not all(h.seq is not None and h.seq.is_finished for h in handles):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return [h.seq.finish_reason for h in handles] == ["abort"] * len(handles)


def leave_mid_reply(server, monkeypatch, messages, n: int, stream: bool) -> list:
    """Post a long request and leave after its first chunk, or while its whole reply is made;
    the Choices it made (spied on)."""
    seen = spy_on_choices(monkeypatch)
    conn = post(server, {"messages": messages, "n": n, "max_tokens": 900, "ignore_eos": True,
                         "stream": stream})
    if stream:
        resp = conn.getresponse()
        assert resp.status == 200 and resp.readline().startswith(b"data: ")
        resp.close()
    else:
        while not seen:
            time.sleep(0.05)
    conn.close()
    return seen


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_a_client_that_leaves_stops_every_choice(server, monkeypatch, stream):
    seen = leave_mid_reply(server, monkeypatch, MESSAGES, 3, stream)
    assert all_aborted(seen[0].handles)


def reuse_lines(capsys, num_prompt_tokens: int, count: int) -> list[str]:
    """The server's next `count` reuse log lines of requests with that many prompt tokens."""
    lines, deadline = [], time.monotonic() + 20
    while len(lines) < count:
        assert time.monotonic() < deadline, f"{len(lines)} of {count} reuse lines logged"
        lines += [line for line in capsys.readouterr().err.splitlines()
                  if f"of {num_prompt_tokens:,} prompt tokens" in line]
        time.sleep(0.05)
    return lines


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_a_request_whose_client_left_logs_its_reuse(server, monkeypatch, capsys, stream):
    """Each choice of a request whose client went away logs its reuse line, as a finished
    one does, marked aborted."""
    monkeypatch.setattr(server, "quiet", False)
    messages = [{"role": "user", "content": f"leave and log {stream}"}]
    num_prompt_tokens = len(server.worker.render(messages))
    capsys.readouterr()
    post(server, {"messages": messages, "max_tokens": 2}).getresponse().read()
    (line,) = reuse_lines(capsys, num_prompt_tokens, 1)
    assert "; 2 new" in line and "aborted" not in line
    leave_mid_reply(server, monkeypatch, messages, 2, stream)
    lines = reuse_lines(capsys, num_prompt_tokens, 2)
    assert len(lines) == 2 and all(line.endswith("; aborted") for line in lines)


def test_reuse_lines_name_the_response_and_its_choice(server, monkeypatch, capsys):
    """Each reuse line starts with the id of the response it belongs to, and the choice's
    index where the response has several, so a log of many requests can be read."""
    monkeypatch.setattr(server, "quiet", False)
    messages = [{"role": "user", "content": "whose reuse line is this"}]
    num_prompt_tokens = len(server.worker.render(messages))
    capsys.readouterr()
    for n in (1, 2):
        resp = post(server, {"messages": messages, "n": n, "max_tokens": 2}).getresponse()
        rid = json.loads(resp.read())["id"]
        lines = reuse_lines(capsys, num_prompt_tokens, n)
        heads = sorted(re.search(r" (chatcmpl-\w+(?: choice \d)?): reused ", line)[1]
                       for line in lines)
        assert heads == ([rid] if n == 1 else [f"{rid} choice 0", f"{rid} choice 1"]), lines


def test_a_client_that_leaves_before_any_choice_starts_gets_each_logged(server, monkeypatch,
                                                                       capsys):
    """With n > 1 every choice is queued at once (the later ones wait in the engine for choice
    0's prompt); a client that leaves before any step gets each aborted and its reuse logged,
    marked aborted."""
    monkeypatch.setattr(server, "quiet", False)
    messages = [{"role": "user", "content": " ".join(["leave before it starts"] * 40)}]
    num_prompt_tokens = len(server.worker.render(messages))
    steps_held_until_an_abort(server, monkeypatch)  # (the step waits until it is aborted)
    capsys.readouterr()
    post(server, {"messages": messages, "n": 3, "max_tokens": 5}).close()
    lines = reuse_lines(capsys, num_prompt_tokens, 3)
    assert len(lines) == 3 and all(line.endswith("; aborted") for line in lines), lines


def test_the_other_choices_resume_from_the_first_ones_prompt(client, monkeypatch):
    """Choice 0 computes the prompt; the others start once it has, from the prefix cache."""
    seen = spy_on_choices(monkeypatch)
    long = [{"role": "user", "content": " ".join(["prefix reuse delta gate kernel"] * 40)}]
    reply = client.chat.completions.create(**{**ASK, "messages": long}, n=3, temperature=1.0)
    outs = [h.output for h in seen[0].handles]
    assert outs[0].num_cached_tokens == 0 and reply.usage.prompt_tokens > 128
    assert all(out.num_cached_tokens >= 128 for out in outs[1:])
    # the prompt counted once: its cached tokens are choice 0's, not the sum of the choices'
    assert reply.usage.prompt_tokens_details.cached_tokens == 0


def test_a_chats_prompt_logprobs_are_computed_by_its_first_choice_alone(client, monkeypatch):
    """A chat response shows choice 0's prompt_logprobs: the other choices do not ask for them,
    and resume from its prompt instead of each computing it whole."""
    seen = spy_on_choices(monkeypatch)
    long = [{"role": "user", "content": " ".join(["prefix reuse delta gate kernel"] * 40)}]
    ask = {**ASK, "messages": long, "extra_body": {"ignore_eos": True, "prompt_logprobs": 1}}
    one = client.chat.completions.create(**ask, temperature=0)
    reply = client.chat.completions.create(**ask, n=3, temperature=0)
    assert reply.model_extra["prompt_logprobs"] == one.model_extra["prompt_logprobs"]
    outs = [h.output for h in seen[1].handles]
    assert outs[0].prompt_logprobs is not None and outs[0].num_cached_tokens == 0
    assert all(out.prompt_logprobs is None and out.num_cached_tokens >= 128 for out in outs[1:])
    assert len({c.message.content for c in reply.choices}) == 1


def test_n_and_best_of_out_of_range_are_400s(client):
    client.chat.completions.create(**{**ASK, "extra_body": {"best_of": 2}}, n=2)
    for n, extra, param in ((17, {}, "n"), (0, {}, "n"), (3, {"best_of": 4}, "best_of"),
                            (1, {"best_of": 2}, "best_of")):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(**{**ASK, "extra_body": extra}, n=n)
        assert info.value.body["param"] == param


def test_a_stream_gives_every_choice_its_prompts_logprobs():
    """Choice 0 of each prompt brings its prompt's logprobs in its first event; the first
    event of every other choice of that prompt carries them too, however late choice 0 is
    (its events are held until then), and every event comes, each choice's in order."""
    choice_1_done = threading.Event()

    def late_choice_0():
        choice_1_done.wait(10)
        yield StreamEvent("a", [1], prompt_logprobs=["scores of 0"])
        yield StreamEvent("b", [2])

    def choice_1():
        yield StreamEvent("c", [3])
        yield StreamEvent("d", [4])
        choice_1_done.set()

    other_prompt = [[StreamEvent("e", [5], prompt_logprobs=["scores of 1"])],
                    [StreamEvent("f", [6])]]
    events = list(Choices([late_choice_0(), choice_1(), *other_prompt], n=2,
                          is_scored=True).merged())
    by_choice: dict[int, list] = {}
    for index, event in events:
        by_choice.setdefault(index, []).append((event.text, event.prompt_logprobs))
    assert by_choice == {0: [("a", ["scores of 0"]), ("b", None)],
                         1: [("c", ["scores of 0"]), ("d", None)],
                         2: [("e", ["scores of 1"])], 3: [("f", ["scores of 1"])]}
    assert next(index for index, _ in events if index < 2) == 0  # (choice 1's waited)
    # a choice 0 that ends with no event at all loses none of the others' (they come last)
    events = list(Choices([[], [StreamEvent("g", [7])]], n=2, is_scored=True).merged())
    assert [(index, event.text, event.prompt_logprobs) for index, event in events] == \
        [(1, "g", None)]
