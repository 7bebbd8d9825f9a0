"""`statechat batch`: JSONL chat requests in, JSONL results out (input order), all run together.

Input, one request a line:
    {"id": "a", "messages": [{"role": "user", "content": "..."}], "max_tokens": 64,
     "temperature": 0}
("id": a string or a number, echoed as given; "line-N" when left out; a line of OpenAI's batch
format, {"custom_id", "url": "/v1/chat/completions", "body"}, as vLLM's run-batch reads, is its
body with the custom_id as "id") with optional
"max_completion_tokens" (over "max_tokens"), "top_p", "top_k", "min_p", "presence_penalty",
"frequency_penalty", "repetition_penalty", "seed", "stop" (a string or a list),
"stop_token_ids", "ignore_eos", "n" (1 only), "logprobs" (0 to 20: each generated token's
logprob and those of that many likeliest tokens; or OpenAI's chat form, true with
"top_logprobs" as that count), "prompt_logprobs" (the same for each prompt
token after the first, with its rank; such a line computes its whole prompt), "min_tokens",
"logit_bias" ({"id": bias}) and "chat_template_kwargs" (variables of the model's chat
template, over --chat-template-kwargs) as well; "max_tokens": 0 computes the prompt alone. A
line's own fields win over the run's defaults (BatchDefaults: greedy, 256 tokens, under the
model's recommended sampling and the command's flags); other fields are named on stderr.
Output, one line per input line, in input order:
    {"id", "text", "finish_reason",
     "usage": {"prompt_tokens", "cached_tokens", "completion_tokens"},
     "ttft_ms", "cache": {"reused_from", "reused_by_tier", "plan", and for a request of a group
     sharing a prefix (below) "shared_prefix": {"tokens", "reused_tokens", "reused_from",
     "computed_tokens"}: what the group's warm-up did with it}}
(and, for a line that asked, "logprobs": [{"token", "logprob", "bytes", "top_logprobs"}], as
OpenAI's chat logprobs.content, and "prompt_logprobs": [null, {id: {"logprob", "rank",
"decoded_token"}}, ...], as vLLM's)
or, for a line that cannot run, {"id", "line", "error": {"message"}}.

Requests run through the engine together (continuous batching). Requests that share a prefix
of at least one block with each other would all compute it at once if admitted in the same
step, since the cache holds only what earlier steps computed; so when the prefix cache is on,
such a group's longest common block-aligned prefix is computed once first (a one-token warm-up
request, not reported) and the group's requests then reuse it.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from statechat.engine.engine import LLMEngine, RequestOutput
from statechat.engine.sampling import SamplingParams, check_vocabulary
from statechat.errors import StatechatError

LINE_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
               "frequency_penalty", "repetition_penalty", "seed", "stop", "stop_token_ids",
               "ignore_eos", "logprobs", "prompt_logprobs", "min_tokens", "logit_bias")  # sampling
# the other fields a line may have; any more are named on stderr, as ignored
OTHER_FIELDS = ("id", "messages", "chat_template_kwargs", "max_completion_tokens", "n",
                "top_logprobs")
WHOLE = ("max_tokens", "top_k", "seed", "logprobs", "prompt_logprobs", "min_tokens")  # integers,
# which a whole-number float may give
DEFAULT_SAMPLING = SamplingParams(temperature=0.0, max_tokens=256)  # batch's own: greedy


@dataclass(frozen=True)
class BatchDefaults:
    sampling: SamplingParams = DEFAULT_SAMPLING  # every line's; its own fields win
    template_kwargs: dict | None = None  # chat-template variables; a line's own win

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
    prompt_ids: list[int] | None = None  # (set by prepare, once the model is loaded)
    params: SamplingParams | None = None
    error: str | None = None
    unknown: tuple[str, ...] = ()  # the line's fields batch does not read (ignored)
    result: dict | None = None
    shared: dict | None = None  # its group's warm-up: the shared prefix and where it came from


def parse_lines(lines: Iterable[str], defaults: BatchDefaults) -> list[Job]:
    """The input's non-blank lines as Jobs, checked as far as they can be before the model
    loads (JSON, id, sampling fields, messages, template variables)."""
    return [parse_line(text, n, defaults) for n, text in enumerate(lines, start=1) if text.strip()]


def parse_line(text: str, line: int, defaults: BatchDefaults) -> Job:
    """One input line -> a Job with its messages and params, or with a one-line error."""
    from statechat.chat.template import check_template_kwargs, merge_template_kwargs

    try:
        req = json.loads(text)
    except json.JSONDecodeError as e:
        return Job(line, None, error=f"line {line} is not valid JSON ({e.msg})")
    except (ValueError, RecursionError) as e:  # an int of over 4300 digits; nesting too deep
        return Job(line, None, error=f"line {line} is not valid JSON ({str(e)[:200]})")
    if not isinstance(req, dict):
        return Job(line, None, error=f"line {line} must be a JSON object")
    if isinstance(req.get("body"), dict) and "messages" not in req:  # (OpenAI's batch format)
        if req.get("url") != "/v1/chat/completions":
            return Job(line, None, error=f'line {line}: "url" must be "/v1/chat/completions" '
                                         f"(batch runs chat requests), got "
                                         f"{json.dumps(req.get('url'))[:60]}")
        req = {**req["body"], "id": req.get("custom_id")}
    rid = req.get("id")
    if rid is None:
        rid = f"line-{line}"
    elif isinstance(rid, bool) or not isinstance(rid, str | int | float) \
            or (isinstance(rid, float) and not math.isfinite(rid)):
        return Job(line, None, error=f'line {line}: "id" must be a string or a number, got '
                                     f"{json.dumps(rid)[:60]}")
    unknown = tuple(sorted(k for k in req if k not in LINE_FIELDS and k not in OTHER_FIELDS))
    try:
        given = {k: req[k] for k in LINE_FIELDS if req.get(k) is not None}
        if req.get("max_completion_tokens") is not None:  # (OpenAI's newer name wins, as in serve)
            given["max_tokens"] = req["max_completion_tokens"]
        chat_logprobs(given, req.get("top_logprobs"))
        if not isinstance(given.get("ignore_eos", False), bool):
            raise StatechatError(f"ignore_eos must be true or false, got "
                                 f"{json.dumps(given['ignore_eos'])[:60]}")
        if req.get("n") not in (None, 1):  # (null: left out, as OpenAI's schema allows)
            raise StatechatError("n must be 1 in a batch line; give each sample a line of its "
                                 "own, with its own seed")
        params = defaults.params(**given)
        messages = chat_messages(req.get("messages"))
        kwargs = merge_template_kwargs(defaults.template_kwargs, req.get("chat_template_kwargs"))
        if kwargs is not None:
            check_template_kwargs(None, kwargs)
    except StatechatError as e:
        return Job(line, rid, error=str(e), unknown=unknown)
    return Job(line, rid, messages, kwargs, params=params, unknown=unknown)


def chat_logprobs(given: dict, top) -> None:
    """OpenAI's chat form of a line's logprobs ("logprobs": true, with "top_logprobs": k) as
    the count that batch's own form gives ("logprobs": k), in `given`."""
    flag = given.get("logprobs")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int)):
        raise StatechatError(f"top_logprobs must be an integer, got {json.dumps(top)[:60]}")
    if flag is True:
        given["logprobs"] = top or 0
    elif top:
        raise StatechatError('top_logprobs needs "logprobs": true (or give the count as '
                             '"logprobs" alone)')
    elif flag is False:
        del given["logprobs"]


