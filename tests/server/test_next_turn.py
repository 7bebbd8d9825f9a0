"""Once a chat reply is sent and the engine has nothing else to do, the server computes the
prefix the conversation's next request starts with, as the app does while its user types: with
a thinking template (an earlier reply rendered without its reasoning), the next request resumes
past the reply instead of computing it again. A busy engine, a reply of several choices or
`--no-warm-next-turn` computes nothing."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest
import torch

from statechat.chat.next_turn import next_turn_prefix
from statechat.config import EngineConfig
from statechat.engine.engine import LLMEngine
from statechat.engine.worker import EngineWorker
from statechat.model.loader import load_model
from statechat.paths import EMBEDDED_MODEL
from statechat.server import ChatServer
from tests.helpers import THINKING, with_template
from tests.server.conftest import KEY

BLOCK = 64


@pytest.fixture(scope="module")
def loaded():
    return with_template(load_model(EMBEDDED_MODEL, dtype=torch.float32), THINKING)


def serving(loaded, warm: bool):
    worker = EngineWorker(LLMEngine(EngineConfig(model=EMBEDDED_MODEL, device="cpu"),
                                    loaded=loaded))
    srv = ChatServer(worker, "tiny", "127.0.0.1", 0, api_key=KEY, quiet=True,
                     warm_next_turn=warm)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    return srv, thread


def chat(srv, messages, stream: bool = False, **fields) -> tuple[str, dict]:
    """(The reply's text, its usage), asked whole or streamed."""
    body = {"messages": messages, "ignore_eos": True, "stream": stream, **fields}
    if stream:
        body["stream_options"] = {"include_usage": True}
    req = urllib.request.Request(f"{srv.url}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          "Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        if not stream:
            reply = json.loads(resp.read())
            return reply["choices"][0]["message"]["content"], reply["usage"]
        chunks = [json.loads(line[6:]) for line in resp.read().decode().splitlines()
                  if line.startswith("data: {")]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    return text, chunks[-1]["usage"]


def settle(srv, replies: int) -> None:
    """Wait until the server has considered `replies` replies for a warm-up, and the warm-up
    it made, if any, has ended."""
    deadline = time.monotonic() + 60
    while srv.next_turns is not None and srv.next_turns.considered < replies:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    if srv.next_turns is not None and srv.next_turns.last is not None:
        srv.next_turns.last.result(timeout=60)


def two_turns(loaded, warm: bool, busy: bool = False, **fields) -> tuple[int, int, int]:
    """Two requests of one conversation, the first reply long: (the second request's cached
    tokens, the first prompt's length, the next-turn prefix's length after the first reply)."""
    srv, thread = serving(loaded, warm)
    if busy:  # (as if another client's request were running)
        srv.worker.idle = lambda: False
    try:
        first = [{"role": "user", "content": "first"}]
        text, usage = chat(srv, first, max_tokens=150, **fields)
        history = [*first, {"role": "assistant", "content": text}]
        settle(srv, 1)
        _, second = chat(srv, [*history, {"role": "user", "content": "second"}], max_tokens=1)
        prefix = next_turn_prefix(lambda ms: srv.worker.render(ms, False), history)
        return second["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"], len(prefix)
    finally:
        srv.shutdown()
        srv.server_close()
        srv.worker.shutdown()
        thread.join(10)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_the_next_request_resumes_past_the_reply(loaded, stream):
    cached, first, prefix = two_turns(loaded, warm=True, stream=stream)
    assert prefix >= first + 150  # (the reply's text, rendered without the <think> it opened)
    assert cached == prefix // BLOCK * BLOCK


def test_without_it_the_reply_is_computed_again(loaded):
    cached, first, _ = two_turns(loaded, warm=False)
    assert cached == (first - 1) // BLOCK * BLOCK


def test_a_reply_of_several_choices_warms_nothing(loaded):
    cached, first, _ = two_turns(loaded, warm=True, n=2)
    assert cached == (first - 1) // BLOCK * BLOCK


def test_a_busy_engine_warms_nothing(loaded):
    cached, first, _ = two_turns(loaded, warm=True, busy=True)
    assert cached == (first - 1) // BLOCK * BLOCK
