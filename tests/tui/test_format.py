"""A thinking model's reply on screen: its reasoning (Qwen's `<think>...</think>`) is shown
dimmed before the answer. Markdown alone drops the tags and the text up to the next blank line,
so a reply still thinking showed nothing, and parts of a finished one's reasoning leaked. A
reply's status line: the sampling line, stats of the wrong types, a continuation's count."""

from __future__ import annotations

import pytest
from rich.console import Console

from statechat.chat.tree import Message
from statechat.tui.format import split_thinking, status_line
from statechat.tui.widgets.message_view import MessageView


@pytest.mark.parametrize("text, parts", [
    ("<think>\nLet me see.\n\nTwo steps.\n</think>\n\nThe answer is 4.",
     ("Let me see.\n\nTwo steps.", "The answer is 4.")),
    ("Let me see.\n</think>\n\nThe answer is 4.",
     ("Let me see.", "The answer is 4.")),  # opened by the prompt
    ("<think>\nstill going", ("still going", "")),  # streaming
    ("The answer is 4.", ("", "The answer is 4.")),
    ("", ("", "")),
])
def test_split_thinking(text, parts):
    assert split_thinking(text) == parts


def shown(text: str) -> str:
    view = MessageView(Message("m", "c", None, "assistant", text, 0.0))
    console = Console(width=80, record=True)
    console.print(view._body())
    return console.export_text()


def test_reasoning_is_shown_before_the_answer():
    screen = shown("<think>\nLet me think about **this**.\n\nStep two.\n</think>\n\n"
                   "The answer is 4.")
    assert (screen.index("thinking: Let me think") < screen.index("Step two.")
            < screen.index("The answer is 4."))
    assert "still going" in shown("<think>\nstill going")  # (was empty while the model thought)
    assert "<think>" not in screen and "</think>" not in screen


def test_sampling_line():
    from statechat.engine.sampling import SamplingParams
    from statechat.tui.format import sampling_line

    assert sampling_line(
        SamplingParams(temperature=0.6, top_k=20, top_p=0.95, presence_penalty=1.5)
    ) == "temperature 0.6, top-p 0.95, top-k 20, presence 1.5"
    assert (sampling_line(SamplingParams(top_k=20, repetition_penalty=1.1))
            == "greedy, repetition 1.1")


@pytest.mark.parametrize("stats", [{"ttft_s": "1"}, {"tokens_per_s": "x"},
                                   {"completion_tokens": "3"}, {"prompt_tokens": None,
                                                                "cached_tokens": 2}])
def test_stats_of_the_wrong_types_show_no_status(stats):
    """Stats are only shown: a row edited by hand into values of the wrong types shows no
    status line (formatting it raised, and the app would not start, or ended in a
    traceback when that chat was opened)."""
    assert status_line(stats) == ""


def test_a_continuation_s_status_counts_the_tokens_it_added():
    """A continuation's token count is its own generation's, with the reply's in all; its
    prompt, which holds the reply it went on from, is what the reuse is counted over."""
    stats = {"ttft_s": 0.012, "tokens_per_s": 85.3, "prompt_tokens": 240, "cached_tokens": 192,
             "computed_tokens": 48, "completion_tokens": 24, "reused_from": "device",
             "finish_reason": "length", "continued_tokens": 200}
    assert status_line(stats) == (
        "TTFT 12 ms · 85.3 tok/s · 24 tokens more (224 in all) · reused 192 of 240 prompt "
        "tokens from device checkpoint; computed 48 · hit max tokens")
    assert "more" not in status_line({**stats, "continued_tokens": None})
    assert "1 token more (201 in all)" in status_line({**stats, "completion_tokens": 1})
