"""POST /v1/chat/completions: a body's prompt (its messages through the model's chat template)
and the shape of its choices (`message`, a stream's `delta`s, `logprobs.content`); vLLM's
`prompt_logprobs`, when asked, is a field of the whole response (the rendered prompt's)."""

from __future__ import annotations

from statechat.api_choices import Shape, finish_reason
from statechat.api_logprobs import logprobs_content, vllm_prompt_logprobs
from statechat.api_request import (
    SHARED_FIELDS,
    ApiError,
    continues_final_message,
    parse_messages,
)
from statechat.chat.template import merge_template_kwargs
from statechat.engine.engine import RequestOutput, StreamEvent
from statechat.engine.worker import EngineWorker
from statechat.errors import StatechatError

# the fields this API reads (a body's others are logged as unknown, unless ignored on purpose)
CHAT_FIELDS = SHARED_FIELDS | {"messages", "continue_final_message", "add_generation_prompt",
                               "chat_template_kwargs"}


def chat_prompt(worker: EngineWorker, body: dict, template_kwargs: dict) -> list[int]:
    """The token ids of the body's conversation, rendered with the server's template variables
    under the body's own chat_template_kwargs; ApiError(400) naming the field at fault."""
    try:
        messages = parse_messages(body.get("messages"))
        return worker.render(messages, not continues_final_message(body, messages),
                             template_kwargs=merge_template_kwargs(
                                 template_kwargs, body.get("chat_template_kwargs")))
    except StatechatError as e:
        kwargs = str(e).startswith("chat_template_kwargs")
        raise ApiError(400, str(e), "chat_template_kwargs" if kwargs else "messages") from None


class ChatShape(Shape):
    """Choices of a chat completion: a message each, or in a stream a role chunk, content
    deltas and a finish chunk each."""

    object, chunk_object, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl"

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def opening(self, index: int) -> list[dict]:
        return [{"index": index, "delta": {"role": "assistant", "content": ""},
                 "logprobs": None, "finish_reason": None}]

    def deltas(self, index: int, event: StreamEvent) -> list[dict]:
        out = []
        if event.text or event.logprobs:
            out.append({"index": index, "delta": {"content": event.text},
                        "logprobs": self._logprobs(event.token_ids, event.logprobs),
                        "finish_reason": None})
        if event.output is not None:
            out.append({"index": index, "delta": {}, "logprobs": None,
                        "finish_reason": finish_reason(event.output)})
        return out

    def choice(self, index: int, out: RequestOutput) -> dict:
        return {"index": index, "message": {"role": "assistant", "content": out.text},
                "logprobs": self._logprobs(out.token_ids, out.logprobs),
                "finish_reason": finish_reason(out)}

    def fields(self, outputs: list[RequestOutput]) -> dict:
        first = outputs[0]
        if first.prompt_logprobs is None:
            return {}
        return {"prompt_logprobs": vllm_prompt_logprobs(self.tokenizer, first.prompt_token_ids,
                                                         first.prompt_logprobs)}

    def _logprobs(self, token_ids: list[int], logprobs: list | None) -> dict | None:
        """A choice's `logprobs`: None unless the request asked for them."""
        if logprobs is None:
            return None
        return {"content": logprobs_content(self.tokenizer, token_ids, logprobs), "refusal": None}
