"""The server's next-turn warm-up: once a chat reply is sent, the prefix its conversation's next
request starts with is computed while the engine has nothing else to do (`warm_after_reply`),
on a thread of its own (`NextTurns`), so that the next turn reuses it from the prefix cache."""

from __future__ import annotations

import logging
import threading

from statechat.api_chat import ChatShape, request_template
from statechat.api_messages import continues_final_message, parse_messages
from statechat.chat.next_turn import warm_next_turn
from statechat.chat.template import merge_template_kwargs
from statechat.engine.engine import RequestOutput
from statechat.engine.worker import EngineWorker, RequestHandle
from statechat.errors import StatechatError

log = logging.getLogger("statechat.server")


def warm_after_reply(worker: EngineWorker, body: dict, template_kwargs: dict,
                     outputs: list[RequestOutput],
                     shape: ChatShape | None = None) -> RequestHandle | None:
    """(Once a chat completion is sent) have the engine compute the prefix the conversation's
    next request starts with: its messages, the reply, and a user message's header
    (chat/next_turn.py). A thinking template renders an earlier reply without its reasoning,
    so without this each turn computes the last answer again. Only for a reply of one choice
    that ended of itself (not aborted), and only while the engine serves no other request,
    before the renders and again after them: a busy server spends no work on a turn that may
    not come, and the warm-up, speculative, yields to any request that comes while it runs.
    With tools (`shape`'s), they are rendered too, and a reply with tool calls goes in as the
    message the client got (its calls as the template renders them; a continued message's
    start before its content). The warm-up's handle, or None."""
    if len(outputs) != 1 or outputs[0].finish_reason == "abort" or not worker.idle():
        return None
    tools = shape.tools if shape is not None else None
    out, messages = outputs[0], parse_messages(body.get("messages"), tools=tools is not None)
    kwargs = merge_template_kwargs(template_kwargs, body.get("chat_template_kwargs"))
    reply: str | dict = (shape.forced if shape is not None else "") + out.text
    start = messages.pop()["content"] if continues_final_message(body, messages) else ""
    if shape is not None and (message := shape.choice(0, out)["message"]).get("tool_calls"):
        # (a continued message's calls: its start and the reply's content, then the calls)
        message = {**message, "content": start + (message["content"] or "")}
        reply = parse_messages([message], tools=True)[0]
    else:  # (the reply goes on the last message, where it continues one)
        reply = start + reply
    try:
        return warm_next_turn(worker, messages, reply, out, kwargs, still=worker.idle,
                              tools=tools.tools if tools is not None else None,
                              chat_template=request_template(body))
    except StatechatError:  # (the engine stopping, a prefix past the context)
        return None


class NextTurns:
    """The server's warm-ups (`warm_after_reply`), made by a thread of their own so that a
    request's thread is free once its answer is sent; only the latest reply's is made (an
    older one waiting is dropped: a newer reply means the engine was not idle for it)."""

    def __init__(self, worker: EngineWorker, template_kwargs: dict) -> None:
        self.worker, self.template_kwargs = worker, template_kwargs
        self._latest: tuple[dict, list[RequestOutput], ChatShape | None] | None = None
        self._ready = threading.Condition()
        self._thread: threading.Thread | None = None
        self.last: RequestHandle | None = None  # the last warm-up submitted
        self.considered = 0  # replies taken from `after_reply` so far (made or not)

    def after_reply(self, body: dict, outputs: list[RequestOutput],
                    shape: ChatShape | None = None) -> None:
        with self._ready:
            self._latest = (body, outputs, shape)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="statechat-next-turn",
                                                daemon=True)
                self._thread.start()
            self._ready.notify()

    def _run(self) -> None:
        while True:
            with self._ready:
                self._ready.wait_for(lambda: self._latest is not None)
                (body, outputs, shape), self._latest = self._latest, None
            try:
                self.last = warm_after_reply(self.worker, body, self.template_kwargs,
                                             outputs, shape) or self.last
            except Exception:  # (a warm-up never takes the server down)
                log.exception("statechat: the next turn's warm-up failed")
            self.considered += 1
