"""Steps of several prompts' chunks replay one packed prefill graph (prefill_graphs.py), whose
inputs are staged in a padded layout (prefill_staging.py): the chunks, one-token paddings for
the unused sequence slots, and a last padding sequence of at least a block. On the CPU, through
an engine whose "graphs" run the real staged layout eagerly (the model forward on the staged
inputs, its outputs copied into fixed buffers as a replay writes them): such steps give the
tokens, logprobs and cache reuse of eager steps, and leave the pools as they do. Which steps
take a packed graph, and what fits a bucket; a packed graph whose capture while serving fails,
in any way, is not tried again and fails no step. On a GPU, the captured graphs do the
same."""

from __future__ import annotations

import contextlib
import gc
from types import SimpleNamespace

import pytest
import torch

from statechat.config import EngineConfig
from statechat.engine.engine import LLMEngine
from statechat.engine.prefill_graphs import (
    PACKED_SLOTS,
    PrefillGraphs,
    _forward,
    graph_keys,
    packed_buckets,
    prefill_buckets,
)
from statechat.engine.prefill_staging import PrefillStaging, checkpoint_entries, fits
from statechat.engine.sampling import SamplingParams
from statechat.engine.scheduler import Batch
from tests.engine.test_split_steps import PARAMS, StandIn, item


class EagerGraph:
    """A stand-in graph: its replay runs the forward on the staged inputs and writes the
    results into the fixed outputs a captured graph would write."""

    def __init__(self, args: tuple, log: list, key: tuple[int, int]):
        self.args, self.log, self.key = args, log, key
        self.out = tuple(t.clone() for t in _forward(*args))

    def replay(self) -> None:
        for buf, new in zip(self.out, _forward(*self.args)):
            buf.copy_(new)
        self.log.append(self.key)


def eager_graphs(runner, budget: int, max_blocks: int) -> list[tuple[int, int]]:
    """Give a CPU runner PrefillGraphs whose graphs are EagerGraphs over the real staging, for
    a token budget. Returns the log of replayed (bucket, slots) keys."""
    keys = graph_keys(budget, max(PACKED_SLOTS))
    pg = PrefillGraphs.__new__(PrefillGraphs)
    pg.max_blocks, pg.replays, pg.graphs, pg.out, log = max_blocks, 0, {}, {}, []
    pg.staging = PrefillStaging(max(b for b, _ in keys), max(PACKED_SLOTS), max_blocks,
                                runner.pad_slot, runner.device)
    for b, k in keys:
        pg.staging.stage(b, k, [])
        args = (runner.model, pg.staging.ids(b), pg.staging.context(b, k, None), runner.caches)
        pg.graphs[b, k] = EagerGraph(args, log, (b, k))
        pg.out[b, k] = pg.graphs[b, k].out
    pg.sizes = sorted(b for b, k in keys if k == 1)
    pg.packed = sorted((key for key in keys if key[1] > 1), key=lambda key: key[::-1])
    runner.prefill_graphs = pg
    return log


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


def bursts(engine: LLMEngine, base: list[int], prompts: list[list[int]]) -> list:
    """Compute `base` (a prefix some prompts resume), then the prompts in bursts of 2, 7 and
    the rest, each added at once with PARAMS in turn and run to its end. Their sequences."""
    engine.generate([base], SamplingParams(max_tokens=2))
    seqs = []
    for burst in (prompts[:2], prompts[2:9], prompts[9:]):
        seqs += [engine.add_request(p, PARAMS[(len(seqs) + j) % len(PARAMS)])
                 for j, p in enumerate(burst)]
        while engine.has_unfinished():
            engine.step()
    return seqs


def test_packed_steps_sample_as_eager_steps_on_the_cpu(tiny_dirs):
    """Bursts of two to seven prompts (fresh, and resuming a shared prefix from the cache, with
    checkpoints in their chunks), every kind of sampling work, a budget that cuts them into
    chunks: the packed layout gives the eager steps' tokens, logprobs and reuse."""
    from statechat.model.loader import load_model
    from tests.helpers import assert_idle_pools, cpu_engine

    loaded = load_model(tiny_dirs["qwen3_5_text"], dtype=torch.float32)
    g = torch.Generator().manual_seed(23)
    base = torch.randint(3, 300, (150,), generator=g).tolist()
    lengths = [5, 40, 70, 130, 9, 64, 1, 100, 12, 33, 2, 66, 80]
    prompts = [(base[:140] if k % 3 == 1 else []) + torch.randint(3, 300, (n,),
                                                                  generator=g).tolist()
               for k, n in enumerate(lengths)]
    runs, log = {}, []
    for packed in (True, False):
        engine = cpu_engine(loaded, max_model_len=512, num_kv_blocks=40, num_state_slots=24,
                            max_num_seqs=8, max_num_batched_tokens=256)
        if packed:
            log = eager_graphs(engine.runner, 256, 8)
        seqs = bursts(engine, base, prompts)
        assert_idle_pools(engine)
        runs[packed] = [(s.output_ids, s.num_cached_tokens,
                         [(round(lp, 4), [t for t, _ in top]) for lp, top in s.logprobs])
                        for s in seqs]
    assert runs[True] == runs[False]
    assert {k for _, k in log} >= {1, 2, 4, 8}  # (one-chunk steps and bursts of each size)
    assert any(cached for _, cached, _ in runs[True])


