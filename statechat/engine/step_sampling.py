"""The runner's sampling of a step's logits: its tokens drawn (each request's penalties, logit
bias, min_tokens and structured output applied, on the sampler's graphs where they can serve),
its logprob table made, and the step returned as Launched for `ModelRunner.collect` to read.

A mixin of ModelRunner (engine/runner.py), which queues the step's forward first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from statechat.engine.logprobs import logprob_table
from statechat.engine.sampler import sample
from statechat.engine.sampler_graphs import SamplerGraphs
from statechat.engine.scheduler import Batch
from statechat.engine.token_counts import TokenCounts


@dataclass
class Launched:
    """A step queued on the device; `ModelRunner.collect` reads its tokens."""

    batch: Batch
    tokens: torch.Tensor | None  # sampled, on the device: one per item that needs logits
    host: np.ndarray | None = None  # their pinned host copy, once a later step was queued
    copied: torch.cuda.Event | None = None  # the event after that copy (torch.npu's on NPUs)
    replay: int | None = None  # the decode graphs' replay count after this step's replay
    logprobs: torch.Tensor | None = None  # logprob_table of the rows whose request asks for it
    host_logprobs: np.ndarray | None = None  # its pinned host copy, as `host`
    prompt: torch.Tensor | None = None  # kernels.score_logits' table of the prompt rows scored
    # (see ModelRunner.scored), in their order
    pending: tuple | None = None  # a step launched with `defer`: what its sampling will read
    # (logits, greedy, sampler graphs, prompt table) until ModelRunner.sample_pending queues it


class StepSampling:
    """The sampling of ModelRunner's steps (`self.device`, `self.generators`, `self.counts`,
    `self.eos_ids`, `self.grammars`, `self._tensor`)."""

    def _sample_step(self, batch: Batch, logits: torch.Tensor, greedy: torch.Tensor | None,
                     graphs: SamplerGraphs | None, replay: int | None,
                     prompt: torch.Tensor | None) -> Launched:
        """Queue the draws of the step's tokens from its `logits` (one row per item that needs
        logits; `greedy`: their argmax, if a replayed graph made it; `graphs`: the sampler's,
        if they may read these logits) and its logprob table: the step, Launched (`replay`:
        the decode graphs' count after its replay; `prompt`: its prompt's score table)."""
        wanted = [it.seq for it in batch.items if it.needs_logits]
        if not wanted:
            return Launched(batch, None, prompt=prompt)
        params = [s.params for s in wanted]
        counts = None
        if any(p.uses_penalties for p in params):
            counts = self._counts(wanted, logits.shape[-1])
        drawn_from = logits
        biases = self._biases(batch, logits.shape[-1]) if any(p.uses_bias for p in params) else None
        held = [j for j, p in enumerate(params) if p.uses_grammar]  # (structured outputs)
        if biases or held:  # (a graph's argmax and sampling do not see them: this step is eager)
            drawn_from, greedy, graphs = self._biased(logits, biases, wanted, held), None, None
        tokens = sample(drawn_from, params, [self._generator(s) for s in wanted], greedy, counts,
                        graphs)
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]  # (of the raw logits)
        table = None
        if rows:
            k = max(params[i].logprobs for i in rows)
            table = graphs.logprobs(logits, tokens, rows, k) if graphs is not None else None
            if table is None:
                table = logprob_table(logits, tokens, rows, k)
        return Launched(batch, tokens, replay=replay, logprobs=table, prompt=prompt)

    def _biases(self, batch: Batch, vocab: int) -> tuple[list[int], list[int], list[float]] | None:
        """(row, token, value) of the step's logit changes, one row per item that samples: each
        request's logit_bias, and -inf on the tokens its min_tokens bars (EOS unless it
        ignores EOS, and its stop_token_ids) while the token drawn comes before min_tokens;
        None where there are none (min_tokens reached: the step samples as a plain one)."""
        rows, cols, values = [], [], []
        for j, it in enumerate(it for it in batch.items if it.needs_logits):
            p = it.seq.params
            for token, bias in p.logit_bias:
                rows.append(j)
                cols.append(token)
                values.append(bias)
            made = it.start + it.num_tokens - it.seq.num_prompt_tokens  # (tokens before this
            # one: a continuation's start already counts the token its feed brings)
            if made < p.min_tokens:
                barred = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_ids)
                barred = [t for t in barred if 0 <= t < vocab]
                rows += [j] * len(barred)
                cols += barred
                values += [-math.inf] * len(barred)
        return (rows, cols, values) if rows else None

    def _biased(self, logits: torch.Tensor,
                biases: tuple[list[int], list[int], list[float]] | None, seqs: list,
                held: list[int]) -> torch.Tensor:
        """A copy of the logits with _biases' changes added, and -inf on the tokens that the
        structured outputs of rows `held` (of `seqs`, one per row) do not allow (the logits may
        be a graph's output, which its next replay overwrites, and the logprobs read them
        raw)."""
        out = logits.clone()
        if biases:
            rows, cols, values = biases
            index = (self._tensor(rows, torch.int64), self._tensor(cols, torch.int64))
            out.index_put_(index, self._tensor(values, out.dtype), accumulate=True)
        if held:
            allowed = self.grammars.mask([seqs[j] for j in held], out.shape[-1], out.device)
            rows = self._tensor(held, torch.int64)
            out[rows] = out[rows].masked_fill(~allowed, -math.inf)
        return out

    def _generator(self, seq) -> torch.Generator | None:
        if seq.params.is_greedy or seq.params.seed is None:
            return None
        gen = self.generators.get(seq.seq_id)
        if gen is None:
            gen = self.generators[seq.seq_id] = (
                torch.Generator(self.device).manual_seed(seq.params.seed)
            )
        return gen

    def _counts(self, seqs, vocab_size: int) -> tuple[TokenCounts, list[int]]:
        """The token counts and each sequence's row in them (0 for one without penalties)."""
        if self.counts is None:
            self.counts = TokenCounts(vocab_size, self.device)
        return self.counts, [
            self.counts.row(s.seq_id, s.token_ids[: s.num_prompt_tokens], s.output_ids)
            if s.params.uses_penalties else 0 for s in seqs]
