"""Graphs of the decode step, replayed with padding (prefill chunks': prefill_graphs.py).

CUDA graphs on NVIDIA GPUs; on Ascend NPUs the same code captures torch_npu's NPUGraph, whose
calls mirror torch.cuda's (`statechat.devices.graph_api`; not run on an NPU yet).

Decode: one graph per batch size bucket. A step's inputs are written into a pinned host buffer
through numpy views and copied into the graphs' static device buffer in one asynchronous copy
(two host buffers in turn); the graph of the smallest bucket >= N is replayed, and the logits
of the first N rows are returned with their argmax (captured in the graph, so a greedy step
launches nothing after the replay). Padding rows feed token 0 at position 0, write no KV
(slot_mapping -1) and leave their GDN state in a reserved pad slot, so they touch nothing
real. Each graph ends by turning its inputs into those of the step after it for the same
sequences (its argmax fed at the next position and slot, one more key): the engine's async
scheduling queues that step before reading this one's tokens, and it then replays with nothing
staged. (So a graph replayed directly, as a benchmark does, moves its rows on each time: mark
them as padding first, slot_mapping -1.)

Both are captured on their runner's stream (`devices.capture_stream`), with Python's garbage
collection paused during each capture (`devices.no_collection`; docs/bench.md, session 17).

The only host synchronisation of a step is the caller's read of the sampled tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

import kernels
from statechat.devices import accelerator, graph_api, no_collection
from statechat.model.context import Context, ModelCaches

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
ALIGN32 = 4  # int32 entries in 16 bytes: where the graphs' int32 input fields start


def aligned32(n: int) -> int:
    """n rounded up to a whole number of 16-byte int32 runs."""
    return -(-n // ALIGN32) * ALIGN32


def capturing(capture: Callable, stream: Any) -> Callable:
    """The capture context manager of graph_api on `stream`, collection paused while it runs."""

    @contextlib.contextmanager
    def run(graph: Any, pool: Any = None) -> Iterator[None]:
        with no_collection(), capture(graph, pool=pool, stream=stream):
            yield

    return run


class DecodeGraphs:
    def __init__(self, model, caches: ModelCaches, max_batch: int, max_blocks: int, pad_slot: int,
                 device: torch.device, stream: Any = None,
                 rope_table: torch.Tensor | None = None) -> None:
        self.sizes = [b for b in BUCKETS if b < max_batch] + [max_batch]
        self.max_blocks, self.pad_slot = max_blocks, pad_slot
        self.rope_table = rope_table  # (Context.rope_table: its rows are read by the graphs)
        acc, (new_graph, capture) = accelerator(device), graph_api(device)
        capture = capturing(capture, stream)
        B, dev, i32 = max_batch, device, torch.int32
        # static device inputs in one buffer, so that a step stages them in one copy: rows
        # (ids, positions, slot_mapping) as int64, rows (src, dst, ctx_len) and the block tables
        # [B, width] as int32, in that order (a batch of b copies the prefix up to its tables)
        self.dev = torch.zeros(self._bytes(B), dtype=torch.uint8, device=dev)
        self.dev64, self.dev32, self.tables = self._views(self.dev, B)
        self.ids, self.positions, self.slot_mapping = self.dev64
        self.src, self.dst, self.ctx_lens = self.dev32
        self.cu = torch.arange(B + 1, dtype=i32, device=dev)
        # pinned host staging of the same layout, written through numpy views (no tensor
        # construction per step); two, used in turn, so that a step can be staged while the one
        # before has not started (see run)
        self.hosts = []
        for _ in range(2):
            host = torch.zeros(self._bytes(B), dtype=torch.uint8, pin_memory=True)
            views = tuple(v.numpy() for v in self._views(host, B))
            _pad_rows(views, self.pad_slot, 0, B)
            self.hosts.append((host, views, acc.Event()))
        self.turn = 0
        self.dev.copy_(self.hosts[0][0])
        self.graphs: dict[int, Any] = {}  # bucket -> its CUDAGraph or NPUGraph
        self.logits: dict[int, torch.Tensor] = {}
        self.greedy: dict[int, torch.Tensor] = {}  # argmax of the logits, replayed with them
        self.replays = 0  # replays so far; a step queued after this many feeds on the last
        self.last_rows: tuple[int, int] | None = None  # (bucket, rows) of the last replay
        pool = None
        for b in reversed(self.sizes):
            ctx = self._context(b)
            model(self.ids[:b], ctx, caches, with_argmax=True)  # compile every kernel first
            self._advance(b, self.ids[:b])  # (padding rows only: changes nothing)
            acc.synchronize(device)
            graph = new_graph()
            with capture(graph, pool=pool):
                self.logits[b], self.greedy[b] = model(self.ids[:b], ctx, caches, with_argmax=True)
                self._advance(b, self.greedy[b])
            pool = graph.pool()
            self.graphs[b] = graph
            graph.replay()  # padding rows only; the first replay uploads the graph, not a step's
        acc.synchronize(device)

    def _bytes(self, b: int) -> int:
        """Bytes of the input buffer up to the block tables of b rows."""
        return 3 * aligned32(self.sizes[-1]) * (8 + 4) + b * self.max_blocks * 4

    def _views(self, buf: torch.Tensor, B: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The int64 rows [3, B], the int32 rows [3, B] and the tables [B, width] of a buffer.
        Rows are aligned32(B) apart, so that each starts on 16 bytes (see
        prefill_graphs.PrefillGraphs)."""
        W = aligned32(B)
        n64, n32 = 3 * W * 8, 3 * W * 4
        rows64 = buf[:n64].view(torch.int64).view(3, W)[:, :B]
        rows32 = buf[n64 : n64 + n32].view(torch.int32).view(3, W)[:, :B]
        return rows64, rows32, buf[n64 + n32 :].view(torch.int32).view(B, self.max_blocks)

    def _context(self, b: int) -> Context:
        return Context(
            positions=self.positions[:b], cu_seqlens=self.cu[: b + 1], is_decode=True,
            state_src=self.src[:b], state_dst=self.dst[:b], slot_mapping=self.slot_mapping[:b],
            block_tables=self.tables[:b], context_lens=self.ctx_lens[:b], checkpoints=None,
            logits_indices=None,  # every row: no gather
            rope_table=self.rope_table,
        )

    def _advance(self, b: int, tokens: torch.Tensor) -> None:
        """The inputs of the step after this one for the same rows, left in the input buffer
        at the end of each replay: a step queued before this one's tokens are read then needs
        no staging (see run). Rows that write no KV (padding) stay as they are."""
        kernels.advance_decode_inputs(tokens, self.ids[:b], self.positions[:b],
                                      self.slot_mapping[:b], self.ctx_lens[:b])

    def can_run(self, n: int, width: int) -> bool:
        return n <= self.sizes[-1] and width <= self.max_blocks

    def run(self, ids: list[int], positions: list[int], slot_mapping: list[int], src: list[int],
            dst: list[int], ctx_lens: list[int], tables: list[list[int]],
            feed: torch.Tensor | None = None,
            follows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the decode graph for N sequences: logits [N, vocab] (float32) and their argmax.

        feed: the N input tokens on the device (the step before's, not read yet), in place of
        `ids`. follows: for such a step, the replay count right after the step before's
        replay. When no replay came between and the rows are the same, the step before's own
        end already advanced the inputs to this step's (every sequence one token on, within its
        block: the caller guarantees it), so nothing is staged, and the argmax it fed itself
        needs no copy either. Otherwise the two host buffers are used in turn: the one used two
        steps ago was copied before the step between was queued, so its wait is already over."""
        n = len(ids)
        b = next(s for s in self.sizes if s >= n)
        if feed is None or follows != self.replays or self.last_rows != (b, n):
            self._stage(b, ids, positions, slot_mapping, src, dst, ctx_lens, tables)
            if feed is not None:
                self.ids[:n].copy_(feed)
        elif feed.data_ptr() != self.greedy[b].data_ptr():  # sampled tokens, not the argmax
            self.ids[:n].copy_(feed)
        self.graphs[b].replay()
        self.replays += 1
        self.last_rows = (b, n)
        return self.logits[b][:n], self.greedy[b][:n]

    def _stage(self, b: int, ids, positions, slot_mapping, src, dst, ctx_lens, tables) -> None:
        """Write the rows and the first b tables into a host buffer, copy them over."""
        n = len(ids)
        host, (np64, np32, np_tables), copied = self.hosts[self.turn]
        self.turn ^= 1
        copied.synchronize()
        np64[0, :n], np64[1, :n], np64[2, :n] = ids, positions, slot_mapping
        np32[0, :n], np32[1, :n], np32[2, :n] = src, dst, ctx_lens
        _pad_rows((np64, np32, np_tables), self.pad_slot, n, b)
        for i, table in enumerate(tables):  # entries past a table's length are never read
            np_tables[i, : len(table)] = table
        # the rows and the first b tables: one contiguous, asynchronous copy
        nbytes = self._bytes(b)
        self.dev[:nbytes].copy_(host[:nbytes], non_blocking=True)
        copied.record()


def _pad_rows(views: tuple[np.ndarray, np.ndarray, np.ndarray], pad_slot: int, lo: int,
              hi: int) -> None:
    """Host rows lo..hi of a decode staging buffer as padding: token 0 at position 0, no KV
    write, state into the pad slot, one token of context over block 0."""
    rows64, rows32, tables = views
    rows64[:, lo:hi] = ((0,), (0,), (-1,))
    rows32[:, lo:hi] = ((0,), (pad_slot,), (1,))
    tables[lo:hi, 0] = 0
