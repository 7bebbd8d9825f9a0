"""Chat-template rendering: extra template variables (chat_template_kwargs, e.g. Qwen's
enable_thinking) reach the template, and names the renderer uses itself are refused."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from statechat.chat.template import merge_template_kwargs, render
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
