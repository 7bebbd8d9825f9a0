"""POST /v1/completions through the openai client's `completions.create`: a string prompt is fed
as its tokens (no chat template) and a token-id prompt gives the same reply; a list of prompts
gives n choices each, indexed prompt * n + i; max_tokens defaults to 16 (or serve's
--max-tokens); echo puts the prompt
first; logprobs give the legacy object (tokens that spell the reply, top_logprobs dicts of the
asked size holding the chosen token, character offsets); a stream matches the whole reply;
usage counts every prompt once; echo with logprobs scores the prompt (its tokens and their
logprobs first, as transformers' logits give them; max_tokens 0 for the prompt alone), whole
or streamed, and vLLM's prompt_logprobs hold the same values; with n > 1 a prompt's logprobs
are computed once, by its choice 0, and shown by every choice; over-long and malformed prompts,
suffix, and max_tokens 0 without echo are 400s naming the field."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from transformers import AutoTokenizer

from statechat.paths import EMBEDDED_MODEL
from tests.server.conftest import KEY

openai = pytest.importorskip("openai", reason="the openai client is a dev dependency")
PROMPT = "state cache block token layer chat model prefix"
GREEDY = {"model": "m", "temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(EMBEDDED_MODEL)


def spelled(tokens: list[str]) -> str:
    """The text that legacy tokens spell ("bytes:\\xNN" ones are parts of a character)."""
    raw = b"".join(bytes.fromhex(t[6:].replace("\\x", "")) if t.startswith("bytes:") else t.encode()
                   for t in tokens)
    return raw.decode("utf-8", "replace")


def test_string_and_token_prompts(client, tokenizer):
    text = client.completions.create(**GREEDY, prompt=PROMPT, max_tokens=10)
    ids = tokenizer.encode(PROMPT)
    assert text.object == "text_completion" and text.choices[0].index == 0
    assert text.usage.prompt_tokens == len(ids) and text.usage.completion_tokens == 10
    assert text.choices[0].finish_reason == "length"
    by_ids = client.completions.create(**GREEDY, prompt=ids, max_tokens=10)
    assert by_ids.choices[0].text == text.choices[0].text
    default = client.completions.create(**GREEDY, prompt=PROMPT)
    assert default.usage.completion_tokens == 16  # OpenAI's and vLLM's default for this API
    assert default.choices[0].text.startswith(text.choices[0].text.rstrip("\ufffd"))


def test_serve_max_tokens_sets_the_default_here_too(client, server, monkeypatch):
    """`serve --max-tokens 5` is the default of a text completion as of a chat one."""
    monkeypatch.setattr(server, "completion_max_tokens", 5)
    assert client.completions.create(**GREEDY, prompt=PROMPT).usage.completion_tokens == 5
    assert client.completions.create(**GREEDY, prompt=PROMPT,
                                     max_tokens=7).usage.completion_tokens == 7


def test_a_list_of_prompts_with_n(client, tokenizer):
    other = [5, 6, 7, 8]
    each = [client.completions.create(**GREEDY, prompt=p, max_tokens=6).choices[0].text
            for p in (PROMPT, other)]
    both = client.completions.create(**GREEDY, prompt=[tokenizer.encode(PROMPT), other], n=2,
                                     max_tokens=6)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert [c.text for c in both.choices] == [each[0], each[0], each[1], each[1]]
    assert both.usage.prompt_tokens == len(tokenizer.encode(PROMPT)) + 4
    assert both.usage.completion_tokens == 4 * 6
    seeded = client.completions.create(model="m", prompt=[PROMPT, PROMPT], n=2, seed=3,
                                       temperature=1.0, max_tokens=6)
    texts = [c.text for c in seeded.choices]
    assert texts[:2] == texts[2:] and texts[0] != texts[1]  # choice i of a prompt: seed + i


def test_echo(client, tokenizer):
    reply = client.completions.create(**GREEDY, prompt=PROMPT, max_tokens=5)
    echoed = client.completions.create(**GREEDY, prompt=PROMPT, max_tokens=5, echo=True)
    assert echoed.choices[0].text == PROMPT + reply.choices[0].text
    ids = [1, *tokenizer.encode("chat model")]
    echoed = client.completions.create(**GREEDY, prompt=ids, max_tokens=5, echo=True)
    assert echoed.choices[0].text.startswith("<|im_start|>chat model")
    stream = list(client.completions.create(**GREEDY, prompt=PROMPT, max_tokens=5, echo=True,
                                            stream=True))
    assert stream[0].choices[0].text == PROMPT
    assert "".join(c.choices[0].text for c in stream) == PROMPT + reply.choices[0].text


def test_logprobs(client):
    reply = client.completions.create(**GREEDY, prompt=PROMPT, max_tokens=12, logprobs=3)
    choice = reply.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 12
    assert spelled(lp.tokens) == choice.text
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and top[token] == logprob == max(top.values())  # greedy
    whole = [not t.startswith("bytes:") for t in lp.tokens]
    if all(whole):
        assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(12)]
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    only = client.completions.create(**GREEDY, prompt=PROMPT, max_tokens=4, logprobs=0)
    assert [len(top) for top in only.choices[0].logprobs.top_logprobs] == [1] * 4
    plain = client.completions.create(**GREEDY, prompt=PROMPT, max_tokens=4)
    assert plain.choices[0].logprobs is None


@pytest.fixture(scope="module")
def prompt_logsoftmax(tokenizer):
    """transformers' log-softmax over PROMPT's tokens (row p: the distribution of token p + 1)."""
    import torch
    import transformers

    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(EMBEDDED_MODEL, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([tokenizer.encode(PROMPT)])).logits[0].log_softmax(-1)


def test_echo_with_logprobs_scores_the_prompt(client, tokenizer, prompt_logsoftmax):
    """A prompt scored: max_tokens 0, echo, logprobs (lm-eval-harness asks for one token). The
    prompt's tokens spell it, the first has null logprobs, the others transformers' values; a
    reply's tokens follow with their own, their offsets counting the echo."""
    ids = tokenizer.encode(PROMPT)
    scored = client.completions.create(**GREEDY, prompt=PROMPT, max_tokens=0, echo=True, logprobs=2)
    choice, lp = scored.choices[0], scored.choices[0].logprobs
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == len(ids)
    assert len(lp.tokens) == len(ids) and spelled(lp.tokens) == PROMPT
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    want = prompt_logsoftmax
    for p in range(1, len(ids)):
        assert lp.token_logprobs[p] == pytest.approx(want[p - 1, ids[p]].item(), abs=1e-4)
        top = lp.top_logprobs[p]
        assert top[lp.tokens[p]] == lp.token_logprobs[p] and len(top) in (2, 3)
        assert sorted(top.values())[-2:] == pytest.approx(
            want[p - 1].topk(2).values.tolist()[::-1], abs=1e-4)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] < len(PROMPT)
    # with a reply: the same prompt part, then the reply's tokens as logprobs alone gives them
    both = client.completions.create(**GREEDY, prompt=PROMPT, max_tokens=5, echo=True, logprobs=2)
    alone = client.completions.create(**GREEDY, prompt=PROMPT, max_tokens=5, logprobs=2)
    blp, alp = both.choices[0].logprobs, alone.choices[0].logprobs
    assert both.choices[0].text == PROMPT + alone.choices[0].text
    assert blp.tokens == lp.tokens + alp.tokens
    assert blp.token_logprobs[1 : len(ids)] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)
    assert blp.token_logprobs[len(ids):] == pytest.approx(alp.token_logprobs, abs=1e-5)
    assert blp.text_offset[len(ids):] == [len(PROMPT) + o for o in alp.text_offset]
    assert both.usage.completion_tokens == 5
    # streamed: the echo and its logprobs in the first chunk, the whole the same
    chunks = list(client.completions.create(**GREEDY, prompt=PROMPT, max_tokens=5, echo=True,
                                            logprobs=2, stream=True))
    assert chunks[0].choices[0].text.startswith(PROMPT)
    assert chunks[0].choices[0].logprobs.tokens[: len(ids)] == lp.tokens
    assert "".join(c.choices[0].text for c in chunks) == both.choices[0].text
    streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    assert [t for s in streamed for t in s.tokens] == blp.tokens
    assert [o for s in streamed for o in s.text_offset] == blp.text_offset


