"""LLMEngine's batch and streaming calls, `generate` and `stream`, over its one-request API.

A mixin of LLMEngine (engine/engine.py): they queue requests with `check_prompt` and
`add_checked` (or `add_request`), run `step` until their requests end, and read `output` and
`next_event`, as the app's and server's worker (engine/worker.py) does from its own thread.
"""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Iterator

import numpy as np

from statechat.engine.output import RequestOutput, StreamEvent
from statechat.engine.sampling import SamplingParams, check_vocabulary
from statechat.errors import ConfigError


class Requests:
    """`generate` and `stream` of LLMEngine (see the module docstring)."""

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
        seqs = []
        try:
            for (ids, packed), sp in zip(checked, plist):
                seqs.append(self.add_checked(ids, packed, sp))
            while self.has_unfinished():
                self.step()
        except BaseException:
            for seq in seqs:
                with contextlib.suppress(Exception):  # (the first error is the one to report)
                    self.abort(seq)
            raise
        return [self.output(s) for s in seqs]

    def stream(
        self, prompt: str | list[int], params: SamplingParams | None = None
    ) -> Iterator[StreamEvent]:
        """Generate one request, yielding text deltas as they are decoded."""
        seq = self.add_request(prompt, params)
        sent_text, sent_tokens = 0, 0
        try:
            while True:
                # (another caller may have stepped the engine, even to this request's end,
                # while an event was out: what it made is sent before any step of this one)
                if seq.num_text_tokens <= sent_tokens and not seq.is_finished:
                    self.step()
                if seq.num_text_tokens > sent_tokens or seq.is_finished:
                    is_last = seq.is_finished  # (its event carries the output)
                    event, sent_text, sent_tokens = self.next_event(seq, sent_text, sent_tokens)
                    if event is not None:
                        yield event
                    if is_last:
                        return
        finally:
            self.abort(seq)


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
