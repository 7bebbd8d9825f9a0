"""A request body, checked: the fields chat and text completions share (SamplingParams, n,
stream; a chat's messages are api_messages.py's). Every bad field is an ApiError (400) naming
it, raised before the request joins the engine's batch (a value that could only fail inside a
step would fail the other requests of that step)."""

from __future__ import annotations

import dataclasses

from statechat.engine.sampling import MAX_LOGPROBS, SamplingParams, check_vocabulary, show_value
from statechat.errors import StatechatError, first_line

DEFAULT_MAX_TOKENS = 2048
MAX_N = 16  # choices a request may ask for per prompt (each is an engine request of its own)
MAX_LOGGED_FIELDS = 20  # unknown fields a log line names (the others are counted)
MAX_NAME_CHARS = 40  # of each name logged
# the server's own sampling (OpenAI's defaults), under the model's recommended sampling, the
# command's flags and a request's own fields; its max_tokens is capped to the room left (a
# request's own past that room is a 400)
DEFAULT_SAMPLING = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=DEFAULT_MAX_TOKENS)
# a body's numeric sampling fields (SamplingParams' names) and their JSON kinds
NUMBER_FIELDS = {
    "temperature": float, "top_p": float, "top_k": int, "min_p": float, "presence_penalty": float,
    "frequency_penalty": float, "repetition_penalty": float, "seed": int, "min_tokens": int,
}
# Fields of OpenAI's and vLLM's APIs this server cannot honour, with the values that leave them
# off (clients send those by default, and they are taken); any other value is a 400 rather
# than a reply made as if it had not been asked for.
NOT_SUPPORTED = {
    "tools": ([],), "functions": ([],), "tool_choice": ("none", "auto"),
    "use_beam_search": (False,), "allowed_token_ids": ([],),
    "bad_words": ([],), "function_call": ("none", "auto"), "echo": (False,),
    "documents": ([],), "add_special_tokens": (False,),
}
# the fields of a structured output (api_structured.py: OpenAI's, vLLM's and llama.cpp's)
STRUCTURED_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar", "structured_outputs", "json_schema", "grammar")
# vLLM's true/false sampling fields (SamplingParams' names) and their defaults
BOOL_FIELDS = {"ignore_eos": False, "include_stop_str_in_output": False,
               "skip_special_tokens": True}
# OpenAI's fields that change nothing about a reply (who asked, whether OpenAI keeps it, its
# billing tier): taken without a word
IGNORED_FIELDS = frozenset({"user", "store", "metadata", "service_tier", "prompt_cache_key",
                            "safety_identifier"})
# the fields parse_params, parse_n and parse_stream read, which both APIs take
SHARED_FIELDS = frozenset({
    *NUMBER_FIELDS, *NOT_SUPPORTED, *STRUCTURED_FIELDS, "model", "n", "best_of", "max_tokens",
    "max_completion_tokens",
    "stop", "stop_token_ids", "ignore_eos", "logprobs", "top_logprobs", "prompt_logprobs",
    "logit_bias", "stream", "stream_options", *BOOL_FIELDS,
})


