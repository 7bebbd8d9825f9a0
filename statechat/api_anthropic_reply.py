"""What a reply is in Anthropic's Messages API: its content blocks, stop_reason and usage, read
from the chat path's parsed choice (api_chat.ChatShape: its reasoning, text and tool calls), and
a stream's events (`BlockStream`) from the same shape's deltas, so a stream's blocks put
together are the whole reply's.

Content: a `thinking` block (the reasoning a `--reasoning-parser` separates; signature ""), a
`text` block, then a `tool_use` block per call (`--tool-call-parser`: its id `toolu_...`, its
input the call's arguments, an object). stop_reason: max_tokens (cut there), stop_sequence (one
of the request's stop_sequences matched: `stop_sequence` names it), tool_use (a reply with calls
that ended of itself, a named tool's call end included), else end_turn.

Usage: the prompt's tokens are split as Anthropic splits them: `cache_read_input_tokens` those
the engine reused from its prefix cache (the request's own reuse, as its log line and /metrics
count it), `input_tokens` those it computed (the prompt's others: the two add up to the
prompt), `cache_creation_input_tokens` 0 (writing the cache costs nothing more here), and
`output_tokens` the reply's."""

from __future__ import annotations

import json

from statechat.api_tools import ToolRequest
from statechat.engine.output import RequestOutput


def tool_use_id(call_id: str) -> str:
    """A parsed call's id (`call_...`) in Anthropic's form, `toolu_...`."""
    return "toolu_" + call_id.removeprefix("call_")


def usage(num_prompt_tokens: int, num_cached_tokens: int, output_tokens: int) -> dict:
    """Anthropic's usage: the prompt's tokens computed, created in the cache and read from it,
    and the reply's."""
    cached = max(num_cached_tokens, 0)
    return {"input_tokens": num_prompt_tokens - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": output_tokens}


def output_usage(out: RequestOutput) -> dict:
    return usage(out.num_prompt_tokens, out.num_cached_tokens, out.num_completion_tokens)


def stop_reason(out: RequestOutput, has_calls: bool,
                tools: ToolRequest | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished reply; `tools`: the request's (a named
    tool's call end, a stop the server added, is no stop sequence of the request's)."""
    if out.finish_reason == "length":
        return "max_tokens", None
    added = tools.stop if tools is not None else None
    if has_calls and out.stop_reason in (None, added):
        return "tool_use", None
    if isinstance(out.stop_reason, str) and out.stop_reason != added:
        return "stop_sequence", out.stop_reason
    return "end_turn", None


def content_blocks(message: dict) -> list[dict]:
    """The content of a chat choice's `message` (ChatShape.choice's) as Anthropic's blocks."""
    blocks = []
    if message.get("reasoning"):
        blocks.append({"type": "thinking", "thinking": message["reasoning"], "signature": ""})
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls", []):
        blocks.append({"type": "tool_use", "id": tool_use_id(call["id"]),
                       "name": call["function"]["name"],
                       "input": json.loads(call["function"]["arguments"] or "{}")})
    return blocks


class BlockStream:
    """The content block events of one streamed reply: `events` of each chat delta (ChatShape's:
    its reasoning, content and tool_calls), then `close`. Each returns (event name, data)
    pairs; a block starts where the kind of text changes, and each call is a block of its own."""

    def __init__(self) -> None:
        self.index = -1  # the open block's
        self.open: str | None = None  # its type
        self.num_calls = 0  # tool_use blocks started

    def events(self, delta: dict) -> list[tuple[str, dict]]:
        out = []
        for kind, key, delta_type in (("thinking", "reasoning", "thinking_delta"),
                                      ("text", "content", "text_delta")):
            if delta.get(key):
                if self.open != kind:
                    out += self._start({"type": kind, kind: "", **(
                        {"signature": ""} if kind == "thinking" else {})})
                out.append(self._delta({"type": delta_type, kind: delta[key]}))
        for part in delta.get("tool_calls", []):
            if "id" in part:  # (a call's first entry: its id and name)
                out += self._start({"type": "tool_use", "id": tool_use_id(part["id"]),
                                    "name": part["function"]["name"], "input": {}})
                self.num_calls += 1
            if part["function"].get("arguments"):
                out.append(self._delta({"type": "input_json_delta",
                                        "partial_json": part["function"]["arguments"]}))
        return out

    def close(self) -> list[tuple[str, dict]]:
        """The open block's end, if one is open."""
        if self.open is None:
            return []
        self.open = None
        return [("content_block_stop", {"index": self.index})]

    def _start(self, block: dict) -> list[tuple[str, dict]]:
        out = self.close()
        self.index, self.open = self.index + 1, block["type"]
        return [*out, ("content_block_start", {"index": self.index, "content_block": block})]

    def _delta(self, delta: dict) -> tuple[str, dict]:
        return "content_block_delta", {"index": self.index, "delta": delta}
