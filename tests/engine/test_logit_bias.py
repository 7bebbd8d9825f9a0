"""logit_bias and min_tokens: greedy tokens under a logit bias equal transformers' greedy
`generate` with a logits processor adding that bias; under min_tokens, EOS and the stop token
ids are barred until that many tokens are generated, as `generate`'s min_new_tokens bars its
EOS ids; and stop strings are not looked for before it. Both hold with plain requests in the
same steps, async scheduling (steps queued before the last one's tokens are read) and chunked
prefill, and on the GPU, whose biased steps leave the graphs' argmax and sampler graphs."""

from __future__ import annotations

import pytest
import torch

from statechat.engine.sampling import SamplingParams
from statechat.errors import ConfigError
from statechat.model.loader import load_model
from tests.engine.test_penalties import engine  # (an engine on a module's setup)

LENGTHS = [9, 75, 140]
NEW = 16


@pytest.fixture(scope="module")
def setup(tiny_dirs, engine_device):
    """The checkpoint, our model on the test device, the prompts, transformers' model (CPU,
    float32) and its plain greedy reply to each prompt."""
    import transformers

    path = tiny_dirs["qwen3_5_text"]
    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(31)
    prompts = [torch.randint(0, hf.config.vocab_size, (n,), generator=gen).tolist()
               for n in LENGTHS]
    plain = [hf_greedy(hf, p) for p in prompts]
    loaded = load_model(path, dtype=torch.float32, device=engine_device)
    return path, loaded, prompts, hf, plain


def hf_greedy(hf, prompt: list[int], bias: dict[int, float] | None = None, **kwargs) -> list[int]:
    import transformers

    class Bias(transformers.LogitsProcessor):
        def __call__(self, input_ids, scores):
            for token, value in (bias or {}).items():
                scores[:, token] += value
            return scores

    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False,
                          logits_processor=transformers.LogitsProcessorList([Bias()]), **kwargs)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("overrides", [
    {"async_scheduling": False}, {"async_scheduling": True}, {"max_num_batched_tokens": 64},
], ids=["sync", "async", "chunked"])
def test_biased_greedy_tokens_match_transformers(setup, engine_device, overrides):
    _, _, prompts, hf, plain = setup
    # each prompt's first plain token barred, another token pushed up
    biases = [{reply[0]: -100.0, (reply[0] + 17) % 300: 4.0} for reply in plain]
    expected = [hf_greedy(hf, p, b, min_new_tokens=NEW) for p, b in zip(prompts, biases)]
    assert all(e != r for e, r in zip(expected, plain))  # (the bias changes every reply)
    eng = engine(setup, engine_device, **overrides)
    seqs = [eng.add_request(p, SamplingParams(max_tokens=NEW, ignore_eos=True, logit_bias=b))
            for p, b in zip(prompts, biases)]
    beside = [eng.add_request(p, SamplingParams(max_tokens=NEW, ignore_eos=True)) for p in prompts]
    while eng.has_unfinished():
        eng.step()
    assert [s.output_ids for s in seqs] == expected
    assert [s.output_ids for s in beside] == plain
    pushed = eng.generate(prompts[:1], SamplingParams(max_tokens=4, logit_bias={5: 100}))[0]
    assert pushed.token_ids == [5] * 4


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_min_tokens_bars_eos_and_stop_tokens(setup, engine_device, async_scheduling):
    """The plain reply's third token made an EOS id (and, for another prompt, a stop token id)
    ends it there; with min_tokens 8 neither can come before the ninth token, as transformers'
    min_new_tokens gives it."""
    _, _, prompts, hf, plain = setup
    eng = engine(setup, engine_device, async_scheduling=async_scheduling)
    eos, stop = plain[0][2], plain[1][2]
    eng.eos_ids.add(eos)  # (the runner bars the engine's own set)
    try:
        early = eng.generate(prompts[:2], [SamplingParams(max_tokens=NEW),
                                           SamplingParams(max_tokens=NEW, stop_token_ids=[stop])])
        assert [len(o.token_ids) for o in early] == [3, 3]
        assert [o.finish_reason for o in early] == ["stop", "stop"]
        outs = eng.generate(prompts[:2], [
            SamplingParams(max_tokens=NEW, min_tokens=8),
            SamplingParams(max_tokens=NEW, min_tokens=8, stop_token_ids=[stop], ignore_eos=True)])
    finally:
        eng.eos_ids.discard(eos)
    for out, prompt, token in zip(outs, prompts, (eos, stop)):
        want = hf_greedy(hf, prompt, min_new_tokens=8, eos_token_id=[token])
        assert out.token_ids == want
        assert token not in out.token_ids[:8] and len(out.token_ids) > 8


def test_stop_strings_wait_for_min_tokens(setup, engine_device):
    """A stop string that the plain reply's text holds early ends it; with min_tokens equal to
    max_tokens the reply runs its whole length, text and all; min_tokens 1 does not look in
    the first token's text."""
    _, _, prompts, _, _ = setup
    eng = engine(setup, engine_device)
    first = eng.generate(prompts[2:], SamplingParams(max_tokens=NEW, ignore_eos=True))[0]
    stop = next(c for c in first.text if not c.isspace())  # (a character of the reply)
    cut = eng.generate(prompts[2:], SamplingParams(max_tokens=NEW, ignore_eos=True, stop=stop))[0]
    held = eng.generate(prompts[2:], SamplingParams(max_tokens=NEW, ignore_eos=True, stop=stop,
                                                    min_tokens=NEW))[0]
    assert cut.finish_reason == "stop" and len(cut.token_ids) < NEW
    assert held.token_ids == first.token_ids and held.text == first.text
    assert held.finish_reason == "length"
    head = eng.tokenizer.decode(first.token_ids[:1])  # (the first token's own text)
    if head.strip():
        once = eng.generate(prompts[2:], SamplingParams(max_tokens=2, ignore_eos=True,
                                                        stop=head.strip()[-1], min_tokens=1))[0]
        assert len(once.token_ids) == 2


def test_a_bias_outside_the_vocabulary_is_refused(setup, engine_device):
    eng = engine(setup, engine_device)
    vocab = setup[1].config.vocab_size
    with pytest.raises(ConfigError, match=f"logit_bias token id {vocab} is outside"):
        eng.generate(setup[2][:1], SamplingParams(logit_bias={vocab: 1.0}))
    assert not eng.has_unfinished()


def test_min_tokens_leaves_the_plain_path_once_reached(setup, engine_device, monkeypatch):
    """A request with min_tokens and no logit_bias copies and biases its logits (the eager
    path, without the graphs' argmax and sampler) only for the tokens min_tokens bars: once
    reached, its steps sample as a plain request's do."""
    from statechat.engine.step_sampling import StepSampling

    eng = engine(setup, engine_device)
    biased = []
    real = StepSampling._biased
    monkeypatch.setattr(StepSampling, "_biased",
                        lambda self, logits, b, *rest: biased.append(len(b[0]))
                        or real(self, logits, b, *rest))
    out = eng.generate(setup[2][:1], SamplingParams(max_tokens=6, min_tokens=2))[0]
    assert len(out.token_ids) == 6  # (this reply has no EOS: the plain one runs NEW tokens)
    assert len(biased) == 2 and all(biased)  # the first two tokens, each with EOS barred
