"""The input of `statechat batch`, read before the model loads.

Input, one request a line:
    {"id": "a", "messages": [{"role": "user", "content": "..."}], "max_tokens": 64,
     "temperature": 0}
("id": a string or a number, echoed as given; "line-N" when left out; a line of OpenAI's batch
format, {"custom_id", "method", "url": "/v1/chat/completions", "body"}, as vLLM's run-batch
reads, is its body with the custom_id as "id"; its other fields, outside the body, are ignored)
with optional
"max_completion_tokens" (over "max_tokens"), "top_p", "top_k", "min_p", "presence_penalty",
"frequency_penalty", "repetition_penalty", "seed", "stop" (a string or a list),
"stop_token_ids", "ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "n" (1 to
16 samples: see batch.py's output), "logprobs" (0 to 20: each generated token's
logprob and those of that many likeliest tokens; or OpenAI's chat form, true with
"top_logprobs" as that count), "prompt_logprobs" (the same for each prompt
token after the first, with its rank; such a line computes its whole prompt), "min_tokens",
"logit_bias" ({"id": bias}) and "chat_template_kwargs" (variables of the model's chat
template, over --chat-template-kwargs) as well; "max_tokens": 0 computes the prompt alone. With
--tool-call-parser, "tools", "tool_choice" ("required" or a named function: the reply
starts with a call's opening and is held to the function's schema, as the server's; a named
function's ends with its call, a stop added to the line's, as the server's) and
"parallel_tool_calls" (false: the reply ends with its first call, as the server's), assistant
messages' "tool_calls" and "tool" messages are read as the server reads them (api_tools.py,
api_messages.py); without it, they are the line's error, as they are the server's 400. A
structured output ("response_format", "guided_json", "guided_regex", "guided_choice",
"guided_grammar", "structured_outputs", "json_schema", "grammar") is read as the server reads
it (api_structured.py), its 400 the line's error. A line's own fields win over the run's defaults
(BatchDefaults: greedy, 256 tokens, under the model's recommended sampling and the command's flags);
other fields are named on stderr. With --seed S, a line without its own "seed" draws one made from S
and its line number (line_seed): the same file and S give the same outputs, and identical lines
still give different samples.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass

from statechat.api_request import MAX_N, STRUCTURED_FIELDS, whole_number
from statechat.api_structured import check_with_tools, parse_structured
from statechat.api_tools import TOOL_FIELDS, ToolRequest, end_at_call, parse_tools
from statechat.engine.sampling import SamplingParams
from statechat.errors import StatechatError

LINE_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
               "frequency_penalty", "repetition_penalty", "seed", "stop", "stop_token_ids",
               "ignore_eos", "logprobs", "prompt_logprobs", "min_tokens", "logit_bias", "n",
               "include_stop_str_in_output", "skip_special_tokens")  # sampling
# the other fields a line may have; any more are named on stderr, as ignored
# ("model": the loaded model answers whatever a line names, as serve's does; a name that is not
# a string is the line's error, as it is serve's 400)
OTHER_FIELDS = ("id", "messages", "chat_template_kwargs", "max_completion_tokens",
                "top_logprobs", "model", "include_reasoning", *TOOL_FIELDS, *STRUCTURED_FIELDS)
BATCH_FORMAT_FIELDS = ("custom_id", "method", "url", "body")  # OpenAI's batch format's; any
# other field of such a line, outside its body, is named on stderr, as ignored
WHOLE = ("max_tokens", "top_k", "seed", "logprobs", "prompt_logprobs", "min_tokens",
         "n")  # integers, which a whole-number float may give
DEFAULT_SAMPLING = SamplingParams(temperature=0.0, max_tokens=256)  # batch's own: greedy


@dataclass(frozen=True)
class BatchDefaults:
    sampling: SamplingParams = DEFAULT_SAMPLING  # every line's; its own fields win
    template_kwargs: dict | None = None  # chat-template variables; a line's own win
    tool_call_parser: str | None = None  # --tool-call-parser (None: a line's tools are refused)
    system_prompt: str | None = None  # --system-prompt: a line with no system message's first

    def params(self, **line) -> SamplingParams:
        """A line's sampling params: its own fields (LINE_FIELDS) where it has them (a
        whole-number float counts as an integer; top_k -1 is off, as 0 is), these defaults
        elsewhere."""
        line = {k: int(v) if k in WHOLE and isinstance(v, float) and v.is_integer() else v
                for k, v in line.items()}
        return dataclasses.replace(self.sampling, **line)


@dataclass
class Job:
    line: int  # 1-based line number in the input
    id: str | int | float | None  # the line's own "id", echoed as given (else "line-N")
    messages: list[dict] | None = None
    template_kwargs: dict | None = None
    tools: ToolRequest | None = None  # its tools (api_tools.parse_tools; None: tools off)
    prompt_ids: list[int] | None = None  # (set by prepare, once the model is loaded)
    params: SamplingParams | None = None
    error: str | None = None
    unknown: tuple[str, ...] = ()  # the line's fields batch does not read (ignored)
    result: dict | None = None
    shared: dict | None = None  # its group's warm-up: the shared prefix and where it came from
    include_reasoning: bool = True  # vLLM's field: false leaves "reasoning" out of its result


def parse_lines(lines: Iterable[str], defaults: BatchDefaults) -> list[Job]:
    """The input's non-blank lines as Jobs, checked as far as they can be before the model
    loads (JSON, id, sampling fields, messages, template variables)."""
    return [parse_line(text, n, defaults) for n, text in enumerate(lines, start=1) if text.strip()]


def parse_line(text: str, line: int, defaults: BatchDefaults) -> Job:
    """One input line -> a Job with its messages and params, or with a one-line error."""
    from statechat.chat.template import check_template_kwargs, merge_template_kwargs

    try:
        req, (method, url), id_field, body, outside = _line_request(text, line)
    except StatechatError as e:
        return Job(line, None, error=str(e))
    rid = req.get("id")
    if rid is None:
        rid = f"line-{line}"
    elif isinstance(rid, bool) or not isinstance(rid, str | int | float) \
            or (isinstance(rid, float) and not math.isfinite(rid)):
        return Job(line, None, error=f'line {line}: "{id_field}" must be a string or a number, '
                                     f"got {json.dumps(rid)[:60]}")
    if method != "POST":  # (OpenAI's batch format: the API's method; its custom_id kept)
        return Job(line, rid, error=f'line {line}: "method" must be "POST" (batch runs chat '
                                    f"requests), got {json.dumps(method)[:60]}")
    if url != "/v1/chat/completions":  # (its custom_id still names its error record)
        return Job(line, rid, error=f'line {line}: "url" must be "/v1/chat/completions" (batch '
                                    f"runs chat requests), got {json.dumps(url)[:60]}")
    if not isinstance(body, dict):
        return Job(line, rid, error=f'line {line}: "body" must be a JSON object (the chat '
                                    f"request), got {json.dumps(body)[:60]}")
    unknown = unread_fields(req, outside)
    try:
        if req.get("model") is not None and not isinstance(req["model"], str):  # (as serve's 400)
            raise StatechatError("model must be a string (any name: the loaded model answers "
                                 "every line)")
        params = line_params(req, defaults, line)
        if "messages" not in req and "prompt" in req:
            raise StatechatError('batch runs chat requests: give "messages", not "prompt" '
                                 "(the completions form)")
        tools = line_tools(req, defaults.tool_call_parser)
        with api_errors():  # (a named function: one call, then the end, as the server's)
            check_with_tools(params, tools)
            params, tools = end_at_call(params, tools)
        include_reasoning = req.get("include_reasoning")
        if include_reasoning is not None and not isinstance(include_reasoning, bool):
            raise StatechatError("include_reasoning must be true or false")
        messages = chat_messages(req.get("messages"), tools is not None)
        if defaults.system_prompt and all(m["role"] != "system" for m in messages):
            messages = [{"role": "system", "content": defaults.system_prompt}, *messages]
        kwargs = merge_template_kwargs(defaults.template_kwargs, req.get("chat_template_kwargs"))
        if kwargs is not None:
            check_template_kwargs(None, kwargs)
    except StatechatError as e:
        return Job(line, rid, error=str(e), unknown=unknown)
    return Job(line, rid, messages, kwargs, tools, params=params, unknown=unknown,
               include_reasoning=include_reasoning is not False)


# said of a line that is no JSON value at all (a file of plain prompts, one a line)
PLAIN_TEXT_HINT = ('; each line is one JSON request, such as '
                   '{"messages": [{"role": "user", "content": "..."}]}')


def _line_request(text: str, line: int) -> tuple[dict, tuple, str, object, tuple[str, ...]]:
    """A line's request (`req`, its "id" as id_field names it), its (method, url), id_field,
    body and the fields outside its body (OpenAI's batch format's envelope unwrapped, its
    method POST where it gives none; a plain line is its own body). A line that is not a JSON
    object is StatechatError, one line."""
    try:
        req = json.loads(text)
    except json.JSONDecodeError as e:
        raise StatechatError(f"line {line} is not valid JSON ({e.msg} at column {e.colno})"
                             + (PLAIN_TEXT_HINT if not text.lstrip().startswith(("{", "["))
                                else "")) from None
    except (ValueError, RecursionError) as e:  # an int of over 4300 digits; nesting too deep
        raise StatechatError(f"line {line} is not valid JSON ({str(e)[:200]})") from None
    if not isinstance(req, dict):
        raise StatechatError(f"line {line} must be a JSON object")
    if "body" not in req or "messages" in req:
        return req, ("POST", "/v1/chat/completions"), "id", req, ()
    body = req["body"]  # (OpenAI's batch format)
    outside = tuple(k for k in req if k not in BATCH_FORMAT_FIELDS)  # (not its body's)
    unwrapped = {**body, "id": req.get("custom_id")} if isinstance(body, dict) else \
        {"id": req.get("custom_id")}
    return unwrapped, (req.get("method", "POST"), req.get("url")), "custom_id", body, outside


def unread_fields(req: dict, outside: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The fields of a line's request `req` that batch does not read (a completions line's
    "prompt" excepted: it is the line's error), with `outside`, those of an OpenAI batch-format
    line outside its body; sorted."""
    return tuple(sorted({*outside, *(k for k in req if k not in LINE_FIELDS
                                     and k not in OTHER_FIELDS
                                     and not (k == "prompt" and "messages" not in req))}))


