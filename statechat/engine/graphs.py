"""CUDA graphs of the decode step and of short one-sequence prefills, replayed with padding.

Decode: one graph per batch size bucket. A step's inputs are copied from pinned host buffers
into static device buffers (one asynchronous copy each), the graph of the smallest bucket >= N
is replayed, and the logits of the first N rows are returned. Padding rows feed token 0 at
position 0, write no KV (slot_mapping -1) and leave their GDN state in a reserved pad slot, so
they touch nothing real.

Prefill: a chunk of one sequence (an edited, regenerated or new short turn: the case where
launching ~35 kernels per layer from Python costs more than running them) replays the graph of
a token bucket. The bucket's tokens past the chunk form a second, padding sequence of at least
one 64-token block: it starts from the zero slot, ends in the pad slot, writes no KV, and
absorbs the unused checkpoint targets of the graph's fixed-size list (its first block, saved to
the pad slot). So every kernel sees the shapes it was captured with, and nothing real is touched.

The only host synchronisation of a step is the caller's read of the sampled tokens.
"""

from __future__ import annotations

import logging

import torch

from kernels import CHUNK, Checkpoints
from statechat.model.context import Context, ModelCaches

log = logging.getLogger("statechat.engine")

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
PREFILL_BUCKETS = (128, 192, 256, 384, 512, 768, 1024, 1536, 2048)  # bucket b: chunks of <= b - 64 tokens


class DecodeGraphs:
    def __init__(self, model, caches: ModelCaches, max_batch: int, max_blocks: int, pad_slot: int,
                 device: torch.device) -> None:
        self.sizes = [b for b in BUCKETS if b < max_batch] + [max_batch]
        self.max_blocks, self.pad_slot = max_blocks, pad_slot
        B, dev, i32, i64 = max_batch, device, torch.int32, torch.int64
        # static device inputs: [B] vectors and [B, max_blocks] block tables
        self.ids = torch.zeros(B, dtype=i64, device=dev)
        self.positions = torch.zeros(B, dtype=i64, device=dev)
        self.src = torch.zeros(B, dtype=i32, device=dev)
        self.dst = torch.full((B,), pad_slot, dtype=i32, device=dev)
        self.slot_mapping = torch.full((B,), -1, dtype=i64, device=dev)
        self.ctx_lens = torch.ones(B, dtype=i32, device=dev)
        self.tables = torch.zeros(B, max_blocks, dtype=i32, device=dev)
        self.cu = torch.arange(B + 1, dtype=i32, device=dev)
        self.rows = torch.arange(B, dtype=i64, device=dev)
        # pinned host staging: rows of (ids, positions, slot_mapping) and (src, dst, ctx_len)
        self.host64 = torch.zeros(3, B, dtype=i64, pin_memory=True)
        self.host32 = torch.zeros(3, B, dtype=i32, pin_memory=True)
        self.host_tables = torch.zeros(B * max_blocks, dtype=i32, pin_memory=True)  # [n, width] packed
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        pool = None
        for b in reversed(self.sizes):
            ctx = self._context(b)
            model(self.ids[:b], ctx, caches)  # compile every kernel before capture
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[b] = model(self.ids[:b], ctx, caches)
            pool = graph.pool()
            self.graphs[b] = graph

    def _context(self, b: int) -> Context:
        return Context(
            positions=self.positions[:b], cu_seqlens=self.cu[: b + 1], is_decode=True,
            state_src=self.src[:b], state_dst=self.dst[:b], slot_mapping=self.slot_mapping[:b],
            block_tables=self.tables[:b], context_lens=self.ctx_lens[:b], checkpoints=None,
            logits_indices=self.rows[:b],
        )

    def can_run(self, n: int, width: int) -> bool:
        return n <= self.sizes[-1] and width <= self.max_blocks

    def run(self, ids: list[int], positions: list[int], slot_mapping: list[int], src: list[int],
            dst: list[int], ctx_lens: list[int], tables: list[list[int]]) -> torch.Tensor:
        """Replay the decode graph for N sequences; logits [N, vocab] (float32)."""
        n = len(ids)
        b = next(s for s in self.sizes if s >= n)
        pad = b - n
        self.host64[:, :b] = torch.tensor([ids + [0] * pad, positions + [0] * pad, slot_mapping + [-1] * pad])
        self.host32[:, :b] = torch.tensor([src + [0] * pad, dst + [self.pad_slot] * pad, ctx_lens + [1] * pad])
        width = max(len(t) for t in tables)
        packed = self.host_tables[: n * width].view(n, width)
        packed.copy_(torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32))
        for dev_buf, row in ((self.ids, 0), (self.positions, 1), (self.slot_mapping, 2)):
            dev_buf[:b].copy_(self.host64[row, :b], non_blocking=True)
        for dev_buf, row in ((self.src, 0), (self.dst, 1), (self.ctx_lens, 2)):
            dev_buf[:b].copy_(self.host32[row, :b], non_blocking=True)
        self.tables[:n, :width].copy_(packed, non_blocking=True)
        if pad:
            self.tables[n:b, 0].zero_()
        self.graphs[b].replay()
        return self.logits[b][:n]