def test_vllms_prompt_logprobs(client, tokenizer, prompt_logsoftmax):
    """prompt_logprobs: per prompt token null (the first) or {id: {logprob, rank,
    decoded_token}} of the token (first, as vLLM orders them) and the k likeliest, in a text
    completion's choice and at the top of a chat response."""
    ids = tokenizer.encode(PROMPT)
    reply = client.completions.create(model="m", temperature=0, prompt=PROMPT, max_tokens=2,
                                      extra_body={"prompt_logprobs": 3})
    entries = reply.choices[0].model_extra["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for p in range(1, len(ids)):
        row = prompt_logsoftmax[p - 1]
        own = entries[p][str(ids[p])]
        assert next(iter(entries[p])) == str(ids[p])  # (the token's own entry first, as vLLM's)
        assert own["logprob"] == pytest.approx(row[ids[p]].item(), abs=1e-4)
        assert own["rank"] == (row > row[ids[p]] + 1e-4).sum().item() + 1
        assert own["decoded_token"] == tokenizer.decode([ids[p]])
        top = sorted((v for k, v in entries[p].items() if v["rank"] <= 3), key=lambda v: v["rank"])
        assert [v["logprob"] for v in top] == pytest.approx(row.topk(3).values.tolist(), abs=1e-4)
    assert reply.choices[0].logprobs is None
    chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": PROMPT}],
                                          max_tokens=2, extra_body={"prompt_logprobs": 0})
    entries = chat.model_extra["prompt_logprobs"]
    assert len(entries) == chat.usage.prompt_tokens and entries[0] is None
    assert all(len(e) == 1 for e in entries[1:])  # (k = 0: the token's own alone)


