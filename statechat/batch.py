"""`statechat batch`: JSONL chat requests in, JSONL results out (input order), all run together.

Input: see batch_lines (one JSON request a line).
Output, one line per input line, in input order:
    {"id", "text" (with --reasoning-parser: the answer, and "reasoning" beside it; with
     --tool-call-parser and tools to call: the text outside the calls, and "tool_calls" beside
     it where the reply made calls; "" where there is none),
     "finish_reason" ("tool_calls" for a reply with calls that ended of itself, "stop" for a
     named tool_choice's call, as the server's),
     "stop_reason" (vLLM's: the stop string or stop token id that ended it, null for the
     tokenizer's EOS and any other end),
     "usage": {"prompt_tokens", "cached_tokens", "completion_tokens"},
     "ttft_ms", "cache": {"reused_from", "reused_by_tier", "plan", and for a request of a group
     sharing a prefix (below) "shared_prefix": {"tokens", "reused_tokens", "reused_from",
     "computed_tokens"}: what the group's warm-up did with it}}
(and, for a line that asked, "logprobs": [{"token", "logprob", "bytes", "top_logprobs"}], as
OpenAI's chat logprobs.content, and "prompt_logprobs": [null, {id: {"logprob", "rank",
"decoded_token"}}, ...], as vLLM's; for a line with "n" > 1, "choices": each sample's "index",
its reply's fields as above, "cached_tokens" and "completion_tokens", the fields beside them
sample 0's but for usage: the prompt counted once, every sample's completion tokens)
or, for a line that cannot run, {"id", "line", "error": {"message"}}.

Requests run through the engine together (continuous batching). Requests that share a prefix
of at least one block with each other would all compute it at once if admitted in the same
step, since the cache holds only what earlier steps computed; so when the prefix cache is on,
such a group's longest common block-aligned prefix is computed once first (a one-token warm-up
request, not reported) and the group's requests then reuse it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from statechat.batch_lines import Job, error_record
from statechat.engine.engine import LLMEngine, RequestOutput
from statechat.engine.samples import gather
from statechat.engine.sampling import SamplingParams, check_vocabulary
from statechat.errors import StatechatError


def prepare(engine: LLMEngine, job: Job, reasoning_parser: str | None = None) -> None:
    """Render a parsed job's prompt with the model's tokenizer (and the call's opening that its
    tool_choice forces, api_tools.force_call, whose call is then held to its function's schema:
    api_tool_grammar.hold_call) and check it against the model (vocabulary, context limit); a
    failure becomes the job's one-line error. With a `reasoning_parser`, a
    structured output starts after the thinking that the prompt opens, as the server's
    (api_structured.gate_thinking)."""
    from statechat.api_structured import gate_thinking
    from statechat.api_tool_grammar import hold_call
    from statechat.api_tools import force_call, unthinking
    from statechat.batch_lines import api_errors
    from statechat.chat.template import opens_thinking, render

    if job.error is not None:
        return
    try:
        check_vocabulary(job.params, engine.loaded.config.vocab_size)
        tools = job.tools.tools if job.tools is not None else None
        ids = force_call(  # (a tool_choice that forces a call: its opening, as the server's)
            render(engine.tokenizer, job.messages, template_kwargs=job.template_kwargs,
                   tools=tools), job.tools, engine.tokenizer,
            lambda: render(engine.tokenizer, job.messages, tools=tools,
                           template_kwargs=unthinking(job.template_kwargs)))
        if len(ids) >= engine.max_model_len:
            raise StatechatError(f"the prompt has {len(ids)} tokens; the context limit is "
                                 f"{engine.max_model_len}; shorten the conversation")
        with api_errors():  # (a forced call held to its function's schema, as the server's)
            job.params = hold_call(job.params, job.tools, engine.tokenizer)
        if reasoning_parser is not None and job.params.structured is not None:
            with api_errors():
                job.params = gate_thinking(job.params, opens_thinking(engine.tokenizer, ids),
                                           engine.tokenizer)
    except StatechatError as e:
        job.error = str(e)
        return
    job.prompt_ids, job.messages = ids, None  # (rendered: the messages are not kept)


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


def _result(job: Job, out: RequestOutput, tokenizer, reasoning_parser: str | None) -> dict:
    """A finished job's record (`out`: its samples gathered, samples.gather): its reply's
    fields (_reply; with n > 1, sample 0's, and "choices" holds every sample's), its usage (the
    prompt counted once, as the server's: the cached tokens of the sample that reused the
    least; the completion tokens of every sample) and what it reused of the cache."""
    from statechat.api_logprobs import vllm_prompt_logprobs

    samples = out.outputs
    record = {
        "id": job.id,
        **_reply(job, out, tokenizer, reasoning_parser),
        "usage": {
            "prompt_tokens": out.num_prompt_tokens,
            "cached_tokens": min(s.num_cached_tokens for s in samples),
            "completion_tokens": sum(s.num_completion_tokens for s in samples),
        },
        "ttft_ms": None if out.ttft_s is None else round(out.ttft_s * 1000, 2),
        # where the reused prefix came from, per tier, and the load-or-recompute plan
        "cache": {"reused_from": out.reused_from, "reused_by_tier": out.reused_by_tier or {},
                  "plan": out.cache_plan},
    }
    if job.shared is not None:
        record["cache"]["shared_prefix"] = job.shared
    if len(samples) > 1:
        record["choices"] = [
            {"index": s.index, **_reply(job, s, tokenizer, reasoning_parser),
             "cached_tokens": s.num_cached_tokens, "completion_tokens": s.num_completion_tokens}
            for s in samples]
    if out.prompt_logprobs is not None:
        record["prompt_logprobs"] = vllm_prompt_logprobs(tokenizer, out.prompt_token_ids,
                                                         out.prompt_logprobs)
    return record


def _reply(job: Job, out: RequestOutput, tokenizer, reasoning_parser: str | None) -> dict:
    """One sample's text, reasoning and tool calls (and its logprobs and finish_reason) as the
    server's chat message and choice give them (api_chat.ChatShape)."""
    from statechat.api_chat import ChatShape
    from statechat.chat.template import opens_thinking

    opened = (opens_thinking(tokenizer, job.prompt_ids) if reasoning_parser is not None
              else None)
    choice = ChatShape(tokenizer, opened, tools=job.tools).choice(0, out)
    message = choice["message"]
    reply = {
        "text": message["content"] or "",  # (the answer alone: "" when none)
        **({"reasoning": message["reasoning"]}
           if reasoning_parser is not None and job.include_reasoning else {}),
        **({"tool_calls": message["tool_calls"]} if "tool_calls" in message else {}),
        "finish_reason": choice["finish_reason"],
        "stop_reason": choice["stop_reason"],  # (the server's: not a stop it added itself)
    }
    if choice["logprobs"] is not None:
        reply["logprobs"] = choice["logprobs"]["content"]
    return reply


