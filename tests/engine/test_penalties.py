"""Penalties, min-p and logprobs: greedy tokens under a repetition penalty equal transformers'
greedy `generate` with its `repetition_penalty`; under presence and frequency penalties they equal
`generate` with a logits processor that applies OpenAI's definition. Both hold for requests
batched with plain ones, with chunked prefill, preemption, and steps queued ahead (async),
and on the GPU through its graphs. A min-p draw only ever picks tokens at least min_p times
as likely as the likeliest, and the logprobs reported are the model's."""

from __future__ import annotations

import pytest
import torch

from statechat.config import EngineConfig
from statechat.engine.engine import LLMEngine
from statechat.engine.sampling import SamplingParams
from statechat.errors import ConfigError
from statechat.model.loader import load_model
from tests.engine.test_engine_parity import count_continuations
from tests.helpers import engine_config

LENGTHS = [7, 70, 130]
NEW = 24
PENALTIES = [  # per prompt: repetition; presence and frequency; all three
    {"repetition_penalty": 1.6},
    {"presence_penalty": 1.5, "frequency_penalty": 0.7},
    {"repetition_penalty": 0.8, "presence_penalty": -0.5, "frequency_penalty": 2.0},
]


def openai_penalties(prompt_len: int, presence: float, frequency: float):
    """A transformers logits processor: OpenAI's presence and frequency penalties over the
    tokens generated so far."""
    import transformers

    class Penalties(transformers.LogitsProcessor):
        def __call__(self, input_ids, scores):
            out = input_ids[:, prompt_len:]
            counts = torch.zeros_like(scores).scatter_add_(1, out,
                                                           torch.ones_like(out, dtype=scores.dtype))
            return scores - frequency * counts - presence * (counts > 0).to(scores.dtype)

    return Penalties()


@pytest.fixture(scope="module")
def setup(tiny_dirs, engine_device):
    """The checkpoint, our model on the test device, the prompts, and transformers' greedy
    tokens for each prompt under its penalties (CPU, float32)."""
    import transformers

    path = tiny_dirs["qwen3_5_text"]
    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    vocab = hf.config.vocab_size
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in LENGTHS]
    prompts[0] = prompts[0][:3] * 2 + prompts[0][:1]  # repeats: the repetition penalty bites
    expected = []
    for p, pen in zip(prompts, PENALTIES):
        extra = {}
        if "presence_penalty" in pen:
            extra["logits_processor"] = transformers.LogitsProcessorList(
                [openai_penalties(len(p), pen["presence_penalty"], pen["frequency_penalty"])])
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW,
                              do_sample=False,
                              repetition_penalty=pen.get("repetition_penalty", 1.0), **extra)
        expected.append(out[0, len(p):].tolist())
    loaded = load_model(path, dtype=torch.float32, device=engine_device)
    return path, loaded, prompts, expected


def engine(setup, engine_device, **overrides) -> LLMEngine:
    path, loaded = setup[:2]
    config = {**engine_config(engine_device), "dtype": "float32", **overrides}
    return LLMEngine(EngineConfig(model=path, **config), loaded=loaded)


def params(**penalties) -> SamplingParams:
    return SamplingParams(max_tokens=NEW, ignore_eos=True, **penalties)


@pytest.mark.parametrize("overrides", [
    {"async_scheduling": False},
    {"async_scheduling": True},
    {"max_num_batched_tokens": 64},
    {"num_kv_blocks": 6, "max_num_batched_tokens": 128},
], ids=["sync", "async", "chunked", "preempted"])
def test_penalised_greedy_tokens_match_transformers(setup, engine_device, overrides):
    if engine_device != "cpu" and "num_kv_blocks" in overrides:
        pytest.skip("a block count this small is a CPU-engine case")
    _, _, prompts, expected = setup
    eng = engine(setup, engine_device, **overrides)
    continued = count_continuations(eng)
    plain = [p + [1] for p in prompts]  # plain greedy requests in the same steps
    seqs = [eng.add_request(p, params(**pen)) for p, pen in zip(prompts, PENALTIES)]
    seqs += [eng.add_request(p, params()) for p in plain]
    while eng.has_unfinished():
        eng.step()
    assert [s.output_ids for s in seqs[:3]] == expected
    alone = eng.generate(plain, params())
    assert [s.output_ids for s in seqs[3:]] == [o.token_ids for o in alone]
    if "num_kv_blocks" in overrides:
        assert sum(s.num_preemptions for s in seqs) > 0
    if overrides.get("async_scheduling"):  # steps were queued before the host saw the last token
        assert continued[0] > 10
    if eng.runner.sampler_graphs is not None:  # (on a GPU, the penalised steps replayed graphs)
        assert eng.runner.sampler_graphs.replays > 0


