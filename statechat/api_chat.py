"""POST /v1/chat/completions: a body's prompt (its messages, and its tools with `serve
--tool-call-parser`, through the model's chat template) and the shape of its choices
(`message`, a stream's `delta`s, `logprobs.content`, the tool calls parsed); vLLM's
`prompt_logprobs`, when asked, is a field of the whole response (the rendered prompt's). Once a
reply is sent, the prefix its conversation's next request will start with is computed while
the engine has nothing else to do (api_next_turn.py)."""

from __future__ import annotations

from statechat.api_logprobs import logprobs_content, vllm_prompt_logprobs
from statechat.api_messages import continues_final_message, parse_messages
from statechat.api_reasoning import ReasoningStream, reasoning_tokens, split_reply
from statechat.api_request import SHARED_FIELDS, ApiError, parse_flag, parse_params
from statechat.api_response import Shape, finish_reason
from statechat.api_structured import check_with_tools, gate_thinking
from statechat.api_tool_calls import ToolCallStream, merge_deltas, parse_tool_calls
from statechat.api_tool_grammar import hold_call
from statechat.api_tools import (
    TOOL_FIELDS,
    ToolRequest,
    end_at_call,
    force_call,
    parse_tools,
    unthinking,
)
from statechat.chat.template import merge_template_kwargs, opens_thinking
from statechat.engine.engine import RequestOutput, StreamEvent
from statechat.engine.sampling import SamplingParams
from statechat.engine.worker import EngineWorker
from statechat.errors import StatechatError

# the fields this API reads (a body's others are logged as unknown, unless ignored on purpose)
CHAT_FIELDS = SHARED_FIELDS | {"messages", "continue_final_message", "add_generation_prompt",
                               "chat_template", "chat_template_kwargs", "include_reasoning",
                               "parallel_tool_calls"}


def chat_request(server, body: dict) -> tuple[list[int], SamplingParams, ChatShape]:
    """A chat body's prompt ids, sampling and choices' shape, under `server`'s (a ChatServer's)
    defaults and parsers; ApiError(400) naming the field at fault."""
    worker = server.worker
    tools = parse_tools(body, server.tool_call_parser)  # (checked here: not sampling's to refuse)
    prompt_ids = chat_prompt_ids(server, body, tools)
    params = parse_params({k: v for k, v in body.items() if k not in TOOL_FIELDS},
                          len(prompt_ids), worker.max_model_len, server.sampling,
                          vocab_size=worker.engine.loaded.config.vocab_size)
    check_with_tools(params, tools)
    params, tools = end_at_call(params, tools)  # (one call, then the end: a named function,
    # or parallel_tool_calls false)
    shape = chat_shape(worker, body, prompt_ids, server.reasoning_parser, tools,
                       params.skip_special_tokens)
    with worker.tokenizer_lock:  # (a forced call held to its schema; a reasoning model's
        # reply held after its thinking)
        params = hold_call(params, tools, worker.engine.tokenizer)
        params = gate_thinking(params, shape.opened, worker.engine.tokenizer)
    return prompt_ids, params, shape


def chat_prompt_ids(server, body: dict, tools: ToolRequest | None) -> list[int]:
    """The prompt ids of a chat body under `server`'s (a ChatServer's) template, its
    variables and its trust in a request's template, with a forced call's opening after it
    (tool_choice "required" or a function: api_tools.force_call): what the engine is given,
    and what /tokenize counts."""
    worker = server.worker
    refuse_untrusted_template(server, body)
    return force_call(
        chat_prompt(worker, body, server.template_kwargs, tools), tools, worker.engine.tokenizer,
        lambda: chat_prompt(worker, {**body, "chat_template_kwargs": unthinking(
            body.get("chat_template_kwargs"))}, server.template_kwargs, tools),
        worker.tokenizer_lock)


def chat_prompt(worker: EngineWorker, body: dict, template_kwargs: dict | None,
                tools: ToolRequest | None = None) -> list[int]:
    """The token ids of the body's conversation, rendered with the server's template variables
    under the body's own chat_template_kwargs, with the body's chat_template (vLLM's: a
    template's text) if it has one, else the engine's, and `tools` (api_tools.parse_tools;
    None: tools off, and so are tool calls in messages); ApiError(400) naming the field at
    fault. (A forced call's opening is chat_request's to add: api_tools.force_call.)"""
    template = request_template(body)
    try:
        messages = parse_messages(body.get("messages"), tools=tools is not None)
        return worker.render(messages, not continues_final_message(body, messages),
                             template_kwargs=merge_template_kwargs(
                                 template_kwargs, body.get("chat_template_kwargs")),
                             tools=tools.tools if tools is not None else None,
                             chat_template=template)
    except StatechatError as e:
        field = "chat_template_kwargs" if str(e).startswith("chat_template_kwargs") else (
            "chat_template" if template is not None and "chat template failed" in str(e)
            else "messages")
        raise ApiError(400, str(e), field) from None


