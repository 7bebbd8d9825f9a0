"""CUDA graphs of the decode step: one graph per batch size bucket, replayed with padding.

A decode step's inputs are copied from pinned host buffers into static device buffers (one
asynchronous copy each), the graph of the smallest bucket >= N is replayed, and the logits of
the first N rows are returned. Padding rows feed token 0 at position 0, write no KV
(slot_mapping -1) and leave their GDN state in a reserved pad slot, so they touch nothing real.
The only host synchronisation of the step is the caller's read of the sampled tokens.
"""

from __future__ import annotations

import torch

from statechat.model.context import Context, ModelCaches

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


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
