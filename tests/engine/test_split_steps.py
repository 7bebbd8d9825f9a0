"""A step of several sequences that no single graph replays (decodes beside a prompt's chunk, or
chunks of a few prompts) replays the decode graph and each chunk's prefill graph in turn
(GraphReplay._replay_split) instead of running eagerly. On the CPU, with stand-in graphs: which
steps split, and the rows put back in item order though each replay reuses its output buffer.
Through a CPU engine whose "graphs" are eager forwards of each part, and on a GPU: such
steps give the tokens, logprobs and cache reuse of eager steps."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest
import torch

from statechat.config import EngineConfig
from statechat.engine.engine import LLMEngine
from statechat.engine.replay import MAX_SPLIT_CHUNKS, GraphReplay
from statechat.engine.sampling import SamplingParams
from statechat.engine.scheduler import Batch

VOCAB = 7


def item(decoding: bool, tokens: int = 1, blocks: int = 2, logits: bool = True):
    seq = SimpleNamespace(is_decoding=decoding, block_table=[0] * blocks,
                          row_value=torch.zeros(VOCAB))
    return SimpleNamespace(seq=seq, num_tokens=tokens, needs_logits=logits)


class StandIn(GraphReplay):
    """GraphReplay over stand-in graphs: a decode graph for up to 4 rows, prefill buckets for
    chunks of up to 128 tokens. Each replay writes its rows' `row_value` into the one output
    buffer of its kind, as a graph writes its static buffer, and logs itself."""

    def __init__(self, max_decodes: int = 4):
        self.device = torch.device("cpu")
        self.replayed: list[str] = []
        self.graphs = SimpleNamespace(can_run=lambda n, width: n <= max_decodes and width <= 8)
        self.prefill_graphs = SimpleNamespace(
            bucket=lambda n, width: 192 if n <= 128 and width <= 8 else None,
            packed_bucket=lambda lens, width: None, ready=lambda key: True)
        self.decode_out = torch.zeros(max_decodes, VOCAB)
        self.prefill_out = torch.zeros(1, VOCAB)

    def _tensor(self, data, dtype):
        return torch.tensor(data, dtype=dtype)

    def _replay_decode(self, batch, feed, follows):
        self.replayed.append(f"decode x{len(batch.items)}")
        n = len(batch.items)
        for j, it in enumerate(batch.items):
            self.decode_out[j] = it.seq.row_value
        return self.decode_out[:n], self.decode_out[:n].argmax(-1)

    def _replay_prefill(self, it, bucket):
        self.replayed.append(f"prefill {it.num_tokens}")
        self.prefill_out[0] = it.seq.row_value
        return self.prefill_out, self.prefill_out.argmax(-1)


def test_which_steps_split():
    runner = StandIn()
    assert runner._split_buckets(Batch([item(True), item(True)])) is None  # (a decode step)
    assert runner._split_buckets(Batch([item(False, 100)])) is None  # (one graph serves it)
    assert runner._split_buckets(Batch([item(True), item(False, 100)])) == [None, 192]
    assert runner._split_buckets(Batch([item(False, 100), item(False, 5)])) == [192, 192]
    assert runner._split_buckets(Batch([item(True), item(False, 500)])) is None  # (no bucket)
    assert runner._split_buckets(Batch([item(True)] * 5 + [item(False, 9)])) is None
    assert runner._split_buckets(Batch([item(True, blocks=9), item(False, 9)])) is None
    chunks = [item(False, 9) for _ in range(MAX_SPLIT_CHUNKS + 1)]
    assert runner._split_buckets(Batch(chunks[:-1])) == [192] * MAX_SPLIT_CHUNKS
    assert runner._split_buckets(Batch(chunks)) is None
    runner.graphs = None  # (no decode graphs: decodes beside chunks run eagerly)
    assert runner._split_buckets(Batch([item(True), item(False, 9)])) is None
    assert runner._split_buckets(Batch([item(False, 9), item(False, 9)])) == [192, 192]
    runner.prefill_graphs = None
    assert runner._split_buckets(Batch([item(False, 9), item(False, 9)])) is None


def test_split_rows_come_back_in_item_order():
    """Decodes and chunks interleaved; two chunks sample (one mid-prompt does not) and write
    the same prefill buffer in turn: each row is the value its own replay wrote."""
    runner = StandIn()
    items = [item(False, 100), item(True), item(False, 30, logits=False), item(True),
             item(False, 7)]
    for k, it in enumerate(items):
        it.seq.row_value = torch.full((VOCAB,), float(k))
        it.seq.row_value[k] = 10.0 + k  # (its argmax: k)
    logits, greedy = runner._replay_split(Batch(items), runner._split_buckets(Batch(items)))
    assert runner.replayed == ["decode x2", "prefill 100", "prefill 30", "prefill 7"]
    sampled = [0, 1, 3, 4]
    assert greedy.tolist() == sampled
    assert torch.equal(logits, torch.stack([items[k].seq.row_value for k in sampled]))


def test_a_split_step_whose_chunks_all_stop_mid_prompt_samples_nothing():
    runner = StandIn()
    items = [item(False, 64, logits=False), item(False, 64, logits=False)]
    assert runner._replay_split(Batch(items), [192, 192]) == (None, None)
    assert runner.replayed == ["prefill 64", "prefill 64"]


def eager_parts(runner, max_decodes: int = 4) -> list[str]:
    """Make a CPU runner split steps as one with graphs does (_split_buckets, _replay_split),
    each "graph" an eager forward of its part (the decodes, or one chunk) whose logits go into
    one buffer of its kind, overwritten by the next such replay. Returns the replays' log."""
    vocab = runner.loaded.config.vocab_size
    out = {"decode": torch.empty(max_decodes, vocab), "prefill": torch.empty(1, vocab)}
    replayed: list[str] = []
    runner.graphs = SimpleNamespace(can_run=lambda n, width: n <= max_decodes, replays=0)
    runner.prefill_graphs = SimpleNamespace(bucket=lambda n, width: 192 if n <= 128 else None,
                                            packed_bucket=lambda lens, width: None,
                                            ready=lambda key: True)

    def replay(kind: str, batch: Batch, feed=None):
        ids, ctx = runner.prepare(batch)
        logits = runner.model(feed if feed is not None else ids, ctx, runner.caches)
        buf = out[kind][: max(len(logits), 1)]
        buf.fill_(float("nan"))  # (a chunk that samples nothing: no row to read)
        buf[: len(logits)] = logits
        replayed.append(kind)
        return buf, buf.argmax(-1)

    def replay_decode(batch, feed, follows):
        assert all(it.seq.is_decoding for it in batch.items)
        runner.graphs.replays += 1
        return replay("decode", batch, feed)

    runner._replay_decode = replay_decode
    runner._replay_prefill = lambda it, bucket: replay("prefill", Batch([it]))
    return replayed


