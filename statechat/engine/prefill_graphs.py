"""Graphs of prefill steps, one per token bucket and number of sequence slots, replayed with
padding.

Captured and replayed as the decode step's are (graphs.py: the capture stream, the
garbage collection paused, NPUGraph on Ascend).

A chunk of one sequence replays the graph of a token bucket with one slot. Buckets run up to
the step's token budget (every 512 tokens past 2048, and one that fits a whole budget-sized
chunk), as launching ~35 kernels per layer from Python costs more than running them on a small
model even for thousands of tokens (an H100 ran the 0.75B model's 8k prompt in 4096-token
chunks host-bound: 48-63 ms eagerly against 30 ms of GPU time). Chunks of several prompts in
one step (a burst of requests) replay one packed graph of PACKED_SLOTS sequence slots, in the
buckets of `packed_buckets`: 16 prompts of 100 tokens took 29 ms eagerly on an H100, and 9.5 ms
in a packed graph (docs/bench.md, session 34). The one-slot graphs are captured when the engine
starts; a packed graph when a step first needs it (`PrefillGraphs.ready`, on CUDA only), since
captured at start the 55 of a 4096-token budget added 4-5 s to every start, and a chat in the
terminal app never has a use for them. Only the slot counts that a step of the engine's
sequences can use are considered (graph_keys). A packed graph returns the last layer's rows,
and the logits are made after the replay, so that the graphs keep no [slots, vocab] buffer
each. The padded layout is prefill_staging.py's. Each graph is replayed once when captured (on
its capture inputs, padding alone), so that no request pays its first replay's upload.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch

from kernels import CHUNK
from statechat.devices import accelerator, graph_api, no_collection
from statechat.engine.graphs import capturing
from statechat.engine.prefill_staging import Chunk, PrefillStaging, fits
from statechat.model.context import Context, ModelCaches

log = logging.getLogger("statechat.engine")

# bucket b: chunks of <= b - 64 tokens
PREFILL_BUCKETS = (128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
LARGE_BUCKET_STEP = 512  # bucket spacing past PREFILL_BUCKETS
PACKED_SLOTS = (2, 4, 8, 16, 32)  # the sequence slots of the packed graphs
PACKED_LARGE = (3072, 4096, 6144)  # packed buckets past PREFILL_BUCKETS (and the top one)


def prefill_buckets(max_tokens: int) -> list[int]:
    """The prefill buckets that serve chunks of up to max_tokens (the step's token budget):
    PREFILL_BUCKETS, then every LARGE_BUCKET_STEP tokens, and last the one that holds a chunk
    of the whole budget (the common chunk of a long prompt) with one block of padding."""
    top = -(-max_tokens // CHUNK) * CHUNK + CHUNK
    sizes = [b for b in PREFILL_BUCKETS if b < top]
    sizes += range(PREFILL_BUCKETS[-1] + LARGE_BUCKET_STEP, top - LARGE_BUCKET_STEP // 2,
                   LARGE_BUCKET_STEP)
    return sizes + [top]


def packed_buckets(sizes: list[int]) -> list[int]:
    """The buckets of the packed graphs, for prefill_buckets' `sizes`: every one up to 2048
    tokens, then a few (each up to 1.5x the one before), as the padding of a large bucket costs
    less than the graphs a finer spacing would capture, and last the top one with a block more,
    so that chunks filling the whole budget fit beside their slots' one-token paddings."""
    return ([b for b in sizes[:-1] if b <= PREFILL_BUCKETS[-1] or b in PACKED_LARGE]
            + [sizes[-1] + CHUNK])


def graph_keys(max_tokens: int, max_seqs: int) -> list[tuple[int, int]]:
    """The (bucket, slots) of the prefill graphs for a token budget and steps of at most
    `max_seqs` sequences, largest bucket first: one slot in every bucket, and in each packed
    bucket the PACKED_SLOTS up to the fewest that hold `max_seqs` chunks (none for one)."""
    sizes = prefill_buckets(max_tokens)
    slots = [k for k in PACKED_SLOTS if k // 2 < max_seqs]
    keys = [(b, 1) for b in reversed(sizes)]
    return keys + [(b, k) for b in reversed(packed_buckets(sizes)) for k in slots]


def _forward(model, ids: torch.Tensor, ctx: Context, caches: ModelCaches
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """A prefill graph's forward: with one slot, the logits and their argmax; with more, the
    last layer's rows and the residual stream (the logits are made after the replay)."""
    if ctx.logits_seqs.shape[0] == 1:
        return model(ids, ctx, caches, with_argmax=True)
    with torch.inference_mode():
        return model.model(ids, ctx, caches)


class PrefillGraphs:
    """Graphs of prefill steps (see the module docstring): keyed by (bucket, slots). The one-slot
    graphs are captured here; a packed graph when a step first needs it (`ready`)."""

    def __init__(self, model, caches: ModelCaches, max_tokens: int, max_blocks: int, pad_slot: int,
                 device: torch.device, stream: Any = None,
                 rope_table: torch.Tensor | None = None, max_seqs: int = PACKED_SLOTS[-1]) -> None:
        self.rope_table = rope_table  # (Context.rope_table: its rows are read by the graphs)
        self.model, self.caches, self.device, self.stream = model, caches, device, stream
        self.max_blocks = max_blocks
        keys = graph_keys(max_tokens, max_seqs)  # (max_seqs: the steps' sequences at most)
        self.staging = PrefillStaging(max(b for b, _ in keys), max(k for _, k in keys),
                                      max_blocks, pad_slot, device)
        self.graphs: dict[tuple[int, int], Any] = {}  # (bucket, slots) -> CUDAGraph or NPUGraph
        # one slot: the logits [1, vocab] and their argmax; more: the last layer's rows and the
        # residual stream [slots, hidden] (PrefillGraphs.run_packed)
        self.out: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.replays = 0
        # graphs whose capture ran out of memory: kept, as destroying a graph makes torch (2.11)
        # drop the cuBLAS workspace of its capture stream, which the graphs captured on that
        # stream before it still write to when replayed
        self.failed: list[Any] = []
        self.pool = None
        self._capture_one_slot(key for key in keys if key[1] == 1)
        self.sizes = sorted(b for b, k in self.graphs if k == 1)
        # the packed graphs a step may capture (CUDA only: NPU graphs are captured at start
        # or not at all), the fewest slots first, then the smallest bucket: packed_bucket's
        # order
        self.packed = sorted((key for key in keys if key[1] > 1 and device.type == "cuda"),
                             key=lambda key: key[::-1])
        self._build_top_packed()

    def _capture_one_slot(self, keys: Iterable[tuple[int, int]]) -> None:
        """Capture the one-slot graph of each (bucket, 1) of `keys`, each kernel built by an
        eager forward first; one that runs out of memory is said in a warning and skipped (its
        steps run eagerly). Returns once the device is done."""
        acc, (new_graph, capture) = accelerator(self.device), graph_api(self.device)
        capture = capturing(capture, self.stream)
        for b, k in keys:
            args = self._args(b, k)
            graph = None
            try:
                _forward(*args)  # compile every kernel before capture
                acc.synchronize(self.device)
                acc.empty_cache()  # leave the capture's private pool room to grow
                graph = new_graph()
                with capture(graph, pool=self.pool):
                    self.out[b, k] = _forward(*args)
            except torch.OutOfMemoryError:
                self._no_memory(b, k, graph)
                acc.empty_cache()
                continue
            self._keep(b, k, graph)
        acc.synchronize(self.device)

    def _build_top_packed(self) -> None:
        """Build the kernels of the top packed bucket by eager forwards of it with the fewest
        and the most slots: it holds more tokens than any one-slot graph, which may take another
        form of a kernel (the GDN prepare kernel's warps go by tokens), and no capture while
        serving may build one. Returns once the device is done."""
        top = max((b for b, _ in self.packed), default=0)
        slots = sorted(k for b, k in self.packed if b == top)
        for k in sorted(set(slots[:1] + slots[-1:])):
            _forward(*self._args(top, k))
        accelerator(self.device).synchronize(self.device)

    def _args(self, b: int, k: int) -> tuple:
        """The forward's arguments for a capture of (b, k), its padding-only inputs staged."""
        self.staging.stage(b, k, [])
        return (self.model, self.staging.ids(b), self.staging.context(b, k, self.rope_table),
                self.caches)

    def _keep(self, b: int, k: int, graph: Any) -> None:
        self.pool = graph.pool()
        self.graphs[b, k] = graph
        # the padding-only capture inputs: the upload is paid here, not by a request
        graph.replay()

    def _no_memory(self, b: int, k: int, graph: Any) -> None:
        log.warning("statechat: no memory for a %d-token prefill graph of %d sequences; such "
                    "steps run eagerly", b, k)
        if graph is not None:  # (its pool, which holds what it took, serves the next)
            self.failed.append(graph)
            self.pool = self.pool or graph.pool()

    def ready(self, key: tuple[int, int]) -> bool:
        """Whether the packed graph `key` (packed_bucket's) can replay: captured already, or
        now. Captured while serving as the sampler's graphs are (sampler_graphs.py): recorded
        on a side stream, with no device-wide synchronisation, so that the cache writer's copies
        on other threads stay allowed; the kernels are built already (the one-slot graphs'
        captures build every kernel the packed ones launch). One that fails (out of memory,
        a capture error, a kernel that fails to build: any Exception) is not tried again: such
        steps replay a graph a chunk or run eagerly."""
        if key in self.graphs:
            return True
        graph = torch.cuda.CUDAGraph()
        args = self._args(*key)
        stream = self.stream or torch.cuda.Stream(self.device)
        try:
            _forward(*args)  # (eagerly first, as at start: what a first call sets up, not captured)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream), no_collection():
                graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
                try:
                    self.out[key] = _forward(*args)
                finally:
                    graph.capture_end()
            torch.cuda.current_stream(self.device).wait_stream(stream)
        except BaseException as e:  # (torch.OutOfMemoryError; triton's errors are not
            # RuntimeErrors: a kernel that fails to build must not fail every such step)
            self.failed.append(graph)  # (kept, even on the way out: see `failed`)
            self.packed.remove(key)
            if not isinstance(e, Exception):
                raise
            log.warning("statechat: the capture of a %d-token prefill graph of %d sequences "
                        "failed; such steps replay a graph a chunk or run eagerly", *key,
                        exc_info=True)
            return False
        self._keep(*key, graph)
        return True

    def bucket(self, n: int, width: int) -> int | None:
        """The bucket whose graph serves an n-token chunk with a block table of `width`, if any."""
        if width > self.max_blocks:
            return None
        return next((b for b in self.sizes if n <= b - CHUNK), None)

    def packed_bucket(self, lens: list[int], width: int) -> tuple[int, int] | None:
        """The (bucket, slots) of the packed graph that serves chunks of `lens` tokens whose
        widest block table is `width`, if any: the fewest slots, then the smallest bucket."""
        if width > self.max_blocks or len(lens) < 2:
            return None
        n = sum(lens)
        return next((key for key in self.packed if fits(n, len(lens), *key)), None)

    def run(self, b: int, chunk: Chunk) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay bucket b's one-slot graph for a chunk: the logits [1, vocab] of its last token
        and their argmax."""
        self.staging.stage(b, 1, [chunk])
        self.graphs[b, 1].replay()
        self.replays += 1
        return self.out[b, 1]

    def run_packed(self, key: tuple[int, int], chunks: list[Chunk]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the packed graph `key` (packed_bucket's) for the chunks: the last layer's
        output and the residual stream before it [slots, hidden], row i the last token of chunk
        i (rows past the chunks: padding). The model's `logits` makes their logits."""
        self.staging.stage(*key, chunks)
        self.graphs[key].replay()
        self.replays += 1
        return self.out[key]
