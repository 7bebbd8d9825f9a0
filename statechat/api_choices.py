"""The choices of one API request, chat or text completion: the engine's n samples of each
prompt (engine/samples.py), submitted together, then waited on, or streamed merged as their
tokens come.

Choice index = prompt index * n + i (OpenAI's and vLLM's order). Choice i of a prompt is its
sample i, as the Python API's `generate` makes it: with a seed it samples with seed + i (vLLM's
rule), so a seeded request is reproducible, its choices differ, and its choice 0 is the reply
the same request with n=1 gets. The other choices of a prompt wait in the engine's queue while
choice 0 computes it, then resume from the prefix cache. When the request asks for the prompt's
logprobs, choice 0 alone computes them (and its prompt whole); every choice of the prompt is
given them. Each API shapes its choices with a `Shape` (api_response.py: the whole response, a
stream's chunks and `usage`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Iterator

from statechat.api_request import ApiError
from statechat.engine.engine import RequestOutput, StreamEvent
from statechat.engine.samples import sample_params, with_prompt_logprobs
from statechat.engine.sampling import SamplingParams
from statechat.engine.worker import EngineWorker, RequestHandle
from statechat.errors import ContextLengthError, ShuttingDownError, StatechatError

POLL_S = 0.5  # how often a wait asks whether the client is still there
_END = object()


def choice_params(params: SamplingParams, n: int, prompt_len: int,
                  max_model_len: int) -> list[SamplingParams]:
    """The params of a prompt's n choices: the engine's samples (samples.sample_params), each
    max_tokens capped to the room the prompt leaves."""
    max_tokens = min(params.max_tokens, max(1, max_model_len - prompt_len))
    capped = dataclasses.replace(params, n=n, max_tokens=max_tokens,
                                 min_tokens=min(params.min_tokens, max_tokens))
    return sample_params(capped)


class Choices:
    """The engine requests of one API request: handles[k] makes choice k. With
    `is_scored`, choice 0 of each prompt computes the prompt's logprobs for them all."""

    def __init__(self, handles: list[RequestHandle], n: int, is_scored: bool = False) -> None:
        self.handles, self.n, self.is_scored = handles, n, is_scored
        self._pumps: dict[int, threading.Thread] = {}  # choice -> the thread reading its handle

    @classmethod
    def submit(cls, worker: EngineWorker, prompts: list[list[int]], params: SamplingParams,
               n: int, param: str,
               on_end: Callable[[RequestOutput | None, float], None] | None = None,
               ) -> Choices:
        """Submit n requests per prompt, choice 0 of each first (the others, forks of its
        prompt, wait in the engine's queue while it computes it, then resume from the prefix
        cache). A prompt the engine refuses is an ApiError(400) naming `param` (code
        context_length_exceeded when it is too long), and nothing stays queued.

        ShuttingDownError if the engine stops before it takes any; once it has taken one, the
        request is in flight, and a choice it would not take then is answered as its running
        ones are, aborted (NotRun), not failed with the request. `on_end`: each request's
        (EngineWorker.submit)."""
        checked = []  # every prompt checked once, before any is queued
        for p, ids in enumerate(prompts):
            with _refused(param, p, len(prompts)):
                checked.append(worker.engine.check_prompt(ids))
        made: dict[tuple[int, int], RequestHandle | NotRun] = {}  # (prompt, choice) -> request
        try:
            for p, ids in enumerate(prompts):
                for i, asked in enumerate(choice_params(params, n, len(ids),
                                                        worker.max_model_len)):
                    with _refused(param, p, len(prompts)):
                        made[p, i] = worker.submit(ids, asked, checked=checked[p], on_end=on_end)
        except ShuttingDownError:
            if not made:
                raise
            for p, (ids, _) in enumerate(checked):
                for i in range(n):
                    made.setdefault((p, i), NotRun(ids))
        except BaseException:
            for handle in made.values():
                handle.abort()
            raise
        return cls([made[p, i] for p in range(len(prompts)) for i in range(n)], n,
                   params.prompt_logprobs is not None)

    def abort(self) -> None:
        """Stop every choice still running (a no-op for those that finished)."""
        for handle in self.handles:
            handle.abort()

    def results(self, gone: Callable[[], bool] = lambda: False) -> list[RequestOutput]:
        """Every choice's output, once all finished, with its prompt's prompt_logprobs when
        asked; ConnectionResetError (every choice still running aborted by the caller) if the
        client goes (`gone`, asked every POLL_S)."""
        outputs = []
        for handle in self.handles:
            while True:
                try:
                    outputs.append(handle.result(timeout=POLL_S))
                    break
                except TimeoutError:
                    if gone():
                        raise ConnectionResetError("the client went away") from None
        return with_prompt_logprobs(outputs, self.n) if self.is_scored else outputs

    def ended(self, timeout: float) -> list[tuple[int, RequestOutput]]:
        """(index, output) of every choice once it has ended, finished or aborted (call abort first:
        an abort ends a choice at the engine's next step), waiting up to `timeout` seconds in
        all; a choice still running then, or one that failed, is left out, as is one that never
        ran (NotRun)."""
        deadline = time.monotonic() + timeout
        for index, handle in enumerate(self.handles):
            left = max(deadline - time.monotonic(), 0)
            pump = self._pumps.get(index)
            if pump is not None:  # (its thread reads the handle: a second reader would race it)
                pump.join(left)
                continue
            with contextlib.suppress(Exception):
                handle.result(timeout=left)
        return [(i, h.output) for i, h in enumerate(self.handles)
                if h.output is not None and not isinstance(h, NotRun)]

    def merged(self, gone: Callable[[], bool] = lambda: False,
               ) -> Iterator[tuple[int, StreamEvent]]:
        """(choice index, event) of every choice as they come, each choice's in order, the
        first with its prompt's prompt_logprobs when asked; an error of any choice is raised,
        and ConnectionResetError (every choice still running aborted by the caller) if the
        client goes (`gone`, asked every POLL_S while no event comes: a long prompt's chunks
        give none, and were all computed for a client that left)."""
        events = self._pumped(gone)
        return self._scored(events) if self.is_scored else events

    def _pumped(self, gone: Callable[[], bool]) -> Iterator[tuple[int, StreamEvent]]:
        """merged's events as the handles give them: a thread per choice reads its handle."""
        events: queue.SimpleQueue = queue.SimpleQueue()
        for index, handle in enumerate(self.handles):
            self._pumps[index] = threading.Thread(target=_pump, args=(index, handle, events),
                                                  daemon=True, name=f"statechat-choice-{index}")
            self._pumps[index].start()
        live = len(self.handles)
        while live:
            try:
                index, item = events.get(timeout=POLL_S)
            except queue.Empty:
                if gone():
                    raise ConnectionResetError("the client went away") from None
                continue
            if item is _END:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item

    def _scored(self, events: Iterator[tuple[int, StreamEvent]],
                ) -> Iterator[tuple[int, StreamEvent]]:
        """`events` with each choice's first carrying the prompt_logprobs of its prompt's
        choice 0 (whose first event brings them); a later choice's events wait for those."""
        scores: dict[int, list | None] = {}  # prompt -> its choice 0's prompt_logprobs
        held: dict[int, list[tuple[int, StreamEvent]]] = {}  # prompt -> events waiting for them
        given: set[int] = set()  # choices whose first event went out

        def give(index: int, event: StreamEvent) -> tuple[int, StreamEvent]:
            if index in given:
                return index, event
            given.add(index)
            return index, dataclasses.replace(event, prompt_logprobs=scores[index // self.n])

        for index, event in events:
            p = index // self.n
            if p in scores:
                yield give(index, event)
            elif index % self.n == 0:
                scores[p] = event.prompt_logprobs
                yield give(index, event)
                for later in held.pop(p, []):
                    yield give(*later)
            else:
                held.setdefault(p, []).append((index, event))
        for p, waiting in held.items():  # (a choice 0 that ended with no event: not lost)
            scores.setdefault(p, None)
            for later in waiting:
                yield give(*later)


class NotRun:
    """A choice of an in-flight request that the engine, stopping, would not take: read as a
    RequestHandle whose request was aborted before its first step (no tokens, finish_reason
    "abort"), as the request's running choices end."""

    def __init__(self, prompt_ids: list[int]) -> None:
        self.output = RequestOutput(
            request_id="", prompt_token_ids=list(prompt_ids), token_ids=[], text="",
            finish_reason="abort", num_prompt_tokens=len(prompt_ids), num_cached_tokens=0,
            num_computed_tokens=0, num_completion_tokens=0, ttft_s=None)
        self.started, self.ended = threading.Event(), True
        self.started.set()

    def __iter__(self) -> Iterator[StreamEvent]:
        yield StreamEvent("", [], self.output)

    def result(self, timeout: float | None = None) -> RequestOutput:
        return self.output

    def abort(self) -> None:
        """(Nothing runs.)"""


@contextlib.contextmanager
def _refused(param: str, p: int, num_prompts: int):
    """A prompt the engine refuses as an ApiError(400) naming `param` (and which prompt, of
    several)."""
    where = f"{param}[{p}]: " if num_prompts > 1 else ""
    try:
        yield
    except ShuttingDownError:
        raise
    except ContextLengthError as e:
        shorten = "conversation" if param == "messages" else "prompt"
        raise ApiError(400, f"{where}{e}; shorten the {shorten}", param,
                       "context_length_exceeded") from None
    except StatechatError as e:
        raise ApiError(400, f"{where}{e}", param) from None


def _pump(index: int, handle: RequestHandle, events: queue.SimpleQueue) -> None:
    try:
        for event in handle:
            events.put((index, event))
    except Exception as e:  # noqa: BLE001 - raised by Choices.merged in the request's thread
        events.put((index, e))
    events.put((index, _END))


def reuse_line(out: RequestOutput, rid: str) -> str:
    """The log line of a choice that ended (`rid`: its response's id, and its index where
    there are several): the prompt tokens it reused, from which tier, and computed, its new
    tokens, the prefix cache's plan with both predictions, and whether it was aborted."""
    plan, choice = out.cache_plan or {}, ""
    if plan.get("candidate_tokens"):
        choice = (f"; {plan['choice']}: loading {plan['candidate_tokens']:,} tokens predicted "
                  f"{plan['predicted_load_s'] * 1e3:.1f} ms, recomputing them "
                  f"{plan['predicted_recompute_s'] * 1e3:.1f} ms")
    if "disk_resident" in plan:
        choice += f" (page cache held {plan['disk_resident']:.0%} of the disk part)"
    tier = f" from {out.reused_from}" if out.reused_from else ""
    return (f"{rid}: reused {out.num_cached_tokens:,} of {out.num_prompt_tokens:,} prompt "
            f"tokens{tier}; computed {out.num_computed_tokens:,}; {out.num_completion_tokens} "
            f"new{choice}{'; aborted' if out.finish_reason == 'abort' else ''}")
