"""The sampler's pieces on made-up logits: the chunked top-k gives torch's top-k for rows as
long as a real vocabulary; drawing among a row's top-k candidates uses exactly the
probabilities the whole-vocabulary path gives (temperature, top-k, min-p and top-p together);
a logprob table with several k unpacks into each request's own; rows of every kind drawn
together draw what each draws alone; and the runner's warm-up leaves its caches as they were
(but the pad slot)."""

from __future__ import annotations

import pytest
import torch

from kernels import gdn_chunk
from kernels.attention import split_widths
from statechat.engine import sampler, warmup
from statechat.engine.logprobs import logprob_table, unpack_logprobs
from statechat.engine.runner import ModelRunner
from statechat.engine.sampler import distribution, sample, top_k
from statechat.engine.sampling import SamplingParams
from statechat.engine.token_counts import TokenCounts
from statechat.model.loader import load_model

VOCAB = 248320  # Qwen3.5's (not a multiple of the chunk)


@pytest.mark.parametrize("k", [0, 1, 5, 20, 1024])
def test_chunked_top_k_is_torchs(k):
    x = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(k))
    values, cols = top_k(x, k)
    want = x.topk(k, dim=-1)
    assert torch.equal(values, want.values)
    assert torch.equal(x.gather(1, cols), values)  # (the columns hold those values)


ROWS = [
    SamplingParams(temperature=0.7, top_k=20, top_p=0.9),
    SamplingParams(temperature=1.3, top_k=50, min_p=0.05),
    SamplingParams(temperature=0.5, top_k=5, top_p=0.5, min_p=0.2),
    SamplingParams(temperature=2.0, top_k=1000),
]


def test_candidates_give_the_whole_vocabularys_probabilities(monkeypatch):
    x = torch.randn(len(ROWS), 4096, generator=torch.Generator().manual_seed(0)) * 4
    probs, cols = distribution(x, ROWS)
    assert cols is not None and probs.shape == (len(ROWS), 1000)
    monkeypatch.setattr(sampler, "CANDIDATES", 0)  # every row over the whole vocabulary
    whole, none = distribution(x, ROWS)
    assert none is None
    spread = torch.zeros_like(whole).scatter(1, cols, probs)
    torch.testing.assert_close(spread, whole, atol=1e-6, rtol=1e-5)
    kept = (whole > 0).sum(-1)
    assert kept.tolist()[0] < 20 and all(1 <= n <= k.top_k for n, k in zip(kept.tolist(), ROWS))


def test_a_logprob_table_of_several_k():
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(1))
    tokens = torch.tensor([7, 8, 9])
    table = logprob_table(logits, tokens, [0, 2], 4).tolist()
    want = logits.log_softmax(-1)
    for row, i, k in zip(table, [0, 2], [4, 1]):
        lp, top = unpack_logprobs(row, k)
        assert lp == pytest.approx(want[i, tokens[i]].item(), abs=1e-6)
        values, ids = want[i].topk(k)
        assert [t for t, _ in top] == ids.tolist()
        assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-6)


@pytest.mark.parametrize("k", [0, 3], ids=["whole", "candidates"])
def test_top_p_keeps_the_smallest_set_reaching_it(k):
    """As vLLM's and transformers': a token goes once the tokens before it reach top_p."""
    x = torch.tensor([[0.5, 0.25, 0.25, 0.0]]).log()
    for top_p, kept in [(0.5, 1), (0.75, 2), (0.76, 3), (1.0, 3)]:
        probs, _ = distribution(x, [SamplingParams(temperature=1.0, top_p=top_p, top_k=k)])
        assert int((probs > 0).sum()) == kept, top_p


def test_rows_of_every_kind_drawn_together_draw_as_alone():
    """A penalised argmax, a penalised argmax under a repetition penalty, a draw among a top-k
    of 100 and one under a top-k of 2000 with top-p (seeded), each with a counts row: drawn
    in one step, each row gets the token it gets alone (each group reads its own rows)."""
    vocab = 3000
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0)) * 3
    params = [SamplingParams(presence_penalty=1.5), SamplingParams(repetition_penalty=1.3),
              SamplingParams(temperature=1.0, top_k=100, seed=1),
              SamplingParams(temperature=1.0, top_k=2000, top_p=0.9, seed=2)]

    def draw(rows: list[int]) -> list[int]:
        table = TokenCounts(vocab, torch.device("cpu"))
        counted = [table.row(i, [int(logits[i].argmax())], [int(logits[i].topk(2).indices[1])])
                   for i in rows]
        generators = [torch.Generator().manual_seed(params[i].seed) if params[i].seed else None
                      for i in rows]
        return sample(logits[rows], [params[i] for i in rows], generators, None,
                      (table, counted)).tolist()

    assert draw([0, 1, 2, 3]) == [draw([i])[0] for i in range(4)]


