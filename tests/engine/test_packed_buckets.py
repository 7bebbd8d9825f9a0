"""Which steps of several prompts' chunks take a packed prefill graph (prefill_graphs.py), and
what fits one: the buckets that have packed graphs, the bucket a step's chunks take (decodes
beside them too), what fits a bucket of the staged layout (prefill_staging.py), which graphs
an engine captures at all; and a packed graph whose capture while serving fails, in any way,
is not tried again and fails no step. (That such steps compute what eager steps do is
test_packed_prefill.py's.)"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch

from statechat.engine.prefill_graphs import (
    PrefillGraphs,
    graph_keys,
    packed_buckets,
    prefill_buckets,
)
from statechat.engine.prefill_staging import PrefillStaging, checkpoint_entries, fits
from statechat.engine.scheduler import Batch
from tests.engine.test_split_steps import StandIn, item


def test_which_buckets_have_packed_graphs():
    assert packed_buckets(prefill_buckets(256)) == [128, 192, 256, 384]
    assert packed_buckets(prefill_buckets(8192)) == [
        128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8320]


def test_chunks_filling_the_budget_take_the_top_packed_graph():
    """Three prompts' chunks that fill a budget of 8192 tokens fit the top packed bucket
    beside the fourth slot's one-token padding (a bucket of the budget and a block would
    not hold it)."""
    pg = PrefillGraphs.__new__(PrefillGraphs)
    pg.max_blocks = 200
    pg.packed = sorted((key for key in graph_keys(8192, 64) if key[1] > 1),
                       key=lambda key: key[::-1])
    assert pg.packed_bucket([4000, 4000, 192], 130) == (8320, 4)
    assert pg.packed_bucket([100, 28], 2) == (192, 2)
    assert pg.packed_bucket([100, 28], 201) is None  # (a table wider than the graphs')


def test_what_fits_a_bucket():
    assert fits(64, 1, 128, 1) and not fits(65, 1, 128, 1)
    assert fits(60, 2, 128, 4) and not fits(63, 2, 128, 4)  # (two one-token paddings)
    assert not fits(10, 5, 1024, 4)  # (more chunks than slots)
    # the checkpoint list: one a block of the bucket, and one more for each slot past the
    # first (each chunk may hold one boundary more than its whole blocks)
    assert checkpoint_entries(128, 1) == 2 and checkpoint_entries(256, 8) == 11


def test_steps_of_several_sequences_take_a_packed_graph():
    """Stand-in graphs: a packed graph of 4 slots in a bucket of 256 tokens holds up to 180
    tokens, one of 8 slots in a bucket of 4096 up to 4000."""
    runner = StandIn()
    runner.prefill_graphs.packed_bucket = lambda lens, width: (
        (256, 4) if 2 <= len(lens) <= 4 and sum(lens) <= 180
        else (4096, 8) if 2 <= len(lens) <= 8 and sum(lens) <= 4000 else None)
    runner._replay_packed = lambda items, key, rows: (
        runner.replayed.append(f"packed {key} x{len(items)}")
        or (torch.zeros(len(rows), 7), torch.zeros(len(rows), dtype=torch.long)))
    split = lambda *items: runner._split_buckets(Batch(list(items)))
    # chunks alone: one packed graph, whatever its bucket
    assert split(item(False, 100), item(False, 5)) == [(256, 4)] * 2
    assert split(item(False, 100), item(False, 100)) == [(4096, 8)] * 2
    # decodes beside chunks, in a bucket of at most 2048 tokens: one graph for all of them
    assert split(item(True), item(False, 9)) == [(256, 4)] * 2
    assert split(item(True), item(False, 9), item(False, 9)) == [(256, 4)] * 3
    # else the decode graph, and one packed graph for the chunks
    assert split(item(True), item(False, 100), item(False, 100)) == [None] + [(4096, 8)] * 2
    assert split(*[item(True)] * 4, item(False, 9), item(False, 9)) == [None] * 4 + [(256, 4)] * 2
    runner.prefill_graphs.ready = lambda key: False  # (their captures failed)
    assert split(item(False, 100), item(False, 5)) == [192, 192]
    assert split(item(True), item(False, 9)) == [None, 192]
    runner.prefill_graphs.ready = lambda key: True
    items = [item(True), item(False, 30), item(False, 7, logits=False), item(False, 50)]
    logits, _ = runner._replay_split(Batch(items), split(*items))
    assert runner.replayed == ["packed (256, 4) x4"]
    assert logits.shape == (3, 7)
    items = [item(True), item(False, 130), item(False, 7, logits=False), item(False, 50)]
    logits, _ = runner._replay_split(Batch(items), split(*items))
    assert runner.replayed[1:] == ["decode x1", "packed (4096, 8) x3"]
    assert logits.shape == (3, 7)


def test_no_packed_graph_is_captured_that_no_step_can_use():
    """A step holds at most max_num_seqs chunks: an engine of fewer sequences captures no
    packed graph of more slots than the fewest that hold them all (each capture costs start
    time and memory), and an engine of one sequence none."""
    full = graph_keys(8192, 64)
    assert len(full) == 86 and full[0] == (8256, 1)  # (the largest first: the pool's size)
    assert {k for _, k in graph_keys(8192, 6)} == {1, 2, 4, 8}
    assert {k for _, k in graph_keys(8192, 8)} == {1, 2, 4, 8}
    assert graph_keys(8192, 1) == [(b, 1) for b in reversed(prefill_buckets(8192))]


class KernelBuildError(Exception):
    """What triton raises for a kernel it cannot build (OutOfResources, CompilationError): an
    Exception, not a RuntimeError."""


class FakeGraph:
    """torch.cuda.CUDAGraph's calls that PrefillGraphs.ready makes, doing nothing."""

    def capture_begin(self, pool=None, capture_error_mode=None) -> None:
        self.began = True

    def capture_end(self) -> None:
        pass

    def pool(self):
        return None


