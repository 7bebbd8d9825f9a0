"""On a GPU the whole stack (Triton kernels, CUDA-graph decode, prefix cache, disk tier) gives
transformers' greedy tokens, and the cache changes nothing but the work done. Skipped without
CUDA; runs on the lent GPU with the rest of the suite."""

from __future__ import annotations

import dataclasses
import functools
import gc

import pytest
import torch

from statechat.config import EngineConfig
from statechat.engine.engine import LLMEngine
from statechat.engine.logprobs import logprob_table
from statechat.engine.sampler_graphs import SamplerGraphs
from statechat.engine.sampling import SamplingParams
from statechat.engine.token_counts import device_index
from statechat.model.loader import load_model
from tests.engine.test_engine_parity import (
    NEW,
    prompts_and_expected,
    run_staggered,
    sync_and_async_outputs,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def drop_engines():
    """Engines size their caches from the free GPU memory. Each test's engines go when it ends
    (they may hold reference cycles) and their memory goes back to the driver, so the next
    test's engines size their caches as in a fresh process, and kernel tests that follow this
    module find memory for the local memory of their spilled registers (float32 attention over
    wide heads failed to launch, "out of memory", when it ran after these tests)."""
    yield
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def gpu_setup(tiny_dirs):
    path = tiny_dirs["qwen3_5_text"]
    loaded = load_model(path, dtype=torch.float32, device="cuda")
    return path, loaded, *prompts_and_expected(path, loaded.config.vocab_size)


@pytest.mark.parametrize("overrides", [{}, {"max_num_batched_tokens": 64},
                                       {"use_graphs": False}, {"async_scheduling": False}])
def test_gpu_engine_matches_transformers(gpu_setup, overrides):
    path, loaded, prompts, expected = gpu_setup
    engine = LLMEngine(EngineConfig(model=path, device="cuda", dtype="float32", **overrides),
                       loaded=loaded)
    seqs = run_staggered(engine, prompts)
    assert [s.output_ids for s in seqs] == expected


def test_gpu_disk_cache_matches_no_cache(gpu_setup, tmp_path):
    path, loaded, prompts, _ = gpu_setup
    params = SamplingParams(max_tokens=NEW, ignore_eos=True)
    plain = LLMEngine(EngineConfig(model=path, device="cuda", dtype="float32",
                                   enable_prefix_cache=False),
                      loaded=loaded)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    first = LLMEngine(EngineConfig(model=path, device="cuda", dtype="float32", cache_dir=tmp_path),
                      loaded=loaded)
    assert [o.token_ids for o in first.generate(prompts, params)] == want
    first.close()
    second = LLMEngine(EngineConfig(model=path, device="cuda", dtype="float32", cache_dir=tmp_path),
                       loaded=loaded)
    outs = second.generate(prompts, params)
    assert [o.token_ids for o in outs] == want
    # on a GPU the tiny model recomputes faster than a disk read, so the store may rightly
    # choose to recompute; whatever it reuses must come from disk (a fresh process's only tier)
    assert all(o.reused_from == "disk" for o in outs if o.num_cached_tokens)


def test_two_engines_over_one_model_keep_their_graphs(gpu_setup):
    """An engine made after another over the same loaded model (a longer rotary table, graphs
    of its own) leaves the first one's graphs reading live memory: used in turn, both give the
    tokens of an engine alone (the first gave zeros when the second freed its table)."""
    path, loaded, prompts, expected = gpu_setup
    params = SamplingParams(max_tokens=NEW, ignore_eos=True)
    first = LLMEngine(EngineConfig(model=path, device="cuda", dtype="float32", max_model_len=512),
                      loaded=loaded)
    assert [o.token_ids for o in first.generate(prompts, params)] == expected
    second = LLMEngine(EngineConfig(model=path, device="cuda", dtype="float32",
                                    enable_prefix_cache=False), loaded=loaded)
    gc.collect()
    torch.cuda.empty_cache()
    for engine in (first, second, first):
        assert [o.token_ids for o in engine.generate(prompts, params)] == expected


def test_an_eager_engine_reads_no_table_a_graphs_engine_built(gpu_setup):
    """An eager engine (no rotary table of its own) and, made after it over the same model, an
    engine with graphs and a short max_model_len, whose capture builds the model's table for its
    own positions alone: the eager one's long prompt gives the tokens it gave before (its steps
    indexed that table past its end, a device-side assert)."""
    path, loaded, _, _ = gpu_setup
    # as in a fresh process: earlier tests' engines built a longer table, which only grows
    loaded.model.model.rotary.table = None
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    prompt = [3 + i % 50 for i in range(300)]
    eager = LLMEngine(EngineConfig(model=path, device="cuda", dtype="float32", max_model_len=512,
                                   use_graphs=False, enable_prefix_cache=False), loaded=loaded)
    alone = eager.generate([prompt], params)[0].token_ids
    short = LLMEngine(EngineConfig(model=path, device="cuda", dtype="float32", max_model_len=128,
                                   max_num_batched_tokens=64, enable_prefix_cache=False),
                      loaded=loaded)
    assert len(short.runner.rope_table) < len(prompt)
    assert eager.generate([prompt], params)[0].token_ids == alone
    assert short.generate([prompt[:100]], params)[0].finish_reason == "length"


def test_prefill_graphs_match_eager(gpu_setup):
    """One-sequence prefill chunks replayed from CUDA graphs (fresh prompts, resumes from
    checkpoints with checkpoints of their own, chunks cut by a small token budget) give the
    tokens and cache reuse of eager steps."""
    path, loaded, _, _ = gpu_setup
    g = torch.Generator().manual_seed(5)
    base = torch.randint(3, loaded.config.vocab_size, (300,), generator=g).tolist()
    tail = torch.randint(3, loaded.config.vocab_size, (40,), generator=g).tolist()
    turns = [base, base[:250] + tail, base, base[:130], base + tail + base[:200]]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    runs = {}
    for graphs in (True, False):
        for budget in (4096, 256):
            engine = LLMEngine(EngineConfig(model=path, device="cuda", dtype="float32",
                                            use_graphs=graphs, max_num_batched_tokens=budget),
                               loaded=loaded)
            outs = [engine.generate([t], params)[0] for t in turns]
            runs[graphs, budget] = [(o.token_ids, o.num_cached_tokens) for o in outs]
            if graphs:
                assert engine.runner.prefill_graphs.replays >= len(turns)
    assert runs[True, 4096] == runs[False, 4096]
    assert runs[True, 256] == runs[False, 256]
    assert any(cached for _, cached in runs[True, 4096])


def _graphs_and_eager(path, loaded, prompt: list[int], new: int, **config):
    """The greedy tokens of one prompt from an engine with CUDA graphs and from one without,
    and the first engine's prefill graphs."""
    tokens, prefill_graphs = [], None
    for graphs in (True, False):
        engine = LLMEngine(EngineConfig(model=path, device="cuda", dtype="float32",
                                        use_graphs=graphs, **config), loaded=loaded)
        tokens.append(engine.generate([prompt],
                                      SamplingParams(max_tokens=new, ignore_eos=True))[0].token_ids)
        prefill_graphs = prefill_graphs or engine.runner.prefill_graphs
    return tokens, prefill_graphs


def test_prefill_graphs_with_a_short_max_model_len(gpu_setup):
    """Block tables narrower than the largest bucket (max_model_len 448 = 7 blocks, buckets up
    to 4160 tokens): the padding sequence's blocks still fit the graphs' table."""
    path, loaded, _, _ = gpu_setup
    prompt = torch.randint(3, loaded.config.vocab_size, (300,),
                           generator=torch.Generator().manual_seed(9)).tolist()
    tokens, prefill_graphs = _graphs_and_eager(path, loaded, prompt, 8, max_model_len=448)
    assert prefill_graphs.replays >= 1
    assert tokens[0] == tokens[1]


@pytest.mark.parametrize("budget", [4096, 1024])
def test_prefill_graphs_of_long_chunks(gpu_setup, budget):
    """Chunks past 2048 tokens replay the large buckets (a 3000-token prompt in one chunk of
    3000, or in budget-sized chunks of 1024 that fit the top bucket exactly) and give the
    tokens of eager steps."""
    path, loaded, _, _ = gpu_setup
    prompt = torch.randint(3, loaded.config.vocab_size, (3000,),
                           generator=torch.Generator().manual_seed(11)).tolist()
    tokens, prefill_graphs = _graphs_and_eager(path, loaded, prompt, 6, enable_prefix_cache=False,
                                               max_num_batched_tokens=budget)
    assert prefill_graphs.sizes[-1] == budget + 64
    assert prefill_graphs.replays == -(-3000 // budget)  # every chunk of the prompt
    assert tokens[0] == tokens[1]


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("use_graphs", [True, False], ids=["graphs", "eager"])
def test_a_decode_step_synchronises_only_to_read_its_tokens(gpu_setup, use_graphs,
                                                             async_scheduling):
    """No host synchronisation inside a decode step beyond reading the sampled tokens: CUDA's
    sync debug mode makes any other synchronising call of the step (an .item(), a blocking
    copy, a read of device memory) raise; it is lifted only for the tokens' read (with the
    logprobs'). Greedy and sampled requests (a top-k of 20, none, and one too wide for the
    candidates' kernels), with penalties, min-p and logprobs, prefix cache
    on (reply-end checkpoints are slot copies); with async scheduling, a step queues the next
    before its read."""
    path, loaded, prompts, _ = gpu_setup
    config = EngineConfig(model=path, device="cuda", dtype="float32",
                          use_graphs=use_graphs, async_scheduling=async_scheduling)
    engine = LLMEngine(config, loaded=loaded)
    sampled = SamplingParams(max_tokens=12, temperature=0.8, top_k=20, top_p=0.9, seed=1,
                             ignore_eos=True)
    penalised = SamplingParams(max_tokens=12, temperature=0.7, min_p=0.05, presence_penalty=1.0,
                               frequency_penalty=0.5, repetition_penalty=1.1, ignore_eos=True)
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    wide = SamplingParams(max_tokens=12, temperature=0.9, top_k=2000, top_p=0.8, ignore_eos=True)
    # a seeded row makes its steps sample eagerly; without one, graphs replay the sampling
    runs = [[greedy, sampled, penalised,
             SamplingParams(max_tokens=12, ignore_eos=True, logprobs=3)],
            [greedy, dataclasses.replace(sampled, seed=None), penalised, wide]]
    for params in runs:
        _decode_guarded(engine, prompts, params, async_scheduling)
    if use_graphs:
        assert engine.runner.sampler_graphs.replays >= 8


def _decode_guarded(engine, prompts, params, async_scheduling: bool) -> None:
    """Run the prompts' requests to their end, every decode step under CUDA's sync debug mode
    but for its tokens' read."""
    seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    while any(not s.output_ids for s in seqs):  # the prefills: every later step decodes
        engine.step()
    launch, collect = engine.runner.launch, engine.runner.collect
    read_allowed = engine.runner.before_wait
    continued = [0]

    def lift_for_the_read() -> None:
        torch.cuda.set_sync_debug_mode(0)
        read_allowed()

    def checked_launch(batch, after=None, **kw):
        assert batch.is_decode
        continued[0] += after is not None
        return launch(batch, after, **kw)

    def guarded_collect(launched):
        try:
            return collect(launched)
        finally:
            torch.cuda.set_sync_debug_mode("error")  # the rest of the step is guarded again

    engine.runner.before_wait, engine.runner.launch = lift_for_the_read, checked_launch
    engine.runner.collect = guarded_collect
    steps = 0
    try:
        while engine.has_unfinished():
            torch.cuda.set_sync_debug_mode("error")
            engine.step()
            steps += 1
    finally:
        torch.cuda.set_sync_debug_mode(0)
        engine.runner.before_wait, engine.runner.launch = read_allowed, launch
        engine.runner.collect = collect
    assert steps >= 10 and all(len(s.output_ids) == 12 for s in seqs)
    assert (continued[0] >= 8) == async_scheduling


def test_sampler_graphs_draw_as_the_options_say(gpu_setup):
    """Unseeded sampled steps replay the sampler's CUDA graphs (captured while serving), and
    what they draw obeys the options: top-k 1 at a temperature gives the greedy tokens; a
    top-k 5 draw at a high temperature only picks among the step's 5 likeliest tokens (as
    its logprobs, computed apart, report them)."""
    path, loaded, prompts, _ = gpu_setup
    engine = LLMEngine(EngineConfig(model=path, device="cuda", dtype="float32"), loaded=loaded)
    greedy = engine.generate(prompts[:3], SamplingParams(max_tokens=16, ignore_eos=True))
    params = [SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.8, top_k=1),
              SamplingParams(max_tokens=16, ignore_eos=True, temperature=3.0, top_k=5, logprobs=5),
              SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.8, top_k=1, top_p=0.5,
                             min_p=0.1, presence_penalty=0.5)]
    graphs = engine.runner.sampler_graphs
    outs = engine.generate(prompts[:3], params)
    assert graphs.captures >= 1 and graphs.replays >= 10
    assert outs[0].token_ids == greedy[0].token_ids
    for token, (_, top) in zip(outs[1].token_ids, outs[1].logprobs):
        assert token in [i for i, _ in top]
    assert len(set(outs[1].token_ids)) > 1  # (a draw, not an argmax)
    penalised = engine.generate([prompts[2]], SamplingParams(max_tokens=16, ignore_eos=True,
                                                             presence_penalty=0.5))
    assert outs[2].token_ids == penalised[0].token_ids


