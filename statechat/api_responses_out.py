"""A Responses API reply, made from the chat API's split of it (api_chat.ChatShape: reasoning,
answer and tool calls, as a chat stream's deltas): its output items (a `reasoning` item, a
`message` item with one `output_text` part, `function_call` items, in the order the reply
makes them) and the stream's events that build them. A whole (non-streamed) reply is read as
one delta, so both give the same items. A reply with no text and no call still has a message
item (its text ""). The response object and its `usage` are `response_object`'s; `text_item` and
`call_item` make the items (api_responses_items.py's stored ones too)."""

from __future__ import annotations

import copy
import time
import uuid

from statechat.api_chat import ChatShape
from statechat.engine.engine import RequestOutput, StreamEvent


def new_id(prefix: str) -> str:
    """An id of OpenAI's shape: `prefix`_ and 32 hex digits."""
    return f"{prefix}_{uuid.uuid4().hex}"


def text_item(kind: str, text: str = "", status: str = "in_progress",
              item_id: str | None = None) -> dict:
    """A `message` item (an assistant's, one output_text part) or a `reasoning` item (one
    reasoning_text part) holding `text`; its id `item_id`, else a new one."""
    if kind == "message":
        return {"type": "message", "id": item_id or new_id("msg"), "status": status,
                "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": []}]}
    return {"type": "reasoning", "id": item_id or new_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def call_item(call_id: str | None, name: str | None, arguments: str,
              status: str = "in_progress", item_id: str | None = None) -> dict:
    """A `function_call` item; its id `item_id`, else a new one."""
    return {"type": "function_call", "id": item_id or new_id("fc"), "call_id": call_id,
            "name": name, "arguments": arguments, "status": status}


class OutputBuilder:
    """The output items of one reply, fed its stream's events (`feed`); each feed returns the
    Responses stream events (less their sequence_number) that its text makes."""

    def __init__(self, shape: ChatShape) -> None:
        self.shape, self.items = shape, []
        self._open: dict | None = None  # the item text goes to now (None: none open)
        self._calls: dict[int, dict] = {}  # chat tool-call index -> its function_call item

    def feed(self, event: StreamEvent) -> list[dict]:
        events = []
        for choice in self.shape.deltas(0, event):
            delta = choice["delta"]
            if delta.get("reasoning"):
                events += self._text("reasoning", delta["reasoning"])
            if delta.get("content"):
                events += self._text("message", delta["content"])
            for call in delta.get("tool_calls", ()):
                events += self._call(call)
        if event.output is not None:
            status = "completed" if event.output.finish_reason == "stop" else "incomplete"
            events += self._close(status)
            if not any(item["type"] in ("message", "function_call") for item in self.items):
                events += self._open_item("message") + self._close(status)
        return events

    def _text(self, kind: str, text: str) -> list[dict]:
        events = [] if self._open and self._open["type"] == kind else self._open_item(kind)
        item = self._open
        item["content"][0]["text"] += text
        name = "output_text" if kind == "message" else "reasoning_text"
        more = {"logprobs": []} if kind == "message" else {}
        return events + [{"type": f"response.{name}.delta", **self._where(item),
                          "content_index": 0, "delta": text, **more}]

    def _call(self, call: dict) -> list[dict]:
        """A chat tool-call delta: its id and name open a function_call item, its arguments
        are that item's."""
        events, item = [], self._calls.get(call["index"])
        if item is None:
            events += self._close("completed")
            item = call_item(call.get("id"), call.get("function", {}).get("name"), "")
            self._calls[call["index"]], self._open = item, item
            self.items.append(item)
            events.append({"type": "response.output_item.added", **self._index(item),
                           "item": copy.deepcopy(item)})
        arguments = call.get("function", {}).get("arguments")
        if arguments:
            item["arguments"] += arguments
            events.append({"type": "response.function_call_arguments.delta",
                           **self._where(item), "delta": arguments})
        return events

    def _open_item(self, kind: str) -> list[dict]:
        """Close the open item and open one of `kind` (a message or reasoning item)."""
        events = self._close("completed")
        item = text_item(kind)
        part = item["content"][0]
        self.items.append(item)
        self._open = item
        added = {**item, "content": []}
        return events + [
            {"type": "response.output_item.added", **self._index(item), "item": added},
            {"type": "response.content_part.added", **self._where(item), "content_index": 0,
             "part": dict(part)}]

    def _close(self, status: str) -> list[dict]:
        """The events that end the open item (with `status`), none when none is open."""
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = status
        where = self._where(item)
        if item["type"] == "function_call":
            return [{"type": "response.function_call_arguments.done", **where,
                     "name": item["name"], "arguments": item["arguments"]},
                    {"type": "response.output_item.done", **self._index(item),
                     "item": copy.deepcopy(item)}]
        part = item["content"][0]
        name = "output_text" if item["type"] == "message" else "reasoning_text"
        more = {"logprobs": []} if item["type"] == "message" else {}
        return [{"type": f"response.{name}.done", **where, "content_index": 0,
                 "text": part["text"], **more},
                {"type": "response.content_part.done", **where, "content_index": 0,
                 "part": dict(part)},
                {"type": "response.output_item.done", **self._index(item),
                 "item": copy.deepcopy(item)}]

    def _index(self, item: dict) -> dict:
        return {"output_index": next(i for i, it in enumerate(self.items) if it is item)}

    def _where(self, item: dict) -> dict:
        return {"item_id": item["id"], **self._index(item)}


def usage(out: RequestOutput | None, shape: ChatShape) -> dict | None:
    """OpenAI's Responses usage of `out` (None: none yet): the engine's own counts, the prompt
    tokens it reused as cached_tokens, and the reasoning parser's reasoning tokens (0 without
    one: the reply is not split)."""
    if out is None:
        return None
    details = shape.completion_details([out]) or {}
    return {"input_tokens": out.num_prompt_tokens,
            "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
            "output_tokens": out.num_completion_tokens,
            "output_tokens_details": {"reasoning_tokens": details.get("reasoning_tokens", 0)},
            "total_tokens": out.num_prompt_tokens + out.num_completion_tokens}


def status_of(out: RequestOutput) -> tuple[str, dict | None]:
    """The response's status and incomplete_details for a finished reply: cut at its token
    limit is "incomplete" (max_output_tokens), cut by the server stopping "cancelled"."""
    if out.finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return ("cancelled" if out.finish_reason == "abort" else "completed"), None


def response_object(rid: str, created: int, model: str, echo: dict, items: list[dict],
                    out: RequestOutput | None, shape: ChatShape, params) -> dict:
    """The response object: in progress (`out` None, no usage yet) or finished; `echo` holds
    the request's settings it repeats, `params` (SamplingParams) the sampling it was made
    with."""
    status, details = status_of(out) if out is not None else ("in_progress", None)
    return {"id": rid, "object": "response", "created_at": created, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": None, "incomplete_details": details, "model": model,
            "output": copy.deepcopy(items), "temperature": params.temperature,
            "top_p": params.top_p, **echo, "usage": usage(out, shape)}