class PrefillGraphs:
    """Graphs of a one-sequence prefill chunk, one per token bucket (see the module docstring)."""

    def __init__(self, model, caches: ModelCaches, max_tokens: int, max_blocks: int, pad_slot: int,
                 device: torch.device) -> None:
        sizes = [b for b in PREFILL_BUCKETS if b - CHUNK <= max_tokens]
        self.B, self.C, self.max_blocks, self.pad_slot = sizes[-1], sizes[-1] // CHUNK, max_blocks, pad_slot
        # int64 inputs: ids, positions, slot_mapping [B each], logits row [1]; int32 inputs:
        # cu_seqlens [3], src, dst, context_lens [2 each], checkpoint seq, boundary and slot
        # [C each] (C: one per block of the largest bucket), then the chunk's block table
        # (staged only). One pinned buffer and one asynchronous copy per dtype.
        self.n32 = 9 + 3 * self.C
        self.host64 = torch.zeros(3 * self.B + 1, dtype=torch.int64, pin_memory=True)
        self.host32 = torch.zeros(self.n32 + max_blocks, dtype=torch.int32, pin_memory=True)
        self.dev64 = torch.zeros(3 * self.B + 1, dtype=torch.int64, device=device)
        self.dev32 = torch.zeros(self.n32, dtype=torch.int32, device=device)
        # block tables: row 0 the chunk's (at most max_blocks wide, see bucket()); row 1, the
        # padding's, stays zeros. As wide as a whole bucket, which either sequence may span.
        self.tables = torch.zeros(2, max(max_blocks, self.B // CHUNK), dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.replays = 0
        self.staged = torch.cuda.Event()  # the last copies out of host staging are done
        pool = None
        for b in reversed(sizes):
            self._stage(b, [0] * (b - CHUNK), 0, [-1] * (b - CHUNK), 0, pad_slot, [], [])
            ctx, ids = self._context(b), self.dev64[:b]
            try:
                model(ids, ctx, caches)  # compile every kernel at these shapes before capture
                torch.cuda.synchronize(device)
                torch.cuda.empty_cache()  # leave the capture's private pool room to grow
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.logits[b] = model(ids, ctx, caches)
            except torch.OutOfMemoryError:
                log.warning("statechat: no memory for a %d-token prefill graph; such chunks run eagerly", b)
                torch.cuda.empty_cache()
                continue
            pool = graph.pool()
            self.graphs[b] = graph
        self.sizes = sorted(self.graphs)

    def _context(self, b: int) -> Context:
        B, C, c, v32, v64 = self.B, self.C, b // CHUNK, self.dev32, self.dev64
        return Context(
            positions=v64[B : B + b], cu_seqlens=v32[0:3], is_decode=False, state_src=v32[3:5],
            state_dst=v32[5:7], slot_mapping=v64[2 * B : 2 * B + b], block_tables=self.tables,
            context_lens=v32[7:9],
            checkpoints=Checkpoints(v32[9 : 9 + c], v32[9 + C : 9 + C + c], v32[9 + 2 * C : 9 + 2 * C + c]),
            logits_indices=v64[3 * B :],
        )

    def _stage(self, b: int, ids: list[int], start: int, slot_mapping: list[int], src: int, dst: int,
               table: list[int], checkpoints: list[tuple[int, int]]) -> None:
        """Stage one chunk (its tokens from position `start`) and its padding, and copy it over."""
        B, C, c, n = self.B, self.C, b // CHUNK, len(ids)
        pad = b - n
        spare = [(1, CHUNK, self.pad_slot)] * (c - len(checkpoints))  # the padding's first block
        targets = [(0, boundary, slot) for boundary, slot in checkpoints] + spare
        h64, h32 = self.host64, self.host32
        self.staged.synchronize()  # a chunk that samples nothing leaves the host unsynchronised
        h64[:b] = torch.tensor(ids + [0] * pad)
        h64[B : B + b] = torch.tensor(list(range(start, start + n)) + list(range(pad)))
        h64[2 * B : 2 * B + b] = torch.tensor(slot_mapping + [-1] * pad)
        h64[3 * B] = n - 1
        h32[:9] = torch.tensor([0, n, b, src, 0, dst, self.pad_slot, start + n, pad])
        for i, column in enumerate(zip(*targets)):
            h32[9 + i * C : 9 + i * C + c] = torch.tensor(column)
        self.dev64.copy_(self.host64, non_blocking=True)
        self.dev32.copy_(self.host32[: self.n32], non_blocking=True)
        if table:
            h32[self.n32 : self.n32 + len(table)] = torch.tensor(table)
            self.tables[0, : len(table)].copy_(h32[self.n32 : self.n32 + len(table)], non_blocking=True)
        self.staged.record()

    def bucket(self, n: int, width: int) -> int | None:
        """The bucket whose graph serves an n-token chunk with a block table of `width`, if any."""
        if width > self.max_blocks:
            return None
        return next((b for b in self.sizes if n <= b - CHUNK), None)

    def run(self, b: int, ids: list[int], start: int, slot_mapping: list[int], src: int, dst: int,
            table: list[int], checkpoints: list[tuple[int, int]]) -> torch.Tensor:
        """Replay bucket b's graph for one chunk; the logits [1, vocab] of its last token."""
        self._stage(b, ids, start, slot_mapping, src, dst, table, checkpoints)
        self.graphs[b].replay()
        self.replays += 1
        return self.logits[b]