def test_draws_over_the_vocabulary_obey_top_p(gpu_setup):
    """Rows without a top-k draw over the whole vocabulary (kernels.sample_vocabulary), in
    the sampler's graphs (unseeded) and eagerly (seeded): a top-p below every token's mass
    gives the greedy tokens either way; a seeded top-p draw repeats itself and is a draw."""
    path, loaded, prompts, _ = gpu_setup
    engine = LLMEngine(EngineConfig(model=path, device="cuda", dtype="float32"), loaded=loaded)
    greedy = engine.generate(prompts[:2], SamplingParams(max_tokens=16, ignore_eos=True))
    graphs = engine.runner.sampler_graphs
    replays = graphs.replays
    for seed in (None, 4):
        narrow = SamplingParams(max_tokens=16, ignore_eos=True, temperature=1.5, top_p=1e-6,
                                seed=seed)
        outs = engine.generate(prompts[:2], narrow)
        assert [o.token_ids for o in outs] == [o.token_ids for o in greedy], seed
    assert graphs.replays > replays  # (the unseeded steps)
    wide = SamplingParams(max_tokens=16, ignore_eos=True, temperature=1.5, top_p=0.9, seed=5)
    first, again = (engine.generate([prompts[0]], wide)[0].token_ids for _ in range(2))
    assert first == again != greedy[0].token_ids