def refuse_untrusted_template(server, body: dict) -> None:
    """ApiError(400) naming `chat_template` where the body has one and `server` (a ChatServer)
    does not trust its clients' templates, as vLLM's refuses them: a template is code the
    server runs, and a few nested loops hold the tokenizer, every request's, for hours."""
    if body.get("chat_template") is not None and not server.trust_request_chat_template:
        raise ApiError(400, "a request's own chat_template is refused: this server renders "
                       "only its own (serve with --trust-request-chat-template to take them)",
                       "chat_template")


def request_template(body: dict) -> str | None:
    """The body's own chat template (its text, checked: it compiles), or None where it has
    none; ApiError(400) naming `chat_template` for anything else."""
    from statechat.chat.template import check_template

    if body.get("chat_template") is None:
        return None
    try:
        return check_template(body["chat_template"])
    except StatechatError as e:
        raise ApiError(400, str(e), "chat_template") from None


def chat_shape(worker: EngineWorker, body: dict, prompt_ids: list[int],
               reasoning_parser: str | None, tools: ToolRequest | None = None,
               skip_special_tokens: bool = True) -> ChatShape:
    """The shape of a chat's choices for its rendered prompt: split into reasoning and answer
    when the server has a reasoning parser (`serve --reasoning-parser`), the reasoning left
    out with the body's `include_reasoning` false (vLLM's field: true or false, taken with no
    parser too, where it changes nothing; ApiError(400) naming it for another value); the
    answer parsed for tool calls when `tools` (api_tools.parse_tools) say so; its replies'
    text made with `skip_special_tokens` as the request's."""
    tokenizer = worker.engine.tokenizer
    include_reasoning = parse_flag(body, "include_reasoning", True)
    if reasoning_parser is None:
        return ChatShape(tokenizer, tools=tools)
    with worker.tokenizer_lock:  # (shared with the other requests' threads)
        opened = opens_thinking(tokenizer, prompt_ids)
    return ChatShape(tokenizer, opened, include_reasoning, tools, skip_special_tokens)