def test_stream_matches_the_whole_reply(client):
    ask = {**GREEDY, "prompt": [PROMPT, "kernel gate delta"], "n": 2, "max_tokens": 9,
           "logprobs": 2}
    whole = client.completions.create(**ask)
    chunks = list(client.completions.create(**ask, stream=True,
                                            stream_options={"include_usage": True}))
    texts, tokens, offsets, finishes = ([""] * 4, [[] for _ in range(4)],
                                        [[] for _ in range(4)], [None] * 4)
    for chunk in chunks[:-1]:
        assert chunk.object == "text_completion"
        (c,) = chunk.choices
        texts[c.index] += c.text
        if c.logprobs:
            tokens[c.index] += c.logprobs.tokens
            offsets[c.index] += c.logprobs.text_offset
        finishes[c.index] = c.finish_reason or finishes[c.index]
    assert texts == [c.text for c in whole.choices]
    assert tokens == [c.logprobs.tokens for c in whole.choices]
    assert offsets == [c.logprobs.text_offset for c in whole.choices]
    assert finishes == ["length"] * 4
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_a_prompts_logprobs_are_computed_once_for_its_choices(client, monkeypatch, tokenizer):
    """With n > 1, echo and logprobs (and vLLM's prompt_logprobs), choice 0 of a prompt alone
    computes the prompt's logprobs, the others resuming from its prompt; every choice shows
    them, whole or streamed, as a request with n=1 does."""
    from tests.server.test_choices import spy_on_choices

    seen = spy_on_choices(monkeypatch)
    long = " ".join(["prefix reuse delta gate kernel"] * 40)
    ask = {"model": "m", "temperature": 0, "max_tokens": 3, "echo": True, "logprobs": 2}
    scored = {"ignore_eos": True, "prompt_logprobs": 1}
    one = client.completions.create(**ask, prompt=long, extra_body=scored)
    reply = client.completions.create(**ask, prompt=[long, PROMPT], n=3, extra_body=scored)
    outs = [h.output for h in seen[1].handles]
    assert outs[0].prompt_logprobs is not None and outs[0].num_cached_tokens == 0
    assert all(out.prompt_logprobs is None and out.num_cached_tokens >= 128 for out in outs[1:3])
    assert outs[3].prompt_logprobs is not None and outs[4].prompt_logprobs is None
    num_ids = len(tokenizer.encode(long))
    want = one.choices[0].logprobs
    for choice in reply.choices[:3]:
        assert choice.logprobs.tokens == want.tokens
        assert choice.logprobs.token_logprobs[1:num_ids] == \
            pytest.approx(want.token_logprobs[1:num_ids], abs=1e-4)
        assert (choice.model_extra["prompt_logprobs"]
                == reply.choices[0].model_extra["prompt_logprobs"])
    num_ids = len(tokenizer.encode(PROMPT))  # (the other prompt's choices: the same copy)
    other = [c.logprobs.token_logprobs[:num_ids] for c in reply.choices[3:]]
    assert other[0][0] is None and None not in other[0][1:] and other == [other[0]] * 3
    chunks = list(client.completions.create(**ask, prompt=[long, PROMPT], n=3, stream=True,
                                            extra_body={"ignore_eos": True}))
    tokens: list[list[str]] = [[] for _ in range(6)]
    for chunk in chunks:
        (c,) = chunk.choices
        tokens[c.index] += c.logprobs.tokens if c.logprobs else []
    assert tokens == [c.logprobs.tokens for c in reply.choices]