def test_async_scheduling_samples_as_the_synchronous_engine_on_graphs(gpu_setup):
    """The decode graphs' continuations: greedy rows fed by the graph's own input advance, and
    seeded sampled rows copied in, draw exactly the synchronous engine's tokens."""
    path, loaded, prompts, _ = gpu_setup
    sync, overlapped = sync_and_async_outputs(path, loaded, prompts, device="cuda", dtype="float32")
    assert sync == overlapped


def test_a_logprob_graph_keeps_the_index_it_reads():
    """A captured logprob table stays right after the cache of row indices has let its index
    go and its memory was reused (the graph holds the index)."""
    device = torch.device("cuda")
    graphs = SamplerGraphs(device)
    logits = torch.randn(6, 1000, device=device)
    tokens = torch.randint(0, 1000, (6,), device=device)
    rows = [0, 2, 5]
    assert graphs.logprobs(logits, tokens, rows, 3) is None  # first seen: the caller's, eagerly
    graphs.logprobs(logits, tokens, rows, 3)  # captured and replayed
    for i in range(80):
        device_index((i, i + 1, 7), device)
    gc.collect()
    reused = [torch.full((3,), 999, dtype=torch.int64, device=device) for _ in range(64)]
    logits.copy_(torch.randn(6, 1000, device=device))
    got = graphs.logprobs(logits, tokens, rows, 3)
    assert graphs.replays == 2 and reused
    assert torch.equal(got, logprob_table(logits, tokens, rows, 3))


