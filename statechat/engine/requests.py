"""LLMEngine's request API: one request (`add_request`, `output`, `next_event`), and the batch
and streaming calls `generate` and `stream` over it, which take SamplingParams.n samples of each
prompt (engine/samples.py).

A mixin of LLMEngine (engine/engine.py): `generate` and `stream` queue requests with
`check_prompt` and `add_checked`, run `step` until their requests end, and read `output` and
`next_event`, as the app's and server's worker (engine/worker.py) does from its own thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import numbers
from collections.abc import Iterator

import numpy as np

from statechat.engine.output import RequestOutput, StreamEvent, next_event, request_output
from statechat.engine.prompts import check_prompt, encode
from statechat.engine.samples import gather, sample_params
from statechat.engine.sampling import SamplingParams, check_vocabulary
from statechat.engine.sequence import Sequence
from statechat.errors import ConfigError


class Requests:
    """The request API of LLMEngine (see the module docstring)."""

    def encode(self, prompt: str | list[int] | np.ndarray) -> list[int]:
        """A prompt's token ids (see prompts.encode)."""
        return encode(self.tokenizer, prompt)

    def check_prompt(self, prompt: str | list[int]) -> tuple[list[int], bytes]:
        """The prompt's ids and int32 bytes, checked (see prompts.check_prompt); any thread may
        call it."""
        return check_prompt(self.tokenizer, prompt, self.loaded.config.vocab_size,
                            self.max_model_len)

    def check_structured(self, params: SamplingParams) -> None:
        """Refuse (ConfigError) a structured output that this model's tokenizer cannot follow
        (Grammars.check); any thread may call it, holding the tokenizer if it shares it."""
        if params.structured is not None:
            self.runner.grammars.check(params.structured)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str = "") -> Sequence:
        """Queue one request (a sample: params.n must be 1); its Sequence."""
        return self.add_checked(*self.check_prompt(prompt), params, request_id)

    def add_checked(
        self, ids: list[int], packed: bytes, params: SamplingParams | None = None,
        request_id: str = "", arrival_time: float | None = None,
    ) -> Sequence:
        """Queue a prompt that `check_prompt` passed, with the bytes it returned; its time to
        first token counts from `arrival_time` (a perf_counter reading) when given, else now.
        No params: `default_params`, the checkpoint's recommended sampling."""
        params = self.default_params if params is None else params
        check_vocabulary(params, self.loaded.config.vocab_size)
        if params.n > 1:
            raise ConfigError(f"add_request runs one sample, not n={params.n}: use generate, "
                              "stream or add_samples")
        self.check_structured(params)
        seq = Sequence(ids, params, request_id=request_id)
        if arrival_time is not None:
            seq.arrival_time = arrival_time
        self.scheduler.add(seq, packed)
        return seq

    def output(self, seq: Sequence) -> RequestOutput:
        """What `seq` has made so far (all of it once it has finished)."""
        return request_output(seq)

    def next_event(
        self, seq: Sequence, sent_text: int, sent_tokens: int
    ) -> tuple[StreamEvent | None, int, int]:
        """A stream's next event for `seq` (see output.next_event)."""
        return next_event(seq, sent_text, sent_tokens)

    def generate(
        self,
        prompts: list[str | list[int]] | str | list[int],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run all prompts together (continuous batching); outputs in input order. One prompt (a
        string, or a flat list of token ids) is a batch of one, as vLLM's LLM.generate takes
        it. On an error (a bad prompt or params, or a failed step) none of them stays queued.
        No params (or None for a prompt): the checkpoint's recommended sampling
        (`default_params`), as vLLM's LLM.generate takes it from generation_config.json."""
        prompts = _as_batch(prompts)
        params = self.default_params if params is None else params
        plist = list(params) if isinstance(params, list | tuple) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ConfigError(f"{len(prompts)} prompt{'s' * (len(prompts) != 1)} but "
                              f"{len(plist)} sampling params: give one for each prompt, or one "
                              "for all")
        plist = [self.default_params if sp is None else sp for sp in plist]
        checked = [self.check_prompt(p) for p in prompts]  # all checked before any is queued
        for sp in plist:
            check_vocabulary(sp, self.loaded.config.vocab_size)
        groups: list[list[Sequence]] = []  # each prompt's samples
        try:
            for (ids, packed), sp in zip(checked, plist):
                groups.append(self.add_samples(ids, packed, sp))
            while self.has_unfinished():
                self.step()
        except BaseException:
            for seq in (seq for group in groups for seq in group):
                with contextlib.suppress(Exception):  # (the first error is the one to report)
                    self.abort(seq)
            raise
        return [gather([self.output(s) for s in group]) for group in groups]

    def add_samples(self, ids: list[int], packed: bytes, params: SamplingParams,
                    request_id: str = "", arrival_time: float | None = None) -> list[Sequence]:
        """Queue the params.n samples of a prompt `check_prompt` passed, sample 0 first
        (samples.py), as add_checked queues one; their sequences in order (gather their outputs
        with samples.gather). On an error none stays queued."""
        check_vocabulary(params, self.loaded.config.vocab_size)
        seqs: list[Sequence] = []
        try:
            for sp in sample_params(params):  # (each sequence appends to a list of its own)
                seqs.append(self.add_checked(list(ids) if seqs else ids, packed, sp, request_id,
                                             arrival_time))
        except BaseException:
            for seq in seqs:
                self.abort(seq)
            raise
        return seqs

    def stream(
        self, prompt: str | list[int], params: SamplingParams | None = None
    ) -> Iterator[StreamEvent]:
        """Generate one request, yielding text deltas as they are decoded; with params.n > 1,
        those of every sample as they come (each event's `index` says whose, each sample's
        last carrying its output). Each sample's first event and its output carry the
        prompt_logprobs asked for, as `generate` gives them: sample 0 computes them, and the
        other samples' events wait for its first."""
        params = self.default_params if params is None else params
        seqs = self.add_samples(*self.check_prompt(prompt), params)
        sent = [(0, 0)] * len(seqs)  # (text, tokens) each sample has sent
        live = list(range(len(seqs)))
        scores: list = []  # sample 0's prompt_logprobs, once its first event is out

        def ready(i: int) -> bool:  # (a later sample's prompt_logprobs are sample 0's)
            return _has_news(seqs[i], sent[i]) and (
                scores or not i or params.prompt_logprobs is None or 0 not in live)

        try:
            while live:
                # (another caller may have stepped the engine, even to a request's end, while
                # an event was out: what it made is sent before any step of this one)
                if not any(ready(i) for i in live):
                    self.step()
                for i in [i for i in live if _has_news(seqs[i], sent[i])]:
                    if not ready(i):  # (sample 0's first event, sent before it, unblocks it)
                        continue
                    is_last = seqs[i].is_finished  # (its event carries the output)
                    event, *counts = self.next_event(seqs[i], *sent[i])
                    first, sent[i] = sent[i] == (0, 0), tuple(counts)
                    if is_last:
                        live.remove(i)
                    if event is not None and not i and not scores:
                        scores.append(event.prompt_logprobs)
                    if event is not None:
                        yield _indexed(event, i, scores[0] if scores else None, first)
        finally:
            for seq in seqs:
                self.abort(seq)


def _indexed(event: StreamEvent, index: int, scores: list | None, first: bool) -> StreamEvent:
    """`event` as sample `index`'s (its output too), given `scores`, sample 0's
    prompt_logprobs, on its first event (`first`) and its output."""
    if not index:
        return event
    out = event.output and dataclasses.replace(event.output, index=index,
                                               prompt_logprobs=scores)
    return dataclasses.replace(event, index=index, output=out,
                               prompt_logprobs=scores if first else None)


def _has_news(seq: Sequence, sent: tuple[int, int]) -> bool:
    """Whether a stream has something to send of `seq`, which has sent `sent` (text, tokens)."""
    return seq.num_text_tokens > sent[1] or seq.is_finished


def _as_batch(prompts) -> list | tuple:
    """generate's prompts as a list: one prompt (a string, or a flat list, tuple or 1-D numpy
    array of token ids; a list of ids was refused as prompts that are each an int) is a list
    of one."""
    if isinstance(prompts, str) or isinstance(prompts, np.ndarray) and prompts.ndim == 1:
        return [prompts]
    if not isinstance(prompts, list | tuple):
        raise ConfigError("generate takes a prompt or a list of prompts "
                          "(each a string or a list of token ids)")
    if prompts and all(isinstance(t, numbers.Integral) for t in prompts):
        return [prompts]
    return prompts