def line_params(req: dict, defaults: BatchDefaults, line: int = 1) -> SamplingParams:
    """A line's sampling params (BatchDefaults.params) from its fields (a line without a seed
    of its own, in a run with one, gets line_seed's for its number `line`); a one-line
    StatechatError naming the field at fault as the line gave it (max_completion_tokens, say,
    which is read as max_tokens)."""
    given = {k: req[k] for k in LINE_FIELDS if req.get(k) is not None}
    if "seed" not in given and defaults.sampling.seed is not None:
        given["seed"] = line_seed(defaults.sampling.seed, line)
    named = {}  # SamplingParams' field -> the line's own name for it
    if req.get("max_completion_tokens") is not None:  # (OpenAI's newer name wins, as in serve)
        given["max_tokens"] = req["max_completion_tokens"]
        named["max_tokens"] = "max_completion_tokens"
    if chat_logprobs(given, req.get("top_logprobs")):
        named["logprobs"] = "top_logprobs"
    for flag in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
        if not isinstance(given.get(flag, False), bool):
            raise StatechatError(f"{flag} must be true or false, got "
                                 f"{json.dumps(given[flag])[:60]}")
    with api_errors():  # (a structured output, read as the server reads a body's)
        structured = parse_structured(req)
    if structured is not None:
        given["structured"] = structured
    n = given.get("n", 1)  # (1.0 is 1, as the server reads it, and true is not)
    if whole_number(n) is None or not 1 <= n <= MAX_N:
        raise StatechatError(f"n must be an integer from 1 to {MAX_N}, got {json.dumps(n)[:60]}")
    try:
        return defaults.params(**given)
    except StatechatError as e:  # (its message starts with the field's name)
        field, _, rest = str(e).partition(" ")
        raise StatechatError(f"{named.get(field, field)} {rest}") from None