def test_graphs_are_captured_on_their_own_stream_with_collection_paused(gpu_setup, monkeypatch):
    """An unreachable engine that Python collects during a capture invalidates it (its memory
    and graphs are freed), and torch drops the cuBLAS workspace of a destroyed graph's capture
    stream: so an engine's decode and prefill graphs are captured with collection paused, on
    a stream no other live engine captures on."""
    from statechat.engine import graphs, prefill_graphs

    path, loaded = gpu_setup[:2]
    seen = []
    real = graphs.graph_api

    def recording_api(device, kind):
        new_graph, capture = real(device)

        def recording(graph, pool=None, stream=None):
            seen.append((kind, gc.isenabled(), None if stream is None else stream.cuda_stream))
            return capture(graph, pool=pool, stream=stream)

        return new_graph, recording

    for kind, module in (("decode", graphs), ("prefill", prefill_graphs)):
        monkeypatch.setattr(module, "graph_api", functools.partial(recording_api, kind=kind))
    config = EngineConfig(model=path, device="cuda", dtype="float32")
    first, second = LLMEngine(config, loaded=loaded), LLMEngine(config, loaded=loaded)
    assert {kind for kind, _, _ in seen} == {"decode", "prefill"}
    assert not any(enabled for _, enabled, _ in seen) and gc.isenabled()
    streams = {stream for _, _, stream in seen}
    assert len(streams) == 2 and None not in streams
    samplers = {e.runner.sampler_graphs.stream.cuda_stream for e in (first, second)}
    assert len(samplers) == 2 and not samplers & streams
    assert first.generate([[1, 2, 3]], SamplingParams(max_tokens=4)) is not None
    assert second.generate([[1, 2, 3]], SamplingParams(max_tokens=4)) is not None
