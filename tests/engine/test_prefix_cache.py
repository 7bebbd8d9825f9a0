"""The device-tier prefix cache changes nothing but the work done.

Conversations are forked at every turn (an earlier user message edited, the last reply
regenerated, a reply continued). Greedy tokens with the cache equal those of an engine with the
cache off, and each request's reported reuse equals the position of the nearest checkpoint that
the checkpoint policy (DESIGN.md) left from earlier requests.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from statechat.chat.template import render
from statechat.config import EngineConfig
from statechat.engine.engine import LLMEngine
from statechat.engine.sampling import SamplingParams
from statechat.model.loader import load_model
from tests.helpers import PolicyModel

PARAMS = SamplingParams(max_tokens=40, ignore_eos=True)
WORDS = ["state", "cache", "block", "token", "layer", "chat", "model", "prefix", "reuse", "delta",
         "gate", "kernel"]


def user_text(rng: torch.Generator, n_words: int) -> str:
    idx = torch.randint(0, len(WORDS), (n_words,), generator=rng).tolist()
    return " ".join(WORDS[i] for i in idx)


@pytest.fixture(scope="module")
def engines(tiny_dirs):
    path = tiny_dirs["qwen3_5_text"]
    loaded = load_model(path, dtype=torch.float32)
    cached = LLMEngine(EngineConfig(model=path, device="cpu", checkpoint_interval=2), loaded=loaded)
    plain = LLMEngine(EngineConfig(model=path, device="cpu", enable_prefix_cache=False),
                      loaded=loaded)
    return cached, plain


def ask(cached: LLMEngine, plain: LLMEngine, policy: PolicyModel, ids: list[int]):
    want = policy.expected_reuse(ids)
    got = cached.generate([ids], PARAMS)[0]
    ref = plain.generate([ids], PARAMS)[0]
    assert got.token_ids == ref.token_ids
    assert got.num_cached_tokens == want, (f"reused {got.num_cached_tokens}, "
                                           f"nearest checkpoint {want}")
    assert got.num_computed_tokens == len(ids) - want
    assert ref.num_cached_tokens == 0
    policy.record(ids, got.token_ids)
    return got


def test_forks_at_every_turn_match_no_cache(engines):
    cached, plain = engines
    tok = cached.tokenizer
    policy = PolicyModel(interval=2)
    rng = torch.Generator().manual_seed(5)
    messages: list[dict] = [{"role": "system", "content": user_text(rng, 30)}]
    history, outs = [], []
    for _turn in range(4):
        messages.append({"role": "user", "content": user_text(rng, 40)})
        out = ask(cached, plain, policy, render(tok, messages))
        messages.append({"role": "assistant", "content": out.text})
        history.append(list(messages))
    for turn, branch in enumerate(history):
        # edit the user message of this turn
        edited = branch[:-2] + [{"role": "user", "content": user_text(rng, 35)}]
        outs.append(ask(cached, plain, policy, render(tok, edited)))
        # regenerate this turn's reply
        outs.append(ask(cached, plain, policy, render(tok, branch[:-1])))
        # continue this turn's reply
        outs.append(ask(cached, plain, policy, render(tok, branch, add_generation_prompt=False)))
    assert sum(o.num_cached_tokens > 0 for o in outs) >= 8


@pytest.mark.parametrize("n", [127, 128, 129])
def test_a_prefix_computed_ahead_serves_its_last_block_boundary(engines, n):
    """A request for no tokens (the app's next-turn warm-up) leaves its checkpoint at its last
    block boundary, its very end included: a 128-token prefix served 64 tokens, not 128."""
    _, plain = engines
    cached = LLMEngine(dataclasses.replace(plain.config, enable_prefix_cache=True,
                                           checkpoint_interval=0), loaded=plain.loaded)
    ids = torch.randint(0, 300, (n + 40,), generator=torch.Generator().manual_seed(n)).tolist()
    cached.generate([ids[:n]], SamplingParams(max_tokens=0))
    again = cached.generate([ids[:n]], SamplingParams(max_tokens=0))[0]  # (a prompt scored anew)
    assert again.num_cached_tokens == (n - 1) // 64 * 64
    got, ref = cached.generate([ids], PARAMS)[0], plain.generate([ids], PARAMS)[0]
    assert got.num_cached_tokens == n // 64 * 64 and got.token_ids == ref.token_ids


@pytest.mark.parametrize("n", [128, 130])
def test_the_next_turn_after_a_short_reply_resumes_at_its_end(engines, n):
    """A reply shorter than a block leaves its checkpoint at the last boundary before its end,
    also when that boundary is its prompt's end (a prompt of whole blocks: it resumed 64 tokens
    earlier, from the prompt's checkpoint), and the next turn's tokens are those without it."""
    _, plain = engines
    cached = LLMEngine(dataclasses.replace(plain.config, enable_prefix_cache=True,
                                           checkpoint_interval=0), loaded=plain.loaded)
    ids = torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    reply = cached.generate([ids], SamplingParams(max_tokens=10, ignore_eos=True))[0].token_ids
    turn = ids + reply + [7, 8, 9]
    got, ref = cached.generate([turn], PARAMS)[0], plain.generate([turn], PARAMS)[0]
    assert (got.num_cached_tokens, got.num_computed_tokens) == (128, len(turn) - 128)
    assert got.token_ids == ref.token_ids


def test_long_prompt_resumes_near_an_edit(engines):
    """An edit deep inside a long prompt resumes from the interval checkpoint before it."""
    cached, plain = engines
    policy = PolicyModel(interval=2)
    gen = torch.Generator().manual_seed(9)
    base = torch.randint(0, 300, (700,), generator=gen).tolist()
    ask(cached, plain, policy, base)
    edited = base[:600] + [(t + 1) % 300 for t in base[600:650]]
    out = ask(cached, plain, policy, edited)
    assert out.num_cached_tokens == 512


def test_prefill_rate_is_timed_over_a_whole_chunked_prompt(tiny_dirs):
    """The cost model sees one observation per prompt (all its chunks, up to the step that reads
    the sampled token), not one per chunk: a chunk that samples nothing returns before an
    accelerator has run it."""
    path = tiny_dirs["qwen3_5_text"]
    engine = LLMEngine(EngineConfig(model=path, device="cpu", max_num_batched_tokens=64),
                       loaded=load_model(path, dtype=torch.float32))
    seen = []

    def observed(tokens: int, seconds: float, capped: bool) -> None:
        seen.append((tokens, seconds))

    engine.prefix.cost.observe_prefill = observed
    engine.generate([list(range(3, 3 + 300))], SamplingParams(max_tokens=3, ignore_eos=True))
    assert [tokens for tokens, _ in seen] == [300]
    assert seen[0][1] > 0


def test_disk_loads_teach_the_rate_they_saw():
    """A disk load served from the page cache teaches the page cache's rate, one from the disk
    the disk's, a mixed one the disk's from the time left after its cached part; a plan prices
    each blob by its cached fraction."""
    from statechat.engine.cost import DISK, PAGE_CACHE, CostModel

    cost = CostModel(1e-6)
    cost.bandwidth.update({DISK: 1e9, PAGE_CACHE: 4e9})
    cost.observe_load(DISK, 8 << 30, 1.0, resident=1.0)  # 8.6 GB/s from the page cache
    assert cost.bandwidth[DISK] == 1e9 and cost.bandwidth[PAGE_CACHE] > 4e9
    cost.observe_load(DISK, 1 << 30, 2.0, resident=0.0)  # 0.5 GB/s from the disk
    assert cost.bandwidth[DISK] < 1e9
    cost.bandwidth.update({DISK: 1e9, PAGE_CACHE: 4e9})
    # the disk half at 0.5 GB/s
    cost.observe_load(DISK, int(4e9), 2e9 / 4e9 + 2e9 / 0.5e9, resident=0.5)
    assert cost.bandwidth[PAGE_CACHE] == 4e9 and 0.5e9 <= cost.bandwidth[DISK] < 0.8e9
    cost.bandwidth.update({DISK: 1e9, PAGE_CACHE: 4e9})
    cost.latency.update({DISK: 0.0, PAGE_CACHE: 0.0})
    assert cost.load_s(DISK, 4e9, resident=1.0) == pytest.approx(1.0)
    assert cost.load_s(DISK, 4e9, resident=0.0) == pytest.approx(4.0)
    assert cost.load_s(DISK, 4e9, resident=0.5) == pytest.approx(2.5)


def test_the_first_timed_prefill_replaces_the_guess():
    """The engine's guessed prefill rate gives way to the first measurement (bounded: a first
    run that compiled kernels is no rate); later ones move it by 30%."""
    from statechat.engine.cost import FIRST_PREFILL_RANGE, CostModel

    cost = CostModel(5e-6)
    cost.observe_prefill(32, 1.0)  # too short to time
    assert cost.prefill_s_per_token == 5e-6
    cost.observe_prefill(8192, 8192 * 4e-6)
    assert cost.prefill_s_per_token == pytest.approx(4e-6)
    cost.observe_prefill(8192, 8192 * 6e-6)
    assert cost.prefill_s_per_token == pytest.approx(0.7 * 4e-6 + 0.3 * 6e-6)
    slow = CostModel(5e-6)
    slow.observe_prefill(8192, 30.0)  # a first run that compiled for half a minute
    assert slow.prefill_s_per_token == pytest.approx(5e-6 * FIRST_PREFILL_RANGE)
