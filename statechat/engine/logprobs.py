"""Log-probabilities as the API returns them: a step's table of the sampled tokens' and the
likeliest tokens' log-probabilities made on the device in one kernel (one copy to the host),
and its rows unpacked into (logprob, [(id, logprob)]) on the host."""

from __future__ import annotations

import numpy as np
import torch

import kernels
from statechat.engine.token_counts import device_ids


def logprob_table(logits: torch.Tensor, tokens: torch.Tensor, rows: list[int], k: int,
                  index: torch.Tensor | None = None) -> torch.Tensor:
    """For the given rows of logits [M, vocab]: [R, 1 + 2k] float32 of each row's sampled
    token's log-probability, then the k largest log-probabilities, then their token ids (exact
    in float32: ids stay below 2**24), so that one copy brings them all to the host: the
    first columns of kernels.score_logits' table (-inf, of a token the model rules out, is
    not JSON: vLLM's -9999 stands for it). `index`: `rows` on the device, if made already
    (none is needed when they are every row)."""
    if rows != list(range(logits.shape[0])):
        index = device_ids(rows, logits.device) if index is None else index
        logits, tokens = logits.index_select(0, index), tokens.index_select(0, index)
    return kernels.score_logits(logits, tokens, k)[:, : 1 + 2 * k]


def unpack_logprobs(row: list[float], k: int) -> tuple[float, list[tuple[int, float]]]:
    """One row of logprob_table, as (the sampled token's log-probability, [(id, logprob)] of
    the k likeliest, likeliest first)."""
    width = (len(row) - 1) // 2  # the table's k, of the request that asked for the most
    values, ids = row[1 : 1 + width], row[1 + width :]
    return row[0], [(int(i), v) for v, i in zip(values[:k], ids[:k])]


def unpack_scores(table: np.ndarray, k: int) -> list[tuple[float, list[tuple[int, float]], int]]:
    """The rows of kernels.score_logits' table (logprob_table's columns, then the rank), each as
    unpack_logprobs' pair and the token's rank; the top lists cut to k. Column by column: a
    prompt has thousands of rows."""
    width = (table.shape[1] - 2) // 2
    values = table[:, 1 : 1 + k].tolist()
    ids = table[:, 1 + width : 1 + width + k].astype(np.int64).tolist()
    return [(chosen, list(zip(i, v)), rank) for chosen, v, i, rank in
            zip(table[:, 0].tolist(), values, ids, table[:, -1].astype(np.int64).tolist())]
