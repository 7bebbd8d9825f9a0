"""The runner's prompt scoring (prompt_logprobs): which rows of a prefill step score a prompt
token, and their table (each row's logprob, rank and top-k of the next prompt token), made some
hundreds of rows at a time.

A mixin of ModelRunner (engine/runner.py), which runs the step's forward and hands the hidden
states over.
"""

from __future__ import annotations

import numpy as np
import torch

import kernels
from statechat.engine.scheduler import Batch

SCORE_BYTES = 2**28  # logits of the prompt rows scored at a time (see _score)


class PromptScoring:
    """Prompt scoring of ModelRunner's steps (`self.model`, `self.loaded`, `self.dtype`,
    `self._tensor`)."""

    @staticmethod
    def scored(batch: Batch) -> list[tuple[int, int, int]]:
        """(item, first position, rows) of each item whose request asks for prompt_logprobs
        and that feeds prompt tokens followed by a prompt token: the row of position p scores
        token p + 1."""
        out = []
        for i, it in enumerate(batch.items):
            end = min(it.start + it.num_tokens, it.seq.num_prompt_tokens - 1)
            if it.seq.params.prompt_logprobs is not None and it.start < end:
                out.append((i, it.start, end - it.start))
        return out

    def _score_rows(self, batch: Batch,
                    scored: list[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The scored rows of the packed batch and their target tokens, on the device."""
        first_row = np.cumsum([0] + [it.num_tokens for it in batch.items])
        rows, targets = [], []
        for i, start, n in scored:
            it = batch.items[i]
            rows += range(first_row[i] + start - it.start, first_row[i] + start - it.start + n)
            targets += it.seq.token_ids[start + 1 : start + 1 + n]
        return self._tensor(rows, torch.int64), self._tensor(targets, torch.int64)

    def _score(self, h: torch.Tensor, residual: torch.Tensor, rows: torch.Tensor,
               targets: torch.Tensor, k: int) -> torch.Tensor:
        """kernels.score_logits' table of the given rows of the packed hidden states h and
        residual, some hundreds of rows' logits at a time (a whole chunk's would take
        gigabytes)."""
        step = max(1, SCORE_BYTES // (self.loaded.config.vocab_size * self.dtype.itemsize))
        tables = []
        for a in range(0, rows.shape[0], step):
            logits = self.model.logits(h, residual, rows[a : a + step], raw=True)
            tables.append(kernels.score_logits(logits, targets[a : a + step], k))
        return torch.cat(tables)