def test_a_packed_graph_whose_capture_fails_in_any_way_leaves_its_steps_to_other_paths(
        monkeypatch, caplog):
    """A packed graph captured while serving whose capture raises anything (a kernel that fails
    to build raises triton's own errors, which are not RuntimeErrors) is a warning, and is not
    tried again: its steps take another path (it failed the step, and every later step that
    wanted it). The graph is kept (destroyed, it would take its capture stream's cuBLAS
    workspace from the graphs captured before it)."""
    from statechat.engine import prefill_graphs

    pg = PrefillGraphs.__new__(PrefillGraphs)
    pg.model, pg.caches, pg.device, pg.rope_table, pg.pool = None, None, torch.device("cpu"), \
        None, None
    pg.max_blocks, pg.graphs, pg.out, pg.failed = 8, {}, {}, []
    pg.staging = PrefillStaging(256, 4, 8, 0, pg.device)
    pg.packed = [(256, 2), (256, 4)]
    pg.stream = SimpleNamespace(wait_stream=lambda other: None)
    calls = []

    def forward(model, ids, ctx, caches):
        calls.append(ids.shape[0])
        if len(calls) == 2:  # (the eager forward passes; the capture's raises)
            raise KernelBuildError("out of resources: shared memory")
        return torch.zeros(2, 4), torch.zeros(2, 4)

    monkeypatch.setattr(prefill_graphs, "_forward", forward)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: pg.stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    key = pg.packed_bucket([30, 40], 2)
    assert key == (256, 2)
    with caplog.at_level("WARNING", logger="statechat.engine"):
        assert pg.ready(key) is False
    assert "the capture of a 256-token prefill graph of 2 sequences failed" in caplog.text
    assert len(pg.failed) == 1 and pg.failed[0].began  # (kept)
    assert pg.packed_bucket([30, 40], 2) == (256, 4)  # (not tried again)