def line_seed(seed: int, line: int) -> int:
    """The seed that line `line` of a run seeded with `seed` (--seed) draws with when it gives
    none: a hash of both (63 bits), so a run repeats while its lines differ from each other
    (the run's seed itself for every line gave identical lines one sample)."""
    digest = hashlib.sha256(f"statechat-batch:{seed}:{line}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def chat_logprobs(given: dict, top) -> bool:
    """OpenAI's chat form of a line's logprobs ("logprobs": true, with "top_logprobs": k) as
    the count that batch's own form gives ("logprobs": k), in `given`; whether the count is
    top_logprobs'."""
    flag = given.get("logprobs")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int)):
        raise StatechatError(f"top_logprobs must be an integer, got {json.dumps(top)[:60]}")
    if flag is True:
        given["logprobs"] = top or 0
        return top is not None
    if top:
        raise StatechatError('top_logprobs needs "logprobs": true (or give the count as '
                             '"logprobs" alone)')
    if flag is False:
        del given["logprobs"]
    return False


def chat_messages(raw, tools: bool = False) -> list[dict]:
    """A line's messages as the server takes a request's (OpenAI's: a "developer" is a system
    message, a content may be a list of text parts, an assistant's may be null; with `tools`,
    an assistant's tool calls and tool messages), as [{"role", "content", ...}]; a one-line
    StatechatError otherwise, the server's 400 message."""
    from statechat.api_messages import parse_messages

    with api_errors():
        return parse_messages(raw, tools)


