"""The engine's greedy tokens equal transformers' greedy `generate` for each prompt alone.

Eight prompts of mixed lengths join at different steps (continuous batching), on the CPU in
float32; the same holds with a token budget small enough to force chunked prefill, with so
few KV blocks that sequences are preempted and recomputed, and with prefills cut to one block a
step while others decode (a step time target too short for more).
"""

from __future__ import annotations

import gc

import pytest
import torch

from statechat.config import EngineConfig
from statechat.engine.engine import LLMEngine
from statechat.engine.sampling import SamplingParams
from statechat.model.loader import load_model

LENGTHS = [5, 40, 64, 65, 100, 150, 200, 300]
NEW = 24


def prompts_and_expected(path, vocab_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """The eight prompts and transformers' greedy continuation of each alone (CPU, float32)."""
    import transformers

    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in LENGTHS]
    expected = []
    for p in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW,
                              do_sample=False)
        expected.append(out[0, len(p):].tolist())
    return prompts, expected


@pytest.fixture(scope="module")
def setup(tiny_dirs):
    path = tiny_dirs["qwen3_5_text"]
    loaded = load_model(path, dtype=torch.float32)
    return path, loaded, *prompts_and_expected(path, loaded.config.vocab_size)


def run_staggered(engine: LLMEngine, prompts: list[list[int]]) -> list:
    """Submit two prompts, then more every few steps, until all finish."""
    params = SamplingParams(max_tokens=NEW, ignore_eos=True)
    pending, seqs, step = list(prompts), [], 0
    while pending or engine.has_unfinished():
        if pending and step % 3 == 0:
            for _ in range(2 if step == 0 else 3):
                if pending:
                    seqs.append(engine.add_request(pending.pop(0), params))
        engine.step()
        step += 1
    return seqs


def count_skipped_rows(engine: LLMEngine) -> list[int]:
    """A counter of the rows whose sequence ended while the step after them was queued."""
    count, postprocess = [0], engine.scheduler.postprocess

    def counted(batch, tokens):
        count[0] += sum(it.seq.is_finished for it in batch.items)
        return postprocess(batch, tokens)

    engine.scheduler.postprocess = counted
    return count


def count_continuations(engine: LLMEngine) -> list[int]:
    """A counter of the decode steps the engine queues before reading the step before's tokens."""
    count, launch = [0], engine.runner.launch

    def counted(batch, after=None, **kw):
        count[0] += after is not None
        return launch(batch, after, **kw)

    engine.runner.launch = counted
    return count


def mixed_prefills(engine: LLMEngine) -> list[int]:
    """The prefill tokens of each step that also decodes, as the engine schedules them."""
    sizes, schedule = [], engine.scheduler.schedule

    def recorded():
        batch = schedule()
        if any(it.seq.is_decoding for it in batch.items):
            sizes.append(sum(it.num_tokens for it in batch.items if not it.seq.is_decoding))
        return batch

    engine.scheduler.schedule = recorded
    return sizes


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"max_num_batched_tokens": 64},
        {"num_kv_blocks": 10, "max_num_batched_tokens": 256},
        {"max_step_ms": 1e-6},  # (a prefill beside decodes: one block a step)
    ],
    ids=["plain", "chunked", "preempted", "step-capped"],
)
def test_staggered_batch_matches_transformers(setup, overrides, async_scheduling):
    path, loaded, prompts, expected = setup
    engine = LLMEngine(EngineConfig(model=path, device="cpu", async_scheduling=async_scheduling,
                                    **overrides), loaded=loaded)
    continued, mixed = count_continuations(engine), mixed_prefills(engine)
    seqs = run_staggered(engine, prompts)
    for i, (seq, e) in enumerate(zip(seqs, expected)):
        assert seq.output_ids == e, f"prompt {i} ({LENGTHS[i]} tokens)"
    if "max_step_ms" in overrides:  # the late prompts joined while others decoded, a block a step
        assert max(mixed) == 64 and mixed.count(64) >= 6
    if "num_kv_blocks" in overrides:
        assert sum(s.num_preemptions for s in seqs) > 0
    assert (continued[0] > 10) == async_scheduling