class ApiError(Exception):
    """An error sent to the client as OpenAI's error object; `headers`: HTTP headers its
    answer carries besides (a 405's Allow)."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code, self.kind, self.headers = code, kind, headers or {}

    @classmethod
    def internal(cls, e: BaseException) -> ApiError:
        """A 500 server_error for an unexpected failure (a bug, not the client's fault),
        its message's first line."""
        return cls(500, first_line(e), kind="server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


def parse_flag(body: dict, key: str, default: bool = False, within: str = "") -> bool:
    """A true/false field; left out or null is `default`. `within`: the object `body` is
    in the request (`stream_options`), for the error's name of the field."""
    value = body.get(key)
    if value is None:  # (left out, or null: OpenAI's schema allows it)
        return default
    if not isinstance(value, bool):
        name = f"{within}.{key}" if within else key
        raise ApiError(400, f"{name} must be true or false", name)
    return value


def whole_number(value) -> int | None:
    """An integer field's value as an int, or None when it is not a whole number. A float with
    no fractional part counts (100.0, as pydantic's lax mode takes it for vLLM's int fields;
    some clients write every number so), 100.5 does not, nor a bool (true is not 1)."""
    if isinstance(value, float):
        return int(value) if value.is_integer() else None  # (NaN and infinities are not)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _number(body: dict, key: str, kind: type, default):
    value = body.get(key, default)
    if value is None:
        return default
    if kind is int:
        if (whole := whole_number(value)) is None:
            raise ApiError(400, f"{key} must be an integer", key)
        return whole
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ApiError(400, f"{key} must be a number", key)
    try:
        return float(value)
    except OverflowError:  # an integer past float's range
        raise ApiError(400, f"{key} is out of range", key) from None


def _is_off(value, off) -> bool:
    """Whether `value` is the off value `off`: numbers by value (0.0 is 0), booleans only as
    themselves (False is not the 0 of a count, 0 not the False of logprobs)."""
    if isinstance(value, bool) or isinstance(off, bool):
        return value is off
    return value == off


def _refuse_unsupported(body: dict) -> None:
    """ApiError(400) for a NOT_SUPPORTED field set to anything but an off value."""
    for key, offs in NOT_SUPPORTED.items():
        value = body.get(key)
        if value is not None and not any(_is_off(value, off) for off in offs):
            raise ApiError(400, f"{key} is not supported by this server; leave it out", key)


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    stop = () if stop is None else (stop,) if isinstance(stop, str) else stop  # ("" is refused
    # as [""] is: SamplingParams takes no empty stop string)
    if not isinstance(stop, list | tuple) or not all(isinstance(s, str) for s in stop):
        raise ApiError(400, "stop must be a string or an array of strings", "stop")
    return tuple(stop)


def _stop_token_ids(body: dict) -> tuple[int, ...]:
    ids = body.get("stop_token_ids")
    if ids is None:
        return ()
    whole = [whole_number(t) for t in ids] if isinstance(ids, list) else [None]
    if None in whole:
        raise ApiError(400, "stop_token_ids must be an array of integers", "stop_token_ids")
    return tuple(whole)


def _max_tokens(body: dict, default: int, least: int) -> tuple[int, str | None]:
    """max_completion_tokens or max_tokens (the former wins, as with vLLM: max_tokens is the
    field OpenAI deprecated for it) and that field's name, else `default` and None."""
    max_tokens, field = default, None
    for key in ("max_tokens", "max_completion_tokens"):
        value = _number(body, key, int, None)
        if value is not None and value < least:
            raise ApiError(400, f"{key} must be >= {least}", key)
        if value is not None:
            max_tokens, field = value, key
    return max_tokens, field


def _check_room(asked: int, field: str, prompt_len: int, max_model_len: int,
                what: str = "the prompt") -> None:
    """ApiError(400) for a max_tokens asked for that the prompt leaves no room for (vLLM's
    answer: a reply cut at the context would not be the one asked for). A prompt that fills
    the context alone is left to the engine's check, which says so (context_length_exceeded)."""
    room = max_model_len - prompt_len
    if 0 < room < asked:
        raise ApiError(400, f"{field} is too large: {show_value(asked)}; the context holds "
                            f"{max_model_len} tokens and {what} has {prompt_len}, which leaves "
                            f"{room} (ask for at most {room}, or leave {field} out to fill the "
                            "room)",
                       field, "context_length_exceeded")


def _logprobs(body: dict) -> int | None:
    """SamplingParams.logprobs from OpenAI's logprobs (a flag) and top_logprobs (0 to 20)."""
    top = _number(body, "top_logprobs", int, None)
    if not parse_flag(body, "logprobs"):
        if top:
            raise ApiError(400, "top_logprobs needs logprobs true", "top_logprobs")
        return None
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise ApiError(400, f"top_logprobs must be from 0 to {MAX_LOGPROBS}", "top_logprobs")
    return top or 0


def _prompt_logprobs(body: dict) -> int | None:
    """vLLM's prompt_logprobs (0 to 20: the likeliest tokens to list beside each prompt
    token's own), in whole responses only."""
    k = _number(body, "prompt_logprobs", int, None)
    if k is not None and parse_flag(body, "stream"):
        raise ApiError(400, "prompt_logprobs is not supported with stream; leave one out",
                       "prompt_logprobs")
    return k


def parse_params(body: dict, prompt_len: int, max_model_len: int,
                 defaults: SamplingParams = DEFAULT_SAMPLING, least_tokens: int = 1,
                 vocab_size: int | None = None, longest_len: int | None = None) -> SamplingParams:
    """SamplingParams from a chat-completions body (OpenAI's fields, logprobs included, and
    vLLM's top_k, min_p, repetition_penalty, stop_token_ids, ignore_eos, min_tokens and
    prompt_logprobs, include_stop_str_in_output, skip_special_tokens), `defaults` for the
    sampling fields it leaves out (or sets to null).
    A max_tokens the body gives (at least `least_tokens`) must fit the room the prompt leaves
    in the context (of several prompts, `longest_len` is the longest's: each must); the
    default is capped to that room, min_tokens then with it. ApiError(400) naming the field for
    a bad one (n and best_of included; a logit_bias id outside `vocab_size`) or one the server
    cannot honour. The seed is the request's: choice i samples with seed + i. Its structured
    output (api_structured.parse_structured) holds the whole reply (a reasoning model's is
    gated after its thinking by the chat API: api_structured.gate_thinking)."""
    from statechat.api_structured import parse_structured  # (it reads ApiError from here)

    _refuse_unsupported(body)
    check_model(body)
    parse_n(body)
    numbers = {key: _number(body, key, kind, getattr(defaults, key))
               for key, kind in NUMBER_FIELDS.items()}
    room = max(1, max_model_len - prompt_len)
    asked, field = _max_tokens(body, defaults.max_tokens, least_tokens)
    if field is not None and longest_len not in (None, prompt_len):
        _check_room(asked, field, longest_len, max_model_len, "the longest prompt")
    elif field is not None:
        _check_room(asked, field, prompt_len, max_model_len)
    if numbers["min_tokens"] > asked:  # (the request's error; past the room a default leaves,
        # a cap)
        raise ApiError(400, f"min_tokens must be from 0 to max_tokens ({asked}), got "
                            f"{show_value(numbers['min_tokens'])}", "min_tokens")
    max_tokens = min(asked, room)
    numbers["min_tokens"] = min(numbers["min_tokens"], max_tokens)
    try:
        params = dataclasses.replace(
            defaults, **numbers, max_tokens=max_tokens,
            stop=_stop(body), stop_token_ids=_stop_token_ids(body),
            **{key: parse_flag(body, key, default) for key, default in BOOL_FIELDS.items()},
            logprobs=_logprobs(body), prompt_logprobs=_prompt_logprobs(body),
            logit_bias=() if body.get("logit_bias") is None else body["logit_bias"],
            structured=parse_structured(body),
        )
        if vocab_size is not None:
            check_vocabulary(params, vocab_size)
        return params
    except StatechatError as e:  # (its message starts with the field's name)
        field = str(e).split(maxsplit=1)[0] if str(e) else ""
        raise ApiError(400, str(e), field if field in body else None) from None


def check_model(body: dict) -> None:
    """The body's model, if given, must be a string. Any name is served by the one model (as
    llama.cpp's server does: clients made for other servers send their own names)."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "model must be a string (any name: this server has one model)",
                       "model")


def parse_n(body: dict) -> int:
    """The choices per prompt: n (1 to MAX_N, 1 when left out). best_of may only equal n (n
    samples, all returned: there is no choosing the best of more)."""
    n = 1 if body.get("n") is None else whole_number(body["n"])
    if n is None or not 1 <= n <= MAX_N:
        raise ApiError(400, f"n must be an integer from 1 to {MAX_N}", "n")
    best_of = body.get("best_of")
    if best_of is not None and whole_number(best_of) != n:
        raise ApiError(400, "best_of is supported only equal to n (each choice is returned); "
                            "leave it out", "best_of")
    return n


def unknown_fields(body: dict, known: frozenset[str]) -> list[str]:
    """The names of the body's fields that are neither `known` (those the API reads) nor
    IGNORED_FIELDS, sorted: fields the reply is made without (a misspelt or another server's
    one), which the server logs; stream_options' other than include_usage (vLLM's
    continuous_usage_stats, say) as `stream_options.NAME`."""
    names = [key for key in body if key not in known and key not in IGNORED_FIELDS]
    options = body.get("stream_options")
    if isinstance(options, dict):
        names += [f"stream_options.{key}" for key in options if key != "include_usage"]
    return sorted(names)


def parse_stream(body: dict) -> tuple[bool, bool]:
    """Whether to stream, and whether the stream ends with a usage chunk
    (stream_options.include_usage)."""
    stream = parse_flag(body, "stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise ApiError(400, "stream_options must be an object", "stream_options")
    if not stream and options:  # (an empty object asks nothing: vLLM takes it too)
        raise ApiError(400, "stream_options needs stream true", "stream_options")
    return stream, parse_flag(options, "include_usage", within="stream_options")


def named(names: list[str]) -> str:
    """The first MAX_LOGGED_FIELDS names for a log line, each escaped (no control characters)
    and cut to MAX_NAME_CHARS, then how many more there are."""
    shown = []
    for name in names[:MAX_LOGGED_FIELDS]:
        name = name if name.isprintable() else repr(name)[1:-1]
        shown.append(name if len(name) <= MAX_NAME_CHARS else name[: MAX_NAME_CHARS - 3] + "...")
    more = len(names) - len(shown)
    return ", ".join(shown) + (f" and {more} more" if more else "")