def chat_messages(raw) -> list[dict]:
    """A line's messages as the server takes a request's (OpenAI's: a "developer" is a system
    message, a content may be a list of text parts, an assistant's may be null), as
    [{"role", "content"}]; a one-line StatechatError otherwise."""
    from statechat.api_request import ApiError, parse_messages

    try:
        return parse_messages(raw)
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


def prepare(engine: LLMEngine, job: Job) -> None:
    """Render a parsed job's prompt with the model's tokenizer and check it against the model
    (vocabulary, context limit); a failure becomes the job's one-line error."""
    from statechat.chat.template import render

    if job.error is not None:
        return
    try:
        check_vocabulary(job.params, engine.loaded.config.vocab_size)
        ids = render(engine.tokenizer, job.messages, template_kwargs=job.template_kwargs)
        if len(ids) >= engine.max_model_len:
            raise StatechatError(
                f"the prompt has {len(ids)} tokens; the context limit is {engine.max_model_len}"
            )
    except StatechatError as e:
        job.error = str(e)
        return
    job.prompt_ids, job.messages = ids, None  # (rendered: the messages are not kept)


def error_record(job: Job) -> dict:
    """The result line of a job that cannot run."""
    return {"id": job.id, "line": job.line, "error": {"message": job.error}}


def warmup_prefixes(jobs: list[Job], block_size: int) -> list[tuple[list[int], list[int]]]:
    """Groups of jobs sharing a first block that can reuse it (not those scoring their prompt,
    which compute it whole): (common block-aligned prefix + 1 token, members).

    The extra token makes the warm-up's prompt-end checkpoint fall exactly on the boundary.
    """
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, job in enumerate(jobs):
        if job.error is None and len(job.prompt_ids) > block_size \
                and job.params.prompt_logprobs is None:  # (one that scores computes it all)
            groups.setdefault(tuple(job.prompt_ids[:block_size]), []).append(i)
    warm = []
    for members in groups.values():
        if len(members) < 2:
            continue
        prompts = [jobs[i].prompt_ids for i in members]
        lcp = min(len(p) for p in prompts) - 1  # a reuse always leaves one token to compute
        first = prompts[0]
        for p in prompts[1:]:
            lcp = next((k for k in range(lcp) if p[k] != first[k]), lcp)
        boundary = lcp // block_size * block_size
        if boundary >= block_size:
            warm.append((first[: boundary + 1], members))
    return warm


