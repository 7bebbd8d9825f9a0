"""vLLM's token routes, which clients use to count a prompt before they send it: POST /tokenize
gives a text's token ids (or a chat's, rendered as /v1/chat/completions renders it: its count is
that request's prompt_tokens), their count and the context's length, and their strings when
asked; POST /detokenize turns ids back into the text; a bad body is a 400 naming the field.
GET /version names the package's version, and /ping answers probes as /health does, without
the API key (vLLM's and SageMaker's probe)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from statechat import __version__
from tests.serving import KEY


def _call(server, route: str, body: dict | None = None, key: bool = True) -> tuple[int, dict]:
    """(status, JSON answer) of a POST with `body`, else a GET, of `route`."""
    headers = {"Authorization": f"Bearer {KEY}"} if key else {}
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"{server.url}{route}", data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_text_is_tokenized_and_back(server):
    tokenizer = server.worker.engine.tokenizer
    text = "Hello there, tokens!"
    status, answer = _call(server, "/tokenize", {"model": "m", "prompt": text})
    assert status == 200
    assert answer["tokens"] == tokenizer.encode(text)
    assert answer["count"] == len(answer["tokens"])
    assert answer["max_model_len"] == server.worker.max_model_len
    assert "token_strs" not in answer or answer["token_strs"] is None
    status, back = _call(server, "/detokenize", {"tokens": answer["tokens"]})
    assert (status, back) == (200, {"prompt": text})


def test_a_chats_count_is_its_prompt_tokens(server, client):
    messages = [{"role": "system", "content": "Be short."}, {"role": "user", "content": "Hi?"}]
    status, answer = _call(server, "/tokenize", {"messages": messages, "return_token_strs": True})
    reply = client.chat.completions.create(model="m", messages=messages, max_tokens=1)
    assert status == 200 and answer["count"] == reply.usage.prompt_tokens
    assert "".join(answer["token_strs"]).startswith("<|im_start|>system")


def test_bad_bodies_are_400s_naming_the_field(server):
    for route, body, field in [("/tokenize", {}, "prompt"),
                               ("/tokenize", {"prompt": 5}, "prompt"),
                               ("/tokenize", {"messages": "hi"}, "messages"),
                               ("/detokenize", {"tokens": "abc"}, "tokens"),
                               ("/detokenize", {"tokens": [10 ** 9]}, "tokens")]:
        status, answer = _call(server, route, body)
        assert status == 400 and answer["error"]["param"] == field, (route, body, answer)
    assert _call(server, "/tokenize", {"prompt": "x"}, key=False)[0] == 401


def test_version_and_ping(server):
    assert _call(server, "/version") == (200, {"version": __version__})
    assert _call(server, "/ping", key=False) == (200, {"status": "ok"})
    assert _call(server, "/ping", {}, key=False) == (200, {"status": "ok"})
