"""api_reasoning's split of a thinking model's reply (vLLM's `--reasoning-parser qwen3`): the
reasoning is what comes before `</think>` when the prompt opened `<think>` (or the reply opens
it itself), a reply cut before `</think>` is all reasoning, one whose prompt did not open it is
all answer; and a stream, however its text is cut into deltas (`</th` + `ink>` included), gives
the same two parts, holding back no more than a tag's possible start. A reply's reasoning
tokens are those up to and including the one that completes its `</think>`, all of them when
it is all reasoning, none when it is all answer, whatever the tokens' cuts."""

from __future__ import annotations

import itertools

import pytest

from statechat.api_reasoning import (
    ReasoningStream,
    check_parser,
    reasoning_tokens,
    split_reply,
)
from statechat.errors import ConfigError

CASES = [  # (text, the prompt opened <think>, reasoning, answer)
    ("plan\n</think>\n\nanswer", True, "plan\n", "\n\nanswer"),
    ("still thinking", True, "still thinking", None),  # (cut at max_tokens or by a stop)
    ("", True, None, None),
    ("</think>\n\nanswer", True, None, "\n\nanswer"),
    ("plan</think>", True, "plan", None),
    ("plan</think>a</think>b", True, "plan", "a</think>b"),
    ("<think>plan</think>x", True, "plan", "x"),  # (a reply that opens it again)
    ("plan </th", True, "plan </th", None),  # (a tag's start, never finished)
    ("just an answer", False, None, "just an answer"),  # (enable_thinking false)
    ("a </think> b", False, None, "a </think> b"),
    ("\n<think>\nplan</think>answer", False, "\nplan", "answer"),  # (it opens its own)
    ("<think>plan", False, "plan", None),
    ("<thi", False, None, "<thi"),
    ("  ", False, None, "  "),
    ("<thinking> is a word", False, None, "<thinking> is a word"),
]


@pytest.mark.parametrize("text, opened, reasoning, answer", CASES)
def test_a_whole_reply_is_split(text, opened, reasoning, answer):
    assert split_reply(text, opened) == (reasoning, answer)


def streamed(pieces: list[str], opened: bool) -> tuple[str, str, list[tuple[str, str]]]:
    """(reasoning, answer, what each feed gave) of a reply streamed in `pieces`."""
    stream = ReasoningStream(opened)
    given = [stream.feed(piece) for piece in pieces] + [stream.flush()]
    return "".join(r for r, _ in given), "".join(a for _, a in given), given


@pytest.mark.parametrize("text, opened, reasoning, answer", CASES)
def test_a_stream_cut_anywhere_gives_the_same_parts(text, opened, reasoning, answer):
    for cuts in itertools.chain.from_iterable(
            itertools.combinations(range(1, len(text)), k) for k in (0, 1, 2)):
        bounds = [0, *cuts, len(text)]
        pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
        got_reasoning, got_answer, _ = streamed(pieces, opened)
        assert (got_reasoning or None, got_answer or None) == (reasoning, answer), pieces


def test_a_tag_split_across_two_deltas_is_held_then_split():
    _, _, given = streamed(["I think", " so</th", "ink>\n\nYes", "."], opened=True)
    assert given == [("I think", ""), (" so", ""), ("", "\n\nYes"), ("", "."), ("", "")]


def test_a_delta_spanning_the_tag_gives_both_parts():
    _, _, given = streamed(["a", "b</think>c", "d"], opened=True)
    assert given == [("a", ""), ("b", "c"), ("", "d"), ("", "")]


def test_a_reply_that_opens_its_own_reasoning_is_told_once_the_tag_is_whole():
    _, _, given = streamed(["\n", "<th", "ink>", "x</think>", "y"], opened=False)
    assert given == [("", ""), ("", ""), ("", ""), ("x", ""), ("", "y"), ("", "")]
    _, _, given = streamed(["<th", "e end"], opened=False)  # (no tag after all)
    assert given == [("", ""), ("", "<the end"), ("", "")]


def test_white_space_is_held_back_only_while_a_tag_may_follow_it():
    """(A reply of white space alone was held back whole, each delta scanning it all again.)"""
    *_, given = streamed(["\n"] * 100 + ["<think>x"], opened=False)
    assert given[:64] == [("", "")] * 64 and given[64] == ("", "\n" * 65)
    assert given[65:] == [("", "\n")] * 35 + [("", "<think>x"), ("", "")]
    assert split_reply("\n" * 65 + "<think>x", False) == (None, "\n" * 65 + "<think>x")
    assert split_reply("\n" * 64 + "<think>x", False) == ("x", None)


def test_only_a_known_parser_is_taken():
    assert check_parser("qwen3") == "qwen3" and check_parser(None) is None
    with pytest.raises(ConfigError, match="^--reasoning-parser must be qwen3, got 'deepseek_r1'$"):
        check_parser("deepseek_r1")


TOKEN_CASES = [  # (the reply's tokens' texts, the prompt opened <think>, reasoning tokens)
    (["plan", "\n", "</think>", "\n\n", "answer"], True, 3),
    (["pl", "an</", "thi", "nk>\n", "\nans", "wer"], True, 4),  # (the tag cut over tokens)
    (["still", " thinking", ""], True, 3),  # (cut inside it: all, an end-of-turn included)
    (["</think>", "answer"], True, 1),
    (["just", " an", " answer"], False, 0),
    (["a ", "</think>", " b"], False, 0),
    (["\n", "<think>", "plan", "</think>", "x"], False, 4),  # (it opens its own)
    (["<think>", "plan"], False, 2),
    (["plan</think>a", "</think>b"], True, 1),  # (the first tag ends it)
    ([], True, 0),
]


@pytest.mark.parametrize("pieces, opened, count", TOKEN_CASES)
def test_the_reasoning_tokens_are_those_up_to_its_end(pieces, opened, count):
    decode = lambda ids: "".join(pieces[i] for i in ids)
    ids = list(range(len(pieces)))
    assert reasoning_tokens(decode, ids, decode(ids), opened) == count
