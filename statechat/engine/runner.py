"""ModelRunner: owns the device tensors (caches), turns a scheduled batch into a Context, runs
the model and samples. The only engine module that does tensor work; its graphs' capture and
replay are in engine/replay.py, its prompt scoring in engine/scoring.py, the sampling of a
step's logits in engine/step_sampling.py and its transfers for the lower cache tiers in
engine/transfer.py (mixins of ModelRunner).
"""

from __future__ import annotations

import numpy as np
import torch

import kernels
from statechat.devices import accelerator
from statechat.engine.graphs import DecodeGraphs
from statechat.engine.prefill_graphs import PrefillGraphs
from statechat.engine.replay import GraphReplay
from statechat.engine.sampler_graphs import SamplerGraphs
from statechat.engine.scheduler import Batch
from statechat.engine.scoring import PromptScoring
from statechat.engine.step_sampling import Launched, StepSampling
from statechat.engine.structured import Grammars
from statechat.engine.token_counts import TokenCounts
from statechat.engine.transfer import StateTransfer
from statechat.model.context import Context, ModelCaches
from statechat.model.loader import LoadedModel


class ModelRunner(GraphReplay, PromptScoring, StepSampling, StateTransfer):
    def __init__(self, loaded: LoadedModel, num_blocks: int, num_slots: int,
                 block_size: int) -> None:
        self.loaded = loaded
        self.model, self.device, self.dtype = loaded.model, loaded.device, loaded.dtype
        self.block_size = block_size
        self.caches = ModelCaches.allocate(loaded.config, num_slots, num_blocks, block_size,
                                           self.dtype, self.device)
        self.pad_slot = num_slots - 1  # never handed out: padding rows of graph replays write here
        self.generators: dict[int, torch.Generator] = {}
        self.counts: TokenCounts | None = None  # of the requests with penalties, once one came
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        self.split_steps = 0  # steps replayed as several graphs (GraphReplay._replay_split)
        self.sampler_graphs: SamplerGraphs | None = None
        self.rope_table: torch.Tensor | None = None  # the rotary table its steps read (None:
        # computed; see Context.rope_table)
        self.eos_ids: set[int] = set()  # (the engine's) barred with stop_token_ids by min_tokens
        self.grammars: Grammars | None = None  # the matchers of structured outputs (the engine's)
        self.before_wait = lambda: None  # runs once a step is launched, before its tokens are read
        # pinned buffer for the tokens of a step that a later one was queued after, and the
        # event after their copy
        self._out = torch.empty(0, dtype=torch.int64)
        self._out_logprobs = torch.empty(0, dtype=torch.float32)
        self._out_copied = None if self.device.type == "cpu" else self._event()

    def _tensor(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype).to(self.device, non_blocking=True)

    def prepare(self, batch: Batch, every_row: bool = False) -> tuple[torch.Tensor, Context]:
        """Host lists -> one Context for the step (a single host-to-device copy per field).
        A step with prompt tokens runs its last layer past the mixer on the logits rows alone
        (Context.logits_seqs) unless `every_row` (a step that scores its prompt reads them all)."""
        bs = self.block_size
        ids, positions, slot_mapping, cu, logits_rows, logits_seqs = [], [], [], [0], [], []
        ck_seq, ck_boundary, ck_slot = [], [], []
        max_blocks = max(len(it.seq.block_table) for it in batch.items)
        tables = []
        for i, it in enumerate(batch.items):
            seq, s, n = it.seq, it.start, it.num_tokens
            ids += seq.token_ids[s : s + n]
            pos = range(s, s + n)
            positions += pos
            slot_mapping += [seq.block_table[p // bs] * bs + p % bs for p in pos]
            cu.append(cu[-1] + n)
            if it.needs_logits:
                logits_rows.append(cu[-1] - 1)
                logits_seqs.append(i)
            tables.append(seq.block_table + [0] * (max_blocks - len(seq.block_table)))
            for boundary, slot in it.checkpoints:
                ck_seq.append(i)
                ck_boundary.append(boundary)
                ck_slot.append(slot)
        i32, i64 = torch.int32, torch.int64
        checkpoints = None
        if ck_seq:
            checkpoints = kernels.Checkpoints(
                self._tensor(ck_seq, i32), self._tensor(ck_boundary, i32),
                self._tensor(ck_slot, i32),
            )
        ctx = Context(
            positions=self._tensor(positions, i64),
            cu_seqlens=self._tensor(cu, i32),
            is_decode=batch.is_decode,
            state_src=self._tensor([it.src_slot for it in batch.items], i32),
            state_dst=self._tensor([it.seq.slot for it in batch.items], i32),
            slot_mapping=self._tensor(slot_mapping, i64),
            block_tables=self._tensor(tables, i32),
            context_lens=self._tensor([it.start + it.num_tokens for it in batch.items], i32),
            checkpoints=checkpoints,
            logits_indices=self._tensor(logits_rows, i64),
            logits_seqs=(None if batch.is_decode or every_row  # (a decode step's rows are all
                         else self._tensor(logits_seqs, i64)),  # logits rows)
            rope_table=self.rope_table,
        )
        return self._tensor(ids, i64), ctx

    def launch(self, batch: Batch, after: Launched | None = None,
               defer: bool = False) -> Launched:
        """Queue the batch's forward and sampling; nothing waits for the device.

        after: the decode step queued just before this one, for the same sequences in the same
        order, whose tokens are not read yet. They are this step's input tokens: they go from
        its output to this step's input on the device, and to pinned host memory in a copy
        queued before this step can overwrite them, which `collect(after)` waits for.
        defer: queue the forward alone; `sample_pending` queues the sampling once the tokens
        before it are read (a structured output's mask needs them)."""
        feed = follows = replay = None
        if after is not None:
            if not batch.is_decode or len(batch.items) != len(after.batch.items):
                raise ValueError(
                    "a step fed on the device continues a decode step of the same sequences")
            feed, follows = after.tokens, after.replay
            self._copy_out(after)
        width = max(len(it.seq.block_table) for it in batch.items)
        scored = [] if batch.is_decode else self.scored(batch)  # (a decode step scores nothing)
        bucket = None if scored else self._prefill_bucket(batch, width)
        split = None if scored or bucket is not None else self._split_buckets(batch)
        greedy = prompt = None  # a replayed graph's argmax of the logits; the prompt's table
        if (batch.is_decode and self.graphs is not None
                and self.graphs.can_run(len(batch.items), width)):
            logits, greedy = self._replay_decode(batch, feed, follows)
            replay = self.graphs.replays
        elif bucket is not None:
            logits, greedy = self._replay_prefill(batch.items[0], bucket)
        elif split is not None:  # (several graphs: their rows copied into one tensor)
            logits, greedy = self._replay_split(batch, split)
            self.split_steps += 1
        elif scored:  # (never a graph: every row's output is read)
            logits, prompt = self._forward_scored(batch, scored)
        else:
            input_ids, ctx = self.prepare(batch)
            logits = self.model(feed if feed is not None else input_ids, ctx, self.caches)
        # (the sampler's graphs read logits in a graph's static buffer: not a split step's)
        graphs = self.sampler_graphs if greedy is not None and split is None else None
        if defer:  # (the logits stay in the graph's buffer: no replay comes before the draw)
            return Launched(batch, None, replay=replay, pending=(logits, greedy, graphs, prompt))
        return self._sample_step(batch, logits, greedy, graphs, replay, prompt)

    def sample_pending(self, launched: Launched) -> None:
        """Queue the sampling of a step launched with `defer` (its sequences' tokens before it
        now appended), filling in its tokens and logprob table."""
        logits, greedy, graphs, prompt = launched.pending
        drawn = self._sample_step(launched.batch, logits, greedy, graphs, launched.replay, prompt)
        launched.tokens, launched.logprobs, launched.pending = drawn.tokens, drawn.logprobs, None

    def _forward_scored(self, batch: Batch, scored: list[tuple[int, int, int]]
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """Queue the eager forward of a step that scores its prompt (`scored`: PromptScoring's
        rows) and the scoring: the logits of its rows that sample, and the prompt's table."""
        input_ids, ctx = self.prepare(batch, every_row=True)
        rows, targets = self._score_rows(batch, scored)  # (copied before the forward is
        # queued: a copy from pageable memory after it would wait for it)
        with torch.inference_mode():
            h, residual = self.model.model(input_ids, ctx, self.caches)
        logits = self.model.logits(h, residual, ctx.logits_indices)
        k = max(batch.items[i].seq.params.prompt_logprobs for i, _, _ in scored)
        return logits, self._score(h, residual, rows, targets, k)

    def collect(self, launched: Launched) -> tuple[list[int], list[list[float]] | None,
                                                   np.ndarray | None]:
        """The sampled tokens of a launched step, one per item that needs logits, in item order,
        the rows of its logprob table (None if no request asked) and those of its prompt's
        (None if it scored no prompt row): the step's one host synchronisation."""
        if launched.tokens is None and launched.prompt is None:
            return [], None, None
        self.before_wait()
        prompt = None if launched.prompt is None else launched.prompt.cpu().numpy()  # (a step
        # that scores a prompt is never followed on the device: `copied` is None)
        if launched.tokens is None:
            return [], None, prompt
        if launched.copied is not None:  # a later step was queued: its copy is the one to wait for
            launched.copied.synchronize()
            table = launched.host_logprobs
            return launched.host.tolist(), None if table is None else table.tolist(), prompt
        tokens = launched.tokens.tolist()  # (nothing queued after this step: the table's read
        # waits for the table alone)
        return tokens, None if launched.logprobs is None else launched.logprobs.tolist(), prompt

    def finish(self) -> bool:
        """Wait for the device to run the step launched (True). For work done ahead: its steps
        sample nothing, so the host would queue every chunk at once, and a request that came
        meanwhile would wait for all of them, not for the step in flight."""
        self.before_wait()
        if self.device.type != "cpu":  # (the CPU's steps are done when launched)
            accelerator(self.device).synchronize(self.device)
        return True

    def _copy_out(self, launched: Launched) -> None:
        """Queue the copy of a step's tokens to pinned host memory. One buffer serves: the
        step whose copy used it last was read (collect) before this one was launched."""
        if self.device.type == "cpu":  # the tokens are computed already and nothing overwrites them
            return
        n = launched.tokens.shape[0]
        if self._out.shape[0] < n:
            self._out = torch.empty(max(n, 64), dtype=torch.int64, pin_memory=True)
        self._out[:n].copy_(launched.tokens, non_blocking=True)
        if launched.logprobs is not None:  # (its own buffer, served the same way)
            table = launched.logprobs
            if self._out_logprobs.numel() < table.numel():
                self._out_logprobs = torch.empty(max(table.numel(), 4096), dtype=torch.float32,
                                                 pin_memory=True)
            host = self._out_logprobs[: table.numel()].view(table.shape)
            launched.host_logprobs = host.copy_(table, non_blocking=True).numpy()
        self._out_copied.record()
        launched.host, launched.copied = self._out[:n].numpy(), self._out_copied

    def forget(self, seq_id: int) -> None:
        self.generators.pop(seq_id, None)
        if self.grammars is not None:
            self.grammars.forget(seq_id)
        if self.counts is not None:
            self.counts.release(seq_id)

    def warm_up(self, max_seqs: int, max_tokens: int, max_blocks: int = 1) -> None:
        """Compile the kernels a step can first need while others run (see warmup.warm_up)."""
        from statechat.engine.warmup import warm_up

        warm_up(self, max_seqs, max_tokens, max_blocks)

    def copy_slots(self, copies: list[tuple[int, int]]) -> None:
        """Copy GDN states (conv + recurrent, every GDN layer) from slot to slot."""
        if not copies:
            return
        src = self._tensor([c[0] for c in copies], torch.int32)
        dst = self._tensor([c[1] for c in copies], torch.int32)
        for pool in self.caches.conv + self.caches.ssm:
            kernels.copy_slots(pool, src, dst)
