"""The first token drawn through the engine follows the distribution vLLM's sampling defines,
computed here in plain torch from transformers' logits of the prompt: the temperature divides
the logits (after the logit bias and the repetition penalty, which reaches the prompt's tokens;
the presence and frequency penalties reach only generated ones, so none here), top-k keeps the
k likeliest, min-p the tokens at least min_p times as likely as the likeliest, and top-p the
smallest set of the likeliest whose mass reaches top_p. Each case draws a first token for many
identical requests, each with its own seed, in one generate call (each sampler path: the whole
vocabulary, with and without top-p; a top-k of at most 64, one above it, one above the
candidates' 1024), then a chi-square test of the counts (a token of probability 0 never
drawn). Each case also shows the test has the power to fail: the same counts are refused
against the distribution of a temperature 30% off, or of a top-p set one token longer or
shorter."""

from __future__ import annotations

import math

import pytest
import torch

from statechat.engine.sampling import SamplingParams
from tests.engine.test_penalties import engine  # (an engine on a module's setup)

PROMPT = [5, 17, 99, 3, 250, 41, 7, 291]
DRAWS = 800
Z = 3.719  # the standard normal's 1 - 1e-4 quantile: a sound test fails once in 10,000 runs


@pytest.fixture(scope="module")
def setup(tiny_dirs):
    """The checkpoint, our model (CPU, float32) and transformers' float64 logits of PROMPT's
    next token."""
    import transformers

    from statechat.model.loader import load_model

    path = tiny_dirs["qwen3_5_text"]
    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT])).logits[0, -1].double()
    return path, load_model(path, dtype=torch.float32, device="cpu"), logits


def reference(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
              min_p: float = 0.0, repetition_penalty: float = 1.0,
              logit_bias: dict[int, float] | None = None, top_p_shift: int = 0,
              is_wrong: bool = False) -> torch.Tensor:
    """vLLM's distribution of the first token (float64). `top_p_shift`: the top-p set made that
    many tokens longer (or shorter); `is_wrong`: a distribution for the power checks (whose
    top-p edge may fall anywhere)."""
    x = logits.clone()
    for token, bias in (logit_bias or {}).items():
        x[token] += bias
    seen = torch.tensor(sorted(set(PROMPT)))
    x[seen] = torch.where(x[seen] > 0, x[seen] / repetition_penalty, x[seen] * repetition_penalty)
    probs = (x / temperature).softmax(-1)
    if top_k:
        probs[x < x.topk(min(top_k, len(x))).values[-1]] = 0
    probs[probs < min_p * probs.max()] = 0
    ranked, order = (probs / probs.sum()).sort(descending=True, stable=True)
    before = ranked.cumsum(0) - ranked
    kept = int((before < top_p).sum()) if top_p < 1 else int((ranked > 0).sum())
    if top_p < 1 and not is_wrong:  # (the edge far from every token: the engine's float32
        assert min(abs(before[: kept + 1] - top_p)) > 1e-3  # sums agree on it)
    ranked[kept + top_p_shift :] = 0
    return torch.zeros_like(probs).scatter(0, order, ranked / ranked.sum())


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """The chi-square statistic of `counts` against `probs` (cells expecting fewer than 5 draws
    pooled) and its 1 - 1e-4 quantile (Wilson-Hilferty); inf when a token of probability 0 was
    drawn."""
    if counts[probs == 0].sum() > 0:
        return math.inf, 0.0
    expected = probs * counts.sum()
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big].sum()[None]])
    expected = torch.cat([expected[big], expected[~big].sum()[None]])
    used = expected > 0
    stat = float(((observed[used] - expected[used]) ** 2 / expected[used]).sum())
    df = int(used.sum()) - 1
    return stat, df * (1 - 2 / (9 * df) + Z * math.sqrt(2 / (9 * df))) ** 3


def first_tokens(setup, **fields) -> torch.Tensor:
    """The counts [vocab] of the first token of DRAWS requests of PROMPT, seeds 0 to DRAWS - 1."""
    path, loaded, logits = setup
    eng = engine((path, loaded), "cpu", max_num_seqs=DRAWS, max_num_batched_tokens=8192)
    outs = eng.generate([PROMPT] * DRAWS, [SamplingParams(max_tokens=1, seed=i, **fields)
                                           for i in range(DRAWS)])
    tokens = torch.tensor([o.token_ids[0] for o in outs])
    return torch.bincount(tokens, minlength=logits.shape[0]).double()


HOTTER, COLDER = {"temperature": 1.3}, {"temperature": 1 / 1.3}  # (factors of the case's)
# name: (the request's sampling fields, the bugs the case must catch: fields changed, a
# temperature by that factor, or top_p_shift: the top-p set made one token longer or shorter)
CASES = {
    "temperature": ({"temperature": 0.1}, [HOTTER, COLDER]),
    "top-p": ({"temperature": 0.1, "top_p": 0.7},
              [HOTTER, COLDER, {"top_p_shift": 1}, {"top_p_shift": -1}]),
    "top-k": ({"temperature": 0.1, "top_k": 4}, [HOTTER, {"top_k": 5}, {"top_k": 3}]),
    "top-k-top-p": ({"temperature": 0.1, "top_k": 100, "top_p": 0.8},
                    [HOTTER, COLDER, {"top_p_shift": 1}, {"top_p_shift": -1}]),
    "wide-top-k-min-p": ({"temperature": 0.2, "top_k": 2000, "min_p": 0.1},
                         [HOTTER, COLDER, {"min_p": 0.05}, {"min_p": 0.2}]),
    "penalties-bias": ({"temperature": 0.1, "repetition_penalty": 2.0, "presence_penalty": 2.0,
                        "frequency_penalty": 2.0, "logit_bias": {7: 0.1, 282: -0.1}},
                       [HOTTER, COLDER, {"repetition_penalty": 1.0}, {"logit_bias": None}]),
}


def shape_of(fields: dict) -> dict:
    """The fields that shape the first token's distribution (presence and frequency penalties
    reach generated tokens only)."""
    return {k: v for k, v in fields.items() if k not in ("presence_penalty", "frequency_penalty")}


def wrong_shape(shape: dict, bug: dict) -> dict:
    """`shape` with a bug's changes (a temperature as a factor of the shape's)."""
    wrong = {**shape, **bug, "is_wrong": True}
    if "temperature" in bug:
        wrong["temperature"] = shape["temperature"] * bug["temperature"]
    return wrong


@pytest.mark.parametrize("case", CASES)
def test_the_first_token_follows_vllms_distribution(setup, case):
    fields, bugs = CASES[case]
    logits, shape = setup[2], shape_of(fields)
    counts = first_tokens(setup, **fields)
    stat, limit = chi_square(counts, reference(logits, **shape))
    assert stat <= limit, (stat, limit)
    for bug in bugs:  # (the test has the power to fail)
        stat, limit = chi_square(counts, reference(logits, **wrong_shape(shape, bug)))
        assert stat > limit, bug


def test_the_reference_is_not_vacuous(setup):
    """The cases' distributions are spread (the likeliest token under 0.9), and the penalty and
    bias reach likely tokens (291 in the prompt, 282 not)."""
    logits = setup[2]
    for fields, _ in CASES.values():
        probs = reference(logits, **shape_of(fields))
        assert probs.max() < 0.9 and (probs > 0.01).sum() >= 3
    plain = reference(logits, 0.1)
    assert plain[291] > 0.1 and plain[282] > 0.05 and logits[291] > 0
