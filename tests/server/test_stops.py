"""Stops through the server, as vLLM's answers them: both APIs, streamed or not, cut the reply
before its stop string and name what stopped it in `stop_reason` (the string, or the
stop_token_ids token or an EOS id other than the tokenizer's; null for the tokenizer's EOS and
for a reply cut at max_tokens), and a stream's text is the whole reply's. vLLM's
include_stop_str_in_output keeps the stop string (or the stop token's text) at the text's end,
and skip_special_tokens false keeps special tokens' text."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai", reason="the openai client is a dev dependency")
MESSAGES = [{"role": "user", "content": "Say something about 中文 and 😀."}]


def chat(client, stream: bool, **fields) -> tuple[str, str, object]:
    """(text, finish_reason, stop_reason) of a greedy chat reply."""
    reply = client.chat.completions.create(model="m", messages=MESSAGES, temperature=0,
                                           stream=stream, **fields)
    if not stream:
        choice = reply.choices[0]
        return choice.message.content, choice.finish_reason, choice.model_extra["stop_reason"]
    chunks = [c.choices[0] for c in reply if c.choices]
    assert all("stop_reason" not in c.model_extra for c in chunks[:-1])  # (the last says)
    return ("".join(c.delta.content or "" for c in chunks), chunks[-1].finish_reason,
            chunks[-1].model_extra["stop_reason"])


def completion(client, stream: bool, **fields) -> tuple[str, str, object]:
    """(text, finish_reason, stop_reason) of a greedy text completion."""
    reply = client.completions.create(model="m", prompt="Say something about 中文",
                                      temperature=0, stream=stream, **fields)
    if not stream:
        choice = reply.choices[0]
        return choice.text, choice.finish_reason, choice.model_extra["stop_reason"]
    chunks = [c.choices[0] for c in reply if c.choices]
    # (vLLM's completions stream has the field on every chunk, null until the last; its chat
    # stream only on the last)
    assert all(c.model_extra["stop_reason"] is None for c in chunks[:-1])
    return ("".join(c.text for c in chunks), chunks[-1].finish_reason,
            chunks[-1].model_extra["stop_reason"])


@pytest.mark.parametrize("ask", [chat, completion])
@pytest.mark.parametrize("stream", [False, True])
def test_stop_reason_names_what_stopped_the_reply(client, ask, stream):
    full, reason, why = ask(client, False, max_tokens=24, extra_body={"ignore_eos": True})
    assert (reason, why) == ("length", None)
    stop = next(full[i : i + 2] for i in range(3, len(full) - 2)
                if full.count(full[i : i + 2]) == 1 and "\ufffd" not in full[i : i + 2])
    got = ask(client, stream, max_tokens=24, stop=["\x00never", stop],
              extra_body={"ignore_eos": True})
    assert got == (full[: full.index(stop)], "stop", stop)
    assert ask(client, stream, max_tokens=24, extra_body={"ignore_eos": True}) == (full, "length",
                                                                                  None)
    token = 40  # forced, and a stop token
    got = ask(client, stream, max_tokens=8, logit_bias={str(token): 100},
              extra_body={"stop_token_ids": [token]})
    assert got[1:] == ("stop", token)
    got = ask(client, stream, max_tokens=8, logit_bias={"2": 100})  # (<|im_end|>: EOS)
    assert got == ("", "stop", None)
    # (<|endoftext|>: generation_config.json's other EOS id, a stop token as vLLM takes it)
    got = ask(client, stream, max_tokens=8, logit_bias={"0": 100})
    assert got == ("", "stop", 0)
    # a stop token as the last token max_tokens allows: "stop", not "length" (vLLM's order)
    assert ask(client, stream, max_tokens=1, logit_bias={"2": 100}) == ("", "stop", None)
    got = ask(client, stream, max_tokens=1, logit_bias={str(token): 100},
              extra_body={"stop_token_ids": [token]})
    assert got == ("", "stop", token)


@pytest.mark.parametrize("ask", [chat, completion])
@pytest.mark.parametrize("stream", [False, True])
def test_kept_stops_and_special_tokens_show_in_the_text(client, server, ask, stream):
    full, _, _ = ask(client, False, max_tokens=24, extra_body={"ignore_eos": True})
    stop = next(full[i : i + 2] for i in range(3, len(full) - 2)
                if full.count(full[i : i + 2]) == 1 and "\ufffd" not in full[i : i + 2])
    got = ask(client, stream, max_tokens=24, stop=[stop],
              extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert got == (full[: full.index(stop) + len(stop)], "stop", stop)
    kept = {"skip_special_tokens": False, "include_stop_str_in_output": True}
    got = ask(client, stream, max_tokens=8, logit_bias={"2": 100}, extra_body=kept)
    assert got == ("<|im_end|>", "stop", None)  # (EOS, forced: its text kept)
    special = server.worker.engine.tokenizer.convert_tokens_to_ids("<|im_start|>")
    got = ask(client, stream, max_tokens=3, logit_bias={str(special): 100},
              extra_body={"skip_special_tokens": False, "ignore_eos": True})
    assert got == ("<|im_start|>" * 3, "length", None)
    got = ask(client, stream, max_tokens=3, logit_bias={str(special): 100},
              extra_body={"ignore_eos": True})
    assert got == ("", "length", None)
