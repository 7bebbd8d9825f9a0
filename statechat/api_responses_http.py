"""The Responses API's routes on a server.py Handler: POST /v1/responses (a whole response or
its server-sent events), GET /v1/responses/ID (a stored one) and DELETE /v1/responses/ID
(GET /v1/responses/ID/input_items is api_responses_items.py's).

A request is read by api_responses.py into a chat body, made by the chat path
(api_chat.chat_request: template, sampling, structured output, tools, reasoning), submitted as
one choice (api_choices.Choices), and written by api_responses_out.py. A stream is OpenAI's:
`event: TYPE` and `data: {...}` lines, response.created and response.in_progress first,
response.completed (or response.incomplete) last, each event with an increasing
sequence_number; an error once it has begun is an `error` event then response.failed. A
client that goes away aborts its reply, as the chat API's do. A finished response is stored
(unless `store` is false) before it is sent, with its conversation, for a later request's
previous_response_id; the next turn's warm-up is the chat API's (api_next_turn.NextTurns)."""

from __future__ import annotations

import json
import time
import urllib.parse

from statechat.api_answer import submit
from statechat.api_chat import chat_request
from statechat.api_choices import Choices
from statechat.api_request import ApiError
from statechat.api_responses import (
    RESPONSES_FIELDS,
    ResponsesRequest,
    parse_responses,
    previous_id,
    renamed,
)
from statechat.api_responses_out import OutputBuilder, new_id, response_object
from statechat.engine.engine import RequestOutput, StreamEvent
from statechat.errors import first_line

RESPONSES_ROUTE = "/v1/responses"
RESPONSE_ROUTE = "/v1/responses/"  # + a stored response's id
BYTES_PER_TOKEN = 4  # a stored response's JSON, counted in the store's bound as tokens


def post_response(handler) -> None:
    """POST /v1/responses on `handler` (a server.py Handler)."""
    server, body = handler.server, handler._body()
    handler._log_unknown(body, RESPONSES_FIELDS)
    previous = None
    if (rid := previous_id(body)) is not None:
        previous = _stored(server, rid, "previous_response_id")[1]
    req = parse_responses(body, previous, server.tool_call_parser is not None)
    try:
        prompt_ids, params, shape = chat_request(server, req.chat_body)
    except ApiError as e:
        raise renamed(e) from None
    choices = submit(server, [prompt_ids], params, 1, "input")
    rid, created = new_id("resp"), int(time.time())
    builder = OutputBuilder(shape)

    def made(out: RequestOutput | None) -> dict:
        return response_object(rid, created, server.model_id, req.echo, builder.items, out,
                               shape, params)

    out = None
    with handler.answering(choices, rid, req.is_stream) as answer:
        if req.is_stream:
            out = _stream(handler, req, choices, builder, made)
        else:
            out = choices.results(handler._gone)[0]
            builder.feed(StreamEvent(out.text, out.token_ids, out))
            handler._send_json(200, _finished(server, req, made(out), builder, out))
    if not answer.gone and out is not None and server.next_turns is not None:
        server.next_turns.after_reply(req.chat_body, [out], shape)


def _finished(server, req: ResponsesRequest, response: dict, builder: OutputBuilder,
              out: RequestOutput) -> dict:
    """`response`, stored first (with its conversation) when the request asks it to be. Its
    weight in the store's bound: the conversation's tokens, and the response's own JSON (what
    it echoes: metadata, user, text.format, none of them tokens) at a token per 4 bytes."""
    if req.is_stored and response["status"] != "cancelled":
        echoed = len(json.dumps(response)) // BYTES_PER_TOKEN
        server.responses.put(response, [*req.history, _as_message(builder.items)],
                             out.num_prompt_tokens + out.num_completion_tokens + echoed,
                             len(req.history))
    return response


def _as_message(items: list[dict]) -> dict:
    """Output items as the chat message a template renders them as (its text, reasoning and
    calls)."""
    message = {"role": "assistant", "content": ""}
    for item in items:
        if item["type"] == "message":
            message["content"] += item["content"][0]["text"]
        elif item["type"] == "reasoning":
            message["reasoning_content"] = item["content"][0]["text"]
        else:
            message.setdefault("tool_calls", []).append({
                "id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"] or "{}"}})
    return message


def _stream(handler, req: ResponsesRequest, choices: Choices, builder: OutputBuilder,
            made) -> RequestOutput | None:
    """Send the reply as OpenAI's server-sent events; its output once it ended, else None
    (an error, reported in the stream). A client that went away raises (BrokenPipeError and
    its kin)."""
    handler.start_events()
    numbers = iter(range(1 << 62))

    def send(event: dict) -> None:
        event = {"type": event["type"], "sequence_number": next(numbers), **event}
        handler.send_event(event, event["type"])

    send({"type": "response.created", "response": made(None)})
    send({"type": "response.in_progress", "response": made(None)})
    try:
        out = None
        for _, event in choices.merged(handler._gone):
            for made_event in builder.feed(event):
                send(made_event)
            out = event.output or out
        response = _finished(handler.server, req, made(out), builder, out)
        kind = "completed" if response["status"] == "completed" else "incomplete"
        send({"type": f"response.{kind}", "response": response})
        return out
    except (BrokenPipeError, ConnectionResetError, TimeoutError):  # the client is gone
        raise
    except Exception as e:  # noqa: BLE001 - headers are sent: report in the stream
        message = first_line(e)
        send({"type": "error", "code": "server_error", "message": message, "param": None})
        failed = {**made(None), "status": "failed",
                  "error": {"code": "server_error", "message": message}}
        send({"type": "response.failed", "response": failed})
        return None


def _stored(server, rid, param: str | None = None) -> tuple[dict, list[dict]]:
    """The stored response `rid` and its conversation; ApiError(404) in OpenAI's shape."""
    entry = server.responses.get(rid) if isinstance(rid, str) else None
    if entry is None:
        raise not_stored(server, rid, param)
    return entry


def not_stored(server, rid, param: str | None = None) -> ApiError:
    """The 404 for a response id `rid` not stored (`param`: the field that named it)."""
    return ApiError(404, f"no stored response has the id {str(rid)[:80]!r} (never stored, "
                         "deleted, or evicted: this server keeps the latest "
                         f"{server.responses.max_responses} in memory)", param,
                    code="response_not_found" if param is None
                    else "previous_response_not_found", kind="invalid_request_error")


def is_response_route(route: str, under: str = "") -> bool:
    """Whether `route` (a path) names one stored response, /v1/responses/ID (`under` "":
    itself; "/input_items": its input items); another path under it (OpenAI's /cancel) is
    no route here."""
    rest = route[len(RESPONSE_ROUTE):]
    if not route.startswith(RESPONSE_ROUTE) or not rest.endswith(under):
        return False
    rest = rest[:len(rest) - len(under)]
    return bool(rest) and "/" not in rest


def route_id(handler, under: str = "") -> str:
    """The response id in the handler's path, /v1/responses/ID`under`."""
    route = handler._route()
    return urllib.parse.unquote(route[len(RESPONSE_ROUTE):len(route) - len(under)])


def get_response(handler) -> None:
    """GET /v1/responses/ID: a stored response, as it was sent."""
    handler._send_json(200, _stored(handler.server, route_id(handler))[0])


def delete_response(handler) -> None:
    """DELETE /v1/responses/ID: forget a stored response (a 404 when there is none)."""
    rid = route_id(handler)
    _stored(handler.server, rid)
    handler.server.responses.delete(rid)
    handler._send_json(200, {"id": rid, "object": "response", "deleted": True})
