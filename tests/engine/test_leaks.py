"""Long mixed use leaks nothing: after a seeded fuzz of a few hundred requests that end in every
way (EOS or a stop token id, max_tokens, a stop string, aborted waiting, mid-prefill or
mid-decode, preempted for want of KV blocks and resumed, refused prompts), with seeds, logprobs,
prompt logprobs and penalties, the idle engine holds every KV block and GDN state slot where it
should (tests.helpers.assert_idle_pools); and the device tier's LRU never outgrows its pools:
once a flood of unrelated prompts has evicted a conversation, repeating it gives the tokens of a
cold run."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from statechat.engine.sampling import SamplingParams
from statechat.errors import ConfigError
from statechat.model.loader import load_model
from tests.helpers import assert_idle_pools, cpu_engine, random_prompts

MAX_LEN = 512


@pytest.fixture(scope="module")
def loaded(tiny_dirs):
    return load_model(tiny_dirs["qwen3_5_text"], dtype=torch.float32)


def small_engine(loaded, **fields):
    """An engine whose pools run short: few KV blocks (preemptions), few state slots (the
    checkpoints' LRU evicts), small steps (prompts prefill in several chunks)."""
    config = {"max_model_len": MAX_LEN, "num_kv_blocks": 12, "num_state_slots": 8,
              "max_num_seqs": 4, "max_num_batched_tokens": 128}
    return cpu_engine(loaded, **{**config, **fields})


def random_params(rng: random.Random) -> SamplingParams:
    """Sampling of every kind that keeps per-request state or ends a reply its own way."""
    fields: dict = {"max_tokens": rng.choice([0, 1, 3, 17, 40, 70, 150]),
                    "ignore_eos": rng.random() < 0.5}
    if rng.random() < 0.4:
        fields.update(temperature=0.9, seed=rng.randrange(1 << 20))
    if rng.random() < 0.3:
        fields["stop_token_ids"] = tuple(rng.sample(range(3, 300), 12))
    if rng.random() < 0.3:
        fields["stop"] = (chr(rng.randrange(97, 123)),)
    if rng.random() < 0.2:
        fields["logprobs"] = rng.choice([0, 3])
    if rng.random() < 0.15:
        fields["prompt_logprobs"] = rng.choice([0, 2])
    if rng.random() < 0.2:
        fields["presence_penalty"] = 0.5
    if rng.random() < 0.1:
        fields["min_tokens"] = min(2, fields["max_tokens"])
    return SamplingParams(**fields)


def random_prompt(rng: random.Random, history: list[list[int]]) -> list[int]:
    """A new prompt, or an earlier one (with its reply) cut and extended: shared prefixes."""
    n = rng.choice([1, 5, 63, 64, 65, 100, 128, 200, 300, 420])
    fresh = [rng.randrange(3, 300) for _ in range(n)]
    if history and rng.random() < 0.5:
        old = rng.choice(history)
        keep = rng.randrange(1, len(old) + 1)
        return (old[:keep] + fresh)[: MAX_LEN - 1 - rng.randrange(0, 80)]
    return fresh


def bad_prompt(rng: random.Random, vocab: int) -> list[int]:
    return rng.choice([[], [5] * MAX_LEN, [5, vocab, 6], [5, -1]])


def fuzz(engine, rng: random.Random, num_requests: int, ended: list) -> Counter:
    """Add `num_requests` requests a few at a time while stepping, aborting some at random; run
    to the end, adding the sequences that ended by themselves to `ended`. How the requests
    ended, by kind."""
    live, history, seen = [], [], Counter()
    vocab = engine.loaded.config.vocab_size
    added = 0
    while added < num_requests or engine.has_unfinished():
        if added < num_requests and rng.random() < 0.35:
            added += 1
            if rng.random() < 0.05:
                with pytest.raises(ConfigError):
                    engine.add_request(bad_prompt(rng, vocab), random_params(rng))
                seen["refused"] += 1
                continue
            live.append(engine.add_request(random_prompt(rng, history), random_params(rng)))
        if live and rng.random() < 0.06:
            seq = live.pop(rng.randrange(len(live)))
            kind = ("waiting" if seq.status.value == "waiting" else
                    "prefill" if seq.num_computed < seq.num_prompt_tokens else "decode")
            if not seq.is_finished:
                seen[f"abort-{kind}"] += 1
            engine.abort(seq)
        for seq in engine.step():
            if seq.is_finished:
                history.append(seq.token_ids)
                ended.append(seq)
                by_token = isinstance(seq.stop_reason, int)
                seen[seq.finish_reason + "-token" * by_token] += 1
                seen["preempted"] += seq.num_preemptions > 0
        live = [s for s in live if not s.is_finished]
    return seen


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_long_fuzz_leaves_the_pools_whole(loaded, async_scheduling):
    engine = small_engine(loaded, async_scheduling=async_scheduling)
    rng, seen, ended = random.Random(29), Counter(), []
    for _ in range(3):
        seen += fuzz(engine, rng, 50, ended)
        assert_idle_pools(engine)
    cold = cpu_engine(loaded, max_model_len=MAX_LEN, enable_prefix_cache=False)
    outs = cold.generate([s.token_ids[: s.num_prompt_tokens] for s in ended],
                         [s.params for s in ended])
    for seq, out in zip(ended, outs):  # (seeded or greedy: the same tokens, cache or none)
        assert seq.output_ids == out.token_ids, (len(seq), seq.params)
    for kind in ("length", "stop", "stop-token", "abort-waiting", "abort-prefill",
                 "abort-decode", "preempted", "refused"):
        assert seen[kind] > 0, f"the fuzz never saw {kind}: {dict(seen)}"


def test_replies_preempted_mid_decode_give_back_their_pending_states(loaded):
    """Two long replies outgrow the KV blocks: the newer one is preempted while it decodes,
    holding the state pending at its last block boundary, and runs again to the end."""
    engine = small_engine(loaded, num_kv_blocks=6, max_model_len=384)
    seqs = [engine.add_request(p, SamplingParams(max_tokens=200, ignore_eos=True))
            for p in random_prompts(100, 110, seed=5)]
    pending_when_preempted = []
    preempt = engine.scheduler.preempt

    def spied(seq, **where) -> None:
        pending_when_preempted.append(seq.pending_slot)
        preempt(seq, **where)

    engine.scheduler.preempt = spied
    while engine.has_unfinished():
        engine.step()
    assert any(pending_when_preempted), "no reply was preempted with a pending state"
    assert [s.finish_reason for s in seqs] == ["length", "length"]
    assert_idle_pools(engine)


@pytest.mark.parametrize("ending", ["stop token", "abort"])
def test_a_reply_that_ends_with_a_step_queued_ahead_leaves_none(loaded, ending):
    """Async scheduling queues the next decode step before a step's token is read; the reply
    ends on that token (a stop token id) or is aborted meanwhile. The idle engine then keeps no
    step queued ahead (it kept it, naming the ended reply, until the next request came)."""
    engine = small_engine(loaded, async_scheduling=True)
    prompt = random_prompts(40, seed=3)[0]
    free_run = engine.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    stop = free_run.token_ids[6]  # (mid-block: 40 + 6 tokens)
    params = SamplingParams(max_tokens=12, ignore_eos=True,
                            stop_token_ids=() if ending == "abort" else (stop,))
    seq = engine.add_request(prompt, params)
    while engine.has_unfinished():
        engine.step()
        if ending == "abort" and len(seq.output_ids) == 5:
            assert engine._ahead is not None  # (the case under test)
            engine.abort(seq)
    if ending == "stop token":
        assert seq.stop_reason == stop and len(seq.output_ids) <= 7
    assert_idle_pools(engine)


def conversation(engine, turns: list[list[int]], max_tokens: int = 12) -> list:
    """Run a chat of these user turns, each prompt the one before with its reply and the next
    turn; the outputs."""
    params, context, outs = SamplingParams(max_tokens=max_tokens, ignore_eos=True), [], []
    for turn in turns:
        out = engine.generate([context + turn], params)[0]
        context = context + turn + out.token_ids
        outs.append(out)
    return outs


def assert_within_pools(engine) -> None:
    blocks, slots = engine.scheduler.blocks, engine.scheduler.slots
    assert len(blocks.by_hash) <= blocks.num_blocks
    assert len(slots.checkpoints) <= slots.num_slots - 1


def test_a_flood_evicts_a_conversation_and_its_repeat_equals_a_cold_run(loaded):
    turns = random_prompts(150, 90, 70, seed=7)
    cold = conversation(cpu_engine(loaded, max_model_len=MAX_LEN, enable_prefix_cache=False),
                        turns)
    engine = small_engine(loaded)
    warm = conversation(engine, turns)
    assert warm[-1].num_cached_tokens > 0  # (the turns did resume from the cache)
    hashes = set(engine.scheduler.blocks.by_hash) | set(engine.scheduler.slots.checkpoints)
    for prompt in random_prompts(*[200] * 12, seed=8):  # unrelated: 4 blocks each
        engine.generate([prompt], SamplingParams(max_tokens=30, ignore_eos=True))
        assert_within_pools(engine)
    left = set(engine.scheduler.blocks.by_hash) | set(engine.scheduler.slots.checkpoints)
    assert not hashes & left, "the flood left some of the conversation cached"
    again = conversation(engine, turns)
    assert again[0].num_cached_tokens == 0
    for a, b, c in zip(cold, warm, again):
        assert a.token_ids == b.token_ids == c.token_ids
    assert_idle_pools(engine)


def test_an_eviction_takes_a_cached_chain_from_its_tail(loaded):
    """A prompt that needs one block more than the free ones evicts one of a conversation's
    cached blocks: its last one (released last), not its first, so that the conversation's
    next repeat still resumes from the checkpoints before it (the first gone, every cached
    block after it is of no use) and gives the cold run's tokens."""
    turns = random_prompts(150, 90, 70, seed=7)
    cold = conversation(cpu_engine(loaded, max_model_len=MAX_LEN, enable_prefix_cache=False),
                        turns)
    engine = small_engine(loaded)
    conversation(engine, turns)  # (5 full blocks cached; checkpoints at 128, 192, 256, 320)
    blocks = engine.scheduler.blocks
    assert len(blocks.evictable) == 5
    flood = random_prompts((len(blocks.free) + 1) * 64 - 10, seed=99)
    engine.generate(flood, SamplingParams(max_tokens=1))
    out = engine.generate([cold_prompt(cold, turns)],
                          SamplingParams(max_tokens=12, ignore_eos=True))[0]
    assert out.token_ids == cold[-1].token_ids
    assert out.num_cached_tokens == 256
    assert_idle_pools(engine)


def cold_prompt(outs: list, turns: list[list[int]]) -> list[int]:
    """The last prompt of a conversation of `turns` whose replies were `outs`."""
    context = []
    for out, turn in zip(outs[:-1], turns):
        context += turn + out.token_ids
    return context + turns[-1]
