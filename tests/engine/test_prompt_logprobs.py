"""Prompt logprobs (SamplingParams.prompt_logprobs, vLLM's field): each prompt token after the
first gets the model's log-probability of it given the tokens before it, the k likeliest
tokens there and its rank, as transformers' logits over the prompt give them; with chunked
prefill, preemption and plain requests in the same steps. A request that asks computes its
whole prompt (no prefix is reused for it, so none of its entries is missing), and max_tokens 0
scores a prompt without generating."""

from __future__ import annotations

import pytest
import torch

from statechat.engine.sampling import SamplingParams
from statechat.errors import ConfigError
from statechat.model.loader import load_model
from tests.engine.test_penalties import engine  # (an engine on a module's setup)

LENGTHS = [5, 70, 200]
NEW = 6


@pytest.fixture(scope="module")
def setup(tiny_dirs, engine_device):
    """The checkpoint, our model on the test device, the prompts and transformers' log-softmax
    over each prompt (row p: the distribution of token p + 1; CPU, float32)."""
    import transformers

    path = tiny_dirs["qwen3_5_text"]
    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(23)
    prompts = [torch.randint(0, hf.config.vocab_size, (n,), generator=gen).tolist()
               for n in LENGTHS]
    with torch.no_grad():
        want = [hf(torch.tensor([p])).logits[0].log_softmax(-1) for p in prompts]
    loaded = load_model(path, dtype=torch.float32, device=engine_device)
    return path, loaded, prompts, want


def assert_models(entries: list, prompt: list[int], want: torch.Tensor, k: int, tol: float) -> None:
    """Entries as transformers' log-softmax `want` over `prompt` gives them."""
    assert len(entries) == len(prompt) and entries[0] is None
    for p in range(1, len(prompt)):
        lp, top, rank = entries[p]
        row = want[p - 1]
        assert lp == pytest.approx(row[prompt[p]].item(), abs=tol)
        assert len(top) == k
        values = row.topk(k).values.tolist()
        assert [v for _, v in top] == pytest.approx(values, abs=tol)
        assert [v for _, v in top] == pytest.approx(row[[i for i, _ in top]].tolist(), abs=tol)
        # (the tokens likelier than it, give or take those within the tolerance of it)
        assert (row > lp + tol).sum().item() + 1 <= rank <= (row > lp - tol).sum().item() + 1


def tolerance(device: str) -> float:
    return 1e-4 if device == "cpu" else 2e-3


@pytest.mark.parametrize("overrides", [
    {},
    {"max_num_batched_tokens": 64},
    {"num_kv_blocks": 6, "max_num_batched_tokens": 128},
], ids=["whole", "chunked", "preempted"])
def test_prompt_logprobs_are_the_models(setup, engine_device, overrides):
    if engine_device != "cpu" and "num_kv_blocks" in overrides:
        pytest.skip("a block count this small is a CPU-engine case")
    _, _, prompts, want = setup
    eng = engine(setup, engine_device, **overrides)
    plain = SamplingParams(max_tokens=NEW, ignore_eos=True)
    asked = [SamplingParams(max_tokens=NEW, ignore_eos=True, prompt_logprobs=k) for k in (3, 0, 5)]
    seqs = [eng.add_request(p, a) for p, a in zip(prompts, asked)]
    seqs.append(eng.add_request(prompts[2][:150], plain))  # a plain one in the same steps
    while eng.has_unfinished():
        eng.step()
    outs = [eng.output(s) for s in seqs]
    for prompt, rows, out, p in zip(prompts, want, outs, asked):
        assert_models(out.prompt_logprobs, prompt, rows, p.prompt_logprobs,
                      tolerance(engine_device))
        assert out.logprobs is None and len(out.token_ids) == NEW
    assert outs[3].prompt_logprobs is None
    if "num_kv_blocks" in overrides:
        assert sum(s.num_preemptions for s in seqs) > 0
    # asking for them changes no reply
    alone = eng.generate(prompts, plain)
    assert [o.token_ids for o in outs[:3]] == [o.token_ids for o in alone]


