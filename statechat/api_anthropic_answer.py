"""The routes of Anthropic's Messages API (server.py serves them): POST /v1/messages, answered
whole or as Anthropic's server-sent events, and POST /v1/messages/count_tokens. A body is read
as a chat completion's (api_anthropic.chat_body, then api_chat.chat_request: one prompt, one
choice), submitted and awaited as a chat's choices are (api_choices.py), and written in
Anthropic's shapes (api_anthropic_reply.py); its reuse is logged and counted for /metrics, a
client that goes away aborts it, and once it is sent the next turn is warmed as a chat's.

A stream: `message_start` (once the prompt is computed, so its usage says what was reused),
each block's `content_block_start`, `content_block_delta`s and `content_block_stop`, then
`message_delta` (stop_reason, stop_sequence, and the whole usage) and `message_stop`; an error
once the stream has begun is an `error` event, and so is a reply the server cut as it stopped
(an `overloaded_error`; a whole response gets a 503 for it)."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

from statechat.api_answer import submit
from statechat.api_anthropic import MESSAGES_FIELDS, chat_body, error_body, renamed_errors
from statechat.api_anthropic_reply import (
    BlockStream,
    content_blocks,
    output_usage,
    stop_reason,
    usage,
)
from statechat.api_chat import ChatShape, chat_request
from statechat.api_choices import Choices
from statechat.api_request import ApiError, parse_flag
from statechat.engine.output import RequestOutput

if TYPE_CHECKING:
    from statechat.api_answer import AnswerHandler

STOPPED = "the server stopped before the reply was complete; send the request again"


def count_tokens(handler: AnswerHandler) -> None:
    """POST /v1/messages/count_tokens: {"input_tokens"}, the prompt's tokens a /v1/messages
    request of the same body would have (its usage's input and cache read tokens together)."""
    body = handler._body()
    handler._log_unknown(body, MESSAGES_FIELDS | {"max_tokens"})
    server = handler.server
    chat, origin = chat_body(body, server.tool_call_parser is not None, count_only=True)
    with renamed_errors(origin, body):
        prompt_ids, _, _ = chat_request(server, chat)
    handler._send_json(200, {"input_tokens": len(prompt_ids)})


def messages(handler: AnswerHandler) -> None:
    """POST /v1/messages: the reply, whole or streamed."""
    body = handler._body()
    handler._log_unknown(body, MESSAGES_FIELDS)
    server = handler.server
    chat, origin = chat_body(body, server.tool_call_parser is not None)
    with renamed_errors(origin, body):
        prompt_ids, params, shape = chat_request(server, chat)
        stream = parse_flag(body, "stream")
        choices = submit(server, [prompt_ids], params, 1, "messages")
    rid = f"msg_{uuid.uuid4().hex[:24]}"
    head = {"id": rid, "type": "message", "role": "assistant", "model": server.model_id}
    out = None
    with handler.answering(choices, rid, stream) as answer:
        if stream:
            out = _stream(handler, shape, choices, head)
        else:
            out = _whole(handler, shape, choices, head)
    if not answer.gone and out is not None and server.next_turns is not None:
        server.next_turns.after_reply(chat, [out], shape)


def _whole(handler: AnswerHandler, shape: ChatShape, choices: Choices,
           head: dict) -> RequestOutput:
    (out,) = choices.results(handler._gone)
    if out.finish_reason == "abort":
        raise ApiError(503, STOPPED, kind="server_error", code="shutting_down")
    message = shape.choice(0, out)["message"]
    reason, sequence = stop_reason(out, bool(message.get("tool_calls")), shape.tools)
    handler._send_json(200, {**head, "content": content_blocks(message), "stop_reason": reason,
                             "stop_sequence": sequence, "usage": output_usage(out)})
    return out


def _stream(handler: AnswerHandler, shape: ChatShape, choices: Choices,
            head: dict) -> RequestOutput | None:
    """Send the reply as Anthropic's events; its output, or None where it ended in an error
    (sent as an `error` event). A client that went away raises (BrokenPipeError and its kin)."""
    handler.start_events()

    def send(name: str, data: dict) -> None:
        handler.send_event({"type": name, **data}, name)

    blocks, out, started = BlockStream(), None, False
    try:
        for _, event in choices.merged(handler._gone):
            if not started:  # (the prompt is computed: its reuse is known)
                send("message_start", _start(head, choices, event.output))
                started = True
            for choice in shape.deltas(0, event):
                for name, data in blocks.events(choice["delta"]):
                    send(name, data)
            out = event.output or out
        if not started:
            send("message_start", _start(head, choices, out))
        for name, data in blocks.close():
            send(name, data)
        if out is None or out.finish_reason == "abort":
            raise ApiError(503, STOPPED, kind="server_error")
        reason, sequence = stop_reason(out, blocks.num_calls > 0, shape.tools)
        send("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                               "usage": output_usage(out)})
        send("message_stop", {})
        return out
    except (BrokenPipeError, ConnectionResetError, TimeoutError):  # the client is gone
        raise
    except Exception as e:  # noqa: BLE001 - the stream has begun: report it in the stream
        error = e if isinstance(e, ApiError) else ApiError.internal(e)
        send("error", {"error": error_body(error)["error"]})
        return None


def _start(head: dict, choices: Choices, out: RequestOutput | None) -> dict:
    """message_start's data: the message with no content yet, and the prompt's usage (the
    engine's reuse, read from its sequence once the first event came, or from `out`)."""
    if out is not None:
        counts = output_usage(out)
    else:
        seq = choices.handles[0].seq
        counts = usage(seq.num_prompt_tokens, seq.num_cached_tokens, 0)
    return {"message": {**head, "content": [], "stop_reason": None, "stop_sequence": None,
                        "usage": {**counts, "output_tokens": 0}}}

