"""A seeded request makes the same reply whatever its steps hold, as vLLM's per-request
generators do: alone, beside other requests (seeded or not, of every sampler path) in either
order, from the prefix cache, in chunked prefill, after preemption, and with steps queued
ahead (async). Another seed makes another reply, and so does a request without a seed run
twice."""

from __future__ import annotations

import pytest
import torch

from statechat.engine.sampling import SamplingParams
from tests.engine.test_penalties import engine  # (an engine on a module's setup)

NEW = 16
KINDS = {  # one per sampler path
    "vocabulary": {"temperature": 1.0, "top_p": 0.9},
    "top-k": {"temperature": 0.8, "top_k": 20, "min_p": 0.02},
    "wide-top-k": {"temperature": 1.2, "top_k": 2000},
    "penalties": {"temperature": 1.0, "top_k": 100, "repetition_penalty": 1.3,
                  "presence_penalty": 0.5, "frequency_penalty": 0.3},
}
OTHERS = [SamplingParams(max_tokens=NEW, ignore_eos=True, temperature=1.5, top_k=3),
          SamplingParams(max_tokens=NEW, ignore_eos=True, temperature=0.5, top_p=0.5, seed=1),
          SamplingParams(max_tokens=NEW, ignore_eos=True, frequency_penalty=1.0)]


@pytest.fixture(scope="module")
def setup(tiny_dirs):
    """The checkpoint, our model (CPU, float32) and four prompts (70 tokens: one full block
    for the prefix cache; 9; 130; 33)."""
    from statechat.model.loader import load_model

    path = tiny_dirs["qwen3_5_text"]
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 384, (n,), generator=gen).tolist() for n in (70, 9, 130, 33)]
    return path, load_model(path, dtype=torch.float32, device="cpu"), prompts


def seeded(kind: str, seed: int = 42) -> SamplingParams:
    return SamplingParams(max_tokens=NEW, ignore_eos=True, seed=seed, **KINDS[kind])


@pytest.mark.parametrize("kind", KINDS)
def test_a_seed_makes_the_same_reply_whatever_the_batch(setup, kind):
    _, _, prompts = setup
    eng = engine(setup, "cpu")
    alone = eng.generate([prompts[0]], seeded(kind))[0]
    cached = eng.generate([prompts[0]], seeded(kind))[0]
    assert cached.num_cached_tokens == 64 and cached.token_ids == alone.token_ids
    replies = {
        "beside": engine(setup, "cpu").generate(prompts[1:2] + prompts[:1] + prompts[2:],
                                                [OTHERS[0], seeded(kind), *OTHERS[1:]])[1],
        "last": engine(setup, "cpu").generate(prompts[:0:-1] + prompts[:1],
                                              [*OTHERS[::-1], seeded(kind)])[3],
        "chunked": engine(setup, "cpu", max_num_batched_tokens=64).generate(
            [prompts[2], prompts[0]], [OTHERS[1], seeded(kind)])[1],
        "async": engine(setup, "cpu", async_scheduling=True).generate(
            prompts[1::-1], [OTHERS[0], seeded(kind)])[1],
    }
    preempting = engine(setup, "cpu", num_kv_blocks=6, max_num_batched_tokens=128)
    seqs = [preempting.add_request(p, sp) for p, sp in zip(
        [prompts[2], prompts[0], prompts[3], prompts[1]], [OTHERS[0], seeded(kind), *OTHERS[1:]])]
    while preempting.has_unfinished():
        preempting.step()
    assert sum(s.num_preemptions for s in seqs) > 0
    replies = {name: out.token_ids for name, out in replies.items()}
    replies["preempted"] = seqs[1].output_ids
    assert replies == {name: alone.token_ids for name in replies}
    other = engine(setup, "cpu").generate([prompts[0]], seeded(kind, 43))[0]
    assert other.token_ids != alone.token_ids


def test_without_a_seed_replies_differ(setup):
    _, _, prompts = setup
    eng = engine(setup, "cpu")
    params = SamplingParams(max_tokens=NEW, ignore_eos=True, temperature=1.0)
    first, second = eng.generate([prompts[1]] * 2, params)
    assert first.token_ids != second.token_ids
