"""`--reasoning-parser qwen3`: a thinking model's reply split into its reasoning and its answer,
as vLLM's parser of that name splits them, for the chat API (api_chat.ChatShape) and `batch`.

Qwen3.5's generation prompt opens `<think>` (chat/template.py's `opens_thinking` tells), so its
reply is reasoning up to the `</think>` it writes, then the answer. The rules:
- the prompt opened `<think>`: the text before the first `</think>` is reasoning, the text
  after it the answer; a reply with no `</think>` (cut at max_tokens, or by a stop string,
  inside its reasoning) is all reasoning, with no answer;
- it did not (`enable_thinking: false`, whose prompt closes an empty thought itself; a template
  that does not think): the reply is all answer;
- a reply that begins (after at most MAX_LEAD characters of white space, dropped) with a
  `<think>` of its own, as older Qwen3 templates and DeepSeek-R1 leave the model to write, is
  read as one whose prompt opened it;
- the tags themselves are in neither part; no white space is trimmed (the answer after Qwen's
  `</think>` begins with its blank line, as vLLM's does).

A stream gets the same split (ReasoningStream): each delta's text goes to reasoning or to the
answer as it comes, a delta that spans `</think>` gives both, and a text that may be the start
of a tag (`</th`) is held back until the next delta says whether it is one.

A reply's reasoning tokens (usage's `completion_tokens_details.reasoning_tokens`) are its
completion tokens up to and including the one that completes its `</think>` (its own
`<think>` counted too): all of them for a reply that is all reasoning, none for one that is
all answer (`reasoning_tokens`).
"""

from __future__ import annotations

from collections.abc import Callable

from statechat.errors import ConfigError

PARSERS = ("qwen3",)  # the names --reasoning-parser takes (vLLM's)
OPEN, CLOSE = "<think>", "</think>"
MAX_LEAD = 64  # white space a reply's own `<think>` may follow (past it, none is looked for: a
# reply of white space alone is not held back whole)


def check_parser(name: str | None) -> str | None:
    """`name` if it is a parser's (None: no parsing); a one-line ConfigError naming the choices
    else (before a model loads)."""
    if name is None or name in PARSERS:
        return name
    raise ConfigError(f"--reasoning-parser must be {' or '.join(PARSERS)}, got {name!r}")


class ReasoningStream:
    """The split of one reply whose text comes in pieces: `feed` each piece, then `flush` once
    it has ended. Each returns (reasoning, answer): the text of each that may go out now."""

    def __init__(self, opened: bool) -> None:
        """`opened`: the prompt ended inside an opened `<think>` (opens_thinking)."""
        self.is_reasoning = opened  # (before a `</think>`: past it, all is answer)
        self.is_start = True  # (a `<think>` of the reply's own may still come)
        self.held = ""  # text not sent yet: a tag's possible start

    def feed(self, text: str) -> tuple[str, str]:
        self.held += text
        if self.is_start:
            head = self.held.lstrip()
            if len(self.held) - len(head) > MAX_LEAD:
                self.is_start = False
            elif head.startswith(OPEN):  # (written by the reply: what is before it goes)
                self.is_start, self.is_reasoning, self.held = False, True, head[len(OPEN):]
            elif OPEN.startswith(head):  # (white space, or a tag's start: wait)
                return "", ""
            else:
                self.is_start = False
        if not self.is_reasoning:
            out, self.held = self.held, ""
            return "", out
        if CLOSE in self.held:
            reasoning, answer = self.held.split(CLOSE, 1)
            self.is_reasoning, self.held = False, ""
            return reasoning, answer
        keep = tag_start(self.held, CLOSE)
        out, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        return out, ""

    def flush(self) -> tuple[str, str]:
        """The text held back, once the reply has ended: in the part it was in."""
        out, self.held = self.held, ""
        return (out, "") if self.is_reasoning else ("", out)


def tag_start(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (0 if none)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def split_reply(text: str, opened: bool) -> tuple[str | None, str | None]:
    """(reasoning, answer) of a whole reply, each None when empty: what its stream gives."""
    stream = ReasoningStream(opened)
    reasoning, answer = stream.feed(text)
    rest_reasoning, rest_answer = stream.flush()
    return (reasoning + rest_reasoning) or None, (answer + rest_answer) or None


def reasoning_end(text: str, opened: bool) -> int:
    """Where a whole reply's reasoning ends in `text`, its `</think>` included: 0 for a reply
    that is all answer, len(text) for one that is all reasoning (split_reply's rules)."""
    head = text.lstrip()
    lead = len(text) - len(head)
    if lead <= MAX_LEAD and head.startswith(OPEN):
        start = lead + len(OPEN)
    elif opened:
        start = 0
    else:
        return 0
    close = text.find(CLOSE, start)
    return len(text) if close < 0 else close + len(CLOSE)


def reasoning_tokens(decode: Callable[[list[int]], str], token_ids: list[int], text: str,
                     opened: bool) -> int:
    """The reasoning's share of a reply's completion `token_ids` (whose text is `text`, as
    `decode` gives it, less what a stop string cut): the tokens up to and including the one
    whose text completes the reasoning's `</think>`; all of them when the reply has no
    `</think>` after its reasoning began (its end, its end-of-turn token included, is
    reasoning); 0 for a reply that is all answer. A binary search of the decoded prefixes
    (each once a prefix holds the tag, all longer ones do): log2(len) decodes."""
    end = reasoning_end(text, opened)
    if end == 0:
        return 0
    if not text[:end].endswith(CLOSE):
        return len(token_ids)
    start = end - len(CLOSE)
    low, high = 1, len(token_ids)  # (the tag is complete in the ids[:high] prefix)
    while low < high:
        mid = (low + high) // 2
        if decode(token_ids[:mid]).find(CLOSE, start) >= 0:
            high = mid
        else:
            low = mid + 1
    return high
