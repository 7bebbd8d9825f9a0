"""Graphs of one-sequence prefill chunks, one per token bucket, replayed with padding.

Captured and replayed as the decode step's are (graphs.py: the capture stream, the
garbage collection paused, NPUGraph on Ascend).

Prefill: a chunk of one sequence replays the graph of a token bucket. Buckets run up to the
step's token budget (every 512 tokens past 2048, and one that fits a whole budget-sized chunk),
as launching ~35 kernels per layer from Python costs more than running them on a small model
even for thousands of tokens (an H100 ran the 0.75B model's 8k prompt in 4096-token chunks
host-bound: 48-63 ms eagerly against 30 ms of GPU time). The bucket's tokens past the chunk
form a second, padding sequence of at least one 64-token block: it starts from the zero slot,
ends in the pad slot, writes no KV, and absorbs the unused checkpoint targets of the graph's
fixed-size list (its first block, saved to the pad slot). So every kernel sees the shapes it
was captured with, and nothing real is touched. Each graph is replayed once when captured (on
its capture inputs, padding alone), so that no request pays its first replay's upload.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from kernels import CHUNK, Checkpoints
from statechat.devices import accelerator, graph_api
from statechat.engine.graphs import ALIGN32, aligned32, capturing
from statechat.model.context import Context, ModelCaches

log = logging.getLogger("statechat.engine")

# bucket b: chunks of <= b - 64 tokens
PREFILL_BUCKETS = (128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
LARGE_BUCKET_STEP = 512  # bucket spacing past PREFILL_BUCKETS


def prefill_buckets(max_tokens: int) -> list[int]:
    """The prefill buckets that serve chunks of up to max_tokens (the step's token budget):
    PREFILL_BUCKETS, then every LARGE_BUCKET_STEP tokens, and last the one that holds a chunk
    of the whole budget (the common chunk of a long prompt) with one block of padding."""
    top = -(-max_tokens // CHUNK) * CHUNK + CHUNK
    sizes = [b for b in PREFILL_BUCKETS if b < top]
    sizes += range(PREFILL_BUCKETS[-1] + LARGE_BUCKET_STEP, top - LARGE_BUCKET_STEP // 2,
                   LARGE_BUCKET_STEP)
    return sizes + [top]


class PrefillGraphs:
    """Graphs of a one-sequence prefill chunk, one per token bucket (see the module docstring)."""

    def __init__(self, model, caches: ModelCaches, max_tokens: int, max_blocks: int, pad_slot: int,
                 device: torch.device, stream: Any = None,
                 rope_table: torch.Tensor | None = None) -> None:
        sizes = prefill_buckets(max_tokens)
        self.rope_table = rope_table  # (Context.rope_table: its rows are read by the graphs)
        acc, (new_graph, capture) = accelerator(device), graph_api(device)
        capture = capturing(capture, stream)
        self.B, self.C, self.max_blocks, self.pad_slot = (sizes[-1], sizes[-1] // CHUNK,
                                                          max_blocks, pad_slot)
        # int64 inputs: ids, positions, slot_mapping [B each], logits row [1]; int32 inputs:
        # cu_seqlens [3], src, dst, context_lens [2 each], checkpoint seq, boundary and slot
        # [C each] (C: one per block of the largest bucket), then the chunk's block table
        # (staged only). Each int32 field starts on 16 bytes (ALIGN32 entries), as a tensor
        # of its own does: the kernels see the alignment an eager step gives them, so Triton
        # builds them once for both. One pinned buffer and one asynchronous copy per dtype; two
        # sets used in turn, so staging a chunk does not wait for the one before to run.
        self.ckpt_width = aligned32(self.C)
        self.n32 = 4 * ALIGN32 + 3 * self.ckpt_width
        self.hosts = []
        for _ in range(2):
            host32 = torch.zeros(self.n32 + max_blocks, dtype=torch.int32, pin_memory=True)
            self.hosts.append((torch.zeros(3 * self.B + 1, dtype=torch.int64, pin_memory=True),
                               host32, self._fields32(host32.numpy()), acc.Event()))
        self.turn = 0
        self.dev64 = torch.zeros(3 * self.B + 1, dtype=torch.int64, device=device)
        self.dev32 = torch.zeros(self.n32, dtype=torch.int32, device=device)
        # block tables: row 0 the chunk's (at most max_blocks wide, see bucket()); row 1, the
        # padding's, stays zeros. As wide as a whole bucket, which either sequence may span.
        self.tables = torch.zeros(2, max(max_blocks, self.B // CHUNK), dtype=torch.int32,
                                  device=device)
        self.first_seq = torch.zeros(1, dtype=torch.int64, device=device)  # (the logits row's)
        self.graphs: dict[int, Any] = {}  # bucket -> its CUDAGraph or NPUGraph
        self.logits: dict[int, torch.Tensor] = {}
        self.greedy: dict[int, torch.Tensor] = {}
        self.replays = 0
        # graphs whose capture ran out of memory: kept, as destroying a graph makes torch (2.11)
        # drop the cuBLAS workspace of its capture stream, which the graphs captured on that
        # stream before it still write to when replayed
        self.failed: list[Any] = []
        pool = None
        for b in reversed(sizes):
            self._stage(b, [0] * (b - CHUNK), 0, [-1] * (b - CHUNK), 0, pad_slot, [], [])
            ctx, ids = self._context(b), self.dev64[:b]
            graph = None
            try:
                model(ids, ctx, caches, with_argmax=True)  # compile every kernel before capture
                acc.synchronize(device)
                acc.empty_cache()  # leave the capture's private pool room to grow
                graph = new_graph()
                with capture(graph, pool=pool):
                    self.logits[b], self.greedy[b] = model(ids, ctx, caches, with_argmax=True)
            except torch.OutOfMemoryError:
                log.warning("statechat: no memory for a %d-token prefill graph; "
                            "such chunks run eagerly", b)
                if graph is not None:  # (its pool, which holds what it took, serves the next)
                    self.failed.append(graph)
                    pool = pool or graph.pool()
                acc.empty_cache()
                continue
            pool = graph.pool()
            self.graphs[b] = graph
            # the padding-only capture inputs: the upload is paid here, not by a request
            graph.replay()
        acc.synchronize(device)
        self.sizes = sorted(self.graphs)

    def _context(self, b: int) -> Context:
        B, c, v64 = self.B, b // CHUNK, self.dev64
        cu, src, dst, ctx, seq, boundary, slot = self._fields32(self.dev32)
        return Context(
            positions=v64[B : B + b], cu_seqlens=cu, is_decode=False, state_src=src,
            state_dst=dst, slot_mapping=v64[2 * B : 2 * B + b], block_tables=self.tables,
            context_lens=ctx, checkpoints=Checkpoints(seq[:c], boundary[:c], slot[:c]),
            logits_indices=v64[3 * B :], logits_seqs=self.first_seq, pad_seqs=1,
            rope_table=self.rope_table,
        )

    def _fields32(self, buf: torch.Tensor | np.ndarray) -> tuple:
        """The int32 fields of a staging buffer (tensor or array): cu_seqlens, src, dst,
        context_lens, and the checkpoints' seq, boundary and slot columns."""
        a, cp = ALIGN32, self.ckpt_width
        heads = [buf[i * a : i * a + n] for i, n in enumerate((3, 2, 2, 2))]
        return (*heads, *(buf[4 * a + i * cp : 4 * a + (i + 1) * cp] for i in range(3)))

    def _stage(self, b: int, ids, start: int, slot_mapping, src: int, dst: int,
               table: list[int], checkpoints: list[tuple[int, int]]) -> None:
        """Stage one chunk (its tokens from position `start`) and its padding, and copy it over.
        ids and slot_mapping: lists or int64 arrays of the chunk's length."""
        B, c, n = self.B, b // CHUNK, len(ids)
        pad = b - n
        spare = [(1, CHUNK, self.pad_slot)] * (c - len(checkpoints))  # the padding's first block
        targets = [(0, boundary, slot) for boundary, slot in checkpoints] + spare
        host64, host32, fields, copied = self.hosts[self.turn]
        self.turn ^= 1
        # this set's copies of two chunks ago must be done (the chunk before, on the other set,
        # may still be queued: a chunk that samples nothing leaves the host unsynchronised)
        copied.synchronize()
        h64, h32 = host64.numpy(), host32.numpy()
        h64[:n], h64[n:b] = ids, 0
        h64[B : B + n], h64[B + n : B + b] = np.arange(start, start + n), np.arange(pad)
        h64[2 * B : 2 * B + n], h64[2 * B + n : 2 * B + b] = slot_mapping, -1
        h64[3 * B] = n - 1
        cu, srcs, dsts, ctx = fields[:4]
        cu[:], srcs[:], dsts[:] = (0, n, b), (src, 0), (dst, self.pad_slot)
        ctx[:] = (start + n, pad)
        for field, column in zip(fields[4:], zip(*targets)):
            field[:c] = column
        self.dev64.copy_(host64, non_blocking=True)
        self.dev32.copy_(host32[: self.n32], non_blocking=True)
        if table:
            h32[self.n32 : self.n32 + len(table)] = table
            staged = host32[self.n32 : self.n32 + len(table)]
            self.tables[0, : len(table)].copy_(staged, non_blocking=True)
        copied.record()

    def bucket(self, n: int, width: int) -> int | None:
        """The bucket whose graph serves an n-token chunk with a block table of `width`, if any."""
        if width > self.max_blocks:
            return None
        return next((b for b in self.sizes if n <= b - CHUNK), None)

    def run(self, b: int, ids, start: int, slot_mapping, src: int, dst: int, table: list[int],
            checkpoints: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay bucket b's graph for one chunk: the logits [1, vocab] of its last token and
        their argmax."""
        self._stage(b, ids, start, slot_mapping, src, dst, table, checkpoints)
        self.graphs[b].replay()
        self.replays += 1
        return self.logits[b], self.greedy[b]
