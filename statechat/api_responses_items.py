"""GET /v1/responses/ID/input_items (OpenAI's input item list, the openai client's
`responses.input_items.list`): the items that made a stored response, which are its stored
conversation before its output (api_responses_store.py: the inputs and outputs of the
responses before it through previous_response_id, then its own input; never instructions,
which are not stored), as a list object `{"object": "list", "data", "first_id", "last_id",
"has_more"}`. User, system and developer messages are `message` items of `input_text` parts
(a developer message is stored, and so listed, as a system one); an assistant message is its
`reasoning` item, its `message` item (of an `output_text` part; left out when it only calls)
and its `function_call` items, as api_responses_out.py makes them; a tool message is a
`function_call_output` item. An item's id is made from the response's id and the item's
place, so it is the same on every call and `after` can page by it. Query: `limit` (1-100,
default 20), `order` (`asc`, or `desc`, OpenAI's default: the newest first), `after` (an item
id of this list: the items after it in that order; another id is a 400) and `include` (the
values that change nothing here are taken, another is a 400)."""

from __future__ import annotations

import urllib.parse

from statechat.api_request import ApiError
from statechat.api_responses import INCLUDE_TAKEN
from statechat.api_responses_http import not_stored, route_id
from statechat.api_responses_out import call_item, text_item

ITEMS_ROUTE = "/input_items"  # after /v1/responses/ID
DEFAULT_LIMIT, MAX_LIMIT = 20, 100
# include values that add nothing to these items: they name outputs of tools this server has
# not, and images it takes none of (message.output_text.logprobs would: no logprobs are kept)
INCLUDE_NOTHING = ("file_search_call.results", "web_search_call.results",
                   "web_search_call.action.sources", "message.input_image.image_url",
                   "computer_call_output.output.image_url", "code_interpreter_call.outputs")
ITEMS_INCLUDE_TAKEN = (*INCLUDE_TAKEN, *INCLUDE_NOTHING)


def list_input_items(handler) -> None:
    """GET /v1/responses/ID/input_items on `handler` (a server.py Handler)."""
    rid = route_id(handler, ITEMS_ROUTE)
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(handler.path).query,
                                  keep_blank_values=True)
    limit, order, after = _query(query)
    messages = handler.server.responses.input_of(rid)
    if messages is None:
        raise not_stored(handler.server, rid)
    items = input_items(rid, messages)
    if order == "desc":
        items.reverse()
    start = 0
    if after is not None:
        start = next((i + 1 for i, item in enumerate(items) if item["id"] == after), None)
        if start is None:
            raise ApiError(400, f"after {after[:80]!r} is no input item of the response {rid!r}",
                           "after")
    page = items[start:start + limit]
    handler._send_json(200, {"object": "list", "data": page,
                             "first_id": page[0]["id"] if page else None,
                             "last_id": page[-1]["id"] if page else None,
                             "has_more": start + limit < len(items)})


def _query(query: dict[str, list[str]]) -> tuple[int, str, str | None]:
    """(limit, order, after) of the query; ApiError(400) naming the parameter at fault."""
    raw = query.get("limit", [str(DEFAULT_LIMIT)])[-1]
    limit = int(raw) if raw.strip().isdecimal() else 0
    if not 1 <= limit <= MAX_LIMIT:
        raise ApiError(400, f"limit must be an integer from 1 to {MAX_LIMIT}, got {raw[:40]!r}",
                       "limit")
    order = query.get("order", ["desc"])[-1]
    if order not in ("asc", "desc"):
        raise ApiError(400, f"order must be asc or desc, got {order[:40]!r}", "order")
    for value in (*query.get("include", ()), *query.get("include[]", ())):
        if value not in ITEMS_INCLUDE_TAKEN:
            raise ApiError(400, f"include {value[:80]!r} is not taken here: give "
                                f"{', '.join(ITEMS_INCLUDE_TAKEN)}", "include")
    return limit, order, query.get("after", [None])[-1]


def input_items(rid: str, messages: list[dict]) -> list[dict]:
    """The stored chat `messages` that made the response `rid` as Responses items, oldest
    first, each id `PREFIX_` + the response's hex + `_` + the item's place."""
    stem, items = rid.partition("_")[2] or rid, []
    for message in messages:
        role = message["role"]
        if role == "tool":
            items.append({"id": f"fco_{stem}_{len(items)}", "type": "function_call_output",
                          "call_id": message.get("tool_call_id"),
                          "output": message.get("content") or ""})
        elif role != "assistant":
            items.append({"id": f"msg_{stem}_{len(items)}", "type": "message", "role": role,
                          "content": [{"type": "input_text", "text": message["content"]}],
                          "status": "completed"})
        else:
            _add_assistant(items, message, stem)
    return items


def _add_assistant(items: list[dict], message: dict, stem: str) -> None:
    """Add an assistant message's items to `items`: its reasoning, its text (unless it only
    calls) and its calls."""
    calls = message.get("tool_calls") or []
    if message.get("reasoning_content"):
        items.append(text_item("reasoning", message["reasoning_content"], "completed",
                               f"rs_{stem}_{len(items)}"))
    if message.get("content") or not calls:
        items.append(text_item("message", message.get("content") or "", "completed",
                               f"msg_{stem}_{len(items)}"))
    for call in calls:
        function = call.get("function", {})
        items.append(call_item(call.get("id"), function.get("name"),
                               function.get("arguments") or "{}", "completed",
                               f"fc_{stem}_{len(items)}"))
