"""Chat-template rendering: extra template variables (chat_template_kwargs, e.g. Qwen's
enable_thinking) reach the template, names the renderer uses itself are refused, and the ids are
transformers' apply_chat_template's, token for token, with a template that drops earlier
reasoning as Qwen3.5's does (so a reply's thinking is not a prefix of the next turn's prompt),
and a generation prompt that opens the reasoning is told from one that does not."""

from __future__ import annotations

import copy

import pytest
from transformers import AutoTokenizer

from statechat.chat.template import merge_template_kwargs, opens_thinking, render
from statechat.errors import ConfigError
from statechat.paths import EMBEDDED_MODEL

MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def tokenizer():
    tok = AutoTokenizer.from_pretrained(EMBEDDED_MODEL)
    tok.chat_template = ("{%- if enable_thinking is defined and not enable_thinking %}"
                         "no-think {% endif %}"
                         "{%- for m in messages %}{{ m['content'] }}{% endfor %}")
    return tok


def test_template_variables_reach_the_template(tokenizer):
    plain = render(tokenizer, MESSAGES)
    off = render(tokenizer, MESSAGES, template_kwargs={"enable_thinking": False})
    assert tokenizer.decode(plain) == "hello"
    assert tokenizer.decode(off) == "no-think hello"
    assert render(tokenizer, MESSAGES, template_kwargs={"enable_thinking": True}) == plain


@pytest.mark.parametrize("kwargs, says", [
    ({"tokenize": False}, "chat_template_kwargs may not set tokenize"),
    ({"messages": [], "add_generation_prompt": False},
     "may not set add_generation_prompt, messages"),
    ({"conversations": [], "chat_template": "{{ 1 }}"}, "may not set chat_template, conversations"),
    ({"self": 1}, "may not set self"),
    ([1, 2], "chat_template_kwargs must be an object"),
])
def test_names_the_renderer_uses_are_refused(tokenizer, kwargs, says):
    with pytest.raises(ConfigError, match=says):
        render(tokenizer, MESSAGES, template_kwargs=kwargs)


def test_a_requests_variables_win_over_the_defaults():
    defaults = {"enable_thinking": False, "x": 1}
    assert merge_template_kwargs(defaults, {"enable_thinking": True}) == {"enable_thinking": True,
                                                                          "x": 1}
    assert merge_template_kwargs(defaults, None) == defaults
    assert merge_template_kwargs(None, None) is None and merge_template_kwargs({}, None) is None
    assert merge_template_kwargs(defaults, [1]) == [1]  # (render refuses it)


# Qwen3.5's shape, in brief: contents trimmed, an earlier reply's reasoning (up to </think>)
# dropped, a generation prompt that opens <think> (or closes it at once without thinking)
THINKING = (
    "{%- for m in messages %}{%- set c = m['content'] | trim %}"
    "{%- if m['role'] == 'assistant' and '</think>' in c %}"
    "{%- set r = c.split('</think>')[0].split('<think>')[-1] | trim %}"
    "{%- set c = c.split('</think>')[-1] | trim %}"
    "{%- if loop.last %}{%- set c = '<think>\\n' + r + '\\n</think>\\n\\n' + c %}{%- endif %}"
    "{%- endif %}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + c + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)
TURNS = [{"role": "system", "content": " be brief "}, {"role": "user", "content": "q1"},
         {"role": "assistant", "content": "why\n</think>\n\nsure é🎉"},
         {"role": "user", "content": "q2 <|im_end|>"}]


@pytest.mark.parametrize("n, add_generation_prompt, kwargs", [
    (4, True, None), (4, True, {"enable_thinking": False}), (3, False, None), (2, False, None),
    (3, True, {"not_a_variable": 1}),
])
def test_ids_are_apply_chat_templates(tokenizer, n, add_generation_prompt, kwargs):
    tok = copy.copy(tokenizer)
    tok.chat_template = THINKING
    messages = TURNS[:n]
    expected = tok.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False,
        continue_final_message=not add_generation_prompt and messages[-1]["role"] == "assistant",
        **(kwargs or {}))
    assert render(tok, messages, add_generation_prompt, kwargs) == list(expected)


def test_an_earlier_replys_thinking_leaves_the_next_prompt(tokenizer):
    tok = copy.copy(tokenizer)
    tok.chat_template = THINKING
    first = render(tok, TURNS[:2])
    reply = tok.encode(TURNS[2]["content"], add_special_tokens=False)
    second = render(tok, TURNS)
    assert tok.decode(second).count("why") == 0  # (the template drops it from history)
    same = next(i for i, (a, b) in enumerate(zip(first + reply, second)) if a != b)
    assert tok.decode(second[:same]).endswith("<|im_start|>assistant\n")  # (what a cache reuses)


@pytest.mark.parametrize("template, kwargs, opened", [
    (THINKING, None, True), (THINKING, {"enable_thinking": False}, False),
    ("{%- for m in messages %}{{ m['content'] }}{% endfor %}<think> x", None, False),
    (None, None, False),  # (the embedded model's plain ChatML)
])
def test_a_prompt_that_opens_the_reasoning_is_told(template, kwargs, opened):
    """Qwen3.5's generation prompt ends in `<think>`: its reply streams reasoning with no tag
    of its own, which the app must show as reasoning (tui/format.py)."""
    tok = AutoTokenizer.from_pretrained(EMBEDDED_MODEL)
    tok.chat_template = template or tok.chat_template
    assert opens_thinking(tok, render(tok, TURNS[:2], template_kwargs=kwargs)) is opened


@pytest.mark.parametrize("template, last, opened", [
    (THINKING, {"role": "assistant", "content": "<think>\nHmm, so"}, True),
    (THINKING, {"role": "assistant", "content": "It is"}, False),
    (None, {"role": "assistant", "content": "<think>\nHmm, so"}, True),
    (None, {"role": "assistant", "content": "It is"}, False),
])
def test_a_continued_reply_inside_its_reasoning_is_told(template, last, opened):
    """A reply continued (continue_final_message) while its `<think>` is still open goes on
    reasoning; one that never opened it goes on answering."""
    tok = AutoTokenizer.from_pretrained(EMBEDDED_MODEL)
    tok.chat_template = template or tok.chat_template
    ids = render(tok, [*TURNS[:1], last], add_generation_prompt=False)
    assert opens_thinking(tok, ids) is opened


def test_a_tag_in_an_earlier_turn_does_not_open_the_reply():
    tok = AutoTokenizer.from_pretrained(EMBEDDED_MODEL)  # (plain ChatML: no thinking)
    ids = render(tok, [{"role": "user", "content": "what does <think> mean?"}])
    assert opens_thinking(tok, ids) is False