def test_async_scheduling_survives_stops_and_aborts(setup):
    """A reply that ends on a stop token while the step after it is already queued, and one
    aborted while a step is queued, leave the other requests, the cache and later requests
    exactly as the synchronous engine does."""
    path, loaded, prompts, expected = setup
    stop_at = expected[0][12]
    cut = expected[0].index(stop_at) + 1  # the stop token ends the reply (and is its last)
    results = []
    for async_scheduling in (False, True):
        engine = LLMEngine(EngineConfig(model=path, device="cpu", async_scheduling=async_scheduling,
                                        checkpoint_interval=1), loaded=loaded)
        continued, skipped = count_continuations(engine), count_skipped_rows(engine)
        stopping = SamplingParams(max_tokens=NEW, stop_token_ids=(stop_at,))
        plain = SamplingParams(max_tokens=NEW, ignore_eos=True)
        outs = engine.generate(prompts[:2], [stopping, plain])
        assert outs[0].token_ids == expected[0][:cut] and outs[0].finish_reason == "stop"
        assert outs[1].token_ids == expected[1]
        assert (skipped[0] == 1) == async_scheduling  # the stopped reply's queued row
        stream = engine.stream(prompts[2], SamplingParams(max_tokens=NEW, ignore_eos=True))
        got = [t for _, event in zip(range(6), stream) for t in event.token_ids]
        assert (engine._ahead is not None) == async_scheduling
        stream.close()  # aborts the request, with a step queued in the async engine
        assert got == expected[2][: len(got)] and engine.scheduler.running == []
        # the stopped and aborted conversations, and a reply continued from the stopped one,
        # resume from what the cache kept
        again = engine.generate([prompts[0], prompts[2], prompts[0] + outs[0].token_ids],
                                SamplingParams(max_tokens=NEW, ignore_eos=True))
        assert [o.token_ids for o in again[:2]] == [expected[0], expected[2]]
        results.append([(o.token_ids, o.num_cached_tokens) for o in again])
        assert (continued[0] > 10) == async_scheduling
    assert results[0] == results[1]


def test_fast_decode_gives_the_tokenizers_text(setup):
    """The engine's detokenizer (the Rust backend, bypassing transformers' wrapper) returns
    exactly what the tokenizer's own decode does, special tokens and broken UTF-8 included."""
    from statechat.engine.output import fast_decode

    tokenizer = setup[1].tokenizer
    decode = fast_decode(tokenizer)
    g = torch.Generator().manual_seed(0)
    for n in [0, 1, 2, 3, 5, 8] * 50:
        ids = torch.randint(0, len(tokenizer), (n,), generator=g).tolist()
        assert decode(ids) == tokenizer.decode(ids, skip_special_tokens=True)


MIXED = [  # seeded sampling (temperature, top-k, top-p) next to a greedy row
    SamplingParams(max_tokens=NEW, temperature=0.8, top_k=20, top_p=0.9, seed=3, ignore_eos=True),
    SamplingParams(max_tokens=NEW, ignore_eos=True),
    SamplingParams(max_tokens=NEW, temperature=1.2, seed=5, ignore_eos=True),
]


def sync_and_async_outputs(path, loaded, prompts, **config) -> list[list[list[int]]]:
    """The MIXED requests' tokens from a synchronous engine, then from an async one (checked
    to have queued steps ahead)."""
    outs = []
    for async_scheduling in (False, True):
        engine = LLMEngine(EngineConfig(model=path, async_scheduling=async_scheduling, **config),
                           loaded=loaded)
        continued = count_continuations(engine)
        outs.append([o.token_ids for o in engine.generate(prompts[:3], MIXED)])
        assert (continued[0] > 10) == async_scheduling
        del engine  # its caches go before the next engine sizes its own from free memory
        gc.collect()
        torch.cuda.empty_cache()  # (back to the driver, whose free memory is what counts)
    return outs


def test_async_scheduling_samples_as_the_synchronous_engine(setup):
    """The async engine, whose queued steps take their input tokens from the step before on
    the device, draws exactly the synchronous engine's tokens."""
    path, loaded, prompts, _ = setup
    sync, overlapped = sync_and_async_outputs(path, loaded, prompts, device="cpu")
    assert sync == overlapped


def test_a_step_that_fails_after_its_read_ends_the_queued_sequences(setup):
    """A step that fails after reading its tokens (here the cache's persist) has already queued
    the step after it, which moved its sequences' states on: they end (abort), nothing stays
    queued, and the engine serves the next request exactly."""
    path, loaded, prompts, expected = setup
    config = EngineConfig(model=path, device="cpu", async_scheduling=True)
    engine = LLMEngine(config, loaded=loaded)
    seq = engine.add_request(prompts[0], SamplingParams(max_tokens=NEW, ignore_eos=True))
    while len(seq.output_ids) < 3:
        engine.step()
    assert engine._ahead is not None
    persist = engine.prefix.persist

    def failing(*args):
        raise OSError("disk full")

    engine.prefix.persist = failing
    with pytest.raises(OSError, match="disk full"):
        engine.step()
    engine.prefix.persist = persist
    assert seq.finish_reason == "abort" and engine._ahead is None and not engine.has_unfinished()
    out = engine.generate([prompts[1]], SamplingParams(max_tokens=NEW, ignore_eos=True))[0]
    assert out.token_ids == expected[1]