def test_a_penalty_changes_the_reply(setup, engine_device):
    """The reference is not vacuous: without its penalty, each prompt's greedy reply differs."""
    _, _, prompts, expected = setup
    outs = engine(setup, engine_device).generate(prompts, params())
    assert all(o.token_ids != e for o, e in zip(outs, expected))


def test_min_p_keeps_only_likely_tokens(setup, engine_device):
    """Every token drawn at a high temperature under min_p is at least min_p times as likely
    as the likeliest under that temperature (checked against transformers' logits), and
    min_p = 1 draws the argmax, as greedy does."""
    import transformers

    path, _, prompts, _ = setup
    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    eng = engine(setup, engine_device)
    temperature, min_p = 3.0, 0.3
    outs = eng.generate(prompts, [SamplingParams(max_tokens=NEW, ignore_eos=True,
                                                 temperature=temperature, min_p=min_p, seed=i)
                                  for i in range(len(prompts))])
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1 : -1]
        probs = (logits / temperature).softmax(-1)
        picked = probs.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
        assert (picked >= min_p * probs.max(-1).values * (1 - 1e-4)).all()
    top = eng.generate(prompts, SamplingParams(max_tokens=NEW, ignore_eos=True, temperature=5.0,
                                               min_p=1.0, seed=0))
    assert [o.token_ids for o in top] == [o.token_ids for o in eng.generate(prompts, params())]


@pytest.mark.parametrize("field, value, message", [
    ("min_p", 1.5, "min_p must be in [0, 1]"),
    ("presence_penalty", 2.5, "presence_penalty must be in [-2, 2]"),
    ("frequency_penalty", -3, "frequency_penalty must be in [-2, 2]"),
    ("repetition_penalty", 0, "repetition_penalty must be > 0"),
    ("repetition_penalty", "1.1", "repetition_penalty must be a number"),
])
def test_bad_values_are_refused_with_their_name(field, value, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_logprobs_are_the_models(setup, engine_device, async_scheduling):
    """Each generated token's logprob, and the k likeliest tokens with theirs, are those of
    transformers' logits at that step (raw: before temperature), for requests asking different
    k next to one asking none; a stream's events carry the logprobs of their own tokens."""
    import transformers

    path, _, prompts, _ = setup
    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    eng = engine(setup, engine_device, async_scheduling=async_scheduling)
    continued = count_continuations(eng)
    asked = [SamplingParams(max_tokens=NEW, ignore_eos=True, logprobs=5),
             SamplingParams(max_tokens=NEW, ignore_eos=True, logprobs=0, temperature=2.0, seed=1),
             SamplingParams(max_tokens=NEW, ignore_eos=True)]
    outs = eng.generate(prompts, asked)
    assert outs[2].logprobs is None
    for prompt, out, p in zip(prompts[:2], outs[:2], asked[:2]):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1 : -1]
        want = logits.log_softmax(-1)
        assert len(out.logprobs) == len(out.token_ids) == NEW
        for t, (token, (lp, top)) in enumerate(zip(out.token_ids, out.logprobs)):
            assert lp == pytest.approx(want[t, token].item(), abs=1e-4)
            values, ids = want[t].topk(p.logprobs)
            assert [i for i, _ in top] == ids.tolist()
            assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-4)
    assert outs[0].logprobs[0][0] == outs[0].logprobs[0][1][0][1]  # greedy: the likeliest
    if async_scheduling:
        assert continued[0] > 10
    events = list(eng.stream(prompts[0], asked[0]))  # (alone: the sums run in another order)
    streamed = [lp for e in events for lp in e.logprobs]
    assert ([[i for i, _ in top] for _, top in streamed]
            == [[i for i, _ in top] for _, top in outs[0].logprobs])
    assert [lp for lp, _ in streamed] == pytest.approx([lp for lp, _ in outs[0].logprobs], abs=1e-4)
    assert all(len(e.logprobs) == len(e.token_ids) for e in events)


def test_a_seeded_draw_does_not_depend_on_the_rows_beside_it(setup, engine_device):
    """Rows that sample are processed together; a seeded request still draws the tokens it
    draws alone, whatever the other rows of its steps ask."""
    _, _, prompts, _ = setup
    seeded = SamplingParams(max_tokens=NEW, ignore_eos=True, temperature=0.9, top_k=30,
                            top_p=0.9, min_p=0.02, presence_penalty=0.4, seed=7)
    others = [SamplingParams(max_tokens=NEW, ignore_eos=True, temperature=1.5, top_p=0.5),
              SamplingParams(max_tokens=NEW, ignore_eos=True, repetition_penalty=1.2, logprobs=2)]
    eng = engine(setup, engine_device)
    alone = eng.generate([prompts[1]], seeded)[0].token_ids
    beside = eng.generate([prompts[0], prompts[1], prompts[2]], [others[0], seeded, others[1]])
    assert beside[1].token_ids == alone
    assert eng.generate([prompts[1]], seeded)[0].token_ids == alone  # (its counts row reused)