@pytest.mark.parametrize("prompt", ["", [], [[]], 5, [1, True], [2.5], [10**6], [-1], [[1], 7]])
def test_bad_prompts_are_400s(client, prompt):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="m", prompt=prompt, max_tokens=2)
    assert info.value.body["param"] == "prompt"


def test_a_lone_surrogate_is_a_400(server):
    req = urllib.request.Request(f"{server.url}/v1/completions", data=b'{"prompt": "a\\ud800"}',
                                 headers={"Authorization": f"Bearer {KEY}"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=30)
    assert info.value.code == 400 and json.loads(info.value.read())["error"]["param"] == "prompt"


def test_a_max_tokens_past_the_room_left_is_a_400(client):
    """A max_tokens the longest prompt leaves no room for is a 400 naming it (vLLM's answer);
    one that just fits is taken."""
    for prompt in ([1] * 1000, [[1] * 10, [1] * 1000]):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="m", prompt=prompt, max_tokens=25)
        assert (info.value.body["param"], info.value.code) == ("max_tokens",
                                                               "context_length_exceeded")
        assert "which leaves 24" in info.value.message
    fits = client.completions.create(**GREEDY, prompt=[1] * 1000, max_tokens=24)
    assert fits.usage.completion_tokens == 24


def test_whole_number_floats_are_integers(client):
    """logprobs, n, max_tokens and token ids given as whole-number floats are the integers
    they are."""
    ids = client.completions.create(**GREEDY, prompt=[[7.0, 8.0], [7, 8]], max_tokens=3,
                                    echo=True)
    assert ids.choices[0].text == ids.choices[1].text and ids.usage.prompt_tokens == 4
    fits = client.completions.create(**GREEDY, prompt=PROMPT, max_tokens=2.0, n=2.0,
                                     logprobs=2.0, echo=True)
    assert fits.usage.completion_tokens == 4 and len(fits.choices) == 2
    assert all(len(top) in (2, 3) for top in fits.choices[1].logprobs.top_logprobs[1:])
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="m", prompt=PROMPT, logprobs=2.5)
    assert info.value.body["param"] == "logprobs"


def test_refused_fields_and_long_prompts(client):
    client.completions.create(model="m", prompt=PROMPT, max_tokens=2, suffix="")
    for fields, param in (({"suffix": "end"}, "suffix"),
                          ({"logprobs": 21}, "logprobs"), ({"n": 17}, "n"),
                          ({"best_of": 3}, "best_of"), ({"max_tokens": 0}, "max_tokens"),
                          ({"extra_body": {"prompt_logprobs": 1}, "stream": True},
                           "prompt_logprobs"),
                          ({"extra_body": {"logprobs": True}}, "logprobs")):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(**{"model": "m", "prompt": PROMPT, **fields})
        assert info.value.body["param"] == param
        if param == "max_tokens":
            assert "0 only with echo" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="m", prompt=[PROMPT] * 20, n=16)
    assert info.value.body["param"] == "prompt" and "at most 256 choices" in info.value.message
    for prompt in ([1] * 1024, [PROMPT, [1] * 1500]):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="m", prompt=prompt, max_tokens=2)
        assert info.value.code == "context_length_exceeded" and info.value.body["param"] == "prompt"
        assert "context limit is 1024" in info.value.message


def test_a_prompt_of_ids_that_ends_inside_a_character(client, tokenizer):
    """A reply that finishes a character the prompt's ids began shows it whole, streamed or
    not (its last byte alone was U+FFFD)."""
    ids = tokenizer.encode("state 中")
    ask = {**GREEDY, "prompt": ids[:-1], "max_tokens": 1, "logit_bias": {str(ids[-1]): 100}}
    assert client.completions.create(**ask).choices[0].text == "中"
    chunks = client.completions.create(**ask, stream=True)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "中"
