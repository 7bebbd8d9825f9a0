"""What one API request's choices are sent as: a whole response, or a stream's chunks, each
choice written by the API's `Shape` (api_chat.ChatShape, api_completions.CompletionShape), and
OpenAI's `usage`, in the whole response or as a stream's last chunk.

In usage, each prompt is counted once (its `cached_tokens` those of its choice that reused the
least), and the completion tokens of every choice are summed; a shape that reports more of
them (a chat split by a reasoning parser: `reasoning_tokens`) adds `completion_tokens_details`,
summed over the choices as well. Without one that field is left out, as vLLM leaves it out
without a reasoning parser (OpenAI's 0 there would claim that no reasoning was made, where
none was looked for).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from statechat.engine.engine import RequestOutput, StreamEvent

if TYPE_CHECKING:
    from statechat.api_choices import Choices


class Shape:
    """How one API writes its choices. A stream sends each choice's `opening` chunks first (a
    chat's role), then the `deltas` of each event as it comes; a whole response holds one
    `choice` per RequestOutput. Every method returns dicts of OpenAI's choice objects."""

    object = ""  # the whole response's "object"
    chunk_object = ""  # a stream chunk's
    id_prefix = ""

    def opening(self, index: int) -> list[dict]:
        return []

    def deltas(self, index: int, event: StreamEvent) -> list[dict]:
        """The stream chunks' choices for `event` of choice `index` (its finish on the last)."""
        raise NotImplementedError

    def choice(self, index: int, out: RequestOutput) -> dict:
        raise NotImplementedError

    def fields(self, outputs: list[RequestOutput]) -> dict:
        """A whole response's own fields beside its choices."""
        return {}

    def completion_details(self, outputs: list[RequestOutput]) -> dict | None:
        """usage's `completion_tokens_details` for every choice's output, or None to leave
        it out."""
        return None


def finish_reason(out: RequestOutput) -> str:
    """OpenAI's finish_reason, or vLLM's "abort" for a reply the server cut (it was stopped):
    the client can tell it from a whole one."""
    return out.finish_reason if out.finish_reason in ("length", "abort") else "stop"


def usage(outputs: list[RequestOutput], n: int, shape: Shape | None = None) -> dict:
    """The usage of `outputs`, n choices per prompt in order (choice index = prompt * n + i);
    `shape`'s completion_details when it gives them."""
    prompts = [outputs[k : k + n] for k in range(0, len(outputs), n)]
    prompt_tokens = sum(group[0].num_prompt_tokens for group in prompts)
    completion_tokens = sum(out.num_completion_tokens for out in outputs)
    counts = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {
            "cached_tokens": sum(min(out.num_cached_tokens for out in group) for group in prompts)},
    }
    details = None if shape is None else shape.completion_details(outputs)
    if details is not None:
        counts["completion_tokens_details"] = details
    return counts


def response(shape: Shape, head: dict, outputs: list[RequestOutput], n: int) -> dict:
    """The whole (non-streamed) response; `head` holds its id, created and model."""
    return {**head, "object": shape.object,
            "choices": [shape.choice(index, out) for index, out in enumerate(outputs)],
            "usage": usage(outputs, n, shape), **shape.fields(outputs)}


def stream_chunks(shape: Shape, choices: Choices, include_usage: bool,
                  gone: Callable[[], bool] = lambda: False) -> Iterator[dict]:
    """A stream's chunks, less their head (id, object, created, model): every choice's opening,
    then each event's deltas as they come, then (include_usage: theirs null) one usage chunk;
    ConnectionResetError if the client goes (`gone`) while they wait (see Choices.merged)."""
    null = {"usage": None} if include_usage else {}  # (OpenAI's: usage null until the last)
    for index in range(len(choices.handles)):
        for choice in shape.opening(index):
            yield {"choices": [choice], **null}
    outputs: list[RequestOutput | None] = [None] * len(choices.handles)
    for index, event in choices.merged(gone):
        for choice in shape.deltas(index, event):
            yield {"choices": [choice], **null}
        if event.output is not None:
            outputs[index] = event.output
    if include_usage:
        yield {"choices": [], "usage": usage(outputs, choices.n, shape)}
