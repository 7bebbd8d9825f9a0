"""The runner's graphs (CUDA graphs; NPU graphs through torch_npu, opted into): their capture at
start (decode steps by batch bucket, one prompt's prefill chunk by length bucket; the packed
prefill graphs of several sequences and the sampler's are captured while serving) and the
replay of a step on them: one graph, or for a step of several sequences, one packed graph for
them all, or the decode graph and one packed graph for its chunks (or a prefill graph a chunk)
in turn (_replay_split).

A mixin of ModelRunner (engine/runner.py), which owns the tensors they read and write and
chooses, per step, between a replay and an eager forward.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import torch

from kernels import CHUNK
from statechat.devices import accelerator, capture_stream, graph_api
from statechat.engine.graphs import DecodeGraphs
from statechat.engine.prefill_graphs import PREFILL_BUCKETS, PrefillGraphs, prefill_buckets
from statechat.engine.prefill_staging import Chunk
from statechat.engine.sampler_graphs import SamplerGraphs
from statechat.engine.scheduler import Batch

log = logging.getLogger("statechat.engine")
T = TypeVar("T")

# A step of several sequences that one graph cannot replay (decodes beside prefill chunks, or
# chunks of several prompts) replays the decodes' graph and each chunk's prefill graph in turn,
# if it has at most this many chunks. Each replay reads every weight again (2-3 ms for a short
# chunk of a 0.75B model on an H100), while the eager step's launches cost the host 15-22 ms
# whatever its size: 2, 4, 6 and 8 short prompts at once took 5.1, 9.8, 14.6 and 19.4 ms split
# against 15.4, 20.3, 22.4 and 21.0 eagerly (docs/bench.md, session 32)
MAX_SPLIT_CHUNKS = 6


class GraphReplay:
    """Capture and replay of ModelRunner's graphs (`self.graphs`, `self.prefill_graphs`,
    `self.sampler_graphs`) on its model and caches (`self.model`, `self.caches`, `self.device`,
    `self.block_size`, `self.pad_slot`)."""

    def prepare_steps(self, use_graphs: bool | None, max_num_seqs: int, max_model_len: int,
                      max_prefill_tokens: int) -> None:
        """Before any request: capture the graphs (`use_graphs`; None: on CUDA) and, on an
        accelerator, compile what a step can first need (`warm_up`), so that serving builds
        nothing."""
        device = self.device
        use_graphs = device.type == "cuda" if use_graphs is None else use_graphs
        max_blocks = -(-max_model_len // self.block_size)
        if use_graphs and graph_api(device) is not None:
            self.capture_graphs(min(max_num_seqs, 512), max_blocks, max_prefill_tokens)
        elif use_graphs and device.type == "npu":
            log.warning("statechat: this torch_npu has no graph capture (torch.npu.NPUGraph); "
                        "steps run eagerly")
        if device.type != "cpu":
            self.warm_up(max_num_seqs, max_prefill_tokens, max_blocks)

    def capture_graphs(self, max_batch: int, max_blocks_per_seq: int,
                       max_prefill_tokens: int) -> None:
        """Capture graphs of the decode step for batch buckets up to `max_batch`, and of
        one-sequence prefill chunks up to `max_prefill_tokens` (0: none).

        On an NPU (opted into: torch_npu's graph capture has not run with these kernels), a
        capture that raises leaves its steps eager, with a warning; on CUDA it raises."""
        # cos/sin gathered from a table: one kernel per step instead of several. It covers the
        # longest sequence and the positions the prefill graphs are captured with (a bucket of
        # the whole budget, and a block more for the packed graphs', which may exceed a short
        # max_model_len)
        longest = max_blocks_per_seq * self.block_size
        with_prefill = max_prefill_tokens >= PREFILL_BUCKETS[0] - CHUNK
        if with_prefill:
            longest = max(longest, prefill_buckets(max_prefill_tokens)[-1] + CHUNK)
        # (the runner keeps the table its graphs read, and hands it to its eager steps too
        # (Context.rope_table): another engine over the same model may build a longer one,
        # which must not free this one under these graphs)
        self.rope_table = self.model.model.rotary.build_table(longest, self.dtype)
        # on a stream of this runner's own, not the process-wide default capture stream: a
        # destroyed graph takes its capture stream's cuBLAS workspace with it (see
        # devices.capture_stream); unreachable engines collected before, not during, a capture
        self.capture_stream = capture_stream(self.device, self)
        gc.collect()
        self.graphs = self._capture("decode", lambda: DecodeGraphs(
            self.model, self.caches, max_batch, max_blocks_per_seq, self.pad_slot, self.device,
            self.capture_stream, self.rope_table))
        if with_prefill:
            self.prefill_graphs = self._capture("prefill", lambda: PrefillGraphs(
                self.model, self.caches, max_prefill_tokens, max_blocks_per_seq, self.pad_slot,
                self.device, self.capture_stream, self.rope_table, max_batch))
        if self.device.type == "cuda":  # (captured while serving: see sampler_graphs)
            self.sampler_graphs = SamplerGraphs(self.device)

    def _capture(self, what: str, build: Callable[[], T]) -> T | None:
        """build(), or on an NPU None if its capture raised (the stream it ran on restored)."""
        if self.device.type != "npu":
            return build()
        acc = accelerator(self.device)
        stream = acc.current_stream(self.device)
        try:
            return build()
        except RuntimeError:
            acc.set_stream(stream)  # a capture that failed on its way out may leave its own
            log.warning("statechat: NPU graph capture of the %s steps failed; they run eagerly",
                        what, exc_info=True)
            return None

    def _replay_decode(self, batch: Batch, feed: torch.Tensor | None,
                       follows: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        bs, items = self.block_size, batch.items
        positions = [it.start for it in items]
        return self.graphs.run(
            ids=[0 if feed is not None else it.seq.token_ids[it.start] for it in items],
            positions=positions,
            slot_mapping=[it.seq.block_table[p // bs] * bs + p % bs
                          for it, p in zip(items, positions)],
            src=[it.src_slot for it in items],
            dst=[it.seq.slot for it in items],
            ctx_lens=[p + 1 for p in positions],
            tables=[it.seq.block_table for it in items],
            feed=feed,
            follows=follows,
        )

    def _split_buckets(self, batch: Batch) -> list[int | tuple[int, int] | None] | None:
        """How a step of several sequences replays (_replay_split): one packed graph for all its
        items (decodes as one-token chunks) when one serves them in a bucket of at most 2048
        tokens; else the decode graph for its decodes (None for each) and, for its chunks, one
        packed graph's (bucket, slots) key, the same for each, or each chunk's prefill bucket.
        None if it does not replay (a decode step, a chunk no graph serves, decodes the decode
        graphs do not, more than MAX_SPLIT_CHUNKS chunks that no packed graph serves)."""
        items, graphs = batch.items, self.prefill_graphs
        if batch.is_decode or graphs is None or len(items) < 2:
            return None
        # (past 2048 tokens the packed buckets are coarse: their padding would cost more than
        # a replay of the decode graph)
        whole = graphs.packed_bucket([it.num_tokens for it in items],
                                     max(len(it.seq.block_table) for it in items))
        if whole is not None and whole[0] <= PREFILL_BUCKETS[-1] and graphs.ready(whole):
            return [whole] * len(items)
        decodes = [it for it in items if it.seq.is_decoding]
        if decodes and (self.graphs is None or not self.graphs.can_run(
                len(decodes), max(len(it.seq.block_table) for it in decodes))):
            return None
        chunks = [it for it in items if not it.seq.is_decoding]
        packed = graphs.packed_bucket([it.num_tokens for it in chunks],
                                      max(len(it.seq.block_table) for it in chunks))
        if packed is not None and graphs.ready(packed):
            return [None if it.seq.is_decoding else packed for it in items]
        if len(chunks) > MAX_SPLIT_CHUNKS:
            return None
        buckets = [None if it.seq.is_decoding
                   else graphs.bucket(it.num_tokens, len(it.seq.block_table)) for it in items]
        if any(b is None for b, it in zip(buckets, items) if not it.seq.is_decoding):
            return None
        return buckets

    def _replay_split(self, batch: Batch, buckets: list[int | tuple[int, int] | None]
                      ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Replay a step of several sequences as the decode graph (its decodes) and one packed
        graph for its chunks or one prefill graph a chunk (`buckets`, of _split_buckets), in
        turn: the sequences share nothing the step computes. Returns the logits rows and their
        argmax, in item order, of the items that sample (None if none does), each replay's
        copied out before the next replay, which may reuse its memory."""
        row = {i: j for j, i in enumerate(i for i, it in enumerate(batch.items)
                                          if it.needs_logits)}
        kept: list[torch.Tensor] = []  # [logits, argmax] of the rows that sample
        decodes = [i for i, b in enumerate(buckets) if b is None]
        if decodes:
            logits, greedy = self._replay_decode(Batch([batch.items[i] for i in decodes]),
                                                 None, None)
            own = [k for k, i in enumerate(decodes) if i in row]
            if len(own) < len(decodes):
                logits, greedy = logits[own], greedy[own]
            self._keep_rows(kept, len(row), [row[decodes[k]] for k in own], logits, greedy)
        packed = [i for i, b in enumerate(buckets) if isinstance(b, tuple)]
        if packed:
            own = [k for k, i in enumerate(packed) if i in row]
            logits, greedy = self._replay_packed([batch.items[i] for i in packed],
                                                 buckets[packed[0]], own)
            self._keep_rows(kept, len(row), [row[packed[k]] for k in own], logits, greedy)
        for i, b in enumerate(buckets):
            if isinstance(b, int):
                logits, greedy = self._replay_prefill(batch.items[i], b)
                if i in row:
                    self._keep_rows(kept, len(row), [row[i]], logits, greedy)
        return (kept[0], kept[1]) if kept else (None, None)

    def _keep_rows(self, kept: list[torch.Tensor], num_rows: int, rows: list[int],
                   logits: torch.Tensor, greedy: torch.Tensor) -> None:
        """Copy a replay's logits and argmax into rows `rows` of `kept`'s (made on the first
        call: [num_rows, vocab] and [num_rows])."""
        if not rows:
            return
        if not kept:
            kept += [logits.new_empty(num_rows, logits.shape[-1]),
                     greedy.new_empty(num_rows)]
        index = self._tensor(rows, torch.int64)
        kept[0].index_copy_(0, index, logits)
        kept[1].index_copy_(0, index, greedy.view(-1))

    def _prefill_bucket(self, batch: Batch, width: int) -> int | None:
        if batch.is_decode or self.prefill_graphs is None or len(batch.items) != 1:
            return None
        return self.prefill_graphs.bucket(batch.items[0].num_tokens, width)

    def _chunk(self, it) -> Chunk:
        """A step item's part of a prefill graph's inputs."""
        seq, s, n, bs = it.seq, it.start, it.num_tokens, self.block_size
        positions = np.arange(s, s + n)
        slot_mapping = (np.asarray(seq.block_table, dtype=np.int64)[positions // bs] * bs
                        + positions % bs)
        return Chunk(seq.token_ids[s : s + n], s, slot_mapping, it.src_slot, seq.slot,
                     seq.block_table, it.checkpoints)

    def _replay_prefill(self, it, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.prefill_graphs.run(bucket, self._chunk(it))

    def _replay_packed(self, items: list, key: tuple[int, int], rows: list[int]
                       ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Replay the packed graph `key` for the chunks `items`: the logits and argmax of those
        at `rows` (None if none), made from the graph's output rows after the replay."""
        h, residual = self.prefill_graphs.run_packed(key, [self._chunk(it) for it in items])
        if not rows:
            return None, None
        return self.model.logits(h, residual, self._tensor(rows, torch.int64), with_argmax=True)