def test_warm_up_leaves_the_caches_but_the_pad_slot(tiny_dirs):
    """On the CPU the engine skips it; run here, it draws, copies and runs the eager forwards
    an accelerator's would, touching no cache slot but the pad slot, and no KV."""
    loaded = load_model(tiny_dirs["qwen3_5_text"], dtype=torch.float32, device="cpu")
    runner = ModelRunner(loaded, 8, 6, 64)
    for pool in runner.caches.conv + runner.caches.ssm:
        pool.normal_()
    before = [pool.clone() for pool in runner.caches.conv + runner.caches.ssm]
    kv = [t.clone() for t in runner.caches.k + runner.caches.v]
    forwards, model = [], runner.model

    def counting(ids, ctx, caches):
        forwards.append((len(ctx.state_src), ids.shape[0], ctx.block_tables.shape[1]))
        return model(ids, ctx, caches)

    runner.model = counting
    runner.warm_up(max_seqs=8, max_tokens=300, max_blocks=40)
    cache = runner.caches.k[0]  # [blocks, block_size, Hkv, D]
    heads = loaded.config.num_attention_heads
    chunk, token = (torch.empty(n, heads, cache.shape[3]) for n in (64, 1))
    chunk_widths, decode_widths = (split_widths(q, cache.shape[2], 40) for q in (chunk, token))
    assert len(decode_widths) > 1 and len(chunk_widths) > 1  # (split forms to build)
    # one forward per GDN state tile (on the CPU every count takes one: see test_gdn); without
    # prefill graphs, one of a step's most tokens (the conv's and prepare's large tiles) and a
    # chunk over a context of each width of another attention form; without decode graphs a
    # decode step of one sequence at each width, and one of two sequences
    assert forwards == [(1, 64, 1), (1, 256, 4), *((1, 64, w) for w in chunk_widths[1:]),
                        *((1, 1, w) for w in decode_widths), (2, 2, 1)]
    for was, pool in zip(before, runner.caches.conv + runner.caches.ssm):
        assert torch.equal(pool[: runner.pad_slot], was[: runner.pad_slot])
        assert not torch.equal(pool[runner.pad_slot], was[runner.pad_slot])
    assert all(torch.equal(a, b) for a, b in zip(kv, runner.caches.k + runner.caches.v))
    forwards.clear()
    runner.prefill_graphs = runner.graphs = object()  # (their captures build those)
    runner.warm_up(max_seqs=8, max_tokens=300, max_blocks=40)
    assert forwards == [(1, 64, 1)]


def test_warm_up_goes_on_without_the_eager_steps_that_do_not_fit(tiny_dirs, monkeypatch, caplog):
    """An eager forward that runs out of memory at start is said once, in a warning, and the
    warm-up goes on to the sampler without the larger forwards."""
    loaded = load_model(tiny_dirs["qwen3_5_text"], dtype=torch.float32, device="cpu")
    runner = ModelRunner(loaded, 8, 6, 64)
    tried = []

    def forward(runner, n, length, width):
        tried.append((n, length))
        if n == 3:
            raise torch.OutOfMemoryError("no room")

    monkeypatch.setattr(warmup, "warm_forward", forward)
    monkeypatch.setattr(gdn_chunk, "state_tile_counts", lambda *a: [1, 3, 8])
    drawn, real = [], warmup.sample
    monkeypatch.setattr(warmup, "sample", lambda *a, **k: drawn.append(1) or real(*a, **k))
    with caplog.at_level("WARNING", logger="statechat.engine"):
        runner.warm_up(max_seqs=8, max_tokens=512)
    assert tried == [(1, 64), (3, 64)] and drawn  # (the step of 512 tokens not tried either)
    assert "no memory for an eager step of 192 tokens" in caplog.text
