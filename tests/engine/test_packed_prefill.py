"""Steps of several prompts' chunks replay one packed prefill graph (prefill_graphs.py), whose
inputs are staged in a padded layout (prefill_staging.py): the chunks, one-token paddings for
the unused sequence slots, and a last padding sequence of at least a block. On the CPU, through
an engine whose "graphs" run the real staged layout eagerly (the model forward on the staged
inputs, its outputs copied into fixed buffers as a replay writes them): such steps give the
tokens, logprobs and cache reuse of eager steps, and leave the pools as they do; replies
decoding beside chunks in a packed graph too. On a GPU, the captured graphs do the same.
(Which steps take a packed graph, what fits a bucket, and a capture that fails:
test_packed_buckets.py.)"""

from __future__ import annotations

import gc

import pytest
import torch

from statechat.config import EngineConfig
from statechat.engine.engine import LLMEngine
from statechat.engine.prefill_graphs import (
    PACKED_SLOTS,
    PrefillGraphs,
    _forward,
    graph_keys,
)
from statechat.engine.prefill_staging import PrefillStaging
from statechat.engine.sampling import SamplingParams
from tests.engine.test_split_steps import PARAMS


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