def line_tools(req: dict, parser: str | None) -> ToolRequest | None:
    """A line's tools and tool_choice as the server reads a body's (api_tools.parse_tools: None
    when `parser`, --tool-call-parser, is None); a one-line StatechatError otherwise, the
    server's 400 message."""
    with api_errors():
        return parse_tools(req, parser)


@contextlib.contextmanager
def api_errors():
    """The server's ApiError (a 400) as a line's StatechatError, with the same message."""
    from statechat.api_request import ApiError

    try:
        yield
    except ApiError as e:
        raise StatechatError(e.message) from None


def ignored_fields(jobs: list[Job], most: int = 8) -> str | None:
    """One line naming the fields of the input that batch does not read (each with the lines
    that have it, the first 8 fields and 5 lines each), or None when there are none."""
    where: dict[str, list[int]] = {}
    for job in jobs:
        for name in job.unknown:
            where.setdefault(name, []).append(job.line)
    if not where:
        return None
    parts = []
    for name in sorted(where)[:most]:
        lines = where[name]
        shown = ", ".join(map(str, lines[:5])) + (f" and {len(lines) - 5} more" if
                                                   len(lines) > 5 else "")
        parts.append(f"{json.dumps(name)[:42]} (line{'s' if len(lines) > 1 else ''} {shown})")
    more = f" and {len(where) - most} more" if len(where) > most else ""
    return f"fields batch does not read were ignored: {'; '.join(parts)}{more}"


def error_record(job: Job) -> dict:
    """The result line of a job that cannot run."""
    return {"id": job.id, "line": job.line, "error": {"message": job.error}}
