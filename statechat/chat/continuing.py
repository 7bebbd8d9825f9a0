"""Continuing a reply: the model is given the reply's own prompt followed by the reply as it was
made, and goes on from its last token; the cache resumes from the checkpoints the reply left.

The reply is not rendered through the chat template as a last, open assistant message (what
the server's `continue_final_message` does): a thinking model's template rewrites assistant
messages (Qwen3.5's drops an earlier turn's reasoning; Qwen3's splits the reasoning off and
writes it back between `<think>` tags of its own, and puts an empty thought before a reply with
no `</think>`), after which transformers may not find the reply's text to cut the prompt after,
or cuts a prompt the reply was not made from; and a reply's text need not tokenize to the ids
it was sampled as (a byte-level token cut inside a character, a merge the model did not make),
so the checkpoints its tokens left would not match. So the prompt is built from ids: the
messages before the reply through the template with its generation prompt (the prompt the
reply was made from, as a regenerate renders it), then the reply's own token ids, which the
chats' store keeps with its text (tree.py), or, where none were kept, its text tokenized.

A reply that ends inside a character (cut there at max tokens, or ended by the model just after
a byte that makes no character) is given whole too, that character's bytes included, as a live
session would go on from its last token (vLLM's and llama.cpp's continuations of a final
message tokenize its text again, and its U+FFFD, and lose those bytes): the model finishes the
character, or does not, and the continuation's text shows it once (`continued_text`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from statechat.engine.output import RequestOutput

MAX_PART_TOKENS = 4  # the most ids that hold part of one character: UTF-8's longest is 4 bytes


@dataclass(frozen=True)
class Start:
    """What a reply being made begins with: nothing for a new reply; for a continuation, the
    text and token ids of the reply it continues (its prompt ends with those ids, and its text
    is that text followed by what the model adds), and its id (`of`, set by the caller: a
    continuation that adds nothing is dropped, and that reply shown again). `open_ids`: the
    last of those ids, where the reply ends inside a character (bytes that make none yet), and
    `open_text`, the end of `text` they show as (U+FFFD)."""

    text: str = ""
    token_ids: tuple[int, ...] = ()
    of: str | None = None
    open_ids: tuple[int, ...] = ()
    open_text: str = ""

    def adds_nothing(self, text: str, finish_reason: str | None) -> bool:
        """Whether a continuation begun with this Start that ended with `text` and
        `finish_reason` added nothing of itself: the model ended the turn at once (a reply that
        had ended of itself was complete). A stopped one is the user's doing, and kept."""
        return self.of is not None and text == self.text and finish_reason == "stop"


def reply_start(tokenizer, text: str, stored: list[int] | None,
                vocab_size: int | None = None) -> Start:
    """The Start of a continuation of the reply whose text is `text`: `stored` (its ids as the
    chats' store kept them) where they decode to exactly that text, else the text tokenized
    (a reply saved as it streamed, or by an earlier statechat, keeps none; a row edited by
    hand may no longer match its ids, or hold one the model has not, at or past `vocab_size`
    (the model's; the tokenizer's length if None), which decodes to nothing). A model's
    vocabulary may be longer than its tokenizer's (Qwen3.5 pads it): an id between the two
    decodes to nothing too, but the model sampled it, and it is fed back as it was made. A
    reply that ends inside a character (its first bytes show as U+FFFD at its end) is fed back
    whole, and its Start names the ids of those bytes (`open_ids`), which the model may finish."""
    limit = len(tokenizer) if vocab_size is None else vocab_size
    if stored is None or max(stored, default=-1) >= limit or _decode(tokenizer, stored) != text:
        return Start(text, tuple(tokenizer.encode(text, add_special_tokens=False)))
    parts = min(MAX_PART_TOKENS, len(stored)) if text.endswith("\ufffd") else 0
    for cut in range(1, parts + 1):
        shown = _decode(tokenizer, stored[:len(stored) - cut])
        if not shown.endswith("\ufffd") and text.startswith(shown):
            return Start(text, tuple(stored), open_ids=tuple(stored[len(stored) - cut:]),
                         open_text=text[len(shown):])
    return Start(text, tuple(stored))  # (U+FFFD of the model's own, or bytes no character has)


def continued_text(start: Start, made: str, ids: Sequence[int],
                   decode: Callable[[list[int]], str]) -> str:
    """The text of a continuation begun with `start`, whose own text (the engine's) is `made`
    so far, made of `ids`: the reply's text, then `made`. Where the reply ended inside a
    character that `ids` finish, the engine shows that character whole at the start of `made`
    (its prompt ended with the first bytes): it takes the place of the U+FFFD they showed as,
    what the open ids showed before it (a space, a character of their own) staying.
    `decode`: the tokenizer's, special tokens left out."""
    if not start.open_ids or not made:
        return start.text + made
    # (the bytes that finish a character come within its first few ids; the engine shows what
    # a decode with them changes of open_text: they did not finish it, nothing, U+FFFD stays)
    first = decode([*start.open_ids, *ids[: 2 * MAX_PART_TOKENS]])
    kept = len(os.path.commonprefix([start.open_text, first]))
    return start.text[: len(start.text) - len(start.open_text) + kept] + made


def text_token_ids(tokenizer, out: RequestOutput, stop_ids: Collection[int],
                   start: Start = Start(), text: str | None = None) -> list[int] | None:
    """The ids the text of a reply begun with `start` (a continuation's: the reply it
    continues) was made of, to keep with the reply: `start`'s, then `out`'s but the stop token
    that ended it (an end-of-turn marker: fed back, it would close the reply that a
    continuation goes on with) and those of a character it was stopped inside (an aborted
    reply's text leaves out the part of a character it had); None where no such ids decode to
    its text, `text` (`out.text` if None; a continuation's: `continued_text`'s), as when a
    stop string cut it. `stop_ids`: the ids that stop a reply (EOS and the request's
    stop_token_ids)."""
    text = out.text if text is None else text
    ids = list(out.token_ids)
    if out.finish_reason == "stop" and ids and ids[-1] in stop_ids:
        ids.pop()
    for cut in range(min(MAX_PART_TOKENS, len(ids)) + 1):
        kept = [*start.token_ids, *ids[:len(ids) - cut]]
        if _decode(tokenizer, kept) == text:
            return kept
    return None


def _decode(tokenizer, ids: list[int]) -> str:
    """`ids` as the engine turns them into a reply's text: special tokens left out."""
    return tokenizer.decode(ids, skip_special_tokens=True)