def test_split_steps_sample_as_eager_steps_on_the_cpu(tiny_dirs):
    """Decodes beside one or two prompts' chunks, with every kind of sampling work (seeds,
    logprobs, penalties, logit bias and min_tokens) and preemptions that resume a reply from
    the prefix cache: the split steps give the tokens and logprobs of eager steps, and leave
    the pools as they do."""
    from statechat.model.loader import load_model
    from tests.helpers import assert_idle_pools, cpu_engine

    loaded = load_model(tiny_dirs["qwen3_5_text"], dtype=torch.float32)
    g = torch.Generator().manual_seed(17)
    base = torch.randint(3, 300, (200,), generator=g).tolist()
    prompts = [base] + [(base[:150] if k % 2 else []) + torch.randint(3, 300, (n,),
                                                                      generator=g).tolist()
                        for k, n in enumerate([5, 40, 70, 130, 9, 64, 1, 100])]
    params = PARAMS + [SamplingParams(max_tokens=12, min_tokens=8, logit_bias={5: 3.0}),
                       SamplingParams(max_tokens=12, repetition_penalty=1.3)]
    runs, replayed = {}, []
    for split in (True, False):
        engine = cpu_engine(loaded, max_model_len=512, num_kv_blocks=9, num_state_slots=12,
                            max_num_seqs=6, max_num_batched_tokens=128)
        if split:
            replayed = eager_parts(engine.runner)
        seqs, pending, step = [], list(prompts), 0
        while pending or engine.has_unfinished():
            for _ in range(1 if step < 4 else 2) if step % 2 == 0 else ():
                if pending:  # (later two at once: steps of two prompts' last chunks)
                    seqs.append(engine.add_request(pending.pop(0),
                                                   params[len(seqs) % len(params)]))
            engine.step()
            step += 1
        assert_idle_pools(engine)
        runs[split] = [(s.output_ids, s.num_cached_tokens, s.num_preemptions,
                        [(round(lp, 4), [t for t, _ in top]) for lp, top in s.logprobs])
                       for s in seqs]
        if split:
            assert engine.runner.split_steps >= 3
    assert runs[True] == runs[False]
    assert "decode" in replayed and "prefill" in replayed
    assert any(preempted for _, _, preempted, _ in runs[True])


