"""Anthropic's `system` and `messages` read as the chat API's messages (api_anthropic.py's
chat_body): text, thinking, tool_use and tool_result blocks, each checked, its errors naming
the block (`messages[1].content[0]`); an image or a document is a 400 that says why."""

from __future__ import annotations

from statechat.api_request import ApiError
from statechat.api_tools import ENABLE


def _text_blocks(blocks, where: str) -> str:
    """The text of a list of text blocks (joined), or ApiError(400) naming the block at fault."""
    texts = []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text" or not isinstance(block.get("text"), str):
            raise _not_taken(kind, f"{where}[{j}]", "text blocks")
        texts.append(block["text"])
    return "".join(texts)


def _not_taken(kind, where: str, taken: str) -> ApiError:
    """The 400 of a block this server does not take here: images and documents say why."""
    if kind in ("image", "document", "search_result", "container_upload"):
        return ApiError(400, f"{where}: {kind} blocks are not supported: this server's model "
                             "reads text only", where)
    shown = repr(kind) if len(repr(kind)) <= 40 else repr(kind)[:37] + "..."
    return ApiError(400, f"{where}: a block of type {shown} is not taken here ({taken} are)",
                    where)


def system_text(system) -> str:
    if isinstance(system, str):
        return system
    if not isinstance(system, list):
        raise ApiError(400, "system must be a string or an array of text blocks", "system")
    return _text_blocks(system, "system")


def chat_messages(message, i: int, tools_on: bool) -> list[dict]:
    """The chat messages of Anthropic's messages[i]: one, or (a user's tool results) more."""
    where = f"messages[{i}]"
    if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
        raise ApiError(400, f"{where}.role must be user or assistant (system goes in the "
                            "system field)", f"{where}.role")
    role, content = message["role"], message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise ApiError(400, f"{where}.content must be a string or an array of content blocks",
                       f"{where}.content")
    out, text, reasoning, calls = [], [], [], []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in ("tool_use", "tool_result") and not tools_on:
            raise ApiError(400, f"{at}: {kind} blocks are not enabled here ({ENABLE})", at)
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif role == "assistant" and kind == "thinking" and isinstance(block.get("thinking"),
                                                                        str):
            reasoning.append(block["thinking"])
        elif role == "assistant" and kind == "redacted_thinking":
            continue  # (another model's: nothing this one can read)
        elif role == "assistant" and kind == "tool_use":
            calls.append(_tool_use(block, at))
        elif role == "user" and kind == "tool_result":
            if text:  # (text before the result: its own user message, in order)
                out.append({"role": "user", "content": "".join(text)})
                text = []
            out.append(_tool_result(block, at))
        else:
            raise _not_taken(kind, at, "text, tool_use and thinking blocks" if role ==
                             "assistant" else "text and tool_result blocks")
    if role == "user":
        return out + [{"role": "user", "content": "".join(text)}] if text or not out else out
    made = {"role": "assistant", "content": "".join(text)}
    if reasoning:
        made["reasoning_content"] = "".join(reasoning)
    return [{**made, "tool_calls": calls} if calls else made]


def _tool_use(block: dict, at: str) -> dict:
    """A tool_use block as the chat API's tool call (its input the arguments, a mapping)."""
    for key, kind, what in (("id", str, "a string"), ("name", str, "a tool's name"),
                            ("input", dict, "an object")):
        if not isinstance(block.get(key), kind) or (kind is str and not block[key].strip()):
            raise ApiError(400, f"{at}.{key} must be {what}", f"{at}.{key}")
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"], "arguments": block["input"]}}


def _tool_result(block: dict, at: str) -> dict:
    """A tool_result block as the chat API's tool message."""
    if not isinstance(block.get("tool_use_id"), str):
        raise ApiError(400, f"{at}.tool_use_id must be the id of the tool_use it answers",
                       f"{at}.tool_use_id")
    content = block.get("content")
    if content is None:
        content = ""
    elif isinstance(content, list):
        content = _text_blocks(content, f"{at}.content")
    elif not isinstance(content, str):
        raise ApiError(400, f"{at}.content must be a string or an array of text blocks",
                       f"{at}.content")
    if block.get("is_error") not in (None, True, False):
        raise ApiError(400, f"{at}.is_error must be true or false", f"{at}.is_error")
    content = f"Error: {content}" if block.get("is_error") else content
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": content}