def test_a_scored_prompt_is_computed_whole(setup, engine_device):
    """With its prompt in the prefix cache, a request that asks for prompt logprobs still
    computes every prompt token (and says so); its blocks serve the plain request after it."""
    _, _, prompts, want = setup
    eng = engine(setup, engine_device)
    prompt = prompts[2]
    first = eng.generate([prompt], SamplingParams(max_tokens=NEW, ignore_eos=True))[0]
    scored = eng.generate([prompt], SamplingParams(max_tokens=NEW, ignore_eos=True,
                                                   prompt_logprobs=2))[0]
    assert scored.num_cached_tokens == 0 and scored.num_computed_tokens == len(prompt)
    assert_models(scored.prompt_logprobs, prompt, want[2], 2, tolerance(engine_device))
    assert scored.token_ids == first.token_ids
    after = eng.generate([prompt + [7]], SamplingParams(max_tokens=2))[0]
    assert after.num_cached_tokens == len(prompt) // 64 * 64


def test_max_tokens_zero_scores_the_prompt_alone(setup, engine_device):
    """max_tokens 0 ends a request with its prompt ("length", no token, no first-token time),
    beside requests that generate; a stream of one sends one event, with the prompt's logprobs
    and the output."""
    _, _, prompts, want = setup
    eng = engine(setup, engine_device, max_num_batched_tokens=64)
    params = [SamplingParams(max_tokens=0, prompt_logprobs=1), SamplingParams(max_tokens=NEW),
              SamplingParams(max_tokens=0)]
    outs = eng.generate(prompts, params)
    assert [o.finish_reason for o in outs] == ["length", "length", "length"]
    assert [len(o.token_ids) for o in outs] == [0, NEW, 0]
    assert outs[0].ttft_s is None and outs[0].num_completion_tokens == 0
    assert_models(outs[0].prompt_logprobs, prompts[0], want[0], 1, tolerance(engine_device))
    assert outs[2].prompt_logprobs is None and outs[2].num_computed_tokens == len(prompts[2])
    events = list(eng.stream(prompts[1], SamplingParams(max_tokens=0, prompt_logprobs=4)))
    assert len(events) == 1 and events[0].token_ids == [] and events[0].text == ""
    assert events[0].output.finish_reason == "length"
    assert events[0].prompt_logprobs == events[0].output.prompt_logprobs
    assert_models(events[0].prompt_logprobs, prompts[1], want[1], 4, tolerance(engine_device))
    assert not eng.has_unfinished()


def test_a_stream_sends_the_prompt_logprobs_first(setup, engine_device):
    """Of a generating stream's events, the first carries the prompt's logprobs, the others
    none."""
    _, _, prompts, want = setup
    eng = engine(setup, engine_device)
    events = list(eng.stream(prompts[1], SamplingParams(max_tokens=NEW, ignore_eos=True,
                                                        prompt_logprobs=2)))
    assert len(events) > 1 and sum(len(e.token_ids) for e in events) == NEW
    assert events[0].prompt_logprobs == events[-1].output.prompt_logprobs
    assert all(e.prompt_logprobs is None for e in events[1:])
    assert_models(events[0].prompt_logprobs, prompts[1], want[1], 2, tolerance(engine_device))


@pytest.mark.parametrize("field, value, message", [
    ("prompt_logprobs", 21, "prompt_logprobs must be from 0 to 20"),
    ("prompt_logprobs", -1, "prompt_logprobs must be from 0 to 20"),
    ("prompt_logprobs", "3", "prompt_logprobs must be an integer"),
    ("max_tokens", -1, "max_tokens must be >= 0"),
])
def test_bad_values_are_refused_with_their_name(field, value, message):
    with pytest.raises(ConfigError, match=message):
        SamplingParams(**{field: value})