class ChatShape(Shape):
    """Choices of a chat completion: a message each, or in a stream a role chunk, content
    deltas and a finish chunk each. With `opened` (a reasoning parser's: whether the prompt
    opened `<think>`, else None: no parsing), each reply is split (api_reasoning.py): the
    message's `content` holds the answer alone (null when there is none) and `reasoning`, with
    its old name `reasoning_content` beside it, the reasoning (null when there is none); a
    stream's deltas carry either, or both where a delta spans `</think>`. Without
    `include_reasoning`, the reasoning's fields are left out (a delta of reasoning alone is
    not sent), the content split as before. With a parser, usage counts the reasoning's tokens
    (api_reasoning.reasoning_tokens) under `completion_tokens_details.reasoning_tokens`. With
    `tools` that parse (api_tools.ToolRequest), the answer's tool calls (api_tool_calls.py) are
    the message's `tool_calls`, its text outside them the `content` (null when none), and a
    reply with calls that ended of itself finishes with "tool_calls" ("stop" for a named
    function's), its stop_reason null where the stop that ended it is the one the server added
    (api_tools.end_at_call: a named function's, or parallel_tool_calls false); a
    stream's deltas carry the content until a call begins, then each call's `tool_calls`
    entry (its id, type and name, then its arguments whole once it ends). A call's opening
    that the request forced (ToolRequest.forced: in the prompt, not in the engine's text) is
    parsed as the start of each reply's answer, so its call's entry comes with the first
    delta. `skip_special_tokens`: the request's (its replies' text keeps special tokens when
    false, a special `</think>` among them: the reasoning's tokens are counted up to it)."""

    object, chunk_object, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl"

    def __init__(self, tokenizer, opened: bool | None = None,
                 include_reasoning: bool = True, tools: ToolRequest | None = None,
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer, self.opened, self.include_reasoning = tokenizer, opened, include_reasoning
        self.skip_special_tokens = skip_special_tokens
        self.tools = tools
        self.is_parsed = tools is not None and tools.is_parsed
        self.forced = tools.forced if self.is_parsed else ""  # (the reply's start: in the prompt)
        self._streams: dict[int, ReasoningStream] = {}  # choice -> its split, as it streams
        self._calls: dict[int, ToolCallStream] = {}  # choice -> its tool calls, as it streams

    def opening(self, index: int) -> list[dict]:
        return [{"index": index, "delta": {"role": "assistant", "content": ""},
                 "logprobs": None, "finish_reason": None}]

    def deltas(self, index: int, event: StreamEvent) -> list[dict]:
        out = []
        delta = self._delta(index, event)
        if delta or event.logprobs:
            out.append({"index": index, "delta": delta,
                        "logprobs": self._logprobs(event.token_ids, event.logprobs),
                        "finish_reason": None})
        if event.output is not None:
            calls = index in self._calls and self._calls[index].calls
            out.append({"index": index, "delta": {}, "logprobs": None,
                        "finish_reason": self._finish(event.output, bool(calls)),
                        "stop_reason": self._stop_reason(event.output)})
        return out

    def _delta(self, index: int, event: StreamEvent) -> dict:
        """The `delta` of an event's text: {"content"}, or with a parser the parts it has."""
        if self.opened is None and not self.is_parsed:
            return {"content": event.text} if event.text or event.logprobs else {}
        reasoning, answer = "", event.text
        if self.opened is not None:
            stream = self._streams.setdefault(index, ReasoningStream(self.opened))
            reasoning, answer = stream.feed(event.text)
            if event.output is not None:
                rest_reasoning, rest_answer = stream.flush()
                reasoning, answer = reasoning + rest_reasoning, answer + rest_answer
        calls = []
        if self.is_parsed:
            if index not in self._calls:  # (the forced start, parsed before the first text)
                self._calls[index], answer = ToolCallStream(self.tools.tools), self.forced + answer
            stream = self._calls[index]
            answer, calls = stream.feed(answer)
            if event.output is not None:
                rest, more = stream.flush()
                answer, calls = answer + rest, calls + more
        delta = {"content": answer} if answer else {}
        if reasoning and self.include_reasoning:
            delta["reasoning"] = delta["reasoning_content"] = reasoning
        if calls:
            delta["tool_calls"] = merge_deltas(calls)
        return delta

    def choice(self, index: int, out: RequestOutput) -> dict:
        message = {"role": "assistant", "content": out.text}
        if self.opened is not None:
            reasoning, message["content"] = split_reply(out.text, self.opened)
            if self.include_reasoning:
                message["reasoning"] = message["reasoning_content"] = reasoning
        calls = []
        if self.is_parsed:
            message["content"], calls = parse_tool_calls(
                self.forced + (message["content"] or ""), self.tools.tools)
        if calls:
            message["tool_calls"] = calls
        return {"index": index, "message": message,
                "logprobs": self._logprobs(out.token_ids, out.logprobs),
                "finish_reason": self._finish(out, bool(calls)),
                "stop_reason": self._stop_reason(out)}

    def _finish(self, out: RequestOutput, has_calls: bool) -> str:
        """finish_reason: "tool_calls" for a reply with calls that ended of itself (one cut at
        max_tokens says "length": its last call may be cut short), but "stop" for a named
        function's call (OpenAI's and vLLM's)."""
        reason = finish_reason(out)
        named = self.is_parsed and self.tools.is_named
        return "tool_calls" if has_calls and reason == "stop" and not named else reason

    def _stop_reason(self, out: RequestOutput) -> str | int | None:
        """The output's stop_reason; None where it is the stop the server added (the end of
        the one call, api_tools.end_at_call): the model's own end, as vLLM's."""
        added = self.tools.stop if self.tools is not None else None
        return None if added is not None and out.stop_reason == added else out.stop_reason

    def fields(self, outputs: list[RequestOutput]) -> dict:
        first = outputs[0]
        if first.prompt_logprobs is None:
            return {}
        return {"prompt_logprobs": vllm_prompt_logprobs(self.tokenizer, first.prompt_token_ids,
                                                         first.prompt_logprobs)}

    def completion_details(self, outputs: list[RequestOutput]) -> dict | None:
        if self.opened is None:
            return None
        decode = self._decode_text
        return {"reasoning_tokens": sum(reasoning_tokens(decode, out.token_ids, out.text,
                                                         self.opened) for out in outputs)}

    def _decode_text(self, ids: list[int]) -> str:
        """ids -> text as a reply's is made (special tokens skipped unless the request keeps
        them)."""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _logprobs(self, token_ids: list[int], logprobs: list | None) -> dict | None:
        """A choice's `logprobs`: None unless the request asked for them."""
        if logprobs is None:
            return None
        return {"content": logprobs_content(self.tokenizer, token_ids, logprobs), "refusal": None}