def test_decodes_in_a_packed_graph_sample_as_in_eager_steps(tiny_dirs):
    """Replies decoding beside long prompts' chunks take the packed graph as one-token chunks,
    those crossing a block boundary too (their state copied to a checkpoint slot after the
    step), with penalties, a logit bias and seeded draws: their tokens and logprobs are the
    eager steps'."""
    from statechat.model.loader import load_model
    from tests.helpers import assert_idle_pools, cpu_engine

    loaded = load_model(tiny_dirs["qwen3_5_text"], dtype=torch.float32)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist()
               for n in (60, 62, 63, 61, 500, 450, 300)]
    params = [SamplingParams(max_tokens=12, ignore_eos=True, **fields) for fields in (
        {"presence_penalty": 0.5, "logprobs": 2}, {"temperature": 1.0, "seed": 3,
                                                   "repetition_penalty": 1.3},
        {"logit_bias": {5: 3.0}}, {"temperature": 0.7, "seed": 9, "top_k": 5,
                                   "frequency_penalty": 0.4})]
    runs, crossing = {}, []
    for packed in (True, False):
        engine = cpu_engine(loaded, max_model_len=1024, num_kv_blocks=60, num_state_slots=24,
                            max_num_seqs=8, max_num_batched_tokens=128)
        if packed:
            eager_graphs(engine.runner, 128, 16)
            split = engine.runner._split_buckets

            def watched(batch, split=split):
                buckets = split(batch)
                if buckets and all(isinstance(b, tuple) for b in buckets):
                    crossing.extend(it for it in batch.items
                                    if it.seq.is_decoding and (it.start + 1) % 64 == 0)
                return buckets

            engine.runner._split_buckets = watched
        seqs = [engine.add_request(p, params[i % 4]) for i, p in enumerate(prompts)]
        while engine.has_unfinished():
            engine.step()
        assert_idle_pools(engine)
        runs[packed] = [(s.output_ids, [round(lp, 4) for lp, _ in s.logprobs]) for s in seqs]
    assert crossing  # (else the test proves less than it says)
    assert runs[True] == runs[False]


def _packed_graphs(engine: LLMEngine) -> list[tuple[int, int]]:
    return [key for key in engine.runner.prefill_graphs.graphs if key[1] > 1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_packed_graphs_match_eager_steps(tiny_dirs, tmp_path):
    """Captured when a burst first needs them (none at start), beside the disk tier's writer,
    packed graphs give the tokens, logprobs and reuse of eager steps."""
    from statechat.model.loader import load_model

    path = tiny_dirs["qwen3_5_text"]
    loaded = load_model(path, dtype=torch.float32, device="cuda")
    g = torch.Generator().manual_seed(29)
    base = torch.randint(3, loaded.config.vocab_size, (150,), generator=g).tolist()
    prompts = [(base[:140] if k % 3 == 1 else []) + torch.randint(
        3, loaded.config.vocab_size, (n,), generator=g).tolist()
        for k, n in enumerate([5, 40, 70, 130, 9, 64, 1, 100, 12, 33, 2, 66, 80, 7, 300, 20])]
    runs = {}
    for graphs in (True, False):
        engine = LLMEngine(EngineConfig(model=path, device="cuda", dtype="float32",
                                        use_graphs=graphs, max_num_batched_tokens=512,
                                        cache_dir=tmp_path / str(graphs)), loaded=loaded)
        if graphs:
            assert not _packed_graphs(engine)
        seqs = bursts(engine, base, prompts)
        runs[graphs] = [(s.output_ids, s.num_cached_tokens, s.logprobs) for s in seqs]
        if graphs:
            assert engine.runner.prefill_graphs.replays >= 3
            assert engine.runner.split_steps >= 3
            assert len(_packed_graphs(engine)) >= 2
        engine.close()
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    for (ids, cached, logprobs), (ids_e, cached_e, logprobs_e) in zip(runs[True], runs[False]):
        assert ids == ids_e and cached == cached_e
        for (lp, top), (lp_e, top_e) in zip(logprobs, logprobs_e):
            assert lp == pytest.approx(lp_e, abs=1e-4)
            assert [t for t, _ in top] == [t for t, _ in top_e]
    assert any(cached for _, cached, _ in runs[True])


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