# --- on a GPU -----------------------------------------------------------------------------

PARAMS = [  # greedy, seeded draws, logprobs and a penalty: every kind of sampling work
    SamplingParams(max_tokens=12, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=4, ignore_eos=True),
    SamplingParams(max_tokens=12, logprobs=3, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=1.1, top_k=30, seed=9, presence_penalty=0.5,
                   ignore_eos=True),
]


def staggered(engine: LLMEngine, prompts: list[list[int]]) -> list:
    """Start one prompt, then add the others two steps apart while the first decode, some
    resuming the first one's prefix: steps of decodes beside one or two prompts' chunks."""
    seqs, pending, step = [], list(prompts), 0
    while pending or engine.has_unfinished():
        if pending and step % 2 == 0:
            for _ in range(1 if step < 4 else 2):
                if pending:
                    k = len(seqs)
                    seqs.append(engine.add_request(pending.pop(0), PARAMS[k % len(PARAMS)]))
        engine.step()
        step += 1
    return [(s.output_ids, s.num_cached_tokens, s.logprobs) for s in seqs]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_split_steps_match_eager_steps(tiny_dirs):
    from statechat.model.loader import load_model

    path = tiny_dirs["qwen3_5_text"]
    loaded = load_model(path, dtype=torch.float32, device="cuda")
    g = torch.Generator().manual_seed(17)
    base = torch.randint(3, loaded.config.vocab_size, (200,), generator=g).tolist()
    prompts = [base] + [
        (base[:150] if k % 2 else []) + torch.randint(3, loaded.config.vocab_size, (n,),
                                                      generator=g).tolist()
        for k, n in enumerate([5, 40, 70, 130, 9, 64])]
    runs = {}
    for graphs in (True, False):
        engine = LLMEngine(EngineConfig(model=path, device="cuda", dtype="float32",
                                        use_graphs=graphs, max_num_batched_tokens=256),
                           loaded=loaded)
        runs[graphs] = staggered(engine, prompts)
        if graphs:
            assert engine.runner.split_steps >= 3
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    for (ids, cached, logprobs), (ids_e, cached_e, logprobs_e) in zip(runs[True], runs[False]):
        assert ids == ids_e and cached == cached_e
        assert len(logprobs) == len(logprobs_e)
        for (lp, top), (lp_e, top_e) in zip(logprobs, logprobs_e):
            assert lp == pytest.approx(lp_e, abs=1e-4)
            assert [t for t, _ in top] == [t for t, _ in top_e]
            assert [v for _, v in top] == pytest.approx([v for _, v in top_e], abs=1e-4)
    assert any(cached for _, cached, _ in runs[True])
