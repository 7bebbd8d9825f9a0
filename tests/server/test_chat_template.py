"""A request's own `chat_template` (vLLM's field: a template's text) is refused (a 400 naming the
field and `--trust-request-chat-template`, before it is rendered: a template is code that can
loop for hours with the tokenizer held) unless the server trusts its clients' templates, as
vLLM's does. A trusted one replaces the model's for that
request alone, on /v1/chat/completions and /tokenize; a bad one (not text, not Jinja, or one
that fails on the conversation) is a 400 naming the field. The prefix cache stays honest: the
same conversation under two templates is two token sequences, so neither reuses the other's
blocks, while each reuses its own when it comes again."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from statechat.chat.template import render
from tests.serving import KEY

# two templates whose renders differ from their first token (nothing in common to reuse)
ANGLE = ("Notes follow.\n{% for m in messages %}<{{ m.role }}> {{ m.content }}\n{% endfor %}"
         "{% if add_generation_prompt %}<assistant>{% endif %}")
SQUARE = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
          "{% if add_generation_prompt %}[assistant]{% endif %}")
LONG = [{"role": "system", "content": "You keep notes on recurrent state caches. " * 12},
        {"role": "user", "content": "What is kept at a block boundary?"}]


@pytest.fixture(autouse=True)
def trusted(server, monkeypatch):
    """The server as `serve --trust-request-chat-template` makes it."""
    monkeypatch.setattr(server, "trust_request_chat_template", True)


def post(server, route: str, body: dict) -> tuple[int, dict]:
    """(status, JSON answer) of a POST of `body` to `route`."""
    req = urllib.request.Request(f"{server.url}{route}", data=json.dumps(body).encode(),
                                 headers={"Authorization": f"Bearer {KEY}"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def chat(server, template: str | None, messages=LONG) -> dict:
    body = {"model": "m", "messages": messages, "max_tokens": 1, "temperature": 0}
    status, answer = post(server, "/v1/chat/completions",
                          {**body, **({"chat_template": template} if template else {})})
    assert status == 200, answer
    return answer["usage"]


def cached(usage: dict) -> int:
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def test_a_request_s_template_is_its_own(server):
    tokenizer = server.worker.engine.tokenizer
    own = render(tokenizer, LONG)
    assert chat(server, ANGLE)["prompt_tokens"] == len(render(tokenizer, LONG,
                                                              chat_template=ANGLE))
    assert len(render(tokenizer, LONG, chat_template=ANGLE)) != len(own)  # (told apart)
    assert chat(server, None)["prompt_tokens"] == len(own)  # (the next request: the model's)
    status, answer = post(server, "/tokenize", {"messages": LONG, "chat_template": SQUARE})
    assert status == 200 and answer["tokens"] == render(tokenizer, LONG, chat_template=SQUARE)
    status, answer = post(server, "/tokenize", {"messages": LONG})
    assert status == 200 and answer["tokens"] == own


def test_a_bad_template_is_a_400_naming_the_field(server):
    failing = "{{ raise_exception('this template takes no system message') }}"
    for route in ("/v1/chat/completions", "/tokenize"):
        for template, said in [
            (5, "chat_template must be the text of a Jinja chat template"),
            ("{% for m in messages %}", "chat_template is not a valid Jinja template (line 1: "),
            (failing, ("the chat template failed on these messages (this template takes no "
                      "system message)")),
        ]:
            status, answer = post(server, route, {"model": "m", "messages": LONG,
                                                  "chat_template": template})
            assert status == 400, (route, template, answer)
            assert answer["error"]["param"] == "chat_template", answer
            assert answer["error"]["message"].startswith(said), answer
    assert chat(server, None)["prompt_tokens"] > 0  # (the server goes on)


def test_two_templates_share_no_prefix_and_each_reuses_its_own(server):
    messages = [{**LONG[0], "content": "Blocks of 64 tokens, hashed as a chain. " * 12},
                LONG[1]]  # (a conversation of this test alone)
    angle, square = chat(server, ANGLE, messages), chat(server, SQUARE, messages)
    assert angle["prompt_tokens"] > 128 and square["prompt_tokens"] > 128
    assert cached(angle) == 0 and cached(square) == 0  # nothing reused across the templates
    again_angle, again_square = chat(server, ANGLE, messages), chat(server, SQUARE, messages)
    assert cached(again_angle) >= 64 and cached(again_square) >= 64  # each reuses its own
    assert again_angle["prompt_tokens"] == angle["prompt_tokens"]


def test_an_untrusted_server_refuses_a_request_s_template_before_rendering_it(server,
                                                                             monkeypatch):
    monkeypatch.setattr(server, "trust_request_chat_template", False)
    endless = ("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}"
               "{% endfor %}")  # (10^10 turns with the tokenizer held: every request waits)
    for route in ("/v1/chat/completions", "/tokenize"):
        status, answer = post(server, route, {"model": "m", "messages": LONG, "max_tokens": 1,
                                              "chat_template": endless})
        assert status == 400, (route, answer)
        assert answer["error"]["param"] == "chat_template", answer
        assert "--trust-request-chat-template" in answer["error"]["message"], answer
    assert chat(server, None)["prompt_tokens"] > 0  # (no template: served as before)