def _result(job: Job, out: RequestOutput, tokenizer) -> dict:
    from statechat.api_logprobs import logprobs_content, vllm_prompt_logprobs

    record = {
        "id": job.id,
        "text": out.text,
        "finish_reason": out.finish_reason,
        "usage": {
            "prompt_tokens": out.num_prompt_tokens,
            "cached_tokens": out.num_cached_tokens,
            "completion_tokens": out.num_completion_tokens,
        },
        "ttft_ms": None if out.ttft_s is None else round(out.ttft_s * 1000, 2),
        # where the reused prefix came from, per tier, and the load-or-recompute plan
        "cache": {"reused_from": out.reused_from, "reused_by_tier": out.reused_by_tier or {},
                  "plan": out.cache_plan},
    }
    if job.shared is not None:
        record["cache"]["shared_prefix"] = job.shared
    if out.logprobs is not None:
        record["logprobs"] = logprobs_content(tokenizer, out.token_ids, out.logprobs)
    if out.prompt_logprobs is not None:
        record["prompt_logprobs"] = vllm_prompt_logprobs(tokenizer, out.prompt_token_ids,
                                                         out.prompt_logprobs)
    return record


def run_batch(
    engine: LLMEngine,
    jobs: list[Job],
    write: Callable[[dict], None],
    progress: Callable[[int, int], None] | None = None,
) -> list[dict]:
    """Run every parsed job (parse_lines); call write(record) in input order as results
    become ready.

    progress(done, total) is called as requests finish. Returns the records.
    """
    for job in jobs:
        prepare(engine, job)
        if job.error is not None:
            job.result = error_record(job)
    warm = (warmup_prefixes(jobs, engine.config.block_size)
            if engine.config.enable_prefix_cache else [])
    waiting_on: dict[int, list[int]] = {}  # warm-up seq_id -> job indices waiting for it
    running: dict[int, int] = {}  # seq_id -> job index
    for n, (prefix, members) in enumerate(warm):
        seq = engine.add_request(prefix, SamplingParams(max_tokens=1), request_id=f"warmup-{n}")
        waiting_on[seq.seq_id] = members
    deferred = {j for _, members in warm for j in members}
    for i, job in enumerate(jobs):
        if job.error is None and i not in deferred:
            running[engine.add_request(job.prompt_ids, job.params, str(job.id)).seq_id] = i
    done, written = sum(j.result is not None for j in jobs), 0
    if progress:
        progress(done, len(jobs))
    written = _flush(jobs, written, write)
    while engine.has_unfinished():
        for seq in engine.step():
            if not seq.is_finished:
                continue
            if seq.seq_id in waiting_on:
                shared = _shared(engine.output(seq))
                for j in waiting_on.pop(seq.seq_id):
                    job = jobs[j]
                    job.shared = shared
                    running[engine.add_request(job.prompt_ids, job.params, str(job.id)).seq_id] = j
            elif seq.seq_id in running:
                job = jobs[running.pop(seq.seq_id)]
                job.result = _result(job, engine.output(seq), engine.tokenizer)
                done += 1
                if progress:
                    progress(done, len(jobs))
        written = _flush(jobs, written, write)
    return [j.result for j in jobs]


def _shared(warmup: RequestOutput) -> dict:
    """What a group's warm-up did with the prefix its requests then reuse from the device tier:
    its tokens, how many it reused and from which tier (a load from disk shows here, not in
    the requests' own reused_from), and how many it computed."""
    return {"tokens": warmup.num_prompt_tokens - 1, "reused_tokens": warmup.num_cached_tokens,
            "reused_from": warmup.reused_from,  # (its prompt is the prefix and one token more)
            "computed_tokens": warmup.num_computed_tokens - 1}


def _flush(jobs: list[Job], written: int, write: Callable[[dict], None]) -> int:
    """Write the finished results that have no unfinished job before them."""
    while written < len(jobs) and jobs[written].result is not None:
        write(jobs[written].result)
        written += 1
    return written
