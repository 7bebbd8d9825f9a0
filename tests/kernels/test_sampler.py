"""The sampler's kernels give their references' results: penalised, temperature-scaled logits
(rows picked out of order through strided index columns, with and without the counts tables,
padding columns -inf); the same token drawn among candidates from the same noise under every
mix of top-k, min-p and top-p; and the same token drawn from the logits on, over a vocabulary
of several chunks, whose candidates the kernels gather chunk by chunk, and of bf16 logits
(equal ones ranked by token id in both); and the prompt scores
of rows of logits (each target's logprob and rank, the k likeliest), from float32 or bf16
logits of several chunks, as the reference gives them; and the same token drawn over the
whole vocabulary under min-p and top-p without a sort, from the race's candidates or, when
none of them is kept, by the exact search (equal logits on the edge of the top-p set kept in
token order; near-ties that make it halve, gather or bisect many times). Each kernel has
two forms: programs looping over several rows or chunks (persistent grids) compute the same
bits, scratch included, as one program per item (CUDA's grids)."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from kernels import reference
from kernels.sampler import (
    draw_candidates,
    penalize_logits,
    sample_top_k,
    sample_vocabulary,
    score_logits,
)

V = 300


def params_of(rows: list[tuple[float, float, float, float, float, float]], device) -> torch.Tensor:
    """[R, 6]: temperature, top-p (inf: off), log min-p (-inf: off), repetition, frequency,
    presence."""
    return torch.tensor(rows, dtype=torch.float32, device=device)


@pytest.mark.parametrize("with_counts", [True, False], ids=["penalties", "temperature-only"])
def test_penalize_logits(device, with_counts):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(5, V, generator=g) * 3).to(device)
    ints = torch.tensor([[4, 2, 0, 1], [0, 0, 0, 0], [2, 1, 0, 1]], device=device)  # (Rows' layout)
    params = params_of([(0.7, 1, 1, 1.3, 0.5, 1.5), (1.0, 1, 1, 1.0, 0.0, 0.0),
                        (2.0, 1, 1, 0.8, -0.4, -1.0)], device)
    counts = in_prompt = None
    if with_counts:
        counts = torch.randint(0, 3, (3, V), generator=g, dtype=torch.int32).to(device)
        counts[0] = 0  # (row 0: a request without penalties)
        in_prompt = (torch.rand(3, V, generator=g) < 0.2).to(device)
    got = penalize_logits(logits, ints[:, 0], ints[:, 1], params, counts, in_prompt, 320)
    want = reference.penalize_logits(logits, ints[:, 0], ints[:, 1], params, counts, in_prompt, 320)
    assert got.shape == (3, 320)
    assert torch.all(got[:, V:] == float("-inf"))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    if with_counts:  # (the penalties did something)
        plain = reference.penalize_logits(logits, ints[:, 0], ints[:, 1], params, None, None, V)
        assert not torch.allclose(got[:, :V], plain)


def test_draw_candidates(device):
    g = torch.Generator().manual_seed(1)
    R, K = 8, 37
    values = (torch.randn(R, K, generator=g) * 2).sort(dim=-1, descending=True).values.to(device)
    cols = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(R)]).to(device)
    inf = math.inf
    top_k = torch.tensor([[0, 0, 1, 0], [0, 0, 5, 0], [0, 0, K, 0], [0, 0, 20, 0],
                          [0, 0, 37, 0], [0, 0, 3, 0], [0, 0, 12, 0], [0, 0, 30, 0]],
                         device=device)[:, 2]  # (a strided column, as Rows holds it)
    params = params_of([(1, inf, -inf, 1, 0, 0), (1, 0.9, -inf, 1, 0, 0), (1, 0.5, -inf, 1, 0, 0),
                        (1, inf, math.log(0.1), 1, 0, 0), (1, 0.95, math.log(0.05), 1, 0, 0),
                        (1, 1e-6, -inf, 1, 0, 0), (1, inf, 0.0, 1, 0, 0), (1, 0.99, -inf, 1, 0, 0)],
                       device)
    for trial in range(20):
        noise = torch.empty(R, K).exponential_(1, generator=g).to(device)
        got = draw_candidates(values, cols, noise, top_k, params)
        want = reference.draw_candidates(values, cols, noise, top_k, params)
        assert torch.equal(got, want), trial
    # the rows that can only draw their likeliest token (top-k 1, a tiny top-p, min-p 1) do
    assert torch.equal(got[[0, 5, 6]], cols[[0, 5, 6], 0])


def test_candidates_that_swap_places_keep_their_draws(device):
    """A candidate's draw follows its token id, not its rank: two logits 1e-6 apart that swap
    places (another batch's rounding) draw the same token from the same noise, as does a row
    whose candidates come in another order. (Draws went by rank: a seeded reply changed with
    its batch from the first near-tie on, for 85 of 200 seeds in the case QA found.)"""
    g = torch.Generator().manual_seed(3)
    K, R = 5, 64
    base = torch.tensor([1.3526, 1.3526 - 1e-6, 0.9, 0.4, -0.2])
    swapped = base[[1, 0, 2, 3, 4]]  # (the two tied logits' places exchanged)
    ids = torch.tensor([240, 174, 12, 290, 55])
    values = torch.stack([base, swapped] * (R // 2)).to(device)
    cols = torch.stack([ids, ids[[1, 0, 2, 3, 4]]] * (R // 2)).to(device)
    top_k = torch.full((R,), K, device=device)
    params = params_of([(0.7, math.inf, -math.inf, 1, 0, 0)] * R, device)
    noise = torch.empty(R // 2, K).exponential_(1, generator=g).repeat_interleave(2, 0)
    for draw in (draw_candidates, reference.draw_candidates):
        got = draw(values, cols, noise.to(device), top_k, params).view(-1, 2)
        assert torch.equal(got[:, 0], got[:, 1]), draw.__module__
        assert len(set(got[:, 0].tolist())) > 2  # (draws, not the argmax)
    logits = torch.full((2, V), -30.0)  # the same from the logits on: sample_top_k
    logits[0, ids], logits[1, ids] = base, swapped
    rows = torch.arange(2, device=device)
    for draw in (sample_top_k, reference.sample_top_k):
        got = [draw(logits.to(device), rows, rows, params[:2], None, None, top_k[:2],
                    noise[2 * i:2 * i + 2].to(device)).tolist() for i in range(R // 2)]
        assert all(a == b for a, b in got), draw.__module__


def test_a_row_short_of_finite_logits_keeps_its_draws(device):
    """A row with fewer finite logits than its candidates draws by its finite ones' ids alone:
    which ids fill its -inf places (the lowest columns in the kernel, torch's top-k's choice
    in the reference) moves no draw, and kernel and reference agree."""
    g = torch.Generator().manual_seed(5)
    K, R = 6, 32
    values = torch.tensor([[2.0, 1.9, 1.0] + [-math.inf] * 3] * R, device=device)
    cols = torch.tensor([[40, 30, 50, 0, 1, 2], [40, 30, 50, 70, 71, 72]]
                        * (R // 2), device=device)
    top_k = torch.full((R,), K, device=device)
    params = params_of([(1, math.inf, -math.inf, 1, 0, 0)] * R, device)
    noise = torch.empty(R // 2, K).exponential_(1, generator=g).repeat_interleave(2, 0)
    for draw in (draw_candidates, reference.draw_candidates):
        got = draw(values, cols, noise.to(device), top_k, params).view(-1, 2)
        assert torch.equal(got[:, 0], got[:, 1]), draw.__module__
        assert len(set(got[:, 0].tolist())) == 3  # (draws among the finite three)
    logits = torch.full((R, V), -math.inf)
    logits[:, [40, 30, 50]] = torch.tensor([2.0, 1.9, 1.0])
    rows = torch.arange(R, device=device)
    args = (logits.to(device), rows, rows, params, None, None, top_k, noise.to(device))
    assert torch.equal(sample_top_k(*args), reference.sample_top_k(*args))


def test_sample_top_k_of_equal_logits(device):
    """bf16 logits (many equal) under top-p: the kernels and the reference rank equal logits
    by token id alike, so draw the same token from the same noise."""
    g = torch.Generator().manual_seed(6)
    logits = (torch.randn(1, V, generator=g) * 3).to(torch.bfloat16).float()
    logits = logits.expand(16, V).contiguous().to(device)
    rows = torch.arange(16, device=device)
    top_p = torch.linspace(0.1, 0.25, 16).tolist()  # (edges between equal logits among them)
    params = params_of([(4.0, p, -math.inf, 1, 0, 0) for p in top_p], device)
    top_k = torch.full((16,), 40, device=device)
    for trial in range(4):
        noise = torch.empty(16, 40).exponential_(1, generator=g).to(device)
        args = (logits, rows, rows, params, None, None, top_k, noise)
        assert torch.equal(sample_top_k(*args), reference.sample_top_k(*args)), trial


@pytest.mark.parametrize("K", [1, 7])
@pytest.mark.parametrize("V", [9000, 8195], ids=["short-last-chunk", "last-chunk-below-K"])
def test_sample_top_k(device, K, V):
    """Three chunks, the last one short (with fewer columns than K: 8195)."""
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(4, V, generator=g) * 2).to(device)
    logits[1, 4096:] -= 30  # (row 1's likeliest all in its first chunk)
    logits[3, 3:] = float("-inf")  # (row 3: fewer finite logits than K, all in one chunk)
    ints = torch.tensor([[3, 1, K, 1], [1, 0, 1, 0], [0, 2, max(1, K - 2), 1]], device=device)
    params = params_of([(0.7, 0.9, -math.inf, 1.2, 0.3, 0.5), (1.0, math.inf, -math.inf, 1, 0, 0),
                        (1.5, math.inf, math.log(0.05), 0.9, -0.2, 1.0)], device)
    counts = torch.randint(0, 3, (3, V), generator=g, dtype=torch.int32).to(device)
    counts[0] = 0
    in_prompt = (torch.rand(3, V, generator=g) < 0.1).to(device)
    for trial in range(8):
        noise = torch.empty(3, K).exponential_(1, generator=g).to(device)
        tables = (counts, in_prompt) if trial % 2 else (None, None)
        args = (logits, ints[:, 0], ints[:, 1], params, *tables, ints[:, 2], noise)
        got, want = sample_top_k(*args), reference.sample_top_k(*args)
        assert torch.equal(got, want), trial


@pytest.mark.parametrize("with_counts", [True, False], ids=["penalties", "no-penalties"])
def test_sample_vocabulary(device, with_counts):
    """Three chunks, the last one short; rows peaked, flat (a top-p of 0.05 keeps some 450
    tokens, often none of the 16 the race tests first, so the exact search runs), of bf16
    values (many equal logits), with -inf columns, with min-p, with a top-p below any token's
    mass, and at a temperature alone."""
    V, inf = 9000, math.inf
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(7, V, generator=g) * 3
    logits[1] = torch.randn(V, generator=g) * 0.1
    logits[2] = (torch.randn(V, generator=g) * 2).to(torch.bfloat16).float()
    logits[3, 50:] = float("-inf")
    logits = logits.to(device)
    ints = torch.tensor([[0, 1, 0, 1], [1, 0, 0, 0], [2, 2, 0, 1], [3, 0, 0, 0], [4, 1, 0, 1],
                         [5, 0, 0, 0], [6, 2, 0, 1]], device=device)
    params = params_of([(0.7, 0.9, -inf, 1.2, 0.3, 0.5), (1.0, 0.05, -inf, 1, 0, 0),
                        (1.0, 0.3, -inf, 0.9, -0.2, 1.0), (1.0, inf, -inf, 1, 0, 0),
                        (1.3, 0.95, math.log(0.05), 1, 0, 0), (0.5, 1e-6, -inf, 1, 0, 0),
                        (0.8, inf, -inf, 1.1, 0.1, 0.2)], device)
    counts = in_prompt = None
    if with_counts:
        counts = torch.randint(0, 3, (3, V), generator=g, dtype=torch.int32).to(device)
        counts[0] = 0
        in_prompt = (torch.rand(3, V, generator=g) < 0.1).to(device)
    for trial in range(6):
        noise = torch.empty(7, V).exponential_(1, generator=g).to(device)
        args = (logits, ints[:, 0], ints[:, 1], params, counts, in_prompt, noise)
        got, want = sample_vocabulary(*args), reference.sample_vocabulary(*args)
        assert torch.equal(got, want), trial
    assert int(got[5]) == int(logits[5].argmax())  # (a top-p below every token: the likeliest)
    assert int(got[3]) < 50


def test_sample_vocabulary_edge_of_top_p(device):
    """Twenty equal logits of 5 spread over three chunks, the rest 0: a top-p of 0.1 keeps the
    first nine of them by token id (the mass before the tenth reaches it). The noise gives the
    race to the eleven dropped ones and to the zeros, so no tested token is kept and the exact
    search draws: among the nine, the one of least noise."""
    V = 9000
    ties = torch.linspace(10, 8900, 20).long()
    logits = torch.zeros(1, V)
    logits[0, ties] = 5.0
    noise = torch.ones(1, V)
    noise[0, ties[:9]] = 1e6 * torch.arange(9, 0, -1).float()  # (least: the ninth)
    noise[0, ties[9:]] = 1e-6
    assert draw_one_row(logits, noise, 0.1, device) == (int(ties[8]),) * 2
    noise[0, ties[2]] = 1.0  # (now the third of the nine draws)
    assert draw_one_row(logits, noise, 0.1, device) == (int(ties[2]),) * 2


@pytest.mark.parametrize("cap,halvings", [(4096, 12), (32, 1)], ids=["gathered", "bisected"])
def test_sample_vocabulary_search_of_a_narrow_cluster(device, monkeypatch, cap, halvings):
    """Forty logits within 4e-5 of each other hold top-p's edge (0.021 keeps the likeliest
    token and the upper half of them); the race goes to dropped tokens far below (sixteen at
    -3); among the kept the one of least noise draws. The exact search's first pass shrinks
    its range to the forty and the likeliest; it gathers them into registers, or (with one
    halving and room for 32) bisects the keys pass by pass. (Triton 3.6 fails to compile the
    search with no halvings at all.)"""
    import kernels.sampler

    monkeypatch.setattr(kernels.sampler, "_CAP", cap)
    monkeypatch.setattr(kernels.sampler, "_HALVINGS", halvings)
    V = 9000
    logits = torch.full((1, V), -3.0)
    cluster = torch.arange(100, 140)
    logits[0, 7000] = 0.0
    logits[0, cluster] = -0.7 + torch.arange(40) * 1e-6
    noise = torch.ones(1, V)
    noise[0, 5000:5016] = 1e-9
    noise[0, cluster] = 1e3
    noise[0, 7000] = 1e3
    noise[0, cluster[30]] = 10.0
    assert draw_one_row(logits, noise, 0.0214, device) == (int(cluster[30]),) * 2


def test_sample_vocabulary_search_of_many_equal_logits(device):
    """More equal logits than the registers take (5,000 of 9,000) hold top-p's edge: the first
    pass that finds the edge among them shrinks the range to their one value. Kept: the two
    likeliest and the equal ones in token order while the mass before them stays below top-p."""
    V = 9000
    logits = torch.full((1, V), -1.0)
    equal = torch.arange(2000, 7000)
    logits[0, equal] = 0.0
    logits[0, [10, 8000]] = 2.0
    noise = torch.ones(1, V)
    noise[0, equal[2000:]] = 1e-6  # (the race: dropped ones, the equal ones past the edge)
    noise[0, equal[:2000]] = 1e3
    noise[0, [10, 8000]] = 1e3
    noise[0, equal[1234]] = 100.0
    assert draw_one_row(logits, noise, 0.3, device) == (int(equal[1234]),) * 2


def test_sample_vocabulary_search_shrinks_to_the_keys_it_holds(device):
    """One token at 0, 1,000 equal logits at -3 (top-p 0.127 keeps the first 484 of them),
    7,999 at -4; the race goes to tokens at -4. The search's first pass finds the mass below
    its middle and shrinks its top to -3's key, the second finds it above and shrinks its
    bottom to the same key: the search ends there, the 484 kept in token order."""
    V = 9000
    logits = torch.full((1, V), -4.0)
    equal = torch.arange(1000, 2000)
    logits[0, 0] = 0.0
    logits[0, equal] = -3.0
    noise = torch.ones(1, V)
    noise[0, 2500:2520] = 1e-12
    noise[0, equal[484:]] = 1e-6  # (past the edge)
    noise[0, 0] = 1e3
    noise[0, equal[123]] = 0.5
    assert draw_one_row(logits, noise, 0.127, device) == (int(equal[123]),) * 2
    noise[0, equal[483]] = 0.01  # (the last one kept)
    assert draw_one_row(logits, noise, 0.127, device) == (int(equal[483]),) * 2


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # (the interpreter's numpy: inf - inf)
def test_sample_vocabulary_of_small_and_degenerate_rows(device):
    """A vocabulary of 12 (one chunk, fewer tokens than the 16 the race tests), rows taken out
    of order, one all -inf (token 0, as the reference's argmax of NaN gives); and min-p alone
    keeping 3 tokens of a flat 9,000, so the race's first 16 draws fall to dropped ones and
    the exact search runs with top-p off."""
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(3, 12, generator=g) * 2
    logits[1] = float("-inf")
    rows = torch.tensor([2, 1, 0], device=device)
    params = params_of([(0.9, 0.7, -math.inf, 1, 0, 0), (1.0, 0.5, -math.inf, 1, 0, 0),
                        (1.2, math.inf, math.log(0.3), 1, 0, 0)], device)
    for trial in range(5):
        noise = torch.empty(3, 12).exponential_(1, generator=g).to(device)
        args = (logits.to(device), rows, rows, params, None, None, noise)
        got, want = sample_vocabulary(*args), reference.sample_vocabulary(*args)
        assert torch.equal(got, want), trial
        assert int(got[1]) == 0
    flat = torch.randn(1, 9000, generator=g) * 0.05
    flat[0, [5, 4500, 8999]] = 1.0
    params = params_of([(1.0, math.inf, math.log(0.5), 1, 0, 0)], device)
    one = torch.zeros(1, dtype=torch.int64, device=device)
    for trial in range(5):
        noise = torch.empty(1, 9000).exponential_(1, generator=g).to(device)
        args = (flat.to(device), one, one, params, None, None, noise)
        got = int(sample_vocabulary(*args))
        assert got == int(reference.sample_vocabulary(*args)) and got in (5, 4500, 8999), trial


def draw_one_row(logits: torch.Tensor, noise: torch.Tensor, top_p: float,
                 device) -> tuple[int, int]:
    """(the kernels' token, the reference's) for one row at temperature 1 under `top_p`."""
    params = params_of([(1.0, top_p, -math.inf, 1, 0, 0)], device)
    rows = torch.zeros(1, dtype=torch.int64, device=device)
    args = (logits.to(device), rows, rows, params, None, None, noise.to(device))
    return int(sample_vocabulary(*args)), int(reference.sample_vocabulary(*args))


@pytest.mark.parametrize("k", [0, 3, 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_score_logits(device, k, dtype):
    """Rows of a wider buffer (row stride past V), three chunks of 4096 with a short last one;
    a target that is its row's likeliest (rank 1), one in the last chunk, a row whose likeliest
    lie in one chunk, a row with -inf logits."""
    V = 9000
    g = torch.Generator().manual_seed(4)
    logits = (torch.randn(5, V + 100, generator=g) * 3).to(dtype).to(device)[:, :V]
    logits[1, 4096:] -= 30
    logits[4, 100:200] = float("-inf")
    targets = torch.tensor([5, 8999, 4000, 0, 150], device=device)
    targets[0] = logits[0].float().argmax()
    got, want = score_logits(logits, targets, k), reference.score_logits(logits, targets, k)
    assert got.shape == want.shape == (5, 2 + 2 * k)
    assert torch.allclose(got[:, : 1 + k], want[:, : 1 + k], atol=1e-4, rtol=0)  # logprobs
    assert torch.equal(got[:, -1], want[:, -1])  # ranks
    ids = got[:, 1 + k : 1 + 2 * k].long()  # (equal values, bf16's, by token id in both)
    assert torch.equal(ids, want[:, 1 + k : 1 + 2 * k].long())
    logp = logits.float().log_softmax(-1).clamp_min(-9999)
    assert torch.allclose(logp.gather(1, ids), got[:, 1 : 1 + k], atol=1e-4, rtol=0)
    assert all(len(set(row.tolist())) == k for row in ids)
    assert got[0, -1] == 1 and got[4, 0] == -9999  # (the likeliest; a -inf one's stand-in)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # (the interpreter's numpy: inf - inf)
def test_score_logits_of_rows_with_few_finite_logits(device):
    """Fewer finite logits than k: the top lists name each column once (the -inf ones lowest
    first, as -9999); a row with none reads -9999 everywhere, as the reference does."""
    logits = torch.full((2, 5000), float("-inf"), device=device)
    logits[0, 4] = 1.0
    logits[0, 4500] = 2.0
    got = score_logits(logits, torch.tensor([4, 7], device=device), 4)
    want = reference.score_logits(logits, torch.tensor([4, 7], device=device), 4)
    assert got[0, 5:9].long().tolist() == [4500, 4, 0, 1]
    assert got[0, :5].tolist() == pytest.approx(want[0, :5].tolist(), abs=1e-5)
    assert got[0, -1] == want[0, -1] == 2
    assert torch.equal(got[1, :5], want[1, :5]) and (got[1, :5] == -9999).all()


@pytest.mark.parametrize("cap,halvings", [(4096, 12), (64, 2), (4, 12)],
                         ids=["gathered", "bisected", "halved-then-gathered"])
def test_sample_vocabulary_search_of_near_ties(device, monkeypatch, cap, halvings):
    """Rows of near-ties (logits 1e-5 apart at most, or a few values 1e-6 apart, or an even
    spread of 1e-3) whose top-p edges no tested token reaches: the exact search halves,
    gathers or bisects many times (its loops have fixed trip counts, the trips after its end
    masked) and draws what the reference draws."""
    import kernels.sampler

    monkeypatch.setattr(kernels.sampler, "_CAP", cap)
    monkeypatch.setattr(kernels.sampler, "_HALVINGS", halvings)
    g = torch.Generator().manual_seed(8)
    V = 9000
    logits = torch.stack([torch.randn(V, generator=g) * 1e-5,
                          torch.randint(0, 4, (V,), generator=g).float() * 1e-6,
                          torch.linspace(0, 1e-3, V)[torch.randperm(V, generator=g)]])
    params = params_of([(1.0, 0.37, -math.inf, 1, 0, 0), (1.0, 0.2, -math.inf, 1, 0, 0),
                        (1.0, 0.61, -math.inf, 1, 0, 0)], device)
    rows = torch.arange(3, device=device)
    for trial in range(2):
        noise = torch.empty(3, V).exponential_(1, generator=g).to(device)
        args = (logits.to(device), rows, rows, params, None, None, noise)
        assert torch.equal(sample_vocabulary(*args), reference.sample_vocabulary(*args)), trial


def _sampler_ops(device):
    """Every sampler op over rows of different params and a vocabulary of 3 chunks (9 to 12
    items a chunk kernel); the vocabulary's rows send the exact search through its paths."""
    g = torch.Generator().manual_seed(9)
    V, R, inf = 9000, 4, math.inf
    logits = torch.stack([torch.randn(V, generator=g) * 3, torch.randn(V, generator=g) * 0.1,
                          (torch.randn(V, generator=g) * 2).to(torch.bfloat16).float(),
                          torch.randn(V, generator=g) * 1e-5]).to(device)
    rows = torch.tensor([2, 0, 3, 1], device=device)
    params = params_of([(0.7, 0.9, -inf, 1.2, 0.3, 0.5), (1.0, 0.01, -inf, 1, 0, 0),
                        (1.0, 0.002, -inf, 1, 0, 0), (1.3, 0.5, math.log(0.05), 0.9, -0.2, 1.0)],
                       device)
    counts = torch.randint(0, 3, (R, V), generator=g, dtype=torch.int32).to(device)
    in_prompt = (torch.rand(R, V, generator=g) < 0.1).to(device)
    noise = torch.empty(R, V).exponential_(1, generator=g)
    for i in (1, 2):  # (the race to dropped tokens: the exact search draws)
        noise[i, logits[rows[i]].topk(300).indices.cpu()] = 1e3
    noise, top_k = noise.to(device), torch.tensor([1, 5, 12, 3], device=device)  # (1: greedy)
    values = (torch.randn(11, 37, generator=g) * 2).sort(dim=-1, descending=True).values
    cols = torch.stack([torch.randperm(V, generator=g)[:37] for _ in range(11)])
    args = (logits, rows, rows, params, counts, in_prompt)
    return (penalize_logits(*args, V + 100),
            draw_candidates(values.to(device), cols.to(device), noise[:, :37].repeat(3, 1)[:11],
                            torch.arange(11, device=device) * 3 + 1, params.repeat(3, 1)[:11]),
            sample_top_k(*args, top_k, noise[:, :12].contiguous()),
            sample_vocabulary(*args, noise),
            score_logits(logits, torch.tensor([5, 8999, 4000, 0], device=device), 3))


def _run_sampler(device, per_core, monkeypatch):
    """_sampler_ops' outputs, every tensor its kernels were given as it was after each launch
    (the scratch a later kernel reads), and each launch's grid and LOOP, with one core of
    `per_core` programs (None: one program per item, as on CUDA). Scratch starts zeroed, so
    that parts never written compare equal."""
    from kernels import hw, sampler

    grids, seen, scratch = [], [], sampler._race_scratch

    def spy(kernel, grid, *args, **kwargs):
        grids.append((grid, kwargs["LOOP"]))
        hw.launch(kernel, grid, *args, **kwargs)
        seen.extend(a.clone() for a in args if isinstance(a, torch.Tensor))

    monkeypatch.setattr(sampler, "launch", spy)
    monkeypatch.setattr(sampler, "_race_scratch", lambda *a: [t.zero_() for t in scratch(*a)])
    monkeypatch.setattr(sampler, "_CAP", 16)  # (the search gathers one row, bisects another)
    monkeypatch.setattr(sampler, "_HALVINGS", 1)
    monkeypatch.setattr(hw, "ITEM_PROGRAMS_PER_CORE", {"cuda": per_core, "other": per_core})
    monkeypatch.setattr(hw, "num_cores", lambda device: 1)  # (the sampler reads no other)
    return (*_sampler_ops(device), *seen), grids


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # (the interpreter's numpy: inf - inf)
def test_sampler_programs_looping_over_items_compute_what_one_program_per_item_does(
    device, monkeypatch
):
    """Each of the sampler's kernels has two forms (kernels.hw.persistent_grid): one program
    per item (LOOP False, CUDA's: rows, or rows x chunks on two axes) and, with one core of 3
    programs, programs looping over items that do not divide evenly (LOOP True, as on Ascend:
    one axis, a row's chunks adjacent items). Every output and every scratch tensor a later
    kernel reads is bit-identical between them (tests/kernels/test_persistent.py's pattern)."""
    whole, item_launches = _run_sampler(device, None, monkeypatch)
    looped, launches = _run_sampler(device, 3, monkeypatch)
    item_grids, grids = [g for g, _ in item_launches], [g for g, _ in launches]
    items = [math.prod(g) for g in item_grids]
    assert [g for g in grids] == [(min(n, 3),) for n in items]  # one axis: items in the loop
    assert any(len(g) == 2 for g in item_grids)  # (rows x chunks)
    assert max(items) >= 9  # programs did loop, several times
    assert not any(loop for _, loop in item_launches)  # both forms of every kernel ran
    assert all(loop for _, loop in launches)
    assert len(whole) == len(looped)
    for a, b in zip(whole, looped, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