def run_batch(
    engine: LLMEngine,
    jobs: list[Job],
    write: Callable[[dict], None],
    progress: Callable[[int, int], None] | None = None,
    reasoning_parser: str | None = None,
) -> list[dict]:
    """Run every parsed job (parse_lines); call write(record) in input order as results
    become ready. With a `reasoning_parser` (api_reasoning.PARSERS), each result's text is
    split into "reasoning" and the answer ("text"), as the server splits a chat reply; a job
    with tools to call (parsed by BatchDefaults.tool_call_parser) has its reply's calls in
    "tool_calls", as the server's message has them.

    progress(done, total) is called as requests finish. Returns the records. Every request's
    time to first token counts from when the batch is queued, a group's deferred members'
    too: their wait for the group's warm-up is part of it.
    """
    for job in jobs:
        prepare(engine, job, reasoning_parser)
        if job.error is not None:
            job.result = error_record(job)
    warm = (warmup_prefixes(jobs, engine.config.block_size)
            if engine.config.enable_prefix_cache else [])
    run = _BatchRun(engine, jobs, reasoning_parser, queued=time.perf_counter())
    run.start(warm)
    done, written = sum(j.result is not None for j in jobs), 0
    if progress:
        progress(done, len(jobs))
    written = _flush(jobs, written, write)
    while engine.has_unfinished():
        for seq in engine.step():
            if seq.is_finished and run.finished(seq):
                done += 1
                if progress:
                    progress(done, len(jobs))
        written = _flush(jobs, written, write)
    return [j.result for j in jobs]


@dataclass
class _BatchRun:
    """A batch in the engine: which sequence belongs to which job, and which jobs wait for a
    group's warm-up (warmup_prefixes) before they are added."""

    engine: LLMEngine
    jobs: list[Job]
    reasoning_parser: str | None
    queued: float  # perf_counter() when the batch was queued: every request's TTFT counts from it
    waiting_on: dict[int, list[int]] = field(default_factory=dict)  # warm-up seq_id -> jobs
    running: dict[int, int] = field(default_factory=dict)  # seq_id -> job index
    samples: dict[int, list] = field(default_factory=dict)  # job -> its samples' sequences

    def start(self, warm: list[tuple[list[int], list[int]]]) -> None:
        """Add the warm-ups of `warm` (warmup_prefixes'), then, in input order, every job that
        can run and waits for none of them."""
        for n, (prefix, members) in enumerate(warm):
            seq = self.engine.add_request(prefix, SamplingParams(max_tokens=1),
                                          request_id=f"warmup-{n}")
            self.waiting_on[seq.seq_id] = members
        deferred = {j for _, members in warm for j in members}
        for i, job in enumerate(self.jobs):
            if job.error is None and i not in deferred:
                self.add(i)

    def add(self, i: int) -> None:
        """Add job i's samples (engine.add_samples) to the engine."""
        job, engine = self.jobs[i], self.engine
        self.samples[i] = engine.add_samples(*engine.check_prompt(job.prompt_ids), job.params,
                                             str(job.id), self.queued)
        self.running.update((seq.seq_id, i) for seq in self.samples[i])

    def finished(self, seq) -> bool:
        """Take a finished sequence: a warm-up adds the jobs that waited for it; a job's last
        sample to finish sets the job's result. Whether a job's result was set."""
        if seq.seq_id in self.waiting_on:
            shared = _shared(self.engine.output(seq))
            for j in self.waiting_on.pop(seq.seq_id):
                self.jobs[j].shared = shared
                self.add(j)
            return False
        if seq.seq_id not in self.running:
            return False
        i = self.running.pop(seq.seq_id)
        if i not in self.samples or not all(s.is_finished for s in self.samples[i]):
            return False  # (its other samples go on, or ended in this step: done)
        job = self.jobs[i]
        out = gather([self.engine.output(s) for s in self.samples.pop(i)])
        job.result = _result(job, out, self.engine.tokenizer, self.reasoning_parser)
        return True


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
