"""Graphs of the decode step and of one-sequence prefill chunks, replayed with padding.

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

Both are captured on their runner's stream (`devices.capture_stream`), with Python's garbage
collection paused during each capture (`devices.no_collection`; docs/bench.md, session 17).

The only host synchronisation of a step is the caller's read of the sampled tokens.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

import kernels
from kernels import CHUNK, Checkpoints
from statechat.devices import accelerator, graph_api, no_collection
from statechat.model.context import Context, ModelCaches

log = logging.getLogger("statechat.engine")

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
# bucket b: chunks of <= b - 64 tokens
PREFILL_BUCKETS = (128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
LARGE_BUCKET_STEP = 512  # bucket spacing past PREFILL_BUCKETS
_ALIGN32 = 4  # int32 entries in 16 bytes: where the graphs' int32 input fields start


def _aligned(n: int) -> int:
    """n rounded up to a whole number of 16-byte int32 runs."""
    return -(-n // _ALIGN32) * _ALIGN32


def _capturing(capture: Callable, stream: Any) -> Callable:
    """The capture context manager of graph_api on `stream`, collection paused while it runs."""

    @contextlib.contextmanager
    def run(graph: Any, pool: Any = None) -> Iterator[None]:
        with no_collection(), capture(graph, pool=pool, stream=stream):
            yield

    return run


def prefill_buckets(max_tokens: int) -> list[int]:
    """The prefill buckets that serve chunks of up to max_tokens (the step's token budget):
    PREFILL_BUCKETS, then every LARGE_BUCKET_STEP tokens, and last the one that holds a chunk
    of the whole budget (the common chunk of a long prompt) with one block of padding."""
    top = -(-max_tokens // CHUNK) * CHUNK + CHUNK
    sizes = [b for b in PREFILL_BUCKETS if b < top]
    sizes += range(PREFILL_BUCKETS[-1] + LARGE_BUCKET_STEP, top - LARGE_BUCKET_STEP // 2,
                   LARGE_BUCKET_STEP)
    return sizes + [top]


class DecodeGraphs:
    def __init__(self, model, caches: ModelCaches, max_batch: int, max_blocks: int, pad_slot: int,
                 device: torch.device, stream: Any = None) -> None:
        self.sizes = [b for b in BUCKETS if b < max_batch] + [max_batch]
        self.max_blocks, self.pad_slot = max_blocks, pad_slot
        acc, (new_graph, capture) = accelerator(device), graph_api(device)
        capture = _capturing(capture, stream)
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
        return 3 * _aligned(self.sizes[-1]) * (8 + 4) + b * self.max_blocks * 4

    def _views(self, buf: torch.Tensor, B: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The int64 rows [3, B], the int32 rows [3, B] and the tables [B, width] of a buffer.
        Rows are _aligned(B) apart, so that each starts on 16 bytes (see PrefillGraphs)."""
        W = _aligned(B)
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


class PrefillGraphs:
    """Graphs of a one-sequence prefill chunk, one per token bucket (see the module docstring)."""

    def __init__(self, model, caches: ModelCaches, max_tokens: int, max_blocks: int, pad_slot: int,
                 device: torch.device, stream: Any = None) -> None:
        sizes = prefill_buckets(max_tokens)
        acc, (new_graph, capture) = accelerator(device), graph_api(device)
        capture = _capturing(capture, stream)
        self.B, self.C, self.max_blocks, self.pad_slot = (sizes[-1], sizes[-1] // CHUNK,
                                                          max_blocks, pad_slot)
        # int64 inputs: ids, positions, slot_mapping [B each], logits row [1]; int32 inputs:
        # cu_seqlens [3], src, dst, context_lens [2 each], checkpoint seq, boundary and slot
        # [C each] (C: one per block of the largest bucket), then the chunk's block table
        # (staged only). Each int32 field starts on 16 bytes (_ALIGN32 entries), as a tensor
        # of its own does: the kernels see the alignment an eager step gives them, so Triton
        # builds them once for both. One pinned buffer and one asynchronous copy per dtype; two
        # sets used in turn, so staging a chunk does not wait for the one before to run.
        self.ckpt_width = _aligned(self.C)
        self.n32 = 4 * _ALIGN32 + 3 * self.ckpt_width
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
            logits_indices=v64[3 * B :], pad_seqs=1,
        )

    def _fields32(self, buf: torch.Tensor | np.ndarray) -> tuple:
        """The int32 fields of a staging buffer (tensor or array): cu_seqlens, src, dst,
        context_lens, and the checkpoints' seq, boundary and slot columns."""
        a, cp = _ALIGN32, self.ckpt_width
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
