"""CUDA graphs of the sampler, captured while serving for the steps that repeat.

A sampled decode step launches 10-25 small kernels after the model's graph (penalties and
temperature, top-k, the draw, the counts), and a step whose requests ask for logprobs about 12
more; each costs the host about 20 us on the lent H100's host, 0.4-1.1 ms a step in all. Here
a step whose Plan key (the rows' kinds and options that shape the work), logits buffer and
counts table match the step before's is captured once and replayed from then on: one launch,
with the rows' values (temperature, top-p, counts rows...) copied into static buffers when
they change. The logprob table is captured the same way, keyed by its rows, k, and the
addresses of the logits and tokens it reads.

Served: logits in a graph's static buffer (the decode and prefill graphs'), at most MAX_ROWS
rows that need sampling work, none seeded (a seeded row draws from its own generator, which a
replay would not advance). Everything else runs eagerly, as does the first step of a key,
which also warms up (and caches the index tensors of) what the capture records. The graphs
share one memory pool: replays run one at a time on one stream, and a graph's tokens are
consumed (fed to the next step, copied to the host) by work queued before the next replay.
CUDA only: torch_npu's graphs have not run here, so an NPU samples eagerly.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from statechat.devices import capture_stream, no_collection
from statechat.engine.logprobs import logprob_table
from statechat.engine.sampler import Plan, Rows
from statechat.engine.token_counts import TokenCounts, device_index

log = logging.getLogger("statechat.engine")

MAX_ROWS = 32  # larger steps are GPU-bound: their launches hide behind the model's graph
MAX_GRAPHS = 8  # kept, least recently used dropped first


class SamplerGraphs:
    """The sampler's graphs of one device: `run` and `logprobs` return a replay's output, or
    None when the caller is to do the work eagerly (and so warm up a later capture)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.floats = torch.zeros(MAX_ROWS, 6, dtype=torch.float32, device=device)
        self.ints = torch.zeros(MAX_ROWS, 4, dtype=torch.int64, device=device)
        self.staged: tuple | None = None  # the values in the static buffers
        # key -> (graph, its output, what it reads that only it holds)
        self.graphs: OrderedDict[tuple, tuple[Any, torch.Tensor, Any]] = OrderedDict()
        self.last: dict[str, tuple] = {}  # kind of work -> the key of its last eager run
        self.pool = None
        self.stream = capture_stream(device, self)  # (its evictions destroy graphs captured on it)
        self.captures = self.replays = 0
        self.is_enabled = True

    def run(self, plan: Plan, logits: torch.Tensor, greedy: torch.Tensor | None,
            table: TokenCounts | None) -> torch.Tensor | None:
        """The step's tokens from a replay, or None: the caller samples eagerly."""
        if not self.is_enabled or plan.seeded or len(plan.todo) > MAX_ROWS:
            return None
        key = ("sample", plan.key, _where(logits), _where(greedy),
               None if table is None else (_where(table.counts), _where(table.in_prompt)))

        def pick() -> torch.Tensor:
            n = len(plan.todo)
            rows = Rows(list(plan.params), self.floats[:n], self.ints[:n])
            return plan.pick(logits, rows, [None] * plan.num_rows, greedy, table)

        return self._replay(key, pick, lambda: self._stage(plan))

    def logprobs(self, logits: torch.Tensor, tokens: torch.Tensor, rows: list[int],
                 k: int) -> torch.Tensor | None:
        """The step's logprob_table from a replay, or None: the caller makes it eagerly."""
        if not self.is_enabled or len(rows) > MAX_ROWS:
            return None
        key = ("logprobs", tuple(rows), k, _where(logits), _where(tokens))
        index = (None if rows == list(range(logits.shape[0]))
                 else device_index(tuple(rows), self.device))
        # (the graph keeps the index it reads: the cache that made it may let it go)
        return self._replay(key, lambda: logprob_table(logits, tokens, rows, k, index), keep=index)

    def _replay(self, key: tuple, work: Callable[[], torch.Tensor],
                stage: Callable[[], None] | None = None, keep: Any = None) -> torch.Tensor | None:
        """Replay key's graph (after `stage`), capturing `work` if the step before of this
        kind had the same key; None when the caller is to run the work eagerly. `keep`: what
        the graph reads that nothing else may hold, kept as long as the graph."""
        entry = self.graphs.get(key)
        if entry is None:
            if key != self.last.get(key[0]):  # first seen: eagerly (the capture's warm-up)
                self.last[key[0]] = key
                return None
            entry = self._capture(key, work, keep)
            if entry is None:
                return None
        self.graphs.move_to_end(key)
        if stage is not None:
            stage()
        entry[0].replay()
        self.replays += 1
        return entry[1]

    def _stage(self, plan: Plan) -> None:
        """Copy the rows' values into the static buffers, unless they are there already."""
        floats, ints = plan.values()
        staged = (floats, ints)
        if staged == self.staged:
            return
        n = len(ints)
        fresh = Rows.of(floats, ints, plan.params, self.device)
        self.floats[:n].copy_(fresh.floats)
        self.ints[:n].copy_(fresh.ints)
        self.staged = staged

    def _capture(self, key: tuple, work: Callable[[], torch.Tensor],
                 keep: Any) -> tuple[Any, torch.Tensor, Any] | None:
        """Record `work` on a side stream (nothing runs): no device-wide synchronisation, and
        a cache writer's copies on other threads stay allowed."""
        graph = torch.cuda.CUDAGraph()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.cuda.stream(self.stream), no_collection():
                graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
                try:
                    out = work()
                finally:
                    graph.capture_end()
        except (RuntimeError, torch.OutOfMemoryError):
            self.is_enabled = False
            log.warning("statechat: the sampler's graph capture failed; sampling runs eagerly",
                        exc_info=True)
            return None
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        self.pool = graph.pool()
        self.captures += 1
        self.graphs[key] = (graph, out, keep)
        if len(self.graphs) > MAX_GRAPHS:
            self.graphs.popitem(last=False)
        return self.graphs[key]


def _where(t: torch.Tensor | None) -> tuple | None:
    """A tensor's address and shape: a graph reads the buffer it was captured with."""
    return None if t is None else (t.data_ptr(), tuple(t.shape))
