"""Device-side tables the sampler reads by row: the token counts behind the penalties, and the
row indices a step's sampling gathers with (kept, so that a graph that read one reads it again).
"""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=64)
def device_index(rows: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Row indices on the device, kept: a graph that reads them reads the same tensor."""
    return device_ids(list(rows), device)


def device_ids(values: list[int], device: torch.device) -> torch.Tensor:
    """int64 indices on the device (a copy that does not wait)."""
    return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)


class TokenCounts:
    """The generated-token counts (presence and frequency penalties) and prompt-token marks
    (repetition penalty) of the requests with penalties, on the device: one row each, row 0
    all zeros for the rows of a step that have none. Each sampled token is counted on the
    device as it is drawn, so a step queued before the host has read the step before's token
    still sees it. Rows grow by doubling and are reused once their request ends."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size, self.device = vocab_size, device
        self.counts = torch.zeros(1, vocab_size, dtype=torch.int32, device=device)  # [rows, vocab]
        # [rows, vocab]
        self.in_prompt = torch.zeros(1, vocab_size, dtype=torch.bool, device=device)
        self.rows: dict[int, int] = {}  # seq_id -> row
        self.free: list[int] = []

    def row(self, seq_id: int, prompt_ids: list[int], output_ids: list[int]) -> int:
        """The request's row, made at its first sampling from the tokens the host holds (a
        prefill step's: a step fed on the device only continues a decode step)."""
        row = self.rows.get(seq_id)
        if row is not None:
            return row
        if not self.free:
            self._grow()
        row = self.rows[seq_id] = self.free.pop()
        self.counts[row].zero_()
        self.in_prompt[row].zero_()
        self.in_prompt[row, device_ids(prompt_ids, self.device)] = True
        if output_ids:
            self.add([row] * len(output_ids), device_ids(output_ids, self.device))
        return row

    def release(self, seq_id: int) -> None:
        row = self.rows.pop(seq_id, None)
        if row is not None:
            self.free.append(row)

    def _grow(self) -> None:
        n = self.counts.shape[0]
        more = max(n - 1, 4)
        self.counts = torch.cat([self.counts, self.counts.new_zeros(more, self.vocab_size)])
        self.in_prompt = torch.cat([self.in_prompt,
                                    self.in_prompt.new_zeros(more, self.vocab_size)])
        self.free += range(n + more - 1, n - 1, -1)

    def add(self, rows: list[int] | torch.Tensor, tokens: torch.Tensor,
            weight: torch.Tensor | None = None) -> None:
        """Count sampled tokens ([R] int64, on the device) in their rows (`weight` [R] int32:
        how much each counts, 0 for a row that keeps no counts)."""
        rows = device_ids(rows, self.device) if isinstance(rows, list) else rows
        if weight is None:
            weight = torch.ones(len(tokens), dtype=torch.int32, device=self.device)
        self.counts.view(-1).index_add_(0, rows * self.vocab_size + tokens, weight)
