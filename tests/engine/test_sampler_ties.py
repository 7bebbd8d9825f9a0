"""Equal logits, common in a bfloat16 model's (8 bits of mantissa over a vocabulary), are ranked
by token id (the lower first) wherever the sampler and the logprob tables rank tokens, as the
kernels rank them: so a seeded draw among its top-k under top-p takes the same tokens whatever
the top-k of the other rows of its steps (torch's topk orders equal values as its k happens to
make it), and a request's likeliest tokens are the same whatever the k of the requests beside
it."""

from __future__ import annotations

import torch

from statechat.config import EngineConfig
from statechat.engine.engine import LLMEngine
from statechat.engine.logprobs import logprob_table, unpack_logprobs
from statechat.engine.sampler import sample, top_k
from statechat.engine.sampling import SamplingParams
from statechat.model.loader import load_model

VOCAB = 384
SEEDS = 48


def tied_logits(rows: int = 1) -> torch.Tensor:
    """[rows, VOCAB] float32 logits of bfloat16 values: many pairs of equal ones."""
    x = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    return x.to(torch.bfloat16).float()


def test_top_k_ranks_equal_values_by_column():
    x = tied_logits(3)
    for k in (5, 20, 50, 100, VOCAB):
        values, cols = top_k(x, k)
        assert torch.equal(values, x.topk(k).values)
        order = torch.stack([torch.tensor(sorted(range(k), key=lambda j: (-values[r, j].item(),
                                                                           cols[r, j].item())))
                             for r in range(3)])
        assert torch.equal(cols, cols.gather(1, order)), k
        kth = values[:, -1:]
        outside = x.masked_fill(torch.zeros_like(x, dtype=torch.bool).scatter(1, cols, True), -1e9)
        # a value equal to the k-th left out has a larger column than every one taken
        left = (outside == kth).float() * torch.arange(VOCAB)
        taken = torch.where(values == kth, cols, -1).amax(1, keepdim=True)
        assert ((left == 0) | (left > taken)).all(), k


def test_a_seeded_top_p_draw_does_not_move_with_the_other_rows_top_k():
    """Rows of tied logits, each seeded, under top-k 20 and a top-p whose edge falls between
    two equal logits: the same tokens beside a row of top-k 19 (the step's candidates are 20)
    as beside one of top-k 60 or the whole vocabulary (the step's candidates are as many), the
    first of the two kept, by token id."""
    temperature = 4.0
    x = tied_logits()
    values, cols = x[0].sort(descending=True, stable=True)  # (equal ones by token id)
    probs = (values[:20] / temperature).softmax(-1)
    edge = next(j for j in range(19) if values[j] == values[j + 1])
    top_p = float(probs[:edge].sum() + probs[edge] / 2)  # keeps the first of the pair alone
    seeded = SamplingParams(temperature=temperature, top_k=20, top_p=top_p, seed=1)
    logits = x.expand(SEEDS + 1, VOCAB).contiguous()

    def draw(other_top_k: int) -> list[int]:
        params = [seeded] * SEEDS + [SamplingParams(temperature=1.0, top_k=other_top_k)]
        gens = [torch.Generator().manual_seed(s) for s in range(SEEDS)] + [None]
        return sample(logits, params, gens).tolist()[:SEEDS]

    drawn = draw(19)
    assert drawn == draw(60) == draw(VOCAB)
    assert int(cols[edge]) in drawn and int(cols[edge + 1]) not in drawn


def test_the_likeliest_tokens_do_not_move_with_the_other_requests_k():
    logits = tied_logits(2)
    tokens = torch.tensor([3, 4])
    few = [unpack_logprobs(row, 5)[1] for row in logprob_table(logits, tokens, [0, 1], 5).tolist()]
    many = [unpack_logprobs(row, 5)[1]
            for row in logprob_table(logits, tokens, [0, 1], 20).tolist()]
    assert few == many
    for top in few:
        assert top == sorted(top, key=lambda pair: (-pair[1], pair[0]))


def test_a_seeded_request_of_a_bfloat16_model_draws_alike_beside_any_top_k(tiny_dirs):
    """Through the engine, with a bfloat16 model's logits: a seeded request under top-k 20
    and top-p 0.5 makes the same reply beside a request of top-k 19 as beside one of top-k
    60 (before, it did not for most seeds: equal logits on the edge of its top-p set)."""
    path = tiny_dirs["qwen3_5_text"]
    loaded = load_model(path, dtype=torch.bfloat16, device="cpu")
    engine = LLMEngine(EngineConfig(model=path, device="cpu", dtype="bfloat16"), loaded=loaded)
    prompts = [[int(t) for t in torch.randint(0, VOCAB, (n,), generator=torch.Generator()
                                              .manual_seed(3))] for n in (20, 9)]
    for seed in range(3):
        seeded = SamplingParams(max_tokens=32, ignore_eos=True, temperature=1.0, top_k=20,
                                top_p=0.5, seed=seed)
        replies = [engine.generate(prompts, [seeded, SamplingParams(
            max_tokens=32, ignore_eos=True, temperature=1.0, top_k=other)])[0].token_ids
            for other in (19, 60)]
        assert replies[0] == replies[1], seed
