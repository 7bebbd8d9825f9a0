"""Sampling at the edges of its values, through the engine: a top-k above the vocabulary keeps
it all; a tiny top-p, a top-k of 1, min_p 1 and a temperature of 1e-5 draw the greedy reply
(no NaN); a logit bias of -100 on every token but one, or of +100 on one, draws that one; and
values past float32's range do what their limit does instead of drawing garbage from NaN or
infinite logits: a temperature of 1e39 (infinite in float32) under top-k draws among the top-k
tokens, not the lowest ids, nor a token min_tokens bars; a repetition penalty of 1e-39 (which
made a prompt token's logit infinite) draws the likeliest prompt token, as the greedy reply
under it does."""

from __future__ import annotations

import pytest
import torch

from statechat.engine.sampling import SamplingParams
from tests.engine.test_penalties import engine  # (an engine on a module's setup)

PROMPT = [5, 17, 99, 3, 250, 41, 7]
NEW = 8
ROWS = 6


@pytest.fixture(scope="module")
def setup(tiny_dirs):
    """The checkpoint, our model (CPU, float32), an engine and its greedy reply to PROMPT."""
    from statechat.model.loader import load_model

    path = tiny_dirs["qwen3_5_text"]
    loaded = load_model(path, dtype=torch.float32, device="cpu")
    eng = engine((path, loaded), "cpu")
    greedy = eng.generate([PROMPT], SamplingParams(max_tokens=NEW, ignore_eos=True))[0]
    return path, loaded, eng, greedy.token_ids


def replies(eng, **fields) -> list[list[int]]:
    """ROWS replies to PROMPT, seeds 0 to ROWS - 1."""
    params = [SamplingParams(max_tokens=NEW, ignore_eos=True, seed=i, **fields)
              for i in range(ROWS)]
    return [o.token_ids for o in eng.generate([PROMPT] * ROWS, params)]


@pytest.mark.parametrize("fields", [
    {"temperature": 1.0, "top_p": 1e-30}, {"temperature": 1.0, "top_p": 1e-6},
    {"temperature": 2.0, "top_k": 1}, {"temperature": 2.0, "min_p": 1.0},
    {"temperature": 1e-5}, {"temperature": 1e-5, "top_k": 5, "top_p": 0.5},
], ids=["top-p-1e-30", "top-p-1e-6", "top-k-1", "min-p-1", "temperature-1e-5", "tiny-mixed"])
def test_narrow_sampling_is_greedy(setup, fields):
    _, _, eng, greedy = setup
    assert replies(eng, **fields) == [greedy] * ROWS


def test_a_top_k_above_the_vocabulary_keeps_it_all(setup):
    _, _, eng, _ = setup
    assert replies(eng, temperature=1.0, top_k=10**12) == replies(eng, temperature=1.0)


@pytest.mark.parametrize("bias", ["all-but-one", "one"])
def test_a_full_bias_draws_its_token(setup, bias):
    _, loaded, eng, _ = setup
    vocab = loaded.config.vocab_size
    values = {t: -100.0 for t in range(vocab) if t != 77} if bias == "all-but-one" else {77: 100}
    for temperature in (3.0, 1e-5):
        assert replies(eng, temperature=temperature, logit_bias=values) == [[77] * NEW] * ROWS


def test_an_infinite_temperature_keeps_the_top_k(setup):
    """temperature 1e39 under top-k 5: every token among the five likeliest at its step (of
    transformers' logits), and across the replies more than one of them."""
    import transformers

    path, _, eng, _ = setup
    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = replies(eng, temperature=1e39, top_k=5)
    for out in outs:
        with torch.no_grad():
            logits = hf(torch.tensor([PROMPT + out])).logits[0, len(PROMPT) - 1 : -1]
        top = logits.topk(5).indices
        assert all(token in row for token, row in zip(out, top.tolist())), out
    assert len({out[0] for out in outs}) > 1


def test_an_infinite_temperature_keeps_min_tokens_bar(setup):
    """EOS, barred by min_tokens (a -inf logit), is never drawn at temperature 1e39 (-inf over
    an infinite temperature was NaN, which the draw took for the likeliest)."""
    _, _, eng, _ = setup
    eos = sorted(eng.eos_ids)
    params = [SamplingParams(max_tokens=NEW, min_tokens=NEW, seed=i, temperature=1e39,
                             logit_bias={t: 100 for t in eos}) for i in range(ROWS)]
    outs = eng.generate([PROMPT] * ROWS, params)
    assert all(len(o.token_ids) == NEW and not set(o.token_ids) & set(eos) for o in outs)


def test_a_vanishing_repetition_penalty_draws_the_likeliest_prompt_token(setup):
    """A repetition penalty of 1e-39 multiplies the prompt's positive logits past float32's
    range: the draw takes the prompt token of the largest logit, as the greedy reply does."""
    _, _, eng, _ = setup
    greedy = eng.generate([PROMPT], SamplingParams(max_tokens=NEW, ignore_eos=True,
                                                   repetition_penalty=1e-39))[0].token_ids
    assert greedy[0] in PROMPT
    drawn = replies(eng, temperature=1.0, repetition_penalty=1e-39)
    assert [out[0] for out in drawn] == [greedy[0]] * ROWS
